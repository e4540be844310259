"""bench/gpu_device_steps.sh send/recv and bench/gpu_wheelhouse.py install, run for real (bash,
pip) on a copy of the script and a wheel built here: issue 31's new-user faults."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import REPO


def _steps(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    bench = tmp_path / "repo" / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "bench" / "gpu_device_steps.sh", bench)
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    return subprocess.run(
        ["bash", str(bench / "gpu_device_steps.sh"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_send_puts_one_piece_in_the_carried_folder_and_recv_takes_it(tmp_path: Path) -> None:
    lane = tmp_path / "repo" / ".gpulane"
    lane.mkdir(parents=True)
    for n in (1, 2, 12):
        (lane / f"chunk-{n:02d}").write_bytes(bytes([n]) * 10)
    r = _steps(tmp_path, "send", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (lane / "send").iterdir()) == ["chunk-02"]
    assert "of 3 pieces" in r.stdout
    assert _steps(tmp_path, "send", "12").returncode == 0
    assert [p.name for p in (lane / "send").iterdir()] == ["chunk-12"]
    assert _steps(tmp_path, "recv").returncode == 0
    assert (tmp_path / "home" / "wh" / "chunk-12").read_bytes() == bytes([12]) * 10


def test_send_refuses_a_missing_or_malformed_piece(tmp_path: Path) -> None:
    (tmp_path / "repo" / ".gpulane").mkdir(parents=True)
    r = _steps(tmp_path, "send", "3")
    assert r.returncode == 2 and ".gpulane/chunk-03: no such piece" in r.stderr
    r = _steps(tmp_path, "send", "3;id")
    assert r.returncode == 2 and "piece number" in r.stderr
    assert not (tmp_path / "repo" / ".gpulane" / "send").exists()


def _wheel(folder: Path, name: str) -> Path:
    """A minimal real wheel pip installs: one module and its dist-info."""
    whl = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{name}.py", "VALUE = 1\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", "")
    return whl


def _install(house: Path, target: Path, *args: str) -> subprocess.CompletedProcess[str]:
    script = str(REPO / "bench" / "gpu_wheelhouse.py")
    return subprocess.run(
        [
            sys.executable,
            script,
            "install",
            "--wheelhouse",
            str(house),
            "--target",
            str(target),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_install_of_an_absent_cubin_is_nothing_to_do(tmp_path: Path) -> None:
    house = tmp_path / "wh"
    house.mkdir()
    _wheel(house, "vfleet_demo_pkg")
    # before the fix pip was called with no wheel: "You must give at least one requirement"
    r = _install(house, tmp_path / "cubin", "--only", "flashinfer-cubin")
    assert r.returncode == 0, r.stderr
    assert "nothing to install" in r.stdout
    r = _install(house, tmp_path / "site", "--leave", "flashinfer-cubin")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "vfleet_demo_pkg.py").is_file()


def test_install_from_an_empty_wheelhouse_says_what_to_carry(tmp_path: Path) -> None:
    (tmp_path / "wh").mkdir()
    r = _install(tmp_path / "wh", tmp_path / "site")
    assert r.returncode == 2 and "send N" in r.stderr and "Traceback" not in r.stderr


def test_install_names_a_missing_piece_and_keeps_the_others(tmp_path: Path) -> None:
    import tarfile

    wheels, house = tmp_path / "wheels", tmp_path / "wh"
    wheels.mkdir()
    house.mkdir()
    for i in range(3):
        (wheels / f"big{i}.whl").write_bytes(os.urandom(20_000))
    whole = tmp_path / "w.tar"
    with tarfile.open(whole, "w") as tar:
        for f in sorted(wheels.iterdir()):
            tar.add(f, arcname=f.name)
    data = whole.read_bytes()
    size = 16_384
    pieces = [data[i : i + size] for i in range(0, len(data), size)]
    assert len(pieces) >= 3
    for n, piece in enumerate(pieces, 1):
        if n != 2:
            (house / f"chunk-{n:02d}").write_bytes(piece)
    r = _install(house, tmp_path / "site")
    assert r.returncode == 2 and "pieces missing: chunk-02" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    # the last piece missing: the join is short, named, and the pieces stay for a retry
    (house / "chunk-02").write_bytes(pieces[1])
    (house / f"chunk-{len(pieces):02d}").unlink()
    r = _install(house, tmp_path / "site")
    assert r.returncode == 2 and "do not join" in r.stderr and "Traceback" not in r.stderr
    assert (house / "chunk-01").is_file() and not (house / "wheels.tar").exists()
    # nothing half-unpacked: no wheel, whole or cut, is left beside the pieces
    assert not list(house.glob("*.whl")) and not (house / ".unpack").exists()


def test_install_joins_the_pieces_and_installs_their_wheels(tmp_path: Path) -> None:
    import tarfile

    wheels, house = tmp_path / "wheels", tmp_path / "wh"
    wheels.mkdir()
    house.mkdir()
    _wheel(wheels, "vfleet_joined_pkg")
    whole = tmp_path / "w.tar"
    with tarfile.open(whole, "w") as tar:
        for f in wheels.iterdir():
            tar.add(f, arcname=f.name)
    data = whole.read_bytes()
    for n, i in enumerate(range(0, len(data), 4096), 1):
        (house / f"chunk-{n:02d}").write_bytes(data[i : i + 4096])
    r = _install(house, tmp_path / "site")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "vfleet_joined_pkg.py").is_file()
    assert [p.name for p in house.iterdir()] == ["vfleet_joined_pkg-1.0-py3-none-any.whl"]
