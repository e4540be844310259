"""Feature draft-prune inside vLLM: hooks on the speculative proposer, and the per-model checks.

Builds on what vLLM already has for greedy drafting: ``SpecDecodeBaseProposer._greedy_sample``
(the one place greedy draft ids come from, also used by ``use_local_argmax_reduction``) is
replaced by a version that asks the pruned head when the proposer has one; ``load_model`` is
wrapped to build that head once the draft model (and its LM head, shared with the target) is
loaded. Anything the head cannot serve exactly (not MTP, a quantised or biased LM head, another
vocabulary, tree drafts) leaves the proposer on vLLM's own path and says why.
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
from typing import Any

from . import draft_vocab, state
from .log import log
from .settings import ENV_TABLE

_TABLE: draft_vocab.DraftVocab | None = None
_TABLE_PATH = ""
_PLAIN_HEAD = "return self.logits_processor(self.lm_head, hidden_states)"


def _returns_plain_head(model: Any) -> bool:
    """The draft model's compute_logits is exactly ``logits_processor(lm_head, hidden)``."""
    try:
        tree = ast.parse(inspect.getsource(type(model).compute_logits).strip())
    except (OSError, TypeError, SyntaxError, AttributeError):
        return False
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef):
        return False
    body = [
        s
        for s in fn.body
        if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))  # docstring
    ]
    return len(body) == 1 and ast.unparse(body[0]) == _PLAIN_HEAD


def why_not(proposer: Any, table: draft_vocab.DraftVocab) -> str | None:
    """None if the pruned head can stand in for this proposer's greedy drafting, else why not."""
    spec = getattr(proposer, "speculative_config", None)
    method = getattr(spec, "method", None)
    if method != "mtp":
        return f"speculative method is {method!r}, not 'mtp'"
    if getattr(proposer, "use_heterogeneous_vocab", False):
        return "use_heterogeneous_vocab maps drafts itself"
    model = getattr(proposer, "model", None)
    lm_head, lp = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
    if lm_head is None or lp is None or not _returns_plain_head(model):
        name = type(model).__name__
        return f"draft model {name} does not compute logits as logits_processor(lm_head, h)"
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if not isinstance(getattr(lm_head, "quant_method", None), UnquantizedEmbeddingMethod):
        return "the LM head is quantised"
    if getattr(lm_head, "bias", None) is not None:
        return "the LM head has a bias"
    if getattr(lp, "logits_as_input", False):
        return "the logits processor takes logits as input (no LM head to prune)"
    if not float(getattr(lp, "scale", 1.0)) > 0:
        return "the logits processor rescales by a non-positive factor"
    if getattr(lp, "soft_cap", None) is not None and not float(lp.soft_cap) > 0:
        return "the logits processor has a non-positive soft cap"
    vocab = int(getattr(lp, "org_vocab_size", -1))
    if vocab != table.vocab_size:
        return (
            f"{_TABLE_PATH} is for a vocabulary of {table.vocab_size}, the model has {vocab}: "
            f"point {ENV_TABLE} at a table built with this model's tokenizer"
        )
    tp = int(getattr(lm_head, "tp_size", 1))
    if len(table.token_ids) < tp:
        return f"K={len(table.token_ids)} is below the tensor-parallel size {tp}"
    return None


def tp_rank(lm_head: Any) -> int:
    """This process's rank in the LM head's TP group. 0.27.1+ keep it on the layer; 0.24.0's
    VocabParallelEmbedding keeps only tp_size, so ask vLLM's parallel state there."""
    rank = getattr(lm_head, "tp_rank", None)
    if rank is None:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    return int(rank)


def _record(proposer: Any, active: bool, reason: str) -> None:
    """The model's result into VFLEET_SM75_STATE (TP rank 0 writes it), if set."""
    path = os.environ.get(state.ENV_STATE)
    lm_head = getattr(getattr(proposer, "model", None), "lm_head", None)
    if not path:
        return
    try:
        rank = tp_rank(lm_head) if lm_head is not None else 0
    except Exception:  # no TP group (a model that never loaded): one process, it writes
        rank = 0
    if rank != 0:
        return
    try:
        state.record_model(path, state.Feature("draft-prune", active, reason))
    except Exception as exc:
        log(logging.WARNING, f"vfleet-sm75: cannot write {state.ENV_STATE}={path}: {exc!r}")


