"""Why a vLLM server stopped, read from the end of its log (standard library only).

Two users, one rule:

- the role, as root on the host, when an instance does not become ready (tasks/ready.yml):

      python3 -c "$(cat logwhy.py)" /opt/vfleet/logs/vllm-main.log [--previous]

  prints the last meaningful error and the log's last lines without the noise an exiting vLLM
  writes (--previous: of the start before the last, where a start that systemd restarted by
  itself ended);
- `vfleet doctor` (fleet/doctor/service.py) calls ``last_error`` on the log tail that
  hostfacts.py brings back.

The noise is why this exists: a vLLM that exits ends its log with nanobind's leak report (30-odd
lines from Triton's bindings) and multiprocessing's resource-tracker warnings, so a plain tail of
40 lines held nothing else (a failed swap in CI, stop 41) and the reason was not reported.

The log lies in vfleet's logs folder, root's own: it is opened without following a link all the
same, and only its last 256 KiB are read (it is appended to forever).
"""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import sys

READ_BYTES = 256 * 1024
# The line launch.sh writes before it starts vLLM (templates/launch.sh.j2): where a start's
# lines begin.
LAUNCH_MARK = "vfleet launch: "
# What the role reads of the log's end, and how many of its last lines it shows.
SCAN_LINES = 400
SHOW_LINES = 15

_LOG_PREFIXES = (
    re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?: "),  # pm2 time
    re.compile(r"^\(\w+ pid=\d+\) "),  # vLLM's process tag: (APIServer pid=12)
)
_LEVEL = re.compile(
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)"
    r"(?: \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?|:\s+)"  # vLLM's, or uvicorn's
)
_EXCEPTION = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$"
)
_ERROR_WORD = re.compile(r"\bError\b|\berror:|\bERROR\b|\bfatal:|\bFATAL\b")
# vLLM's executor when a worker process dies (0.32: "Worker proc VllmWorker-0 died unexpectedly
# (exit code: -4), shutting down executor"). What follows it (the engine's "RuntimeError:
# cancelled", the API server's EngineDeadError) is the shutdown it starts, not its cause.
_WORKER_DIED = re.compile(
    r"\bWorker proc \S+ died unexpectedly\b(?: \(exit code: (-?\d+|None)\))?.*"
)
# Python's faulthandler (PYTHONFAULTHANDLER=1, rule observability) when a fatal signal reaches
# a process: "Fatal Python error: Illegal instruction", then each thread's stack, innermost
# frame first, the signalled thread's under "Current thread ...".
_FATAL = re.compile(r"^Fatal Python error: (.+?)\s*$")
_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)')
# An exiting process's reports, and the readiness probe's own progress lines.
_NOISE = re.compile(
    r"^nanobind: |^ - (?:leaked|\.\.\. skipped)|refleaks\.html|resource_tracker|"
    r"^\s+warnings\.warn\(|^waiting for http"
)


def _log_message(line: str) -> tuple[str | None, str]:
    for prefix in _LOG_PREFIXES:
        line = prefix.sub("", line, count=1)
    m = _LEVEL.match(line)
    return (m.group(1), line[m.end() :]) if m else (None, line)


