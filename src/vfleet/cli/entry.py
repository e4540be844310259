"""The `vfleet` console script: says what is missing before the command line's imports fail.

vfleet's companion packages live beside it in this repository and are not on PyPI, so they are
not in its dependencies: `pip install -e .` alone gave a `vfleet` that died with "No module named
'vfleet_healthcheck'" (issue 31, the GPU lane as a new user meets it). `make venv` installs all
three.
"""

from __future__ import annotations

import importlib.util
import sys

# Import name -> the repository folder that installs it.
COMPANIONS = {"vfleet_healthcheck": "./healthcheck", "vfleet_sm75": "./plugin"}


def missing() -> list[str]:
    return [name for name in COMPANIONS if importlib.util.find_spec(name) is None]


def main() -> int:
    gone = missing()
    if gone:
        folders = " ".join(f"-e {COMPANIONS[n]}" for n in gone)
        print(
            f"error: vfleet's companion package{'s' if len(gone) > 1 else ''} "
            f"{', '.join(gone)} {'are' if len(gone) > 1 else 'is'} not installed beside it\n"
            # pip first: `make venv` skips a .venv newer than the pyprojects (one the user
            # made with `pip install -e .`), so it would not add what is missing.
            f"  fix: from the repository, pip install {folders} "
            f"(or make venv where no .venv exists yet: it installs all three)",
            file=sys.stderr,
        )
        return 2
    from vfleet.cli.main import main as run

    return run()


if __name__ == "__main__":
    raise SystemExit(main())
