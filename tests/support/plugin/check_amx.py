"""vLLM's own CPU attention op with the AMX kernel, in a fresh process: run by tests/integration/
test_plugin_vllm.py, once without the plugin (Linux kills it with SIGILL where AMX was never asked
for) and once after the plugin's load with VFLEET_SM75=cpu-amx (it runs). Prints one JSON line
before the op: torch's AMX reading, the XTILEDATA permission, the ISA vLLM picks."""

import ctypes
import json
import math
import os
import platform
import sys

import torch

libc = ctypes.CDLL(None, use_errno=True)


def permitted() -> bool:
    if platform.machine() != "x86_64":  # arch_prctl's AMX permission is x86-64's
        return False
    mask = ctypes.c_ulong(0)
    libc.syscall(158, 0x1022, ctypes.byref(mask))  # SYS_arch_prctl, ARCH_GET_XCOMP_PERM
    return bool((mask.value >> 18) & 1)  # XFEATURE_XTILEDATA


before = permitted()
if os.environ.get("VFLEET_SM75"):
    from vfleet_sm75 import plugin

    plugin.register()
from vllm import _custom_ops as ops  # noqa: E402  (after the plugin's load, as vLLM does)
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

heads, head_dim, block, tokens = 2, 128, 32, 64
isa = _get_attn_isa(torch.bfloat16, block, head_dim)
print(
    json.dumps(
        {
            "amx": torch.cpu._is_amx_tile_supported(),
            "before": before,
            "permitted": permitted(),
            "isa": isa,
        }
    ),
    flush=True,
)
if isa != "amx":
    sys.exit(0)
torch.manual_seed(0)
q = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16)
k = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16)
v = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16)
blocks = tokens // block
key_cache = torch.zeros(blocks, heads, block, head_dim, dtype=torch.bfloat16)
value_cache = torch.zeros(blocks, heads, block, head_dim, dtype=torch.bfloat16)
slots = torch.arange(tokens, dtype=torch.int64)
ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
qsl = torch.tensor([0, tokens], dtype=torch.int32)
seq_lens = torch.tensor([tokens], dtype=torch.int32)
meta = ops.cpu_attn_get_scheduler_metadata(
    num_reqs=1,
    num_heads=heads,
    num_kv_heads=heads,
    head_dim=head_dim,
    seq_lens=seq_lens,
    dtype=torch.bfloat16,
    query_start_loc=qsl,
    causal=True,
    sliding_window_size=-1,
    isa=isa,
    enable_kv_split=False,
)
out = torch.empty_like(q)
ops.cpu_attention_with_kv_cache(
    query=q,
    key_cache=key_cache,
    value_cache=value_cache,
    output=out,
    query_start_loc=qsl,
    seq_lens=seq_lens,
    scale=1 / math.sqrt(head_dim),
    causal=True,
    alibi_slopes=None,
    sliding_window=-1,
    block_table=torch.arange(blocks, dtype=torch.int32).view(1, -1),
    softcap=0.0,
    scheduler_metadata=meta,
    s_aux=None,
)
# The first token attends to itself only: its output is its own value row.
print(
    json.dumps(
        {"ran": True, "first_row_ok": bool(torch.allclose(out[0].float(), v[0].float(), atol=2e-2))}
    )
)
