"""`vfleet status`: the sidecar's derived figures for vLLM servers, in a terminal.

For operators without Prometheus. Each target's `/metrics` is read twice, `--interval` seconds
apart, into the sidecar's own `Window` (vfleet_healthcheck): same parser, same metric-name
table per vLLM version, same formulas, so the figures are the ones `vfleet-exporter` exports.
A figure that cannot be computed prints as `-` (JSON null), never as 0.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import json
import math
import re
import shlex
import subprocess
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vfleet.config.profiles import find_baseline
from vfleet.config.schema import DEFAULT_INSTANCE, HostVars
from vfleet.errors import VfleetError
from vfleet.fleet.inventory import (
    become,
    host_namespace,
    host_plan,
    host_vars,
    hosts_of,
    inventory_arg,
    is_local,
    ssh_argv,
)
from vfleet.fleet.targets import endpoint

_IMPORT_ERROR: ImportError | None = None
try:
    from vfleet_healthcheck import switch_record
    from vfleet_healthcheck.depth import StepCost, StepTimesSource, advise
    from vfleet_healthcheck.exporter import SCALARS, Identity, UpstreamError, fetch
    from vfleet_healthcheck.vllm_metrics import (
        DEFAULT_VERSION,
        NOTES,
        UnsupportedVersion,
        families,
        parse,
        table_version,
    )
    from vfleet_healthcheck.window import Figures, Window
except ImportError as exc:  # `make venv` installs it; a bare `pip install vfleet` does not
    _IMPORT_ERROR = exc


TARGET_FIX = "pass a vLLM base URL such as http://127.0.0.1:8000, or HOST:PORT such as :8000"
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]*):(\d{1,5})$")

DESCRIPTION = """\
Show what vLLM servers are doing now: the figures the vfleet sidecar exports to Prometheus,
computed the same way, for operators without Prometheus. Each target's /metrics is read twice,
--interval seconds apart; rates and ratios come from the counter deltas between the two reads.
Targets are read concurrently; a down target does not stop the others.

