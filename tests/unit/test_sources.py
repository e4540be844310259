"""Every source vfleet cites resolves inside this repository (or is a seed, cited by its file
name): the rules' sources, each rendered argument's and note's source, and the profiles' and
presets' `sources:` lists. `vfleet explain` prints these to operators, so a citation of a file
that is not in the repository is a dead end for them."""

from __future__ import annotations

import re

import pytest

from tests.conftest import REPO
from vfleet.config.profiles import list_models, list_profiles, load_model, load_profile
from vfleet.engine.compile import resolve
from vfleet.engine.rules import RULES
from vfleet.errors import VfleetError

# The five seed write-ups (the project's origin, cited by file name) and their README.
SEED = re.compile(r"^seeds/(00[0-4]|README\.md)$")
# Citations that name no file: vfleet's own design decisions ("vfleet default", "vfleet planner"),
# and vLLM's source (the parenthesis names the file read, or the module that records the versions).
NAMED = re.compile(r"^(vfleet( [a-z ]+)?|vLLM source of the pinned versions|vLLM source)$")


def _parts(source: str) -> list[str]:
    """'a (why; more); b#x (why)' -> ['a', 'b#x']: split on ';' outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in source:
        depth += (ch == "(") - (ch == ")")
        if ch == ";" and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [re.sub(r"\s*\(.*$", "", p).strip() for p in parts if p.strip()]


def unresolved(source: str) -> list[str]:
    bad = []
    for part in _parts(source):
        if SEED.match(part) or NAMED.match(part):
            continue
        path, _, anchor = part.partition("#")
        file = REPO / path
        missing = not path or ".." in path or not file.is_file()
        if missing or (anchor and f'id="{anchor}"' not in file.read_text(encoding="utf-8")):
            bad.append(part)
    return bad


def test_the_check_rejects_what_is_outside() -> None:
    assert unresolved("docs/not-in-repo.md") == ["docs/not-in-repo.md"]
    assert unresolved("../outside/notes.md") == ["../outside/notes.md"]
    assert unresolved("docs/SOURCES.md#nowhere (x)") == ["docs/SOURCES.md#nowhere"]
    assert unresolved("seeds/007") == ["seeds/007"]
    assert unresolved("seeds/002 (a); docs/SOURCES.md#community") == []
    assert unresolved("docs/SOURCES.md#observed (a; b)") == []
    assert unresolved("issue 3") == ["issue 3"]


def test_rule_sources_resolve() -> None:
    bad = {r.name: unresolved(r.source) for r in RULES if unresolved(r.source)}
    assert not bad


def test_profile_and_preset_sources_resolve() -> None:
    bad: dict[str, list[str]] = {}
    for name in list_profiles():
        prof = load_profile(name)
        cited = list(prof.sources) + [s for st in prof.stacks.values() for s in st.sources]
        bad.update({f"profile {name}": unresolved(";".join(cited))} if cited else {})
    for name in list_models():
        bad[f"model {name}"] = unresolved(";".join(load_model(name).sources))
    assert not {k: v for k, v in bad.items() if v}


@pytest.mark.parametrize("profile", list_profiles())
def test_rendered_entry_sources_resolve(profile: str) -> None:
    seen = 0
    for model in list_models():
        for stack in load_profile(profile).stacks:
            try:
                launch = resolve(profile, model, sets=[f"stack={stack}"], strict_memory=False)
            except VfleetError:
                continue  # a refused combination renders nothing to cite
            entries = [*launch.args, *launch.env]
            seen += len(entries)
            bad = {e.key: unresolved(e.source) for e in entries if unresolved(e.source)}
            bad.update({n.rule: unresolved(n.source) for n in launch.notes if unresolved(n.source)})
            assert not bad, (profile, model, stack)
    assert seen > 0
