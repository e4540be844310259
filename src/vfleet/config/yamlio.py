"""Reading operator YAML safely: a loader that refuses duplicate keys and aliases, and files that
are not small UTF-8 text.

Profiles, presets and deployment files are short hand-written data: an alias there is almost
always a paste accident, and a few hundred bytes of nested aliases expand into gigabytes (a
"billion laughs" file ran `vfleet render` past 60 s and 1.6 GB). A duplicate key silently kept
the last value. Both are refused with the line to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from vfleet.errors import VfleetError

# Far above any profile or deployment file (the largest is ~4 KB); a cap on what is parsed.
MAX_BYTES = 1 << 20


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader without aliases, and with duplicate mapping keys refused."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.constructor.ConstructorError(
                None, None, "aliases (*name) are not accepted in vfleet files", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: SafeLoader reports it below
                duplicate = False
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def loads(text: str, where: str) -> Any:
    """Parse YAML text; a VfleetError naming `where`, the line and a fix on anything wrong."""
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark else where
        problem = getattr(exc, "problem", None) or str(exc)
        if "duplicate key" in problem:
            fix = "keep one of the two entries (YAML would silently keep the last)"
        elif "aliases" in problem:
            fix = "write the value out instead of referring to an anchor"
        else:
            fix = "correct the YAML syntax at that line"
        raise VfleetError(f"malformed YAML: {problem}", where=at, fix=fix) from None


def read(path: Path) -> Any:
    """Read a small UTF-8 YAML file (profiles, presets, deployment files)."""
    try:
        if path.is_dir():
            raise VfleetError(
                "is a folder, not a YAML file", where=str(path), fix="name the .yaml file itself"
            )
        if path.stat().st_size > MAX_BYTES:
            raise VfleetError(
                f"larger than {MAX_BYTES // 1024} KiB: not a vfleet YAML file",
                where=str(path),
                fix="check the path",
            )
        raw = path.read_bytes()
    except FileNotFoundError:
        raise VfleetError("file not found", where=str(path), fix="check the path") from None
    except OSError as exc:
        raise VfleetError(f"cannot read it: {exc.strerror}", where=str(path)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise VfleetError(
            f"not UTF-8 text (byte {exc.start})", where=str(path), fix="check the path"
        ) from None
    if "\x00" in text:
        raise VfleetError("a binary file, not YAML", where=str(path), fix="check the path")
    return loads(text, str(path))
