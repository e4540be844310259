"""The fleet's Prometheus: its config, rules and file_sd targets, rendered from deploy plans.

Each instance's deploy plan carries a `monitoring` entry (`scrape_target()`): where its vLLM
and sidecar answer, its identity labels and its alert thresholds. The Ansible role
`vfleet_prometheus` collects those entries from every host it deployed and calls
`prometheus_files()`, the same code `vfleet prometheus render` runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vfleet import __version__
from vfleet.config.defaults import PROMETHEUS_LISTEN
from vfleet.config.escape import js_literal
from vfleet.config.schema import Alerts
from vfleet.engine.compile import Launch
from vfleet.paths import PROMETHEUS_DIR
from vfleet.render.promrules import THRESHOLDS_HEADER, rules_yaml, threshold_rules, to_yaml
from vfleet.render.release import RenderedFile, sidecar_config, template_env

RULES_FILE = "rules/vfleet.rules.yml"
THRESHOLDS_FILE = "rules/vfleet-thresholds.rules.yml"
VLLM_TARGETS = "targets/vllm.json"
SIDECAR_TARGETS = "targets/sidecar.json"
PM2_FILE = "prometheus.config.js"
PM2_NAME = "vfleet-prometheus"
DEFAULT_LISTEN = PROMETHEUS_LISTEN


# The "decode below baseline" alert fires 20 % under the lowest decode speed the baseline saw:
# the seeds' own runs spread by about that much (seed 002: 77.6-105.6 tok/s).
DECODE_FLOOR_SHARE = 0.8


def effective_alerts(launch: Launch) -> Alerts:
    """The instance's alert thresholds: its settings, plus a decode floor from its baseline
    (profiles/baselines/) when the settings do not set one."""
    alerts = launch.settings.alerts or Alerts()
    decode = launch.baseline.decode_tokens_per_second if launch.baseline else None
    if alerts.stream_decode_tokens_per_second_floor is None and decode is not None:
        floor = round(decode.low * DECODE_FLOOR_SHARE, 1)
        alerts = alerts.model_copy(update={"stream_decode_tokens_per_second_floor": floor})
    return alerts


def scrape_target(launch: Launch) -> dict[str, Any]:
    """What Prometheus needs to know about one instance (JSON-able, part of the deploy plan)."""
    sidecar = sidecar_config(launch)
    return {
        "labels": sidecar["labels"],
        # vLLM's own port: behind a front it answers only on its host's loopback.
        "vllm_port": launch.vllm_port,
        "sidecar_port": int(sidecar["listen"].rsplit(":", 1)[1]),
        "alerts": effective_alerts(launch).model_dump(exclude_none=True),
    }


def _file_sd(targets: list[dict[str, Any]], port_key: str) -> str:
    groups = [
        {"targets": [f"{t['address']}:{t[port_key]}"], "labels": t["labels"]}
        for t in sorted(
            targets, key=lambda t: (t["labels"]["host"], t["labels"]["vfleet_instance"])
        )
    ]
    return json.dumps(groups, indent=2) + "\n"


def prometheus_argv(
    prometheus_dir: str, listen: str, prometheus_bin: str, retention: str
) -> list[str]:
    return [
        prometheus_bin,
        f"--config.file={prometheus_dir}/prometheus.yml",
        f"--storage.tsdb.path={prometheus_dir}/data",
        f"--storage.tsdb.retention.time={retention}",
        f"--web.listen-address={listen}",
        # No --web.enable-lifecycle: with it any local user could POST /-/quit. A deploy
        # reloads rules and config with SIGHUP through pm2 (the role's handler).
    ]


def _pm2(prometheus_dir: str, listen: str, prometheus_bin: str, retention: str) -> str:
    argv = prometheus_argv(prometheus_dir, listen, prometheus_bin, retention)
    app = {
        "name": PM2_NAME,
        "script": argv[0],
        "args": argv[1:],
        "interpreter": "none",
        "cwd": prometheus_dir,
        "autorestart": True,
        "restart_delay": 5000,
        "out_file": f"{prometheus_dir}/prometheus.log",
        "error_file": f"{prometheus_dir}/prometheus.log",
        "merge_logs": True,
        "time": True,
    }
    return (
        f"// Rendered by vfleet {__version__}: pm2 ecosystem for the fleet's Prometheus.\n"
        f"module.exports = {js_literal({'apps': [app]})};\n"
    )


def prometheus_files(
    targets: list[dict[str, Any]],
    *,
    prometheus_dir: str,
    listen: str = DEFAULT_LISTEN,
    scrape_interval: str = "15s",
    prometheus_bin: str = "/usr/bin/prometheus",
    retention: str = "15d",
) -> list[RenderedFile]:
    """Render prometheus.yml, the rules and the target files for ``targets``.

    Each target is a `scrape_target()` dict plus `address`: how the Prometheus host reaches
    that serving host (127.0.0.1 for the control machine itself).
    """
    header = (
        f"# Rendered by vfleet {__version__} for {len(targets)} instance(s). Do not edit: "
        "deploy again."
    )
    ctx = {
        "header": header,
        "scrape_interval": scrape_interval,
        "listen": listen,
        "rule_files": [f"{prometheus_dir}/{RULES_FILE}", f"{prometheus_dir}/{THRESHOLDS_FILE}"],
        "vllm_targets": f"{prometheus_dir}/{VLLM_TARGETS}",
        "sidecar_targets": f"{prometheus_dir}/{SIDECAR_TARGETS}",
    }
    thresholds = threshold_rules((t["labels"], Alerts(**t["alerts"])) for t in targets)
    files = {
        "prometheus.yml": template_env().get_template("prometheus.yml.j2").render(ctx),
        RULES_FILE: rules_yaml(),
        THRESHOLDS_FILE: to_yaml(thresholds, THRESHOLDS_HEADER),
        VLLM_TARGETS: _file_sd(targets, "vllm_port"),
        SIDECAR_TARGETS: _file_sd(targets, "sidecar_port"),
        PM2_FILE: _pm2(prometheus_dir, listen, prometheus_bin, retention),
    }
    return [RenderedFile(name, text, 0o644) for name, text in files.items()]


def committed_rules_path() -> Path:
    return PROMETHEUS_DIR / RULES_FILE
