"""Host-side companions of vLLM: the readiness probe (stdlib only) and the metrics sidecar."""

from importlib.metadata import PackageNotFoundError, version

try:  # the version lives only in healthcheck/pyproject.toml
    __version__ = version("vfleet-healthcheck")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"
