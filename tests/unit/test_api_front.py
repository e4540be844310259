"""Only the API leaves the box (issue 29, finding 5): the rule `front`, its refusals, the
rendered nginx front (checked by the real nginx) and the balancer's routes.

What reaches vLLM through the front with a real server is in
tests/integration/test_api_front.py; this file needs no vLLM.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, require_tools
from vfleet.checks.api_routes import from_markdown
from vfleet.config.defaults import NGINX
from vfleet.config.escape import nginx_word
from vfleet.config.schema import HostVars
from vfleet.engine.api_routes import ALLOWED_ROUTES, allowed, is_loopback
from vfleet.engine.compile import resolve
from vfleet.errors import VfleetError
from vfleet.fleet.balancer import render_conf, replicas_from_inventory
from vfleet.render.plan import plan
from vfleet.render.release import FRONT_CONF, render_files

HAVE_NGINX = shutil.which("nginx") is not None or Path(NGINX).exists()
needs_nginx = pytest.mark.skipif(
    not HAVE_NGINX and not require_tools(), reason="nginx not installed (make deps)"
)
KEY = "sk-front-test-0123456789"


def _deployment(tmp_path: Path, **settings: object) -> Path:
    """A deployment file with a key: the way a key reaches `vfleet render` (mode 0600)."""
    path = tmp_path / "dep.yaml"
    body = {"profile": "cpu", "model": "tiny-dense", "settings": {"api_key": KEY, **settings}}
    path.write_text(yaml.safe_dump(body))
    path.chmod(0o600)
    return path


def _nginx_t(conf: Path, prefix: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [shutil.which("nginx") or NGINX, "-t", "-e", "stderr", "-p", f"{prefix}/", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


# -- the rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (
            ["host=0.0.0.0", "extra_env.VLLM_SERVER_DEV_MODE=1", "allow_no_api_key=true"],
            [
                "extra_env VLLM_SERVER_DEV_MODE on host 0.0.0.0",
                "/collective_rpc",
                "fix: drop extra_env.VLLM_SERVER_DEV_MODE, or set host 127.0.0.1",
            ],
        ),
        (
            ["host=0.0.0.0"],
            [
                "host 0.0.0.0 is not loopback and there is no api_key",
                "fix: give a key (make deploy API_KEY_FILE=path",
                "allow_no_api_key true",
            ],
        ),
        (
            ["host=10.1.2.3", "front=false", "allow_no_api_key=true"],
            [
                "front is false but host 10.1.2.3 is not loopback",
                "/invocations",
                "fix: drop `front: false`",
            ],
        ),
        (
            ["host=0.0.0.0", "port=60000", "allow_no_api_key=true"],
            ["port 60000: vLLM's port behind the front", "fix: set port at most 55535"],
        ),
    ],
    ids=["dev-mode-off-loopback", "no-key-off-loopback", "front-off-off-loopback", "port"],
)
def test_an_exposed_host_is_refused_with_the_setting_and_the_fix(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, sets: list[str], said: list[str]
) -> None:
    out = tmp_path / "out"
    args = ["render", "-p", "cpu", "-m", "tiny-dense", "--out", str(out)]
    res = cli(*args, *(x for s in sets for x in ("--set", s)))
    assert res.rc == 2, res
    assert "rule front" in res.err and "Traceback" not in res.err
    for text in said:
        assert text in res.err, res.err
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("key", ["host", "port", "uds"])
def test_extra_args_cannot_move_vllm_from_behind_the_front(key: str) -> None:
    with pytest.raises(VfleetError, match=f"extra_args {key} would move vLLM off"):
        resolve("cpu", "tiny-dense", sets=["front=true", f"extra_args.{key}=0.0.0.0"])


def test_dev_mode_stays_possible_on_loopback_and_0_is_off() -> None:
    resolve("cpu", "tiny-dense", sets=["extra_env.VLLM_SERVER_DEV_MODE=1"])
    resolve("cpu", "tiny-dense", sets=["host=0.0.0.0", "extra_env.VLLM_SERVER_DEV_MODE=0",
                                       "allow_no_api_key=true"])  # fmt: skip


def test_the_default_loopback_deploy_has_no_front_and_keeps_its_ports() -> None:
    launch = resolve("cpu", "tiny-dense")
    d = launch.decisions
    assert (d.front, d.host, d.port, d.vllm_host, d.vllm_port) == (
        False, "127.0.0.1", 8000, "127.0.0.1", 8000,
    )  # fmt: skip
    names = {f.name for f in render_files(launch)}
    assert FRONT_CONF not in names and not any("front" in n for n in names)
    p = plan("cpu", "tiny-dense")
    assert p.front is None and "nginx-light" not in p.software.os_packages
    assert p.config()["host"] == "127.0.0.1" and p.config()["port"] == 8000


def test_off_loopback_vllm_moves_behind_the_front(tmp_path: Path) -> None:
    p = plan("cpu", "tiny-dense", deployment=str(_deployment(tmp_path, host="0.0.0.0", port=8100)))
    # vLLM on loopback at the derived port; the front on the deployment's address.
    assert p.config()["host"] == "127.0.0.1" and p.config()["port"] == 18100
    assert p.service.listen_host == "127.0.0.1" and p.service.port == 18100  # vLLM itself
    assert p.service.url == "http://127.0.0.1:18100"  # the probe and the sidecar use it
    assert p.front is not None and (p.front.host, p.front.port) == ("0.0.0.0", 8100)
    assert p.front.url == "http://127.0.0.1:8100"
    assert "nginx-light" in p.software.os_packages  # installed by the preflight
    files = {f.name: f for f in p.files}
    assert p.front.unit_name in files and FRONT_CONF in files
    eco = files["ecosystem.config.js"].content
    assert '"name": "vfleet-front-main"' in eco and '"-e",' in eco  # the pm2 path runs it too
    probe = json.loads(files["probe.json"].content)
    assert probe["prereqs"]["port"] == 18100


def test_front_on_a_loopback_host_when_asked() -> None:
    d = resolve("cpu", "tiny-dense", sets=["front=true", "port=8200"]).decisions
    assert (d.front, d.host, d.port, d.vllm_port) == (True, "127.0.0.1", 8200, 18200)


def test_loopback_is_what_only_this_machine_reaches() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "box1.lan", "localhost.evil"]))


# -- the rendered front, checked by nginx ---------------------------------------------------


@needs_nginx
def test_the_rendered_front_passes_nginx_t_and_forwards_only_the_allowed_routes(
    tmp_path: Path,
) -> None:
    base = tmp_path / "base"
    dep = _deployment(tmp_path, host="0.0.0.0", port=8100)
    launch = resolve("", "", deployment=dep, host=HostVars(base_dir=str(base)))
    files = {f.name: f.content for f in render_files(launch)}
    text = files[FRONT_CONF]
    state = base / "instances" / "main" / "state"
    state.mkdir(parents=True)
    conf = tmp_path / FRONT_CONF
    conf.write_text(text)
    r = _nginx_t(conf, state)
    assert r.returncode == 0, r.stderr
    # The locations: a 404 for everything, then exactly the allowed routes.
    locations = re.findall(r"^\s*location (.+?) \{", text, re.M)
    assert locations == ["/", *(r.nginx_location for r in ALLOWED_ROUTES)]
    assert "upstream vllm {\n        server 127.0.0.1:18100;" in text
    assert "listen 0.0.0.0:8100;" in text and "server_tokens off;" in text
    assert "X-Vfleet-Replica" not in text
    unit = files["vfleet-front@main.service"]
    assert "User=vfleet" in unit and f"ReadWritePaths={state}" in unit


def test_a_value_that_is_not_one_nginx_word_is_refused() -> None:
    for bad in ("a;b", "x y", "$host", "a{", "a#b", "'q'"):
        with pytest.raises(VfleetError, match="nginx configuration"):
            nginx_word(bad)
    assert nginx_word("[::1]:8000") == "[::1]:8000"


# -- the balancer ---------------------------------------------------------------------------


def _balancer_state(replica_header: bool | None) -> dict[str, object]:
    state: dict[str, object] = {
        "group": "pair",
        "served_model_name": "m",
        "listen": "127.0.0.1:8080",
        "drain_timeout_s": 60,
        "replicas": [{"host": "a", "address": "10.0.0.1", "port": 8000, "down": False}],
    }
    if replica_header is not None:
        state["replica_header"] = replica_header
    return state


@needs_nginx
@pytest.mark.parametrize("header", [None, False, True])
def test_the_balancer_forwards_only_the_allowed_routes_and_names_replicas_only_if_asked(
    tmp_path: Path, header: bool | None
) -> None:
    text = render_conf(_balancer_state(header), tmp_path)
    locations = re.findall(r"^\s*location (.+?) \{", text, re.M)
    assert locations == ["/", *(r.nginx_location for r in ALLOWED_ROUTES)]
    assert text.count("add_header X-Vfleet-Replica") == (len(ALLOWED_ROUTES) if header else 0)
    for sub in ("logs", "tmp"):
        (tmp_path / sub).mkdir()
    conf = tmp_path / "nginx.conf"
    conf.write_text(text)
    r = _nginx_t(conf, tmp_path)
    assert r.returncode == 0, r.stderr


# -- the docs' route tables -----------------------------------------------------------------

SECURITY = (REPO / "docs" / "SECURITY.md").read_text()
ROUTES_SECTION = SECURITY.split("## Routes of each pinned vLLM")[-1]


def doc_routes(version: str) -> list[tuple[str, str, bool, bool, str]]:
    """The route table of one version in docs/SECURITY.md: method, path, guarded, dev, front."""
    rows = from_markdown(ROUTES_SECTION, version)
    return [(r.method, r.path, r.guarded, r.dev, front) for r, front in rows]


@pytest.mark.parametrize("version", ["0.21.0", "0.24.0", "0.27.1", "0.32.0"])
def test_the_docs_route_table_of_each_pinned_version_says_what_the_front_does(
    version: str,
) -> None:
    rows = doc_routes(version)
    assert len(rows) > 30, f"docs/SECURITY.md has no route table for {version}"
    for _method, path, _guarded, _dev, front in rows:
        assert front == ("forwarded" if allowed(path) else "404"), (version, path)
    # The finding's routes are in every table and none is forwarded.
    paths = {p for _m, p, _g, _d, _f in rows}
    assert {"/invocations", "/tokenize", "/metrics", "/version", "/collective_rpc"} <= paths
    assert {p for p in paths if allowed(p)} <= {p for p in paths if p.startswith("/v1/")} | {
        "/health"
    }
    # Every forwarded route but /health is behind the key in that version's own guard.
    for _m, path, guarded, _dev, front in rows:
        if front == "forwarded" and path != "/health":
            assert guarded, (version, path)


def test_the_docs_name_the_allowed_routes_of_the_one_list() -> None:
    section = SECURITY.split("## Only the API leaves the box")[1].split("\n## ")[0]
    for r in ALLOWED_ROUTES:
        assert f"`{r.nginx_location}`" in section


# -- the front's unit -----------------------------------------------------------------------

NO_SYSTEMD = shutil.which("systemd-analyze") is None
VERIFIER = REPO / "ansible" / "roles" / "vfleet" / "files" / "vfleet-verify-unit"


@needs_nginx
@pytest.mark.skipif(NO_SYSTEMD, reason="systemd-analyze not installed")
def test_the_front_unit_verifies_scores_like_the_sidecar_and_passes_the_role_verifier(
    tmp_path: Path,
) -> None:
    base = tmp_path / "vfleet"
    launch = resolve("cpu", "tiny-dense", sets=["front=true"], host=HostVars(base_dir=str(base)))
    p = plan("cpu", "tiny-dense", sets=["front=true"], base_dir=str(base))
    assert p.front is not None
    unit = tmp_path / p.front.unit_name
    unit.write_text(next(f.content for f in render_files(launch) if f.name == unit.name))
    (base / "logs").mkdir(parents=True)
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr
    score = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", score.stdout)
    assert found and float(found.group(1)) <= 2.0, score.stdout[-500:]
    ok = subprocess.run(
        [str(VERIFIER), unit.name, str(unit), p.front.unit_directives],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr


def test_the_balancer_reaches_a_replica_through_its_front(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yml"
    inv.write_text(
        "all:\n  children:\n    g:\n      hosts:\n"
        "        a: {ansible_connection: local, vfleet_set: [front=true, port=8300]}\n"
        "        b: {ansible_connection: local, vfleet_set: [port=8301]}\n"
    )
    replicas, _name, _drain = replicas_from_inventory(str(inv), "g", None)
    # a's vLLM is on 18300 behind its front: the balancer goes to the front's 8300.
    assert [(r.host, r.port) for r in replicas] == [("a", 8300), ("b", 8301)]


@pytest.mark.parametrize("sets", [["front=true"], ["host=0.0.0.0", "allow_no_api_key=true"]])
def test_compose_refuses_a_front_it_would_not_run(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, sets: list[str]
) -> None:
    out = tmp_path / "out"
    (tmp_path / "model").mkdir()
    args = ["compose", "-p", "cpu", "-m", "tiny-dense", "--model-dir", str(tmp_path / "model")]
    res = cli(*args, "--out", str(out), *(x for s in sets for x in ("--set", s)))
    assert res.rc == 2 and "the images run no nginx front" in res.err, res.err
    assert "fix: keep host on loopback" in res.err and not out.exists()
