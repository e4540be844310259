"""`vfleet caches pack HOST --out FILE.tar`: an instance's compile caches as a cache seed.

A fresh host's first start compiles what a warm restart reads from the instance's caches
(torch.compile, Triton, FlashInfer's JIT, Python bytecode; docs/CACHES.md has the measured
figures). The caches' paths are the profile's (vfleet_base_dir), the same on every host, so a
deploy can give a fresh host the caches of an earlier start on a host with the same stack and
accelerator: pack them here, then deploy with `vfleet_cache_seed: FILE.tar`.

HOST is an inventory host, reached as `vfleet doctor` reaches it (ssh with the inventory's user,
port, key and become; locally for ansible_connection: local). The instance's plan is built as
the deploy builds it (options, else the host's vfleet_* vars): its cache dir and HOME say what
to pack, its stack and accelerator what the manifest (vfleet-cache-seed.json) records.

The seed is signed here with the operator's key (`ssh-keygen -Y sign -n vfleet-cache-seed`):
the manifest lists every member's size and sha256, this machine checks them against what it
received and signs the manifest, and a deploy unpacks only a seed that a key of its
vfleet_cache_seed_allowed_signers signed (docs/SECURITY.md, "Cache seeds"). Pack only from a
fresh host that has started the instance and served no one: a seed is code the server runs.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from vfleet.errors import VfleetError
from vfleet.fleet.inventory import host_args, host_plan, host_vars, script_argv
from vfleet.hostside.cacheseed import (
    NAMESPACE,
    NOTHING_TO_PACK,
    SIG_SUFFIX,
    SeedError,
    parse_manifest,
    read_seed,
)
from vfleet.paths import hostside_script
from vfleet.render.cache_seed import MANIFEST, mismatches, roots
from vfleet.render.plan import Plan

EXAMPLES = """\
examples:
  ssh-keygen -t ed25519 -f ~/.ssh/vfleet-seed -C ops@example     # once: the operator's key
  echo "ops@example namespaces=\\"vfleet-cache-seed\\" $(cat ~/.ssh/vfleet-seed.pub)" \\
      > seeds/allowed_signers
  vfleet caches pack gpu1 -i my-inventory.yml --key ~/.ssh/vfleet-seed \\
      --out seeds/h200-vllm-0.24.0.tar
  make deploy HOST=gpu2 INVENTORY=my-inventory.yml ANSIBLE_ARGS='-e \\
      vfleet_cache_seed=seeds/h200-vllm-0.24.0.tar -e \\
      vfleet_cache_seed_allowed_signers=seeds/allowed_signers'

