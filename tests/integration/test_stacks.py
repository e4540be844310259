"""`vfleet stacks check`: pip's real resolver on every GPU stack's pins (PyPI, nothing installed).

One `vfleet stacks check` run resolves every GPU stack (one pip process per stack, in
parallel); each stack's test reads its line. A deliberately conflicting pin set (finding 6 of
issue 18: flashinfer 0.6.8 beside vLLM 0.21.0, whose wheel requires 0.6.8.post1) must fail
with pip's own explanation. Needs PyPI (CI reaches it) and `make wheels`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest
import yaml

from vfleet.checks import stacks, stacks_index
from vfleet.config.pins import requirements
from vfleet.config.profiles import load_profile
from vfleet.config.schema import Stack
from vfleet.render.plan import plan

VFLEET = str(Path(sys.executable).with_name("vfleet"))
GPU_STACKS = [r.label for r in stacks.gpu_stacks()]


def run_check(*args: str, profiles: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if profiles is not None:
        env["VFLEET_PROFILES_DIR"] = str(profiles)
    return subprocess.run(
        [VFLEET, "stacks", "check", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )


@pytest.fixture(scope="module")
def checked() -> subprocess.CompletedProcess[str]:
    if not stacks.reachable(stacks.PYPI):
        pytest.fail("PyPI cannot be reached: the pins cannot be resolved here")
    return run_check()


def block(out: str, label: str) -> str:
    """The line of one stack and its indented detail lines."""
    lines = out.splitlines()
    start = next(
        i for i, ln in enumerate(lines) if ln.split(" ", 1)[-1].lstrip().startswith(label + ":")
    )
    end = next(
        (i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines)
    )
    return "\n".join(lines[start:end])


def test_every_gpu_stack_is_checked() -> None:
    assert len(GPU_STACKS) >= 4  # 2x2080ti (two), 4x2080ti, a100
    assert all(not label.startswith("cpu/") for label in GPU_STACKS)


@pytest.mark.parametrize("label", GPU_STACKS)
def test_gpu_stack_pins_resolve(checked: subprocess.CompletedProcess[str], label: str) -> None:
    text = block(checked.stdout, label)
    assert text.startswith("ok "), checked.stdout + checked.stderr
    profile, name = label.split("/")
    stack = load_profile(profile).stacks[name]
    # The report's versions are the pins, for the stack's Python (pip's marker environment).
    assert f"Python {stack.python}," in text
    assert f"vllm {stack.vllm}," in text and f"torch {stack.torch} (CUDA {stack.cuda})" in text
    if stack.flashinfer:
        assert f"flashinfer-python {stack.flashinfer}" in text
    if stack.triton:
        assert f"triton {stack.triton}" in text
    if stack.plugin:
        assert f"vfleet-sm75 {stack.plugin}" in text
    report = stacks.OUT_DIR / f"{profile}--{name}.json"
    assert stacks.Report.parse(report.read_text()).python_version == stack.python


def test_markers_are_evaluated_for_the_stacks_python(
    checked: subprocess.CompletedProcess[str],
) -> None:
    """vLLM 0.27.1 requires `setuptools<81.0.0,>=77.0.3; python_version > "3.11"`. pip alone
    would evaluate that with the Python it runs on (3.11 here: marker false, setuptools
    unbounded); for the stack's 3.12 it must hold."""
    assert checked.returncode in (0, 1)
    report = stacks.OUT_DIR / "2x2080ti-22g--vllm-0.27.1-plugin.json"
    resolved = stacks.Report.parse(report.read_text())
    (vllm_req,) = [r for r in resolved.installs["vllm"].requires_dist if r.startswith("setuptools")]
    assert 'python_version > "3.11"' in vllm_req
    setuptools = resolved.version("setuptools")
    assert setuptools is not None and int(setuptools.split(".")[0]) < 81, setuptools


