"""The one loopback fake HTTP server of the tests: a stand-in for vLLM (or a replica behind the
balancer) where a real one cannot be made to do what the test needs.

A real vLLM cannot be made to trickle its answer a byte at a time, hang after accepting, cut its
body at a line boundary, repeat a series, answer a completion with HTML, stream an SSE answer
with chosen gaps, or change its /metrics between two scrapes on cue: those answers are produced
here, by a small server that writes each answer byte for byte as the test sets it (status line,
headers, framing, body, pacing). A route is a fixed Reply or a function of the Request. Users:
the sidecar and probe tests, the bench client, `vfleet status`, the balancer (nginx in front of
two of these) and the doctor (one in a process started as vLLM's server module). Everything
that behaves normally in those tests is real. Loopback only; closing the upstream ends every
thread it started.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

Framing = Literal["length", "chunked", "close"]


@dataclass
class Reply:
    body: bytes = b""
    status: int = 200
    content_type: str = "text/plain; version=0.0.4; charset=utf-8"
    # length: Content-Length (as vLLM sends /metrics); chunked: Transfer-Encoding chunked;
    # close: neither, the body ends when the connection closes (HTTP/1.0 style).
    framing: Framing = "length"
    length: int | None = None  # the Content-Length to claim; None: the true one
    delay: float = 0.0  # seconds before the status line
    trickle: float = 0.0  # seconds between bytes, from the status line on
    hang: bool = False  # read the request, then never answer (until closed)
    # Chunked, one chunk per (seconds to wait first, bytes), as uvicorn streams SSE; overrides
    # body and framing.
    chunks: list[tuple[float, bytes]] | None = None


class _Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True  # as http.server's: a fixed port can be bound again at once
    daemon_threads = True


@dataclass
class Request:
    method: str
    path: str  # without the query
    headers: dict[str, str] = field(default_factory=dict)  # names in lower case
    body: bytes = b""
    query: str = ""  # after the '?', as sent


Route = Reply | Callable[[Request], Reply]


class FakeUpstream:
    """Serves ``routes[path]`` (``routes["*"]`` for any other path) to each request: a Reply, or
    a function that makes one from the Request. ``hits`` lists the paths asked for, ``requests``
    the requests themselves."""

    def __init__(
        self,
        routes: dict[str, Route] | None = None,
        tls: ssl.SSLContext | None = None,
        port: int = 0,
    ) -> None:
        self.routes: dict[str, Route] = routes if routes is not None else {}
        self.hits: list[str] = []
        self.requests: list[Request] = []
        self.stop = threading.Event()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                with contextlib.suppress(OSError):
                    conn = self.request
                    if tls is not None:
                        conn.settimeout(5)
                        conn = tls.wrap_socket(conn, server_side=True)
                    outer._serve(conn)

        self.server = _Server(("127.0.0.1", port), Handler)
        self.port = int(self.server.server_address[1])
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def reply(self, request: Request) -> Reply:
        route = self.routes.get(request.path) or self.routes.get("*") or Reply(status=404)
        return route if isinstance(route, Reply) else route(request)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                return
            head += chunk
        head, _, rest = head.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target = lines[0].split(" ")[:2]
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])
        }
        length = int(headers.get("content-length") or 0)
        while len(rest) < length:  # read a POST body before answering, as a server does
            chunk = conn.recv(4096)
            if not chunk:
                return
            rest += chunk
        path, _, query = target.partition("?")
        request = Request(method, path, headers, rest[:length], query)
        self.hits.append(request.path)
        self.requests.append(request)
        r = self.reply(request)
        if r.hang:
            self.stop.wait()
            return
        if r.delay and self.stop.wait(r.delay):
            return
        out = [f"HTTP/1.1 {r.status} X\r\n", f"Content-Type: {r.content_type}\r\n"]
        body = r.body
        if r.chunks is not None:
            out.append("Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            conn.sendall("".join(out).encode())
            for delay, data in r.chunks:
                if delay and self.stop.wait(delay):
                    return
                conn.sendall(b"%x\r\n%s\r\n" % (len(data), data))
            conn.sendall(b"0\r\n\r\n")
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)
            return
        if r.framing == "length":
            out.append(f"Content-Length: {len(body) if r.length is None else r.length}\r\n")
        elif r.framing == "chunked":
            out.append("Transfer-Encoding: chunked\r\n")
            body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
        out.append("Connection: close\r\n\r\n")
        data = "".join(out).encode() + body
        if not r.trickle:
            conn.sendall(data)
        else:
            for i in range(len(data)):
                if self.stop.wait(r.trickle):
                    return
                conn.sendall(data[i : i + 1])
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeUpstream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
