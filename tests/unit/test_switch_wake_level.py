"""`vfleet switch` wakes a sleeper from the level it went to sleep at, not the inventory's now."""

from __future__ import annotations

import sys

from vfleet.fleet import switch


def test_a_sleeper_is_woken_from_the_level_it_slept_at() -> None:
    """The inventory's sleep_level may change while an instance sleeps; switch.json has the
    level it went to sleep at (a level 2 sleeper needs reload_weights at its wake)."""
    r = switch.Replica("b", {}, sys.executable, 1, "chat", 1, None, plugin_state="/s.json")
    assert r.wake_level({"state": "asleep", "level": 2}) == 2
    assert r.state_args(r.wake_level({"state": "asleep", "level": 2})) == [
        "--plugin-state",
        "/s.json",
    ]
    assert r.wake_level({"state": "serving", "level": 2}) == 1  # not asleep: the inventory's
    assert r.wake_level({}) == 1  # nothing recorded (never went through standby or a switch)
    assert r.state_args() == []
