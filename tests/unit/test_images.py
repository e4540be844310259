"""Images and compose files without a Docker engine: pins from the profiles, the pin check
(and that it catches drift), hadolint, compose.yaml against the compose specification's JSON
schema, and `vfleet compose` output."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, require_tools
from vfleet.config.profiles import load_profile
from vfleet.render import images

DOCKERFILES = sorted(REPO.glob("images/*/Dockerfile"))
HADOLINT = Path(sys.executable).with_name("hadolint")
# Debian's docker-compose ships the compose specification's schema it validates with.
COMPOSE_SPEC = Path("/usr/lib/python3/dist-packages/compose/config/compose_spec.json")


def test_every_profile_stack_has_images_in_sync_with_its_pins() -> None:
    results = images.check_all()
    assert results and all(not p for p in results.values()), results
    # Every stack of every profile is covered, GPU ones included.
    refs = [r for r in results if r.startswith("vfleet/vllm:")]
    stacks = sum(len(load_profile(p.stem).stacks) for p in REPO.glob("profiles/hardware/*.yaml"))
    assert len(refs) == stacks


def test_tags_and_build_args_come_from_the_stack() -> None:
    for name in ("2x2080ti-22g", "a100-32g", "cpu"):
        profile = load_profile(name)
        stack = profile.stacks[profile.default_stack]
        vllm, sidecar, prom = images.images_for(name)
        assert vllm.build_args["VLLM_VERSION"] == stack.vllm
        assert vllm.build_args["TORCH_VERSION"] == stack.torch
        assert vllm.build_args["PYTHON_VERSION"] == stack.python
        assert f"{stack.vllm_package}{stack.vllm}" in vllm.tag and name in vllm.tag
        assert vllm.build_args["VENV"] == f"/opt/vfleet/venvs/{stack.vllm_package}-{stack.vllm}"
        if stack.plugin:
            assert vllm.build_args["PLUGIN_VERSION"] == stack.plugin == images.plugin_version()
            assert f"sm75p{stack.plugin}" in vllm.tag
        if stack.flashinfer:
            assert vllm.build_args["FLASHINFER_VERSION"] == stack.flashinfer
        assert vllm.dockerfile_dir == ("vllm-cpu" if name == "cpu" else "vllm-cuda")
        assert sidecar.build_args["HEALTHCHECK_VERSION"] == images.healthcheck_version()
        assert prom.kind == "prometheus"
    (cuda,) = [s for s in images.images_for("a100-32g") if s.kind == "vllm"]
    # PyPI's torch is the stack's CUDA build (`vfleet stacks check`): no PyTorch index.
    assert cuda.build_args["TORCH_INDEX"] == ""
    assert images.images_config().bases[cuda.base_key].startswith("nvidia/cuda:13.0")
    labelled = (
        load_profile("a100-32g").stacks["vllm-0.27.1"].model_copy(update={"torch": "2.13.0+cu130"})
    )
    assert images.torch_index(labelled) == "https://download.pytorch.org/whl/cu130"


@pytest.mark.parametrize(
    ("edit", "pin"),
    [
        ('${FLASHINFER_VERSION:+"flashinfer-python==$FLASHINFER_VERSION"}', "flashinfer-python"),
        ('"torch==$TORCH_VERSION"', "torch"),
        ('${TRITON_VERSION:+"triton==$TRITON_VERSION"}', "triton"),
    ],
)
def test_pin_check_catches_a_pin_the_image_does_not_install(
    images_copy: Path, edit: str, pin: str
) -> None:
    """Every pin the role installs (config.pins.requirements) reaches the image's install line."""
    path = images_copy / "vllm-cuda" / "Dockerfile"
    text = path.read_text()
    assert edit in text
    profile = load_profile("2x2080ti-22g")
    stack = profile.stacks["vllm-0.24.0"]  # pins flashinfer and triton
    (spec,) = [s for s in images.images_for(profile.name, "vllm-0.24.0") if s.kind == "vllm"]
    assert images.check_spec(spec, stack) == []
    path.write_text(text.replace(edit, "", 1))
    problems = images.check_spec(spec, stack)
    assert any(f"does not install the stack's pin {pin}==" in p for p in problems), problems


@pytest.fixture
def images_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    dest = tmp_path / "images"
    shutil.copytree(REPO / "images", dest)
    monkeypatch.setattr(images, "IMAGES_DIR", dest)
    return dest


