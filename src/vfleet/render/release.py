"""Render a launch configuration into files, all or nothing.

The same templates (`templates/`) serve the CLI and Ansible (through the `vfleet_render`
lookup plugin, which calls `render_files`). Files are rendered in memory first, written
into a temporary folder next to the target and then swapped in, so a failure leaves the
target exactly as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from vfleet import __version__
from vfleet.config.defaults import NGINX, STOP_MARGIN_S
from vfleet.config.escape import (
    js_literal,
    nginx_word,
    one_line,
    shell_word,
    systemd_command,
    systemd_path,
    systemd_value,
)
from vfleet.engine.api_routes import ALLOWED_ROUTES
from vfleet.engine.compile import Launch
from vfleet.engine.decode_cost import decode_cost
from vfleet.engine.rules import CACHE_ENV, DRAFT_VOCAB_FILE, plugin_state_file
from vfleet.engine.warmup import warmup_plan
from vfleet.errors import VfleetError
from vfleet.hostside.logwhy import LAUNCH_MARK
from vfleet.paths import TEMPLATES_DIR

MARKER = ".vfleet-render"


# What stands for a secret's value wherever a file is hashed or published.
REDACTED = "<secret>"


@dataclass(frozen=True)
class RenderedFile:
    name: str
    content: str
    mode: int
    # The content with every secret value replaced by REDACTED, where the file holds secrets
    # (vllm.env). Hashes (release.json, the release id) are taken over this text: both are
    # published (0644 file, the sidecar's /metrics), and a hash over the key would let anyone
    # check guesses of it offline.
    redacted: str | None = None

    @property
    def public(self) -> str:
        """The text a hash may be taken over: the content without its secrets."""
        return self.content if self.redacted is None else self.redacted


def template_env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    # Every value a template writes goes through its target's helper (src/vfleet/config/escape.py).
    env.filters.update(
        systemd=systemd_value,
        systemd_path=systemd_path,
        sh=shell_word,
        one_line=one_line,
        nginx=nginx_word,
    )
    return env


def shell_quote_env(key: str, value: str) -> str:
    """Single-quote a value so that systemd's EnvironmentFile and sh read it the same."""
    if "'" in value or "\n" in value or "\\" in value:
        raise VfleetError(
            "value contains a quote, backslash or newline",
            key=f"env {key}",
            fix="use a value without ', \\ or newlines",
        )
    return f"'{value}'"


def unit_name(instance: str) -> str:
    return f"vfleet-vllm@{instance}.service"


def pm2_name(instance: str) -> str:
    return f"vfleet-vllm-{instance}"


def sidecar_unit_name(instance: str) -> str:
    return f"vfleet-sidecar@{instance}.service"


def sidecar_pm2_name(instance: str) -> str:
    return f"vfleet-sidecar-{instance}"


def front_unit_name(instance: str) -> str:
    return f"vfleet-front@{instance}.service"


def front_pm2_name(instance: str) -> str:
    return f"vfleet-front-{instance}"


FRONT_CONF = "nginx-front.conf"
# How long the front waits for the next byte of an answer (a long generation streams).
FRONT_READ_TIMEOUT_S = 600


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def front_context(launch: Launch) -> dict[str, Any]:
    """The nginx front's values, each one nginx word (config/escape.py)."""
    h, inst = launch.host, launch.instance
    prefix = f"{h.instance_dir(inst)}/state"
    return {
        "listen": nginx_word(_address(launch.listen_host, launch.port), "host"),
        "upstream": nginx_word(_address(launch.vllm_host, launch.vllm_port), "host"),
        "prefix": nginx_word(prefix, "base_dir"),
        "conf": nginx_word(f"{h.instance_dir(inst)}/current/{FRONT_CONF}", "base_dir"),
        "nginx": NGINX,
        "routes": ALLOWED_ROUTES,
        "read_timeout_s": FRONT_READ_TIMEOUT_S,
    }


