"""The example fleet inventory is valid: every host resolves to a plan vfleet can render."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vfleet.deploy_plan import plan

from .conftest import REPO

INVENTORY = REPO / "ansible" / "inventory" / "example-fleet"


def test_every_example_host_renders() -> None:
    bin_dir = Path(sys.executable).parent
    out = subprocess.run(
        [str(bin_dir / "ansible-inventory"), "-i", str(INVENTORY), "--list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    hostvars = json.loads(out)["_meta"]["hostvars"]
    assert set(hostvars) == {"box1", "box2", "box-a100"}
    profiles = set()
    for name, hv in hostvars.items():
        p = plan(
            hv["vfleet_profile"],
            hv["vfleet_model"],
            sets=hv.get("vfleet_set", []),
            base_dir=hv["vfleet_base_dir"],
            python=hv["vfleet_python"],
            host_name=name,
        )
        assert p["accelerator"]["kind"] == "cuda"
        profiles.add(p["profile"])
    assert profiles == {"2x2080ti-22g", "a100-32g"}
    assert plan("2x2080ti-22g", "qwen3.6-27b-fp8", sets=["port=8001"])["port"] == 8001
