"""A vLLM worker extension for the model-switch bench: reload the MTP drafter's weights.

vLLM 0.24.0's ``reload_weights`` (``v1/worker/gpu_model_runner.py``) reloads the parameters of
``self.get_model()`` only, the target model. After a level 2 sleep the drafter's own parameters
(``mtp.*``: its layer, ``fc`` and norms) were discarded with the rest of the ``weights`` pool, and
``wake_up(tags=["weights"])`` maps that memory back without its contents, so the drafter drafts
from whatever the memory holds and acceptance falls to 0 while the text stays right (upstream
vllm-project/vllm#52479; the fix proposed in #52487 reloads the drafter in ``reload_weights``).

This does what #52487 does, from outside vLLM: loaded as ``--worker-extension-cls
switch_ext.DrafterReload`` (the module on the engine's PYTHONPATH), it adds one worker method
that ``POST /collective_rpc {"method": "vfleet_reload_drafter"}`` calls after
``reload_weights``: the drafter's checkpoint read with its model loader (the draft load config,
or the target's for MTP) and loaded in place through vLLM's layerwise reload, which keeps the
parameter addresses the CUDA graphs captured. Measured on the H200 (docs/GPU.md, section 8);
not a product feature: the bench's own workaround.
"""

from __future__ import annotations

import time
from typing import Any


class DrafterReload:
    """Mixed into vLLM's GPU worker (``worker_extension_cls``): ``self`` is the worker."""

    model_runner: Any

    def vfleet_reload_drafter(self) -> dict[str, Any]:
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        t0 = time.perf_counter()
        runner = self.model_runner
        drafter = getattr(runner, "drafter", None)
        model = getattr(drafter, "model", None)
        spec = runner.vllm_config.speculative_config
        if model is None or spec is None:
            return {"reloaded": 0, "why": "no drafter model"}
        load_config = spec.draft_load_config or runner.load_config
        draft_config = spec.draft_model_config
        loader = get_model_loader(load_config)
        weights = loader.get_all_weights(draft_config, model)
        initialize_layerwise_reload(model)
        loaded = model.load_weights(weights)
        finalize_layerwise_reload(model, draft_config)
        return {
            "reloaded": len(loaded) if loaded is not None else None,
            "parameters": sum(1 for _ in model.named_parameters()),
            "seconds": round(time.perf_counter() - t0, 3),
            "model": type(model).__name__,
        }