TARGET is a vLLM base URL (http://127.0.0.1:8000), or HOST:PORT (127.0.0.1:8000, :8000 for
localhost). Without TARGET, the instances deployed on this host are read: every
BASE_DIR/instances/*/current/sidecar.json names its vLLM URL, model, versions and release.
With --hosts and -i, each inventory host's instance is read the same way over ssh (its vLLM
through an ssh tunnel when it listens on the host's loopback): per host, model, release and
since when it serves.
"""

EPILOG = """\
the table has one column per target and one row per figure; `-` means the figure cannot be
computed from this interval (no traffic, no speculative decoding), JSON null:
  url                       vLLM base URL read
  state                     up, or down and why: connect (refused / unreachable), timeout,
                            http_<code>, truncated, too_large, protocol (not HTTP),
                            parse (no vLLM metrics in the answer),
                            unsupported_version (older than the metric-name table)
  model                     served model name (from sidecar.json, else vLLM's /v1/models)
  vLLM                      vLLM version (vLLM's /version, else sidecar.json); selects the
                            metric-name table
  release                   deployed release id (the folder `current` points to)
  release since (UTC)       when `current` was switched to it (deploy, swap or rollback)
  started (UTC), uptime     when the vLLM process started (process_start_time_seconds)
  requests running/waiting  requests in the engine / queued for it (second read)
  KV cache usage (%)        KV cache blocks in use (second read)
  decode (tok/s)            generated tokens per second, all requests together
  tokens/step               generated tokens per engine step (raised by accepted drafts)
  steps/s                   engine steps per second; decode = tokens/step x steps/s
  step (ms)                 the live decode step: inter-token latency sum / count
  step floor (ms)           the running depth's step at the card's memory bandwidth: the
                            bytes it reads per GPU (sidecar.json decode_cost; vfleet plan's
                            decode line) / the bandwidth
  floor / step (%)          how much of the step the card's bandwidth explains
  per-stream decode (tok/s) what one request sees: its tokens after the first / the time
                            between them
  acceptance (%)            accepted draft tokens / proposed draft tokens (MTP, ngram, ...)
  mean acceptance length    1 + accepted draft tokens / drafts: tokens per verify step
  accepted at pos N (%)     drafts whose token at position N was accepted / drafts
  MTP depth running         num_speculative_tokens the instance runs (sidecar.json; else
                            the positions vLLM reports)
  MTP depth recommended     the depth of the step-time table (vfleet tune) with the highest
                            expected tok/s: (1 + sum of the per-position acceptance, positions
                            beyond the running depth from tune's measured acceptance) / seconds
                            per step; "N (modelled)" where no table exists and the decode
                            cost model gives the step times from the live step; "- (why)"
                            without one: no_step_times, bad_step_times, no_drafts (no traffic),
                            speculation_off (docs/TUNE.md, Recommended depth)
  expected gain (%)         expected tok/s at the recommended depth / at the running one - 1
  TTFT p50/p95 (ms)         time to first token, of the first tokens sent in the interval
  ITL p50/p95 (ms)          inter-token latency: one engine step as a request sees it
  window (s)                time between the two reads
  last switch               the last `vfleet switch` the instance took part in (its
                            last-switch.json, as the sidecar exports it): outcome, the step or
                            gate it failed at, seconds from the flip to the last gate, how long
                            ago, and which way (FROM -> TO); `-` for none or a URL target

exit status: 0 all targets up, 1 any target down, 2 bad input (a bad TARGET, no instance).

examples:
  vfleet status                              # every instance deployed on this host
  vfleet status --base-dir ~/.local/share/vfleet
  vfleet status http://127.0.0.1:8000 gpu-box-2:8000 --interval 10
  vfleet status :8000 --json | jq '.[0].spec_decode_acceptance_rate'
  vfleet status :8000 --explain              # which vLLM series each figure comes from
  vfleet status --hosts gpu_2080ti -i ansible/inventory/example-fleet   # per host, over ssh
"""


# --------------------------------------------------------------------------- targets


@dataclass
class Target:
    url: str  # base URL, no trailing slash
    name: str  # column header: the instance, else host:port
    instance: str | None = None
    labels: dict[str, str] = field(default_factory=dict)  # sidecar.json identity labels
    info: dict[str, str] = field(default_factory=dict)  # versions, release
    since: float | None = None  # when `current` was last switched (a deploy or rollback)
    error: str | None = None  # the host could not be asked (ssh), so nothing was read
    spec_depth: int | None = None  # sidecar.json: the rendered num_speculative_tokens
    step_times: str | None = None  # the MTP step-time table, where readable from here
    decode_cost: StepCost | None = None  # sidecar.json decode_cost: floors, modelled depths
    decode_cost_problem: str = ""  # why sidecar.json's decode_cost was not used
    switch: switch_record.SwitchRecord | None = None  # its last-switch.json, where read
    switch_error: str | None = None  # why that file was not used


def base_url(text: str) -> str:
    """A TARGET as a vLLM base URL. Raises ValueError saying what is wrong."""
    if "://" in text:
        parts = urllib.parse.urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL with a host: {text!r}")
        try:
            parts.port  # noqa: B018 - validates the port
        except ValueError:
            raise ValueError(f"bad port in {text!r}") from None
        if parts.query or parts.fragment:
            raise ValueError(f"a base URL has no query or fragment: {text!r}")
        path = parts.path.rstrip("/")
        path = path.removesuffix("/metrics")  # a pasted metrics URL means its server
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
    m = _HOST_PORT.match(text)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"not a URL or HOST:PORT: {text!r}")
    return f"http://{m.group(1) or '127.0.0.1'}:{int(m.group(2))}"


def _url_target(text: str) -> Target:
    try:
        url = base_url(text)
    except ValueError as exc:
        raise VfleetError(str(exc), key="TARGET", fix=TARGET_FIX) from None
    parts = urllib.parse.urlsplit(url)
    return Target(url, parts.netloc + parts.path)


def discover(base_dir: Path, *, strict: bool) -> list[Target]:
    """The instances deployed under ``base_dir``, from their current sidecar.json.

    ``strict``: a sidecar.json that cannot be read is an error (else it is skipped: when the
    operator named URLs, a broken unrelated instance must not stop them).
    """
    root = base_dir / "instances"
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    except OSError as exc:
        if strict:
            raise VfleetError(f"cannot list it: {exc}", where=str(root)) from None
        return []
    out: list[Target] = []
    for folder in folders:
        path = folder / "current" / "sidecar.json"
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            url = base_url(str(data["vllm_url"]))
            identity = Identity.from_file(path)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            if not strict:
                continue
            raise VfleetError(
                f"cannot read it: {exc!s}",
                where=str(path),
                fix="redeploy the instance, or pass its vLLM URL as TARGET",
            ) from None
        # Identity names the release only under releases/; a hand-made `current` still has one.
        identity.info.setdefault("release", path.resolve().parent.name)
        since = (folder / "current").lstat().st_mtime
        times = str(identity.step_times) if identity.step_times else None
        target = Target(
            url,
            folder.name,
            folder.name,
            identity.labels,
            identity.info,
            since,
            spec_depth=identity.spec_depth,
            step_times=times,
            decode_cost=identity.decode_cost,
            decode_cost_problem=identity.decode_cost_problem,
        )
        try:  # the sidecar's reader: bounded, no link, checked fields
            target.switch = switch_record.read(folder / switch_record.FILENAME)
        except (OSError, ValueError) as exc:
            target.switch_error = str(exc)
        out.append(target)
    return out


# `current` (a symlink) is replaced when a deploy or rollback switches release: its own mtime
# says since when the release serves. Then the instance's last-switch.json on one line (base64;
# empty without one): a regular file and not a link, read bounded (it may run as root), checked
# here by the sidecar's own parser. One ssh round trip per host.
_REMOTE_READ = (
    'readlink "$1" && stat -c %Y "$1" && '
    '{ if [ -f "$2" ] && [ ! -L "$2" ]; then head -c '
    + str(switch_record.MAX_BYTES + 1 if _IMPORT_ERROR is None else 1)
    + ' "$2" | base64 -w0; fi; echo; } && cat "$1/sidecar.json"'
)


def _remote_switch(line: str, target: Target) -> None:
    """The base64 line of _REMOTE_READ into ``target``'s record (or why it is not used)."""
    if not line.strip():
        return
    try:
        text = base64.b64decode(line.strip(), validate=True)
        if len(text) > switch_record.MAX_BYTES:
            raise ValueError(f"larger than {switch_record.MAX_BYTES} bytes")
        target.switch = switch_record.SwitchRecord.from_json(text.decode("utf-8"))
    except (ValueError, binascii.Error) as exc:  # UnicodeDecodeError is a ValueError
        target.switch_error = f"{switch_record.FILENAME}: {exc}"


def inventory_targets(
    inventory: str, pattern: str, instance: str | None, tunnels: list[subprocess.Popen[bytes]]
) -> list[Target]:
    """Each inventory host's instance as a target: its release and since when, read over ssh,
    and its vLLM through an ssh tunnel where it listens on the host's loopback. Tunnels go into
    ``tunnels`` as they open, so that the caller closes them even when a later host fails."""

    targets: list[Target] = []
    for host in hosts_of(inventory, pattern):
        hv = host_vars(inventory, host)
        plan, _ = host_plan(host_namespace(inventory, host, None, instance), hv)
        current = plan.dirs.current
        name = host if plan.instance == DEFAULT_INSTANCE else f"{host}/{plan.instance}"
        record = f"{plan.dirs.instance}/{switch_record.FILENAME}"
        argv = [*become(hv, host), "sh", "-c", _REMOTE_READ, "sh", current, record]
        if not is_local(hv, host):
            argv = [*ssh_argv(host, hv), shlex.join(argv)]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
            lines = r.stdout.split("\n", 3)
            if r.returncode != 0 or len(lines) < 4:
                raise ValueError((r.stderr.strip() or r.stdout.strip())[-300:] or "no output")
            data = json.loads(lines[3])
            labels = {str(k): str(v) for k, v in data.get("labels", {}).items()}
            info = {str(k): str(v) for k, v in data.get("info", {}).items()}
            info.setdefault("release", Path(lines[0].strip()).name)
            url, tunnel, _how = endpoint(host, hv, plan.service)
        except (OSError, ValueError, subprocess.TimeoutExpired, VfleetError) as exc:
            why = f"cannot read {current} on {host}: {exc}"
            targets.append(Target(f"ssh://{host}", name, plan.instance, error=why))
            continue
        if tunnel is not None:
            tunnels.append(tunnel)
        since = float(lines[1])
        spec = data.get("spec_decode")
        depth = spec.get("depth") if isinstance(spec, dict) else None
        target = Target(
            url,
            name,
            plan.instance,
            labels,
            info,
            since,
            # The step-time table stays on the host: --step-times names a local copy.
            spec_depth=depth if isinstance(depth, int) else None,
        )
        _remote_switch(lines[2], target)
        targets.append(target)
    return targets


def resolve_targets(texts: list[str], base_dir: Path) -> list[Target]:
    if not texts:
        found = discover(base_dir, strict=True)
        if not found:
            raise VfleetError(
                "no vLLM instance found (no instances/*/current/sidecar.json)",
                where=str(base_dir),
                fix="pass the vLLM URL, e.g. `vfleet status http://127.0.0.1:8000`, or "
                "--base-dir DIR where vfleet deployed (make deploy: ~/.local/share/vfleet "
                "when not root)",
            )
        return found
    # A URL that a local instance serves gets that instance's name, model and release.
    known = {t.url: t for t in discover(base_dir, strict=False)}
    out: list[Target] = []
    for text in texts:
        target = _url_target(text)
        target = known.get(target.url, target)
        if target.url not in (t.url for t in out):
            out.append(target)
    return out


