#!/usr/bin/env python3
"""Carry a vLLM stack to a CUDA machine that has torch but no network (docs/GPU.md).

`build` (here, with network): pip's resolver in report mode works out what vLLM needs for the
target's Python and platform, with placeholder wheels standing in for what the target already
has (torch, torchvision, torchaudio and numba, whose real wheels are GBs); the rest is downloaded
and packed into tar chunks small enough to travel one per call.

`install` (there, no network): unpacks the chunks and installs with `--no-index --no-deps
--target`, skipping a wheel whose distribution the target's Python already has at a version
that satisfies every requirement the resolved set puts on it.

Standard library only, except `packaging` for the skip test (pip depends on it and the CUDA
images have it).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# What the H200 machine has and vLLM 0.24.0 pins (torch==2.11.0 and its companions): resolved
# against placeholders of these exact versions, so pip keeps the machine's own.
PLACEHOLDERS = {
    "torch": "2.11.0+cu130",
    "torchvision": "0.26.0+cu130",
    "torchaudio": "2.11.0+cu130",
    "numba": "0.65.0+placeholder",
}
# Left out of the carried set: the placeholders, what the image has (its CUDA libraries, numpy,
# pillow), and what this configuration does not need to serve (measured: the lane served every
# configuration without them). flashinfer-cubin is left out by default and carried on request
# (`--with flashinfer-cubin`), to measure its effect on a cold start.
LEAVE_OUT_PREFIXES = ("nvidia-", "cuda-")
LEAVE_OUT = {
    "torch",
    "torchvision",
    "torchaudio",
    "triton",
    "numba",
    "numpy",
    "pillow",
    "tilelang",
    "z3-solver",
    "opencv-python-headless",
    "flashinfer-cubin",
}
LEAVE_OUT_MARKERS = ("quack", "humming", "nvidia-cutlass-dsl", "tokenspeed")
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)


def _canon(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _placeholder_wheel(folder: Path, name: str, version: str) -> Path:
    """A wheel with metadata only: enough for the resolver to take it as installed."""
    dist = f"{name}-{version}"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    files = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: vfleet\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    with zipfile.ZipFile(path, "w") as zf:
        for arc, text in files.items():
            data = text.encode()
            zf.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(data)}")
        record.append(f"{dist}.dist-info/RECORD,,")
        zf.writestr(f"{dist}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def _left_out(name: str, extra: set[str]) -> bool:
    n = _canon(name)
    if n in extra:
        return False
    return (
        n in LEAVE_OUT or n.startswith(LEAVE_OUT_PREFIXES) or any(m in n for m in LEAVE_OUT_MARKERS)
    )


def build(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wheels = out / "wheels"
    wheels.mkdir(exist_ok=True)
    extra = {_canon(w.split("==")[0]) for w in args.with_}
    with tempfile.TemporaryDirectory() as tmp:
        ph = Path(tmp)
        for name, version in PLACEHOLDERS.items():
            _placeholder_wheel(ph, name, version)
        plat = [f"--platform={p}" for p in PLATFORMS]
        pins = [f"{n}=={v}" for n, v in PLACEHOLDERS.items()]
        report = out / "resolve-report.json"
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--target",
            str(ph / "target"),
            "--quiet",
            "--report",
            str(report),
            "--only-binary=:all:",
            "--python-version",
            args.python_version,
            "--implementation",
            "cp",
            *plat,
            "--find-links",
            str(ph),
            "--find-links",
            str(Path(args.vllm_wheel).parent),
            args.vllm_wheel,
            *pins,
            *args.pin,
            *args.with_,
        ]
        print("resolving:", " ".join(cmd[3:8]), "...", flush=True)
        subprocess.run(cmd, check=True)
    resolved = json.loads(report.read_text())["install"]
    take: list[tuple[str, str, str]] = []
    for item in resolved:
        meta = item["metadata"]
        name, version, url = meta["name"], meta["version"], item["download_info"]["url"]
        if _left_out(name, extra) or "+cu" in version or "+placeholder" in version:
            continue
        take.append((name, version, url))
    print(f"resolved {len(resolved)} packages, carrying {len(take)}", flush=True)
    for name, version, url in take:
        if url.startswith("file://"):
            src = Path(url[len("file://") :])
            dest = wheels / src.name
            if not dest.exists():
                dest.write_bytes(src.read_bytes())
            continue
        fname = url.rsplit("/", 1)[-1]
        if (wheels / fname).exists():
            continue
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                args.python_version,
                "--implementation",
                "cp",
                *[f"--platform={p}" for p in PLATFORMS],
                "-d",
                str(wheels),
                f"{name}=={version}",
            ],
            check=True,
        )
    for w in wheels.glob("vllm-*.whl"):
        _strip(w)
    (out / "requirements.json").write_text(
        json.dumps(
            {"python": args.python_version, "packages": [[n, v] for n, v, _ in take]}, indent=1
        )
    )
    return _chunk(out, wheels, args.chunk_mb << 20, extra)


# vLLM's FlashAttention-2 kernels (181 MB unpacked): SM90 uses FA3 and the lane's configurations
# name FLASHINFER; leaving them out saves 77 MB of transfer.
STRIP = ("vllm/vllm_flash_attn/_vllm_fa2_C",)


def _strip(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as src:
        names = [n for n in src.namelist() if n.startswith(STRIP)]
        if not names:
            return
        tmp = wheel.with_suffix(".tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename.startswith(STRIP):
                    continue
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(
                        line + b"\n"
                        for line in data.splitlines()
                        if not line.decode().startswith(STRIP)
                    )
                dst.writestr(info, data)
    tmp.replace(wheel)
    print(f"left out of {wheel.name}: {', '.join(names)}", flush=True)


def _chunk(out: Path, wheels: Path, limit: int, keep: set[str]) -> int:
    """One uncompressed tar of the wheels (they are zips already), cut into pieces of `limit`
    bytes: a call carries one piece; `install` joins them."""
    for f in list(wheels.glob("*.whl")):
        name = _canon(f.name.split("-")[0])
        if _left_out(name, keep):
            f.unlink()
    for old in out.glob("chunk-*"):
        old.unlink()
    files = sorted(wheels.glob("*.whl"))
    whole = out / "wheels.tar"
    with tarfile.open(whole, "w") as tar:
        for f in files:
            tar.add(f, arcname=f.name)
    n = 0
    with whole.open("rb") as fh:
        while piece := fh.read(limit):
            n += 1
            (out / f"chunk-{n:02d}").write_bytes(piece)
    size = whole.stat().st_size
    whole.unlink()
    print(
        f"{len(files)} wheels, {size / 1e6:.0f} MB in {n} pieces of "
        f"<= {limit / (1 << 20):.0f} MiB: {out}/chunk-NN",
        flush=True,
    )
    return 0


def install(args: argparse.Namespace) -> int:
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.version import Version

    house = Path(args.wheelhouse)
    pieces = sorted(house.glob("chunk-*"))
    if pieces:
        numbers = [int(p.name.split("-")[1]) for p in pieces if p.name.split("-")[1].isdigit()]
        gaps = sorted(set(range(1, max(numbers, default=0) + 1)) - set(numbers))
        if gaps:
            print(
                f"{house}: pieces missing: {', '.join(f'chunk-{n:02d}' for n in gaps)}; carry "
                "them (recv) and run install again",
                file=sys.stderr,
            )
            return 2
        whole = house / "wheels.tar"
        with whole.open("wb") as fh:
            for piece in pieces:
                fh.write(piece.read_bytes())
        # Unpacked beside the house and moved in only when whole: a cut join leaves no
        # truncated wheel behind.
        staging = house / ".unpack"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            with tarfile.open(whole) as t:
                t.extractall(staging, filter="data")
        except (tarfile.TarError, EOFError) as exc:
            whole.unlink()
            shutil.rmtree(staging, ignore_errors=True)
            # No gap in the numbers: the last piece is missing, or one was cut short.
            print(
                f"{house}: chunk-01..{pieces[-1].name} do not join into the whole wheelhouse "
                f"({exc}): the last piece is missing or a piece was cut; carry the rest (recv) "
                "and run install again",
                file=sys.stderr,
            )
            return 2
        for f in staging.iterdir():
            f.replace(house / f.name)
        staging.rmdir()
        whole.unlink()
        for piece in pieces:
            piece.unlink()
    wheels = sorted(house.glob("*.whl"))
    if not wheels:
        print(
            f"{house}: no wheels and no chunk-NN pieces: carry them first "
            "(bench/gpu_device_steps.sh send N here, recv there)",
            file=sys.stderr,
        )
        return 2

    def _active(lines: list[str]) -> list[Requirement]:
        reqs = [Requirement(line) for line in lines]
        return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]

    # Each wheel's own requirements, and the version this Python already has of its name.
    by_name: dict[str, Path] = {}
    wheel_reqs: dict[str, list[Requirement]] = {}
    wheel_version: dict[str, Version] = {}
    for w in wheels:
        name = _canon(w.name.split("-")[0])
        by_name[name] = w
        wheel_version[name] = Version(w.name.split("-")[1])
        with zipfile.ZipFile(w) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            text = zf.read(meta).decode()
        wheel_reqs[name] = _active(
            [
                ln.split(":", 1)[1].strip()
                for ln in text.splitlines()
                if ln.startswith("Requires-Dist:")
            ]
        )
    have: dict[str, Version] = {}
    have_reqs: dict[str, list[Requirement]] = {}
    for name in by_name:
        try:
            have[name] = Version(metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
        have_reqs[name] = _active(metadata.requires(name) or [])
    # Keep the machine's own version of a name when every requirement on it is met, counting
    # the requirements of what is then installed: a taken wheel's own, and for a kept name the
    # machine's copy's (not its wheel's: a newer resolved transformers may want a newer
    # huggingface-hub than the machine's transformers accepts). A kept name whose own
    # requirements a taken wheel breaks is taken too. Repeated until nothing changes.
    keep = set() if args.no_skip else set(have)
    while True:
        wants: dict[str, list[Requirement]] = {}
        for name in by_name:
            for req in have_reqs[name] if name in keep else wheel_reqs[name]:
                wants.setdefault(_canon(req.name), []).append(req)
        nxt = {n for n in keep if all(have[n] in r.specifier for r in wants.get(n, []))}
        nxt = {
            n
            for n in nxt
            if all(
                _canon(r.name) not in by_name
                or _canon(r.name) in nxt
                or wheel_version[_canon(r.name)] in r.specifier
                for r in have_reqs[n]
            )
        }
        if nxt == keep:
            break
        keep = nxt
    only = {_canon(n) for n in args.only}
    leave = {_canon(n) for n in args.leave}
    take, skipped = [], []
    for name, w in by_name.items():
        if (only and name not in only) or name in leave:
            continue
        if name in keep:
            skipped.append(f"{name} {have[name]}")
        else:
            take.append(w)
    print(
        f"{len(wheels)} wheels: {len(skipped)} satisfied by this Python, installing "
        f"{len(take)} into {args.target}",
        flush=True,
    )
    if not take:  # e.g. --only flashinfer-cubin when none was built: pip would refuse (exit 1)
        print(f"nothing to install into {args.target}", flush=True)
        return 0
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        args.target,
        *[str(w) for w in take],
    ]
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="resolve, download and chunk the wheels (needs network)")
    b.add_argument(
        "--vllm-wheel",
        required=True,
        help="path of the vLLM wheel (e.g. "
        ".cache/wheels/vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl)",
    )
    b.add_argument("--out", default=".gpulane", help="folder for the chunks (git-ignored)")
    b.add_argument("--python-version", default="3.12")
    b.add_argument(
        "--pin",
        action="append",
        default=["flashinfer-python==0.6.12", "xgrammar==0.2.3"],
        help="extra requirement (repeatable; default pins "
        "flashinfer-python 0.6.12 and xgrammar 0.2.3: 0.2.9 needs a newer "
        "apache-tvm-ffi than vLLM 0.24.0 pins and fails at import)",
    )
    b.add_argument(
        "--with",
        dest="with_",
        action="append",
        default=[],
        help="carry a package left out by default, e.g. flashinfer-cubin==0.6.12",
    )
    b.add_argument(
        "--chunk-mb",
        type=int,
        default=55,
        help="piece size in MiB: a call carries 64 MiB with the working tree",
    )
    i = sub.add_parser("install", help="unpack the chunks and install them (no network)")
    i.add_argument("--wheelhouse", required=True, help="folder holding the pieces chunk-NN")
    i.add_argument("--target", required=True, help="pip --target folder (put it on PYTHONPATH)")
    i.add_argument("--no-skip", action="store_true", help="install every wheel")
    i.add_argument(
        "--only", action="append", default=[], help="install only this name (repeatable)"
    )
    i.add_argument(
        "--leave",
        action="append",
        default=[],
        help="leave this name in the wheelhouse uninstalled (repeatable)",
    )
    args = p.parse_args(argv)
    return build(args) if args.cmd == "build" else install(args)


if __name__ == "__main__":
    sys.exit(main())
