"""Turn a bench result into a baseline (profiles/baselines/): what speed is normal here.

The baseline names the profile, model preset and stack from the deployment's release.json, so
it applies to exactly what was measured; the "decode below baseline" alert and `vfleet status`
read it. Figures are the range over the repeats (low = the slowest run).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from vfleet.config.schema import Baseline
from vfleet.errors import VfleetError


def _range(values: list[float], note: str, digits: int) -> dict[str, Any] | None:
    if not values:
        return None
    return {"low": round(min(values), digits), "high": round(max(values), digits), "note": note}


def baseline_from(doc: dict[str, Any]) -> Baseline:
    release = doc.get("deployment") or {}
    release = release.get("release", release)
    missing = [k for k in ("profile", "model", "stack") if not release.get(k)]
    if missing:
        raise VfleetError(
            f"the result has no deployment {', '.join(missing)}",
            key="--save-baseline",
            fix="run with --release-json <base>/instances/<instance>/current/release.json",
        )
    ok = [r for r in doc["runs"] if not r.get("error")]
    decode = [r["decode_tps"] for r in ok if r["scenario"] == "decode" and r["decode_tps"]]
    accept = [
        r["acceptance_rate"]
        for r in ok
        if r["scenario"] == "decode" and r["acceptance_rate"] is not None
    ]
    fit = (doc.get("fits") or {}).get("prefill")
    tokens = ok[0]["max_tokens"] if ok else None
    data: dict[str, Any] = {
        "profile": release["profile"],
        "model": release["model"],
        "stack": release["stack"],
        "source": f"vfleet bench at {doc['target']['url']}, {doc['started_at']}",
        "decode_tokens_per_second": _range(decode, f"{tokens}-token generations", 1),
        "spec_decode_acceptance_rate": _range(accept, "decode scenario", 3),
        "prefill_tokens_per_second": (
            {"low": round(fit["rate_tps"], 0), "note": f"regression, R^2 {fit['r2'] or 0:.3f}"}
            if fit and fit.get("rate_tps")
            else None
        ),
    }
    if not any(data[k] for k in ("decode_tokens_per_second", "prefill_tokens_per_second")):
        raise VfleetError(
            "the result has neither a decode nor a prefill figure",
            key="--save-baseline",
            fix="include the decode or prefill scenario (--scenario decode,prefill)",
        )
    return Baseline.model_validate({k: v for k, v in data.items() if v is not None})


def save(baseline: Baseline, path: Path) -> None:
    """Write atomically; a baseline already there is replaced (it is the operator's own)."""
    text = (
        "# Saved by `vfleet bench run --save-baseline`: what speed is normal for this\n"
        "# profile x model x stack. Edit the figures if this run was not representative.\n"
        + yaml.safe_dump(baseline.model_dump(exclude_none=True), sort_keys=False)
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
