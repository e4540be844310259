"""`vfleet stacks check`: every GPU stack's pins resolved together by pip's own resolver.

For each GPU stack of each hardware profile, pip resolves the stack's pins (vLLM, torch,
FlashInfer, triton where pinned, the SM75 plugin's wheel where the stack has it, and the probe
wheel that every deploy installs beside vLLM) for the stack's Python on x86-64 Linux with the
stack's glibc: `pip install --dry-run --ignore-installed --report`, wheels only, nothing
installed. A conflict is pip's own `ResolutionImpossible`, shown with pip's explanation.

What pip does not check is checked on its report: torch's CUDA (from the CUDA packages torch
depends on) equals the stack's `cuda`, and flashinfer-cubin, where vLLM pulls it in, has
flashinfer-python's version (FlashInfer raises at import time otherwise: flashinfer/jit/env.py).

pip evaluates environment markers (`python_version > "3.11"`) with the Python it runs on, not
the one `--python-version` names (pypa/pip#10050): the check runs pip with packaging's marker
environment set to the stack's Python, and reads that environment back from pip's report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vfleet.checks import stacks_index
from vfleet.config.pins import (
    healthcheck_version,
    is_gpu,
    plugin_version,
    public_version,
    stack_pins,
)
from vfleet.config.profiles import load_profile, profiles_dir
from vfleet.config.schema import HardwareProfile, Stack
from vfleet.errors import VfleetError
from vfleet.paths import REPO_ROOT, tools_dir

PYPI = "https://pypi.org/simple"
# Wheel metadata by sha256 and the index's project pages (10 minutes), kept between runs by
# the loopback index pip resolves through (stacks_index.py).
CACHE_DIR = tools_dir() / "stacks-pip"
# Each stack's pip report and log, for a look after a run.
OUT_DIR = REPO_ROOT / "build" / "stacks"
WHEELS_DIR = REPO_ROOT / "build" / "wheels"
PIP_TIMEOUT_S = 900
OLDEST_MANYLINUX = 17  # manylinux2014; older tags are listed by their legacy names below
LEGACY_TAGS = ("manylinux2014", "manylinux2010", "manylinux1", "linux")
# CUDA packages whose version is the CUDA a torch wheel was built for.
CUDA_REQ = re.compile(
    r"^(?:cuda-toolkit|nvidia-cuda-runtime(?:-cu\d+)?)\s*(?:\[[^\]]*\])?\s*==\s*(\d+)\.(\d+)"
)

# Runs pip with packaging's marker environment set to the target's (argv[1], JSON): the
# only change to pip, so that `python_version` markers are evaluated for the stack's Python.
PIP_BOOT = """\
import json, sys
from pip._vendor.packaging import markers
env = dict(markers.default_environment(), **json.loads(sys.argv[1]))
markers.default_environment = lambda: dict(env)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


@dataclass(frozen=True)
class Target:
    """The machine pip resolves for."""

    python: str
    glibc: str

    def platforms(self) -> list[str]:
        newest = int(self.glibc.split(".")[1])
        tags = [f"manylinux_2_{n}" for n in range(newest, OLDEST_MANYLINUX - 1, -1)]
        return [f"{t}_x86_64" for t in (*tags, *LEGACY_TAGS)]

    def markers(self) -> dict[str, str]:
        # The patch level is unknown: .0 (markers on python_full_version are rare).
        return {
            "python_version": self.python,
            "python_full_version": f"{self.python}.0",
            "implementation_version": f"{self.python}.0",
            "implementation_name": "cpython",
            "platform_python_implementation": "CPython",
            "platform_machine": "x86_64",
            "platform_system": "Linux",
            "sys_platform": "linux",
            "os_name": "posix",
        }


@dataclass(frozen=True)
class StackRef:
    profile: str
    stack_name: str
    stack: Stack
    where: str  # the profile file

    @property
    def label(self) -> str:
        return f"{self.profile}/{self.stack_name}"


