"""vfleet-exporter: the metrics sidecar that runs next to one vLLM instance.

At each scrape of its own `/metrics` it scrapes vLLM's `/metrics` (a custom Collector: no
background thread polls vLLM), adds the sample to a sliding window and exports the derived
figures under the `vfleet_` prefix with the deployment's identity as constant labels. When vLLM
cannot be read, only `vfleet_vllm_up 0`, the scrape duration and the exporter's own counters are
exported: no stale figures. Bad input never crashes it; each new problem is logged once.

It reports only what is true of a misbehaving upstream: one deadline bounds each read of vLLM
(connect and whole body, `--timeout`) and a cap its size (`--max-body-bytes`); a body known to
be cut is not used; a family with a NaN, infinite or negative counter sample, a gauge outside
its range or a repeated series is skipped for that scrape and counted in
`vfleet_upstream_bad_samples_total{family,reason}`; counters are continued per series.

    vfleet-exporter --vllm-url http://127.0.0.1:8000 --listen 127.0.0.1:9500 [--window 60]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import __version__, switch_record
from .bounded_http import DEFAULT_MAX_BYTES, RequestError, request
from .depth import STATES, Advice, StepCost, StepTimesError, StepTimesSource, advise
from .perf_record import FILENAME, PerfRecord
from .vllm_metrics import (
    DEFAULT_VERSION,
    Family,
    UnsupportedVersion,
    families,
    parse,
    table_version,
)
from .window import Figures, Window

log = logging.getLogger("vfleet-exporter")

IDENTITY = ("host", "profile", "preset", "vfleet_instance", "model_name")
INFO_KEYS = ("vllm_version", "stack", "torch", "plugin", "plugin_features", "release")

# perf.json's figures (the performance gate's bench at rollout) -> (metric name, help)
RELEASE_PERF: dict[str, tuple[str, str]] = {
    "output_tps": (
        "vfleet_release_output_tokens_per_second",
        "Per-stream output tok/s this release measured at its rollout (performance gate).",
    ),
    "ttft_p95_s": (
        "vfleet_release_ttft_p95_seconds",
        "TTFT p95 this release measured at its rollout (performance gate).",
    ),
    "acceptance_rate": (
        "vfleet_release_spec_decode_acceptance_rate",
        "MTP acceptance this release measured at its rollout (performance gate).",
    ),
    "tokens_per_step": (
        "vfleet_release_tokens_per_step",
        "Tokens per engine step this release measured at its rollout (performance gate).",
    ),
}

# figure name -> (metric name, help)
SCALARS: dict[str, tuple[str, str]] = {
    "spec_decode_acceptance_rate": (
        "vfleet_spec_decode_acceptance_rate",
        "Accepted draft tokens / draft tokens over the window.",
    ),
    "spec_decode_mean_acceptance_length": (
        "vfleet_spec_decode_mean_acceptance_length",
        "1 + accepted draft tokens / drafts over the window (tokens per verify step).",
    ),
    "spec_decode_drafts_per_second": ("vfleet_spec_decode_drafts_per_second", "Drafts per s."),
    "spec_decode_draft_tokens_per_second": (
        "vfleet_spec_decode_draft_tokens_per_second",
        "Draft tokens proposed per second.",
    ),
    "spec_decode_accepted_tokens_per_second": (
        "vfleet_spec_decode_accepted_tokens_per_second",
        "Draft tokens accepted per second.",
    ),
    "decode_tokens_per_second": (
        "vfleet_decode_tokens_per_second",
        "Generated tokens per second, all requests.",
    ),
    "prefill_tokens_per_second": ("vfleet_prefill_tokens_per_second", "Prompt tokens per s."),
    "steps_per_second": ("vfleet_steps_per_second", "Engine steps per second."),
    "tokens_per_step": ("vfleet_tokens_per_step", "Generated tokens per engine step."),
    "stream_decode_tokens_per_second": (
        "vfleet_stream_decode_tokens_per_second",
        "Per-stream decode speed: tokens after the first / inter-token time.",
    ),
    "decode_step_seconds": (
        "vfleet_decode_step_seconds",
        "The live decode step: inter-token latency sum / count over the window (one sample per "
        "engine step and request).",
    ),
    "requests_running": ("vfleet_requests_running", "Requests running (last sample)."),
    "engine_awake": (
        "vfleet_engine_awake",
        "1 serving, 0 asleep (vLLM's sleep mode, a resident standby; last sample).",
    ),
    "engine_sleep_level": (
        "vfleet_engine_sleep_level",
        "While asleep: 0 scheduling paused, 1 weights in host memory, 2 weights dropped.",
    ),
    "requests_waiting": ("vfleet_requests_waiting", "Requests waiting (last sample)."),
    "kv_cache_usage_ratio": ("vfleet_kv_cache_usage_ratio", "KV cache usage 0..1 (last sample)."),
}
QUANTILE_METRICS = {
    "ttft": ("vfleet_time_to_first_token_seconds", "Time to first token over the window."),
    "itl": (
        "vfleet_inter_token_latency_seconds",
        "Inter-token latency (one engine step as a request sees it) over the window.",
    ),
}


class UpstreamError(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def fetch(url: str, timeout: float, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """GET ``url`` within ``timeout`` seconds in all (connect and whole body); raise
    UpstreamError(reason) on anything but a complete 200 response of at most ``max_bytes``.

    Reasons: connect, timeout, truncated, too_large, protocol, http_<status>.
    """
    try:
        resp = request(url, timeout=timeout, max_bytes=max_bytes)
    except RequestError as exc:
        raise UpstreamError(exc.reason, str(exc)) from None
    if resp.status != 200:
        raise UpstreamError(f"http_{resp.status}", f"HTTP {resp.status} from {url}")
    return resp.body.decode("utf-8", errors="replace")


_END_LINE = re.compile(r"^# (?:HELP|TYPE) (\S+)|^([^\s{]+)")


def last_name(text: str) -> str | None:
    """The metric name on the body's last line (a sample, or a HELP/TYPE comment)."""
    line = text.rstrip("\n").rsplit("\n", 1)[-1].strip()
    m = _END_LINE.match(line)
    if not m or (line.startswith("#") and not m.group(1)):
        return None
    return m.group(1) or m.group(2)


