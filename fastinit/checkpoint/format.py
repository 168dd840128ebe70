"""The on-disk format of a fastinit checkpoint: layout, index, manifests, commit marker.

A checkpoint directory (see docs/checkpoint.md for the full description)::

    DIR/
      fastinit-commit.json       the commit marker, created last, once (never replaced): the
                                 save's id, its data directory, the digest of the index and of
                                 every part's manifest
      data-<save id>/            every file of that save, invisible until the marker names it
        fastinit-index.json      rank 0: the index (JSON, below)
        replicated/              rank 0: a DCP checkpoint (.metadata + .distcp) of every value
                                 that is not sharded, and its fastinit-manifest.json
        rank_00000/              rank r: a DCP checkpoint of rank r's shards (DCP's
        rank_00001/              FileSystemWriter: .metadata + __0_0.distcp), layouts.json (the
        ...                      global layout of every sharded value whose shard 0 it holds)
                                 and fastinit-manifest.json
      fastinit-abort-<id>.json   a save that failed (why), written where the disk allows

A part's manifest names every file of the part with its size and digest, and every data item
(a tensor chunk or a pickled object) with where its bytes lie and their digest; the marker names
the digest of every manifest, so every byte a load uses is proven by the commit.

The index is small and does not grow with the world size: the compact plan (fastinit's codec,
base64), the model's tensors (FQN, shape, dtype) and fingerprint, the layout of every sharded
model tensor as shard runs (:class:`~fastinit.plan.layout.ShardRun`), the FQNs of the
replicated values, the world size and the name pattern of the rank directories, the step and
the user's metadata.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

from fastinit.checkpoint.digest import digest as _digest
from fastinit.checkpoint.digest import fsync_dir
from fastinit.errors import CheckpointError
from fastinit.plan.codec import decode_plan
from fastinit.plan.layout import ShardRun

__all__ = [
    "FORMAT",
    "VERSION",
    "INDEX_FILE",
    "COMMIT_FILE",
    "MANIFEST_FILE",
    "REPLICATED_DIR",
    "LAYOUTS_FILE",
    "CheckpointError",
    "Index",
    "Commit",
    "Manifest",
    "Item",
    "TensorEntry",
    "rank_dir",
    "read_commit",
    "read_index",
    "read_manifest",
    "is_committed",
    "has_stock_metadata",
    "fingerprint",
    "write_json_atomic",
    "data_dir_name",
    "abort_file",
]

FORMAT = "fastinit-checkpoint"
VERSION = 2
INDEX_FILE = "fastinit-index.json"
COMMIT_FILE = "fastinit-commit.json"
MANIFEST_FILE = "fastinit-manifest.json"
REPLICATED_DIR = "replicated"
LAYOUTS_FILE = "layouts.json"
RANK_DIR_PATTERN = "rank_{rank:05d}"
DATA_DIR_PREFIX = "data-"
#: DCP's global metadata file (what a stock DCP checkpoint, or a consolidated one, holds).
DCP_METADATA = ".metadata"
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")


def data_dir_name(save_id: str) -> str:
    """The directory (relative to the checkpoint) that holds every file of save ``save_id``."""
    return f"{DATA_DIR_PREFIX}{save_id}"


def abort_file(checkpoint_dir: str, save_id: str) -> str:
    """Where a failed save leaves its reason (when the disk allows)."""
    return os.path.join(checkpoint_dir, f"fastinit-abort-{save_id}.json")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """One value of the checkpointed state, as the index records it."""

    fqn: str
    shape: tuple[int, ...] | None
    """Global shape; None for a non-tensor value."""
    dtype: str | None
    """``str(torch.dtype)`` without the ``torch.`` prefix; None for a non-tensor value."""

    def to_json(self) -> list[Any]:
        """This entry as JSON values (its form in the index)."""
        return [self.fqn, None if self.shape is None else list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, obj: Any) -> TensorEntry:
        """The entry read back from :meth:`to_json`'s form."""
        fqn, shape, dtype = obj
        return cls(fqn, None if shape is None else tuple(int(x) for x in shape), dtype)

    def describe(self) -> str:
        """The value's shape and dtype, for a message."""
        if self.shape is None:
            return "a non-tensor value"
        return f"shape {list(self.shape)} {self.dtype}"


