"""The pruned draft head: the LM head's rows for the K most frequent tokens, split round-robin.

MTP drafting needs only the argmax of the draft logits, and a wrong draft is rejected by the
target model anyway, so drafting from the K most frequent tokens changes acceptance, never the
output. Each tensor-parallel rank holds K/TP rows (frequency ranks r, r+TP, ...), computes a local
max and maps it to the target id; the (value, id) pairs are all-gathered and the best kept:
the same reduction as vLLM's ``LogitsProcessor.get_top_tokens``, over K/TP rows instead of V/TP.
No host synchronisation, so the step can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

AllGather = Callable[[torch.Tensor], torch.Tensor]  # [B, 2] -> [B, 2 * tp] (along the last dim)
AllReduce = Callable[[torch.Tensor], None]  # in-place sum over the TP group


class PrunedHead:
    """One rank's share: ``weight`` [n, H] rows of the LM head and their target ``ids`` [n]."""

    def __init__(
        self,
        weight: torch.Tensor,
        ids: torch.Tensor,
        tp_size: int = 1,
        all_gather: AllGather | None = None,
    ) -> None:
        if weight.shape[0] != ids.shape[0]:
            raise ValueError(f"{weight.shape[0]} rows but {ids.shape[0]} ids")
        if tp_size > 1 and all_gather is None:
            raise ValueError("tp_size > 1 needs an all_gather")
        self.weight = weight
        self.ids = ids.to(device=weight.device, dtype=torch.int64)
        self.ids_f = (
            self.ids.float()
        )  # float32 holds every id below 2**24 exactly (Qwen3.x: 248,320)
        self.tp_size = tp_size
        self.all_gather = all_gather

    def top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Greedy draft token ids [B] (target vocabulary) for hidden states [B, H]."""
        logits = torch.nn.functional.linear(hidden_states.to(self.weight.dtype), self.weight)
        if self.tp_size == 1:  # argmax alone is one output less than max (docs/BENCHMARKS.md)
            return self.ids[logits.argmax(dim=-1)]
        assert self.all_gather is not None
        values, index = logits.max(dim=-1)
        pair = torch.stack([values.float(), self.ids_f[index]], dim=-1)
        gathered = self.all_gather(pair).view(-1, self.tp_size, 2)
        best = gathered[:, :, 0].argmax(dim=-1, keepdim=True)
        return gathered[:, :, 1].gather(-1, best).squeeze(-1).to(torch.int64)


def build_share(
    local_weight: torch.Tensor,
    vocab_start: int,
    vocab_end: int,
    token_ids: Sequence[int],
    rank: int = 0,
    tp_size: int = 1,
    all_reduce: AllReduce | None = None,
    chunk_rows: int = 4096,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's round-robin share of ``token_ids`` (frequency order) as (weight, ids).

    ``local_weight`` holds rows [vocab_start, vocab_end) of the LM head (vLLM's contiguous
    vocab-parallel shard). The K rows are assembled chunk by chunk: each rank copies the rows it
    owns into a zero buffer and a sum all-reduce fills in the rest (each row is non-zero on
    exactly one rank, so the sum is exact); the rank keeps every TP-th row. One-time cost at
    load: K x H values through the all-reduce; extra memory: K/TP rows per rank (``out``, in
    its dtype, if given: allocate it before any rank starts the collectives).
    """
    if tp_size > 1 and all_reduce is None:
        raise ValueError("tp_size > 1 needs an all_reduce")
    device = local_weight.device
    hidden = local_weight.shape[1]
    ids_all = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    k = ids_all.shape[0]
    step = max(tp_size, chunk_rows - chunk_rows % tp_size)
    n_share = len(range(rank, k, tp_size))
    if out is None:
        out = torch.empty(n_share, hidden, dtype=local_weight.dtype, device=device)
    if tuple(out.shape) != (n_share, hidden):
        raise ValueError(f"out is {tuple(out.shape)}, the share needs {(n_share, hidden)}")
    for start in range(0, k, step):
        ids_c = ids_all[start : start + step]
        buf = torch.zeros(ids_c.shape[0], hidden, dtype=local_weight.dtype, device=device)
        mine = (ids_c >= vocab_start) & (ids_c < vocab_end)
        buf[mine] = local_weight[ids_c[mine] - vocab_start]
        if tp_size > 1:
            assert all_reduce is not None
            all_reduce(buf)
        first = (rank - start) % tp_size
        rows = buf[first::tp_size]
        at = (start + first) // tp_size
        out[at : at + rows.shape[0]] = rows.to(out.dtype)
    return out, ids_all[rank::tp_size].clone()
