"""`vfleet tune`: its search space (from the real rules and planner), the skip logic, the
objective, the order of trying, the state file that makes it resumable, the report and the
host overrides (read back by the real ansible-inventory). The tune itself, on a real host
with real vLLM servers and swaps, is in test_fleet_hosts.py."""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO
from vfleet.engine.compile import Launch, resolve
from vfleet.errors import VfleetError
from vfleet.fleet.tune_measure import BenchPlan, Measurement, objective_from, p95, summarize
from vfleet.fleet.tune_report import (
    TUNED_VAR,
    host_vars_dir,
    markdown,
    merged_sets,
    read_tuned,
    svg,
    write_overrides,
)
from vfleet.fleet.tune_space import (
    Choice,
    Dimension,
    Search,
    build_space,
    candidate,
    infeasible,
    next_candidate,
    parse_depths,
)
from vfleet.fleet.tune_state import Identity, Result, State, load, save
from vfleet.measure.scenarios import Run

VENV_BIN = Path(sys.executable).parent


def cpu(*sets: str) -> Launch:
    return resolve("cpu", "tiny-hybrid-mtp", sets=list(sets))


def measured(tps: float, **kw: float | None) -> Measurement:
    m = {"decode_tps": tps, "aggregate_tps": tps * 0.9, "ttft_p95_s": 0.2, "requests": 3,
         "failed_requests": 0} | kw  # fmt: skip
    return Measurement(**m)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the space


def test_cpu_space_is_depth_and_chunk_the_rest_left_out_with_why() -> None:
    dims, left_out = build_space(cpu(), ["depth", "batched-tokens", "cudagraph-mode",
                                         "async-scheduling", "cpu-threads"])  # fmt: skip
    by = {d.name: d for d in dims}
    assert [c.label for c in by["depth"].choices] == ["0", "1", "2", "3", "4"]
    # The rules' default depth (3) is what the host runs: the others are tried against it.
    assert by["depth"].choices[by["depth"].start].label == "3"
    assert [c.label for c in by["batched-tokens"].choices] == ["1024", "2048", "4096"]
    assert set(left_out) == {"cudagraph-mode", "async-scheduling", "cpu-threads"}
    assert "cpu profile" in left_out["cudagraph-mode"]
    assert "cpu_cores" in left_out["cpu-threads"]


def test_cpu_threads_are_prefixes_of_the_instances_own_cores() -> None:
    dims, _ = build_space(cpu("cpu_cores=2-5"), ["cpu-threads"])
    (threads,) = dims
    assert [c.sets for c in threads.choices] == [
        ("cpu_cores=2", "omp_num_threads=1"),
        ("cpu_cores=2-3", "omp_num_threads=2"),
        ("cpu_cores=2-5", "omp_num_threads=4"),
    ]
    # One core bound: nothing to compare, and the report says so.
    dims, left_out = build_space(cpu("cpu_cores=0"), ["cpu-threads"])
    assert dims == [] and "one value only" in left_out["cpu-threads"]


def test_gpu_space_has_graph_mode_and_async_scheduling() -> None:
    launch = resolve("2x2080ti-22g", "qwen3.6-27b-fp8")
    dims, left_out = build_space(launch, ["depth", "cudagraph-mode", "async-scheduling",
                                          "cpu-threads"])  # fmt: skip
    names = [d.name for d in dims]
    assert names == ["depth", "cudagraph-mode", "async-scheduling"]
    assert "cpu-profile" in left_out["cpu-threads"]


def test_a_model_without_mtp_has_no_depth_to_sweep() -> None:
    dims, left_out = build_space(resolve("cpu", "tiny-dense"), ["depth"])
    assert dims == [] and "no MTP layers" in left_out["depth"]


