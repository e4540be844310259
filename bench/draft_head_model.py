"""The draft head's shapes, bytes and cost model, without torch (unit-tested on any machine).

``draft_head_gpu.py`` times the heads on a GPU; this module says what each call must read and
what pruning can save on another card. The draft step's LM head is a GEMV over its rows, so it
is bound by the bytes of those rows: ``rows x hidden x 2`` (bf16/fp16) per call.

Cost model (docs/GPU.md section 7): per draft call, pruning saves the rows it does not read,
``(full bytes - pruned bytes) / bandwidth``, and pays a fixed cost that does not depend on the
card's bandwidth: its extra op (the id map), launch and the bandwidth it fails to reach, measured
on the H200 as ``(pruned time - pruned bytes / bw) - (full time - full bytes / bw)``. It pays on a
card when the first exceeds the second; MTP k makes k such calls per decode step.

Run: ``python bench/draft_head_model.py bench/results/h200/draft-head-run*.json`` prints the
model's table for the cards below from those measurements (the largest fixed cost measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

# The arithmetic the product's rule `plugin` decides with (vfleet.engine.draft_prune: stdlib
# only, so this runs on the device machine, which has no pydantic, from the repository's src/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from vfleet.engine.draft_prune import (
    BANDWIDTH,
    BYTES_PER_VALUE,
    DRAFT_VOCAB_TOP,
    plugin_k,
    rows_full,
    rows_pruned,
)

MTP_STEPS = 3  # draft calls per decode step at MTP 3 (every rendered profile's depth)
__all__ = ["DRAFT_VOCAB_TOP", "MTP_STEPS", "plugin_k"]


@dataclass(frozen=True)
class Shape:
    """One model's draft head: hidden size and vocabulary (the rows of the LM head)."""

    name: str
    hidden: int
    vocab: int

    @property
    def k(self) -> int:
        return plugin_k(self.vocab)

    def rows_full(self, tp: int = 1) -> int:
        """Rows one TP rank reads with vLLM's head: its padded contiguous shard."""
        return rows_full(self.vocab, tp)

    def rows_pruned(self, tp: int = 1) -> int:
        """Rows one TP rank reads with the plugin's head: its round-robin share of K."""
        return rows_pruned(self.k, tp)

    def bytes_full(self, tp: int = 1) -> int:
        return self.rows_full(tp) * self.hidden * BYTES_PER_VALUE

    def bytes_pruned(self, tp: int = 1) -> int:
        return self.rows_pruned(tp) * self.hidden * BYTES_PER_VALUE


# Vocabulary and hidden sizes of the presets (profiles/models/*.yaml, hostside/tinymodels.py;
# a unit test checks them against those files).
SHAPES = {
    "qwen": Shape("qwen", 5120, 248_320),  # Qwen3.x-27B
    "mid": Shape("mid", 4096, 32_768),  # mid-hybrid-mtp
    "tiny": Shape("tiny", 256, 1024),  # tiny-hybrid-mtp
}


@dataclass(frozen=True)
class Card:
    """A card by its memory bandwidth (GB/s, 1e9 bytes) and the TP size its stack runs."""

    name: str
    gbs: float
    tp: int
    source: str


@dataclass(frozen=True)
class Prediction:
    card: str
    shape: str
    tp: int
    full_us: float  # bandwidth-bound time of the full head per call
    pruned_us: float
    saved_us: float  # per call, bytes alone
    fixed_us: float  # the pruned head's fixed cost per call (measured on the H200)
    net_us: float  # saved - fixed, per call (> 0: pruning pays)
    net_step_ms: float  # per decode step at MTP_STEPS draft calls


def fixed_cost_us(
    full_us: float, pruned_us: float, bytes_full: int, bytes_pruned: int, gbs: float
) -> float:
    """The pruned head's cost beyond its bytes, relative to the full head's (per call, us):
    ``(pruned - its bytes at gbs) - (full - its bytes at gbs)``, from measured times."""
    return (pruned_us - bytes_pruned / gbs / 1e3) - (full_us - bytes_full / gbs / 1e3)


