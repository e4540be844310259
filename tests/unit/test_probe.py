"""The probe's exit codes and output without a server (the tiers against a real vLLM are in
test_e2e_deploy.py), and against hostile servers: an answer trickled a byte at a time, a server
that accepts and never answers, a 200 whose body is not the JSON expected. A real vLLM cannot be
made to do those, so they come from a loopback fake (tests/support/fake_upstream.py, shared with
the sidecar's tests); the probe itself runs as the real command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vfleet_healthcheck.probe import Target, marker_file, read_env_file

from tests.support.fake_upstream import FakeUpstream, Reply

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
    r = probe("--config", str(bad), "--prereqs")
    assert r.returncode == 2 and str(bad) in r.stderr and "Traceback" not in r.stderr
    for flag, value in (("--timeout", "0"), ("--timeout", "nan"), ("--wait", "-1")):
        r = probe("--url", "http://127.0.0.1:1", "--model", "m", flag, value)
        assert r.returncode == 2 and f"{flag}: expected" in r.stderr, r.stderr
    bad.write_text("[1, 2]")
    for args in ((), ("--prereqs",)):
        r = probe("--config", str(bad), *args)
        assert r.returncode == 2 and "expected a JSON object" in r.stderr, r.stderr


def test_env_file_is_read_bounded_and_never_through_a_link(tmp_path: Path) -> None:
    """The env file is the service user's and the probe may run as root (pm2's readiness
    step): a link (to /dev/zero: a read without end) or a huge file is refused, not read."""
    link = tmp_path / "link.env"
    link.symlink_to("/dev/zero")
    with pytest.raises(OSError):
        read_env_file(link)
    huge = tmp_path / "huge.env"
    huge.write_text("X='" + "y" * (1 << 20) + "'\n")
    with pytest.raises(ValueError, match="larger than"):
        read_env_file(huge)
    fifo = tmp_path / "fifo.env"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        read_env_file(fifo)


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


# ------------------------------------------------------- issue 22: a hostile server (finding 5)


def server(**over: Reply) -> dict[str, Reply]:
    """A server that passes every tier up to serving; ``over`` replaces a path's answer."""
    routes = {
        "/health": Reply(b""),
        "/v1/models": Reply(b'{"object": "list", "data": [{"id": "m"}]}'),
        "/v1/chat/completions": Reply(
            b'{"choices": [{"message": {"content": "OK"}}], "usage": {"completion_tokens": 1}}'
        ),
    }
    routes.update({"/" + k.replace("_", "/"): v for k, v in over.items()})
    return routes