@pytest.mark.parametrize(
    ("edit", "expect"),
    [
        (("ARG VLLM_VERSION\n", "ARG VLLM_VERSION=0.27.0\n"), "ARG VLLM_VERSION has a default"),
        (("ARG FLASHINFER_VERSION\n", ""), "does not declare ARG FLASHINFER_VERSION"),
        (('"torch==$TORCH_VERSION"', '"torch==2.12.0"'), "a literal version"),
        (("ARG BASE_IMAGE\n", "ARG SOMETHING_NEW\n"), "ARG SOMETHING_NEW has no default"),
    ],
)
def test_pin_check_catches_drift(images_copy: Path, edit: tuple[str, str], expect: str) -> None:
    path = images_copy / "vllm-cuda" / "Dockerfile"
    text = path.read_text()
    assert edit[0] in text
    path.write_text(text.replace(edit[0], edit[1], 1))
    (spec,) = [s for s in images.images_for("2x2080ti-22g") if s.kind == "vllm"]
    problems = images.check_spec(spec)
    assert any(expect in p for p in problems), problems


def test_pin_check_catches_a_plugin_pin_that_differs_from_the_plugin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(images, "plugin_version", lambda: "9.9.9")
    (spec,) = [s for s in images.images_for("cpu") if s.kind == "vllm"]
    assert any("plugin/pyproject.toml is 9.9.9" in p for p in images.check_spec(spec))


