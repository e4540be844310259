"""The draft vocabulary: a frequency table of token ids, its file format, split and coverage.

Pure Python (no torch): the table is built on any machine and checked by the doctor.

File (JSON): ``{"format", "vocab_size", "tokenizer_sha256", "token_ids": [most frequent
first], "source": {...build facts and coverage...}}``. Only ``token_ids[:K]`` are used.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "vfleet-sm75.draft-vocab/1"
# `vocab build` without --corpus: a small mixed corpus shipped in the package (data/README.md).
DEFAULT_CORPUS = Path(__file__).parent / "data" / "draft-corpus.txt"
# vLLM pads the LM head's rows to a multiple of 64 before splitting them across TP ranks
# (vllm/model_executor/layers/vocab_parallel_embedding.py, DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64


class TableError(ValueError):
    """A table file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class DraftVocab:
    token_ids: tuple[int, ...]  # most frequent first
    vocab_size: int
    tokenizer_sha256: str
    source: dict[str, Any] = field(default_factory=dict)

    def top(self, k: int | None) -> DraftVocab:
        if k is None or k >= len(self.token_ids):
            return self
        return DraftVocab(self.token_ids[:k], self.vocab_size, self.tokenizer_sha256, self.source)


def load(path: str | os.PathLike[str], k: int | None = None) -> DraftVocab:
    """Read and check a table; ``k`` keeps the K most frequent ids (error if it holds fewer)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TableError(f"{p}: cannot read the draft vocabulary: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise TableError(
            f"{p}: not JSON ({exc}); build one with `vfleet-sm75 vocab build`"
        ) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TableError(f"{p}: not a draft vocabulary (format must be {FORMAT!r})")
    ids, size = data.get("token_ids"), data.get("vocab_size")
    if not isinstance(size, int) or size < 2:
        raise TableError(f"{p}: vocab_size must be an integer >= 2, got {size!r}")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise TableError(f"{p}: token_ids must be a non-empty list of integers")
    bad = [i for i in ids if not 0 <= i < size]
    if bad:
        raise TableError(f"{p}: token id {bad[0]} is outside the vocabulary [0, {size})")
    if len(set(ids)) != len(ids):
        raise TableError(f"{p}: token_ids has duplicates")
    if k is not None and k > len(ids):
        raise TableError(f"{p}: K={k} asked for, but the table holds only {len(ids)} ids")
    table = DraftVocab(
        tuple(ids), size, str(data.get("tokenizer_sha256", "")), data.get("source") or {}
    )
    return table.top(k)


def save(table: DraftVocab, path: str | os.PathLike[str]) -> None:
    """Write atomically (temp file + rename): a failed write leaves the old table in place."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FORMAT,
        "vocab_size": table.vocab_size,
        "tokenizer_sha256": table.tokenizer_sha256,
        "top_k": len(table.token_ids),
        "source": table.source,
        "token_ids": list(table.token_ids),
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1, ensure_ascii=False)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------------
# tensor-parallel split


