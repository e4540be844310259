"""What the rules decide, per profile, and that every decision carries its reason."""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import itertools
import json
import pkgutil
import re
from collections.abc import Callable
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest
from vfleet_sm75.settings import FEATURES

from tests.conftest import REPO, Result
from tests.support.cases import COMBOS
from vfleet.config.schema import HostVars
from vfleet.engine import rules as rules_pkg
from vfleet.engine.compile import resolve
from vfleet.engine.decisions import Decisions
from vfleet.engine.rules import RULES, Ctx, Rule
from vfleet.errors import Refused
from vfleet.render.release import release_id, render_files


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
        ("2x2080ti-22g", "qwen3.6-27b-fp8", ["stack=vllm-0.24.0"]),
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


# `nvidia-smi topo -m` of a real two-GPU NVLink box (H200 x2), and the same box as if its GPUs
# were linked over the CPU socket (SYS): what a deploy reads on the host before planning.
TOPO_NVLINK = (REPO / "tests" / "data" / "nvidia-smi-2xh200" / "topology.txt").read_text()
TOPO_PCIE = TOPO_NVLINK.replace("NV18", "SYS ")


def _allreduce(
    topology: str, *sets: str, profile: str = "2x2080ti-22g", model: str = "qwen3.6-27b-fp8"
) -> tuple[object, str]:
    launch = resolve(
        profile,
        model,
        sets=list(sets),
        host=HostVars(gpu_topology=topology),
    )
    arg = next((e for e in launch.args if e.key == "disable-custom-all-reduce"), None)
    notes = " ".join(n.message for n in launch.notes if n.rule == "all-reduce")
    return (arg.value if arg else None), (arg.reason if arg else notes)


def test_custom_all_reduce_from_the_hosts_real_topology() -> None:
    # NVLink on every pair (seed 002's box): custom all-reduce stays on, as the seed ran it.
    value, why = _allreduce(TOPO_NVLINK)
    assert value is None and "NVLink-connected on every pair" in why
    # PCIe / socket links: NCCL.
    value, why = _allreduce(TOPO_PCIE)
    assert value is True and "not NVLink-connected" in why
    # Nothing read (a render on the control machine): NCCL, and the reason says why.
    value, why = _allreduce("")
    assert value is True and "not known" in why
    # The operator (an inventory variable) forces either way, whatever the links.
    assert _allreduce(TOPO_PCIE, "custom_all_reduce=true")[0] is None
    assert _allreduce(TOPO_NVLINK, "custom_all_reduce=false")[0] is True


def test_topology_of_other_gpus_is_not_known() -> None:
    # One TP 2 replica on GPUs 2 and 3 of a 4-GPU box; the text covers GPUs 0 and 1 only.
    value, why = _allreduce(
        TOPO_NVLINK,
        "tensor_parallel_size=2",
        "gpus=[2,3]",
        profile="4x2080ti-22g",
        model="qwen3.6-27b-awq-int4",
    )
    assert value is True and "not known" in why


def test_async_scheduling_off_only_where_its_reason_holds() -> None:
    # SM75 with one sequence (seed 002): off, no gain there.
    assert vals("2x2080ti-22g", "qwen3.6-27b-fp8", "max_num_seqs=1")["no-async-scheduling"] is True
    # More sequences (seeds 000 and 004 ran 8 and 4): vLLM's default (on for MTP) stays.
    assert "no-async-scheduling" not in vals("2x2080ti-22g", "qwen3.6-27b-fp8", "max_num_seqs=4")
    # Not SM75: vLLM's default.
    assert "no-async-scheduling" not in vals("a100-32g", "qwen3.8-27b-awq-mtp")


