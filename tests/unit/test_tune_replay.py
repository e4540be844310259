"""The tune fleet test's comparison of the climb with the exhaustive search, on the measured
table both read (tests/support/tune_replay.py), against the tables of docs/TUNE.md's runs and the
CI failure of issue 30, where the climb picked depth 2 and the exhaustive search, measuring the
depths the climb had left out minutes later on a loaded machine, picked depth 0."""

from __future__ import annotations

import pytest

from tests.support.tune_replay import replay_climb


def table(*speeds: float) -> dict[str, float | None]:
    return {f"depth={k}": v for k, v in enumerate(speeds)}


@pytest.mark.parametrize(
    ("speeds", "visited", "pick"),
    [
        # docs/TUNE.md runs 4c, 4d and 5 (decode tok/s at c1), node1 running depth 3, margin 0.1.
        ((108.0, 117.3, 110.3, 137.5, 111.7), {2, 3, 4}, "3"),
        ((182.4, 168.1, 102.3, 111.7, 112.2), {0, 1, 2, 3}, "0"),
        ((154.9, 179.7, 220.0, 179.4, 110.6), {1, 2, 3}, "2"),
    ],
)
def test_the_replay_walks_as_the_recorded_climbs_did(
    speeds: tuple[float, ...], visited: set[int], pick: str
) -> None:
    seen, best = replay_climb(table(*speeds), start=3, margin=0.1)
    assert seen == {f"depth={k}" for k in visited} and best == pick


def test_a_left_out_depth_that_won_later_is_the_loads_call_not_a_defect() -> None:
    """Issue 30's failure, in kind: the climb measured 3, 2, 1 and stopped at 1 (more than the
    margin below 2); depth 0, measured later by the exhaustive run under more or less load,
    came out best. The old assertion (same winner) failed; the new one holds: the climb
    followed its rule on what it measured, and the exhaustive winner is a depth it left out."""
    t = table(230.0, 150.0, 200.0, 160.0, 120.0)
    climb_keys, climb_pick = replay_climb(t, start=3, margin=0.1)
    grid_pick = max((v, k) for k, v in t.items() if v is not None)[1].removeprefix("depth=")
    assert (climb_pick, grid_pick) == ("2", "0")  # the old assertion: climb == grid, fails
    assert "depth=0" not in climb_keys  # the new one: the winner was left out by the rule
