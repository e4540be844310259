"""The probe's exit codes and output without a server (the tiers against a real vLLM are in
test_e2e_deploy.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from vfleet_healthcheck.probe import read_env_file

PROBE = [sys.executable, "-m", "vfleet_healthcheck.probe"]


def probe(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run the real probe CLI in a subprocess."""
    return subprocess.run(
        [*PROBE, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when the socket closes


def test_nothing_listening_fails_live_and_skips_later_tiers() -> None:
    port = closed_port()
    r = probe("--url", f"http://127.0.0.1:{port}", "--model", "m", "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["ok"] is False and list(report["tiers"]) == ["live"]
    assert (
        report["tiers"]["live"]["ok"] is False and "Connection" in report["tiers"]["live"]["detail"]
    )


def test_wait_gives_up_after_its_deadline() -> None:
    port = closed_port()
    r = probe(
        "--url", f"http://127.0.0.1:{port}", "--model", "m", "--wait", "2", "--interval", "0.5"
    )
    assert r.returncode == 1
    assert "waiting for" in r.stderr and "live     FAIL" in r.stdout


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    r = probe()
    assert r.returncode == 2 and "need --url and --model" in r.stderr
    bad = tmp_path / "probe.json"
    bad.write_text("{not json")
    r = probe("--config", str(bad))
    assert r.returncode == 2 and str(bad) in r.stderr


def test_env_file_is_read_like_systemd_and_sh(tmp_path: Path) -> None:
    f = tmp_path / "vllm.env"
    f.write_text("# comment\nVLLM_API_KEY='sk-1 2'\nOTHER=plain\n")
    assert read_env_file(f) == {"VLLM_API_KEY": "sk-1 2", "OTHER": "plain"}


def test_wait_stops_when_the_server_process_exits() -> None:
    """ExecStartPost passes $MAINPID: a server dying at start fails the start at once."""
    port = closed_port()
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    start = time.monotonic()
    r = probe(
        "--url",
        f"http://127.0.0.1:{port}",
        "--model",
        "m",
        "--wait",
        "60",
        "--interval",
        "0.5",
        "--pid",
        str(server.pid),
    )
    server.wait()
    assert r.returncode == 1 and f"server process {server.pid} exited" in r.stderr
    assert time.monotonic() - start < 30  # not the 60 s wait


def test_prereqs_name_what_is_missing(tmp_path: Path) -> None:
    """ExecStartPre: model readable, caches writable, port free; each failure says what."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        conf = tmp_path / "probe.json"
        conf.write_text(
            json.dumps(
                {
                    "url": f"http://127.0.0.1:{port}",
                    "served_model_name": "m",
                    "prereqs": {
                        "model_dir": str(tmp_path / "no-model"),
                        "writable": [str(tmp_path / "cache" / "vllm")],
                        "host": "127.0.0.1",
                        "port": port,
                        "gpus": 0,
                    },
                }
            )
        )
        r = probe("--config", str(conf), "--prereqs")
    assert r.returncode == 1
    assert f"{tmp_path}/no-model/config.json missing" in r.stderr
    assert f"port {port} already in use" in r.stderr
    assert (tmp_path / "cache" / "vllm").is_dir() and "writable" in r.stdout
    (tmp_path / "no-model").mkdir()
    (tmp_path / "no-model" / "config.json").write_text("{}")
    r = probe("--config", str(conf), "--prereqs")
    assert r.returncode == 0, r.stderr
