"""Shared fixtures. Tests use the real profiles, the real CLI and real vLLM parsers."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vfleet.cli.main import main

REPO = Path(__file__).resolve().parents[1]
PROFILES = REPO / "profiles"


@dataclass
class Result:
    rc: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Result]:
    def run(*args: str) -> Result:
        capsys.readouterr()
        rc = main(list(args))
        cap = capsys.readouterr()
        return Result(rc, cap.out, cap.err)

    return run


@pytest.fixture
def profiles_copy(tmp_path: Path) -> Path:
    """A private copy of profiles/ that a test may break."""
    dest = tmp_path / "profiles"
    shutil.copytree(PROFILES, dest)
    return dest


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under root with its mode and content hash (to prove nothing changed)."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        if path.is_file():
            out[str(path.relative_to(root))] = (
                f"{st.st_mode:o}:" + hashlib.sha256(path.read_bytes()).hexdigest()
            )
        else:
            out[str(path.relative_to(root))] = f"{st.st_mode:o}"
    return out


def ansible_task_times(where: Path) -> dict[str, str]:
    """Environment that makes Ansible record each task's time per host (tests/support/callbacks), in
    one file per test under `where`: `python -m tests.support.task_times FILE` sums them up."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "setup").split("::")[-1].split(" ")[0]
    test = re.sub(r"[^\w.-]", "_", test)  # a parametrized id may hold "/" or spaces
    return {
        "ANSIBLE_CALLBACK_PLUGINS": str(REPO / "tests" / "support" / "callbacks"),
        "ANSIBLE_CALLBACKS_ENABLED": "task_times",
        "VFLEET_TASK_TIMES": str(where / f"task-times-{test}.jsonl"),
    }


def playbook_failure(stdout: str, stderr: str = "", tail: int = 3000) -> str:
    """An assertion message for a failed make/ansible-playbook run: each failed or unreachable
    host's task and message first, then the recap, then the tail. A bare tail can show only the
    hosts that went on (seen: a host lost in the first tasks left no trace in the last 6000
    characters)."""
    lines = stdout.splitlines()
    picked: list[str] = []
    task = ""
    for i, line in enumerate(lines):
        if line.startswith(("TASK [", "RUNNING HANDLER [", "PLAY [")):
            task = line
        elif line.startswith(("fatal:", "failed:", "ERROR!")) or "UNREACHABLE!" in line:
            picked += [task, *lines[i : i + 12], ""]
    recap = stdout.rsplit("PLAY RECAP", 1)
    summary = "\n".join(picked) or "(no failed task in the output)"
    if len(recap) == 2:
        summary += "\nPLAY RECAP" + recap[1][:1500]
    return f"{summary}\n--- stderr ---\n{stderr[-2000:]}\n--- tail ---\n{stdout[-tail:]}"


def require_tools() -> bool:
    """In `make test` the vLLM parsers must be there: a missing one fails instead of skipping."""
    return os.environ.get("VFLEET_REQUIRE_TOOLS") == "1"


def pinned_vllm_source(version: str) -> Path:
    """A pinned vLLM's ``vllm`` package folder from `make tools`; missing: fails in `make test`,
    skips elsewhere."""
    from tests.support.vllm_server import pinned_source

    root = pinned_source(version)
    if root is None:
        if require_tools():
            pytest.fail(f"vLLM {version} source missing: run `make tools`")
        pytest.skip(f"vLLM {version} source missing (make tools)")
    return root


# The slowest files first (CI durations, docs/BENCHMARKS.md), then those that mostly wait.
# `make test` runs two pytest workers that take whole files in collection order: each starts
# with one, and takes the next whenever it has one test of its own left. So the two longest
# start at once and the short files fill the gaps at the end; `python -m
# tests.support.timeline` shows who ran what.
# Disk: the fleet hosts' venvs (~8 GB) live while the compose test builds its images on the other
# worker, after the local deploy, which in CI gives its venv back first: peak +25 GB over the
# start (docs/BENCHMARKS.md, c591479).
SLOW_FIRST = (
    "test_fleet_hosts.py",
    "test_e2e_deploy.py",
    "test_compose_e2e.py",
    "test_planner_vllm.py",
    "test_observability_e2e.py",
    "test_tinymodels.py",  # the wide-model wiring test (67 s alone): not last in the queue
    "test_plugin_vllm.py",
    "test_vllm_engine.py",
    # Files that mostly wait (deadlines, timeouts, restarts of small servers: 55, 42, 42, 13,
    # 9, 5, 5 s of wall for ~20 s of CPU in all, fresh-clone run of 4690960): they ran last, and
    # the run's last minute and a half kept the two cores 35 % busy. Here they run while the
    # fleet file's tune and swaps keep the cores busy, and the files that end the run compute.
    "test_probe.py",
    "test_exporter.py",
    "test_status.py",
    "test_ansible_pm2.py",
    "test_sleepctl.py",
    "test_switch_record.py",
    "test_vfleet_serve.py",
    # The rest of the integration files, longest first, so that the two workers end together
    # (cf21c72's run: the switch file, 2.1 min, came last in alphabetical order and ran alone).
    "test_switch.py",
    "test_api_front.py",
    "test_stacks.py",
    "test_vllm_parse.py",
)


