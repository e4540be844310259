"""`vfleet swap HOSTS --model M`: the rolling model swap, and what it cost each host.

The swap is `ansible/swap.yml`: a batch of hosts at a time (one host first, the canary), each
host deployed with every gate of a deploy; a host that fails a gate goes back to its previous
release and the rollout stops. This command runs that playbook and, while it runs, watches
every host's instance from this machine: a real one-token generation every --interval
seconds. Its report gives per host the model before and after, the downtime (time with no
successful generation, from the last success before a failure to the first one after) and
the outcome. On a single box with no spare capacity the swap is stop -> start -> gate, and
the downtime is what it cost; behind a balancer it is the time the host was out of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vfleet.config.apikey import read_api_key_file, refuse_key_in_sets
from vfleet.config.escape import host_name
from vfleet.config.profiles import profiles_dir
from vfleet.errors import VfleetError
from vfleet.fleet.balancer import load
from vfleet.fleet.inventory import (
    ANSIBLE_CFG,
    ansible_bin,
    api_key_file_arg,
    host_namespace,
    host_plan,
    host_settings,
    host_vars,
    hosts_of,
    inventory_arg,
)
from vfleet.fleet.perfgate import (
    DEFAULT_CONCURRENCY,
    Verdict,
    require,
)
from vfleet.fleet.perfgate_run import default_tolerances_text, parse_tolerances
from vfleet.fleet.targets import endpoint
from vfleet.paths import REPO_ROOT

PLAYBOOK = REPO_ROOT / "ansible" / "swap.yml"
DEFAULT_SERIAL = "1,50%"
PROBE_TIMEOUT_S = 30.0
BALANCER = "(balancer)"  # the report's row for the balancer's own endpoint
SERIAL_ITEM = re.compile(r"^(\d+|\d+%)$")

EXAMPLES = """\
examples:
  vfleet swap localhost --model tiny-dense            # one box: stop, start, gate, report
  vfleet swap cpu_fleet -i inv.yml --model tiny-dense # one host first, then half the rest
  vfleet swap node1 -i inv.yml -m tiny-dense --set served_model_name=chat
  make swap HOST=cpu_fleet MODEL=tiny-dense INVENTORY=inv.yml