def _clip(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _exit_code(died: str) -> str:
    """What the executor's exit code says: -N is signal N; None, that the process was still
    exiting (its threads ending, a core being written) when vLLM looked."""
    m = _WORKER_DIED.search(died)
    code = m.group(1) if m else None
    if code is None:
        return ""
    if code == "None":
        return "; exit code None: still exiting when vLLM looked, the cause not yet known"
    n = int(code)
    if n >= 0:
        return f"; it exited {n}"
    try:
        name = signal.Signals(-n).name
    except ValueError:
        name = f"signal {-n}"
    return f"; exit code {n}: killed by {name}"


def fatal_signal(msgs: list[str]) -> str | None:
    """faulthandler's last report: the signal and the signalled thread's innermost frame."""
    for i in range(len(msgs) - 1, -1, -1):
        m = _FATAL.match(msgs[i])
        if not m:
            continue
        block = msgs[i + 1 : i + 400]
        current = next((j for j, x in enumerate(block) if x.startswith("Current thread")), 0)
        frame = next((f for x in block[current:] if (f := _FRAME.match(x))), None)
        where = f" in {frame.group(3)} ({frame.group(1)}:{frame.group(2)})" if frame else ""
        return f"Fatal Python error: {m.group(1)}{where}"
    return None


def _with_fatal(msg: str, msgs: list[tuple[str | None, str]]) -> str:
    fatal = fatal_signal([m for _, m in msgs])
    if fatal is None:
        return _clip(msg)
    return _clip(fatal if _FATAL.match(msg) else f"{msg}; {fatal}", 700)


def last_error(lines: list[str]) -> str | None:
    """The last meaningful error of a log tail: the last line of a Python traceback, else the
    last error line. vLLM's "see the root cause above" gets the earlier exception added."""
    msgs = [_log_message(line) for line in lines]
    for i in range(len(msgs) - 1, -1, -1):
        level, msg = msgs[i]
        if level in ("DEBUG", "INFO", "WARNING") or not msg.strip():
            continue
        if _EXCEPTION.match(msg):
            # pydantic and friends put the reason on the indented lines below the exception.
            detail: list[str] = []
            for _, m in msgs[i + 1 : i + 3]:
                if not m[:1].isspace():
                    break
                if not m.strip().startswith("For further information"):
                    detail.append(m.strip())
            msg = ": ".join([msg.rstrip(":"), *detail])
            if "root cause" in msg:
                # Anywhere above: the engine's traceback and the API server's after it ran to
                # more than 100 lines in vLLM 0.32's logs; callers pass one start's lines.
                died = [w.group(0) for _, m in msgs[:i] if (w := _WORKER_DIED.search(m))]
                earlier = [
                    m
                    for lv, m in msgs[:i]
                    if lv not in ("DEBUG", "INFO", "WARNING") and _EXCEPTION.match(m) and m != msg
                ]
                if died:
                    msg = f"{msg} (root cause: {died[-1]}{_exit_code(died[-1])})"
                elif earlier:
                    msg = f"{msg} (root cause: {earlier[-1]})"
            return _with_fatal(msg, msgs)
        if (
            not msg[0].isspace()
            and not msg.startswith("Traceback")
            and (level in ("ERROR", "CRITICAL") or _ERROR_WORD.search(msg))
        ):
            return _with_fatal(msg, msgs)
    return None


def without_noise(lines: list[str]) -> list[str]:
    """The lines that say something: not nanobind's leak report, the resource tracker's
    warnings or the probe's "waiting for" lines. nanobind's last line ends without a newline,
    so the next writer's first line may be glued to it: that part is kept."""
    out = []
    for line in lines:
        if "refleaks.html" in line:
            line = line.split("refleaks.html", 1)[1]
        if line.strip() and not _NOISE.search(line):
            out.append(line)
    return out


def read_tail(path: str, lines: int = SCAN_LINES) -> list[str]:
    """The last ``lines`` lines of the file at ``path``: a regular file with one name, not a
    link. Root runs this; the logs folder is root's (0755), and this holds should it ever not
    be: a FIFO planted there would block the open and the read (O_NONBLOCK, then refused), and
    a second name (a hard link to a file only root may read) would put that file in the report."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else "has another name"
        raise OSError(errno.EPERM, f"{what}: refused")
    with os.fdopen(fd, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        start = max(0, size - READ_BYTES)
        fh.seek(start)
        text = fh.read().decode(errors="replace").splitlines()
    if start > 0 and text:
        text = text[1:]  # the first line was cut
    return text[-lines:]


def _marks(lines: list[str]) -> list[int]:
    # pm2 writes its time before each line ("time": true in the ecosystem file).
    return [
        i
        for i, line in enumerate(lines)
        if _LOG_PREFIXES[0].sub("", line, count=1).startswith(LAUNCH_MARK)
    ]


def since_last_start(lines: list[str]) -> list[str]:
    """The lines from the last start on (launch.sh's mark), or all of them without one."""
    marks = _marks(lines)
    return lines[marks[-1] :] if marks else lines


def previous_start(lines: list[str]) -> list[str] | None:
    """The lines of the start before the last one (from its mark to the last mark): where a
    start that systemd restarted by itself ended. None where the lines read hold no such start."""
    marks = _marks(lines)
    return lines[marks[-2] : marks[-1]] if len(marks) >= 2 else None


def report(lines: list[str], show: int = SHOW_LINES, previous: bool = False) -> str:
    """The last error of the last start (or of the one before it) and its last lines, for a
    person to read."""
    which = "the start before the last" if previous else "the last start"
    start = previous_start(lines) if previous else since_last_start(lines)
    if start is None:
        return f"no start before the last one in the log's last {READ_BYTES // 1024} KiB"
    reason = last_error(start)
    kept = [_clip(x, 300) for x in without_noise(start)[-show:]]
    return "\n".join(
        [
            f"last error in the log: {reason}" if reason else f"no error line in {which}",
            "its last lines (leak reports and warnings left out):",
            *(f"  {x}" for x in kept),
        ]
    )


def main(argv: list[str]) -> int:
    previous = argv[2:] == ["--previous"]
    if len(argv) != 2 and not previous:
        print("usage: logwhy.py LOG_FILE [--previous]", file=sys.stderr)
        return 2
    try:
        # the start before the last: every line of the end read (a start writes hundreds)
        lines = read_tail(argv[1], lines=1 << 30 if previous else SCAN_LINES)
    except OSError as exc:
        print(f"cannot read {argv[1]}: {exc.strerror}")
        return 0  # a report, not a second failure: the caller fails with its own message
    print(report(lines, previous=previous))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
