"""Check the Ansible roles' argument specs against their defaults and their entry points.

For every role under ansible/roles/ (as prometheus-community/ansible checks its roles):

- every variable in defaults/main.yml is an option of at least one entry point in
  meta/argument_specs.yml, with the same default and a type its value has;
- every option of an entry point that has a default has that value in defaults/main.yml, and
  an option without one is required (nothing else would give it a value);
- every entry point the playbooks and roles use (`roles:`, `include_role`/`import_role`, with
  or without `tasks_from`) has a spec, so Ansible validates its inputs.

A default that is a template (`{{ ... }}`) is taken at its word: the spec's default must be the
same text (its type is known only once Ansible renders it). `python -m vfleet.checks.argument_specs`
prints each problem with its file and key and exits 1 (`make lint`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vfleet.paths import ANSIBLE_DIR

# Ansible's option types -> the Python types a YAML value of that type loads as.
TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "path": (str,),
    "raw": (object,),
    "bool": (bool,),
    "int": (int,),
    "float": (float, int),
    "list": (list,),
    "dict": (dict,),
}


@dataclass(frozen=True)
class Problem:
    file: Path
    key: str
    message: str

    def render(self, root: Path) -> str:
        try:
            where = self.file.relative_to(root)
        except ValueError:
            where = self.file
        return f"{where}: {self.key}: {self.message}"


def _load(path: Path) -> Any:
    if not path.is_file():
        return None
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def _is_template(value: Any) -> bool:
    return isinstance(value, str) and "{{" in value


def _has_type(value: Any, option: dict[str, Any]) -> bool:
    kind = str(option.get("type", "str"))
    if kind not in TYPES:
        return False
    if kind != "bool" and isinstance(value, bool):  # a bool is an int to Python, not to Ansible
        return kind == "raw"
    if not isinstance(value, TYPES[kind]):
        return False
    elements = option.get("elements")
    if isinstance(value, list) and elements is not None:
        return all(_has_type(v, {"type": elements}) for v in value)
    return True


def check_role(role: Path) -> list[Problem]:
    """Defaults against argument specs, both ways, for one role folder."""
    defaults_file = role / "defaults" / "main.yml"
    specs_file = role / "meta" / "argument_specs.yml"
    defaults: dict[str, Any] = _load(defaults_file) or {}
    specs: dict[str, Any] = (_load(specs_file) or {}).get("argument_specs") or {}
    out: list[Problem] = []
    if not specs:
        if defaults or (role / "tasks").is_dir():
            out.append(Problem(specs_file, "argument_specs", "missing: no entry point has a spec"))
        return out
    specified: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for entry, spec in specs.items():
        for name, option in ((spec or {}).get("options") or {}).items():
            specified.setdefault(name, []).append((entry, option or {}))
            where = f"{entry}.{name}"
            if not isinstance(option, dict) or "type" not in option:
                out.append(Problem(specs_file, where, "no type"))
                continue
            if option["type"] not in TYPES:
                out.append(Problem(specs_file, where, f"unknown type {option['type']!r}"))
            if "default" in option:
                if name not in defaults:
                    out.append(
                        Problem(
                            specs_file,
                            where,
                            f"default {option['default']!r} is not in defaults/main.yml "
                            "(add it there, or drop it from the spec)",
                        )
                    )
            elif not option.get("required", False) and name not in defaults:
                out.append(
                    Problem(
                        specs_file,
                        where,
                        "neither required nor given a default in defaults/main.yml",
                    )
                )
    for name, value in defaults.items():
        if name not in specified:
            out.append(
                Problem(
                    defaults_file,
                    name,
                    "no entry point in meta/argument_specs.yml has it as an option",
                )
            )
            continue
        for entry, option in specified[name]:
            where = f"{entry}.{name}"
            if "default" not in option:
                if not option.get("required", False):
                    out.append(
                        Problem(specs_file, where, f"no default; defaults/main.yml has {value!r}")
                    )
                continue
            if option["default"] != value:
                out.append(
                    Problem(
                        specs_file,
                        where,
                        f"default {option['default']!r} but defaults/main.yml has {value!r}",
                    )
                )
            elif not _is_template(value) and not _has_type(value, option):
                out.append(
                    Problem(
                        specs_file,
                        where,
                        f"type {option.get('type')!r}"
                        + (f" of {option['elements']!r}" if option.get("elements") else "")
                        + f" does not fit the default {value!r}",
                    )
                )
    return out


def _role_uses(node: Any) -> Iterator[tuple[str, str]]:
    """(role, entry point) for every use of a role in a loaded playbook or task file."""
    if isinstance(node, list):
        for item in node:
            yield from _role_uses(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in ("roles",) and isinstance(value, list):
                for role in value:
                    name = role.get("role", role.get("name")) if isinstance(role, dict) else role
                    if isinstance(name, str):
                        yield name, "main"
            elif key.split(".")[-1] in ("include_role", "import_role") and isinstance(value, dict):
                name = value.get("name")
                if isinstance(name, str):
                    yield name, str(value.get("tasks_from", "main")).removesuffix(".yml")
            else:
                yield from _role_uses(value)


def check_entry_points(ansible_dir: Path) -> list[Problem]:
    """Every role entry point that a playbook or role uses has a spec."""
    out: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    files = sorted(
        p
        for p in ansible_dir.rglob("*.yml")
        if "inventory" not in p.relative_to(ansible_dir).parts
        and "plugins" not in p.relative_to(ansible_dir).parts
    )
    for path in files:
        for role, entry in _role_uses(_load(path)):
            if "{{" in role or (role, entry) in seen:
                continue
            seen.add((role, entry))
            specs_file = ansible_dir / "roles" / role / "meta" / "argument_specs.yml"
            specs = (_load(specs_file) or {}).get("argument_specs") or {}
            if entry not in specs:
                out.append(
                    Problem(
                        specs_file,
                        entry,
                        f"entry point used by {path.relative_to(ansible_dir)} has no argument spec",
                    )
                )
    return out


def check(ansible_dir: Path = ANSIBLE_DIR) -> list[Problem]:
    roles = sorted(p for p in (ansible_dir / "roles").iterdir() if p.is_dir())
    out = [p for role in roles for p in check_role(role)]
    return out + check_entry_points(ansible_dir)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vfleet.checks.argument_specs", description=__doc__)
    ap.add_argument(
        "ansible_dir", nargs="?", type=Path, default=ANSIBLE_DIR, help="the ansible/ folder"
    )
    args = ap.parse_args(argv)
    if not (args.ansible_dir / "roles").is_dir():
        print(
            f"{args.ansible_dir}: no roles/ folder in it (give the ansible/ folder)",
            file=sys.stderr,
        )
        return 2
    try:
        problems = check(args.ansible_dir)
    except yaml.YAMLError as exc:
        print(f"cannot read a YAML file under {args.ansible_dir}: {exc}", file=sys.stderr)
        return 2
    for problem in problems:
        print(problem.render(args.ansible_dir), file=sys.stderr)
    if problems:
        print(
            f"{len(problems)} argument spec problem(s). Fix: make meta/argument_specs.yml and "
            "defaults/main.yml agree (docs/ARCHITECTURE.md, Ansible)",
            file=sys.stderr,
        )
        return 1
    roles = sum(1 for p in (args.ansible_dir / "roles").iterdir() if p.is_dir())
    print(f"argument specs agree with defaults and entry points ({roles} roles)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
