"""What the Ansible role needs to deploy one instance, computed on the control machine.

The `vfleet_plan` lookup plugin calls `plan()`; the role then only copies files, creates
the venv, builds or checks the model and starts the service. All decisions stay in Python.

`plan()` returns a typed `Plan` (frozen dataclasses, one per concern). The role sees it as a
dict: `Plan.as_dict()` is called only at the Ansible lookup boundary
(ansible/plugins/lookup/vfleet_plan.py), and `Plan.from_dict()` reads that dict back where
Ansible hands it to Python again (ansible/plugins/lookup/vfleet_doctor.py). The dict's keys are
the role's interface (ansible/roles/vfleet reads `vfleet_plan.*`): tests/unit/test_plan.py holds
them to the dicts captured before the plan was typed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from vfleet import __version__
from vfleet.config.apikey import KEY as API_KEY_FILE_KEY
from vfleet.config.apikey import read_api_key_file
from vfleet.config.defaults import NGINX_PACKAGE
from vfleet.config.pins import healthcheck_version, plugin_version, requirements
from vfleet.config.profiles import validation_error
from vfleet.config.schema import Accelerator, HostVars, ModelArch, Stack
from vfleet.engine.compile import Launch, resolve
from vfleet.engine.decisions import DraftVocabBuild
from vfleet.engine.rules import API_KEY_ENV
from vfleet.errors import VfleetError
from vfleet.hostside.hostfacts import parse_env
from vfleet.render.cache_seed import VENV_FILE_TIME, CacheSeed, identity
from vfleet.render.cache_seed import cache_seed as read_cache_seed
from vfleet.render.cache_seed import roots as seed_roots
from vfleet.render.monitoring import PM2_FILE, PM2_NAME, prometheus_files, scrape_target
from vfleet.render.release import (
    context,
    expected_unit_directives,
    front_context,
    front_pm2_name,
    front_unit_name,
    local_host,
    pm2_name,
    probe_config,
    release_id,
    render_files,
    sidecar_pm2_name,
    sidecar_unit_name,
    template_env,
    unit_name,
)


def logrotate(launch: Launch) -> str:
    """/etc/logrotate.d/vfleet for the host's log folder (one per base dir, all instances).
    Its header names no instance, model or profile: it is every instance's file, and a swap
    or another instance's deploy must not rewrite a file in /etc for nothing."""
    header = (
        f"# Rendered by vfleet {__version__} for every instance under {launch.host.base_dir}. "
        "Do not edit: a deploy writes it again."
    )
    return template_env().get_template("logrotate.j2").render({**context(launch), "header": header})


# --------------------------------------------------------------------------- the typed plan


@dataclass(frozen=True)
class Versions:
    """The versions a release installs besides the stack's pins."""

    vfleet: str
    """vfleet's own version (written into release.json)."""
    healthcheck: str
    """The probe wheel's version (healthcheck/pyproject.toml), installed into the venv."""
    plugin: str | None
    """The SM75 plugin wheel this checkout builds (plugin/pyproject.toml); None when the stack
    has no plugin."""


@dataclass(frozen=True)
class Software:
    """What the instance's venv and host get installed: the stack and its pins."""

    stack_name: str
    """The stack's name in the hardware profile (a key of its `stacks`)."""
    stack: Stack
    """The stack: vLLM, torch, CUDA and Python pins, package name, plugin."""
    packages: list[str]
    """Every pin of the stack as the venv installs them (`vfleet stacks check` resolves the
    same list)."""
    remove_packages: list[str]
    """Packages removed from the venv after the install."""
    os_packages: list[str]
    """Debian packages the hardware profile needs on the host."""
    file_time: int = VENV_FILE_TIME
    """The mtime (epoch seconds) the role gives every non-Python file of the venv after an
    install: the same on every host, so a cache seed's JIT objects stay newer than their
    inputs (render.cache_seed.VENV_FILE_TIME)."""


