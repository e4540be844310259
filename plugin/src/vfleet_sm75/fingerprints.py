"""Fingerprints of the vLLM functions the plugin hooks, read from source without importing vLLM.

A feature hooks a few named vLLM functions. It turns on only where each of them has exactly the
fingerprint it had in a verified vLLM version: the hash of ``ast.unparse`` of the function (so
comments and formatting do not count, any change of code does). A vLLM upgrade that changes a
hooked function switches the feature off with the function's name, instead of patching code
that no longer does what the hook expects.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from pathlib import Path


def vllm_root() -> Path | None:
    """The directory of the importable ``vllm`` package (found, not imported)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in qualname.split("."):
        body = getattr(node, "body", [])
        found = [
            child
            for child in body
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and child.name == part
        ]
        if not found:
            return None
        node = found[-1]  # the last definition wins, as at import time
    return node


def _node(target: str, root: Path | None) -> ast.AST | None:
    relpath, _, qualname = target.partition(":")
    base = root if root is not None else vllm_root()
    if base is None:
        return None
    try:
        tree = ast.parse((base / relpath).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    return _find(tree, qualname)


def names(target: str, root: Path | None = None) -> frozenset[str]:
    """Every identifier the function uses (names, attributes, its own defs): what it touches."""
    node = _node(target, root)
    if node is None:
        return frozenset()
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(n.name)
    return frozenset(out)


def fingerprint(target: str, root: Path | None = None) -> str | None:
    """``"v1/spec_decode/x.py:Class.method"`` -> 16 hex digits, or None if it is not there."""
    node = _node(target, root)
    if node is None:
        return None
    return hashlib.sha256(ast.unparse(node).encode()).hexdigest()[:16]


def fingerprints(targets: list[str], root: Path | None = None) -> dict[str, str | None]:
    base = root if root is not None else vllm_root()
    return {t: fingerprint(t, base) for t in targets}
