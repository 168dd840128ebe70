"""PlanCache: round trips, corrupt and foreign entries, unwritable directories, concurrent writers."""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchrec")

from torchrec.distributed.types import (  # noqa: E402
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)

from fastinit import knobs  # noqa: E402
from fastinit.errors import PlanMismatchError  # noqa: E402
from fastinit.plan.cache import (  # noqa: E402
    FastinitCacheWarning,
    PlanCache,
    plan_bytes_bound,
    resolve_cache_dir,
)
from fastinit.plan.codec import encode_plan  # noqa: E402
from fastinit.testing.models import SHARDING_TYPES, ModelSpec, build_model, build_plan  # noqa: E402

KEY = bytes(range(32))
OTHER = bytes(range(1, 33))


@pytest.fixture(scope="module")
def plan() -> ShardingPlan:
    model = build_model(
        ModelSpec(num_tables=7, num_ec_tables=7, num_weighted_tables=2, fp16_every=3),
        device="meta",
    )
    return build_plan(model, list(SHARDING_TYPES), world_size=4, local_world_size=2)


def _small_plan(rank: int) -> ShardingPlan:
    mp = EmbeddingModuleShardingPlan()
    mp["t0"] = ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[rank])
    return ShardingPlan({"ebc": mp})


def _get_quietly(cache: PlanCache, key: bytes) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        return cache.get(key)


def test_round_trip_and_layout(tmp_path: Path, plan: ShardingPlan) -> None:
    directory = tmp_path / "a" / "b"
    cache = PlanCache(directory)
    assert _get_quietly(cache, KEY) is None  # the directory does not exist yet
    assert cache.put(KEY, plan)
    assert os.listdir(directory) == [KEY.hex() + ".fiplan"]
    got = _get_quietly(cache, KEY)
    assert got is not None and encode_plan(got) == encode_plan(plan)
    assert _get_quietly(cache, OTHER) is None
    assert _get_quietly(PlanCache(str(directory)), KEY) is not None  # str paths too
    data = (directory / (KEY.hex() + ".fiplan")).read_bytes()
    assert data.startswith(b"FIPCACHE") and KEY in data and encode_plan(plan) in data


def test_same_entry_is_not_rewritten(tmp_path: Path, plan: ShardingPlan) -> None:
    cache = PlanCache(tmp_path)
    assert cache.put(KEY, plan)
    before = os.stat(cache.path(KEY)).st_ino
    assert cache.put(KEY, plan)
    assert os.stat(cache.path(KEY)).st_ino == before
    assert cache.put(KEY, _small_plan(1))  # a different plan for the key replaces it
    assert os.stat(cache.path(KEY)).st_ino != before
    assert encode_plan(_get_quietly(cache, KEY)) == encode_plan(_small_plan(1))


def _corruptions(entry: bytes, other_entry: bytes) -> dict[str, bytes]:
    payload_start = len(entry) - len(encode_plan(_small_plan(0)))
    flipped = bytearray(entry)
    flipped[-5] ^= 0xFF
    # a well-formed envelope (right key, right checksum) around bytes the codec rejects
    import hashlib
    import struct

    junk = b"FIPLAN\x00\x00\x01{}"
    envelope = (
        entry[: payload_start - 40]
        + struct.pack(">32sQ", hashlib.sha256(junk).digest(), len(junk))
        + junk
    )
    return {
        "empty": b"",
        "truncated header": entry[:10],
        "truncated payload": entry[:-7],
        "bad checksum": bytes(flipped),
        "wrong magic": b"NOTCACHE" + entry[8:],
        "wrong version": entry[:8] + b"\x00\x09" + entry[10:],
        "foreign key": other_entry,
        "undecodable payload": envelope,
        "trailing bytes": entry + b"x",
    }


