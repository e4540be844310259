"""Pack and unpack an instance's compile caches on a serving host. Python 3.11 stdlib only.

A cache seed is a tar of an instance's compile caches (docs/CACHES.md), made on one host by
`vfleet caches pack` and unpacked by the deploy on another host of the same stack, accelerator
and paths before its first start. This script does the host's part; the control machine
decides what to pack and whether a seed matches (src/vfleet/render/cache_seed.py), and passes
everything in the request, so nothing here repeats a vfleet name or path.

    python3 cacheseed.py pack   '<request json>'   > seed.tar   (over ssh: python3 - pack ...)
    python3 cacheseed.py check  '<request json>'   one JSON line: are the roots empty?
    python3 cacheseed.py unpack '<request json>'   one JSON line: what was unpacked

Members are `<root name>/<path under that root>` plus the manifest, last (its sizes are the
ones written). Bytecode under the request's `pycache` (PYTHONPYCACHEPREFIX) is rewritten from
timestamp pycs to checked-hash pycs (PEP 552): pip writes every venv file with its install time
as mtime, so a timestamp pyc from another host never matches there and would be compiled again;
a checked-hash pyc is valid wherever the source's bytes are the same. A pyc that no longer
matches its source here is left out.

Exit status: 0 done, 2 bad request, 3 nothing to pack (every root missing or empty).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import pwd
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

NOTHING_TO_PACK = 3
# PEP 552 flags: bit 0 hash-based, bit 1 check_source.
CHECKED_HASH = 0b11


def _walk(root: Path) -> Iterator[Path]:
    """Folders and regular files under root (symlinks and sockets are not cache content)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        d = Path(dirpath)
        for name in dirnames:
            if not (d / name).is_symlink():
                yield d / name
        for name in sorted(filenames):
            p = d / name
            if p.is_file() and not p.is_symlink():
                yield p


def _ns_text(ns: int) -> str:
    """A pax mtime with all nine decimals: tarfile's float keeps about seven."""
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def member_mtime_ns(m: tarfile.TarInfo) -> int:
    """The member's mtime to the nanosecond, read from its pax text where there is one.

    Why exact: ninja (FlashInfer's JIT) takes an output whose mtime is newer than the one its
    deps log recorded as "stored deps info out of date" and rebuilds it. tarfile reads a pax
    mtime into a float, which lands up to ~100 ns off: seen with ninja 1.11.1 here, and on the
    H200 a seed unpacked that way at the same path paid FlashInfer's JIT again (docs/CACHES.md).
    """
    text = m.pax_headers.get("mtime")
    if text:
        sec, _, frac = text.partition(".")
        return int(sec) * 1_000_000_000 + int((frac + "000000000")[:9])
    return int(m.mtime) * 1_000_000_000


def checked_hash_pyc(pyc: Path, data: bytes) -> bytes | None:
    """`data` (the pyc's bytes) as a checked-hash pyc of its source here; None when it is not
    this Python's bytecode of the source as it is now (stale, or its source gone)."""
    if len(data) < 16 or data[:4] != importlib.util.MAGIC_NUMBER:
        return None
    flags = int.from_bytes(data[4:8], "little")
    try:
        source = Path(importlib.util.source_from_cache(str(pyc)))
        st = source.stat()
        src = source.read_bytes()
    except (OSError, ValueError):
        return None
    if flags & 1:  # already hash-based: keep it only if it matches the source
        ok = data[8:16] == importlib.util.source_hash(src)
        return data if ok else None
    mtime = int.from_bytes(data[8:12], "little")
    size = int.from_bytes(data[12:16], "little")
    if mtime != int(st.st_mtime) & 0xFFFFFFFF or size != st.st_size & 0xFFFFFFFF:
        return None
    header = data[:4] + CHECKED_HASH.to_bytes(4, "little") + importlib.util.source_hash(src)
    return header + data[16:]


