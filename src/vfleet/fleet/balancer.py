"""`vfleet balancer`: nginx in front of the replicas of a model group, and its drain switch.

`render GROUP` reads the group's hosts from the inventory and writes, into one folder:
`balancer.json` (the replicas, the served model name, which replicas are drained) and
`nginx.conf` (a whole configuration for a dedicated nginx, its pid, logs and temp files in
that folder). `drain HOST` / `admit HOST` flip one replica's `down` flag under a lock (a
swap batch drains several hosts at once), render again, check the result with `nginx -t`,
and reload nginx when it runs; `flip` (for `vfleet switch`) admits one replica and drains
another in one reload, and `workers_gone` waits until the old workers have finished what they
held. Only the allowed routes (vfleet.engine.api_routes) are forwarded;
the rest is answered 404. A reload is graceful: new workers stop sending new requests
to a drained replica at once; the old workers finish the requests they hold.

nginx (open source) has no active health checks: a replica that refuses connections is
skipped for `fail_timeout` (passive), and the request is retried on the next replica. A
replica that is up but not ready is kept out by the swap, which admits a host only after
every readiness gate passed. docs/SWAP.md has the whole behaviour.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vfleet.config.defaults import NGINX, NGINX_PACKAGE, STOP_MARGIN_S
from vfleet.engine.api_routes import ALLOWED_ROUTES
from vfleet.errors import VfleetError
from vfleet.fleet.inventory import (
    address,
    host_namespace,
    host_plan,
    host_vars,
    hosts_of,
    inventory_arg,
    is_local,
)
from vfleet.render.release import template_env

STATE = "balancer.json"
CONF = "nginx.conf"
DEFAULTS = {"max_fails": 1, "fail_timeout_s": 10, "read_timeout_s": 600}


@dataclass
class Replica:
    host: str
    address: str
    port: int
    down: bool = False


def _nginx() -> str:
    found = shutil.which("nginx") or (NGINX if Path(NGINX).exists() else None)
    if not found:
        raise VfleetError(
            "nginx not found", fix=f"apt-get install {NGINX_PACKAGE} (make deps does)"
        )
    return found


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace one file whole (temp file + rename): a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def render_conf(state: dict[str, Any], prefix: Path) -> str:
    replicas = [Replica(**r) for r in state["replicas"]]
    return (
        template_env()
        .get_template("nginx-balancer.conf.j2")
        .render(
            managed="rendered by vfleet balancer: edit balancer.json or re-render, not this file",
            group=state["group"],
            served_model_name=state["served_model_name"],
            upstream="vfleet_" + "".join(c if c.isalnum() else "_" for c in state["group"]),
            replicas=replicas,
            listen=state["listen"],
            drain_timeout_s=state["drain_timeout_s"],
            conf=prefix / CONF,
            prefix=prefix,
            routes=ALLOWED_ROUTES,
            replica_header=bool(state.get("replica_header")),
            **DEFAULTS,
        )
    )


def test_conf(prefix: Path, text: str) -> None:
    """`nginx -t` on the text before it replaces nginx.conf: a bad render never lands."""
    candidate = prefix / f".{CONF}.candidate"
    candidate.write_text(text, encoding="utf-8")
    try:
        r = subprocess.run(
            [_nginx(), "-t", "-q", "-c", str(candidate), "-p", f"{prefix}/"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        candidate.unlink(missing_ok=True)
    if r.returncode != 0:
        raise VfleetError(
            f"nginx -t refused the configuration: {r.stderr.strip()}", where=str(prefix)
        )


def save(prefix: Path, state: dict[str, Any]) -> None:
    """Render, test, then write both files and reload nginx if it runs."""
    for sub in ("logs", "tmp"):
        (prefix / sub).mkdir(parents=True, exist_ok=True)
    text = render_conf(state, prefix)
    test_conf(prefix, text)
    _write(prefix / STATE, json.dumps(state, indent=2) + "\n")
    _write(prefix / CONF, text)
    pid = running_pid(prefix)
    if pid is not None:
        reload(pid)


def _workers(master: int) -> set[int]:
    try:
        text = Path(f"/proc/{master}/task/{master}/children").read_text()
    except OSError:
        return set()
    return {int(x) for x in text.split()}


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""  # gone


def reload(master: int, timeout: float = 10.0) -> None:
    """nginx's graceful reload, and wait until it took effect.

    SIGHUP returns at once; for a moment the old workers still accept new requests (with the
    old upstream list). A drain is done only once each old worker is gone or has stopped
    accepting ("worker process is shutting down"): it then finishes what it holds.
    """
    old = _workers(master)
    os.kill(master, signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all("shutting down" in t or not t for t in map(_title, old)) and (
            _workers(master) - old
        ):
            return
        time.sleep(0.02)
    raise VfleetError(
        f"nginx (pid {master}) did not reload within {timeout:.0f} s",
        fix="look at the balancer's logs/error.log",
    )


def load(prefix: Path) -> dict[str, Any]:
    path = prefix / STATE
    if not path.is_file():
        raise VfleetError(
            "no balancer here", where=str(path), fix="vfleet balancer render GROUP --dir DIR first"
        )
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


@contextmanager
def locked(prefix: Path) -> Iterator[None]:
    prefix.mkdir(parents=True, exist_ok=True)
    with (prefix / ".lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def running_pid(prefix: Path) -> int | None:
    """The pid of this balancer's nginx master, or None.

    A pid file left by an nginx that was killed names a number the kernel hands out again
    (pid_max is 32768 on many machines): that process is signalled only if it is an nginx
    master with this balancer's configuration, never whatever holds the number now.
    """
    try:
        pid = int((prefix / "nginx.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    title = _title(pid)
    if not title.startswith("nginx: master process") or str(prefix.resolve() / CONF) not in title:
        return None
    return pid


def set_down(prefix: Path, host: str, down: bool) -> dict[str, Any]:
    load(prefix)  # no balancer there: refused before the lock creates anything
    with locked(prefix):
        state = load(prefix)
        _require_replicas(prefix, state, (host,))
        for r in state["replicas"]:
            if r["host"] == host:
                r["down"] = down
        if all(r["down"] for r in state["replicas"]):
            raise VfleetError(
                f"draining {host} would leave no replica serving",
                where=str(prefix / STATE),
                fix="admit another replica first, or swap this group one host at a time",
            )
        save(prefix, state)
        return state


def _require_replicas(prefix: Path, state: dict[str, Any], hosts: tuple[str, ...]) -> None:
    names = [r["host"] for r in state["replicas"]]
    for host in hosts:
        if host not in names:
            raise VfleetError(
                f"{host!r} is not a replica of this balancer",
                where=str(prefix / STATE),
                fix=f"one of: {', '.join(names)}",
            )


def flip(prefix: Path, admit: str, drain: str) -> set[int]:
    """Admit `admit` and drain `drain` in ONE graceful reload (`vfleet switch`): from its return
    nginx sends every new request to `admit`. The old workers, which may still be forwarding
    what they accepted before, are returned for `workers_gone`."""
    load(prefix)
    with locked(prefix):
        state = load(prefix)
        _require_replicas(prefix, state, (admit, drain))
        for r in state["replicas"]:
            if r["host"] in (admit, drain):
                r["down"] = r["host"] == drain
        pid = running_pid(prefix)
        old = _workers(pid) if pid is not None else set()
        save(prefix, state)
    return old


def workers_gone(prefix: Path, old: set[int]) -> float:
    """Wait until nginx's old workers exited: the requests they held are finished, and nothing
    they accepted before a reload can still reach a drained replica. Seconds it took; bounded
    by the balancer's drain timeout."""
    limit = float(load(prefix)["drain_timeout_s"])
    t0 = time.monotonic()
    while any(_title(w) for w in old):
        if time.monotonic() - t0 > limit:
            raise VfleetError(
                f"nginx's old workers still hold requests after {limit:.0f} s",
                where=str(prefix),
                fix="look at the balancer's logs/error.log; a stream longer than the drain "
                "timeout keeps them",
            )
        time.sleep(0.02)
    return time.monotonic() - t0