def test_unknown_dimension_and_bad_depths_are_refused_with_the_fix() -> None:
    with pytest.raises(VfleetError) as e:
        build_space(cpu(), ["depth", "warp-speed"])
    assert e.value.key == "--sweep" and "batched-tokens" in (e.value.fix or "")
    with pytest.raises(VfleetError) as e:
        parse_depths("0,5")
    assert e.value.key == "--depths"
    assert parse_depths("3,1,1,0") == (0, 1, 3)


def test_each_depth_renders_its_own_speculative_config_through_the_rules() -> None:
    dims, _ = build_space(cpu(), ["depth"])
    for i, choice in enumerate(dims[0].choices):
        launch = cpu(*candidate(dims, {"depth": i}).sets)
        spec = launch.config_values().get("speculative-config")
        if choice.label == "0":
            assert spec is None and launch.decisions.spec_k == 0
        else:
            assert isinstance(spec, dict) and spec["num_speculative_tokens"] == int(choice.label)


# --------------------------------------------------------------------------- skip logic


def test_a_candidate_the_rules_refuse_is_skipped_with_the_rules_message() -> None:
    bad = Dimension("x", (Choice("gpus", ("gpus=[0]",)),), 0, ordered=False, why="")
    why = infeasible(lambda extra: cpu(*extra), candidate([bad], {"x": 0}))
    assert why is not None and why.startswith("refused: the cpu profile has no GPUs")


def test_a_candidate_that_does_not_fit_is_skipped_with_the_planners_problem() -> None:
    # 1 MiB of KV on the 2080 Tis cannot hold one request: the rules accept it, the planner not.
    tiny = Dimension("kv", (Choice("1M", ("kv_cache_memory_bytes=1048576",)),), 0, False, "")
    why = infeasible(
        lambda extra: resolve("2x2080ti-22g", "qwen3.6-27b-fp8", sets=list(extra)),
        candidate([tiny], {"kv": 0}),
    )
    assert why is not None and why.startswith("does not fit (planner): one 100000-token"), why


def test_a_candidate_that_fits_is_not_skipped() -> None:
    dims, _ = build_space(cpu(), ["depth"])
    assert infeasible(lambda extra: cpu(*extra), candidate(dims, {"depth": 2})) is None


# --------------------------------------------------------------------------- order of trying


def dims_2() -> list[Dimension]:
    depth = Dimension("depth", tuple(Choice(str(k), (f"d={k}",)) for k in range(5)), 3, True, "")
    chunk = Dimension("chunk", (Choice("a", ("c=a",)), Choice("b", ("c=b",))), 0, False, "")
    return [depth, chunk]


def run_search(
    dims: list[Dimension], truth: Mapping[str, float | None], search: Search
) -> list[str]:
    scores: dict[str, float | None] = {}
    order = []
    while (c := next_candidate(dims, scores, search, 0.05)) is not None:
        order.append(c.key)
        scores[c.key] = truth[c.key]
    return order


def test_climb_starts_at_what_runs_walks_to_the_peak_and_stops_past_it() -> None:
    acc = {0: 10.0, 1: 14.0, 2: 16.0, 3: 12.0, 4: 9.0}
    truth = {f"depth={k} chunk={c}": v + (1 if c == "b" else 0) for k, v in acc.items()
             for c in "ab"}  # fmt: skip
    order = run_search(dims_2(), truth, "climb")
    # The host runs depth 3: then 2 (better), 1 (25% below 2: stop going down); 3 is already
    # below 2, so 4 is never deployed, nor 0. Then the chunk, at depth 2.
    assert order == ["depth=3 chunk=a", "depth=2 chunk=a", "depth=1 chunk=a", "depth=2 chunk=b"]


def test_climb_keeps_going_while_within_the_margin() -> None:
    truth = {
        f"depth={k} chunk={c}": v for k, v in enumerate([10, 10.2, 9.9, 9.8, 11]) for c in "ab"
    }
    order = run_search(dims_2(), truth, "climb")
    assert [k for k in order if k.endswith("chunk=a")] == [
        f"depth={k} chunk=a" for k in (3, 2, 1, 0, 4)
    ]


