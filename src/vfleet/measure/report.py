"""Benchmark results: the JSON document, its summaries, a markdown report and PNG plots.

The JSON keeps every run, so summaries can be recomputed and two results compared run by run
(``metric_samples``). Summaries use the median over repeats: with 2-3 repeats one slow outlier
(a JIT compile, seed 002's run2) must not move the figure.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vfleet.measure.stats import Comparison, noise, percentile

if TYPE_CHECKING:  # not at run time: comparing results needs no vfleet_healthcheck
    from vfleet.measure.scenarios import Outcome, Settings

SCHEMA = "vfleet-bench"
SCHEMA_VERSION = 1

Doc = dict[str, Any]
Row = dict[str, Any]


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


def document(
    *,
    url: str,
    model: str,
    vllm_version: str | None,
    max_model_len: int | None,
    metrics_table: str | None,
    settings: Settings,
    outcome: Outcome,
    started_at: float,
    finished_at: float,
    token_counting: str,
    deployment: Any = None,
    deployment_source: str | None = None,
    host_facts: Any = None,
) -> Doc:
    runs = [asdict(r) for r in outcome.runs]
    fit = outcome.prefill_fit
    doc: Doc = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "target": {
            "url": url,
            "model": model,
            "vllm_version": vllm_version,
            "max_model_len": max_model_len,
            "metrics_table": metrics_table,
        },
        "started_at": _iso(started_at),
        "finished_at": _iso(finished_at),
        "duration_s": outcome.duration_s,
        "parameters": {**asdict(settings), "token_counting": token_counting},
        "completed": outcome.stopped is None,
        "stopped": outcome.stopped,
        "steps_planned": outcome.steps_planned,
        "requests_planned": outcome.requests_planned,
        "requests_sent": outcome.requests_sent,
        "skipped": outcome.skipped,
        "warnings": outcome.warnings,
        "warmup": outcome.warmup,
        "runs": runs,
        "fits": {"prefill": asdict(fit) if fit is not None else None},
        "deployment": (
            {"source": deployment_source, "release": deployment, "host": host_facts}
            if deployment is not None
            else None
        ),
    }
    doc["summary"] = summarize(runs)
    # As a reader will load it (tuples become lists): equal after a round trip.
    plain: Doc = json.loads(json.dumps(doc))
    return plain


def load_document(path: Path) -> Doc:
    """A result written by `vfleet bench run`. Raises ValueError saying what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read it: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError('not a vfleet bench result (no "schema": "vfleet-bench")')
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"schema_version {data.get('schema_version')!r}; this vfleet reads {SCHEMA_VERSION}"
        )
    if not isinstance(data.get("runs"), list):
        raise ValueError("no runs list")
    return data


# --------------------------------------------------------------------------- summaries


def _ok(runs: Iterable[Row], scenario: str) -> list[Row]:
    return [r for r in runs if r["scenario"] == scenario and not r.get("error")]


def _median(rows: Sequence[Row], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _groups(rows: Iterable[Row], *keys: str) -> dict[tuple[Any, ...], list[Row]]:
    out: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return dict(sorted(out.items()))


FIELDS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "ttft_s",
    "e2e_s",
    "prefill_tps",
    "decode_tps",
    "aggregate_tps",
    "acceptance_rate",
    "mean_acceptance_length",
    "tokens_per_step",
)


def _row(rows: Sequence[Row], **head: Any) -> Row:
    return {**head, "n": len(rows), **{k: _median(rows, k) for k in FIELDS}}


def summarize(runs: Sequence[Row]) -> dict[str, Any]:
    """Medians over repeats per scenario and size; what the table and plots show."""
    mode_order = {"cold": 0, "warm": 1}
    context = [
        _row(rows, context=ctx, mode=mode)
        for (ctx, mode), rows in sorted(
            _groups(_ok(runs, "context"), "context", "mode").items(),
            key=lambda kv: (kv[0][0], mode_order.get(kv[0][1], 2)),
        )
    ]
    decode_rows = _ok(runs, "decode")
    decode = _row(decode_rows) if decode_rows else None
    if decode is not None:
        speeds = [r["decode_tps"] for r in decode_rows if r["decode_tps"] is not None]
        decode["decode_tps_spread"] = noise(speeds)
    prefill = []
    for (ctx,), rows in _groups(_ok(runs, "prefill"), "context").items():
        row = _row(rows, context=ctx)
        ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
        row["ttft_p90_s"] = percentile(ttfts, 90) if ttfts else None
        prefill.append(row)
    concurrency = [
        _row(rows, context=ctx, concurrency=c)
        for (ctx, c), rows in _groups(_ok(runs, "concurrency"), "context", "concurrency").items()
    ]
    return {"context": context, "decode": decode, "prefill": prefill, "concurrency": concurrency}


