"""The role's hand-over of the service user's folders (src/vfleet/hostside/handover.py), run as
the role runs it (python3 -c with a JSON request) as root, with `nobody` standing in for the
service user. The links are planted as the red team planted them: in the service user's own
cache, pointing at root's files. (The end-to-end deploy plants them as the real service user
before its second deploy: tests/integration/test_e2e_deploy.py.)"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "ansible" / "roles" / "vfleet" / "files" / "handover.py"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


def run(user: str, dirs: list[Path], migrate: list[Path]) -> subprocess.CompletedProcess[str]:
    req = {"user": user, "dirs": [str(d) for d in dirs], "migrate": [str(d) for d in migrate]}
    return subprocess.run(
        [sys.executable, "-c", SCRIPT.read_text(), json.dumps(req)],
        capture_output=True,
        text=True,
        check=False,
    )


def owner(path: Path) -> tuple[int, int, int]:
    st = path.lstat()
    return st.st_uid, st.st_gid, st.st_mode & 0o7777


@pytest.fixture
def host() -> Iterator[dict[str, Path]]:
    """A base folder as root leaves it (root's, 0755), a cache from before the service user
    (root's), and root's secrets outside it. Not under pytest's tmp: its 0700 folder would keep
    the stand-in service user out."""
    tmp_path = Path(tempfile.mkdtemp(prefix="vfleet-handover-", dir="/var/tmp"))
    tmp_path.chmod(0o755)
    base = tmp_path / "base"
    secret = tmp_path / "etc" / "shadow"
    secret.parent.mkdir()
    secret.write_text("root:x\n")
    secret.chmod(0o600)
    secret_dir = tmp_path / "etc" / "private"
    secret_dir.mkdir()
    (secret_dir / "key").write_text("k\n")
    cache, home, state = base / "cache" / "main", base / "home", base / "state"
    for d in (cache / "torch" / "inductor", home, state):
        d.mkdir(parents=True)
    (cache / "torch" / "inductor" / "kernel.so").write_bytes(b"\0" * 16)
    # Links inside a cache from an older deploy: the hand-over must change them, not their targets.
    (cache / "x").symlink_to(secret)
    (cache / "d").symlink_to(secret_dir)
    yield {"base": base, "cache": cache, "home": home, "state": state, "secret": secret,
           "secret_dir": secret_dir}  # fmt: skip
    shutil.rmtree(tmp_path)


def test_migration_hands_over_the_cache_but_never_what_a_link_names(host: dict[str, Path]) -> None:
    nobody = pwd.getpwnam("nobody")
    before = {p: owner(p) for p in (host["secret"], host["secret_dir"], host["secret_dir"] / "key")}
    r = run("nobody", [host["home"], host["state"]], [host["cache"]])
    assert r.returncode == 0, r.stderr
    changed = json.loads(r.stdout)["changed"]
    ids = (nobody.pw_uid, nobody.pw_gid)
    for p in (host["home"], host["state"], host["cache"], host["cache"] / "torch",
              host["cache"] / "torch" / "inductor" / "kernel.so"):  # fmt: skip
        assert owner(p)[:2] == ids, p
        assert str(p) in changed
    # The links themselves became the service user's (lchown), their targets did not.
    assert owner(host["cache"] / "x")[:2] == ids and owner(host["cache"] / "d")[:2] == ids
    assert {p: owner(p) for p in before} == before
    # Idempotent: a second run changes nothing.
    again = run("nobody", [host["home"], host["state"]], [host["cache"]])
    assert again.returncode == 0 and json.loads(again.stdout)["changed"] == [], again.stdout


def test_a_link_planted_after_the_migration_is_never_walked(host: dict[str, Path]) -> None:
    assert run("nobody", [], [host["cache"]]).returncode == 0
    # The service user plants a link to root's file (it owns the cache now): the next deploy's
    # hand-over sees a cache that is already the service user's and walks nothing.
    nobody = pwd.getpwnam("nobody")
    planted = host["cache"] / "planted"
    subprocess.run(
        ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
         "ln", "-s", str(host["secret"]), str(planted)],
        check=True,
    )  # fmt: skip
    root_file = host["cache"] / "torch" / "root-made"
    root_file.write_text("")  # even a root-owned file inside: not the hand-over's business
    r = run("nobody", [], [host["cache"]])
    assert r.returncode == 0 and json.loads(r.stdout)["changed"] == [], r.stdout
    assert owner(host["secret"]) == (0, 0, 0o600)
    assert owner(root_file)[:2] == (0, 0)


def test_a_folder_that_is_a_link_is_refused_and_its_target_untouched(
    host: dict[str, Path],
) -> None:
    host["state"].rmdir()
    host["state"].symlink_to(host["secret_dir"])
    r = run("nobody", [host["state"]], [])
    assert r.returncode == 2
    assert "is a symbolic link" in r.stderr and str(host["state"]) in r.stderr
    assert "Traceback" not in r.stderr
    assert owner(host["secret_dir"])[:2] == (0, 0)
    # The cache as a link to root's folder: refused too, nothing inside it walked.
    cache = host["cache"]
    os.rename(cache, cache.with_name("old"))
    cache.symlink_to(host["secret_dir"])
    r = run("nobody", [], [cache])
    assert r.returncode == 2 and "is a symbolic link" in r.stderr
    assert owner(host["secret_dir"] / "key")[:2] == (0, 0)


def test_a_hard_linked_file_is_left_to_its_owner_and_reported(host: dict[str, Path]) -> None:
    # Another name of the same file may be anywhere (protected_hardlinks stops the service
    # user from making one to root's files, but an older deploy's own may exist).
    other = host["base"] / "elsewhere"
    os.link(host["cache"] / "torch" / "inductor" / "kernel.so", other)
    r = run("nobody", [], [host["cache"]])
    assert r.returncode == 0
    assert json.loads(r.stdout)["skipped"] == [str(host["cache"] / "torch/inductor/kernel.so")]
    assert owner(other)[:2] == (0, 0)
