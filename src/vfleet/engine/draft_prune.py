"""Does the SM75 plugin's draft-prune pay on this card? Its cost model, from the draft head's bytes.

Every MTP draft step ends in the LM head: a GEMV over the head's rows and an argmax, bound by
reading the rows (rows x hidden x 2 B, bf16 or fp16). vLLM's head reads its TP rank's padded
vocab-parallel shard; the plugin's pruned head reads the rank's round-robin share of the K most
frequent tokens (plugin/src/vfleet_sm75/head.py), from a copy of those rows it makes at load.
Per draft call pruning saves the rows it skips, at the card's memory bandwidth, and pays a
fixed cost that does not shrink with bandwidth (its id map, a launch): at most 10.2 us, the
largest measured on the H200 (bench/results/h200/draft-head-run*.json, docs/GPU.md section 7).

Pure arithmetic and no third-party import: bench/draft_head_model.py (run on the device machine,
which has no pydantic) uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass

# Seed 000's table size (65,536 of Qwen3.x's 248,320 rows); half of a smaller vocabulary.
DRAFT_VOCAB_TOP = 65_536
BYTES_PER_VALUE = 2  # the head's rows in bf16 (SM80+) or fp16 (SM75): the same bytes
VOCAB_PAD = 64  # vLLM pads the vocab-parallel LM head to a multiple of 64 rows
# The pruned head's cost per call beyond its bytes, relative to vLLM's head: the largest of the
# H200 cases (the tiny model's host-bound call; 4-5 us at the 27B shape).
FIXED_COST_US = 10.2
# How far the bytes saved per call must clear the fixed cost. On the H200 the plugin made decode
# slower on the tiny, mid and 27B models (about 6 ms a step, cause not found: docs/GPU.md
# sections 7 and 9), more than the fixed cost explains, so pruning is turned on only where the
# model's saving is large beside it: ten times the fixed cost. The 27B vocabulary clears it on
# every card below (430-1,509 us a call); the tiny model never does, the mid model only at TP 1
# on a 2080 Ti (208 us; 98.7 at the 2x 2080 Ti profile's TP 2).
PAYS_MARGIN_US = 100.0


@dataclass(frozen=True)
class Bandwidth:
    """A card's memory bandwidth in GB/s (1e9 bytes), and where the figure comes from."""

    gbs: float
    source: str


# By the hardware profiles' accelerator.gpu_model.
BANDWIDTH: dict[str, Bandwidth] = {
    "NVIDIA GeForce RTX 2080 Ti": Bandwidth(616.0, "datasheet (seed 000's card)"),
    "NVIDIA A100 32GB (DRIVE-PG199-PROD)": Bandwidth(
        1555.0,
        "the A100 40 GB's datasheet figure as a stand-in: the DRIVE PG199's own is not "
        "published in seed 001",
    ),
    "NVIDIA H200": Bandwidth(
        4232.0,
        "measured: a 2 GiB device-to-device copy, 4,216 and 4,247 GB/s "
        "(bench/results/h200/draft-head-run*.json)",
    ),
}


def card_bandwidth(gpu_model: str | None, stated_gbs: float | None = None) -> Bandwidth | None:
    """The card's bandwidth: the profile's `accelerator.memory_bandwidth_gbs` where it states
    one, else vfleet's figure for the card model, else None."""
    if stated_gbs is not None:
        return Bandwidth(stated_gbs, "the profile's accelerator.memory_bandwidth_gbs")
    return BANDWIDTH.get(gpu_model or "")


def plugin_k(vocab: int) -> int:
    """K of a table built on the host, as rule `plugin` asks for it."""
    return min(DRAFT_VOCAB_TOP, vocab // 2)


def rows_full(vocab: int, tp: int = 1) -> int:
    """Rows one TP rank reads with vLLM's head: its padded contiguous shard."""
    return -(-vocab // VOCAB_PAD) * VOCAB_PAD // tp


def rows_pruned(k: int, tp: int = 1) -> int:
    """Rows TP rank 0 reads (and copies at load) with the plugin's head: its round-robin share
    of K, the largest of the ranks' shares."""
    return len(range(0, k, tp))


def copy_bytes(k: int, hidden: int, tp: int = 1) -> int:
    """The pruned head's rows the plugin copies per rank at load (vLLM logs them as weights)."""
    return rows_pruned(k, tp) * hidden * BYTES_PER_VALUE


@dataclass(frozen=True)
class DraftPruneCost:
    """The model's figures for one deployment: per draft call, and per decode step at depth k."""

    k: int
    tp: int
    rows_full: int
    rows_pruned: int
    saved_us: float  # the rows not read, at the card's bandwidth
    net_us: float  # saved - FIXED_COST_US
    gbs: float
    gbs_source: str

    @property
    def pays(self) -> bool:
        return self.net_us >= PAYS_MARGIN_US

    def per_step_ms(self, depth: int) -> float:
        """The net saving per decode step: one draft call per speculative token."""
        return self.net_us * depth / 1e3

    def summary(self, depth: int) -> str:
        return (
            f"K={self.k}: {self.rows_full:,} -> {self.rows_pruned:,} head rows per rank saves "
            f"{_us(self.saved_us)} a draft call at {self.gbs:,.0f} GB/s ({self.gbs_source}), "
            f"{_us(self.net_us)} after the pruned head's {FIXED_COST_US} us fixed cost "
            f"({self.per_step_ms(depth):.2f} ms a step at MTP {depth})"
        )


def _us(value: float) -> str:
    return f"{value:,.0f} us" if abs(value) >= 100 else f"{value:.1f} us"


def cost(vocab: int, hidden: int, k: int, tp: int, bandwidth: Bandwidth) -> DraftPruneCost:
    full, pruned = rows_full(vocab, tp), rows_pruned(k, tp)
    saved = (full - pruned) * hidden * BYTES_PER_VALUE / bandwidth.gbs / 1e3
    return DraftPruneCost(
        k,
        tp,
        full,
        pruned,
        round(saved, 1),
        round(saved - FIXED_COST_US, 1),
        bandwidth.gbs,
        bandwidth.source,
    )
