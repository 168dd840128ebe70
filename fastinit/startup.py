"""``fastinit.setup``: TorchRec's ``DistributedModelParallel``, with near-zero start-up messages.

The start-up protocol (DESIGN.md, "verify cheaply, send only what differs"):

1. Every rank builds a fixed-size record — fingerprint of its planner inputs, digest of the plan it
   holds (explicit or from the cache), digest of its dense parameters (or "on meta"), the planning
   rank's encoded plan length, rank 0's default seed and collective-validation flag, and an error
   slot — and the ranks exchange them in **one all_gather**. Any disagreement raises the same
   :class:`StartupMismatchError` on every rank, naming the ranks that differ. A rank that failed
   before the exchange (planning raised, say) still joins it with its error, so every rank raises
   instead of hanging.
2. Every rank already holds the same plan: no broadcast. Otherwise **one broadcast** of the
   encoded plan (pickle-free, see :mod:`fastinit.sharding.codec`), checked against its digest.
3. Dense parameters differ (eagerly initialised with unsynchronised RNG): **one coalesced
   broadcast** from rank 0. Parameters on the meta device are materialised from generators seeded
   by ``(seed, module FQN)``: identical on every rank with no message.
4. Everything else is local: shard metadata from the plan (fast sharders), process groups from the
   plan (:mod:`fastinit.pg`), DDP without init sync, collective validation configured from the
   record, ``ShardingEnv`` on the existing group through ``DeviceMesh.from_group``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastinit import compat, knobs, trace
from fastinit.errors import PlanMismatchError, StartupError, StartupMismatchError
from fastinit.seeding import materialize_dense
from fastinit.sharding.validate import validate_plan

logger = logging.getLogger(__name__)

__all__ = ["setup", "validate_plan", "StartupError", "StartupMismatchError", "PlanMismatchError"]

_RECORD_VERSION = 1
_ERROR_BYTES = 384
# version, flags, fingerprint, plan digest, dense digest, plan length, seed, error length, error
_RECORD = struct.Struct(f"<BB32s32s32sQqH{_ERROR_BYTES}s")
_HAS_PLAN, _EXPLICIT, _DENSE_META, _FAILED, _VALIDATE, _PLANNER = (1, 2, 4, 8, 16, 32)


@dataclasses.dataclass(slots=True)
class _Record:
    flags: int
    fingerprint: bytes
    plan_digest: bytes
    dense_digest: bytes
    plan_len: int
    seed: int
    error: str

    def pack(self) -> bytes:
        err = self.error.encode("utf-8", "replace")[:_ERROR_BYTES]
        return _RECORD.pack(
            _RECORD_VERSION,
            self.flags,
            self.fingerprint,
            self.plan_digest,
            self.dense_digest,
            self.plan_len,
            self.seed,
            len(err),
            err,
        )

    @classmethod
    def unpack(cls, data: bytes) -> _Record:
        version, flags, fp, pd, dd, plen, seed, elen, err = _RECORD.unpack(data)
        if version != _RECORD_VERSION:
            raise StartupError(f"start-up record version {version}, expected {_RECORD_VERSION}")
        return cls(flags, fp, pd, dd, plen, seed, err[:elen].decode("utf-8", "replace"))


def _group_ranks(values: list[bytes]) -> str:
    groups: dict[bytes, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    return "; ".join(f"ranks {ranks} have {v.hex()[:12]}" for v, ranks in groups.items())


def _sharded_paths(module: nn.Module, sharders: list[Any], plan: Any) -> list[str]:
    types = tuple(s.module_type for s in sharders)
    return [
        path for path, m in module.named_modules() if isinstance(m, types) and path in plan.plan
    ]


def _dense_named_tensors(module: nn.Module, sharded: list[str]) -> list[tuple[str, torch.Tensor]]:
    prefixes = tuple(f"{p}." for p in sharded if p) if "" not in sharded else ("",)
    out = []
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if prefixes and name.startswith(prefixes):
            continue
        out.append((name, t))
    return out


def _embedding_state_names(module: nn.Module, paths: list[str]) -> set[str]:
    """Names of every parameter and buffer under the modules at ``paths``."""
    names: set[str] = set()
    for path in paths:
        sub = module.get_submodule(path)
        prefix = f"{path}." if path else ""
        names.update(prefix + n for n, _ in sub.named_parameters())
        names.update(prefix + n for n, _ in sub.named_buffers())
    return names


def _default_planner(env_world_size: int, device: torch.device) -> Any:
    from torchrec.distributed.comm import get_local_size
    from torchrec.distributed.planner import Topology

    from fastinit.sharding.planner import FastPlanner

    return FastPlanner(
        topology=Topology(
            local_world_size=get_local_size(env_world_size),
            world_size=env_world_size,
            compute_device=device.type,
        )
    )


def _default_topology(env_world_size: int, device: torch.device) -> Any:
    """The topology ``_default_planner`` plans for (without building a planner: TorchRec's method
    logger formats the topology, O(ranks), on every planner construction)."""
    from torchrec.distributed.comm import get_local_size
    from torchrec.distributed.planner import Topology

    return Topology(
        local_world_size=get_local_size(env_world_size),
        world_size=env_world_size,
        compute_device=device.type,
    )


def _make_env(pg: Any, device: torch.device) -> Any:
    """A ``ShardingEnv`` on ``pg`` whose device mesh comes from the group itself."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchrec.distributed.types import ShardingEnv

    env = ShardingEnv.__new__(ShardingEnv)
    env.world_size = dist.get_world_size(pg)
    env.rank = dist.get_rank(pg)
    env.process_group = pg
    mesh_device = "cpu" if dist.get_backend(pg) == "gloo" else device.type
    env.device_mesh = DeviceMesh.from_group(pg, mesh_device)
    env.output_dtensor = False
    return env