def test_the_check_exits_0_when_every_stack_resolves(
    checked: subprocess.CompletedProcess[str],
) -> None:
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(GPU_STACKS)} of {len(GPU_STACKS)} GPU stacks resolve" in checked.stdout


def test_a_conflicting_pin_fails_with_pips_explanation(profiles_copy: Path) -> None:
    """Finding 6: the 4x stack pinned flashinfer 0.6.8; vLLM 0.21.0 requires 0.6.8.post1."""
    path = profiles_copy / "hardware" / "4x2080ti-22g.yaml"
    data = yaml.safe_load(path.read_text())
    data["stacks"]["vllm-0.21.0"]["flashinfer"] = "0.6.8"
    path.write_text(yaml.safe_dump(data))
    proc = run_check("--profile", "4x2080ti-22g", profiles=profiles_copy)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FAIL  4x2080ti-22g/vllm-0.21.0" in out
    # pip's own words, and the profile key that sets the pin.
    assert "ResolutionImpossible" in out
    assert "vllm 0.21.0 depends on flashinfer-python==0.6.8.post1" in out
    assert f"{path}: stacks.vllm-0.21.0.flashinfer: flashinfer-python==0.6.8" in out
    assert "0 of 1 GPU stacks resolve" in out


def test_an_unreachable_index_is_not_reported_as_resolving() -> None:
    proc = run_check("--index-url", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the package index cannot be reached: the pins were not resolved" in proc.stderr
    assert proc.stdout == ""


def test_a_missing_plugin_wheel_is_bad_input(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(stacks, "WHEELS_DIR", tmp_path)
    (ref,) = [r for r in stacks.gpu_stacks() if r.label == "2x2080ti-22g/vllm-0.27.1-plugin"]
    with pytest.raises(stacks.VfleetError, match="wheel not built"):
        stacks.local_wheels(ref.stack)


def test_torch_cuda_is_read_from_torchs_own_dependencies() -> None:
    # torch 2.13.0 from PyPI (its Requires-Dist) and an older cu12 build's form.
    assert (
        stacks.torch_cuda(['cuda-toolkit[cudart,nvrtc]==13.0.3; platform_system == "Linux"'])
        == "13.0"
    )
    assert (
        stacks.torch_cuda(["nvidia-cuda-runtime-cu12==12.8.90; platform_system == 'Linux'"])
        == "12.8"
    )
    assert stacks.torch_cuda(["filelock", "sympy>=1.13.3"]) is None
    assert stacks.label_cuda("2.11.0+cu130") == "13.0" and stacks.label_cuda("2.13.0+cpu") is None


def test_the_cuda_check_fails_a_stack_whose_torch_is_another_cuda_build() -> None:
    """What pip cannot see: the stack's `cuda` against the CUDA torch's wheel was built for
    (the 0.24.0 stack said 12.9 while PyPI's torch 2.11.0 is a CUDA 13.0 build)."""
    stack = Stack(python="3.12", vllm="0.24.0", vllm_package="vllm", torch="2.11.0", cuda="12.9")
    ref = stacks.StackRef("p", "s", stack, "p.yaml")
    torch = stacks.Resolved("torch", "2.11.0", ("cuda-toolkit[cudart]==13.0.2",))
    result = stacks.check_report(ref, stacks.Report("3.12", {"torch": torch}))
    assert not result.ok
    assert result.problems == [
        "p.yaml: stacks.s.cuda: 12.9, but torch 2.11.0 from the index is built for CUDA 13.0"
    ]
    cubin = {
        "torch": torch,
        "flashinfer-python": stacks.Resolved("flashinfer-python", "0.6.16.post3", ()),
        "flashinfer-cubin": stacks.Resolved("flashinfer-cubin", "0.6.12", ()),
    }
    fixed = stack.model_copy(update={"cuda": "13.0"})
    result = stacks.check_report(
        stacks.StackRef("p", "s", fixed, "p.yaml"), stacks.Report("3.12", cubin)
    )
    assert any("FlashInfer refuses to load mismatched versions" in p for p in result.problems)


def test_a_local_torch_label_is_checked_against_the_index_builds_cuda() -> None:
    """+cu130 wheels live on PyTorch's index: the check resolves PyPI's build of the version
    and says so, and fails when that build's CUDA is not the label's."""
    torch = stacks.Resolved("torch", "2.13.0", ("cuda-toolkit[cudart]==13.0.3",))
    for label, ok in (("+cu130", True), ("+cu129", False)):
        stack = Stack(
            python="3.13", vllm="0.27.1", vllm_package="vllm", torch=f"2.13.0{label}", cuda="13.0"
        )
        ref = stacks.StackRef("p", "s", stack, "p.yaml")
        result = stacks.check_report(ref, stacks.Report("3.13", {"torch": torch}))
        assert result.ok is ok, result.problems
        if ok:
            assert result.notes and "was not resolved" in result.notes[0]
        else:
            assert (
                "2.13.0+cu129 names CUDA 12.9; the index's torch 2.13.0 is CUDA 13.0"
                in (result.problems[0])
            )
    # The argv pip gets names the public version, which PyPI has.
    (ref,) = [r for r in stacks.gpu_stacks() if r.label == "a100-32g/vllm-0.27.1"]
    labelled = stacks.StackRef(
        ref.profile, ref.stack_name, ref.stack.model_copy(update={"torch": "2.13.0+cu130"}), ""
    )
    argv = stacks.pip_argv(labelled, stacks.PYPI, Path("r.json"))
    assert "torch==2.13.0" in argv and "torch==2.13.0+cu130" not in argv


def test_pins_are_what_the_role_and_the_image_install() -> None:
    stack = load_profile("4x2080ti-22g").stacks["vllm-0.21.0"]
    assert requirements(stack) == [
        "vllm==0.21.0",
        "torch==2.11.0",
        "flashinfer-python==0.6.8.post1",
    ]
    p = plan("4x2080ti-22g", "qwen3.6-27b-awq-int4")
    assert p.software.packages == requirements(stack)


def test_platform_tags_cover_the_stacks_glibc_and_older() -> None:
    tags = stacks.Target("3.12", "2.35").platforms()
    assert tags[0] == "manylinux_2_35_x86_64" and "manylinux_2_17_x86_64" in tags
    assert tags[-4:] == [
        "manylinux2014_x86_64",
        "manylinux2010_x86_64",
        "manylinux1_x86_64",
        "linux_x86_64",
    ]
    assert "manylinux_2_36_x86_64" not in tags


def test_the_loopback_index_serves_each_wheels_own_metadata(tmp_path: Path) -> None:
    """The metadata pip reads through the loopback index is the wheel's own METADATA: read
    out of the remote wheel with range requests, cached by sha256, and the same the second
    time without the network (the cached file is what is served)."""
    with stacks_index.serve(stacks.PYPI, tmp_path) as simple:
        page = json.loads(urllib.request.urlopen(f"{simple}/six/").read())
        (whl,) = [f for f in page["files"] if f["filename"] == "six-1.17.0-py2.py3-none-any.whl"]
        assert whl["core-metadata"] is True and whl["url"].startswith(simple.rsplit("/", 1)[0])
        served = urllib.request.urlopen(whl["url"] + ".metadata").read()
        # The wheel itself, from the real index (the loopback redirects to it).
        wheel = tmp_path / whl["filename"]
        wheel.write_bytes(urllib.request.urlopen(whl["url"]).read())
    own = zipfile.ZipFile(wheel).read("six-1.17.0.dist-info/METADATA")
    assert served == own and b"Name: six" in own
    cached = tmp_path / "metadata" / whl["hashes"]["sha256"]
    assert cached.read_bytes() == own
    assert (tmp_path / "pages" / "six.json").is_file()
