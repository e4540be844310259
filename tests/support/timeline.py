"""Where the test run's minutes went, per pytest worker and per file.

    .venv/bin/python -m tests.support.timeline [--since EPOCH] [build/test-timeline.jsonl]

Reads what tests/conftest.py records: each test phase's start, stop, worker and CPU seconds
(the worker's own and its waited-for children's: the CLI, Ansible, a vLLM a fixture started and
stopped; not the hosts' services). Prints, per worker, its files in the order it ran them with
their wall time and CPU, and when it finished; then the slowest files, pytest's wall time and,
with --since (when `make test` started, in epoch seconds), the whole run's: what CI's
40-minute budget is checked against (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

from tests.conftest import TIMELINE

SLOWEST = 8


def main(argv: list[str]) -> int:
    since: float | None = None
    if argv[:1] == ["--since"]:
        since, argv = float(argv[1]), argv[2:]
    where = Path(argv[0]) if argv else TIMELINE
    rows = [json.loads(line) for line in where.open()] if where.exists() else []
    if not rows:
        print(f"{where}: no timeline (run pytest first)", file=sys.stderr)
        return 2
    t0 = min(r["start"] for r in rows)
    spans: dict[str, dict[str, list[float]]] = defaultdict(dict)
    cpu: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        file = r["test"].split("::")[0]
        span = spans[r["worker"]].setdefault(file, [r["start"], r["stop"]])
        span[0], span[1] = min(span[0], r["start"]), max(span[1], r["stop"])
        for i, v in enumerate(r.get("cpu_s") or ()):  # older timelines have none
            cpu[file][i] += v
    for worker, files in sorted(spans.items(), key=lambda kv: (len(kv[0]), kv[0])):
        end = max(s[1] for s in files.values()) - t0
        print(f"{worker}: done at {end / 60:5.1f} min")
        for file, (a, b) in sorted(files.items(), key=lambda kv: kv[1][0]):
            own, kids = cpu[file]
            print(
                f"  {(a - t0) / 60:5.1f} -> {(b - t0) / 60:5.1f} min  {b - a:7.1f} s"
                f"  cpu {own:6.1f} + {kids:6.1f} s  {file}"
            )
    walls = {f: b - a for files in spans.values() for f, (a, b) in files.items()}
    print(f"slowest files ({sum(walls.values()) / 60:.1f} worker-minutes in all):")
    for file, wall in sorted(walls.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        print(f"  {wall / 60:5.1f} min  {file}")
    own, kids = (sum(c[i] for c in cpu.values()) / 60 for i in (0, 1))
    print(f"CPU: {own:.1f} min in the pytest workers, {kids:.1f} in their finished children")
    t1 = max(r["stop"] for r in rows)
    print(f"pytest wall time: {(t1 - t0) / 60:.1f} min")
    if since is not None:
        whole, setup = (t1 - since) / 60, (t0 - since) / 60
        print(f"make test wall time: {whole:.1f} min (setup and lint {setup:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
