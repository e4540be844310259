"""Feature sleep-memory: with sleep mode on, vLLM 0.24.0's KV budget counts the weights right.

Sleep mode allocates the weights through CuMemAllocator's memory pool (a pluggable allocator).
When the weights' load context ends, ``CuMemAllocator.use_memory_pool`` releases every segment
of that pool that is free by then (the buffers a quantized checkpoint's repack freed: AWQ to
Marlin, say) with ``unmap_and_release``, behind PyTorch's back: PyTorch still counts those
segments in ``memory_reserved()``. vLLM 0.24.0 takes "non-torch" memory as the device's used
memory minus ``memory_reserved()``, so that figure falls by the released bytes, the profile's
``non_kv_cache_memory`` with it, and the KV cache gets the released bytes on top of its share.
Measured on an H200 (docs/GPU.md section 13): two 27B AWQ engines at 0.45 of the card each held
69.5-70.05 GiB against a 62.91 GiB share, and the second one's start ran out of memory. The
upstream report is vllm-project/vllm#40256 (and #37096); vLLM 0.27.1 measures the profile with
the driver's free memory instead (``total_consumed`` in ``utils/mem_utils.py``), so the feature
is for 0.24.0 only.

The hook corrects the measurement where it is taken: ``MemorySnapshot.measure`` subtracts from
``torch_memory`` the segments PyTorch still lists in the allocator's pools whose allocation the
allocator no longer holds (released behind its back), and ``non_torch_memory`` follows. The free
bytes inside the segments it still holds go the same way: they are on the card, no tensor of the
weights counts them, and no later allocation can use them (the pool is not entered again while
the engine serves), so they belong with what the KV cache cannot have. Without sleep mode there
is no allocator, nothing to subtract, and the snapshot is vLLM's own. Memory a sleeping engine
unmapped stays in the allocator's table (to be mapped again at the wake), so a sleep is not
counted as a release.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import lazy
from .log import log

FEATURE = "sleep-memory"
MODULE = "vllm.utils.mem_utils"
CUMEM_MODULE = "vllm.device_allocator.cumem"
GIB = 1 << 30


def stranded_bytes(
    segments: Iterable[Mapping[str, Any]], held: Mapping[int, Any]
) -> tuple[int, int]:
    """Of a pool's segments (PyTorch's snapshot): the bytes of those whose allocation the
    allocator released (not held any more), and the free bytes inside those it holds."""
    released = free = 0
    for seg in segments:
        total = int(seg.get("total_size", 0))
        if seg.get("address") not in held:
            released += total
        else:
            free += max(0, total - int(seg.get("allocated_size", 0)))
    return released, free


def stranded_in_pools() -> tuple[int, int]:
    """Released behind PyTorch, and free inside kept segments, over every pool ((0, 0): no
    allocator, sleep mode off)."""
    import sys

    cumem = sys.modules.get(CUMEM_MODULE)
    allocator = getattr(getattr(cumem, "CuMemAllocator", None), "instance", None)
    if allocator is None:
        return 0, 0
    held = allocator.pointer_to_data
    released = free = 0
    for pool_and_allocator in list(allocator.allocator_and_pools.values()):
        r, f = stranded_bytes(pool_and_allocator[0].snapshot(), held)
        released, free = released + r, free + f
    return released, free


class _Said:
    """The last correction logged, so that a repeated measurement does not repeat the line."""

    last = 0


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``MemorySnapshot.measure`` with the released segments taken out of torch's share."""

    def measure(self: Any) -> None:
        original(self)
        try:
            released, free = stranded_in_pools()
        except Exception as exc:  # vLLM's own figure stands; said once
            if _Said.last != -1:
                log(logging.WARNING, f"vfleet-sm75: sleep-memory: pools unreadable: {exc!r}")
                _Said.last = -1
            return
        if released + free <= 0:
            return
        self.torch_memory -= released + free
        self.non_torch_memory = self.cuda_memory - self.torch_memory
        if released + free != _Said.last:
            _Said.last = released + free
            log(
                logging.INFO,
                f"vfleet-sm75: sleep-memory: {released / GIB:.2f} GiB of sleep mode's pools "
                f"released behind PyTorch and {free / GIB:.2f} GiB free inside the segments "
                "it keeps (both in memory_reserved): counted outside torch's share, so the KV "
                "budget leaves them out",
            )

    measure.__wrapped__ = original  # type: ignore[attr-defined]
    return measure


def install() -> None:
    """Patch the snapshot now, or when the process imports it (fingerprints checked before)."""
    lazy.wrap_method(MODULE, "MemorySnapshot", "measure", wrap, "_vfleet_sleep_memory")