@pytest.mark.parametrize(
    ("profile", "model"),
    [("2x2080ti-22g", "qwen3.8-27b-awq-mtp"), ("a100-32g", "qwen3.8-27b-awq-mtp"),
     ("4x2080ti-22g", "qwen3.6-27b-awq-int4"), ("h200-141g", "qwen3.6-27b-awq-int4")],
)  # fmt: skip
def test_full_decode_graphs_without_speculation_piecewise_with_it(profile: str, model: str) -> None:
    def graphs(*sets: str) -> tuple[str, str]:
        launch = resolve(profile, model, sets=list(sets))
        e = next(e for e in launch.args if e.key == "compilation-config")
        return e.value["cudagraph_mode"], e.reason

    mode, why = graphs()  # MTP: the scramble report keeps PIECEWISE
    assert mode == "PIECEWISE" and "scramble" in why
    mode, why = graphs("speculative.method=none")
    assert mode == "FULL_AND_PIECEWISE" and "52.3 tok/s PIECEWISE, 91.2" in why
    assert graphs("speculative.method=ngram")[0] == "PIECEWISE"  # 1+k tokens a step too
    # The operator's choice stands either way, without the rule's reason.
    mode, why = graphs("speculative.method=none", "cudagraph_mode=PIECEWISE")
    assert mode == "PIECEWISE" and "91.2" not in why and "scramble" not in why
    assert graphs("cudagraph_mode=FULL_AND_PIECEWISE")[0] == "FULL_AND_PIECEWISE"


def test_triton_attn_reason_and_graph_mode_agree() -> None:
    launch = resolve("2x2080ti-22g", "qwen3.8-27b-awq-mtp")
    backend = next(e for e in launch.args if e.key == "attention-backend")
    graphs = next(e for e in launch.args if e.key == "compilation-config")
    assert backend.value == "TRITON_ATTN" and "full CUDA graphs" not in backend.reason
    assert graphs.value["cudagraph_mode"] == "PIECEWISE" and "PIECEWISE" in backend.reason


def test_flashinfer_on_sm75_needs_the_plugin_from_vllm_024(profiles_copy: Path) -> None:
    # vLLM 0.24.0 raised FLASHINFER's floor to SM80 (its flashinfer.py); without the plugin's
    # hook a stack of 0.24 or later cannot run it on a 2080 Ti.
    f = profiles_copy / "hardware" / "2x2080ti-22g.yaml"
    f.write_text(f.read_text().replace('    plugin: "0.1.0"\n', ""))
    with pytest.raises(Refused) as exc:
        resolve("2x2080ti-22g", "qwen3.6-27b-fp8", sets=["kv_cache_dtype=fp8"], root=profiles_copy)
    assert "vLLM 0.27.1 refuses FLASHINFER below SM80" in str(exc.value)
    assert "SM75 plugin" in str(exc.value)
    # The plugin lifts the floor only with a FlashInfer that has the SM75 fix (0.6.16+): stock
    # 0.24.0 pins 0.6.12, so FLASHINFER stays refused on that stack even with the plugin.
    with pytest.raises(Refused) as exc:
        resolve("2x2080ti-22g", "qwen3.6-27b-fp8", sets=["stack=vllm-0.24.0", "kv_cache_dtype=fp8"])
    assert "FlashInfer >= 0.6.16" in str(exc.value) and "installs FlashInfer 0.6.12" in str(
        exc.value
    )
    assert "vllm-0.27.1-plugin" in str(exc.value)
    # 0.21.0 still allows SM75: no plugin needed there.
    launch = resolve("4x2080ti-22g", "qwen3.6-27b-awq-int4", sets=["kv_cache_dtype=fp8"])
    assert launch.config_values()["attention-backend"] == "FLASHINFER"


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


