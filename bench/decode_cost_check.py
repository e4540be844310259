#!/usr/bin/env python3
"""Check the decode cost model against every pair of decode speeds vfleet has measured or cites.

The sidecar and `vfleet tune` model a depth's step time from one measured step (docs/TUNE.md,
"The cost model"): this script does the same, the way they do it (vfleet.engine.decode_cost
gives the bytes, the sidecar's StepCost models), for each pair of configurations whose decode
speed is known, and compares the model's speed for one configuration, from the other's
measured step, with the measured speed. Each configuration is re-planned through vfleet's own
profiles (its bytes come from the plan, not from the measurement).

The pairs:
- the H200 lane's runs of qwen3.6-27b-awq-int4 at its own size with dummy weights (one token a
  step: random weights accept nothing), committed under bench/results/h200/: MTP off against
  MTP 3 with full decode graphs (FLASHINFER / TRITON_ATTN), the same with PIECEWISE graphs, and
  qwen3.8-27b-awq-mtp with draft-prune's pruned head against vLLM's full head;
- seed 001 (an A100 32 GB, qwen3.8-27b-awq-mtp, MTP 2, 3 and 4 at four context lengths, its
  table 4.3): depths 2 and 4 from depth 3, with each depth's measured acceptance;
- seed 002 (2x 2080 Ti, qwen3.6-27b-fp8, MTP 3 at ~75% acceptance: ~85 tok/s against ~29 tok/s
  without speculative decoding): MTP off from MTP 3.

Beside the model's error, two alternatives show whether the pair can tell models apart: a depth
that costs nothing beyond the target's step ("free"), and one that costs twice what the model
says ("twice").

    .venv/bin/python bench/decode_cost_check.py [--out bench/results/decode-cost]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "healthcheck" / "src")]

from vfleet_healthcheck.depth import StepCost  # noqa: E402

from vfleet.engine.compile import resolve  # noqa: E402
from vfleet.engine.decode_cost import decode_cost  # noqa: E402
from vfleet.engine.draft_prune import plugin_k, rows_pruned  # noqa: E402

H200 = REPO / "bench" / "results" / "h200"
DUMMY = ["extra_args.load-format=dummy"]


@dataclass(frozen=True)
class Side:
    """One configuration of a pair: how vfleet plans it, and what it measured."""

    label: str
    profile: str
    model: str
    sets: tuple[str, ...]
    depth: int
    tokens_per_s: float
    tokens_per_step: float  # 1 + accepted draft tokens per step
    source: str
    # The SM75 plugin's draft-prune with a table of K rows, turned on by the run's environment
    # (VFLEET_SM75=draft-prune) on a stack whose profile carries no plugin (the H200's): the
    # plan's head is replaced by the pruned share, as rule plugin would plan it.
    pruned_k: int | None = None


@dataclass(frozen=True)
class Row:
    pair: str
    given: str
    predicted: str
    measured_tok_s: float
    model_tok_s: float
    error_pct: float  # model / measured - 1
    free_error_pct: float | None  # None: a pair at one depth (the alternatives equal the model)
    twice_error_pct: float | None
    source: str


def cost_of(side: Side) -> StepCost:
    launch = resolve(side.profile, side.model, sets=list(side.sets), strict_memory=False)
    dc = decode_cost(launch)
    if side.pruned_k is not None:
        rows = rows_pruned(side.pruned_k, dc.tp)
        dc = replace(dc, head_rows=rows, head_bytes=rows * dc.head_bytes // dc.head_rows)
    doc = dc.sidecar()
    if doc is None:
        raise SystemExit(f"{side.label}: no bandwidth figure for {side.profile}")
    return StepCost.from_json(doc, side.label)


def predict(given: Side, want: Side, f: float) -> float:
    """The decode speed of `want` modelled from `given`'s measured step, with a depth costing
    `f` times what the model says (1: the model; 0: free; 2: twice): a step at depth d is
    floor(0) + p x target layers + f x d x (the depth's bytes at bandwidth + p x its layers),
    p solved from the measured step."""
    cg, cw = cost_of(given), cost_of(want)
    step = given.tokens_per_step / given.tokens_per_s
    bw = cg.bandwidth_gbs * 1e9
    d = given.depth
    p = (step - cg.floor_s(0) - f * d * cg.per_depth_bytes / bw) / (
        cg.target_layers + f * d * cg.draft_layers
    )
    p = max(0.0, p)
    k = want.depth
    bw_w = cw.bandwidth_gbs * 1e9
    modelled = (
        cw.floor_s(0)
        + p * cw.target_layers
        + f * k * (cw.per_depth_bytes / bw_w + p * cw.draft_layers)
    )
    return want.tokens_per_step / modelled


def row(pair: str, given: Side, want: Side) -> Row:
    model = predict(given, want, 1.0)
    m = want.tokens_per_s
    same = given.depth == want.depth

    def alt(f: float) -> float | None:
        return None if same else round(100 * (predict(given, want, f) / m - 1), 1)

    return Row(
        pair,
        given.label,
        want.label,
        round(m, 2),
        round(model, 2),
        round(100 * (model / m - 1), 1),
        alt(0.0),
        alt(2.0),
        f"{given.source}; {want.source}",
    )


def lane_side(
    label: str,
    file: str | Path,
    config: str,
    sets: tuple[str, ...],
    depth: int,
    pruned: bool = False,
) -> Side:
    """A configuration of a lane run: median decode speed of its repeats."""
    path = H200 / file
    doc = json.loads(path.read_text(encoding="utf-8"))
    cfg = next(c for c in doc["configs"] if c["name"] == config)
    runs = [r for r in cfg["decode"]["runs"] if r.get("ok")]
    speed = statistics.median(r["decode_tokens_per_s"] for r in runs)
    per_step = statistics.median(r["tokens_per_step"] for r in runs)
    vocab = resolve(doc["profile"], doc["model"], strict_memory=False).model.arch.vocab_size
    return Side(
        label,
        doc["profile"],
        doc["model"],
        tuple(DUMMY + list(sets)),
        depth,
        speed,
        per_step,
        f"{_rel(path)} {config}",
        plugin_k(vocab) if pruned else None,
    )


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


NOMTP_FULL = ("speculative.method=none", "cudagraph_mode=FULL_AND_PIECEWISE")
NOMTP_PIECEWISE = ("speculative.method=none", "cudagraph_mode=PIECEWISE")
MTP_TRITON_FULL = ("attention_backend=TRITON_ATTN", "cudagraph_mode=FULL_AND_PIECEWISE")
MTP_PIECEWISE: tuple[str, ...] = ()


def h200_rows() -> list[Row]:
    rows = []
    mtp_full = lane_side(
        "MTP 3, TRITON_ATTN, full graphs",
        "lane-graphs-2026-12-04c-awq-int4-mtp-triton-full.json",
        "mtp-triton-full",
        MTP_TRITON_FULL,
        3,
    )
    mtp_pw = lane_side(
        "MTP 3, FLASHINFER, PIECEWISE",
        "lane-graphs-2026-12-04c-awq-int4-plugin-off.json",
        "plugin-off",
        MTP_PIECEWISE,
        3,
    )
    for tag, file in (
        ("04b", "lane-graphs-2026-12-04b-awq-int4-nomtp-full.json"),
        ("04c", "lane-graphs-2026-12-04c-awq-int4-nomtp-full.json"),
        ("04c pair", "lane-graphs-2026-12-04c-awq-int4-pair.json"),
    ):
        off = lane_side(f"MTP off, full graphs ({tag})", file, "nomtp-full", NOMTP_FULL, 0)
        rows.append(row("H200 awq-int4, full graphs", mtp_full, off))
    for tag, file in (
        ("04b", "lane-graphs-2026-12-04b-awq-int4-nomtp-piecewise.json"),
        ("04c", "lane-graphs-2026-12-04c-awq-int4-nomtp-piecewise.json"),
        ("04c pair", "lane-graphs-2026-12-04c-awq-int4-pair.json"),
    ):
        off = lane_side(f"MTP off, PIECEWISE ({tag})", file, "nomtp-piecewise", NOMTP_PIECEWISE, 0)
        rows.append(row("H200 awq-int4, PIECEWISE", mtp_pw, off))
    full_head = lane_side(
        "MTP 3, vLLM's head",
        "lane-real-2026-12-03-plugin.json",
        "plugin-off",
        (),
        3,
    )
    pruned = lane_side(
        "MTP 3, draft-prune's head",
        "lane-real-2026-12-03-plugin.json",
        "plugin-on",
        (),
        3,
        pruned=True,
    )
    rows.append(row("H200 awq-mtp, pruned head", full_head, pruned))
    return rows


# Seed 001, table 4.3: context -> {depth: (decode tok/s, acceptance)}; vLLM's acceptance is
# accepted / drafted tokens, so a step yields 1 + depth x acceptance tokens.
SEED_001 = {
    "0": {2: (65.4, 0.59), 3: (68.8, 0.47), 4: (68.7, 0.39)},
    "1K": {2: (62.9, 0.55), 3: (69.6, 0.46), 4: (69.1, 0.40)},
    "32K": {2: (66.7, 0.63), 3: (70.1, 0.47), 4: (66.3, 0.38)},
    "128K": {2: (66.0, 0.63), 3: (69.8, 0.49), 4: (65.7, 0.40)},
}


def seed_rows() -> list[Row]:
    rows = []
    for ctx, table in SEED_001.items():

        def side(k: int, ctx: str = ctx, table: Any = table) -> Side:
            speed, acc = table[k]
            return Side(
                f"MTP {k} at context {ctx}",
                "a100-32g",
                "qwen3.8-27b-awq-mtp",
                (f"speculative.num_speculative_tokens={k}",),
                k,
                speed,
                1 + k * acc,
                "seed 001 (001_e0d750da022808db.txt) table 4.3",
            )

        for k in (2, 4):
            rows.append(row("seed 001, A100", side(3), side(k)))
    mtp = Side(
        "MTP 3 at ~75% acceptance",
        "2x2080ti-22g",
        "qwen3.6-27b-fp8",
        ("draft_prune=false",),
        3,
        85.0,
        1 + 3 * 0.75,
        "seed 002 (002_c3b89ed1671a1b0f.txt): ~85 tok/s",
    )
    off = Side(
        "MTP off",
        "2x2080ti-22g",
        "qwen3.6-27b-fp8",
        ("speculative.method=none",),
        0,
        29.0,
        1.0,
        "seed 002: ~29 tok/s without speculative decoding",
    )
    rows.append(row("seed 002, 2x 2080 Ti", mtp, off))
    return rows


PRUNE_SET = "extra_env.VFLEET_SM75=draft-prune"


def lane_rows(files: list[Path]) -> list[Row]:
    """New lane runs (bench/gpu_device_steps.sh `depths`): every configuration with decode
    figures, re-planned from the sets it recorded; the deepest one with vLLM's head is the
    measured step the others are modelled from, as the sidecar would from a running depth."""
    sides: list[Side] = []
    for file in files:
        doc = json.loads(Path(file).read_text(encoding="utf-8"))
        for cfg in doc["configs"]:
            if not any(r.get("ok") for r in (cfg.get("decode") or {}).get("runs", [])):
                continue
            spec = yaml.safe_load(cfg["vllm_yaml"]).get("speculative-config") or {}
            depth = int(spec.get("num_speculative_tokens", 0)) if spec.get("method") else 0
            sets = tuple(x for x in cfg["sets"] if x not in DUMMY)
            pruned = PRUNE_SET in sets
            label = f"{cfg['name']} (MTP {depth}{', pruned head' if pruned else ''})"
            sides.append(lane_side(label, Path(file).resolve(), cfg["name"], sets, depth, pruned))
    full = [x for x in sides if x.pruned_k is None]
    if not full:
        raise SystemExit("--lane: no configuration with vLLM's head and decode figures")
    given = max(full, key=lambda x: x.depth)
    return [row("lane (--lane)", given, want) for want in sides if want is not given]


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def report(rows: list[Row]) -> str:
    lines = [
        "| pair | from | modelled | measured tok/s | model tok/s | error | a depth free | twice |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.pair} | {r.given} | {r.predicted} | {r.measured_tok_s} | {r.model_tok_s} | "
            f"{r.error_pct:+.1f}% | {_pct(r.free_error_pct)} | {_pct(r.twice_error_pct)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for rows.json and result.md")
    p.add_argument(
        "--lane",
        nargs="+",
        type=Path,
        metavar="LANE_JSON",
        help="check new lane results instead (the lane.json of each `depths` run)",
    )
    a = p.parse_args(argv)
    rows = lane_rows(a.lane) if a.lane else h200_rows() + seed_rows()
    text = report(rows)
    print(text, end="")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rows.json").write_text(
            json.dumps([asdict(r) for r in rows], indent=2) + "\n", encoding="utf-8"
        )
        args = " ".join(argv if argv is not None else sys.argv[1:])
        (out / "result.md").write_text(
            f"Command: `.venv/bin/python bench/decode_cost_check.py {args}`\n\n" + text,
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