class _NoDataParallel:
    """A data-parallel wrapper for a job without a process group: nothing to replicate."""

    def wrap(self, dmp: Any, env: Any, device: torch.device) -> None:
        return None


def _ensure_process_group(device: torch.device) -> Any:
    if dist.is_initialized():
        return dist.GroupMember.WORLD
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.info("fastinit.setup: no process group; creating a world of one (%s)", backend)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.GroupMember.WORLD


def setup(
    module: nn.Module,
    env: Any = None,
    device: torch.device | None = None,
    plan: Any = None,
    sharders: list[Any] | None = None,
    init_data_parallel: bool = True,
    init_parameters: bool = True,
    data_parallel_wrapper: Any = None,
    *,
    planner: Any = None,
    plan_cache: str | os.PathLike[str] | None = None,
    seed: int | None = None,
) -> Any:
    """Shard ``module`` as ``DistributedModelParallel`` would, with at most 2 start-up collectives.

    Args:
        module: the model, usually built on the meta device.
        env: the ``ShardingEnv``; default: the world process group (a world of one is created
            when no process group exists).
        device: the compute device (default CPU).
        plan: an explicit ``ShardingPlan``; every rank must pass the same one.
        sharders: the sharders (default TorchRec's); stock EBC/EC sharders are replaced by fast
            subclasses with the same settings.
        init_data_parallel: as for ``DistributedModelParallel``.
        init_parameters: as for ``DistributedModelParallel``; meta parameters are materialised
            from seeded generators.
        data_parallel_wrapper: as for ``DistributedModelParallel``; the default wraps the dense
            part in DDP without its init sync once the dense parameters are known to agree.
        planner: plans when ``plan`` is None (default: fastinit's planner for the topology of
            ``env``). Only one rank plans.
        plan_cache: plan-cache directory (default ``FASTINIT_PLAN_CACHE``); a hit means no
            planning at all.
        seed: seeds the materialisation of meta parameters per module FQN; default: rank 0's
            ``torch.initial_seed()``, shared through the start-up record.

    Returns:
        A ``torchrec.distributed.model_parallel.DistributedModelParallel``.

    Raises:
        StartupMismatchError: ranks disagree on planner inputs or on an explicit plan.
        StartupError: start-up failed on some rank (planning, a dead peer, a corrupt plan).
    """
    from torchrec.distributed.model_parallel import (
        DefaultDataParallelWrapper,
        DistributedModelParallel,
    )

    from fastinit.sharding import _torchrec_modules as _trc
    from fastinit.sharding.cache import PlanCache, resolve_cache_dir
    from fastinit.sharding.codec import encode_plan
    from fastinit.sharding.fingerprint import dense_digest as dense_digest_of
    from fastinit.sharding.fingerprint import planner_fingerprint
    from fastinit.sharding.sharders import fast_sharders

    compat.require("setup")
    device = device or torch.device("cpu")
    with _tracer_from_env(), trace.span("fastinit.setup"):
        pg = env.process_group if env is not None else _ensure_process_group(device)
        if env is None:
            env = _make_env(pg, device)
        world_size, rank = env.world_size, env.rank
        if pg is None and world_size > 1:
            raise StartupError("fastinit.setup needs a process group when world_size > 1")
        local_seed = int(seed) if seed is not None else int(torch.initial_seed()) & ((1 << 63) - 1)
        all_sharders = fast_sharders(sharders, local_seed)
        flags = _VALIDATE if _trc.collective_validation_on_leader() else 0
        error = ""
        fingerprint = b"\0" * 32
        digest = b"\0" * 32
        encoded: bytes | None = None
        cache = None
        try:
            if planner is None and plan is not None:  # scale: no planner (O(ranks)) for a plan
                topology, constraints = _default_topology(world_size, device), None
            else:
                planner = planner or _default_planner(world_size, device)
                topology, constraints = _trc.planner_inputs(planner)
            with trace.span("fastinit.fingerprint"):
                fingerprint = planner_fingerprint(
                    module, all_sharders, topology, constraints=constraints, planner=planner
                )
            if plan is None:
                cache_dir = resolve_cache_dir(plan_cache)
                if cache_dir is not None:
                    cache = PlanCache(cache_dir)
                    with trace.span("fastinit.plan_cache.get"):
                        cached = cache.get(fingerprint)
                    if cached is not None:
                        plan = cached
                if plan is None and rank == 0:
                    with trace.span("fastinit.plan"):
                        plan = planner.plan(module, all_sharders)
                    flags |= _PLANNER
            else:
                flags |= _EXPLICIT
            if plan is not None:
                validate_plan(module, plan, all_sharders)
                encoded = encode_plan(plan)
                digest = hashlib.sha256(encoded).digest()  # = codec.plan_digest(plan)
                flags |= _HAS_PLAN
        except Exception as e:  # joins the exchange with its error: nobody hangs
            error = f"{type(e).__name__}: {e}"
            flags |= _FAILED
            failure: Exception | None = e
        else:
            failure = None

        # Every rank leaves out the same subtrees (all embedding modules, planned or not), so
        # the digests compare like with like whether or not a rank holds the plan yet.
        types = tuple(s.module_type for s in all_sharders)
        embedding_paths = [p for p, m in module.named_modules() if isinstance(m, types)]
        dense_digest = dense_digest_of(module, _embedding_state_names(module, embedding_paths))
        if dense_digest is None:
            flags |= _DENSE_META
        mine = _Record(
            flags=flags,
            fingerprint=fingerprint,
            plan_digest=digest,
            dense_digest=dense_digest or b"\0" * 32,
            plan_len=len(encoded) if encoded is not None else 0,
            seed=local_seed,
            error=error,
        )
        records = _exchange(mine, pg, world_size)
        _check(records, rank, failure)

        # Every rank agrees: take the plan, broadcasting it only if someone lacks it.
        leader = records[0]
        seed_used = int(seed) if seed is not None else leader.seed
        if seed_used != local_seed:
            for s in all_sharders:
                _set_seed(s, seed_used)
        holders = [r for r, rec in enumerate(records) if rec.flags & _HAS_PLAN]
        src = holders[0]
        if len(holders) < world_size or len({records[r].plan_digest for r in holders}) > 1:
            plan = _broadcast_plan(encoded, records[src], src, rank, pg)
        # Ranks whose lookup missed fill the cache: the planner, and one rank per host.
        local_leader = os.environ.get("LOCAL_RANK", "0") == "0"
        if cache is not None and (flags & _PLANNER or (not flags & _HAS_PLAN and local_leader)):
            with trace.span("fastinit.plan_cache.put"):
                cache.put(fingerprint, plan)

        # Collective validation: what rank 0 would have broadcast.
        _trc.set_collective_validation(bool(leader.flags & _VALIDATE))

        sharded = _sharded_paths(module, all_sharders, plan)
        dense_meta = [bool(rec.flags & _DENSE_META) for rec in records]
        dense_differs = not all(dense_meta) and (
            any(dense_meta) or len({rec.dense_digest for rec in records}) > 1
        )
        if init_parameters:
            with trace.span("fastinit.materialize_dense"):
                materialize_dense(module, sharded, device, seed_used)

        from fastinit import pg as fastinit_pg

        if pg is not None:
            with trace.span("fastinit.process_groups"):
                fastinit_pg.prepare_for_plan(plan, pg=pg)

        if data_parallel_wrapper is None:
            if pg is None:
                data_parallel_wrapper = _NoDataParallel()
            else:
                data_parallel_wrapper = DefaultDataParallelWrapper(ddp_kwargs={"init_sync": False})
        with trace.span("fastinit.dmp"):
            model = DistributedModelParallel(
                module,
                env=env,
                device=device,
                plan=plan,
                sharders=all_sharders,
                init_data_parallel=False,
                init_parameters=init_parameters,
                data_parallel_wrapper=data_parallel_wrapper,
            )
        if dense_differs and world_size > 1:
            with trace.span("fastinit.dense_broadcast"):
                _broadcast_dense(model, sharded, pg)
        if init_data_parallel:
            model.init_data_parallel()
    return model


