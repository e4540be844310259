"""Put a vLLM engine on this host to sleep and wake it, over loopback only (standard library).

vLLM's sleep controls (`POST /sleep?level=N&mode=M`, `POST /wake_up`, `GET /is_sleeping`,
`POST /collective_rpc`) are dev-mode routes: mounted only with VLLM_SERVER_DEV_MODE=1, and
behind no API key in any pinned version (docs/SECURITY.md). vfleet's fronts never forward
them, and vLLM listens on loopback wherever they are mounted (rule `sleep-mode`). So they are
called from the host itself: `vfleet switch` runs this file on the serving host (directly for
`ansible_connection: local`, else over ssh with the script on stdin, as hostfacts.py).

    python3 sleepctl.py PORT state
    python3 sleepctl.py PORT sleep LEVEL [--mode wait|abort|keep] [--timeout S]
    python3 sleepctl.py PORT wake LEVEL [--timeout S] [--plugin-state FILE]

The address is always 127.0.0.1: there is no option to name another host. Every call is
bounded (--timeout, default 120 s for a sleep that waits for in-flight requests, 60 s for a
wake). A wake returns once /is_sleeping says false. Level 2 drops the weights: its wake is
vLLM's own sequence (wake the weights' memory, `reload_weights` from disk, wake the KV cache),
as a plain /wake_up would leave garbage weights (docs/GPU.md, section 6).

With --plugin-state (the instance's VFLEET_SM75_STATE), a level 2 wake also reports what the
SM75 plugin's drafter-reload recorded for this wake's reload_weights ("drafter": whether the MTP
drafter was reloaded and the plugin's line), or null when it recorded nothing since the wake
began (the feature off, or no plugin).

Prints one JSON line: {"ok": true, "action": ..., "seconds": ..., "is_sleeping": ...}, exit 0;
{"ok": false, "error": ...} and exit 1 when vLLM refused or did not answer in time; a usage
message and exit 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from typing import Any

HOST = "127.0.0.1"  # never anything else: the dev routes are for this machine only
MODES = ("wait", "abort", "keep")
LEVELS = (0, 1, 2)
SLEEP_TIMEOUT_S = 120.0
WAKE_TIMEOUT_S = 60.0
POLL_S = 0.05
BODY_LIMIT = 1 << 16  # these routes answer a few bytes; more is not vLLM


class SleepCtlError(Exception):
    """vLLM refused, failed or did not answer in time: the switch must not go on."""


def call(
    port: int, method: str, path: str, timeout: float, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One request to 127.0.0.1:PORT; the JSON object it answered. Bounded by `timeout`
    (connect and each read); SleepCtlError for anything but a 200 with a JSON object."""
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port")
    conn = http.client.HTTPConnection(HOST, port, timeout=max(timeout, 0.1))
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data is not None else {}
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read(BODY_LIMIT + 1)
    except TimeoutError:
        raise SleepCtlError(f"{method} {path}: no answer within {timeout:.0f} s") from None
    except OSError as exc:
        raise SleepCtlError(f"{method} {path}: {type(exc).__name__}: {exc}") from None
    except http.client.HTTPException as exc:
        raise SleepCtlError(f"{method} {path}: bad HTTP answer: {exc!r}") from None
    finally:
        conn.close()
    text = raw[:BODY_LIMIT].decode(errors="replace")
    if resp.status == 404:
        raise SleepCtlError(
            f"{method} {path}: 404, vLLM on port {port} has no sleep controls "
            "(not started with VLLM_SERVER_DEV_MODE=1: set sleep_level and deploy again)"
        )
    if resp.status != 200:
        raise SleepCtlError(f"{method} {path}: HTTP {resp.status}: {text[:300]}")
    try:
        out = json.loads(text) if text.strip() else {}
    except ValueError:
        raise SleepCtlError(f"{method} {path}: not JSON: {text[:200]!r}") from None
    if not isinstance(out, dict):
        raise SleepCtlError(f"{method} {path}: not a JSON object: {text[:200]!r}")
    return out


def is_sleeping(port: int, timeout: float = 10.0) -> bool:
    out = call(port, "GET", "/is_sleeping", timeout)
    value = out.get("is_sleeping")
    if not isinstance(value, bool):
        raise SleepCtlError(f"GET /is_sleeping: no is_sleeping in {out!r}")
    return value


