"""Every touch of a private TorchRec name made by ``fastinit.planner``, in one place.

Written against torchrec 1.8.0. When TorchRec is upgraded, read the upstream source of the names
below.
"""

from __future__ import annotations

# =================================================================================================
# Section: planner (fastinit.planner.FastPlanner) -- written against torchrec 1.8.0.
#
# The ported enumerator and estimators live in files named after the upstream ones:
#   fastinit/planner/{enumerators,shard_estimators,types}.py and
#   fastinit/planner/estimator/estimator.py (each lists what it touches).
# Touches (the adapters FastPlanner reads and writes the stock components through):
#   torchrec.distributed.planner.proposers: GreedyProposer._threshold,
#       ._best_perf_rating, ._num_inferior_perf, ._use_depth; UniformProposer._use_depth;
#       GridSearchProposer._max_proposals.
#   torchrec.distributed.planner.partitioners: GreedyPerfPartitioner._sort_by, ._balance_modules.
#   torchrec.distributed.planner.storage_reservations: HeuristicalStorageReservation._percentage,
#       ._dense_storage, ._kjt_storage; FixedAbsoluteStorageReservation._hbm_reserved_bytes
#       (only to build the same "no plan" message as the stock planner).
#   torchrec.distributed.planner.perf_models: NoopPerfModel._topology.
# =================================================================================================
import functools
import logging
from typing import Any

from torchrec.distributed.planner.types import Topology


def greedy_proposer_state(proposer: Any) -> tuple[bool, int | None, float, int]:
    """The settings and carried-over state of a stock ``GreedyProposer``.

    Args:
        proposer: a ``torchrec.distributed.planner.proposers.GreedyProposer``.

    Returns:
        ``(use_depth, threshold, best_perf_rating, num_inferior_perf)``.
    """
    return (
        proposer._use_depth,
        proposer._threshold,
        proposer._best_perf_rating,
        proposer._num_inferior_perf,
    )


def set_greedy_proposer_state(proposer: Any, best_perf_rating: float, num_inferior: int) -> None:
    """Write back the state a stock ``GreedyProposer`` carries from one ``plan()`` to the next.

    Args:
        proposer: a ``GreedyProposer``.
        best_perf_rating: its ``_best_perf_rating`` after the search.
        num_inferior: its ``_num_inferior_perf`` after the search.
    """
    proposer._best_perf_rating = best_perf_rating
    proposer._num_inferior_perf = num_inferior


def uniform_proposer_use_depth(proposer: Any) -> bool:
    """``UniformProposer._use_depth``."""
    return bool(proposer._use_depth)


def grid_max_proposals(proposer: Any) -> int:
    """``GridSearchProposer._max_proposals``."""
    return int(proposer._max_proposals)


def partitioner_settings(partitioner: Any) -> tuple[str, bool]:
    """``(sort_by.value, balance_modules)`` of a stock ``GreedyPerfPartitioner``."""
    return partitioner._sort_by.value, bool(partitioner._balance_modules)


def perf_model_world_size(perf_model: Any) -> int:
    """``NoopPerfModel._topology.world_size`` (the length of its per-rank perf list)."""
    return int(perf_model._topology.world_size)


def reservation_percentage(reservation: Any) -> Any:
    """``reservation._percentage``; raises ``AttributeError`` where absent, as the stock message does."""
    return reservation._percentage


def storage_reservation_details(reservation: Any) -> dict[str, Any]:
    """The private fields of a storage reservation that the stock "no plan" message prints.

    Args:
        reservation: the planner's storage reservation.

    Returns:
        ``percentage``, ``dense_storage``, ``kjt_storage``, ``hbm_reserved_bytes`` (None if absent).
    """
    return {
        "percentage": getattr(reservation, "_percentage", None),
        "dense_storage": getattr(reservation, "_dense_storage", None),
        "kjt_storage": getattr(reservation, "_kjt_storage", None),
        "hbm_reserved_bytes": getattr(reservation, "_hbm_reserved_bytes", None),
    }


#: Device types a TorchRec planner might know; which it does is asked of the installed Topology.
_DEVICE_CANDIDATES = ("cpu", "cuda", "mtia", "tpu", "xpu", "hpu", "mps", "meta")


@functools.cache
def topology_compute_devices() -> frozenset[str]:
    """The ``compute_device`` values the installed TorchRec's ``Topology`` accepts (cpu, cuda,
    mtia in 1.8.0; tpu too in 1.9), found by building a one-rank topology for each."""
    quiet = logging.getLogger("torchrec.distributed.planner.types")
    hush = _DropAll()
    quiet.addFilter(hush)  # 1.9 warns about every Topology built directly
    out = set()
    try:
        for device in _DEVICE_CANDIDATES:
            try:
                Topology(world_size=1, local_world_size=1, compute_device=device)
            except (AssertionError, ValueError):
                continue
            out.add(device)
    finally:
        quiet.removeFilter(hush)
    return frozenset(out)


class _DropAll(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def sku_aware_reservation_class() -> type | None:
    """torchrec 1.9's ``SKUAwareStorageReservation`` (None where the installed one has none)."""
    from torchrec.distributed.planner import storage_reservations

    return getattr(storage_reservations, "SKUAwareStorageReservation", None)


def sku_aware_reservation_details(reservation: Any) -> dict[str, Any]:
    """The private fields of a ``SKUAwareStorageReservation`` the 1.9 "no plan" message prints."""
    return {
        "model_base_bytes": reservation._model_base_bytes,
        "margin_bytes": getattr(reservation, "_margin_bytes", None),
        "runtime_overhead_bytes": reservation._runtime_overhead_bytes,
    }


# ---- end of section: planner -------------------------------------------------------------------
