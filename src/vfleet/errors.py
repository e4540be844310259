"""Errors an operator can act on. Each names where the problem is and how to fix it."""

from __future__ import annotations


class VfleetError(Exception):
    """Bad input or an impossible configuration. The CLI prints it and exits 2."""

    exit_code = 2

    def __init__(
        self,
        message: str,
        *,
        where: str | None = None,
        key: str | None = None,
        fix: str | None = None,
    ) -> None:
        self.message = message
        self.where = where
        self.key = key
        self.fix = fix
        super().__init__(self.render())

    def render(self) -> str:
        head = "error"
        if self.where:
            head += f": {self.where}"
        if self.key:
            head += f": {self.key}"
        text = f"{head}: {self.message}"
        if self.fix:
            text += f"\n  fix: {self.fix}"
        return text


class Refused(VfleetError):
    """A rule refused a known-bad combination."""

    def __init__(self, rule: str, message: str, fix: str, source: str) -> None:
        self.rule = rule
        self.source = source
        super().__init__(f"{message} [source: {source}]", where=f"rule {rule}", fix=fix)