def front_argv(launch: Launch, test: bool = False) -> list[str]:
    """nginx in the foreground (`daemon off;` in its file), errors to its log."""
    f = front_context(launch)
    return [f["nginx"], *(["-t", "-q"] if test else []), "-e", "stderr", "-p", f"{f['prefix']}/",
            "-c", f["conf"]]  # fmt: skip


def _yaml_entry(key: str, value: Any) -> str:
    # Scalars as `key: value`; a nested config as one flow-style line, readable in a diff.
    flow = None if isinstance(value, dict | list) else False
    text = yaml.safe_dump({key: value}, default_flow_style=flow, sort_keys=False, width=10**6)
    return text.rstrip("\n")


def context(launch: Launch, *, redact: bool = False) -> dict[str, Any]:
    """The templates' variables; redact=True puts REDACTED in place of secret env values."""
    h = launch.host
    inst = launch.instance
    instance_dir = h.instance_dir(inst)
    current = f"{instance_dir}/current"
    cache = h.cache_dir(inst)
    start_timeout = launch.profile.start_timeout_s
    stop_timeout = launch.decisions.shutdown_timeout_s + STOP_MARGIN_S
    header = one_line(
        f"# Rendered by vfleet {__version__}: profile {launch.profile.name}, model "
        f"{launch.model.name}, stack {launch.stack_name}. Do not edit: change the profile or "
        "deployment and render again."
    )
    probe = [f"{launch.venv}/bin/vfleet-probe", "--config", f"{current}/probe.json"]
    sidecar = sidecar_config(launch)
    sidecar_argv = [
        f"{launch.venv}/bin/vfleet-exporter",
        "--config",
        f"{current}/sidecar.json",
        "--vllm-url",
        sidecar["vllm_url"],
        "--listen",
        sidecar["listen"],
        "--window",
        str(sidecar["window_s"]),
    ]
    apps = {
        "apps": [
            {
                "name": pm2_name(inst),
                "script": f"{current}/launch.sh",
                "interpreter": "none",
                "cwd": instance_dir,
                "autorestart": True,
                # A crash loop must stop: restarts within min_uptime count against max_restarts.
                "min_uptime": f"{start_timeout}s",
                "max_restarts": 5,
                "restart_delay": launch.decisions.restart_sec * 1000,
                "kill_timeout": stop_timeout * 1000,
                "out_file": h.log_file(inst),
                "error_file": h.log_file(inst),
                "merge_logs": True,
                "time": True,
            },
            {
                "name": sidecar_pm2_name(inst),
                "script": sidecar_argv[0],
                "args": sidecar_argv[1:],
                "interpreter": "none",
                "cwd": instance_dir,
                "autorestart": True,
                "restart_delay": 5000,
                "out_file": h.sidecar_log_file(inst),
                "error_file": h.sidecar_log_file(inst),
                "merge_logs": True,
                "time": True,
            },
        ]
    }
    if launch.decisions.front:
        front = front_argv(launch)
        apps["apps"].append(
            {
                "name": front_pm2_name(inst),
                "script": front[0],
                "args": front[1:],
                "interpreter": "none",
                "cwd": instance_dir,
                "autorestart": True,
                "restart_delay": 5000,
                "out_file": h.front_log_file(inst),
                "error_file": h.front_log_file(inst),
                "merge_logs": True,
                "time": True,
            }
        )
    return {
        "header": header,
        "header_js": header.replace("# ", "// ", 1),
        "instance": inst,
        "profile": launch.profile.name,
        "model": launch.model.name,
        "vllm_version": launch.stack.vllm,
        "server_module": launch.server_module,
        "launch_mark": LAUNCH_MARK,
        "python": f"{launch.venv}/bin/python",
        "args": [
            {"rule": e.rule, "reason": e.reason, "yaml": _yaml_entry(e.key, e.value)}
            for e in launch.args
        ],
        "env": [
            {
                "rule": e.rule,
                "reason": "secret" if e.secret else e.reason,
                "key": e.key,
                "quoted": shell_quote_env(e.key, REDACTED if redact and e.secret else str(e.value)),
            }
            for e in launch.env
        ],
        "cache_dirs": cache_dirs(launch),
        "instance_dir": instance_dir,
        "current_dir": current,
        "release_dir": current,
        "log_file": h.log_file(inst),
        "start_timeout_s": start_timeout,
        "stop_timeout_s": stop_timeout,
        "start_limit_interval_s": start_timeout * 3,
        "start_limit_burst": launch.decisions.start_limit_burst,
        "restart_sec": launch.decisions.restart_sec,
        "home_dir": f"{instance_dir}/home",
        "gpu": launch.profile.accelerator.kind == "cuda",
        # ProtectSystem=strict: only these stay writable ('-': not an error if missing).
        "writable_paths": [instance_dir, cache, f"{h.base_dir}/logs"],
        # A base dir under /home or /root (a non-root deploy) must stay reachable.
        "protect_home": "read-only" if _under_home(h.base_dir) else "yes",
        # Exec*= lines, each word escaped for systemd. $MAINPID stays a live variable.
        "prereqs_command": systemd_command([*probe, "--prereqs"]),
        "ready_command": systemd_command(
            [*probe, "--wait", str(start_timeout), "--warmup", "--pid"]
        )
        + " $MAINPID",
        "launch_command": systemd_command([f"{current}/launch.sh"]),
        "sidecar_command": systemd_command(sidecar_argv),
        # The system user both units run as (pm2: when pm2 runs as root, ecosystem.config.js).
        "service_user": h.service_user,
        "sidecar_log_file": h.sidecar_log_file(inst),
        "logs_dir": f"{h.base_dir}/logs",
        "vllm_unit": unit_name(inst),
        "apps_json": js_literal(apps),
        "service_user_js": js_literal(h.service_user),
        **(_front_values(launch) if launch.decisions.front else {}),
    }


