"""Files the compile cache and the CPU vector-ISA record keep: owner-only directories, atomic
writes, and what makes a file unsafe to load from (both hold code or answers a process acts on)."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

__all__: list[str] = []


def private_dir(path: str) -> None:
    """Create ``path`` (and missing parents) owner-only; tighten it if it exists and is ours
    (where it can be: a directory on a read-only filesystem keeps its mode)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)


def writable(path: str) -> bool:
    """A file can be created in the directory ``path`` (probed: on a read-only mount, or a
    directory without write permission, ``os.access`` and the mode bits can disagree with what a
    write does, e.g. for root)."""
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return True


def nonempty(path: str) -> bool:
    """``path`` is a directory with at least one entry (the iterator is closed)."""
    try:
        with os.scandir(path) as entries:
            return any(True for _ in entries)
    except (FileNotFoundError, NotADirectoryError):
        return False


def untrusted(path: str) -> str | None:
    """Why ``path`` must not be loaded from (another owner, writable by others), or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None

    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link"
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {oct(st.st_mode & 0o777)})"
    return None


def atomic_write(path: str, data: bytes) -> None:
    directory = os.path.dirname(path)
    private_dir(directory)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