METRICS = {
    "context": ("ttft_s", "prefill_tps", "decode_tps", "acceptance_rate"),
    "decode": ("decode_tps", "acceptance_rate", "mean_acceptance_length", "tokens_per_step"),
    "prefill": ("ttft_s",),
    "concurrency": ("aggregate_tps", "decode_tps", "ttft_s"),
}


def metric_samples(doc: Doc) -> dict[str, list[float]]:
    """Every comparable figure with its samples (one per repeat), keyed by scenario and size."""
    out: dict[str, list[float]] = {}
    for r in doc["runs"]:
        if r.get("error") or r["scenario"] not in METRICS:
            continue
        where = {
            "context": f"context/{r['context']}/{r['mode']}",
            "decode": "decode",
            "prefill": f"prefill/{r['context']}",
            "concurrency": f"concurrency/{r['context']}x{r['concurrency']}",
        }[r["scenario"]]
        for key in METRICS[r["scenario"]]:
            if r.get(key) is not None:
                out.setdefault(f"{where}/{key}", []).append(float(r[key]))
    # The fitted rate only: the fixed overhead is near 0 on fast servers, where a ratio of two
    # intercepts says nothing.
    fit = (doc.get("fits") or {}).get("prefill")
    if fit and fit.get("rate_tps") is not None:
        out["prefill/fit/rate_tps"] = [float(fit["rate_tps"])]
    return out


# --------------------------------------------------------------------------- markdown