# --------------------------------------------------------------------------- reading


@dataclass
class Reading:
    target: Target
    up: bool = False
    reason: str | None = None  # UpstreamError.reason (or unsupported_version) when down
    error: str | None = None
    model_name: str | None = None
    vllm_version: str | None = None
    metrics_table: str | None = None
    started: float | None = None  # vLLM's process_start_time_seconds
    figures: Figures | None = None
    warnings: list[str] = field(default_factory=list)


def _get_json(url: str, timeout: float) -> Any:
    try:
        return json.loads(fetch(url, timeout))
    except (UpstreamError, ValueError):
        return None


def _version(url: str, timeout: float) -> str | None:
    data = _get_json(url + "/version", timeout)
    version = data.get("version") if isinstance(data, dict) else None
    return version if isinstance(version, str) and version else None


def _models(url: str, timeout: float) -> str | None:
    data = _get_json(url + "/v1/models", timeout)
    items = data.get("data") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return None  # e.g. 401: /v1 needs vLLM's API key
    ids = [str(m["id"]) for m in items if isinstance(m, dict) and "id" in m]
    return ", ".join(ids) or None


def read(target: Target, interval: float, timeout: float) -> Reading:
    """Read one target twice, ``interval`` seconds apart. Never raises."""
    r = Reading(target, model_name=target.labels.get("model_name"))
    if target.error is not None:
        r.reason, r.error = "ssh", target.error
        return r
    metrics = target.url + "/metrics"
    try:
        first = fetch(metrics, timeout)
        t1 = time.monotonic()
        # Asked while the interval runs: the version selects the names to parse.
        r.vllm_version = _version(target.url, timeout) or target.info.get("vllm_version")
        if r.model_name is None:
            r.model_name = _models(target.url, timeout)
        time.sleep(max(0.0, t1 + interval - time.monotonic()))
        second = fetch(metrics, timeout)
        t2 = time.monotonic()
    except UpstreamError as exc:
        r.reason, r.error = exc.reason, str(exc)
        return r
    if r.vllm_version is None:
        r.warnings.append(f"vLLM version unknown (no /version): metric names of {DEFAULT_VERSION}")
    try:
        table = families(r.vllm_version or DEFAULT_VERSION)
        r.metrics_table = table_version(r.vllm_version or DEFAULT_VERSION)
    except UnsupportedVersion as exc:
        r.reason, r.error = "unsupported_version", str(exc)
        return r
    # Both samples count, however long the reads took.
    window = Window(math.inf, table)
    for t, text in ((t1, first), (t2, second)):
        if not text.endswith("\n"):
            # As the exporter does: a body cut inside a line is not used at all.
            r.reason, r.error = "truncated", f"{metrics} ended inside a line"
            return r
        parsed = parse(text, table)
        if not parsed.values:
            r.reason, r.error = "parse", f"{metrics} returned no vLLM metrics"
            return r
        for logical, why in sorted(parsed.bad.items()):
            r.warnings.append(f"skipped {logical}: {why}")
        if window.add(t, parsed):
            r.warnings.append("vLLM restarted between the two reads")
    r.up = True
    r.figures = window.figures()
    r.started = window.samples[-1].values.get("process_start_time")
    return r