@contextlib.contextmanager
def _tracer_from_env() -> Iterator[None]:
    """With ``FASTINIT_TRACE_DIR`` set and no tracer running, trace this ``setup`` call and write
    ``trace-rank<N>.jsonl`` there."""
    out_dir = knobs.get_trace_dir()
    if out_dir is None or trace.active() is not None:
        yield
        return
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    tracer = trace.Tracer(rank=rank, out_dir=out_dir).start()
    try:
        yield
    finally:
        tracer.stop()


def _set_seed(sharder: Any, seed: int) -> None:
    if hasattr(sharder, "seed"):
        sharder.seed = seed
    for attr in ("_ebc_sharder", "_e_sharder", "_ec_sharder"):
        inner = getattr(sharder, attr, None)
        if inner is not None and hasattr(inner, "seed"):
            inner.seed = seed


def _wait(work: Any, what: str, rank: int) -> None:
    from datetime import timedelta

    try:
        work.wait(timedelta(seconds=knobs.get_collective_timeout()))
    except Exception as e:
        raise StartupError(
            f"fastinit.setup on rank {rank}: the {what} failed — a peer died, hung or has not "
            f"called fastinit.setup (FASTINIT_COLLECTIVE_TIMEOUT="
            f"{knobs.get_collective_timeout():.0f}s): {e}"
        ) from e