def replicas_from_inventory(
    inventory: str, group: str, instance: str | None
) -> tuple[list[Replica], str, int]:
    """The group's replicas (address and port of each instance), their served model name, and
    the longest drain time (--shutdown-timeout) among them."""
    replicas: list[Replica] = []
    names: set[str] = set()
    drain = 0
    for host in hosts_of(inventory, group):
        hv = host_vars(inventory, host)
        plan, _ = host_plan(host_namespace(inventory, host, None, instance), hv)
        at = "127.0.0.1" if is_local(hv, host) else address(hv, host)
        # Through the replica's front where it has one (vLLM itself is then on loopback).
        listen, port = (
            (plan.front.host, plan.front.port)
            if plan.front
            else (plan.service.listen_host, plan.service.port)
        )
        if listen.startswith("127.") and not at.startswith("127."):
            raise VfleetError(
                f"{host}'s vLLM listens on {listen}: a balancer elsewhere cannot reach it",
                where=f"inventory host {host}",
                fix="set host=0.0.0.0 in its vfleet_set, give it an API key (vfleet_api_key_file) "
                "and deploy again: its nginx front then lets /v1/ and /health through",
            )
        replicas.append(Replica(host, at, port))
        names.add(plan.service.served_model_name)
        drain = max(drain, plan.service.shutdown_timeout_s)
    if len(names) > 1:
        raise VfleetError(
            f"the replicas of {group} serve different names: {', '.join(sorted(names))}",
            where=inventory,
            fix="give them one served_model_name (an alias clients keep across swaps)",
        )
    return replicas, names.pop(), drain


# --------------------------------------------------------------------------- CLI


