"""The draft head's shapes, bytes and cost model, without torch (unit-tested on any machine).

``draft_head_gpu.py`` times the heads on a GPU; this module says what each call must read and
what pruning can save on another card. The draft step's LM head is a GEMV over its rows, so it
is bound by the bytes of those rows: ``rows x hidden x 2`` (bf16/fp16) per call.

Cost model (docs/GPU.md section 7): per draft call, pruning saves the rows it does not read,
``(full bytes - pruned bytes) / bandwidth``, and pays a fixed cost that does not depend on the
card's bandwidth: its extra op (the id map), launch and the bandwidth it fails to reach, measured
on the H200 as ``(pruned time - pruned bytes / bw) - (full time - full bytes / bw)``. It pays on a
card when the first exceeds the second; MTP k makes k such calls per decode step.
"""

from __future__ import annotations

from dataclasses import dataclass

# The plugin's table size: rule `plugin` takes min(this, vocabulary // 2)
# (src/vfleet/engine/rules/hardware.py DRAFT_VOCAB_TOP; a unit test keeps the two equal: the
# device machine has no pydantic to import the rule itself).
DRAFT_VOCAB_TOP = 65_536
BYTES_PER_VALUE = 2  # bf16 on the H200, fp16 on SM75: the same bytes
MTP_STEPS = 3  # draft calls per decode step at MTP 3 (every rendered profile's depth)
VLLM_VOCAB_PAD = 64  # vLLM pads the vocab-parallel LM head to a multiple of 64 rows


def plugin_k(vocab: int) -> int:
    """K as rule `plugin` chooses it for a table built on the host."""
    return min(DRAFT_VOCAB_TOP, vocab // 2)


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
        return -(-self.vocab // VLLM_VOCAB_PAD) * VLLM_VOCAB_PAD // tp

    def rows_pruned(self, tp: int = 1) -> int:
        """Rows one TP rank reads with the plugin's head: its round-robin share of K."""
        return len(range(0, self.k, tp))

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
