"""The plugin's runtime decision as a file: what the sidecar's label and `vfleet doctor` report.

``VFLEET_SM75_STATE=FILE`` (vfleet renders it into the instance's state folder): every vLLM
process writes the decision table at plugin load, and the process that loads the model adds
draft-prune's result for that model (on with its rows, or off with the model's reason). Each
write is whole (temp file + rename), so a reader never sees half a file.

Later processes start while the model loads (TP workers, more API servers): their plugin-load
write keeps a model result whose writer is still alive, so the file never loses it; a result
from a process that has exited (a previous start) is dropped.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

FORMAT = "vfleet-sm75.state/1"
ENV_STATE = "VFLEET_SM75_STATE"


@dataclass(frozen=True)
class Feature:
    feature: str
    active: bool
    reason: str


@dataclass(frozen=True)
class Writer:
    """One process exactly: its pid and its start time (clock ticks since boot)."""

    pid: int
    start_ticks: int | None

    def alive(self) -> bool:
        return self.start_ticks is not None and _start_ticks(self.pid) == self.start_ticks


@dataclass(frozen=True)
class PluginState:
    plugin: str
    vllm: str | None
    written_at: float
    writer: Writer
    features: tuple[Feature, ...]  # at plugin load, one per feature
    model: tuple[Feature, ...] = ()  # at model load: a feature's result for the model
    model_writer: Writer | None = None

    def active_features(self) -> list[str]:
        """The features on now: on at plugin load and not turned off by the model's checks."""
        for_model = {m.feature: m.active for m in self.model}
        return [f.feature for f in self.features if f.active and for_model.get(f.feature, True)]

    def reasons(self) -> dict[str, Feature]:
        """Each feature's state now, with its reason (the model's, once it has loaded)."""
        out = {f.feature: f for f in self.features}
        for m in self.model:
            if out.get(m.feature) is not None and out[m.feature].active:
                out[m.feature] = m
        return out

    def to_json(self) -> dict[str, object]:
        # "active": what a reader without this package shows (the sidecar's label)
        return {"format": FORMAT, "active": self.active_features(), **asdict(self)}


_last: PluginState | None = None  # what this process last wrote


def _start_ticks(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _me() -> Writer:
    return Writer(os.getpid(), _start_ticks(os.getpid()))


def _features(items: object) -> tuple[Feature, ...]:
    if not isinstance(items, list):
        raise ValueError("features must be a list")
    return tuple(Feature(str(i["feature"]), bool(i["active"]), str(i["reason"])) for i in items)


def _writer(item: object) -> Writer | None:
    if not isinstance(item, dict):
        return None
    ticks = item.get("start_ticks")
    return Writer(int(item["pid"]), ticks if isinstance(ticks, int) else None)


def load(path: str | os.PathLike[str]) -> PluginState:
    """Read a state file; ValueError/OSError with the reason if it is not one."""
    return from_json(json.loads(Path(path).read_text(encoding="utf-8")))


def from_json(data: object) -> PluginState:
    """A state file's parsed JSON (as `vfleet doctor` gets it from the host); ValueError."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"not a vfleet-sm75 state file (format must be {FORMAT!r})")
    try:
        writer = _writer(data["writer"])
        if writer is None:
            raise ValueError("writer missing")
        return PluginState(
            str(data["plugin"]),
            None if data.get("vllm") is None else str(data["vllm"]),
            float(data["written_at"]),
            writer,
            _features(data["features"]),
            _features(data.get("model") or []),
            _writer(data.get("model_writer")),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed: {exc!r}") from None


def _read(path: Path) -> PluginState | None:
    try:
        return load(path)
    except (OSError, ValueError):
        return None


def _write(path: Path, state: PluginState) -> None:
    global _last
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(state.to_json(), fh, indent=1)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _last = state


def record_load(path: str, features: list[Feature], plugin: str, vllm: str | None) -> None:
    """At plugin load: the decision table. Keeps a model result whose writer still runs."""
    old = _read(Path(path))
    keep = old is not None and old.model_writer is not None and old.model_writer.alive()
    state = PluginState(
        plugin,
        vllm,
        time.time(),
        _me(),
        tuple(features),
        old.model if keep and old is not None else (),
        old.model_writer if keep and old is not None else None,
    )
    _write(Path(path), state)


def record_model(path: str, result: Feature) -> None:
    """At model load (one writer: TP rank 0): a feature's result for this model."""
    state = _read(Path(path)) or _last
    if state is None:
        return
    alive = state.model_writer is not None and state.model_writer.alive()
    model = [m for m in (state.model if alive else ()) if m.feature != result.feature]
    _write(
        Path(path),
        replace(state, written_at=time.time(), model=(*model, result), model_writer=_me()),
    )
