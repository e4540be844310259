"""The import layers of src/vfleet (docs/ARCHITECTURE.md), read from the source with ast.

Low to high: errors, paths < hostside < config < engine < render < checks, measure < fleet < cli.
A module may import from its own layer or a lower one, never from a higher one; hostside (code
that runs on hosts or in vLLM venvs) imports nothing of vfleet; no two modules import each other,
directly or round a longer loop. Every import counts, also one inside a function or under
TYPE_CHECKING: each is a dependency a reader has to follow.

Today's exceptions are listed in KNOWN, each with its reason, and the test asserts that KNOWN is
exactly what it finds: a fixed one must be struck from the list, a new one fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "vfleet"

# Layer of each top-level part of vfleet: equal numbers are one layer (sideways imports allowed).
LAYERS: dict[str, int] = {
    "errors": 0,
    "paths": 0,
    "hostside": 1,
    "config": 2,
    "engine": 3,
    "render": 4,
    "checks": 5,
    "measure": 5,
    "fleet": 6,
    "cli": 7,
}

# Accepted exceptions, each with its reason (none today: the ones the package move at fae2b44
# left, balancer <-> swap, doctor's internals, render -> checks.stacks, tune -> cli.bench,
# were removed in issue 21). (importer, imported) -> why.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}

# Accepted import cycles (none): the sorted modules of each cycle -> why.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}

# Accepted private names (a leading underscore) imported from another module (none):
# (importer, imported module, name) -> why. A private name is an internal: share it publicly.
KNOWN_PRIVATE: dict[tuple[str, str, str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The vfleet modules that `name` imports (a `from pkg import mod` counts as pkg.mod)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = resolve(name, path.name == "__init__.py", node)
            targets = [f"{mod}.{alias.name}" if f"{mod}.{alias.name}" in known else mod
                       for alias in node.names]  # fmt: skip
        else:
            continue
        for target in targets:
            if target == "vfleet" or target.startswith("vfleet."):
                # The nearest known module (a name imported from a module is not a module).
                while target not in known and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target != name:
                    found.add(target)
    return found


def private_imports(name: str, path: Path) -> set[tuple[str, str, str]]:
    """(importer, module, name) for each `from vfleet... import _name` in `name`'s source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[tuple[str, str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            mod = resolve(name, path.name == "__init__.py", node)
            if mod == "vfleet" or mod.startswith("vfleet."):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.add((name, mod, alias.name))
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def upward(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports from a lower layer to a higher one, and every vfleet import of hostside's (its
    modules are copied to hosts and into vLLM venvs alone: they import nothing of vfleet)."""
    bad: set[tuple[str, str]] = set()
    for src, dests in edges.items():
        for dest in dests:
            here, there = LAYERS.get(part(src), -1), LAYERS.get(part(dest), -1)
            if part(src) == "hostside" or (here >= 0 and there > here):
                bad.add((src, dest))
    return bad


def cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[tuple[str, ...]] = set()
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.add(tuple(sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_part_has_a_layer() -> None:
    parts = {part(m) for m in modules()} - {""}
    assert parts <= set(LAYERS), f"give these a layer in LAYERS: {sorted(parts - set(LAYERS))}"


def test_no_import_goes_up_a_layer() -> None:
    found = upward(graph())
    new = sorted(found - set(KNOWN_UPWARD))
    fixed = sorted(set(KNOWN_UPWARD) - found)
    assert not new, "imports from a lower layer to a higher one:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in new
    )
    assert not fixed, "fixed: strike these from KNOWN_UPWARD:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in fixed
    )


def test_no_import_cycles() -> None:
    found = cycles(graph())
    new = sorted(found - set(KNOWN_CYCLES))
    fixed = sorted(set(KNOWN_CYCLES) - found)
    assert not new, "import cycles:\n" + "\n".join(f"  {' <-> '.join(c)}" for c in new)
    assert not fixed, "fixed: strike these from KNOWN_CYCLES:\n" + "\n".join(
        f"  {' <-> '.join(c)}" for c in fixed
    )


def test_no_private_name_imported_from_another_module() -> None:
    found: set[tuple[str, str, str]] = set()
    for name, path in modules().items():
        found |= private_imports(name, path)
    new = sorted(found - set(KNOWN_PRIVATE))
    fixed = sorted(set(KNOWN_PRIVATE) - found)
    assert not new, "private names imported from another module:\n" + "\n".join(
        f"  {a}: from {b} import {c}" for a, b, c in new
    )
    assert not fixed, "fixed: strike these from KNOWN_PRIVATE:\n" + "\n".join(
        f"  {a}: from {b} import {c}" for a, b, c in fixed
    )


# The checks themselves, on small made-up graphs: a test that cannot fail is a defect.
@pytest.mark.parametrize(
    ("edges", "expected"),
    [
        ({"vfleet.config.a": {"vfleet.engine.b"}}, {("vfleet.config.a", "vfleet.engine.b")}),
        ({"vfleet.engine.b": {"vfleet.config.a"}}, set()),
        ({"vfleet.checks.a": {"vfleet.measure.b"}}, set()),
        ({"vfleet.hostside.a": {"vfleet.errors"}}, {("vfleet.hostside.a", "vfleet.errors")}),
        ({"vfleet.cli.main": {"vfleet.fleet.swap"}}, set()),
    ],
)
def test_upward_detects(edges: dict[str, set[str]], expected: set[tuple[str, str]]) -> None:
    assert upward(edges) == expected


def test_cycles_detects() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == {("a", "b", "c")}
    assert cycles({"a": {"b"}, "b": set()}) == set()


def test_private_imports_detects(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "from vfleet.fleet.doctor import _settings, host_plan, __all__\nfrom os import _exit\n"
    )
    assert private_imports("vfleet.fleet.x", src) == {
        ("vfleet.fleet.x", "vfleet.fleet.doctor", "_settings")
    }


def test_imports_of_resolves_relative_and_names_from_a_package(tmp_path: Path) -> None:
    src = tmp_path / "rules.py"
    src.write_text(
        "from ..config import schema\nfrom . import planner\nfrom vfleet.errors import Refused\n"
        "def f():\n    import vfleet.render.plan\n"
    )
    known = {"vfleet.config", "vfleet.config.schema", "vfleet.engine.planner", "vfleet.errors",
             "vfleet.render.plan", "vfleet.engine.rules"}  # fmt: skip
    assert imports_of("vfleet.engine.rules", src, known) == {
        "vfleet.config.schema",
        "vfleet.engine.planner",
        "vfleet.errors",
        "vfleet.render.plan",
    }


def test_no_test_module_imports_another() -> None:
    """Shared test data and helpers live in tests/support, not in a test module."""
    tests = SRC.parent / "tests"
    found = []
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            for name in names:
                if re.match(r"tests\.(unit|integration)\.test_", name):
                    found.append(f"{path.relative_to(tests.parent)}: {name}")
    assert not found, "move what they share to tests/support:\n" + "\n".join(found)
