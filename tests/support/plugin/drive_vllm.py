"""Run a real vLLM (offline, in one process) over chat prompts and record what the tests compare.

Run with a vLLM virtualenv's python: ``python drive_vllm.py MODEL_DIR OUT.json PROMPTS.json``.
Records the generated token ids and text (greedy; with DRIVE_SAMPLED also the texts of the
same prompts sampled at temperature 0.01, top_p 0.95, top_k 20), every draft token id the
proposer returned (the proposer's public ``propose`` is wrapped here, independently of the
plugin), the spec-decode counters from vLLM's own metrics. The caller keeps the process output
(the plugin's log).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine and worker in-process


def main() -> None:
    model, out_path, prompts_path = sys.argv[1:4]
    max_tokens = int(os.environ.get("DRIVE_MAX_TOKENS", "48"))
    prompts = json.loads(Path(prompts_path).read_text(encoding="utf-8"))

    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    drafts: list[list[int]] = []
    original = SpecDecodeBaseProposer.propose

    def propose(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        drafts.extend(result.tolist())
        return result

    SpecDecodeBaseProposer.propose = propose  # type: ignore[method-assign]
    llm = LLM(
        model=model,
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=4,
        max_num_batched_tokens=1024,
        enable_prefix_caching=False,  # the CPU build has no Mamba 'align' kernel for MTP
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config={"method": "mtp", "num_speculative_tokens": 3},
    )
    messages = [[{"role": "user", "content": p}] for p in prompts]
    outputs = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )
    sampled: list[str] | None = None
    if os.environ.get("DRIVE_SAMPLED"):
        # Sampled as users send it, at a temperature so low that the reply must be the greedy
        # one: every draft position takes its request's temperature, top_p and top_k through
        # the rejection sampler's expand (cpu-expand's subject).
        params = SamplingParams(temperature=0.01, top_p=0.95, top_k=20, max_tokens=max_tokens)
        sampled = [o.outputs[0].text for o in llm.chat(messages, params, use_tqdm=False)]
    counters: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name] = counters.get(metric.name, 0) + float(metric.value)
    result = {
        "texts": [o.outputs[0].text for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "drafts": drafts,
        "sampled_texts": sampled,
        "spec_decode": counters,
        "proposer_greedy": getattr(SpecDecodeBaseProposer._greedy_sample, "__module__", ""),
    }
    Path(out_path).write_text(json.dumps(result), encoding="utf-8")


if __name__ == "__main__":
    main()
