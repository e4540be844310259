"""docs/VERIFICATION.md says how each GPU claim is known; these tests keep it honest: every
named test exists, every GPU profile's stack has a record, and the page is not stale."""

from __future__ import annotations

import ast
from functools import cache

from tests.conftest import REPO
from vfleet.checks import verification
from vfleet.checks.verification import Level
from vfleet.config.profiles import list_profiles, load_profile


@cache
def _test_names(path: str) -> frozenset[str]:
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    return frozenset(
        n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    )


def test_every_named_test_exists() -> None:
    missing = []
    for rec in verification.RECORDS:
        for claim in rec.claims:
            assert (claim.level is Level.MAKE_TEST) == bool(claim.tests), (rec.stack, claim.what)
            for node in claim.tests:
                path, _, name = node.partition("::")
                if not (REPO / path).is_file() or name not in _test_names(path):
                    missing.append(node)
    assert not missing


def test_every_gpu_stack_has_a_record() -> None:
    recorded = {(r.profile, r.stack) for r in verification.RECORDS}
    stacks = {
        (name, stack)
        for name in list_profiles()
        if load_profile(name).accelerator.kind == "cuda"
        for stack in load_profile(name).stacks
    }
    assert stacks == recorded


def test_the_page_is_up_to_date() -> None:
    assert (REPO / "docs" / "VERIFICATION.md").read_text() == verification.render()


def test_the_check_fails_on_a_stale_page(tmp_path: object) -> None:
    from pathlib import Path

    page = Path(str(tmp_path)) / "VERIFICATION.md"
    page.write_text("old\n")
    assert verification.main(["--check", str(page)]) == 1
    assert verification.main(["--write", str(page)]) == 0
    assert verification.main(["--check", str(page)]) == 0