def read_all(targets: list[Target], interval: float, timeout: float) -> list[Reading]:
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return list(pool.map(lambda t: read(t, interval, timeout), targets))


# --------------------------------------------------------------------------- output

QUANTILES = {"p50": 0.5, "p95": 0.95}


def as_json(r: Reading, now: float) -> dict[str, Any]:
    """One target's figures under machine-friendly names (the sidecar's, without `vfleet_`)."""
    f = r.figures if r.figures is not None else Figures()
    uptime = now - r.started if r.started is not None else None
    out: dict[str, Any] = {
        "target": r.target.name,
        "url": r.target.url,
        "instance": r.target.instance,
        "up": r.up,
        "reason": r.reason,
        "error": r.error,
        "model_name": r.model_name,
        "vllm_version": r.vllm_version,
        "metrics_table": r.metrics_table,
        "release": r.target.info.get("release"),
        "release_since": _iso(r.target.since),
        "started_at": _iso(r.started),
        # A negative age means the clocks disagree: unknowable, not 0.
        "uptime_seconds": uptime if uptime is not None and uptime >= 0 else None,
        "window_seconds": f.window_seconds,
    }
    for key in SCALARS:
        out[key] = f.scalars.get(key)
    out["spec_decode_position_acceptance_rate"] = (
        {p: f.positions[p] for p in sorted(f.positions, key=int)} if f.positions else None
    )
    for hist in ("ttft", "itl"):
        for name, q in QUANTILES.items():
            out[f"{hist}_{name}_seconds"] = f.quantiles.get(hist, {}).get(q)
    out["baseline_decode_tokens_per_second"] = _baseline_decode(r.target)
    out.update(_depth(r, f))
    out["last_switch"] = _last_switch(r.target.switch)
    if r.target.switch_error:
        r.warnings.append(f"last switch unknown: {r.target.switch_error}")
    out["warnings"] = r.warnings
    return out


