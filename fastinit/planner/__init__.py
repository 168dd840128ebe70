"""The planner: :class:`FastPlanner`, TorchRec's ``EmbeddingShardingPlanner`` plan, found much sooner.

Its modules are named after the TorchRec files they mirror
(``torchrec/distributed/planner/<name>.py`` -> ``fastinit/planner/<name>.py``):
``planners.py`` (``FastPlanner``, the proposal stream), ``proposers.py`` (the stock proposers,
replayed on option indices), ``partitioners.py`` (the greedy partitioner and the rating, on flat
arrays), ``perf_models.py``, ``enumerators.py``, ``shard_estimators.py``, ``types.py`` and
``estimator/estimator.py``; ``_torchrec.py`` holds its touches of private TorchRec names. Every
mirrored function is registered, with the hash of the upstream source per release, in
``fastinit/ports.py`` (docs/ports.md). How the search returns the stock plan is in
``planners.py`` and docs/planner.md.

What one of these modules uses from another is named without an underscore (``partitioners.Search``,
``proposers.GreedyReplay``, ``types.UNIFORM``, ...): the package's internal API. A leading
underscore means private to its module.

Nothing heavy is imported here: names below load their module (and TorchRec) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastinit._lazy import lazy_exports

if TYPE_CHECKING:
    from fastinit.planner.planners import FastPlanner

__all__ = ["FastPlanner"]

_EXPORTS = {
    "FastPlanner": ".planners",
}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
