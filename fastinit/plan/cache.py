"""A directory of sharding plans, content-addressed by the planner fingerprint.

One file per key, named ``<hex of key>.fiplan``::

    b"FIPCACHE" | uint16 format version | uint16 key length | key
                | sha256 of the payload (32 bytes) | uint64 payload length | payload

where the payload is :func:`fastinit.plan.codec.encode_plan`'s bytes. Entries are written to a
temporary file in the same directory and moved into place with ``os.replace``, so a reader sees a
whole entry or none, however many processes write the same key at once. A corrupt, truncated or
foreign entry is ignored with a :class:`FastinitCacheWarning` and replaced by the next ``put``.
The cache only ever replaces files named like its own entries, and deletes only its own
temporaries (``.<16 hex digits>.<random>.tmp``, regular files) older than
:data:`STALE_TMP_SECONDS`: what a writer killed between ``mkstemp`` and ``os.replace`` left
behind, removed by the next ``put`` in the directory.

A cached plan is a hint, never an authority: ``get(key, accept=check)`` hands the decoded plan to
``check`` (e.g. :func:`fastinit.plan.validate.validate_plan` for this module and world), and a
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

TorchRec 1.9's plan-cache protocol (``torchrec.distributed.planner.dry_run.PlanCache``: ``get`` and
``put`` of ``(ShardingPlan, CacheMetadata)`` by a request-fingerprint string) is spoken both ways:

* :class:`TorchRecPlanCache` wraps this directory cache as a TorchRec ``PlanCache`` (for TorchRec's
  dry-run planner, or anything else that takes one); the metadata goes in a sidecar file;
* :func:`as_plan_cache` turns what ``fastinit.setup(plan_cache=...)`` is given into the cache it
  uses: a directory (or None: ``FASTINIT_PLAN_CACHE``), a :class:`PlanCache`, or any object with
  ``get``/``put`` in TorchRec's protocol, keyed by the hex of fastinit's planner fingerprint. What
  such an object returns is a hint, never an authority: it must decode as a ``ShardingPlan``,
  re-encode, and pass the same ``accept`` check (``validate_plan``) as a file entry, else it is a
  miss with one warning; an exception from its ``get`` or ``put`` is a warning too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import stat
import struct
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastinit import knobs
from fastinit.errors import FastinitCacheWarning, PlanMismatchError
from fastinit.plan.codec import PlanDecodeError, decode_plan, encode_plan

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

__all__ = [
    "DEFAULT_MAX_BYTES",
    "STALE_TMP_SECONDS",
    "FastinitCacheWarning",
    "PlanCache",
    "TorchRecPlanCache",
    "as_plan_cache",
    "cache_metadata",
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
            :func:`fastinit.plan.validate.count_tables`).
        world_size: ranks in the job.

    Returns:
        The bound in bytes, to pass as ``PlanCache.get(..., max_bytes=...)``.
    """
    tables = max(int(num_tables), 1)
    ranks = max(int(world_size), 1)
    return _BOUND_BASE + tables * (_BOUND_PER_TABLE + ranks * _BOUND_PER_SHARD)


def resolve_cache_dir(plan_cache: str | os.PathLike[str] | None) -> str | None:
    """The plan-cache directory: ``plan_cache`` if given, else ``FASTINIT_PLAN_CACHE``, else None.

    An empty ``plan_cache`` (``""``) means off, as an empty ``FASTINIT_PLAN_CACHE`` does (it does
    not fall back to the knob).
    """
    if plan_cache is not None:
        return os.fspath(plan_cache) or None

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
            key: the planner fingerprint (see ``fastinit.plan.fingerprint``).
            accept: called with the decoded plan; a :class:`~fastinit.errors.PlanMismatchError`
                from it makes the entry a miss (one warning; the next ``put`` replaces it).
                Any other exception propagates.
            max_bytes: read at most this many bytes (default :data:`DEFAULT_MAX_BYTES`); a
                larger entry is a miss with a warning. See :func:`plan_bytes_bound`.

        Returns:
            The decoded, accepted plan, or None when there is no usable entry.
        """
        got = self.read(key, accept=accept, max_bytes=max_bytes)
        return None if got is None else got[0]

    def read(
        self,
        key: bytes,
        *,
        accept: Callable[[ShardingPlan], object] | None = None,
        max_bytes: int | None = None,
    ) -> tuple[ShardingPlan, bytes] | None:
        """As :meth:`get`, with the entry's payload: ``(plan, the encoded plan as read)``, so
        that a caller digests or sends the bytes it read instead of encoding the plan again."""
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
            payload = _parse_entry(data, key)
            plan = decode_plan(payload)
        except (ValueError, PlanDecodeError) as e:
            _warn(f"ignoring {path}: {e}; it will be replaced")
            return None
        if not _accepted(plan, accept, f"ignoring {path}: its plan"):
            return None
        return plan, payload

    def put(self, key: bytes, plan: ShardingPlan | bytes) -> bool:
        """Stores ``plan`` under ``key``, atomically; never raises on I/O errors.

        Args:
            key: the planner fingerprint.
            plan: the plan to store, or its bytes as :func:`~fastinit.plan.codec.encode_plan`
                wrote them (``setup`` stores the bytes that travelled; nothing is re-encoded).

        Returns:
            True when the entry is in place (written now, or already there with the same bytes);
            False, with a warning, when the directory cannot be created or written.
        """
        path = self.path(key)
        payload = bytes(plan) if isinstance(plan, bytes | bytearray) else encode_plan(plan)
        entry = _entry_bytes(key, payload)
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


# -- TorchRec 1.9's PlanCache protocol ----------------------------------------------------------

_META_SUFFIX = ".fimeta.json"
_MAX_META_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class _CacheMetadata:
    """TorchRec 1.9's ``CacheMetadata`` fields, for a TorchRec that has no such class (1.8)."""

    created_by: str = ""
    sku: str = ""
    world_size: int = 0
    extra: dict[str, str] = dataclasses.field(default_factory=dict)


