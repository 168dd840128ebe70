"""A synthetic Criteo-style dataset on disk and the data pipeline that reads it.

The benchmark's data pipeline is real: DataLoader worker processes open files, decode them and
build :class:`fastinit.testing.models.Batch` objects (dense features, a KeyedJaggedTensor of id
lists, labels). The files are generated once per model into a cache directory (not timed) and
reused by every run.

Layout of one dataset directory (one per :class:`DatasetConfig`, named by its digest)::

    part-00000.npz   dense [R, F] float32, labels [R] float32,
                     lengths [T, R] int32 (feature-major, as a KJT), values [sum] int32
    ...
    DONE             written last: the directory is complete

Example::

    root = ensure_dataset(DatasetConfig(spec=spec), "bench-out/data")
    loader = make_loader(root, DataConfig(batch_size=256, num_workers=2))
    first = next(iter(loader))
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from torch.utils.data import IterableDataset

if TYPE_CHECKING:
    from fastinit.testing.models import ModelSpec

__all__ = ["DatasetConfig", "DataConfig", "ensure_dataset", "CriteoFiles", "make_loader"]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class DatasetConfig:
    """What is generated."""

    spec: ModelSpec
    """The model the data feeds: features, table rows, dense width, mean pooling."""
    num_files: int = 4
    """Files in the dataset (each DataLoader worker reads its share)."""
    rows_per_file: int = 1024
    """Samples per file."""
    seed: int = 0
    """Generator seed."""

    def __post_init__(self) -> None:
        if self.num_files < 1 or self.rows_per_file < 1:
            raise ValueError("num_files and rows_per_file must be >= 1")

    def digest(self) -> str:
        """A short digest naming the dataset directory."""
        blob = json.dumps(
            [repr(self.spec), self.num_files, self.rows_per_file, self.seed, 1]
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig:
    """How the pipeline reads it."""

    batch_size: int = 256
    """Samples per batch (per rank)."""
    num_workers: int = 1
    """DataLoader worker processes per rank."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead."""
    context: str = "spawn"
    """Multiprocessing start method of the workers ("spawn": safe with the threads of a
    concurrent start-up; "fork" only when nothing else runs)."""

    def __post_init__(self) -> None:
        if self.batch_size < 2:
            raise ValueError(f"batch_size must be >= 2, got {self.batch_size}")
        if self.num_workers < 1:
            raise ValueError("the pipeline needs at least one worker process")


def _features(spec: ModelSpec) -> tuple[list[str], list[int]]:
    """Unweighted feature names (EBC then EC, the model's order) and their table rows."""
    from fastinit.testing.models import table_configs

    configs = table_configs(spec)
    if configs["wbc"]:
        raise ValueError("the benchmark dataset has no weighted features")
    names: list[str] = []
    rows: list[int] = []
    for c in configs["ebc"] + configs["ec"]:
        for f in c.feature_names:
            names.append(f)
            rows.append(int(c.num_embeddings))
    return names, rows


def _generate_file(path: str, spec: ModelSpec, rows: list[int], n: int, seed: int) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    t = len(rows)
    p = 1.0 / (1.0 + spec.pooling)
    lengths = (rng.geometric(p, size=(t, n)) - 1).astype(np.int32)
    per_table = lengths.sum(axis=1)
    highs = np.repeat(np.asarray(rows, dtype=np.int64), per_table)
    values = (rng.random(int(per_table.sum())) * highs).astype(np.int32)
    dense = rng.standard_normal((n, spec.dense_in), dtype=np.float32)
    labels = (rng.random(n) < 0.25).astype(np.float32)
    np.savez(path, dense=dense, labels=labels, lengths=lengths, values=values)


