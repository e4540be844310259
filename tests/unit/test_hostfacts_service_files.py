"""hostfacts runs as root and reads the SM75 plugin's state file from instances/<i>/state, a
folder the service user writes (issue 29, finding 7.3). That user chooses what the name is: a
link to /dev/zero or to a root-only file, a FIFO, a hard link, a huge file. Each is refused
and `vfleet doctor` reports it as a finding. The real hostfacts.py, run as `vfleet doctor` runs
it on a local host (python3 - with the script on stdin), on real files of each kind."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from vfleet.fleet.doctor import check_plugin
from vfleet.fleet.inventory import request, run_hostfacts
from vfleet.render.plan import plan

SECRET = "root-only-3f9a1c"  # in a file the service user must not get to the control machine


def plant_link(state: Path, tmp: Path) -> str:
    secret = tmp / "root-only.json"
    secret.write_text(json.dumps({"format": "vfleet-sm75.state/1", "secret": SECRET}))
    secret.chmod(0o600)
    state.symlink_to(secret)
    return "symbolic link"


def plant_dev_zero(state: Path, tmp: Path) -> str:
    state.symlink_to("/dev/zero")  # old code: a read without end, as root
    return "symbolic link"


def plant_dangling(state: Path, tmp: Path) -> str:
    state.symlink_to(tmp / "not-yet")  # created later as root by someone else's write
    return "symbolic link"


def plant_fifo(state: Path, tmp: Path) -> str:
    os.mkfifo(state)  # old code: an open that waits for a writer
    return "not a regular file"


def plant_hardlink(state: Path, tmp: Path) -> str:
    secret = tmp / "root-only.json"
    secret.write_text(json.dumps({"format": "vfleet-sm75.state/1", "secret": SECRET}))
    os.link(secret, state)
    return "2 hard links"


def plant_huge(state: Path, tmp: Path) -> str:
    state.write_text(json.dumps({"pad": "x" * (1 << 20), "secret": SECRET}))
    return "larger than"


@pytest.mark.parametrize(
    "plant",
    [plant_link, plant_dev_zero, plant_dangling, plant_fifo, plant_hardlink, plant_huge],
    ids=lambda f: f.__name__.removeprefix("plant_"),
)
def test_a_state_file_the_service_user_planted_is_refused_and_reported(
    tmp_path: Path, plant: Callable[[Path, Path], str]
) -> None:
    p = plan("cpu", "tiny-hybrid-mtp", base_dir=str(tmp_path / "vf"))
    req = request(p)
    state = Path(req["plugin_state_file"])
    state.parent.mkdir(parents=True)
    says = plant(state, tmp_path)
    facts = run_hostfacts("localhost", {"ansible_connection": "local"}, req, "python3")
    assert facts["plugin_state"] is None
    (line,) = [e for e in facts["errors"] if e.startswith("plugin state:")]
    assert "refused" in line and says in line, line
    assert SECRET not in json.dumps(facts)
    # What the operator sees: a finding that names the file and why, not a traceback.
    (finding,) = check_plugin(p, facts)
    assert finding.status == "warn" and says in finding.message, finding
    assert str(state) in finding.fix and "remove" in finding.fix


def test_the_state_file_the_plugin_wrote_is_read(tmp_path: Path) -> None:
    p = plan("cpu", "tiny-hybrid-mtp", base_dir=str(tmp_path / "vf"))
    req = request(p)
    state = Path(req["plugin_state_file"])
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"format": "vfleet-sm75.state/1", "plugin": "x"}))
    facts = run_hostfacts("localhost", {"ansible_connection": "local"}, req, "python3")
    assert facts["plugin_state"] == {"format": "vfleet-sm75.state/1", "plugin": "x"}


@pytest.mark.parametrize(
    "plant",
    [plant_dev_zero, plant_fifo, plant_huge],
    ids=lambda f: f.__name__.removeprefix("plant_"),
)
def test_the_env_file_is_read_bounded_as_the_service_users_file(
    tmp_path: Path, plant: Callable[[Path, Path], str]
) -> None:
    """vllm.env is the service user's (0600, launch.sh sources it as that user): a huge one
    was read whole as root, a link or FIFO in its place followed (issue 29's leftovers).
    Each is refused; the rest of the facts are gathered."""
    p = plan("cpu", "tiny-hybrid-mtp", base_dir=str(tmp_path / "vf"))
    req = request(p)
    env = Path(req["env_file"])
    env.parent.mkdir(parents=True)
    says = plant(env, tmp_path)
    facts = run_hostfacts("localhost", {"ansible_connection": "local"}, req, "python3")
    (line,) = [e for e in facts["errors"] if e.startswith("env file:")]
    assert "refused" in line and says in line, line
    assert SECRET not in json.dumps(facts)
    assert facts["plugin_state"] is None  # absent: the other facts went on


def test_the_env_file_the_deploy_wrote_is_read(tmp_path: Path) -> None:
    p = plan("cpu", "tiny-hybrid-mtp", base_dir=str(tmp_path / "vf"))
    req = request(p)
    env = Path(req["env_file"])
    env.parent.mkdir(parents=True)
    env.write_text("VLLM_API_KEY='k-123456'\nOMP_NUM_THREADS='2'\n")
    facts = run_hostfacts("localhost", {"ansible_connection": "local"}, req, "python3")
    assert not [e for e in facts["errors"] if e.startswith("env file:")], facts["errors"]
    assert "k-123456" not in json.dumps(facts)  # a secret: hashed, never sent back
