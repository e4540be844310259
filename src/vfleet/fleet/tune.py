"""`vfleet tune HOST`: measure what the rules allow on one host, keep the best, roll it out.

The host is drained from its balancer (--balancer), then each candidate (src/vfleet/
tune_space.py) is checked against the rules and the planner, deployed through the release
machinery (`vfleet swap HOST --set ...`: every gate of a deploy; a candidate that fails one is
rolled back and recorded as failed) and measured with the bench client (src/vfleet/
tune_measure.py), one at a time. The best candidate for the objective is written into the
inventory's host_vars/<host>/vfleet_tuned.yml (the role applies `vfleet_tuned_set` after the
host's vfleet_set) with the measured table beside it, and rolled out through `vfleet swap`,
which admits the host to its balancer again once every gate passed. The seconds per engine
step measured at each depth go into the instance folder on the host (step-times.json), where
the sidecar reads them for its recommended depth. Report: OUT/tune.{json,md,svg}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vfleet.config.apikey import read_api_key_file
from vfleet.config.escape import host_name
from vfleet.config.schema import STEP_TIMES_FILE
from vfleet.engine.compile import Launch, resolve
from vfleet.engine.decode_cost import decode_cost
from vfleet.errors import VfleetError
from vfleet.fleet.balancer import load as load_balancer
from vfleet.fleet.balancer import set_down
from vfleet.fleet.inventory import (
    become,
    host_launch,
    host_namespace,
    host_plan,
    host_settings,
    host_vars,
    inventory_arg,
    literal,
    ssh_argv,
)
from vfleet.fleet.targets import endpoint
from vfleet.fleet.tune_measure import (
    OBJECTIVES,
    BenchPlan,
    Measurement,
    Objective,
    measure,
    objective_from,
    until_decoded,
)
from vfleet.fleet.tune_report import (
    OVERRIDES_FILE,
    host_vars_dir,
    merged_sets,
    read_tuned,
    table,
    write_overrides,
    write_report,
)
from vfleet.fleet.tune_space import (
    BUILDERS,
    SEARCHES,
    Candidate,
    all_candidates,
    build_space,
    candidate,
    infeasible,
    next_candidate,
    parse_depths,
)
from vfleet.fleet.tune_state import Identity, Result, State, load, save
from vfleet.render.plan import Plan
from vfleet.render.release import release_id, render_files

STATE_FILE = "state.json"
SWAP_LOG = "swaps.log"

EXAMPLES = """\
examples:
  vfleet tune node1 -i inv.yml --budget 60                      # every dimension that applies
  vfleet tune node1 -i inv.yml --sweep depth --balancer /srv/vfleet-lb
  vfleet tune node1 -i inv.yml --objective throughput --concurrency 4 --ttft-slo 2.5
  vfleet tune node1 -i inv.yml --dry-run                        # the space and what fits
  vfleet tune node1 -i inv.yml --out tune-node1                 # again: resumes from its state

objectives: decode (default): concurrency x per-stream decode tok/s (tokens after the first
over the time after the first); throughput: generated tok/s of each batch over its wall time
(prefill included), among candidates whose TTFT p95 is within --ttft-slo. A candidate with a
failed request cannot win.

search: climb (default) takes one dimension at a time, the others at the best found so far
(or at what the host runs); along an ordered dimension (depth, sizes, threads) it starts at
what the host runs, walks down then up, and stops walking a way once a value scores worse
than the best so far by more than --margin (or failed); grid measures every combination.
Either way a re-run with the same --out skips every candidate measured or skipped before and
tries the failed ones again (a start can time out on a busy box).

