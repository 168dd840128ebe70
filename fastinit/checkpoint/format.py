"""The on-disk format of a fastinit checkpoint: directory layout, index, commit marker.

A checkpoint directory (see docs/checkpoint.md for the full description)::

    DIR/
      fastinit-index.json      rank 0: the index (JSON, below)
      fastinit-commit.json     rank 0, written last and atomically: {"index_sha256": ...}
      replicated/              rank 0: a DCP checkpoint (.metadata + .distcp) of every value
                               that is not sharded (dense parameters, data-parallel tables,
                               dense optimizer state, param_groups, ...)
      rank_00000/              rank r: a DCP checkpoint of rank r's shards only, written with
      rank_00001/              DCP's FileSystemWriter (.metadata + __0_0.distcp), plus
      ...                      layouts.json: the global layout (shard runs) of every sharded
                               value whose shard 0 this rank holds

The index is small and does not grow with the world size: the compact plan (fastinit's codec,
base64), the model's tensors (FQN, shape, dtype) and fingerprint, the layout of every sharded
model tensor as shard runs (:class:`~fastinit.sharding.layout.ShardRun`), the FQNs of the
replicated values, the world size and the name pattern of the rank directories, the step and
the user's metadata.

A checkpoint is committed when ``fastinit-commit.json`` exists and names the SHA-256 of the
index's bytes; :func:`read_index` accepts nothing else.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "FORMAT",
    "VERSION",
    "INDEX_FILE",
    "COMMIT_FILE",
    "REPLICATED_DIR",
    "LAYOUTS_FILE",
    "CheckpointError",
    "Index",
    "TensorEntry",
    "rank_dir",
    "read_index",
    "write_index",
    "commit",
    "is_committed",
    "is_fastinit_checkpoint",
    "fingerprint",
    "write_json_atomic",
]

FORMAT = "fastinit-checkpoint"
VERSION = 1
INDEX_FILE = "fastinit-index.json"
COMMIT_FILE = "fastinit-commit.json"
REPLICATED_DIR = "replicated"
LAYOUTS_FILE = "layouts.json"
RANK_DIR_PATTERN = "rank_{rank:05d}"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked (torn, foreign, damaged, ...)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    """One value of the checkpointed state, as the index records it."""

    fqn: str
    shape: tuple[int, ...] | None
    """Global shape; None for a non-tensor value."""
    dtype: str | None
    """``str(torch.dtype)`` without the ``torch.`` prefix; None for a non-tensor value."""

    def to_json(self) -> list[Any]:
        return [self.fqn, None if self.shape is None else list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, obj: Any) -> TensorEntry:
        fqn, shape, dtype = obj
        return cls(fqn, None if shape is None else tuple(int(x) for x in shape), dtype)

    def describe(self) -> str:
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

    def rank_dir(self, checkpoint_dir: str, rank: int) -> str:
        return os.path.join(checkpoint_dir, self.rank_dir_pattern.format(rank=rank))

    def runs(self, fqn: str) -> tuple[Any, ...] | None:
        """The shard runs of a sharded model tensor (None if the index has none for ``fqn``)."""
        from fastinit.plan.layout import ShardRun

        raw = self.sharded.get(fqn)
        return None if raw is None else tuple(ShardRun.from_json(r) for r in raw)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.world_size,
            "rank_dir": self.rank_dir_pattern,
            "replicated_dir": REPLICATED_DIR,
            "fingerprint": self.fingerprint,
            "model": [e.to_json() for e in self.model],
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
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise CheckpointError(f"{where} is not a fastinit checkpoint index")
        if obj.get("version") != VERSION:
            raise CheckpointError(
                f"{where}: index format version {obj.get('version')!r}, this fastinit reads {VERSION}"
            )
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
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: malformed index ({type(e).__name__}: {e})") from None

    def decoded_plan(self) -> Any:
        """The stored ShardingPlan (decoded with fastinit's codec), or None."""
        if self.plan is None:
            return None
        from fastinit.plan.codec import decode_plan

        return decode_plan(self.plan)


def rank_dir(checkpoint_dir: str, rank: int) -> str:
    """The directory holding rank ``rank``'s shards and per-rank metadata."""
    return os.path.join(checkpoint_dir, RANK_DIR_PATTERN.format(rank=rank))


def _fsync_dir(path: str) -> None:
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


def write_json_atomic(path: str, obj: Any) -> bytes:
    """Write ``obj`` as JSON to ``path`` atomically (tmp file, fsync, rename, fsync dir)."""
    data = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")
    return data


def write_index(checkpoint_dir: str, index: Index) -> str:
    """Write the index (not yet committed); returns the SHA-256 of its bytes."""
    data = write_json_atomic(os.path.join(checkpoint_dir, INDEX_FILE), index.to_json())
    return hashlib.sha256(data).hexdigest()


def commit(checkpoint_dir: str, index_sha256: str, world_size: int) -> None:
    """Write the commit marker, last: from now on the checkpoint is complete."""
    write_json_atomic(
        os.path.join(checkpoint_dir, COMMIT_FILE),
        {"format": FORMAT, "index_sha256": index_sha256, "world_size": world_size},
    )


def is_committed(checkpoint_dir: str) -> bool:
    return os.path.exists(os.path.join(checkpoint_dir, COMMIT_FILE))


def is_fastinit_checkpoint(checkpoint_dir: str) -> bool:
    """True if ``checkpoint_dir`` holds a fastinit index (committed or not)."""
    return os.path.exists(os.path.join(checkpoint_dir, INDEX_FILE)) or is_committed(checkpoint_dir)


def read_index(checkpoint_dir: str) -> Index:
    """The index of a committed checkpoint.

    Raises:
        CheckpointError: no index, no commit marker (a torn save), or a marker that does not
            name this index (a save that was interrupted while replacing an older one).
    """
    index_path = os.path.join(checkpoint_dir, INDEX_FILE)
    commit_path = os.path.join(checkpoint_dir, COMMIT_FILE)
    if not os.path.exists(commit_path):
        raise CheckpointError(
            f"{checkpoint_dir} is not a committed fastinit checkpoint: no {COMMIT_FILE} "
            "(the save did not finish on every rank; load an earlier checkpoint)"
        )
    try:
        with open(index_path, "rb") as f:
            data = f.read()
        with open(commit_path, "rb") as f:
            marker = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{checkpoint_dir}: cannot read the index ({e})") from None
    digest = hashlib.sha256(data).hexdigest()
    if not isinstance(marker, dict) or marker.get("index_sha256") != digest:
        raise CheckpointError(
            f"{checkpoint_dir}: the commit marker does not name this index "
            "(a torn or tampered checkpoint)"
        )
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise CheckpointError(f"{index_path}: not JSON ({e})") from None
    return Index.from_json(obj, index_path)


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
