"""The last switch as the sidecar sees it (issue 32): `last-switch.json` in the instance folder.

`vfleet switch` builds one record per instance of the pair and writes it on the box with
`vfleet_healthcheck/switch_record.py` run as a script (as over ssh: the file on stdin); the
sidecar reads it at each scrape. Here: the record's bounds, the writer (through the folder's
descriptor, never through a link, root's folder only when root), the reader against hostile
files (too large, a FIFO, a link, a hard link, bad JSON, values outside their sets: no metric,
no crash, one log line), the exported families, and the switch's own bookkeeping (counts,
one record per role). The switch itself with real engines: tests/integration/test_switch.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vfleet_healthcheck import switch_record as sr
from vfleet_healthcheck.exporter import Identity, VllmCollector

from tests.conftest import REPO
from tests.support.fake_upstream import FakeUpstream, Reply
from vfleet.fleet import switch

REAL = (REPO / "tests" / "data" / "vllm-0.32.0-metrics.txt").read_bytes()
Series = dict[tuple[tuple[str, str], ...], float]

T = 1_780_000_000.0  # a Unix time in range
GOOD = sr.SwitchRecord(
    role="to",
    to="box1-b",
    frm="box1-a",
    outcome="rolled_back",
    failed_at="greedy",
    seconds=3.02,
    ended_at=T,
    counts={"to": {"rolled_back": 1, "switched": 2}, "from": {"switched": 1}},
)
SWITCH_FAMILIES = {
    sr.METRIC_OUTCOME,
    sr.METRIC_DURATION,
    sr.METRIC_FIRST_TOKEN,
    sr.METRIC_TIMESTAMP,
    sr.METRIC_TOTAL,
}


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    """A vLLM /metrics body captured from a real server (as tests/unit/test_exporter.py)."""
    with FakeUpstream({"/metrics": Reply(body=REAL)}) as u:
        yield u


def scrape(collector: VllmCollector) -> dict[str, Series]:
    """One Prometheus-style scrape, parsed back with prometheus_client's own parser."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    out: dict[str, Series] = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def only_value(series: Series) -> float:
    assert len(series) == 1, series
    return next(iter(series.values()))


def _data(record: sr.SwitchRecord = GOOD) -> dict[str, object]:
    data: dict[str, object] = json.loads(record.to_json())
    return data


# --------------------------------------------------------------------------- the record


def test_the_record_round_trips_and_names_come_from_one_list() -> None:
    assert sr.SwitchRecord.from_json(GOOD.to_json()) == GOOD
    assert "\n" not in GOOD.to_json()  # one argument on the writer's command line
    assert switch.OUTCOME_KEYS["rolled back"] == "rolled_back"
    assert set(sr.FAILED_AT) == {"none", *sr.STEPS, *sr.GATES}
    assert (switch.FLIP, switch.WAKE, switch.GREEDY) == ("flip", "wake", "greedy")
    assert set(sr.METRICS) == SWITCH_FAMILIES


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"outcome": "exploded"}, "outcome 'exploded' is not one of"),
        ({"outcome": 'switched"} 1\nvfleet_x{a="'}, "is not one of"),  # a label injection
        ({"failed_at": "the greedy gate, because"}, "failed_at"),
        ({"failed_at": "none"}, "failed_at 'none' with outcome 'rolled_back'"),
        ({"role": "both"}, "role 'both'"),
        ({"to": 'b"} 1'}, "not an inventory host name"),
        ({"seconds": -1}, "outside 0 < seconds"),
        ({"seconds": 0}, "outside 0 < seconds"),
        ({"seconds": 1e308}, "outside 0 < seconds"),
        ({"seconds": "3.0"}, "not a number"),
        ({"seconds": True}, "not a number"),
        ({"first_token_s": -0.5}, "first_token_s"),
        ({"ended_at": 12}, "not a Unix time"),
        ({"schema": 2}, "schema 2"),
        ({"counts": {"to": {"switched": -1}}}, "not a count"),
        ({"counts": {"to": {"switched": 10**30}}}, "not a count"),
        ({"counts": {"to": {"exploded": 1}}}, "'exploded' is not an outcome"),
        ({"counts": {"sideways": {}}}, "not a role"),
        ({"counts": []}, "counts: not an object"),
    ],
)
def test_a_field_outside_its_set_or_bounds_refuses_the_whole_record(
    change: dict[str, object], message: str
) -> None:
    text = json.dumps({**_data(), **change})
    with pytest.raises(sr.BadRecord) as exc:
        sr.SwitchRecord.from_json(text)
    assert message in str(exc.value)


