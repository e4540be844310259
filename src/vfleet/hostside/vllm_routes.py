"""List the routes a pinned vLLM's OpenAI server mounts, and which its API-key guard covers.

Run it with the python of a virtualenv that has the pinned vLLM (no GPU, no model needed):

    VENV/bin/python vllm_routes.py --out FILE [--source-dir DIR --source-version X.Y.Z] [VLLM ARGS]

It builds the server's app with vLLM's own `build_app` from the arguments `vllm serve` would
parse (an API key is always given, so the guard is installed), once as served and once with
`VLLM_SERVER_DEV_MODE=1`, and prints one JSON object: {"vllm": version, "routes": [{"path",
"methods", "guarded", "dev"}]}. `guarded` is decided by the app's own guard middleware: a
request without the key is passed through it to a stand-in app that only records whether it
was reached, so no handler runs. `dev` marks a route only dev mode mounts.

`--source-dir` puts another version's source first on the path (the GPU pins, whose wheels
do not install here; see vllm_argcheck.py). Stdlib-only at import.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import tempfile
import warnings
from typing import Any

KEY = "vfleet-routes-key"


def _first_attr(modules: tuple[str, ...], name: str) -> Any:
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"{name} not found in {modules}")


def _cpu_metadata(version: str) -> None:
    # vLLM picks the CPU platform when its distribution says "cpu" (as vllm_argcheck.py does).
    meta = tempfile.mkdtemp(prefix="vfleet-routes-")
    info = f"{meta}/vllm-{version}+cpu.dist-info"
    os.makedirs(info)
    with open(f"{info}/METADATA", "w", encoding="utf-8") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    sys.path.insert(0, meta)


def _build(argv: list[str]) -> Any:
    parser_cls = _first_attr(("vllm.utils.argparse_utils", "vllm.utils"), "FlexibleArgumentParser")
    make = _first_attr(
        ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args"),
        "make_arg_parser",
    )
    args = make(parser_cls()).parse_args([*argv, "--api-key", KEY])
    build_app = _first_attr(
        ("vllm.entrypoints.launchers.app", "vllm.entrypoints.openai.api_server"), "build_app"
    )
    try:
        return build_app(args, ("generate",))
    except TypeError:  # versions whose build_app takes only the arguments
        return build_app(args)


def _sample(path: str) -> str:
    # A concrete path for a route template: every {param} becomes "x".
    out, depth = [], 0
    for ch in path:
        if ch == "{":
            depth += 1
            out.append("x")
        elif ch == "}":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def _guarded(app: Any, method: str, path: str) -> bool:
    """Does the app's own key guard stop `method path` without the key?"""
    reached: list[bool] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached.append(True)

    name = "AuthenticationMiddleware"
    guard = next(m for m in app.user_middleware if getattr(m.cls, "__name__", "") == name)
    kwargs = dict(getattr(guard, "kwargs", None) or getattr(guard, "options", {}))
    mw = guard.cls(inner, *getattr(guard, "args", ()), **kwargs)
    scope = {
        "type": "http", "method": method, "path": path, "raw_path": path.encode(),
        "root_path": "", "headers": [], "query_string": b"",
        "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
        "http_version": "1.1", "app": app,
    }  # fmt: skip

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        return None

    async def run() -> None:
        result = mw(scope, receive, send)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            await result

    asyncio.run(run())
    return not reached


def routes(app: Any) -> dict[tuple[str, str], bool]:
    out = {}
    for r in app.routes:
        path = getattr(r, "path", None)
        if path is None:
            continue
        methods = sorted(getattr(r, "methods", None) or ["GET"])  # a mount answers GET
        for method in methods:
            if method == "HEAD":
                continue
            out[(method, path)] = _guarded(app, method, _sample(path))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--source-dir")
    p.add_argument("--source-version", help="with --source-dir: its version")
    known, rest = p.parse_known_args(argv)
    warnings.simplefilter("ignore")
    if known.source_dir:
        sys.path.insert(0, known.source_dir)
        _cpu_metadata(known.source_version or "0")
    os.environ.pop("VLLM_SERVER_DEV_MODE", None)
    os.environ.pop("VLLM_API_KEY", None)
    served = routes(_build(rest))
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    dev = routes(_build(rest))
    import vllm

    listed = [
        {"path": path, "method": method, "guarded": guarded, "dev": (method, path) not in served}
        for (method, path), guarded in {**dev, **served}.items()
    ]
    listed.sort(key=lambda r: (r["dev"], r["path"], r["method"]))
    with open(known.out, "w", encoding="utf-8") as fh:
        json.dump({"vllm": getattr(vllm, "__version__", "?"), "routes": listed}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
