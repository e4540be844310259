"""The API key, read from a file on the control machine (`make deploy API_KEY_FILE=...`).

A key given on a command line (`SET='api_key=...'`, `--set api_key=...`) is readable by every
local user in /proc/<pid>/cmdline for as long as the command runs, is echoed by make, and
reached pm2's stored environment through MAKEFLAGS. A file keeps it out of every argv: only
its path travels; the key itself is read here, in the process that renders the env file.
"""

from __future__ import annotations

import os
import stat

from vfleet.errors import VfleetError

KEY = "API_KEY_FILE (vfleet_api_key_file)"
WHY = "an API key on a command line is readable by every local user (ps) while the command runs"


def refuse_key_in_sets(sets: list[str], fix: str) -> None:
    """Exit 2 on `--set api_key=...`: the key must not be in any argv (docs/SECURITY.md)."""
    if any(s.split("=", 1)[0].strip() == "api_key" for s in sets):
        raise VfleetError(WHY, key="--set api_key", fix=fix)


def read_api_key_file(path: str) -> str:
    """The key held in `path`: one line, the file readable by its owner only (like ssh's keys)."""
    fix_mode = f"chmod 600 {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise VfleetError(
            f"cannot read the API key file: {exc.strerror}",
            where=path,
            key=KEY,
            fix="name a regular file holding the key on one line (printf %s KEY > FILE; "
            f"{fix_mode})",
        ) from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise VfleetError(
                "not a regular file", where=path, key=KEY, fix="name the file holding the key"
            )
        if st.st_mode & 0o077:
            raise VfleetError(
                f"other users may read or change it (mode {stat.S_IMODE(st.st_mode):04o})",
                where=path,
                key=KEY,
                fix=fix_mode,
            )
        raw = fh.read(64 * 1024 + 1)
    # Never the content in a message: it is the secret.
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "\0"
    key = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if len(raw) > 64 * 1024 or not key or not key.isprintable() or key != key.strip():
        raise VfleetError(
            "the file must hold the key alone on one line (printable UTF-8, no surrounding "
            "spaces, at most 64 KiB)",
            where=path,
            key=KEY,
            fix=f"printf %s KEY > {path} (one line; a final newline is allowed)",
        )
    return key
