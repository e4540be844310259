"""Feature reader-spin: its gate (fingerprints of the pinned sources, the decision), its setting
and its hook.

The hook runs here on a stand-in class with SpinCondition's two relevant attributes (the control
venv has no vLLM); tests/integration/test_plugin_vllm.py runs it on vLLM's own SpinCondition,
and the CPU it saves is a benchmark (docs/BENCHMARKS.md, "The reader's spin").
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from vfleet_sm75 import decide, fingerprints, reader_spin, settings
from vfleet_sm75.verified import HOOKS, SPIN, VERIFIED

from tests.conftest import pinned_vllm_source
from tests.support.plugin_facts import facts
from vfleet.engine.rules.hardware import READER_SPIN_S
from vfleet.render.plan import plan

FEATURE = "reader-spin"


_root = pinned_vllm_source


@pytest.mark.parametrize("version", ["0.24.0", "0.27.1", "0.32.0"])
def test_the_recorded_fingerprints_are_the_pinned_sources(version: str) -> None:
    prints = VERIFIED[FEATURE][version]
    assert set(prints) == set(HOOKS[FEATURE])
    assert fingerprints.fingerprints(list(prints), _root(version)) == prints


@pytest.mark.parametrize("version", ["0.24.0", "0.27.1", "0.32.0"])
def test_the_premise_readers_spin_a_second_in_every_pinned_version(version: str) -> None:
    """vLLM's default window is 1 s and wait() reads busy_loop_s: what the hook changes."""
    text = (_root(version) / SPIN.split(":")[0]).read_text()
    assert "busy_loop_s: float = 1," in text
    assert "busy_loop_s" in fingerprints.names(f"{SPIN}.wait", _root(version))


def _facts(**kw: Any) -> decide.Facts:
    return facts("0.32.0", **{"spin_s": 0.1, **kw})


def _decision(f: decide.Facts) -> decide.Decision:
    return {d.feature: d for d in decide.decide(f)}[FEATURE]


def test_on_with_a_window_and_says_which() -> None:
    d = _decision(_facts())
    assert d.active and "busy-poll 0.1 s after a read (vLLM: 1 s)" in d.reason
    assert d.detail == {"spin_s": 0.1}


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"spin_s": None}, "no window: set VFLEET_SM75_SPIN_S"),
        ({"spin_error": "VFLEET_SM75_SPIN_S=x: must be"}, "VFLEET_SM75_SPIN_S=x: must be"),
        ({"vllm_version": "0.21.0"}, "vLLM 0.21.0 is not a verified version"),
        ({"hooks": {}}, "SpinCondition.wait is missing"),
        (
            {"setting": "draft-prune", "requested": frozenset({"draft-prune"})},
            "not asked for (VFLEET_SM75=draft-prune)",
        ),
    ],
)
def test_off_and_why(kw: dict[str, Any], reason: str) -> None:
    d = _decision(_facts(**kw))
    assert not d.active and reason in d.reason


@pytest.mark.parametrize(("raw", "value"), [("", None), ("0.1", 0.1), ("0", 0.0), (" 1 ", 1.0)])
def test_the_setting(raw: str, value: float | None) -> None:
    assert settings.spin_s({settings.ENV_SPIN: raw}) == value


@pytest.mark.parametrize("raw", ["x", "-0.1", "2", "nan"])
def test_a_bad_setting_names_the_variable_and_the_range(raw: str) -> None:
    with pytest.raises(settings.SettingError, match=r"VFLEET_SM75_SPIN_S=.*0 to 1"):
        settings.spin_s({settings.ENV_SPIN: raw})


def test_facts_read_the_setting_and_its_error() -> None:
    ok = decide.facts({settings.ENV: "reader-spin", settings.ENV_SPIN: "0.25"}, probe_device=False)
    assert (ok.spin_s, ok.spin_error) == (0.25, None)
    bad = decide.facts({settings.ENV: "reader-spin", settings.ENV_SPIN: "5"}, probe_device=False)
    assert bad.spin_s is None and bad.spin_error and "0 to 1" in bad.spin_error


class _Cond:
    """SpinCondition's two attributes the hook touches: a reader's window, and wait()."""

    def __init__(self, is_reader: bool) -> None:
        self.busy_loop_s = 1.0 if is_reader else 0.0
        self.seen: list[tuple[float, int | None]] = []

    def wait(self, timeout_ms: int | None = None) -> None:
        self.seen.append((self.busy_loop_s, timeout_ms))


def test_the_wrapped_wait_lowers_a_readers_window_and_leaves_a_writers_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = types.ModuleType(reader_spin.MODULE)
    cls = type("SpinCondition", (_Cond,), {})
    module.SpinCondition = cls  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, reader_spin.MODULE, module)
    made_before = cls(True)  # a queue made before the plugin loaded (the worker's broadcast)
    reader_spin.install(0.1)
    reader_spin.install(0.1)  # vLLM may load plugins twice: wrapped once
    writer, later = cls(False), cls(True)
    for c in (made_before, writer, later):
        c.wait(5)
    assert made_before.seen == [(0.1, 5)] and later.seen == [(0.1, 5)]
    assert writer.seen == [(0.0, 5)]
    assert cls._vfleet_reader_spin == 0.1  # type: ignore[attr-defined]
    assert cls.wait.__wrapped__ is _Cond.wait  # type: ignore[attr-defined]  # once
    larger = cls(True)
    larger.busy_loop_s = 0.01
    larger.wait()
    assert larger.seen == [(0.01, None)]  # a window already below the setting stays


def test_the_cpu_profile_sets_the_window_and_gpu_profiles_do_not() -> None:
    cpu = plan("cpu", "tiny-hybrid-mtp").env()
    assert cpu["VFLEET_SM75_SPIN_S"] == READER_SPIN_S and cpu["VFLEET_SM75"] == "auto"
    assert float(READER_SPIN_S) == 0.1
    gpu = plan("2x2080ti-22g", "qwen3.6-27b-fp8").env()
    assert gpu["VFLEET_SM75"] == "auto" and "VFLEET_SM75_SPIN_S" not in gpu
