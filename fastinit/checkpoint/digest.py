"""Checksums of checkpoint bytes: xxHash's XXH3-128, about 30 GB/s on one core here.

Every file a checkpoint names and every data item in it carries one: a save computes them as it
writes (a file's digest from the stream it writes, an item's from its staged bytes), a load
verifies the items it reads (:class:`Hasher` in chunks as they arrive, so the hash runs on bytes
still in cache). A digest is the 32-character hex of the 128-bit hash; in the commit exchange
it travels as its 16 raw bytes.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["Hasher", "digest", "file_digest", "DIGEST_BYTES"]

#: Raw size of a digest (the hex form is twice as long).
DIGEST_BYTES = 16
_CHUNK = 16 << 20


def _xxh3() -> Any:
    import xxhash

    return xxhash.xxh3_128()


class Hasher:
    """An incremental digest: ``update`` with chunks, ``hexdigest`` at the end."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = _xxh3()

    def update(self, data: Any) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return str(self._h.hexdigest())


def digest(data: Any) -> str:
    """The digest of a bytes-like object (bytes, memoryview, a numpy array's buffer)."""
    h = Hasher()
    h.update(data)
    return h.hexdigest()


def file_digest(path: str) -> tuple[int, str]:
    """``(size, digest)`` of a file, read in chunks."""
    h = Hasher()
    size = 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def fsync_dir(path: str) -> None:
    """``fsync`` a directory (its new entries durable); errors are ignored."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
