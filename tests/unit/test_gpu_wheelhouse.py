"""bench/gpu_wheelhouse.py without network or GPU: the placeholder wheels pip takes for what the
CUDA machine has, the rules for what is left out, and the pieces joined and installed again
with the real pip (`--no-index --no-deps --target`), skipping what the running Python already
has at a version the set accepts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from types import ModuleType

from tests.conftest import REPO


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gpu_wheelhouse", REPO / "bench" / "gpu_wheelhouse.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_wheelhouse"] = mod
    spec.loader.exec_module(mod)
    return mod


wh = _load()


def test_a_placeholder_wheel_installs_with_pip_and_reads_back_its_version(tmp_path: Path) -> None:
    wheel = wh._placeholder_wheel(tmp_path, "torch", "2.11.0+cu130")
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    dists = list(metadata.distributions(path=[str(target)]))
    assert [(d.metadata["Name"], d.version) for d in dists] == [("torch", "2.11.0+cu130")]


def test_what_the_machine_has_or_the_lane_does_not_need_is_left_out() -> None:
    for name in (
        "torch",
        "nvidia-cublas",
        "cuda-bindings",
        "tokenspeed_triton",
        "flashinfer-cubin",
        "numba",
        "quack-kernels",
    ):
        assert wh._left_out(name, set()), name
    for name in ("vllm", "flashinfer-python", "xgrammar", "fastapi"):
        assert not wh._left_out(name, set()), name
    # carried on request
    assert not wh._left_out("flashinfer_cubin", {"flashinfer-cubin"})


def _wheel_with_requirement(folder: Path, name: str, version: str, requires: str) -> Path:
    path = wh._placeholder_wheel(folder, name, version)
    with zipfile.ZipFile(path) as src:
        files = {n: src.read(n) for n in src.namelist()}
    meta = f"{name}-{version}.dist-info/METADATA"
    files[meta] += f"Requires-Dist: {requires}\n".encode()
    with zipfile.ZipFile(path, "w") as dst:
        for n, data in files.items():
            dst.writestr(n, data)
    return path


def test_pieces_join_and_install_skipping_what_this_python_has(tmp_path: Path) -> None:
    wheels, out = tmp_path / "wheels", tmp_path / "house"
    wheels.mkdir()
    out.mkdir()
    have = metadata.version("packaging")
    wh._placeholder_wheel(wheels, "vfleet_demo_a", "1.0")
    # the set asks packaging >= what this Python has: satisfied, so skipped
    _wheel_with_requirement(wheels, "vfleet_demo_b", "2.0", f"packaging>={have}")
    wh._placeholder_wheel(wheels, "packaging", "0.1")
    wh._placeholder_wheel(wheels, "torch", "2.11.0")  # left out when chunking
    assert wh._chunk(out, wheels, 1500, set()) == 0
    pieces = sorted(out.glob("chunk-*"))
    assert len(pieces) > 2 and all(p.stat().st_size <= 1500 for p in pieces)
    assert not (wheels / "torch-2.11.0-py3-none-any.whl").exists()
    target = tmp_path / "site"
    rc = wh.main(["install", "--wheelhouse", str(out), "--target", str(target)])
    assert rc == 0
    assert not list(out.glob("chunk-*"))
    got = sorted(d.metadata["Name"] for d in metadata.distributions(path=[str(target)]))
    assert got == ["vfleet_demo_a", "vfleet_demo_b"]
    # --only installs just the named one (the cubin, into its own target)
    other = tmp_path / "site2"
    assert (
        wh.main(
            ["install", "--wheelhouse", str(out), "--target", str(other), "--only", "vfleet-demo-a"]
        )
        == 0
    )
    got = [d.metadata["Name"] for d in metadata.distributions(path=[str(other)])]
    assert got == ["vfleet_demo_a"]


def test_a_kept_package_keeps_the_dependencies_its_own_copy_accepts(tmp_path: Path) -> None:
    """The H200 run of 2026-12-03: the resolved transformers wanted huggingface-hub >= 2, the
    machine's transformers (kept: it met vLLM's pin) wants < 2, and hub 2.4.0 was carried
    beside it: every import of transformers failed. Here pytest stands for the kept package
    and pluggy for its dependency: the wheelhouse's newer pytest wants a pluggy this Python's
    pytest refuses; the machine's pytest and pluggy are kept and nothing of them installed."""
    wheels, out = tmp_path / "wheels", tmp_path / "house"
    wheels.mkdir()
    out.mkdir()
    have = metadata.version("pytest")
    _wheel_with_requirement(wheels, "vfleet_demo_c", "1.0", f"pytest>={have}")
    _wheel_with_requirement(wheels, "pytest", "99.0", "pluggy>=99")
    wh._placeholder_wheel(wheels, "pluggy", "99.0")
    assert wh._chunk(out, wheels, 1 << 20, set()) == 0
    target = tmp_path / "site"
    assert wh.main(["install", "--wheelhouse", str(out), "--target", str(target)]) == 0
    got = sorted(d.metadata["Name"] for d in metadata.distributions(path=[str(target)]))
    assert got == ["vfleet_demo_c"]