def test_climb_stops_walking_past_a_failed_value() -> None:
    # The host runs depth 0; depth 1 fails its swap (say vLLM refused it at start): deeper is
    # not tried. The scores beyond would be higher, but a climb assumes one peak.
    depth = Dimension("depth", tuple(Choice(str(k), (f"d={k}",)) for k in range(5)), 0, True, "")
    truth = {"depth=0": 10.0, "depth=1": None, "depth=2": 30.0, "depth=3": 40.0, "depth=4": 50.0}
    order = run_search([depth], truth, "climb")
    assert order == ["depth=0", "depth=1"]
    assert run_search([depth], truth, "grid") == list(truth)


def test_grid_measures_every_combination_once() -> None:
    truth = {f"depth={k} chunk={c}": float(k) for k in range(5) for c in "ab"}
    order = run_search(dims_2(), truth, "grid")
    assert sorted(order) == sorted(truth) and len(order) == 10


def test_failed_and_skipped_candidates_count_as_tried_not_as_scores() -> None:
    dims = dims_2()
    scores: dict[str, float | None] = {f"depth={k} chunk=a": None for k in range(5)}
    # Every depth failed: the chunk is tried at the depth the host runs now (3).
    c = next_candidate(dims, scores, "climb", 0.05)
    assert c is not None and c.key == "depth=3 chunk=b"


# --------------------------------------------------------------------------- objective


def test_decode_objective_is_streams_times_per_stream_speed() -> None:
    obj = objective_from("decode", 4, None)
    assert obj.score(measured(10.0)) == (40.0, None)


def test_throughput_objective_needs_and_applies_the_ttft_slo() -> None:
    with pytest.raises(VfleetError) as e:
        objective_from("throughput", 2, None)
    assert e.value.key == "--ttft-slo"
    obj = objective_from("throughput", 2, 0.5)
    assert obj.score(measured(10.0, ttft_p95_s=0.4)) == (9.0, None)
    score, why = obj.score(measured(50.0, ttft_p95_s=0.6))
    assert score is None and why == "TTFT p95 0.600 s > SLO 0.5 s"


def test_a_failed_request_disqualifies_a_candidate() -> None:
    score, why = objective_from("decode", 1, None).score(measured(99.0, failed_requests=1))
    assert score is None and why == "1 of 3 requests failed"


def test_bad_objective_options_exit_2_with_the_key() -> None:
    for args, key in (("decode", 0, None), "--concurrency"), (("decode", 1, -1.0), "--ttft-slo"):
        with pytest.raises(VfleetError) as e:
            objective_from(*args)
        assert e.value.key == key


def test_p95_is_a_measured_value_nearest_rank() -> None:
    assert p95([]) is None
    assert p95([3.0]) == 3.0
    assert p95([float(x) for x in range(1, 21)]) == 19.0  # ceil(0.95 * 20) = 19th
    assert p95([float(x) for x in range(1, 101)]) == 95.0


def test_summary_of_bench_runs_and_the_step_time() -> None:
    runs = [
        Run("concurrency", 256, "cold", 0, 64, 2, ttfts_s=[0.1, 0.3], decode_tps=10.0,
            aggregate_tps=18.0, tokens_per_step=3.0, acceptance_rate=0.5),
        Run("concurrency", 256, "cold", 1, 64, 2, ttfts_s=[0.2, 0.4], decode_tps=12.0,
            aggregate_tps=20.0, tokens_per_step=3.0, acceptance_rate=0.7),
        Run("concurrency", 256, "cold", 2, 64, 2, error="timeout"),
    ]  # fmt: skip
    m = summarize(runs, 2, 12.34)
    assert isinstance(m, Measurement)
    # Speeds: the fastest repeat (load only slows one down); counts: the mean.
    assert (m.decode_tps, m.aggregate_tps, m.ttft_p95_s) == (12.0, 20.0, 0.4)
    assert m.acceptance_rate == pytest.approx(0.6)
    assert (m.requests, m.failed_requests) == (6, 2)
    # 3 tokens per engine step over 2 streams at 12 tok/s each: 24 tok/s / 3 = 8 steps/s.
    assert m.step_time_s == pytest.approx(3.0 / 24.0)
    assert summarize(runs[2:], 2, 1.0) == "no decode speed measured: timeout"


