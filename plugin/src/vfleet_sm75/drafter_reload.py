"""Feature drafter-reload inside vLLM: ``reload_weights`` reloads the speculative drafter too.

vLLM 0.24.0 and 0.27.1's ``GPUModelRunner.reload_weights`` reload ``self.get_model()`` only, the
target. After a level 2 sleep the drafter's parameters (MTP's ``mtp.*``) were dropped with the
rest of the ``weights`` pool and the wake maps that memory back without its contents, so the
drafter drafts garbage: the text stays right (the target verifies), MTP acceptance falls to 0
(vllm-project/vllm#52479; the fix proposed upstream is #52487). The wrapper below does, after the
target's reload from disk, what that fix and bench/switch_ext.py do: the draft checkpoint read
with its model loader (the draft load config, else the target's, as MTP has none of its own) and
loaded in place between ``initialize_layerwise_reload`` and ``finalize_layerwise_reload``, which
keep the parameter addresses the CUDA graphs captured. Each call logs what it reloaded and how
long it took, and TP rank 0 records it in VFLEET_SM75_STATE (what `vfleet switch` reports).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from . import lazy, state
from .log import log

FEATURE = "drafter-reload"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


@dataclass(frozen=True)
class Outcome:
    reloaded: bool
    message: str


def draft_model(runner: Any) -> Any:
    """The drafter's own module (``runner.drafter.model``, unwrapped from a CUDA graph
    wrapper as 0.27.1's ``get_draft_model`` does), or None: ngram, suffix or no speculation."""
    model = getattr(getattr(runner, "drafter", None), "model", None)
    unwrap = getattr(model, "unwrap", None)
    return unwrap() if callable(unwrap) else model


def skip_reason(weights_iterator: Any, weights_path: Any, is_checkpoint_format: bool) -> str | None:
    """Why a reload_weights call leaves the drafter alone, or None to reload it.

    Only the reload from the configured checkpoint (no arguments: vLLM's level 2 wake) has a
    drafter checkpoint to read; weights the caller streams or names are the caller's, as in
    #52487, which reloads on the ``weights_iterator is None`` path only."""
    if weights_iterator is not None:
        return "weights were passed in (weights_iterator): the caller's, drafter left as it is"
    if weights_path is not None:
        return "weights_path names another checkpoint: the drafter's own is not reloaded"
    if not is_checkpoint_format:
        return "is_checkpoint_format=False: kernel-format weights, drafter left as it is"
    return None


def reload_drafter(runner: Any) -> Outcome:
    """Reload the drafter in place from its checkpoint; what was done, for the log."""
    model = draft_model(runner)
    spec = getattr(getattr(runner, "vllm_config", None), "speculative_config", None)
    if model is None or spec is None:
        method = getattr(spec, "method", None)
        return Outcome(False, f"no drafter model to reload (speculative method: {method})")
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    t0 = time.perf_counter()
    draft_config = spec.draft_model_config
    loader = get_model_loader(spec.draft_load_config or runner.load_config)
    weights = loader.get_all_weights(draft_config, model)
    initialize_layerwise_reload(model)
    loaded = model.load_weights(weights)
    finalize_layerwise_reload(model, draft_config)
    seconds = time.perf_counter() - t0
    total = sum(1 for _ in model.named_parameters())
    count = "?" if loaded is None else str(len(loaded))
    return Outcome(
        True,
        f"reloaded {count} of {total} parameters of the drafter {type(model).__name__} from "
        f"{getattr(draft_config, 'model', '?')} in {seconds:.3f} s (after the target's reload)",
    )


def _tp_rank() -> int:
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no TP group: one process, it writes
        return 0


def _record(active: bool, message: str) -> None:
    path = os.environ.get(state.ENV_STATE)
    if not path or _tp_rank() != 0:
        return
    try:
        state.record_model(path, state.Feature(FEATURE, active, message))
    except Exception as exc:
        log(logging.WARNING, f"vfleet-sm75: cannot write {state.ENV_STATE}={path}: {exc!r}")


def after_reload(runner: Any, why_not: str | None) -> None:
    """What the wrapper does once the target reloaded: never raises into vLLM."""
    if why_not is not None:
        outcome = Outcome(False, f"not reloaded: {why_not}")
    else:
        try:
            outcome = reload_drafter(runner)
        except Exception as exc:  # the target is back; serving goes on with a wrong drafter
            log(logging.WARNING, f"vfleet-sm75: drafter-reload failed: {exc!r}")
            _record(False, f"reload failed: {exc!r}")
            return
    log(logging.INFO, f"vfleet-sm75: drafter-reload: {outcome.message}")
    _record(outcome.reloaded, f"{outcome.message} at {time.strftime('%Y-%m-%dT%H:%M:%S')}")


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GPUModelRunner.reload_weights`` with the drafter reloaded after the target."""

    def reload_weights(
        self: Any,
        weights_iterator: Any = None,
        weights_path: str | None = None,
        is_checkpoint_format: bool = True,
    ) -> Any:
        result = original(self, weights_iterator, weights_path, is_checkpoint_format)
        after_reload(self, skip_reason(weights_iterator, weights_path, is_checkpoint_format))
        return result

    reload_weights.__wrapped__ = original  # type: ignore[attr-defined]
    return reload_weights


FLAG = "_vfleet_drafter_reload"


def patch(module: ModuleType) -> None:
    """Wrap the runner of an imported module (what install() does at the runner's import)."""
    lazy.wrap_method(module.__name__, "GPUModelRunner", "reload_weights", wrap, FLAG)


def install() -> None:
    """Hook the runner when the worker imports it (fingerprints checked by the caller)."""
    lazy.wrap_method(RUNNER_MODULE, "GPUModelRunner", "reload_weights", wrap, FLAG)
