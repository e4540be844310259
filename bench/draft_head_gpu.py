"""Time the MTP draft head alone, full vocabulary vs the plugin's pruned head, on a CUDA GPU.

Shapes (bf16, batch 1 and 4; ``draft_head_model.SHAPES``, K as rule `plugin` chooses it):
``qwen`` Qwen3.x-27B (hidden 5120, vocabulary 248,320, K 65,536), ``mid`` mid-hybrid-mtp (4096,
32,768, K 16,384), ``tiny`` tiny-hybrid-mtp (256, 1024, K 512). First the card's copy bandwidth
(a 2 GiB device-to-device copy, bytes read + written), against which each eager call's bytes
are expressed as a fraction of the bandwidth bound.
Cases: TP=1 for every shape, and for ``qwen`` one TP=2 rank's share (V/2 rows for the full head,
K/2 for the pruned one; the all-gather of (value, id) pairs between ranks is not timed: one GPU).
Variants per case:
  full     vLLM's path: logits over the (shard of the) vocabulary, the vocabulary slice, argmax
  plain    a plain PyTorch GEMV + argmax over the K rows (the issue's yardstick)
  plugin   vfleet_sm75.head.PrunedHead.top_tokens (GEMV + argmax + id map)

Two ways of timing each, because vLLM 0.24.0 runs the draft head outside any CUDA graph
(``SpecDecodeBaseProposer.propose`` calls ``_greedy_sample`` eagerly after each piecewise-graphed
draft forward):
  graph    3 draft steps captured in one CUDA graph, ms per replay (GPU time of the head)
  eager    ms per call of --iters eager calls back to back between two CUDA events (launch
           gaps + GPU time, as the proposer pays it), and the host's enqueue time alone per
           call (``host``); if the pruned head cost the milliseconds per draft step seen in
           issue 19, ``eager`` would show it here.
``sync`` runs each variant once under ``torch.cuda.set_sync_debug_mode("error")``: "none" means
no operation in it waited for the GPU; otherwise the error.

Run: ``PYTHONPATH=plugin/src python bench/draft_head_gpu.py [--out DIR] [--shapes qwen,mid,tiny]``.
Prints a table and writes draft_head.json (with the copy bandwidth, the bytes per call, each
eager call's fraction of the bound and the pruned head's fixed cost per call). Medians of
--reps timings of --iters calls each. ``draft_head_model.py`` holds the arithmetic.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from draft_head_model import MTP_STEPS, SHAPES, fixed_cost_us, fraction_of_bound
from vfleet_sm75.head import PrunedHead

STEPS = MTP_STEPS
Head = Callable[[torch.Tensor], torch.Tensor]


def graph_time(fn: Head, hiddens: list[torch.Tensor], iters: int, reps: int) -> float:
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


def eager_time(fn: Head, h: torch.Tensor, iters: int, reps: int) -> tuple[float, float]:
    """Median (ms per call, host enqueue ms per call) of ``iters`` eager calls back to back,
    between two CUDA events: what the proposer pays per draft position outside the graph
    (launch gaps included when the host enqueues slower than the GPU runs)."""
    for _ in range(10):
        fn(h)
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(h)
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end) / iters)
        hosts.append((t1 - t0) * 1e3 / iters)
    return statistics.median(walls), statistics.median(hosts)


def copy_gbs(gib: int = 2, reps: int = 20) -> float:
    """The card's measured copy bandwidth, GB/s: a device-to-device copy of ``gib`` GiB, bytes
    read plus bytes written, median of ``reps`` (METHOD.md's ceiling)."""
    src = torch.randn(gib * 2**29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    assert torch.equal(dst[:: 2**20], src[:: 2**20])
    nbytes = 2 * src.numel() * src.element_size()
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / (statistics.median(times) / 1e3) / 1e9


def sync_check(fn: Head, h: torch.Tensor) -> str:
    """ "none" if one call makes no host synchronisation, else what CUDA's sync debug said."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(h)
        return "none"
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=".", help="folder for draft_head.json")
    ap.add_argument("--shapes", default="qwen,mid,tiny", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        print(
            f"--shapes: unknown {unknown or 'none given'}; choose from {', '.join(SHAPES)}",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    name = torch.cuda.get_device_name()
    rows = []
    bw = copy_gbs()
    print(f"copy bandwidth (read + written): {bw:.0f} GB/s", flush=True)
    for shape in shapes:
        sh = SHAPES[shape]
        H, V, K = sh.hidden, sh.vocab, sh.k
        full_w = torch.randn(sh.rows_full(), H, dtype=torch.bfloat16, device=dev) * 0.02
        ids = torch.randperm(V, device=dev)[:K]  # "most frequent first"
        for tp in (1, 2) if shape == "qwen" else (1,):
            rank_v = sh.rows_full(tp)  # vLLM's padded shard
            w_full = full_w[:rank_v] if tp == 2 else full_w
            org = min(rank_v, V)
            share_ids = ids[0::tp]  # rank 0's round-robin share
            assert w_full.numel() * 2 == sh.bytes_full(tp)
            w_share = full_w[share_ids].contiguous()
            head = PrunedHead(w_share, share_ids)
            # The TP=2 rank's own path: max, (value, id) pair, reduction over ranks; the
            # all-gather is replaced by a local concatenation (one GPU: communication untimed).
            head_tp = PrunedHead(w_share, share_ids, 2, lambda t: torch.cat([t, t], dim=-1))
            for batch in (1, 4):
                hiddens = [
                    torch.randn(batch, H, dtype=torch.bfloat16, device=dev) for _ in range(STEPS)
                ]

                def full(h: torch.Tensor, w: torch.Tensor = w_full, n: int = org) -> torch.Tensor:
                    return torch.nn.functional.linear(h, w)[..., :n].argmax(dim=-1)

                def plain(h: torch.Tensor, w: torch.Tensor = w_share) -> torch.Tensor:
                    return torch.nn.functional.linear(h, w).argmax(dim=-1)

                # correctness: the plugin picks the best logit of its share (fp32 reference)
                for h in hiddens:
                    got = head.top_tokens(h)
                    ref = h.float() @ w_share.float().T
                    best = ref.max(dim=-1).values
                    chosen = ref.gather(
                        -1,
                        (share_ids.unsqueeze(0) == got.unsqueeze(1)).int().argmax(-1, keepdim=True),
                    ).squeeze(-1)
                    assert torch.all(best - chosen <= 2e-2 * best.abs().clamp(min=1)), (
                        best,
                        chosen,
                    )
                    assert bool(torch.isin(got, share_ids).all())
                variants: dict[str, Head] = {
                    "full": full,
                    "plain": plain,
                    "plugin": head.top_tokens,
                }
                if tp == 2:
                    variants["plugin_tp2_path"] = head_tp.top_tokens
                t = {
                    k: graph_time(fn, hiddens, args.iters, args.reps) for k, fn in variants.items()
                }
                t["plugin_again"] = graph_time(head.top_tokens, hiddens, args.iters, args.reps)
                eager = {
                    k: eager_time(fn, hiddens[0], args.iters, args.reps)
                    for k, fn in variants.items()
                }
                syncs = {k: sync_check(fn, hiddens[0]) for k, fn in variants.items()}
                bytes_full, bytes_share = sh.bytes_full(tp), sh.bytes_pruned(tp)
                assert w_share.numel() * 2 == bytes_share
                e_full, e_plug = eager["full"][0], eager["plugin"][0]
                rows.append(
                    {
                        "shape": shape,
                        "hidden": H,
                        "vocab": V,
                        "k": K,
                        "tp": tp,
                        "batch": batch,
                        "rows_full": int(w_full.shape[0]),
                        "rows_pruned": int(w_share.shape[0]),
                        "bytes_full": bytes_full,
                        "bytes_pruned": bytes_share,
                        "bytes_ratio": round(w_full.shape[0] / w_share.shape[0], 3),
                        "ms": {k: round(v, 4) for k, v in t.items()},
                        "eager_ms_per_call": {k: round(v[0], 4) for k, v in eager.items()},
                        "eager_host_ms_per_call": {k: round(v[1], 4) for k, v in eager.items()},
                        "host_syncs": syncs,
                        "speedup_plain": round(t["full"] / t["plain"], 3),
                        "speedup_plugin": round(t["full"] / t["plugin"], 3),
                        "eager_speedup_plugin": round(eager["full"][0] / eager["plugin"][0], 3),
                        "tbs_full": round(STEPS * bytes_full / (t["full"] / 1e3) / 1e12, 2),
                        "tbs_plugin": round(STEPS * bytes_share / (t["plugin"] / 1e3) / 1e12, 2),
                        # per eager call against the copy bandwidth (1.0 = the bound)
                        "bound_ms": {
                            "full": round(bytes_full / bw / 1e6, 4),
                            "pruned": round(bytes_share / bw / 1e6, 4),
                        },
                        "eager_of_bound": {
                            "full": round(fraction_of_bound(bytes_full, e_full, bw), 3),
                            "plugin": round(fraction_of_bound(bytes_share, e_plug, bw), 3),
                        },
                        "eager_fixed_us": round(
                            fixed_cost_us(e_full * 1e3, e_plug * 1e3, bytes_full, bytes_share, bw),
                            1,
                        ),
                    }
                )
        del full_w
        torch.cuda.empty_cache()
    doc = {
        "device": name,
        "torch": torch.__version__,
        "copy_gbs": round(bw, 1),
        "steps": STEPS,
        "iters": args.iters,
        "reps": args.reps,
        "command": " ".join(sys.argv),
        "rows": rows,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "draft_head.json").write_text(json.dumps(doc, indent=1))
    print(
        f"{name}, torch {torch.__version__}; graph: {STEPS} draft steps per replay; "
        f"eager: ms per call; median of {args.reps}"
    )
    print(
        "case             rows full/pruned  ratio  full ms  plain ms  plugin ms (again)  plain x  "
        "plugin x  TB/s full/plugin | eager full/plugin ms (host)  syncs"
    )
    for r in rows:
        m, e, eh = r["ms"], r["eager_ms_per_call"], r["eager_host_ms_per_call"]
        case = f"{r['shape']} TP={r['tp']} B={r['batch']}"
        print(
            f"{case:<16} {r['rows_full']:>7}/{r['rows_pruned']:<7}  {r['bytes_ratio']:>5}  "
            f"{m['full']:>7.4f}  {m['plain']:>8.4f}  {m['plugin']:>9.4f} "
            f"({m['plugin_again']:.4f})  {r['speedup_plain']:>7}  "
            f"{r['speedup_plugin']:>8}  {r['tbs_full']}/{r['tbs_plugin']}"
            f" | {e['full']:.4f}/{e['plugin']:.4f} ({eh['full']:.4f}/{eh['plugin']:.4f})"
            f"  {r['host_syncs']['plugin']}  of bound {r['eager_of_bound']['full']}/"
            f"{r['eager_of_bound']['plugin']}  fixed {r['eager_fixed_us']} us"
            + (
                f"  TP=2 path {m['plugin_tp2_path']:.4f} ms "
                f"({m['full'] / m['plugin_tp2_path']:.3f}x), eager {e['plugin_tp2_path']:.4f}"
                if "plugin_tp2_path" in m
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