def test_json_nan_and_a_missing_key_are_refused() -> None:
    with pytest.raises(sr.BadRecord, match="seconds"):
        sr.SwitchRecord.from_json(GOOD.to_json().replace('"seconds":3.02', '"seconds":NaN'))
    data = _data()
    del data["outcome"]
    with pytest.raises(sr.BadRecord, match="missing outcome"):
        sr.SwitchRecord.from_json(json.dumps(data))
    for bad in ("{", "[]", "null", '"x"'):
        with pytest.raises(sr.BadRecord):
            sr.SwitchRecord.from_json(bad)


# --------------------------------------------------------------------------- the writer


def _run_script(*args: str) -> subprocess.CompletedProcess[str]:
    """switch_record.py as `vfleet switch` runs it over ssh: `python - ARGS`, the file on stdin."""
    return subprocess.run(
        [sys.executable, "-", *args],
        input=Path(sr.__file__).read_text(encoding="utf-8"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},  # no PYTHONPATH: standalone
    )


def test_the_script_writes_the_record_as_the_switch_runs_it(tmp_path: Path) -> None:
    folder = tmp_path / "instances" / "b"
    folder.mkdir(parents=True)
    r = _run_script("write", str(folder), GOOD.to_json())
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ok": True, "path": str(folder / sr.FILENAME)}
    path = folder / sr.FILENAME
    assert sr.read(path) == GOOD
    assert path.stat().st_mode & 0o777 == 0o644  # the sidecar's user reads it
    assert [p.name for p in folder.iterdir()] == [sr.FILENAME]  # no temporary file left
    # A second switch replaces it.
    newer = replace(GOOD, outcome="switched", failed_at="none", first_token_s=1.2)
    assert _run_script("write", str(folder), newer.to_json()).returncode == 0
    assert sr.read(path) == newer


def test_the_script_never_writes_what_a_reader_refuses(tmp_path: Path) -> None:
    bad = json.dumps({**_data(), "outcome": "exploded"})
    r = _run_script("write", str(tmp_path), bad)
    assert r.returncode == 1 and json.loads(r.stdout)["ok"] is False
    assert "outcome 'exploded'" in json.loads(r.stdout)["error"]
    assert list(tmp_path.iterdir()) == []
    assert _run_script("write", str(tmp_path)).returncode == 2  # usage
    r = _run_script("write", "relative/dir", GOOD.to_json())
    assert r.returncode == 1 and "absolute path" in json.loads(r.stdout)["error"]


def test_the_writer_refuses_a_linked_folder_and_replaces_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "linked").symlink_to(target)
    with pytest.raises(OSError):  # O_NOFOLLOW | O_DIRECTORY on a link: ELOOP or ENOTDIR
        sr.write(str(tmp_path / "linked"), GOOD.to_json())
    assert list(target.iterdir()) == []
    # A link at the record's name is replaced by the rename, its target untouched.
    folder = tmp_path / "inst"
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    (folder / sr.FILENAME).symlink_to(victim)
    sr.write(str(folder), GOOD.to_json())
    assert victim.read_text() == "root's file\n"
    assert not (folder / sr.FILENAME).is_symlink() and sr.read(folder / sr.FILENAME) == GOOD


