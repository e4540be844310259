"""The entry point vLLM calls in every process (``vllm.general_plugins``): decide, log, hook.

Nothing is imported from vLLM and nothing is hooked unless ``VFLEET_SM75`` asks for a feature;
``VFLEET_SM75=off`` (or unset) is the same as the plugin not being installed, except that with
``VFLEET_SM75_STATE`` set the state file says so (state.py), so it never shows a past start.
"""

from __future__ import annotations

import logging
import os

from . import __version__, decide, settings, state
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
        _record([state.Feature(f, False, f"unexpected error {exc!r}") for f in settings.FEATURES])


def _record(features: list[state.Feature]) -> None:
    """The decision into VFLEET_SM75_STATE, if set; a failed write is logged, never raised."""
    path = os.environ.get(state.ENV_STATE)
    if not path:
        return
    try:
        state.record_load(path, features, __version__, decide.vllm_version())
    except Exception as exc:
        log(logging.WARNING, f"vfleet-sm75: cannot write {state.ENV_STATE}={path}: {exc!r}")


def _register() -> None:
    try:
        if not settings.requested():
            shown = os.environ.get(settings.ENV) or "unset"
            why = f"not asked for ({settings.ENV}={shown})"
            _record([state.Feature(f, False, why) for f in settings.FEATURES])
            return
    except settings.SettingError as exc:
        log(logging.WARNING, f"vfleet-sm75: every feature off: {exc}")
        _record([state.Feature(f, False, str(exc)) for f in settings.FEATURES])
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
            elif d.feature == "drafter-reload":
                from . import drafter_reload

                drafter_reload.install()
            elif d.feature == "reader-spin":
                from . import reader_spin

                assert facts.spin_s is not None
                reader_spin.install(facts.spin_s)
            elif d.feature == "cpu-expand":
                from . import cpu_expand

                cpu_expand.install()
            elif d.feature == "cpu-gdn-indices":
                from . import cpu_gdn

                cpu_gdn.install()
            elif d.feature == "sleep-memory":
                from . import sleep_memory

                sleep_memory.install()
            elif d.feature == "cpu-amx":
                from . import cpu_amx

                cpu_amx.install()
        except Exception as exc:  # a hook that cannot be installed leaves vLLM stock
            d.active, d.reason = False, f"hook failed: {exc!r}"
    log(logging.INFO, decide.summary(decisions, facts.vllm_version))
    _record([state.Feature(d.feature, d.active, d.reason) for d in decisions])
