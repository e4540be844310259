"""Cache seeds: an instance's compile caches from one host, for another host's first start.

`vfleet caches pack HOST` (src/vfleet/fleet/caches.py) tars a running instance's compile caches
(the rule `caches`' folders under the instance cache dir, and FlashInfer's JIT under the
instance HOME) with a manifest saying what they were made with; a deploy given the tar as
`vfleet_cache_seed` unpacks it into an instance whose caches are empty, before its first start,
when the manifest matches the host's plan. This module owns the manifest: its name, format,
what it must match and the verdict the plan carries (`CacheSeed`). The host's part is
src/vfleet/hostside/cacheseed.py. Why the paths must be the same: torch.compile's and
FlashInfer's caches are keyed by path (docs/CACHES.md).

A seed is signed (`ssh-keygen -Y sign`, by `vfleet caches pack --key`); the plan reads only a
seed whose signature one of vfleet_cache_seed_allowed_signers' keys made, so a deploy stops in
preflight on an unsigned or wrongly signed one. The host verifies it again before it unpacks
(docs/SECURITY.md, "Cache seeds").
"""

from __future__ import annotations

import contextlib
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vfleet.config.schema import Accelerator, Stack
from vfleet.errors import VfleetError
from vfleet.hostside.cacheseed import SeedError, parse_manifest, read_seed, verify

MANIFEST = "vfleet-cache-seed.json"
# Raised when the manifest's meaning changes; a seed of another format never matches.
# 2: every member listed with its size and sha256, signed; bytecode compiled at pack.
FORMAT = 2
# FlashInfer's JIT builds under ~/.cache/flashinfer; launch.sh sets HOME to the instance's.
FLASHINFER_UNDER_HOME = ".cache/flashinfer"
# The mtime the role gives every venv file but .py and .pyc after an install, on every host
# (2000-01-01). ninja, which FlashInfer's JIT runs at each load, rebuilds an output older than
# any of its inputs, and pip stamps each file it installs with the install time: without a
# fixed time a fresh host's venv headers are newer than any seed's JIT objects. Python sources
# keep theirs: a timestamp pyc checks mtime and size, and a changed file of the same size under
# a fixed mtime would pass for the old one.
VENV_FILE_TIME = 946_684_800
# Disk a seed's unpack leaves free on the host beyond its own size (cacheseed.py refuses a seed
# that would leave less): the caches' filesystem also holds the model and the logs.
KEEP_FREE_BYTES = 2**30
# What a seed must share with the host's plan to be unpacked, in the order mismatches are told.
MATCHED = ("format", "stack", "vllm", "torch", "python", "accelerator", "cache_dir", "home_dir")


def accelerator_key(acc: Accelerator) -> str:
    """cpu, or cuda-sm<compute capability> (compiled kernels are per architecture)."""
    if acc.kind == "cpu" or acc.compute_capability is None:
        return "cpu"
    return "cuda-sm" + acc.compute_capability.replace(".", "")


def identity(
    stack_name: str, stack: Stack, acc: Accelerator, cache_dir: str, home_dir: str
) -> dict[str, Any]:
    """The manifest's fields a seed must match (MATCHED), for one instance's plan."""
    return {
        "format": FORMAT,
        "stack": stack_name,
        "vllm": stack.vllm,
        "torch": stack.torch,
        "python": stack.python,
        "accelerator": accelerator_key(acc),
        "cache_dir": cache_dir,
        "home_dir": home_dir,
    }


def roots(cache_dir: str, home_dir: str) -> dict[str, str]:
    """The folders a seed carries, by the name their members sit under in the tar."""
    return {"cache": cache_dir, "flashinfer": f"{home_dir}/{FLASHINFER_UNDER_HOME}"}


