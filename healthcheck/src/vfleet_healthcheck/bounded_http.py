"""HTTP requests with one deadline for the whole exchange and a cap on the body. Stdlib only.

urllib's ``timeout`` bounds each socket operation, not the request: an upstream that sends one
byte a second keeps a read going for as long as it likes (issue 22: a sidecar scrape that never
ended, a probe that ran 90 s with ``--timeout 3``). Here every send and receive is given what is
left of one deadline (connect, request, status line, headers and body together), so a request
ends by its deadline whatever the upstream does, in the calling thread: no thread is left behind
to finish it. Proxies from the environment are not used: the upstream is a vLLM on the same host
or network, never reached through a proxy. Name resolution is not bounded (use an address or
``localhost``).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

# vLLM's /metrics is ~55 KB on a small server; many LoRA adapters or engines make it a few
# times that. 16 MiB is far above any real exposition and still a bounded amount of memory.
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
_READ = 64 * 1024


class RequestError(Exception):
    """Why a request gave no complete answer. ``reason``: timeout, connect, truncated,
    too_large or protocol (not HTTP, or headers beyond http.client's limits)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    # True when the length was announced (Content-Length or chunked): a cut body is then an
    # error. False for a body that ends when the connection closes (HTTP/1.0 style): a cut at
    # a line boundary cannot be told from the end here; the caller has to judge the content.
    framed: bool


class _Deadline:
    """Gives each socket operation what is left of one deadline."""

    deadline: float = float("inf")

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        self.settimeout(left)  # type: ignore[attr-defined]

    # First in the MRO of both socket classes below: each call is armed, then passed on.
    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return int(super().recv_into(*args, **kwargs))  # type: ignore[misc]

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        self._arm()
        return bytes(super().recv(*args, **kwargs))  # type: ignore[misc]

    def sendall(self, *args: Any, **kwargs: Any) -> None:
        self._arm()
        super().sendall(*args, **kwargs)  # type: ignore[misc]


class _Socket(_Deadline, socket.socket):
    pass


class _SSLSocket(_Deadline, ssl.SSLSocket):
    pass


class _Connection(http.client.HTTPConnection):
    def __init__(
        self, host: str, port: int, deadline: float, context: ssl.SSLContext | None
    ) -> None:
        super().__init__(host, port)
        self.deadline = deadline
        self.context = context

    def connect(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        plain = socket.create_connection((self.host, self.port), left)
        sock = _Socket(plain.family, plain.type, plain.proto, fileno=plain.detach())
        sock.deadline = self.deadline
        if self.context is None:
            self.sock = sock
            return
        sock._arm()  # the handshake runs inside wrap_socket, under the socket's timeout
        wrapped = self.context.wrap_socket(sock, server_hostname=self.host)
        assert isinstance(wrapped, _SSLSocket)
        wrapped.deadline = self.deadline
        self.sock = wrapped


def _ssl_context(given: ssl.SSLContext | None) -> ssl.SSLContext:
    context = given or ssl.create_default_context()
    context.sslsocket_class = _SSLSocket
    return context


def request(
    url: str,
    *,
    timeout: float,
    method: str = "GET",
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    context: ssl.SSLContext | None = None,
) -> Response:
    """One request to ``url`` that ends within ``timeout`` seconds, whatever the server does.

    Any status is returned (the caller judges it); RequestError for no complete answer.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RequestError("connect", f"not an http(s) URL: {url!r}")
    deadline = time.monotonic() + timeout
    https = parts.scheme == "https"
    conn = _Connection(
        parts.hostname,
        parts.port or (443 if https else 80),
        deadline,
        _ssl_context(context) if https else None,
    )
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    try:
        conn.request(
            method,
            target,
            body=body,
            headers={"Accept-Encoding": "identity", "Connection": "close", **(headers or {})},
        )
        resp = conn.getresponse()
        if resp.length is not None and resp.length > max_bytes:
            raise RequestError(
                "too_large", f"{url} announced {resp.length} bytes (cap {max_bytes})"
            )
        chunks: list[bytes] = []
        size = 0
        while chunk := resp.read(_READ):
            size += len(chunk)
            if size > max_bytes:
                raise RequestError("too_large", f"{url} sent more than {max_bytes} bytes")
            chunks.append(chunk)
        if resp.length:  # http.client stops quietly when a Content-Length body is cut
            raise RequestError("truncated", f"{url} closed the connection mid-body")
        return Response(
            int(resp.status), b"".join(chunks), framed=resp.chunked or resp.length is not None
        )
    except TimeoutError:
        raise RequestError("timeout", f"no complete answer from {url} within {timeout} s") from None
    except http.client.IncompleteRead:
        raise RequestError("truncated", f"{url} closed the connection mid-body") from None
    except http.client.RemoteDisconnected:
        raise RequestError("connect", f"{url} closed the connection without answering") from None
    except http.client.HTTPException as exc:
        raise RequestError("protocol", f"{url} did not answer HTTP: {exc!r}") from None
    except ssl.SSLError as exc:
        raise RequestError("connect", f"{url}: TLS failed: {exc}") from None
    except OSError as exc:
        raise RequestError("connect", f"cannot reach {url}: {exc}") from None
    finally:
        conn.close()
