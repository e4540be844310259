"""`vfleet compose`: what `docker compose` needs to run one deployment in containers.

Renders, all or nothing, into one folder:
- `release/`: the same release a host gets (vllm.yaml, vllm.env, launch.sh, probe.json,
  sidecar.json...), rendered for the container layout (the host defaults: /opt/vfleet), and
  mounted read-only where the image expects it;
- `prometheus/`: prometheus.yml, the rules and the scrape targets;
- `compose.env`: the variables compose.yaml reads (image tags from the profile's pins, paths,
  ports, the Grafana admin password), passed with `docker compose --env-file`.

Secrets stay out of that folder: VLLM_API_KEY goes in the secrets file (`--secrets-env`,
created empty once, never overwritten), which compose passes to vLLM as `env_file`.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from .compile import Launch
from .errors import VfleetError
from .images import CONTAINER_HOST, INSTANCE, images_config, images_for
from .monitoring import DEFAULT_LISTEN, PM2_FILE, prometheus_files, scrape_target
from .profiles import REPO_ROOT
from .render import RenderedFile, local_host, render_files, sidecar_config, write_atomic

COMPOSE_FILE = REPO_ROOT / "compose.yaml"
COMPOSE_GPU_FILE = REPO_ROOT / "compose.gpu.yaml"
ENV_FILE = "compose.env"
PROMETHEUS_MOUNT = "/etc/vfleet/prometheus"
GRAFANA_DIR = REPO_ROOT / "observability" / "grafana"


@dataclass(frozen=True)
class ComposeOptions:
    out: Path
    model_dir: Path
    secrets_env: Path | None = None
    prometheus_listen: str = DEFAULT_LISTEN
    grafana_listen: str = "127.0.0.1:3000"
    grafana: bool = False
    project: str | None = None


def default_secrets_env(out: Path) -> Path:
    """Beside the render folder, not in it: a re-render replaces the folder, never this."""
    out = out.resolve()
    return out.with_name(f"{out.name}.secrets.env")


def _check_model_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise VfleetError(
            "no config.json: not a model folder",
            where=str(path),
            key="--model-dir",
            fix="give the folder that holds the model's config.json and weights",
        )
    # The image runs as a non-root user: a root-only file reads as "No such file or
    # directory" inside the container (field notes), so say so here.
    for p in [path, *path.rglob("*")]:
        mode = p.stat().st_mode
        need = stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0)
        if mode & need != need:
            raise VfleetError(
                "not readable by other users (the container runs as uid 10001)",
                where=str(p),
                key="--model-dir",
                fix=f"chmod -R a+rX {path}",
            )


def _previous_env(out: Path) -> dict[str, str]:
    path = out / ENV_FILE
    values: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            key, sep, value = line.partition("=")
            if sep and not key.startswith("#"):
                values[key.strip()] = value
    return values


def _grafana_password(out: Path) -> str:
    """From $GRAFANA_ADMIN_PASSWORD, else the previous render's, else a new random one."""
    given = os.environ.get("GRAFANA_ADMIN_PASSWORD")
    if given:
        return given
    return _previous_env(out).get("GRAFANA_ADMIN_PASSWORD") or secrets.token_urlsafe(18)