def ensure_dataset(config: DatasetConfig, root: str) -> str:
    """The dataset directory for ``config`` under ``root``, generated on first use.

    Generation goes to a temporary directory renamed into place, so concurrent callers and
    interrupted runs never see a partial dataset.
    """
    path = os.path.join(root, f"criteo-{config.digest()}")
    if os.path.exists(os.path.join(path, "DONE")):
        return path
    os.makedirs(root, exist_ok=True)
    _, rows = _features(config.spec)
    tmp = tempfile.mkdtemp(dir=root, prefix=".gen-")
    try:
        for i in range(config.num_files):
            _generate_file(
                os.path.join(tmp, f"part-{i:05d}.npz"),
                config.spec,
                rows,
                config.rows_per_file,
                config.seed * 1_000_003 + i,
            )
        with open(os.path.join(tmp, "DONE"), "w") as f:
            f.write(json.dumps({"spec": repr(config.spec), "files": config.num_files}))
        try:
            os.rename(tmp, path)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


class CriteoFiles(IterableDataset):
    """Endless batches read from a dataset directory; each worker of each rank reads its own
    share of the files (round-robin over rank x worker), cycling.

    Args:
        path: the dataset directory (:func:`ensure_dataset`).
        spec: the model spec (feature names).
        batch_size: samples per batch.
        rank: this trainer rank; world_size: ranks.
        start: the first batch (a resumed job's position): the loader yields exactly what it
            would after ``start`` batches, and the skipped batches are counted, not built (as a
            stateful data loader resumes).
    """

    def __init__(
        self,
        path: str,
        spec: ModelSpec,
        batch_size: int,
        rank: int,
        world_size: int,
        start: int = 0,
    ) -> None:
        super().__init__()
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self.path = path
        self.spec = spec
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.start = start

    def __iter__(self) -> Iterator[Any]:
        import numpy as np
        import torch
        from torch.utils.data import get_worker_info
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        from fastinit.testing.models import Batch

        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # The DataLoader takes batch n from worker n % workers. Batch n after ``start`` is batch
        # start + n of the whole sequence, which worker (start + n) % workers makes as its
        # ((start + n) // workers)-th: so this worker plays worker (start + worker) % workers and
        # skips its first (start + worker) // workers batches.
        skip = (self.start + worker) // workers
        worker = (self.start + worker) % workers
        files = sorted(f for f in os.listdir(self.path) if f.endswith(".npz"))
        reader = self.rank * workers + worker
        readers = self.world_size * workers
        mine = [f for i, f in enumerate(files) if i % readers == reader % len(files)] or files
        names, _ = _features(self.spec)
        b = self.batch_size
        while True:
            for name in mine:
                with np.load(os.path.join(self.path, name)) as data:
                    batches = len(range(0, len(data["labels"]) - b + 1, b))  # as the loop below
                    if skip >= batches:  # a file whose batches are all skipped: not read
                        skip -= batches
                        continue
                    dense, labels = data["dense"], data["labels"]
                    lengths, values = data["lengths"], data["values"]
                t, n = lengths.shape
                offsets = np.zeros(t * n + 1, dtype=np.int64)
                np.cumsum(lengths.reshape(-1), out=offsets[1:])
                for s in range(0, n - b + 1, b):
                    if skip:
                        skip -= 1
                        continue
                    e = s + b
                    idx = [(offsets[i * n + s], offsets[i * n + e]) for i in range(t)]
                    vals = np.concatenate([values[lo:hi] for lo, hi in idx])
                    yield Batch(
                        dense=torch.from_numpy(dense[s:e].copy()),
                        sparse=KeyedJaggedTensor(
                            keys=names,
                            values=torch.from_numpy(vals.astype(np.int64)),
                            lengths=torch.from_numpy(lengths[:, s:e].reshape(-1).astype(np.int64)),
                        ),
                        weighted=None,
                        labels=torch.from_numpy(labels[s:e].copy()),
                    )


def make_loader(
    path: str,
    spec: ModelSpec,
    config: DataConfig,
    rank: int = 0,
    world_size: int = 1,
    start: int = 0,
) -> Any:
    """A ``torch.utils.data.DataLoader`` over the dataset (batches are built by the workers),
    from batch ``start`` on."""
    from torch.utils.data import DataLoader

    return DataLoader(
        CriteoFiles(path, spec, config.batch_size, rank, world_size, start),
        batch_size=None,
        num_workers=config.num_workers,
        prefetch_factor=config.prefetch_factor,
        multiprocessing_context=config.context,
        persistent_workers=False,
    )
