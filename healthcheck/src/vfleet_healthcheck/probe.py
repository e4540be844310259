"""Readiness probe for a vLLM server: live, models, serving, warm. Standard library only.

`/health` only says the engine is not dead; a static `/v1/models` answered for hours while
generation hung in a community report. So readiness here means a real generation, and
"warm" means the warmup set ran against this very server process (JIT kernels compiled
before traffic arrives).

Every request ends by its deadline (``--timeout`` for the request as a whole, and the end of
``--wait`` while waiting), whatever the server does; an answer that is not what vLLM sends (HTML
from a proxy, a JSON list, ``"usage": null``, binary) fails its tier with a one-line reason.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .bounded_http import RequestError, request

TIERS = ("live", "models", "serving", "warm")


@dataclass
class Target:
    url: str
    model: str
    api_key: str | None = None
    timeout_s: float = 60.0
    # The warmup set rendered by vfleet (warmup.py): batch sizes, prefill lengths, a decode.
    warmup_steps: list[dict[str, Any]] = field(
        default_factory=lambda: [{"concurrency": 1, "prompt_tokens": 8, "max_tokens": 8}]
    )
    state_dir: Path = Path(os.environ.get("VFLEET_PROBE_STATE", "/tmp"))
    until: float = math.inf  # monotonic end of --wait: no request runs past it


@dataclass
class TierResult:
    ok: bool
    detail: str
    ms: int
    cut: bool = False  # failed because --wait ran out, not because of the server

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail, "ms": self.ms}


class ProbeError(Exception):
    pass


class WaitRanOut(ProbeError):
    pass


def read_env_file(path: Path) -> dict[str, str]:
    """KEY='value' lines as written by vfleet (and accepted by systemd and sh). The file is the
    service user's (launch.sh sources it as that user) and the probe may run as root: read
    like the warm marker, not through a link, only a regular file, bounded (ValueError)."""
    out: dict[str, str] = {}
    for line in _read_small(path).splitlines():
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line.strip())
        if m:
            value = m.group(2)
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            out[m.group(1)] = value
    return out


def _request(
    t: Target, path: str, body: dict[str, Any] | None = None, timeout: float | None = None
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if t.api_key:
        headers["Authorization"] = f"Bearer {t.api_key}"
    data = json.dumps(body).encode() if body is not None else None
    limit = timeout or t.timeout_s
    left = t.until - time.monotonic()
    cut = left < limit
    if cut:
        if left <= 0:
            raise WaitRanOut(f"{path}: --wait ran out before the request")
        limit = left
    try:
        resp = request(
            t.url.rstrip("/") + path,
            timeout=limit,
            method="POST" if data is not None else "GET",
            body=data,
            headers=headers,
        )
    except RequestError as exc:
        if cut and exc.reason == "timeout":
            raise WaitRanOut(f"{path}: no complete answer before --wait ran out") from None
        raise ProbeError(str(exc)) from None
    return resp.status, resp.body


def _preview(raw: bytes) -> str:
    """The start of a body, on one line (binary escaped)."""
    return repr(raw[:60]) + ("..." if len(raw) > 60 else "")


def _json(raw: bytes, what: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        raise ProbeError(f"{what} answered 200, but not JSON: {_preview(raw)}") from None


def _timed(fn: Any, *args: Any) -> TierResult:
    start = time.monotonic()
    cut = False
    try:
        ok, detail = fn(*args)
    except WaitRanOut as exc:
        ok, detail, cut = False, str(exc), True
    except ProbeError as exc:
        ok, detail = False, str(exc)
    return TierResult(ok, detail, int((time.monotonic() - start) * 1000), cut)


def check_live(t: Target) -> tuple[bool, str]:
    status, _ = _request(t, "/health", timeout=min(t.timeout_s, 5))
    return status == 200, f"/health {status}"


def check_models(t: Target) -> tuple[bool, str]:
    status, body = _request(t, "/v1/models", timeout=min(t.timeout_s, 10))
    if status != 200:
        return False, f"/v1/models {status}"
    data = _json(body, "/v1/models")
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return False, f"/v1/models answered 200 without a data list: {_preview(body)}"
    ids = [m.get("id") for m in items if isinstance(m, dict)]
    if t.model in ids:
        return True, f"{t.model} listed"
    return False, f"{t.model} not in {ids}"


# What a warmup step may ask a sampled request for (the warmup plan's "sampling").
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


def sampling_of(step: dict[str, Any]) -> dict[str, float]:
    """A warmup step's sampling parameters, checked: numbers under known names only."""
    raw = step.get("sampling") or {}
    if not isinstance(raw, dict) or any(
        k not in SAMPLING_KEYS or isinstance(v, bool) or not isinstance(v, int | float)
        for k, v in raw.items()
    ):
        raise ProbeError(f"warmup step sampling {raw!r}: numbers for {', '.join(SAMPLING_KEYS)}")
    return dict(raw)


