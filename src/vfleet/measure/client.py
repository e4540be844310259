"""A streaming OpenAI-compatible client on the standard library, timed per request.

Times are taken on the client, as a user sees them (the seeds measure the same way):

- TTFT: request sent -> first delta with non-empty ``content``, ``reasoning_content`` or
  ``reasoning`` (a reasoning parser moves thinking tokens out of ``content``; they still are
  tokens the server produced).
- decode tok/s: the tokens after the first over the time between the first and the last delta,
  ``(completion_tokens - 1) / (t_last - t_first)``. The token count is the usage chunk's
  (``stream_options.include_usage``); counting deltas is only a fallback, and undercounts with
  speculative decoding, where one delta can carry several tokens. Not measured (None) when
  most deltas after the first arrived less than SPACED_S after the one before: no engine step
  is that short (vLLM sends a delta per step, and its steps take milliseconds), so the stream
  was not read as it was generated (the server's output or this client fell behind) and the
  span between arrivals says nothing about decode. Seen in `make test`'s tune runs on a loaded
  machine: 127 tokens "decoded" in 0.5 ms (237,000 and 223,000 tok/s), and the tuner, which
  keeps a candidate's fastest repeat, picked its depth on that.
- prefill tok/s: ``prompt_tokens / TTFT`` (includes the fixed per-request overhead; the prefill
  scenario's regression separates the two).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TIMEOUT_S = 600.0
# Less than this between two deltas: they were waiting together (in the server's output or in
# this client's socket), not generated then. A vLLM engine step takes milliseconds.
SPACED_S = 0.0002


class BenchError(Exception):
    """A request that produced no usable answer. ``kind``: connect, timeout, http, protocol."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class HTTPStatusError(BenchError):
    def __init__(self, method: str, url: str, status: int, body: bytes) -> None:
        self.status = status
        self.body = body
        super().__init__("http", f"HTTP {status} from {method} {url}: {excerpt(body)}")