def mismatches(manifest: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Each field of MATCHED where the seed differs from the host's plan, named."""
    return [
        f"{key}: seed {manifest.get(key)!r}, this host {want[key]!r}"
        for key in MATCHED
        if manifest.get(key) != want[key]
    ]


def _bad(path: str, what: str, key: str = "vfleet_cache_seed") -> VfleetError:
    return VfleetError(
        what,
        where=path,
        key=key,
        fix="make one with `vfleet caches pack HOST --key KEY --out FILE.tar`, or unset "
        "vfleet_cache_seed",
    )


def read_manifest(path: str) -> dict[str, Any]:
    """The seed's manifest, checked against its members' headers (not its signature).
    VfleetError (file + fix) when the file is not a readable seed."""
    with _seed_errors(path), tarfile.open(path, mode="r:") as tar:
        return parse_manifest(read_seed(tar, MANIFEST, None))


@contextlib.contextmanager
def _seed_errors(path: str) -> Iterator[None]:
    """A seed that cannot be read or is refused: VfleetError naming the file."""
    try:
        yield
    except FileNotFoundError:
        raise _bad(path, "cache seed not found") from None
    except (OSError, tarfile.TarError) as exc:
        raise _bad(path, f"cache seed is not a readable tar ({exc})") from None
    except SeedError as exc:
        raise _bad(path, f"cache seed refused: {exc}") from None


def read_signed_manifest(
    path: str, allowed_signers: str, into: dict[str, str] | None = None
) -> tuple[dict[str, Any], str]:
    """The manifest of a seed one of allowed_signers' keys signed, and that signer's name
    (members only under the roots `into`, when given)."""
    if not allowed_signers:
        raise VfleetError(
            "a cache seed needs vfleet_cache_seed_allowed_signers: seeds are signed code",
            where=path,
            key="vfleet_cache_seed_allowed_signers",
            fix="set it to an allowed_signers file on the control machine holding the "
            "operator's public key (docs/SECURITY.md, Cache seeds)",
        )
    if not os.access(allowed_signers, os.R_OK) or not os.path.isfile(allowed_signers):
        raise VfleetError(
            "cannot read the allowed signers file",
            where=allowed_signers,
            key="vfleet_cache_seed_allowed_signers",
            fix='give a readable file of lines `operator@example namespaces="vfleet-cache-seed" '
            "ssh-ed25519 AAAA...`",
        )
    with _seed_errors(path):
        with tarfile.open(path, mode="r:") as tar:
            seed = read_seed(tar, MANIFEST, into)
        manifest = parse_manifest(seed)  # first: its errors say more than a bad signature
        return manifest, verify(seed.manifest, seed.signature, allowed_signers)


@dataclass(frozen=True)
class CacheSeed:
    """What the deploy does with the seed given as vfleet_cache_seed (tasks/cache_seed.yml)."""

    path: str
    """The tar on the control machine."""
    matches: bool
    """The manifest matches this plan: unpacked where the instance's caches are empty."""
    why: str
    """One line: where the seed comes from and what matched, or each mismatch."""
    error: str | None
    """The seed is unreadable (file and fix): the deploy's preflight stops on it."""
    roots: dict[str, str]
    """The folders it is unpacked into, by member prefix (`roots()`)."""
    manifest_name: str
    """The manifest's member name (not unpacked)."""
    allowed_signers: str
    """The allowed_signers file on the control machine the host verifies the seed with."""
    pycache: str | None
    """PYTHONPYCACHEPREFIX: a pyc there is kept only when it fits the host's own source."""
    keep_free_bytes: int = KEEP_FREE_BYTES
    """Disk the unpack must leave free beyond the seed's size."""


def cache_seed(
    path: str, want: dict[str, Any], into: dict[str, str], allowed_signers: str, pycache: str | None
) -> CacheSeed:
    """The verdict on the seed at `path` for a plan whose identity() is `want`."""

    def verdict(matches: bool, why: str, error: str | None) -> CacheSeed:
        return CacheSeed(path, matches, why, error, into, MANIFEST, allowed_signers, pycache)

    try:
        manifest, signer = read_signed_manifest(path, allowed_signers, into)
    except VfleetError as exc:
        return verdict(False, "unreadable", exc.render())
    wrong = mismatches(manifest, want)
    size = manifest.get("bytes")
    made = (
        f"made on {manifest.get('source_host', '?')} at {manifest.get('created_at', '?')}, "
        f"signed by {signer}, {manifest.get('files', '?')} files, "
        + (f"{size / 2**20:.1f} MiB" if isinstance(size, int | float) else "? MiB")
    )
    if wrong:
        return verdict(False, f"{made}; does not match: {'; '.join(wrong)}", None)
    return verdict(True, f"{made}; matches (same {', '.join(MATCHED)})", None)
