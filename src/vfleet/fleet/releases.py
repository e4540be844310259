"""`vfleet releases HOST`: the releases kept on a host, and which is current and previous.

Each deploy installs a content-addressed release (`instances/<instance>/releases/<id>`: the
rendered config, env, units, launch script and release.json) and points `current` at it,
`previous` at the one before. A rollback (`make rollback HOST=...`) swaps the two and restarts:
it runs what is on the host, never a new render from a control checkout that may have changed.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

EXAMPLES = """\
examples:
  vfleet releases localhost
  vfleet releases gpu1 -i my-inventory.yml --instance b --json
  make rollback HOST=gpu1            # current <-> previous, restart, wait until ready and warm
"""


def rows(release: dict[str, Any]) -> list[dict[str, Any]]:
    """The host's releases, newest first, each with state current / previous / kept."""
    out = []
    for r in release.get("releases") or []:
        state = (
            "current"
            if r["path"] == release.get("current")
            else "previous"
            if r["path"] == release.get("previous")
            else "kept"
        )
        out.append({**r, "state": state})
    return out


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def cmd_releases(a: argparse.Namespace) -> int:
    from vfleet.fleet.doctor import host_plan, request
    from vfleet.fleet.remote import host_vars, run_hostfacts

    hv = host_vars(a.inventory, a.host)
    plan, python = host_plan(a, hv)
    facts = run_hostfacts(a.host, hv, request(plan), python)
    release = facts.get("release") or {}
    listed = rows(release)
    if a.json:
        out = {
            "host": a.host,
            "instance": plan["instance"],
            "current": release.get("current"),
            "previous": release.get("previous"),
            "switched_at": release.get("switched_at"),
            "releases": listed,
        }
        print(json.dumps(out, indent=2))
        return 0
    where = f"{a.host}, instance {plan['instance']} ({plan['dirs']['releases']})"
    if not listed:
        print(f"{where}: no release (never deployed)")
        return 0
    print(f"{where}:")
    print(f"{'ID':<12}  {'STATE':<8}  {'INSTALLED (UTC)':<19}  MODEL (PROFILE, vLLM)")
    for r in listed:
        vllm = (r.get("versions") or {}).get("vllm", "?")
        print(
            f"{r['id']:<12}  {r['state']:<8}  {_when(r['installed_at'])}  "
            f"{r.get('model')} as {r.get('served_model_name')} ({r.get('profile')}, {vllm})"
        )
    if release.get("switched_at"):
        print(f"current since {_when(release['switched_at'])} UTC")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from vfleet.fleet.doctor import host_args

    p = sub.add_parser(
        "releases",
        help="the releases kept on a host: current, previous, when, which model",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    host_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_releases)