@dataclass(frozen=True)
class Resolved:
    """One distribution of pip's report: what would be installed."""

    name: str  # normalised: lower case
    version: str
    requires_dist: tuple[str, ...]


@dataclass(frozen=True)
class Report:
    """pip's installation report, the parts the check reads."""

    python_version: str  # of the marker environment pip evaluated with
    installs: dict[str, Resolved]

    @classmethod
    def parse(cls, text: str) -> Report:
        data = json.loads(text)
        installs = {}
        for item in data["install"]:
            meta = item["metadata"]
            name = str(meta["name"]).lower().replace("_", "-")
            requires = tuple(str(r) for r in meta.get("requires_dist", []))
            installs[name] = Resolved(name, str(meta["version"]), requires)
        return cls(str(data["environment"]["python_version"]), installs)

    def version(self, name: str) -> str | None:
        dist = self.installs.get(name)
        return dist.version if dist else None


@dataclass
class Result:
    ref: StackRef
    ok: bool
    summary: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    log: str = ""


def shown(path: Path) -> str:
    """A path as an operator types it: relative to the working folder where it is inside."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def gpu_stacks(root: Path | None = None, profile: str | None = None) -> list[StackRef]:
    root = root or profiles_dir()
    names = [profile] if profile else sorted(p.stem for p in (root / "hardware").glob("*.yaml"))
    out: list[StackRef] = []
    for name in names:
        prof: HardwareProfile = load_profile(name, root)
        where = shown(root / "hardware" / f"{name}.yaml")
        for stack_name, stack in prof.stacks.items():
            if is_gpu(stack):
                out.append(StackRef(prof.name, stack_name, stack, where))
    return out


def local_wheels(stack: Stack) -> list[Path]:
    """The vfleet wheels a deploy installs beside vLLM (built by `make wheels`)."""
    wheels = [WHEELS_DIR / f"vfleet_healthcheck-{healthcheck_version()}-py3-none-any.whl"]
    if stack.plugin:
        wheels.append(WHEELS_DIR / f"vfleet_sm75-{plugin_version()}-py3-none-any.whl")
    for whl in wheels:
        if not whl.is_file():
            raise VfleetError("wheel not built", where=str(whl), fix="make wheels")
    return wheels


def pip_argv(ref: StackRef, index_url: str, report: Path) -> list[str]:
    stack = ref.stack
    target = Target(stack.python, stack.glibc)
    argv = [sys.executable, "-c", PIP_BOOT, json.dumps(target.markers())]
    argv += ["install", "--dry-run", "--ignore-installed", "--report", str(report)]
    argv += ["--only-binary=:all:", "--python-version", stack.python, "--implementation", "cp"]
    for tag in target.platforms():
        argv += ["--platform", tag]
    # The loopback index (stacks_index.py) gives pip every wheel's metadata from the cache:
    # pip reads no wheel (torch and the CUDA libraries are GBs).
    argv += ["--index-url", index_url, "--no-cache-dir", "--progress-bar", "off", "--no-input"]
    # A local label (+cu130) names PyTorch's own index, which is not the check's: the public
    # version is resolved on the index, and its CUDA checked against the label (check_report).
    for pin in stack_pins(ref.stack_name, stack):
        torch = pin.key.endswith(".torch")
        argv.append(f"torch=={public_version(stack.torch)}" if torch else pin.requirement)
    argv += [str(w) for w in local_wheels(stack)]
    return argv


def pip_env() -> dict[str, str]:
    """No pip configuration of this machine (extra indexes, find-links, constraints) takes part:
    the check resolves against the index it names. Certificates and proxies stay."""
    keep = {"PIP_CERT", "PIP_CLIENT_CERT", "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k in keep}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def explanation(log: str) -> list[str]:
    """pip's own account of a failure: its ERROR lines and the conflict it names."""
    lines = log.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("ERROR: ")), len(lines))
    # "Ignored the following versions that require a different python version: ..." lists
    # hundreds of versions: its head says enough.
    return [ln if len(ln) <= 400 else ln[:400] + " ..." for ln in lines[start:] if ln.strip()]


