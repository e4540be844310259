"""`vfleet doctor HOST`: gather on the host, judge here, print a table or JSON."""

from __future__ import annotations

import argparse
import json
import shutil
import textwrap
from dataclasses import asdict

from vfleet.fleet.doctor.common import Finding
from vfleet.fleet.doctor.judge import findings_from
from vfleet.fleet.inventory import host_args, host_plan, host_vars, request, run_hostfacts

DESCRIPTION = """\
Check one host against what vfleet would deploy there: is it fit (Python, OS packages, GPUs
and driver or CPU features and memory, disk, model files, free ports, clock), is the
instance healthy (pm2 or systemd state, and why it failed, from its log), and does what runs
equal what vfleet renders (drift: vllm.yaml, environment, argv, served model, KV cache)?

HOST is an inventory host, resolved with ansible-inventory. The doctor gathers on the host and
judges here: it runs src/vfleet/hostside/hostfacts.py there (stdlib Python, nothing installed or
left
behind; locally for ansible_connection: local, else over ssh with the inventory's user, port,
key and ssh args) and compares the facts with the deploy plan. Secrets never leave the host
in clear: the API key is compared by its sha256.

The plan is built as `make deploy` builds it: profile, model, instance, base dir and settings
come from the options, else from the host's vfleet_* inventory vars, else the defaults
(cpu, tiny-hybrid-mtp, instance main, /opt/vfleet). Use the same settings as the deploy, or
every difference shows up as drift.
"""

EPILOG = """\
checks (each ok, warn or FAIL; warn and FAIL come with a fix):
  python, os-packages, time-sync    the stack's Python pin, the profile's Debian packages, NTP
  gpu, gpu-sm, gpu-vram             GPU profiles: count and model, compute capability, memory
  cuda-driver, gpu-topology         the driver's CUDA vs the stack's; P2P/NVLink vs custom
                                    all-reduce (tensor parallel only)
  gpu-free                          GPU memory held by other processes (leftover TP workers)
  cpu, memory                       CPU profile: AVX2/AVX-512; RAM for KV space + weights
  threads, disk, model              OMP threads vs cores; space for weights, venv and caches;
                                    config.json architecture and quantisation, safetensors
  port, sidecar-port                free, or held by this very instance
  service, copies, http             pm2/systemd state (a failure says why, from the log), a
                                    second server of the instance, /v1/models answering
  drift:*                           release, restart, argv, vllm.yaml, env, served-model, cache:
                                    the running server vs the rendered release (--no-drift: skip)

exit status: 0 all ok, 1 warnings only, 2 any failure, or bad input (unknown host, ssh failed).

examples:
  vfleet doctor localhost                                   # this machine, `make deploy` defaults
  vfleet doctor localhost --base-dir ~/.local/share/vfleet  # after a non-root make deploy
  vfleet doctor gpu1 -i my-inventory.yml                    # profile/model from vfleet_* vars
  vfleet doctor gpu1 -i my-inventory.yml -p 2x2080ti-22g -m qwen3.6-27b-fp8 --set port=8001
  vfleet doctor gpu1 -i my-inventory.yml --json | jq '.findings[] | select(.status != "ok")'
  vfleet doctor gpu1 -i my-inventory.yml --no-drift         # preflight only
"""


def summary(findings: list[Finding]) -> dict[str, int]:
    counts = {s: sum(f.status == s for f in findings) for s in ("ok", "warn", "fail")}
    counts["exit"] = 2 if counts["fail"] else 1 if counts["warn"] else 0
    return counts


def _fill(text: str, width: int, first: str, rest: str) -> str:
    # Paths and commands stay whole: a broken one cannot be copied.
    return textwrap.fill(
        text,
        width,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def table(findings: list[Finding], width: int) -> str:
    w = max((len(f.check) for f in findings), default=5)
    indent = " " * (w + 10)
    lines = [f"{'CHECK':<{w}}  STATUS  MESSAGE"]
    for f in findings:
        status = "FAIL" if f.status == "fail" else f.status
        head = f"{f.check:<{w}}  {status:<6}  "
        lines.append(_fill(f.message, width, head, indent))
        if f.fix and f.status != "ok":
            lines.append(_fill(f"fix: {f.fix}", width, indent, indent + "  "))
    return "\n".join(lines)


def cmd_doctor(a: argparse.Namespace) -> int:
    hv = host_vars(a.inventory, a.host)
    plan, python = host_plan(a, hv)
    facts = run_hostfacts(a.host, hv, request(plan), python)
    topology = str((facts.get("gpus") or {}).get("topology") or "")
    if topology:
        # Plan again as a deploy does, with the links read on the host (the all-reduce rule),
        # so that the drift check compares with what a deploy there would write.
        plan, python = host_plan(a, hv, topology)
    findings = findings_from(plan, facts, drift=not a.no_drift)
    counts = summary(findings)
    if a.json:
        out = {
            "host": a.host,
            "profile": plan.profile,
            "model": plan.model.name,
            "instance": plan.instance,
            "release_id": plan.release_id,
            "findings": [asdict(f) for f in findings],
            "summary": counts,
            "errors": facts.get("errors", []),
        }
        print(json.dumps(out, indent=2))
        return counts["exit"]
    width = max(80, shutil.get_terminal_size((120, 20)).columns)
    print(
        f"vfleet doctor {a.host}: {plan.model.name} on {plan.profile}, instance "
        f"{plan.instance}, release {plan.release_id}, {plan.dirs.base}\n"
    )
    print(table(findings, width))
    said = " ".join(f.message for f in findings)
    for line in facts.get("errors", []):
        if line.split(":", 1)[-1].strip() not in said:  # not already told by a finding
            print(f"note: not gathered: {line}")
    print(f"\n{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail")
    return counts["exit"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="preflight and drift check of one host (GPUs, model, ports, service, drift)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    host_args(p)
    p.add_argument(
        "--json", action="store_true", help='{"host", "findings": [...], "summary": {...}}'
    )
    p.add_argument("--no-drift", action="store_true", help="preflight and health only")
    p.set_defaults(fn=cmd_doctor)
