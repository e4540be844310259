"""bench/gpu_switch.py without a GPU: both releases render with the switch's settings, and the
report reads the H200 runs' results (bench/results/h200/switch-run*.json)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

from tests.conftest import REPO


def _switch() -> ModuleType:
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("gpu_switch", REPO / "bench" / "gpu_switch.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_switch"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_both_engines_render_with_sleep_mode_their_port_and_the_drafter_extension(
    tmp_path: Path,
) -> None:
    sw = _switch()
    host = sw.lane.Host(
        tmp_path, "python3", "", "/usr/local/cuda", tmp_path / "m", "h200-141g", "tiny-hybrid-mtp"
    )
    for name, model, port in (("a", "tiny-hybrid-mtp", 8001), ("b", "mid-hybrid-mtp", 8002)):
        rel = sw.render(host, sw.Engine(name, model, port, ""), 0.45)
        yaml = (rel / "vllm.yaml").read_text(encoding="utf-8")
        assert f"\nport: {port}\n" in yaml
        assert "\ngpu-memory-utilization: 0.45\n" in yaml
        assert "\nenable-sleep-mode: true\n" in yaml
        assert "\nworker-extension-cls: switch_ext.DrafterReload\n" in yaml
        assert "VLLM_SERVER_DEV_MODE='1'" in (rel / "vllm.env").read_text(encoding="utf-8")


def test_the_report_reads_the_h200_runs() -> None:
    sw = _switch()
    for run, failed in (("switch-run1.json", 3), ("switch-run2.json", 0), ("switch-run3.json", 3)):
        result = json.loads((REPO / "bench/results/h200" / run).read_text(encoding="utf-8"))
        table = sw.report_md(result)
        rows = [line for line in table.splitlines() if line.startswith("| a ->")]
        rows += [line for line in table.splitlines() if line.startswith("| b ->")]
        assert len(rows) == 5
        assert sum(s["n_failed"] for s in result["switches"]) == failed
        assert "0.000 -> 1.000 (drafter reloaded)" in table