@dataclass(frozen=True)
class Dirs:
    """Folders on the host (absolute paths)."""

    base: str
    """vfleet's folder (vfleet_base_dir)."""
    venv: str
    """The vLLM venv of the instance's stack."""
    instance: str
    """The instance's folder."""
    releases: str
    """The instance's releases, one folder per release id."""
    release: str
    """This plan's release folder."""
    current: str
    """Symlink to the running release."""
    previous: str
    """Symlink to the release before it (rollback target)."""
    state: str
    """Runtime state the server writes (the SM75 plugin's decision)."""
    logs: str
    """Log folder of all instances."""
    cache: str
    """Compile caches of the instance."""
    home: str
    """The instance's HOME (launch.sh and the unit set it): libraries' caches under ~."""
    bin: str
    """vfleet's scripts on the host."""
    wheels: str
    """Wheels built or shipped for the host."""
    models: str
    """Model folders."""


@dataclass(frozen=True)
class ModelPlan:
    """The model the instance serves and what the doctor checks its folder against."""

    name: str
    """The model preset's name."""
    dir: str
    """The model folder on the host."""
    generator: str | None
    """How the deploy generates the weights (tiny models); None when the operator set
    model_dir ("my weights": never generated over, only checked) or the preset has none."""
    arch: ModelArch
    """The preset's architecture numbers (the planner's weight estimate reads them)."""
    architecture: str
    """config.json's architectures entry the folder must have."""
    quantization: str
    """The preset's quantisation method (none, awq, fp8)."""
    unmodelled_weights_gib: float
    """Weights the architecture numbers do not account for (GiB)."""
    draft_vocab_build: DraftVocabBuild | None
    """The SM75 plugin's draft vocabulary to build on the host (tasks/draft_vocab.yml)."""


@dataclass(frozen=True)
class Service:
    """The vLLM server of the instance and its process manager's names."""

    unit_name: str
    """The systemd unit (vfleet-vllm@INSTANCE.service)."""
    unit_directives: str
    """What vfleet-verify-unit accepts in the unit: the template's directives, in order."""
    pm2_name: str
    """The pm2 app's name."""
    user: str
    """The system user both services run as where the deploy runs as root."""
    log_file: str
    """The server's log file."""
    server_module: str
    """The Python module launch.sh runs (`python -m MODULE --config vllm.yaml`)."""
    listen_host: str
    """The address vLLM listens on (loopback behind a front)."""
    port: int
    """vLLM's own port: the API and /metrics (behind a front: on loopback only)."""
    url: str
    """The API's URL as seen from the host."""
    served_model_name: str
    """The model name the API serves."""
    start_timeout_s: int
    """How long a start may take (the profile's start_timeout_s)."""
    shutdown_timeout_s: int
    """vLLM drains in-flight requests this long on SIGTERM (the "drain" rule)."""


@dataclass(frozen=True)
class Sidecar:
    """The metrics sidecar beside the server."""

    port: int
    """The sidecar's port."""
    url: str
    """The sidecar's URL as seen from the host."""
    pm2_name: str
    """The sidecar's pm2 app."""
    unit_name: str
    """The sidecar's systemd unit."""
    unit_directives: str
    """What vfleet-verify-unit accepts in the sidecar's unit."""


@dataclass(frozen=True)
class Front:
    """The nginx front before vLLM (rule `front`): only the allowed routes leave the box."""

    host: str
    """Where clients connect: the deployment's host."""
    port: int
    """... and port."""
    url: str
    """Its URL as seen from the host (the deploy checks /health through it)."""
    vllm_port: int
    """vLLM's own port behind it, on loopback."""
    conf: str
    """Its nginx configuration in the release."""
    unit_name: str
    """Its systemd unit (vfleet-front@INSTANCE.service)."""
    unit_directives: str
    """What vfleet-verify-unit accepts in its unit."""
    pm2_name: str
    """Its pm2 app."""
    log_file: str
    """Its log (nginx's errors)."""