# --------------------------------------------------------------------------- state and resume


def ident(**kw: object) -> Identity:
    base = Identity.of("node1", "cpu", "tiny-hybrid-mtp", "main", ["port=8000", "api_key=s"],
                       BenchPlan())  # fmt: skip
    return Identity(**{**base.__dict__, **kw})


def test_state_round_trips_and_a_resume_skips_what_was_tried(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    state = load(path, ident())
    assert state.results == {}
    state.runs += 1
    dims = dims_2()
    first = next_candidate(dims, state.scores(objective_from("decode", 1, None)), "grid", 0.05)
    assert first is not None
    state.add(Result(first.key, dict(first.picks), list(first.sets), "measured",
                     measurement=measured(5.0), seconds=60.0))  # fmt: skip
    state.add(Result("depth=1 chunk=a", {}, [], "skipped", "refused: x"))
    save(path, state)
    assert "api_key" not in path.read_text()  # the host's settings are kept as a hash only
    again = load(path, ident())
    assert again.results == state.results and again.runs == 1
    nxt = next_candidate(dims, again.scores(objective_from("decode", 1, None)), "grid", 0.05)
    assert nxt is not None and nxt.key == "depth=0 chunk=b"
    assert again.mean_candidate_s() == 60.0  # skipped candidates cost no deploy
    # A failed candidate (a start that timed out) is tried again by the next run.
    again.add(Result("depth=2 chunk=a", {}, [], "failed", "swap failed (start-limit-hit)"))
    assert [r.key for r in again.forget_failed()] == ["depth=2 chunk=a"]
    assert "depth=2 chunk=a" not in again.results and "depth=1 chunk=a" in again.results
    assert again.winner(objective_from("decode", 1, None)).key == first.key  # type: ignore[union-attr]


def test_state_of_another_tune_or_a_broken_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    save(path, State(ident()))
    with pytest.raises(VfleetError) as e:
        load(path, ident(bench=BenchPlan(concurrency=4)))
    assert e.value.key == "--state" and "differs in: bench" in e.value.message
    with pytest.raises(VfleetError) as e:
        load(path, ident(host="node2"))
    assert "differs in: host" in e.value.message
    path.write_text("{not json")
    with pytest.raises(VfleetError) as e:
        load(path, ident())
    assert "not a tune state file" in e.value.message and e.value.where == str(path)


# --------------------------------------------------------------------------- report, overrides


def test_report_marks_the_best_and_the_plot_is_an_svg() -> None:
    state = State(ident(), 1)
    for k, tps in ((0, 10.0), (1, 14.0), (2, 12.0)):
        state.add(Result(f"depth={k}", {"depth": str(k)}, [], "measured",
                         measurement=measured(tps, step_time_s=0.05)))  # fmt: skip
    state.add(Result("depth=4", {"depth": "4"}, [], "skipped", "does not fit (planner): x"))
    obj = objective_from("decode", 1, None)
    winner = state.winner(obj)
    assert winner is not None and winner.key == "depth=1"
    doc = {"host": "node1", "profile": "cpu", "model": "m", "instance": "main",
           "search": "climb", "dimensions": ["depth"], "left_out": {"x": "why"},
           "measured": 3, "skipped": 1, "failed": 0, "unmeasured": 0,
           "bench": BenchPlan().__dict__, "command": "vfleet tune node1",
           "stopped": None}  # fmt: skip
    text = markdown(doc, state, obj, winner)
    assert "| depth=1 **(best)** | measured | 14.00 |" in text
    assert "| depth=4 | skipped | - |" in text and "does not fit (planner): x" in text
    assert "not swept: x: why" in text
    root = ET.fromstring(svg(state, obj, winner))
    bars = root.findall("{http://www.w3.org/2000/svg}rect")
    assert len(bars) == 3 and sum(b.get("fill") == "#2a7" for b in bars) == 1
    assert "decode cost model" not in text  # no step times written: nothing said
    model = {"from_depth": 1, "error_by_depth": {"0": -0.052, "2": 0.031}}
    text = markdown({**doc, "step_times": {"cost_model": model}}, state, obj, winner)
    assert "from MTP 1's step: MTP 0 -5.2%, MTP 2 +3.1% against what was measured" in text
    why = {"not_checked": "no memory-bandwidth figure for this card"}
    text = markdown({**doc, "step_times": {"cost_model": why}}, state, obj, winner)
    assert "the decode cost model not checked: no memory-bandwidth figure" in text


def test_merged_sets_keep_old_keys_the_new_tune_did_not_set() -> None:
    old = ["max_num_batched_tokens=4096", "speculative.num_speculative_tokens=3"]
    new = ["speculative.method=mtp", "speculative.num_speculative_tokens=2"]
    assert merged_sets(old, new) == ["max_num_batched_tokens=4096", *new]


def test_overrides_land_where_ansible_reads_them_and_the_doctor_plans_with_them(
    tmp_path: Path,
) -> None:
    inv = tmp_path / "inv.yml"
    inv.write_text(
        "all:\n  hosts:\n    h1:\n      ansible_connection: local\n      vfleet_set: [port=18123]\n"
    )
    assert host_vars_dir(inv, "h1") == tmp_path / "host_vars" / "h1"
    assert host_vars_dir(tmp_path, "h1") == tmp_path / "host_vars" / "h1"
    sets = ["speculative.method=mtp", "speculative.num_speculative_tokens=2"]
    yml, md = write_overrides(inv, "h1", sets, "Written by a test.\nSecond line.", "| t |\n")
    assert yml.read_text().startswith("# Written by a test.\n# Second line.\n")
    assert md.read_text() == "| t |\n" and read_tuned(inv, "h1") == sets
    # The real ansible-inventory reads host_vars/h1/ beside the inventory (and not the .md).
    out = subprocess.run(
        [str(VENV_BIN / "ansible-inventory"), "-i", str(inv), "--host", "h1"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    hv = json.loads(out.stdout)
    assert hv[TUNED_VAR] == sets and hv["vfleet_set"] == ["port=18123"]
    # The doctor (and the swap, which plans through it) applies it after vfleet_set, as the
    # role does: the rendered depth is the tuned one.
    from vfleet.fleet.inventory import host_namespace, host_plan, host_settings

    ns = host_namespace(str(inv), "h1", None, None)
    assert host_settings(ns, hv)["sets"] == ["port=18123", *sets]
    plan, _ = host_plan(ns, hv)
    vllm_yaml = plan.file("vllm.yaml")
    assert '"num_speculative_tokens": 2' in vllm_yaml or "num_speculative_tokens: 2" in vllm_yaml


def test_the_role_applies_the_tuned_set_between_vfleet_set_and_a_swaps_settings() -> None:
    tasks = (REPO / "ansible/roles/vfleet/tasks/main.yml").read_text()
    assert "sets=vfleet_set + vfleet_tuned_set + vfleet_extra_set" in tasks
    defaults = yaml.safe_load((REPO / "ansible/roles/vfleet/defaults/main.yml").read_text())
    assert defaults[TUNED_VAR] == []


# --------------------------------------------------------------------------- the command


def vfleet(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VENV_BIN / "vfleet"), *args], capture_output=True, text=True, timeout=300, check=False
    )


def test_dry_run_lists_the_space_and_what_fits_deploying_nothing(tmp_path: Path) -> None:
    r = vfleet("tune", "localhost", "--dry-run", "--search", "grid", "--sweep", "depth",
               "--out", str(tmp_path / "t"))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "depth: 0, 1, 2, 3 (now), 4" in r.stdout
    assert "  depth=2: fits" in r.stdout and "5 combination(s)" in r.stdout
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--sweep", "warp"], "--sweep: unknown dimension(s) for --sweep: warp"),
        (["--objective", "throughput"], "--ttft-slo: the throughput objective needs a TTFT SLO"),
        (["--budget", "0"], "--budget: --budget must be > 0"),
        (["--depths", "7"], "--depths: --depths '7' is not a list of depths 0..4"),
        (["--margin", "1.5"], "--margin: --margin is a fraction in [0, 1)"),
    ],
)
def test_bad_options_exit_2_naming_the_option(args: list[str], said: str, tmp_path: Path) -> None:
    r = vfleet("tune", "localhost", "--out", str(tmp_path / "t"), *args)
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "t").exists()


