"""tests/support/timeline.py: per worker, its files in the order it ran them and when it
finished, with the CPU its phases recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import timeline


def test_spans_per_worker_and_file_in_run_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        ("gw10", "tests/test_b.py::t1", 0.0, 60.0, [1.5, 30.0]),
        ("gw10", "tests/test_b.py::t2", 60.0, 120.0, [0.5, 60.0]),
        ("gw2", "tests/test_c.py::t", 30.0, 90.0, None),  # a timeline from before cpu_s
        ("gw2", "tests/test_a.py::t", 90.0, 300.0, [12.0, 0.0]),
    ]
    f = tmp_path / "t.jsonl"
    f.write_text("".join(json.dumps({"worker": w, "test": t, "when": "call", "start": a + 1000,
                                     "stop": b + 1000, "outcome": "passed", "cpu_s": c}) + "\n"
                         for w, t, a, b, c in rows))  # fmt: skip
    assert timeline.main(["--since", "940", str(f)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "gw2: done at   5.0 min",
        "    0.5 ->   1.5 min     60.0 s  cpu    0.0 +    0.0 s  tests/test_c.py",
        "    1.5 ->   5.0 min    210.0 s  cpu   12.0 +    0.0 s  tests/test_a.py",
        "gw10: done at   2.0 min",
        "    0.0 ->   2.0 min    120.0 s  cpu    2.0 +   90.0 s  tests/test_b.py",
        "slowest files (6.5 worker-minutes in all):",
        "    3.5 min  tests/test_a.py",
        "    2.0 min  tests/test_b.py",
        "    1.0 min  tests/test_c.py",
        "CPU: 0.2 min in the pytest workers, 1.5 in their finished children",
        "pytest wall time: 5.0 min",
        "make test wall time: 6.0 min (setup and lint 1.0)",
    ]


def test_no_timeline_says_so_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert timeline.main([str(tmp_path / "none.jsonl")]) == 2
    assert "no timeline" in capsys.readouterr().err
