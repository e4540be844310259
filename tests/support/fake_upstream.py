"""A hostile HTTP upstream on loopback, shared by the sidecar and probe tests.

A real vLLM cannot be made to trickle its answer a byte at a time, hang after accepting, cut its
body at a line boundary, repeat a series, or answer a completion with HTML: those faults are
produced here, by a small server that writes each answer byte for byte as the test sets it
(status line, headers, framing, body, pacing). Everything that behaves normally in these tests
is real (the exporter's HTTP server, the probe's command line, prometheus_client's parser).
Loopback only; closing the upstream ends every thread it started.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import ssl
import threading
from dataclasses import dataclass
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


class FakeUpstream:
    """Serves ``routes[path]`` (``routes["*"]`` for any other path) to each request."""

    def __init__(
        self, routes: dict[str, Reply] | None = None, tls: ssl.SSLContext | None = None
    ) -> None:
        self.routes: dict[str, Reply] = routes if routes is not None else {}
        self.hits: list[str] = []
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

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def reply(self, path: str) -> Reply:
        return self.routes.get(path) or self.routes.get("*") or Reply(status=404)

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
        path = lines[0].split(" ")[1].split("?")[0]
        length = next(
            (
                int(v)
                for k, _, v in (h.partition(":") for h in lines[1:])
                if k.lower() == "content-length"
            ),
            0,
        )
        while len(rest) < length:  # read a POST body before answering, as a server does
            chunk = conn.recv(4096)
            if not chunk:
                return
            rest += chunk
        self.hits.append(path)
        r = self.reply(path)
        if r.hang:
            self.stop.wait()
            return
        if r.delay and self.stop.wait(r.delay):
            return
        out = [f"HTTP/1.1 {r.status} X\r\n", f"Content-Type: {r.content_type}\r\n"]
        body = r.body
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
