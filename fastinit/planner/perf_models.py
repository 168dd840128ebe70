"""Mirrors ``torchrec/distributed/planner/perf_models.py`` (written against torchrec 1.8.0).

``NoopPerfModel.rate`` ported as ``noop_rate``: the rating of a partitioned proposal, on the flat
arrays of the partitioner replay (``partitioners.Search._rate`` calls it). Registered in
``fastinit/ports.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fastinit.planner.types import UNIFORM


def noop_rate(search: Any, proposal: Sequence[int], ranks: list[list[int]]) -> float:
    """``NoopPerfModel.rate``: per-rank sums in proposal order, then the maximum.

    ``search`` is the ``partitioners.Search`` (its options and rated world size; not imported
    here: ``partitioners`` imports this module).
    """
    opts = search.opts
    perfs = np.zeros(search.rating_ws, dtype=np.float64)
    run_r: list[int] = []
    run_t: list[float] = []
    for pos, i in enumerate(proposal):
        o = opts[i]
        if o.kind == UNIFORM and o.n == search.rating_ws:
            if run_r:
                np.add.at(perfs, run_r, run_t)
                run_r, run_t = [], []
            if o.const:
                perfs += o.tot_d[0]
            else:
                perfs += o.vecs()[2]
        else:
            run_r.extend(ranks[pos])
            run_t.extend(o.tot if o.kind != UNIFORM else o.tot_full())
    if run_r:
        np.add.at(perfs, run_r, run_t)
    return float(perfs.max())