def _metadata_class() -> type:
    try:
        from torchrec.distributed.planner.dry_run.protocols import CacheMetadata
    except ImportError:  # TorchRec before 1.9
        return _CacheMetadata
    return CacheMetadata


def cache_metadata(**fields: Any) -> Any:
    """A ``CacheMetadata`` (TorchRec's class when it has one, else a stand-in with its fields)."""
    return _metadata_class()(**fields)


def _fingerprint_key(request_fingerprint: str) -> bytes:
    """The entry key of a TorchRec request fingerprint: apart from fastinit's raw-digest keys."""
    if not isinstance(request_fingerprint, str) or not request_fingerprint:
        raise ValueError(
            f"a request fingerprint is a non-empty str, got {request_fingerprint!r:.80}"
        )
    return hashlib.sha256(b"torchrec PlanCache\0" + request_fingerprint.encode()).digest()


class TorchRecPlanCache:
    """This directory cache as TorchRec 1.9's ``PlanCache`` (``dry_run/protocols.py``).

    ``get(request_fingerprint)`` returns ``(plan, metadata)`` or None and ``put(request_fingerprint,
    plan, metadata)`` stores both; ``isinstance(TorchRecPlanCache(d), PlanCache)`` holds. Plans are
    the directory's ordinary entries (same format, same checks: a corrupt, foreign, oversized or
    non-regular entry is a miss with a warning), under a key derived from the fingerprint string;
    the metadata is a JSON sidecar next to it, replaced atomically, and is only attribution: an
    unreadable sidecar gives an empty ``CacheMetadata``.

    Example::

        from torchrec.distributed.planner.dry_run import CacheMetadata, DryRunRequest
        cache = TorchRecPlanCache("plans")
        fp = request.fingerprint(sku)          # a DryRunRequest's per-SKU key
        hit = cache.get(fp)
        if hit is None:
            cache.put(fp, plan, CacheMetadata(sku=sku, world_size=request.world_size))

    Args:
        cache: a :class:`PlanCache` or its directory.
        max_bytes: the read bound of ``get`` (default :data:`DEFAULT_MAX_BYTES`).
    """

    def __init__(
        self, cache: PlanCache | str | os.PathLike[str], *, max_bytes: int | None = None
    ) -> None:
        self.cache = cache if isinstance(cache, PlanCache) else PlanCache(cache)
        self.max_bytes = max_bytes

    def _meta_path(self, key: bytes) -> str:
        return self.cache.path(key)[: -len(_SUFFIX)] + _META_SUFFIX

    def get(self, request_fingerprint: str) -> tuple[ShardingPlan, Any] | None:
        """TorchRec's ``PlanCache.get``: ``(plan, metadata)`` for the fingerprint, or None."""
        key = _fingerprint_key(request_fingerprint)
        plan = self.cache.get(key, max_bytes=self.max_bytes)
        if plan is None:
            return None
        return plan, self._read_metadata(key)

    def put(self, request_fingerprint: str, plan: ShardingPlan, metadata: Any = None) -> None:
        """TorchRec's ``PlanCache.put``: store ``plan`` (and ``metadata``) for the fingerprint."""
        key = _fingerprint_key(request_fingerprint)
        if not self.cache.put(key, plan):
            return
        doc = {
            "created_by": str(getattr(metadata, "created_by", "")),
            "sku": str(getattr(metadata, "sku", "")),
            "world_size": int(getattr(metadata, "world_size", 0) or 0),
            "extra": {
                str(k): str(v) for k, v in dict(getattr(metadata, "extra", {}) or {}).items()
            },
        }
        path = self._meta_path(key)
        tmp: str | None = None
        try:
            fd, tmp = tempfile.mkstemp(
                prefix=f".{key.hex()[:16]}.", suffix=".tmp", dir=self.cache.directory
            )
            with os.fdopen(fd, "w") as f:
                os.fchmod(f.fileno(), 0o644)
                json.dump(doc, f, sort_keys=True)
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            _warn(f"cannot write {path} ({e}); the plan is cached without its metadata")
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _read_metadata(self, key: bytes) -> Any:
        path = self._meta_path(key)
        try:
            data = _read_regular_file(path, _MAX_META_BYTES)
            doc = json.loads(data) if data is not None else {}
            return cache_metadata(
                created_by=str(doc.get("created_by", "")),
                sku=str(doc.get("sku", "")),
                world_size=int(doc.get("world_size", 0)),
                extra={str(k): str(v) for k, v in dict(doc.get("extra", {})).items()},
            )
        except (_Unusable, ValueError, TypeError, AttributeError) as e:
            _warn(f"ignoring {path}: {e}")
            return cache_metadata()


