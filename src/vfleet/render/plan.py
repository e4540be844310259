"""What the Ansible role needs to deploy one instance, computed on the control machine.

The `vfleet_render` lookup plugin calls `plan()`; the role then only copies files, creates
the venv, builds or checks the model and starts the service. All decisions stay in Python.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from vfleet import __version__
from vfleet.checks.stacks import requirements
from vfleet.config.apikey import KEY as API_KEY_FILE_KEY
from vfleet.config.apikey import read_api_key_file
from vfleet.config.profiles import validation_error
from vfleet.config.schema import HostVars
from vfleet.engine.compile import Launch, resolve
from vfleet.engine.rules import API_KEY_ENV
from vfleet.errors import VfleetError
from vfleet.paths import REPO_ROOT
from vfleet.render.monitoring import PM2_FILE, PM2_NAME, prometheus_files, scrape_target
from vfleet.render.release import (
    context,
    expected_unit_directives,
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


def _project_version(folder: str) -> str:
    import tomllib

    path = REPO_ROOT / folder / "pyproject.toml"
    return str(tomllib.loads(path.read_text(encoding="utf-8"))["project"]["version"])


def healthcheck_version() -> str:
    """The probe wheel's version, read from its pyproject.toml (the one place it is set)."""
    return _project_version("healthcheck")


def plugin_version() -> str:
    """The SM75 plugin wheel's version this checkout builds (plugin/pyproject.toml)."""
    return _project_version("plugin")


def logrotate(launch: Launch) -> str:
    """/etc/logrotate.d/vfleet for the host's log folder (one per base dir, all instances)."""
    return template_env().get_template("logrotate.j2").render(context(launch))


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
) -> dict[str, Any]:
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
    return {
        "vfleet_version": __version__,
        "release_id": rid,
        "instance": inst,
        "profile": launch.profile.name,
        "model": launch.model.name,
        "stack_name": launch.stack_name,
        "stack": stack.model_dump(),
        "accelerator": launch.profile.accelerator.model_dump(),
        "os_packages": launch.profile.os_packages,
        "start_timeout_s": launch.profile.start_timeout_s,
        # Every pin of the stack, as the image installs them (`vfleet stacks check` resolves
        # the same list).
        "packages": requirements(stack),
        "remove_packages": stack.remove_packages,
        "healthcheck_version": healthcheck_version(),
        # The stack pins the plugin (profiles); the checkout builds one version of it.
        "plugin_version": plugin_version() if stack.plugin else None,
        "dirs": {
            "base": h.base_dir,
            "venv": launch.venv,
            "instance": instance_dir,
            "releases": f"{instance_dir}/releases",
            "release": f"{instance_dir}/releases/{rid}",
            "current": f"{instance_dir}/current",
            "previous": f"{instance_dir}/previous",
            "state": f"{instance_dir}/state",
            "logs": f"{h.base_dir}/logs",
            "cache": h.cache_dir(inst),
            "bin": f"{h.base_dir}/bin",
            "wheels": f"{h.base_dir}/wheels",
            "models": f"{h.base_dir}/models",
        },
        "model_dir": launch.model_dir,
        # A model_dir the operator set means "my weights": never generated over, only checked.
        "model_generator": None if launch.settings.model_dir else launch.model.source.generator,
        "model_arch": launch.model.arch.model_dump(),
        # The SM75 plugin's draft vocabulary to build on the host (tasks/draft_vocab.yml), or None.
        "draft_vocab_build": (
            asdict(build) if (build := launch.decisions.draft_vocab_build) is not None else None
        ),
        "model_architecture": launch.model.arch.architecture,
        "files": [{"name": f.name, "content": f.content, "mode": f"{f.mode:04o}"} for f in files],
        "unit_name": unit_name(inst),
        # What vfleet-verify-unit accepts in each unit: the template's directives, in order.
        "unit_directives": " ".join(expected_unit_directives(launch, "vllm")),
        # The system user both services run as where the deploy runs as root.
        "service_user": h.service_user,
        "pm2_name": pm2_name(inst),
        "listen_host": launch.listen_host,
        "port": launch.port,
        "url": probe_config(launch)["url"],
        "served_model_name": launch.served_model_name,
        # vLLM drains in-flight requests this long on SIGTERM (the "drain" rule).
        "shutdown_timeout_s": launch.decisions.shutdown_timeout_s,
        "sidecar": {
            "port": launch.decisions.sidecar_port,
            "url": f"http://{local_host(launch)}:{launch.decisions.sidecar_port}",
            "pm2_name": sidecar_pm2_name(inst),
            "unit_name": sidecar_unit_name(inst),
            "unit_directives": " ".join(expected_unit_directives(launch, "sidecar")),
        },
        "monitoring": scrape_target(launch),
        "logrotate": logrotate(launch),
        "warnings": [n.message for n in launch.notes if n.level == "warn"],
        # What `vfleet doctor` checks a host against (src/vfleet/fleet/doctor.py).
        "model_quantization": launch.model.quantization.method,
        "model_unmodelled_weights_gib": launch.model.unmodelled_weights_gib,
        "server_module": launch.server_module,
        "log_file": h.log_file(inst),
        "secret_env": [e.key for e in launch.env if e.secret],
        # The env names that may hold a secret in any release of the instance: write_release.py
        # gives every kept release the current values (or none), so none keeps a replaced key.
        "release_secret_env": sorted({*(e.key for e in launch.env if e.secret), API_KEY_ENV}),
        "pm2": {"bin": f"{h.base_dir}/pm2/node_modules/.bin/pm2", "home": f"{h.base_dir}/pm2/home"},
        "sets": sets,
    }


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
