"""Reference models, explicit plans and batches, shared by tests and benchmarks.

A :class:`ModelSpec` describes a DLRM-style model: a dense arch over ``dense_in`` features, up to
three sparse modules (an unweighted ``EmbeddingBagCollection``, a weighted one, an
``EmbeddingCollection`` whose sequence embeddings are sum-pooled per sample), and an over arch
producing one logit. Tables vary deterministically in rows, dims and dtype, so the same spec
always means the same model on every rank.

Example::

    spec = ModelSpec(num_tables=8, num_ec_tables=4, fp16_every=3)
    model = build_model(spec, device=torch.device("meta"))
    plan = build_plan(model, "table_wise", world_size=2)
    batch = make_batch(spec, batch_size=32, seed=0)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchrec.distributed import sharding_plan as sp
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import BaseEmbeddingConfig

__all__ = [
    "SHARDING_TYPES",
    "ModelSpec",
    "RefModel",
    "Batch",
    "build_model",
    "build_plan",
    "make_batch",
    "batches",
    "table_configs",
    "plan_to_plain",
]

#: The seven sharding types of torchrec 1.8.0, in ShardingType's spelling.
SHARDING_TYPES: tuple[str, ...] = (
    "data_parallel",
    "table_wise",
    "column_wise",
    "table_column_wise",
    "row_wise",
    "table_row_wise",
    "grid_shard",
)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ModelSpec:
    """A DLRM-style reference model."""

    num_tables: int = 8
    """Tables in the unweighted EmbeddingBagCollection (``sparse.ebc``)."""
    num_weighted_tables: int = 0
    """Tables in the weighted EmbeddingBagCollection (``sparse.wbc``)."""
    num_ec_tables: int = 0
    """Tables in the EmbeddingCollection (``sparse.ec``); all share ``ec_dim``."""
    rows: int = 1000
    """Base row count; table i has ``rows + 37 * (i % 7)`` rows (varied, deterministic)."""
    dims: tuple[int, ...] = (16, 32)
    """EmbeddingBag dims, cycled over the tables (multiples of 4 keep column-wise shardable)."""
    ec_dim: int = 16
    """The EmbeddingCollection's dim."""
    fp16_every: int = 0
    """Every n-th table (n > 0) holds fp16 weights; 0 means all fp32."""
    pooling: float = 4.0
    """Mean ids per sample and feature."""
    dense_in: int = 13
    """Dense features per sample."""
    dense_arch: tuple[int, ...] = (32, 16)
    """Dense MLP layer sizes."""
    over_arch: tuple[int, ...] = (32, 1)
    """Over MLP layer sizes; the last is the logit."""

    def __post_init__(self) -> None:
        if self.num_tables + self.num_weighted_tables + self.num_ec_tables < 1:
            raise ValueError("a ModelSpec needs at least one table")
        if self.rows < 8:
            raise ValueError(f"rows must be >= 8, got {self.rows}")
        if any(d % 4 for d in (*self.dims, self.ec_dim)):
            raise ValueError("embedding dims must be multiples of 4")
        if self.over_arch[-1] != 1:
            raise ValueError("the over arch must end in one logit")


def _dtype(spec: ModelSpec, index: int) -> Any:
    if spec.fp16_every and index % spec.fp16_every == spec.fp16_every - 1:
        return DataType.FP16
    return DataType.FP32


def table_configs(spec: ModelSpec) -> dict[str, list[BaseEmbeddingConfig]]:
    """The table configs of each sparse module (``ebc``, ``wbc``, ``ec``), deterministic."""
    out: dict[str, list[BaseEmbeddingConfig]] = {"ebc": [], "wbc": [], "ec": []}
    index = itertools.count()
    for prefix, key, count in (
        ("t", "ebc", spec.num_tables),
        ("w", "wbc", spec.num_weighted_tables),
        ("e", "ec", spec.num_ec_tables),
    ):
        for i in range(count):
            g = next(index)
            rows = spec.rows + 37 * (g % 7)
            common = {
                "name": f"{prefix}{i}",
                "num_embeddings": rows,
                "feature_names": [f"{prefix}f{i}"],
                "data_type": _dtype(spec, g),
            }
            if key == "ec":
                out[key].append(EmbeddingConfig(embedding_dim=spec.ec_dim, **common))
            else:
                dim = spec.dims[g % len(spec.dims)]
                out[key].append(EmbeddingBagConfig(embedding_dim=dim, **common))
    return out


