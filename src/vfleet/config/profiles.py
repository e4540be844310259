"""Load hardware profiles, model presets and deployment files; layer serving settings.

Layering, lowest first: hardware profile defaults < model preset defaults < deployment file
< command line `--set key=value`. Each layer is validated alone so that an error names the
file (or the --set argument) that holds the bad key.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from vfleet.config import yamlio
from vfleet.config.schema import Baseline, Deployment, HardwareProfile, ModelPreset, ServeSettings
from vfleet.errors import VfleetError
from vfleet.paths import REPO_ROOT

DEFAULT_PROFILES_DIR = REPO_ROOT / "profiles"

M = TypeVar("M", bound=BaseModel)


def profiles_dir(override: str | os.PathLike[str] | None = None) -> Path:
    if override is not None:
        return Path(override)
    env = os.environ.get("VFLEET_PROFILES_DIR")
    return Path(env) if env else DEFAULT_PROFILES_DIR


def read_yaml(path: Path) -> Any:
    return yamlio.read(path)


def _loc(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def validation_error(exc: ValidationError, where: str, model: type[BaseModel]) -> VfleetError:
    """Turn pydantic's error into one that names the file, key and a fix."""
    # A typo gives both "unknown key" and "missing key": the unknown one points at the typo.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    err = errors[0]
    key = _loc(err["loc"])
    if err["type"] == "extra_forbidden":
        field = str(err["loc"][-1])
        parent = model
        for part in err["loc"][:-1]:
            info = parent.model_fields.get(str(part)) if isinstance(part, str) else None
            ann = info.annotation if info else None
            sub = _model_in(ann)
            if sub is None:
                break
            parent = sub
        known = sorted(parent.model_fields)
        close = difflib.get_close_matches(field, known, n=1)
        fix = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        return VfleetError("unknown key", where=where, key=key, fix=fix)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    fix = (
        f"add {key}: <value>"
        if err["type"] == "missing"
        else "see docs/PROFILES.md for the allowed values of this key"
    )
    return VfleetError(f"{err['msg']}{more}", where=where, key=key, fix=fix)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def parse(model: type[M], data: Any, where: str) -> M:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise VfleetError(
            f"expected a mapping, got {type(data).__name__}",
            where=where,
            fix="the file must be a YAML mapping of keys to values",
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, where, model) from None


def _available(kind_dir: Path) -> list[str]:
    return sorted(p.stem for p in kind_dir.glob("*.yaml")) if kind_dir.is_dir() else []


def _load_named(model: type[M], kind: str, name: str, root: Path) -> M:
    kind_dir = root / kind
    path = kind_dir / f"{name}.yaml"
    if not path.is_file():
        names = _available(kind_dir)
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise VfleetError(
            f"unknown {kind[:-1] if kind.endswith('s') else kind} {name!r}",
            where=str(kind_dir),
            fix=f"{hint}available: {', '.join(names) or '(none)'}",
        )
    obj = parse(model, read_yaml(path), str(path))
    if getattr(obj, "name", name) != name:
        raise VfleetError(
            f"name {obj.name!r} does not match the file name",  # type: ignore[attr-defined]
            where=str(path),
            key="name",
            fix=f"set name: {name}",
        )
    return obj


def load_profile(name: str, root: Path | None = None) -> HardwareProfile:
    return _load_named(HardwareProfile, "hardware", name, root or profiles_dir())


def load_model(name: str, root: Path | None = None) -> ModelPreset:
    return _load_named(ModelPreset, "models", name, root or profiles_dir())


def list_profiles(root: Path | None = None) -> list[str]:
    return _available((root or profiles_dir()) / "hardware")


def list_models(root: Path | None = None) -> list[str]:
    return _available((root or profiles_dir()) / "models")


def load_deployment(path: Path) -> Deployment:
    return parse(Deployment, read_yaml(path), str(path))


# --------------------------------------------------------------------------- --set


