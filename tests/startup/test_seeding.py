"""fastinit's own initial values: explicit generators only, plan-invariant tables, distinct shards.

Unit tests check the rules in one process. The multi-rank test builds the same model under a
1-rank table-wise plan and two mixed 4-rank plans ("fused" and "dense" kernels, every sharding
type, EBC and EC, fp16 tables) while a thread draws from the global RNG, and compares what
fastinit made — not stock's values loaded over it.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import pytest
import torch
from torch import nn

from fastinit import seeding
from fastinit.testing.dist import run_ranks

# --------------------------------------------------------------------------------------------
# Unit: the block rule.
# --------------------------------------------------------------------------------------------


def _assemble(size: tuple[int, int], splits: list[tuple[int, int, int, int]], **kw: Any) -> Any:
    """Initialise ``splits`` (row, col, rows, cols) of one table and put them back together."""
    full = torch.full(size, float("nan"), dtype=kw.get("dtype", torch.float32))
    pieces = [(torch.empty(h, w, dtype=full.dtype), r, c) for r, c, h, w in splits]
    seeding.init_table_shards(
        kw.get("init_fn", functools.partial(torch.nn.init.uniform_, a=-0.1, b=0.1)),
        kw.get("fqn", "sparse.ebc.t0"),
        kw.get("seed", 3),
        size,
        full.dtype,
        pieces,
    )
    for t, r, c in pieces:
        full[r : r + t.shape[0], c : c + t.shape[1]] = t
    return full, [t for t, _, _ in pieces]


def _layouts(rows: int, dim: int) -> dict[str, list[tuple[int, int, int, int]]]:
    third = -(-rows // 3)
    return {
        "whole": [(0, 0, rows, dim)],
        "row_wise": [(r, 0, min(third, rows - r), dim) for r in range(0, rows, third)],
        "column_wise": [(0, 0, rows, dim // 2), (0, dim // 2, rows, dim // 2)],
        "grid": [
            (r, c, min(third, rows - r), dim // 2)
            for r in range(0, rows, third)
            for c in (0, dim // 2)
        ],
    }


@pytest.mark.parametrize(
    "init_fn",
    [
        functools.partial(torch.nn.init.uniform_, a=-0.1, b=0.1),
        functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02),
        functools.partial(torch.nn.init.trunc_normal_, std=0.02),
        torch.nn.init.zeros_,
    ],
    ids=["uniform", "normal", "trunc_normal", "zeros"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_any_layout_gathers_to_the_same_table(init_fn: Any, dtype: torch.dtype) -> None:
    rows, dim = 1001, 1024  # 256 rows per block: shards start and end inside blocks
    assert seeding.block_rows(dim) == 256
    tables = {
        name: _assemble((rows, dim), splits, init_fn=init_fn, dtype=dtype)
        for name, splits in _layouts(rows, dim).items()
    }
    whole, _ = tables["whole"]
    assert not torch.isnan(whole).any()
    for name, (table, _) in tables.items():
        assert torch.equal(table, whole), name
    if init_fn is not torch.nn.init.zeros_:
        # Shards are pairwise distinct, and so are the blocks (no block is a copy of another).
        _, grid = tables["grid"]
        for i, a in enumerate(grid):
            for b in grid[i + 1 :]:
                assert a.shape != b.shape or not torch.equal(a, b)
        assert not torch.equal(whole[:256], whole[256:512])
        # A function of (seed, FQN): another seed or another table differs.
        other_seed, _ = _assemble((rows, dim), [(0, 0, rows, dim)], init_fn=init_fn, seed=4)
        other_fqn, _ = _assemble((rows, dim), [(0, 0, rows, dim)], init_fn=init_fn, fqn="x")
        assert not torch.equal(other_seed.to(dtype), whole)
        assert not torch.equal(other_fqn.to(dtype), whole)


def test_shape_dependent_init_runs_per_shard(caplog: pytest.LogCaptureFixture) -> None:
    rows, dim = 64, 16
    with caplog.at_level(logging.INFO, logger="fastinit.seeding"):
        table, pieces = _assemble(
            (rows, dim),
            _layouts(rows, dim)["row_wise"],
            init_fn=torch.nn.init.xavier_uniform_,
            fqn="sparse.ebc.xavier",
        )
    assert not torch.isnan(table).any()
    # Stock semantics (the shard's own shape), from per-shard generators: distinct shards.
    assert not torch.equal(pieces[0], pieces[1])
    bound = (6.0 / (pieces[0].shape[0] + dim)) ** 0.5
    assert pieces[0].abs().max() <= bound
    assert "not plan-invariant" in caplog.text
    again, _ = _assemble(
        (rows, dim),
        _layouts(rows, dim)["row_wise"],
        init_fn=torch.nn.init.xavier_uniform_,
        fqn="sparse.ebc.xavier",
    )
    assert torch.equal(again, table)


# --------------------------------------------------------------------------------------------
# Unit: explicit generators only, on this thread only.
# --------------------------------------------------------------------------------------------


class _Bare(nn.Module):
    """A custom module with a bare parameter and no reset_parameters."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(5, device=device))
        self.register_buffer("steps", torch.empty(2, device=device))