def timed_probe(url: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    try:
        r = probe("--url", url, "--model", "m", "--interval", "0.5", *args, timeout=25)
    except subprocess.TimeoutExpired:
        pytest.fail("the probe ran past 25 s")
    return r, time.monotonic() - start


def test_a_healthy_server_passes() -> None:
    """The fake's normal answers are what the probe expects: the failures below are theirs."""
    with FakeUpstream(server()) as u:
        r, _ = timed_probe(u.url, "--timeout", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "serving  ok" in r.stdout


SLOW = b"x" * 500  # trickled at 0.1 s a byte: 50 s for one answer


@pytest.mark.parametrize("path", ["health", "v1_models", "v1_chat_completions"])
@pytest.mark.parametrize("how", ["trickle", "hang"])
def test_timeout_and_wait_hold_against_a_slow_or_hung_server(path: str, how: str) -> None:
    """Was: `--timeout 3 --wait 10` ran 90 s against a trickling server until killed."""
    slow = Reply(SLOW, trickle=0.1) if how == "trickle" else Reply(hang=True)
    with FakeUpstream(server(**{path: slow})) as u:
        r, took = timed_probe(u.url, "--timeout", "1", "--wait", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    # --wait plus the interpreter's start, with room for a loaded machine (2.5 s of room failed
    # under CI-like load): the fault it guards against took 50 s (the trickled answer) or more.
    assert took < 3 + 12
    failed = [line for line in r.stdout.splitlines() if "FAIL" in line]
    assert len(failed) == 1 and "within 1.0 s" in failed[0], r.stdout


def test_wait_cuts_a_request_that_outlives_it() -> None:
    """--wait is the end of the waiting even while a request's own --timeout has time left."""
    with FakeUpstream(server(health=Reply(SLOW, trickle=0.1))) as u:
        r, took = timed_probe(u.url, "--timeout", "30", "--wait", "2")
    # As above: far below the 30 s --timeout and the 50 s trickle, loose for a loaded machine.
    assert r.returncode == 1 and took < 2 + 12, (took, r.stdout)


NOT_JSON = "not JSON"


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("v1_models", b"<html><body>Welcome to nginx!</body></html>", NOT_JSON),
        ("v1_models", b'[{"id": "m"}]', "without a data list"),
        ("v1_models", b'{"data": "m"}', "without a data list"),
        ("v1_models", bytes(range(256)), NOT_JSON),
        ("v1_chat_completions", b'{"usage": null}', "without usage.completion_tokens"),
        ("v1_chat_completions", b'{"usage": {"completion_tokens": "1"}}', "completion_tokens"),
        ("v1_chat_completions", b"[]", "not a JSON object"),
        ("v1_chat_completions", bytes(range(256)), NOT_JSON),
        ("v1_chat_completions", b"<html>502 Bad Gateway</html>", NOT_JSON),
    ],
    ids=[
        "models-html",
        "models-list",
        "models-data-str",
        "models-binary",
        "usage-null",
        "tokens-str",
        "completion-list",
        "completion-binary",
        "completion-html",
    ],
)
def test_an_unexpected_200_body_fails_its_tier_in_one_line(
    path: str, body: bytes, says: str
) -> None:
    """Was: a traceback (exit 1 by accident) and --wait ignored."""
    with FakeUpstream(server(**{path: Reply(body)})) as u:
        r, took = timed_probe(u.url, "--timeout", "2", "--wait", "1.5")
        assert u.hits.count("/" + path.replace("_", "/")) >= 2  # --wait honoured: it retried
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr
    assert "waiting for" in r.stderr
    failed = [line for line in r.stdout.splitlines() if "FAIL" in line]
    assert len(failed) == 1 and says in failed[0], r.stdout
    assert took < 1.5 + 2.5
    with FakeUpstream(server(**{path: Reply(body)})) as u:
        r = probe("--url", u.url, "--model", "m", "--timeout", "2", "--json")
    report = json.loads(r.stdout)  # --json stays one JSON object
    assert r.returncode == 1 and report["ok"] is False


# ------------------------------------------- issue 29, finding 7.3: the service user's folder
# Under pm2 the deploy's readiness step runs `vfleet-probe --warmup` as root, and the warm
# marker lives in instances/<i>/state, which the service user writes.


def warm_setup(tmp_path: Path, url: str) -> tuple[Path, Path, Path]:
    state = tmp_path / "state"
    state.mkdir()
    conf = tmp_path / "probe.json"
    conf.write_text(
        json.dumps(
            {
                "url": url,
                "served_model_name": "m",
                "state_dir": str(state),
                "warmup": {"steps": [{"concurrency": 1, "prompt_tokens": 8, "max_tokens": 1}]},
            }
        )
    )
    return conf, marker_file(Target(url, "m", state_dir=state)), tmp_path / "victim"


def warm_server() -> dict[str, Reply]:
    return server() | {"/metrics": Reply(b"process_start_time_seconds 1700000000.5\n")}


def test_the_warmup_never_writes_through_a_link_in_the_state_folder(tmp_path: Path) -> None:
    with FakeUpstream(warm_server()) as u:
        conf, marker, victim = warm_setup(tmp_path, u.url)
        victim.write_text("root's file\n")
        marker.symlink_to(victim)
        r = probe("--config", str(conf), "--warmup", "--timeout", "5")
        assert r.returncode == 0, r.stdout + r.stderr
    assert victim.read_text() == "root's file\n"  # the old probe wrote its JSON here
    assert marker.is_file() and not marker.is_symlink()
    assert json.loads(marker.read_text())["server"] is not None
    assert sorted(p.name for p in marker.parent.iterdir()) == [marker.name]  # no temp left


def test_a_linked_warm_marker_is_not_read(tmp_path: Path) -> None:
    with FakeUpstream(warm_server()) as u:
        conf, marker, victim = warm_setup(tmp_path, u.url)
        assert probe("--config", str(conf), "--warmup", "--timeout", "5").returncode == 0
        marker.rename(victim)  # a marker this server's warmup really wrote...
        marker.symlink_to(victim)  # ...reached through a link is not taken
        r = probe("--config", str(conf), "--tier", "warm", "--timeout", "5")
    assert r.returncode != 0 and "unreadable" in r.stdout, r.stdout + r.stderr
