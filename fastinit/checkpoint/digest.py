"""Checksums of checkpoint bytes: xxHash's XXH3-128, about 30 GB/s on one core here.

Every file a checkpoint names and every data item in it carries one: a save computes them as it
writes (a file's digest from the stream it writes, an item's from its staged bytes), a load
verifies the items it reads (:class:`Hasher` in chunks as they arrive, so the hash runs on bytes
still in cache). A digest is the 32-character hex of the 128-bit hash; in the commit exchange
it travels as its 16 raw bytes.
"""

from __future__ import annotations

import io
import os
import time
from typing import Any

__all__ = ["Hasher", "digest", "file_digest", "HashingWriter", "DIGEST_BYTES"]

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


class HashingWriter(io.RawIOBase):
    """A writable binary stream that hashes what passes through it to ``raw``."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.hasher = Hasher()
        self.size = 0
        self.hash_s = 0.0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        t = time.perf_counter()
        self.hasher.update(b)
        self.hash_s += time.perf_counter() - t
        n = self.raw.write(b)
        n = len(memoryview(b).cast("B")) if n is None else n
        self.size += n
        return n

    def tell(self) -> int:
        return int(self.raw.tell())

    def seekable(self) -> bool:
        return False

    def fileno(self) -> int:
        return int(self.raw.fileno())

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if self.closed:
            return
        super().close()  # flushes first
        self.raw.close()


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