def test_corrupt_entries_are_ignored_with_a_warning_and_replaced(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    assert cache.put(KEY, _small_plan(0)) and cache.put(OTHER, _small_plan(1))
    entry = Path(cache.path(KEY)).read_bytes()
    other_entry = Path(cache.path(OTHER)).read_bytes()
    for what, data in _corruptions(entry, other_entry).items():
        Path(cache.path(KEY)).write_bytes(data)
        with pytest.warns(FastinitCacheWarning, match=KEY.hex()) as record:
            assert cache.get(KEY) is None, what
        assert len(record) == 1, what
        assert cache.put(KEY, _small_plan(0)), what
        assert Path(cache.path(KEY)).read_bytes() == entry, what
        assert encode_plan(_get_quietly(cache, KEY)) == encode_plan(_small_plan(0)), what


def test_unwritable_directory_warns_and_returns_false(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cache = PlanCache(blocker / "cache")
    with pytest.warns(FastinitCacheWarning, match="cannot write"):
        assert cache.put(KEY, _small_plan(0)) is False
    assert _get_quietly(cache, KEY) is None
    assert blocker.read_text() == "not a directory"
    if os.geteuid() != 0:  # root ignores permission bits
        readonly = tmp_path / "ro"
        readonly.mkdir(mode=0o500)
        with pytest.warns(FastinitCacheWarning):
            assert PlanCache(readonly).put(KEY, _small_plan(0)) is False


def test_entry_path_that_is_a_directory(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    os.mkdir(cache.path(KEY))
    with pytest.warns(FastinitCacheWarning):
        assert cache.get(KEY) is None
    with pytest.warns(FastinitCacheWarning):
        assert cache.put(KEY, _small_plan(0)) is False
    assert os.path.isdir(cache.path(KEY))
    assert os.listdir(tmp_path) == [KEY.hex() + ".fiplan"]  # no temporary file left behind


def test_other_files_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "abcd.fiplan.bak").write_bytes(b"junk")
    cache = PlanCache(tmp_path)
    for rank in range(3):
        assert cache.put(KEY, _small_plan(rank))
        assert cache.put(OTHER, _small_plan(rank))
    _get_quietly(cache, KEY)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "abcd.fiplan.bak").read_bytes() == b"junk"
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["notes.txt", "abcd.fiplan.bak", KEY.hex() + ".fiplan", OTHER.hex() + ".fiplan"]
    )


def test_bad_keys(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    for key in (b"", b"x" * 65, "text"):
        with pytest.raises(ValueError):
            cache.get(key)  # type: ignore[arg-type]


def _writer(directory: str, worker: int, rounds: int, big: ShardingPlan) -> None:
    cache = PlanCache(directory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(rounds):  # alternate plans, so that every put writes
            assert cache.put(KEY, big if (worker + i) % 2 else _small_plan(worker))


def test_concurrent_writers_of_one_key(tmp_path: Path, plan: ShardingPlan) -> None:
    ctx = multiprocessing.get_context("fork")  # torch and torchrec are already imported here
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 60, plan)) for w in range(4)]
    for p in procs:
        p.start()
    cache = PlanCache(tmp_path)
    valid = {encode_plan(plan)} | {encode_plan(_small_plan(r)) for r in range(4)}
    seen = 0
    while any(p.is_alive() for p in procs) or seen == 0:
        got = _get_quietly(cache, KEY)  # never torn, never corrupt
        if got is not None:
            assert encode_plan(got) in valid
            seen += 1
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert os.listdir(tmp_path) == [KEY.hex() + ".fiplan"]  # every temporary file was moved
    assert encode_plan(_get_quietly(cache, KEY)) in valid


def test_resolve_cache_dir(tmp_path: Path) -> None:
    with knobs.override(FASTINIT_PLAN_CACHE=str(tmp_path / "env")):
        assert resolve_cache_dir(tmp_path / "explicit") == str(tmp_path / "explicit")
        assert resolve_cache_dir(None) == str(tmp_path / "env")
    with knobs.override(FASTINIT_PLAN_CACHE=None):
        assert resolve_cache_dir(None) is None


# -- a cached plan is a hint: special files, size bounds, plans that do not fit --------------------


