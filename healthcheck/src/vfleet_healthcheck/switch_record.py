"""last-switch.json: the last `vfleet switch` that concerned an instance, for its sidecar.

`vfleet switch` (src/vfleet/fleet/switch.py) keeps its state in the balancer's folder, which may
be on another machine than the box. So after each switch it builds one record per instance of
the pair (the one woken, role `to`, and the one put to sleep, role `from`) and runs **this file**
on the box (locally, or over ssh with the file on stdin, as the host-side scripts: standard
library only, no relative import) to write it into the instance's folder
(`instances/<i>/last-switch.json`, beside step-times.json). The sidecar reads it at each scrape
and exports the `vfleet_switch_*` families; `vfleet status` shows it. The format, its bounds,
the outcome and failed-step values and the metric names live here only: the writer, the reader,
the rules and the dashboards derive from them.

    python3 switch_record.py write INSTANCE_DIR RECORD_JSON

The writer may run as root (`ansible_become`): the instance folder is root's, not the service
user's, and it is opened with O_NOFOLLOW | O_DIRECTORY and refused when it is not root's or when
others may write it; the file is written under a new name (O_EXCL | O_NOFOLLOW) through the
folder's descriptor and renamed over the old one. Every reader treats the file as untrusted
input: opened with O_NOFOLLOW | O_NONBLOCK, a regular file with one link, at most MAX_BYTES,
every field checked against its bounds; a record that fails one is refused whole (no metric
from it), never half-used.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = 1
FILENAME = "last-switch.json"
MAX_BYTES = 64 * 1024  # a record is a few hundred bytes

# The instance's part in the switch: woken (the switch's target) or put to sleep.
ROLES = ("to", "from")
# Outcome label value -> how `vfleet switch` prints it (its report, `--json` and `show`).
OUTCOMES: dict[str, str] = {
    "switched": "switched",
    "rolled_back": "rolled back",  # a step or gate failed; the old model serves again
    "failed": "FAILED",  # a step or gate failed and so did the rollback
    "not_started": "not started",  # nginx refused the flip: nothing changed
}
OK_OUTCOME = "switched"
# Where a switch that did not pass stopped: a step of the switch, or a gate on the woken engine
# (in the order they run). "none" for a switch that passed.
STEPS = ("flip", "drain", "recording", "sleep", "wake")
GATES = ("health", "completion", "greedy", "acceptance", "performance")
NO_FAILURE = "none"
FAILED_AT = (NO_FAILURE, *STEPS, *GATES)

# The sidecar's families (exposition names; the counter's family is METRIC_TOTAL without
# `_total`, which prometheus_client appends).
METRIC_OUTCOME = "vfleet_switch_last_outcome"
METRIC_DURATION = "vfleet_switch_last_duration_seconds"
METRIC_FIRST_TOKEN = "vfleet_switch_last_first_token_seconds"
METRIC_TIMESTAMP = "vfleet_switch_last_timestamp_seconds"
METRIC_TOTAL = "vfleet_switches_total"
METRICS = (METRIC_OUTCOME, METRIC_DURATION, METRIC_FIRST_TOKEN, METRIC_TIMESTAMP, METRIC_TOTAL)

# Bounds: a switch's steps are bounded (sleep 120 s, wake 60 s, the gates' requests and bench
# a few minutes), so a day is far above any real one and catches a corrupt or hand-made file.
MAX_SECONDS = 86400.0
EARLIEST, LATEST = 1.5e9, 1e11  # Unix time: 2017 .. far future
MAX_COUNT = 2**53  # a float's exact integers
# Inventory host names, for display only (never a label): the grammar's characters, bounded.
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class BadRecord(ValueError):
    """Not a switch record: says which field and why."""


def _seconds(name: str, value: object, *, optional: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRecord(f"{name}: {value!r} is not a number")
    number = float(value)
    if not (math.isfinite(number) and 0 < number <= MAX_SECONDS):
        raise BadRecord(f"{name}: {value!r} is outside 0 < {name} <= {MAX_SECONDS:g}")
    return number


@dataclass(frozen=True)
class SwitchRecord:
    """One instance's view of the last switch it took part in; refused at construction
    (BadRecord) when a field is outside its set or bounds, so a bad one is never written."""

    role: str  # ROLES
    to: str  # the inventory host woken
    frm: str  # the inventory host that served before
    outcome: str  # a key of OUTCOMES
    failed_at: str  # FAILED_AT; NO_FAILURE exactly when the outcome is OK_OUTCOME
    seconds: float  # the flip to the last gate (or to the rollback's end)
    ended_at: float  # Unix time the switch ended
    first_token_s: float | None = None  # the flip to the first token from `to` (switched only)
    # Switches of this instance so far, by role and outcome (kept with the balancer's state).
    counts: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    schema: int = SCHEMA

    def __post_init__(self) -> None:
        if self.schema != SCHEMA:
            raise BadRecord(f"schema {self.schema!r}, this reader knows {SCHEMA}")
        if self.role not in ROLES:
            raise BadRecord(f"role {self.role!r} is not one of {', '.join(ROLES)}")
        if self.outcome not in OUTCOMES:
            raise BadRecord(f"outcome {self.outcome!r} is not one of {', '.join(OUTCOMES)}")
        if self.failed_at not in FAILED_AT:
            raise BadRecord(f"failed_at {self.failed_at!r} is not one of {', '.join(FAILED_AT)}")
        if (self.failed_at == NO_FAILURE) != (self.outcome == OK_OUTCOME):
            raise BadRecord(f"failed_at {self.failed_at!r} with outcome {self.outcome!r}")
        for name in ("to", "frm"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _HOST.fullmatch(value):
                raise BadRecord(f"{name}: {value!r} is not an inventory host name")
        _seconds("seconds", self.seconds)
        _seconds("first_token_s", self.first_token_s, optional=True)
        t = self.ended_at
        if isinstance(t, bool) or not isinstance(t, int | float) or not EARLIEST <= t <= LATEST:
            raise BadRecord(f"ended_at: {t!r} is not a Unix time")
        if not isinstance(self.counts, Mapping):
            raise BadRecord("counts: not an object")
        for role, by in self.counts.items():
            if role not in ROLES or not isinstance(by, Mapping):
                raise BadRecord(f"counts: {role!r} is not a role with outcomes")
            for outcome, n in by.items():
                if outcome not in OUTCOMES:
                    raise BadRecord(f"counts.{role}: {outcome!r} is not an outcome")
                if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_COUNT:
                    raise BadRecord(f"counts.{role}.{outcome}: {n!r} is not a count")

    def count(self, role: str, outcome: str) -> int:
        return self.counts.get(role, {}).get(outcome, 0)

    def to_json(self) -> str:
        """One line (the writer takes it as one argument)."""
        data = {
            "schema": self.schema,
            "role": self.role,
            "to": self.to,
            "frm": self.frm,
            "outcome": self.outcome,
            "failed_at": self.failed_at,
            "seconds": self.seconds,
            "ended_at": self.ended_at,
            "first_token_s": self.first_token_s,
            "counts": {r: dict(by) for r, by in self.counts.items()},
        }
        return json.dumps(data, sort_keys=True, allow_nan=False, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> SwitchRecord:
        """BadRecord (a ValueError) naming what is wrong."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:  # 64 KiB of "[" nests too deep
            raise BadRecord(f"not JSON: {type(exc).__name__}: {exc}") from None
        if not isinstance(data, dict):
            raise BadRecord("not a JSON object")
        keys = {"schema", "role", "to", "frm", "outcome", "failed_at", "seconds", "ended_at"}
        missing = sorted(keys - data.keys())
        if missing:
            raise BadRecord(f"missing {', '.join(missing)}")
        counts = data.get("counts", {})
        return cls(
            role=data["role"],
            to=data["to"],
            frm=data["frm"],
            outcome=data["outcome"],
            failed_at=data["failed_at"],
            seconds=data["seconds"],
            ended_at=data["ended_at"],
            first_token_s=data.get("first_token_s"),
            counts=counts,
            schema=data["schema"],
        )


# --------------------------------------------------------------------------- reading


def read_bounded(path: str | os.PathLike[str]) -> str:
    """The file's text: not through a link, a regular file with one link, at most MAX_BYTES.
    FileNotFoundError when there is none; another OSError or BadRecord otherwise."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadRecord(f"{path} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadRecord(f"{path} is not a regular file")
        if st.st_nlink != 1:
            raise BadRecord(f"{path} has {st.st_nlink} hard links")
        raw = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise BadRecord(f"{path} is larger than {MAX_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRecord(f"{path} is not UTF-8") from None


def read(path: str | os.PathLike[str]) -> SwitchRecord | None:
    """The record at ``path``; None when there is none (no switch yet). OSError or BadRecord
    when there is one that cannot be used."""
    try:
        text = read_bounded(path)
    except FileNotFoundError:
        return None
    return SwitchRecord.from_json(text)


# --------------------------------------------------------------------------- writing


def _folder(path: str) -> int:
    """The instance folder's descriptor: not a link, a folder; as root, root's and closed to
    others' writes (else a link planted in it could steer the rename)."""
    if not os.path.isabs(path) or ".." in Path(path).parts:
        raise BadRecord(f"{path!r} is not an absolute path without '..'")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(fd)
    if os.geteuid() == 0 and (st.st_uid != 0 or st.st_mode & 0o022):
        os.close(fd)
        raise BadRecord(f"{path} is not root's alone (owner {st.st_uid}, mode {st.st_mode:o})")
    return fd


def write(folder: str, text: str) -> str:
    """Write ``text`` (checked as a record first) as FILENAME in ``folder``; its path."""
    if len(text.encode("utf-8")) > MAX_BYTES:
        raise BadRecord(f"larger than {MAX_BYTES} bytes")
    SwitchRecord.from_json(text)  # never write what a reader refuses
    dfd = _folder(folder)
    tmp = f".{FILENAME}.{os.getpid()}.{os.urandom(4).hex()}"
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o644, dir_fd=dfd)
        try:
            os.fchmod(fd, 0o644)  # whatever the umask: the sidecar's user reads it
            data = (text + "\n").encode("utf-8")
            while data:
                data = data[os.write(fd, data) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, FILENAME, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    finally:
        os.close(dfd)
    return os.path.join(folder, FILENAME)


def main(argv: list[str] | None = None) -> int:
    """One JSON line: {"ok": true, ...}, exit 0; {"ok": false, "error": ...}, exit 1; usage 2."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "write":
        print("usage: switch_record.py write INSTANCE_DIR RECORD_JSON", file=sys.stderr)
        return 2
    try:
        out = {"ok": True, "path": write(args[1], args[2])}
    except (OSError, ValueError) as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
