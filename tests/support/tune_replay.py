"""The climb search's walk over a measured table (vfleet.fleet.tune_space.next_candidate is a
pure function of the scores): which depths it measures and which it picks. The tune fleet test
compares the climb with the exhaustive search on the table both read, not on speeds measured
minutes apart on a loaded machine."""

from __future__ import annotations

from vfleet.fleet.tune_space import Choice, Dimension, next_candidate


def replay_climb(table: dict[str, float | None], start: int, margin: float) -> tuple[set[str], str]:
    """The climb's walk over a measured table: the depths it measures and the one it picks."""
    dims = [Dimension("depth", tuple(Choice(str(k), ()) for k in range(5)), start, True, "")]
    seen: dict[str, float | None] = {}
    while (c := next_candidate(dims, seen, "climb", margin)) is not None:
        seen[c.key] = table[c.key]
    best = max((v, k) for k, v in seen.items() if v is not None)[1]
    return set(seen), best.removeprefix("depth=")