@dataclass(frozen=True)
class Pm2:
    """vfleet's own pm2 on the host."""

    bin: str
    """The pm2 executable."""
    home: str
    """PM2_HOME."""


@dataclass(frozen=True)
class RenderedFile:
    """One file of the release, rendered on the control machine."""

    name: str
    """Its path under the release folder."""
    content: str
    """Its text."""
    mode: str
    """Its mode, four octal digits (e.g. 0644)."""


@dataclass(frozen=True)
class Plan:
    """Everything the role needs to deploy one instance, and the doctor to check it."""

    release_id: str
    """The release's id: a hash of its rendered files."""
    instance: str
    """The instance's name."""
    profile: str
    """The hardware profile's name."""
    accelerator: Accelerator
    """The profile's accelerator (kind, count, GPU model, compute capability, VRAM)."""
    versions: Versions
    """vfleet, probe and plugin versions."""
    software: Software
    """The stack and its pins."""
    dirs: Dirs
    """Folders on the host."""
    model: ModelPlan
    """The served model."""
    files: list[RenderedFile]
    """The release's rendered files."""
    service: Service
    """The vLLM server's names, address and timings."""
    sidecar: Sidecar
    """The metrics sidecar."""
    pm2: Pm2
    """vfleet's pm2 on the host."""
    monitoring: dict[str, Any]
    """The Prometheus scrape target (render.monitoring.scrape_target): handed on as it is to
    the vfleet_prometheus lookup."""
    logrotate: str
    """/etc/logrotate.d/vfleet for the host's log folder."""
    warnings: list[str]
    """The rules' warnings, shown by the deploy."""
    secret_env: list[str]
    """The env names of this release that hold a secret."""
    release_secret_env: list[str]
    """The env names that may hold a secret in any release of the instance: write_release.py
    gives every kept release the current values (or none), so none keeps a replaced key."""
    sets: list[str]
    """The settings the plan was made with (key=value; the API key file's key included)."""
    cache_seed: CacheSeed | None = None
    """vfleet_cache_seed's verdict for this plan (render.cache_seed); None when none given."""
    front: Front | None = None
    """The nginx front; None where vLLM itself is what clients reach (loopback, no front)."""

    def cache_identity(self) -> dict[str, Any]:
        """What a cache seed of this instance says it was made with (render.cache_seed)."""
        return identity(
            self.software.stack_name,
            self.software.stack,
            self.accelerator,
            self.dirs.cache,
            self.dirs.home,
        )

    def file(self, name: str) -> str:
        """A rendered file's content (StopIteration when the release has none)."""
        return next(f.content for f in self.files if f.name == name)

    def config(self) -> dict[str, Any]:
        """The rendered vllm.yaml (vLLM's --config), parsed."""
        return dict(yaml.safe_load(self.file("vllm.yaml")) or {})

    def env(self) -> dict[str, str]:
        """The rendered vllm.env, parsed as the host-side scripts parse it."""
        return parse_env(self.file("vllm.env"))

    def secret_keys(self) -> list[str]:
        """The env names whose values are secrets here (the API key's always)."""
        return sorted({*self.secret_env, API_KEY_ENV})

    def as_dict(self) -> dict[str, Any]:
        """The dict the Ansible role reads as `vfleet_plan` (only the lookups call this)."""
        return {
            "vfleet_version": self.versions.vfleet,
            "release_id": self.release_id,
            "instance": self.instance,
            "profile": self.profile,
            "model": self.model.name,
            "stack_name": self.software.stack_name,
            "stack": self.software.stack.model_dump(),
            "accelerator": self.accelerator.model_dump(),
            "os_packages": list(self.software.os_packages),
            "start_timeout_s": self.service.start_timeout_s,
            "packages": list(self.software.packages),
            "remove_packages": list(self.software.remove_packages),
            "venv_file_time": self.software.file_time,
            "healthcheck_version": self.versions.healthcheck,
            "plugin_version": self.versions.plugin,
            "dirs": asdict(self.dirs),
            "model_dir": self.model.dir,
            "model_generator": self.model.generator,
            "model_arch": self.model.arch.model_dump(),
            "draft_vocab_build": (
                asdict(self.model.draft_vocab_build) if self.model.draft_vocab_build else None
            ),
            "model_architecture": self.model.architecture,
            "files": [asdict(f) for f in self.files],
            "unit_name": self.service.unit_name,
            "unit_directives": self.service.unit_directives,
            "service_user": self.service.user,
            "pm2_name": self.service.pm2_name,
            "listen_host": self.service.listen_host,
            "port": self.service.port,
            "url": self.service.url,
            "served_model_name": self.service.served_model_name,
            "shutdown_timeout_s": self.service.shutdown_timeout_s,
            "sidecar": asdict(self.sidecar),
            "monitoring": self.monitoring,
            "logrotate": self.logrotate,
            "warnings": list(self.warnings),
            "model_quantization": self.model.quantization,
            "model_unmodelled_weights_gib": self.model.unmodelled_weights_gib,
            "server_module": self.service.server_module,
            "log_file": self.service.log_file,
            "secret_env": list(self.secret_env),
            "release_secret_env": list(self.release_secret_env),
            "pm2": asdict(self.pm2),
            "sets": list(self.sets),
            "cache_seed": asdict(self.cache_seed) if self.cache_seed else None,
            "front": asdict(self.front) if self.front else None,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        """The plan back from `as_dict()`'s dict, as Ansible hands it to a lookup."""
        draft = d["draft_vocab_build"]
        return cls(
            release_id=d["release_id"],
            instance=d["instance"],
            profile=d["profile"],
            accelerator=Accelerator.model_validate(d["accelerator"]),
            versions=Versions(
                vfleet=d["vfleet_version"],
                healthcheck=d["healthcheck_version"],
                plugin=d["plugin_version"],
            ),
            software=Software(
                stack_name=d["stack_name"],
                stack=Stack.model_validate(d["stack"]),
                packages=list(d["packages"]),
                remove_packages=list(d["remove_packages"]),
                os_packages=list(d["os_packages"]),
                file_time=int(d["venv_file_time"]),
            ),
            dirs=Dirs(**d["dirs"]),
            model=ModelPlan(
                name=d["model"],
                dir=d["model_dir"],
                generator=d["model_generator"],
                arch=ModelArch.model_validate(d["model_arch"]),
                architecture=d["model_architecture"],
                quantization=d["model_quantization"],
                unmodelled_weights_gib=d["model_unmodelled_weights_gib"],
                draft_vocab_build=DraftVocabBuild(**draft) if draft else None,
            ),
            files=[RenderedFile(**f) for f in d["files"]],
            service=Service(
                unit_name=d["unit_name"],
                unit_directives=d["unit_directives"],
                pm2_name=d["pm2_name"],
                user=d["service_user"],
                log_file=d["log_file"],
                server_module=d["server_module"],
                listen_host=d["listen_host"],
                port=d["port"],
                url=d["url"],
                served_model_name=d["served_model_name"],
                start_timeout_s=d["start_timeout_s"],
                shutdown_timeout_s=d["shutdown_timeout_s"],
            ),
            sidecar=Sidecar(**d["sidecar"]),
            pm2=Pm2(**d["pm2"]),
            monitoring=dict(d["monitoring"]),
            logrotate=d["logrotate"],
            warnings=list(d["warnings"]),
            secret_env=list(d["secret_env"]),
            release_secret_env=list(d["release_secret_env"]),
            sets=list(d["sets"]),
            cache_seed=CacheSeed(**d["cache_seed"]) if d.get("cache_seed") else None,
            front=Front(**d["front"]) if d.get("front") else None,
        )


def plan(
    profile: str,
    model: str,
    instance: str | None = None,
    base_dir: str = HostVars().base_dir,
    python: str = HostVars().python,
    sets: list[str] | None = None,
    deployment: str | None = None,
    profiles_dir: str | None = None,
    host_name: str = HostVars().name,
    gpu_topology: str = "",
    api_key_file: str | None = None,
    cache_seed: str | None = None,
    cache_seed_allowed_signers: str = "",
) -> Plan:
    """The deploy plan of one instance. `cache_seed`: a seed tar on this machine
    (vfleet_cache_seed), judged against the plan (render.cache_seed), whose signature must be
    by a key of `cache_seed_allowed_signers` (an allowed_signers file on this machine)."""
    sets = list(sets or [])
    if api_key_file:
        if any(s.startswith("api_key=") for s in sets):
            raise VfleetError(
                "the API key is given twice: by a file and as api_key in the settings",
                key=API_KEY_FILE_KEY,
                fix="keep one: the file (API_KEY_FILE=...), or api_key in the inventory's "
                "vfleet_set (a vault variable)",
            )
        # Read here, in the process that renders: the key never passes through an argv.
        sets.append(f"api_key={read_api_key_file(api_key_file)}")
    if instance:
        sets.append(f"instance={instance}")
    try:
        host = HostVars(name=host_name, base_dir=base_dir, python=python, gpu_topology=gpu_topology)
    except ValidationError as exc:
        # Inventory variables (vfleet_base_dir, vfleet_python, the host's name).
        raise validation_error(exc, f"inventory host {host_name}", HostVars) from None
    launch = resolve(
        profile,
        model,
        deployment=Path(deployment) if deployment else None,
        sets=sets,
        root=Path(profiles_dir) if profiles_dir else None,
        host=host,
    )
    files = render_files(launch)
    rid = release_id(files)
    h = launch.host
    inst = launch.instance
    stack = launch.stack
    instance_dir = h.instance_dir(inst)
    sidecar_port = launch.decisions.sidecar_port
    cache_dir = h.cache_dir(inst)
    # launch.sh's HOME (render.release's home_dir).
    home_dir = f"{instance_dir}/home"
    return Plan(
        release_id=rid,
        instance=inst,
        profile=launch.profile.name,
        accelerator=launch.profile.accelerator,
        versions=Versions(
            vfleet=__version__,
            healthcheck=healthcheck_version(),
            # The stack pins the plugin (profiles); the checkout builds one version of it.
            plugin=plugin_version() if stack.plugin else None,
        ),
        software=Software(
            stack_name=launch.stack_name,
            stack=stack,
            packages=requirements(stack),
            remove_packages=list(stack.remove_packages),
            # The front's nginx comes from the OS, installed by the preflight like the rest.
            os_packages=[
                *launch.profile.os_packages,
                *([NGINX_PACKAGE] if launch.decisions.front else []),
            ],
        ),
        dirs=Dirs(
            base=h.base_dir,
            venv=launch.venv,
            instance=instance_dir,
            releases=f"{instance_dir}/releases",
            release=f"{instance_dir}/releases/{rid}",
            current=f"{instance_dir}/current",
            previous=f"{instance_dir}/previous",
            state=f"{instance_dir}/state",
            logs=f"{h.base_dir}/logs",
            cache=cache_dir,
            home=home_dir,
            bin=f"{h.base_dir}/bin",
            wheels=f"{h.base_dir}/wheels",
            models=f"{h.base_dir}/models",
        ),
        model=ModelPlan(
            name=launch.model.name,
            dir=launch.model_dir,
            generator=None if launch.settings.model_dir else launch.model.source.generator,
            arch=launch.model.arch,
            architecture=launch.model.arch.architecture,
            quantization=launch.model.quantization.method,
            unmodelled_weights_gib=launch.model.unmodelled_weights_gib,
            draft_vocab_build=launch.decisions.draft_vocab_build,
        ),
        files=[RenderedFile(f.name, f.content, f"{f.mode:04o}") for f in files],
        service=Service(
            unit_name=unit_name(inst),
            unit_directives=" ".join(expected_unit_directives(launch, "vllm")),
            pm2_name=pm2_name(inst),
            user=h.service_user,
            log_file=h.log_file(inst),
            server_module=launch.server_module,
            listen_host=launch.vllm_host,
            port=launch.vllm_port,
            url=probe_config(launch)["url"],
            served_model_name=launch.served_model_name,
            start_timeout_s=launch.profile.start_timeout_s,
            shutdown_timeout_s=launch.decisions.shutdown_timeout_s,
        ),
        sidecar=Sidecar(
            port=sidecar_port,
            url=f"http://{local_host(launch)}:{sidecar_port}",
            pm2_name=sidecar_pm2_name(inst),
            unit_name=sidecar_unit_name(inst),
            unit_directives=" ".join(expected_unit_directives(launch, "sidecar")),
        ),
        pm2=Pm2(bin=f"{h.base_dir}/pm2/node_modules/.bin/pm2", home=f"{h.base_dir}/pm2/home"),
        monitoring=scrape_target(launch),
        logrotate=logrotate(launch),
        warnings=[n.message for n in launch.notes if n.level == "warn"],
        secret_env=[e.key for e in launch.env if e.secret],
        release_secret_env=sorted({*(e.key for e in launch.env if e.secret), API_KEY_ENV}),
        sets=sets,
        cache_seed=(
            _cache_seed(cache_seed, cache_seed_allowed_signers, launch, cache_dir, home_dir)
            if cache_seed
            else None
        ),
        front=_front(launch) if launch.decisions.front else None,
    )


def _front(launch: Launch) -> Front:
    inst = launch.instance
    f = front_context(launch)
    return Front(
        host=launch.listen_host,
        port=launch.port,
        url=f"http://{local_host(launch)}:{launch.port}",
        vllm_port=launch.vllm_port,
        conf=f["conf"],
        unit_name=front_unit_name(inst),
        unit_directives=" ".join(expected_unit_directives(launch, "front")),
        pm2_name=front_pm2_name(inst),
        log_file=launch.host.front_log_file(inst),
    )


def _cache_seed(
    path: str, allowed_signers: str, launch: Launch, cache_dir: str, home_dir: str
) -> CacheSeed:
    acc = launch.profile.accelerator
    want = identity(launch.stack_name, launch.stack, acc, cache_dir, home_dir)
    pycache = next((str(e.value) for e in launch.env if e.key == "PYTHONPYCACHEPREFIX"), None)
    into = seed_roots(cache_dir, home_dir)
    return read_cache_seed(path, want, into, allowed_signers, pycache)


def prometheus_plan(
    targets: list[dict[str, Any]],
    prometheus_dir: str,
    listen: str,
    scrape_interval: str = "15s",
    prometheus_bin: str = "/usr/bin/prometheus",
) -> dict[str, Any]:
    """What the `vfleet_prometheus` role installs: files under ``prometheus_dir`` and facts."""
    files = prometheus_files(
        targets,
        prometheus_dir=prometheus_dir,
        listen=listen,
        scrape_interval=scrape_interval,
        prometheus_bin=prometheus_bin,
    )
    return {
        "dir": prometheus_dir,
        "listen": listen,
        "url": f"http://{listen}",
        "pm2_name": PM2_NAME,
        "pm2_file": f"{prometheus_dir}/{PM2_FILE}",
        "subdirs": sorted({f.name.rsplit("/", 1)[0] for f in files if "/" in f.name}),
        "files": [{"name": f.name, "content": f.content, "mode": f"{f.mode:04o}"} for f in files],
        "instances": len(targets),
    }
