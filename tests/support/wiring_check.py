"""Greedy chat replies and hand-run MTP drafts of a generated Qwen3Next model, with transformers.

Run with a vLLM virtualenv's python (torch + transformers + safetensors), not vfleet's:

    python tests/support/wiring_check.py MODEL_DIR [NEW_TOKENS]

Prints JSON: for each of bench/gpu_lane.py's greedy prompts (sent as the lane sends them: one
user message through the chat template) the greedy reply, how many of the MTP head's drafts
during the reply match the token after next, and the smallest logit margin (chosen token against
the runner-up) of the replies and of the drafts: the wiring aims at ~16 (_LOGIT_MARGIN).

The MTP head is run the way vLLM's Qwen3NextMTP runs it (read in
vllm/model_executor/models/qwen3_next_mtp.py): position t gets the target's final, normed hidden
state at t and the embedding of token t + 1, concatenated after the two pre-fc norms, through
mtp.fc, the MTP decoder layer and mtp.norm into the shared LM head; its argmax drafts token
t + 2. Only the drafts made during the reply count (from the last prompt position on), as vLLM
drafts only while decoding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PROMPTS = ("Tell me about the quick brown fox.", "Write one sentence about GPUs.", "What is 2 + 2?")


def _mtp_layer(model: Any, mtp: dict[str, Any]) -> Any:
    import torch
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    cfg = model.config
    extra = type(cfg).from_dict(cfg.to_dict())
    extra.layer_types = [*cfg.layer_types, "full_attention"]
    extra._attn_implementation = "sdpa"
    layer = Qwen3NextDecoderLayer(extra, cfg.num_hidden_layers).to(torch.bfloat16).eval()
    state = {k[len("layers.0.") :]: v for k, v in mtp.items() if k.startswith("layers.0.")}
    experts = int(cfg.num_experts or 0)
    if experts:  # saved per expert (the checkpoint names), held as stacked tensors in memory
        gate_up = [
            torch.cat([state.pop(f"mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up")])
            for e in range(experts)
        ]
        down = [state.pop(f"mlp.experts.{e}.down_proj.weight") for e in range(experts)]
        state["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        state["mlp.experts.down_proj"] = torch.stack(down)
    layer.load_state_dict(state)
    return layer


def _margin(logits: Any) -> float:
    """How far the chosen token's logit is ahead of the runner-up's."""
    top = logits.float().topk(2).values
    return round(float(top[0] - top[1]), 2)


def main(root: Path, new_tokens: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    tok = AutoTokenizer.from_pretrained(root)
    model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.bfloat16).eval()
    cfg = model.config
    weights = load_file(str(root / "model.safetensors"))
    mtp = {k[len("mtp.") :]: v for k, v in weights.items() if k.startswith("mtp.")}
    del weights
    layer = _mtp_layer(model, mtp)
    norms = {}
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        norm = Qwen3NextRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps).to(torch.bfloat16)
        norm.weight.data.copy_(mtp[f"{name}.weight"])
        norms[name] = norm
    out: dict[str, Any] = {"replies": [], "mtp": [], "mtp2": []}
    with torch.no_grad():
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = tok(text, return_tensors="pt").input_ids
            gen = model.generate(
                ids,
                max_new_tokens=new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            seq = gen.sequences
            reply = tok.decode(seq[0, ids.shape[1] :], skip_special_tokens=False)
            margin = min(_margin(step[0]) for step in gen.logits)
            out["replies"].append({"prompt": prompt, "reply": reply, "margin": margin})
            hidden = model.model(seq).last_hidden_state  # after the final norm, as vLLM passes it
            start = ids.shape[1] - 1
            # Position 1 drafts seq[t + 2] from the target's hidden state at t and seq[t + 1];
            # position 2 drafts seq[t + 3] from the head's own (normed) output at t and position
            # 1's draft, taken as right (only then does vLLM count position 2 as accepted).
            for position in (1, 2):
                embed = model.model.embed_tokens(seq[:, position:])
                x = torch.cat(
                    [
                        norms["pre_fc_norm_embedding"](embed),
                        norms["pre_fc_norm_hidden"](hidden[:, : embed.shape[1]]),
                    ],
                    dim=-1,
                )
                x = torch.nn.functional.linear(x, mtp["fc.weight"])
                pos = torch.arange(position - 1, position - 1 + x.shape[1]).unsqueeze(0)
                y = layer(x, position_embeddings=model.model.rotary_emb(x, pos), position_ids=pos)
                hidden = norms["norm"](y[0] if isinstance(y, tuple) else y)
                logits = model.lm_head(hidden)[0, :-1]  # drafting seq[t + position + 1]
                got, want = logits[start:].argmax(-1), seq[0, position + 1 :][start:]
                out["mtp" if position == 1 else "mtp2"].append(
                    {
                        "prompt": prompt,
                        "drafts": int(want.numel()),
                        "accepted": int((got == want).sum()),
                        "margin": min(_margin(row) for row in logits[start:]),
                    }
                )
    return out


if __name__ == "__main__":
    import torch

    torch.set_num_threads(2)  # the CI machine's cores
    result = main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 24)
    print(json.dumps(result, indent=1, ensure_ascii=False))