def has_name(text: str, name: str) -> bool:
    return re.search(rf"^(?:# (?:HELP|TYPE) )?{re.escape(name)}[ {{]", text, re.M) is not None


# The SM75 plugin's state file (vfleet_sm75/state.py writes it): its "active" list is the label.
PLUGIN_STATE_FORMAT = "vfleet-sm75.state/1"


def plugin_features(path: Path) -> str:
    """The plugin's features on now, comma-separated; "" if none. OSError/ValueError if the
    file cannot be read as the plugin's state (not written yet, say)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != PLUGIN_STATE_FORMAT:
        raise ValueError(f"{path}: not a vfleet-sm75 state file")
    active = data.get("active")
    if not isinstance(active, list):
        raise ValueError(f"{path}: no list of active features")
    return ",".join(str(a) for a in active)


@dataclass
class Identity:
    labels: dict[str, str] = field(default_factory=dict)  # IDENTITY keys
    info: dict[str, str] = field(default_factory=dict)  # INFO_KEYS
    plugin_state: Path | None = None  # read at each scrape for info's plugin_features
    perf: Path | None = None  # the release's perf.json (written after start): each scrape
    spec_depth: int | None = None  # the rendered num_speculative_tokens (0: speculation off)
    step_times: Path | None = None  # the instance's step-time table (vfleet tune writes it)
    switch: Path | None = None  # the instance's last-switch.json (vfleet switch writes it)
    # What a decode step reads (sidecar.json decode_cost, vfleet.engine.decode_cost): the
    # floor gauges, and step times modelled where no table was measured. None: no figure.
    decode_cost: StepCost | None = None
    decode_cost_problem: str = ""  # why a decode_cost in the file was not used

    @classmethod
    def from_file(cls, path: Path) -> Identity:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object")
        labels = {k: str(data["labels"][k]) for k in IDENTITY if k in data.get("labels", {})}
        info = {k: str(data["info"][k]) for k in INFO_KEYS if k in data.get("info", {})}
        # A deploy installs sidecar.json in releases/<id>/ (reached through `current`): the
        # release id is the folder's name, so a rollback shows up as a changed label.
        real = path.resolve()
        perf = switch = None
        if real.parent.parent.name == "releases":
            info.setdefault("release", real.parent.name)
            # Through `current`, not the resolved folder: a swap that leaves the sidecar's
            # unit unchanged does not restart it, and it must then show the new release's.
            perf = path.parent / FILENAME
            # The instance's folder (instances/<i>/releases/<id>/sidecar.json): the record
            # outlives swaps, as the step-time table does.
            switch = real.parent.parent.parent / switch_record.FILENAME
        state = data.get("plugin_state")
        spec = data.get("spec_decode")
        depth = spec.get("depth") if isinstance(spec, dict) else None
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)):
            raise ValueError(f"{path}: spec_decode.depth must be an integer, got {depth!r}")
        times = data.get("step_times")
        cost, problem = None, ""
        if data.get("decode_cost") is not None:
            # A bad figure costs the cost model, not the sidecar: said once in its log.
            try:
                cost = StepCost.from_json(data["decode_cost"], str(path))
            except StepTimesError as exc:
                problem = str(exc)
        return cls(
            labels,
            info,
            Path(state) if isinstance(state, str) and state else None,
            perf,
            depth,
            Path(times) if isinstance(times, str) and times else None,
            switch,
            cost,
            problem,
        )


class IdentityFile:
    """sidecar.json, read again whenever the file it names changes. The sidecar is given the
    path through the instance's `current` link, and a swap that leaves the sidecar's unit as
    it was (a new depth, say) repoints `current` without restarting it on systemd: read once,
    the running depth, the release and the step-time path stayed the first release's (seen:
    running depth 3 exported after `vfleet tune` rolled out depth 1). ``labels`` and
    ``step_times`` (the command line's) override the file's, as at the start."""

    def __init__(
        self, path: Path, labels: dict[str, str] | None = None, step_times: Path | None = None
    ) -> None:
        self.path = path
        self.labels = dict(labels or {})
        self.step_times = step_times
        self._seen = self._key()
        self.identity = self._load()  # a bad file at the start is the caller's error
        self.problem = ""  # why the newest file is not in use ("" when it is)

    def _key(self) -> tuple[int, int, int, int] | None:
        try:
            st = self.path.stat()  # follows `current`: another release is another file
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def _load(self) -> Identity:
        identity = Identity.from_file(self.path)
        identity.labels.update(self.labels)
        if self.step_times is not None:
            identity.step_times = self.step_times
        return identity

    def get(self) -> Identity:
        """The identity of the file there now; the last good one while it cannot be read."""
        key = self._key()
        if key is not None and key != self._seen:
            self._seen = key
            try:
                self.identity = self._load()
                self.problem = ""
            except (OSError, ValueError, KeyError) as exc:
                self.problem = f"{self.path}: {exc}"
        return self.identity


class VllmCollector(Collector):
    """Scrapes vLLM when Prometheus scrapes us. One lock: concurrent scrapes queue."""

    def __init__(
        self,
        vllm_url: str,
        *,
        window: float = 60.0,
        timeout: float = 3.0,
        max_bytes: int = DEFAULT_MAX_BYTES,
        identity: Identity | IdentityFile | None = None,
        vllm_version: str = DEFAULT_VERSION,
        clock: Any = time.monotonic,
    ) -> None:
        self.url = vllm_url.rstrip("/") + "/metrics"
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.config = identity if isinstance(identity, IdentityFile) else None
        if isinstance(identity, IdentityFile):
            identity = identity.identity
        self.identity: Identity = identity or Identity()
        self.table: dict[str, Family] = families(vllm_version)
        self.table_version = table_version(vllm_version)
        self.window = Window(window, self.table)
        self.clock = clock
        self.errors: dict[str, int] = {}
        # (vLLM family, reason) -> scrapes in which that family had bad samples
        self.bad_samples: dict[tuple[str, str], int] = {}
        # The last line's metric name of the previous body, and its process start time: a
        # later body of the same process that lacks it was cut short.
        self._end: tuple[str | None, float | None] = (None, None)
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self._up: bool | None = None
        self.last_figures = Figures()
        self.step_times = StepTimesSource(self.identity.step_times)

    # -- logging: each distinct problem once, and every up/down change
    def _refresh_identity(self) -> None:
        """Follow a changed sidecar.json (IdentityFile says why); under the scrape lock."""
        if self.config is None:
            return
        self.identity = self.config.get()
        if self.config.problem:
            problem = self.config.problem
            self._once(f"config:{problem}", f"kept the last good config: {problem}")
        if self.identity.step_times != self.step_times.path:
            self.step_times = StepTimesSource(self.identity.step_times)

    def _once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message)

    def _set_up(self, up: bool, detail: str = "") -> None:
        if up != self._up:
            if up:
                log.info("vLLM at %s is up", self.url)
            else:
                log.warning("vLLM at %s is down: %s", self.url, detail)
        self._up = up

    def _cut_short(self, text: str, start: float | None) -> bool:
        """True when this body ends before the previous body of the same vLLM process did.

        prometheus_client writes the families in a fixed order and a running process never
        drops one, so a body lacking the name that ended the previous body lost its tail. The
        first body, a body cut the same way every time and a body after a restart cannot be
        judged this way. A family vLLM really dropped costs one scrape: the end is taken from
        every body, used or not.
        """
        prev_end, prev_start = self._end
        end = last_name(text)
        self._end = (end, start)
        if prev_end is None or start is None or start != prev_start or end == prev_end:
            return False
        return not has_name(text, prev_end)

    def scrape(self) -> tuple[bool, float]:
        """Scrape vLLM once and update the window. Returns (up, seconds taken)."""
        t0 = time.perf_counter()
        try:
            text = fetch(self.url, self.timeout, self.max_bytes)
            parsed = parse(text, self.table)
            if not parsed.values:
                raise UpstreamError("parse", f"{self.url} returned no vLLM metrics")
            if not text.endswith("\n"):
                # prometheus_client ends every line with a newline: this body was cut inside
                # a line, and a multi-engine sum cut between its series would be wrong.
                raise UpstreamError("truncated", f"{self.url}: the body ends inside a line")
            if self._cut_short(text, parsed.values.get("process_start_time")):
                raise UpstreamError(
                    "truncated", f"{self.url}: the body ends before the previous one did"
                )
        except UpstreamError as exc:
            self.errors[exc.reason] = self.errors.get(exc.reason, 0) + 1
            self._set_up(False, str(exc))
            self.window.clear()  # a gap in the samples would hide an outage inside a rate
            self.last_figures = Figures()
            return False, time.perf_counter() - t0
        for logical, why in parsed.bad.items():
            self._count_bad(logical, parsed.rejected.get(logical, "malformed"))
            self._once(f"bad:{logical}:{why}", f"skipping {logical} this scrape: {why}")
        for logical, fam in self.table.items():
            if (
                logical not in parsed.bad
                and fam.kind != "gauge"
                and not any(k == logical or k.startswith(logical + "/") for k in parsed.values)
            ):
                self._once(f"missing:{logical}", f"vLLM does not export {fam.name}")
        if self.window.add(self.clock(), parsed):
            log.warning("vLLM restarted (restart %d seen by this exporter)", self.window.restarts)
        for logical in sorted({key.split("/", 1)[0] for key in self.window.last_resets}):
            self._count_bad(logical, "counter_reset")
            self._once(
                f"reset:{logical}",
                f"{logical} went back without a restart: taken as a reset of that series only",
            )
        self._set_up(True)
        self.last_figures = self.window.figures()
        return True, time.perf_counter() - t0

    def _count_bad(self, logical: str, reason: str) -> None:
        key = (self.table[logical].name, reason)
        self.bad_samples[key] = self.bad_samples.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        # Each scrape ends by its deadline, so the lock is free within about one --timeout;
        # the bound keeps a pile of concurrent scrapes from holding threads any longer.
        t0 = time.perf_counter()
        if self._lock.acquire(timeout=2 * self.timeout + 1):
            try:
                self._refresh_identity()
                up, took = self.scrape()
                figures = self.last_figures
                errors, bad = dict(self.errors), dict(self.bad_samples)
            finally:
                self._lock.release()
        else:
            up, took, figures = False, time.perf_counter() - t0, Figures()
            self.errors["busy"] = self.errors.get("busy", 0) + 1
            errors, bad = dict(self.errors), dict(self.bad_samples)
        names = list(self.identity.labels)
        values = [self.identity.labels[k] for k in names]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        yield gauge("vfleet_vllm_up", "1 if vLLM's /metrics was read at this scrape.", float(up))
        yield gauge("vfleet_scrape_duration_seconds", "Time to read vLLM's /metrics.", took)
        failed = CounterMetricFamily(
            "vfleet_upstream_errors", "Failed reads of vLLM's /metrics.", labels=[*names, "reason"]
        )
        for reason, count in sorted(errors.items()):
            failed.add_metric([*values, reason], count)
        yield failed
        rejected = CounterMetricFamily(
            "vfleet_upstream_bad_samples",
            "Scrapes in which a vLLM family had bad samples, by family and reason: skipped for "
            "that scrape (nan, inf, negative, out_of_range, duplicate, malformed, incomplete) "
            "or a counter that went back in one process (counter_reset, that series only).",
            labels=[*names, "family", "reason"],
        )
        for (family, reason), count in sorted(bad.items()):
            rejected.add_metric([*values, family, reason], count)
        yield rejected
        restarts = CounterMetricFamily(
            "vfleet_vllm_restarts", "vLLM restarts this exporter saw.", labels=names
        )
        restarts.add_metric(values, self.window.restarts)
        yield restarts
        info = GaugeMetricFamily(
            "vfleet_info",
            "What this instance runs (always 1).",
            labels=[*names, *INFO_KEYS, "exporter_version", "metrics_table"],
        )
        info_values = dict(self.identity.info)
        if self.identity.plugin_state is not None:
            try:
                info_values["plugin_features"] = plugin_features(self.identity.plugin_state)
            except (OSError, ValueError) as exc:
                self._once(f"plugin-state:{exc}", f"plugin_features unknown: {exc}")
                info_values["plugin_features"] = ""
        info.add_metric(
            [
                *values,
                *(info_values.get(k, "") for k in INFO_KEYS),
                __version__,
                self.table_version,
            ],
            1.0,
        )
        yield info
        yield from self._release_perf(names, values)
        yield from self._switch_metrics(names, values)
        if not up:
            return
        if figures.window_seconds is not None:
            yield gauge(
                "vfleet_window_seconds",
                "Time between the oldest and newest vLLM sample in the window.",
                figures.window_seconds,
            )
        for key, (name, doc) in SCALARS.items():
            if key in figures.scalars:
                yield gauge(name, doc, figures.scalars[key])
        if figures.positions:
            pos = GaugeMetricFamily(
                "vfleet_spec_decode_position_acceptance_rate",
                "Accepted tokens at a draft position / drafts over the window.",
                labels=[*names, "position"],
            )
            for position, rate in sorted(figures.positions.items(), key=lambda x: int(x[0])):
                pos.add_metric([*values, position], rate)
            yield pos
        step = figures.scalars.get("decode_step_seconds")
        cost = self.identity.decode_cost
        if self.identity.decode_cost_problem:
            self._once(
                f"decode-cost:{self.identity.decode_cost_problem}",
                f"no decode cost model: {self.identity.decode_cost_problem}",
            )
        running = max(1, round(figures.scalars.get("requests_running", 1.0)))
        advice = advise(
            figures.positions, self.identity.spec_depth, self.step_times, step, cost, running
        )
        if cost is not None and advice.running_depth is not None:
            floor = cost.floor_s(advice.running_depth)
            yield gauge(
                "vfleet_decode_step_floor_seconds",
                "The running depth's decode step at the card's memory bandwidth: the bytes it "
                "reads per GPU (sidecar.json decode_cost) / the bandwidth.",
                floor,
            )
            if step:
                yield gauge(
                    "vfleet_decode_floor_ratio",
                    "The step's floor / the live step (1: bound by memory bandwidth; 0.35: the "
                    "card's bandwidth explains 35% of the step).",
                    floor / step,
                )
        yield from self._depth_metrics(advice, names, values)
        for key, (name, doc) in QUANTILE_METRICS.items():
            if key in figures.quantiles:
                q = GaugeMetricFamily(name, doc, labels=[*names, "quantile"])
                for quantile, v in figures.quantiles[key].items():
                    q.add_metric([*values, str(quantile)], v)
                yield q

    def _release_perf(self, names: list[str], values: list[str]) -> Iterator[Metric]:
        """The figures the performance gate measured for this release at its rollout (none
        before it wrote perf.json; vLLM being down does not change what was measured)."""
        path = self.identity.perf
        if path is None or not path.exists():
            return
        try:
            record = PerfRecord.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            self._once(f"perf:{exc}", f"{path}: not used: {exc}")
            return
        extra = ["release", "concurrency"]
        ids = [*values, record.release, str(record.shape.concurrency)]
        for key, (name, doc) in RELEASE_PERF.items():
            value = getattr(record.figures, key)
            if value is not None:
                g = GaugeMetricFamily(name, doc, labels=[*names, *extra])
                g.add_metric(ids, value)
                yield g

    def _switch_metrics(self, names: list[str], values: list[str]) -> Iterator[Metric]:
        """The last `vfleet switch` this instance took part in (vfleet_healthcheck.switch_record:
        written on the host after each switch). None before the first; a file that is not a
        record (a link, not a regular file, too large, a field outside its set) gives none,
        logged once: every label value comes from a fixed set, never from the file's text."""
        path = self.identity.switch
        if path is None:
            return
        try:
            record = switch_record.read(path)
        except (OSError, ValueError) as exc:
            self._once(f"switch:{exc}", f"{path}: not used: {exc}")
            return
        if record is None:
            return
        role = [*names, "role"]
        ids = [*values, record.role]
        outcome = GaugeMetricFamily(
            switch_record.METRIC_OUTCOME,
            "1 for how the last `vfleet switch` this instance took part in ended (role: to = "
            "woken, from = put to sleep; outcome: " + ", ".join(switch_record.OUTCOMES) + "; "
            "failed_at: the step or gate that failed, none when it switched).",
            labels=[*role, "outcome", "failed_at"],
        )
        outcome.add_metric([*ids, record.outcome, record.failed_at], 1.0)
        yield outcome
        for name, doc, value in (
            (
                switch_record.METRIC_DURATION,
                "Seconds from the last switch's nginx flip to its last gate (or to the end of "
                "its rollback).",
                record.seconds,
            ),
            (
                switch_record.METRIC_FIRST_TOKEN,
                "Seconds from the last switch's flip to the first token a client got from the "
                "woken model through the front (a switch that passed, where it was measured).",
                record.first_token_s,
            ),
            (
                switch_record.METRIC_TIMESTAMP,
                "When the last switch this instance took part in ended (Unix time).",
                record.ended_at,
            ),
        ):
            if value is not None:
                g = GaugeMetricFamily(name, doc, labels=role)
                g.add_metric(ids, value)
                yield g
        total = CounterMetricFamily(
            switch_record.METRIC_TOTAL.removesuffix("_total"),
            "`vfleet switch` runs this instance took part in, by role and outcome.",
            labels=[*role, "outcome"],
        )
        for r in switch_record.ROLES:
            for o in switch_record.OUTCOMES:
                total.add_metric([*values, r, o], record.count(r, o))
        yield total

    def _depth_metrics(
        self, advice: Advice, names: list[str], values: list[str]
    ) -> Iterator[Metric]:
        """The MTP depth recommendation (vfleet_healthcheck.depth) beside the running depth."""
        if advice.state == "bad_step_times":
            self._once(f"step-times:{advice.detail}", f"no depth recommendation: {advice.detail}")

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        state = GaugeMetricFamily(
            "vfleet_spec_decode_recommendation_state",
            "1 for why there is or is not an MTP depth recommendation: "
            + "; ".join(f"{k}: {v}" for k, v in STATES.items()),
            labels=[*names, "state"],
        )
        state.add_metric([*values, advice.state], 1.0)
        yield state
        if advice.running_depth is not None:
            yield gauge(
                "vfleet_spec_decode_running_depth",
                "num_speculative_tokens this instance runs (0: no speculative decoding).",
                advice.running_depth,
            )
        if advice.table is not None and advice.state == "ok":
            yield gauge(
                "vfleet_spec_decode_step_times_timestamp_seconds",
                "When the step-time table the recommendation uses was measured (Unix time).",
                advice.table.measured_at_unix,
            )
        rec = advice.recommendation
        if rec is None:
            return
        yield gauge(
            "vfleet_spec_decode_recommended_depth",
            "The depth of the step-time table with the highest expected tok/s: (1 + the sum of "
            "the window's per-position acceptance, extrapolated beyond the running depth) / "
            "seconds per step at that depth.",
            rec.recommended_depth,
        )
        if rec.gain is not None:
            yield gauge(
                "vfleet_spec_decode_recommended_gain_ratio",
                "Expected tok/s at the recommended depth / at the running depth - 1 "
                "(0.12: 12% faster; 0: the running depth is the best).",
                rec.gain,
            )
        expected = GaugeMetricFamily(
            "vfleet_spec_decode_expected_tokens_per_second",
            "Expected decode tok/s per MTP depth of the step-time table, from the window's "
            "acceptance (label extrapolated: positions beyond the running depth, not measured "
            "live: from the step-time table's acceptance where it has it, else guessed).",
            labels=[*names, "depth", "extrapolated"],
        )
        for e in rec.estimates:
            expected.add_metric([*values, str(e.depth), str(e.extrapolated)], e.tokens_per_second)
        yield expected


def _listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _positive(kind: type[float] | type[int]) -> Any:
    def convert(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text!r}")
        return value

    return convert


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vfleet-exporter",
        description="Metrics sidecar for one vLLM instance: scrapes vLLM's /metrics when "
        "Prometheus scrapes this exporter and exports MTP acceptance, decode speed "
        "(tokens/step x steps/s), TTFT and inter-token latency quantiles over a sliding "
        "window, with the deployment's identity as labels.",
        epilog="Example: vfleet-exporter --vllm-url http://127.0.0.1:8000 "
        "--listen 127.0.0.1:9500 --config /opt/vfleet/instances/main/current/sidecar.json",
    )
    p.add_argument("--vllm-url", required=True, help="vLLM base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--listen", type=_listen, default=("127.0.0.1", 9500), help="HOST:PORT to serve /metrics"
    )
    p.add_argument(
        "--window", type=float, default=60.0, help="sliding window in seconds (default 60)"
    )
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=3.0,
        help="seconds for a whole read of vLLM's /metrics (connect, headers and body "
        "together): a slower or hung vLLM gives vfleet_vllm_up 0 by then; keep it below "
        "Prometheus' scrape timeout (default 3)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=DEFAULT_MAX_BYTES,
        metavar="BYTES",
        help="largest /metrics body read; a larger one gives vfleet_vllm_up 0 "
        f"(reason too_large; default {DEFAULT_MAX_BYTES}, vLLM's is ~55 KB)",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="sidecar.json rendered by vfleet (identity labels, versions, release, MTP "
        "depth); read again whenever the file it names changes (a swap repoints current)",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"identity label (one of {', '.join(IDENTITY)}); overrides --config",
    )
    p.add_argument(
        "--step-times",
        type=Path,
        metavar="FILE",
        help="the instance's MTP step-time table (vfleet tune writes it; default: --config's "
        "step_times); missing: no depth recommendation, vfleet_spec_decode_recommendation_state "
        "says why",
    )
    p.add_argument(
        "--vllm-version",
        help="vLLM version, selects the metric-name table (default: from --config, else 0.32)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        labels: dict[str, str] = {}
        for item in args.label:
            key, sep, value = item.partition("=")
            if not sep or key not in IDENTITY:
                raise ValueError(f"--label {item!r}: expected KEY=VALUE with KEY in {IDENTITY}")
            labels[key] = value
        source: Identity | IdentityFile
        if args.config:
            source = IdentityFile(args.config, labels, args.step_times)
            identity = source.identity
        else:
            source = identity = Identity(labels=labels, step_times=args.step_times)
        # The metric-name table stays the start's: another vLLM version comes with another
        # sidecar wheel, and the role restarts the sidecar for that.
        version = args.vllm_version or identity.info.get("vllm_version") or DEFAULT_VERSION
        collector = VllmCollector(
            args.vllm_url,
            window=args.window,
            timeout=args.timeout,
            max_bytes=args.max_body_bytes,
            identity=source,
            vllm_version=version,
        )
    except (OSError, ValueError, KeyError, UnsupportedVersion) as exc:
        print(f"vfleet-exporter: error: {exc}", file=sys.stderr)
        return 2
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    host, port = args.listen
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        print(f"vfleet-exporter: error: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    log.info(
        "serving http://%s:%d/metrics for %s (window %.0f s, metric names of vLLM %s)",
        host,
        port,
        collector.url,
        args.window,
        collector.table_version,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
