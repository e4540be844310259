"""``vfleet-sm75``: the plugin's decision table without starting vLLM; the vocabulary builder."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import __version__, decide, draft_vocab, settings, state
from .verified import HOOKS, VERIFIED

EPILOG = f"""\
environment:
  {settings.ENV}=off|auto|<features>
      off (default): as if not installed; auto: every feature whose conditions hold;
      or a comma list of: {", ".join(settings.FEATURES)}
  {settings.ENV_TABLE}=FILE
      the draft vocabulary table (vfleet-sm75 vocab build)
  {settings.ENV_TOP_K}=K
      use only the K most frequent ids of the table (default: all)
  {state.ENV_STATE}=FILE
      vLLM writes the plugin's decision there (JSON; vfleet's sidecar and doctor read it)

examples:
  VFLEET_SM75=auto VFLEET_SM75_DRAFT_VOCAB=vocab.json vfleet-sm75 doctor
  vfleet-sm75 vocab build --tokenizer /models/Qwen3.8-27B --corpus zh.txt en.txt --top 65536 \\
      --eval answers-zh.txt --out qwen3.8-27b.draft-vocab.json
  vfleet-sm75 vocab build --tokenizer /models/Qwen3.8-27B --out vocab.json --if-changed
      (the plugin's default corpus; nothing done if vocab.json was built from the same inputs)
  vfleet-sm75 vocab show qwen3.8-27b.draft-vocab.json --tp 2
"""


def _model_check(model_dir: Path, table: draft_vocab.DraftVocab | None) -> list[str]:
    """Problems between a model directory and the table (the checks vLLM would make at load)."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{model_dir}/config.json: cannot read ({exc})"]
    text = config.get("text_config") or config
    problems = []
    mtp = text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0
    if not mtp:
        problems.append(f"{model_dir}: no MTP layers in config.json (draft-prune serves MTP only)")
    vocab = text.get("vocab_size")
    if table is not None and vocab != table.vocab_size:
        problems.append(
            f"{model_dir}: vocab_size {vocab}, but the table is for {table.vocab_size} "
            "(build the table with this model's tokenizer)"
        )
    tokenizer = model_dir / "tokenizer.json"
    built_with = table.tokenizer_sha256 if table is not None else ""
    if built_with and tokenizer.is_file() and draft_vocab.file_sha256(tokenizer) != built_with:
        problems.append(
            f"{tokenizer}: not the tokenizer the table was built with (sha256 differs): "
            "the ids may mean other tokens; rebuild the table with this model's tokenizer"
        )
    return problems


def _doctor(args: argparse.Namespace) -> int:
    facts = decide.facts()
    decisions = decide.decide(facts)
    problems = _model_check(Path(args.model), facts.table) if args.model else []
    hooks: dict[str, Any] = {
        target: {
            "feature": feature,
            "use": use,
            "fingerprint": facts.hooks.get(target),
            "verified": {v: p[target] for v, p in VERIFIED[feature].items() if target in p},
        }
        for feature, targets in HOOKS.items()
        for target, use in targets.items()
    }
    bad_input = facts.setting_error or facts.table_error
    if args.json:
        doc = {
            "plugin": __version__,
            "vllm": facts.vllm_version,
            "setting": facts.setting,
            "platform": facts.platform,
            "capability": list(facts.capability) if facts.capability else None,
            "flashinfer": asdict(facts.flashinfer),
            "features": [asdict(d) for d in decisions],
            "model_problems": problems,
            "hooks": hooks,
            "summary": decide.summary(decisions, facts.vllm_version),
        }
        print(json.dumps(doc, indent=2))
    else:
        cap = ".".join(map(str, facts.capability)) if facts.capability else "-"
        print(
            f"vfleet-sm75 {__version__}  vLLM {facts.vllm_version or '-'}  platform "
            f"{facts.platform} (compute capability {cap})  "
            f"{settings.ENV}={facts.setting or 'unset'}"
        )
        width = max(len(f) for f in settings.FEATURES)
        for d in decisions:
            print(f"  {d.feature:<{width}}  {'on ' if d.active else 'off'}  {d.reason}")
        for p in problems:
            print(f"  model: {p}")
        if args.verbose:
            for target, h in hooks.items():
                ok = h["fingerprint"] in h["verified"].values()
                print(f"  hook {target}: {h['fingerprint']} ({'verified' if ok else 'unverified'})")
    if bad_input:
        print(f"vfleet-sm75: error: {bad_input}", file=sys.stderr)
        return 2
    return 1 if problems else 0