def _last_switch(rec: switch_record.SwitchRecord | None) -> dict[str, Any] | None:
    """The instance's last switch as its sidecar exports it (vfleet_switch_*)."""
    if rec is None:
        return None
    return {
        "role": rec.role,
        "from": rec.frm,
        "to": rec.to,
        "outcome": rec.outcome,
        "failed_at": rec.failed_at,
        "seconds": rec.seconds,
        "first_token_seconds": rec.first_token_s,
        "ended_at": _iso(rec.ended_at),
        "ended_at_unix": rec.ended_at,
        "switches": {role: dict(by) for role, by in rec.counts.items()},
    }


def _switch_cell(o: dict[str, Any], now: float) -> str:
    last = o.get("last_switch")
    if last is None:
        return "-"
    text = switch_record.OUTCOMES[last["outcome"]]
    if last["failed_at"] != switch_record.NO_FAILURE:
        text += f" at {last['failed_at']}"
    age = now - last["ended_at_unix"]
    ago = f", {_age(age)} ago" if age >= 0 else ""
    return f"{text} {last['seconds']:.2f} s{ago} ({last['from']} -> {last['to']})"


def _depth(r: Reading, f: Figures) -> dict[str, Any]:
    """The sidecar's MTP depth recommendation, computed the same way (vfleet_healthcheck.depth)."""
    out: dict[str, Any] = {
        "decode_step_floor_seconds": None,
        "decode_floor_ratio": None,
        "spec_decode_running_depth": r.target.spec_depth,
        "spec_decode_recommendation_state": None,
        "spec_decode_recommended_depth": None,
        "spec_decode_recommended_gain_ratio": None,
        "spec_decode_expected_tokens_per_second": None,
    }
    if not r.up:
        return out
    step = f.scalars.get("decode_step_seconds")
    cost = r.target.decode_cost
    if r.target.decode_cost_problem:
        r.warnings.append(f"no decode cost model: {r.target.decode_cost_problem}")
    running = max(1, round(f.scalars.get("requests_running", 1.0)))
    source = StepTimesSource(r.target.step_times)
    advice = advise(f.positions, r.target.spec_depth, source, step, cost, running)
    if cost is not None and advice.running_depth is not None:
        floor = cost.floor_s(advice.running_depth)
        out["decode_step_floor_seconds"] = floor
        out["decode_floor_ratio"] = floor / step if step else None
    out["spec_decode_running_depth"] = advice.running_depth
    out["spec_decode_recommendation_state"] = advice.state
    if advice.state == "bad_step_times":  # a missing table is normal: the state row says so
        r.warnings.append(f"no depth recommendation: {advice.detail}")
    rec = advice.recommendation
    if rec is not None:
        out["spec_decode_recommended_depth"] = rec.recommended_depth
        out["spec_decode_recommended_gain_ratio"] = rec.gain
        out["spec_decode_expected_tokens_per_second"] = {
            str(e.depth): e.tokens_per_second for e in rec.estimates
        }
    return out


