"""Lookup plugin: the fleet Prometheus's files (config, rules, file_sd targets) on the controller.

Calls vfleet.render.plan.prometheus_plan(): the same code as `vfleet prometheus render`.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleError

from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: vfleet_prometheus
short_description: render the fleet Prometheus (config, rules, targets) on the controller
description:
  - Calls vfleet.render.plan.prometheus_plan() with the given keyword arguments.
options:
  targets: {description: scrape targets (plan monitoring entries + address), required: true}
  prometheus_dir: {description: Prometheus folder on its host, required: true}
  listen: {description: HOST:PORT Prometheus listens on, required: true}
  scrape_interval: {description: scrape and rule evaluation interval}
  prometheus_bin: {description: the prometheus binary on its host}
"""


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: Any = None, **kwargs: Any) -> list[Any]:
        try:
            from vfleet.errors import VfleetError
            from vfleet.render.plan import prometheus_plan
        except ImportError as exc:
            raise AnsibleError(
                f"vfleet is not importable by Ansible's Python ({exc}); run Ansible from the "
                "vfleet virtualenv (make deploy does)"
            ) from None
        args = {k: v for k, v in kwargs.items() if v not in (None, "")}
        try:
            return [prometheus_plan(**args)]
        except (VfleetError, ValueError, KeyError, TypeError) as exc:
            raise AnsibleError(f"vfleet_prometheus: {exc}") from None
