"""Check the pruned head against a plain reference, at TP=1 and at TP=2 (two gloo processes).

Run with a python that has torch: ``python check_head.py OUT.json``. Writes what it compared;
tests/integration/test_plugin_vllm.py asserts on it. Fresh random inputs on every run (seeded by
time). Also records the aten ops one ``top_tokens`` call dispatches, next to vLLM's own greedy
head (``compute_logits(h).argmax(-1)``: linear, the vocabulary slice, argmax), so the test can
show the pruned head adds no host synchronisation and at most one small op per draft step.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from vfleet_sm75.head import PrunedHead, build_share

V, H, K, B = 1000, 64, 256, 6
PADDED = 1024  # vLLM pads the vocabulary to a multiple of 64 before splitting it


def problem(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(V, H, generator=g)
    ids = torch.randperm(V, generator=g)[:K]  # "frequency order"
    hidden = torch.randn(B, H, generator=g)
    return weight, ids, hidden


def reference(weight: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor) -> list[int]:
    """argmax over the subset's logits, mapped back to target ids (float64)."""
    logits = hidden.double() @ weight[ids].double().T
    return ids[logits.argmax(dim=-1)].tolist()


class _Ops(TorchDispatchMode):
    """The aten ops dispatched inside the block, in order (a real dispatch, nothing replaced)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        # a copy that names a device (``.cpu()``, ``.to("cpu")``) shows it: a host round trip
        self.ops.append(f"{func}(device={kwargs['device']})" if "device" in kwargs else str(func))
        return func(*args, **kwargs)


def ops(seed: int) -> dict[str, list[str]]:
    """Ops per greedy draft call: vLLM's full head, the pruned head at TP=1, one TP=2 rank.

    On the meta device (shapes, no data): an op that needs the values on the host (``.item()``,
    ``.tolist()``, ``bool(t)``, a copy to the CPU) raises or shows as a copy naming a device, as
    it would cost a device round trip on a GPU; on the CPU some of them dispatch nothing."""
    weight, ids, hidden = (t.to("meta") for t in problem(seed))
    head1 = PrunedHead(weight[:K], ids)
    # the all-gather stands in as a local concatenation: its own ops are vLLM's, not the head's
    head2 = PrunedHead(weight[:K], ids, 2, lambda t: torch.cat([t, t], dim=-1))
    got: dict[str, list[str]] = {}
    calls = {
        "stock": lambda: torch.nn.functional.linear(hidden, weight)[..., :V].argmax(dim=-1),
        "tp1": lambda: head1.top_tokens(hidden),
        "tp2": lambda: head2.top_tokens(hidden),
    }
    for name, call in calls.items():
        with _Ops() as rec:
            try:
                call()
            except Exception as exc:  # recorded for the test to name
                rec.ops.append(f"raised {exc!r}")
        got[name] = rec.ops
    return got


def tp1(seed: int) -> dict[str, object]:
    weight, ids, hidden = problem(seed)
    w, i = build_share(weight, 0, V, ids.tolist(), chunk_rows=100)
    got = PrunedHead(w, i).top_tokens(hidden).tolist()
    return {
        "rows": int(w.shape[0]),
        "rows_equal": bool(torch.equal(w, weight[ids])),
        "got": got,
        "want": reference(weight, ids, hidden),
        "in_subset": all(t in set(ids.tolist()) for t in got),
    }


def _rank(rank: int, seed: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    weight, ids, hidden = problem(seed)
    per_rank = PADDED // 2
    start, end = rank * per_rank, min((rank + 1) * per_rank, V)
    local = torch.cat([weight[start:end], torch.zeros(per_rank - (end - start), H)])  # padding rows

    def all_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t)

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=-1)

    share = torch.empty(K // 2, H)  # allocated before the collectives, as draft_prune.attach does
    w, i = build_share(
        local, start, end, ids.tolist(), rank, 2, all_reduce, chunk_rows=64, out=share
    )
    got = PrunedHead(w, i, 2, all_gather).top_tokens(hidden).tolist()
    result = {
        "rank": rank,
        "rows": int(w.shape[0]),
        "rows_equal": bool(torch.equal(w, weight[ids[rank::2]])),
        "ids_equal": i.tolist() == ids[rank::2].tolist(),
        "contiguous_rows": int(((ids >= start) & (ids < end)).sum()),
        "got": got,
        "want": reference(weight, ids, hidden),
    }
    with open(f"{out}.rank{rank}", "w") as fh:
        json.dump(result, fh)
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    seed = int(time.time()) % 100_000
    port = 29500 + seed % 1000
    mp.spawn(_rank, args=(seed, port, out), nprocs=2, join=True)
    ranks = []
    for r in range(2):
        with open(f"{out}.rank{r}") as fh:
            ranks.append(json.load(fh))
        os.unlink(f"{out}.rank{r}")
    with open(out, "w") as fh:
        json.dump({"seed": seed, "k": K, "tp1": tp1(seed), "tp2": ranks, "ops": ops(seed)}, fh)


if __name__ == "__main__":
    main()