class _Dense(nn.Module):
    def __init__(self, device: str, with_first: bool = True) -> None:
        super().__init__()
        if with_first:
            self.first = nn.Linear(7, 9, device=device)
        self.second = nn.Linear(9, 3, device=device)
        self.norm = nn.LayerNorm(3, device=device)
        self.bare = _Bare(device)
        self.tied = nn.Linear(3, 3, bias=False, device=device)
        self.tied_too = nn.Linear(3, 3, bias=False, device=device)
        self.tied_too.weight = self.tied.weight


def _materialized(seed: int, with_first: bool = True) -> dict[str, torch.Tensor]:
    model = _Dense("meta", with_first)
    seeding.materialize_dense(model, [], torch.device("cpu"), seed)
    assert model.tied.weight is model.tied_too.weight  # ties survive
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _Background:
    """A thread running ``_step`` until the ``with`` block ends."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _step(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self.stop.is_set():
            self._step()

    def __enter__(self) -> Any:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class _GlobalDrawer(_Background):
    """A thread that draws from the global RNG until stopped, as a data pipeline would."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = 0

    def _step(self) -> None:
        torch.rand(64)
        self.draws += 1


def test_materialize_dense_uses_explicit_generators(caplog: pytest.LogCaptureFixture) -> None:
    state = torch.get_rng_state()
    with caplog.at_level(logging.WARNING, logger="fastinit.seeding"):
        quiet = _materialized(seed=11)
    assert torch.equal(torch.get_rng_state(), state), "setup drew from the global RNG"
    with _GlobalDrawer() as drawer:
        busy = _materialized(seed=11)
    assert drawer.draws > 0
    assert quiet.keys() == busy.keys()
    for key in quiet:
        assert torch.equal(quiet[key], busy[key]), key
    # Per-tensor generators: a parameter's value does not depend on the modules before it.
    without_first = _materialized(seed=11, with_first=False)
    assert torch.equal(without_first["second.weight"], quiet["second.weight"])
    assert not torch.equal(_materialized(seed=12)["second.weight"], quiet["second.weight"])
    # No initialiser: zero, and said so.
    assert torch.equal(quiet["bare.scale"], torch.zeros(5))
    assert torch.equal(quiet["bare.steps"], torch.zeros(2))
    assert "bare.scale" in caplog.text
    # reset_parameters ran: LayerNorm's ones, Linear's kaiming bound.
    assert torch.equal(quiet["norm.weight"], torch.ones(3))
    assert 0 < quiet["first.weight"].abs().max() <= 1 / 7**0.5


def _nine_random_draws() -> list[torch.Tensor]:
    """One draw from each kind of random op: factories, in-place fills, a sampling op."""
    return [
        torch.rand(3),
        torch.randn(3),
        torch.randint(0, 100, (3,)),
        torch.randperm(5),
        torch.empty(3).uniform_(),
        torch.empty(3).normal_(),
        torch.empty(3).random_(0, 9),
        torch.empty(3).exponential_(),
        torch.bernoulli(torch.full((3,), 0.5)),
    ]