def _recommended(o: dict[str, Any]) -> str:
    depth = o.get("spec_decode_recommended_depth")
    state = o.get("spec_decode_recommendation_state")
    if depth is not None:
        return f"{depth} (modelled)" if state == "modelled" else str(depth)
    return "-" if state in (None, "ok") else f"- ({state})"


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def _baseline_decode(target: Target) -> dict[str, Any] | None:
    """The decode speed normal for this deployment (profiles/baselines/), if measured."""

    profile, preset = target.labels.get("profile"), target.labels.get("preset")
    if not profile or not preset:
        return None
    try:
        found = find_baseline(profile, preset, target.info.get("stack"))
    except VfleetError:  # a broken baseline file must not hide the live figures
        return None
    if found is None or found[1].decode_tokens_per_second is None:
        return None
    d = found[1].decode_tokens_per_second
    return {"low": d.low, "high": d.high, "source": found[1].source}


def _expected(v: dict[str, Any] | None) -> str:
    if v is None:
        return "-"
    return f"{v['low']:g}" + (f"-{v['high']:g}" if v.get("high") is not None else "")


Format = Callable[[Any], str]


def _num(fmt: str, scale: float = 1.0) -> Format:
    return lambda v: "-" if v is None else format(v * scale, fmt)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m}m"
    return f"{m}m {s % 60}s" if m else f"{s}s"


def _text(v: Any) -> str:
    return "-" if v is None else str(v)


def _state(o: dict[str, Any]) -> str:
    return "up" if o["up"] else f"down: {o['reason']}"


def _engine(o: dict[str, Any]) -> str:
    """vLLM's sleep state: a resident standby (docs/SWAP.md) reads "asleep (level N)"."""
    awake = o.get("engine_awake")
    if awake is None:
        return "-"
    level = o.get("engine_sleep_level")
    return "awake" if awake else f"asleep (level {'-' if level is None else f'{level:.0f}'})"


def _started(v: str | None) -> str:
    return "-" if v is None else v.replace("T", " ").removesuffix("+00:00")


