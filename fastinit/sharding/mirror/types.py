"""Mirrors ``torchrec/distributed/types.py``: ``ShardingEnv.from_process_group``
(:func:`sharding_env_from_process_group`), its device mesh taken from the group itself.

``fastinit.setup`` builds its environment with it when it is given none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fastinit import protocol

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingEnv

__all__ = ["sharding_env_from_process_group"]


def sharding_env_from_process_group(pg: dist.ProcessGroup, device: torch.device) -> ShardingEnv:
    """A ``ShardingEnv`` on ``pg`` whose device mesh comes from the group itself (stock builds a
    new mesh with ``init_device_mesh``, on the device torch uses for object collectives)."""
    from torchrec.distributed.types import ShardingEnv

    env = ShardingEnv.__new__(ShardingEnv)
    env.world_size = dist.get_world_size(pg)
    env.rank = dist.get_rank(pg)
    env.process_group = pg
    env.device_mesh = DeviceMesh.from_group(pg, protocol.comm_device(pg, device).type)
    env.output_dtensor = False
    return env
