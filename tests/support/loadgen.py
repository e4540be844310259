"""A bounded load generator for the swap tests: real chat requests to a real server.

Bounded three ways, so it always stops by itself: a request count, a time limit, and a stop
event; paced at `rate` requests per second per worker at most. It records every request
(start, end, ok), so a test can count failures, take latency percentiles per window, and
measure downtime (the longest stretch with no successful request). When the served model
changes (a swap without an alias), a 404 makes it read /v1/models again; that request still
counts as failed.
"""

from __future__ import annotations

import http.client
import itertools
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any


@dataclass
class Request:
    start: float  # seconds since the load started
    end: float
    ok: bool
    status: int  # HTTP status, 0: no answer


class Load:
    def __init__(
        self,
        url: str,
        api_key: str | None,
        *,
        concurrency: int = 1,
        max_requests: int = 2000,
        limit_s: float = 900,
        max_tokens: int = 4,
        rate: float = 2.0,
    ) -> None:
        self.url, self.concurrency = url.rstrip("/"), concurrency
        self.max_requests, self.limit_s, self.max_tokens = max_requests, limit_s, max_tokens
        # Requests per second per worker, at most: the load lasts as long as the test needs it
        # (a swap of minutes) instead of spending its request count in the first minute.
        self.pace = 1.0 / rate
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.requests: list[Request] = []
        self.model: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.t0 = 0.0

    def _models(self) -> str | None:
        req = urllib.request.Request(f"{self.url}/v1/models", headers=self.headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return str(json.loads(r.read())["data"][0]["id"])
        except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError):
            return None

    def _one(self) -> Request:
        start = time.monotonic() - self.t0
        status = 0
        model = self.model or self._models()
        if model is not None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "Count to three."}],
                "max_tokens": self.max_tokens,
            }
            req = urllib.request.Request(
                f"{self.url}/v1/chat/completions", json.dumps(body).encode(), self.headers
            )
            try:
                with urllib.request.urlopen(req, timeout=60) as r:
                    status = r.status
                    json.loads(r.read())
            except urllib.error.HTTPError as exc:
                status = exc.code
            # A body cut mid-way (IncompleteRead: nginx passes answers on unbuffered, and a
            # swap may end the server mid-answer) is a failed request, not a dead worker.
            except (OSError, http.client.HTTPException, ValueError):
                status = 0
        self.model = model if status == 200 else None
        return Request(start, time.monotonic() - self.t0, status == 200, status)

    def _worker(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if len(self.requests) >= self.max_requests:
                    return
            if time.monotonic() - self.t0 > self.limit_s:
                return
            r = self._one()
            with self._lock:
                self.requests.append(r)
            # Paced; a down server is asked again soon, not in a spin.
            self._stop.wait(max(0.2 if not r.ok else 0.0, self.pace - (r.end - r.start)))

    def start(self) -> Load:
        self.t0 = time.monotonic()
        for n in range(self.concurrency):
            t = threading.Thread(target=self._worker, name=f"load-{n}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def now(self) -> float:
        return time.monotonic() - self.t0

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)

    # ------------------------------------------------------------------ what it saw

    def window(self, start: float, end: float) -> list[Request]:
        return [r for r in self.requests if start <= r.start < end]

    def answered(self, since: float, n: int, limit_s: float = 120) -> list[Request]:
        """The requests started at `since` or later, once n of them have an answer (ok or
        not) or limit_s passed (the test's assertion then says how many): a window as long as
        the count needs, not a fixed sleep (1 request/s gives n in about n seconds)."""
        deadline = time.monotonic() + limit_s
        while True:
            got = self.window(since, float("inf"))
            if len(got) >= n or time.monotonic() > deadline or self._stop.is_set():
                return got
            time.sleep(0.2)

    def downtime(self) -> float:
        """The longest stretch with no successful request ending, in seconds."""
        ends = sorted(r.end for r in self.requests if r.ok)
        if not ends:
            return self.now()
        gaps = [b - a for a, b in itertools.pairwise(ends)]
        return max(gaps, default=0.0)

    @staticmethod
    def summary(reqs: list[Request]) -> dict[str, Any]:
        lat = sorted(r.end - r.start for r in reqs if r.ok)

        def pct(q: float) -> float | None:
            if not lat:
                return None
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3)

        return {
            "requests": len(reqs),
            "ok": sum(r.ok for r in reqs),
            "failed": sum(not r.ok for r in reqs),
            "p50_s": round(statistics.median(lat), 3) if lat else None,
            "p99_s": pct(0.99),
        }
