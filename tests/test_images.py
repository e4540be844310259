"""Images and compose files without a Docker engine: pins from the profiles, the pin check
(and that it catches drift), hadolint, compose.yaml against the compose specification's JSON
schema, and `vfleet compose` output."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from vfleet import images
from vfleet.profiles import load_profile

from .conftest import REPO, require_tools

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
    """Every pin the role installs (stacks.requirements) reaches the image's install line."""
    path = images_copy / "vllm-cuda" / "Dockerfile"
    text = path.read_text()
    assert edit in text
    profile = load_profile("2x2080ti-22g")
    stack = profile.stacks["vllm-0.24.0-flashinfer-sm75"]  # pins flashinfer and triton
    (spec,) = [
        s
        for s in images.images_for(profile.name, "vllm-0.24.0-flashinfer-sm75")
        if s.kind == "vllm"
    ]
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


def test_dry_run_stages_a_small_context_and_a_feed_with_the_wheels(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if not (REPO / "build" / "wheels" / images.wheel_name("vfleet_sm75", "0.1.0")).exists():
        pytest.skip("make wheels first") if not require_tools() else pytest.fail("no wheels")
    res = cli("images", "build", "--profile", "cpu", "--only", "vllm", "--dry-run")
    assert res.rc == 0, res.err
    argv = res.out.strip()
    assert argv.startswith("docker build --network host --tag vfleet/vllm:cpu-")
    assert "--build-arg PIP_INDEX=https://pypi.org/simple" in argv
    assert "--build-arg FEED_URL=http://127.0.0.1:PORT" in argv
    ctx = Path(argv.split()[-1])
    root = ctx.parent
    assert root.parent == REPO / "build" / "images" and root.name.startswith("vllm-cpu-")
    # The context docker receives holds no wheel and no CA: those are served from the feed.
    assert sorted(p.name for p in ctx.iterdir()) == [".dockerignore", "Dockerfile", "common"]
    assert (ctx / "common" / "vfleet-serve").stat().st_mode & stat.S_IXUSR
    assert sorted(p.name for p in (root / "feed" / "wheels").iterdir()) == sorted(
        [
            images.wheel_name("vfleet_healthcheck", images.healthcheck_version()),
            images.wheel_name("vfleet_sm75", images.plugin_version()),
        ]
    )
    assert (root / "feed" / "ca.crt").read_bytes() == b""
    shutil.rmtree(root)


def test_pip_installs_from_the_feed_over_loopback(tmp_path: Path) -> None:
    # What the Dockerfiles' RUN step does, outside Docker: real pip, --no-index, the feed's URL.
    hc = images.healthcheck_version()
    if not (images.WHEELS_DIR / images.wheel_name("vfleet_healthcheck", hc)).exists():
        pytest.skip("make wheels first") if not require_tools() else pytest.fail("no wheels")
    spec = images.sidecar_image(images.images_config())
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\nnot a real one\n-----END CERTIFICATE-----\n")
    staged = images.stage_context(spec, ca_bundle=ca, out=tmp_path / "stage")
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


def _compose_config() -> dict[str, object]:
    data = yaml.safe_load((REPO / "compose.yaml").read_text())
    assert isinstance(data, dict)
    return data


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    if not COMPOSE_SPEC.exists():
        if require_tools():
            pytest.fail("docker-compose not installed (make deps)")
        pytest.skip("docker-compose not installed")
    import jsonschema

    # The file says draft 2019-09 (as "http://.../draft/2019-09/schema#", which jsonschema
    # does not recognise by that spelling): name the validator.
    schema = json.loads(COMPOSE_SPEC.read_text())
    validator = jsonschema.Draft201909Validator(schema)
    for name in ("compose.yaml", "compose.gpu.yaml"):
        validator.validate(yaml.safe_load((REPO / name).read_text()))
    # And a broken one is caught (the check can fail).
    bad = _compose_config()
    bad["services"]["vllm"]["healthcheck"]["start_period"] = {"x": 1}  # type: ignore[index]
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)


def test_compose_services_as_the_issue_asks() -> None:
    services = _compose_config()["services"]
    assert isinstance(services, dict)
    vllm = services["vllm"]
    assert vllm["ipc"] == "host" and vllm["network_mode"] == "host"
    assert "start_period" in vllm["healthcheck"] and "--tier warm" in vllm["healthcheck"]["test"][1]
    assert vllm["env_file"] == ["${VFLEET_SECRETS_ENV:?run vfleet compose}"]
    assert services["sidecar"]["depends_on"] == {"vllm": {"condition": "service_healthy"}}
    assert services["grafana"]["profiles"] == ["grafana"]
    password = services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert password.startswith("${GRAFANA_ADMIN_PASSWORD:?")  # no default, ever
    gpu = yaml.safe_load((REPO / "compose.gpu.yaml").read_text())
    (dev,) = gpu["services"]["vllm"]["deploy"]["resources"]["reservations"]["devices"]
    assert dev["capabilities"] == ["gpu"] and dev["driver"] == "nvidia"
    # Every ${VAR} compose.yaml reads is one vfleet compose writes.
    import re

    from vfleet.compile import resolve
    from vfleet.compose import ComposeOptions, env_lines

    text = (REPO / "compose.yaml").read_text() + (REPO / "compose.gpu.yaml").read_text()
    used = set(re.findall(r"\$\{([A-Z_]+)", text))
    launch = resolve("2x2080ti-22g", "qwen3.6-27b-fp8")
    written = {
        k for k, _, _ in env_lines(launch, ComposeOptions(Path("/x"), Path("/m")), Path("/x"))
    }
    assert used <= written, used - written


def test_grafana_provisioning_files_are_valid() -> None:
    prov = REPO / "observability" / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "vfleet.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "${VFLEET_PROMETHEUS_URL}"
    dash = yaml.safe_load((prov / "dashboards" / "vfleet.yml").read_text())
    (provider,) = dash["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/vfleet"
    # compose.yaml mounts the dashboards exactly there, and they are JSON dashboards.
    vols = _compose_config()["services"]["grafana"]["volumes"]  # type: ignore[index]
    assert "${VFLEET_GRAFANA_DASHBOARDS}:/var/lib/grafana/dashboards/vfleet:ro" in vols
    boards = list((REPO / "observability" / "grafana" / "dashboards").glob("*.json"))
    assert boards and all("panels" in json.loads(b.read_text()) for b in boards)


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
    assert env["VFLEET_VLLM_URL"] == "http://127.0.0.1:8123"
    assert env["VFLEET_MODEL_MOUNT"] == "/opt/vfleet/models/tiny-hybrid-mtp"
    assert env["VFLEET_RELEASE_MOUNT"] == "/opt/vfleet/instances/main/current"
    assert env["VFLEET_VLLM_IMAGE"] == images.images_for("cpu")[0].ref
    assert env["COMPOSE_FILE"] == str(REPO / "compose.yaml")  # no GPU file for the CPU
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
    assert "VFLEET_VLLM_URL=http://127.0.0.1:8124" in again


def test_compose_gpu_profile_adds_the_gpu_file(cli, tmp_path: Path, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
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
    assert f"COMPOSE_FILE={REPO / 'compose.yaml'}:{REPO / 'compose.gpu.yaml'}" in text
    assert "VFLEET_GPU_COUNT=2" in text and "VFLEET_START_PERIOD=900s" in text


@pytest.mark.parametrize(
    ("extra", "expect"),
    [
        (("--set", "api_key=sekrit"), "api_key: api_key would be written into the release"),
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
