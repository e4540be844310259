"""Parse a rendered vLLM config with vLLM's own argument parser. Standalone script.

Run it with the python of a virtualenv that has the pinned vLLM (no GPU needed):

    VENV/bin/python vllm_argcheck.py CONFIG.yaml [CONFIG.yaml ...] [--source-dir DIR]

It builds the OpenAI server's parser exactly as `vllm serve` does, expands `--config` the
way vLLM does, parses, and turns the result into EngineArgs (which runs vLLM's own type
checks on nested configs such as --compilation-config). It prints one JSON object per
config, one per line: {"config": path, "ok": bool, "vllm": version, "error": str|null,
"unknown_keys": [...], "parsed": {...}}. vLLM is imported once for all configs.

`--source-dir` puts another vLLM version's Python source first on the path (used for
versions whose wheels need a torch that does not install here; the parser code is pure
Python, the CPU platform is forced so that no GPU is looked for). Stdlib-only at import.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from typing import Any


def _force_cpu_platform(version: str) -> None:
    # A GPU wheel's source cannot detect a device here, and the parser needs *a* platform.
    # vLLM picks the CPU platform when its distribution version says "cpu": give the source
    # tree such metadata in a temporary folder.
    import tempfile

    meta = tempfile.mkdtemp(prefix="vfleet-argcheck-")
    info = f"{meta}/vllm-{version}+cpu.dist-info"
    import os

    os.makedirs(info)
    with open(f"{info}/METADATA", "w", encoding="utf-8") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    sys.path.insert(0, meta)


def _first_attr(modules: tuple[str, ...], name: str) -> Any:
    """`name` from the first of `modules` that has it (vLLM moves things between versions)."""
    import importlib

    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"{name} not found in {modules}")


def _make_parser() -> Any:
    parser_cls = _first_attr(("vllm.utils.argparse_utils", "vllm.utils"), "FlexibleArgumentParser")
    make_arg_parser = _first_attr(
        ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"),
        "make_arg_parser",
    )
    return make_arg_parser(parser_cls(prog="vllm serve"))


def check(config_path: str) -> dict[str, Any]:
    return parse(config_path)[0]


def parse(config_path: str) -> tuple[dict[str, Any], Any]:
    """(result, the parsed namespace or None): the namespace feeds the engine-level check."""
    import vllm
    import yaml

    result: dict[str, Any] = {
        "ok": False,
        "vllm": getattr(vllm, "__version__", "?"),
        "error": None,
        "unknown_keys": [],
        "parsed": {},
    }
    parser = _make_parser()
    with open(config_path, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh) or {}
    # Keys that are not options would otherwise be reported by argparse one at a time;
    # a false boolean would be dropped silently by some versions: both are errors here.
    for key, value in raw.items():
        if f"--{key}" not in parser._option_string_actions:
            result["unknown_keys"].append(key)
        elif value is False:
            result["unknown_keys"].append(f"{key}: false (write no-{key}: true)")
    if result["unknown_keys"]:
        result["error"] = "keys vLLM does not accept: " + ", ".join(result["unknown_keys"])
        return result, None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            ns = parser.parse_args(["--config", config_path])
    except SystemExit:
        # argparse prints usage, then "prog: error: ..." and any detail lines after it.
        lines = err.getvalue().strip().splitlines()
        start = next((i for i, line in enumerate(lines) if ": error:" in line), len(lines) - 1)
        detail = [ln.strip() for ln in lines[start:] if "errors.pydantic.dev" not in ln]
        result["error"] = " ".join(detail) or "argument parsing failed"
        return result, None
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs

        AsyncEngineArgs.from_cli_args(ns)
    except Exception as exc:  # vLLM's own validation of the parsed values
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result, None
    for key in raw:
        dest = parser._option_string_actions[f"--{key}"].dest
        value = getattr(ns, dest, None)
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        result["parsed"][key] = value
    result["ok"] = True
    return result, ns


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("config", nargs="+")
    ap.add_argument("--source-dir", help="put this vLLM source tree first on sys.path")
    ap.add_argument("--source-version", help="the version of --source-dir")
    args = ap.parse_args(argv)
    if args.source_dir:
        sys.path.insert(0, args.source_dir)
        _force_cpu_platform(args.source_version or "0.0.0")
    all_ok = True
    for config in args.config:
        try:
            result = check(config)
        except Exception as exc:  # an import problem in the venv: report, do not crash
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        result["config"] = config
        all_ok = all_ok and bool(result.get("ok"))
        print(json.dumps(result, sort_keys=True), flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
