"""Defaults that more than one part of vfleet uses: each is written here once and imported.

The Makefile and the Ansible roles are read by other tools and carry their own copies of a few of
these (`PROMETHEUS ?= ...`, a role's `defaults/main.yml`); tests/unit/test_one_source.py checks
that each such copy equals the value here, and fails when a value is written anywhere else.
"""

from __future__ import annotations

# vLLM's OpenAI-compatible API: loopback and port 8000 unless the settings say otherwise.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# Seconds vLLM drains in-flight requests after SIGTERM (--shutdown-timeout) unless
# shutdown_timeout_s is set; the service manager (systemd, pm2, docker compose) waits the drain
# and STOP_MARGIN_S more before it kills what is left.
SHUTDOWN_TIMEOUT_S = 30
STOP_MARGIN_S = 30
# vfleet's folder on a host: as root (the role's vfleet_base_dir, HostVars.base_dir), and the
# Makefile's BASE_DIR for anyone else.
BASE_DIR = "/opt/vfleet"
USER_BASE_DIR = "~/.local/share/vfleet"
# The fleet's Prometheus on the control machine: where it listens, and its folder.
PROMETHEUS_LISTEN = "127.0.0.1:9090"
PROMETHEUS_HOST_DIR = f"{BASE_DIR}/prometheus"
# Grafana under docker compose (`vfleet compose --grafana`).
GRAFANA_LISTEN = "127.0.0.1:3000"
# nginx as Debian installs it (nginx-light): the instance's API front and `vfleet balancer`.
NGINX = "/usr/sbin/nginx"
NGINX_PACKAGE = "nginx-light"