def _build(args: argparse.Namespace) -> int:
    tokenizer = Path(args.tokenizer)
    files = [Path(p) for p in args.corpus] if args.corpus else [draft_vocab.DEFAULT_CORPUS]
    evaluate = [Path(p) for p in args.eval or []]
    for p in [*files, *evaluate]:
        if not p.is_file():
            print(f"vfleet-sm75: error: {p}: no such file", file=sys.stderr)
            return 2
    if args.if_changed:
        try:
            same = draft_vocab.built_from(Path(args.out), tokenizer, files, args.top)
        except draft_vocab.TableError as exc:
            print(f"vfleet-sm75: error: {exc}", file=sys.stderr)
            return 2
        if same:
            print(f"{args.out}: unchanged (same tokenizer, corpus and K)")
            return 0
    print(f"counting tokens in {len(files)} corpus file(s) with {tokenizer}...", file=sys.stderr)
    try:
        table = draft_vocab.build(tokenizer, files, args.top, evaluate)
    except draft_vocab.TableError as exc:
        print(f"vfleet-sm75: error: {exc}", file=sys.stderr)
        return 2
    draft_vocab.save(table, args.out)
    _report(table, Path(args.out), args.tp)
    low = [
        e
        for e in (*table.source["corpus"], *table.source["evaluation"])
        if e["coverage"] < args.min_coverage
    ]
    for e in low:
        print(
            f"warning: {e['file']}: coverage {e['coverage']:.1%} < {args.min_coverage:.0%}: drafts "
            "for such text will often miss; add text of that kind (language, task) to the corpus",
            file=sys.stderr,
        )
    return 0


def _report(table: draft_vocab.DraftVocab, path: Path, tp: int) -> None:
    k, v = len(table.token_ids), table.vocab_size
    src = table.source
    print(f"{path}: K={k} of {v} tokens (LM head rows {v / k:.2f}x fewer)")
    for kind in ("corpus", "evaluation"):
        for e in src.get(kind, []):
            print(f"  {kind:<10} {e['file']}: {e['tokens']} tokens, coverage {e['coverage']:.1%}")
    if "coverage_all" in src:
        print(f"  whole corpus coverage {src['coverage_all']:.1%}")
    if tp > 1:
        rr = [len(s) for s in draft_vocab.round_robin(table.token_ids, tp)]
        cont = draft_vocab.contiguous_counts(table.token_ids, v, tp)
        print(
            f"  TP={tp}: rows per rank round-robin {'/'.join(map(str, rr))}, "
            f"contiguous split {'/'.join(map(str, cont))}"
        )


def _show(args: argparse.Namespace) -> int:
    try:
        table = draft_vocab.load(args.table)
    except draft_vocab.TableError as exc:
        print(f"vfleet-sm75: error: {exc}", file=sys.stderr)
        return 2
    _report(table, Path(args.table), args.tp)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vfleet-sm75",
        description="The vfleet SM75 vLLM plugin: what it would do here, and its draft vocabulary.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"vfleet-sm75 {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser(
        "doctor",
        help="the decision table vLLM would log, without starting vLLM",
        description="Which features would turn on in this environment and why each other one "
        "would not; exit 0, 1 if --model does not fit, 2 on bad settings.",
    )
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.add_argument(
        "--model", metavar="DIR", help="also check this model directory against the table"
    )
    d.add_argument("-v", "--verbose", action="store_true", help="also list hooked vLLM functions")
    d.set_defaults(func=_doctor)
    voc = sub.add_parser("vocab", help="draft vocabulary tables").add_subparsers(
        dest="vocab_command", required=True, metavar="ACTION"
    )
    b = voc.add_parser(
        "build",
        help="count token frequencies over a corpus and keep the K most frequent",
        description="Build a draft vocabulary table with the model's tokenizer. Mix the languages "
        "and tasks the model answers in: an English-only table covered 80.7% of Chinese answers "
        "and erased the speed-up; a mixed one covered 98.7% (seed 000).",
    )
    b.add_argument(
        "--tokenizer", required=True, metavar="DIR", help="model dir with tokenizer.json"
    )
    b.add_argument(
        "--corpus",
        nargs="+",
        metavar="FILE",
        help="UTF-8 text files (default: the plugin's own small mixed corpus, "
        f"{draft_vocab.DEFAULT_CORPUS.name}: English, Chinese and code, written for the project)",
    )
    b.add_argument("--top", type=int, default=65536, metavar="K", help="table size (default 65536)")
    b.add_argument("--eval", nargs="*", metavar="FILE", help="held-out files to report coverage on")
    b.add_argument("--out", required=True, metavar="FILE", help="where to write the table (JSON)")
    b.add_argument(
        "--if-changed",
        action="store_true",
        help="do nothing (and say 'unchanged') if --out was built from this tokenizer, these "
        "corpus files and this K (their SHA-256s, as the table records them)",
    )
    b.add_argument("--tp", type=int, default=2, help="show the split for this TP size (default 2)")
    b.add_argument(
        "--min-coverage", type=float, default=0.95, help="warn below this coverage (default 0.95)"
    )
    b.set_defaults(func=_build)
    s = voc.add_parser("show", help="summarise a table: K, coverage, split across TP ranks")
    s.add_argument("table", metavar="FILE")
    s.add_argument("--tp", type=int, default=2, help="TP size for the split (default 2)")
    s.set_defaults(func=_show)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except settings.SettingError as exc:
        print(f"vfleet-sm75: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