def test_explicit_rng_is_thread_local_and_fills_every_random_op() -> None:
    expected = torch.Generator().manual_seed(5)
    seen: list[torch.Tensor] = []
    entered, drawn = threading.Event(), threading.Event()

    def other() -> None:
        entered.wait()
        torch.manual_seed(5)  # the other thread owns the global RNG
        seen.append(torch.rand(4))
        drawn.set()

    t = threading.Thread(target=other)
    t.start()
    with seeding.scratch_rng(1, "x"):
        entered.set()
        drawn.wait()
        ours = _nine_random_draws()
    t.join()
    assert torch.equal(seen[0], torch.rand(4, generator=expected))
    state = torch.get_rng_state()
    with seeding.scratch_rng(1, "x"):
        again = _nine_random_draws()
    assert torch.equal(torch.get_rng_state(), state)
    for a, b in zip(ours, again, strict=True):
        assert torch.equal(a, b)
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


# --------------------------------------------------------------------------------------------
# Multi-rank: the same tables under every plan and world size, agreement, no class changed.
# --------------------------------------------------------------------------------------------

SPEC = {"num_tables": 6, "num_weighted_tables": 2, "num_ec_tables": 3, "fp16_every": 3}
EBC_CYCLE = [
    "row_wise",
    "column_wise",
    "table_row_wise",
    "grid_shard",
    "table_column_wise",
    "data_parallel",
]
EC_CYCLE = ["row_wise", "column_wise", "data_parallel"]


def _class_state() -> dict[str, dict[str, Any]]:
    import inspect

    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    out = {}
    for cls in (ShardedTensor, ShardedEmbeddingCollection, ShardedEmbeddingBagCollection):
        out[cls.__name__] = {
            k: (id(v), type(inspect.getattr_static(cls, k)).__name__) for k, v in vars(cls).items()
        }
    out["init"] = {k: id(v) for k, v in vars(torch.nn.init).items() if callable(v)}
    import importlib

    for name in _WATCHED_MODULES:  # the names TorchRec's own code constructs through
        module = importlib.import_module(name)
        out[name] = {k: id(v) for k, v in vars(module).items() if not k.startswith("__")}
    return out


_WATCHED_MODULES = (
    "torch.distributed._shard.sharded_tensor.api",
    "torchrec.distributed.batched_embedding_kernel",
    "torchrec.distributed.embedding_kernel",
    "torchrec.distributed.embedding_lookup",
    "torchrec.distributed.embedding_sharding",
    "torchrec.distributed.embedding",
    "torchrec.distributed.embeddingbag",
    "torchrec.distributed.sharding.tw_sharding",
    "torchrec.distributed.sharding.rw_sharding",
    "torchrec.distributed.sharding.cw_sharding",
    "torchrec.distributed.sharding.twrw_sharding",
    "torchrec.distributed.sharding.grid_sharding",
)


class _Watcher(_Background):
    """Samples :func:`_class_state` on another thread while setup runs: a class or module
    global swapped even briefly (and restored) shows up as a differing sample."""

    def __init__(self, before: dict[str, Any]) -> None:
        super().__init__()
        self.before = before
        self.samples = 0
        self.changed: list[str] = []

    def _step(self) -> None:
        now = _class_state()
        self.samples += 1
        self.changed += [k for k in self.before if now.get(k) != self.before[k]]
        self.stop.wait(0.001)


def _plan_types(model: Any, world: int, shift: int) -> dict[str, str]:
    from torchrec.modules.embedding_modules import EmbeddingCollection

    types: dict[str, str] = {}
    for _, module in model.named_modules():
        if not hasattr(module, "embedding_bag_configs") and not hasattr(
            module, "embedding_configs"
        ):
            continue
        is_ec = isinstance(module, EmbeddingCollection)
        configs = module.embedding_configs() if is_ec else module.embedding_bag_configs()
        cycle = EC_CYCLE if is_ec else EBC_CYCLE
        for i, config in enumerate(configs):
            types[config.name] = "table_wise" if world == 1 else cycle[(i + shift) % len(cycle)]
    return types


def _build(seed: int, world: int, shift: int, kernel: str = "fused") -> Any:
    import fastinit
    from fastinit.testing.models import ModelSpec, build_model, build_plan

    def model() -> nn.Module:
        m = build_model(ModelSpec(**SPEC), device="meta")
        m.extra = _Bare("meta")  # a bare meta parameter, no reset_parameters
        return m

    plan = build_plan(model(), _plan_types(model(), world, shift), world, compute_kernel=kernel)
    return fastinit.setup(model(), plan=plan, seed=seed)


