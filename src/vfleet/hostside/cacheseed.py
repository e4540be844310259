"""Pack and unpack an instance's compile caches on a serving host. Python 3.11 stdlib only.

A cache seed is a tar of an instance's compile caches (docs/CACHES.md), made on one host by
`vfleet caches pack`, signed on the control machine with the operator's key, and unpacked by
the deploy on another host of the same stack, accelerator and paths before its first start.
This script does the host's part; the control machine decides what to pack and whether a seed
matches (src/vfleet/render/cache_seed.py), and passes everything in the request, so nothing
here repeats a vfleet name or path.

    python3 cacheseed.py pack   '<request json>'   > seed.tar   (over ssh: python3 - pack ...)
    python3 cacheseed.py check  '<request json>'   one JSON line: are the roots empty?
    python3 cacheseed.py unpack '<request json>'   one JSON line: what was unpacked

Layout: regular files `<root name>/<path under that root>`, then the manifest (every member's
name, size, sha256, mode and mtime), then its signature (`ssh-keygen -Y sign`, added by the
control machine). Nothing else: no folders, links, devices or sparse members.

Links (docs/SECURITY.md, "Cache seeds"): as root, pack drops to the caches' owner and unpack
to the service user (the request's `owner`) before they touch a cache folder, so a link planted
by that user leads only where it could read or write anyway, and nothing is chowned. On top of
that a link is refused as a root, anywhere in a root's tree, and in any folder of a root's
path that is not root's alone; below a root everything is opened relative to a folder
descriptor with O_NOFOLLOW. Unpack verifies the signature as root before it drops, writes
into a staging folder beside the caches, checks every member's size and sha256 as it is
written, and renames the whole into place only when all of it was right.

Bytecode is never carried from the cache: pack compiles each module whose pyc is in the
pycache folder again from its source into a checked-hash pyc (PEP 552), so what a Python there
planted into its pycache is not carried; unpack keeps a pyc only when its source hash is the
one of the target host's own source file.

Exit status: 0 done, 2 bad request or refused seed, 3 nothing to pack.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import marshal
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

NOTHING_TO_PACK = 3
# PEP 552 flags: bit 0 hash-based, bit 1 check_source.
CHECKED_HASH = 0b11
# ssh-keygen -Y's namespace: a signature made for anything else never verifies as a seed's.
NAMESPACE = "vfleet-cache-seed"
SIG_SUFFIX = ".sig"
# A manifest lists ~6,000 members in ~1 MiB; a signature is under 1 KiB.
MANIFEST_MAX = 64 * 2**20
SIG_MAX = 64 * 2**10
# Staging folders (unpack) start with this; `check` does not count what one holds.
STAGING = ".vfleet-seed-"
REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE)
NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class SeedError(ValueError):
    """A refused request or seed: exit 2 with this message, nothing written."""


# ------------------------------------------------------------------------- privileges, links


def drop_to(user: str | None) -> None:
    """As root, become `user` (groups, gid, uid) for good; otherwise stay who we are."""
    if not user or os.geteuid() != 0:
        return
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise SeedError(f"the service user {user!r} does not exist on this host") from None
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


def drop_to_owner_of(roots: dict[str, str]) -> None:
    """As root, become the owner of the first root that exists (the role gives the caches to
    the service user): pack then reads only what that user could read. A root owned by root
    (a deploy from before the service user) keeps root, with links still never followed."""
    if os.geteuid() != 0:
        return
    for root in roots.values():
        if check_path(root) != root:
            continue
        fd = os.open(root, NOFOLLOW_DIR)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if st.st_uid != 0:
            os.setgroups([])
            os.setgid(st.st_gid)
            os.setuid(st.st_uid)
        return


def _trusted_folder(st: os.stat_result) -> bool:
    """Root's folder that no one else may write: a link in it is the operator's."""
    return st.st_uid == 0 and not st.st_mode & 0o022


def check_path(root: str) -> str:
    """Refuse a root that is a link, or whose path has a link in a folder anyone but root may
    change. Returns the nearest existing folder of root's path (root itself if it exists)."""
    if not os.path.isabs(root) or os.path.normpath(root) != root:
        raise SeedError(f"{root!r} is not a plain absolute path")
    parts = root.strip("/").split("/")
    here, parent_st = "/", os.lstat("/")
    for i, name in enumerate(parts):
        path = os.path.join(here, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return here
        if stat.S_ISLNK(st.st_mode):
            if i == len(parts) - 1:
                raise SeedError(f"{path} is a symbolic link: a cache root must be a real folder")
            if not _trusted_folder(parent_st):
                raise SeedError(
                    f"{path} is a symbolic link in {here}, a folder others than root can change"
                )
            st = os.stat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise SeedError(f"{path} is not a folder")
        here, parent_st = path, st
    return here


def _tree(dirfd: int) -> Iterator[tuple[str, list[str], list[str], int]]:
    """os.fwalk below an open folder, links never followed."""
    yield from os.fwalk(".", dir_fd=dirfd, follow_symlinks=False)


def nonempty(roots: dict[str, str]) -> list[str]:
    """The roots that hold at least one file (folders without files are empty). A root that is
    a link counts as empty here: unpack refuses it with the reason."""
    found = []
    for path in roots.values():
        try:
            fd = os.open(path, NOFOLLOW_DIR)
        except OSError:
            continue
        try:
            for dirpath, dirnames, filenames, _fd in _tree(fd):
                if dirpath == ".":
                    dirnames[:] = [d for d in dirnames if not d.startswith(STAGING)]
                if filenames:
                    found.append(path)
                    break
        finally:
            os.close(fd)
    return found


# ------------------------------------------------------------------------- bytecode


def pyc_source(pyc: str, pycache: str) -> str | None:
    """The source a pyc under the PYTHONPYCACHEPREFIX folder `pycache` stands for; None for an
    optimised one (.opt-N.pyc: vLLM runs without -O) or one outside the prefix."""
    if os.path.basename(pyc).count(".") != 2:
        return None
    saved = sys.pycache_prefix
    try:
        sys.pycache_prefix = pycache
        return importlib.util.source_from_cache(pyc)
    except ValueError:
        return None
    finally:
        sys.pycache_prefix = saved


def compiled_pyc(source: str) -> bytes | None:
    """A checked-hash pyc compiled here from `source` (as the import system compiles it), or
    None when the source cannot be read or compiled."""
    try:
        with open(source, "rb") as fh:
            src = fh.read()
        code = compile(src, source, "exec", dont_inherit=True, optimize=-1)
    except (OSError, SyntaxError, ValueError):
        return None
    flags = CHECKED_HASH.to_bytes(4, "little")
    return (
        importlib.util.MAGIC_NUMBER + flags + importlib.util.source_hash(src) + marshal.dumps(code)
    )


def pyc_matches_source(head: bytes, source: str) -> bool:
    """This Python's checked-hash pyc whose source hash is the one of `source` as it is here."""
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return False
    if int.from_bytes(head[4:8], "little") != CHECKED_HASH:
        return False
    try:
        with open(source, "rb") as fh:
            return head[8:16] == importlib.util.source_hash(fh.read())
    except OSError:
        return False


# ------------------------------------------------------------------------- pack


def _ns_text(ns: int) -> str:
    """A pax mtime with all nine decimals: tarfile's float keeps about seven."""
    return f"{ns // 1_000_000_000}.{ns % 1_000_000_000:09d}"


def _read_regular(name: str, dirfd: int) -> tuple[bytes, os.stat_result] | None:
    """A regular file's bytes, opened without following a link; None for anything else."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
    except OSError:  # a link (ELOOP), or removed by a running server meanwhile
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(), st
    finally:
        os.close(fd)


def _add(tar: tarfile.TarFile, name: str, data: bytes, mode: int, mtime_ns: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, mtime_ns // 1_000_000_000
    info.pax_headers = {"mtime": _ns_text(mtime_ns)}
    tar.addfile(info, io.BytesIO(data))


def pack(req: dict[str, Any], out: IO[bytes]) -> dict[str, Any]:
    """Write the tar to `out` (as the caches' owner); return the manifest, its last member."""
    drop_to_owner_of(req["roots"])
    pycache = req.get("pycache") or None
    members: list[dict[str, Any]] = []
    sizes: dict[str, dict[str, int]] = {}
    pyc = {"compiled": 0, "dropped": 0}
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for rname, root in req["roots"].items():
            sizes[rname] = {"files": 0, "bytes": 0}
            if check_path(root) != root:
                continue  # not there
            rfd = os.open(root, NOFOLLOW_DIR)
            try:
                for dirpath, dirnames, filenames, dfd in _tree(rfd):
                    dirnames.sort()
                    for fname in sorted(filenames):
                        rel = os.path.normpath(os.path.join(dirpath, fname))
                        got = _read_regular(fname, dfd)
                        if got is None:
                            continue
                        data, st = got
                        full = os.path.join(root, rel)
                        if pycache and full.endswith(".pyc") and full.startswith(pycache + "/"):
                            # Never the cache's bytes: compiled again from the source here.
                            source = pyc_source(full, pycache)
                            new = compiled_pyc(source) if source else None
                            pyc["dropped" if new is None else "compiled"] += 1
                            if new is None:
                                continue
                            data = new
                        name, mode = f"{rname}/{rel}", st.st_mode & 0o755 | 0o600
                        _add(tar, name, data, mode, st.st_mtime_ns)
                        members.append(
                            {
                                "name": name,
                                "size": len(data),
                                "sha256": hashlib.sha256(data).hexdigest(),
                                "mode": mode,
                                "mtime_ns": st.st_mtime_ns,
                            }
                        )
                        sizes[rname]["files"] += 1
                        sizes[rname]["bytes"] += len(data)
            finally:
                os.close(rfd)
        manifest = {
            **req["manifest"],
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "roots": sizes,
            "files": len(members),
            "bytes": sum(m["size"] for m in members),
            "pyc": pyc,
            "members": members,
        }
        if members:
            body = json.dumps(manifest, indent=1, sort_keys=True).encode()
            _add(tar, req["manifest_name"], body, 0o644, time.time_ns())
    return manifest


# ------------------------------------------------------------------------- the seed's headers


@dataclass(frozen=True)
class Seed:
    """A seed's members as its tar headers say, with its manifest and signature read."""

    members: list[tarfile.TarInfo]
    manifest: bytes
    signature: bytes | None


def _check_name(name: str, roots: dict[str, str] | None) -> None:
    top, _, rest = name.partition("/")
    parts = rest.split("/")
    if (
        not rest
        or (roots is not None and top not in roots)
        or any(p in ("", ".", "..") for p in parts)
        or parts[0].startswith(STAGING)
        or not name.isprintable()
    ):
        raise SeedError(f"member {name!r} is outside the seed's roots")


def _regular(m: tarfile.TarInfo) -> bool:
    """A plain file: not a link, device, folder, or a sparse member (which unpacks to its
    declared size from a few bytes: a 10 kB seed gave 1 GiB)."""
    sparse = m.sparse is not None or any(k.startswith("GNU.sparse") for k in m.pax_headers)
    return m.type in REGULAR and not sparse


def _read_member(tar: tarfile.TarFile, m: tarfile.TarInfo, cap: int, what: str) -> bytes:
    if not _regular(m) or m.size > cap:
        raise SeedError(f"the seed's {what} is not a plain file of at most {cap} bytes")
    fh = tar.extractfile(m)
    assert fh is not None  # a regular member
    return fh.read(cap + 1)[:cap]


def read_seed(tar: tarfile.TarFile, manifest_name: str, roots: dict[str, str] | None) -> Seed:
    """Every header (no member's data but the manifest's and signature's): only plain files
    with names under the roots, once each, then the manifest, then its signature, last."""
    members: list[tarfile.TarInfo] = []
    manifest = signature = None
    seen: set[str] = set()
    for m in tar:
        if signature is not None:
            raise SeedError(f"member {m.name!r} after the signature")
        if m.name == manifest_name + SIG_SUFFIX:
            if manifest is None:
                raise SeedError("the signature comes before the manifest")
            signature = _read_member(tar, m, SIG_MAX, "signature")
            continue
        if manifest is not None:
            raise SeedError(f"member {m.name!r} after the manifest")
        if m.name == manifest_name:
            manifest = _read_member(tar, m, MANIFEST_MAX, f"manifest {manifest_name}")
            continue
        _check_name(m.name, roots)
        if not _regular(m):
            raise SeedError(f"member {m.name!r} is not a plain file (link, folder, sparse)")
        if m.name in seen:
            raise SeedError(f"member {m.name!r} appears twice")
        seen.add(m.name)
        members.append(m)
    if manifest is None:
        raise SeedError(f"the seed has no {manifest_name} (not made by vfleet caches pack)")
    return Seed(members, manifest, signature)


def _entry_ok(e: Any) -> bool:
    """One member of the manifest as pack writes it (types checked: no traceback later)."""
    ints = ("size", "mode", "mtime_ns")
    return (
        isinstance(e, dict)
        and isinstance(e.get("name"), str)
        and all(isinstance(e.get(k), int) and e[k] >= 0 for k in ints)
        and isinstance(e.get("sha256"), str)
        and len(e["sha256"]) == 64
        and all(c in "0123456789abcdef" for c in e["sha256"])
    )


def parse_manifest(seed: Seed) -> dict[str, Any]:
    """The manifest, which must list the tar's members in order with their sizes."""
    try:
        manifest = json.loads(seed.manifest)
    except ValueError as exc:
        raise SeedError(f"the manifest is not JSON ({exc})") from None
    listed = manifest.get("members") if isinstance(manifest, dict) else None
    if not isinstance(listed, list):
        raise SeedError("the manifest lists no members (a seed of an older format)")
    if not all(_entry_ok(e) for e in listed):
        raise SeedError("the manifest's members are not {name, size, sha256, mode, mtime_ns}")
    want = [(e["name"], e["size"]) for e in listed]
    got = [(m.name, m.size) for m in seed.members]
    if want != got:
        diff = next(
            (f"{g} where the manifest says {w}" for g, w in zip(got, want, strict=False) if g != w),
            f"{len(got)} members, the manifest lists {len(want)}",
        )
        raise SeedError(f"the members are not the ones the manifest lists: {diff}")
    assert isinstance(manifest, dict)
    return manifest


def verify(manifest: bytes, signature: bytes | None, allowed_signers: str) -> str:
    """The principal of allowed_signers whose key signed the manifest (ssh-keygen -Y, namespace
    NAMESPACE); SeedError for an unsigned seed or a signature none of them made."""
    if signature is None:
        raise SeedError("the seed is not signed: pack it with `vfleet caches pack --key KEY`")
    with tempfile.TemporaryDirectory(prefix="vfleet-seed-sig-") as tmp:
        sig = os.path.join(tmp, "manifest.sig")
        with open(sig, "wb") as fh:
            fh.write(signature)
        found = subprocess.run(
            ["ssh-keygen", "-Y", "find-principals", "-s", sig, "-f", allowed_signers],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        principals = found.stdout.decode(errors="replace").split()
        if found.returncode != 0 or not principals:
            raise SeedError(
                f"the seed's signature is by no key of {allowed_signers}: "
                + (found.stderr.decode(errors="replace").strip() or "no principal matches")
            )
        ok = subprocess.run(
            ["ssh-keygen", "-Y", "verify", "-f", allowed_signers, "-I", principals[0],
             "-n", NAMESPACE, "-s", sig],
            input=manifest, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
    if ok.returncode != 0:
        said = (ok.stdout + ok.stderr).decode(errors="replace").strip()
        raise SeedError(f"the seed's signature does not verify: {said}")
    return principals[0]


# ------------------------------------------------------------------------- unpack


def _opendir(name: str, dirfd: int, create: bool) -> int:
    """A folder below dirfd, never through a link (made 0755 when missing and `create`)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=dirfd)
    try:
        return os.open(name, NOFOLLOW_DIR, dir_fd=dirfd)
    except OSError as exc:
        raise SeedError(f"{name} is not a plain folder ({exc.strerror})") from None


def _no_links(root: str) -> None:
    """Refuse a root whose tree holds anything but folders (files make it non-empty)."""
    try:
        fd = os.open(root, NOFOLLOW_DIR)
    except FileNotFoundError:
        return
    try:
        for dirpath, dirnames, filenames, dfd in _tree(fd):
            if dirpath == ".":  # this unpack's own staging folder
                dirnames[:] = [d for d in dirnames if not d.startswith(STAGING)]
            for name in filenames:
                st = os.lstat(name, dir_fd=dfd)
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a plain file"
                raise SeedError(f"{os.path.join(root, dirpath, name)} is {what}")
            for name in dirnames:
                if stat.S_ISLNK(os.lstat(name, dir_fd=dfd).st_mode):
                    raise SeedError(f"{os.path.join(root, dirpath, name)} is a symbolic link")
    finally:
        os.close(fd)


def _merge(src: int, dst: int, where: str) -> None:
    """Rename what the staging folder `src` holds into `dst`, descending into folders that
    exist there (empty ones: the roots were checked empty); never over a file or a link."""
    for name in sorted(os.listdir(src)):
        st = os.lstat(name, dir_fd=src)
        try:
            there = os.lstat(name, dir_fd=dst)
        except FileNotFoundError:
            os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
            continue
        if not (stat.S_ISDIR(st.st_mode) and stat.S_ISDIR(there.st_mode)):
            raise SeedError(f"{os.path.join(where, name)} appeared while unpacking")
        a, b = _opendir(name, src, False), _opendir(name, dst, False)
        try:
            _merge(a, b, os.path.join(where, name))
        finally:
            os.close(a)
            os.close(b)


def _write(fh: IO[bytes], into: int, rel: str, entry: dict[str, Any]) -> None:
    """One member into the staging folder `into`, checked against its manifest entry."""
    *dirs, fname = rel.split("/")
    fds = [into]
    try:
        for folder in dirs:
            fds.append(_opendir(folder, fds[-1], True))
        mode = int(entry["mode"]) & 0o755 | 0o600
        fd = os.open(
            fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=fds[-1]
        )
        digest, left = hashlib.sha256(), int(entry["size"])
        with os.fdopen(fd, "wb") as out:
            while left and (chunk := fh.read(min(left, 1 << 20))):
                digest.update(chunk)
                out.write(chunk)
                left -= len(chunk)
            out.flush()
            os.fchmod(out.fileno(), mode)
            # Kept to the nanosecond: ninja (FlashInfer's JIT) compares them (docs/CACHES.md).
            ns = int(entry["mtime_ns"])
            os.utime(out.fileno(), ns=(ns, ns))
        if left or digest.hexdigest() != entry["sha256"]:
            raise SeedError(f"member {rel!r}: its content is not the one the manifest signs")
    finally:
        for fd in fds[1:]:
            os.close(fd)


def after_staging() -> None:
    """Called once everything is staged, before the final check and the renames (a test
    swaps a link in here: a race it cannot produce otherwise)."""


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def unpack(req: dict[str, Any]) -> dict[str, Any]:
    """Verify the seed, then (as the owner) unpack it into empty roots. All or nothing."""
    roots: dict[str, str] = req["roots"]
    allowed = req.get("allowed_signers")
    if not allowed:
        raise SeedError("no allowed_signers in the request: an unsigned seed is never unpacked")
    # Root's part: read the tar and verify the signature before anything is written.
    with open(req["tar"], "rb") as raw, tarfile.open(fileobj=raw, mode="r:") as tar:
        seed = read_seed(tar, req["manifest_name"], roots)
        signer = verify(seed.manifest, seed.signature, allowed)
        manifest = parse_manifest(seed)
        drop_to(req.get("owner"))
        full = nonempty(roots)
        if full:
            return {"unpacked": False, "why": f"not empty: {', '.join(full)}"}
        base = {name: check_path(path) for name, path in roots.items()}
        for path in roots.values():
            _no_links(path)
        total = sum(m.size for m in seed.members)
        keep = int(req.get("keep_free_bytes", 0))
        for at in base.values():
            if total + keep > _free(at):
                raise SeedError(
                    f"the seed's {total} bytes (+ {keep} kept free) do not fit in {at} "
                    f"({_free(at)} bytes free)"
                )
        return _unpack_into(tar, seed, manifest, roots, base, req.get("pycache"), signer)


def _unpack_into(
    tar: tarfile.TarFile,
    seed: Seed,
    manifest: dict[str, Any],
    roots: dict[str, str],
    base: dict[str, str],
    pycache: str | None,
    signer: str,
) -> dict[str, Any]:
    # One staging folder per root, in the nearest folder of its path that exists (the same
    # filesystem, so the final renames are renames).
    staged: dict[str, tuple[int, str, str]] = {}
    try:
        for name, path in roots.items():
            at = base[name]
            afd = os.open(at, os.O_RDONLY | os.O_DIRECTORY)
            for old in os.listdir(afd):  # what a killed unpack left
                if old.startswith(STAGING) and old.endswith(f"-{name}"):
                    shutil.rmtree(old, dir_fd=afd, ignore_errors=True)
            sname = f"{STAGING}{os.getpid()}-{name}"
            os.mkdir(sname, 0o700, dir_fd=afd)
            staged[name] = (afd, sname, os.path.relpath(path, at))
        files = size = dropped = 0
        entries = manifest["members"]
        for m, entry in zip(seed.members, entries, strict=True):
            top, _, rest = m.name.partition("/")
            afd, sname, rel = staged[top]
            target = os.path.join(roots[top], rest)
            sfd = _opendir(sname, afd, False)
            try:
                fh = tar.extractfile(m)
                assert fh is not None
                inside = os.path.normpath(os.path.join(rel, rest))
                _write(fh, sfd, inside, entry)
                if pycache and target.endswith(".pyc") and target.startswith(pycache + "/"):
                    source = pyc_source(target, pycache)
                    fd = os.open(inside, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=sfd)
                    with os.fdopen(fd, "rb") as fh2:
                        head = fh2.read(16)
                    if source is None or not pyc_matches_source(head, source):
                        os.unlink(inside, dir_fd=sfd)  # not this host's source: compiled here
                        dropped += 1
                        continue
            finally:
                os.close(sfd)
            files += 1
            size += m.size
        after_staging()
        for path in roots.values():
            _no_links(path)
        for name, (afd, sname, _rel) in staged.items():
            sfd = _opendir(sname, afd, False)
            try:
                _merge(sfd, afd, base[name])
            finally:
                os.close(sfd)
    finally:
        for afd, sname, _rel in staged.values():
            shutil.rmtree(sname, dir_fd=afd, ignore_errors=True)
            os.close(afd)
    return {
        "unpacked": True,
        "signed_by": signer,
        "files": files,
        "bytes": size,
        "pyc_left_out": dropped,
    }


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
        except (OSError, SeedError, tarfile.TarError) as exc:
            print(f"cacheseed: refused {req['tar']}: {exc}; nothing unpacked", file=sys.stderr)
            return 2
        return 0
    try:
        manifest = pack(req, sys.stdout.buffer)
    except (OSError, SeedError) as exc:
        print(f"cacheseed: cannot pack: {exc}", file=sys.stderr)
        return 2
    sys.stdout.buffer.flush()
    if manifest["files"] == 0:
        where = ", ".join(req["roots"].values())
        print(f"cacheseed: no cache files under {where}", file=sys.stderr)
        return NOTHING_TO_PACK
    summary = {k: v for k, v in manifest.items() if k != "members"}
    print(json.dumps(summary, sort_keys=True), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
