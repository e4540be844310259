"""What a client on another machine may reach of a vLLM server: the one list of allowed routes.

vLLM's API-key guard covers only some path prefixes (`/v1` in every pinned version, more in
later ones), while its app also mounts `/invocations` (SageMaker's chat and completions),
`/tokenize`, `/load`, `/scale_elastic_ep`, `/metrics`, the docs and, in dev mode,
`/collective_rpc`, `/sleep` and more without a key (docs/SECURITY.md, "Routes of each pinned
vLLM"). So vfleet's fronts (the instance's nginx front, `vfleet balancer`) forward only these
routes and answer 404 to everything else; the docs' route tables and their tests read the same
list.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class AllowedRoute:
    """One route a front forwards: `path` exactly, or everything under it (a prefix)."""

    path: str
    exact: bool
    why: str

    def matches(self, path: str) -> bool:
        return path == self.path if self.exact else path.startswith(self.path)

    @property
    def nginx_location(self) -> str:
        """The nginx `location` argument that matches the same paths."""
        return f"= {self.path}" if self.exact else self.path


ALLOWED_ROUTES: tuple[AllowedRoute, ...] = (
    AllowedRoute("/v1/", False, "the OpenAI API: vLLM's key guard covers /v1 in every version"),
    AllowedRoute("/health", True, "liveness for balancers and probes; answers no data"),
)


def allowed(path: str) -> bool:
    """Does a front forward `path` (a normalised request path)?"""
    return any(r.matches(path) for r in ALLOWED_ROUTES)


def is_loopback(host: str) -> bool:
    """Is `host` reachable only from the machine itself (127.0.0.0/8, ::1, localhost)?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: it may resolve to anything