def pack(req: dict[str, Any], out: IO[bytes]) -> dict[str, Any]:
    """Write the tar to `out`; return the manifest written as its last member."""
    roots = {name: Path(path) for name, path in req["roots"].items()}
    pycache = Path(req["pycache"]) if req.get("pycache") else None
    if pycache is not None:
        # source_from_cache maps a pyc under the prefix back to its source only with it set.
        sys.pycache_prefix = str(pycache)
    sizes: dict[str, dict[str, int]] = {}
    pyc = {"converted": 0, "kept": 0, "dropped": 0}
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name, root in roots.items():
            sizes[name] = {"files": 0, "bytes": 0}
            if not root.is_dir():
                continue
            for p in _walk(root):
                arcname = f"{name}/{p.relative_to(root)}"
                try:
                    st = p.stat()
                    if p.is_dir():
                        info = tarfile.TarInfo(arcname)
                        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, int(st.st_mtime)
                        tar.addfile(info)
                        continue
                    data = p.read_bytes()
                except OSError:  # written or removed by a running server while packing
                    continue
                if pycache is not None and p.suffix == ".pyc" and p.is_relative_to(pycache):
                    new = checked_hash_pyc(p, data)
                    if new is None:
                        pyc["dropped"] += 1
                        continue
                    pyc["converted" if new is not data else "kept"] += 1
                    data = new
                info = tarfile.TarInfo(arcname)
                info.size, info.mode = len(data), st.st_mode & 0o755
                info.mtime = st.st_mtime_ns // 1_000_000_000
                info.pax_headers = {"mtime": _ns_text(st.st_mtime_ns)}
                tar.addfile(info, io.BytesIO(data))
                sizes[name]["files"] += 1
                sizes[name]["bytes"] += len(data)
        files = sum(s["files"] for s in sizes.values())
        manifest = {
            **req["manifest"],
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "roots": sizes,
            "files": files,
            "bytes": sum(s["bytes"] for s in sizes.values()),
            "pyc": pyc,
        }
        if files == 0:
            return manifest
        body = json.dumps(manifest, indent=2, sort_keys=True).encode()
        info = tarfile.TarInfo(req["manifest_name"])
        info.size, info.mode, info.mtime = len(body), 0o644, int(time.time())
        tar.addfile(info, io.BytesIO(body))
    return manifest


def nonempty(roots: dict[str, str]) -> list[str]:
    """The roots that hold at least one file (a folder tree without files is empty)."""
    found = []
    for path in roots.values():
        for _dirpath, _dirnames, filenames in os.walk(path):
            if filenames:
                found.append(path)
                break
    return found


def _owner(user: str | None) -> tuple[int, int] | None:
    if not user or os.geteuid() != 0:
        return None
    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid


def _makedirs(path: Path, owner: tuple[int, int] | None) -> None:
    """Create path and its missing parents (0755, the owner's: the service user's folders)."""
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=0o755)
        d.chmod(0o755)
        if owner:
            os.chown(d, *owner)


def unpack(req: dict[str, Any]) -> dict[str, Any]:
    """Unpack the seed into empty roots; refuse members outside them. Never overwrites."""
    roots = {name: Path(path) for name, path in req["roots"].items()}
    full = nonempty(req["roots"])
    if full:
        return {"unpacked": False, "why": f"not empty: {', '.join(full)}"}
    owner = _owner(req.get("owner"))
    files = size = 0
    with tarfile.open(req["tar"], mode="r:") as tar:
        for m in tar:
            if m.name == req["manifest_name"]:
                continue
            top, _, rest = m.name.partition("/")
            parts = Path(rest).parts
            if top not in roots or not rest or rest.startswith("/") or ".." in parts:
                raise ValueError(f"member {m.name!r} is outside the seed's roots")
            target = roots[top].joinpath(*parts)
            if m.isdir():
                _makedirs(target, owner)
                continue
            if not m.isfile():
                raise ValueError(f"member {m.name!r} is not a file or folder")
            _makedirs(target.parent, owner)
            src = tar.extractfile(m)
            assert src is not None  # a regular file
            # O_EXCL: a file that appeared meanwhile is never overwritten.
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, m.mode & 0o755 | 0o600)
            with os.fdopen(fd, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            os.chmod(target, m.mode & 0o755 | 0o600)
            if owner:
                os.chown(target, *owner)
            # Kept to the nanosecond: ninja (FlashInfer's JIT) compares them (member_mtime_ns).
            ns = member_mtime_ns(m)
            os.utime(target, ns=(ns, ns))
            files += 1
            size += m.size
    return {"unpacked": True, "files": files, "bytes": size}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("pack", "check", "unpack"):
        print("usage: python3 cacheseed.py pack|check|unpack '<request json>'", file=sys.stderr)
        return 2
    try:
        req = json.loads(args[1])
    except ValueError as exc:
        print(f"cacheseed: the request is not JSON: {exc}", file=sys.stderr)
        return 2
    if args[0] == "check":
        print(json.dumps({"nonempty": nonempty(req["roots"])}))
        return 0
    if args[0] == "unpack":
        try:
            print(json.dumps(unpack(req)))
        except (OSError, ValueError, tarfile.TarError) as exc:
            print(f"cacheseed: cannot unpack {req['tar']}: {exc}", file=sys.stderr)
            return 2
        return 0
    manifest = pack(req, sys.stdout.buffer)
    sys.stdout.buffer.flush()
    if manifest["files"] == 0:
        where = ", ".join(req["roots"].values())
        print(f"cacheseed: no cache files under {where}", file=sys.stderr)
        return NOTHING_TO_PACK
    print(json.dumps(manifest, sort_keys=True), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
