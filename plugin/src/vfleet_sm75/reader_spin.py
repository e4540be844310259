"""Feature reader-spin: vLLM's shared-memory queue readers stop busy-polling sooner.

A reader of vLLM's shared-memory message queue (``shm_broadcast.SpinCondition``: the worker
reading the engine's scheduler output, the engine reading the workers' answers) keeps polling
with ``sched_yield`` for ``busy_loop_s`` after each read, 1 s in every pinned version and not a
setting in any of them (the idle case is vllm-project/vllm#19036; #52814, open, makes it one).
Under sparse traffic, one request a second or more, a worker so spins all the time: on the CPU
profile a serving worker used 98 % of a core at one 4-token chat a second against 7 % with a
0.01 s window (docs/BENCHMARKS.md, "The reader's spin"), cores a CPU box needs for its compute
and a GPU box's host for everything else. Decode is untouched while steps follow each other
within the window: the writer notifies on every write, and a reader past its window waits on
that notification instead of spinning.

The window is ``VFLEET_SM75_SPIN_S`` (vfleet's rules set it). ``SpinCondition.wait`` is wrapped
rather than its constructor, so queues made before the plugin loaded (the worker's broadcast
queue is made early) are covered too: a reader's window is lowered to the setting at its next
wait. Writers have no window (0) and are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import lazy

FEATURE = "reader-spin"
MODULE = "vllm.distributed.device_communicators.shm_broadcast"


def wrap(original: Callable[..., Any], window_s: float) -> Callable[..., Any]:
    """``SpinCondition.wait`` with a reader's busy window at most ``window_s``."""

    def wait(self: Any, timeout_ms: int | None = None) -> Any:
        if getattr(self, "busy_loop_s", 0) > window_s:
            self.busy_loop_s = window_s
        return original(self, timeout_ms)

    wait.__wrapped__ = original  # type: ignore[attr-defined]
    return wait


def patcher(window_s: float) -> Callable[[ModuleType], None]:
    def patch(module: ModuleType) -> None:
        cond = module.SpinCondition
        if getattr(cond, "_vfleet_reader_spin", None) is not None:
            return
        cond.wait = wrap(cond.wait, window_s)
        cond._vfleet_reader_spin = window_s

    return patch


def install(window_s: float) -> None:
    """Patch the queue's SpinCondition now, or when the process imports it."""
    lazy.when_imported(MODULE, patcher(window_s))
