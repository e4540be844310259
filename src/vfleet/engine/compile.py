"""Deployment -> launch configuration: layering, stack choice, then the rules."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vfleet.config.profiles import (
    Layer,
    find_baseline,
    layer_settings,
    load_deployment,
    load_model,
    load_profile,
    profiles_dir,
    settings_from_set,
)
from vfleet.config.schema import (
    Baseline,
    HardwareProfile,
    HostVars,
    ModelPreset,
    ServeSettings,
    Stack,
)
from vfleet.engine.decisions import Decisions
from vfleet.engine.rules import Ctx, Entry, Note, apply
from vfleet.engine.versions import server_module
from vfleet.errors import VfleetError


@dataclass(frozen=True)
class Launch:
    """Everything needed to render one vLLM instance."""

    profile: HardwareProfile
    model: ModelPreset
    stack_name: str
    settings: ServeSettings
    origin: dict[str, str]
    host: HostVars
    ctx: Ctx
    # What speed is normal here (profiles/baselines/), if anyone measured it.
    baseline: Baseline | None = None
    baseline_file: str | None = None
    # The SM75 plugin's draft vocabulary (JSON text), when the stack carries the plugin.
    draft_vocab: str | None = None

    @property
    def stack(self) -> Stack:
        return self.ctx.stack

    @property
    def instance(self) -> str:
        return self.ctx.instance

    @property
    def args(self) -> list[Entry]:
        return list(self.ctx.args.values())

    @property
    def env(self) -> list[Entry]:
        return list(self.ctx.env.values())

    @property
    def notes(self) -> list[Note]:
        return self.ctx.notes

    @property
    def decisions(self) -> Decisions:
        """What the rules decided (port, TP, context, MTP depth, service timings, ...)."""
        return self.ctx.d

    @property
    def port(self) -> int:
        """Where clients connect: vLLM's port, or its front's."""
        return self.decisions.port

    @property
    def listen_host(self) -> str:
        """Where clients connect: vLLM's address, or its front's."""
        return self.decisions.host

    @property
    def vllm_port(self) -> int:
        """vLLM's own port (behind the front: loopback only)."""
        return self.decisions.vllm_port

    @property
    def vllm_host(self) -> str:
        return self.decisions.vllm_host

    @property
    def served_model_name(self) -> str:
        return self.decisions.served_model_name

    @property
    def model_dir(self) -> str:
        return self.decisions.model_dir

    @property
    def venv(self) -> str:
        return self.host.venv_dir(self.stack)

    @property
    def server_module(self) -> str:
        return server_module(self.stack.vllm)

    def config_values(self) -> dict[str, Any]:
        return {e.key: e.value for e in self.args}


def resolve(
    profile: str,
    model: str,
    *,
    deployment: Path | None = None,
    sets: list[str] | None = None,
    root: Path | None = None,
    host: HostVars | None = None,
    preset: ModelPreset | None = None,
    strict_memory: bool = True,
) -> Launch:
    root = profiles_dir(root)
    dep = load_deployment(deployment) if deployment else None
    if dep is not None:
        # A deployment file names its profile and model; the command line must agree.
        for key, given, in_file in (("profile", profile, dep.profile), ("model", model, dep.model)):
            if given and given != in_file:
                raise VfleetError(
                    f"the deployment file says {key} {in_file!r}, the command line {given!r}",
                    where=str(deployment),
                    key=key,
                    fix=f"drop --{key} or make them agree",
                )
        profile, model = dep.profile, dep.model
    hw = load_profile(profile, root)
    preset = preset or load_model(model, root)
    layers = [
        Layer(f"{root}/hardware/{hw.name}.yaml", hw.defaults),
        Layer(f"{root}/models/{preset.name}.yaml", preset.defaults),
    ]
    if dep is not None:
        layers.append(Layer(str(deployment), dep.settings))
    if sets:
        layers.append(Layer("--set", settings_from_set(sets)))
    settings, origin = layer_settings(layers)
    stack_name = settings.stack or hw.default_stack
    if stack_name not in hw.stacks:
        close = difflib.get_close_matches(stack_name, list(hw.stacks), n=1)
        raise VfleetError(
            f"unknown stack {stack_name!r} for profile {hw.name}",
            where=origin.get("stack", "settings"),
            key="stack",
            fix=(f"did you mean {close[0]!r}? " if close else "")
            + f"stacks of {hw.name}: {', '.join(hw.stacks)}",
        )
    host = host or HostVars()
    ctx = apply(hw, preset, stack_name, settings, host, strict_memory=strict_memory)
    found = find_baseline(hw.name, preset.name, stack_name, root)
    draft_vocab = None
    if preset.draft_vocab and ctx.d.draft_prune is not None:  # shipped only where it prunes
        draft_vocab = read_draft_vocab(root / "models" / preset.draft_vocab, preset)
    return Launch(
        hw,
        preset,
        stack_name,
        settings,
        origin,
        host,
        ctx,
        baseline=found[1] if found else None,
        baseline_file=str(found[0]) if found else None,
        draft_vocab=draft_vocab,
    )


def read_draft_vocab(path: Path, preset: ModelPreset) -> str:
    """The table's text, checked by the plugin's own reader and against the preset's vocabulary."""
    where = f"{path.parent}/{preset.name}.yaml"
    try:
        from vfleet_sm75 import draft_vocab  # the plugin package: one definition of the format
    except ImportError:
        raise VfleetError(
            "the vfleet-sm75 package (plugin/) is not installed beside vfleet",
            where=where,
            key="draft_vocab",
            fix="make venv (installs ./plugin), or pip install -e ./plugin",
        ) from None
    try:
        table = draft_vocab.load(path)
    except draft_vocab.TableError as exc:
        raise VfleetError(
            str(exc), where=where, key="draft_vocab", fix="rebuild it: vfleet-sm75 vocab build"
        ) from None
    if table.vocab_size != preset.arch.vocab_size:
        raise VfleetError(
            f"{path.name} is for a vocabulary of {table.vocab_size}, the model has "
            f"{preset.arch.vocab_size}",
            where=where,
            key="draft_vocab",
            fix="build the table with this model's tokenizer (vfleet-sm75 vocab build)",
        )
    return path.read_text(encoding="utf-8")