_INT = re.compile(r"^[+-]?(0|[1-9][0-9]*)$")
_FLOAT = re.compile(r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$")


def _field_annotation(parts: list[str]) -> Any:
    """The schema's type for a dotted --set key (None: not a known key; pydantic says so)."""
    model: Any = ServeSettings
    annotation: Any = None
    for n, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if fields is None:
            # Inside a dict[str, X] (extra_env, extra_args): the value type X.
            args = typing.get_args(annotation)
            return args[1] if n == len(parts) - 1 and len(args) == 2 else None
        if part not in fields:
            return None
        annotation = fields[part].annotation
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        core = inner[0] if len(inner) == 1 else annotation
        model = core
        if n < len(parts) - 1 and typing.get_origin(core) is dict:
            annotation = core
            model = None
    return annotation


def _core(annotation: Any) -> Any:
    """Optional[X] -> X."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _typed(raw: str, annotation: Any, item: str) -> Any:
    """A --set value converted by the schema's type, never by YAML's guessing: text stays text
    (`s3cr3t #prod` keeps its '#', `12:30` is not 750, `010` is not 8, `on` is not true)."""
    core = _core(annotation)
    bad = VfleetError(
        f"{raw!r} is not a valid value",
        where=f"--set {item}",
        fix="see docs/PROFILES.md for the key's type",
    )
    if core is bool:
        if raw.lower() not in ("true", "false"):
            bad.fix = "write true or false"
            raise bad
        return raw.lower() == "true"
    if core is int:
        if not _INT.match(raw):
            bad.fix = "write a whole number in decimal (e.g. 8192)"
            raise bad
        return int(raw)
    if core is float:
        if not _FLOAT.match(raw):
            bad.fix = "write a decimal number (e.g. 0.9)"
            raise bad
        return float(raw)
    if typing.get_origin(core) is list:
        (elem,) = typing.get_args(core)
        text = raw.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        return [_typed(x.strip(), elem, item) for x in text.split(",") if x.strip()]
    if annotation is None or core is Any:
        # An escape hatch (extra_args: vLLM's own types) or an unknown key (refused by the
        # schema with a suggestion): YAML scalars, through the strict loader.
        return yamlio.loads(raw, f"--set {item}")
    return raw


def parse_set(items: list[str]) -> dict[str, Any]:
    """`--set speculative.num_speculative_tokens=4 port=8001` -> nested dict, schema-typed."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise VfleetError(
                "expected key=value",
                where=f"--set {item}",
                fix="write e.g. --set max_model_len=8192",
            )
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if raw.strip() in ("", "null", "~", "None"):
            raise VfleetError(
                "a value is required",
                where=f"--set {item}",
                fix=f"give {key.strip()} a value; to leave it to the rules, drop the --set",
            )
        value = _typed(raw, _field_annotation(parts), item)
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise VfleetError("conflicting keys", where=f"--set {item}")
        node[parts[-1]] = value
    return out


def _merge(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    out = dict(low)
    for key, value in high.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@dataclass(frozen=True)
class Layer:
    where: str
    settings: ServeSettings


def layer_settings(layers: list[Layer]) -> tuple[ServeSettings, dict[str, str]]:
    """Merge layers (lowest first). Returns the settings and, per key, which layer set it."""
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for layer in layers:
        data = layer.settings.model_dump(exclude_none=True)
        for key in data:
            origin[key] = layer.where
        merged = _merge(merged, data)
    # Secrets come back from model_dump as SecretStr: keep them as they are.
    return ServeSettings.model_validate(merged), origin


def settings_from_set(items: list[str]) -> ServeSettings:
    return parse(ServeSettings, parse_set(items), "--set")


BASELINES = "baselines"
LOCAL_BASELINES = "local"  # an operator's own (`vfleet bench --save-baseline`) win


def load_baselines(root: Path | None = None) -> list[tuple[Path, Baseline]]:
    """Every baseline file under profiles/baselines/ (recursively), validated."""
    folder = profiles_dir(root) / BASELINES
    out: list[tuple[Path, Baseline]] = []
    for path in sorted(folder.rglob("*.yaml")):
        out.append((path, parse(Baseline, read_yaml(path), str(path))))
    return out


def find_baseline(
    profile: str, model: str, stack: str | None = None, root: Path | None = None
) -> tuple[Path, Baseline] | None:
    """The baseline for profile x model on ``stack``: same stack before any stack, an
    operator's own (profiles/baselines/local/) before the shipped ones."""
    best: tuple[tuple[int, int], Path, Baseline] | None = None
    for path, b in load_baselines(root):
        if b.profile != profile or b.model != model or b.stack not in (None, stack):
            continue
        rank = (int(b.stack is not None), int(LOCAL_BASELINES in path.parent.parts[-1:]))
        if best is None or rank >= best[0]:
            best = (rank, path, b)
    return (best[1], best[2]) if best else None
