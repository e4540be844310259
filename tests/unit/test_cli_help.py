"""`--help` works for every command and subcommand (a `%` in a help string once crashed
`vfleet swap --help` with a traceback: argparse formats help strings with `%`)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from vfleet.cli.main import build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path in the parser tree, e.g. ("model", "make")."""
    found = [path]
    for action in parser._actions:  # argparse has no public API for its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*path, name))
    return found


COMMANDS = _commands(build_parser())


def test_the_tree_is_walked() -> None:
    # Guards the walk itself: it must reach nested subcommands, or the test below proves little.
    assert ("swap",) in COMMANDS
    assert ("model", "make") in COMMANDS
    assert len(COMMANDS) > 20


@pytest.mark.parametrize("path", COMMANDS, ids=lambda p: " ".join(p) or "vfleet")
def test_help_prints(path: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*path, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vfleet")
    assert "Traceback" not in out


def test_swap_help_in_a_real_process() -> None:
    # The console entry point, as an operator types it.
    proc = subprocess.run(
        [sys.executable, "-m", "vfleet.cli.main", "swap", "--help"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--serial" in proc.stdout and "1,50%" in proc.stdout
