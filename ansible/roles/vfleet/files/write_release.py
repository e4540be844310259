"""Write a release folder on the host in one step (standard-library Python).

Reads {"dir": ..., "files": [{"name", "content", "mode"}]} as JSON on stdin (stdin, not
arguments: the env file may hold the API key). A new release is written into a temporary
folder beside it, synced, and renamed into place, so a deploy cut short never leaves a
half-written release that a later deploy would take as complete; temporary folders that an
interrupted run left behind are removed first. An existing release (same inputs, same name)
gets any file whose content or mode differs rewritten, each by rename. Prints "changed" or
"ok"; on failure, one line on stderr that holds no file content (the task hides its output).

Secrets are per instance, not per release: the release id is taken over the files without
their values, so a new API key keeps the release and rewrites its env file. With "secrets":
{"file": "vllm.env", "keys": [...]}, every other release of the instance then gets those
lines of its env file replaced by the new release's (or removed where it has none), so no
release on disk keeps a replaced key and a rollback keeps the current one.
"""

import json
import os
import shutil
import sys
import tempfile


def write(path, content, mode):
    # Created with its final mode: the env file is never readable by others, even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8", newline="") as out:
        out.write(content)
        out.flush()
        os.fsync(out.fileno())
    os.chmod(path, mode)  # the umask may have narrowed it


def same(path, content, mode):
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read() == content and (os.stat(path).st_mode & 0o7777) == mode
    except (OSError, ValueError):  # missing, unreadable, or not UTF-8: rewrite it
        return False


def replace(path, content, mode):
    """Rewrite `path` by rename: readers see the old file or the new, never a part."""
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=folder)
    os.close(fd)
    os.unlink(tmp)  # write() creates it again with the file's own mode
    write(tmp, content, mode)
    os.replace(tmp, path)


def secret_lines(text, keys):
    return {k: line for line in text.splitlines() for k in keys if line.startswith(k + "=")}


def sync_secrets(dest, secrets, files):
    """Give every other release of the instance the new release's secret lines."""
    name, keys = secrets["file"], secrets["keys"]
    current = secret_lines(next((c for n, c, _ in files if n == name), ""), keys)
    parent = os.path.dirname(dest)
    changed = False
    for other in sorted(os.listdir(parent)):
        path = os.path.join(parent, other, name)
        if other.startswith(".") or other == os.path.basename(dest) or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", newline="") as f:
            old = f.read()
        lines = []
        for line in old.splitlines(keepends=True):
            key = next((k for k in keys if line.startswith(k + "=")), None)
            if key is None:
                lines.append(line)
            elif key in current:
                lines.append(current[key] + "\n")
        new = "".join(lines)
        if new != old:
            replace(path, new, 0o600)
            changed = True
    return changed


def sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main():
    req = json.load(sys.stdin)
    dest = req["dir"]
    parent = os.path.dirname(dest)
    files = [(f["name"], f["content"], int(f["mode"], 8)) for f in req["files"]]
    changed = write_release(dest, parent, files)
    if req.get("secrets") and sync_secrets(dest, req["secrets"], files):
        changed = True
    print("changed" if changed else "ok")


def write_release(dest, parent, files):
    if os.path.isdir(dest):
        changed = False
        for name, content, mode in files:
            path = os.path.join(dest, name)
            if same(path, content, mode):
                continue
            replace(path, content, mode)
            changed = True
        if changed:
            sync_dir(dest)
        return changed
    for old in os.listdir(parent):
        if old.startswith(".tmp-"):  # left by a run that was killed
            shutil.rmtree(os.path.join(parent, old), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        for name, content, mode in files:
            write(os.path.join(tmp, name), content, mode)
        os.chmod(tmp, 0o755)
        sync_dir(tmp)
        os.rename(tmp, dest)
        sync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


if __name__ == "__main__":
    try:
        main()
    except Exception as exc:  # noqa: BLE001 - the reason, never the content
        if isinstance(exc, OSError):
            why = f"{exc.strerror} ({exc.filename})" if exc.filename else str(exc.strerror)
        else:
            why = "bad request (not the JSON the role sends)"
        print(f"{type(exc).__name__}: {why}", file=sys.stderr)
        sys.exit(1)