def _peak_allocation_mb(fn: Any) -> float:
    """The most memory Python allocated while ``fn`` ran, in MiB (tracemalloc: independent of
    what the process held before)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / (1 << 20)
    finally:
        tracemalloc.stop()


@pytest.mark.timeout(60)
def test_fifo_at_an_entry_is_a_miss_not_a_hang_and_is_replaced(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    os.mkfifo(cache.path(KEY))
    with pytest.warns(FastinitCacheWarning, match="not a regular file") as record:
        assert cache.get(KEY) is None  # before: open() waits for a writer forever
    assert len(record) == 1
    assert cache.put(KEY, _small_plan(0))  # before: put's read-back hung the same way
    assert Path(cache.path(KEY)).is_file()
    assert encode_plan(_get_quietly(cache, KEY)) == encode_plan(_small_plan(0))


@pytest.mark.timeout(60)
def test_symlink_to_dev_zero_is_a_miss_and_is_replaced(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    os.symlink("/dev/zero", cache.path(KEY))
    with pytest.warns(FastinitCacheWarning, match="symbolic link") as record:
        assert cache.get(KEY) is None  # before: read() of /dev/zero without end
    assert len(record) == 1
    assert cache.put(KEY, _small_plan(1))
    assert not os.path.islink(cache.path(KEY))
    assert encode_plan(_get_quietly(cache, KEY)) == encode_plan(_small_plan(1))


def test_symlink_to_a_valid_entry_is_not_followed(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path / "c")
    assert cache.put(KEY, _small_plan(0))
    elsewhere = tmp_path / "elsewhere.fiplan"
    os.replace(cache.path(KEY), elsewhere)
    os.symlink(elsewhere, cache.path(KEY))
    with pytest.warns(FastinitCacheWarning, match="symbolic link"):
        assert cache.get(KEY) is None
    assert cache.put(KEY, _small_plan(2))
    assert not os.path.islink(cache.path(KEY))
    assert encode_plan(_get_quietly(cache, KEY)) == encode_plan(_small_plan(2))
    assert elsewhere.read_bytes()  # the link's target is left alone


@pytest.mark.timeout(120)
def test_huge_sparse_file_is_rejected_before_it_is_read(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    with open(cache.path(KEY), "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse: no disk used

    def check() -> None:
        with pytest.warns(FastinitCacheWarning, match="more than the bound"):
            assert cache.get(KEY) is None
        with pytest.warns(FastinitCacheWarning, match="more than the bound"):
            assert cache.get(KEY, max_bytes=plan_bytes_bound(16, 4)) is None

    grown = _peak_allocation_mb(check)
    assert grown < 64, f"reading a 1 GiB entry allocated {grown:.0f} MiB"  # before: 1-2 GiB
    assert cache.put(KEY, _small_plan(0))
    assert os.path.getsize(cache.path(KEY)) < 4096


def test_an_entry_over_the_callers_bound_is_a_miss(tmp_path: Path, plan: ShardingPlan) -> None:
    cache = PlanCache(tmp_path)
    assert cache.put(KEY, plan)
    size = os.path.getsize(cache.path(KEY))
    assert _get_quietly_bounded(cache, KEY, size) is not None  # exactly the bound: read
    with pytest.warns(FastinitCacheWarning, match=f"{size} bytes, more than the bound of 100"):
        assert cache.get(KEY, max_bytes=100) is None


def _get_quietly_bounded(cache: PlanCache, key: bytes, max_bytes: int) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return cache.get(key, max_bytes=max_bytes)


def test_plan_bytes_bound_is_generous_for_real_plans(plan: ShardingPlan) -> None:
    # The 16-table model of the `plan` fixture, every sharding type, 4 ranks.
    assert len(encode_plan(plan)) * 20 < plan_bytes_bound(16, 4)
    big = build_model(ModelSpec(num_tables=64, num_ec_tables=0), device="meta")
    rw = build_plan(big, ["row_wise"], world_size=64, local_world_size=8)
    assert len(encode_plan(rw)) * 5 < plan_bytes_bound(64, 64)
    assert plan_bytes_bound(16, 4) < plan_bytes_bound(17, 4) < plan_bytes_bound(17, 5)
    assert plan_bytes_bound(16, 4) < 8 << 20  # a 1 GiB file is far outside it


def test_a_plan_that_does_not_fit_is_a_miss_and_is_replaced(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    foreign = _small_plan(5)  # a valid entry under this key, naming rank 5
    assert cache.put(KEY, foreign)
    calls: list[ShardingPlan] = []

    def fits_world_of_two(p: ShardingPlan) -> None:
        calls.append(p)
        ranks = [r for mp in p.plan.values() for ps in mp.values() for r in ps.ranks or []]
        if any(r >= 2 for r in ranks):
            raise PlanMismatchError(f"rank {max(ranks)} is outside the world of 2")

    with pytest.warns(FastinitCacheWarning, match="does not fit.*rank 5 is outside") as record:
        assert cache.get(KEY, accept=fits_world_of_two) is None  # before: every rank raised
    assert len(record) == 1 and len(calls) == 1
    assert cache.put(KEY, _small_plan(1))  # re-planned: the entry is replaced
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = cache.get(KEY, accept=fits_world_of_two)
    assert again is not None and encode_plan(again) == encode_plan(_small_plan(1))


def test_accept_errors_other_than_a_mismatch_propagate(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    assert cache.put(KEY, _small_plan(0))

    def broken(p: ShardingPlan) -> None:
        raise RuntimeError("a bug in the caller")

    with pytest.raises(RuntimeError, match="a bug in the caller"):
        cache.get(KEY, accept=broken)


def test_a_foreign_models_plan_is_rejected_by_validate_plan(tmp_path: Path) -> None:
    from torchrec.distributed.sharding_plan import get_default_sharders

    from fastinit.plan.validate import count_tables, validate_plan

    ours = build_model(ModelSpec(num_tables=3, num_ec_tables=0), device="meta")
    theirs = build_model(ModelSpec(num_tables=5, num_ec_tables=0), device="meta")
    sharders = get_default_sharders()
    cache = PlanCache(tmp_path)
    assert cache.put(KEY, build_plan(theirs, ["table_wise"], world_size=2))
    bound = plan_bytes_bound(count_tables(ours, sharders), 2)
    with pytest.warns(FastinitCacheWarning, match="does not fit") as record:
        got = cache.get(KEY, accept=lambda p: validate_plan(ours, p, sharders, 2), max_bytes=bound)
    assert got is None and len(record) == 1


def _foreign_entries(cache_dir: str) -> dict[str, Any]:
    """On every rank: a valid entry under setup's key that holds a plan that does not fit."""
    import torch.distributed as dist

    import fastinit

    rank = dist.get_rank()
    spec = ModelSpec(num_tables=4, num_ec_tables=0)
    out: dict[str, Any] = {}
    fastinit.setup(build_model(spec, device="meta"), plan_cache=cache_dir, seed=1)
    dist.barrier()
    (name,) = [n for n in os.listdir(cache_dir) if n.endswith(".fiplan")]
    key = bytes.fromhex(name[: -len(".fiplan")])
    cache = PlanCache(cache_dir)
    good = cache.get(key)
    assert good is not None
    other = build_model(ModelSpec(num_tables=6, num_ec_tables=0), device="meta")
    foreign = {
        "another model": build_plan(other, ["table_wise"], world_size=2),
        "a rank outside the world": build_plan(
            build_model(spec, device="meta"), ["table_wise"], world_size=4
        ),
    }
    for what, plan in foreign.items():
        dist.barrier()
        if rank == 0:
            assert cache.put(key, plan)
        dist.barrier()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = fastinit.setup(build_model(spec, device="meta"), plan_cache=cache_dir, seed=1)
        fits = [str(w.message) for w in caught if "does not fit" in str(w.message)]
        out[what] = len(fits)
        assert type(model).__name__ == "DistributedModelParallel"
        dist.barrier()
        replaced = cache.get(key)
        assert replaced is not None and encode_plan(replaced) == encode_plan(good), what
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fastinit.setup(build_model(spec, device="meta"), plan_cache=cache_dir, seed=1)
    out["then"] = [str(w.message) for w in caught if issubclass(w.category, FastinitCacheWarning)]
    return out