def _front_values(launch: Launch) -> dict[str, Any]:
    return {
        "front": front_context(launch),
        "front_prefix": front_context(launch)["prefix"],
        "front_log_file": launch.host.front_log_file(launch.instance),
        "front_command": systemd_command(front_argv(launch)),
        "front_test_command": systemd_command(front_argv(launch, test=True)),
    }


def _under_home(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ("/home", "/root", "/run/user"))


def local_host(launch: Launch) -> str:
    """The address a client on the same host uses for what listens on listen_host."""
    return _reached_at(launch.listen_host)


def _reached_at(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def vllm_url(launch: Launch) -> str:
    """vLLM itself as the probe and the sidecar on its host reach it (behind the front too)."""
    return f"http://{_reached_at(launch.vllm_host)}:{launch.vllm_port}"


def cache_dirs(launch: Launch) -> list[str]:
    """The compile cache folders the rules chose (created before start, kept across restarts)."""
    return [str(e.value) for e in launch.env if e.key in CACHE_ENV]


def probe_config(launch: Launch) -> dict[str, Any]:
    inst_dir = launch.host.instance_dir(launch.instance)
    return {
        "url": vllm_url(launch),
        "served_model_name": launch.served_model_name,
        "env_file": f"{launch.host.instance_dir(launch.instance)}/current/vllm.env",
        "state_dir": f"{launch.host.instance_dir(launch.instance)}/state",
        "serving_timeout_s": 60,
        # Checked by `vfleet-probe --prereqs` before vLLM starts (systemd ExecStartPre).
        "prereqs": {
            "model_dir": launch.model_dir,
            "writable": [*cache_dirs(launch), f"{inst_dir}/home", f"{inst_dir}/state"],
            "host": _reached_at(launch.vllm_host),
            "port": launch.vllm_port,
            "gpus": launch.profile.accelerator.count,
            # More than this used on a GPU before start: a previous server still holds it.
            "gpu_free_mib": 1024,
        },
        "warmup": warmup_plan(launch),
    }


def sidecar_config(launch: Launch) -> dict[str, Any]:
    """sidecar.json: what vfleet-exporter needs to know about the instance it watches."""
    stack = launch.stack
    return {
        "vllm_url": probe_config(launch)["url"],
        # Where vLLM listens, the sidecar listens: a remote Prometheus reaches both or neither.
        "listen": f"{launch.listen_host}:{launch.decisions.sidecar_port}",
        "window_s": launch.decisions.sidecar_window_s,
        "labels": {
            "host": launch.host.name,
            "profile": launch.profile.name,
            "preset": launch.model.name,
            "vfleet_instance": launch.instance,
            "model_name": launch.served_model_name,
        },
        "info": {
            "vllm_version": stack.vllm,
            "stack": launch.stack_name,
            "torch": stack.torch,
            "plugin": stack.plugin or "",
            # Read from plugin_state at each scrape where the stack carries the plugin.
            "plugin_features": "",
        },
        # The running speculative depth and where `vfleet tune` leaves the measured step time
        # per depth: with both, the sidecar recommends a depth (vfleet_healthcheck.depth).
        "spec_decode": {"method": launch.decisions.spec_method, "depth": launch.decisions.spec_k},
        "step_times": launch.host.step_times_file(launch.instance),
        # What a decode step reads per GPU and the card's bandwidth: the floor gauges, and
        # step times modelled from the live step where no table exists (engine/decode_cost.py).
        **({"decode_cost": cost} if (cost := decode_cost(launch).sidecar()) else {}),
        # The SM75 plugin's runtime decision (VFLEET_SM75_STATE): the features on now.
        **(
            {"plugin_state": plugin_state_file(launch.host, launch.instance)}
            if stack.plugin
            else {}
        ),
    }


def release_manifest(launch: Launch, files: dict[str, str]) -> dict[str, Any]:
    stack = launch.stack.model_dump(exclude={"sources", "description", "remove_packages"})
    return {
        "vfleet": __version__,
        "instance": launch.instance,
        "profile": launch.profile.name,
        "model": launch.model.name,
        "stack": launch.stack_name,
        "versions": stack,
        "served_model_name": launch.served_model_name,
        "url": probe_config(launch)["url"],
        # What a rollback needs to wait for this release without rendering anything.
        "venv": launch.venv,
        "start_timeout_s": launch.profile.start_timeout_s,
        "log_file": launch.host.log_file(launch.instance),  # why it did not come back
        "args": {e.key: e.value for e in launch.args},
        "env": {e.key: ("<secret>" if e.secret else e.value) for e in launch.env},
        "decisions": [
            {"kind": e.kind, "key": e.key, "rule": e.rule, "source": e.source}
            for e in [*launch.args, *launch.env]
        ],
        "notes": [{"level": n.level, "rule": n.rule, "message": n.message} for n in launch.notes],
        "files": {name: hashlib.sha256(text.encode()).hexdigest() for name, text in files.items()},
    }


UNIT_TEMPLATES = {
    "vllm": "vfleet-vllm.service.j2",
    "sidecar": "vfleet-sidecar.service.j2",
    "front": "vfleet-front.service.j2",
}


def unit_directives(text: str) -> list[str]:
    """A unit's directives in order, as Section/Key (what vfleet-verify-unit reads the same way)."""
    out, section = [], ""
    # Only "\n" ends a line for systemd (str.splitlines would also split at U+2028).
    for line in text.split("\n"):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
        else:
            out.append(f"{section}/{line.split('=', 1)[0].rstrip()}")
    return out


def _placeholder(value: Any) -> Any:
    # Strings become a plain path (comments stay comments); flags, numbers and the shape of
    # lists stay as they are.
    if isinstance(value, str):
        return "# x" if value.startswith("#") else "/x"
    if isinstance(value, list):
        return [_placeholder(v) for v in value]
    if isinstance(value, dict):
        return {k: _placeholder(v) for k, v in value.items()}
    return value


def expected_unit_directives(launch: Launch, unit: str) -> list[str]:
    """The directives the unit template produces for this launch, whatever its values hold.

    The template is rendered with every string replaced by a harmless one, so a value that
    smuggled a newline into the real unit cannot change this list (the role's unit
    verification compares the two).
    """
    ctx = _placeholder(context(launch))
    return unit_directives(template_env().get_template(UNIT_TEMPLATES[unit]).render(ctx))


def render_files(launch: Launch) -> list[RenderedFile]:
    env = template_env()
    ctx = context(launch)
    env_file = env.get_template("vllm.env.j2")
    redacted = {"vllm.env": env_file.render(context(launch, redact=True))}
    out: dict[str, tuple[str, int]] = {
        "vllm.yaml": (env.get_template("vllm.yaml.j2").render(ctx), 0o644),
        "vllm.env": (env_file.render(ctx), 0o600),
        "launch.sh": (env.get_template("launch.sh.j2").render(ctx), 0o755),
        unit_name(launch.instance): (
            env.get_template(UNIT_TEMPLATES["vllm"]).render(ctx),
            0o644,
        ),
        "ecosystem.config.js": (env.get_template("ecosystem.config.js.j2").render(ctx), 0o644),
        "probe.json": (json.dumps(probe_config(launch), indent=2) + "\n", 0o644),
        "sidecar.json": (json.dumps(sidecar_config(launch), indent=2) + "\n", 0o644),
        sidecar_unit_name(launch.instance): (
            env.get_template(UNIT_TEMPLATES["sidecar"]).render(ctx),
            0o644,
        ),
    }
    if launch.decisions.front:
        out[FRONT_CONF] = (env.get_template("nginx-front.conf.j2").render(ctx), 0o644)
        out[front_unit_name(launch.instance)] = (
            env.get_template(UNIT_TEMPLATES["front"]).render(ctx),
            0o644,
        )
    if launch.draft_vocab is not None:
        out[DRAFT_VOCAB_FILE] = (launch.draft_vocab, 0o644)
    # The manifest hashes the other files, the env file without its secrets' values.
    manifest = release_manifest(launch, {k: redacted.get(k, v[0]) for k, v in out.items()})
    out["release.json"] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n", 0o644)
    return [
        RenderedFile(name, text, mode, redacted.get(name)) for name, (text, mode) in out.items()
    ]


def release_id(files: list[RenderedFile]) -> str:
    """Content address of a release: same inputs, same id (so a redeploy changes nothing).

    Taken over the files without their secrets: the id is published (release folder names,
    the `release` label of `vfleet_info` on the sidecar's /metrics), so it must not let anyone
    check a guessed key. A new key alone keeps the id; the role then rewrites the env file in
    place and restarts.
    """
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        h.update(f.name.encode() + b"\0" + f.public.encode() + b"\0")
    return h.hexdigest()[:12]


def write_atomic(files: list[RenderedFile], out: Path) -> None:
    """Write files into `out`, replacing a previous render. All or nothing.

    Refuses to touch a non-empty folder that vfleet did not render, so nothing of the
    operator's is ever overwritten.
    """
    out = out.resolve()
    if out.exists():
        if not out.is_dir():
            raise VfleetError(
                "exists and is not a folder", where=str(out), fix="choose another --out"
            )
        if any(out.iterdir()) and not (out / MARKER).exists():
            raise VfleetError(
                "folder is not empty and was not rendered by vfleet",
                where=str(out),
                fix="choose an empty or new --out folder",
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        for f in files:
            path = tmp / f.name
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, f.mode)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(f.content)
            os.chmod(path, f.mode)
        (tmp / MARKER).write_text(release_id(files) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            old.rmdir()
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