def test_step_times_are_the_winners_neighbours_in_depth_and_land_on_the_host(
    tmp_path: Path,
) -> None:
    from vfleet_healthcheck.depth import load_step_times

    from vfleet.config.schema import HostVars
    from vfleet.fleet.tune import Target, step_times, write_step_times

    state = State(ident(), 1)
    for key, picks, step, accept in (
        ("depth=0 chunk=a", {"depth": "0", "chunk": "a"}, 0.008, None),  # no speculation
        ("depth=1 chunk=a", {"depth": "1", "chunk": "a"}, 0.010, 0.72),
        ("depth=2 chunk=a", {"depth": "2", "chunk": "a"}, 0.012, 0.42),
        ("depth=2 chunk=b", {"depth": "2", "chunk": "b"}, 0.020, 0.9),  # another chunk: not used
        ("depth=3 chunk=a", {"depth": "3", "chunk": "a"}, None, 0.28),  # no step time measured
    ):
        m = measured(9, step_time_s=step, acceptance_rate=accept)
        state.add(Result(key, picks, [], "measured", measurement=m))
    winner = state.results["depth=2 chunk=a"]
    # Accepted per draft = depth x acceptance rate (accepted / draft tokens).
    assert step_times(state, winner) == ({0: 0.008, 1: 0.010, 2: 0.012}, {1: 0.72, 2: 0.84})
    # A host reached locally (ansible_connection: local): the file lands in its instance folder.
    base = tmp_path / "vfleet"
    launch = resolve("cpu", "tiny-hybrid-mtp", host=HostVars(base_dir=str(base)))
    hv = {"ansible_connection": "local"}
    t = Target("h1", tmp_path / "inv.yml", launch, [], [], None, None, "cpu", "tiny-hybrid-mtp",
               None, None, hv, {})  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    said = write_step_times(t, state, winner, BenchPlan(), out)
    assert said is not None and said["not_copied"] is None and said["depths"] == [0, 1, 2]
    on_host = load_step_times(base / "instances" / "main" / "step-times.json")
    assert dict(on_host.seconds_per_step) == {0: 0.008, 1: 0.010, 2: 0.012}
    assert dict(on_host.accepted_per_draft) == {1: 0.72, 2: 0.84} and on_host.concurrency == 1
    assert "vfleet tune h1" in on_host.method
    assert (out / "step-times.json").read_text() == (
        base / "instances/main/step-times.json"
    ).read_text()


