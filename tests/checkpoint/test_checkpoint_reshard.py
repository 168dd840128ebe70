"""fastinit.checkpoint's overlap arithmetic and index format, without processes."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest


def _shards(runs: Any) -> list[tuple[int, int | None, tuple[int, ...], tuple[int, ...]]]:
    out = []
    base = 0
    for run in runs:
        for j in range(run.count):
            out.append((base + j, run.rank_at(j), tuple(run.offsets_at(j)), run.sizes))
        base += run.count
    return out


def _brute(runs: Any, off: tuple[int, ...], size: tuple[int, ...]) -> list[int]:
    from fastinit.checkpoint.reshard import overlap_volume

    return [i for i, _, o, s in _shards(runs) if overlap_volume(off, size, o, s) > 0]


def _layouts() -> list[tuple[str, Any]]:
    from torch.distributed._shard.metadata import ShardMetadata

    from fastinit.plan.layout import runs_of

    def md(offsets: list[int], sizes: list[int], rank: int) -> Any:
        return ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=f"rank:{rank}/cpu")

    rows, dim = 103, 16
    rw = [md([min(26 * r, rows), 0], [max(0, min(26, rows - 26 * r)), dim], r) for r in range(6)]
    cw = [md([0, 4 * r], [rows, 4], 2 + r) for r in range(4)]
    twrw = [md([52 * r, 0], [min(52, rows - 52 * r), dim], 4 + r) for r in range(2)]
    grid = [
        md([52 * (r // 2), 8 * (r % 2)], [min(52, rows - 52 * (r // 2)), 8], r) for r in range(4)
    ]
    tw = [md([0, 0], [rows, dim], 3)]
    rev = [md([80 - 20 * r, 0], [20, dim], r) for r in range(5)]  # offsets decreasing with rank
    return [
        (name, runs_of(shards))
        for name, shards in (
            ("row_wise", rw),
            ("column_wise", cw),
            ("table_row_wise", twrw),
            ("grid", grid),
            ("table_wise", tw),
            ("reversed", rev),
        )
    ]


@pytest.mark.parametrize("case", range(6))
def test_overlapping_matches_brute_force(case: int) -> None:
    from fastinit.checkpoint.reshard import overlapping

    name, runs = _layouts()[case]
    rng = random.Random(case)
    chunks = [((0, 0), (103, 16)), ((26, 0), (26, 16)), ((0, 4), (103, 4)), ((100, 15), (3, 1))]
    for _ in range(200):
        a, b = rng.randrange(0, 103), rng.randrange(0, 16)
        chunks.append(((a, b), (rng.randrange(1, 104 - a), rng.randrange(1, 17 - b))))
    for off, size in chunks:
        got = [s.index for s in overlapping(runs, off, size)]
        assert sorted(got) == _brute(runs, off, size), (name, off, size)


def test_shards_of_rank_and_overlaps_are_not_linear_in_world_size() -> None:
    from torch.distributed._shard.metadata import ShardMetadata

    from fastinit.checkpoint.reshard import overlapping, shards_of_rank
    from fastinit.plan.layout import runs_of

    n, rows = 8192, 8192 * 10 + 3
    block = -(-rows // n)
    shards = [
        ShardMetadata(
            [min(block * r, rows), 0], [max(0, min(block, rows - block * r)), 8], f"rank:{r}/cpu"
        )
        for r in range(n)
    ]
    runs = runs_of(shards)
    assert len(runs) <= 3
    new = (rows // 2, 0), (2 * block, 8)  # a new rank's chunk (world size halved)
    got = list(overlapping(runs, *new))
    assert [s.index for s in got] == _brute(runs, *new)
    assert len(got) in (2, 3)
    (mine,) = shards_of_rank(runs, 4097)
    assert mine.offsets == (block * 4097, 0)


def test_index_round_trips_and_rejects_torn_tampered_and_taken(tmp_path: Any) -> None:
    import os

    from fastinit.checkpoint import commit as commits
    from fastinit.checkpoint import format as fmt
    from fastinit.checkpoint.digest import digest

    entries = [
        fmt.TensorEntry("model.a", (4, 2), "float32"),
        fmt.TensorEntry("model.b", None, None),
    ]
    save_id = "ab" * 16
    index = fmt.Index(
        world_size=4,
        rank_dir_pattern=fmt.RANK_DIR_PATTERN,
        model=entries,
        fingerprint=fmt.fingerprint(entries),
        sharded={"model.a": [[2, [2, 2], [0, 0], [2, 0], 0, 1, "cpu", 0]]},
        replicated=["model.b"],
        optimizers=["optim"],
        plan=b"FIPLAN\x00\x00\x02{}",
        plan_sha256="x",
        step=3,
        metadata={"k": [1, 2]},
        save_id=save_id,
    )
    d = str(tmp_path)
    os.makedirs(os.path.join(d, index.data_dir))
    path = os.path.join(d, index.data_dir, fmt.INDEX_FILE)
    data = fmt.write_json_atomic(path, index.to_json())
    with pytest.raises(fmt.CheckpointError, match="no fastinit-commit.json"):
        fmt.read_index(d)
    marker = os.path.join(d, fmt.COMMIT_FILE)
    open(marker, "w").close()  # an empty marker: incomplete, never committed
    with pytest.raises(fmt.CheckpointError, match="is empty"):
        fmt.read_index(d)
    os.remove(marker)
    kwargs = {"manifests": ["0" * 32] * 4, "replicated": "1" * 32, "torch_version": "t", "job": "j"}
    commits.commit(d, save_id, index_digest=digest(data), **kwargs)
    commits.commit(d, save_id, index_digest=digest(data), **kwargs)  # the same save: idempotent
    with pytest.raises(commits.Taken, match="committed by another save"):
        commits.commit(d, "cd" * 16, index_digest=digest(data), **kwargs)
    back = fmt.read_index(d)
    assert back.to_json() == index.to_json() and back.plan == index.plan
    assert [r.rank_at(1) for r in back.runs("model.a")] == [1]
    with open(path) as f:
        obj = json.load(f)
    obj["world_size"] = 8
    with open(path, "w") as f:
        json.dump(obj, f)
    with pytest.raises(fmt.CheckpointError, match="does not match the digest the commit recorded"):
        fmt.read_index(d)
    other = [fmt.TensorEntry("model.a", (4, 3), "float32"), entries[1]]
    msg = fmt.first_mismatch(entries, other)
    assert msg is not None and "'model.a'" in msg and "[4, 2]" in msg
    assert fmt.first_mismatch(entries, entries) is None