def predict(shape: Shape, card: Card, fixed_us: float) -> Prediction:
    """What pruning saves per draft call and per MTP step on ``card``, bytes at its bandwidth."""
    full = shape.bytes_full(card.tp) / card.gbs / 1e3
    pruned = shape.bytes_pruned(card.tp) / card.gbs / 1e3
    net = full - pruned - fixed_us
    return Prediction(
        card.name,
        shape.name,
        card.tp,
        round(full, 1),
        round(pruned, 1),
        round(full - pruned, 1),
        round(fixed_us, 1),
        round(net, 1),
        round(net * MTP_STEPS / 1e3, 3),
    )


def step_saving_ms(tokens_per_step: float, before_tps: float, after_tps: float) -> float:
    """The step time a decode speed-up implies at a fixed number of tokens per step (ms)."""
    return tokens_per_step * (1 / before_tps - 1 / after_tps) * 1e3


def fraction_of_bound(nbytes: int, ms: float, copy_gbs: float) -> float:
    """Achieved read bandwidth over the card's measured copy bandwidth (1.0 = at the bound)."""
    return nbytes / (ms / 1e3) / 1e9 / copy_gbs


# The cards of the stacks that carry (or could carry) the plugin, each at the TP its stack runs
# a 27B model with; a card with 0 GB/s takes the measured copy bandwidth.
CARDS = (
    Card(
        "2080 Ti",
        BANDWIDTH["NVIDIA GeForce RTX 2080 Ti"].gbs,
        2,
        "datasheet, seed 000's figure; 2x 2080 Ti stacks run TP 2",
    ),
    Card(
        "A100 40 GB",
        BANDWIDTH["NVIDIA A100 32GB (DRIVE-PG199-PROD)"].gbs,
        1,
        "datasheet (the 80 GB SXM part: 2,039); seed 001 runs TP 1",
    ),
    Card("H200", 0.0, 1, "the measured copy bandwidth, from the results"),
)


@dataclass(frozen=True)
class Measured:
    """What the model takes from draft_head_gpu.py's results: the copy bandwidth (median over
    the files) and the largest fixed cost per call of any case."""

    copy_gbs: float
    fixed_us: float


def read_results(paths: list[Path]) -> Measured:
    docs = [json.loads(p.read_text()) for p in paths]
    bw = statistics.median(float(d["copy_gbs"]) for d in docs)
    fixed = max(float(r["eager_fixed_us"]) for d in docs for r in d["rows"])
    return Measured(bw, max(fixed, 0.0))


def table(measured: Measured) -> list[Prediction]:
    out = []
    for card in CARDS:
        if not card.gbs:  # the measured card
            card = Card(card.name, measured.copy_gbs, card.tp, card.source)
        out.extend(predict(SHAPES[s], card, measured.fixed_us) for s in ("qwen", "mid", "tiny"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the pruning cost model from draft_head.json files")
    ap.add_argument("results", nargs="+", type=Path, help="draft_head.json files (one card)")
    args = ap.parse_args(argv)
    try:
        measured = read_results(args.results)
    except (OSError, ValueError, KeyError) as exc:
        print(f"{exc}: give draft_head.json files written by draft_head_gpu.py", file=sys.stderr)
        return 2
    print(
        f"copy bandwidth {measured.copy_gbs:.0f} GB/s; fixed cost {measured.fixed_us:.1f} us per "
        f"call (the largest measured); {MTP_STEPS} draft calls per step"
    )
    print("card         shape TP  full us  pruned us  saved us  net us/call  net ms/step")
    for p in table(measured):
        print(
            f"{p.card:<12} {p.shape:<5} {p.tp:>2}  {p.full_us:>7}  {p.pruned_us:>9}  "
            f"{p.saved_us:>8}  {p.net_us:>11}  {p.net_step_ms:>11}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