def complete(
    t: Target, prompt: str, max_tokens: int, sampling: dict[str, float] | None = None
) -> dict[str, Any]:
    """One chat completion: greedy (temperature 0), or sampled with `sampling`."""
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False},
        **(sampling or {}),
    }
    status, raw = _request(t, "/v1/chat/completions", body)
    if status != 200:
        raise ProbeError(f"chat completion {status}: {_preview(raw)}")
    result = _json(raw, "chat completion")
    if not isinstance(result, dict):
        raise ProbeError(f"chat completion answered 200, but not a JSON object: {_preview(raw)}")
    usage = result.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(n, int) or isinstance(n, bool):
        raise ProbeError(
            f"chat completion answered 200 without usage.completion_tokens: {_preview(raw)}"
        )
    return result


def check_serving(t: Target) -> tuple[bool, str]:
    n = complete(t, "Say OK.", 1)["usage"]["completion_tokens"]
    return n >= 1, f"1-token completion: {n} token(s)"


def server_identity(t: Target) -> str | None:
    """The API server's process start time from /metrics: changes on every restart."""
    status, body = _request(t, "/metrics", timeout=min(t.timeout_s, 10))
    if status != 200:
        return None
    m = re.search(rb"^process_start_time_seconds\s+(\S+)", body, re.M)
    return m.group(1).decode() if m else None


def marker_file(t: Target) -> Path:
    safe = re.sub(r"[^A-Za-z0-9]+", "_", t.url)
    return t.state_dir / f"vfleet-warm-{safe}.json"


# The state folder is the service user's, and under pm2 the deploy's readiness step runs this
# probe as root: the marker's name is never followed there (a link would make root read or
# overwrite its target), only a regular file of at most MARKER_MAX bytes is read. The same
# holds for the env file, which that user owns.
MARKER_MAX = 64 * 1024


def _read_small(path: Path) -> str:
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        raw = os.read(fd, MARKER_MAX + 1)
    finally:
        os.close(fd)
    if len(raw) > MARKER_MAX:
        raise ValueError(f"larger than {MARKER_MAX} bytes")
    return raw.decode("utf-8", errors="replace")