@dataclasses.dataclass(slots=True)
class Index:
    """The parsed index of a committed checkpoint."""

    world_size: int
    rank_dir_pattern: str
    model: list[TensorEntry]
    """The model's state (FQNs prefixed ``model.``), in state_dict order."""
    fingerprint: str
    sharded: dict[str, list[Any]]
    """FQN -> shard runs (``ShardRun.to_json``) of each sharded model tensor."""
    replicated: list[str]
    """FQNs of every value stored once, in ``replicated/``."""
    optimizers: list[str]
    plan: bytes | None
    """fastinit's encoded plan (``fastinit.plan.codec``), or None (no plan, or not encodable)."""
    plan_sha256: str | None
    step: int | None = None
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    torch_version: str = ""
    save_id: str = ""
    """The save's identity: every file of the save lies under ``data-<save_id>/``."""
    state: list[TensorEntry] = dataclasses.field(default_factory=list)
    """``[fqn, global shape, dtype]`` of every sharded value that is not the model's (a fused
    optimizer's state): what a load can carry, and what it cannot, known on every rank alike."""

    @property
    def data_dir(self) -> str:
        """This save's data directory, relative to the checkpoint."""
        return data_dir_name(self.save_id)

    def part_dir(self, checkpoint_dir: str, rank: int | None) -> str:
        """The directory of rank ``rank``'s part (None: the replicated part)."""
        sub = REPLICATED_DIR if rank is None else self.rank_dir_pattern.format(rank=rank)
        return os.path.join(checkpoint_dir, self.data_dir, sub)

    def rank_dir(self, checkpoint_dir: str, rank: int) -> str:
        """Where ``rank``'s files of this save are (its part directory)."""
        return self.part_dir(checkpoint_dir, rank)

    def runs(self, fqn: str) -> tuple[Any, ...] | None:
        """The shard runs of a sharded model tensor (None if the index has none for ``fqn``)."""
        raw = self.sharded.get(fqn)
        return None if raw is None else tuple(ShardRun.from_json(r) for r in raw)

    def to_json(self) -> dict[str, Any]:
        """This index as JSON values (the index file's content)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "rank_dir": self.rank_dir_pattern,
            "replicated_dir": REPLICATED_DIR,
            "fingerprint": self.fingerprint,
            "model": [e.to_json() for e in self.model],
            "state": [e.to_json() for e in self.state],
            "sharded": self.sharded,
            "replicated": self.replicated,
            "optimizers": self.optimizers,
            "plan": None if self.plan is None else base64.b64encode(self.plan).decode("ascii"),
            "plan_sha256": self.plan_sha256,
            "step": self.step,
            "metadata": self.metadata,
            "torch": self.torch_version,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Index:
        """The index read back from :meth:`to_json`'s form; ``where`` names the file in errors."""
        _check_header(obj, where, "index")
        try:
            plan = obj.get("plan")
            return cls(
                world_size=int(obj["world_size"]),
                rank_dir_pattern=str(obj["rank_dir"]),
                model=[TensorEntry.from_json(e) for e in obj["model"]],
                fingerprint=str(obj["fingerprint"]),
                sharded=dict(obj["sharded"]),
                replicated=list(obj["replicated"]),
                optimizers=list(obj["optimizers"]),
                plan=None if plan is None else base64.b64decode(plan),
                plan_sha256=obj.get("plan_sha256"),
                step=obj.get("step"),
                metadata=dict(obj.get("metadata") or {}),
                torch_version=str(obj.get("torch", "")),
                save_id=str(obj["save_id"]),
                state=[TensorEntry.from_json(e) for e in obj.get("state", [])],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: malformed index ({type(e).__name__}: {e})") from None

    def decoded_plan(self) -> Any:
        """The stored ShardingPlan (decoded with fastinit's codec), or None."""
        if self.plan is None:
            return None

        return decode_plan(self.plan)


def _check_header(obj: Any, where: str, what: str) -> None:
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{where} is not a fastinit checkpoint {what}")
    if obj.get("version") != VERSION:
        raise CheckpointError(
            f"{where}: a fastinit checkpoint of format version {obj.get('version')!r}; this "
            f"fastinit reads version {VERSION} (a version-1 checkpoint loads with the fastinit "
            "that wrote it, or with stock DCP after that fastinit's `checkpoint consolidate`)"
        )


@dataclasses.dataclass(slots=True)
class Commit:
    """The commit marker: a save made visible, and the digests that prove its files."""

    save_id: str
    index_digest: str
    world_size: int
    manifests: list[str | None]
    """The digest of each rank's manifest (None only in a checkpoint that the scale benchmark
    synthesised from some ranks' files)."""
    replicated: str
    """The digest of the replicated part's manifest."""
    torch_version: str = ""
    job: str = ""

    @property
    def data_dir(self) -> str:
        """This save's data directory, relative to the checkpoint."""
        return data_dir_name(self.save_id)

    def to_json(self) -> dict[str, Any]:
        """This marker as JSON values (the commit file's content)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "data": self.data_dir,
            "index": self.index_digest,
            "world_size": self.world_size,
            "manifests": self.manifests,
            "replicated": self.replicated,
            "torch": self.torch_version,
            "job": self.job,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Commit:
        """The marker read back from :meth:`to_json`'s form; ``where`` names the file in errors."""
        _check_header(obj, where, "commit marker")
        try:
            commit = cls(
                save_id=str(obj["save_id"]),
                index_digest=str(obj["index"]),
                world_size=int(obj["world_size"]),
                manifests=[None if m is None else str(m) for m in obj["manifests"]],
                replicated=str(obj["replicated"]),
                torch_version=str(obj.get("torch", "")),
                job=str(obj.get("job", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{where}: malformed commit marker ({type(e).__name__}: {e})"
            ) from None
        if not _SAVE_ID.match(commit.save_id) or len(commit.manifests) != commit.world_size:
            raise CheckpointError(f"{where}: malformed commit marker (save id or ranks)")
        return commit


@dataclasses.dataclass(frozen=True, slots=True)
class Item:
    """Where one stored data item's bytes lie, and their digest.

    A tensor chunk's bytes are its raw data (``nbytes``, row-major, in the chunk's dtype) at
    ``offset`` of ``file`` (inside DCP's ``torch.save`` record of it) and, while the save's
    staging buffer lives, at ``segment_offset`` of the rank's shared-memory segment. A pickled
    object's bytes are its whole record.
    """

    fqn: str
    chunk_offsets: tuple[int, ...] | None
    """The chunk's offsets (None for a pickled object)."""
    file: str
    offset: int
    nbytes: int
    digest: str
    segment_offset: int | None = None

    def to_json(self) -> list[Any]:
        """This item as JSON values (its form in the manifest)."""
        offs = None if self.chunk_offsets is None else list(self.chunk_offsets)
        return [
            self.fqn,
            offs,
            self.file,
            self.offset,
            self.nbytes,
            self.digest,
            self.segment_offset,
        ]

    @classmethod
    def from_json(cls, obj: Any) -> Item:
        """The item read back from :meth:`to_json`'s form."""
        fqn, offs, file, offset, nbytes, digest, seg = obj
        return cls(
            str(fqn),
            None if offs is None else tuple(int(x) for x in offs),
            str(file),
            int(offset),
            int(nbytes),
            str(digest),
            None if seg is None else int(seg),
        )


@dataclasses.dataclass(slots=True)
class Manifest:
    """One part's manifest (a rank's shards, or the replicated values)."""

    save_id: str
    part: str
    """``rank_<r>`` or ``replicated``."""
    rank: int
    files: dict[str, tuple[int, str]]
    """file name -> (size, digest) of every file of the part."""
    items: list[Item]
    segment: str | None = None
    """The shared-memory segment that staged this part (the host-memory tier), if any."""
    torch_version: str = ""

    def to_json(self) -> dict[str, Any]:
        """This manifest as JSON values (the manifest file's content)."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "part": self.part,
            "rank": self.rank,
            "files": {k: list(v) for k, v in sorted(self.files.items())},
            "items": [i.to_json() for i in self.items],
            "segment": self.segment,
            "torch": self.torch_version,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Manifest:
        """The manifest read back from :meth:`to_json`'s form; ``where`` names the file in errors."""
        _check_header(obj, where, "manifest")
        try:
            return cls(
                save_id=str(obj["save_id"]),
                part=str(obj["part"]),
                rank=int(obj["rank"]),
                files={str(k): (int(v[0]), str(v[1])) for k, v in obj["files"].items()},
                items=[Item.from_json(i) for i in obj["items"]],
                segment=obj.get("segment"),
                torch_version=str(obj.get("torch", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"{where}: malformed manifest ({type(e).__name__}: {e})"
            ) from None

    def item_map(self) -> dict[tuple[str, tuple[int, ...] | None], Item]:
        """The items by ``(fqn, chunk offsets)``."""
        return {(i.fqn, i.chunk_offsets): i for i in self.items}


def write_bytes_atomic(path: str, data: bytes) -> bytes:
    """Write ``data`` to ``path`` atomically (tmp file, fsync, rename, fsync dir)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_dir(os.path.dirname(path) or ".")
    return data


def json_bytes(obj: Any) -> bytes:
    """The canonical JSON bytes fastinit writes (sorted keys, no spaces)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_json_atomic(path: str, obj: Any) -> bytes:
    """Write ``obj`` as JSON to ``path`` atomically; returns the bytes written."""
    return write_bytes_atomic(path, json_bytes(obj))


def create_json_once(path: str, obj: Any) -> tuple[bool, bytes]:
    """Create ``path`` holding ``obj`` as JSON, atomically and only if it does not exist.

    Returns ``(True, bytes)`` when this call created it, ``(False, existing bytes)`` when the
    path already existed (nothing is overwritten). The file appears whole or not at all: a
    temporary file is written and fsync'd, then hard-linked to ``path`` (``link`` fails if
    ``path`` exists). On a file system without hard links, ``O_EXCL`` creation is the fallback
    (there, a reader may see the file before its bytes: :func:`read_commit` calls an empty or
    partial marker incomplete, never committed).
    """
    data = json_bytes(obj)
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False, _read_bytes(path)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False, _read_bytes(path)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
    finally:
        _remove(tmp)
    fsync_dir(directory)
    return True, data


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def rank_dir(checkpoint_dir: str, rank: int) -> str:
    """The directory holding rank ``rank``'s shards and per-rank metadata (committed only)."""
    return os.path.join(
        checkpoint_dir, read_commit(checkpoint_dir).data_dir, RANK_DIR_PATTERN.format(rank=rank)
    )


def is_committed(checkpoint_dir: str) -> bool:
    """True if ``checkpoint_dir`` holds a commit marker (whole or not)."""
    return os.path.exists(os.path.join(checkpoint_dir, COMMIT_FILE))


def has_stock_metadata(checkpoint_dir: str) -> bool:
    """True if ``checkpoint_dir`` holds DCP's global ``.metadata`` (stock, or consolidated)."""
    return os.path.exists(os.path.join(checkpoint_dir, DCP_METADATA))


def parse_commit(data: bytes, where: str) -> Commit:
    """The commit marker from its bytes (errors name ``where``)."""
    if not data.strip():
        raise CheckpointError(
            f"{where} is empty: the save was interrupted while committing (or is committing "
            "right now); the checkpoint is not committed"
        )
    try:
        obj = json.loads(data)
    except ValueError:
        raise CheckpointError(
            f"{where} is incomplete or damaged (not JSON): the checkpoint is not committed"
        ) from None
    return Commit.from_json(obj, where)


def read_commit(checkpoint_dir: str) -> Commit:
    """The commit marker of ``checkpoint_dir``.

    Raises:
        CheckpointError: no marker (a torn save, or not a checkpoint), an empty, partial or
            malformed one, or one of another format version.
    """
    path = os.path.join(checkpoint_dir, COMMIT_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        if has_stock_metadata(checkpoint_dir):
            raise CheckpointError(
                f"{checkpoint_dir} is a stock DCP checkpoint (a global .metadata), not a "
                "fastinit one"
            ) from None
        raise CheckpointError(
            f"{checkpoint_dir} is not a committed fastinit checkpoint: no {COMMIT_FILE} "
            "(the save did not finish on every rank; load an earlier checkpoint)"
        ) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the commit marker ({e})") from None
    return parse_commit(data, path)


def read_verified(path: str, expect: str | None, what: str) -> bytes:
    """The bytes of ``path`` (a small file), checked against the digest ``expect``."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing ({what}; a damaged checkpoint)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e})") from None
    if expect is not None and _digest(data) != expect:
        raise CheckpointError(
            f"{path}: {what} does not match the digest the commit recorded (a replaced, stale "
            "or damaged file)"
        )
    return data


def read_index(checkpoint_dir: str, commit: Commit | None = None) -> Index:
    """The index of a committed checkpoint, proven by its commit marker.

    Raises:
        CheckpointError: no marker or a damaged one, an index missing, replaced or damaged.
    """
    commit = commit if commit is not None else read_commit(checkpoint_dir)
    path = os.path.join(checkpoint_dir, commit.data_dir, INDEX_FILE)
    data = read_verified(path, commit.index_digest, "the index")
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    index = Index.from_json(obj, path)
    if index.save_id != commit.save_id or index.world_size != commit.world_size:
        raise CheckpointError(f"{path}: the index belongs to another save than the marker names")
    return index


def read_manifest(checkpoint_dir: str, commit: Commit, rank: int | None) -> tuple[Manifest, int]:
    """A part's manifest (rank ``rank``'s, or the replicated part's with None), proven by the
    commit marker; returns it and its size in bytes.

    Raises:
        CheckpointError: the manifest is missing, replaced, damaged or of another save.
    """
    sub = REPLICATED_DIR if rank is None else RANK_DIR_PATTERN.format(rank=rank)
    path = os.path.join(checkpoint_dir, commit.data_dir, sub, MANIFEST_FILE)
    if rank is not None and not 0 <= rank < commit.world_size:
        raise CheckpointError(
            f"{checkpoint_dir}: rank {rank} is outside the {commit.world_size} ranks that saved"
        )
    expect = commit.replicated if rank is None else commit.manifests[rank]
    if expect is None:
        raise CheckpointError(f"{checkpoint_dir}: the commit records no files of rank {rank}")
    what = "the replicated part's manifest" if rank is None else f"rank {rank}'s manifest"
    data = read_verified(path, expect, what)
    try:
        manifest = Manifest.from_json(json.loads(data), path)
    except ValueError as e:
        raise CheckpointError(f"{path}: not JSON ({e})") from None
    if manifest.save_id != commit.save_id:
        raise CheckpointError(f"{path}: a manifest of another save than the marker names")
    return manifest, len(data)


def fingerprint(entries: Iterable[TensorEntry]) -> str:
    """SHA-256 over the model's (FQN, shape, dtype) list: the same model under any plan."""
    h = hashlib.sha256()
    for e in entries:
        h.update(json.dumps(e.to_json(), separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()


def first_mismatch(stored: Sequence[TensorEntry], current: Sequence[TensorEntry]) -> str | None:
    """A sentence naming the first tensor where two models differ, or None if they agree."""
    by_name = {e.fqn: e for e in stored}
    names = {e.fqn for e in current}
    for e in current:
        s = by_name.get(e.fqn)
        if s is None:
            return f"tensor {e.fqn!r} of the model is not in the checkpoint"
        if s != e:
            return f"tensor {e.fqn!r}: checkpoint has {s.describe()}, the model {e.describe()}"
    for s in stored:
        if s.fqn not in names:
            return f"tensor {s.fqn!r} of the checkpoint is not in the model"
    return None
