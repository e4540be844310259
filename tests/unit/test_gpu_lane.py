"""bench/gpu_lane.py without a GPU: its configuration matrix renders, vLLM's log and /metrics
are read right, the sidecar check compares the right figures, and the report runs the planner.

The log and /metrics lines below are copied in the format of vLLM 0.24.0's own source
(gpu_worker.py, gpu_model_runner.py, kv_cache_utils.py, mem_utils.py, core.py); the figures
in the H200 run's logs (bench/results/h200/) are parsed by the same functions.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO
from vfleet.engine.compile import resolve


def _lane() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_lane", REPO / "bench" / "gpu_lane.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_lane"] = mod
    spec.loader.exec_module(mod)
    return mod


lane = _lane()

LOG = """\
(EngineCore pid=7) INFO 12-01 13:40:01 [gpu_model_runner.py:5256] Model loading took 0.02 GiB memory and 1.234567 seconds
(EngineCore pid=7) INFO 12-01 13:40:02 [backends.py:1149] Dynamo bytecode transform time: 3.10 s
(EngineCore pid=7) INFO 12-01 13:40:09 [monitor.py:20] torch.compile took 18.90 s in total
(EngineCore pid=7) INFO 12-01 13:40:10 [gpu_model_runner.py:6589] Estimated CUDA graph memory: 0.07 GiB total
(EngineCore pid=7) DEBUG 12-01 13:40:10 [gpu_worker.py:497] Initial free memory: 138.90 GiB; Requested memory: 0.920000 (util), 128.80 GiB
(EngineCore pid=7) DEBUG 12-01 13:40:10 [gpu_worker.py:508] Memory profiling takes 2.10 seconds. Total non KV cache memory: 1.21GiB; torch peak memory increase: 0.95GiB; non-torch forward increase memory: 0.24GiB; weights memory: 0.02GiB.
(EngineCore pid=7) INFO 12-01 13:40:10 [gpu_worker.py:509] Available KV cache memory: 127.52 GiB
(EngineCore pid=7) INFO 12-01 13:40:10 [kv_cache_utils.py:2146] GPU KV cache size: 191,166,691 tokens
(EngineCore pid=7) INFO 12-01 13:40:10 [kv_cache_utils.py:2150] Maximum concurrency for 4,096 tokens per request: 46671.55x
(EngineCore pid=7) INFO 12-01 13:40:12 [gpu_model_runner.py:6657] Graph capturing finished in 2 secs, took 0.04 GiB
(EngineCore pid=7) INFO 12-01 13:40:12 [core.py:338] init engine (profile, create kv cache, warmup model) took 31.20 s (compilation: 18.90 s)
(EngineCore pid=7) INFO 12-01 13:40:12 [cuda.py:300] Using FLASHINFER attention backend out of potential backends: ['FLASHINFER']
(EngineCore pid=7) ERROR 12-01 13:41:00 [core.py:900] EngineCore encountered a fatal error.
"""  # noqa: E501


def test_parse_log_reads_every_memory_term_and_time() -> None:
    t = lane.parse_log(LOG)
    assert t.kv_tokens == 191_166_691
    assert (t.available_kv_gib, t.weights_gib, t.load_s) == (127.52, 0.02, 1.234567)
    assert (t.cudagraph_estimate_gib, t.graph_capture_s, t.graph_pool_gib) == (0.07, 2.0, 0.04)
    assert (t.torch_peak_gib, t.non_torch_gib, t.non_kv_gib) == (0.95, 0.24, 1.21)
    assert (t.requested_gib, t.initial_free_gib) == (128.80, 138.90)
    assert (t.init_engine_s, t.compile_s, t.max_concurrency) == (31.2, 18.9, 46671.55)
    assert t.attention_backends == ["FLASHINFER"]
    assert len(t.errors) == 1 and "fatal error" in t.errors[0]


def test_parse_log_leaves_missing_terms_empty() -> None:
    t = lane.parse_log("nothing of interest\n")
    assert t.kv_tokens is None and t.available_kv_gib is None and t.errors == []


METRICS_0 = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 27.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 8.0
vllm:generation_tokens_total{engine="0",model_name="m"} 40.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 12.0
vllm:cache_config_info{block_size="160",cache_dtype="fp8",engine="0",num_gpu_blocks="1194791"} 1.0
"""
METRICS_1 = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 110.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 330.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 267.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 100.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 89.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 78.0
vllm:generation_tokens_total{engine="0",model_name="m"} 380.0
vllm:iteration_tokens_total_count{engine="0",model_name="m"} 112.0
"""


def test_spec_delta_is_computed_from_counter_deltas() -> None:
    d = lane.spec_delta(lane.counter_sums(METRICS_0), lane.counter_sums(METRICS_1), 2.0)
    assert (d.drafts, d.draft_tokens, d.accepted) == (100, 300, 240)
    assert d.acceptance == pytest.approx(0.8)
    assert d.mean_acceptance_length == pytest.approx(3.4)
    assert d.per_position == pytest.approx({"0": 0.9, "1": 0.8, "2": 0.7})
    assert d.decode_tokens_per_s == pytest.approx(170.0)
    assert d.tokens_per_step == pytest.approx(3.4)


def test_spec_delta_without_drafts_says_none_not_zero() -> None:
    same = lane.counter_sums(METRICS_0)
    d = lane.spec_delta(same, same, 1.0)
    assert d.acceptance is None and d.mean_acceptance_length is None and d.per_position == {}


def test_counter_sums_add_up_engines_and_keep_positions_apart() -> None:
    text = 'vllm:generation_tokens_total{engine="0"} 5\n'
    text += 'vllm:generation_tokens_total{engine="1"} 7\n'
    assert lane.counter_sums(text)["vllm:generation_tokens_total"] == 12
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total/2" in lane.counter_sums(METRICS_0)


def test_cache_info_reads_the_block_count() -> None:
    info = lane.cache_info(METRICS_0)
    assert (info["num_gpu_blocks"], info["block_size"], info["cache_dtype"]) == (
        "1194791",
        "160",
        "fp8",
    )
    assert lane.cache_info("") == {}


def test_sidecar_comparison_flags_a_wrong_figure() -> None:
    hand = lane.spec_delta(lane.counter_sums(METRICS_0), lane.counter_sums(METRICS_1), 2.0)
    side = lane.exporter_figures(
        'vfleet_spec_decode_acceptance_rate{host="h"} 0.8\n'
        'vfleet_spec_decode_mean_acceptance_length{host="h"} 3.4\n'
        'vfleet_tokens_per_step{host="h"} 3.4\n'
        'vfleet_decode_tokens_per_second{host="h"} 150.0\n'
        'vfleet_spec_decode_position_acceptance_rate{host="h",position="0"} 0.9\n'
        'vfleet_spec_decode_position_acceptance_rate{host="h",position="1"} 0.8\n'
    )
    rows = {r["figure"]: r for r in lane.compare_sidecar(side, hand)}
    assert rows["vfleet_spec_decode_acceptance_rate"]["rel_err"] == pytest.approx(0.0)
    assert rows["vfleet_decode_tokens_per_second"]["rel_err"] == pytest.approx(20 / 170)
    assert rows["vfleet_spec_decode_position_acceptance_rate/2"]["sidecar"] is None


def test_greedy_identity_compares_every_config_with_mtp_off() -> None:
    def rec(name: str, text: str) -> dict[str, object]:
        return {"name": name, "greedy": {"replies": [{"reasoning": "r", "content": text}]}}

    out = lane.greedy_identity([rec("main", "a"), rec("no-mtp", "a"), rec("fp16", "b")])
    assert out == {"reference": "no-mtp", "same": {"main": True, "fp16": False}}
    # issue 31: a skipped no-mtp read {"reference": null, "same": {}}, as if all had matched
    assert lane.greedy_identity([rec("main", "a")]) == lane.NOT_RUN
    assert lane.NOT_RUN.startswith("not run")


# Lines of healthy H200 starts (bench/results/h200/no-mtp.log, main.log) that the old matcher
# took for errors, and real error lines (tiny-sleep-fp8.log; a crashed process's stderr).
HEALTHY = """(APIServer pid=3008) WARNING 12-01 13:34:39 [system_utils.py:299] Found ulimit of 20000 and failed to automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many open files`
(EngineCore pid=3949) DEBUG 12-01 13:38:18 [compilation/backends.py:1111]  'VLLM_TOOL_JSON_ERROR_AUTOMATIC_RETRY': False,
(EngineCore pid=7) INFO 12-01 13:40:12 [core.py:338] init engine (profile, create kv cache, warmup model) took 31.20 s
"""  # noqa: E501
FAILED = """(EngineCore pid=1150) ERROR 12-01 16:15:00 [core.py:1449] Invocation of wake_up method failed
Traceback (most recent call last):
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
(EngineCore pid=9) CRITICAL 12-01 16:15:01 [core.py:900] EngineCore died
"""  # noqa: E501


def test_log_errors_are_errors_not_words_in_healthy_lines() -> None:
    assert lane.parse_log(HEALTHY).errors == []
    assert len(lane.parse_log(HEALTHY + FAILED).errors) == 4
    for name in ("no-mtp.log", "main.log", "main-restart.log", "tiny-plugin-off.log"):
        text = (REPO / "bench" / "results" / "h200" / name).read_text(errors="replace")
        assert lane.parse_log(text).errors == [], name


def test_matrix_renders_on_the_h200_profile_and_varies_every_term() -> None:
    names = [c.name for c in lane.MATRIX]
    assert len(set(names)) == len(names) >= 6
    seen: dict[str, set[object]] = {}
    for cfg in lane.MATRIX:
        assert set(cfg.roles) <= set(lane.ROLES)
        if cfg.emulate:  # its own test below
            continue
        # A window past the tiny model's 4096 is a real-scale configuration: a 27B preset's.
        big = any(x.startswith("max_model_len=") for x in cfg.sets)
        model, base = (
            ("qwen3.6-27b-awq-int4", lane.DUMMY_SETS)
            if big
            else ("tiny-hybrid-mtp", lane.BASE_SETS)
        )
        v = resolve("h200-141g", model, sets=[*base, *cfg.sets])
        vals = v.config_values()
        spec = vals.get("speculative-config") or {}
        for key, value in (
            ("util", vals["gpu-memory-utilization"]),
            ("seqs", vals["max-num-seqs"]),
            ("k", spec.get("num_speculative_tokens", 0)),
            ("kv", vals.get("kv-cache-dtype", "auto")),
            ("mnbt", vals["max-num-batched-tokens"]),
            ("sizes", tuple(vals["compilation-config"]["cudagraph_capture_sizes"])),
        ):
            seen.setdefault(key, set()).add(value)
    # the planner comparison needs each term varied at least once
    assert all(len(values) >= 2 for values in seen.values()), seen
    assert [c.name for c in lane.select("main,no-mtp")] == ["main", "no-mtp"]
    with pytest.raises(SystemExit, match="unknown configuration"):
        lane.select("nope")


def test_report_puts_the_planner_beside_the_logged_terms() -> None:
    rec = {
        "name": "main",
        "sets": list(lane.BASE_SETS),
        "log_terms": {
            "kv_tokens": 191_166_691,
            "available_kv_gib": 127.52,
            "weights_gib": 0.02,
            "requested_gib": 128.62,
        },
        "cache_info": {"num_gpu_blocks": "1677726", "block_size": "160"},
    }
    rows = lane.planner_rows(rec, "h200-141g", "tiny-hybrid-mtp")
    terms = {r.term: r for r in rows}
    assert terms["KV tokens"].vllm == 191_166_691 and terms["KV tokens"].planner > 0
    # requested - available - weights
    assert terms["non-KV in budget (reserve) GiB"].vllm == pytest.approx(1.08)
    # the page math on vLLM's own block count (the H200 main configuration's figures)
    assert terms["KV tokens from vLLM's block count"].planner == 190_887_936
    assert terms["block size (tokens)"].error_pct == 0
    # without the DEBUG line, requested memory is util x the total torch reported
    del rec["log_terms"]["requested_gib"]  # type: ignore[attr-defined]
    rows = lane.planner_rows(rec, "h200-141g", "tiny-hybrid-mtp", 150_109_880_320)
    reserve = {r.term: r for r in rows}["non-KV in budget (reserve) GiB"].vllm
    assert reserve == pytest.approx(0.92 * 150_109_880_320 / 2**30 - 127.52 - 0.02)
    md = lane.report_md({"profile": "h200-141g", "model": "tiny-hybrid-mtp", "configs": [rec]})
    # 6 GiB rows, then each planner term in MiB against its logged figure (and the context)
    assert md.count("| main |") == 12 and "%" in md
    assert terms["peak activation MiB"].vllm is None  # logged at DEBUG only


def test_run_needs_no_gpu_to_explain_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        lane.main(["run", "--help"])
    assert "--pythonpath" in capsys.readouterr().out


def test_results_of_the_h200_run_parse() -> None:
    # the committed figures were produced by this module's own parser (docs/GPU.md)
    results = REPO / "bench" / "results" / "h200"
    logs = sorted(results.glob("*.log"))
    if not logs:
        pytest.skip("no H200 logs committed")
    for log in logs:
        terms = lane.parse_log(log.read_text(encoding="utf-8", errors="replace"))
        assert terms.kv_tokens is not None, log.name
        assert terms.attention_backends == ["FLASHINFER"], log.name


def test_lane_paths_are_inside_the_repo() -> None:
    assert Path(lane.REPO) == REPO


SLEEP_LOG = """\
(EngineCore pid=7) INFO 12-01 17:01:02 [gpu_worker.py:181] Sleep mode freed 127.95 GiB memory, 1.62 GiB memory is still in use.
(EngineCore pid=7) INFO 12-01 17:01:09 [gpu_model_runner.py:5455] Reloading and processing weights took 0.84 seconds
(EngineCore pid=7) INFO 12-01 17:01:12 [gpu_worker.py:181] Sleep mode freed 128.01 GiB memory, 1.60 GiB memory is still in use.
(EngineCore pid=7) INFO 12-01 17:00:01 [plugin.py:80] vfleet-sm75 0.1.0 on vLLM 0.24.0: draft-prune=on (drafts from K=16384 of 32768 tokens)
(APIServer pid=6) INFO 12-01 17:00:01 [plugin.py:80] vfleet-sm75 0.1.0 on vLLM 0.24.0: draft-prune=on (drafts from K=16384 of 32768 tokens)
(EngineCore pid=7) INFO 12-01 17:01:10 [drafter_reload.py:118] vfleet-sm75: drafter-reload: reloaded 18 of 18 parameters of the drafter Qwen3_5MTP from /m in 0.019 s (after the target's reload)
"""  # noqa: E501


def test_parse_log_reads_each_sleep_the_reload_and_the_plugin_line() -> None:
    t = lane.parse_log(SLEEP_LOG)
    assert t.sleep_freed_gib == [127.95, 128.01]
    assert t.sleep_in_use_gib == [1.62, 1.60]
    assert t.reload_s == 0.84
    # one line however many processes logged it
    assert t.plugin_lines == [
        "vfleet-sm75 0.1.0 on vLLM 0.24.0: draft-prune=on (drafts from K=16384 of 32768 tokens)"
    ]
    # drafter-reload's line per reload_weights call
    assert [ln.split(" from ")[0] for ln in t.drafter_lines] == [
        "drafter-reload: reloaded 18 of 18 parameters of the drafter Qwen3_5MTP"
    ]


def test_spread_is_median_and_range() -> None:
    assert lane.Spread.of([3.0, 1.0, 2.0]) == lane.Spread(3, 2.0, 1.0, 3.0)
    assert lane.Spread.of([4.0, 1.0, None, 2.0, 3.0]).median == 2.5
    assert lane.Spread.of([None]).text() == "-"
    assert lane.Spread.of([1.5]).text() == "1.50 s"


def _cycle(
    level: int, reload: bool, sleep_s: float, wake_s: float, same: bool
) -> dict[str, object]:
    return {
        "level": level,
        "reload": reload,
        "mib_before": 132_000,
        "mib_asleep": 2_000,
        "sleep": {"status": 200, "seconds": sleep_s},
        "wake_total_s": wake_s,
        "first_request": {"ok": True, "ttft_s": 0.05},
        "greedy_same": same,
        "acceptance": 1.0 if same else 0.0,
    }


def test_sleep_rows_summarise_each_kind_beside_the_restarts() -> None:
    rec = {
        "name": "sleep",
        "gpu_used_mib": 132_500,
        "sleep": {
            "cycles": [
                _cycle(1, True, 0.5, 1.0, True),
                _cycle(1, True, 0.7, 3.0, True),
                _cycle(1, True, 0.6, 2.0, True),
                _cycle(2, True, 0.1, 4.0, True),
                _cycle(2, False, 0.1, 0.2, False),
            ]
        },
        "restarts": [
            {"stop_s": 2.0, "ready_s": 36.0, "to_first_token_s": 39.0, "first_request": {}},
            {"stop_s": 2.2, "ready_s": 38.0, "to_first_token_s": 41.0},
            {"stop_s": 2.1, "ready_s": None, "to_first_token_s": 900.0},
        ],
    }
    rows = {r.what.split(" (")[0]: r for r in lane.sleep_rows(rec)}
    one = rows["level 1 sleep + wake"]
    assert (one.off_s.median, one.on_s.median, one.on_s.low, one.on_s.high) == (0.6, 2.0, 1.0, 3.0)
    assert one.total_s.median == pytest.approx(0.6 + 2.0 + 0.05)
    assert one.freed_mib.median == 130_000 and one.greedy_same is True
    no_reload = rows["level 2 sleep + plain wake"]
    assert no_reload.greedy_same is False and no_reload.acceptance == 0.0
    # a restart that never got ready is not a figure
    restart = rows["full restart"]
    assert restart.on_s == lane.Spread(2, 37.0, 36.0, 38.0)
    assert restart.total_s.median == 40.0 and restart.greedy_same is None
    md = lane.sleep_md({"configs": [rec]})
    assert md.count("| sleep |") == 4 and "| NO |" in md


def test_sleep_runs_each_level_then_a_plain_level_2_and_stops_at_a_failed_wake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No server: the cycle itself is replaced, so only the order and the stop are checked here.
    greedy = {"replies": [{"reasoning": "r", "content": "c"}], "spec": {}}
    monkeypatch.setattr(lane, "run_greedy", lambda model: greedy)
    calls: list[tuple[int, bool]] = []

    def cycle(model: str, level: int, ref: object, reload: bool = True) -> dict[str, object]:
        calls.append((level, reload))
        return {"first_request": {"ok": True}}

    monkeypatch.setattr(lane, "sleep_cycle", cycle)
    out = lane.run_sleep("m", 2)
    assert calls == [(1, True), (1, True), (2, True), (2, True), (2, False)]
    assert len(out["cycles"]) == 5

    # a failed wake leaves the engine paused: no further cycle is tried
    calls.clear()

    def failing(model: str, level: int, ref: object, reload: bool = True) -> dict[str, object]:
        calls.append((level, reload))
        return {"first_request": {"ok": len(calls) < 2}}

    monkeypatch.setattr(lane, "sleep_cycle", failing)
    assert len(lane.run_sleep("m", 3)["cycles"]) == 2 and calls == [(1, True), (1, True)]


def _fill(base: Path, rel: str, text: str) -> None:
    f = base / rel / "entry.bin"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text, encoding="utf-8")


def test_cache_variants_take_away_the_named_caches_and_restore_them(tmp_path: Path) -> None:
    base = tmp_path / "base"
    for rels in lane.CACHES.values():
        for rel in rels:
            _fill(base, rel, rel)
    names = [v.name for v in lane.CACHE_VARIANTS]
    assert len(set(names)) == len(names)
    # each cache is taken away alone once, and all together for the cold starts
    alone = {v.removes for v in lane.CACHE_VARIANTS if len(v.removes) == 1}
    assert alone == {(k,) for k in lane.CACHES}
    cold = lane.select_variants("cold,cold-warmup")
    assert all(set(v.removes) == set(lane.CACHES) for v in cold) and cold[1].warmup
    with pytest.raises(SystemExit, match="unknown variant"):
        lane.select_variants("warm,nope")
    aside = tmp_path / "aside"
    moved = lane.move_aside(base, ("triton",), aside)
    assert [o for o, _ in moved] == [base / "cache/main/triton"]
    assert not (base / "cache/main/triton").exists()
    assert (aside / "cache/main/triton/entry.bin").read_text(encoding="utf-8") == (
        "cache/main/triton"
    )
    # what the start rebuilt is dropped, the original comes back
    _fill(base, "cache/main/triton", "rebuilt")
    lane.restore(moved)
    assert (base / "cache/main/triton/entry.bin").read_text(encoding="utf-8") == (
        "cache/main/triton"
    )
    assert not (aside / "cache/main/triton").exists()
    # a cache that is not there is not "removed"
    (base / "cache/main/pycache/entry.bin").unlink()
    (base / "cache/main/pycache").rmdir()
    assert lane.move_aside(base, ("bytecode",), aside) == []


def test_caches_carried_as_a_tar_land_at_the_same_paths_of_another_base(tmp_path: Path) -> None:
    base, fresh = tmp_path / "base", tmp_path / "fresh"
    _fill(base, "cache/main/vllm", "aot")
    _fill(base, "instances/main/home/.cache/flashinfer", "jit")
    _fill(base, "models/not-a-cache", "weights")
    fresh.mkdir()
    packed = lane.pack_caches(base, tmp_path / "c.tar")
    assert packed["mib"] >= 0 and packed["seconds"] >= 0
    lane.unpack_caches(tmp_path / "c.tar", fresh)
    got = fresh / "instances/main/home/.cache/flashinfer/entry.bin"
    assert got.read_text(encoding="utf-8") == "jit"
    assert (fresh / "cache/main/vllm/entry.bin").read_text(encoding="utf-8") == "aot"
    assert not (fresh / "models").exists()
    sizes = lane.cache_sizes(fresh)
    assert "instances/main/home/.cache/flashinfer" in sizes
    assert sizes["cache/main/triton"] == 0.0


def test_caches_table_names_what_was_taken_away() -> None:
    result = {
        "variants": [
            {
                "variant": "no-triton",
                "removed": ["cache/main/triton"],
                "ready_s": 40.1,
                "init_engine_s": 9.0,
                "compile_s": 1.1,
                "first_request": {"ttft_s": 12.5},
                "second_request": {"ttft_s": 0.05},
                "to_first_token_s": 53.0,
            },
            {"variant": "carried", "tar": {"mib": 1.0}, "ready_s": 38.0},
            {"variant": "cold-warmup", "removed": ["x"], "warmup": {"seconds": 30.2}},
        ]
    }
    md = lane.caches_md(result)
    assert "| no-triton | cache/main/triton | 40.1 | 9.0 | 1.1 | - | 12.5 | 0.05 | 53.0 |" in md
    assert "| carried | fresh base folder, caches carried in | 38.0 |" in md
    assert "| 30.2 |" in md


def test_greedy_pairs_put_plugin_on_against_plugin_off() -> None:
    def rec(name: str, text: str, ok: bool = True) -> dict[str, object]:
        return {
            "name": name,
            "greedy": {"replies": [{"ok": ok, "reasoning": "r", "content": text}]},
        }

    assert lane.greedy_pairs([rec("plugin-off", "a"), rec("plugin-on", "a")]) == {
        "plugin-on = plugin-off": True
    }
    assert lane.greedy_pairs([rec("plugin-off", "a"), rec("plugin-on", "b")]) == {
        "plugin-on = plugin-off": False
    }
    # a failed request is never "identical"
    assert not lane.greedy_pairs([rec("plugin-off", ""), rec("plugin-on", "", ok=False)])[
        "plugin-on = plugin-off"
    ]
    assert lane.greedy_pairs([rec("plugin-off", "a")]) == {}


def test_caches_needs_no_gpu_to_explain_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        lane.main(["caches", "--help"])
    out = capsys.readouterr().out
    assert "--variants" in out and "no-triton" in out


def test_the_covered_table_is_built_from_the_replies_of_earlier_configs(tmp_path: Path) -> None:
    def rec(name: str, *replies: dict[str, object]) -> dict[str, object]:
        return {"name": name, "greedy": {"replies": list(replies)}}

    ok = {"ok": True, "reasoning": " Random weights", "content": "\n\n The quick\nbrown fox."}
    failed = {"ok": False, "content": "never seen"}
    text = lane.replies_corpus([rec("plugin-off", ok, failed), {"name": "x"}])
    # one line per text, newlines inside a reply flattened; failed requests left out
    assert text == "Random weights\nThe quick brown fox.\n"
    assert lane.replies_corpus([]) == ""
    # the plugin's default corpus is passed beside the replies: it must be where the lane looks
    assert lane.DEFAULT_DRAFT_CORPUS.is_file()
    cfg = lane.select("plugin-on-covered")[0]
    assert cfg.draft_prune and cfg.vocab_from_replies
    # without earlier replies it refuses before rendering or starting anything
    host = lane.Host(
        tmp_path / "base", sys.executable, "", "", tmp_path, "h200-141g", "tiny-hybrid-mtp"
    )
    out = lane.serve_one(host, cfg, tmp_path, 1.0, [])
    assert "run it after plugin-off" in out["error"]
    assert not (tmp_path / "base").exists()
    pairs = lane.greedy_pairs(
        [
            {"name": "plugin-off", "greedy": {"replies": [ok]}},
            {"name": "plugin-on-covered", "greedy": {"replies": [ok]}},
        ]
    )
    assert pairs == {"plugin-on-covered = plugin-off": True}


def test_carried_same_starts_from_a_tar_of_the_caches_at_their_own_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The vLLM start needs a GPU: a stand-in records what the start would find (the cache
    # handling around it is the lane's own code).
    base = tmp_path / "base"
    for rels in lane.CACHES.values():
        for rel in rels:
            _fill(base, rel, rel)
    seen: dict[str, str] = {}

    def fake_start(host, cfg, name, logdir, timeout, warmup):  # type: ignore[no-untyped-def]
        for rels in lane.CACHES.values():
            for rel in rels:
                seen[rel] = (base / rel / "entry.bin").read_text(encoding="utf-8")
                _fill(base, rel, "rebuilt")
        aside = tmp_path / "base-aside"
        seen["aside"] = str(sorted(p.name for p in (aside / "cache/main").iterdir()))
        return {"variant": name}

    monkeypatch.setattr(lane, "start_and_first_request", fake_start)
    host = lane.Host(
        base, sys.executable, "", "/usr/local/cuda", tmp_path, "h200-141g", "tiny-hybrid-mtp"
    )
    (v,) = lane.select_variants("carried-same")
    rec = lane.run_cache_variant(host, lane.select("main")[0], v, tmp_path, 1.0)
    # the start found every cache, unpacked from the tar at its own path...
    assert {k: s for k, s in seen.items() if k != "aside"} == {
        rel: rel for rels in lane.CACHES.values() for rel in rels
    }
    # ...while the originals were aside, and afterwards the originals are back
    assert "triton" in seen["aside"]
    for rels in lane.CACHES.values():
        for rel in rels:
            assert (base / rel / "entry.bin").read_text(encoding="utf-8") == rel
    assert rec["tar"]["from"] == rec["tar"]["to"] == str(base)
    assert set(rec["removed"]) == {r for rels in lane.CACHES.values() for r in rels}
    assert not (tmp_path / "base-caches.tar").exists()


def test_seeded_unpacks_the_caches_as_a_deploys_seed_with_exact_mtimes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The vLLM start needs a GPU: a stand-in records what the start would find.
    base = tmp_path / "base"
    rels = ["cache/main/vllm", "cache/main/triton", "instances/main/home/.cache/flashinfer/90"]
    for rel in rels:
        _fill(base, rel, rel)
    ns = {rel: (base / rel / "entry.bin").stat().st_mtime_ns for rel in rels}
    seen: dict[str, tuple[str, int]] = {}

    def fake_start(host, cfg, name, logdir, timeout, warmup):  # type: ignore[no-untyped-def]
        for rel in rels:
            f = base / rel / "entry.bin"
            seen[rel] = (f.read_text(encoding="utf-8"), f.stat().st_mtime_ns)
        return {"variant": name}

    monkeypatch.setattr(lane, "start_and_first_request", fake_start)
    host = lane.Host(
        base, sys.executable, "", "/usr/local/cuda", tmp_path, "h200-141g", "tiny-hybrid-mtp"
    )
    (v,) = lane.select_variants("seeded")
    rec = lane.run_cache_variant(host, lane.select("main")[0], v, tmp_path, 1.0)
    assert seen == {rel: (rel, ns[rel]) for rel in rels}
    assert rec["tar"]["from"] == rec["tar"]["to"] == str(base)
    for rel in rels:
        assert (base / rel / "entry.bin").read_text(encoding="utf-8") == rel


def test_dummy_weights_serve_a_real_preset_at_its_own_size(tmp_path: Path) -> None:
    # issue 31: a 27B preset from a config-only folder with --load-format dummy; the render is
    # the preset's own but for that flag and (the multimodal class) language-model-only
    sets = lane.dummy_base_sets("qwen3.6-27b-fp8")
    assert sets == ("extra_args.load-format=dummy", "language_model_only=true")
    host = lane.Host(
        tmp_path / "base",
        sys.executable,
        "",
        "/usr/local/cuda",
        tmp_path,
        "h200-141g",
        "qwen3.6-27b-fp8",
        base_sets=sets,
    )
    # the preset's own render on the same host (base folder: the model's path)
    plain = lane.resolve_values(replace(host, base_sets=()), lane.select("real")[0])
    for cfg in lane.select("real,real-restart,real-no-mtp"):
        assert cfg.debug_log  # every memory term is logged at DEBUG only
        values = lane.resolve_values(host, cfg)
        assert values["load-format"] == "dummy" and values["language-model-only"] is True
        assert values["max-model-len"] == plain["max-model-len"] == 262144
        changed = {k for k in {*values, *plain} if values.get(k) != plain.get(k)}
        expect = {"load-format", "language-model-only"}
        if cfg.name == "real-no-mtp":
            expect |= {"speculative-config", "compilation-config"}
        assert changed == expect, (cfg.name, changed)
    # a real preset without --dummy-weights is refused before anything is built
    ns = argparse.Namespace(
        base_dir=str(tmp_path / "b2"),
        cuda_home="/usr/local/cuda",
        model_dir=str(tmp_path / "none"),
        python=sys.executable,
        pythonpath="",
        profile="h200-141g",
        model="qwen3.6-27b-fp8",
        sets=[],
        repeats=1,
        dummy_weights=False,
    )
    with pytest.raises(SystemExit, match="--dummy-weights"):
        lane.make_host(ns)


def test_report_compares_every_planner_term_and_the_decode_roofline() -> None:
    t = lane.parse_log(LOG)
    rec = {
        "name": "real-no-mtp",
        "sets": [*lane.dummy_base_sets("qwen3.6-27b-fp8"), "speculative.method=none"],
        "log_terms": vars(t),
        "decode": {"median_tokens_per_s": 120.0},
    }
    rows = {r.term: r for r in lane.planner_rows(rec, "h200-141g", "qwen3.6-27b-fp8", 150 << 30)}
    assert rows["peak activation MiB"].vllm == pytest.approx(0.95 * 1024)
    assert rows["non-torch memory MiB"].vllm == pytest.approx(0.24 * 1024)
    assert rows["CUDA graph estimate MiB"].vllm == pytest.approx(0.07 * 1024)
    assert rows["CUDA graph pool (captured) MiB"].vllm == pytest.approx(0.04 * 1024)
    # the context: the card's total less vLLM's initial free memory
    assert rows["CUDA context MiB"].vllm == pytest.approx(150 * 1024 - 138.90 * 1024)
    assert rows["CUDA context MiB"].planner == 527
    # MTP off: the planner's weights leave the MTP module out
    assert rows["weights MiB"].planner == pytest.approx(28_104.4, abs=0.1)
    roof = lane.roofline(rec, "h200-141g", "qwen3.6-27b-fp8", 4_232.0)
    # every weight but the gathered embedding (and no MTP), plus the GDN state read + written
    assert roof["gdn_state_bytes"] == 2 * 48 * 3_207_168
    assert roof["step_bytes"] == roof["weights_read_bytes"] + roof["gdn_state_bytes"]
    assert roof["floor_ms"] == pytest.approx(roof["step_bytes"] / 4_232e9 * 1e3, abs=1e-3)
    assert roof["of_roofline"] == pytest.approx(120.0 * roof["floor_ms"] / 1e3, abs=1e-3)
    md = lane.report_md(
        {
            "profile": "h200-141g",
            "model": "qwen3.6-27b-fp8",
            "machine": {"copy_gbps": 4_232.0, "total_memory": 150 << 30},
            "configs": [rec],
        }
    )
    assert "roofline tok/s" in md and "| real-no-mtp | 27." in md


def test_an_older_run_is_planned_again_in_the_graph_mode_it_ran_with() -> None:
    # The tenth H200 run's nomtp-piecewise: rendered when MTP off still meant PIECEWISE.
    raw = REPO / "bench/results/h200/lane-graphs-2026-12-04b-awq-int4-nomtp-piecewise.json"
    rec = json.loads(raw.read_text())["configs"][0]
    assert rec["sets"][-1] == "speculative.method=none"
    assert lane.replan_sets(rec) == [*rec["sets"], "cudagraph_mode=PIECEWISE"]
    rows = {r.term: r for r in lane.planner_rows(rec, "h200-141g", "qwen3.6-27b-awq-int4")}
    assert rows["CUDA graph estimate MiB"].planner == 110  # PIECEWISE, as it ran
    # A run that names its mode, or has no rendered file, keeps its settings as they are.
    named = {**rec, "sets": [*rec["sets"], "cudagraph_mode=FULL_AND_PIECEWISE"]}
    assert lane.replan_sets(named) == named["sets"]
    assert lane.replan_sets({"sets": ["speculative.method=none"]}) == ["speculative.method=none"]


def _info_rec(**extra: object) -> dict[str, object]:
    """A `main`-like record whose log has the INFO terms and none of the DEBUG-only ones."""
    return {
        "name": "main",
        "sets": list(lane.BASE_SETS),
        "log_terms": {"kv_tokens": 191_166_691, "available_kv_gib": 127.52, "weights_gib": 0.02},
        "cache_info": {"num_gpu_blocks": "1677726", "block_size": "160"},
        **extra,
    }


def _logged(rec: dict[str, object]) -> dict[str, str]:
    """term -> the report's 'vLLM logged' cell."""
    md = lane.report_md(
        {
            "profile": "h200-141g",
            "model": "tiny-hybrid-mtp",
            "machine": {"total_memory": 150_109_880_320},
            "configs": [rec],
        }
    )
    cells = [ln.split(" | ") for ln in md.splitlines() if ln.startswith(f"| {rec['name']} |")]
    return {c[1]: c[3] for c in cells}


def test_report_says_a_debug_only_term_was_not_logged_at_info() -> None:
    at_info = _logged(_info_rec(debug_log=False))
    for term in ("peak activation MiB", "non-torch memory MiB", "CUDA context MiB"):
        assert at_info[term] == lane.NOT_LOGGED, term
    assert lane.NOT_LOGGED.startswith("not logged (INFO")
    # a term vLLM logs at INFO too is never blamed on the level
    assert at_info["CUDA graph pool (captured) MiB"] == "-"
    assert at_info["weights MiB"] == "20.480"
    # a run at DEBUG that lacks the figure: nothing to suggest
    at_debug = _logged(_info_rec(debug_log=True))
    assert at_debug["peak activation MiB"] == at_debug["CUDA context MiB"] == "-"


def test_report_infers_info_for_an_older_record_only_from_its_own_log() -> None:
    # before `debug_log`: vLLM 0.24.0's INFO line of the memory profile without its DEBUG lines
    assert _logged(_info_rec(vllm_version="0.24.0"))["peak activation MiB"] == lane.NOT_LOGGED
    # another (or no) version: not inferred
    assert _logged(_info_rec(vllm_version="0.25.0"))["peak activation MiB"] == "-"
    assert _logged(_info_rec())["peak activation MiB"] == "-"
    # the H200 records: `main` ran at INFO, `no-mtp` at DEBUG (its figures are there)
    raw = REPO / "bench/results/h200/lane-run1.json"
    configs = {r["name"]: r for r in json.loads(raw.read_text())["configs"]}
    assert "debug_log" not in configs["main"]
    assert _logged(configs["main"])["peak activation MiB"] == lane.NOT_LOGGED
    no_mtp = _logged(configs["no-mtp"])
    assert lane.NOT_LOGGED not in no_mtp.values()
    assert no_mtp["peak activation MiB"] == "163.840"


def test_run_records_the_level_vllm_logged_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start needs a GPU: a busy port stops serve_one right after the render.
    monkeypatch.setattr(lane, "port_free", lambda port: False)

    def level(name: str, *sets: str) -> object:
        args = (sys.executable, "", "/usr/local/cuda", tmp_path, "h200-141g", "tiny-hybrid-mtp")
        host = lane.Host(tmp_path / "base", *args, sets)
        rec = lane.serve_one(host, lane.select(name)[0], tmp_path, 1.0)
        assert "busy" in rec["error"]
        return rec["debug_log"]

    assert level("main") is False and level("no-mtp") is True
    # launch.sh sources vllm.env after the lane's environment: a rendered level wins
    assert level("main", "extra_env.VLLM_LOGGING_LEVEL=DEBUG") is True
    assert level("no-mtp", "extra_env.VLLM_LOGGING_LEVEL=INFO") is False


def _fake_server(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """serve_one / start_and_first_request without vLLM: what they call, in order."""

    class Proc:
        pid = 0

        def poll(self) -> None:
            return None

    def start(rel: Path, log: Path, debug: bool, pidfile: Path) -> Proc:
        log.write_text("", encoding="utf-8")
        calls.append("start")
        return Proc()

    def chat(model: str, prompt: str, max_tokens: int, stream: bool = False) -> dict[str, object]:
        calls.append(prompt.split()[0])
        return {"ok": True, "ttft_s": 41.5 if prompt.startswith("[first]") else 0.86}

    def probe(host: object, rel: Path) -> dict[str, object]:
        calls.append("warmup set")
        return {"rc": 0, "seconds": 7.9}

    for name, fake in {
        "port_free": lambda port: True,
        "start": start,
        "wait_ready": lambda proc, timeout: 1.0,
        "stop": lambda proc: None,
        "chat": chat,
        "run_probe": probe,
        "scrape": lambda port=lane.PORT: "",
        "http": lambda *a, **k: (200, b"{}"),
        "gpu_used_mib": lambda: None,
        "run_greedy": lambda model: {"replies": [], "spec": {}},
        "run_sidecar": lambda host, rel, model, logdir: {},
        "dir_mib": lambda path: 0.0,
    }.items():
        monkeypatch.setattr(lane, name, fake)


def test_the_first_request_says_whether_a_warmup_ran_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    _fake_server(monkeypatch, calls)
    host = lane.Host(
        tmp_path / "base",
        sys.executable,
        "",
        "/usr/local/cuda",
        tmp_path,
        "h200-141g",
        "tiny-hybrid-mtp",
    )
    rec = lane.serve_one(host, lane.select("main")[0], tmp_path, 1.0)
    # `run`: the first request right after /health, the probe's warmup set after it
    assert calls == ["start", "[first]", "[second]", "warmup set"]
    assert rec["first_request"] == {"ok": True, "ttft_s": 41.5, "after_warmup": False}
    assert rec["debug_log"] is False
    # `caches` cold-warmup: the warmup set first
    calls.clear()
    cold = lane.start_and_first_request(
        host, lane.select("main")[0], "cold-warmup", tmp_path, 1.0, True
    )
    assert calls == ["start", "warmup set", "[first]", "[second]"]
    assert cold["first_request"]["after_warmup"] is True
    # the summary names it beside the figure
    old = {"name": "real", "first_request": {"ok": True, "ttft_s": 54.09}}
    failed = {"name": "fp8", "first_request": {"ok": False, "error": "timed out"}}
    md = lane.summary_md(
        {
            "profile": "h200-141g",
            "model": "tiny-hybrid-mtp",
            "machine": {},
            "configs": [rec, {**cold, "name": "cold-warmup"}, old, failed],
            "greedy_identity": lane.NOT_RUN,
        }
    )
    assert "first request main: 41.5 s (no warmup), second 0.86 s" in md
    assert "first request cold-warmup: 41.5 s (after the warmup set), second 0.86 s" in md
    assert "first request real: 54.09 s (warmup not recorded)" in md
    assert "first request fp8: failed: timed out (warmup not recorded)" in md


def test_chat_requests_wait_as_long_as_a_cold_first_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/GPU.md section 4: a cold bf16-KV first request outlasted 120 s
    seen: list[float] = []

    def http(
        path: str, body: object = None, timeout: float = 120, port: int = lane.PORT
    ) -> tuple[int, bytes]:
        seen.append(timeout)
        return 200, json.dumps({"choices": [{"message": {"content": "c"}}]}).encode()

    class Resp:
        def __enter__(self) -> list[bytes]:
            return [b"data: {}\n", b"data: [DONE]\n"]

        def __exit__(self, *exc: object) -> None:
            return None

    def urlopen(req: object, timeout: float) -> Resp:
        seen.append(timeout)
        return Resp()

    monkeypatch.setattr(lane, "http", http)
    monkeypatch.setattr(lane.urllib.request, "urlopen", urlopen)
    assert lane.chat("m", "p", 8)["ok"] and lane.chat("m", "p", 8, stream=True)["ok"]
    # one timeout for both paths: the greedy replies (not streamed) and the first request
    assert seen == [lane.REQUEST_TIMEOUT_S] * 2 == [300, 300]


def test_the_a100_emulation_serves_its_render_with_its_planned_kv_pool() -> None:
    """a100-emulated: the a100-32g profile's render of the 27B MTP preset, served as the H200
    profile renders those settings, with the KV bytes the A100's plan leaves: the pool (and so
    the KV tokens) is the A100's, the page math this card's vLLM's."""
    from vfleet.engine.planner import plan_launch

    model = "qwen3.8-27b-awq-mtp"
    sets = lane.emulated_sets("a100-32g", model)
    a100 = plan_launch(resolve("a100-32g", model))
    assert a100.gpu is not None and f"kv_cache_memory_bytes={a100.gpu.kv_bytes}" in sets
    assert "max_model_len=262144" in sets and "max_num_seqs=1" in sets
    assert "speculative.num_speculative_tokens=3" in sets
    here = resolve("h200-141g", model, sets=[*lane.DUMMY_SETS, *lane.MULTIMODAL_DUMMY_SETS, *sets])
    args = {e.key: e.value for e in here.args}
    assert args["kv-cache-memory-bytes"] == a100.gpu.kv_bytes
    assert (args["max-model-len"], args["max-num-seqs"]) == (262_144, 1)
    assert plan_launch(here).kv.kv_cache_tokens == a100.kv.kv_cache_tokens
    cfg = {c.name: c for c in lane.MATRIX}["a100-emulated"]
    assert cfg.emulate == "a100-32g"
    with pytest.raises(SystemExit, match="does not fit its card"):
        lane.emulated_sets("a100-32g", "qwen3.6-27b-fp8")  # 29.4 GiB of weights on 32 GB