def _write_marker(path: Path, text: str) -> None:
    """Written beside under a new name (O_EXCL: never an existing file or link), then renamed
    over the marker's name, which replaces a link there rather than its target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        tmp = f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644, dir_fd=folder)
        try:
            data = text.encode("utf-8")
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(folder)


def check_warm(t: Target) -> tuple[bool, str]:
    ident = server_identity(t)
    marker = marker_file(t)
    if ident is None:
        return False, "no process_start_time_seconds in /metrics"
    if not os.path.lexists(marker):
        return False, "warmup has not run (vfleet-probe --warmup)"
    try:
        data = json.loads(_read_small(marker))
    except (OSError, ValueError) as exc:
        return False, f"{marker} unreadable ({exc}): run vfleet-probe --warmup again"
    if not isinstance(data, dict) or data.get("server") != ident:
        return False, "warmup ran against an earlier server process"
    return True, f"warmup ran {data.get('requests')} requests in {data.get('seconds')} s"


# One filler unit; its token count is measured with vLLM's /tokenize (the tokenizer is not here).
FILLER = "The quick brown fox jumps over the lazy dog. "


def tokens_per_filler(t: Target) -> float:
    """Tokens per FILLER unit for this model; a safe overestimate if /tokenize is missing."""
    try:
        status, raw = _request(t, "/tokenize", {"model": t.model, "prompt": FILLER * 20})
        data = json.loads(raw) if status == 200 else None
        count = data.get("count") if isinstance(data, dict) else None
    except (ProbeError, ValueError):
        count = None
    return count / 20 if isinstance(count, int) and count > 0 else 20.0


def warmup_prompt(tokens: int, per_filler: float, salt: int) -> str:
    # A salt first: each request is new to the prefix cache, so its prefill really runs.
    units = max(1, int(tokens / per_filler))
    return f"[{salt}] " + FILLER * units


def run_warmup(t: Target, progress: bool = True) -> tuple[bool, str]:
    from concurrent.futures import ThreadPoolExecutor

    start = time.monotonic()
    per_filler = tokens_per_filler(t)
    n = 0
    for i, step in enumerate(t.warmup_steps, 1):
        width = int(step.get("concurrency", 1))
        prompt_tokens = int(step.get("prompt_tokens", 8))
        max_tokens = int(step.get("max_tokens", 8))
        prompts = [warmup_prompt(prompt_tokens, per_filler, n + j) for j in range(width)]
        # The first `sampled` requests sample (the sampler's other path), the rest are greedy.
        sampling = sampling_of(step)
        kinds = [sampling if j < int(step.get("sampled", 0)) else None for j in range(width)]
        with ThreadPoolExecutor(max_workers=width) as pool:
            # list() re-raises the first failure: a warmup that cannot run is not warm.
            list(pool.map(complete, [t] * width, prompts, [max_tokens] * width, kinds))
        n += width
        if progress:
            why = step.get("why", f"{width} x {prompt_tokens} tokens")
            print(f"warmup {i}/{len(t.warmup_steps)}: {why}", file=sys.stderr)
    ident = server_identity(t)
    seconds = round(time.monotonic() - start, 2)
    _write_marker(marker_file(t), json.dumps({"server": ident, "requests": n, "seconds": seconds}))
    return True, f"{n} requests in {seconds} s"


CHECKS = {"live": check_live, "models": check_models, "serving": check_serving, "warm": check_warm}


def probe(t: Target, upto: str) -> dict[str, TierResult]:
    """Run tiers in order up to `upto`; stop at the first failure (later tiers: not run)."""
    results: dict[str, TierResult] = {}
    for tier in TIERS[: TIERS.index(upto) + 1]:
        res = _timed(CHECKS[tier], t)
        results[tier] = res
        if not res.ok:
            break
    return results


def load_target(a: argparse.Namespace) -> Target:
    conf: dict[str, Any] = {}
    if a.config:
        try:
            conf = json.loads(Path(a.config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SystemExit(_usage_error(f"{a.config}: {exc}")) from None
        if not isinstance(conf, dict):
            raise SystemExit(_usage_error(f"{a.config}: expected a JSON object"))
    url = a.url or conf.get("url")
    model = a.model or conf.get("served_model_name")
    if not url or not model:
        raise SystemExit(_usage_error("need --url and --model, or --config probe.json"))
    key = os.environ.get("VLLM_API_KEY")
    env_file = a.env_file or conf.get("env_file")
    if key is None and env_file and Path(env_file).exists():
        try:
            key = read_env_file(Path(env_file)).get("VLLM_API_KEY")
        except (OSError, ValueError):
            key = None
    warm = conf.get("warmup", {})
    return Target(
        url=url,
        model=model,
        api_key=key,
        timeout_s=a.timeout or float(conf.get("serving_timeout_s", 60)),
        warmup_steps=list(warm["steps"]) if warm.get("steps") else Target(url, model).warmup_steps,
        state_dir=Path(conf["state_dir"]) if conf.get("state_dir") else Target.state_dir,
    )


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


def _gpu_memory_used_mib(visible: str | None) -> dict[str, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    used = {i.strip(): int(m) for i, m in (line.split(",") for line in out.strip().splitlines())}
    if visible:
        wanted = [v.strip() for v in visible.split(",")]
        return {i: m for i, m in used.items() if i in wanted}
    return used


def check_prereqs(conf: dict[str, Any]) -> list[tuple[bool, str]]:
    """What must hold before vLLM starts (systemd ExecStartPre): each (ok, detail with fix)."""
    pre = conf.get("prereqs") or {}
    results: list[tuple[bool, str]] = []
    model_dir = Path(pre.get("model_dir", ""))
    cfg = model_dir / "config.json"
    readable = os.access(cfg, os.R_OK)
    results.append(
        (True, f"model {cfg} readable")
        if readable
        else (False, f"model {cfg} missing or unreadable: put the weights there or fix model_dir")
    )
    for d in pre.get("writable", []):
        try:
            Path(d).mkdir(parents=True, exist_ok=True)
            ok = os.access(d, os.W_OK)
        except OSError:
            ok = False
        results.append((ok, f"{d} writable" if ok else f"{d} not writable: fix its owner/mode"))
    host, port = pre.get("host", "127.0.0.1"), pre.get("port")
    if port:
        busy = _port_in_use(host, int(port))
        results.append(
            (False, f"port {port} already in use: stop what listens there or change port")
            if busy
            else (True, f"port {port} free")
        )
    if pre.get("gpus"):
        try:
            env = read_env_file(Path(conf["env_file"])) if conf.get("env_file") else {}
        except (OSError, ValueError) as exc:
            env = {}
            results.append((False, f"env file {conf['env_file']}: {exc}: deploy again"))
        limit = int(pre.get("gpu_free_mib", 1024))
        try:
            used = _gpu_memory_used_mib(env.get("CUDA_VISIBLE_DEVICES"))
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            results.append((False, f"nvidia-smi failed ({exc}): check the driver"))
        else:
            held = {i: m for i, m in used.items() if m > limit}
            results.append(
                (
                    False,
                    f"GPU memory still held (MiB by GPU {held}): a previous vLLM or its "
                    "TP workers survive; find them with nvidia-smi and stop them",
                )
                if held
                else (True, f"GPU memory free on {sorted(used)}")
            )
    return results


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone: it only waits to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except OSError:
        return True
    return "\nState:\tZ" not in status


def _seconds(zero: bool) -> Any:
    """An argparse type: a finite number of seconds, above 0 (or at least 0 when ``zero``)."""

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            low = "0 or more" if zero else "more than 0"
            raise argparse.ArgumentTypeError(f"expected {low} seconds, got {text!r}")
        return value

    return convert


def _usage_error(msg: str) -> int:
    print(f"vfleet-probe: error: {msg}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vfleet-probe",
        description="Probe a vLLM server tier by tier: live (/health), models (/v1/models "
        "lists the served name), serving (a real 1-token completion), warm (the warmup set "
        "ran against this server process).",
        epilog="exit: 0 all requested tiers ok, 1 a tier failed (no answer within --timeout, "
        "an HTTP error, or an answer that is not what vLLM sends, e.g. HTML from a proxy), "
        "2 bad usage",
    )
    ap.add_argument("--config", help="probe.json rendered next to the instance's vLLM config")
    ap.add_argument("--url", help="server base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", help="served model name expected in /v1/models")
    ap.add_argument("--env-file", help="env file holding VLLM_API_KEY (default: from --config)")
    ap.add_argument(
        "--tier",
        choices=TIERS,
        default="serving",
        help="check tiers up to this one (default: %(default)s)",
    )
    ap.add_argument(
        "--warmup",
        action="store_true",
        help="run the warmup set once the server serves, then check 'warm'",
    )
    ap.add_argument(
        "--wait",
        type=_seconds(zero=True),
        default=0,
        metavar="SECONDS",
        help="retry until the tiers pass or SECONDS have passed; a request still running then "
        "is cut (the warmup that follows a pass is not: each of its requests has --timeout)",
    )
    ap.add_argument(
        "--interval", type=_seconds(zero=True), default=2.0, help="seconds between retries"
    )
    ap.add_argument(
        "--pid",
        type=int,
        help="stop waiting as soon as this process (the server) exits: systemd's $MAINPID in "
        "ExecStartPost, so a crash at start fails the start at once, not at the timeout",
    )
    ap.add_argument(
        "--timeout",
        type=_seconds(zero=False),
        help="seconds for each request as a whole (connect and the whole answer), however "
        "slowly the server sends it (default: serving_timeout_s from --config, else 60; "
        "/health gets at most 5 s, /v1/models 10 s)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--prereqs",
        action="store_true",
        help="check what must hold before vLLM starts (model readable, caches writable, port "
        "free, GPU memory free) and exit; needs --config",
    )
    a = ap.parse_args(argv)
    if a.prereqs:
        if not a.config:
            return _usage_error("--prereqs needs --config probe.json")
        try:
            conf = json.loads(Path(a.config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return _usage_error(f"{a.config}: {exc}")
        if not isinstance(conf, dict):
            return _usage_error(f"{a.config}: expected a JSON object")
        checks = check_prereqs(conf)
        for ok, detail in checks:
            print(f"{'ok' if ok else 'FAIL':<5} {detail}", file=sys.stdout if ok else sys.stderr)
        return 0 if all(ok for ok, _ in checks) else 1
    t = load_target(a)
    upto = "warm" if a.warmup else a.tier
    deadline = time.monotonic() + a.wait
    if a.wait > 0:
        t.until = deadline
    attempt = 0
    previous: dict[str, TierResult] | None = None
    while True:
        attempt += 1
        results = probe(t, "serving" if a.warmup else upto)
        ok = (
            all(r.ok for r in results.values())
            and len(results) == TIERS.index("serving" if a.warmup else upto) + 1
        )
        if previous is not None and any(r.cut for r in results.values()):
            results = previous  # the end of --wait cut this attempt: report the server's answer
        previous = results
        if ok and a.warmup:
            t.until = math.inf  # the server serves: the warmup is not waiting
            try:
                run_warmup(t, progress=not a.json)
            except ProbeError as exc:
                results["warm"] = TierResult(False, f"warmup failed: {exc}", 0)
                ok = False
            else:
                results["warm"] = _timed(check_warm, t)
                ok = results["warm"].ok
        if ok or time.monotonic() >= deadline:
            break
        if a.pid is not None and not process_alive(a.pid):
            results.setdefault("live", TierResult(False, f"server process {a.pid} exited", 0))
            print(f"server process {a.pid} exited: not waiting any longer", file=sys.stderr)
            break
        if not a.json:
            failed = next((f"{k}: {r.detail}" for k, r in results.items() if not r.ok), "")
            print(f"waiting for {t.url} ({attempt}, {failed})", file=sys.stderr)
        time.sleep(min(a.interval, max(0.0, deadline - time.monotonic())))
        if time.monotonic() >= deadline:
            break  # an attempt now would be cut at once: report the last one
    report = {
        "ok": ok,
        "url": t.url,
        "model": t.model,
        "tiers": {k: r.as_dict() for k, r in results.items()},
    }
    if a.json:
        print(json.dumps(report))
    else:
        for k in TIERS:
            if k in results:
                r = results[k]
                print(f"{k:<8} {'ok' if r.ok else 'FAIL':<5} {r.ms:>6} ms  {r.detail}")
            else:
                print(f"{k:<8} {'-':<5} {'':>6}     not checked")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