# (row label with unit, JSON key, formatter); the state and position rows are built in table().
ROWS: list[tuple[str, str, Format | None]] = [
    ("url", "url", _text),
    ("state", "up", None),
    ("engine", "engine_awake", None),
    ("model", "model_name", _text),
    ("vLLM", "vllm_version", _text),
    ("release", "release", _text),
    ("release since (UTC)", "release_since", _started),
    ("started (UTC)", "started_at", _started),
    ("uptime", "uptime_seconds", _age),
    ("requests running", "requests_running", _num(".0f")),
    ("requests waiting", "requests_waiting", _num(".0f")),
    ("KV cache usage (%)", "kv_cache_usage_ratio", _num(".1f", 100)),
    ("decode (tok/s)", "decode_tokens_per_second", _num(".1f")),
    ("tokens/step", "tokens_per_step", _num(".2f")),
    ("steps/s", "steps_per_second", _num(".1f")),
    ("step (ms)", "decode_step_seconds", _num(".2f", 1000)),
    ("step floor (ms)", "decode_step_floor_seconds", _num(".2f", 1000)),
    ("floor / step (%)", "decode_floor_ratio", _num(".0f", 100)),
    ("per-stream decode (tok/s)", "stream_decode_tokens_per_second", _num(".1f")),
    ("baseline decode (tok/s)", "baseline_decode_tokens_per_second", _expected),
    ("acceptance (%)", "spec_decode_acceptance_rate", _num(".1f", 100)),
    ("mean acceptance length", "spec_decode_mean_acceptance_length", _num(".2f")),
    ("", "spec_decode_position_acceptance_rate", None),
    ("MTP depth running", "spec_decode_running_depth", _num(".0f")),
    ("MTP depth recommended", "spec_decode_recommended_depth", None),
    ("expected gain (%)", "spec_decode_recommended_gain_ratio", _num(".1f", 100)),
    ("TTFT p50 (ms)", "ttft_p50_seconds", _num(".1f", 1000)),
    ("TTFT p95 (ms)", "ttft_p95_seconds", _num(".1f", 1000)),
    ("ITL p50 (ms)", "itl_p50_seconds", _num(".1f", 1000)),
    ("ITL p95 (ms)", "itl_p95_seconds", _num(".1f", 1000)),
    ("window (s)", "window_seconds", _num(".2f")),
    ("last switch", "last_switch", None),
]


def table(objs: list[dict[str, Any]], now: float | None = None) -> str:
    """One column per target, one row per figure; values right-aligned."""
    now = time.time() if now is None else now
    rows: list[list[str]] = [["", *(o["target"] for o in objs)]]
    pct = _num(".1f", 100)
    for label, key, fmt in ROWS:
        if key == "up":
            rows.append([label, *(_state(o) for o in objs)])
        elif key == "engine_awake":
            rows.append([label, *(_engine(o) for o in objs)])
        elif key == "spec_decode_recommended_depth":
            rows.append([label, *(_recommended(o) for o in objs)])
        elif key == "last_switch":
            rows.append([label, *(_switch_cell(o, now) for o in objs)])
        elif key == "spec_decode_position_acceptance_rate":
            positions = sorted({p for o in objs for p in (o[key] or {})}, key=int)
            for p in positions:
                cells = [pct((o[key] or {}).get(p)) for o in objs]
                rows.append([f"accepted at pos {p} (%)", *cells])
        elif fmt is not None:
            rows.append([label, *(fmt(o[key]) for o in objs)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            [
                row[0].ljust(widths[0]),
                *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)),
            ]
        )
        for row in rows
    ]
    for o in objs:
        if o["error"]:
            lines.append(f"{o['target']}: {o['error']}")
        lines.extend(f"{o['target']}: warning: {w}" for w in o["warnings"])
    return "\n".join(line.rstrip() for line in lines)