@pytest.mark.timeout(600)
def test_setup_replans_and_replaces_a_plan_that_does_not_fit(tmp_path: Path) -> None:
    from fastinit.testing.dist import run_ranks

    results = run_ranks(_foreign_entries, 2, args=(str(tmp_path / "c"),), timeout=500)
    for rank, out in enumerate(results):
        # before: every rank raised PlanMismatchError, on every restart, until the file was deleted
        assert out["another model"] == 1 and out["a rank outside the world"] == 1, (rank, out)
        assert out["then"] == [], (rank, out)


def test_an_empty_plan_cache_means_off_like_the_empty_knob(tmp_path: Path) -> None:
    with knobs.override(FASTINIT_PLAN_CACHE=str(tmp_path / "env")):
        assert resolve_cache_dir("") is None  # off: neither the working directory nor the knob
    with knobs.override(FASTINIT_PLAN_CACHE=""):
        assert resolve_cache_dir(None) is None


def test_put_removes_stale_temporaries_of_dead_writers_only(
    tmp_path: Path, plan: ShardingPlan
) -> None:
    from fastinit.plan.cache import STALE_TMP_SECONDS

    old = time.time() - STALE_TMP_SECONDS - 60
    stale = tmp_path / f".{KEY.hex()[:16]}.abc123.tmp"  # a writer SIGKILLed inside put
    fresh = tmp_path / f".{'0' * 16}.def456.tmp"  # a writer still writing
    foreign = tmp_path / "mine.tmp"  # not the cache's
    for p in (stale, fresh, foreign):
        p.write_bytes(b"partial")
    for p in (stale, foreign):
        os.utime(p, (old, old))
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / f".{'1' * 16}.link.tmp"
    link.symlink_to(target)
    os.utime(link, (old, old), follow_symlinks=False)
    cache = PlanCache(tmp_path)
    assert cache.put(KEY, plan)
    assert not stale.exists()
    assert fresh.read_bytes() == foreign.read_bytes() == b"partial"
    assert link.is_symlink() and target.read_bytes() == b"keep"
    # The next put of an entry already in place cleans up too.
    stale.write_bytes(b"partial")
    os.utime(stale, (old, old))
    assert cache.put(KEY, plan)
    assert not stale.exists()
