"""The `vfleet` console script without its companion packages: a clear error and exit 2, not
a traceback (`pip install -e .` alone, as a new user did on the GPU lane)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vfleet.cli import entry

HIDE = "import sys; [sys.modules.__setitem__(n, None) for n in {names!r}]; "
RUN = "from vfleet.cli.entry import main; raise SystemExit(main())"


@pytest.mark.parametrize("names", [["vfleet_healthcheck"], ["vfleet_healthcheck", "vfleet_sm75"]])
def test_a_missing_companion_is_named_with_its_fix(names: list[str]) -> None:
    code = HIDE.format(names=names) + RUN
    r = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, check=False
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{', '.join(names)} {'are' if len(names) > 1 else 'is'} not installed" in r.stderr
    assert "fix: from the repository, pip install -e ./healthcheck" in r.stderr, r.stderr
    assert "make venv" in r.stderr, r.stderr


def test_with_them_it_runs_the_command_line() -> None:
    assert entry.missing() == []
    r = subprocess.run(
        [sys.executable, "-c", RUN, "--version"], capture_output=True, text=True, check=False
    )
    assert r.returncode == 0 and r.stdout.strip(), r.stdout + r.stderr