def excerpt(body: bytes, limit: int = 300) -> str:
    """The server's error message (vLLM: {"error": {"message": ...}}), else the body's start."""
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        err = data.get("error", data)
        msg = err.get("message") if isinstance(err, dict) else err
        if isinstance(msg, str) and msg:
            text = msg
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SSEDecoder:
    """Server-Sent Events: bytes in (split anywhere), the ``data`` of each complete event out.

    Events end at a blank line; several ``data:`` lines of one event are joined with newlines;
    comment lines (``: keep-alive``) and other fields are ignored. Lines are split on bytes
    before decoding, so a UTF-8 character cut between two reads is never broken.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        out: list[str] = []
        start = 0
        while (end := self._buf.find(b"\n", start)) != -1:
            line = bytes(self._buf[start:end]).rstrip(b"\r").decode("utf-8", errors="replace")
            start = end + 1
            event = self._line(line)
            if event is not None:
                out.append(event)
        del self._buf[:start]
        return out

    def close(self) -> list[str]:
        """End of stream: an unterminated last line and event still count (lenient)."""
        out = self.feed(b"\n") if self._buf else []
        event = self._line("")
        return [*out, event] if event is not None else out

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            event = "\n".join(self._data)
            self._data = []
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


@dataclass
class StreamResult:
    """One streamed request. Times in seconds from the moment the request was sent."""

    e2e_s: float
    first_s: float | None = None  # first non-empty delta
    last_s: float | None = None  # last non-empty delta
    deltas: int = 0  # non-empty deltas seen
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # from the usage chunk
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    finish_reason: str | None = None
    text: str = ""
    reasoning: str = ""
    # Deltas after the first that came SPACED_S or more after the one before (all of them when
    # the stream is read as it is generated); None: not counted (a result made by hand).
    spaced: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.first_s

    @property
    def tokens(self) -> int:
        """Completion tokens: the usage count, else the deltas counted (a lower bound)."""
        return self.completion_tokens if self.completion_tokens is not None else self.deltas

    @property
    def streamed_in_time(self) -> bool:
        """Most deltas after the first came SPACED_S or more after the one before."""
        if self.spaced is None or self.deltas < 4:
            return True
        return 2 * self.spaced >= self.deltas - 1

    @property
    def decode_tps(self) -> float | None:
        if self.first_s is None or self.last_s is None or self.tokens < 2:
            return None
        if not self.streamed_in_time:
            return None
        span = self.last_s - self.first_s
        return (self.tokens - 1) / span if span > 0 else None

    @property
    def prefill_tps(self) -> float | None:
        if not self.prompt_tokens or not self.first_s:
            return None
        return self.prompt_tokens / self.first_s


@dataclass
class _Accumulator:
    result: StreamResult = field(default_factory=lambda: StreamResult(e2e_s=0.0))

    def add(self, obj: Any, now: float) -> None:
        if not isinstance(obj, dict):
            raise BenchError("protocol", f"stream event is not a JSON object: {obj!r:.200}")
        if "error" in obj:  # vLLM reports errors that happen mid-stream as an event
            raise BenchError(
                "protocol", f"server error in stream: {excerpt(json.dumps(obj).encode())}"
            )
        r = self.result
        usage = obj.get("usage")
        if isinstance(usage, dict):
            r.prompt_tokens = _int(usage.get("prompt_tokens"), r.prompt_tokens)
            r.completion_tokens = _int(usage.get("completion_tokens"), r.completion_tokens)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict):
                r.cached_tokens = _int(details.get("cached_tokens"), r.cached_tokens)
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            part = delta if isinstance(delta, dict) else choice  # chat: delta; completions: text
            content = part.get("content") or part.get("text") or ""
            thought = part.get("reasoning_content") or part.get("reasoning") or ""
            if content or thought:
                if r.first_s is None:
                    r.first_s, r.spaced = now, 0
                elif r.last_s is not None and now - r.last_s >= SPACED_S:
                    r.spaced = (r.spaced or 0) + 1
                r.last_s = now
                r.deltas += 1
                r.text += content if isinstance(content, str) else ""
                r.reasoning += thought if isinstance(thought, str) else ""
            if choice.get("finish_reason"):
                r.finish_reason = str(choice["finish_reason"])


def _int(value: Any, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


class Client:
    """One base URL; a new connection per request (so threads can share a Client)."""

    def __init__(
        self, base_url: str, *, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None
    ) -> None:
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self._parts = parts
        self.timeout = timeout
        self.api_key = api_key

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        cls = (
            http.client.HTTPSConnection
            if self._parts.scheme == "https"
            else http.client.HTTPConnection
        )
        return cls(self._parts.hostname or "", self._parts.port, timeout=timeout)

    def _headers(self, body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json, text/event-stream"}
        if body:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def request_json(
        self, method: str, path: str, body: Any = None, timeout: float | None = None
    ) -> Any:
        """A plain JSON request. Raises BenchError (HTTPStatusError for a non-200)."""
        url = self.base_url + path
        limit = timeout if timeout is not None else self.timeout
        data = json.dumps(body).encode() if body is not None else None
        conn = self._connection(limit)
        try:
            conn.request(
                method, self._parts.path.rstrip("/") + path, data, self._headers(bool(data))
            )
            resp = conn.getresponse()
            raw = resp.read()
        except TimeoutError:
            raise BenchError("timeout", f"no answer from {method} {url} within {limit} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise BenchError("connect", f"{method} {url}: {exc}") from None
        finally:
            conn.close()
        if resp.status != 200:
            raise HTTPStatusError(method, url, resp.status, raw)
        try:
            return json.loads(raw)
        except ValueError:
            raise BenchError("protocol", f"{method} {url}: not JSON: {excerpt(raw)}") from None

    def stream(
        self,
        path: str,
        body: dict[str, Any],
        timeout: float | None = None,
        *,
        allow_no_text: bool = False,
    ) -> StreamResult:
        """POST ``body`` with ``stream: true`` and time the answer. ``timeout`` bounds it all.

        Tokens that decode to no text (a special token the server skips, as vLLM does by
        default) are a protocol error for a bench, which times text; ``allow_no_text`` returns
        such an answer (``first_s`` None, ``completion_tokens`` from the usage) instead."""
        url = self.base_url + path
        limit = timeout if timeout is not None else self.timeout
        payload = json.dumps({**body, "stream": True}).encode()
        conn = self._connection(limit)
        acc = _Accumulator()
        decoder = SSEDecoder()
        t0 = time.perf_counter()
        deadline = t0 + limit
        try:
            conn.connect()
            sock = conn.sock  # kept: http.client may drop conn.sock once the response owns it
            conn.request("POST", self._parts.path.rstrip("/") + path, payload, self._headers(True))
            resp = conn.getresponse()
            if resp.status != 200:
                raise HTTPStatusError("POST", url, resp.status, resp.read(4096))
            done = False
            while not done:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError
                if sock is not None:
                    sock.settimeout(left)
                chunk = resp.read1(65536)
                now = time.perf_counter() - t0
                events = decoder.feed(chunk) if chunk else decoder.close()
                for data in events:
                    if data.strip() == "[DONE]":
                        done = True
                        break
                    try:
                        acc.add(json.loads(data), now)
                    except ValueError:
                        raise BenchError("protocol", f"bad event from {url}: {data:.200}") from None
                if not chunk:
                    break
        except TimeoutError:
            raise BenchError("timeout", f"POST {url} did not finish within {limit} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise BenchError("connect", f"POST {url}: {exc}") from None
        finally:
            conn.close()
        result = acc.result
        result.e2e_s = time.perf_counter() - t0
        if result.first_s is None and result.completion_tokens and not allow_no_text:
            raise BenchError("protocol", f"POST {url}: usage says tokens but no delta had text")
        return result

    def chat(
        self,
        model: str,
        prompt: str,
        max_tokens: int,
        *,
        enable_thinking: bool = False,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> StreamResult:
        body: dict[str, Any] = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            # Qwen3 thinks by default; a hidden thinking phase would distort TTFT and decode.
            "chat_template_kwargs": {"enable_thinking": enable_thinking},
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
        return self.stream("/v1/chat/completions", body, timeout)

    def complete(
        self,
        model: str,
        prompt: str,
        max_tokens: int,
        *,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        allow_no_text: bool = False,
    ) -> StreamResult:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
        return self.stream("/v1/completions", body, timeout, allow_no_text=allow_no_text)
