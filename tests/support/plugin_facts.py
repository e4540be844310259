"""The facts the SM75 plugin decides from (vfleet_sm75.decide.Facts), made for its unit tests:
a vLLM version with the fingerprints each feature was verified with, every feature asked for,
nothing else present; a test names what its case adds or changes."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vfleet_sm75 import decide, settings
from vfleet_sm75.flashinfer_fix import FlashInferFacts
from vfleet_sm75.verified import VERIFIED


def verified_hooks(version: str) -> dict[str, str | None]:
    """Every hooked function's fingerprint as recorded for ``version`` (all features)."""
    return {t: h for f in VERIFIED for t, h in VERIFIED[f].get(version, {}).items()}


def facts(version: str, **kw: Any) -> decide.Facts:
    base = decide.Facts(
        setting="auto",
        requested=frozenset(settings.FEATURES),
        setting_error=None,
        vllm_version=version,
        hooks=verified_hooks(version),
        platform="cpu",
        capability=None,
        flashinfer=FlashInferFacts(None, None, ""),
        table_path=None,
        table=None,
        table_error=None,
    )
    return replace(base, **kw)