def blamed_pins(ref: StackRef, lines: list[str]) -> list[str]:
    """The stack's pins that pip names in its explanation ("The user requested X")."""
    out = []
    for pin in stack_pins(ref.stack_name, ref.stack):
        name = pin.requirement.split("==")[0]
        if any(f"requested {name}==" in ln or f"for {name}==" in ln for ln in lines):
            out.append(f"{ref.where}: {pin.key}: {pin.requirement}")
    return out


def torch_cuda(requires_dist: list[str]) -> str | None:
    """The CUDA a torch wheel was built for, from the CUDA runtime it depends on."""
    for req in requires_dist:
        m = CUDA_REQ.match(req)
        if m:
            return f"{m.group(1)}.{m.group(2)}"
    return None


def label_cuda(version: str) -> str | None:
    """+cu130 -> 13.0; None without a CUDA label."""
    m = re.search(r"\+cu(\d+)(\d)$", version)
    return f"{m.group(1)}.{m.group(2)}" if m else None


def check_report(ref: StackRef, report: Report) -> Result:
    """What pip does not check, checked on its report."""
    stack = ref.stack
    problems: list[str] = []
    notes: list[str] = []
    if report.python_version != stack.python:
        problems.append(
            f"pip evaluated markers for Python {report.python_version}, not the stack's "
            f"{stack.python}"
        )
    torch = report.installs.get("torch")
    built_for = torch_cuda(list(torch.requires_dist)) if torch else None
    if stack.cuda and built_for != stack.cuda:
        problems.append(
            f"{ref.where}: stacks.{ref.stack_name}.cuda: {stack.cuda}, but torch "
            f"{report.version('torch')} from the index is built for CUDA {built_for or '(none)'}"
        )
    labelled = label_cuda(stack.torch)
    if labelled:
        if labelled != built_for:
            problems.append(
                f"{ref.where}: stacks.{ref.stack_name}.torch: {stack.torch} names CUDA "
                f"{labelled}; the index's torch {public_version(stack.torch)} is CUDA {built_for}"
            )
        else:
            notes.append(
                f"torch {stack.torch} resolved as the index's {public_version(stack.torch)} "
                f"(CUDA {built_for} build, same version); the {stack.torch} wheel itself is on "
                "PyTorch's index and was not resolved"
            )
    cubin, python = report.version("flashinfer-cubin"), report.version("flashinfer-python")
    if cubin and cubin != python:
        problems.append(
            f"flashinfer-cubin {cubin} with flashinfer-python {python}: FlashInfer refuses "
            "to load mismatched versions (flashinfer/jit/env.py)"
        )
    parts = [
        f"vllm {report.version('vllm')}",
        f"torch {report.version('torch')} (CUDA {built_for})",
    ]
    for name in ("flashinfer-python", "flashinfer-cubin", "triton", "vfleet-sm75"):
        if name in report.installs:
            parts.append(f"{name} {report.version(name)}")
    summary = (
        f"Python {stack.python}, manylinux_{stack.glibc.replace('.', '_')} x86_64: "
        + ", ".join(parts)
        + f"; {len(report.installs)} packages"
    )
    return Result(ref, not problems, summary, problems, notes)


