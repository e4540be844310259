"""`vfleet releases`: what hostfacts reads of the releases kept on a host, and the states."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vfleet.fleet.releases import rows
from vfleet.hostside.hostfacts import release_facts, release_list


def release(inst: Path, rid: str, model: str, mtime: float) -> Path:
    d = inst / "releases" / rid
    d.mkdir(parents=True)
    manifest = {"profile": "cpu", "model": model, "served_model_name": model, "env": {"X": "1"}}
    (d / "release.json").write_text(json.dumps(manifest))
    (d / "vllm.yaml").write_text(f"model: /m/{model}\n")
    os.utime(d / "release.json", (mtime, mtime))
    return d


def test_states_and_order(tmp_path: Path) -> None:
    inst = tmp_path / "instances" / "main"
    a = release(inst, "aaaa", "tiny-dense", 1000)
    b = release(inst, "bbbb", "tiny-hybrid-mtp", 2000)
    release(inst, "cccc", "old", 500)
    (inst / "current").symlink_to(b)
    (inst / "previous").symlink_to(a)
    facts = release_facts(str(inst / "current"), [])
    listed = rows(facts)
    assert [(r["id"], r["state"]) for r in listed] == [
        ("bbbb", "current"),
        ("aaaa", "previous"),
        ("cccc", "kept"),
    ]
    assert listed[0]["model"] == "tiny-hybrid-mtp" and "env" not in listed[0]
    assert facts["config_text"] == "model: /m/tiny-hybrid-mtp\n"


def test_never_deployed(tmp_path: Path) -> None:
    facts = release_facts(str(tmp_path / "instances" / "main" / "current"), [])
    assert facts["current"] is None and rows(facts) == []


def test_a_release_being_written_is_not_listed(tmp_path: Path) -> None:
    inst = tmp_path / "instances" / "main"
    done = release(inst, "aaaa", "tiny-dense", 1000)
    release(inst, ".tmp-x1y2", "tiny-hybrid-mtp", 2000)  # the role's writer, not yet renamed
    (inst / "current").symlink_to(done)
    assert [r["id"] for r in release_list(str(inst / "current"))] == ["aaaa"]
