"""vfleet-sm75: a vLLM general plugin for SM75 (RTX 2080 Ti) serving boxes.

Installed, it does nothing until ``VFLEET_SM75`` asks for a feature (``auto`` asks for all).
Each feature turns itself on only on a vLLM version it was verified against, with the hooked
vLLM functions unchanged, and when its own conditions hold; the plugin logs one line per process
saying which features are on and why each other one is off. See README.md.
"""

from importlib.metadata import PackageNotFoundError, version

try:  # one source: plugin/pyproject.toml
    __version__ = version("vfleet-sm75")
except PackageNotFoundError:  # run from a source tree without installing
    __version__ = "0+source"