def test_published_hashes_cannot_check_a_guessed_key() -> None:
    """Issue 22, finding 3: release.json (0644) held the sha256 of vllm.env and the release id
    (published on the sidecar's /metrics) was a hash over it: a guess of the key could be
    checked offline. Both are now taken over the env file with the key's value redacted."""

    def render(*sets: str) -> tuple[str, dict[str, str], str]:
        files = render_files(resolve("cpu", "tiny-dense", sets=list(sets)))
        by_name = {f.name: f.content for f in files}
        return release_id(files), json.loads(by_name["release.json"])["files"], by_name["vllm.env"]

    rid_a, hashes_a, env_a = render("api_key=sk-first-key-1")
    rid_b, hashes_b, env_b = render("api_key=sk-other-key-2")
    rid_none, _, _ = render()
    digests = {hashlib.sha256(env.encode()).hexdigest() for env in (env_a, env_b)}
    assert not digests & {*hashes_a.values(), *hashes_b.values(), rid_a, rid_b}
    # The key's value is not an input of either: rotating it keeps the release (the role
    # rewrites the env file in place); adding or removing a key is a new release.
    assert env_a != env_b and hashes_a == hashes_b and rid_a == rid_b
    assert rid_none != rid_a
    assert (
        hashes_a["vllm.env"]
        == hashlib.sha256(env_a.replace("'sk-first-key-1'", "'<secret>'").encode()).hexdigest()
    )


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


def test_auto_memory_keeps_the_tested_utilisation_when_the_terms_are_uncertain() -> None:
    # 4x2080ti leaves memory unset; the terms' uncertainty exceeds the 3% margin explicit KV
    # bytes would leave, so the seed's tested utilisation is rendered (tests/unit/test_planner.py
    # checks the decision both ways).
    launch = resolve("4x2080ti-22g", "qwen3.6-27b-awq-int4")
    v = launch.config_values()
    assert "kv-cache-memory-bytes" not in v and v["gpu-memory-utilization"] == 0.868
    entry = launch.ctx.args["gpu-memory-utilization"]
    assert entry.rule == "auto-memory" and "seeds/004" in entry.reason
    assert "uncertainty" in entry.reason
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


def test_sleep_mode_with_fp8_kv_on_a_hybrid_model_is_refused_before_0_27_1() -> None:
    # vLLM 0.24.0's wake_up calls .zero_() on the GDN state lists (init_fp8_kv_scales) and the
    # engine stays paused: seen on the H200 lane (docs/GPU.md); 0.27.1 zeroes list entries.
    sleep = ["max_model_len=4096", "extra_args.enable-sleep-mode=true"]
    with pytest.raises(Refused, match="wake_up fails on the GDN state") as exc:
        resolve("h200-141g", "tiny-hybrid-mtp", sets=sleep)
    assert "kv_cache_dtype auto" in exc.value.fix
    # what the lane served and woke: bf16 KV on 0.24.0
    ok = resolve("h200-141g", "tiny-hybrid-mtp", sets=[*sleep, "kv_cache_dtype=auto"])
    assert ok.config_values()["enable-sleep-mode"] is True
    # a dense model (no state lists) and a 0.27.1 stack keep fp8 KV with sleep mode
    assert resolve("h200-141g", "tiny-dense", sets=sleep).config_values()["kv-cache-dtype"] == "fp8"
    fixed = resolve("a100-32g", "qwen3.8-27b-awq-mtp", sets=sleep[1:])
    assert fixed.config_values()["kv-cache-dtype"] == "fp8"


# The rule table in order, recorded before engine/rules.py became a package (issue 21): the order
# decides which rule reads which decision and which of two arguments wins, so a change to it
# is a change of behaviour, made here on purpose.
RULE_ORDER = [
    "model",
    "front",
    "listen",
    "api-key-in-env",
    "device-fits-profile",
    "devices",
    "tensor-parallel",
    "dtype-half-sm75",
    "quantization",
    "attention-backend",
    "cuda-env",
    "cpu-kv-space",
    "threads",
    "caches",
    "context-and-batch",
    "gpu-memory",
    "speculative",
    "cudagraphs",
    "async-scheduling",
    "plugin",
    "prefix-caching",
    "chunked-prefill",
    "all-reduce",
    "multimodal-profiling",
    "parsers",
    "bench-thinking-off",
    "observability",
    "sidecar",
    "drain",
    "restart-policy",
    "sleep-mode",
    "auto-memory",
    "operator-overrides",
]