def test_base_image_without_digest_is_refused(profiles_copy: Path) -> None:
    path = profiles_copy / "images.yaml"
    data = yaml.safe_load(path.read_text())
    data["bases"]["cuda-13.0"] = "nvidia/cuda:13.0.1-devel-ubuntu24.04"
    path.write_text(yaml.safe_dump(data))
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("vfleet")), "images", "list", "-p", "a100-32g"],
        env=dict(os.environ, VFLEET_PROFILES_DIR=str(profiles_copy)),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "images.yaml: bases.cuda-13.0: base image is not pinned by digest" in proc.stderr
    assert "fix: append @sha256:" in proc.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    if not HADOLINT.exists():
        pytest.skip("hadolint not installed (make venv)")
    proc = subprocess.run(
        [str(HADOLINT), "--no-color", str(dockerfile)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout


def test_dry_run_builds_from_the_repository_root_with_a_feed(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stage = REPO / "build" / "images"
    before = set(stage.iterdir()) if stage.exists() else set()
    res = cli("images", "build", "--profile", "cpu", "--only", "vllm", "--dry-run")
    assert res.rc == 0, res.err
    argv = res.out.strip().split()
    assert argv[:6] == ["docker", "build", "--network", "host", "--tag", argv[5]]
    assert argv[5].startswith("vfleet/vllm:cpu-")
    assert argv[6:8] == ["--file", str(REPO / "images" / "vllm-cpu" / "Dockerfile")]
    assert "PIP_INDEX=https://pypi.org/simple" in argv and "FEED_URL=http://127.0.0.1:PORT" in argv
    # The context is the repository root; its .dockerignore sends only what the Dockerfiles
    # COPY (the probe's and plugin's sources, images/common): no wheel, venv or cache.
    assert argv[-1] == str(REPO)
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*")] == "*" and "!healthcheck/src/" in ignore
    assert not any(line.startswith("!") and "build" in line for line in ignore)
    # The feed (no wheelhouse given): no wheel, an empty CA file.
    (feed,) = set(stage.iterdir()) - before
    assert feed.name.startswith("feed-")
    assert list((feed / "feed" / "wheels").iterdir()) == []
    assert (feed / "feed" / "ca.crt").read_bytes() == b""
    shutil.rmtree(feed)


def test_pip_installs_from_the_feed_over_loopback(tmp_path: Path) -> None:
    # What the Dockerfiles' RUN step does, outside Docker: real pip, --no-index, the feed's URL.
    hc = images.healthcheck_version()
    if not (images.WHEELS_DIR / images.wheel_name("vfleet_healthcheck", hc)).exists():
        pytest.skip("make wheels first") if not require_tools() else pytest.fail("no wheels")
    house = tmp_path / "wheelhouse"
    house.mkdir()
    shutil.copy(images.WHEELS_DIR / images.wheel_name("vfleet_healthcheck", hc), house)
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nnot a real one\n-----END CERTIFICATE-----\n")
    staged = images.stage_feed(wheelhouse=house, ca_bundle=ca, out=tmp_path / "stage")
    with images.serve_feed(staged.feed) as url:
        with urllib.request.urlopen(f"{url}/ca.crt", timeout=10) as r:
            assert r.read() == ca.read_bytes()
        proc = subprocess.run(
            [
                sys.executable, "-m", "pip", "download", "--no-deps", "--no-index",
                "--find-links", f"{url}/wheels/", "-d", str(tmp_path / "got"),
                f"vfleet-healthcheck=={hc}",
            ],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in (tmp_path / "got").iterdir()] == [
        images.wheel_name("vfleet_healthcheck", hc)
    ]
    # Served until the build ends, not after.
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/ca.crt", timeout=5)


def _compose_config() -> dict[str, Any]:
    data = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def _fragment(profile: str) -> dict[str, Any]:
    data = yaml.safe_load((REPO / "images" / "compose" / f"{profile}.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_compose_files_are_valid_against_the_compose_spec() -> None:
    if not COMPOSE_SPEC.exists():
        if require_tools():
            pytest.fail("docker-compose not installed (make deps)")
        pytest.skip("docker-compose not installed")
    import jsonschema

    # The file says draft 2019-09 (as "http://.../draft/2019-09/schema#", which jsonschema
    # does not recognise by that spelling): name the validator.
    schema = json.loads(COMPOSE_SPEC.read_text())
    validator = jsonschema.Draft201909Validator(schema)
    paths = [REPO / "compose.yaml", *sorted((REPO / "images" / "compose").glob("*.yaml"))]
    assert len(paths) == 1 + len(list((REPO / "profiles" / "hardware").glob("*.yaml")))
    for path in paths:
        validator.validate(yaml.safe_load(path.read_text()))
    # And a broken one is caught (the check can fail).
    bad = _fragment("cpu")
    bad["services"]["vllm"]["healthcheck"]["start_period"] = {"x": 1}
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)


def test_compose_services_as_the_issue_asks() -> None:
    services = _compose_config()["services"]
    vllm = services["vllm"]
    assert vllm["network_mode"] == "host"
    assert vllm["depends_on"] == {"model": {"condition": "service_completed_successfully"}}
    assert services["model"]["depends_on"] == {
        "init": {"condition": "service_completed_successfully"}
    }
    assert services["sidecar"]["depends_on"] == {"vllm": {"condition": "service_healthy"}}
    # Each service of the stack takes its profile's part from the file PROFILE names.
    for name in ("init", "model", "vllm", "sidecar", "prometheus"):
        assert services[name]["extends"] == {
            "file": "images/compose/${PROFILE}.yaml",
            "service": name,
        }
    assert services["grafana"]["profiles"] == ["grafana"]
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password == "${GRAFANA_ADMIN_PASSWORD}"  # no default, and Grafana refuses empty
    assert "GRAFANA_ADMIN_PASSWORD" in services["grafana"]["entrypoint"][2]
    cpu = _fragment("cpu")["services"]
    assert "--tier warm" in cpu["vllm"]["healthcheck"]["test"][1]
    assert cpu["vllm"]["healthcheck"]["start_period"] == f"{load_profile('cpu').start_timeout_s}s"
    assert "deploy" not in cpu["vllm"]
    for profile in ("2x2080ti-22g", "4x2080ti-22g", "a100-32g"):
        gpu = _fragment(profile)["services"]
        count = load_profile(profile).accelerator.count
        for name in ("init", "vllm"):
            (dev,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
            assert (
                dev["driver"] == "nvidia" and dev["count"] == count and "gpu" in dev["capabilities"]
            )
        (mount,) = gpu["vllm"]["volumes"]
        assert mount["type"] == "bind" and mount["source"].startswith("${MODEL_DIR:?")
        assert gpu["model"]["build"]["dockerfile"] == "images/vllm-cuda/Dockerfile"
    # Images and build arguments: the ones `vfleet images build` uses, for every profile.
    for profile in ("cpu", "2x2080ti-22g"):
        frag = _fragment(profile)["services"]
        vllm_spec, sidecar_spec, prom_spec = images.images_for(profile)
        assert frag["vllm"]["image"] == frag["model"]["image"] == vllm_spec.ref
        assert frag["sidecar"]["image"] == frag["init"]["image"] == sidecar_spec.ref
        assert frag["prometheus"]["image"] == prom_spec.ref
        args = frag["model"]["build"]["args"]
        assert {k: args[k] for k in vllm_spec.build_args} == vllm_spec.build_args
        assert frag["model"]["build"]["labels"] == vllm_spec.labels
    # Every ${VAR} the compose files read is in .env, except the GPU profiles' overrides.
    from vfleet.render.compose import dotenv_vars

    text = "".join(
        p.read_text()
        for p in [REPO / "compose.yaml", *(REPO / "images" / "compose").glob("*.yaml")]
    )
    used = set(re.findall(r"(?<!\$)\$\{([A-Z_]+)", text))
    assert used - {v.key for v in dotenv_vars()} == {"CUDA_BASE_IMAGE"}


def test_generated_compose_files_are_up_to_date_and_the_check_catches_drift(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from vfleet.render import compose

    assert compose.stale_files() == []
    env = tmp_path / ".env"
    env.write_text((REPO / ".env").read_text().replace("MODEL=tiny-hybrid-mtp", "MODEL=other"))
    frags = tmp_path / "compose"
    shutil.copytree(REPO / "images" / "compose", frags)
    (frags / "gone.yaml").write_text("services: {}\n")
    monkeypatch.setattr(compose, "DOTENV", env)
    monkeypatch.setattr(compose, "FRAGMENTS_DIR", frags)
    monkeypatch.setattr(compose, "REPO_ROOT", tmp_path)
    assert compose.stale_files() == [".env", "compose/gone.yaml (no such profile)"]
    proc = subprocess.run(
        [sys.executable, "-m", "vfleet.render.compose", "generated", "--check"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "up to date" in proc.stdout, proc.stdout + proc.stderr


def test_docker_compose_reads_the_stack_as_typed(tmp_path: Path) -> None:
    """Debian's docker-compose 1.29, in the repository root, nothing set: the CPU stack from
    .env; a GPU profile without MODEL_DIR stops before anything starts, with one message."""
    if not shutil.which("docker-compose"):
        pytest.fail("docker-compose not installed (make deps)") if require_tools() else pytest.skip(
            "docker-compose not installed"
        )
    from vfleet.render.compose import dotenv_vars

    # None of .env's variables from this environment (make passes PROFILE, MODEL, SET...).
    keys = {v.key for v in dotenv_vars()} | {"COMPOSE_FILE"}
    env = {k: v for k, v in os.environ.items() if k not in keys}

    def config(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["docker-compose", "config"], cwd=REPO, env=dict(env, **extra),
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip

    cpu = config()
    assert cpu.returncode == 0, cpu.stderr
    got = yaml.safe_load(cpu.stdout)["services"]
    assert sorted(got) == ["grafana", "init", "model", "prometheus", "sidecar", "vllm"]
    assert got["vllm"]["image"] == images.images_for("cpu")[0].ref
    assert "models:/opt/vfleet/models/tiny-hybrid-mtp:ro" in got["vllm"]["volumes"]
    assert got["model"]["build"]["args"]["BASE_IMAGE"].startswith("debian:bookworm-slim@sha256:")
    mine = config(BASE_IMAGE="vfleet-base:test", MODEL_DIR=str(tmp_path))
    got = yaml.safe_load(mine.stdout)["services"]
    assert got["init"]["build"]["args"]["BASE_IMAGE"] == "vfleet-base:test"
    assert f"{tmp_path}:/opt/vfleet/models/tiny-hybrid-mtp:ro" in got["vllm"]["volumes"]
    gpu = config(PROFILE="2x2080ti-22g", MODEL="qwen3.6-27b-fp8")
    assert gpu.returncode != 0
    assert (
        "PROFILE=2x2080ti-22g serves a real model: set MODEL_DIR=<the model folder>" in gpu.stderr
    )
    gpu = config(PROFILE="2x2080ti-22g", MODEL="qwen3.6-27b-fp8", MODEL_DIR=str(tmp_path))
    assert gpu.returncode == 0, gpu.stderr
    got = yaml.safe_load(gpu.stdout)["services"]
    assert got["vllm"]["image"] == images.images_for("2x2080ti-22g")[0].ref
    assert got["vllm"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2
    assert got["vllm"]["healthcheck"]["start_period"] == "15m"


def test_init_renders_the_release_and_checks_the_model(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The init service's work, outside Docker (the compose test runs it in the image)."""
    from vfleet.errors import VfleetError
    from vfleet.render import compose

    release, prom = tmp_path / "release", tmp_path / "prometheus"
    release.mkdir()
    prom.mkdir()
    (release / "stale.txt").write_text("from an earlier render")
    for key in ("PROFILE", "MODEL", "MODEL_DIR", "RELEASE_DIR", "PROMETHEUS_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SET", "port=8123 sidecar_port=9123")
    monkeypatch.setenv("PROMETHEUS_LISTEN", "127.0.0.1:9191")
    did = compose.init(release, prom)
    assert did.startswith("release rendered for cpu x tiny-hybrid-mtp (port=8123")
    assert "port: 8123" in (release / "vllm.yaml").read_text()
    assert "model: /opt/vfleet/models/tiny-hybrid-mtp" in (release / "vllm.yaml").read_text()
    assert json.loads((release / "sidecar.json").read_text())["listen"] == "127.0.0.1:9123"
    assert not (release / "stale.txt").exists()
    assert all(p.stat().st_mode & stat.S_IROTH for p in release.iterdir())
    assert "127.0.0.1:9191" in (prom / "prometheus.yml").read_text()
    # A model that is not generated needs MODEL_DIR; MODEL_DIR needs a model in it.
    monkeypatch.setenv("PROFILE", "2x2080ti-22g")
    monkeypatch.setenv("MODEL", "qwen3.6-27b-fp8")
    monkeypatch.setenv("SET", "")
    with pytest.raises(VfleetError, match=r"MODEL_DIR: MODEL=qwen3\.6-27b-fp8 is not a generated"):
        compose.init(release, prom)
    monkeypatch.setenv("MODEL_DIR", "/srv/models/qwen")
    with pytest.raises(VfleetError, match=r"no config\.json: not a model folder"):
        compose.init(release, prom)
    # A release vfleet compose rendered (RELEASE_DIR) is used as it is.
    monkeypatch.setenv("PROFILE", "cpu")
    monkeypatch.setenv("MODEL", "tiny-hybrid-mtp")
    monkeypatch.delenv("MODEL_DIR")
    monkeypatch.setenv("RELEASE_DIR", "/srv/render/release")
    before = (release / "vllm.yaml").read_text()
    assert compose.init(release, prom).startswith("release from RELEASE_DIR=/srv/render/release")
    assert (release / "vllm.yaml").read_text() == before


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_text("x")
    for p in (d, *d.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return d


def test_compose_render(cli, tmp_path: Path, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    args = ("compose", "-p", "cpu", "-m", "tiny-hybrid-mtp", "--model-dir", str(model_dir))
    res = cli(*args, "--out", str(out), "--set", "port=8123")
    assert res.rc == 0, res.err
    env = dict(
        line.split("=", 1)
        for line in (out / "compose.env").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert stat.S_IMODE((out / "compose.env").stat().st_mode) == 0o600
    # .env's variables, pointed at this render: init takes the release as it is.
    from vfleet.render.compose import dotenv_vars

    assert set(env) == {"COMPOSE_FILE"} | {v.key for v in dotenv_vars()}
    assert env["COMPOSE_FILE"] == str(REPO / "compose.yaml")
    assert (env["PROFILE"], env["MODEL"]) == ("cpu", "tiny-hybrid-mtp")
    assert env["MODEL_DIR"] == str(model_dir)
    assert env["RELEASE_DIR"] == str(out / "release")
    assert env["PROMETHEUS_DIR"] == str(out / "prometheus")
    assert env["VFLEET_RELEASE_MOUNT"] == "/opt/vfleet/instances/main/current"
    assert env["SECRETS_ENV"] == str(tmp_path / "out.secrets.env")
    assert len(env["GRAFANA_ADMIN_PASSWORD"]) >= 16
    # The release is the host release, readable by the container's user; vllm.yaml names
    # the mounted model.
    rel = out / "release"
    assert "model: /opt/vfleet/models/tiny-hybrid-mtp" in (rel / "vllm.yaml").read_text()
    assert (rel / "vllm.env").stat().st_mode & stat.S_IROTH
    assert out.stat().st_mode & stat.S_IXOTH
    prom = (out / "prometheus" / "prometheus.yml").read_text()
    assert "/etc/vfleet/prometheus/" in prom
    targets = json.loads((out / "prometheus" / "targets" / "vllm.json").read_text())
    assert targets[0]["targets"] == ["127.0.0.1:8123"]
    # Secrets file: created once, 0600, never overwritten; the password survives a re-render.
    secrets = tmp_path / "out.secrets.env"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    secrets.write_text("VLLM_API_KEY=mine\n")
    res = cli(*args, "--out", str(out), "--set", "port=8124")
    assert res.rc == 0, res.err
    assert secrets.read_text() == "VLLM_API_KEY=mine\n"
    again = (out / "compose.env").read_text()
    assert f"GRAFANA_ADMIN_PASSWORD={env['GRAFANA_ADMIN_PASSWORD']}" in again
    assert "port: 8124" in (out / "release" / "vllm.yaml").read_text()


def test_compose_gpu_profile_names_the_profile(cli, tmp_path: Path, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "out"
    res = cli(
        "compose",
        "-p",
        "2x2080ti-22g",
        "-m",
        "qwen3.6-27b-fp8",
        "--model-dir",
        str(model_dir),
        "--out",
        str(out),
    )
    assert res.rc == 0, res.err
    text = (out / "compose.env").read_text()
    # PROFILE picks images/compose/2x2080ti-22g.yaml (images, GPU reservation, start period).
    assert f"COMPOSE_FILE={REPO / 'compose.yaml'}\n" in text
    assert "PROFILE=2x2080ti-22g\n" in text and "MODEL=qwen3.6-27b-fp8\n" in text


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        (("--set", "api_key=sekrit"), "--set api_key: an API key on a command line"),
        (("--base-dir", "/srv/vfleet"), "--base-dir: the images use /opt/vfleet"),
        (("--set", "instance=b"), "instance: the images run instance 'main', not 'b'"),
    ],
)
def test_compose_refuses_and_writes_nothing(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, model_dir: Path, extra: tuple[str, ...], expect: str
) -> None:
    out = tmp_path / "out"
    res = cli(
        "compose",
        "-p",
        "cpu",
        "-m",
        "tiny-hybrid-mtp",
        "--model-dir",
        str(model_dir),
        "--out",
        str(out),
        *extra,
    )
    assert res.rc == 2 and expect in res.err, res.err
    assert "fix:" in res.err
    assert not out.exists() and not (tmp_path / "out.secrets.env").exists()


def test_compose_refuses_a_model_the_container_cannot_read(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, model_dir: Path
) -> None:
    (model_dir / "model.safetensors").chmod(0o600)
    res = cli(
        "compose",
        "-p",
        "cpu",
        "-m",
        "tiny-hybrid-mtp",
        "--model-dir",
        str(model_dir),
        "--out",
        str(tmp_path / "out"),
    )
    assert res.rc == 2, res.err
    assert "model.safetensors: --model-dir: not readable by other users" in res.err
    assert f"fix: chmod -R a+rX {model_dir}" in res.err
    res = cli(
        "compose",
        "-p",
        "cpu",
        "-m",
        "tiny-hybrid-mtp",
        "--model-dir",
        str(tmp_path),
        "--out",
        str(tmp_path / "out"),
    )
    assert res.rc == 2 and "no config.json" in res.err


def test_build_refuses_bad_paths_before_staging_anything(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stage = REPO / "build" / "images"
    before = sorted(stage.iterdir()) if stage.exists() else []
    for flag, expect in (
        ("--wheelhouse", "--wheelhouse: not a folder"),
        ("--ca-bundle", "--ca-bundle: not a file"),
    ):
        res = cli("images", "build", "-p", "cpu", "--dry-run", flag, str(tmp_path / "nope"))
        assert res.rc == 2 and expect in res.err and "fix:" in res.err, res.err
    after = sorted(stage.iterdir()) if stage.exists() else []
    assert after == before


def test_compose_refuses_a_bad_listen_address(  # type: ignore[no-untyped-def]
    cli, tmp_path: Path, model_dir: Path
) -> None:
    res = cli(
        "compose",
        "-p",
        "cpu",
        "-m",
        "tiny-hybrid-mtp",
        "--model-dir",
        str(model_dir),
        "--out",
        str(tmp_path / "out"),
        "--prometheus-listen",
        "127.0.0.1:99999",
    )
    assert res.rc == 2 and "--prometheus-listen: expected HOST:PORT" in res.err, res.err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.secrets.env").exists()
