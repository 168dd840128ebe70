"""``FastPlanner``: TorchRec's ``EmbeddingShardingPlanner`` plan, found much sooner.

The entry point. The code lives in files named after the TorchRec files it mirrors
(``torchrec/distributed/planner/<name>.py`` -> ``fastinit/sharding/mirror/planner/<name>.py``):
``planners.py`` (``FastPlanner``, the proposal stream), ``proposers.py`` (the stock proposers,
replayed on option indices) and ``partitioners.py`` (the greedy partitioner and the rating, on
flat arrays); how the search returns the stock plan is in ``planners.py`` and docs/planner.md.
"""

from __future__ import annotations

from fastinit.sharding.mirror.planner.planners import FastPlanner

__all__ = ["FastPlanner"]
