"""A directory of sharding plans, content-addressed by the planner fingerprint.

One file per key, named ``<hex of key>.fiplan``::

    b"FIPCACHE" | uint16 format version | uint16 key length | key
                | sha256 of the payload (32 bytes) | uint64 payload length | payload

where the payload is :func:`fastinit.sharding.codec.encode_plan`'s bytes. Entries are written to a
temporary file in the same directory and moved into place with ``os.replace``, so a reader sees a
whole entry or none, however many processes write the same key at once. A corrupt, truncated or
foreign entry is ignored with a :class:`FastinitCacheWarning` and replaced by the next ``put``.
The cache never deletes a file and only ever replaces files named like its own entries.

Example::

    cache = PlanCache(resolve_cache_dir(plan_cache))
    plan = cache.get(key)
    if plan is None:
        plan = planner.plan(module, sharders)
        cache.put(key, plan)
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import tempfile
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

__all__ = ["FastinitCacheWarning", "PlanCache", "resolve_cache_dir"]

_MAGIC = b"FIPCACHE"
_VERSION = 1
_SUFFIX = ".fiplan"
_PREFIX = struct.Struct(">HH")  # format version, key length
_PAYLOAD = struct.Struct(">32sQ")  # sha256 of the payload, payload length
_MAX_KEY_BYTES = 64


class FastinitCacheWarning(UserWarning):
    """A plan-cache entry was ignored, or the cache could not be written."""


def resolve_cache_dir(plan_cache: str | os.PathLike[str] | None) -> str | None:
    """The plan-cache directory: ``plan_cache`` if given, else ``FASTINIT_PLAN_CACHE``, else None."""
    if plan_cache is not None:
        return os.fspath(plan_cache)
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

    def _read(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):  # nothing stored there
            return None
        except OSError as e:
            warnings.warn(
                f"fastinit plan cache: cannot read {path} ({e}); planning instead",
                FastinitCacheWarning,
                stacklevel=3,
            )
            return None

    def get(self, key: bytes) -> ShardingPlan | None:
        """The plan stored for ``key``, or None (missing, or ignored with a warning).

        Args:
            key: the planner fingerprint (see ``fastinit.sharding.fingerprint``).

        Returns:
            The decoded plan, or None when there is no usable entry.
        """
        from fastinit.sharding.codec import PlanDecodeError, decode_plan

        path = self.path(key)
        data = self._read(path)
        if data is None:
            return None
        try:
            return decode_plan(_parse_entry(data, key))
        except (ValueError, PlanDecodeError) as e:
            warnings.warn(
                f"fastinit plan cache: ignoring {path}: {e}; it will be replaced",
                FastinitCacheWarning,
                stacklevel=2,
            )
            return None

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
        if self._read_quietly(path) == entry:
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

    def _read_quietly(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:
            return None