def _pieces(model: Any) -> dict[str, Any]:
    """Every state_dict entry: a sharded table as its local pieces, anything else whole.

    Also checks that the values written into a table's local shards are the kernel's weights
    (the module's registered parameter), not a copy of them."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out: dict[str, Any] = {}
    state = model.state_dict()
    aliased = 0
    for name, param in model.named_parameters():
        value = state.get(name)
        if isinstance(value, ShardedTensor) and len(value.local_shards()) == 1:
            shard = value.local_shards()[0].tensor
            if shard.numel() and param.numel() == shard.numel():
                assert torch.equal(param.detach().view_as(shard), shard), name
                aliased += 1
    assert aliased, "no table was checked against its kernel's weights"
    for key, value in state.items():
        key = key.replace("_dmp_wrapped_module.", "").replace("module.", "", 1)
        if isinstance(value, ShardedTensor):
            out[key] = (
                tuple(value.size()),
                [(tuple(s.metadata.shard_offsets), _np(s.tensor)) for s in value.local_shards()],
            )
        else:
            out[key] = _np(value)
    return out


def _np(t: torch.Tensor) -> Any:
    # numpy, not tensors: torch pickles tensors as shared memory the exiting rank takes along
    return t.detach().cpu().contiguous().numpy().copy()


def _seeded_ranks(world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from fastinit import trace

    seeding.BLOCK_ELEMENTS = 1 << 11  # 128 rows per block at dim 16: shards cross blocks
    before = _class_state()
    modes = list(_get_current_dispatch_mode_stack())  # the harness's tracer, if any
    out: dict[str, Any] = {}
    with _GlobalDrawer() as drawer, _Watcher(before) as watcher:
        out["busy"] = _pieces(_build(seed=21, world=world, shift=0))
    out["draws"] = drawer.draws
    out["watched"] = (watcher.samples, sorted(set(watcher.changed)))
    if world > 1:
        dist.barrier()
        state = torch.get_rng_state()
        tracer = trace.active()
        assert tracer is not None
        with tracer.window() as counts:
            model = _build(seed=21, world=world, shift=2, kernel="dense")
        out["shifted"] = _pieces(model)
        out["allgathers"] = counts["c10d_ops"].get("allgather_", 0)
        out["rng_unchanged"] = torch.equal(torch.get_rng_state(), state)
    out["classes_unchanged"] = _class_state() == before
    out["no_mode_left"] = list(_get_current_dispatch_mode_stack()) == modes
    return out


def _gather(per_rank: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """Full tables from every rank's pieces (and each table's pieces), replicated values
    checked equal on every rank."""
    tables: dict[str, Any] = {}
    shards: dict[str, list[Any]] = {}
    per_rank = [
        {
            k: (v[0], [(o, torch.from_numpy(a)) for o, a in v[1]])
            if isinstance(v, tuple)
            else torch.from_numpy(v)
            for k, v in values.items()
        }
        for values in per_rank
    ]
    for key, value in per_rank[0].items():
        if isinstance(value, tuple):
            size, _ = value
            dtypes = {t.dtype for values in per_rank for _, t in values[key][1]}
            assert len(dtypes) == 1, (key, dtypes)
            full = torch.full(size, float("nan"), dtype=dtypes.pop())
            shards[key] = []
            for rank_values in per_rank:
                for (r, c), t in rank_values[key][1]:
                    full[r : r + t.shape[0], c : c + t.shape[1]] = t
                    shards[key].append(t)
            tables[key] = full
        else:
            for rank, rank_values in enumerate(per_rank):
                assert torch.equal(rank_values[key], value), f"{key} differs on rank {rank}"
            tables[key] = value
    return tables, shards


def test_tables_are_plan_invariant_and_replicas_agree() -> None:
    one = run_ranks(_seeded_ranks, 1, args=(1,), timeout=300)
    four = run_ranks(_seeded_ranks, 4, args=(4,), local_world_size=2, timeout=400, trace=True)
    for results in (one, four):
        for r in results:
            assert r["classes_unchanged"], "a torch/TorchRec class was changed by setup"
            samples, changed = r["watched"]
            assert samples > 10 and not changed, f"changed while setup ran: {changed}"
            assert r["no_mode_left"]
            assert r["draws"] > 0
    assert all(r["rng_unchanged"] for r in four), "setup drew from or reseeded the global RNG"
    # The EmbeddingCollection's ShardedTensors come from the plan: the start-up record's
    # all_gather is the only one (stock: 2 per sharded EC table).
    assert all(r["allgathers"] == 1 for r in four), [r["allgathers"] for r in four]

    reference, _ = _gather([r["busy"] for r in one])
    for name in ("busy", "shifted"):
        tables, shards = _gather([r[name] for r in four])
        assert tables.keys() == reference.keys()
        for key, table in reference.items():
            assert table.dtype == tables[key].dtype, key
            assert not table.isnan().any(), key
            assert torch.equal(tables[key], table), f"{name}: {key} differs from the 1-rank table"
        for key, pieces in shards.items():
            for i, a in enumerate(pieces):
                for b in pieces[i + 1 :]:
                    assert a.shape != b.shape or not torch.equal(a, b), f"{key}: equal shards"
    # Both plans shard every table somewhere, and every sharding type occurs.
    assert any(t.dtype == torch.float16 for t in reference.values())
    assert torch.equal(reference["extra.scale"], torch.zeros(5))


def test_an_op_without_a_generator_variant_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.WARNING, logger="fastinit.seeding"),
        seeding.scratch_rng(1, "dropout"),
    ):
        torch.ops.aten.native_dropout(torch.ones(16), 0.5, True)
    assert "native_dropout" in caplog.text and "global RNG" in caplog.text


def test_fast_sharders_are_seeded_copies_and_never_change_the_given_ones() -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder

    from fastinit.sharding.sharders import FastEmbeddingBagCollectionSharder, fast_sharders

    stock = EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.5})
    fast = FastEmbeddingBagCollectionSharder(seed=5)
    composite = FeatureProcessedEmbeddingBagCollectionSharder(ebc_sharder=fast)
    got = fast_sharders([stock, fast, composite], 9)
    assert isinstance(got[0], FastEmbeddingBagCollectionSharder) and got[0].seed == 9
    assert got[0].fused_params == {"learning_rate": 0.5}
    assert got[1] is not fast and got[1].seed == 9 and fast.seed == 5
    assert got[2] is not composite and got[2]._ebc_sharder.seed == 9
    assert composite._ebc_sharder is fast and fast.seed == 5  # the given ones: unchanged


def _kernel_inits(world: int) -> dict[str, int]:
    """How often the kernels' own initialisation runs while fastinit builds the model, and once
    it is built (outside construction a kernel initialises itself as TorchRec's does)."""
    from torchrec.distributed import batched_embedding_kernel as bek

    calls = {"construction": 0}
    for cls in (bek.BaseBatchedEmbeddingBag, bek.BaseBatchedEmbedding):
        stock = cls.__dict__["init_parameters"]

        def counted(self: Any, _stock: Any = stock) -> None:
            calls["construction"] += 1
            _stock(self)

        cls.init_parameters = counted  # this rank's process only: it exits after the test
    model = _build(seed=4, world=world, shift=1)
    built = calls["construction"]
    kernels = [
        kernel
        for module in model.modules()
        for lookup in getattr(module, "_lookups", [])
        for kernel in getattr(lookup, "_emb_modules", [])
        if isinstance(kernel, (bek.BaseBatchedEmbeddingBag, bek.BaseBatchedEmbedding))
    ]
    for k in kernels:
        k.init_parameters()
    return {"construction": built, "kernels": len(kernels), "after": calls["construction"] - built}


def test_kernels_leave_seeded_tables_to_the_seeded_init() -> None:
    # Stock writes every table twice (the kernel's uniform_, then reset_parameters); fastinit's
    # kernels skip their own pass for tables initialised from (seed, FQN) blocks right after.
    for r in run_ranks(_kernel_inits, 2, args=(2,), timeout=300):
        assert r["kernels"] > 0
        assert r["construction"] == 0, r
        assert r["after"] == r["kernels"], r