def _left(deadline: float, action: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise SleepCtlError(f"{action}: the time limit ran out")
    return left


def sleep(port: int, level: int, mode: str = "wait", timeout: float = SLEEP_TIMEOUT_S) -> float:
    """Pause the engine (level 0) or free its memory too (1: weights to host RAM, 2: dropped).
    With mode `wait` vLLM answers once its in-flight requests finished; requests that arrive
    meanwhile are queued until the wake. Seconds it took."""
    if level not in LEVELS or mode not in MODES:
        raise ValueError(f"level {level} / mode {mode!r}: level 0, 1 or 2; mode one of {MODES}")
    t0 = time.monotonic()
    call(port, "POST", f"/sleep?level={level}&mode={mode}", timeout)
    if not is_sleeping(port, min(10.0, _left(t0 + timeout, "sleep"))):
        raise SleepCtlError(f"POST /sleep?level={level} answered, but /is_sleeping says false")
    return time.monotonic() - t0


def wake(port: int, level: int, timeout: float = WAKE_TIMEOUT_S) -> float:
    """Wake the engine and wait until /is_sleeping is false; seconds it took."""
    if level not in LEVELS:
        raise ValueError(f"level {level}: 0, 1 or 2")
    t0 = time.monotonic()
    deadline = t0 + timeout
    if level == 2:
        # The weights' memory back, the weights from disk, then the KV cache (vLLM's own tests;
        # docs/GPU.md: a plain /wake_up after level 2 serves garbage).
        call(port, "POST", "/wake_up?tags=weights", _left(deadline, "wake"))
        call(
            port,
            "POST",
            "/collective_rpc",
            _left(deadline, "wake"),
            {"method": "reload_weights"},
        )
        call(port, "POST", "/wake_up?tags=kv_cache", _left(deadline, "wake"))
    else:
        call(port, "POST", "/wake_up", _left(deadline, "wake"))
    while is_sleeping(port, min(10.0, _left(deadline, "wake"))):
        time.sleep(min(POLL_S, _left(deadline, "wake: /is_sleeping still true")))
    return time.monotonic() - t0


DRAFTER_FEATURE = "drafter-reload"
STATE_LIMIT = 1 << 20  # the plugin's state file is a few hundred bytes


def drafter_record(path: str, since: float) -> dict[str, Any] | None:
    """The plugin's drafter-reload result if its state file was written at or after `since`
    (epoch seconds): {"reloaded": bool, "detail": str}; None otherwise or if unreadable."""
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.loads(fh.read(STATE_LIMIT))
        if float(doc.get("written_at", 0)) < since:
            return None
        for m in doc.get("model") or []:
            if m.get("feature") == DRAFTER_FEATURE:
                return {"reloaded": bool(m.get("active")), "detail": str(m.get("reason"))[:300]}
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sleepctl.py", description=__doc__.split("\n\n")[0])
    p.add_argument("port", type=int, help="vLLM's port on 127.0.0.1")
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("state", help="is the engine asleep?")
    s = sub.add_parser("sleep", help="pause it (0) or free its memory too (1, 2)")
    s.add_argument("level", type=int, choices=LEVELS)
    s.add_argument("--mode", choices=MODES, default="wait")
    s.add_argument("--timeout", type=float, default=SLEEP_TIMEOUT_S)
    w = sub.add_parser("wake", help="wake it; returns once /is_sleeping is false")
    w.add_argument("level", type=int, choices=LEVELS, help="the level it was put to sleep at")
    w.add_argument("--timeout", type=float, default=WAKE_TIMEOUT_S)
    w.add_argument("--plugin-state", help="the SM75 plugin's state file: report drafter-reload")
    a = p.parse_args(argv)  # bad arguments: usage and exit 2
    if not 0 < a.port < 65536 or getattr(a, "timeout", 1.0) <= 0:
        p.error("PORT must be 1-65535 and --timeout above 0")
    out: dict[str, Any] = {"action": a.action, "port": a.port}
    try:
        if a.action == "sleep":
            out["seconds"] = round(sleep(a.port, a.level, a.mode, a.timeout), 3)
        elif a.action == "wake":
            began = time.time()
            out["seconds"] = round(wake(a.port, a.level, a.timeout), 3)
            if a.plugin_state and a.level == 2:
                out["drafter"] = drafter_record(a.plugin_state, began)
        out["is_sleeping"] = is_sleeping(a.port)
    except SleepCtlError as exc:
        print(json.dumps(out | {"ok": False, "error": str(exc)}))
        return 1
    print(json.dumps(out | {"ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