def cmd_render(a: argparse.Namespace) -> int:
    prefix = Path(a.dir).resolve()
    host, _, port = a.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise VfleetError(
            f"--listen {a.listen!r} is not HOST:PORT", key="--listen", fix="e.g. 127.0.0.1:8080"
        )
    replicas, name, drain = replicas_from_inventory(a.inventory, a.group, a.instance)
    with locked(prefix):
        old = load(prefix) if (prefix / STATE).is_file() else None
        down = {r["host"] for r in old["replicas"] if r["down"]} if old else set()
        for r in replicas:
            r.down = r.host in down  # a re-render keeps what is drained drained
        state = {
            "group": a.group,
            "served_model_name": name,
            "listen": a.listen,
            "drain_timeout_s": drain + STOP_MARGIN_S,
            "replicas": [asdict(r) for r in replicas],
            "replica_header": a.replica_header,
        }
        save(prefix, state)
    print(f"balancer for {a.group} ({name}) in {prefix}: listens on {a.listen}")
    for r in replicas:
        print(f"  {r.host:<16} {r.address}:{r.port}{'  (drained)' if r.down else ''}")
    print(f"start: vfleet balancer start {prefix}")
    return 0


def cmd_drain(a: argparse.Namespace) -> int:
    set_down(Path(a.dir).resolve(), a.host, True)
    print(f"{a.host} drained: no new requests; in-flight ones finish")
    return 0


def cmd_admit(a: argparse.Namespace) -> int:
    set_down(Path(a.dir).resolve(), a.host, False)
    print(f"{a.host} admitted")
    return 0


def cmd_start(a: argparse.Namespace) -> int:
    prefix = Path(a.dir).resolve()
    load(prefix)
    if running_pid(prefix) is not None:
        print(f"nginx already runs for {prefix} (pid {running_pid(prefix)})")
        return 0
    r = subprocess.run(
        [_nginx(), "-c", str(prefix / CONF), "-p", f"{prefix}/"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if r.returncode != 0:
        raise VfleetError(f"nginx did not start: {r.stderr.strip()}", where=str(prefix / CONF))
    for _ in range(50):
        if running_pid(prefix) is not None:
            break
        time.sleep(0.1)
    listen = load(prefix)["listen"]
    print(f"nginx runs for {prefix} (pid {running_pid(prefix)}), listening on {listen}")
    return 0


def cmd_stop(a: argparse.Namespace) -> int:
    prefix = Path(a.dir).resolve()
    pid = running_pid(prefix)
    if pid is None:
        print("nginx is not running")
        return 0
    os.kill(pid, signal.SIGQUIT)  # graceful: in-flight requests finish
    for _ in range(600):
        if running_pid(prefix) is None:
            break
        time.sleep(0.1)
    print("nginx stopped")
    return 0


def cmd_show(a: argparse.Namespace) -> int:
    prefix = Path(a.dir).resolve()
    state = load(prefix)
    if a.json:
        print(json.dumps(state | {"running_pid": running_pid(prefix)}, indent=2))
        return 0
    pid = running_pid(prefix)
    print(f"{state['group']} ({state['served_model_name']}) on {state['listen']}: "
          f"{'nginx pid ' + str(pid) if pid else 'nginx not running'}")  # fmt: skip
    for r in state["replicas"]:
        print(f"  {r['host']:<16} {r['address']}:{r['port']}  {'drained' if r['down'] else 'in'}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "balancer",
        help="nginx in front of a model group's replicas; drain and admit one host",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bs = p.add_subparsers(dest="balancer_cmd", required=True, metavar="COMMAND")
    r = bs.add_parser("render", help="write nginx.conf and balancer.json for GROUP into --dir")
    r.add_argument("group", metavar="GROUP", help="inventory group (or host pattern)")
    r.add_argument("--dir", required=True, help="the balancer's folder (config, state, logs)")
    r.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT (127.0.0.1:8080)")
    inventory_arg(r)
    r.add_argument("--instance", metavar="NAME", help="instance on each host (main)")
    r.add_argument(
        "--replica-header",
        action="store_true",
        help="name the replica that answered in X-Vfleet-Replica (an internal address: "
        "for tests and debugging, off by default)",
    )
    r.set_defaults(fn=cmd_render)
    for name, fn, text in (
        ("drain", cmd_drain, "stop sending new requests to HOST (in-flight ones finish)"),
        ("admit", cmd_admit, "send requests to HOST again"),
    ):
        c = bs.add_parser(name, help=text)
        c.add_argument("dir", metavar="DIR")
        c.add_argument("host", metavar="HOST")
        c.set_defaults(fn=fn)
    for name, fn, text in (
        ("start", cmd_start, "run nginx with the folder's configuration"),
        ("stop", cmd_stop, "stop it gracefully (in-flight requests finish)"),
        ("show", cmd_show, "replicas, which are drained, whether nginx runs"),
    ):
        c = bs.add_parser(name, help=text)
        c.add_argument("dir", metavar="DIR")
        if name == "show":
            c.add_argument("--json", action="store_true")
        c.set_defaults(fn=fn)
