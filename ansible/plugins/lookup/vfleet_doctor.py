"""Lookup plugin: vfleet doctor's host checks for the deploy's preflight.

`lookup('vfleet_doctor', plan=vfleet_plan)` returns the host-side script's path and its request
(the role runs it with `ansible.builtin.script`); `lookup('vfleet_doctor', plan=..., facts=...)`
judges the facts it printed, with the same code as `vfleet doctor HOST`, into
`{findings, warnings, failures}` (failures: one text, each with its fix; empty when none).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ansible.errors import AnsibleError

from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: vfleet_doctor
short_description: vfleet doctor's request, or its preflight findings, on the controller
options:
  plan: {description: the vfleet_plan of the instance, required: true}
  facts: {description: what hostfacts.py printed on the host; omit to get the request}
"""


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: Any = None, **kwargs: Any) -> list[Any]:
        try:
            from vfleet.fleet.doctor import preflight, request
            from vfleet.fleet.remote import HOSTFACTS
        except ImportError as exc:
            raise AnsibleError(f"vfleet is not importable by Ansible's Python ({exc})") from None
        plan = kwargs["plan"]
        if kwargs.get("facts") is None:
            return [{"script": str(HOSTFACTS), "request": request(plan)}]
        findings = preflight(plan, kwargs["facts"])
        failed = [f for f in findings if f.status == "fail"]
        return [
            {
                "findings": [asdict(f) for f in findings],
                "warnings": [f.message for f in findings if f.status == "warn"],
                "failures": "\n".join(f"{f.check}: {f.message}\n  Fix: {f.fix}" for f in failed),
            }
        ]