def _split_listen(listen: str, key: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise VfleetError(f"expected HOST:PORT, got {listen!r}", key=key, fix="e.g. 127.0.0.1:9090")
    return host, int(port)


def env_lines(launch: Launch, opts: ComposeOptions, out: Path) -> list[tuple[str, str, str]]:
    """(key, value, why) for compose.env."""
    vllm, sidecar, prom = images_for(launch.profile.name, launch.stack_name)
    conf = images_config()
    inst_dir = CONTAINER_HOST.instance_dir(launch.instance)
    grafana_host, grafana_port = _split_listen(opts.grafana_listen, "--grafana-listen")
    gpu = launch.profile.accelerator.kind == "cuda"
    files = [str(COMPOSE_FILE)] + ([str(COMPOSE_GPU_FILE)] if gpu else [])
    stop_grace = int(launch.ctx.d.get("shutdown_timeout_s", 30)) + 30
    secrets_env = opts.secrets_env or default_secrets_env(out)
    project = opts.project or f"vfleet-{launch.profile.name}"
    return [
        ("COMPOSE_PROJECT_NAME", project, "one project per deployment"),
        ("COMPOSE_FILE", os.pathsep.join(files), "GPU profiles add compose.gpu.yaml"),
        ("COMPOSE_PROFILES", "grafana" if opts.grafana else "", "grafana: needs a registry"),
        ("VFLEET_VLLM_IMAGE", vllm.ref, "vfleet images build: tagged with the pins"),
        ("VFLEET_SIDECAR_IMAGE", sidecar.ref, "vfleet images build"),
        ("VFLEET_PROMETHEUS_IMAGE", prom.ref, "vfleet images build"),
        ("VFLEET_GRAFANA_IMAGE", conf.grafana, "profiles/images.yaml"),
        ("VFLEET_RELEASE_DIR", str(out / "release"), "rendered release (read-only mount)"),
        ("VFLEET_RELEASE_MOUNT", f"{inst_dir}/current", "where launch.sh expects it"),
        ("VFLEET_MODEL_DIR", str(opts.model_dir.resolve()), "model on this machine"),
        ("VFLEET_MODEL_MOUNT", launch.model_dir, "the model path in vllm.yaml"),
        ("VFLEET_CACHE_MOUNT", f"{CONTAINER_HOST.base_dir}/cache", "compile caches (volume)"),
        ("VFLEET_STATE_MOUNT", f"{inst_dir}/state", "probe state (volume)"),
        ("VFLEET_SECRETS_ENV", str(secrets_env), "VLLM_API_KEY; never in the release"),
        ("VFLEET_START_TIMEOUT_S", str(launch.profile.start_timeout_s), "profile: model load"),
        ("VFLEET_START_PERIOD", f"{launch.profile.start_timeout_s}s", "healthcheck grace"),
        ("VFLEET_STOP_GRACE", f"{stop_grace}s", "vLLM's drain (--shutdown-timeout) + 30 s"),
        ("VFLEET_VLLM_URL", f"http://{local_host(launch)}:{launch.port}", "vLLM"),
        ("VFLEET_SIDECAR_LISTEN", sidecar_config(launch)["listen"], "sidecar /metrics"),
        ("VFLEET_SIDECAR_WINDOW", str(launch.ctx.d["sidecar_window_s"]), "sidecar window"),
        ("VFLEET_PROMETHEUS_DIR", str(out / "prometheus"), "rendered config (read-only)"),
        ("VFLEET_PROMETHEUS_MOUNT", PROMETHEUS_MOUNT, "where prometheus.yml names it"),
        ("VFLEET_PROMETHEUS_LISTEN", opts.prometheus_listen, "Prometheus web"),
        ("VFLEET_PROMETHEUS_RETENTION", "15d", "TSDB retention"),
        ("VFLEET_GPU_COUNT", str(launch.profile.accelerator.count), "GPUs reserved"),
        ("VFLEET_GRAFANA_ADDR", grafana_host, "Grafana web"),
        ("VFLEET_GRAFANA_PORT", str(grafana_port), "Grafana web"),
        ("VFLEET_GRAFANA_PROVISIONING", str(GRAFANA_DIR / "provisioning"), "datasource"),
        ("VFLEET_GRAFANA_DASHBOARDS", str(GRAFANA_DIR / "dashboards"), "dashboards"),
        ("GRAFANA_ADMIN_PASSWORD", _grafana_password(out), "never a default"),
    ]


def compose_files(launch: Launch, opts: ComposeOptions) -> list[RenderedFile]:
    if launch.host.base_dir != CONTAINER_HOST.base_dir:
        raise VfleetError(
            f"the images use {CONTAINER_HOST.base_dir}, not {launch.host.base_dir}",
            key="--base-dir",
            fix="drop --base-dir for vfleet compose",
        )
    if launch.instance != INSTANCE:
        raise VfleetError(
            f"the images run instance {INSTANCE!r}, not {launch.instance!r}",
            key="instance",
            fix="drop the instance setting for vfleet compose (a compose project is one instance; "
            "use --project to run two)",
        )
    if launch.settings.api_key is not None:
        raise VfleetError(
            "api_key would be written into the release, which the container user must read",
            key="api_key",
            fix="remove api_key from the settings and put VLLM_API_KEY=... in the secrets "
            "file (--secrets-env)",
        )
    _check_model_dir(opts.model_dir)
    _split_listen(opts.prometheus_listen, "--prometheus-listen")
    _split_listen(opts.grafana_listen, "--grafana-listen")
    out = opts.out.resolve()
    files: list[RenderedFile] = []
    for f in render_files(launch):
        # No secret in it (api_key is refused above): readable by the container's user.
        files.append(RenderedFile(f"release/{f.name}", f.content, f.mode | 0o044))
    target = dict(scrape_target(launch), address=local_host(launch))
    for f in prometheus_files(
        [target], prometheus_dir=PROMETHEUS_MOUNT, listen=opts.prometheus_listen
    ):
        if f.name != PM2_FILE:
            files.append(RenderedFile(f"prometheus/{f.name}", f.content, f.mode))
    lines = [
        "# Rendered by vfleet compose: docker compose --env-file <this file> up -d",
        f"# profile {launch.profile.name}, model {launch.model.name}, stack {launch.stack_name}."
        " Mode 0600: it holds the Grafana admin password.",
    ]
    for key, value, why in env_lines(launch, opts, out):
        if "\n" in value:
            raise VfleetError("value contains a newline", key=key)
        lines += [f"# {why}", f"{key}={value}"]
    files.append(RenderedFile(ENV_FILE, "\n".join(lines) + "\n", 0o600))
    return files


def write_compose(launch: Launch, opts: ComposeOptions) -> Path:
    """Render into opts.out (all or nothing) and create the secrets file if missing."""
    files = compose_files(launch, opts)
    out = opts.out.resolve()
    write_atomic(files, out)
    # The container users (uid 10001, Prometheus' 10002) traverse these folders.
    for d in [out, out / "release", out / "prometheus", *(out / "prometheus").rglob("*")]:
        if d.is_dir():
            d.chmod(0o755)
    secrets_env = opts.secrets_env or default_secrets_env(out)
    if not secrets_env.exists():
        fd = os.open(secrets_env, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(
                "# Secrets for the vLLM and sidecar containers (compose env_file). Mode 0600.\n"
                "# VLLM_API_KEY=<key>   # clients then send 'Authorization: Bearer <key>'\n"
            )
    return secrets_env
