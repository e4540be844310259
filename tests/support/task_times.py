"""Where an Ansible run's time went, from tests/support/callbacks/task_times.py's JSON lines.

    python -m tests.support.task_times FILE [--top N]

Prints, per host, the total time its tasks took and the slowest tasks (summed over runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path


def summary(rows: list[dict[str, object]], top: int) -> str:
    per_host: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        per_host[str(r["host"])][str(r["task"])].append(float(r["end"]) - float(r["start"]))  # type: ignore[arg-type]
    lines: list[str] = []
    for host in sorted(per_host):
        tasks = per_host[host]
        total = sum(sum(v) for v in tasks.values())
        count = sum(len(v) for v in tasks.values())
        lines.append(f"{host}: {count} task runs, {total:.1f} s")
        ranked = sorted(tasks.items(), key=lambda kv: -sum(kv[1]))[:top]
        for name, spans in ranked:
            lines.append(f"  {sum(spans):7.1f} s  x{len(spans):<3} {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.support.task_times", description=__doc__)
    p.add_argument("file", type=Path)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args(argv)
    if not a.file.exists():
        print(f"{a.file}: no such file (run the fleet tests first)", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in a.file.read_text().splitlines() if line.strip()]
    print(summary(rows, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
