"""A loopback package index in front of the real one: pip reads wheel metadata from a cache.

pip resolves from metadata alone where the index serves each wheel's METADATA as a file of
its own (PEP 658/714) and keeps it in its HTTP cache where the index's headers allow. A mirror
that does neither makes pip download every candidate wheel (torch and the CUDA libraries: GBs
per stack) on every run. This index passes the real index's project pages through (PEP 691
JSON, kept for 10 minutes as PyPI's own `Cache-Control: max-age=600` allows) and offers pip a
metadata file for every wheel. That file comes from `.cache/stacks-pip/metadata/<sha256>`,
filled on a miss from the real index: its own metadata file where it has one, else the
METADATA member read out of the wheel with HTTP range requests (the zip's directory and that
one member). A wheel's metadata never changes for its sha256, so the cache needs no expiry.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import re
import tempfile
import threading
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote

JSON_TYPE = "application/vnd.pypi.simple.v1+json"
PAGE_MAX_AGE_S = 600  # PyPI's Cache-Control for its project pages
CHUNK = 256 * 1024
TIMEOUT_S = 120
SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _get(url: str, headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    for attempt in range(3):
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                data: bytes = resp.read()
                return data
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError):
            if attempt == 2:
                raise
            time.sleep(1 + attempt)
    raise AssertionError("unreachable")


class RangeFile(io.RawIOBase):
    """A remote file read with HTTP range requests, in aligned chunks, for zipfile."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos = url, size, 0
        self.chunks: dict[int, bytes] = {}

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _chunk(self, index: int) -> bytes:
        if index not in self.chunks:
            start = index * CHUNK
            end = min(self.size, start + CHUNK) - 1
            data = _get(self.url, {"Range": f"bytes={start}-{end}"})
            if len(data) != end - start + 1:
                raise OSError(f"{self.url}: the server ignored the range request")
            self.chunks[index] = data
        return self.chunks[index]

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        want = min(len(buffer), self.size - self.pos)
        got = 0
        while got < want:
            index, offset = divmod(self.pos, CHUNK)
            piece = self._chunk(index)[offset : offset + want - got]
            buffer[got : got + len(piece)] = piece
            got += len(piece)
            self.pos += len(piece)
        return got


def wheel_metadata(url: str, size: int) -> bytes:
    """The METADATA of a remote wheel, from its zip directory and that one member."""
    with zipfile.ZipFile(io.BufferedReader(RangeFile(url, size), CHUNK)) as whl:
        names = [n for n in whl.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(names) != 1:
            raise OSError(f"{url}: {len(names)} .dist-info/METADATA members")
        return whl.read(names[0])


class MetadataIndex:
    """The cache and the upstream index; what the loopback server answers from."""

    def __init__(self, upstream: str, cache: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.pages = cache / "pages"
        self.metadata = cache / "metadata"
        self.files: dict[str, tuple[str, int, bool]] = {}  # sha256 -> url, size, has .metadata
        self.lock = threading.Lock()
        self.base = ""  # the loopback URL, set once the server listens

    def page(self, project: str) -> bytes | None:
        """A project's PEP 691 page with every wheel's URL on the loopback, or None (404)."""
        cached = self.pages / f"{project}.json"
        if cached.is_file() and time.time() - cached.stat().st_mtime < PAGE_MAX_AGE_S:
            raw = cached.read_bytes()
        else:
            try:
                raw = _get(f"{self.upstream}/{quote(project)}/", {"Accept": JSON_TYPE})
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return None
                raise
            _write(cached, raw)
        data = json.loads(raw)
        for f in data.get("files", []):
            sha = f.get("hashes", {}).get("sha256", "")
            if not f["filename"].endswith(".whl") or not SHA256.match(sha):
                continue
            upstream_meta = bool(f.get("core-metadata") or f.get("dist-info-metadata"))
            with self.lock:
                self.files[sha] = (str(f["url"]), int(f.get("size") or 0), upstream_meta)
            f["url"] = f"{self.base}/files/{sha}/{quote(f['filename'])}"
            f["core-metadata"] = True
            f.pop("dist-info-metadata", None)
        return json.dumps(data).encode()

    def wheel_metadata(self, sha: str) -> bytes | None:
        cached = self.metadata / sha
        if cached.is_file():
            return cached.read_bytes()
        with self.lock:
            known = self.files.get(sha)
        if known is None:
            return None
        url, size, upstream_meta = known
        if upstream_meta:
            data = _get(url + ".metadata")
        else:
            data = wheel_metadata(url, size or _content_length(url))
        _write(cached, data)
        return data


def _content_length(url: str) -> int:
    req = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        return int(resp.headers["Content-Length"])


def _write(path: Path, data: bytes) -> None:
    """Whole or not at all: four pip processes read the cache while it fills."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


class _Handler(http.server.BaseHTTPRequestHandler):
    index: MetadataIndex

    def log_message(self, format: str, *args: object) -> None:
        pass  # pip's hundreds of requests would drown the check's output

    def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        parts = [unquote(p) for p in self.path.split("?")[0].strip("/").split("/")]
        try:
            if len(parts) == 2 and parts[0] == "simple":
                page = self.index.page(parts[1])
                if page is None:
                    self._send(404, b"not found")
                else:
                    self._send(200, page, JSON_TYPE)
            elif len(parts) == 3 and parts[0] == "files" and parts[2].endswith(".metadata"):
                meta = self.index.wheel_metadata(parts[1])
                self._send(200, meta) if meta is not None else self._send(404, b"unknown")
            elif len(parts) == 3 and parts[0] == "files":
                with self.index.lock:
                    known = self.index.files.get(parts[1])
                if known is None:
                    self._send(404, b"unknown")
                else:  # the wheel itself: from the real index
                    self.send_response(302)
                    self.send_header("Location", known[0])
                    self.end_headers()
            else:
                self._send(404, b"not found")
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            self._send(502, f"{type(exc).__name__}: {exc}".encode())


@contextlib.contextmanager
def serve(upstream: str, cache: Path) -> Iterator[str]:
    """Serve the metadata index on 127.0.0.1 while the block runs: its /simple URL."""
    index = MetadataIndex(upstream, cache)
    handler = type("Handler", (_Handler,), {"index": index})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    index.base = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="vfleet-stacks-index")
    thread.daemon = True
    thread.start()
    try:
        yield f"{index.base}/simple"
    finally:
        server.shutdown()
        server.server_close()