exit status: 0 every host swapped and serving; 1 the rollout stopped (a host failed a gate
and was rolled back, or was unreachable); 2 bad input (nothing was started).
"""


# --------------------------------------------------------------------------- watching


@dataclass
class Sample:
    t: float  # seconds since the swap started
    ok: bool
    model: str | None = None  # the served name clients use
    weights: str | None = None  # the model folder's name behind it (vLLM's `root`)
    error: str | None = None


@dataclass
class Outage:
    start: float
    end: float
    ongoing: bool  # still failing at the last sample

    @property
    def seconds(self) -> float:
        return self.end - self.start


def outages(samples: list[Sample]) -> list[Outage]:
    """Stretches with no successful generation: from the last success before a failure (or the
    first failure, if none came before) to the first success after it."""
    out: list[Outage] = []
    last_ok: float | None = None
    start: float | None = None
    for s in samples:
        if s.ok:
            if start is not None:
                out.append(Outage(start, s.t, ongoing=False))
                start = None
            last_ok = s.t
        elif start is None:
            start = last_ok if last_ok is not None else s.t
    if start is not None:
        out.append(Outage(start, samples[-1].t, ongoing=True))
    return out


class Watcher(threading.Thread):
    """One host's instance, probed with a real generation until stopped."""

    def __init__(
        self, host: str, url: str, api_key: str | None, interval: float, t0: float
    ) -> None:
        super().__init__(name=f"watch-{host}", daemon=True)
        self.host, self.url, self.interval, self.t0 = host, url.rstrip("/"), interval, t0
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.samples: list[Sample] = []
        self.done = threading.Event()

    def _call(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode() if body is not None else None,
            headers=self.headers,
        )
        # Bounded: one token. Slow is not down (a busy host still serves); no answer in 30 s is.
        with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def probe(self) -> Sample:
        t = time.monotonic() - self.t0
        try:
            card = self._call("/v1/models")["data"][0]
            model = str(card["id"])
            self._call("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 1})
            return Sample(t, True, model, Path(str(card.get("root") or model)).name)
        except (OSError, ValueError, KeyError, IndexError) as exc:
            return Sample(t, False, error=f"{type(exc).__name__}: {exc}"[:200])

    def run(self) -> None:
        while True:
            self.samples.append(self.probe())
            if self.done.wait(self.interval):
                self.samples.append(self.probe())  # the state once the playbook ended
                return


# --------------------------------------------------------------------------- the report


@dataclass
class HostReport:
    host: str
    url: str
    expected_model: str  # the served name the new release has
    expected_weights: str | None = None  # and the model folder it loads
    model_before: str | None = None
    model_after: str | None = None
    weights_before: str | None = None  # the model folder behind the served name
    weights_after: str | None = None
    recap: dict[str, int] | None = None  # None: the rollout never reached this host
    downtime_s: float = 0.0
    outages: list[dict[str, Any]] = field(default_factory=list)
    outcome: str = ""
    why: str | None = None  # the playbook's message for a failed or unreachable host
    left_drained: bool = False  # still out of the balancer when the swap ended
    # Times systemd restarted vLLM by itself before the new start served (the role waits for
    # vfleet_start_retries such restarts: a worker that died at its warmup, say): 0 where none.
    self_restarts: int = 0
    perf: Verdict | None = None  # the performance gate's verdict; None: it did not run here

    @property
    def still_down(self) -> bool:
        return any(o["ongoing"] for o in self.outages)


RECAP = re.compile(r"^(\S+)\s+:\s+((?:\w+=\d+\s*)+)$")


def parse_recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP lines: host -> {ok, changed, unreachable, failed, skipped, rescued, ...}."""
    tail = output.rsplit("PLAY RECAP", 1)[-1] if "PLAY RECAP" in output else ""
    out: dict[str, dict[str, int]] = {}
    for line in tail.splitlines():
        m = RECAP.match(line.strip())
        if m:
            out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return out


FATAL = re.compile(r"^fatal: \[([^\]]+)\](?: -> [^:]+)?: (FAILED|UNREACHABLE)! => (.*)$")


def host_errors(output: str) -> dict[str, str]:
    """The last `fatal:` message per host: why it failed or could not be reached.

    The swap's own "Stop the rollout" message wins over the failed task it reports on; an
    unreachable host has no rescue, so its ssh error is the reason."""
    out: dict[str, str] = {}
    for line in output.splitlines():
        m = FATAL.match(line.strip())
        if not m:
            continue
        host, kind, rest = m.groups()
        try:
            msg = str(json.loads(rest).get("msg", rest))
        except (json.JSONDecodeError, AttributeError):
            msg = rest
        out[host] = ("unreachable: " if kind == "UNREACHABLE" else "") + " ".join(msg.split())
    return out


RESTARTED = re.compile(r"systemd restarted it (\d+) time\(s\) by itself")
TASK_RESULT = re.compile(r"^(?:ok|changed|fatal|skipping): \[([^\]]+)\]")


def self_restarts(output: str) -> dict[str, int]:
    """Per host, the restarts the role said systemd made by itself (ready.yml's "Say that
    systemd restarted vLLM by itself"): the last such line per host. A task's result starts at
    its host's line; its message may wrap over the lines that follow (result_format yaml)."""
    out: dict[str, int] = {}
    host, block = "", []
    for line in [*output.splitlines(), "ok: [-]"]:
        m = TASK_RESULT.match(line)
        if m is None and not line.startswith(("TASK ", "PLAY ")):
            block.append(line)
            continue
        said = RESTARTED.search(" ".join(" ".join(block).split()))
        if host and said:
            out[host] = int(said.group(1))
        host, block = (m.group(1).split(" -> ")[0], [line]) if m else ("", [])
    return out


def outcome(r: HostReport) -> str:
    said = _outcome(r)
    if r.self_restarts:
        said += f" (after {r.self_restarts} restart(s) systemd made by itself: see why)"
    return said + "; left drained in the balancer" if r.left_drained else said


def _outcome(r: HostReport) -> str:
    if r.host == BALANCER:
        return "what clients saw: " + ("serving" if r.model_after else "NOT serving at the end")
    if r.recap is None:
        return "not touched: the rollout stopped before its batch"
    serving = r.model_after is not None
    if r.recap.get("unreachable"):
        return "lost (unreachable) during its swap: the rollout stopped; see why"
    if r.recap.get("failed"):
        if serving and (r.model_after, r.weights_after) == (r.model_before, r.weights_before):
            now = _shown(r.model_after, r.weights_after)
            return f"failed a gate; back on {now} (previous release), serving"
        return "failed a gate and is NOT serving: see the playbook output above"
    now = _shown(r.model_after, r.weights_after)
    if r.model_after == r.expected_model and r.weights_after in (None, r.expected_weights):
        return f"swapped to {now}"
    want = _shown(r.expected_model, r.expected_weights)
    return f"playbook ok, but it serves {now}, not {want}"


def _shown(name: str | None, weights: str | None) -> str:
    if name is None:
        return "-"
    return name if weights in (None, name) else f"{weights} as {name}"


def report_text(reports: list[HostReport], rc: int, seconds: float) -> str:
    head = ("host", "before", "after", "downtime", "outcome")
    rows = [
        (
            r.host,
            _shown(r.model_before, r.weights_before),
            _shown(r.model_after, r.weights_after),
            f"{r.downtime_s:.1f} s" + (" (still down)" if r.still_down else ""),
            r.outcome,
        )
        for r in reports
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    lines = ["", f"swap {'done' if rc == 0 else 'STOPPED'} in {seconds:.0f} s"]
    for row in (head, *rows):
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())
    for r in reports:
        if r.why and not (r.perf and r.perf.state == "fail"):
            lines.append(f"why {r.host}: {textwrap.shorten(r.why, 400)}")
        elif r.self_restarts:
            lines.append(
                f"why {r.host} restarted: its vLLM ended after the new start served and systemd "
                "started it again; the log says why, before launch.sh's last mark "
                f"(vfleet doctor {r.host})"
            )
    for r in reports:
        if r.perf is not None:
            lines.append(f"{r.host}: " + r.perf.text())
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command


def parse_serial(text: str) -> list[int | str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items or not all(SERIAL_ITEM.match(x) for x in items):
        raise VfleetError(
            f"--serial {text!r} is not a list of batch sizes",
            key="--serial",
            fix="give sizes or percentages, e.g. 1,50% (one host first, then half the rest)",
        )
    return [x if x.endswith("%") else int(x) for x in items]


def perf_args(a: argparse.Namespace) -> list[str]:
    """`vfleet perf-gate check`'s bench and tolerance options, from swap's --perf-*."""

    require()
    parse_tolerances(a.perf_tolerance or [])  # bad input stops here, before anything runs
    if a.perf_concurrency < 1:
        raise VfleetError("must be 1 or more", key="--perf-concurrency", fix="e.g. 4")
    out = ["--concurrency", str(a.perf_concurrency)]
    for t in a.perf_tolerance or []:
        out += ["--tolerance", t]
    return out


def playbook_argv(
    a: argparse.Namespace, serial: list[int | str], perf_dir: Path | None = None
) -> list[str]:
    extra: dict[str, Any] = {
        "vfleet_hosts": a.hosts,
        "vfleet_model": a.model,
        "vfleet_extra_set": list(a.sets or []),
        "vfleet_swap_serial": serial,
    }
    if a.instance:
        extra["vfleet_instance"] = a.instance
    if getattr(a, "api_key_file", None):
        # The file's path, never the key: this argv is readable by every local user.
        extra["vfleet_api_key_file"] = str(Path(a.api_key_file).resolve())
    if a.base_dir:
        extra["vfleet_base_dir"] = a.base_dir
    if a.balancer:
        extra["vfleet_balancer_dir"] = str(Path(a.balancer).resolve())
    if perf_dir is not None:
        extra["vfleet_perf_gate"] = {
            "inventory": str(Path(a.inventory).resolve()),
            "report_dir": str(perf_dir),
            "args": perf_args(a),
        }
    return [
        ansible_bin("ansible-playbook"),
        "-i",
        a.inventory,
        str(PLAYBOOK),
        "-e",
        json.dumps(extra),
    ]


def _api_key(sets: list[str], api_key_file: str | None) -> str | None:
    """The key the swapped instance will want: from its key file, else its settings."""

    if api_key_file:
        return read_api_key_file(api_key_file)
    keys = [s.split("=", 1)[1] for s in sets if s.startswith("api_key=")]
    return keys[-1] if keys else None


def cmd_swap(a: argparse.Namespace) -> int:

    refuse_key_in_sets(
        a.sets or [],
        fix="--api-key-file FILE (the key on one line, chmod 600), or api_key in the "
        "inventory's vfleet_set from a vault variable",
    )
    if not (profiles_dir() / "models" / f"{a.model}.yaml").exists():
        names = sorted(p.stem for p in (profiles_dir() / "models").glob("*.yaml"))
        raise VfleetError(
            f"unknown model preset {a.model!r}",
            where=str(profiles_dir() / "models"),
            key="--model",
            fix=f"one of: {', '.join(names)}",
        )
    serial = parse_serial(a.serial)
    if a.interval <= 0:
        raise VfleetError("--interval must be > 0", key="--interval", fix="e.g. --interval 1")
    hosts = hosts_of(a.inventory, a.hosts)
    front: HostReport | None = None
    if a.balancer:
        lb = load(Path(a.balancer).resolve())
        outside = sorted(set(hosts) - {r["host"] for r in lb["replicas"]})
        if outside:
            raise VfleetError(
                f"not replicas of this balancer: {', '.join(outside)}",
                where=str(Path(a.balancer) / "balancer.json"),
                key="--balancer",
                fix=f"swap the balancer's group ({lb['group']}), or render it for these hosts",
            )
        front = HostReport(BALANCER, f"http://{lb['listen']}", str(lb["served_model_name"]))
    # The performance gate's per-host verdicts come back through this folder (--report-dir).
    perf_dir = None if a.no_perf_gate else Path(tempfile.mkdtemp(prefix="vfleet-perf-"))
    argv = playbook_argv(a, serial, perf_dir)
    # Each host's instance as it is now and as the swap will make it: its URL (an ssh tunnel
    # where vLLM listens on the host's loopback) and the model name the new release serves.
    targets: list[Target] = []
    tunnels = []
    try:
        for host in hosts:
            hv = host_vars(a.inventory, host)
            here = host_namespace(a.inventory, host, None, a.instance, a.base_dir, a.api_key_file)
            now, _ = host_plan(here, hv)
            settings = host_settings(here, hv)
            sets = list(settings["sets"]) + list(a.sets or [])
            ns = host_namespace(a.inventory, host, a.model, a.instance, a.base_dir, a.api_key_file)
            ns.sets = sets
            new, _ = host_plan(ns, hv)
            if a.dry_run:
                url, tunnel = now.service.url, None
            else:
                url, tunnel, _how = endpoint(host, hv, now.service)
            if tunnel is not None:
                tunnels.append(tunnel)
            report = HostReport(host, url, new.service.served_model_name, Path(new.model.dir).name)
            targets.append((report, _api_key(sets, settings["api_key_file"])))
        if a.dry_run:
            print(" ".join(argv))
            for r, _key in targets:
                print(f"{r.host}: watch {r.url}, expect {r.expected_model} after the swap")
            return 0
        if front is not None:
            # What clients see: the balancer's own endpoint, with the first host's key.
            targets.append((front, targets[0][1] if targets else None))
        return _run(a, argv, targets, perf_dir)
    finally:
        if perf_dir is not None:
            shutil.rmtree(perf_dir, ignore_errors=True)
        for t in tunnels:
            t.terminate()


Target = tuple[HostReport, str | None]  # a host's report-to-be and its API key, if any


def _run(
    a: argparse.Namespace, argv: list[str], targets: list[Target], perf_dir: Path | None
) -> int:
    t0 = time.monotonic()
    watchers = [Watcher(r.host, r.url, key, a.interval, t0) for r, key in targets]
    for w in watchers:
        w.start()
    out = sys.stderr if a.json else sys.stdout
    print(f"swapping {len(targets)} host(s) to {a.model}; watching each with a generation "
          f"every {a.interval:g} s", file=out, flush=True)  # fmt: skip
    env = dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_CFG), ANSIBLE_NOCOLOR="1")
    # stdin: a /dev/null of its own. ansible-playbook refuses to start on a non-blocking stdin
    # ("Ansible requires blocking IO"), and an inherited one is shared with whatever else holds
    # it: a Node.js process (pm2) beside it may set O_NONBLOCK on that shared description.
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO_ROOT,
    )
    seen: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the playbook's progress, as it comes
        seen.append(line)
        out.write(line)
        out.flush()
    rc = proc.wait()
    for w in watchers:
        w.done.set()
    for w in watchers:
        w.join(timeout=60)
    recaps = parse_recap("".join(seen))
    errors = host_errors("".join(seen))
    restarts = self_restarts("".join(seen))
    drained: set[str] = set()
    if a.balancer:
        drained = {x["host"] for x in load(Path(a.balancer).resolve())["replicas"] if x["down"]}
    reports = []
    for (r, _key), w in zip(targets, watchers, strict=True):
        ok = [s for s in w.samples if s.ok]
        first = ok[0] if ok and w.samples[0].ok else None
        last = w.samples[-1] if w.samples and w.samples[-1].ok else None
        r.model_before, r.weights_before = (first.model, first.weights) if first else (None, None)
        r.model_after, r.weights_after = (last.model, last.weights) if last else (None, None)
        r.recap = recaps.get(r.host)
        r.why = errors.get(r.host)
        r.left_drained = r.host in drained
        r.self_restarts = restarts.get(r.host, 0)
        found = outages(w.samples)
        r.outages = [asdict(o) | {"seconds": round(o.seconds, 1)} for o in found]
        r.downtime_s = round(sum(o.seconds for o in found), 1)
        r.perf = _perf_verdict(perf_dir, r.host)
        r.outcome = outcome(r)
        reports.append(r)
    seconds = time.monotonic() - t0
    if a.json:
        print(json.dumps({"rc": rc, "seconds": round(seconds, 1),
                          "hosts": [asdict(r) for r in reports]}, indent=2))  # fmt: skip
    else:
        print(report_text(reports, rc, seconds))
    return 0 if rc == 0 else 1


