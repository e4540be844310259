"""Gather the facts `vfleet doctor` judges, on the serving host. Python 3.11 stdlib only.

Copied to a host and run as ``python3 hostfacts.py '<request json>'`` (or over ssh as
``python3 - '<request json>' < hostfacts.py``); also importable (`gather`). It prints ONE JSON
object and always exits 0 once the request parses: a fact it cannot get is null, with a line
in ``errors`` saying why. It judges nothing; the control machine does (src/vfleet/fleet/doctor/).

Secrets never leave the host in clear: environment values whose key is a secret (the request's
``secret_keys``, or a name like *KEY/*TOKEN/*SECRET/*PASSWORD) are replaced by their sha256
hex, and any secret value found elsewhere (log lines, argv, config text) is masked.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NotRequired, TypedDict

VERSION = 1
LOG_LINES = 200
HTTP_TIMEOUT_S = 3.0
CPU_FLAGS = ("avx", "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
SYSTEMD_PROPS = (
    "ActiveState,SubState,Result,NRestarts,MainPID,ExecMainStatus,ExecMainCode,"
    "LoadState,UnitFileState"
)
GPU_QUERY = "index,name,compute_cap,memory.total,memory.used,driver_version,uuid"
# process_name last: a name with a comma stays whole.
APPS_QUERY = "gpu_uuid,pid,used_memory,process_name"
# Names that hold credentials even when the request does not list them (defence in depth).
SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL)", re.IGNORECASE)
# Secrets shorter than this are not masked inside other text (it would garble every line).
MASK_MIN_LEN = 4
# The most read of a file the service user writes (the plugin's state is a few hundred bytes).
SERVICE_FILE_MAX = 64 * 1024


class Pm2Request(TypedDict):
    bin: str  # the pm2 executable vfleet installed
    home: str  # PM2_HOME
    name: str  # the app name of this instance


class Request(TypedDict):
    """What to look at. Built on the control machine by `vfleet.fleet.inventory.request(plan)`."""

    base_dir: str  # disk space is measured here (or at its nearest existing parent)
    instance_dir: str  # a process with `--config <under this dir>` belongs to the instance
    current_dir: str  # the `current` release link
    venv_dir: str  # the vLLM virtualenv (its pyvenv.cfg names its Python)
    model_dir: str
    accelerator: str  # "cuda" (query nvidia-smi) or "cpu"
    ports: list[int]  # who listens on each
    packages: list[str]  # Debian packages to look up with dpkg-query
    unit: str  # systemd unit of the instance
    pm2: Pm2Request | None
    log_file: str  # the instance log: its last LOG_LINES lines
    url: str  # loopback base URL of the instance (/v1/models, /metrics)
    env_file: str  # the rendered vllm.env: VLLM_API_KEY for the HTTP requests, read here
    env_keys: list[str]  # environment of the running process: these keys...
    env_prefixes: list[str]  # ...and every key starting with one of these
    secret_keys: list[str]  # values hashed (sha256 hex), never sent in clear
    timeout_s: NotRequired[float]  # per external command (default 15)
    plugin_state_file: NotRequired[str]  # the SM75 plugin's runtime decision (JSON), if any


class GatherError(Exception):
    """A fact that cannot be had; the message says why."""


def is_secret(key: str, secret_keys: list[str]) -> bool:
    return key in secret_keys or bool(SECRET_NAME.search(key))


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """stdout of a command; GatherError when it is missing, fails or hangs."""
    if shutil.which(argv[0]) is None and not os.access(argv[0], os.X_OK):
        raise GatherError(f"{argv[0]} not found")
    try:
        r = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        raise GatherError(f"{' '.join(argv[:3])} timed out after {timeout:g} s") from None
    except OSError as exc:
        raise GatherError(f"{argv[0]}: {exc}") from None
    if r.returncode != 0:
        why = (r.stderr.strip() or r.stdout.strip()).splitlines()
        raise GatherError(f"{' '.join(argv[:3])} exited {r.returncode}: {' '.join(why[-2:])}")
    return r.stdout


def read_text(path: str | Path) -> str:
    return Path(path).read_text(encoding="utf-8", errors="replace")


def read_service_file(path: str, limit: int = SERVICE_FILE_MAX) -> str:
    """A file in a folder the service user writes (instances/<i>/state), read as root.

    That user chooses what the name is: a link to /dev/zero (a read without end) or to a
    root-only file (its content would travel to the control machine), a FIFO (an open that
    never returns), a hard link to another user's file. So: the last component is not followed
    (O_NOFOLLOW; the folders above it are root's), the open does not wait (O_NONBLOCK), and
    only a regular file with one link, at most `limit` bytes, is read."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise GatherError(f"{path} is a symbolic link: refused, not followed") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise GatherError(f"{path} is not a regular file: refused")
        if st.st_nlink != 1:
            raise GatherError(f"{path} has {st.st_nlink} hard links: refused (another file)")
        chunks, size = [], 0
        while chunk := os.read(fd, min(65536, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise GatherError(f"{path} is larger than {limit} bytes: refused")
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- system


def os_facts() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "kernel": platform.release(),
        "hostname": socket.gethostname(),
    }


def cpu_facts() -> dict[str, Any]:
    model: str | None = None
    flags: set[str] = set()
    logical = 0
    for line in read_text("/proc/cpuinfo").splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            logical += 1
        elif key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return {
        "model": model,
        "flags": [f for f in CPU_FLAGS if f in flags],
        "logical_cpus": logical or os.cpu_count(),
    }


def memory_facts() -> dict[str, Any]:
    kib: dict[str, int] = {}
    for line in read_text("/proc/meminfo").splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            kib[key] = int(parts[0])
    return {
        "total_bytes": kib["MemTotal"] * 1024,
        "available_bytes": kib["MemAvailable"] * 1024,
    }


def disk_facts(base_dir: str) -> dict[str, Any]:
    path = Path(base_dir)
    while not path.exists() and path != path.parent:
        path = path.parent  # before the first deploy the base dir does not exist yet
    st = os.statvfs(path)
    return {"path": str(path), "free_bytes": st.f_bavail * st.f_frsize}


def time_sync(timeout: float) -> bool:
    try:
        out = run(["timedatectl", "show", "-p", "NTPSynchronized", "--value"], timeout).strip()
        return out == "yes"
    except GatherError as exc:
        # Without a system bus timedatectl fails; timesyncd still leaves its marker file.
        if Path("/run/systemd/timesync/synchronized").exists():
            return True
        raise GatherError(f"{exc}; no /run/systemd/timesync/synchronized") from None


def package_facts(names: list[str], timeout: float) -> dict[str, bool]:
    if not names:
        return {}
    if shutil.which("dpkg-query") is None:
        raise GatherError("dpkg-query not found (not a Debian host?)")
    # dpkg-query exits 1 when a name is unknown; its stdout still lists the known ones.
    r = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${Status}\n", *names],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    installed = {
        line.split()[0]
        for line in r.stdout.splitlines()
        if line.endswith(" installed") and " not-installed" not in line
    }
    return {name: name in installed for name in names}


def venv_facts(venv_dir: str) -> dict[str, Any]:
    cfg = Path(venv_dir) / "pyvenv.cfg"
    version = None
    if cfg.exists():
        for line in read_text(cfg).splitlines():
            key, _, value = line.partition("=")
            if key.strip() in ("version", "version_info"):
                version = value.strip()
                break
    return {"dir": venv_dir, "exists": cfg.exists(), "python": version}


# --------------------------------------------------------------------------- GPUs


def gpu_facts(timeout: float) -> dict[str, Any]:
    out = run(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"], timeout)
    return {
        "query": out,
        # The driver's CUDA version is printed only in the plain header.
        "header": run(["nvidia-smi"], timeout),
        "topology": run(["nvidia-smi", "topo", "-m"], timeout),
        "apps": run(
            [
                "nvidia-smi",
                f"--query-compute-apps={APPS_QUERY}",
                "--format=csv,noheader,nounits",
            ],
            timeout,
        ),
        # memory.total less this is the card as torch reports it (the planner's
        # calibration.torch_total_mib); a separate query, as older drivers lack the field.
        "reserved_mib": _reserved_mib(timeout),
    }


def _reserved_mib(timeout: float) -> str | None:
    try:
        return run(
            ["nvidia-smi", "--query-gpu=index,memory.reserved", "--format=csv,noheader,nounits"],
            timeout,
        )
    except GatherError:
        return None


# --------------------------------------------------------------------------- model


def model_facts(model_dir: str) -> dict[str, Any]:
    d = Path(model_dir)
    cfg_path = d / "config.json"
    out: dict[str, Any] = {
        "dir": model_dir,
        "exists": d.is_dir(),
        "config": cfg_path.is_file(),
        "architectures": None,
        "model_type": None,
        "quant_method": None,
        "safetensors": False,
        "weights_bytes": 0,
    }
    if not d.is_dir():
        return out
    files = list(d.glob("*.safetensors"))
    out["safetensors"] = bool(files)
    out["weights_bytes"] = sum(f.stat().st_size for f in files)
    if cfg_path.is_file():
        cfg = json.loads(read_text(cfg_path))
        # Multimodal checkpoints may keep the text model's facts in text_config.
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        quant = cfg.get("quantization_config") or text.get("quantization_config") or {}
        out["architectures"] = cfg.get("architectures")
        out["model_type"] = cfg.get("model_type")
        out["quant_method"] = quant.get("quant_method") if isinstance(quant, dict) else None
    return out


# --------------------------------------------------------------------------- processes


def _pids() -> list[int]:
    return sorted(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())


def _cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else []


def _stat(pid: int) -> tuple[int, int]:
    """(ppid, start time in clock ticks after boot) from /proc/PID/stat."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()  # the comm field may hold spaces
    return int(fields[1]), int(fields[19])


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0  # a kernel thread or a zombie


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise GatherError("no btime in /proc/stat")


def _config_arg(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _under(path: str, folder: str) -> bool:
    p, f = os.path.normpath(path), os.path.normpath(folder)
    return p.startswith(f + os.sep) or os.path.realpath(p).startswith(os.path.realpath(f) + os.sep)


def _pid_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def process_table() -> dict[int, dict[str, Any]]:
    """Every readable process of this host: argv, parent, start tick. Processes that vanish
    are skipped, and so are those of containers running here (another mount namespace): their
    /opt/vfleet is not this host's."""
    table: dict[int, dict[str, Any]] = {}
    own = _pid_ns("self")
    for pid in _pids():
        ns = _pid_ns(pid)
        if own is not None and ns is not None and ns != own:
            continue
        try:
            ppid, start = _stat(pid)
            table[pid] = {"argv": _cmdline(pid), "ppid": ppid, "start": start}
        except (OSError, ValueError, IndexError):
            continue
    return table


def _descendants(pid: int, table: dict[int, dict[str, Any]]) -> list[int]:
    kids: dict[int, list[int]] = {}
    for p, info in table.items():
        kids.setdefault(info["ppid"], []).append(p)
    out, todo = [], [pid]
    while todo:
        found = kids.get(todo.pop(), [])
        out += found
        todo += found
    return sorted(out)


def _environ(pid: int, req: Request) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if not sep:
            continue
        if key in req["env_keys"] or key.startswith(tuple(req["env_prefixes"])):
            env[key] = value
    return env


def _proc_name(pid: int, argv: list[str]) -> str:
    # vLLM retitles its engine and workers (setproctitle: "VLLM::EngineCore"); comm is cut
    # at 15 characters, so prefer argv when it was retitled.
    if argv and "::" in argv[0]:
        return argv[0]
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return argv[0] if argv else "?"


def find_processes(
    req: Request, table: dict[int, dict[str, Any]], errors: list[str]
) -> dict[str, Any]:
    """vLLM (``--config .../vllm.yaml``) and sidecar (``--config .../sidecar.json``) of the
    instance: the oldest outermost matching process of each, with its process tree, and the
    pids of any other copies (``others``: a server left over beside the managed one)."""
    me = os.getpid()
    matches: dict[str, list[int]] = {"vllm.yaml": [], "sidecar.json": []}
    for pid, info in table.items():
        cfg = _config_arg(info["argv"])
        if pid != me and cfg and _under(cfg, req["instance_dir"]):
            name = os.path.basename(cfg)
            if name in matches:
                matches[name].append(pid)
    out: dict[str, Any] = {"instance": None, "sidecar": None}
    for name, key in (("vllm.yaml", "instance"), ("sidecar.json", "sidecar")):
        found = set(matches[name])
        roots = sorted(
            (p for p in found if table[p]["ppid"] not in found), key=lambda p: table[p]["start"]
        )
        if roots:
            out[key] = describe_process(roots[0], req, table, errors)
            out[key]["others"] = roots[1:]
    return out


def describe_process(
    pid: int, req: Request, table: dict[int, dict[str, Any]], errors: list[str]
) -> dict[str, Any]:
    argv = table[pid]["argv"]
    cfg = _config_arg(argv) or ""
    tick = os.sysconf("SC_CLK_TCK")
    kids = _descendants(pid, table)
    out: dict[str, Any] = {
        "pid": pid,
        "argv": argv,
        "config_path": cfg,
        "config_realpath": os.path.realpath(cfg),
        "config_text": None,
        "environ": None,
        "started_at": None,
        "rss_bytes": None,
        "children": [{"pid": k, "name": _proc_name(k, table[k]["argv"])} for k in kids],
    }
    for key, fn in (
        ("config_text", lambda: read_text(cfg)),
        ("environ", lambda: _environ(pid, req)),
        ("started_at", lambda: _boot_time() + table[pid]["start"] / tick),
        ("rss_bytes", lambda: sum(_rss_bytes(p) for p in [pid, *kids])),
    ):
        out[key] = attempt(f"process {pid} {key}", fn, errors)
    return out


# --------------------------------------------------------------------------- ports


def _listening() -> list[tuple[int, str, int]]:
    """(port, address, socket inode) of every TCP socket in LISTEN (state 0A)."""
    out = []
    for name, width in (("tcp", 8), ("tcp6", 32)):
        path = Path(f"/proc/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            if len(f) < 10 or f[3] != "0A":
                continue
            addr_hex, port_hex = f[1].split(":")
            raw = bytes.fromhex(addr_hex[:width])
            # The kernel prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if width == 8 else socket.AF_INET6
            out.append((int(port_hex, 16), socket.inet_ntop(family, raw), int(f[9])))
    return out


def _socket_owners(inodes: set[int]) -> dict[int, list[int]]:
    """socket inode -> pids holding it (only processes whose fds we may read)."""
    owners: dict[int, list[int]] = {}
    wanted = {f"socket:[{i}]": i for i in inodes}
    for pid in _pids():
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link in wanted:
                owners.setdefault(wanted[link], []).append(pid)
    return owners


def port_facts(ports: list[int], table: dict[int, dict[str, Any]]) -> dict[str, Any]:
    listening = [x for x in _listening() if x[0] in ports]
    owners = _socket_owners({inode for _, _, inode in listening})
    out: dict[str, Any] = {}
    for port in ports:
        mine = [x for x in listening if x[0] == port]
        pids = sorted({p for _, _, inode in mine for p in owners.get(inode, [])})
        out[str(port)] = {
            "listening": bool(mine),
            "addresses": sorted({addr for _, addr, _ in mine}),
            # Empty while listening: the owner's fds are not ours to read (not root).
            "owners": [
                {"pid": p, "name": _proc_name(p, table.get(p, {}).get("argv", []))} for p in pids
            ],
        }
    return out


# --------------------------------------------------------------------------- service


# systemd 252 keeps Result=exit-code when the start limit stops automatic restarts; only its
# journal says so.
START_LIMIT_LINE = "Start request repeated too quickly"


def systemd_facts(unit: str, timeout: float) -> dict[str, str]:
    out = run(["systemctl", "show", unit, "-p", SYSTEMD_PROPS], timeout)
    facts = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if facts.get("ActiveState") == "failed":
        try:
            journal = run(
                ["journalctl", "-u", unit, "-n", "20", "--no-pager", "-o", "cat"], timeout
            )
        except GatherError:
            journal = ""
        facts["StartLimitHit"] = "yes" if START_LIMIT_LINE in journal else "no"
    return facts


def _pm2_daemon_alive(home: str, table: dict[int, dict[str, Any]]) -> bool:
    """pm2.pid names the daemon, but a daemon can outlive its pid file (seen in CI after two
    pm2 commands raced on one PM2_HOME): its process title names the home too."""
    try:
        pid = int(read_text(Path(home) / "pm2.pid").strip())
        os.kill(pid, 0)
        return True
    except (OSError, ValueError):
        title = f"God Daemon ({os.path.normpath(home)})"
        return any(info["argv"] and title in info["argv"][0] for info in table.values())


def pm2_facts(p: Pm2Request, timeout: float, table: dict[int, dict[str, Any]]) -> dict[str, Any]:
    if not os.access(p["bin"], os.X_OK):
        raise GatherError(f"pm2 not installed at {p['bin']}")
    # `pm2 jlist` would start a daemon; the doctor looks, it does not start anything.
    if not _pm2_daemon_alive(p["home"], table):
        return {"daemon": False, "app": None}
    out = run([p["bin"], "jlist"], timeout, env=dict(os.environ, PM2_HOME=p["home"]))
    apps: list[dict[str, Any]] = []
    # pm2 may print daemon start-up lines before the JSON: take the last line that parses.
    for line in reversed(out.splitlines()):
        try:
            parsed = json.loads(line)
        except ValueError:
            continue
        if isinstance(parsed, list):
            apps = parsed
            break
    for app in apps:
        if app.get("name") == p["name"]:
            env = app.get("pm2_env") or {}
            return {
                "daemon": True,
                "app": {
                    "status": env.get("status"),
                    "restart_time": env.get("restart_time"),
                    "unstable_restarts": env.get("unstable_restarts"),
                    "pid": app.get("pid"),
                },
            }
    return {"daemon": True, "app": None}


def log_tail(path: str, lines: int = LOG_LINES) -> list[str]:
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        start = max(0, size - 256 * 1024)  # the log is appended forever: read its end only
        fh.seek(start)
        text = fh.read().decode(errors="replace").splitlines()
    if start > 0 and text:
        text = text[1:]  # the first line was cut
    return text[-lines:]


# What `vfleet releases` shows of each release (from its release.json; never the env).
RELEASE_KEYS = ("profile", "model", "stack", "served_model_name", "versions", "url")


def release_list(current_dir: str) -> list[dict[str, Any]]:
    """Every release kept beside `current` (releases/<id>), newest first."""
    folder = Path(current_dir).parent / "releases"
    if not folder.is_dir():
        return []
    out = []
    for rel in folder.iterdir():
        if rel.name.startswith("."):  # a release being written (renamed into place when done)
            continue
        manifest = rel / "release.json"
        if not manifest.is_file():
            continue
        try:
            data = json.loads(read_text(manifest))
        except ValueError:
            data = {}
        out.append(
            {
                "id": rel.name,
                "path": str(rel),
                "installed_at": manifest.stat().st_mtime,
                **{k: data.get(k) for k in RELEASE_KEYS},
            }
        )
    return sorted(out, key=lambda r: -float(r["installed_at"]))


def release_facts(current_dir: str, secrets: list[str]) -> dict[str, Any]:
    """Where `current` and `previous` point, since when, the current vllm.yaml (what the next
    start reads) and every release kept on the host."""
    link = Path(current_dir)
    previous = link.parent / "previous"
    listing = release_list(current_dir)
    if not link.exists():
        return {"current": None, "switched_at": None, "config_text": None, "releases": listing}
    config = link / "vllm.yaml"
    return {
        "current": os.path.realpath(link),
        "previous": os.path.realpath(previous) if previous.exists() else None,
        "switched_at": link.lstat().st_mtime,
        "config_text": hash_secret_values(read_text(config), secrets) if config.exists() else None,
        "releases": listing,
    }


# --------------------------------------------------------------------------- HTTP


def env_file_values(path: str) -> dict[str, str]:
    """The release's vllm.env, read as root: the file is the service user's (launch.sh sources
    it as that user), so it is read like the other files that user controls: bounded, not
    through a link, only a regular file."""
    return parse_env(read_service_file(path))


def parse_env(text: str) -> dict[str, str]:
    """KEY='value' lines of a rendered vllm.env (values never contain a quote)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line.strip())
        if m:
            value = m.group(2)
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            out[m.group(1)] = value
    return out


def _get(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    req = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S) as resp:
            return str(resp.read().decode(errors="replace"))
    except urllib.error.HTTPError as exc:
        raise GatherError(f"GET {url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise GatherError(f"GET {url}: {reason}") from None


LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def cache_config_labels(metrics: str) -> dict[str, str] | None:
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(LABEL.findall(line[: line.rindex("}")]))
    return None


def http_facts(url: str, api_key: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "models": None,
        "models_error": None,
        "cache_config": None,
        "metrics_error": None,
    }
    try:
        data = json.loads(_get(f"{url}/v1/models", api_key)).get("data") or []
        out["models"] = [
            {"id": m.get("id"), "max_model_len": m.get("max_model_len"), "root": m.get("root")}
            for m in data
            if isinstance(m, dict)
        ]
    except (GatherError, ValueError, AttributeError) as exc:
        out["models_error"] = str(exc)
    try:
        out["cache_config"] = cache_config_labels(_get(f"{url}/metrics", api_key))
        if out["cache_config"] is None:
            out["metrics_error"] = "no vllm:cache_config_info in /metrics"
    except GatherError as exc:
        out["metrics_error"] = str(exc)
    return out


# --------------------------------------------------------------------------- secrets


def _mask(value: Any, secrets: list[str]) -> Any:
    if isinstance(value, str):
        for s in secrets:
            value = value.replace(s, f"<secret sha256:{sha256(s)[:12]}>")
        return value
    if isinstance(value, list):
        return [_mask(v, secrets) for v in value]
    if isinstance(value, dict):
        return {k: _mask(v, secrets) for k, v in value.items()}
    return value


_SECRET_ARG = re.compile(r"^(\s*-{0,2}api[-_]key\s*[:=]\s*)(\S+)", re.IGNORECASE | re.MULTILINE)


def hash_secret_values(text: str, found: list[str]) -> str:
    """`api-key: X` (config file) or `--api-key=X`: X becomes its sha256 (and joins found)."""

    def hashed(m: re.Match[str]) -> str:
        found.append(m.group(2))
        return m.group(1) + sha256(m.group(2))

    return _SECRET_ARG.sub(hashed, text)


def _hash_secret_args(proc: dict[str, Any], found: list[str]) -> None:
    argv = proc["argv"]
    for i, arg in enumerate(argv):
        if arg in ("--api-key", "--api_key") and i + 1 < len(argv):
            found.append(argv[i + 1])
            argv[i + 1] = sha256(argv[i + 1])
        else:
            argv[i] = hash_secret_values(arg, found)
    if proc["config_text"]:
        proc["config_text"] = hash_secret_values(proc["config_text"], found)


# --------------------------------------------------------------------------- gather


def attempt(name: str, fn: Callable[[], Any], errors: list[str]) -> Any:
    """fn's value, or None with a line in errors: one missing fact never stops the rest."""
    try:
        return fn()
    except GatherError as exc:
        errors.append(f"{name}: {exc}")
    except Exception as exc:  # any failure is a missing fact, not a crash
        errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return None


def gather(req: Request) -> dict[str, Any]:
    errors: list[str] = []
    timeout = float(req.get("timeout_s", 15))
    pm2 = req["pm2"]
    table = attempt("processes", process_table, errors) or {}
    procs = attempt("processes", lambda: find_processes(req, table, errors), errors) or {}
    instance = procs.get("instance")
    secrets: list[str] = []
    env_file: dict[str, str] = {}
    if os.path.lexists(req["env_file"]):  # absent before the first deploy
        env_file = attempt("env file", lambda: env_file_values(req["env_file"]), errors) or {}
    secrets += [v for k, v in env_file.items() if is_secret(k, req["secret_keys"])]
    # The key the server was started with, when the env file is not readable by us.
    api_key = env_file.get("VLLM_API_KEY") or ((instance or {}).get("environ") or {}).get(
        "VLLM_API_KEY"
    )
    for proc in (instance, procs.get("sidecar")):
        if proc is None:
            continue
        env = proc["environ"] or {}
        secrets += [v for k, v in env.items() if is_secret(k, req["secret_keys"])]
        if proc["environ"] is not None:
            proc["environ"] = {
                k: sha256(v) if is_secret(k, req["secret_keys"]) else v for k, v in env.items()
            }
        _hash_secret_args(proc, secrets)
    facts: dict[str, Any] = {
        "hostfacts_version": VERSION,
        "gathered_at": time.time(),
        "os": attempt("os", os_facts, errors),
        "cpu": attempt("cpu", cpu_facts, errors),
        "memory": attempt("memory", memory_facts, errors),
        "disk": attempt("disk", lambda: disk_facts(req["base_dir"]), errors),
        "gpus": attempt("gpus", lambda: gpu_facts(timeout), errors)
        if req["accelerator"] == "cuda"
        else None,
        "model": attempt("model", lambda: model_facts(req["model_dir"]), errors),
        "venv": attempt("venv", lambda: venv_facts(req["venv_dir"]), errors),
        "release": attempt("release", lambda: release_facts(req["current_dir"], secrets), errors),
        "ports": attempt("ports", lambda: port_facts(req["ports"], table), errors),
        "time_sync": attempt("time-sync", lambda: time_sync(timeout), errors),
        "packages": attempt("packages", lambda: package_facts(req["packages"], timeout), errors),
        "instance": instance,
        "sidecar": procs.get("sidecar"),
        "systemd": attempt("systemd", lambda: systemd_facts(req["unit"], timeout), errors),
        "pm2": attempt("pm2", lambda: pm2_facts(pm2, timeout, table), errors) if pm2 else None,
        # No log file yet (never started) is a fact, not a failure to gather one.
        "log_tail": attempt("log", lambda: log_tail(req["log_file"]), errors)
        if os.path.exists(req["log_file"])
        else None,
        # The SM75 plugin's decision as the running server wrote it; None before a start.
        # A folder the service user writes: read without following it (read_service_file);
        # lexists: a dangling link is refused, not taken for "not written yet".
        "plugin_state": attempt(
            "plugin state", lambda: json.loads(read_service_file(plugin_state)), errors
        )
        if (plugin_state := req.get("plugin_state_file")) and os.path.lexists(plugin_state)
        else None,
        # Asked only of this instance's own server: a foreign one on the port says nothing.
        "http": http_facts(req["url"], api_key) if instance else None,
        "errors": errors,
    }
    return dict(_mask(facts, [s for s in set(secrets) if len(s) >= MASK_MIN_LEN]))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python3 hostfacts.py '<request json>'", file=sys.stderr)
        return 2
    try:
        req = json.loads(args[0])
    except ValueError as exc:
        print(f"hostfacts: the request is not JSON: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(gather(req), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