def explain(objs: list[dict[str, Any]]) -> str:
    """Which vLLM series each figure comes from, per metric-name table in use."""
    out: list[str] = []
    for version in sorted({o["metrics_table"] for o in objs if o["metrics_table"]}):
        fam = {k: f.name for k, f in families(version).items()}
        gen, steps = fam["generation_tokens"], fam["iteration_tokens"] + "_count"
        out += [
            f"figures from the metric names of vLLM {version} (d = increase between the reads):",
            f"  decode (tok/s)          d {gen} / window",
            f"  tokens/step             d {gen} / d {steps}",
            f"  steps/s                 d {steps} / window",
            f"  per-stream decode       (d {gen} - d {fam['ttft']}_count) / d {fam['itl']}_sum",
            f"  acceptance              d {fam['spec_accepted_tokens']}"
            f" / d {fam['spec_draft_tokens']}",
            f"  mean acceptance length  1 + d {fam['spec_accepted_tokens']}"
            f" / d {fam['spec_drafts']}",
            f"  accepted at pos N       d {fam['spec_accepted_per_pos']}{{position=N}}"
            f" / d {fam['spec_drafts']}",
            f"  TTFT, ITL quantiles     histogram_quantile over d {fam['ttft']}_bucket,"
            f" d {fam['itl']}_bucket",
            f"  requests, KV usage      {fam['requests_running']}, {fam['requests_waiting']},"
            f" {fam['kv_cache_usage']} (second read)",
        ]
        key = tuple(int(x) for x in version.split("."))
        out += [f"  note: {n}" for n in NOTES.get((key[0], key[1]), [])]
    return "\n".join(out)


# --------------------------------------------------------------------------- command


def _interval(text: str) -> float:
    value = float(text)
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 second, got {text}")
    return value


def _timeout(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help="live figures of vLLM servers (decode speed, acceptance, latency), no Prometheus",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "targets",
        nargs="*",
        metavar="TARGET",
        help="vLLM base URL or HOST:PORT (default: the instances under --base-dir)",
    )
    p.add_argument(
        "--hosts",
        metavar="PATTERN",
        help="inventory hosts or a group (with -i): each host's instance, its release and "
        "since when it serves, read over ssh; vLLM through an ssh tunnel when on loopback",
    )
    inventory_arg(p)
    p.add_argument("--instance", metavar="NAME", help="with --hosts: this instance on each")
    p.add_argument(
        "--base-dir",
        default=HostVars().base_dir,
        metavar="DIR",
        help="where vfleet deployed on this host (default: %(default)s)",
    )
    p.add_argument(
        "--interval",
        type=_interval,
        default=5.0,
        metavar="S",
        help="seconds between the two reads of /metrics, at least 1 (default: %(default)s); "
        "longer averages over more traffic",
    )
    p.add_argument(
        "--timeout",
        type=_timeout,
        default=3.0,
        metavar="S",
        help="seconds to wait for each HTTP request to a target (default: %(default)s)",
    )
    p.add_argument(
        "--step-times",
        metavar="FILE",
        help="the MTP step-time table for the depth recommendation (default: each local "
        "instance's own, from sidecar.json; URL and --hosts targets have none)",
    )
    p.add_argument("--json", action="store_true", help="a JSON list, one object per target")
    p.add_argument(
        "--explain",
        action="store_true",
        help="after the table, print which vLLM series each figure comes from",
    )
    p.set_defaults(fn=cmd_status)


def cmd_status(a: argparse.Namespace) -> int:
    if _IMPORT_ERROR is not None:
        raise VfleetError(
            f"needs the vfleet-healthcheck package: {_IMPORT_ERROR}",
            where="vfleet status",
            fix="pip install -e ./healthcheck (`make venv` does)",
        )
    tunnels: list[subprocess.Popen[bytes]] = []
    try:
        if a.hosts:
            if a.targets:
                raise VfleetError(
                    "TARGET and --hosts together", key="--hosts", fix="give one or the other"
                )
            targets = inventory_targets(a.inventory, a.hosts, a.instance, tunnels)
        else:
            targets = resolve_targets(list(a.targets), Path(a.base_dir).expanduser())
        if a.step_times:
            for target in targets:
                target.step_times = a.step_times
        readings = read_all(targets, a.interval, a.timeout)
    finally:
        for t in tunnels:
            t.terminate()
    now = time.time()
    objs = [as_json(r, now) for r in readings]
    if a.json:
        print(json.dumps(objs, indent=2))
    else:
        print(table(objs, now))
        if a.explain:
            print()
            print(explain(objs))
    return 0 if all(r.up for r in readings) else 1
