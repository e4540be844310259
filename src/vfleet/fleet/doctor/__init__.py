"""`vfleet doctor`: preflight and drift check of one host, judged on the control machine.

Gather on the host, judge here: `hostfacts.py` (stdlib only) runs on the host and prints
facts as JSON; this package compares them with the deploy plan (`vfleet.render.plan.plan`)
and returns findings, each with a concrete fix. The Ansible role calls `preflight` through a
lookup plugin (ansible/plugins/lookup/vfleet_doctor.py), so the CLI and the role judge the
same way.

Modules, low to high: `common` (findings, fix commands, plan-derived numbers), `host_checks`,
`gpus`, `service` (service state and log diagnosis), `drift_checks`, `judge` (which checks
run), `command` (the CLI). Host targeting and ssh are `vfleet.fleet.inventory`'s.
"""

from __future__ import annotations

from vfleet.engine.topology import parse_topology
from vfleet.fleet.doctor.command import add_parser, cmd_doctor, summary, table
from vfleet.fleet.doctor.common import Finding, fail, ok, warn
from vfleet.fleet.doctor.drift_checks import drift, launch_argv
from vfleet.fleet.doctor.gpus import parse_apps, parse_cuda_version, parse_gpus
from vfleet.fleet.doctor.host_checks import check_plugin
from vfleet.fleet.doctor.judge import RUNTIME_CHECKS, findings_from, judge, preflight
from vfleet.hostside.logwhy import last_error

__all__ = [
    "RUNTIME_CHECKS",
    "Finding",
    "add_parser",
    "check_plugin",
    "cmd_doctor",
    "drift",
    "fail",
    "findings_from",
    "judge",
    "last_error",
    "launch_argv",
    "ok",
    "parse_apps",
    "parse_cuda_version",
    "parse_gpus",
    "parse_topology",
    "preflight",
    "summary",
    "table",
    "warn",
]