def _off(reason: str, proposer: Any = None) -> None:
    log(logging.WARNING, f"vfleet-sm75: draft-prune off for this model (full draft head): {reason}")
    _record(proposer, False, f"off for this model (full draft head): {reason}")


def attach(proposer: Any) -> None:
    """After load_model: give the proposer a pruned head, or log why it keeps the full one."""
    table = _TABLE
    proposer._vfleet_pruned_head = None
    if table is None:
        return
    reason = why_not(proposer, table)
    if reason is not None:
        _off(reason, proposer)
        return
    import torch

    from . import head

    lm_head, lp = proposer.model.lm_head, proposer.model.logits_processor
    tp, rank = int(lm_head.tp_size), tp_rank(lm_head)
    all_reduce = all_gather = None
    if tp > 1:
        from vllm.distributed import get_tp_group, tensor_model_parallel_all_gather

        group = get_tp_group().device_group

        def all_reduce(t: torch.Tensor) -> None:
            torch.distributed.all_reduce(t, group=group)

        def all_gather(t: torch.Tensor) -> torch.Tensor:
            return tensor_model_parallel_all_gather(t, dim=-1)

    def agreed(ok: bool) -> bool:
        """Every TP rank takes the same path: the draft step's collectives must match."""
        if tp == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=lm_head.weight.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())

    shard = lm_head.shard_indices
    head_dtype = getattr(lp, "head_dtype", None) or lm_head.weight.dtype
    n_share = len(range(rank, len(table.token_ids), tp))
    error: BaseException | None = None
    try:  # allocate first, so that no rank fails between the build's collectives
        out = torch.empty(
            n_share, lm_head.weight.shape[1], dtype=head_dtype, device=lm_head.weight.device
        )
    except Exception as exc:
        error = exc
    if not agreed(error is None):
        _off(
            f"could not allocate the pruned head: {error!r}" if error else "another rank failed",
            proposer,
        )
        return
    try:
        with torch.no_grad():
            weight, ids = head.build_share(
                lm_head.weight.data,
                int(shard.org_vocab_start_index),
                int(shard.org_vocab_end_index),
                table.token_ids,
                rank,
                tp,
                all_reduce,
                out=out,
            )
    except Exception as exc:
        error = exc
    if not agreed(error is None):
        _off(
            f"building the pruned head failed: {error!r}" if error else "another rank failed",
            proposer,
        )
        return
    proposer._vfleet_pruned_head = head.PrunedHead(weight, ids, tp, all_gather)
    k = len(table.token_ids)
    contiguous = draft_vocab.contiguous_counts(table.token_ids, table.vocab_size, tp)
    mib = weight.numel() * weight.element_size() / 2**20
    on = (
        f"drafts from K={k} of {table.vocab_size} tokens; TP rank "
        f"{rank} of {tp} holds {weight.shape[0]} rows ({mib:.1f} MiB; vLLM's contiguous split "
        f"would give ranks {'/'.join(map(str, contiguous))})"
    )
    log(logging.INFO, f"vfleet-sm75: draft-prune on: {on}")
    _record(proposer, True, on)


def install(table: draft_vocab.DraftVocab, path: str) -> None:
    """Hook SpecDecodeBaseProposer (fingerprints checked by the caller)."""
    global _TABLE, _TABLE_PATH
    _TABLE, _TABLE_PATH = table, path
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer as P

    if getattr(P, "_vfleet_sm75_hooked", False):
        return
    original_greedy = P._greedy_sample
    original_load = P.load_model

    def _greedy_sample(self: Any, hidden_states: Any) -> Any:
        pruned = getattr(self, "_vfleet_pruned_head", None)
        if pruned is not None:
            return pruned.top_tokens(hidden_states)
        return original_greedy(self, hidden_states)

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original_load(self, *args, **kwargs)
        try:
            attach(self)
        except Exception as exc:  # never break serving: fall back to the full head
            self._vfleet_pruned_head = None
            _off(repr(exc), self)
        return result

    P._greedy_sample = _greedy_sample
    P.load_model = load_model
    P._vfleet_sm75_hooked = True