def test_the_bench_sends_the_key_from_the_inventorys_key_file(tmp_path: Path) -> None:
    """vfleet_api_key_file (how the fleet deploys the key, never a setting): tune's bench reads
    it there. Seen on the fleet: without it every candidate answered HTTP 401 and failed."""
    import argparse

    from vfleet.fleet.tune import target

    key = tmp_path / "api.key"
    key.write_text("sk-tune-test\n")
    key.chmod(0o600)
    inv = tmp_path / "inv.yml"
    inv.write_text(
        "all:\n  hosts:\n    h1:\n      ansible_connection: local\n"
        f"      vfleet_set: [port=18123]\n      vfleet_api_key_file: {key}\n"
    )
    a = argparse.Namespace(
        inventory=str(inv), host="h1", instance=None, base_dir=None, profiles_dir=None
    )
    t = target(a)
    assert t.api_key_file == str(key) and t.api_key == "sk-tune-test"
    assert not any("sk-tune-test" in s for s in t.sets)  # nowhere in what is rendered or logged
    key.chmod(0o644)  # a key other users can read is refused, naming the file
    with pytest.raises(VfleetError) as err:
        _ = t.api_key
    assert str(key) in str(err.value.where) or str(key) in str(err.value)


def test_the_rollout_gate_renders_a_release_without_speculative_decoding(tmp_path: Path) -> None:
    """Seen on the fleet: tune's rollout of depth 0 (`speculative.method=none`: no
    speculative-config in vllm.yaml) failed the swap's gate task ("object of type 'dict' has no
    attribute 'speculative-config'"), so the winner was rolled back. swap.yml's own expression,
    templated by Ansible for vllm.yaml with and without it."""
    plays = yaml.safe_load((REPO / "ansible" / "swap.yml").read_text())

    def tasks(node: object) -> list[dict[str, object]]:
        if isinstance(node, list):
            return [t for n in node for t in tasks(n)]
        if isinstance(node, dict):
            found = [node] if "name" in node and "vars" in node else []
            return found + [t for v in node.values() for t in tasks(v)]
        return []

    gate = next(t for t in tasks(plays) if "(performance gate)" in str(t["name"]))
    expression = gate["vars"]["_vfleet_perf_spec"]  # type: ignore[index]
    play = [{
        "hosts": "localhost", "gather_facts": False,
        "tasks": [{
            "name": "spec", "ansible.builtin.debug": {"msg": "[{{ _vfleet_perf_spec }}]"},
            "vars": {"_vfleet_perf_args": "{{ item | from_yaml }}",
                     "_vfleet_perf_spec": expression},
            "loop": ["model: m\nport: 1\n",
                     "model: m\nspeculative-config:\n  num_speculative_tokens: 2\n  method: mtp\n"],
        }],
    }]  # fmt: skip
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    proc = subprocess.run(
        [str(REPO / ".venv" / "bin" / "ansible-playbook"), "-i", "localhost,", "-c", "local",
         str(tmp_path / "play.yml")],
        capture_output=True, text=True, timeout=120, check=False,
        env={"ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"), "PATH": "/usr/bin:/bin",
             "ANSIBLE_STDOUT_CALLBACK": "default", "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert '"msg": "[]"' in proc.stdout  # no speculation: --speculative ''
    assert '"msg": "[method=mtp,num_speculative_tokens=2]"' in proc.stdout


def test_a_bench_without_a_decode_speed_is_run_again_then_given_up() -> None:
    """Every stream of a bench read late (vfleet.measure.client): no decode speed, so the bench
    runs again, BENCH_TRIES in all; any other failure is final at once."""
    from vfleet.fleet.tune_measure import BENCH_TRIES, NO_DECODE, Measurement, until_decoded

    good = Measurement(
        decode_tps=200.0, aggregate_tps=190.0, ttft_p95_s=0.1, requests=5, failed_requests=0,
        acceptance_rate=0.5, tokens_per_step=1.8, step_time_s=0.009, bench_s=3.0,
    )  # fmt: skip
    answers: list[Measurement | str] = [NO_DECODE, NO_DECODE + ": x", good]
    said: list[str] = []
    assert until_decoded(lambda: answers.pop(0), said.append) is good
    assert not answers and len(said) == 2 and "bench 3 of at most 3" in said[-1]
    calls: list[int] = []

    def never() -> str:
        calls.append(1)
        return NO_DECODE

    assert until_decoded(never, said.append) == NO_DECODE and len(calls) == BENCH_TRIES
    other: list[Measurement | str] = ["the server did not answer: refused", good]
    assert until_decoded(lambda: other.pop(0), said.append) == "the server did not answer: refused"
    assert other == [good]