# The unit files' worker. The run's wall time is its worker-minutes over its workers, waits
# included: the fleet file is a serial chain of swaps (~0.5 of a core for 30 minutes), and the
# unit files that wait on deadlines (~3 min of ~6) kept one of the two workers, and so half the
# machine, from the CPU-bound files. A third worker that takes only files under tests/unit (no
# vLLM, hosts or docker: COST_MARKERS) runs them beside the two that take the integration files
# in SLOW_FIRST order, so three first starts never meet (a plain third worker did: the local
# deploy's and the fleet's first starts ran out of their 300 s probe, docs/BENCHMARKS.md).
UNIT_PREFIX = "tests/unit/"

# Markers that say what a test costs (pyproject.toml). A unit test costs none of them.
COST_MARKERS = ("vllm", "hosts", "docker")
UNIT_DIR = REPO / "tests" / "unit"


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.path.is_relative_to(UNIT_DIR):
        costly = [m for m in COST_MARKERS if item.get_closest_marker(m)]
        if costly:
            raise pytest.UsageError(
                f"{item.nodeid} is marked {', '.join(costly)}: such a test belongs in "
                "tests/integration (`make unit` runs tests/unit, none of them)"
            )


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, but a worker takes its next file only when one test of its own is
    left, not two. xdist's two let the fleet worker take test_vllm_engine.py (4 min) when the
    fleet file still had its two longest tests to run (16 min): the other worker ran out of
    work and waited 3 minutes for it (CI run of 12562a3's parent, docs/BENCHMARKS.md). One is
    the least that keeps a worker busy: it runs a test only once it knows the next one."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]

    # xdist's private methods (3.6-3.8): another xdist without them keeps its own scheduler.
    if not all(hasattr(LoadFileScheduling, m) for m in ("_pending_of", "_assign_work_unit")):
        return None

    class LastTestFirst(LoadFileScheduling):  # type: ignore[misc]
        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) > 1:
                return
            self._assign_work_unit(node)

        def _unit_worker(self, node: Any) -> bool:
            """With three workers or more, the last takes unit files only (UNIT_WORKER)."""
            if len(self.nodes) < 3:
                return False
            last = max(self.nodes, key=lambda n: int(str(n.gateway.id).lstrip("gw") or 0))
            return bool(node is last)

        def _assign_work_unit(self, node: Any) -> None:
            if not self._unit_worker(node):
                super()._assign_work_unit(node)
                return
            unit = next((s for s in self.workqueue if s.startswith(UNIT_PREFIX)), None)
            if unit is None:
                node.shutdown()  # no unit file left: the others take what remains
                return
            # The parent's own assignment, for this file instead of the queue's first.
            self.workqueue.move_to_end(unit, last=False)
            super()._assign_work_unit(node)

    return LastTestFirst(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order inside each file is kept


# Where CI's minutes go: each test phase's start, stop and pytest worker, one JSON line each
# in build/test-timeline.jsonl, read by `python -m tests.support.timeline`. Written by the one
# process
# that sees every report (xdist's controller, or pytest alone).
TIMELINE = REPO / "build" / "test-timeline.jsonl"


def pytest_sessionstart(session: pytest.Session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        TIMELINE.unlink(missing_ok=True)


def _cpu_s() -> tuple[float, float]:
    """CPU seconds of this process, and of its children that have been waited for (a
    subprocess.run's whole tree: an ansible-playbook with its forks, a vLLM server stopped at
    a fixture's teardown). Not counted: the hosts' services, which are no one's children here."""
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


_CPU_LAST = [_cpu_s()]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    # Where the worker's CPU went: each phase's share since the previous report of this
    # process (setup, call and teardown follow one another), sent to the controller with the
    # report (xdist carries user_properties) for the timeline.
    outcome = yield
    report = outcome.get_result()
    now = _cpu_s()
    own, children = (round(b - a, 2) for a, b in zip(_CPU_LAST[0], now, strict=True))
    _CPU_LAST[0] = now
    report.user_properties.append(("cpu_s", [own, children]))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # A crashed worker's report has no times (start = stop = 0): nothing to place.
    if os.environ.get("PYTEST_XDIST_WORKER") or not report.start:
        return
    node = getattr(report, "node", None)  # set by xdist on the controller
    worker = node.gateway.id if node is not None else "main"
    TIMELINE.parent.mkdir(parents=True, exist_ok=True)
    cpu = dict(report.user_properties).get("cpu_s")
    line = {"worker": worker, "test": report.nodeid, "when": report.when,
            "start": report.start, "stop": report.stop, "outcome": report.outcome,
            "cpu_s": cpu}  # fmt: skip
    with TIMELINE.open("a") as out:
        out.write(json.dumps(line) + "\n")
