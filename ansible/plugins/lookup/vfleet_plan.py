"""Lookup plugin: vfleet's deploy plan for one instance (rendered files and facts).

Runs on the control machine, in the Python that runs Ansible (which has vfleet installed):
the same code and templates as `vfleet render`, so the CLI and Ansible cannot drift.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleError

from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: vfleet_plan
short_description: render a vfleet instance (files + facts) on the controller
description:
  - Calls vfleet.render.plan.plan() with the given keyword arguments and returns its dict
    (Plan.as_dict(), the one place where the typed plan becomes the role's dict).
options:
  profile: {description: hardware profile name, required: true}
  model: {description: model preset name, required: true}
  instance: {description: instance name}
  base_dir: {description: vfleet base directory on the host}
  python: {description: python used to create the venv on the host}
  sets: {description: list of key=value overrides}
  deployment: {description: deployment YAML on the controller}
  profiles_dir: {description: profiles folder on the controller}
  host_name: {description: the host's inventory name}
  gpu_topology: {description: "`nvidia-smi topo -m` as read on the host (empty: not known)"}
  api_key_file: {description: "file on the controller holding the API key (mode 0600; empty: none)"}
  cache_seed: {description: "a cache seed tar on the controller (vfleet caches pack; empty: none)"}
  cache_seed_allowed_signers: {description: "allowed_signers file on the controller (seed signers)"}
"""


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: Any = None, **kwargs: Any) -> list[Any]:
        try:
            from vfleet.errors import VfleetError
            from vfleet.render.plan import plan
        except ImportError as exc:
            raise AnsibleError(
                f"vfleet is not importable by Ansible's Python ({exc}); run Ansible from the "
                "vfleet virtualenv (make deploy does)"
            ) from None
        args = {k: v for k, v in kwargs.items() if v not in (None, "")}
        try:
            return [plan(**args).as_dict()]
        except VfleetError as exc:
            raise AnsibleError(exc.render()) from None
