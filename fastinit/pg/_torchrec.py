"""Every touch of a private TorchRec name made by ``fastinit.pg``, in one place.

Written against torchrec 1.8.0. Whether the names below are there is
decided by capability (``fastinit.compat.missing("pg")``); when one is missing,
:func:`unsupported_reason` names it and :func:`fastinit.pg.prepare_for_plan` falls back to
TorchRec's own groups. When TorchRec is upgraded, read the upstream source of the names below.

Touches:
    torchrec.distributed.comm._INTRA_PG, _CROSS_PG: the module globals that
        ``comm.intra_and_cross_node_pg`` returns once set (it creates every intra- and cross-node
        group on every rank, then runs 2 world barriers, only while they are None). In 1.8.0 it is
        called, in the 1-D case (a plain ``ShardingEnv``), by ``BaseTwRwEmbeddingSharding.__init__``
        (sharding/twrw_sharding.py), ``BaseGridEmbeddingSharding.__init__``
        (sharding/grid_sharding.py), ``collective_utils`` (the intra-node group only),
        ``rw_kjt_pool_sharding`` and ``embedding_tower_sharding``. Setting both globals makes all
        of them use fastinit's groups without creating anything.

Not touched: ``_INTRA_PG_2D`` / ``_CROSS_PG_2D`` / ``_NODE_GROUP_SIZE_2D``, which
``intra_and_cross_node_pg_2D`` fills for a ``ShardingEnv2D`` (``DMPCollection``); that path still
creates TorchRec's own groups.

Public TorchRec names used here for the same reason (to agree with what the sharders will do):
``comm.get_local_size`` and ``comm.get_topology_group_world_size`` (the group size
``intra_and_cross_node_pg`` uses: ``LOCAL_WORLD_SIZE``, or the pod size when
``TORCHREC_RESOLVED_POD_SIZE`` is set).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "torchrec_version",
    "unsupported_reason",
    "default_local_size",
    "installed_node_groups",
    "install_node_groups",
    "reset_node_groups",
]

_GLOBALS = ("_INTRA_PG", "_CROSS_PG")


def _comm() -> Any:
    import torchrec.distributed.comm as comm

    return comm


def torchrec_version() -> str:
    """The installed torchrec's version, without a local suffix (``1.8.0+cu128`` -> ``1.8.0``)."""
    import torchrec

    return str(getattr(torchrec, "__version__", "unknown")).split("+")[0]


def unsupported_reason() -> str | None:
    """Why fastinit cannot install its node groups into this TorchRec, or None if it can.

    Decided by capability (:func:`fastinit.compat.missing`), not by the version string, so a
    TorchRec source build whose version reads "unknown" works when the names are there.
    """
    from fastinit import compat

    missing = compat.missing("pg")
    if missing:
        return "torchrec lacks what fastinit.pg needs: " + "; ".join(missing)
    return None


def _check() -> Any:
    reason = unsupported_reason()
    if reason is not None:
        raise RuntimeError(reason)
    return _comm()


def default_local_size(world_size: int) -> int:
    """The node-group size TorchRec's ``intra_and_cross_node_pg`` would use for ``world_size``.

    ``comm.get_local_size`` (``LOCAL_WORLD_SIZE``, falling back to the world size), or the pod size
    ``comm.get_topology_group_world_size`` computes when ``TORCHREC_RESOLVED_POD_SIZE`` is set.
    """
    comm = _comm()
    if os.environ.get("TORCHREC_RESOLVED_POD_SIZE") is None:
        # Same value as get_topology_group_world_size, without its warning on every call.
        return int(comm.get_local_size(world_size))
    return int(comm.get_topology_group_world_size(world_size))


def installed_node_groups() -> tuple[ProcessGroup | None, ProcessGroup | None]:
    """TorchRec's cached (intra-node, cross-node) groups; (None, None) before anything set them."""
    comm = _check()
    return comm._INTRA_PG, comm._CROSS_PG


def install_node_groups(intra: ProcessGroup, cross: ProcessGroup) -> None:
    """Make TorchRec's TWRW and GRID sharding (and every other 1-D user) use these groups.

    Raises:
        RuntimeError: the installed torchrec is not the version this was written against.
    """
    comm = _check()
    comm._INTRA_PG = intra
    comm._CROSS_PG = cross


def reset_node_groups() -> None:
    """Forget TorchRec's cached node groups, so its next ``intra_and_cross_node_pg`` creates them.

    For tests and benchmarks that run the stock path and fastinit's in one process.
    """
    comm = _check()
    comm._INTRA_PG = None
    comm._CROSS_PG = None