@pytest.mark.skipif(os.geteuid() != 0, reason="the owner checks apply to root")
def test_as_root_the_folder_must_be_roots_alone(tmp_path: Path) -> None:
    folder = tmp_path / "inst"
    folder.mkdir(mode=0o755)
    folder.chmod(0o775)  # group-writable: someone else could plant in it
    with pytest.raises(sr.BadRecord, match="not root's alone"):
        sr.write(str(folder), GOOD.to_json())
    folder.chmod(0o755)
    os.chown(folder, 65534, 65534)  # the service user's (nobody standing in)
    with pytest.raises(sr.BadRecord, match="not root's alone"):
        sr.write(str(folder), GOOD.to_json())
    assert list(folder.iterdir()) == []
    os.chown(folder, 0, 0)
    sr.write(str(folder), GOOD.to_json())
    assert sr.read(folder / sr.FILENAME) == GOOD


# --------------------------------------------------------------------------- the reader


def _hostile(kind: str, path: Path) -> None:
    if kind == "too large":
        path.write_text(GOOD.to_json() + " " * sr.MAX_BYTES)
    elif kind == "fifo":
        os.mkfifo(path)  # opened O_NONBLOCK: no writer needed, and no hang
    elif kind == "folder":
        path.mkdir()
    elif kind == "symlink":
        real = path.parent / "real.json"
        real.write_text(GOOD.to_json())
        path.symlink_to(real)
    elif kind == "hard link":
        real = path.parent / "real.json"
        real.write_text(GOOD.to_json())
        os.link(real, path)
    elif kind == "bad json":
        path.write_text('{"schema": 1, "role": ')
    elif kind == "not utf-8":
        path.write_bytes(b'{"role": "\xff"}')
    elif kind == "unknown outcome":
        path.write_text(json.dumps({**_data(), "outcome": "exploded"}))
    elif kind == "deep nesting":
        path.write_text("[" * 20000 + "]" * 20000)
    else:
        raise AssertionError(kind)


HOSTILE = [
    "too large", "fifo", "folder", "symlink", "hard link", "bad json", "not utf-8",
    "unknown outcome", "deep nesting",
]  # fmt: skip


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_file_is_refused_by_the_reader(tmp_path: Path, kind: str) -> None:
    path = tmp_path / sr.FILENAME
    _hostile(kind, path)
    with pytest.raises((OSError, ValueError)):
        sr.read(path)


def test_no_file_is_no_switch_yet(tmp_path: Path) -> None:
    assert sr.read(tmp_path / sr.FILENAME) is None


# --------------------------------------------------------------------------- the sidecar


def _switch_series(out: dict[str, Series]) -> set[str]:
    return {name for name in out if name.startswith("vfleet_switch")}


def test_the_sidecar_exports_the_last_switch_and_the_counts(
    upstream: FakeUpstream, tmp_path: Path
) -> None:
    path = tmp_path / sr.FILENAME
    sr.write(str(tmp_path), GOOD.to_json())
    c = VllmCollector(upstream.url, timeout=2, identity=Identity({"host": "box1-b"}, switch=path))
    out = scrape(c)
    outcome = out[sr.METRIC_OUTCOME]
    assert outcome == {
        (("failed_at", "greedy"), ("host", "box1-b"), ("outcome", "rolled_back"), ("role", "to")):
        1.0
    }  # fmt: skip
    assert only_value(out[sr.METRIC_DURATION]) == 3.02
    assert only_value(out[sr.METRIC_TIMESTAMP]) == T
    assert sr.METRIC_FIRST_TOKEN not in out  # a rolled-back switch has no first token
    totals = out[sr.METRIC_TOTAL]
    assert len(totals) == len(sr.ROLES) * len(sr.OUTCOMES)  # every series, zeros included
    assert totals[(("host", "box1-b"), ("outcome", "rolled_back"), ("role", "to"))] == 1
    assert totals[(("host", "box1-b"), ("outcome", "switched"), ("role", "to"))] == 2
    assert totals[(("host", "box1-b"), ("outcome", "failed"), ("role", "from"))] == 0
    # The next switch passed: the sidecar shows it at its next scrape.
    newer = replace(GOOD, outcome="switched", failed_at="none", first_token_s=1.25, seconds=5.3)
    sr.write(str(tmp_path), newer.to_json())
    out = scrape(c)
    labels = dict(next(iter(out[sr.METRIC_OUTCOME])))
    assert (labels["outcome"], labels["failed_at"]) == ("switched", "none")
    assert only_value(out[sr.METRIC_FIRST_TOKEN]) == 1.25
    assert only_value(out[sr.METRIC_DURATION]) == 5.3


