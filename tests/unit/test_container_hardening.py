"""Issue 29, finding 7.4: the compose stack and the images.

- Prometheus without `--web.enable-lifecycle` (any local user could POST /-/quit): the real
  Prometheus with the argv vfleet renders refuses it and still reloads on SIGHUP, which the
  fleet role's handler sends through pm2.
- vLLM without `ipc: host`: its own /dev/shm, sized per profile (compose.shm_size).
- A credentialed PIP_INDEX never becomes a build argument (the image history keeps those):
  `vfleet images build` refuses it, and so does each Dockerfile's first RUN that sees it.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.support.vllm_server import free_port
from vfleet.config.profiles import list_profiles, load_profile, profiles_dir
from vfleet.render.monitoring import prometheus_argv

CREDENTIALED = "https://builder:s3cret-pw@pypi.example.internal/simple"


def _yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def test_no_service_shares_the_hosts_ipc_or_opens_prometheus_lifecycle_api() -> None:
    files = [REPO / "compose.yaml", *sorted((REPO / "images/compose").glob("*.yaml"))]
    for path in files:
        for name, service in _yaml(path).get("services", {}).items():
            assert service.get("ipc") is None, f"{path.name}: {name}"
            assert "--web.enable-lifecycle" not in (service.get("command") or []), name
    assert "--web.enable-lifecycle" not in prometheus_argv("/p", "127.0.0.1:9090", "prom", "1d")


def test_vllm_gets_its_own_shm_sized_for_its_workers() -> None:
    from vfleet.render.compose import SHM_GIB, shm_size  # here: the old code had neither

    for name in list_profiles(profiles_dir()):
        profile = load_profile(name)
        vllm = _yaml(REPO / f"images/compose/{name}.yaml")["services"]["vllm"]
        workers = profile.accelerator.count if profile.accelerator.kind == "cuda" else 1
        assert vllm["shm_size"] == shm_size(workers)
        assert int(vllm["shm_size"].removesuffix("gb")) >= SHM_GIB  # Docker's default: 64 MiB
    assert shm_size(1) == "4gb" and shm_size(4) == "10gb"


def _post(url: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_prometheus_as_rendered_refuses_quit_and_reloads_on_sighup(tmp_path: Path) -> None:
    (tmp_path / "prometheus.yml").write_text("global:\n  scrape_interval: 15s\n")
    listen = f"127.0.0.1:{free_port()}"
    argv = prometheus_argv(str(tmp_path), listen, "/usr/bin/prometheus", "1d")
    log = tmp_path / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://{listen}/-/ready", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        for path in ("/-/quit", "/-/reload"):
            assert _post(f"http://{listen}{path}") == 403, path  # lifecycle API not enabled
        time.sleep(0.5)
        assert proc.poll() is None, "Prometheus quit on a POST from a local user"
        loads = log.read_text().count("Completed loading of configuration file")
        proc.send_signal(signal.SIGHUP)  # what `pm2 sendSignal SIGHUP` delivers
        while log.read_text().count("Completed loading of configuration file") == loads:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_fleet_role_reloads_prometheus_with_sighup_not_http() -> None:
    (handler,) = yaml.safe_load(
        (REPO / "ansible/roles/vfleet_prometheus/handlers/main.yml").read_text()
    )
    cmd = handler["ansible.builtin.shell"]["cmd"]
    assert "sendSignal SIGHUP" in cmd and cmd.startswith("env -i ")
    assert "ansible.builtin.uri" not in handler


def test_images_build_refuses_an_index_with_credentials(cli) -> None:  # type: ignore[no-untyped-def]
    stage = REPO / "build" / "images"
    before = sorted(stage.iterdir()) if stage.exists() else []
    res = cli("images", "build", "-p", "cpu", "--dry-run", "--pip-index", CREDENTIALED)
    assert res.rc == 2 and "--pip-index" in res.err and "credentials" in res.err, res.err
    assert "fix:" in res.err and "s3cret-pw" not in res.err + res.out
    assert "Traceback" not in res.err and res.out == ""
    assert (sorted(stage.iterdir()) if stage.exists() else []) == before  # nothing staged
    ok = cli(
        "images",
        "build",
        "-p",
        "cpu",
        "--dry-run",
        "--only",
        "vllm",
        "--pip-index",
        "https://pypi.example.internal/simple",
    )
    assert ok.rc == 0 and "PIP_INDEX=https://pypi.example.internal/simple" in ok.out, ok.err
    for feed in stage.iterdir() if stage.exists() else []:
        if feed not in before:
            shutil.rmtree(feed)


def _first_run_after_pip_index(dockerfile: Path) -> str:
    """The first RUN after `ARG PIP_INDEX`: the classic builder writes a declared build
    argument into the history of every RUN from there on."""
    text = dockerfile.read_text()
    after = text[text.index("ARG PIP_INDEX") :]
    match = re.search(r"^RUN (.*?)(?<!\\)$", after, re.M | re.S)
    assert match is not None
    return match.group(1)


@pytest.mark.parametrize(
    "dockerfile",
    [p for p in sorted(REPO.glob("images/*/Dockerfile")) if "ARG PIP_INDEX" in p.read_text()],
    ids=lambda p: p.parent.name,
)
def test_each_dockerfile_refuses_an_index_with_credentials(dockerfile: Path) -> None:
    """The guard as the image's sh runs it (a plain `docker compose build` with PIP_INDEX in
    the environment does not go through `vfleet images build`)."""
    run = _first_run_after_pip_index(dockerfile)
    guard = run.split(" \\\n", 1)[0]
    assert guard.startswith('case "$PIP_INDEX" in')
    for index, rc in ((CREDENTIALED, 1), ("https://pypi.org/simple", 0), ("offline", 0)):
        p = subprocess.run(
            ["sh", "-c", guard], env={"PIP_INDEX": index}, capture_output=True, text=True
        )
        assert p.returncode == rc, (index, p.stderr)
        assert ("holds credentials" in p.stderr) == (rc == 1)
