"""Lookup plugin: the other hosts of this play batch that are the same machine as this one.

Two instances on one box (the 4-GPU two-replica layout) are two inventory hosts with the same
`ansible_host` and port and different `vfleet_instance`. Deployed in the same batch they would
install the same virtualenv, model and process manager at once; the role's preflight stops
that and says how to deploy them one at a time.
"""

from __future__ import annotations

from typing import Any

from ansible.plugins.lookup import LookupBase

DOCUMENTATION = r"""
name: vfleet_same_box
short_description: other hosts of the play batch with this host's ansible_host and port
"""


def box(name: str, hostvars: Any) -> tuple[str, int]:
    v = hostvars[name]
    if v.get("ansible_connection") == "local":
        return "(the control machine)", 0  # every local alias runs here, whatever its address
    return str(v.get("ansible_host") or name), int(v.get("ansible_port") or 22)


def same_box(me: str, batch: list[str], hostvars: Any) -> list[str]:
    mine = box(me, hostvars)
    return [h for h in batch if h != me and box(h, hostvars) == mine]


class LookupModule(LookupBase):
    def run(self, terms: list[Any], variables: Any = None, **kwargs: Any) -> list[Any]:
        v = variables or {}
        return [same_box(v["inventory_hostname"], list(v["ansible_play_batch"]), v["hostvars"])]
