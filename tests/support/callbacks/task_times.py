"""Ansible callback for the tests: each task's start and end per host, as JSON lines.

Enabled by the fleet tests (ANSIBLE_CALLBACKS_ENABLED=task_times) and written to the file in
VFLEET_TASK_TIMES, so `python -m tests.support.task_times FILE` can say where a deploy's or a swap's
minutes went. The output on the terminal is unchanged (this is not a stdout callback).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):  # type: ignore[misc]
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "task_times"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._path = os.environ.get("VFLEET_TASK_TIMES", "")
        self._started: dict[tuple[str, str], float] = {}
        self._play = ""

    def v2_playbook_on_play_start(self, play: Any) -> None:
        self._play = play.get_name()

    def v2_runner_on_start(self, host: Any, task: Any) -> None:
        self._started[(host.get_name(), task._uuid)] = time.time()

    def _done(self, result: Any, status: str) -> None:
        if not self._path:
            return
        host, task = result._host.get_name(), result._task
        end = time.time()
        start = self._started.pop((host, task._uuid), end)
        row = {"play": self._play, "host": host, "task": task.get_name(), "status": status,
               "start": round(start, 3), "end": round(end, 3)}  # fmt: skip
        os.makedirs(os.path.dirname(self._path) or ".", exist_ok=True)
        with open(self._path, "a", encoding="utf-8") as out:
            out.write(json.dumps(row) + "\n")

    def v2_runner_on_ok(self, result: Any) -> None:
        self._done(result, "changed" if result._result.get("changed") else "ok")

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        self._done(result, "failed")

    def v2_runner_on_skipped(self, result: Any) -> None:
        self._done(result, "skipped")

    def v2_runner_on_unreachable(self, result: Any) -> None:
        self._done(result, "unreachable")
