"""One escaping helper per target a rendered value is written into.

The grammars in config/schema.py refuse hostile values at load; these helpers are the second line:
whatever reaches a template is written so that its consumer reads back exactly that value,
or refused with an error naming the setting. The consumers themselves check the round trip
(tests/unit/test_units.py): systemd-analyze and systemctl for units, sh for scripts, node for
the pm2 ecosystem file. The env file's helper is render.shell_quote_env (systemd's
EnvironmentFile= and sh must read it the same).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Sequence
from typing import Any

from vfleet.config.schema import HOST_NAME_PATTERN
from vfleet.errors import VfleetError

_CONTROL = {chr(c) for c in range(32)} | {"\x7f"}
# Characters that mean nothing to systemd's word splitting, specifiers or $ substitution.
_PLAIN = re.compile(r"[A-Za-z0-9/_.,:+=@-]+")


def _refuse(key: str, value: str, what: str, fix: str) -> VfleetError:
    return VfleetError(f"{value!r} {what}", key=key, fix=fix)


def host_name(value: str, where: str | None = None) -> str:
    """An inventory host name, checked before it becomes a path component (a report, tune's
    folder, host_vars/<host>/) or a label: Ansible accepts `../../..` as a host name.

    HOST_NAME_PATTERN starts with a letter or digit and has no `/`, so neither `.`, `..` nor
    a path can pass."""
    if re.fullmatch(HOST_NAME_PATTERN, value) is None:
        raise VfleetError(
            f"host name {value!r} is not a plain inventory host name (letters, digits and "
            ". _ -, starting with a letter or digit)",
            where=where,
            key="host",
            fix="rename the host in the inventory (ansible_host keeps its address), e.g. node1",
        )
    return value


def one_line(value: str, key: str = "comment") -> str:
    """A value inside a comment of any rendered file: a line end would end the comment.

    U+2028 and U+2029 end a line for JavaScript too.
    """
    if any(c in _CONTROL or c in "\u2028\u2029" for c in value):
        raise _refuse(key, value, "holds a line end or control character", "use one plain line")
    return value


def systemd_value(value: str, key: str = "unit value") -> str:
    """A one-line unit setting (Description=, a path): `%` doubled, so no specifier expands.

    A newline would start a new directive and a trailing backslash would join the next line:
    both are refused, as is anything systemd would strip (leading or trailing whitespace).
    """
    if any(c in _CONTROL for c in value) or value.endswith("\\") or value != value.strip():
        raise _refuse(
            key,
            value,
            "cannot be one systemd setting (a control character, a trailing backslash or "
            "leading/trailing space)",
            "use a value without newlines, control characters or edge spaces",
        )
    return value.replace("%", "%%")


def systemd_path(value: str, key: str = "unit path") -> str:
    """An absolute path in a unit (WorkingDirectory=, append:, ReadWritePaths= items)."""
    if not value.startswith("/") or any(c in value for c in " \t\"'\\"):
        raise _refuse(
            key,
            value,
            "is not an absolute path without spaces, quotes or backslashes",
            "use an absolute path such as /opt/vfleet",
        )
    return systemd_value(value, key)


def systemd_word(value: str) -> str:
    """One argument of ExecStart=: double-quoted with C escapes; `%` and `$` doubled.

    systemd expands specifiers on the whole line first (`%%` -> `%`), then splits it into
    words (quotes and C escapes such as \\n), then substitutes $VAR in each word (`$$` -> `$`).
    A word of plain characters stays bare (readable); any other is quoted, which also keeps
    a lone `;` an argument instead of a command separator.
    """
    if _PLAIN.fullmatch(value):
        return value
    out = []
    for c in value:
        if c in ('"', "\\"):
            out.append("\\" + c)
        elif c in _CONTROL:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return '"' + "".join(out).replace("%", "%%").replace("$", "$$") + '"'


def systemd_command(argv: Sequence[str], key: str = "command") -> str:
    """An Exec*= command line: the program as a path, each argument as a systemd_word."""
    if not argv:
        raise _refuse(key, "", "is an empty command", "name the program to run")
    program = argv[0]
    # No $ in the program: systemd does not substitute variables there, so `$$` would stay.
    if "$" in program:
        raise _refuse(key, program, "contains $", "install the program under a path without $")
    systemd_path(program, key)  # checked only: systemd_word escapes it
    return " ".join([systemd_word(program), *(systemd_word(a) for a in argv[1:])])


def shell_word(value: str) -> str:
    """One word of a POSIX sh script (launch.sh): single-quoted unless plainly safe."""
    return shlex.quote(value)


def js_literal(value: Any) -> str:
    """A JavaScript expression for a JSON-able value (ecosystem.config.js).

    JSON is a subset of JavaScript since ES2019; ensure_ascii also escapes U+2028 and U+2029,
    which older engines read as line ends inside strings.
    """
    return json.dumps(value, indent=2, ensure_ascii=True)


# Characters nginx's configuration parser reads as part of one bare word: no ; { } quotes,
# $ (variables), # (comments) or whitespace.
_NGINX_WORD = re.compile(r"[A-Za-z0-9/_.:\[\]+-]+")


def nginx_word(value: str | int, key: str = "nginx value") -> str:
    """One bare word of an nginx configuration (a path, an address, a port)."""
    text = str(value)
    if not _NGINX_WORD.fullmatch(text):
        raise _refuse(
            key,
            text,
            "cannot be one word of an nginx configuration",
            "use letters, digits and / _ . : + - only",
        )
    return text
