"""Every upstream function fastinit mirrors, with the hash of the source it mirrors, per release.

fastinit copies a few TorchRec (and torch) functions and methods, reduced or reshaped (the
planner's search, the enumerator, the estimators, the fused optimizer's constructor, the row-wise
and data-parallel shardings, ...), and runs others with a global name rebound
(:mod:`fastinit.sharding.kernels`). A copy is only right while the upstream source is the one it
was written from: a release that changes it must fail loudly, not train something else. So each
is listed in :data:`PORTS` with the fastinit code that mirrors it, and ``fastinit/_port_hashes.py``
holds, per supported release (``torchrec 1.8.0``, ``torchrec 1.9.2``, ``torch 2.13.0``, ...), the
sha256 of its normalised source (:func:`source_hash`: ``inspect.getsource`` of the installed
object, dedented, tokenised, comments and blank lines dropped; code, strings and docstrings kept).

:func:`check` (called by :func:`fastinit.compat.require`, so by ``fastinit.setup``,
``FastPlanner`` and ``fast_sharders``, once per component and process) raises
:class:`~fastinit.errors.CompatibilityError` naming every mirrored function whose installed
source matches no registered hash. ``FASTINIT_PORT_CHECK=warn`` turns that into one warning
(:mod:`fastinit.knobs`). Nothing is imported until a check runs.

For a new release: read the upstream diff of every function the check names (``python -m
tools.port_hashes --diff`` shows the hashes that changed), update the fastinit code that mirrors
it, then ``python -m tools.port_hashes --write`` in that release's environment registers its
hashes (it never drops another release's).

Example::

    from fastinit import ports

    ports.mismatches("planner")  # -> [] on a registered release
    ports.check("setup")  # CompatibilityError naming what changed, if anything did
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import inspect
import linecache
import logging
import re
import sys
import textwrap
import threading
import warnings
from typing import Any

from fastinit import knobs
from fastinit.errors import CompatibilityError

__all__ = [
    "PORTS",
    "Port",
    "Mismatch",
    "check",
    "discovered",
    "mismatches",
    "mirrored",
    "registered_releases",
    "release",
    "source_hash",
    "source_of",
    "installed_hashes",
]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Port:
    """One upstream function (method, property, class) fastinit mirrors."""

    component: str
    """The :data:`fastinit.compat.COMPONENTS` entry whose check covers it."""
    where: str
    """The fastinit code that mirrors it."""
    how: str = "ported"
    """``ported`` (a copy, reduced or reshaped), ``rebound`` (its own code run with a global
    name bound to a fastinit class) or ``assumed`` (fastinit relies on what it does)."""


_TR_PLANNER = "torchrec.distributed.planner."
_TR_DISTRIBUTED = "torchrec.distributed."
_ENUMERATORS = "fastinit.planner.enumerators"
_ESTIMATOR = "fastinit.planner.estimator.estimator"
_SHARD_ESTIMATORS = "fastinit.planner.shard_estimators"
_TYPES = "fastinit.planner.types"
_PROPOSERS = "fastinit.planner.proposers"
_PARTITIONERS = "fastinit.planner.partitioners"
_PERF_MODELS = "fastinit.planner.perf_models"
_PLANNERS = "fastinit.planner.planners"
_KERNELS = "fastinit.sharding.kernels"
_LOCAL = "fastinit.sharding.local"
_SHARDERS = "fastinit.sharding.sharders"
_MODULES = "fastinit.sharding._torchrec_modules"
_MIRROR = "fastinit.sharding.mirror."

#: ``"module:qualname"`` of the upstream object -> the fastinit code that mirrors it.
PORTS: dict[str, Port] = {
    # -- the planner (FastPlanner, FastEnumerator, the memoising estimators) ---------------------
    f"{_TR_PLANNER}enumerators:EmbeddingEnumerator.__init__": Port(
        "planner", f"{_ENUMERATORS}.FastEnumerator"
    ),
    f"{_TR_PLANNER}enumerators:EmbeddingEnumerator.enumerate": Port(
        "planner", f"{_ENUMERATORS}.FastEnumerator._enumerate_described"
    ),
    f"{_TR_PLANNER}enumerators:EmbeddingEnumerator._get_num_buckets": Port(
        "planner", f"{_ENUMERATORS}.FastEnumerator._num_buckets_lookup"
    ),
    f"{_TR_PLANNER}enumerators:_extract_constraints_for_param": Port(
        "planner", f"{_ENUMERATORS}.FastEnumerator._enumerate_described", "assumed"
    ),
    f"{_TR_PLANNER}enumerators:EmbeddingEnumerator._get_stash_weights": Port(
        "planner", f"{_ENUMERATORS}.FastEnumerator._stash_weights_lookup"
    ),
    f"{_TR_PLANNER}estimator.estimator:EmbeddingPerfEstimator.estimate": Port(
        "planner", f"{_ESTIMATOR}.MemoPerfEstimator"
    ),
    f"{_TR_PLANNER}estimator.annotations:_get_annotated_method": Port(
        "planner", f"{_ESTIMATOR}.with_cached_dir", "assumed"
    ),
    f"{_TR_PLANNER}estimator.estimator:EmbeddingShardingPerfEvaluator": Port(
        "planner", f"{_ESTIMATOR}._trial_fields", "assumed"
    ),
    f"{_TR_PLANNER}estimator.estimator:TableWiseEvaluator": Port(
        "planner", f"{_ESTIMATOR}._trial_fields", "assumed"
    ),
    f"{_TR_PLANNER}estimator.estimator:RowWiseEvaluator": Port(
        "planner", f"{_ESTIMATOR}._trial_fields", "assumed"
    ),
    f"{_TR_PLANNER}estimator.estimator:TableRowWiseEvaluator": Port(
        "planner", f"{_ESTIMATOR}._trial_fields", "assumed"
    ),
    f"{_TR_PLANNER}estimator.estimator:DataParallelEvaluator": Port(
        "planner", f"{_ESTIMATOR}._trial_fields", "assumed"
    ),
    f"{_TR_PLANNER}estimator.estimator:ColumnWiseEvaluator": Port(
        "planner", f"{_ESTIMATOR}._trial_fields", "assumed"
    ),
    f"{_TR_PLANNER}estimator.estimator:TableColumnWiseEvaluator": Port(
        "planner", f"{_ESTIMATOR}._trial_fields", "assumed"
    ),
    f"{_TR_PLANNER}estimator.estimator:GridShardEvaluator": Port(
        "planner", f"{_ESTIMATOR}._trial_fields", "assumed"
    ),
    f"{_TR_PLANNER}estimator.config:EmbeddingPerfEstimatorConfig": Port(
        "planner", f"{_ESTIMATOR}._trial_fields", "assumed"
    ),
    f"{_TR_PLANNER}shard_estimators:EmbeddingStorageEstimator.estimate": Port(
        "planner", f"{_SHARD_ESTIMATORS}.MemoStorageEstimator._storages"
    ),
    f"{_TR_PLANNER}types:ShardingOption.__deepcopy__": Port(
        "planner", f"{_TYPES}.copy_sharding_options"
    ),
    f"{_TR_PLANNER}types:Shard": Port("planner", f"{_TYPES}.new_shard", "assumed"),
    f"{_TR_PLANNER}types:Storage": Port("planner", f"{_TYPES}.new_storage", "assumed"),
    f"{_TR_PLANNER}types:Perf": Port("planner", f"{_TYPES}.perf_from_fields", "assumed"),
    f"{_TR_PLANNER}proposers:GreedyProposer.load": Port("planner", f"{_PROPOSERS}.GreedyReplay"),
    f"{_TR_PLANNER}proposers:GreedyProposer.propose": Port("planner", f"{_PROPOSERS}.GreedyReplay"),
    f"{_TR_PLANNER}proposers:GreedyProposer.feedback": Port(
        "planner", f"{_PROPOSERS}.GreedyReplay"
    ),
    f"{_TR_PLANNER}proposers:UniformProposer.load": Port("planner", f"{_PROPOSERS}.UniformReplay"),
    f"{_TR_PLANNER}proposers:UniformProposer.propose": Port(
        "planner", f"{_PROPOSERS}.UniformReplay"
    ),
    f"{_TR_PLANNER}proposers:UniformProposer.feedback": Port(
        "planner", f"{_PROPOSERS}.UniformReplay"
    ),
    f"{_TR_PLANNER}proposers:GridSearchProposer.load": Port("planner", f"{_PROPOSERS}.GridReplay"),
    f"{_TR_PLANNER}proposers:GridSearchProposer.propose": Port(
        "planner", f"{_PROPOSERS}.GridReplay"
    ),
    f"{_TR_PLANNER}proposers:GridSearchProposer.feedback": Port(
        "planner", f"{_PROPOSERS}.GridReplay"
    ),
    f"{_TR_PLANNER}proposers:_sharding_option_score": Port("planner", f"{_PROPOSERS}._score"),
    f"{_TR_PLANNER}partitioners:GreedyPerfPartitioner.partition": Port(
        "planner", f"{_PARTITIONERS}.Search"
    ),
    f"{_TR_PLANNER}partitioners:GreedyPerfPartitioner._establish_minheap": Port(
        "planner", f"{_PARTITIONERS}._device_place"
    ),
    f"{_TR_PLANNER}partitioners:GreedyPerfPartitioner._device_partition": Port(
        "planner", f"{_PARTITIONERS}._device_place"
    ),
    f"{_TR_PLANNER}partitioners:GreedyPerfPartitioner._column_wise_device_partition": Port(
        "planner", f"{_PARTITIONERS}.Search._cw_kv_place"
    ),
    f"{_TR_PLANNER}partitioners:GreedyPerfPartitioner._multi_hosts_partition": Port(
        "planner", f"{_PARTITIONERS}._Hosts"
    ),
    f"{_TR_PLANNER}partitioners:GreedyPerfPartitioner._cohost_partition": Port(
        "planner", f"{_PARTITIONERS}._Hosts"
    ),
    f"{_TR_PLANNER}partitioners:GreedyPerfPartitioner._get_host_level_devices": Port(
        "planner", f"{_PARTITIONERS}._Hosts"
    ),
    f"{_TR_PLANNER}partitioners:GreedyPerfPartitioner._uniform_partition": Port(
        "planner", f"{_PARTITIONERS}.Search.evaluate"
    ),
    f"{_TR_PLANNER}partitioners:OrderedDeviceHardware.__lt__": Port(
        "planner", f"{_PARTITIONERS}._device_place"
    ),
    f"{_TR_PLANNER}partitioners:_sort_devices_by_perf": Port("planner", f"{_PARTITIONERS}._Hosts"),
    f"{_TR_PLANNER}partitioners:_group_and_sort_non_uniform_sharding_options": Port(
        "planner", f"{_PARTITIONERS}.Search.evaluate"
    ),
    f"{_TR_PLANNER}partitioners:_get_uniform_sharding_options": Port(
        "planner", f"{_PARTITIONERS}.Search.evaluate"
    ),
    f"{_TR_PLANNER}perf_models:NoopPerfModel.rate": Port("planner", f"{_PERF_MODELS}.noop_rate"),
    f"{_TR_PLANNER}planners:EmbeddingShardingPlanner.__init__": Port(
        "planner", f"{_PLANNERS}.FastPlanner"
    ),
    f"{_TR_PLANNER}planners:EmbeddingShardingPlanner.plan": Port(
        "planner", f"{_PLANNERS}.FastPlanner._fast_plan, ._finish, ._raise_no_plan"
    ),
    # -- the sharded modules, their lookups, kernels and fused optimizer -------------------------
    f"{_TR_DISTRIBUTED}embedding_kernel:get_state_dict": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}batched_embedding_kernel:BaseBatchedEmbeddingBag.state_dict": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}batched_embedding_kernel:BaseBatchedEmbedding.state_dict": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}batched_embedding_kernel:BatchedFusedEmbeddingBag.__init__": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}batched_embedding_kernel:BatchedFusedEmbedding.__init__": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}batched_embedding_kernel:BatchedFusedEmbeddingBag._param_per_table": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}batched_embedding_kernel:BatchedFusedEmbedding._param_per_table": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}batched_embedding_kernel:_gen_named_parameters_by_table_fused": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}batched_embedding_kernel:EmbeddingFusedOptimizer.__init__": Port(
        "setup", f"{_MIRROR}batched_embedding_kernel.fused_optimizer_init"
    ),
    f"{_TR_DISTRIBUTED}embedding_lookup:GroupedPooledEmbeddingsLookup._create_embedding_kernel": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}embedding_lookup:GroupedEmbeddingsLookup._create_embedding_kernel": Port(
        "setup", f"{_KERNELS}.fast_classes", "rebound"
    ),
    f"{_TR_DISTRIBUTED}embedding_sharding:group_tables": Port(
        "setup", f"{_KERNELS}.fast_group_tables", "assumed"
    ),
    f"{_TR_DISTRIBUTED}embeddingbag:ShardedEmbeddingBagCollection._initialize_torch_state": Port(
        "setup", f"{_KERNELS}.ebc_initialize_torch_state", "rebound"
    ),
    f"{_TR_DISTRIBUTED}embeddingbag:ShardedEmbeddingBagCollection.create_embedding_bag_sharding": Port(
        "setup", f"{_KERNELS}._sharding_factory", "rebound"
    ),
    f"{_TR_DISTRIBUTED}embeddingbag:ShardedEmbeddingBagCollection._create_lookups": Port(
        "setup", f"{_SHARDERS}.FastShardedEmbeddingBagCollection._create_lookups"
    ),
    f"{_TR_DISTRIBUTED}embeddingbag:ShardedEmbeddingBagCollection.init_data_parallel": Port(
        "setup", f"{_SHARDERS}.FastShardedEmbeddingBagCollection.init_data_parallel"
    ),
    f"{_TR_DISTRIBUTED}embeddingbag:EmbeddingBagCollectionSharder.shard": Port(
        "setup", f"{_SHARDERS}.FastEmbeddingBagCollectionSharder.shard"
    ),
    f"{_TR_DISTRIBUTED}embedding:ShardedEmbeddingCollection._initialize_torch_state": Port(
        "setup", f"{_MIRROR}embedding.ec_initialize_torch_state"
    ),
    f"{_TR_DISTRIBUTED}embedding:ShardedEmbeddingCollection.create_embedding_sharding": Port(
        "setup", f"{_KERNELS}._sharding_factory", "rebound"
    ),
    f"{_TR_DISTRIBUTED}embedding:ShardedEmbeddingCollection._create_lookups": Port(
        "setup", f"{_SHARDERS}.FastShardedEmbeddingCollection._create_lookups"
    ),
    f"{_TR_DISTRIBUTED}embedding:ShardedEmbeddingCollection.init_data_parallel": Port(
        "setup", f"{_SHARDERS}.FastShardedEmbeddingCollection.init_data_parallel"
    ),
    f"{_TR_DISTRIBUTED}embedding:EmbeddingCollectionSharder.shard": Port(
        "setup", f"{_SHARDERS}.FastEmbeddingCollectionSharder.shard"
    ),
    f"{_TR_DISTRIBUTED}sharding.rw_sharding:BaseRwEmbeddingSharding.__init__": Port(
        "setup", f"{_MIRROR}sharding.rw_sharding.OwnRankRw"
    ),
    f"{_TR_DISTRIBUTED}sharding.rw_sharding:BaseRwEmbeddingSharding._shard": Port(
        "setup", f"{_MIRROR}sharding.rw_sharding._rw_tables"
    ),
    f"{_TR_DISTRIBUTED}sharding.dp_sharding:BaseDpEmbeddingSharding.__init__": Port(
        "setup", f"{_MIRROR}sharding.dp_sharding.OwnRankDp"
    ),
    f"{_TR_DISTRIBUTED}sharding.dp_sharding:BaseDpEmbeddingSharding._shard": Port(
        "setup", f"{_MIRROR}sharding.dp_sharding._dp_tables"
    ),
    f"{_TR_DISTRIBUTED}collective_utils:init_collective_validation": Port(
        "setup", f"{_MIRROR}collective_utils.set_collective_validation"
    ),
    f"{_TR_DISTRIBUTED}types:ShardingEnv.from_process_group": Port(
        "setup", f"{_MIRROR}types.sharding_env_from_process_group"
    ),
    f"{_TR_DISTRIBUTED}model_parallel:DistributedModelParallel._shard_modules_impl": Port(
        "setup", "fastinit.plan.validate.validate_plan", "assumed"
    ),
    "torch.distributed._shard.sharded_tensor.api:"
    "ShardedTensor._init_from_local_shards_and_global_metadata": Port(
        "setup", f"{_LOCAL}.fast_sharded_tensor, {_MODULES}.sharded_tensor_from_checked_layout"
    ),
    # -- process groups --------------------------------------------------------------------------
    f"{_TR_DISTRIBUTED}comm:intra_and_cross_node_pg": Port(
        "pg", "fastinit.pg.registry.node_groups"
    ),
    f"{_TR_DISTRIBUTED}comm:get_topology_group_world_size": Port(
        "pg", "fastinit.pg._torchrec.default_local_size"
    ),
}

_NOTHING = object()


def _resolve(key: str) -> Any:
    """The installed object named by ``"module:qualname"`` (a property: its getter), or raise."""
    module_name, _, qualname = key.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        owner = obj
        obj = owner.__dict__.get(part, _NOTHING) if isinstance(owner, type) else _NOTHING
        if obj is _NOTHING:
            obj = getattr(owner, part)
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, staticmethod | classmethod):
        obj = obj.__func__
    return obj


def normalise(source: str) -> str:
    """``source`` dedented, each line without trailing blanks, blank lines and lines holding only
    a comment dropped: a reflow of comments or blank lines upstream is not a change; anything
    else (code, strings, docstrings, indentation, inline comments) is."""
    kept = [
        line.rstrip()
        for line in textwrap.dedent(source).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return "\n".join(kept) + "\n"


#: The registry's value for a release that does not have the object at all (a method added
#: later: fastinit's copy then follows the release that lacks it).
ABSENT = "absent"


def source_hash(key: str) -> str:
    """sha256 of the normalised source of the installed upstream object ``key``, or
    :data:`ABSENT` where the installed release does not have it.

    Raises:
        Exception: its source cannot be read (a build without sources).
    """

    try:
        obj = _resolve(key)
    except (ImportError, AttributeError):
        return ABSENT
    return hashlib.sha256(normalise(installed_source(key, obj)).encode()).hexdigest()


def installed_source(key: str, obj: Any | None = None) -> str:
    """The source of the upstream object ``key`` as its installed file defines it.

    Normally ``source_of`` of the live object. Where the live attribute is not the function the
    file defines under that name (replaced at run time: ``unittest.mock.patch.object`` of a
    method, as TorchRec's own tests do, or any monkeypatch; its ``__qualname__`` is another), the
    definition is read from the module's file instead: what is judged is the installed release,
    not what a caller swapped in for the moment.

    Raises:
        Exception: the source cannot be read.
    """
    if obj is None:
        obj = _resolve(key)
    fn = inspect.unwrap(obj)
    qualname = key.partition(":")[2]
    if isinstance(fn, type) or getattr(fn, "__qualname__", None) == qualname:
        return source_of(fn)
    found = source_in_file(key)
    return found if found is not None else source_of(fn)


def source_in_file(key: str) -> str | None:
    """The lines (decorators included) of the ``def`` of ``key`` in its module's file, or None."""
    module_name, _, qualname = key.partition(":")
    module = importlib.import_module(module_name)
    filename = getattr(module, "__file__", None)
    lines = linecache.getlines(filename) if filename else []
    if not lines:
        return None
    body: list[ast.stmt] = ast.parse("".join(lines)).body
    node: ast.stmt | None = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in body
                if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        body = node.body if isinstance(node, ast.ClassDef) else []
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
        return None
    first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    return "".join(lines[first : node.end_lineno])


def source_of(obj: Any) -> str:
    """``inspect.getsource(obj)`` for a function or a top-level class, found faster: the lines
    from its first (decorator, ``def`` or ``class``) line up to the first line back at or left
    of its indentation whose prefix parses (``inspect`` tokenises in Python, and parses the
    whole module to find a class: seconds on a busy host for the functions fastinit mirrors)."""
    if isinstance(obj, type):
        filename = inspect.getsourcefile(obj)
        lines = linecache.getlines(filename) if filename else []
        pattern = re.compile(rf"class\s+{re.escape(obj.__name__)}\b")
        starts = [i for i, line in enumerate(lines) if pattern.match(line)]
        if obj.__qualname__ != obj.__name__ or len(starts) != 1:
            return inspect.getsource(obj)  # nested, or defined twice: let inspect decide
        first = starts[0]
        while first > 0 and lines[first - 1].lstrip().startswith("@"):
            first -= 1
    else:
        code = getattr(obj, "__code__", None)
        if code is None:
            return inspect.getsource(obj)
        lines = linecache.getlines(code.co_filename)
        first = code.co_firstlineno - 1
    if not lines or first >= len(lines):
        raise OSError(f"no source for {obj!r}")
    return "".join(lines[first : _block_end(lines, first)])


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _block_end(lines: list[str], first: int) -> int:
    """The index just past the statement (a decorated ``def``/``class``) starting at ``first``."""
    indent = _indent(lines[first])
    decorated = lines[first].lstrip().startswith("@")  # the def/class line is still to come
    for j in range(first + 1, len(lines)):
        stripped = lines[j].strip()
        if not stripped or stripped.startswith("#") or _indent(lines[j]) > indent:
            continue
        if decorated:
            if stripped.startswith(("def ", "async def ", "class ")):
                decorated = False
            if stripped.startswith(("@", "def ", "async def ", "class ")):
                continue
        try:
            # under an "if" rather than dedented: a string's lines may sit left of the code.
            # Compiled, not ast.parse'd: the same syntax check without a Python object per
            # node (setup runs this for every mirrored function; those trees were enough
            # allocation to set off a full garbage collection of the caller's heap).
            compile(("if 1:\n" if indent else "") + "".join(lines[first:j]), "<port>", "exec")
        except SyntaxError:
            continue  # the line is inside a string or brackets: the block goes on
        return _trim(lines, first, j)
    return len(lines)


def _trim(lines: list[str], first: int, end: int) -> int:
    """``end`` moved back over trailing blank and comment lines (``inspect`` stops at the last
    line of code)."""
    while end > first + 1 and (
        not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")
    ):
        end -= 1
    return end


def release(key: str) -> str:
    """The installed release ``key``'s package belongs to: ``"torchrec 1.9.2"``, ``"torch 2.13.0"``
    (the local suffix, ``+cpu``, left off)."""
    package = key.split(".", 1)[0]
    module = sys.modules.get(package) or importlib.import_module(package)
    version = str(getattr(module, "__version__", "unknown")).split("+")[0]
    return f"{package} {version}"


@dataclasses.dataclass(frozen=True, slots=True)
class Mismatch:
    """A mirrored upstream object whose installed source matches no registered hash."""

    key: str
    port: Port
    installed: str
    """``release(key)``, e.g. ``"torchrec 1.9.2"``."""
    reason: str
    """``"changed"``, ``"unregistered"`` (fastinit has no hash for it) or the error reading it."""
    registered: tuple[str, ...]
    """The releases whose source fastinit mirrors."""
    installed_absent: bool = False
    """The installed release does not have it."""

    def line(self) -> str:
        name = self.key.replace(":", ".")
        if self.reason == "changed" and self.installed_absent:
            what = f"{self.installed} does not have it ({', '.join(self.registered)} do)"
        elif self.reason == "changed":
            what = (
                f"its source on {self.installed} matches none of "
                f"{', '.join(self.registered) or 'no release'}"
            )
        elif self.reason == "unregistered":
            what = "no hash registered (fastinit/_port_hashes.py)"
        else:
            what = f"its source cannot be read ({self.reason})"
        return f"{name}: {what}; mirrored by {self.port.where} ({self.port.how})"


def _registry() -> dict[str, dict[str, str]]:
    from fastinit._port_hashes import HASHES

    return HASHES


def registered_releases() -> frozenset[str]:
    """Every release some mirrored function's hash is registered for (``"torchrec 1.9.2"``)."""
    return frozenset(r for known in _registry().values() for r in known)


def discovered() -> dict[str, Port]:
    """Upstream functions found only on the installed TorchRec: the ``create_lookup`` and the
    table-grouping ``__init__`` of every sharding class the stock sharding factories build
    (:mod:`fastinit.sharding.kernels` runs those rebound)."""
    from torchrec.distributed.embedding import ShardedEmbeddingCollection
    from torchrec.distributed.embedding_sharding import EmbeddingSharding
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    out: dict[str, Port] = {}
    for factory in (
        ShardedEmbeddingBagCollection.create_embedding_bag_sharding,
        ShardedEmbeddingCollection.create_embedding_sharding,
    ):
        fn = factory.__func__
        for name in fn.__code__.co_names:
            cls = fn.__globals__.get(name)
            if not (isinstance(cls, type) and issubclass(cls, EmbeddingSharding)):
                continue
            for base in cls.__mro__:
                for attr, where in (
                    ("create_lookup", f"{_KERNELS}.create_lookup"),
                    ("__init__", f"{_KERNELS}.fast_sharding_class"),
                ):
                    code = getattr(base.__dict__.get(attr), "__code__", None)
                    if code is None:
                        continue
                    if attr == "create_lookup" and not any(
                        n in code.co_names
                        for n in ("GroupedPooledEmbeddingsLookup", "GroupedEmbeddingsLookup")
                    ):
                        continue
                    if attr == "__init__" and "group_tables" not in code.co_names:
                        continue
                    key = f"{base.__module__}:{base.__qualname__}.{attr}"
                    out.setdefault(key, Port("setup", where, "rebound"))
    return out


def _ports(component: str | None) -> dict[str, Port]:
    comp = "setup" if component == "sharders" else component
    every = dict(PORTS)
    if comp in (None, "setup"):
        every.update(discovered())
    return {k: p for k, p in every.items() if comp is None or p.component == comp}


def mismatches(component: str | None = None) -> list[Mismatch]:
    """Every mirrored upstream object (of ``component``; None: all) whose installed source
    matches no registered hash. Uncached."""
    registry = _registry()
    out: list[Mismatch] = []
    for key, port in sorted(_ports(component).items()):
        known = registry.get(key, {})
        try:
            installed = release(key)
        except Exception:  # noqa: BLE001 - the package itself is missing
            installed = "unknown"
        registered = tuple(sorted(known))
        try:
            digest = source_hash(key)
        except Exception as e:  # noqa: BLE001 - missing, or no source (a compiled build)
            out.append(Mismatch(key, port, installed, f"{type(e).__name__}: {e}", registered))
            continue
        if not known:
            out.append(Mismatch(key, port, installed, "unregistered", registered))
        elif digest not in known.values():
            out.append(Mismatch(key, port, installed, "changed", registered, digest == ABSENT))
    return out


def installed_hashes(component: str | None = None) -> dict[str, tuple[str, str]]:
    """``{key: (release, hash)}`` of every mirrored upstream object as installed (for the
    registry tool); objects whose source cannot be read are left out."""
    out: dict[str, tuple[str, str]] = {}
    for key in sorted(_ports(component)):
        try:
            out[key] = (release(key), source_hash(key))
        except Exception:  # noqa: BLE001
            continue
    return out


_mirrored: dict[str, str | None] = {}


def mirrored(key: str) -> str | None:
    """The registered release whose source of ``key`` the installed one is (``"torchrec 1.8.0"``),
    or None (changed, unreadable, unregistered). Where fastinit's copy follows two releases, this
    picks the installed one's behaviour. Cached per process."""
    if key in _mirrored:
        return _mirrored[key]
    try:
        digest = source_hash(key)
    except Exception:  # noqa: BLE001
        digest = None
    found = next((r for r, h in sorted(_registry().get(key, {}).items()) if h == digest), None)
    _mirrored[key] = found
    return found


def mirrors_release(key: str, release_: str) -> bool:
    """``mirrored(key) == release_``: the installed ``key`` is that release's."""
    return mirrored(key) == release_


_checked: set[str] = set()
_lock = threading.Lock()


def check(component: str = "setup") -> None:
    """Raise :class:`CompatibilityError` naming every upstream function ``component`` mirrors
    whose installed source fastinit was not written against; once per component and process.

    ``FASTINIT_PORT_CHECK=warn`` logs and warns instead; ``off`` skips the check.

    Raises:
        CompatibilityError: one line per changed (or unreadable) function.
    """
    mode = knobs.get_port_check()
    if component == "sharders":
        component = "setup"  # the same mirrored functions (``_ports``): checked once for both
    if mode == "off" or component in _checked:
        return
    with _lock:
        if component in _checked:
            return
        found = mismatches(component)
        if found:
            lines = "\n".join(f"  - {m.line()}" for m in found)
            message = (
                f"fastinit ({component}) mirrors TorchRec/torch code that changed in the installed "
                f"release; its copies would no longer do what the installed code does:\n{lines}\n"
                "Install a release fastinit supports (see fastinit/_port_hashes.py), or set "
                "FASTINIT_PORT_CHECK=warn to run anyway (the plan and the model may then differ "
                "from DistributedModelParallel's)."
            )
            if mode != "warn":
                raise CompatibilityError(message)
            logger.warning("%s", message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        _checked.add(component)
