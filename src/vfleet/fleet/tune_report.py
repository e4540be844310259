"""`vfleet tune`'s outputs: the report (JSON, markdown, an SVG plot) and the host's overrides.

The plot is an SVG written here with the standard library: matplotlib is only a development
dependency of vfleet, and a tune runs wherever vfleet runs.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from vfleet.config.escape import host_name
from vfleet.fleet.tune_measure import Objective
from vfleet.fleet.tune_state import Result, State, save

TUNED_VAR = "vfleet_tuned_set"  # the role applies it after vfleet_set (defaults/main.yml)
OVERRIDES_FILE = "vfleet_tuned.yml"  # in the inventory's host_vars/<host>/
TABLE_FILE = "vfleet_tuned.md"  # beside it: Ansible reads only .yml/.yaml/.json there


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(state: State, objective: Objective, winner: Result | None) -> list[str]:
    scores = state.scores(objective)
    head = ["candidate", "status", "objective", "decode tok/s", "agg tok/s", "TTFT p95 s",
            "accept", "tok/step", "step ms", "run", "note"]  # fmt: skip
    rows = [head, ["---"] * len(head)]
    for key, r in state.results.items():
        m = r.measurement
        note = r.why or (objective.score(m)[1] if m else None) or ""
        rows.append(
            [
                key + (" **(best)**" if winner is not None and key == winner.key else ""),
                r.status,
                _f(scores.get(key), ".2f"),
                _f(m.decode_tps if m else None, ".2f"),
                _f(m.aggregate_tps if m else None, ".2f"),
                _f(m.ttft_p95_s if m else None, ".3f"),
                _f(m.acceptance_rate if m else None, ".2f"),
                _f(m.tokens_per_step if m else None, ".2f"),
                _f(m.step_time_s * 1000 if m and m.step_time_s else None, ".1f"),
                str(r.run),
                note.replace("|", "/")[:160],
            ]
        )
    return ["| " + " | ".join(row) + " |" for row in rows]


def markdown(doc: dict[str, Any], state: State, objective: Objective, winner: Result | None) -> str:
    lines = [
        f"# vfleet tune {doc['host']}",
        "",
        f"- deployment: profile {doc['profile']}, model {doc['model']}, instance {doc['instance']}",
        f"- objective: {objective.describe()}",
        f"- search: {doc['search']} over {', '.join(doc['dimensions']) or '(nothing)'}; "
        f"{doc['measured']} measured, {doc['skipped']} skipped, {doc['failed']} failed, "
        f"{doc['unmeasured']} left unmeasured",
        f"- bench per candidate: {doc['bench']['repeats']} x {doc['bench']['concurrency']} "
        f"request(s) of {doc['bench']['decode_tokens']} tokens after a "
        f"{doc['bench']['prompt_tokens']}-token prompt",
        f"- command: `{doc['command']}`",
    ]
    for name, why in doc["left_out"].items():
        lines.append(f"- not swept: {name}: {why}")
    if doc.get("stopped"):
        lines.append(f"- stopped: {doc['stopped']}")
    rollout = doc.get("rollout")
    if rollout:
        perf = rollout.get("perf") or {}
        gate = f"; performance gate: {perf.get('state')}" if perf else ""
        lines.append(f"- rollout ({rollout['what']}): {rollout['outcome']}{gate}")
    model = (doc.get("step_times") or {}).get("cost_model") or {}
    if "error_by_depth" in model:
        said = ", ".join(f"MTP {d} {e * 100:+.1f}%" for d, e in model["error_by_depth"].items())
        lines.append(
            f"- the decode cost model (the sidecar's where no table exists) from MTP "
            f"{model['from_depth']}'s step: {said} against what was measured"
        )
    elif model.get("not_checked"):
        lines.append(f"- the decode cost model not checked: {model['not_checked']}")
    lines += ["", *table(state, objective, winner), ""]
    if winner is not None:
        lines.append(f"Best: **{winner.key}** (`--set {' --set '.join(winner.sets)}`).")
    else:
        lines.append("No candidate met the objective: nothing to roll out.")
    lines += ["", "![objective per candidate](tune.svg)", ""]
    return "\n".join(lines)


def svg(state: State, objective: Objective, winner: Result | None, width: int = 640) -> str:
    """A horizontal bar per candidate: its objective (none: skipped, failed or over the SLO)."""
    scores = state.scores(objective)
    keys = list(state.results)
    top = max([s for s in scores.values() if s is not None], default=1.0) or 1.0
    row, label_w, pad = 22, 230, 10
    height = pad * 2 + 24 + row * max(1, len(keys))
    bar_w = width - label_w - 90
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<text x="{pad}" y="{pad + 12}" font-weight="bold">'
        f"{html.escape(objective.describe())}</text>",
    ]
    for i, key in enumerate(keys):
        y = pad + 24 + i * row
        s = scores.get(key)
        out.append(f'<text x="{pad}" y="{y + 14}">{html.escape(key)}</text>')
        if s is None:
            why = state.results[key].status
            out.append(f'<text x="{label_w}" y="{y + 14}" fill="#888">({why})</text>')
            continue
        w = max(1, round(bar_w * s / top))
        color = "#2a7" if winner is not None and key == winner.key else "#58a"
        out.append(
            f'<rect x="{label_w}" y="{y + 3}" width="{w}" height="{row - 6}" fill="{color}"/>'
        )
        out.append(f'<text x="{label_w + w + 4}" y="{y + 14}">{s:.2f}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def write_report(
    out_dir: Path, doc: dict[str, Any], state: State, objective: Objective, winner: Result | None
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    full = {
        **doc,
        "objective": asdict(objective),
        "winner": asdict(winner) if winner else None,
        "results": [
            {**asdict(r), "objective": state.scores(objective).get(r.key)}
            for r in state.results.values()
        ],
    }
    files = {
        "tune.json": json.dumps(full, indent=2) + "\n",
        "tune.md": markdown(doc, state, objective, winner),
        "tune.svg": svg(state, objective, winner),
    }
    for name, text in files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return [out_dir / n for n in files]


def save_state(path: Path, state: State) -> None:
    save(path, state)


# --------------------------------------------------------------------------- overrides


def host_vars_dir(inventory: Path, host: str) -> Path:
    """Where Ansible reads the host's variables: host_vars/ beside an inventory file, or
    inside an inventory folder."""
    base = inventory if inventory.is_dir() else inventory.parent
    return base / "host_vars" / host_name(host, str(inventory))


def merged_sets(old: list[str], new: list[str]) -> list[str]:
    """The new tuned settings, plus the old ones for keys this tune did not set."""
    keys = {s.split("=", 1)[0] for s in new}
    return [s for s in old if s.split("=", 1)[0] not in keys] + list(new)


def read_tuned(inventory: Path, host: str) -> list[str]:
    path = host_vars_dir(inventory, host) / OVERRIDES_FILE
    if not path.exists():
        return []
    doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return [str(s) for s in doc.get(TUNED_VAR) or []]


def write_overrides(
    inventory: Path, host: str, sets: list[str], header: str, table_md: str
) -> tuple[Path, Path]:
    """host_vars/<host>/vfleet_tuned.yml (the settings the role applies after vfleet_set) and
    the measured table beside it. Each file is replaced whole."""
    folder = host_vars_dir(inventory, host)
    folder.mkdir(parents=True, exist_ok=True)
    comment = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    body = yaml.safe_dump({TUNED_VAR: sets}, sort_keys=False, default_flow_style=False)
    files = {OVERRIDES_FILE: comment + body, TABLE_FILE: table_md}
    for name, text in files.items():
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(folder / name)
    return folder / OVERRIDES_FILE, folder / TABLE_FILE
