"""`vfleet switch`'s gates on an engine whose tokens decode to no text (docs/GPU.md section 10).

On the H200 every switch to the mid-size test model rolled back at the completion gate: its one
token after "Hi" came back with no text (vLLM skips special tokens when it detokenizes), the
usage said 1 completion token, and the bench client treats that as a protocol error. The engine
was healthy (it served the load's chat requests meanwhile). A stub server answers the way vLLM
does there: a chunk with empty text, then the usage.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vfleet.fleet import switch
from vfleet.measure.client import BenchError, Client


def _server(tokens: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # /health
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:  # /v1/completions, streamed: no text, `tokens` counted
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            events = [
                {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
                {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": tokens}},
            ]
            body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            body += b"data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture(params=[1, 0], ids=["one-token-no-text", "no-token"])
def replica(request: pytest.FixtureRequest) -> Iterator[tuple[switch.Replica, int]]:
    srv = _server(request.param)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    r = switch.Replica(
        "b", {}, sys.executable, port, "chat", 1, None, url=f"http://127.0.0.1:{port}"
    )
    try:
        yield r, request.param
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_token_without_text_passes_the_completion_gate_and_no_token_fails_it(
    replica: tuple[switch.Replica, int],
) -> None:
    r, tokens = replica
    # The bench keeps its rule: a timed answer needs text.
    if tokens:
        with pytest.raises(BenchError, match="no delta had text"):
            Client(r.url, timeout=10).complete("chat", "Hi", 1)
    gates = {g.name: g for g in switch.run_gates(r, {}, False, 0.5)}
    if tokens:
        assert all(g.ok for g in gates.values()), gates
        assert gates["completion"].detail == "1 token (no text: a token the server does not print)"
        assert gates["greedy"].detail == "not compared: nothing recorded"
    else:
        assert list(gates) == ["health", "completion"]
        assert not gates["completion"].ok
        assert gates["completion"].detail == "no token: no text and no usage count"


def test_the_greedy_gate_compares_an_empty_reply() -> None:
    srv = _server(16)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    port = srv.server_address[1]
    r = switch.Replica(
        "b", {}, sys.executable, port, "chat", 1, None, url=f"http://127.0.0.1:{port}"
    )
    try:
        same = switch.run_gates(r, {"greedy": {"text": ""}}, False, 0.5)
        other = switch.run_gates(r, {"greedy": {"text": " The quick"}}, False, 0.5)
    finally:
        srv.shutdown()
        srv.server_close()
    assert [g.name for g in same if g.ok] == [
        "health",
        "completion",
        "greedy",
        "acceptance",
        "performance",
    ]
    assert not other[-1].ok and other[-1].name == "greedy", other