class ProtocolCache:
    """What ``setup`` uses for an object with TorchRec's ``get``/``put``: :class:`PlanCache`'s
    interface (bytes keys, ``accept``, ``max_bytes``) over the object, keyed by the key's hex."""

    def __init__(self, target: Any, world_size: int) -> None:
        self.target = target
        self.world_size = world_size

    def _describe(self) -> str:
        return f"{type(self.target).__name__} object"

    get = PlanCache.get  # the plan of :meth:`read`

    def read(
        self,
        key: bytes,
        *,
        accept: Callable[[ShardingPlan], object] | None = None,
        max_bytes: int | None = None,
    ) -> tuple[ShardingPlan, bytes] | None:
        from torchrec.distributed.types import ShardingPlan

        where = self._describe()
        try:
            got = self.target.get(key.hex())
        except Exception as e:  # a hint, never an authority: a failing cache is a miss
            _warn(f"{where}.get raised {type(e).__name__}: {e}; planning instead")
            return None
        if got is None:
            return None
        plan = got[0] if isinstance(got, tuple) and len(got) == 2 else got
        if not isinstance(plan, ShardingPlan):
            _warn(
                f"{where}.get returned {type(got).__name__}, not a ShardingPlan or "
                "(ShardingPlan, CacheMetadata); planning instead"
            )
            return None
        bound = DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
        try:  # a copy of our own, in the form every rank compares
            encoded = encode_plan(plan)
            if len(encoded) > bound:
                raise ValueError(
                    f"it encodes to {len(encoded)} bytes, more than the bound of {bound}"
                )
            plan = decode_plan(encoded)
        except (ValueError, TypeError, AttributeError, KeyError, PlanDecodeError) as e:
            _warn(f"ignoring the plan from {where}.get: {e}; planning instead")
            return None
        if not _accepted(plan, accept, f"ignoring the plan from {where}.get: it"):
            return None
        return plan, encoded

    def put(self, key: bytes, plan: ShardingPlan | bytes) -> bool:
        if isinstance(plan, bytes | bytearray):  # the bytes that travelled: the object's plan
            plan = decode_plan(bytes(plan))
        metadata = cache_metadata(
            created_by="fastinit", world_size=self.world_size, extra={"fastinit_key": key.hex()}
        )
        try:
            self.target.put(key.hex(), plan, metadata)
        except Exception as e:
            _warn(
                f"{self._describe()}.put raised {type(e).__name__}: {e}; continuing without caching"
            )
            return False
        return True


def _accepted(
    plan: ShardingPlan, accept: Callable[[ShardingPlan], object] | None, subject: str
) -> bool:
    """Whether ``accept`` (if any) takes ``plan``; a :class:`PlanMismatchError` from it is one
    warning that starts with ``subject`` (any other exception propagates)."""
    if accept is not None:
        try:
            accept(plan)
        except PlanMismatchError as e:
            _warn(
                f"{subject} does not fit this module and world ({e}); "
                "planning instead, and it will be replaced"
            )
            return False
    return True


def as_plan_cache(plan_cache: Any, world_size: int) -> PlanCache | ProtocolCache | None:
    """The cache ``fastinit.setup(plan_cache=...)`` uses, or None (no cache).

    Args:
        plan_cache: a directory (str or path; None: ``FASTINIT_PLAN_CACHE``, else no cache), a
            :class:`PlanCache`, or an object with callable ``get`` and ``put`` in TorchRec 1.9's
            ``PlanCache`` protocol (a :class:`TorchRecPlanCache`, say).
        world_size: the job's world size (the ``CacheMetadata`` of what is put).

    Raises:
        TypeError: ``plan_cache`` is none of these.
    """
    if isinstance(plan_cache, PlanCache):
        return plan_cache
    if plan_cache is None or isinstance(plan_cache, (str, os.PathLike)):
        directory = resolve_cache_dir(plan_cache)
        return PlanCache(directory) if directory is not None else None
    if callable(getattr(plan_cache, "get", None)) and callable(getattr(plan_cache, "put", None)):
        return ProtocolCache(plan_cache, world_size)
    raise TypeError(
        "plan_cache is a directory, a fastinit PlanCache or an object with get/put "
        "(TorchRec's PlanCache protocol); got "
        f"{type(plan_cache).__name__}"
    )


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