def round_robin(token_ids: Sequence[int], tp: int) -> list[list[int]]:
    """Rank r drafts from the ids at frequency ranks r, r+tp, r+2tp, ...: equal row counts."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    return [list(token_ids[r::tp]) for r in range(tp)]


def contiguous_counts(token_ids: Iterable[int], vocab_size: int, tp: int) -> list[int]:
    """How many of the ids each rank would hold under vLLM's contiguous vocab split."""
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    per_rank = padded // tp
    counts = [0] * tp
    for i in token_ids:
        counts[min(i // per_rank, tp - 1)] += 1
    return counts


# ------------------------------------------------------------------------------------------
# building from a corpus


def file_sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _tokenizer(tokenizer_dir: Path) -> Any:
    from tokenizers import Tokenizer  # present wherever vLLM or transformers is

    path = tokenizer_dir / "tokenizer.json"
    if not path.is_file():
        raise TableError(f"{path}: missing (give --tokenizer the model directory)")
    return Tokenizer.from_file(str(path))


def _model_vocab(model_dir: Path) -> int | None:
    """The LM head's row count from config.json (Qwen pads it past the tokenizer's size)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    size = (config.get("text_config") or config).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else None


def _eos_ids(tokenizer_dir: Path) -> list[int]:
    """EOS ids from generation_config.json: always in the table, so drafts can end a reply."""
    try:
        data = json.loads((tokenizer_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    eos = data.get("eos_token_id")
    items = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in items if isinstance(i, int)]


def count_tokens(tokenizer: Any, path: Path, batch_lines: int = 2048) -> Counter[int]:
    counts: Counter[int] = Counter()
    with path.open(encoding="utf-8") as fh:
        batch: list[str] = []
        for line in fh:
            batch.append(line)
            if len(batch) >= batch_lines:
                for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
                    counts.update(enc.ids)
                batch = []
        if batch:
            for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
                counts.update(enc.ids)
    return counts


def coverage(counts: Counter[int], ids: set[int]) -> float:
    total = sum(counts.values())
    return sum(c for i, c in counts.items() if i in ids) / total if total else 0.0


def build(
    tokenizer_dir: Path,
    corpus: Sequence[Path],
    k: int,
    evaluate: Sequence[Path] = (),
) -> DraftVocab:
    """Count tokens over ``corpus``, keep the K most frequent (ties: lower id first).

    ``vocab_size`` is the model's (config.json: the LM head's rows, which Qwen pads past the
    tokenizer's size), so the table matches what vLLM loads; the tokenizer's size without one.

    EOS ids come first. If the corpus shows fewer than K distinct tokens, the rest is filled
    with unseen ids in id order (a BPE vocabulary's low ids are its bytes and commonest merges).
    ``source`` records the inputs and the coverage of every corpus and evaluation file.
    """
    tok = _tokenizer(tokenizer_dir)
    tokens = int(tok.get_vocab_size(with_added_tokens=True))
    vocab_size = _model_vocab(tokenizer_dir) or tokens
    if tokens > vocab_size:
        raise TableError(
            f"{tokenizer_dir}: the tokenizer has {tokens} tokens, more than the model's "
            f"vocab_size {vocab_size} (config.json): is this the model's own tokenizer?"
        )
    if not 1 <= k < vocab_size:
        raise TableError(
            f"--top {k}: must be between 1 and the vocabulary size - 1 ({vocab_size - 1})"
        )
    per_file = {p: count_tokens(tok, p) for p in corpus}
    total: Counter[int] = Counter()
    for c in per_file.values():
        total.update(c)
    ranked = [i for i in _eos_ids(tokenizer_dir) if i < vocab_size]
    seen = set(ranked)
    for i, _ in sorted(total.items(), key=lambda kv: (-kv[1], kv[0])):
        if i not in seen:
            ranked.append(i)
            seen.add(i)
    distinct = len(ranked)
    fill = (i for i in range(tokens) if i not in seen)  # ids past the tokenizer are padding
    while len(ranked) < k:
        ranked.append(next(fill))
    ids = ranked[:k]
    chosen = set(ids)
    report = {
        "tokenizer": tokenizer_dir.name,  # the model folder's name, not a local path
        "tokenizer_tokens": tokens,
        "top_k": k,
        "distinct_tokens_seen": distinct,
        "corpus": [
            {
                "file": p.name,
                "sha256": file_sha256(p),
                "tokens": sum(c.values()),
                "coverage": round(coverage(c, chosen), 4),
            }
            for p, c in per_file.items()
        ],
        "evaluation": [
            {"file": p.name, "tokens": sum(c.values()), "coverage": round(coverage(c, chosen), 4)}
            for p, c in ((p, count_tokens(tok, p)) for p in evaluate)
        ],
        "coverage_all": round(coverage(total, chosen), 4),
    }
    sha = file_sha256(tokenizer_dir / "tokenizer.json")
    return DraftVocab(tuple(ids), vocab_size, sha, report)


def built_from(out: Path, tokenizer_dir: Path, corpus: Sequence[Path], k: int) -> bool:
    """``out`` is a table built from this tokenizer, these corpus files and this K (by SHA-256):
    a deploy need not build it again. False if it is missing; TableError if it is unreadable."""
    if not out.exists():
        return False
    table = load(out)
    recorded = [e.get("sha256") for e in table.source.get("corpus", [])]
    tokenizer = tokenizer_dir / "tokenizer.json"
    return (
        tokenizer.is_file()
        and table.tokenizer_sha256 == file_sha256(tokenizer)
        and len(table.token_ids) == k
        and recorded == [file_sha256(p) for p in corpus]
    )
