"""Hostile values round-trip through each target's real consumer (issue 22, finding 1).

The grammars (config.py) refuse these at load; the escaping helpers (src/vfleet/config/escape.py)
are
the second line and are checked here on their own: sh reads back every word, node every string
of the ecosystem file, systemd-analyze verify accepts a unit holding every word without adding
a directive. systemd's own reading of each argument is checked where systemd runs (the fleet
host,
tests/integration/test_fleet_hosts.py::test_services_run_unprivileged_and_units_read_back_exactly).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.cases import HOSTILE
from vfleet.config.escape import (
    js_literal,
    one_line,
    shell_word,
    systemd_command,
    systemd_path,
    systemd_value,
    systemd_word,
)
from vfleet.errors import VfleetError
from vfleet.render.release import unit_directives


def test_sh_reads_back_every_word(tmp_path: Path) -> None:
    script = tmp_path / "words.sh"
    script.write_text(
        "for w in "
        + " ".join(shell_word(v) for v in HOSTILE)
        + "; do printf '%s\\0' \"$w\"; done\n"
    )
    out = subprocess.run(["sh", str(script)], capture_output=True, check=True, cwd=tmp_path)
    assert out.stdout.decode().split("\0")[:-1] == HOSTILE
    assert not (tmp_path / "pwned").exists()


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed (pm2 needs it)")
def test_node_reads_back_every_string(tmp_path: Path) -> None:
    eco = tmp_path / "ecosystem.config.js"
    value = {"apps": [{"name": v, "args": HOSTILE} for v in HOSTILE]}
    eco.write_text(f"module.exports = {js_literal(value)};\n")
    out = subprocess.run(
        ["node", "-e", f"process.stdout.write(JSON.stringify(require({json.dumps(str(eco))})))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(out.stdout) == value


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_accepts_every_word_as_one_argument(tmp_path: Path) -> None:
    # verify parses the line (specifiers, quotes, C escapes) and checks that the program
    # exists: a program path holding `%` is found only if `%%` came back as `%`.
    program = tmp_path / "bin%n" / "prog"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    unit = tmp_path / "roundtrip.service"
    unit.write_text(
        "[Service]\nType=exec\n"
        f"ExecStart={systemd_command([str(program), *HOSTILE])}\n"
        f"WorkingDirectory={systemd_path(str(tmp_path / 'w%i'))}\n"
        f"Environment=X={systemd_value('pct%n')}\n"
    )
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"),
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout + proc.stderr == "", proc.stderr
    text = unit.read_text()
    assert unit_directives(text) == [
        "Service/Type",
        "Service/ExecStart",
        "Service/WorkingDirectory",
        "Service/Environment",
    ]
    assert text.count("\n") == 5


def test_plain_words_stay_readable() -> None:
    assert systemd_word("--listen") == "--listen"
    assert systemd_word("127.0.0.1:9500") == "127.0.0.1:9500"
    assert systemd_word("a b") == '"a b"'
    assert systemd_word("5%$") == '"5%%$$"'
    assert systemd_word("l\nx") == '"l\\x0ax"'


@pytest.mark.parametrize("value", ["new\nline", "trail\\", " lead", "cr\r", "nul\0"], ids=repr)
def test_a_one_line_setting_refuses_what_it_cannot_hold(value: str) -> None:
    with pytest.raises(VfleetError) as err:
        systemd_value(value, key="host")
    assert err.value.key == "host" and err.value.fix


@pytest.mark.parametrize("value", ["relative/x", "/a b", "/a'b", '/a"b', "/a\\b"], ids=repr)
def test_a_unit_path_is_absolute_and_plain(value: str) -> None:
    with pytest.raises(VfleetError):
        systemd_path(value, key="base_dir")


def test_a_program_with_a_dollar_is_refused() -> None:
    with pytest.raises(VfleetError):
        systemd_command(["/opt/$x/bin/prog"])


@pytest.mark.parametrize("value", ["a\nrm -rf /", "a\rb", "js\u2028code", "js\u2029code"], ids=repr)
def test_a_comment_refuses_a_line_end(value: str) -> None:
    # Comments in launch.sh, vllm.env, the units and ecosystem.config.js hold names: a line end
    # there would start a command (sh), a directive (systemd) or code (JavaScript).
    with pytest.raises(VfleetError):
        one_line(value, key="instance")
    assert one_line("main (tiny-hybrid-mtp on cpu)") == "main (tiny-hybrid-mtp on cpu)"