def check_stack(ref: StackRef, index_url: str) -> Result:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    report = OUT_DIR / f"{ref.profile}--{ref.stack_name}.json"
    log_file = OUT_DIR / f"{ref.profile}--{ref.stack_name}.log"
    report.unlink(missing_ok=True)
    argv = pip_argv(ref, index_url, report)
    try:
        proc = subprocess.run(
            argv,
            env=pip_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # pip's explanation and its ERROR lines, in order
            text=True,
            timeout=PIP_TIMEOUT_S,
            check=False,
        )
        log = proc.stdout
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        log, rc = f"pip did not finish in {PIP_TIMEOUT_S} s", -1
    log_file.write_text(log, encoding="utf-8")
    if rc != 0 or not report.is_file():
        lines = explanation(log) or log.strip().splitlines()[-15:]
        return Result(
            ref,
            False,
            f"pip cannot install these pins together (exit {rc}; log: {log_file})",
            blamed_pins(ref, lines) + lines,
        )
    return check_report(ref, Report.parse(report.read_text(encoding="utf-8")))


def reachable(index_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{index_url.rstrip('/')}/pip/", timeout=30) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def check(refs: list[StackRef], index_url: str = PYPI, jobs: int = 4) -> Iterator[Result]:
    """Resolve every stack, `jobs` pip processes at a time; results in the order given."""
    if not reachable(index_url):
        raise VfleetError(
            "the package index cannot be reached: the pins were not resolved",
            where=index_url,
            key="--index-url",
            fix="run where PyPI is reachable, or give a reachable mirror with --index-url",
        )
    for ref in refs:
        local_wheels(ref.stack)  # a missing wheel is bad input: refused before any pip runs
    with (
        stacks_index.serve(index_url, CACHE_DIR) as local,
        ThreadPoolExecutor(max_workers=max(1, jobs)) as pool,
    ):
        yield from pool.map(lambda r: check_stack(r, local), refs)


# --------------------------------------------------------------------------- CLI

EXAMPLES = """\
examples:
  vfleet stacks check                      # every GPU stack of every profile
  vfleet stacks check -p 2x2080ti-22g --stack vllm-0.27.1-plugin

Exit status: 0 every stack resolves; 1 a stack's pins cannot be installed together (pip's
explanation follows, with the profile key that sets the pin), or its torch is not the stack's
CUDA build; 2 bad input or the index cannot be reached. Resolving is not running: a stack
that resolves may still fail on its GPU (docs/STACKS.md says what this check cannot know).
"""


def cmd_check(a: argparse.Namespace) -> int:
    refs = gpu_stacks(Path(a.profiles_dir) if a.profiles_dir else None, a.profile)
    if a.stack:
        refs = [r for r in refs if r.stack_name == a.stack]
        if not refs:
            raise VfleetError(
                f"no GPU stack {a.stack!r}",
                key="--stack",
                fix="see `vfleet profiles` for each profile's stacks",
            )
    if not refs:
        raise VfleetError("no GPU stack to check", key="--profile", fix="name a GPU profile")
    failed = 0
    for res in check(refs, a.index_url, a.jobs):
        print(f"{'ok' if res.ok else 'FAIL':<5} {res.ref.label}: {res.summary}", flush=True)
        for line in res.problems:
            print(f"      {line}")
        for line in res.notes:
            print(f"      note: {line}")
        failed += not res.ok
    print(f"{len(refs) - failed} of {len(refs)} GPU stacks resolve ({a.index_url})")
    return 1 if failed else 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "stacks",
        help="resolve every GPU stack's pins with pip's resolver (nothing installed)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ssub = p.add_subparsers(dest="stacks_command", metavar="SUBCOMMAND", required=True)
    c = ssub.add_parser(
        "check",
        help="pip --dry-run --report per GPU stack, for its Python and glibc; conflicts fail",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("--profiles-dir", metavar="DIR", help="load profiles from DIR")
    c.add_argument("--profile", "-p", help="only this hardware profile's GPU stacks")
    c.add_argument("--stack", help="only the stack of this name")
    c.add_argument(
        "--index-url",
        default=PYPI,
        metavar="URL",
        help="the package index to resolve against (default: %(default)s)",
    )
    c.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=4,
        metavar="N",
        help="pip processes at once (default: %(default)s; each waits mostly on the network)",
    )
    c.set_defaults(fn=cmd_check)
