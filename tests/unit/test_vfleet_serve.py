"""The vLLM images' entrypoint (images/common/vfleet-serve) outside a container: it passes
SIGTERM on to the server and waits for its drain, exits with the server's status, and refuses
to start without a release. A shell script stands in for launch.sh (it is what vLLM's signal
handling looks like from outside: trap, drain, exit); the probe is the real vfleet-probe."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO

SERVE = REPO / "images" / "common" / "vfleet-serve"


def release(tmp_path: Path, launch: str) -> Path:
    rel = tmp_path / "current"
    rel.mkdir()
    (rel / "launch.sh").write_text("#!/bin/sh\n" + launch)
    (rel / "launch.sh").chmod(0o755)
    # Nothing listens there: the warmup keeps waiting until the server process exits.
    probe = {"url": "http://127.0.0.1:9", "served_model_name": "m", "state_dir": str(tmp_path)}
    (rel / "probe.json").write_text(json.dumps(probe))
    return rel


def start(rel: Path, tmp_path: Path) -> subprocess.Popen[str]:
    env = dict(
        os.environ,
        VFLEET_RELEASE=str(rel),
        VFLEET_START_TIMEOUT_S="60",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    return subprocess.Popen(
        [str(SERVE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_sigterm_reaches_the_server_and_waits_for_its_drain(tmp_path: Path) -> None:
    marker = tmp_path / "drained"
    rel = release(
        tmp_path,
        f"trap 'sleep 2; touch {marker}; exit 0' TERM\necho serving\nwhile :; do sleep 0.2; done\n",
    )
    proc = start(rel, tmp_path)
    time.sleep(2)
    assert proc.poll() is None
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    # It returned only after the 2 s drain, with the server's exit status.
    assert proc.returncode == 0, out
    assert marker.exists() and time.monotonic() - t0 >= 1.5
    assert "serving" in out


def test_exit_status_is_the_servers(tmp_path: Path) -> None:
    proc = start(release(tmp_path, "exit 3\n"), tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "warmup failed" in out  # the probe stopped waiting when the server died


def test_no_release_mounted(tmp_path: Path) -> None:
    proc = start(tmp_path / "missing", tmp_path)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 2
    assert "no release at" in out and "vfleet compose" in out
