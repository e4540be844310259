"""Time the MTP draft head alone, full vocabulary vs the plugin's pruned head, on a CUDA GPU.

Qwen3.8-27B shapes: hidden 5120, vocabulary 248,320, K 65,536, bf16; batch 1 and 4; 3 draft
steps captured in one CUDA graph (the head runs once per draft step). Cases: TP=1, and one TP=2
rank's share (V/2 rows for the full head, K/2 for the pruned one; the all-gather of (value, id)
pairs between ranks is not timed: one GPU). Variants per case:
  full     vLLM's path: logits over the (shard of the) vocabulary, then argmax
  plain    a plain PyTorch GEMV + argmax over the K rows (the issue's yardstick)
  plugin   vfleet_sm75.head.PrunedHead.top_tokens (GEMV + max + id map)

Run: ``PYTHONPATH=plugin/src python bench/draft_head_gpu.py [--out DIR]``. Prints a table and
writes draft_head.json. Median of --reps timings of --iters graph replays each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from vfleet_sm75.head import PrunedHead

H, V, K, STEPS = 5120, 248_320, 65_536, 3


def graph_time(fn, hiddens, iters: int, reps: int) -> float:
    """Median ms per replay of a graph running ``fn`` on each of ``hiddens`` (one per step)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up outside the graph (allocations, cuBLAS handles)
            for h in hiddens:
                fn(h)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(h) for h in hiddens]
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    del outs
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=".", help="folder for draft_head.json")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    full_w = torch.randn(V, H, dtype=torch.bfloat16, device=dev) * 0.02
    ids = torch.randperm(V, device=dev)[:K]  # "most frequent first"
    rows = []
    for tp in (1, 2):
        rank_v = -(-V // 64) * 64 // tp  # vLLM's padded shard
        w_full = full_w[:rank_v] if tp == 2 else full_w
        share_ids = ids[0::tp]  # rank 0's round-robin share
        w_share = full_w[share_ids].contiguous()
        head = PrunedHead(w_share, share_ids)
        # The TP=2 rank's own path: max, (value, id) pair, reduction over ranks; the all-gather
        # is replaced by a local concatenation (one GPU: communication is not timed).
        head_tp = PrunedHead(w_share, share_ids, 2, lambda t: torch.cat([t, t], dim=-1))
        for batch in (1, 4):
            hiddens = [
                torch.randn(batch, H, dtype=torch.bfloat16, device=dev) for _ in range(STEPS)
            ]

            def full(h: torch.Tensor, w: torch.Tensor = w_full) -> torch.Tensor:
                return torch.nn.functional.linear(h, w).argmax(dim=-1)

            def plain(h: torch.Tensor, w: torch.Tensor = w_share) -> torch.Tensor:
                return torch.nn.functional.linear(h, w).argmax(dim=-1)

            # correctness: the plugin picks the best logit of its share (fp32 reference)
            for h in hiddens:
                got = head.top_tokens(h)
                ref = h.float() @ w_share.float().T
                best = ref.max(dim=-1).values
                chosen = ref.gather(
                    -1, (share_ids.unsqueeze(0) == got.unsqueeze(1)).int().argmax(-1, keepdim=True)
                ).squeeze(-1)
                assert torch.all(best - chosen <= 2e-2 * best.abs().clamp(min=1)), (best, chosen)
                assert bool(torch.isin(got, share_ids).all())
            t = {
                "full": graph_time(full, hiddens, args.iters, args.reps),
                "plain": graph_time(plain, hiddens, args.iters, args.reps),
                "plugin": graph_time(head.top_tokens, hiddens, args.iters, args.reps),
                "plugin_again": graph_time(head.top_tokens, hiddens, args.iters, args.reps),
            }
            if tp == 2:
                t["plugin_tp2_path"] = graph_time(
                    head_tp.top_tokens, hiddens, args.iters, args.reps
                )
            bytes_full = w_full.numel() * 2 * STEPS
            bytes_share = w_share.numel() * 2 * STEPS
            rows.append(
                {
                    "tp": tp,
                    "batch": batch,
                    "rows_full": int(w_full.shape[0]),
                    "rows_pruned": int(w_share.shape[0]),
                    "bytes_ratio": round(w_full.shape[0] / w_share.shape[0], 3),
                    "ms": {k: round(v, 4) for k, v in t.items()},
                    "speedup_plain": round(t["full"] / t["plain"], 3),
                    "speedup_plugin": round(t["full"] / t["plugin"], 3),
                    "tbs_full": round(bytes_full / (t["full"] / 1e3) / 1e12, 2),
                    "tbs_plugin": round(bytes_share / (t["plugin"] / 1e3) / 1e12, 2),
                }
            )
    doc = {"device": name, "torch": torch.__version__, "steps": STEPS, "rows": rows}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "draft_head.json").write_text(json.dumps(doc, indent=1))
    print(
        f"{name}, torch {torch.__version__}; {STEPS} draft steps per graph; median of {args.reps}"
    )
    print(
        "case        rows full/pruned  ratio  full ms  plain ms  plugin ms (again)  plain x  "
        "plugin x  TB/s full/plugin"
    )
    for r in rows:
        m = r["ms"]
        case = f"TP={r['tp']} B={r['batch']}"
        print(
            f"{case:<11} {r['rows_full']:>7}/{r['rows_pruned']:<7}  {r['bytes_ratio']:>5}  "
            f"{m['full']:>7.4f}  {m['plain']:>8.4f}  {m['plugin']:>9.4f} "
            f"({m['plugin_again']:.4f})  {r['speedup_plain']:>7}  "
            f"{r['speedup_plugin']:>8}  {r['tbs_full']}/{r['tbs_plugin']}"
            + (
                f"  TP=2 path {m['plugin_tp2_path']:.4f} ms "
                f"({m['full'] / m['plugin_tp2_path']:.3f}x)"
                if "plugin_tp2_path" in m
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
