"""Write a release folder on the host in one step (standard-library Python).

Reads {"dir": ..., "files": [{"name", "content", "mode"}]} as JSON on stdin (stdin, not
arguments: the env file may hold the API key). A new release is written into a temporary
folder beside it and renamed into place, so a deploy cut short never leaves a half-written
release that a later deploy would take as complete. An existing release (same inputs, same
name) gets any file whose content or mode differs rewritten, each by rename. Prints
"changed" or "ok".
"""

import json
import os
import shutil
import sys
import tempfile


def write(path, content, mode):
    # Created with its final mode: the env file is never readable by others, even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(content)
    os.chmod(path, mode)  # the umask may have narrowed it


def same(path, content, mode):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == content and (os.stat(path).st_mode & 0o7777) == mode
    except OSError:
        return False


def main():
    req = json.load(sys.stdin)
    dest = req["dir"]
    files = [(f["name"], f["content"], int(f["mode"], 8)) for f in req["files"]]
    if os.path.isdir(dest):
        changed = False
        for name, content, mode in files:
            path = os.path.join(dest, name)
            if same(path, content, mode):
                continue
            tmp = os.path.join(dest, f".{name}.tmp-{os.getpid()}")
            write(tmp, content, mode)
            os.replace(tmp, path)
            changed = True
        print("changed" if changed else "ok")
        return
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(dest))
    try:
        for name, content, mode in files:
            write(os.path.join(tmp, name), content, mode)
        os.chmod(tmp, 0o755)
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print("changed")


if __name__ == "__main__":
    main()
