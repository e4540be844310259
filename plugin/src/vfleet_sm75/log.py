"""The plugin's log lines go through vLLM's logger, or to stderr while vLLM has none yet.

vLLM 0.32 configures its logging after it loads general plugins, so a line logged from
``register()`` would be dropped; it goes to stderr with the same prefix instead.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("vllm.vfleet_sm75")


def log(level: int, message: str) -> None:
    if logger.isEnabledFor(level) and logger.hasHandlers():
        logger.log(level, "%s", message, stacklevel=2)
    else:
        print(f"{logging.getLevelName(level)} [vfleet_sm75] {message}", file=sys.stderr, flush=True)
