"""A directory of sharding plans, content-addressed by the planner fingerprint.

One file per key, named ``<hex of key>.fiplan``::

    b"FIPCACHE" | uint16 format version | uint16 key length | key
                | sha256 of the payload (32 bytes) | uint64 payload length | payload

where the payload is :func:`fastinit.sharding.codec.encode_plan`'s bytes. Entries are written to a
temporary file in the same directory and moved into place with ``os.replace``, so a reader sees a
whole entry or none, however many processes write the same key at once. A corrupt, truncated or
foreign entry is ignored with a :class:`FastinitCacheWarning` and replaced by the next ``put``.
The cache only ever replaces files named like its own entries, and deletes only its own
temporaries (``.<16 hex digits>.<random>.tmp``, regular files) older than
:data:`STALE_TMP_SECONDS`: what a writer killed between ``mkstemp`` and ``os.replace`` left
behind, removed by the next ``put`` in the directory.

A cached plan is a hint, never an authority: ``get(key, accept=check)`` hands the decoded plan to
``check`` (e.g. :func:`fastinit.sharding.validate.validate_plan` for this module and world), and a
plan it rejects with :class:`~fastinit.errors.PlanMismatchError` is a miss with one warning, so the
caller plans again and its ``put`` replaces the entry. Only a regular file is ever read (opened
non-blocking and without following a final symlink, then checked with ``fstat``), and never more
than ``max_bytes`` of it (see :func:`plan_bytes_bound`): a FIFO, a device, a symlink or a file
larger than the bound is a miss with a warning, never a hang and never a large allocation.

Example::

    cache = PlanCache(resolve_cache_dir(plan_cache))
    bound = plan_bytes_bound(num_tables, world_size)
    plan = cache.get(key, accept=lambda p: validate_plan(module, p, sharders, world_size),
                     max_bytes=bound)
    if plan is None:
        plan = planner.plan(module, sharders)
        cache.put(key, plan)
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import struct
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastinit.errors import PlanMismatchError

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

__all__ = [
    "DEFAULT_MAX_BYTES",
    "STALE_TMP_SECONDS",
    "FastinitCacheWarning",
    "PlanCache",
    "plan_bytes_bound",
    "resolve_cache_dir",
]

_MAGIC = b"FIPCACHE"
_VERSION = 1
_SUFFIX = ".fiplan"
_PREFIX = struct.Struct(">HH")  # format version, key length
_PAYLOAD = struct.Struct(">32sQ")  # sha256 of the payload, payload length
_MAX_KEY_BYTES = 64

#: Age after which a ``put`` removes another writer's temporary file: a write takes milliseconds,
#: so a temporary this old belongs to a writer that died (1 hour, room for a stalled shared disk).
STALE_TMP_SECONDS = 3600.0
_TMP_NAME = re.compile(r"\.[0-9a-f]{16}\..+\.tmp")

#: The read bound of ``PlanCache.get`` when the caller gives none (256 MiB).
DEFAULT_MAX_BYTES = 256 << 20

# plan_bytes_bound's allowances. Measured with codec version 1 (fastinit.testing.models plans,
# 2-32 ranks, every sharding type): about 600 bytes per table plus about 140 bytes per shard of a
# row-wise table. The allowances are ~25x and ~7x those, for long names and fused parameters.
_BOUND_BASE = 1 << 20
_BOUND_PER_TABLE = 16 << 10
_BOUND_PER_SHARD = 1 << 10


def plan_bytes_bound(num_tables: int, world_size: int) -> int:
    """A generous upper bound on the size of a plan-cache entry for a model and world.

    ``1 MiB + num_tables * (16 KiB + world_size * 1 KiB)``: a plan holds at most one shard per
    rank per table (row-wise), and an encoded plan takes about 600 bytes per table and 140 per
    shard, so real entries stay far below it while a junk file of another size class (a 1 GiB
    file for a 10-table model) is rejected by its size, before anything is read.

    Args:
        num_tables: tables of every shardable module (see
            :func:`fastinit.sharding.validate.count_tables`).
        world_size: ranks in the job.

    Returns:
        The bound in bytes, to pass as ``PlanCache.get(..., max_bytes=...)``.
    """
    tables = max(int(num_tables), 1)
    ranks = max(int(world_size), 1)
    return _BOUND_BASE + tables * (_BOUND_PER_TABLE + ranks * _BOUND_PER_SHARD)


class FastinitCacheWarning(UserWarning):
    """A plan-cache entry was ignored, or the cache could not be written."""


def resolve_cache_dir(plan_cache: str | os.PathLike[str] | None) -> str | None:
    """The plan-cache directory: ``plan_cache`` if given, else ``FASTINIT_PLAN_CACHE``, else None.

    An empty ``plan_cache`` (``""``) means off, as an empty ``FASTINIT_PLAN_CACHE`` does (it does
    not fall back to the knob).
    """
    if plan_cache is not None:
        return os.fspath(plan_cache) or None
    from fastinit import knobs

    return knobs.get_plan_cache()


def _entry_bytes(key: bytes, payload: bytes) -> bytes:
    return b"".join(
        (
            _MAGIC,
            _PREFIX.pack(_VERSION, len(key)),
            key,
            _PAYLOAD.pack(hashlib.sha256(payload).digest(), len(payload)),
            payload,
        )
    )


def _parse_entry(data: bytes, key: bytes) -> bytes:
    """The payload of an entry for ``key``; ValueError saying what is wrong otherwise."""
    head = len(_MAGIC) + _PREFIX.size
    if len(data) < head:
        raise ValueError(f"truncated ({len(data)} bytes)")
    if data[: len(_MAGIC)] != _MAGIC:
        raise ValueError("not a fastinit plan-cache entry (wrong magic)")
    version, key_len = _PREFIX.unpack_from(data, len(_MAGIC))
    if version != _VERSION:
        raise ValueError(f"entry format version {version}, expected {_VERSION}")
    stored_key = data[head : head + key_len]
    if len(stored_key) < key_len or len(data) < head + key_len + _PAYLOAD.size:
        raise ValueError(f"truncated ({len(data)} bytes)")
    if stored_key != key:
        raise ValueError(f"holds the entry of another key ({stored_key.hex()})")
    checksum, length = _PAYLOAD.unpack_from(data, head + key_len)
    payload = data[head + key_len + _PAYLOAD.size :]
    if len(payload) != length:
        raise ValueError(f"payload is {len(payload)} bytes, the header says {length}")
    if hashlib.sha256(payload).digest() != checksum:
        raise ValueError("bad checksum")
    return payload


class PlanCache:
    """Sharding plans on disk, one file per key; safe for concurrent readers and writers.

    Args:
        directory: the cache directory; created on the first ``put``.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)

    def path(self, key: bytes) -> str:
        """The file of ``key``'s entry.

        Raises:
            ValueError: ``key`` is empty or longer than 64 bytes.
        """
        if not isinstance(key, bytes) or not 0 < len(key) <= _MAX_KEY_BYTES:
            raise ValueError(f"a plan-cache key is 1 to {_MAX_KEY_BYTES} bytes, got {key!r:.80}")
        return os.path.join(self.directory, key.hex() + _SUFFIX)

    def get(
        self,
        key: bytes,
        *,
        accept: Callable[[ShardingPlan], object] | None = None,
        max_bytes: int | None = None,
    ) -> ShardingPlan | None:
        """The plan stored for ``key``, or None (missing, or ignored with one warning).

        Args:
            key: the planner fingerprint (see ``fastinit.sharding.fingerprint``).
            accept: called with the decoded plan; a :class:`~fastinit.errors.PlanMismatchError`
                from it makes the entry a miss (one warning; the next ``put`` replaces it).
                Any other exception propagates.
            max_bytes: read at most this many bytes (default :data:`DEFAULT_MAX_BYTES`); a
                larger entry is a miss with a warning. See :func:`plan_bytes_bound`.

        Returns:
            The decoded, accepted plan, or None when there is no usable entry.
        """
        from fastinit.sharding.codec import PlanDecodeError, decode_plan

        path = self.path(key)
        bound = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
        try:
            data = _read_regular_file(path, bound)
        except _Unusable as e:
            _warn(f"ignoring {path}: {e}; planning instead, and it will be replaced")
            return None
        if data is None:
            return None
        try:
            plan = decode_plan(_parse_entry(data, key))
        except (ValueError, PlanDecodeError) as e:
            _warn(f"ignoring {path}: {e}; it will be replaced")
            return None
        if accept is not None:
            try:
                accept(plan)
            except PlanMismatchError as e:
                _warn(
                    f"ignoring {path}: its plan does not fit this module and world ({e}); "
                    "planning instead, and it will be replaced"
                )
                return None
        return plan

    def put(self, key: bytes, plan: ShardingPlan) -> bool:
        """Stores ``plan`` under ``key``, atomically; never raises on I/O errors.

        Args:
            key: the planner fingerprint.
            plan: the plan to store.

        Returns:
            True when the entry is in place (written now, or already there with the same bytes);
            False, with a warning, when the directory cannot be created or written.
        """
        from fastinit.sharding.codec import encode_plan

        path = self.path(key)
        entry = _entry_bytes(key, encode_plan(plan))
        with contextlib.suppress(_Unusable):
            if _read_regular_file(path, len(entry)) == entry:
                self._remove_stale_temporaries()
                return True
        tmp: str | None = None
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(
                prefix=f".{key.hex()[:16]}.", suffix=".tmp", dir=self.directory
            )
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 would hide entries from other users
                f.write(entry)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
            self._remove_stale_temporaries()
        except OSError as e:
            warnings.warn(
                f"fastinit plan cache: cannot write {path} ({e}); continuing without caching",
                FastinitCacheWarning,
                stacklevel=2,
            )
            return False
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return True

    def _remove_stale_temporaries(self, max_age: float = STALE_TMP_SECONDS) -> int:
        """Delete this cache's temporaries older than ``max_age`` seconds; returns how many.

        Only regular files named like :meth:`put`'s temporaries (never a symlink's target, never
        another file); one that vanishes or cannot be removed meanwhile is skipped.
        """
        removed = 0
        cutoff = time.time() - max_age
        with contextlib.suppress(OSError), os.scandir(self.directory) as entries:
            for entry in entries:
                if not _TMP_NAME.fullmatch(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
                except OSError:
                    continue
        return removed


class _Unusable(Exception):
    """The entry's path holds something the cache does not read (said in the message)."""


def _warn(message: str) -> None:
    warnings.warn(f"fastinit plan cache: {message}", FastinitCacheWarning, stacklevel=3)


_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)  # a FIFO opens at once instead of waiting for a writer
    | getattr(os, "O_NOFOLLOW", 0)  # a symlink (to /dev/zero, say) is refused, not followed
    | getattr(os, "O_CLOEXEC", 0)
)


def _read_regular_file(path: str, max_bytes: int) -> bytes | None:
    """The bytes of the regular file at ``path``; None when nothing is there.

    Raises:
        _Unusable: the path is a symlink, FIFO, device, socket or directory, is larger than
            ``max_bytes``, or cannot be read.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except (FileNotFoundError, NotADirectoryError):  # nothing stored there
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _Unusable("it is a symbolic link, not a regular file") from e
        if e.errno == errno.EISDIR:
            raise _Unusable("it is a directory, not a regular file") from e
        raise _Unusable(f"cannot open it ({e})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _Unusable(f"it is not a regular file (mode {stat.filemode(st.st_mode)})")
        if st.st_size > max_bytes:
            raise _Unusable(f"it is {st.st_size} bytes, more than the bound of {max_bytes}")
        chunks: list[bytes] = []
        left = max_bytes + 1  # one byte more tells a file that grew past the bound
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise _Unusable(f"it grew past the bound of {max_bytes} bytes while being read")
        return b"".join(chunks)
    except OSError as e:
        raise _Unusable(f"cannot read it ({e})") from e
    finally:
        os.close(fd)