exit status: 0 written; 2 bad input (unknown host, ssh failed, the instance has no caches,
a missing or unreadable key).
"""
SCRIPT = hostside_script("cacheseed")
# A progress line every this many bytes received.
PROGRESS_EVERY = 256 * 2**20


def pack_request(plan: Plan, host: str) -> dict[str, Any]:
    """What cacheseed.py packs on the host for this plan, and the manifest's fixed fields."""
    return {
        "roots": roots(plan.dirs.cache, plan.dirs.home),
        # Bytecode there is compiled again from the host's sources (cacheseed.py).
        "pycache": plan.env().get("PYTHONPYCACHEPREFIX"),
        "manifest_name": MANIFEST,
        "manifest": {
            **plan.cache_identity(),
            "source_host": host,
            "instance": plan.instance,
            "profile": plan.profile,
            "gpu_model": plan.accelerator.gpu_model,
        },
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _copy(src: IO[bytes], dst: IO[bytes], host: str) -> int:
    got, told, t0 = 0, 0, time.monotonic()
    while chunk := src.read(1 << 20):
        dst.write(chunk)
        got += len(chunk)
        if got - told >= PROGRESS_EVERY:
            told = got
            print(f"  {host}: {_mib(got)} in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return got


def check_key(key: Path) -> None:
    """The signing key: a file only its owner can read (ssh-keygen refuses others anyway)."""
    fix = (
        "give --key an OpenSSH private key readable by you alone (chmod 600 KEY); make one "
        "with `ssh-keygen -t ed25519 -f ~/.ssh/vfleet-seed` and put its .pub in the "
        "deploy's vfleet_cache_seed_allowed_signers file"
    )
    try:
        st = key.stat()
        with key.open("rb"):
            pass
    except OSError as exc:
        raise VfleetError(
            f"cannot read the signing key ({exc.strerror})", where=str(key), fix=fix
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise VfleetError("the signing key is not a file", where=str(key), fix=fix)
    if st.st_mode & 0o077:
        raise VfleetError(
            f"the signing key is readable by others (mode {st.st_mode & 0o777:o})",
            where=str(key),
            fix=f"chmod 600 {key}",
        )


def seal(part: str, key: Path) -> dict[str, Any]:
    """Check every member of the packed tar against its manifest (size, sha256, plain files
    only), sign the manifest with `key` and add the signature as the last member."""
    try:
        with tarfile.open(part, mode="r:") as tar:
            seed = read_seed(tar, MANIFEST, None)
            manifest = parse_manifest(seed)
            for m, entry in zip(seed.members, manifest["members"], strict=True):
                fh = tar.extractfile(m)
                assert fh is not None
                digest = hashlib.sha256()
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
                if digest.hexdigest() != entry["sha256"]:
                    raise SeedError(f"member {m.name!r} differs from its manifest entry")
    except (OSError, SeedError, tarfile.TarError) as exc:
        raise VfleetError(f"the packed seed is not sound: {exc}", where=part) from None
    try:
        proc = subprocess.run(
            ["ssh-keygen", "-Y", "sign", "-n", NAMESPACE, "-f", str(key)],
            input=seed.manifest, capture_output=True, timeout=300, check=False,
        )  # fmt: skip
    except FileNotFoundError:
        raise VfleetError("ssh-keygen not found", fix="install OpenSSH's client") from None
    if proc.returncode != 0 or not proc.stdout:
        raise VfleetError(
            f"ssh-keygen could not sign with the key: {proc.stderr.decode(errors='replace')}",
            where=str(key),
            fix="check the key and its passphrase (ssh-keygen -y -f KEY)",
        )
    info = tarfile.TarInfo(MANIFEST + SIG_SUFFIX)
    info.size, info.mode, info.mtime = len(proc.stdout), 0o644, int(time.time())
    with tarfile.open(part, mode="a", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(proc.stdout))
    return manifest


def fetch(
    host: str, hv: dict[str, Any], python: str, req: dict[str, Any], out: Path, key: Path
) -> None:
    """Run the pack on the host and write its tar to `out` (renamed into place when whole)."""
    argv, stdin, target = script_argv(host, hv, python, SCRIPT, ["pack", json.dumps(req)])
    fd, part = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as dst, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=err,
                )
            except FileNotFoundError:
                raise VfleetError(f"{argv[0]} not found", where=f"host {host}") from None
            assert proc.stdout is not None
            if stdin is not None:
                assert proc.stdin is not None
                # A thread: the script is small, but a blocked write must not stop the read.
                feeder = threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True)
                feeder.start()
            got = _copy(proc.stdout, dst, host)
            rc = proc.wait()
            err.seek(0)
            said = err.read().decode(errors="replace").strip()
        _check_rc(rc, host, target, argv, req, said, python)
        manifest = seal(part, key)
        wrong = mismatches(manifest, req["manifest"])
        if wrong:  # the script writes what it is given: this would be a bug, not bad input
            raise VfleetError(f"the packed manifest differs from the plan: {wrong}", where=part)
        os.chmod(part, 0o644)  # mkstemp's 0600; a seed holds no secret
        os.replace(part, out)
    finally:
        Path(part).unlink(missing_ok=True)
    print(
        f"{host}: wrote {out} ({_mib(got)}): {manifest['files']} files, "
        + ", ".join(
            f"{name} {r['files']} files {_mib(r['bytes'])}" for name, r in manifest["roots"].items()
        )
        + f"; bytecode compiled from the host's sources {manifest['pyc']['compiled']}, "
        f"left out (no source) {manifest['pyc']['dropped']}; signed with {key}",
        file=sys.stderr,
    )


def _feed(pipe: IO[bytes], text: str) -> None:
    try:
        pipe.write(text.encode())
        pipe.close()
    except OSError:  # the far end exited early: its exit status says why
        pass


def _check_rc(
    rc: int,
    host: str,
    target: str,
    argv: list[str],
    req: dict[str, Any],
    said: str,
    python: str,
) -> None:
    if rc == 0:
        return
    if rc == 255 and argv[0] == "ssh":
        raise VfleetError(
            f"ssh to {target} failed: {said[-600:]}",
            where=f"host {host}",
            fix=f"check that `{' '.join(argv[:-1])} true` works without a password "
            "(user, port, key and ssh args come from the inventory)",
        )
    if rc == NOTHING_TO_PACK:
        where = " and ".join(req["roots"].values())
        raise VfleetError(
            f"instance {req['manifest']['instance']} has no compile caches under {where} "
            "(never started, or its caches were removed)",
            where=f"host {host}",
            fix=f"start it once (make deploy HOST={host}) so that it compiles, then pack; or "
            "name the instance that has run (--instance NAME)",
        )
    raise VfleetError(
        f"cacheseed.py failed on {target} (exit {rc}): {said[-600:]}",
        where=f"host {host}",
        fix=f"the host needs Python >= 3.11 as `{python}` (vfleet_python in the inventory)",
    )


def cmd_pack(a: argparse.Namespace) -> int:
    out, key = Path(a.out), Path(a.key).expanduser()
    check_key(key)
    if not out.parent.is_dir():
        raise VfleetError(
            "the folder of --out does not exist", where=str(out), fix="create it first"
        )
    hv = host_vars(a.inventory, a.host)
    plan, python = host_plan(a, hv)
    req = pack_request(plan, a.host)
    print(
        f"{a.host}: packing instance {plan.instance}'s caches "
        f"({' and '.join(req['roots'].values())}; stack {plan.software.stack_name}, "
        f"vLLM {plan.software.stack.vllm}, {req['manifest']['accelerator']})",
        file=sys.stderr,
    )
    fetch(a.host, hv, python, req, out, key)
    print(
        f"deploy a host of the same stack and accelerator with it: vfleet_cache_seed: {out} "
        "(host or group var; docs/CACHES.md)",
        file=sys.stderr,
    )
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "caches",
        help="cache seeds: an instance's compile caches for another host's first start",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    csub = p.add_subparsers(dest="caches_command", required=True, metavar="COMMAND")
    pk = csub.add_parser(
        "pack",
        help="tar a host's instance caches with a manifest, here",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    host_args(pk)
    pk.add_argument("--out", required=True, metavar="FILE.tar", help="the seed to write here")
    pk.add_argument(
        "--key",
        required=True,
        metavar="KEY",
        help="the operator's OpenSSH private key (mode 0600) that signs the seed here "
        "(ssh-keygen -Y sign -n vfleet-cache-seed); hosts accept it when its public key is "
        "in vfleet_cache_seed_allowed_signers",
    )
    pk.set_defaults(fn=cmd_pack)
