"""Cache seeds: an instance's compile caches from one host, for another host's first start.

`vfleet caches pack HOST` (src/vfleet/fleet/caches.py) tars a running instance's compile caches
(the rule `caches`' folders under the instance cache dir, and FlashInfer's JIT under the
instance HOME) with a manifest saying what they were made with; a deploy given the tar as
`vfleet_cache_seed` unpacks it into an instance whose caches are empty, before its first start,
when the manifest matches the host's plan. This module owns the manifest: its name, format,
what it must match and the verdict the plan carries (`CacheSeed`). The host's part is
src/vfleet/hostside/cacheseed.py. Why the paths must be the same: torch.compile's and
FlashInfer's caches are keyed by path (docs/CACHES.md).
"""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from typing import Any

from vfleet.config.schema import Accelerator, Stack
from vfleet.errors import VfleetError

MANIFEST = "vfleet-cache-seed.json"
# Raised when the manifest's meaning changes; a seed of another format never matches.
FORMAT = 1
# FlashInfer's JIT builds under ~/.cache/flashinfer; launch.sh sets HOME to the instance's.
FLASHINFER_UNDER_HOME = ".cache/flashinfer"
# The mtime the role gives every venv file but .py and .pyc after an install, on every host
# (2000-01-01). ninja, which FlashInfer's JIT runs at each load, rebuilds an output older than
# any of its inputs, and pip stamps each file it installs with the install time: without a
# fixed time a fresh host's venv headers are newer than any seed's JIT objects. Python sources
# keep theirs: a timestamp pyc checks mtime and size, and a changed file of the same size under
# a fixed mtime would pass for the old one.
VENV_FILE_TIME = 946_684_800
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


def _bad(path: str, what: str) -> VfleetError:
    return VfleetError(
        what,
        where=path,
        key="vfleet_cache_seed",
        fix="make one with `vfleet caches pack HOST --out FILE.tar`, or unset vfleet_cache_seed",
    )


def read_manifest(path: str) -> dict[str, Any]:
    """The seed's manifest. VfleetError (file + fix) when the file is not a readable seed."""
    try:
        with tarfile.open(path, mode="r:") as tar:
            fh = tar.extractfile(tar.getmember(MANIFEST))
            if fh is None:
                raise KeyError(MANIFEST)
            manifest = json.loads(fh.read())
    except FileNotFoundError:
        raise _bad(path, "cache seed not found") from None
    except (OSError, tarfile.TarError) as exc:
        raise _bad(path, f"cache seed is not a readable tar ({exc})") from None
    except KeyError:
        raise _bad(path, f"cache seed has no {MANIFEST} (not made by vfleet caches pack)") from None
    except ValueError as exc:
        raise _bad(path, f"cache seed's {MANIFEST} is not JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise _bad(path, f"cache seed's {MANIFEST} is not a JSON object")
    return manifest


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


def cache_seed(path: str, want: dict[str, Any], into: dict[str, str]) -> CacheSeed:
    """The verdict on the seed at `path` for a plan whose identity() is `want`."""
    try:
        manifest = read_manifest(path)
    except VfleetError as exc:
        return CacheSeed(path, False, "unreadable", exc.render(), into, MANIFEST)
    wrong = mismatches(manifest, want)
    size = manifest.get("bytes")
    made = (
        f"made on {manifest.get('source_host', '?')} at {manifest.get('created_at', '?')}, "
        f"{manifest.get('files', '?')} files, "
        + (f"{size / 2**20:.1f} MiB" if isinstance(size, int | float) else "? MiB")
    )
    if wrong:
        why = f"{made}; does not match: {'; '.join(wrong)}"
        return CacheSeed(path, False, why, None, into, MANIFEST)
    return CacheSeed(
        path, True, f"{made}; matches (same {', '.join(MATCHED)})", None, into, MANIFEST
    )