@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_file_gives_no_switch_metric_and_no_crash(
    upstream: FakeUpstream, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / sr.FILENAME
    _hostile(kind, path)
    c = VllmCollector(upstream.url, timeout=2, identity=Identity(switch=path))
    with caplog.at_level(logging.WARNING, logger="vfleet-exporter"):
        for _ in range(2):
            out = scrape(c)
            assert only_value(out["vfleet_vllm_up"]) == 1.0  # the rest of the scrape stands
            assert _switch_series(out) == set()
    logged = [r.getMessage() for r in caplog.records if sr.FILENAME in r.getMessage()]
    assert len(logged) == 1 and "not used" in logged[0], logged  # once, not every scrape


def test_the_record_is_found_in_the_instance_folder_of_a_deployed_release(tmp_path: Path) -> None:
    instance = tmp_path / "instances" / "main"
    release = instance / "releases" / "abc123"
    release.mkdir(parents=True)
    (release / "sidecar.json").write_text('{"labels": {"host": "box1"}}')
    (instance / "current").symlink_to(release)
    identity = Identity.from_file(instance / "current" / "sidecar.json")
    assert identity.switch == instance / sr.FILENAME
    # Anywhere else (a hand-started sidecar): no record.
    (tmp_path / "sidecar.json").write_text("{}")
    assert Identity.from_file(tmp_path / "sidecar.json").switch is None


# --------------------------------------------------------------------------- the switch's side


def test_each_switch_is_counted_per_host_and_role_and_garbage_is_dropped() -> None:
    state: dict[str, object] = {
        "counts": {"b": {"to": {"switched": 2, "exploded": 5, "failed": "x"}, "sideways": {}}}
    }
    rep = switch.Report("b", "a", "rolled back", 3.0, failed_at="greedy")
    counts = switch.count(state, rep)
    assert counts == {
        "b": {"to": {"switched": 2, "rolled_back": 1}},
        "a": {"from": {"rolled_back": 1}},
    }
    assert state["counts"] == counts
    records = switch.host_records(rep, counts, T)
    assert records["b"].role == "to" and records["a"].role == "from"
    assert (
        records["b"].count("to", "rolled_back") == 1 and records["a"].count("to", "switched") == 0
    )
    assert {r.failed_at for r in records.values()} == {"greedy"}
    assert {r.outcome for r in records.values()} == {"rolled_back"}


def test_a_switch_that_never_started_still_makes_a_valid_record() -> None:
    rep = switch.Report("b", "a", "not started", 0.0, failed_at="flip")
    records = switch.host_records(rep, switch.count({}, rep), T)
    assert records["b"].outcome == "not_started" and records["b"].seconds > 0


def test_publish_writes_on_the_host_and_a_failure_is_a_note(tmp_path: Path) -> None:
    local = {"ansible_connection": "local"}
    r = switch.Replica("b", local, sys.executable, 8000, "chat", 0, None, instance_dir="")
    folder = tmp_path / "instances" / "b"
    folder.mkdir(parents=True)
    assert switch.publish(replace(r, instance_dir=str(folder)), GOOD) is None
    assert sr.read(folder / sr.FILENAME) == GOOD
    note = switch.publish(replace(r, instance_dir=str(tmp_path / "gone")), GOOD)
    assert note is not None and note.startswith("b: the sidecar's record of this switch was not")
    assert "FileNotFoundError" in note