def test_the_rule_table_keeps_its_order_names_summaries_and_sources() -> None:
    assert [r.name for r in RULES] == RULE_ORDER
    # A rule's function is named after it (`def all_reduce` in rules/multigpu.py), and the
    # package defines no rule that the table leaves out.
    assert [r.fn.__name__ for r in RULES] == [n.replace("-", "_") for n in RULE_ORDER]
    defined = {
        id(obj)
        for module in pkgutil.iter_modules(rules_pkg.__path__)
        for obj in vars(importlib.import_module(f"vfleet.engine.rules.{module.name}")).values()
        if isinstance(obj, Rule)
    }
    assert defined == {id(r) for r in RULES}
    # Every summary and source as recorded with the order (sha256 of their repr): `vfleet rules`
    # and `vfleet explain` print them.
    table = repr([(r.name, r.summary, r.source) for r in RULES]).encode()
    assert hashlib.sha256(table).hexdigest() == (
        "e6df9f263d33849782bfc1da3182127b194f55b86630b785ab62c05ceec80d98"
    )


def test_decisions_are_typed_set_once_and_sealed_after_the_rules() -> None:
    launch = resolve("cpu", "tiny-hybrid-mtp")
    d = launch.decisions
    assert (d.port, d.sidecar_port, d.tp, d.spec_method, d.spec_k) == (8000, 9500, 1, "mtp", 3)
    assert d.backend is None and d.shutdown_timeout_s == 30 and d.restart_sec == 10
    with pytest.raises(FrozenInstanceError):
        d.port = 8001
    assert launch.port == 8000
    fresh = Decisions()
    with pytest.raises(AttributeError):
        _ = fresh.port  # a rule that reads a decision before the rule that makes it ran
    fresh.tp = 2
    with pytest.raises(AssertionError, match="tp set twice"):
        fresh.tp = 4
    with pytest.raises(AttributeError, match="no field 'tpp'"):
        setattr(fresh, "tpp", 2)  # noqa: B010 (mypy refuses the misspelling written plainly)
    with pytest.raises(AssertionError, match="no rule decided model_dir, served_model_name"):
        fresh.seal()


def test_every_decision_is_documented_with_the_rule_that_makes_it() -> None:
    """Each field of Decisions has a docstring naming the rule that sets it, and running the
    rules one by one over these deployments shows that rule, and no other, setting it."""
    tree = ast.parse(Path(inspect.getfile(Decisions)).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Decisions")
    docs: dict[str, str] = {}
    for field, doc in itertools.pairwise(cls.body):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
            name = field.target.id
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), name
            docs[name] = str(doc.value.value)
    assert set(docs) == {f.name for f in fields(Decisions)}
    documented = {
        name: set(re.findall(r"Rule\s+`([a-z0-9-]+)`", doc)) for name, doc in docs.items()
    }
    assert all(len(rules) == 1 for rules in documented.values()), documented
    seen: dict[str, set[str]] = {name: set() for name in docs}
    deployments = [
        *((p, m, []) for p, m in COMBOS),
        ("cpu", "tiny-hybrid-mtp", ["draft_vocab_corpus=/srv/c.txt", "max_num_batched_tokens=512"]),
    ]
    for profile, model, sets in deployments:
        launch = resolve(profile, model, sets=sets)
        ctx = Ctx(launch.profile, launch.model, launch.stack_name, launch.settings, launch.host)
        for r in RULES:
            before = set(vars(ctx.d))
            ctx.current = r
            r.fn(ctx)
            for name in set(vars(ctx.d)) - before:
                seen[name].add(r.name)
        assert ctx.d == launch.decisions
    assert seen == documented