exit status: 0 the best candidate was rolled out (or, with --no-rollout / nothing better,
the host was put back as it was); 1 a swap or the rollout failed, or nothing could be
measured; 2 bad input (nothing was started).
"""


@dataclass
class Target:
    """The host as a deploy sees it, and what tune needs to measure and swap it."""

    host: str
    inventory: Path
    launch: Launch
    sets: list[str]  # vfleet_set + vfleet_tuned_set, as the role applies them
    own_sets: list[str]  # vfleet_set alone: the state's identity
    instance: str | None
    base_dir: str | None
    profile: str
    model: str
    deployment: str | None
    profiles_dir: str | None
    host_vars: dict[str, Any]
    plan: Plan
    api_key_file: str | None = None  # vfleet_api_key_file: where the deploy reads the key

    def resolve_with(self, extra: Sequence[str]) -> Launch:
        sets = [*self.sets, *extra]
        if self.instance:
            sets.append(f"instance={self.instance}")
        return resolve(
            self.profile,
            self.model,
            deployment=Path(self.deployment) if self.deployment else None,
            sets=sets,
            root=Path(self.profiles_dir) if self.profiles_dir else None,
            host=self.launch.host,
        )

    @property
    def api_key(self) -> str | None:
        """The key the bench sends: the inventory's key file (as the deploy reads it), else an
        `api_key=` setting (the older way, still honoured)."""
        if self.api_key_file:
            return read_api_key_file(self.api_key_file)
        keys = [s.split("=", 1)[1] for s in self.sets if s.startswith("api_key=")]
        return keys[-1] if keys else None


def target(a: argparse.Namespace) -> Target:

    hv = host_vars(a.inventory, a.host)
    ns = host_namespace(a.inventory, a.host, None, a.instance, a.base_dir)
    s = host_settings(ns, hv)
    plan, _ = host_plan(ns, hv)
    own = literal(hv, "vfleet_set", a.host) or []
    own_sets = shlex.split(own) if isinstance(own, str) else [str(x) for x in own]
    sets = list(s["sets"])
    instance = s["instance"]
    launch = host_launch(ns, hv, plan)
    return Target(
        a.host, Path(a.inventory), launch, sets, own_sets, instance, a.base_dir,
        plan.profile, plan.model.name, s["deployment"], s["profiles_dir"], hv, plan,
        s["api_key_file"],
    )  # fmt: skip


# --------------------------------------------------------------------------- swaps


@dataclass(frozen=True)
class Swapped:
    rc: int
    said: str  # the swap's outcome for the host, and why when it failed
    perf: dict[str, Any] | None = None  # the performance gate's verdict (rollout only)


def swap(
    t: Target, sets: Sequence[str], log: Path, balancer: Path | None, perf_concurrency: int
) -> Swapped:
    """`vfleet swap HOST` to the host's settings plus `sets`. Its own output goes to `log`.

    A candidate (`balancer` None) is swapped without the performance gate: it is measured here,
    and a slower candidate is a finding, not a failure; the host stays drained. The rollout
    names the balancer and runs the gate at the tuner's concurrency: the host is admitted
    again only once the winner passed every gate.
    """
    argv = [
        sys.executable, "-m", "vfleet.cli.main", "swap", t.host, "-i", str(t.inventory),
        "--model", t.model, "--serial", "1", "--json", "--interval", "2",
    ]  # fmt: skip
    for s in sets:
        argv += ["--set", s]
    if t.instance:
        argv += ["--instance", t.instance]
    if t.base_dir:
        argv += ["--base-dir", t.base_dir]
    if balancer is None:
        argv.append("--no-perf-gate")
    else:
        argv += ["--balancer", str(balancer)]
    if perf_concurrency:
        argv += ["--perf-concurrency", str(perf_concurrency)]
    with log.open("a", encoding="utf-8") as out:
        shown = [x if not x.startswith("api_key=") else "api_key=***" for x in argv]
        out.write(f"\n$ {shlex.join(shown)}\n")
        out.flush()
        proc = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=out, text=True, check=False, timeout=3600
        )
        out.write(proc.stdout)
    try:
        doc = json.loads(proc.stdout)
        host = next(h for h in doc["hosts"] if h["host"] == t.host)
    except (ValueError, KeyError, StopIteration):
        return Swapped(proc.returncode, f"vfleet swap exited {proc.returncode} without a report")
    said = str(host.get("outcome") or "")
    if host.get("why"):
        said += f": {' '.join(str(host['why']).split())[:400]}"
    perf = host.get("perf")
    return Swapped(proc.returncode, said, perf if isinstance(perf, dict) else None)


# --------------------------------------------------------------------------- the sweep


class Progress:
    def __init__(self, budget_s: float, total: int | None) -> None:
        self.t0 = time.monotonic()
        self.budget_s = budget_s
        self.total = total
        self.n = 0

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def say(self, text: str) -> None:
        of = f"/{self.total}" if self.total else ""
        mins = f"{self.elapsed_s / 60:.1f}/{self.budget_s / 60:g} min"
        print(f"tune [{self.n}{of}, {mins}] {text}", file=sys.stderr, flush=True)


def sweep(
    t: Target,
    state: State,
    dims: Sequence[Any],
    a: argparse.Namespace,
    objective: Objective,
    bench: BenchPlan,
    url: str,
    out_dir: Path,
) -> str | None:
    """Measure candidates until the search is done or the budget is spent; why it stopped
    early, or None when every candidate the search wanted was tried."""
    budget_s = a.budget * 60
    total = all_candidates(dims) if a.search == "grid" else None
    progress = Progress(budget_s, total)
    progress.n = len(state.results)
    for key, r in state.results.items():
        progress.say(f"{key}: {r.status} in run {r.run} (state file): skipped now")
    while True:
        c = next_candidate(dims, state.scores(objective), a.search, a.margin)
        if c is None:
            return None
        progress.n += 1
        why = infeasible(t.resolve_with, c)
        if why is not None:
            state.add(Result(c.key, dict(c.picks), list(c.sets), "skipped", why))
            save(a.state, state)
            progress.say(f"{c.key}: skipped, {why}")
            continue
        per = state.mean_candidate_s() or 0.0
        if progress.elapsed_s + per > budget_s:
            progress.n -= 1
            return (
                f"budget of {a.budget:g} min: the next candidate ({c.key}) would need about "
                f"{per / 60:.1f} min more; run again with the same --out to continue"
            )
        progress.say(f"{c.key}: deploying")
        state.add(try_candidate(t, c, a, bench, url, out_dir, progress))
        save(a.state, state)
        r = state.results[c.key]
        if r.measurement is not None:
            score, note = objective.score(r.measurement)
            shown = f"{score:.2f}" if score is not None else f"no score ({note})"
            progress.say(f"{c.key}: {shown} in {r.seconds:.0f} s")
        else:
            progress.say(f"{c.key}: {r.status}: {r.why}")


def try_candidate(
    t: Target,
    c: Candidate,
    a: argparse.Namespace,
    bench: BenchPlan,
    url: str,
    out_dir: Path,
    progress: Progress,
) -> Result:

    started = time.monotonic()
    rid = release_id(render_files(t.resolve_with(c.sets)))
    done = swap(t, c.sets, out_dir / SWAP_LOG, None, 0)
    if done.rc != 0:
        # A start can time out on a busy box (seen on the shared test machine: depth 0's start
        # hit systemd's start limit while other fleets started vLLM, and the climb stopped
        # walking there). One more try before the candidate counts as failed; the swap has
        # rolled the host back, so the second try starts from a serving host again.
        progress.say(f"{c.key}: swap failed ({done.said}); trying once more")
        done = swap(t, c.sets, out_dir / SWAP_LOG, None, 0)
    result = Result(c.key, dict(c.picks), list(c.sets), "failed", release_id=rid)
    if done.rc != 0:
        result.why = f"swap failed twice ({done.said})"
    else:
        progress.say(f"{c.key}: {done.said}; measuring")
        got = until_decoded(
            lambda: measure(url, t.api_key, bench), lambda why: progress.say(f"{c.key}: {why}")
        )
        if isinstance(got, Measurement):
            result.status, result.measurement = "measured", got
        else:
            result.why = got
    result.seconds = round(time.monotonic() - started, 1)
    return result


# --------------------------------------------------------------------------- the command


def cmd_tune(a: argparse.Namespace) -> int:

    objective = objective_from(a.objective, a.concurrency, a.ttft_slo)
    for value, option in ((a.budget, "--budget"), (a.repeats, "--repeats"),
                          (a.decode_tokens, "--decode-tokens")):  # fmt: skip
        if value <= 0:
            raise VfleetError(f"{option} must be > 0", key=option, fix=f"e.g. {option} 30")
    if not 0 <= a.margin < 1:
        raise VfleetError("--margin is a fraction in [0, 1)", key="--margin", fix="e.g. 0.05")
    bench = BenchPlan(a.concurrency, a.decode_tokens, a.prompt_tokens, a.repeats, a.bench_limit)
    balancer = Path(a.balancer).resolve() if a.balancer else None
    t = target(a)
    names = [n.strip() for n in a.sweep.split(",") if n.strip()] if a.sweep else list(BUILDERS)
    dims, left_out = build_space(t.launch, names, parse_depths(a.depths))
    out_dir: Path = a.out or Path(f"tune-{host_name(a.host)}")
    a.state = a.state or out_dir / STATE_FILE
    identity = Identity.of(a.host, t.profile, t.model, t.launch.instance, t.own_sets, bench)
    state = load(a.state, identity)
    if a.dry_run:
        return dry_run(t, dims, left_out, state, a)
    # A failure can be the host's moment (a start that timed out on a busy box): a re-run tries
    # failed candidates again. Skipped ones stay skipped: the rules and the plan say the same.
    for r in state.forget_failed():
        print(f"tune: trying {r.key} again (failed in run {r.run}: {(r.why or '')[:200]})",
              file=sys.stderr)  # fmt: skip
    if not dims:
        raise VfleetError(
            "nothing to sweep on this host: " + "; ".join(f"{k}: {v}" for k, v in left_out.items()),
            key="--sweep",
            fix="name dimensions that apply to the host's profile and model",
        )
    if balancer is not None and a.host not in {
        r["host"] for r in load_balancer(balancer)["replicas"]
    }:
        raise VfleetError(
            f"{a.host} is not a replica of this balancer",
            where=str(balancer / "balancer.json"),
            key="--balancer",
            fix="pass the balancer in front of this host, or none",
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    state.runs += 1
    url, tunnel, _how = endpoint(a.host, t.host_vars, t.plan.service)
    stopped: str | None = None
    try:
        if balancer is not None:
            set_down(balancer, a.host, True)
            print(f"tune: {a.host} drained in {balancer}", file=sys.stderr)
        else:
            print(f"tune: no --balancer: {a.host} keeps any clients it has while tuning, and "
                  "they are measured with it", file=sys.stderr)  # fmt: skip
        stopped = sweep(t, state, dims, a, objective, bench, url, out_dir)
    except KeyboardInterrupt:
        print(interrupted(a, t, balancer), file=sys.stderr)
        return 130
    finally:
        if tunnel is not None:
            tunnel.terminate()
    return finish(a, t, state, dims, left_out, objective, bench, out_dir, balancer, stopped)


def interrupted(a: argparse.Namespace, t: Target, balancer: Path | None) -> str:
    lb = f" --balancer {balancer}" if balancer else ""
    return (
        f"tune interrupted: {a.host} runs the last candidate tried"
        + (" and is drained in the balancer" if balancer else "")
        + f". Everything measured is in {a.state}: run the same command again to resume, or "
        f"`vfleet swap {a.host} -i {a.inventory} --model {t.model}{lb}` to put the host back."
    )


def finish(
    a: argparse.Namespace,
    t: Target,
    state: State,
    dims: Sequence[Any],
    left_out: dict[str, str],
    objective: Objective,
    bench: BenchPlan,
    out_dir: Path,
    balancer: Path | None,
    stopped: str | None,
) -> int:
    from dataclasses import asdict

    winner = state.winner(objective)
    counts = {s: sum(r.status == s for r in state.results.values())
              for s in ("measured", "skipped", "failed")}  # fmt: skip
    doc: dict[str, Any] = {
        "host": a.host,
        "profile": t.profile,
        "model": t.model,
        "instance": t.launch.instance,
        "search": a.search,
        "dimensions": [d.name for d in dims],
        "left_out": left_out,
        "bench": asdict(bench),
        "command": shlex.join(["vfleet", "tune", *sys.argv[2:]])
        if len(sys.argv) > 2
        else f"vfleet tune {a.host}",
        "stopped": stopped,
        **counts,
        "unmeasured": "unknown (climb)" if a.search == "climb" and stopped else
        (all_candidates(dims) - len(state.results) if a.search == "grid" else 0),
        "state_file": str(a.state),
        "runs": state.runs,
    }  # fmt: skip
    old = read_tuned(t.inventory, a.host)
    new = merged_sets(old, winner.sets) if winner else old
    changed = new != old and not a.no_rollout
    # The table beside the overrides is refreshed by every run that found a best candidate.
    write = winner is not None and not a.no_rollout
    doc["overrides"] = {"before": mask(old), "after": mask(new), "written": write}
    written = write_report(out_dir, doc, state, objective, winner)
    print("\n".join(table(state, objective, winner)))
    if write:
        header = (
            f"Written by `{doc['command']}` at "
            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}.\n"
            f"Objective: {objective.describe()}.\nBest of {counts['measured']} measured: "
            f"{winner.key if winner else '-'}. The measured table is in vfleet_tuned.md beside "
            f"this file; the full report in {out_dir.resolve()}/tune.md."
        )
        paths = write_overrides(t.inventory, a.host, new, header, (out_dir / "tune.md").read_text())
        written += list(paths)
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    if winner is None:
        print(f"tune: nothing measured met the objective; {a.host} goes back to its "
              "configured release", file=sys.stderr)  # fmt: skip
    # The rollout: the inventory's settings (with the new tuned set) through the gated swap,
    # which admits the host to the balancer again. Without a change it puts the host back to
    # the release its inventory describes.
    if write and winner is not None:
        doc["step_times"] = write_step_times(t, state, winner, bench, out_dir)
    what = "rolling out " + winner.key if changed and winner else "putting the host back"
    print(f"tune: {what} through vfleet swap", file=sys.stderr, flush=True)
    done = swap(t, [], out_dir / SWAP_LOG, balancer, objective.concurrency)
    print(f"tune: {a.host}: {done.said}", file=sys.stderr)
    if done.perf is not None:
        reasons = "; ".join(map(str, done.perf.get("reasons") or []))
        print(f"tune: performance gate: {done.perf.get('state')} ({reasons})", file=sys.stderr)
    if done.rc != 0 and write:
        # The gates refused the winner: the inventory must not say otherwise.
        write_overrides(t.inventory, a.host, old, "Restored: the tuned rollout failed.", "")
        print(f"tune: the rollout failed; {host_vars_dir(t.inventory, a.host) / OVERRIDES_FILE} "
              "holds the settings from before again", file=sys.stderr)  # fmt: skip
    doc["rollout"] = {"what": what, "rc": done.rc, "outcome": done.said, "perf": done.perf}
    write_report(out_dir, doc, state, objective, winner)
    return 1 if done.rc != 0 or winner is None else 0


def mask(sets: list[str]) -> list[str]:
    return [s if not s.startswith("api_key=") else "api_key=***" for s in sets]


def dry_run(
    t: Target, dims: Sequence[Any], left_out: dict[str, str], state: State, a: argparse.Namespace
) -> int:
    """The space, and for a grid every candidate's verdict; nothing is deployed."""
    import itertools

    print(f"{a.host}: profile {t.profile}, model {t.model}, instance {t.launch.instance}")
    for d in dims:
        labels = ", ".join(
            c.label + (" (now)" if i == d.start else "") for i, c in enumerate(d.choices)
        )
        print(f"  {d.name}: {labels}  -- {d.why}")
    for name, why in left_out.items():
        print(f"  not swept: {name}: {why}")
    print(f"{all_candidates(dims)} combination(s); the state file holds {len(state.results)}")
    for idx in itertools.product(*(range(len(d.choices)) for d in dims)):
        c = candidate(dims, {d.name: i for d, i in zip(dims, idx, strict=True)})
        skip = infeasible(t.resolve_with, c)
        done = state.results.get(c.key)
        said = (
            f"{done.status} (run {done.run})"
            if done
            else (f"would skip: {skip}" if skip else "fits")
        )
        print(f"  {c.key}: {said}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:

    p = sub.add_parser(
        "tune",
        help="measure the settings the rules allow on one host, keep and roll out the best",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("host", metavar="HOST", help="one inventory host")
    inventory_arg(p)
    p.add_argument("--instance", metavar="NAME", help="instance (default: vfleet_instance, main)")
    p.add_argument("--base-dir", metavar="DIR", help="vfleet's folder on the host")
    p.add_argument(
        "--sweep",
        metavar="DIMS",
        help=f"comma-separated dimensions (default: every one that applies): {', '.join(BUILDERS)}",
    )
    p.add_argument(
        "--depths", default="0,1,2,3,4", help="MTP depths to try, 0 = off (default %(default)s)"
    )
    p.add_argument("--search", choices=SEARCHES, default="climb", help="climb (default) or grid")
    p.add_argument(
        "--margin",
        type=float,
        default=0.05,
        help="climb: stop walking a way once a value is this fraction below the best (0.05)",
    )
    p.add_argument("--objective", choices=OBJECTIVES, default="decode", help="what to maximise")
    p.add_argument("--concurrency", type=int, default=1, help="simultaneous requests (1)")
    p.add_argument("--ttft-slo", type=float, metavar="S", help="TTFT p95 limit, seconds")
    p.add_argument("--budget", type=float, default=60.0, help="minutes for the sweep (60)")
    p.add_argument("--repeats", type=int, default=3, help="batches measured per candidate (3)")
    p.add_argument(
        "--decode-tokens", type=int, default=256, help="tokens generated per request (256)"
    )
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length (256)")
    p.add_argument(
        "--bench-limit", type=float, default=300.0, help="seconds one candidate's bench may take"
    )
    p.add_argument(
        "--balancer",
        metavar="DIR",
        help="the `vfleet balancer` folder in front of the host: drained while tuning, "
        "admitted again by the rollout",
    )
    p.add_argument("--out", type=Path, metavar="DIR", help="report and state (tune-HOST)")
    p.add_argument("--state", type=Path, metavar="FILE", help="state file (OUT/state.json)")
    p.add_argument(
        "--no-rollout",
        action="store_true",
        help="measure and report only: the overrides are not written, the host is put back",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print the space and what fits; deploy nothing"
    )
    p.set_defaults(fn=cmd_tune)


# --------------------------------------------------------------------------- step times


def step_times(state: State, winner: Result) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds per engine step per depth, and accepted draft tokens per draft per depth >= 1
    (depth x acceptance rate), from the candidates that differ from the winner in the depth
    alone (the same chunk, graphs, threads): what the sidecar divides by, and what carries its
    recommendation past the running depth (vfleet_healthcheck.depth)."""
    others = {k: v for k, v in winner.picks.items() if k != "depth"}
    seconds: dict[int, float] = {}
    accepted: dict[int, float] = {}
    for r in state.results.values():
        m = r.measurement
        same = {k: v for k, v in r.picks.items() if k != "depth"} == others
        if "depth" in r.picks and same and m is not None and m.step_time_s:
            depth = int(r.picks["depth"])
            seconds[depth] = m.step_time_s
            if depth >= 1 and m.acceptance_rate is not None:
                accepted[depth] = round(min(1.0, max(0.0, m.acceptance_rate)) * depth, 4)
    return seconds, accepted


def write_step_times(
    t: Target, state: State, winner: Result, bench: BenchPlan, out_dir: Path
) -> dict[str, Any] | None:
    """The measured seconds per step per depth, in vfleet_healthcheck.depth's format: into
    OUT/step-times.json and the instance folder on the host, where the sidecar reads it for its
    recommended depth. None when no depth was measured beside the winner."""
    from vfleet_healthcheck.depth import StepTimes, save_step_times

    times, accepted = step_times(state, winner)
    if not times:
        return None
    table = StepTimes.measured(
        times,
        method=f"vfleet tune {t.host}: bench concurrency scenario, {bench.repeats} x "
        f"{bench.concurrency} request(s) of {bench.decode_tokens} tokens after "
        f"{bench.prompt_tokens}; tokens per step / (concurrency x decode tok/s); accepted per "
        "draft = depth x accepted / draft tokens (vLLM's counters)",
        concurrency=bench.concurrency,
        accepted_per_draft=accepted,
    )
    model = cost_model_check(t, state, winner, times)
    local = out_dir / STEP_TIMES_FILE
    save_step_times(local, table)
    on_host = t.launch.host.step_times_file(t.launch.instance)
    why = put_file(t, on_host, local.read_text(encoding="utf-8"))
    said = f"step times of depths {sorted(times)} -> {t.host}:{on_host}"
    print(f"tune: {said}" + (f" NOT copied: {why}" if why else ""), file=sys.stderr)
    return {
        "file": str(local),
        "host_path": on_host,
        "depths": sorted(times),
        "not_copied": why,
        "cost_model": model,
    }


def cost_model_check(
    t: Target, state: State, winner: Result, times: dict[int, float]
) -> dict[str, Any]:
    """How far the decode cost model (docs/TUNE.md, "The cost model"), which the sidecar uses
    where no table exists, is from the depths this tune measured on this box: each shallower
    depth modelled from the deepest one's step, as the sidecar models from a running depth
    (planned with that candidate's settings: a depth-0 winner has no MTP to model). Said on
    stderr and kept in tune.json."""
    from vfleet_healthcheck.depth import StepCost

    base = max(times)
    others = {k: v for k, v in winner.picks.items() if k != "depth"}
    deepest = next(
        (r for r in state.results.values()
         if r.picks.get("depth") == str(base)
         and {k: v for k, v in r.picks.items() if k != "depth"} == others),
        None,
    )  # fmt: skip
    cost, why = None, ""
    if base == 0 or len(times) < 2 or deepest is None:
        why = "fewer than two depths measured beside the winner, one of them with MTP"
    else:
        try:  # a report line: it must never stop the rollout that follows
            cost = decode_cost(t.resolve_with(deepest.sets)).sidecar()
        except VfleetError as exc:
            why = f"the plan of MTP {base}: {exc.message}"
        else:
            if cost is None:
                why = "no memory-bandwidth figure for this card (accelerator.memory_bandwidth_gbs)"
    if cost is not None and not why:
        errors = StepCost.from_json(cost, "decode_cost").errors(times, base)
        said = ", ".join(f"MTP {d} {e * 100:+.1f}%" for d, e in errors.items())
        print(f"tune: the decode cost model from MTP {base}'s step: {said}", file=sys.stderr)
        return {
            "from_depth": base,
            "error_by_depth": {str(d): round(e, 4) for d, e in errors.items()},
        }
    print(f"tune: decode cost model not checked: {why}", file=sys.stderr)
    return {"not_checked": why}


def put_file_script(path: str) -> str:
    """The sh script that writes its stdin to `path`, replaced whole, as the deploy's user
    (root where the deploy becomes root).

    It writes only into a folder of that user alone: not a link, owned by the user, not
    writable by group or others (the instance folder is root's; a service user who could
    write there could plant a link for root to follow). The new file is a fresh mktemp name,
    renamed over `path`: a link planted at `path` is replaced, never written through. Exit 3
    with the reason on stderr otherwise."""
    d, f = shlex.quote(path.rsplit("/", 1)[0]), shlex.quote(path)
    return (
        f'set -eu; d={d}; mkdir -p "$d"; '
        'if [ -L "$d" ] || [ "$(stat -c %u "$d")" != "$(id -u)" ] || '
        '[ -n "$(find "$d" -maxdepth 0 -perm /022)" ]; then '
        'echo "$d is not a folder of $(id -un) alone (a link, another owner, or writable by '
        'group or others): nothing written" >&2; exit 3; fi; '
        't=$(mktemp "$d/.vfleet-put.XXXXXX"); '
        f'cat > "$t"; chmod 0644 "$t"; mv -fT "$t" {f}'
    )


def put_file(t: Target, path: str, text: str) -> str | None:
    """Write `text` to `path` on the host (over ssh as the deploy reaches it, or locally),
    replaced whole (put_file_script); why it could not be, or None."""
    command = [*become(t.host_vars, t.host), "sh", "-c", put_file_script(path)]
    local = str(literal(t.host_vars, "ansible_connection", t.host)) == "local"
    argv = command if local else [*ssh_argv(t.host, t.host_vars), shlex.join(command)]
    try:
        r = subprocess.run(
            argv, input=text, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if r.returncode == 0 else f"exit {r.returncode}: {r.stderr.strip()[-300:]}"
