"""draft-prune's model-load step on a vLLM's own LM head and logits processor, TP=1, on the CPU.

Run with a vLLM on the path (a CPU build, or a GPU wheel's source tree) and the plugin:
``python check_attach.py OUT.json``. vLLM's parallel state is set up for one gloo rank with
vLLM's CPU platform; vLLM's ``ParallelLMHead`` and ``LogitsProcessor`` are built as an MTP
draft model builds them. The one stand-in is the proposer around them (no draft model is
loaded): the attributes ``draft_prune.attach`` reads (``speculative_config.method``, ``model``).
Writes whether the pruned head was attached, its rows, and its greedy ids next to the
reference (the full head's logits in float32, argmax over the table's ids).
"""

from __future__ import annotations

import json
import sys
import types
from typing import Any

import torch

sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
import vllm.platforms  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402

vllm.platforms.current_platform = CpuPlatform()
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed.parallel_state import (  # noqa: E402
    init_distributed_environment,
    initialize_model_parallel,
)

VOCAB, HIDDEN, K = 1024, 64, 96


class DraftModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from vllm.model_executor.layers.logits_processor import LogitsProcessor
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        self.lm_head = ParallelLMHead(VOCAB, HIDDEN)
        self.logits_processor = LogitsProcessor(VOCAB)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)


def main() -> None:
    from vfleet_sm75 import draft_prune, draft_vocab

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{sys.argv[2]}",
            backend="gloo",
        )
        initialize_model_parallel(1)
        model = DraftModel()
    torch.manual_seed(0)
    model.lm_head.weight.data.normal_()
    ids = tuple(int(i) for i in torch.randperm(VOCAB)[:K])
    draft_prune._TABLE = draft_vocab.DraftVocab(ids, VOCAB, "x")
    proposer: Any = types.SimpleNamespace(
        speculative_config=types.SimpleNamespace(method="mtp"), model=model
    )
    draft_prune.attach(proposer)
    head = proposer._vfleet_pruned_head
    hidden = torch.randn(5, HIDDEN)
    logits = hidden @ model.lm_head.weight.data.T  # the plain head: scale 1, no soft cap
    table = torch.tensor(ids)
    want = table[logits[:, table].argmax(dim=-1)]
    out = {
        "vllm": vllm.__version__,
        "has_tp_rank": hasattr(model.lm_head, "tp_rank"),
        "attached": head is not None,
        "rows": None if head is None else int(head.weight.shape[0]),
        "got": None if head is None else head.top_tokens(hidden).tolist(),
        "want": want.tolist(),
    }
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