def test_sleep_level_mounts_the_dev_routes_on_loopback_and_frees_memory_only_on_a_gpu() -> None:
    # docs/SWAP.md, "Resident models": the standby `vfleet switch` sleeps and wakes.
    e = env("cpu", "tiny-dense", "sleep_level=0")
    assert (e["VLLM_SERVER_DEV_MODE"], e["VFLEET_SLEEP_LEVEL"]) == ("1", "0")
    v = vals("cpu", "tiny-dense", "sleep_level=0")
    assert "enable-sleep-mode" not in v and v["host"] == "127.0.0.1"
    assert "VLLM_SERVER_DEV_MODE" not in env("cpu", "tiny-dense")
    # vLLM's CPU platform has no sleep mode: levels 1 and 2 are refused there, with the fix.
    for level in (1, 2):
        with pytest.raises(Refused, match=f"sleep_level {level} on profile cpu") as exc:
            resolve("cpu", "tiny-dense", sets=[f"sleep_level={level}"])
        assert "sleep_level 0" in (exc.value.fix or "")
        assert "is_sleep_mode_available" in exc.value.message
    # on a GPU: the CuMem allocator that sleep frees memory through
    gpu = resolve("h200-141g", "tiny-dense", sets=["sleep_level=1", "max_model_len=4096"])
    assert gpu.config_values()["enable-sleep-mode"] is True
    assert {x.key: x.value for x in gpu.env}["VFLEET_SLEEP_LEVEL"] == "1"


def test_sleep_level_keeps_vllm_on_loopback_whatever_the_listen_address() -> None:
    # Off loopback the front listens; vLLM and its dev routes stay on 127.0.0.1.
    front = resolve("cpu", "tiny-dense", sets=["sleep_level=0", "host=0.0.0.0", "api_key=k"])
    assert front.config_values()["host"] == "127.0.0.1" and front.decisions.front
    # extra_args cannot move vLLM off loopback while the dev routes are mounted.
    for moved in ("extra_args.host=0.0.0.0", "extra_args.host=192.0.2.1", "extra_args.uds=/x"):
        with pytest.raises(Refused, match="sleep_level 0 mounts") as exc:
            resolve("cpu", "tiny-dense", sets=["sleep_level=0", moved])
        assert "drop extra_args host/uds" in (exc.value.fix or "")
    assert vals("cpu", "tiny-dense", "sleep_level=0", "extra_args.host=127.0.0.2")["host"] == (
        "127.0.0.2"
    )


def test_sleep_level_with_fp8_kv_on_a_hybrid_model_is_refused_as_the_flag_is() -> None:
    # The wake bug of 0.24.0 (rule operator-overrides) holds for the setting too.
    with pytest.raises(Refused, match="wake_up fails on the GDN state"):
        resolve("h200-141g", "tiny-hybrid-mtp", sets=["sleep_level=1", "max_model_len=4096"])