def _mlp(sizes: Sequence[int], in_features: int, device: torch.device, last_act: bool) -> nn.Module:
    layers: list[nn.Module] = []
    for i, size in enumerate(sizes):
        layers.append(nn.Linear(in_features, size, device=device))
        if i < len(sizes) - 1 or last_act:
            layers.append(nn.ReLU())
        in_features = size
    return nn.Sequential(*layers)


@dataclasses.dataclass
class Batch(Pipelineable):
    """A training batch: dense features, unweighted and weighted KJTs, labels.

    Implements torchrec's ``Pipelineable`` protocol (``to``, ``record_stream``, ``pin_memory``) so
    ``TrainPipelineSparseDist`` can move and overlap it.
    """

    dense: torch.Tensor
    sparse: Any  # KeyedJaggedTensor
    weighted: Any  # KeyedJaggedTensor or None
    labels: torch.Tensor

    def _map(self, fn: Any) -> Batch:
        return Batch(
            dense=fn(self.dense),
            sparse=fn(self.sparse),
            weighted=None if self.weighted is None else fn(self.weighted),
            labels=fn(self.labels),
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        """The batch on ``device`` (TorchRec's ``Pipelineable`` interface)."""
        return self._map(lambda t: t.to(device=device, non_blocking=non_blocking))

    def record_stream(self, stream: Any) -> None:
        """Record ``stream`` on every tensor (TorchRec's ``Pipelineable`` interface)."""
        for t in (self.dense, self.sparse, self.weighted, self.labels):
            if t is not None:
                t.record_stream(stream)

    def pin_memory(self) -> Batch:
        """The batch in pinned memory (TorchRec's ``Pipelineable`` interface)."""
        return self._map(lambda t: t.pin_memory())


def sum_pool(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum each sample's sequence embeddings: ``(sum(lengths), D) -> (len(lengths), D)``."""
    batch = lengths.numel()
    segments = torch.repeat_interleave(torch.arange(batch, device=lengths.device), lengths)
    pooled = torch.zeros(batch, values.shape[1], dtype=values.dtype, device=values.device)
    return pooled.index_add(0, segments, values)


# A leaf for torch.fx, so TorchRec's train pipelines can trace the model.
torch.fx.wrap("sum_pool")


class SparseArch(nn.Module):
    """Holds the sparse modules and pools each to one vector per sample and feature."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        super().__init__()

        configs = table_configs(spec)
        self.ebc = (
            EmbeddingBagCollection(tables=configs["ebc"], device=device) if configs["ebc"] else None
        )
        self.wbc = (
            EmbeddingBagCollection(
                tables=configs["wbc"],
                is_weighted=True,
                device=device,
            )
            if configs["wbc"]
            else None
        )
        self.ec = (
            EmbeddingCollection(tables=configs["ec"], device=device) if configs["ec"] else None
        )
        self.out_features = sum(c.embedding_dim for cs in configs.values() for c in cs)
        self.ebc_features = [f for c in configs["ebc"] for f in c.feature_names]
        self.wbc_features = [f for c in configs["wbc"] for f in c.feature_names]
        self.ec_features = [f for c in configs["ec"] for f in c.feature_names]

    def forward(self, sparse: Any, weighted: Any) -> torch.Tensor:
        parts: list[torch.Tensor] = []
        # By key, never by position: a sharded EBC returns its keys in the plan's order
        # (grouped by sharding type and rank), not the tables' order (as torchrec's DLRM does).
        if self.ebc is not None:
            pooled = self.ebc(sparse).to_dict()
            parts.extend(pooled[name] for name in self.ebc_features)
        if self.wbc is not None:
            pooled = self.wbc(weighted).to_dict()
            parts.extend(pooled[name] for name in self.wbc_features)
        if self.ec is not None:
            jts = self.ec(sparse)
            for name in self.ec_features:
                parts.append(sum_pool(jts[name].values(), jts[name].lengths()))
        return torch.cat([p.float() for p in parts], dim=1)


class RefModel(nn.Module):
    """DLRM-style model: ``forward(batch) -> (loss, (loss, logits, labels))``, as torchrec's
    train pipelines expect."""

    def __init__(self, spec: ModelSpec, device: torch.device | None = None) -> None:
        super().__init__()
        device = device or torch.device("cpu")
        self.spec = spec
        self.dense_arch = _mlp(spec.dense_arch, spec.dense_in, device, last_act=True)
        self.sparse = SparseArch(spec, device)
        over_in = spec.dense_arch[-1] + self.sparse.out_features
        self.over_arch = _mlp(spec.over_arch, over_in, device, last_act=False)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The loss on ``batch``, and (loss, logits, labels) detached."""
        dense = self.dense_arch(batch.dense)
        sparse = self.sparse(batch.sparse, batch.weighted)
        logits = self.over_arch(torch.cat([dense, sparse], dim=1)).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def build_model(
    spec: ModelSpec, device: torch.device | str | None = None, seed: int = 0
) -> RefModel:
    """The reference model for ``spec``; on "meta" nothing is allocated (TorchRec's usual way)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return RefModel(spec, device)


def _generator(kind: str, index: int, world_size: int, local_size: int, kernel: str) -> Any:
    num_hosts = world_size // local_size
    if kind == "data_parallel":
        return sp.data_parallel()
    if kind == "table_wise":
        return sp.table_wise(rank=index % world_size, compute_kernel=kernel)
    if kind in ("column_wise", "table_column_wise"):
        n = 2 if world_size > 1 else 1
        return sp.column_wise(
            ranks=[(index + k) % world_size for k in range(n)], compute_kernel=kernel
        )
    if kind == "row_wise":
        return sp.row_wise(compute_kernel=kernel)
    if kind == "table_row_wise":
        return sp.table_row_wise(host_index=index % num_hosts)
    if kind == "grid_shard":

        def grid(param: Any, local: int, world: int, device_type: str, sharder: Any) -> Any:
            # One host per column block: as many hosts as the table has column shards.
            sizes, _ = sp.calculate_shard_sizes_and_offsets(param, world, local, kind)
            hosts = [(index + k) % num_hosts for k in range(len(sizes) // local)]
            return sp.grid_shard(host_indexes=hosts)(param, local, world, device_type, sharder)

        return grid
    raise ValueError(f"unknown sharding type {kind!r}; one of {SHARDING_TYPES}")


def build_plan(
    model: nn.Module,
    types: str | Sequence[str] | Mapping[str, str],
    world_size: int,
    local_world_size: int | None = None,
    device_type: str = "cpu",
    compute_kernel: str = "fused",
) -> ShardingPlan:
    """An explicit plan for every sparse module of ``model``, through torchrec's
    ``sharding_plan`` helpers.

    Args:
        model: a model holding EmbeddingBagCollection / EmbeddingCollection modules.
        types: one sharding type for all tables, a sequence cycled over the tables (in module
            order), or a mapping from table name to type.
        world_size: ranks in the job.
        local_world_size: ranks per host (table_row_wise and grid_shard use it); default: what
            torchrec's ``get_local_size`` reads (``LOCAL_WORLD_SIZE``), as the sharders will.
        device_type: "cpu" or "cuda".
        compute_kernel: kernel of every non-data-parallel table ("fused" on CPU: EmbeddingCollection
            + table_wise + "dense" corrupts the heap in stock torchrec 1.8.0).

    Returns:
        A ``ShardingPlan`` with one module plan per sparse module.
    """
    local_world_size = local_world_size or get_local_size(world_size)
    if world_size % local_world_size:
        raise ValueError(f"world_size {world_size} is not a multiple of {local_world_size}")
    index = itertools.count()
    plan: dict[str, Any] = {}
    for path, module in model.named_modules():
        if not isinstance(module, EmbeddingBagCollection | EmbeddingCollection):
            continue
        configs = (
            module.embedding_bag_configs()
            if isinstance(module, EmbeddingBagCollection)
            else module.embedding_configs()
        )
        per_param: dict[str, Any] = {}
        kinds: dict[str, str] = {}
        for config in configs:
            i = next(index)
            if isinstance(types, str):
                kind = types
            elif isinstance(types, Mapping):
                kind = types[config.name]
            else:
                kind = types[i % len(types)]
            kinds[config.name] = kind
            per_param[config.name] = _generator(
                kind, i, world_size, local_world_size, compute_kernel
            )
        module_plan = construct_module_sharding_plan(
            module,
            per_param,
            local_size=local_world_size,
            world_size=world_size,
            device_type=device_type,
        )
        for name, ps in module_plan.items():
            if kinds[name] == "table_column_wise":
                ps.sharding_type = "table_column_wise"
            if ps.sharding_type != "data_parallel":
                ps.compute_kernel = compute_kernel
        plan[path] = module_plan
    return ShardingPlan(plan)


def make_batch(
    spec: ModelSpec,
    batch_size: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> Batch:
    """A valid batch for ``spec``: ids within each table's rows, lengths around ``spec.pooling``
    (a geometric spread, as in click logs: many short lists, a few long ones)."""
    g = torch.Generator().manual_seed(seed)
    configs = table_configs(spec)

    def kjt(cs: list[Any], weighted: bool) -> Any:
        keys: list[str] = []
        lengths: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for c in cs:
            p = 1.0 / (1.0 + spec.pooling)
            u = torch.rand(batch_size, generator=g).clamp_min(1e-6)
            n = torch.floor(torch.log(u) / torch.log(torch.tensor(1.0 - p))).long()
            lengths.append(n)
            values.append(torch.randint(0, c.num_embeddings, (int(n.sum()),), generator=g))
            keys.extend(c.feature_names)
        v = torch.cat(values) if values else torch.empty(0, dtype=torch.long)
        return KeyedJaggedTensor(
            keys=keys,
            values=v,
            lengths=torch.cat(lengths) if lengths else torch.empty(0, dtype=torch.long),
            weights=torch.rand(v.numel(), generator=g) if weighted else None,
        )

    sparse = kjt(configs["ebc"] + configs["ec"], weighted=False)
    weighted = kjt(configs["wbc"], weighted=True) if configs["wbc"] else None
    batch = Batch(
        dense=torch.randn(batch_size, spec.dense_in, generator=g),
        sparse=sparse,
        weighted=weighted,
        labels=torch.randint(0, 2, (batch_size,), generator=g).float(),
    )
    return batch.to(torch.device(device))


def batches(
    spec: ModelSpec, batch_size: int, seed: int = 0, device: torch.device | str = "cpu"
) -> Iterator[Batch]:
    """An endless iterator of distinct batches (seeded by ``seed`` and the step)."""
    for step in itertools.count():
        yield make_batch(spec, batch_size, seed=seed * 1_000_003 + step, device=device)


def plan_to_plain(plan: Any) -> dict[str, dict[str, Any]]:
    """A ShardingPlan as plain, JSON-able, comparable data: every field a ``ParameterSharding``
    carries (enums and nested parameters by ``repr``), keyed ``"<module path>.<table>"``."""
    out: dict[str, dict[str, Any]] = {}
    for module_path, module_plan in plan.plan.items():
        for name, ps in module_plan.items():
            spec = None
            if ps.sharding_spec is not None:
                spec = [
                    [list(s.shard_offsets), list(s.shard_sizes), str(s.placement)]
                    for s in ps.sharding_spec.shards
                ]
            out[f"{module_path}.{name}"] = {
                "sharding_type": ps.sharding_type,
                "compute_kernel": ps.compute_kernel,
                "ranks": ps.ranks,
                "shards": spec,
                "cache_params": repr(ps.cache_params),
                "enforce_hbm": ps.enforce_hbm,
                "stochastic_rounding": ps.stochastic_rounding,
                "bounds_check_mode": repr(ps.bounds_check_mode),
                "output_dtype": repr(ps.output_dtype),
                "key_value_params": repr(ps.key_value_params),
            }
    return out
