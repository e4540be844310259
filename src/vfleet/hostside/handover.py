"""Give the service user its folders, as root, without ever following a link (standard library).

Run by the role (tasks/install.yml) as root on the host:

    python3 -c "$(cat handover.py)" '{"user": "vfleet", "dirs": [...], "migrate": [...]}'

Each folder in ``dirs`` and ``migrate`` must be a real folder (not a link) whose parent the
service user cannot write (vfleet's base folder is root's): it is opened with O_NOFOLLOW and
handed over with fchown on that descriptor. A folder in ``migrate`` that was not yet the
service user's (a deploy from before the service user left the caches owned by root) is
handed over with everything in it, once: os.fwalk opens every sub-folder relative to its
parent's descriptor and checks that it is the folder it listed, and each entry is chowned
through its folder's descriptor with AT_SYMLINK_NOFOLLOW, so a link the service user plants
(``cache/main/x -> /etc/shadow``, or a folder swapped for a link during the walk) changes at
most the link itself. A file with more than one hard link is left as it is and reported: its
other name may be anywhere. Once the folder is the service user's, later runs walk nothing:
what is inside is the service user's own doing (docs/SECURITY.md, "Privileged steps").

Prints one JSON line: {"changed": [...], "skipped": [...]}; exit 2 with a message on stderr
for a folder that is a link or not a folder.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import sys

FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    pass


def open_folder(path: str) -> int:
    """A descriptor of ``path`` itself: refused if it is a link or not a folder."""
    try:
        return os.open(path, FOLDER_FLAGS)
    except OSError as exc:
        st = os.lstat(path) if os.path.lexists(path) else None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise Refused(
                f"{path} is a symbolic link: vfleet hands over real folders only"
            ) from exc
        raise Refused(f"{path}: {exc.strerror}") from exc


def migrate(fd: int, path: str, uid: int, gid: int) -> tuple[list[str], list[str]]:
    """Everything under the folder open at ``fd`` becomes uid:gid, links themselves included,
    never what they point at. Returns (changed, skipped)."""
    changed: list[str] = []
    skipped: list[str] = []
    # fwalk needs a path; the descriptor pins the folder: walk "." relative to it.
    for folder, subdirs, files, dirfd in os.fwalk(".", dir_fd=fd, follow_symlinks=False):
        for name in subdirs + files:
            where = os.path.normpath(os.path.join(path, folder, name))
            st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            if st.st_uid == uid and st.st_gid == gid:
                continue
            if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
                skipped.append(where)
                continue
            os.chown(name, uid, gid, dir_fd=dirfd, follow_symlinks=False)
            changed.append(where)
    return changed, skipped


def hand_over(user: str, dirs: list[str], recursive: list[str]) -> dict[str, list[str]]:
    pw = pwd.getpwnam(user)
    uid, gid = pw.pw_uid, pw.pw_gid
    changed: list[str] = []
    skipped: list[str] = []
    for path in dirs + recursive:
        fd = open_folder(path)
        try:
            st = os.fstat(fd)
            if path in recursive and (st.st_uid, st.st_gid) != (uid, gid):
                more, left = migrate(fd, path, uid, gid)
                changed += more
                skipped += left
            if (st.st_uid, st.st_gid) != (uid, gid):
                os.fchown(fd, uid, gid)
                changed.append(path)
        finally:
            os.close(fd)
    return {"changed": changed, "skipped": skipped}


def main(argv: list[str]) -> int:
    req = json.loads(argv[1])
    try:
        result = hand_over(str(req["user"]), list(req["dirs"]), list(req.get("migrate", [])))
    except Refused as exc:
        print(f"handover: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
