"""Where vfleet's own files are: the one place that knows the repository's layout.

Every module that reads a template, a profile, a generated file or a host-side script takes
its path from here, so moving a folder is a change to this file only.
"""

from __future__ import annotations

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
