"""The stock TorchRec start-up path, instrumented: what fastinit is compared against.

``collective_plan`` (rank 0 plans, two ``broadcast_object_list`` broadcasts) followed by
``DistributedModelParallel``: exactly what a TorchRec 1.8.0 trainer does, with each phase a span.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastinit import trace

__all__ = ["stock_setup"]


def stock_setup(
    module: nn.Module,
    plan: Any = None,
    *,
    device: torch.device | None = None,
    planner: Any = None,
    sharders: list[Any] | None = None,
    phases: dict[str, dict[str, Any]] | None = None,
) -> Any:
    """Shard ``module`` the stock way and return the ``DistributedModelParallel``.

    Args:
        module: the model, usually on the meta device.
        plan: an explicit plan; when None, ``planner.collective_plan`` makes one (rank 0 plans).
        device: the compute device (default CPU).
        planner: the planner; default TorchRec's ``EmbeddingShardingPlanner`` for the world.
        sharders: the sharders (default TorchRec's).
        phases: when given and a tracer is active, filled with per-phase counts
            (``"plan"``, ``"dmp"``) from :meth:`fastinit.trace.Tracer.window`.
    """
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    device = device or torch.device("cpu")
    tracer = trace.active()

    def window(name: str) -> Any:
        return tracer.window(name) if tracer is not None else _NullWindow(name)

    with window("plan") as counts:
        if plan is None:
            if planner is None:
                planner = EmbeddingShardingPlanner(
                    topology=Topology(world_size=dist.get_world_size(), compute_device=device.type)
                )
            plan = planner.collective_plan(module, sharders, dist.GroupMember.WORLD)
    if phases is not None:
        phases["plan"] = counts
    with window("dmp") as counts:
        model = DistributedModelParallel(module, device=device, plan=plan, sharders=sharders)
    if phases is not None:
        phases["dmp"] = counts
    return model


class _NullWindow(trace.span):
    __slots__ = ()

    def __enter__(self) -> dict[str, Any]:  # type: ignore[override]
        super().__enter__()
        return {}
