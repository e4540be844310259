"""What the rules decide, per profile, and that every decision carries its reason."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from vfleet.compile import resolve
from vfleet.errors import Refused
from vfleet.render import render_files
from vfleet.rules import RULES

from .conftest import Result

COMBOS = [
    ("cpu", "tiny-dense"),
    ("cpu", "tiny-hybrid-mtp"),
    ("2x2080ti-22g", "qwen3.8-27b-awq-mtp"),
    ("2x2080ti-22g", "qwen3.6-27b-fp8"),
    ("4x2080ti-22g", "qwen3.6-27b-awq-int4"),
    ("a100-32g", "qwen3.8-27b-awq-mtp"),
]


def vals(profile: str, model: str, *sets: str) -> dict[str, object]:
    return resolve(profile, model, sets=list(sets)).config_values()


def env(profile: str, model: str, *sets: str) -> dict[str, str]:
    return {e.key: e.value for e in resolve(profile, model, sets=list(sets)).env}


def test_sm75_computes_in_half_and_a100_leaves_dtype_alone() -> None:
    assert vals("2x2080ti-22g", "qwen3.6-27b-fp8")["dtype"] == "half"
    assert "dtype" not in vals("a100-32g", "qwen3.8-27b-awq-mtp")


def test_fp8_kv_goes_through_flashinfer_below_sm89() -> None:
    v = vals("a100-32g", "qwen3.8-27b-awq-mtp")
    assert (v["attention-backend"], v["kv-cache-dtype"]) == ("FLASHINFER", "fp8")
    v = vals("4x2080ti-22g", "qwen3.6-27b-awq-int4")
    assert (v["attention-backend"], v["kv-cache-dtype"]) == ("FLASHINFER", "fp8")


def test_flashinfer_sampler_off_on_every_gpu_profile_and_not_on_cpu() -> None:
    for profile, model in COMBOS:
        e = env(profile, model)
        assert (e.get("VLLM_USE_FLASHINFER_SAMPLER") == "0") == (profile != "cpu")


def test_mtp_depth_three_below_four_sm75_gpus_four_at_four() -> None:
    # the 0.27.1 plugin stack runs target and draft on TRITON_ATTN (full CUDA graphs)
    assert vals("2x2080ti-22g", "qwen3.6-27b-fp8")["speculative-config"] == {
        "method": "mtp",
        "num_speculative_tokens": 3,
        "attention_backend": "TRITON_ATTN",
    }
    assert vals("4x2080ti-22g", "qwen3.6-27b-awq-int4")["speculative-config"] == {
        "method": "mtp",
        "num_speculative_tokens": 4,
        "attention_backend": "FLASHINFER",
    }
    assert (
        vals("a100-32g", "qwen3.8-27b-awq-mtp")["speculative-config"]["num_speculative_tokens"] == 3
    )
    launch = resolve(
        "a100-32g", "qwen3.8-27b-awq-mtp", sets=["speculative.num_speculative_tokens=4"]
    )
    assert any(n.level == "warn" and "MTP 4" in n.message for n in launch.notes)


def test_mtp_draft_takes_the_targets_attention_backend() -> None:
    # Without it vLLM 0.24.0 picked FLASH_ATTN (FA3) for the draft beside a FLASHINFER target on
    # the H200, which refuses fp8 KV with fp16 and killed the engine at the first request.
    for profile, model, sets in [
        ("h200-141g", "tiny-hybrid-mtp", ["max_model_len=4096"]),
        ("h200-141g", "tiny-hybrid-mtp", ["max_model_len=4096", "kv_cache_dtype=auto"]),
        ("a100-32g", "qwen3.8-27b-awq-mtp", []),
        ("2x2080ti-22g", "qwen3.6-27b-fp8", ["stack=vllm-0.24.0-flashinfer-sm75"]),
    ]:
        v = vals(profile, model, *sets)
        assert v["speculative-config"]["attention_backend"] == v["attention-backend"], profile
    h200 = vals(
        "h200-141g", "tiny-hybrid-mtp", "max_model_len=4096", "attention_backend=FLASH_ATTN"
    )
    assert h200["speculative-config"]["attention_backend"] == "FLASH_ATTN"
    # ngram has no draft model; the CPU build names no backend at all
    ngram = vals("h200-141g", "tiny-hybrid-mtp", "max_model_len=4096", "speculative.method=ngram")
    assert "attention_backend" not in ngram["speculative-config"]
    assert "attention_backend" not in vals("cpu", "tiny-hybrid-mtp")["speculative-config"]


@pytest.mark.parametrize(("seqs", "k"), [(1, 3), (4, 3), (2, 4), (8, 3)])
def test_cudagraph_sizes_cover_seqs_times_one_plus_k(seqs: int, k: int) -> None:
    v = vals(
        "4x2080ti-22g",
        "qwen3.6-27b-awq-int4",
        f"max_num_seqs={seqs}",
        f"speculative.num_speculative_tokens={k}",
    )
    cc = v["compilation-config"]
    assert isinstance(cc, dict)
    assert cc["max_cudagraph_capture_size"] == seqs * (1 + k)
    assert cc["cudagraph_capture_sizes"] == [(1 + k) * i for i in range(1, seqs + 1)]
    assert cc["cudagraph_mode"] == "PIECEWISE"


def test_one_sequence_on_a_32g_card_and_refusal_above_it_at_256k() -> None:
    assert vals("a100-32g", "qwen3.8-27b-awq-mtp")["max-num-seqs"] == 1
    with pytest.raises(Refused) as exc:
        resolve("a100-32g", "qwen3.8-27b-awq-mtp", sets=["max_num_seqs=2"])
    assert "max_num_seqs: 1" in str(exc.value)
    # a shorter context is allowed
    assert (
        vals("a100-32g", "qwen3.8-27b-awq-mtp", "max_num_seqs=2", "max_model_len=32768")[
            "max-num-seqs"
        ]
        == 2
    )


def test_prefix_caching_on_for_hybrid_gpu_and_off_for_cpu_mtp() -> None:
    launch = resolve("2x2080ti-22g", "qwen3.6-27b-fp8")
    v = launch.config_values()
    assert v["enable-prefix-caching"] is True and v["enable-chunked-prefill"] is True
    assert "mamba-cache-mode" not in v  # implied by every pinned vLLM for GDN models
    assert any(n.level == "dropped" and "mamba-cache-mode" in n.message for n in launch.notes)
    cpu = vals("cpu", "tiny-hybrid-mtp")
    assert cpu["no-enable-prefix-caching"] is True and "enable-prefix-caching" not in cpu
    # the dense model keeps prefix caching on the CPU
    assert vals("cpu", "tiny-dense")["enable-prefix-caching"] is True


def test_false_booleans_render_as_no_flags() -> None:
    # `key: false` is dropped silently by vLLM <= 0.27.1's --config loader.
    for profile, model in COMBOS:
        assert not [k for k, v in vals(profile, model).items() if v is False]


def test_custom_all_reduce_only_over_nvlink(profiles_copy: Path) -> None:
    assert vals("2x2080ti-22g", "qwen3.6-27b-fp8")["disable-custom-all-reduce"] is True
    f = profiles_copy / "hardware" / "2x2080ti-22g.yaml"
    f.write_text(f.read_text().replace("  nvlink: null", "  nvlink: true"))
    launch = resolve("2x2080ti-22g", "qwen3.6-27b-fp8", root=profiles_copy)
    assert "disable-custom-all-reduce" not in launch.config_values()


def test_flashinfer_on_sm75_with_vllm_027_needs_the_plugin(profiles_copy: Path) -> None:
    f = profiles_copy / "hardware" / "2x2080ti-22g.yaml"
    f.write_text(f.read_text().replace('    plugin: "0.1.0"\n', ""))
    with pytest.raises(Refused) as exc:
        resolve("2x2080ti-22g", "qwen3.6-27b-fp8", sets=["kv_cache_dtype=fp8"], root=profiles_copy)
    assert "FLASHINFER below SM80" in str(exc.value) and "vllm-0.24.0-flashinfer-sm75" in str(
        exc.value
    )


def test_bench_purpose_disables_thinking() -> None:
    v = vals("cpu", "tiny-hybrid-mtp", "purpose=bench")
    assert v["default-chat-template-kwargs"] == {"enable_thinking": False}
    assert "default-chat-template-kwargs" not in vals("cpu", "tiny-hybrid-mtp")


def test_api_key_only_in_the_0600_env_file(tmp_path: Path) -> None:
    secret = "sk-test-5f3c9e"
    launch = resolve("cpu", "tiny-dense", sets=[f"api_key={secret}"])
    files = {f.name: f for f in render_files(launch)}
    assert secret in files["vllm.env"].content and files["vllm.env"].mode == 0o600
    for name, f in files.items():
        if name != "vllm.env":
            assert secret not in f.content, name
    assert "api-key" not in launch.config_values()


def test_extra_args_override_with_a_warning() -> None:
    launch = resolve("cpu", "tiny-dense", sets=["extra_args.max-num-seqs=7"])
    assert launch.config_values()["max-num-seqs"] == 7
    assert launch.ctx.args["max-num-seqs"].rule == "operator-overrides"
    assert any("overrides --max-num-seqs" in n.message for n in launch.notes)


@pytest.mark.parametrize(("profile", "model"), COMBOS)
def test_explain_gives_a_reason_and_source_for_every_argument(
    cli: Callable[..., Result], profile: str, model: str
) -> None:
    r = cli("explain", "-p", profile, "-m", model, "--json")
    assert r.rc == 0
    out = json.loads(r.out)
    decisions = out["decisions"]
    rendered = resolve(profile, model).config_values()
    assert {d["key"] for d in decisions if d["kind"] == "arg"} == set(rendered)
    rule_names = {r.name for r in RULES}
    for d in decisions:
        assert d["rule"] in rule_names and d["reason"].strip() and d["source"].strip(), d
    text = cli("explain", "-p", profile, "-m", model)
    assert text.rc == 0
    for key in rendered:
        assert f"--{key} = " in text.out


def test_rules_list_has_sources(cli: Callable[..., Result]) -> None:
    r = cli("rules")
    assert r.rc == 0
    assert r.out.count("source:") == len(RULES) >= 20


def test_auto_memory_sizes_the_kv_cache_from_the_plan() -> None:
    # 4x2080ti leaves gpu_memory_utilization unset: the planner sizes the KV cache
    launch = resolve("4x2080ti-22g", "qwen3.6-27b-awq-int4")
    v = launch.config_values()
    assert "gpu-memory-utilization" not in v
    entry = launch.ctx.args["kv-cache-memory-bytes"]
    assert entry.rule == "auto-memory" and "KV tokens" in entry.reason
    from vfleet.planner import plan_launch

    plan = plan_launch(launch)
    assert v["kv-cache-memory-bytes"] == plan.kv.num_blocks * plan.kv.bytes_per_block
    assert plan.fits and plan.gpu is not None and plan.gpu.headroom_bytes > 0
    # a profile default or operator setting wins
    assert "kv-cache-memory-bytes" not in vals("2x2080ti-22g", "qwen3.6-27b-fp8")


def test_auto_memory_refuses_what_cannot_fit() -> None:
    with pytest.raises(Refused) as exc:
        resolve("4x2080ti-22g", "qwen3.6-27b-fp8", sets=["tensor_parallel_size=1"])
    assert "rule auto-memory" in str(exc.value) and "vfleet plan" in str(exc.value)


def test_two_replicas_on_a_4_gpu_box_each_get_one_tp_pair() -> None:
    """The two-replica layout: two TP=2 instances, one per GPU pair, on one box."""
    for gpus, visible in (("[0,1]", "0,1"), ("[2,3]", "2,3")):
        sets = (f"gpus={gpus}",)
        assert vals("4x2080ti-22g", "qwen3.6-27b-awq-int4", *sets)["tensor-parallel-size"] == 2
        assert env("4x2080ti-22g", "qwen3.6-27b-awq-int4", *sets)["CUDA_VISIBLE_DEVICES"] == visible
    assert "CUDA_VISIBLE_DEVICES" not in env("4x2080ti-22g", "qwen3.6-27b-awq-int4")


@pytest.mark.parametrize(
    ("profile", "sets", "says"),
    [
        ("4x2080ti-22g", ["gpus=[3,4]"], "[4] not distinct GPU indices of the profile's 4 GPUs"),
        ("4x2080ti-22g", ["gpus=[1,1]"], "[1] not distinct"),
        ("4x2080ti-22g", ["gpus=[0,1]", "tensor_parallel_size=4"], "but 2 gpus [0, 1]"),
        ("4x2080ti-22g", ["cpu_cores=0-3"], "remove cpu_cores"),
        ("cpu", ["gpus=[0]"], "the cpu profile has no GPUs"),
    ],
)
def test_devices_that_do_not_fit_the_box_are_refused(
    profile: str, sets: list[str], says: str
) -> None:
    model = "tiny-dense" if profile == "cpu" else "qwen3.6-27b-awq-int4"
    with pytest.raises(Refused) as exc:
        resolve(profile, model, sets=sets)
    assert says in str(exc.value) and "rule device-fits-profile" in str(exc.value)


def test_cpu_instances_bind_the_cores_they_are_given() -> None:
    assert env("cpu", "tiny-dense", "cpu_cores=1")["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env("cpu", "tiny-dense", "cpu_cores=2-3")["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env("cpu", "tiny-dense")