def test_sleep_level_on_the_cpu_is_refused_by_the_cli_with_nothing_written(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    out = tmp_path / "release"
    r = cli("render", "-p", "cpu", "-m", "tiny-dense", "--set", "sleep_level=1", "--out", str(out))
    assert r.rc == 2 and "rule sleep-mode" in r.err and "sleep_level 0" in r.err, r.err
    assert "Traceback" not in r.err and not out.exists()
    r = cli("render", "-p", "cpu", "-m", "tiny-dense", "--set", "sleep_level=3", "--out", str(out))
    assert r.rc == 2 and "sleep_level" in r.err and not out.exists(), r.err


def test_a_level_2_wake_with_mtp_gets_the_drafter_reloaded_or_a_warning() -> None:
    """vLLM's reload_weights reloads the target only (vllm#52479): the plugin's drafter-reload
    covers the stacks that carry it; elsewhere the render warns, as the switch would roll back."""
    sets = ["sleep_level=2", "max_model_len=4096"]

    def notes(profile: str, *more: str) -> list[tuple[str, str]]:
        launch = resolve(profile, "tiny-hybrid-mtp", sets=[*sets, *more])
        return [(n.level, n.message) for n in launch.notes if n.rule == "sleep-mode"]

    # vllm-0.27.1-plugin: every feature but draft-prune, which the tiny head does not pay for
    [(level, message)] = notes("2x2080ti-22g")
    assert level == "info" and "reloads the MTP drafter" in message
    assert f"(VFLEET_SM75={','.join(f for f in FEATURES if f != 'draft-prune')})" in message
    [(level, message)] = notes("h200-141g", "kv_cache_dtype=auto")  # 0.24.0, no plugin
    assert level == "warn" and "MTP acceptance is 0" in message and "sleep_level 1" in message
    assert notes("2x2080ti-22g", "speculative.method=none") == []  # no drafter
    assert notes("2x2080ti-22g", "sleep_level=1") == []  # level 1 keeps the weights


def test_sleep_mode_with_repacked_weights_on_0_24_0_gets_the_budget_fix_or_a_warning() -> None:
    """vLLM 0.24.0's KV budget counts what sleep mode's pool released after the repack as free
    (vllm#40256; GPU.md section 13): the plugin's sleep-memory covers the stacks that carry it,
    elsewhere the render warns; 0.27.1 and unquantized weights have nothing to say."""
    sets = ["sleep_level=1", "max_model_len=32768"]

    def notes(profile: str, model: str, *more: str) -> list[tuple[str, str]]:
        launch = resolve(profile, model, sets=[*sets, *more])
        return [(n.level, n.message) for n in launch.notes if n.rule == "sleep-mode"]

    awq = "qwen3.6-27b-awq-int4"
    [(level, message)] = notes("h200-141g", awq, "kv_cache_dtype=auto")  # 0.24.0, no plugin
    assert level == "warn" and "vllm-project/vllm#40256" in message
    assert "more than gpu_memory_utilization" in message and "sleep-memory" in message
    [(level, message)] = notes("2x2080ti-22g", awq, "stack=vllm-0.24.0")  # carries the plugin
    assert level == "info" and "sleep-memory" in message and "takes them out" in message
    assert notes("2x2080ti-22g", awq) == []  # vllm-0.27.1-plugin: the driver's free memory
    assert notes("h200-141g", "tiny-hybrid-mtp", "kv_cache_dtype=auto", "max_model_len=4096") == []


def test_the_sleep_memory_versions_are_the_plugins() -> None:
    from vfleet_sm75.verified import VERIFIED

    from vfleet.engine.rules import api_surface

    assert set(VERIFIED["sleep-memory"]) == api_surface.RESERVED_PROFILE_VLLM


def test_turning_cpu_expand_off_on_vllm_cpu_with_speculation_is_refused() -> None:
    """Without the plugin's cpu-expand, vllm-cpu 0.32.0's sampled decode with speculation read
    top_k from uninitialised memory and the server died at start (2 of 2): an extra_env that
    leaves it out is refused; keeping it, or no speculation, renders."""
    for value in ("off", "reader-spin,drafter-reload"):
        with pytest.raises(Refused, match="leaves out cpu-expand") as exc:
            resolve("cpu", "tiny-dense", sets=[f"extra_env.VFLEET_SM75={value}"])
        assert "keep cpu-expand" in (exc.value.fix or "")
    with pytest.raises(Refused, match="unknown feature nope"):
        resolve("cpu", "tiny-dense", sets=["extra_env.VFLEET_SM75=nope"])
    for sets in (
        ["extra_env.VFLEET_SM75=cpu-expand,reader-spin"],
        ["extra_env.VFLEET_SM75=auto"],
        ["extra_env.VFLEET_SM75=off", "speculative.method=none"],
    ):
        launch = resolve("cpu", "tiny-dense", sets=sets)
        assert launch.config_values()["model"], sets


def test_the_cpu_expand_versions_are_the_plugins() -> None:
    from vfleet_sm75.verified import VERIFIED

    from vfleet.engine.rules import overrides

    assert set(VERIFIED["cpu-expand"]) == overrides.CPU_EXPAND_VLLM


def test_the_drafter_reload_versions_are_the_plugins() -> None:
    from vfleet_sm75.verified import VERIFIED

    from vfleet.engine.rules import api_surface

    assert set(VERIFIED["drafter-reload"]) == api_surface.DRAFTER_RELOAD_VLLM
    assert api_surface.DRAFTER_RELOAD_VLLM <= api_surface.TARGET_ONLY_RELOAD
