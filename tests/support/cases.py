"""Test data that more than one test module uses (a test module imports no other test module).

HOSTILE: values that break naive escaping, round-tripped by tests/unit/test_escape.py through
each consumer here and by tests/integration/test_fleet_hosts.py through systemd on a host.
COMBOS: the profile x model pairs that tests/unit/test_rules.py and test_units.py render.
"""

from __future__ import annotations

# Each one breaks a naive template somewhere: word splitting, specifiers (%n), $ substitution,
# quotes, C escapes, a newline (a new directive or command), a lone `;` (systemd's old command
# separator), a trailing backslash (a continuation line), line separators JS engines disagree on.
HOSTILE = [
    "a b",
    ";",
    "x; touch /tmp/pwned",
    "pct%n%%i",
    "dollar$HOME${X}$$",
    'dq"',
    "sq'",
    "back\\slash",
    "trail\\",
    "new\nExecStartPre=/bin/touch /tmp/pwned",
    "tab\tcr\r",
    "`id` $(id)",
    "*glob?[x]",
    "-dash",
    "unicode é ✓ \u2028\u2029",
    "",
]

# The profile x model pairs the rules are checked on: the CPU reference and the seeds' hardware.
COMBOS = [
    ("cpu", "tiny-dense"),
    ("cpu", "tiny-hybrid-mtp"),
    ("2x2080ti-22g", "qwen3.8-27b-awq-mtp"),
    ("2x2080ti-22g", "qwen3.6-27b-fp8"),
    ("4x2080ti-22g", "qwen3.6-27b-awq-int4"),
    ("a100-32g", "qwen3.8-27b-awq-mtp"),
]