def _perf_verdict(folder: Path | None, host: str) -> Verdict | None:
    """The performance gate's verdict for an inventory host; none for the balancer's own row
    (BALANCER is a report row, never a host: no gate, and not a name to check as a path)."""
    if folder is None or host == BALANCER:
        return None
    path = folder / f"{host_name(host)}.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return Verdict.from_dict(data["verdict"])


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:

    p = sub.add_parser(
        "swap",
        help="move hosts to another model, canary first; roll back and stop on a failed gate",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("hosts", metavar="HOSTS", help="inventory host, group or pattern")
    p.add_argument("-m", "--model", required=True, help="the model preset to swap to")
    inventory_arg(p)
    p.add_argument("--instance", metavar="NAME", help="instance (default: vfleet_instance, main)")
    p.add_argument(
        "--set",
        "-s",
        dest="sets",
        action="append",
        metavar="KEY=VALUE",
        help="a setting for the new release, after each host's own vfleet_set (repeatable; "
        "never api_key: see --api-key-file)",
    )
    api_key_file_arg(p)
    p.add_argument(
        "--serial",
        default=DEFAULT_SERIAL,
        help="batch sizes, hosts or percentages, comma-separated (default %(default)s: a canary "
        "of one host, then half of the rest per batch)",
    )
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between watch generations (1)"
    )
    p.add_argument(
        "--balancer",
        metavar="DIR",
        help="a `vfleet balancer` folder: drain each host in it first, admit it once gated, "
        "and watch the balancer's endpoint too (what clients see)",
    )
    gate = p.add_argument_group(
        "performance gate (docs/SWAP.md): after the health gates, bench each new release and "
        "roll it back when it is slower than the release it replaces on that host"
    )
    gate.add_argument(
        "--no-perf-gate",
        action="store_true",
        help="skip it (the new release is neither measured nor compared)",
    )
    gate.add_argument(
        "--perf-concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        metavar="N",
        help="simultaneous requests in the bench: the concurrency your clients run at "
        "(default %(default)s; a reference measured at another one is not compared)",
    )
    gate.add_argument(
        "--perf-tolerance",
        action="append",
        metavar="FIGURE=FRACTION",
        help="allowed change in the worse direction, e.g. output_tps=0.2 (repeatable; "
        "defaults from measured noise: " + default_tolerances_text() + ")",
    )
    p.add_argument("--base-dir", metavar="DIR", help="vfleet's folder on the hosts")
    p.add_argument("--json", action="store_true", help="the report as JSON (progress on stderr)")
    p.add_argument("--dry-run", action="store_true", help="print the playbook command and hosts")
    p.set_defaults(fn=cmd_swap)
