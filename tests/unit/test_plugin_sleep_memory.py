"""Feature sleep-memory: its gate (fingerprints of the pinned sources, the premise in each
pinned version, the decision) and its hook.

The hook runs here on stand-ins for vLLM's MemorySnapshot and CuMemAllocator (the control venv
has no CUDA, and sleep mode has no CPU build: a stand-in is the only way to run it here). On a
GPU it ran inside vLLM 0.24.0 itself (docs/GPU.md says where and what it measured).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from vfleet_sm75 import decide, fingerprints, sleep_memory
from vfleet_sm75.verified import CUMEM, HOOKS, PROFILING, SNAPSHOT, VERIFIED

from tests.conftest import pinned_vllm_source
from tests.support.plugin_facts import facts

FEATURE = "sleep-memory"
GIB = 1 << 30


def test_the_recorded_fingerprints_are_the_pinned_source() -> None:
    prints = VERIFIED[FEATURE]["0.24.0"]
    assert set(prints) == set(HOOKS[FEATURE])
    assert fingerprints.fingerprints(list(prints), pinned_vllm_source("0.24.0")) == prints


def test_the_premise_0_24_0_takes_torch_memory_from_memory_reserved() -> None:
    """What the hook corrects: non-torch memory is the device's used memory minus torch's
    memory_reserved(), and the weights' pool is emptied behind torch by unmap_and_release."""
    root = pinned_vllm_source("0.24.0")
    measure = fingerprints.names(f"{SNAPSHOT}.measure", root)
    assert {"memory_reserved", "non_torch_memory"} <= measure
    pool = fingerprints.names(f"{CUMEM}.use_memory_pool", root)
    assert {"snapshot", "unmap_and_release", "allocator_and_pools"} <= pool
    assert "pop" in fingerprints.names(f"{CUMEM}._python_free_callback", root)
    assert "total_consumed" not in fingerprints.names(PROFILING, root)


@pytest.mark.parametrize("version", ["0.27.1", "0.32.0"])
def test_later_versions_profile_from_the_drivers_free_memory(version: str) -> None:
    """0.27.1 and 0.32.0 take the total from mem_get_info (total_consumed): the decision's
    profile_by_driver fact is read from there."""
    assert "total_consumed" in fingerprints.names(PROFILING, pinned_vllm_source(version))


def _decision(f: decide.Facts) -> decide.Decision:
    return {d.feature: d for d in decide.decide(f)}[FEATURE]


def test_on_for_0_24_0_on_cuda_and_says_why() -> None:
    d = _decision(facts("0.24.0", platform="cuda"))
    assert d.active and "vllm-project/vllm#40256" in d.reason
    assert "nothing changes without sleep mode" in d.reason


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"platform": "cpu"}, "not a CUDA device (vLLM platform: cpu)"),
        ({"vllm_version": "0.21.0"}, "vLLM 0.21.0 is not a verified version (verified: 0.24.0)"),
        ({"profile_by_driver": True}, "from the driver's free memory (total_consumed)"),
        ({"setting": "off", "requested": frozenset()}, "not asked for (VFLEET_SM75=off)"),
    ],
)
def test_off_with_its_reason(kw: dict[str, Any], reason: str) -> None:
    d = _decision(facts("0.24.0", **{"platform": "cuda", **kw}))
    assert not d.active and reason in d.reason, d.reason


def test_a_changed_hooked_function_turns_it_off_naming_it() -> None:
    hooks = dict(facts("0.24.0").hooks)
    hooks[f"{CUMEM}.use_memory_pool"] = "0000000000000000"
    d = _decision(facts("0.24.0", platform="cuda", hooks=hooks))
    assert not d.active and "CuMemAllocator.use_memory_pool differs" in d.reason


class _Pool:
    def __init__(self, segments: list[dict[str, int]]) -> None:
        self.segments = segments

    def snapshot(self) -> list[dict[str, int]]:
        return self.segments


