"""``fastinit.setup``: TorchRec's ``DistributedModelParallel``, with near-zero start-up messages.

``setup`` reads as its phases, each owned by one module:

1. **prepare** (here) — local work only: the plan key (:func:`plan_key`), the plan (explicit, from
   the plan cache, or planned on rank 0), the model's structure and this rank's seed, all packed
   into a fixed-size record; a failure is packed too, so every rank still joins the exchange.
2. **exchange** (:func:`fastinit.protocol.exchange`) — one ``all_gather`` of the records; any
   failure or disagreement raises the same error on every rank.
3. **agree_on_plan** (:func:`fastinit.protocol.agree_on_plan`) — no message when every rank holds
   the same plan, else one broadcast of the encoded plan; ranks that planned or missed fill the
   cache.
4. **materialize** (:func:`fastinit.seeding.materialize_dense`) — meta dense parameters from
   explicit generators seeded by rank 0's seed and each tensor's name.
5. **construct** (:func:`_construct`) — TorchRec's ``DistributedModelParallel`` with fast sharders
   (shard metadata from the plan), the plan's process groups only, DDP without its init sync.
6. **verify** (:func:`fastinit.protocol.verify_replicas`) — one ``all_reduce`` of digests of every
   replicated value; rank 0's values are broadcast only where they differ, with a warning.

Each phase is one ``fastinit.<phase>`` trace span (``prepare``, ``exchange``, ``agree_on_plan``,
``materialize``, ``construct``, ``verify``, ``init_data_parallel``), its seconds in the DEBUG
summary, and one named fault point ``startup.<phase>`` at its start (``startup.plan`` inside
prepare, where a failure is packed into the record): :mod:`fastinit.testing.faults` makes a rank
fail there; without an installed action a point does nothing. The fast sharders are built once,
for construction, with the agreed seed.

At most 3 start-up collectives (record, plan, digests), plus one broadcast only where replicated
values differ; none for a world of one. ``docs/startup.md`` describes the protocol as built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from fastinit import _faults, compat, knobs, protocol, trace
from fastinit import pg as fastinit_pg
from fastinit.errors import PlanCacheError, StartupError
from fastinit.plan._torchrec import planner_inputs
from fastinit.plan.cache import FastinitCacheWarning, PlanCache, as_plan_cache, plan_bytes_bound
from fastinit.plan.codec import encode_plan, is_current
from fastinit.plan.compact import compact_plan
from fastinit.plan.fingerprint import DefaultTopology, planner_fingerprint, uncacheable_reason
from fastinit.plan.provenance import log_miss, record_inputs
from fastinit.plan.summary import PlanSummary, summarize_plan, table_layouts
from fastinit.plan.validate import check_unsharded, count_tables, validate_plan
from fastinit.protocol import Record
from fastinit.seeding import materialize_dense
from fastinit.sharding._torchrec_modules import collective_validation_on_leader
from fastinit.sharding.mirror.collective_utils import set_collective_validation
from fastinit.sharding.mirror.types import sharding_env_from_process_group

if TYPE_CHECKING:
    from torchrec.distributed.model_parallel import DataParallelWrapper, DistributedModelParallel
    from torchrec.distributed.model_tracker.types import ModelTrackerConfigs
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import (
        ModuleSharder,
        ShardingEnv,
        ShardingPlan,
        ShardingPlanner,
    )

    from fastinit.plan.cache import ProtocolCache

logger = logging.getLogger(__name__)

__all__ = ["setup", "plan_key", "PlanKey", "plan_ahead"]


@dataclasses.dataclass(frozen=True, slots=True)
class PlanKey:
    """What ``setup`` plans with and the plan-cache key it looks the plan up under."""

    planner: Any
    """The planner that plans when no plan is given (the default one resolved)."""
    sharders: list[Any]
    """The sharders the plan is made for (fast equivalents of the given or default ones)."""
    fingerprint: bytes
    """The plan-cache key: a digest of every planner input (32 bytes)."""
    uncacheable: str | None
    """Why the plan cache is off for these inputs (a planner input without a canonical
    description), or None."""


def plan_key(
    module: nn.Module,
    *,
    world_size: int,
    local_world_size: int,
    device: torch.device,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    planner: ShardingPlanner | None = None,
    constraints: dict[str, ParameterConstraints] | None = None,
) -> PlanKey:
    """Resolve the default planner and sharders and compute the plan-cache key, as ``setup`` does.

    Needs no process group: an offline tool can compute the key (and plan) for a world it is not
    part of.

    Args:
        module: the unsharded model (usually on the meta device).
        world_size: ranks in the job.
        local_world_size: ranks per host.
        device: the compute device of the job (its type picks the topology's device).
        sharders: as for ``setup`` (default: TorchRec's default sharders).
        planner: as for ``setup`` (default: fastinit's planner for this topology).
        constraints: per-table constraints for the default planner; with ``planner`` given,
            they replace the planner's own in the key.

    Returns:
        The :class:`PlanKey`.
    """
    from fastinit.sharding.sharders import fast_sharders

    all_sharders = fast_sharders(sharders, 0)
    if planner is None:
        planner = _default_planner(world_size, local_world_size, device, constraints)
    topology, planner_constraints = planner_inputs(planner)
    if constraints is None:
        constraints = planner_constraints
    with trace.span("fastinit.fingerprint"):
        fingerprint = planner_fingerprint(
            module, all_sharders, topology, constraints=constraints, planner=planner
        )
    uncacheable = uncacheable_reason(planner, all_sharders, constraints)
    return PlanKey(planner, all_sharders, fingerprint, uncacheable)


def _default_planner(
    world_size: int,
    local_world_size: int,
    device: torch.device,
    constraints: dict[str, ParameterConstraints] | None = None,
) -> ShardingPlanner:
    from torchrec.distributed.planner import Topology

    from fastinit.planner.planners import FastPlanner

    return FastPlanner(
        topology=Topology(
            local_world_size=local_world_size,
            world_size=world_size,
            compute_device=device.type,
        ),
        constraints=constraints,
    )


def setup(
    module: nn.Module,
    env: ShardingEnv | None = None,
    device: torch.device | None = None,
    plan: ShardingPlan | None = None,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    init_data_parallel: bool = True,
    init_parameters: bool = True,
    data_parallel_wrapper: DataParallelWrapper | None = None,
    model_tracker_configs: ModelTrackerConfigs | None = None,
    *,
    planner: ShardingPlanner | None = None,
    plan_cache: str | os.PathLike[str] | PlanCache | Any | None = None,
    seed: int | None = None,
    init_tables: bool = True,
) -> DistributedModelParallel:
    """Shard ``module`` as ``DistributedModelParallel`` would, with at most 3 start-up collectives.

    The first nine parameters are those of torchrec 1.8.0's ``DistributedModelParallel``, in its
    order, and mean the same.

    Args:
        module: the model, usually built on the meta device.
        env: the ``ShardingEnv``; default: the world process group (a world of one is created
            when no process group exists and the environment says ``WORLD_SIZE`` 1 or nothing).
        device: the compute device (default CPU); ``meta`` needs an explicit ``plan``.
        plan: an explicit ``ShardingPlan``; every rank must pass the same one.
        sharders: the sharders (default TorchRec's); stock EBC/EC sharders are replaced by fast
            subclasses with the same settings.
        init_data_parallel: as for ``DistributedModelParallel``.
        init_parameters: as for ``DistributedModelParallel``; meta parameters are materialised
            from seeded generators.
        data_parallel_wrapper: as for ``DistributedModelParallel``; the default wraps the dense
            part in DDP without its init sync (the verify phase has made the replicas equal).
        model_tracker_configs: as for ``DistributedModelParallel``.
        planner: plans when ``plan`` is None (default: fastinit's planner for the topology of
            ``env``). Only rank 0 plans.
        plan_cache: plan-cache directory (default ``FASTINIT_PLAN_CACHE``), a
            ``fastinit.plan.PlanCache``, or any object with ``get``/``put`` in TorchRec 1.9's
            ``PlanCache`` protocol (keyed by the hex planner fingerprint; see
            ``fastinit.plan.cache.as_plan_cache``); a hit means no planning at all. A cached
            plan is a hint: one that does not decode or fit is a miss with one warning.
        seed: seeds every initial value fastinit makes; any Python int (outside
            ``[0, 2**63)`` it is hashed to a 63-bit value). Default: rank 0's
            ``torch.initial_seed()``. Every rank uses rank 0's seed; different explicit seeds are
            reported in a warning.
        init_tables: False for a job that loads a checkpoint right after: the sharded
            embedding tables are left as allocated, for the load to fill
            (:mod:`fastinit.tables`). ``fastinit.checkpoint.load`` initialises those the
            checkpoint lacks as this call would have; without a load, call
            ``fastinit.init_tables(model)``. Until then the model refuses a forward and
            ``fastinit.checkpoint.save`` refuses it. Data-parallel tables are initialised
            either way. The same value on every rank.

    Returns:
        A ``torchrec.distributed.model_parallel.DistributedModelParallel``.

    Raises:
        PlanMismatchError: the explicit plan does not fit the module or the world; raised as
            itself on every rank (a cached plan that does not fit is a cache miss instead).
        StartupMismatchError: ranks disagree on the model, the planner inputs, the explicit plan
            or ``init_parameters``; on every rank.
        StartupError: start-up failed on some rank (planning, a dead or late peer, a corrupt
            plan message), or ``WORLD_SIZE`` > 1 with no process group.
        CompatibilityError: the installed TorchRec lacks what fastinit relies on.
    """
    compat.require("setup")
    device = device or torch.device("cpu")
    phases = _Phases()
    with _tracer_from_env(), trace.span("fastinit.setup"):
        env = _resolve_env(env, device)
        channel = protocol.Channel(env.process_group if env.world_size > 1 else None, device)
        phases.rank = channel.rank
        with phases("prepare"):
            local = _prepare(
                module,
                env,
                device,
                plan,
                sharders,
                planner,
                plan_cache,
                seed,
                init_parameters,
                init_tables,
            )
        with phases("exchange"):
            records = _exchange(channel, local)
            seed_used = _adopt_rank0_settings(records)
        with phases("agree_on_plan"):
            plan = _agree_on_plan(channel, records, local, module)
        if init_parameters:
            with phases("materialize"):
                materialize_dense(module, _sharded_paths(module, plan), device, seed_used)
        with phases("construct"):
            model = _construct(
                module,
                env,
                device,
                plan,
                local.sharders,
                seed_used,
                init_parameters,
                data_parallel_wrapper,
                model_tracker_configs,
                init_tables,
            )
        with phases("verify"):
            differed = protocol.verify_replicas(
                channel,
                protocol.replicated_tensors(model.module, plan),
                seeds=protocol.explicit_seeds(records),
                log=logger.warning,
            )
        if init_data_parallel:
            with phases("init_data_parallel"):
                model.init_data_parallel()
    _log_summary(channel, records, local, phases, differed)
    return model


class _Phases:
    """``setup``'s phases, each one ``fastinit.<phase>`` trace span, timed (for the summary), and
    one fault point ``startup.<phase>`` at its start."""

    def __init__(self) -> None:
        self.rank = 0  # the group rank, once the channel is made
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            with trace.span(f"fastinit.{name}"):
                _faults.point(f"startup.{name}", rank=self.rank)
                yield
        finally:
            self.seconds[name] = time.perf_counter() - t0

    def total(self) -> float:
        return time.perf_counter() - self.started


# -- phase 0: the environment ------------------------------------------------------------------


def _resolve_env(env: ShardingEnv | None, device: torch.device) -> ShardingEnv:
    if env is not None:
        if env.process_group is None and env.world_size > 1:
            raise StartupError("fastinit.setup needs a process group when world_size > 1")
        return env
    return sharding_env_from_process_group(_ensure_process_group(device), device)


def _ensure_process_group(device: torch.device) -> dist.ProcessGroup:
    if dist.is_initialized():
        pg = dist.GroupMember.WORLD
        assert pg is not None
        return pg
    world = os.environ.get("WORLD_SIZE", "").strip()
    if world and world != "1":
        raise StartupError(
            f"fastinit.setup: WORLD_SIZE={world} in the environment (torchrun?) but no process "
            "group: call torch.distributed.init_process_group() before fastinit.setup, as "
            "DistributedModelParallel requires"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.debug("fastinit.setup: no process group; creating a world of one (%s)", backend)
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        device_id=_cuda_device_id(device),
    )
    pg = dist.GroupMember.WORLD
    assert pg is not None
    return pg


def _cuda_device_id(device: torch.device) -> torch.device | None:
    """The device ``init_process_group`` binds an NCCL group to (torch 2.15's ``nccl`` backend,
    nccl2, needs it): ``device`` with its index, else the current CUDA device; None off CUDA."""
    if device.type != "cuda":
        return None
    if device.index is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device())


# -- phase 1: local preparation ----------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class _Local:
    """What this rank holds before the exchange."""

    record: Record
    structure: bytes
    sharders: list[Any]
    """The sharders as given (TorchRec's defaults when none were): the fast ones are built from
    these once the seed is agreed."""
    plan: ShardingPlan | None = None
    encoded: bytes | None = None
    fingerprint: bytes | None = None
    key: PlanKey | None = None
    """The plan key when ``setup`` looked the plan up (no explicit plan)."""
    cache: PlanCache | ProtocolCache | None = None
    failure: Exception | None = None


def _prepare(
    module: nn.Module,
    env: ShardingEnv,
    device: torch.device,
    plan: ShardingPlan | None,
    sharders: list[ModuleSharder[nn.Module]] | None,
    planner: ShardingPlanner | None,
    plan_cache: str | os.PathLike[str] | PlanCache | Any | None,
    seed: int | None,
    init_parameters: bool,
    init_tables: bool = True,
) -> _Local:
    """Everything this rank can do alone; never raises (a failure is packed into the record)."""
    structure = protocol.structure_of(module)
    local = _Local(record=Record(), structure=structure, sharders=[])
    found: dict[str, Any] = {"seed": 0, "source": "explicit" if plan is not None else None}
    try:
        _faults.point("startup.plan", rank=env.rank)  # a failure here travels in the record
        check_unsharded(module)  # before the structure of a sharded model misleads the checks
        found["validate"] = collective_validation_on_leader()
        found["seed"] = protocol.normalize_seed(seed if seed is not None else torch.initial_seed())
        local.sharders = _given_sharders(sharders)
        if plan is not None:  # as DMP: no planner is built when a plan is given
            from fastinit.sharding.sharders import fast_sharders

            planning = fast_sharders(local.sharders, 0)  # no seed matters to the plan
            found["fingerprint"] = _explicit_plan_fingerprint(module, env, device, planning)
        else:
            key = _plan_key(module, env, device, local.sharders, planner)
            local.key = key
            planning, local.fingerprint = key.sharders, key.fingerprint
            found["fingerprint"] = key.fingerprint
            plan, found["source"] = _plan_from_cache_or_planner(module, env, key, plan_cache, local)
        if plan is not None:
            if local.encoded is None:  # explicit or planned here: compact once, encode once
                with trace.span("fastinit.compact_plan"):
                    plan = compact_plan(plan)
                validate_plan(module, plan, planning, world_size=env.world_size)
                with trace.span("fastinit.encode_plan"):
                    local.encoded = encode_plan(plan)
            local.plan = plan
    except Exception as e:  # joins the exchange with its error: nobody hangs
        local.failure = e
    local.record = protocol.build_record(
        structure=structure,
        init_parameters=init_parameters,
        init_tables=init_tables,
        validate=found.get("validate", False),
        seed=found["seed"],
        seed_given=seed is not None,
        fingerprint=found.get("fingerprint"),
        source=found["source"],
        encoded=local.encoded,
        failure=local.failure,
    )
    return local


def _given_sharders(sharders: list[ModuleSharder[nn.Module]] | None) -> list[Any]:
    if sharders is not None:
        return list(sharders)
    from torchrec.distributed.sharding_plan import get_default_sharders

    return list(get_default_sharders())


def _explicit_plan_fingerprint(
    module: nn.Module, env: ShardingEnv, device: torch.device, sharders: list[Any]
) -> bytes:
    """The planner inputs other than the planner (tables, sharders, topology), compared across
    ranks even when the plan is given; a constant on a device TorchRec has no topology for
    ("meta"), where the plan digest alone is compared."""
    from fastinit.planner._torchrec import topology_compute_devices

    if device.type not in topology_compute_devices():
        return hashlib.sha256(f"fastinit: explicit plan on {device.type}".encode()).digest()
    from torchrec.distributed.comm import get_local_size

    # TorchRec's default topology, by its arguments (not its O(ranks) device list)
    topology = DefaultTopology(
        world_size=env.world_size,
        local_world_size=get_local_size(env.world_size),
        compute_device=device.type,
    )
    with trace.span("fastinit.fingerprint"):
        return planner_fingerprint(module, sharders, topology)


def _plan_key(
    module: nn.Module,
    env: ShardingEnv,
    device: torch.device,
    sharders: list[ModuleSharder[nn.Module]] | None,
    planner: ShardingPlanner | None,
) -> PlanKey:
    from torchrec.distributed.comm import get_local_size

    return plan_key(
        module,
        world_size=env.world_size,
        local_world_size=get_local_size(env.world_size),
        device=device,
        sharders=sharders,
        planner=planner,
    )


def _plan_from_cache_or_planner(
    module: nn.Module,
    env: ShardingEnv,
    key: PlanKey,
    plan_cache: str | os.PathLike[str] | PlanCache | Any | None,
    local: _Local,
) -> tuple[ShardingPlan | None, str | None]:
    """The cached plan, else rank 0's planner's (None on the other ranks on a miss), and where
    it came from."""
    cache = as_plan_cache(plan_cache, env.world_size)
    if cache is not None and key.uncacheable is not None:
        warnings.warn(
            f"fastinit plan cache: off for this call: {key.uncacheable}",
            FastinitCacheWarning,
            stacklevel=4,
        )
    elif cache is not None:
        local.cache = cache
        with trace.span("fastinit.plan_cache.get"):
            cached = _cache_get(local.cache, key.fingerprint, module, key.sharders, env)
        if cached is not None:  # validated by the cache's accept; its bytes are the digest's
            plan, local.encoded = cached
            return plan, "cache"
        # which planner input differs from the plans made ahead (a directory only), if any
        cache_dir = cache.directory if isinstance(cache, PlanCache) else None
        if env.rank == 0 and cache_dir is not None:
            try:
                log_miss(cache_dir, module, key, log=logger)
            except Exception as e:  # a diagnostic only: never fails a start-up
                logger.debug("fastinit plan cache: could not explain the miss: %s", e)
    if env.rank != 0:
        return None, None
    with trace.span("fastinit.plan"):
        plan = key.planner.plan(module, key.sharders)
    return plan, "planned"


def _cache_get(
    cache: PlanCache | ProtocolCache,
    key: bytes,
    module: nn.Module,
    sharders: list[Any],
    env: ShardingEnv,
) -> tuple[ShardingPlan, bytes] | None:
    """A cached plan that fits this module and world, with its encoded bytes; an entry that
    does not, or is larger than any plan for this model could be, is a miss with one warning
    (and is replaced)."""

    def accept(plan: ShardingPlan) -> None:
        validate_plan(module, plan, sharders, world_size=env.world_size)

    bound = plan_bytes_bound(count_tables(module, sharders), env.world_size)
    got = cache.read(key, accept=accept, max_bytes=bound)
    if got is None:
        return None
    plan, payload = got
    # an entry of an older codec version: its plan's bytes as this version writes them
    return plan, payload if is_current(payload) else encode_plan(plan)


# -- phases 2 and 3: the exchange and the plan --------------------------------------------------


def _exchange(channel: protocol.Channel, local: _Local) -> protocol.Records:
    try:
        return protocol.exchange(channel, local.record, local.structure)
    except StartupError as e:
        if local.failure is not None and e.__cause__ is None:
            e.__cause__ = local.failure
        raise


def _agree_on_plan(
    channel: protocol.Channel, records: Sequence[Record], local: _Local, module: nn.Module
) -> ShardingPlan:
    received = protocol.agree_on_plan(channel, records, local.encoded)
    plan, encoded = received if received is not None else (local.plan, local.encoded)
    assert plan is not None and encoded is not None
    # Ranks whose lookup missed fill the cache (with the bytes that travelled): the planner,
    # and one rank per host.
    record = local.record
    local_leader = os.environ.get("LOCAL_RANK", "0") == "0"
    if (
        local.cache is not None
        and local.fingerprint is not None
        and (record.planned or (not record.has_plan and local_leader))
    ):
        with trace.span("fastinit.plan_cache.put"):
            stored = local.cache.put(local.fingerprint, encoded)
        if stored:
            _describe_entry(local.cache, module, local.key)
    return plan


def _describe_entry(
    cache: PlanCache | ProtocolCache, module: nn.Module, key: PlanKey | None
) -> None:
    """Beside an entry this job wrote into a cache directory, what it was planned for
    (``<key>.inputs.json``, as ``fastinit plan`` writes it), so that a later job's miss can name
    the input that differs. A description only: a failure is logged, never raised."""
    if key is None or not isinstance(cache, PlanCache):
        return
    try:
        with trace.span("fastinit.plan_cache.describe"):
            record_inputs(cache.directory, module, key, written_by="fastinit.setup")
    except Exception as e:  # noqa: BLE001 - never fails a start-up
        logger.debug("fastinit plan cache: could not describe the entry: %s", e)


# -- phase 5: construction ---------------------------------------------------------------------


def _construct(
    module: nn.Module,
    env: ShardingEnv,
    device: torch.device,
    plan: ShardingPlan,
    sharders: list[Any],
    seed: int,
    init_parameters: bool,
    data_parallel_wrapper: DataParallelWrapper | None,
    model_tracker_configs: ModelTrackerConfigs | None,
    init_tables: bool = True,
) -> DistributedModelParallel:
    """TorchRec's DMP on the agreed plan, with fast sharders built from ``sharders`` and the
    agreed ``seed``: the plan's process groups only, DDP without init sync
    (``init_data_parallel`` is left to the caller, after the verify phase); with
    ``init_tables`` False, the sharded tables left pending and a forward refused until none is
    (:mod:`fastinit.tables`)."""
    from torchrec.distributed.model_parallel import (
        DefaultDataParallelWrapper,
        DistributedModelParallel,
    )

    from fastinit.sharding.sharders import fast_sharders

    pg = env.process_group
    if pg is not None:
        with trace.span("fastinit.process_groups"):
            fastinit_pg.prepare_for_plan(plan, pg=pg)
    wrapper: Any = data_parallel_wrapper
    if wrapper is None:
        wrapper = (
            _NoDataParallel()
            if pg is None
            else DefaultDataParallelWrapper(ddp_kwargs={"init_sync": False})
        )
    extra: dict[str, Any] = {}
    if model_tracker_configs is not None:
        extra["model_tracker_configs"] = model_tracker_configs
    from fastinit.sharding.sharders import tables_deferred

    with trace.span("fastinit.dmp"), tables_deferred(not init_tables):
        model = DistributedModelParallel(
            module,
            env=env,
            device=device,
            plan=plan,
            sharders=fast_sharders(sharders, seed),
            init_data_parallel=False,
            init_parameters=init_parameters,
            data_parallel_wrapper=wrapper,
            **extra,
        )
    if not init_tables:
        _refuse_forward_while_pending(model)
    return model


def _refuse_forward_while_pending(model: nn.Module) -> None:
    """A forward pre-hook that raises while tables are pending and removes itself once none is."""
    from fastinit import tables

    def hook(module: nn.Module, args: Any) -> None:
        message = tables.refuse_pending(module, "forward")
        if message is not None:
            raise StartupError(message)
        handle.remove()

    handle = model.register_forward_pre_hook(hook)


class _NoDataParallel:
    """A data-parallel wrapper for a job without a process group: nothing to replicate."""

    def wrap(self, dmp: Any, env: Any, device: torch.device) -> None:
        return None


def _sharded_paths(module: nn.Module, plan: ShardingPlan) -> list[str]:
    modules = dict(module.named_modules())
    return [path for path in plan.plan if path in modules]


# -- helpers -----------------------------------------------------------------------------------


def _adopt_rank0_settings(records: Sequence[Record]) -> int:
    """Rank 0's seed (returned: the sharders are built with it) and collective-validation
    setting, from the records: what stock would broadcast, already known."""
    seed = protocol.agreed_seed(records)
    set_collective_validation(records[0].validate)  # so DMP's own call sends nothing
    return seed


def _log_summary(
    channel: protocol.Channel,
    records: Sequence[Record],
    local: _Local,
    phases: _Phases,
    differed: list[str],
) -> None:
    """One INFO line on rank 0; the details (each phase's seconds) at DEBUG on every rank."""
    seconds = phases.total()
    if channel.rank == 0:
        logger.info(
            "fastinit.setup: %.2fs, world %d, plan %s, %d start-up collective(s), %d bytes sent%s",
            seconds,
            channel.world_size,
            protocol.plan_source(local.record),
            channel.collectives,
            channel.bytes,
            f", {len(differed)} replicated tensor(s) set from rank 0" if differed else "",
        )
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "fastinit.setup rank %d: phases %s; ops %s on %s; plan sources %s; seed %d",
            channel.rank,
            ", ".join(f"{k} {v:.3f}s" for k, v in phases.seconds.items()),
            channel.ops,
            channel.device,
            [protocol.plan_source(r) for r in records],
            records[0].seed,
        )


@contextlib.contextmanager
def _tracer_from_env() -> Iterator[None]:
    """With ``FASTINIT_TRACE_DIR`` set and no tracer running, trace this ``setup`` call and write
    ``trace-rank<N>.jsonl`` there (a directory that cannot be written: a warning, untraced)."""
    out_dir = knobs.get_trace_dir()
    if out_dir is None or trace.active() is not None:
        yield
        return
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    with trace.traced_to(out_dir, rank):
        yield


# -- planning ahead (``fastinit plan``) ---------------------------------------------------------


def plan_ahead(
    module: nn.Module,
    cache_dir: str | os.PathLike[str],
    *,
    world_size: int,
    local_world_size: int,
    device: torch.device,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    planner: ShardingPlanner | None = None,
    force: bool = False,
) -> PlanSummary:
    """Plan ``module`` as ``fastinit.setup`` would in a job of that shape; store it in the cache.

    Args:
        module: the model, built as the job builds it (same factory, same device: "meta").
        cache_dir: the plan-cache directory the job will use (``plan_cache=`` or
            ``FASTINIT_PLAN_CACHE``).
        world_size: the job's ranks.
        local_world_size: the job's ranks per host.
        device: the job's compute device.
        sharders: the sharders the job passes to ``setup`` (default TorchRec's).
        planner: the planner the job passes to ``setup`` (default ``FastPlanner`` for the job's
            topology).
        force: replace an entry of the same key that holds a different plan.

    Returns:
        A :class:`PlanSummary`.

    Raises:
        ValueError: ``world_size`` is not a positive multiple of ``local_world_size``.
        PlanCacheError: the key cannot be cached, an entry with a different plan is in the way,
            or the cache cannot be written.
    """
    compat.require("planner")
    compat.require("sharders")
    if world_size < 1 or local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"world_size ({world_size}) must be a positive multiple of local_world_size "
            f"({local_world_size})"
        )
    key = plan_key(
        module,
        world_size=world_size,
        local_world_size=local_world_size,
        device=device,
        sharders=sharders,
        planner=planner,
    )
    if key.uncacheable is not None:
        raise PlanCacheError(f"this job's plan cannot be cached: {key.uncacheable}")
    cache = PlanCache(cache_dir)
    t0 = time.perf_counter()
    plan = key.planner.plan(module, list(key.sharders))
    seconds = time.perf_counter() - t0
    validate_plan(module, plan, list(key.sharders), world_size=world_size)
    existing = cache.get(key.fingerprint)
    status = "written"
    if existing is not None:
        if encode_plan(existing) == encode_plan(plan):
            status = "unchanged"
        elif not force:
            raise PlanCacheError(
                f"{cache.path(key.fingerprint)} holds a different plan for the same inputs "
                "(a nondeterministic planner?); pass --force (force=True) to replace it"
            )
        else:
            status = "replaced"
    if status != "unchanged" and not cache.put(key.fingerprint, plan):
        raise PlanCacheError(f"cannot write the plan cache in {cache_dir} (see the warning above)")
    try:
        inputs: str | None = os.fspath(
            record_inputs(cache_dir, module, key, written_by="fastinit plan")
        )
    except OSError as e:
        logger.warning("cannot describe the entry's inputs beside it: %s", e)
        inputs = None
    by_type, by_kernel, shards, nbytes = summarize_plan(plan, module, key.sharders, world_size)
    return PlanSummary(
        key=key.fingerprint.hex(),
        entry=cache.path(key.fingerprint),
        inputs=inputs,
        status=status,
        planner=f"{type(key.planner).__module__}.{type(key.planner).__qualname__}",
        seconds=seconds,
        world_size=world_size,
        local_world_size=local_world_size,
        device=device.type,
        tables_by_type=by_type,
        tables_by_kernel=by_kernel,
        rank_shards=shards,
        rank_bytes=nbytes,
        tables=table_layouts(plan, world_size),
    )
