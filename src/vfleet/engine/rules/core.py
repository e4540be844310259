"""What every rule shares: the rendered entries, notes, the Rule type and the context the
rules run over (facts about the deployment, and the effects: arg, setenv, warn, info, refuse).
Also the sources the rules cite."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from vfleet.config.schema import (
    DEFAULT_INSTANCE,
    HardwareProfile,
    HostVars,
    ModelPreset,
    ServeSettings,
    Stack,
)
from vfleet.engine.decisions import Decisions
from vfleet.engine.versions import option_supported
from vfleet.errors import Refused

SEED_BOOST = "seeds/000 (2x 2080 Ti, vllm-boost, vLLM 0.27.1)"
SEED_A100 = "seeds/001 (A100 32 GB, vLLM 0.27.1, pm2)"
SEED_SYSTEMD = "seeds/002 (2x 2080 Ti NVLink, vLLM 0.24.0 systemd unit)"
SEED_TURBO3 = "seeds/004 (4x 2080 Ti, Caovan Turbo3, vLLM 0.21.0)"
SEEDS_README = "seeds/README.md (recurring facts)"
COMMUNITY = "docs/SOURCES.md#community"
FIELD_NOTES = "docs/SOURCES.md#observed (seen on vfleet's machines)"
VLLM_SOURCE = "vLLM source of the pinned versions (src/vfleet/engine/versions.py)"
GPU_LANE = "docs/GPU.md (vfleet's renders served on an H200 by the GPU lane)"


@dataclass(frozen=True)
class Entry:
    """One rendered argument or environment variable and the rule that set it."""

    kind: Literal["arg", "env"]
    key: str
    value: Any
    rule: str
    reason: str
    source: str
    secret: bool = False


@dataclass(frozen=True)
class Note:
    level: Literal["warn", "dropped", "info"]
    rule: str
    message: str
    source: str


@dataclass(frozen=True)
class Rule:
    """A named step of the knowledge base: what it decides (summary) and where that was learned
    (source); fn sets arguments, env and decisions on the context, warns, or refuses."""

    name: str
    summary: str
    source: str
    fn: Callable[[Ctx], None]


def rule(name: str, source: str, summary: str) -> Callable[[Callable[[Ctx], None]], Rule]:
    """Make a function a Rule; `vfleet.engine.rules.RULES` puts it in its place in the order."""

    def deco(fn: Callable[[Ctx], None]) -> Rule:
        return Rule(name, summary, source, fn)

    return deco


@dataclass
class Ctx:
    profile: HardwareProfile
    model: ModelPreset
    stack_name: str
    s: ServeSettings
    host: HostVars
    args: dict[str, Entry] = field(default_factory=dict)
    env: dict[str, Entry] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    # False for `vfleet plan`: report a configuration that does not fit instead of refusing.
    strict_memory: bool = True
    # What the rules decided that later rules, the planner and the renderers build on
    # (vfleet.engine.decisions): filled once per field in rule order, sealed by apply().
    d: Decisions = field(default_factory=Decisions)
    current: Rule | None = None

    # -- facts -------------------------------------------------------------------------
    @property
    def stack(self) -> Stack:
        return self.profile.stacks[self.stack_name]

    @property
    def version(self) -> str:
        return self.stack.vllm

    @property
    def is_cpu(self) -> bool:
        return self.profile.accelerator.kind == "cpu"

    @property
    def sm(self) -> tuple[int, int]:
        return self.profile.accelerator.sm or (0, 0)

    @property
    def is_sm75(self) -> bool:
        return not self.is_cpu and self.sm == (7, 5)

    @property
    def one_32g_gpu(self) -> bool:
        """One GPU of at most 32 GB (seed 001's A100): MTP fits there only with one sequence."""
        acc = self.profile.accelerator
        return not self.is_cpu and acc.count == 1 and (acc.vram_gib or 0) <= 32

    @property
    def instance(self) -> str:
        return self.s.instance or DEFAULT_INSTANCE

    # -- effects -----------------------------------------------------------------------
    def _rule(self) -> Rule:
        assert self.current is not None
        return self.current

    def arg(self, key: str, value: Any, why: str, source: str | None = None) -> None:
        r = self._rule()
        src = source or r.source
        if not option_supported(key, self.version):
            self.notes.append(
                Note(
                    "dropped",
                    r.name,
                    f"--{key} not emitted: vLLM {self.version} has no such option ({why})",
                    src,
                )
            )
            return
        if value is False:
            # `key: false` is dropped silently by `vllm serve --config` before
            # FALSE_BOOL_DROPPED_BEFORE; `no-key: true` means the same in every version.
            key, value = f"no-{key}", True
        if key in self.args:
            raise AssertionError(f"rule {r.name} sets --{key} twice (first: {self.args[key].rule})")
        self.args[key] = Entry("arg", key, value, r.name, why, src)

    def setenv(
        self, key: str, value: str, why: str, source: str | None = None, secret: bool = False
    ) -> None:
        r = self._rule()
        self.env[key] = Entry("env", key, value, r.name, why, source or r.source, secret)

    def warn(self, message: str, source: str | None = None) -> None:
        r = self._rule()
        self.notes.append(Note("warn", r.name, message, source or r.source))

    def info(self, message: str, source: str | None = None) -> None:
        r = self._rule()
        self.notes.append(Note("info", r.name, message, source or r.source))

    def refuse(self, message: str, fix: str, source: str | None = None) -> None:
        r = self._rule()
        raise Refused(r.name, message, fix, source or r.source)
