"""The entry point vLLM calls in every process (``vllm.general_plugins``): decide, log, hook.

Nothing is imported from vLLM and nothing is hooked unless ``VFLEET_SM75`` asks for a feature;
``VFLEET_SM75=off`` (or unset) is the same as the plugin not being installed.
"""

from __future__ import annotations

import logging

from . import decide, settings
from .log import log

_DONE = False


def register() -> None:
    global _DONE
    if _DONE:  # vLLM may load general plugins more than once per process
        return
    _DONE = True
    try:
        _register()
    except Exception as exc:  # vLLM calls plugins unguarded: never stop it from starting
        log(logging.WARNING, f"vfleet-sm75: every feature off: unexpected error {exc!r}")


def _register() -> None:
    try:
        if not settings.requested():
            return
    except settings.SettingError as exc:
        log(logging.WARNING, f"vfleet-sm75: every feature off: {exc}")
        return
    facts = decide.facts()
    decisions = decide.decide(facts)
    for d in decisions:
        if not d.active:
            continue
        try:
            if d.feature == "draft-prune":
                from . import draft_prune

                assert facts.table is not None
                draft_prune.install(facts.table, facts.table_path or "")
            elif d.feature == "flashinfer-sm75":
                from . import flashinfer_sm75

                flashinfer_sm75.install()
        except Exception as exc:  # a hook that cannot be installed leaves vLLM stock
            d.active, d.reason = False, f"hook failed: {exc!r}"
    log(logging.INFO, decide.summary(decisions, facts.vllm_version))