class _Snapshot:
    """MemorySnapshot's fields as 0.24.0's measure fills them (stand-in)."""

    reading = (0, 0)  # (device used, memory_reserved)

    def measure(self) -> None:
        self.cuda_memory, self.torch_memory = self.reading
        self.non_torch_memory = self.cuda_memory - self.torch_memory


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> tuple[type[_Snapshot], types.ModuleType]:
    """A mem_utils with the stand-in snapshot, hooked; a cumem module with no allocator yet."""
    mem = types.ModuleType(sleep_memory.MODULE)
    cls = type("MemorySnapshot", (_Snapshot,), {})
    mem.MemorySnapshot = cls  # type: ignore[attr-defined]
    cumem = types.ModuleType(sleep_memory.CUMEM_MODULE)
    cumem.CuMemAllocator = type("CuMemAllocator", (), {"instance": None})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, sleep_memory.MODULE, mem)
    monkeypatch.setitem(sys.modules, sleep_memory.CUMEM_MODULE, cumem)
    monkeypatch.setattr(sleep_memory._Said, "last", 0)
    sleep_memory.install()
    return cls, cumem


def _allocator(held: dict[int, object], pools: dict[str, list[dict[str, int]]]) -> Any:
    return types.SimpleNamespace(
        pointer_to_data=held,
        allocator_and_pools={tag: (_Pool(segs), object()) for tag, segs in pools.items()},
    )


def test_released_segments_leave_torchs_share_and_non_torch_follows(
    stand_ins: tuple[type[_Snapshot], types.ModuleType],
) -> None:
    """Section 13's shape: torch still lists 7 GiB the pool released; the budget then counted
    non-torch memory 7 GiB low. With the hook the snapshot says what the device holds."""
    cls, cumem = stand_ins
    held = {0x1000: object(), 0x2000: object()}
    cumem.CuMemAllocator.instance = _allocator(
        held,
        {
            "weights": [
                # the weights, held, 1 GiB of it free (a fragment no tensor uses)
                {"address": 0x1000, "total_size": 18 * GIB, "allocated_size": 17 * GIB},
                # released after the repack (vLLM releases only wholly free segments)
                {"address": 0x3000, "total_size": 5 * GIB, "allocated_size": 0},
                {"address": 0x4000, "total_size": 2 * GIB, "allocated_size": 0},
            ],
            "kv_cache": [{"address": 0x2000, "total_size": 40 * GIB, "allocated_size": 40 * GIB}],
        },
    )
    cls.reading = (60 * GIB, 65 * GIB)  # vLLM's figure: non-torch -5 GiB
    snap = cls()
    snap.measure()
    assert snap.torch_memory == 57 * GIB  # 65 - 7 released - 1 free inside a kept segment
    assert snap.non_torch_memory == 3 * GIB
    assert cls._vfleet_sleep_memory is True  # type: ignore[attr-defined]


def test_without_sleep_mode_or_a_release_the_snapshot_is_vllms(
    stand_ins: tuple[type[_Snapshot], types.ModuleType],
) -> None:
    cls, cumem = stand_ins
    cls.reading = (10 * GIB, 9 * GIB)
    snap = cls()
    snap.measure()  # no allocator: sleep mode off
    assert (snap.torch_memory, snap.non_torch_memory) == (9 * GIB, 1 * GIB)
    # asleep: unmapped memory stays in pointer_to_data (to be mapped again), not a release
    cumem.CuMemAllocator.instance = _allocator(
        {0x1000: object()},
        {"weights": [{"address": 0x1000, "total_size": 8 * GIB, "allocated_size": 8 * GIB}]},
    )
    snap.measure()
    assert (snap.torch_memory, snap.non_torch_memory) == (9 * GIB, 1 * GIB)


def test_unreadable_pools_leave_vllms_figure(
    stand_ins: tuple[type[_Snapshot], types.ModuleType],
) -> None:
    cls, cumem = stand_ins

    class Broken:
        def snapshot(self) -> list[dict[str, int]]:
            raise RuntimeError("no pool")

    cumem.CuMemAllocator.instance = types.SimpleNamespace(
        pointer_to_data={}, allocator_and_pools={"weights": (Broken(), object())}
    )
    cls.reading = (10 * GIB, 9 * GIB)
    snap = cls()
    snap.measure()
    assert (snap.torch_memory, snap.non_torch_memory) == (9 * GIB, 1 * GIB)


def test_the_hook_is_installed_once(stand_ins: tuple[type[_Snapshot], types.ModuleType]) -> None:
    cls, _ = stand_ins
    first = cls.measure
    sleep_memory.install()
    assert cls.measure is first and first.__wrapped__ is _Snapshot.measure  # type: ignore[attr-defined]