def _f(v: Any, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


def _table(head: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _mtp(r: Row) -> list[str]:
    return [
        _f(r["acceptance_rate"], ".1f", 100),
        _f(r["mean_acceptance_length"], ".2f"),
        _f(r["tokens_per_step"], ".2f"),
    ]


MTP_HEAD = ("MTP accept (%)", "accept len", "tok/step")
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def markdown(doc: Doc) -> str:
    t, p, s = doc["target"], doc["parameters"], doc["summary"]
    how = f"{p['repeats']} repeat(s), {ENDPOINTS.get(p['endpoint'], p['endpoint'])}"
    if p["endpoint"] == "chat":
        how += f", thinking {'on' if p['enable_thinking'] else 'off'}"
    facts = [
        f"vLLM {t['vllm_version'] or 'unknown'}, max_model_len {t['max_model_len'] or 'unknown'}",
        f"{doc['started_at']} .. {doc['finished_at']} ({doc['duration_s']:.0f} s)",
        how + ", temperature 0",
        f"prompt sizes: {p['token_counting']}. Figures are medians over repeats.",
    ]
    out = [f"## vfleet bench: {t['model']} at {t['url']}", "", "; ".join(facts)]
    if doc["stopped"]:
        out += ["", f"**Stopped early: {doc['stopped']}** (the tables show what was measured)."]
    if s["context"]:
        out += ["", "### Context sweep (cold: new prompt; warm: the same prompt again)", ""]
        out += _table(
            (
                *("context", "mode", "prompt tok", "cached", "TTFT (s)", "prefill (tok/s)"),
                *("output tok", "decode (tok/s)", *MTP_HEAD, "n"),
            ),
            (
                [
                    str(r["context"]),
                    r["mode"],
                    _f(r["prompt_tokens"], ".0f"),
                    _f(r["cached_tokens"], ".0f"),
                    _f(r["ttft_s"], ".3f"),
                    _f(r["prefill_tps"], ",.0f"),
                    _f(r["completion_tokens"], ".0f"),
                    _f(r["decode_tps"], ".1f"),
                    *_mtp(r),
                    str(r["n"]),
                ]
                for r in s["context"]
            ),
        )
    if s["decode"]:
        d = s["decode"]
        out += ["", "### Decode (long generation from a short prompt)", ""]
        out += _table(
            ("output tok", "decode (tok/s)", "spread (%)", "TTFT (s)", *MTP_HEAD, "n"),
            [
                [
                    _f(d["completion_tokens"], ".0f"),
                    _f(d["decode_tps"], ".1f"),
                    _f(d["decode_tps_spread"], ".1f", 100),
                    _f(d["ttft_s"], ".3f"),
                    *_mtp(d),
                    str(d["n"]),
                ]
            ],
        )
    if s["prefill"]:
        out += ["", "### Prefill (1 output token; TTFT = fixed + N / rate)", ""]
        out += _table(
            ("prompt tok", "TTFT median (s)", "TTFT p90 (s)", "prompt/TTFT (tok/s)", "n"),
            (
                [
                    _f(r["prompt_tokens"], ".0f"),
                    _f(r["ttft_s"], ".3f"),
                    _f(r["ttft_p90_s"], ".3f"),
                    _f(r["prefill_tps"], ",.0f"),
                    str(r["n"]),
                ]
                for r in s["prefill"]
            ),
        )
        fit = doc["fits"]["prefill"]
        if fit:
            out += [
                "",
                f"Fit: prefill **{_f(fit['rate_tps'], ',.0f')} tok/s**, fixed overhead "
                f"{fit['fixed_s']:.3f} s, R² {_f(fit['r2'], '.4f')}, {fit['n']} points "
                f"({fit['dropped']} first dropped).",
            ]
        else:
            out += ["", "Fit: not enough points (needs 3 runs of 2 sizes or more)."]
    if s["concurrency"]:
        out += ["", "### Concurrency (simultaneous requests)", ""]
        out += _table(
            (
                *("context", "concurrency", "aggregate (tok/s)", "per-stream decode (tok/s)"),
                *("TTFT mean (s)", *MTP_HEAD, "n"),
            ),
            (
                [
                    str(r["context"]),
                    str(r["concurrency"]),
                    _f(r["aggregate_tps"], ".1f"),
                    _f(r["decode_tps"], ".1f"),
                    _f(r["ttft_s"], ".3f"),
                    *_mtp(r),
                    str(r["n"]),
                ]
                for r in s["concurrency"]
            ),
        )
    notes = [f"skipped {k['scenario']} {k['context']}: {k['why']}" for k in doc["skipped"]]
    failed: dict[str, list[str]] = {}  # one line per distinct error: a cause repeats per run
    for r in doc["runs"]:
        if r.get("error"):
            failed.setdefault(r["error"], []).append(f"{r['scenario']} {r['context']} {r['mode']}")
    notes += [f"failed {', '.join(runs)}: {error}" for error, runs in failed.items()]
    notes += [f"warning: {w}" for w in doc["warnings"]]
    if doc.get("deployment"):
        notes.append(f"deployment facts attached from {doc['deployment']['source']}")
    if notes:
        out += ["", *(f"- {n}" for n in notes)]
    return "\n".join(out) + "\n"


def compare_markdown(a: str, b: str, rows: Sequence[Comparison]) -> str:
    out = [f"A: {a}", f"B: {b}", ""]
    out += _table(
        ("metric", "A", "B", "B/A", "noise (%)", "verdict"),
        (
            [
                c.metric,
                f"{c.a:.4g}",
                f"{c.b:.4g}",
                _f(c.ratio, ".3f"),
                _f(c.noise, ".1f", 100),
                c.verdict,
            ]
            for c in rows
        ),
    )
    if not rows:
        out.append("(no metric measured in both results)")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- plots


def plot(doc: Doc, out_dir: Path) -> list[Path]:
    """PNG plots of the context sweep and the prefill fit; returns the files written."""
    import matplotlib  # lazy: `import vfleet.benchmark` must not pay for it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    title = f"{doc['target']['model']} (vLLM {doc['target']['vllm_version'] or '?'})"
    rows = doc["summary"]["context"]
    if rows:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        panels = (
            ("ttft_s", 1.0, "TTFT (s)"),
            ("decode_tps", 1.0, "decode (tok/s)"),
            ("acceptance_rate", 100.0, "MTP acceptance (%)"),
        )
        for ax, (key, scale, label) in zip(axes, panels, strict=True):
            for mode, style in (("cold", "o-"), ("warm", "s--")):
                pts = [
                    (r["prompt_tokens"], r[key] * scale)
                    for r in rows
                    if r["mode"] == mode and r["prompt_tokens"] is not None and r[key] is not None
                ]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, label=mode)
            ax.set_xscale("symlog", linthresh=1024)
            # Label the measured sizes themselves (log axes would print 1.6395e2 otherwise).
            sizes = sorted({r["prompt_tokens"] for r in rows if r["prompt_tokens"] is not None})
            ax.set_xticks(sizes, [f"{s:,}" for s in sizes])
            ax.minorticks_off()
            ax.set_xlabel("prompt tokens")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        fig.suptitle(f"context sweep: {title}")
        fig.tight_layout()
        path = out_dir / "context.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    prefill = [
        (r["prompt_tokens"], r["ttft_s"])
        for r in doc["runs"]
        if r["scenario"] == "prefill" and not r.get("error") and r["prompt_tokens"] and r["ttft_s"]
    ]
    fit = doc["fits"]["prefill"]
    if prefill:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        dropped = fit["dropped"] if fit else 0
        if dropped:
            ax.plot(*zip(*prefill[:dropped], strict=True), "x", color="grey", label="dropped")
        if prefill[dropped:]:
            ax.plot(*zip(*prefill[dropped:], strict=True), "o", label="runs")
        if fit and fit["rate_tps"]:
            xs = [0.0, max(x for x, _ in prefill)]
            ax.plot(
                xs,
                [fit["fixed_s"] + x / fit["rate_tps"] for x in xs],
                "-",
                label=f"{fit['rate_tps']:,.0f} tok/s, fixed {fit['fixed_s']:.3f} s"
                f" (R² {_f(fit['r2'], '.3f')})",
            )
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"prefill: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / "prefill.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
