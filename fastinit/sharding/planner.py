"""``FastPlanner``: TorchRec's ``EmbeddingShardingPlanner`` plan, found much sooner.

The entry point. The code lives in files named after the TorchRec files it mirrors
(``torchrec/distributed/planner/<name>.py`` -> ``fastinit/sharding/mirror/planner/<name>.py``):
``planners.py`` (``FastPlanner``, the proposal stream), ``proposers.py`` (the stock proposers,
replayed on option indices) and ``partitioners.py`` (the greedy partitioner and the rating, on
flat arrays); how the search returns the stock plan is in ``planners.py`` and docs/planner.md.
The private names below are re-exported for the tests and benchmarks that reach into the search.
"""

from __future__ import annotations

from fastinit.sharding.mirror.planner.partitioners import _CUT as _CUT
from fastinit.sharding.mirror.planner.partitioners import _EXACT_BITS as _EXACT_BITS
from fastinit.sharding.mirror.planner.partitioners import _PRUNE_SLACK as _PRUNE_SLACK
from fastinit.sharding.mirror.planner.partitioners import _SCALAR as _SCALAR
from fastinit.sharding.mirror.planner.partitioners import _counts as _counts
from fastinit.sharding.mirror.planner.partitioners import _Cut as _Cut
from fastinit.sharding.mirror.planner.partitioners import _CutType as _CutType
from fastinit.sharding.mirror.planner.partitioners import _device_place as _device_place
from fastinit.sharding.mirror.planner.partitioners import _exact as _exact
from fastinit.sharding.mirror.planner.partitioners import _expand as _expand
from fastinit.sharding.mirror.planner.partitioners import _Hosts as _Hosts
from fastinit.sharding.mirror.planner.partitioners import _Opt as _Opt
from fastinit.sharding.mirror.planner.partitioners import _partition_classes as _partition_classes
from fastinit.sharding.mirror.planner.partitioners import _ScalarType as _ScalarType
from fastinit.sharding.mirror.planner.partitioners import _Search as _Search
from fastinit.sharding.mirror.planner.partitioners import _State as _State
from fastinit.sharding.mirror.planner.partitioners import _Unsupported as _Unsupported
from fastinit.sharding.mirror.planner.planners import _PLAN as _PLAN
from fastinit.sharding.mirror.planner.planners import FastPlanner
from fastinit.sharding.mirror.planner.planners import _Best as _Best
from fastinit.sharding.mirror.planner.planners import _proposal_storage as _proposal_storage
from fastinit.sharding.mirror.planner.planners import _reservation_text as _reservation_text
from fastinit.sharding.mirror.planner.planners import _Stream as _Stream
from fastinit.sharding.mirror.planner.proposers import _by_fqn as _by_fqn
from fastinit.sharding.mirror.planner.proposers import _Changes as _Changes
from fastinit.sharding.mirror.planner.proposers import _GreedyReplay as _GreedyReplay
from fastinit.sharding.mirror.planner.proposers import _GridReplay as _GridReplay
from fastinit.sharding.mirror.planner.proposers import _ProposerReplay as _ProposerReplay
from fastinit.sharding.mirror.planner.proposers import _score as _score
from fastinit.sharding.mirror.planner.proposers import _UniformReplay as _UniformReplay
from fastinit.sharding.mirror.planner.types import _CW_KEY_VALUE as _CW_KEY_VALUE
from fastinit.sharding.mirror.planner.types import _DEVICE as _DEVICE
from fastinit.sharding.mirror.planner.types import _HOST as _HOST
from fastinit.sharding.mirror.planner.types import _UNIFORM as _UNIFORM

__all__ = ["FastPlanner"]
