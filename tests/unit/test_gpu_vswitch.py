"""bench/gpu_vswitch.py without a GPU: each pair's inventory renders the releases `vfleet switch`
acts on, as the device run starts them (the 27B pair at its own size with random weights)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_vswitch as vs


def _render(
    tmp_path: Path, pair: str, plugin: str = "drafter-reload", sets: list[str] | None = None
) -> dict[str, dict[str, object]]:
    a = argparse.Namespace(
        pair=pair,
        profile=vs.lane.DEFAULT_PROFILE,
        models_dir=str(tmp_path / "models"),
        util=0.45,
        plugin=plugin,
        plugin_b=None,
        set=sets,
    )
    base = tmp_path / "base"
    base.mkdir()
    vs.write_inventory(base / "inv.yml", vs.inventory(a, base, {"a": 1, "b": 2}))
    out = {}
    for inst in ("a", "b"):
        rel = vs.render_release(base, inst)
        cfg = yaml.safe_load((rel / "vllm.yaml").read_text(encoding="utf-8"))
        env = (rel / "vllm.env").read_text(encoding="utf-8")
        out[inst] = {"cfg": cfg, "env": env}
    return out


def test_the_27b_pair_serves_both_awq_presets_at_their_size_with_random_weights(
    tmp_path: Path,
) -> None:
    r = _render(tmp_path, "27b-awq")
    for inst, model in vs.PAIRS["27b-awq"].items():
        cfg, env = r[inst]["cfg"], r[inst]["env"]
        assert isinstance(cfg, dict) and isinstance(env, str)
        assert cfg["model"] == str(tmp_path / "models" / model)
        assert cfg["load-format"] == "dummy"
        assert cfg["max-model-len"] == 32768
        assert cfg["gpu-memory-utilization"] == 0.45
        assert cfg["enable-sleep-mode"] is True
        assert cfg["served-model-name"] == vs.SERVED
        assert cfg["port"] == vs.PORTS[inst]
        assert "kv-cache-dtype" not in cfg or cfg["kv-cache-dtype"] == "auto"
        assert cfg["speculative-config"]["method"] == "mtp"
        assert "VFLEET_SM75='drafter-reload'" in env
    # the multimodal preset starts without an image processor only as a language model
    assert r["a"]["cfg"]["language-model-only"] is True
    assert "VFLEET_SLEEP_LEVEL='1'" in str(r["a"]["env"])
    assert "VFLEET_SLEEP_LEVEL='2'" in str(r["b"]["env"])


def test_the_next_holds_pair_runs_sleep_memory_and_takes_settings_for_both(
    tmp_path: Path,
) -> None:
    """GPU.md's next hold: the 27B pair with the plugin's sleep-memory, eager (no compile or
    graphs: a start of minutes less); the setting reaches both engines' releases."""
    r = _render(
        tmp_path,
        "27b-awq",
        plugin="drafter-reload,sleep-memory",
        sets=["extra_args.enforce-eager=true"],
    )
    for inst in ("a", "b"):
        cfg, env = r[inst]["cfg"], r[inst]["env"]
        assert isinstance(cfg, dict) and cfg["enforce-eager"] is True
        assert "VFLEET_SM75='drafter-reload,sleep-memory'" in str(env)


def test_the_default_pair_stays_the_generated_models_in_their_window(tmp_path: Path) -> None:
    r = _render(tmp_path, "tiny-mid")
    for inst, model in vs.MODELS.items():
        cfg = r[inst]["cfg"]
        assert isinstance(cfg, dict)
        assert cfg["model"] == str(tmp_path / "models" / model)
        assert cfg["max-model-len"] == 4096
        assert "load-format" not in cfg


def test_up_names_only_the_pairs_it_knows(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        vs.main(["up", "--pair", "27b-fp8"])
    assert exc.value.code == 2
    assert "27b-awq" in capsys.readouterr().err


def test_a_pair_with_random_weights_switches_at_level_1_only() -> None:
    # vLLM 0.24.0's reload_weights has no checkpoint to read with load-format dummy
    assert all(not levels for _, levels in vs.sequence_of("27b-awq", "sleep-first"))
    assert [to for to, _ in vs.sequence_of("27b-awq", "wake-first")] == ["b", "a", "b", "a", "b"]
    assert any(2 in levels.values() for _, levels in vs.sequence_of("tiny-mid", "sleep-first"))


def test_alternate_runs_each_direction_twice_in_each_order() -> None:
    seq = vs.sequence_of("27b-awq", "alternate")
    assert all(not levels for _, levels in seq)
    runs = [(("a" if to == "b" else "b") + "->" + to, vs.order_of("alternate", i))
            for i, (to, _) in enumerate(seq)]  # fmt: skip
    assert len(runs) == 8
    for direction in ("a->b", "b->a"):
        for order in ("sleep-first", "wake-first"):
            assert runs.count((direction, order)) == 2, (direction, order, runs)
    assert vs.order_of("wake-first", 5) == "wake-first"
    # the orders are compared at one level whatever the pair; a single order keeps the
    # pair's own sequence (level 2 wakes where the pair has checkpoints)
    assert vs.sequence_of("tiny-mid", "alternate") == seq
    assert vs.sequence_of("tiny-mid", "wake-first") == vs.SEQUENCE


def test_a_memory_reading_says_whether_the_engine_sleeps(tmp_path: Path) -> None:
    """`asleep` reads vLLM's /is_sleeping (here a loopback server answering as vLLM does): the
    state at the reading, which `level` (the level it sleeps at) is not."""
    import http.server
    import threading

    import gpu_switch as gs

    answers = iter([b'{"is_sleeping": true}', b'{"is_sleeping": false}', b"not json"])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            assert self.path == "/is_sleeping"
            body = next(answers)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        assert [gs.asleep(port), gs.asleep(port), gs.asleep(port)] == [True, False, None]
    finally:
        server.shutdown()
    assert gs.asleep(port, timeout=0.5) is None  # nobody listens any more