def _exchange(mine: _Record, pg: Any, world_size: int) -> list[_Record]:
    if world_size == 1:
        return [mine]
    data = torch.frombuffer(bytearray(mine.pack()), dtype=torch.uint8)
    out = [torch.empty_like(data) for _ in range(world_size)]
    work = dist.all_gather(out, data, group=pg, async_op=True)
    _wait(work, "start-up record all_gather", dist.get_rank())
    return [_Record.unpack(bytes(t.numpy())) for t in out]


def _check(records: list[_Record], rank: int, failure: Exception | None) -> None:
    failed = [(r, rec.error) for r, rec in enumerate(records) if rec.flags & _FAILED]
    if failed:
        lines = "; ".join(f"rank {r}: {err}" for r, err in failed)
        raise StartupError(f"fastinit.setup failed on {len(failed)} rank(s): {lines}") from failure
    explicit = [bool(rec.flags & _EXPLICIT) for rec in records]
    if any(explicit) and not all(explicit):
        ranks = [r for r, e in enumerate(explicit) if e]
        raise StartupMismatchError(
            f"an explicit plan was passed on ranks {ranks} only; pass it on every rank or none"
        )
    if all(explicit):
        digests = [rec.plan_digest for rec in records]
        if len(set(digests)) > 1:
            raise StartupMismatchError(
                "ranks were given different explicit plans: " + _group_ranks(digests)
            )
    fps = [rec.fingerprint for rec in records]
    if len(set(fps)) > 1:
        raise StartupMismatchError(
            "planner inputs differ across ranks (module tables, sharders, topology, constraints "
            "or planner settings): " + _group_ranks(fps) + ". Every rank must build the same model."
        )
    if not any(rec.flags & _HAS_PLAN for rec in records):
        raise StartupError("no rank holds a plan after planning (internal error)")


def _broadcast_plan(encoded: bytes | None, source: _Record, src: int, rank: int, pg: Any) -> Any:
    from fastinit.sharding.codec import decode_plan

    if rank == src:
        assert encoded is not None
        buf = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    else:
        buf = torch.empty(source.plan_len, dtype=torch.uint8)
    work = dist.broadcast(buf, src=dist.get_global_rank(pg, src), group=pg, async_op=True)
    _wait(work, "plan broadcast", rank)
    data = bytes(buf.numpy())
    if hashlib.sha256(data).digest() != source.plan_digest:
        raise StartupError(f"rank {rank}: the plan received from rank {src} fails its digest check")
    return decode_plan(data)


@torch.no_grad()
def _broadcast_dense(model: Any, sharded: list[str], pg: Any) -> None:
    tensors = [t for _, t in _dense_named_tensors(model.module, sharded) if t.numel()]
    if tensors:
        dist._broadcast_coalesced(pg, tensors, 250 * 1024 * 1024, 0)
