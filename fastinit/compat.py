"""What fastinit needs from the installed torch and TorchRec, checked in one place, by capability.

fastinit was written against torchrec 1.8.0 and torch 2.13.0, and touches some of their private
names (each listed, per subpackage, in that subpackage's adapter module). Whether it can run is
decided by whether those names are there, not by the version string: a TorchRec imported from a
source checkout (whose ``torchrec.__version__`` reads ``"unknown"``) or a local build
(``1.8.0+cu128``) works when everything below is present; a release other than 1.8.0 with
everything present works too, with one warning (a name can keep its place and change meaning).
Anything missing raises :class:`CompatibilityError` naming each missing piece.

One thing is decided by version: the pair of torch and fbgemm. fbgemm's compiled kernels are
built against one torch series, and with another one ``import fbgemm_gpu`` fails deep in a
shared library (torch 2.15 with fbgemm 1.9.0: ``undefined symbol: _ZN3c1015report_overflowEPKc``)
or, worse, loads and misbehaves. :func:`require_stack` (run by :func:`require` before any check,
and by the ``fastinit`` command before it imports a user's model) reads the installed versions
from the distributions' metadata, without importing either, and raises
:class:`CompatibilityError` naming them and :data:`SUPPORTED_STACKS` when the pair is not one of
them; then it imports fbgemm, and a failure there is the same error with fbgemm's message in it.
A build whose version says nothing about its torch (fbgemm's ``+git`` or nightly date versions,
no metadata at all) is only checked by that import.

Components and where they are checked:

* ``"setup"`` — :func:`fastinit.setup` (the fast sharders, the start-up protocol, the plan
  fingerprint); ``setup`` calls ``require("setup")``. The same touches serve the sharders when
  used directly (``require("sharders")`` is an alias).
* ``"planner"`` — :class:`fastinit.planner.FastPlanner` (ported planner internals).
* ``"pg"`` — :mod:`fastinit.pg` (TorchRec's cached node groups, torch's group timeout).
* ``"warmup"`` — :mod:`fastinit.warmup` (sharded modules' table configs, the combined optimizer's
  children, the train pipeline's optimizer, the ``torch.compiler`` cache-artifact API);
  :func:`fastinit.warmup.warm_up` calls ``require("warmup")``.

A check imports the modules it names and looks the names up; an attribute that TorchRec sets on
an instance is looked for in the code of the class's methods (the names its bytecode stores or
loads), so no model has to be built. A component that passed is not checked again.

Example::

    from fastinit import compat

    compat.require("pg")  # CompatibilityError naming what is missing, if anything is
    compat.missing("warmup")  # -> [] when everything is there
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import threading
import types
from collections.abc import Callable, Iterator

from fastinit.errors import CompatibilityError

__all__ = [
    "COMPONENTS",
    "SUPPORTED_STACKS",
    "TORCHREC_VERSION",
    "CompatibilityError",
    "installed_versions",
    "missing",
    "require",
    "require_stack",
]

logger = logging.getLogger(__name__)

#: The TorchRec release fastinit's private touches were written against.
TORCHREC_VERSION = "1.8.0"

#: The stacks fastinit supports, each the versions of one CI lane (``make test`` and
#: ``make test STACK=1.9``; FBGEMM's compatibility table pairs each fbgemm series with one torch
#: series): ``(torch, fbgemm, torchrec)`` series. pyproject.toml's torch range is these.
SUPPORTED_STACKS: tuple[tuple[str, str, str], ...] = (
    ("2.13", "1.8", "1.8"),
    ("2.14", "1.9", "1.9"),
)

#: fbgemm's distributions, the first installed one is fbgemm (the CPU or the CUDA build).
_FBGEMM_DISTRIBUTIONS = (
    "fbgemm-gpu-cpu",
    "fbgemm-gpu",
    "fbgemm-gpu-nightly-cpu",
    "fbgemm-gpu-nightly",
)

# A requirement is one of:
#   "module"                      the module imports
#   "module:Name"                 the module has Name
#   "module:Class.attr"           the class (or a base) has attr (a method, property or class attr)
#   "module:Class@attr"           an instance attribute: some method of the class (or a base) in
#                                 the module's package stores or loads ``attr``
#   "module:Callable(param)"      the callable (or class constructor) takes the keyword ``param``
#   "module:Func>name"            the function (a method, property or classmethod too) reads the
#                                 global ``name`` of its module (fastinit.sharding.kernels rebinds
#                                 it in a copy of the function)
_SETUP: tuple[str, ...] = (
    "torch.distributed._shard.sharded_tensor:"
    "ShardedTensor._init_from_local_shards_and_global_metadata",
    "torch.distributed._shard.sharded_tensor:TensorProperties",
    # own-rank construction (fastinit/sharding/local.py, _torchrec_modules.py, mirror/)
    "torch.distributed._shard.sharded_tensor:ShardedTensor._normalize_pg",
    "torch.distributed._shard.sharded_tensor:ShardedTensor._prepare_init",
    "torch.distributed._shard.sharded_tensor:ShardedTensor._post_init",
    "torch.distributed.distributed_c10d:_rank_not_in_group",
    "torch.distributed._shard.sharding_spec.api:_infer_sharding_spec_from_shards_metadata",
    "torch.distributed._shard.sharding_spec._internals:validate_non_overlapping_shards_metadata",
    "torch.distributed._shard.sharding_spec._internals:check_tensor",
    "torchrec.distributed.batched_embedding_kernel:EmbeddingFusedOptimizer",
    # TorchRec's code run with fastinit's classes bound in (fastinit/sharding/kernels.py)
    "torchrec.distributed.embedding_kernel:get_state_dict>ShardedTensor",
    "torchrec.distributed.batched_embedding_kernel:BaseBatchedEmbeddingBag.state_dict>get_state_dict",
    "torchrec.distributed.batched_embedding_kernel:BaseBatchedEmbedding.state_dict>get_state_dict",
    "torchrec.distributed.batched_embedding_kernel:"
    "BatchedFusedEmbeddingBag.__init__>EmbeddingFusedOptimizer",
    "torchrec.distributed.batched_embedding_kernel:"
    "BatchedFusedEmbedding.__init__>EmbeddingFusedOptimizer",
    "torchrec.distributed.batched_embedding_kernel:"
    "BatchedFusedEmbeddingBag._param_per_table>_gen_named_parameters_by_table_fused",
    "torchrec.distributed.batched_embedding_kernel:"
    "BatchedFusedEmbedding._param_per_table>_gen_named_parameters_by_table_fused",
    "torchrec.distributed.batched_embedding_kernel:"
    "_gen_named_parameters_by_table_fused>EmbeddingFusedOptimizer",
    "torchrec.distributed.embedding_lookup:"
    "GroupedPooledEmbeddingsLookup._create_embedding_kernel>BatchedFusedEmbeddingBag",
    "torchrec.distributed.embedding_lookup:"
    "GroupedPooledEmbeddingsLookup._create_embedding_kernel>BatchedDenseEmbeddingBag",
    "torchrec.distributed.embedding_lookup:"
    "GroupedEmbeddingsLookup._create_embedding_kernel>BatchedFusedEmbedding",
    "torchrec.distributed.embedding_lookup:"
    "GroupedEmbeddingsLookup._create_embedding_kernel>BatchedDenseEmbedding",
    "torchrec.distributed.sharding.rw_sharding:RwPooledEmbeddingSharding.create_lookup"
    ">GroupedPooledEmbeddingsLookup",
    "torchrec.distributed.sharding.tw_sharding:BaseTwEmbeddingSharding.__init__>group_tables",
    "torchrec.distributed.embeddingbag:"
    "ShardedEmbeddingBagCollection._initialize_torch_state>ShardedTensor",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection._create_lookups",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection._create_lookups",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_updates",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@enable_embedding_update",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection.create_embedding_bag_sharding",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection.create_embedding_sharding",
    "torch.distributed:_broadcast_coalesced",
    "torch.distributed.device_mesh:DeviceMesh.from_group",
    "torch.nn.parallel:DistributedDataParallel(init_sync)",
    "torchrec.distributed.collective_utils:_INITIALIZED",
    "torchrec.distributed.collective_utils:_USE_COLLECTIVE_VALIDATION",
    "torchrec.distributed.collective_utils:_resolve_enablement_on_leader",
    "torchrec.distributed.model_parallel:DistributedModelParallel(data_parallel_wrapper)",
    "torchrec.distributed.model_parallel:DefaultDataParallelWrapper(ddp_kwargs)",
    "torchrec.distributed.types:ShardingEnv2D@sharding_pg",
    "torchrec.distributed.embedding_types:EmbeddingComputeKernel",
    "torchrec.modules.embedding_configs:data_type_to_dtype",
    "torchrec.optim.fused:EmptyFusedOptimizer",
    "torchrec.distributed.types:ShardingEnv@device_mesh",
    "torchrec.distributed.types:ShardingEnv@output_dtensor",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection._initialize_torch_state",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_model_parallel_name_to_local_shards",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_table_name_to_config",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_sharding_type_to_sharding",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_lookups",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_embedding_configs",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_env",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_device",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_model_parallel_name_to_shards_wrapper",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_model_parallel_name_to_sharded_tensor",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_output_dtensor",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@embeddings",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@module_sharding_plan",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection(use_index_dedup)",
    "torchrec.distributed.embedding:EmbeddingCollectionSharder@_use_index_dedup",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@_embedding_shardings",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@_lookups",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@_embedding_bag_configs",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@_env",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@_device",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@_model_parallel_name_to_local_shards",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@embedding_bags",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@module_sharding_plan",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection(sharded_module_order_overwrite)",
    "torchrec.distributed.embeddingbag:EmbeddingBagCollectionSharder@_sharded_module_order_overwrite",
    "torchrec.distributed.sharding.dp_sharding:DpPooledEmbeddingSharding",
    "torchrec.distributed.sharding.dp_sequence_sharding:DpSequenceEmbeddingSharding",
    "torchrec.distributed.planner.planners:EmbeddingPlannerBase@_topology",
    "torchrec.distributed.planner.planners:EmbeddingPlannerBase@_constraints",
    "torchrec.distributed.planner.planners:EmbeddingPlannerBase@_enumerator",
    "torchrec.distributed.planner.planners:EmbeddingShardingPlanner@_proposers",
    "torchrec.distributed.planner.planners:EmbeddingShardingPlanner@_partitioner",
    "torchrec.distributed.planner.planners:EmbeddingPlannerBase@_storage_reservation",
    "torchrec.distributed.planner.types:Topology@_custom_topology_data",
)
_PLANNER: tuple[str, ...] = (
    "torchrec.distributed.planner.enumerators:EmbeddingEnumerator.enumerate",
    "torchrec.distributed.planner.enumerators:_extract_constraints_for_param",
    "torchrec.distributed.planner.enumerators:_get_tower_index",
    "torchrec.distributed.planner.enumerators:EmbeddingEnumerator@_sharder_map",
    "torchrec.distributed.planner.enumerators:EmbeddingEnumerator@_last_stored_search_space",
    "torchrec.distributed.planner.enumerators:EmbeddingEnumerator@_use_exact_enumerate_order",
    "torchrec.distributed.planner.estimator.estimator:EmbeddingPerfEstimator.estimate",
    "torchrec.distributed.planner.estimator.estimator:get_embedding_perf_sharding_evaluator",
    "torchrec.distributed.planner.estimator.types:ShardPerfContext.build_shard_perf_contexts",
    "torchrec.distributed.planner.shard_estimators:EmbeddingStorageEstimator.estimate",
    "torchrec.distributed.planner.shard_estimators:calculate_shard_storages",
    "torchrec.distributed.planner.shard_estimators:get_num_poolings",
    "torchrec.distributed.planner.proposers:GreedyProposer@_threshold",
    "torchrec.distributed.planner.proposers:GreedyProposer@_best_perf_rating",
    "torchrec.distributed.planner.proposers:GreedyProposer@_num_inferior_perf",
    "torchrec.distributed.planner.proposers:GreedyProposer@_use_depth",
    "torchrec.distributed.planner.proposers:UniformProposer@_use_depth",
    "torchrec.distributed.planner.proposers:GridSearchProposer@_max_proposals",
    "torchrec.distributed.planner.partitioners:GreedyPerfPartitioner@_sort_by",
    "torchrec.distributed.planner.partitioners:GreedyPerfPartitioner@_balance_modules",
    "torchrec.distributed.planner.storage_reservations:HeuristicalStorageReservation@_percentage",
    "torchrec.distributed.planner.storage_reservations:HeuristicalStorageReservation@_dense_storage",
    "torchrec.distributed.planner.storage_reservations:HeuristicalStorageReservation@_kjt_storage",
    "torchrec.distributed.planner.perf_models:NoopPerfModel@_topology",
    "torchrec.distributed.planner.utils:build_sharder_data_map",
    "torchrec.distributed.sharding_plan:calculate_shard_sizes_and_offsets",
)
_PG: tuple[str, ...] = (
    "torchrec.distributed.comm:_INTRA_PG",
    "torchrec.distributed.comm:_CROSS_PG",
    "torchrec.distributed.comm:intra_and_cross_node_pg",
    "torchrec.distributed.comm:get_local_size",
    "torchrec.distributed.comm:get_topology_group_world_size",
    "torch.distributed.distributed_c10d:_hash_ranks_to_str",
)
_WARMUP: tuple[str, ...] = (
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@_embedding_bag_configs",
    "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection@_is_weighted",
    "torchrec.distributed.embedding:ShardedEmbeddingCollection@_embedding_configs",
    "torchrec.optim.keyed:CombinedOptimizer@_optims",
    "torchrec.distributed.train_pipeline:TrainPipelineSparseDist@_optimizer",
    "torch.compiler:save_cache_artifacts",
    "torch.compiler:load_cache_artifacts",
    "torch._dynamo:maybe_mark_dynamic",
)

#: component -> the capabilities it needs (see the module docstring).
COMPONENTS: dict[str, tuple[str, ...]] = {
    "setup": _SETUP,
    "sharders": _SETUP,
    "planner": _PLANNER,
    "pg": _PG,
    "warmup": _WARMUP,
}

_passed: set[str] = set()
_lock = threading.Lock()
_warned_version = False


def installed_versions() -> dict[str, str | None]:
    """The installed ``torch``, ``fbgemm`` and ``torchrec`` versions and fbgemm's distribution
    name (``fbgemm_dist``), from the distributions' metadata: nothing is imported. None where a
    distribution is not installed (or carries no metadata, as a source checkout may)."""
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    out: dict[str, str | None] = {
        "torch": version("torch"),
        "torchrec": version("torchrec"),
        "fbgemm": None,
        "fbgemm_dist": None,
    }
    for dist in _FBGEMM_DISTRIBUTIONS:
        found = version(dist)
        if found is not None:
            out["fbgemm"], out["fbgemm_dist"] = found, dist
            break
    return out


def _series(version: str | None) -> str | None:
    """``"2.14"`` of ``"2.14.1+cpu"``; None for a version that names no release series (a
    date-versioned nightly, ``INTERNAL``, a ``+git`` local build, none)."""
    if version is None or "+git" in version:
        return None
    m = re.match(r"^(\d+)\.(\d+)(?:\.|$)", version)
    if m is None or int(m.group(1)) >= 2000:  # fbgemm nightlies are versioned by date
        return None
    return f"{m.group(1)}.{m.group(2)}"


def _stack_line(versions: dict[str, str | None]) -> str:
    fbgemm = versions["fbgemm_dist"] or "fbgemm-gpu"
    return (
        f"torch {versions['torch'] or '(no metadata)'}, {fbgemm} {versions['fbgemm'] or '(none)'}, "
        f"torchrec {versions['torchrec'] or '(no metadata)'}"
    )


def _supported_line() -> str:
    return "; ".join(
        f"torch {t}.x with fbgemm-gpu(-cpu) {f}.x and torchrec {r}.x"
        for t, f, r in SUPPORTED_STACKS
    )


def require_stack() -> None:
    """Raise :class:`CompatibilityError` unless the installed torch and fbgemm are a supported
    pair (:data:`SUPPORTED_STACKS`, read from the distributions' metadata before anything is
    imported) and ``fbgemm_gpu`` imports. Passes once per process.

    Raises:
        CompatibilityError: naming the installed torch, fbgemm and torchrec, the supported
            stacks, and fbgemm's own import error where it failed.
    """
    if "stack" in _passed:
        return
    versions = installed_versions()
    pair = (_series(versions["torch"]), _series(versions["fbgemm"]))
    supported = {(t, f) for t, f, _ in SUPPORTED_STACKS}
    if None not in pair and pair not in supported:
        raise CompatibilityError(
            f"fastinit cannot run on this stack: {_stack_line(versions)}. fbgemm's kernels are "
            f"built for one torch series, and this pair is not one fastinit supports: "
            f"{_supported_line()}. Install a matching set, e.g. "
            "`pip install torch==2.14.1 fbgemm-gpu-cpu==1.9.0` (GPU hosts: fbgemm-gpu==1.9.0) "
            "and torchrec 1.9.x; see the README's install lines."
        )
    try:
        importlib.import_module("fbgemm_gpu")
    except Exception as e:  # OSError (an undefined symbol), ImportError, RuntimeError
        lines = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {lines[-1] if lines else ''}"
        raise CompatibilityError(
            f"fastinit cannot run on this stack: {_stack_line(versions)}: `import fbgemm_gpu` "
            f"failed ({why}). Supported: {_supported_line()}; install a matching set of torch "
            "and fbgemm (see the README's install lines)."
        ) from e
    with _lock:
        _passed.add("stack")


def torchrec_version() -> str:
    """``torchrec.__version__`` as installed (``"unknown"`` for a source checkout)."""
    import torchrec

    return str(getattr(torchrec, "__version__", "unknown"))


def _is_release_other_than_pinned(version: str) -> bool:
    base = version.split("+")[0]
    if not base or not base[0].isdigit():  # "unknown", "", a git describe: a source build
        return False
    return not base.startswith(TORCHREC_VERSION)


def missing(component: str) -> list[str]:
    """The capabilities ``component`` needs that the installed torch/TorchRec lack (uncached).

    Args:
        component: one of :data:`COMPONENTS`.

    Returns:
        One human-readable line per missing capability; empty when everything is there.

    Raises:
        ValueError: unknown component.
    """
    try:
        needs = COMPONENTS[component]
    except KeyError:
        raise ValueError(
            f"unknown fastinit component {component!r}; known: {sorted(COMPONENTS)}"
        ) from None
    return [line for req in needs if (line := _missing(req)) is not None]


def require(component: str = "setup") -> None:
    """Raise :class:`CompatibilityError` unless every capability ``component`` needs is present.

    The TorchRec version string does not decide: a source build (version ``"unknown"``) passes
    when the capabilities are there; a release other than 1.8.0 passes with one warning.

    Args:
        component: ``"setup"``, ``"sharders"``, ``"planner"``, ``"pg"`` or ``"warmup"``.

    Raises:
        CompatibilityError: an unsupported torch/fbgemm pair (:func:`require_stack`), or naming
            the installed versions and every missing capability.
        ValueError: unknown component.
    """
    global _warned_version
    if component in _passed:
        return
    require_stack()
    absent = missing(component)
    version = torchrec_version()
    if absent:
        import torch

        lines = "\n".join(f"  - {line}" for line in absent)
        raise CompatibilityError(
            f"fastinit ({component}) cannot run on this torch/TorchRec (torch {torch.__version__}, "
            f"torchrec {version}; fastinit was written against torchrec {TORCHREC_VERSION}). "
            f"Missing:\n{lines}\nInstall torchrec {TORCHREC_VERSION} or use "
            "DistributedModelParallel directly."
        )
    from fastinit import ports

    ports.check(component)  # CompatibilityError naming each mirrored function that changed
    with _lock:
        if (
            _is_release_other_than_pinned(version)
            and f"torchrec {version.split('+')[0]}" not in ports.registered_releases()
            and not _warned_version
        ):
            _warned_version = True
            logger.warning(
                "fastinit was written against torchrec %s and torchrec %s is installed; every "
                "internal fastinit uses is present, but their behaviour was not checked",
                TORCHREC_VERSION,
                version,
            )
        _passed.add(component)


def _missing(req: str) -> str | None:
    module_name, _, name = req.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or a module that fails while importing
        return f"module {module_name} ({type(e).__name__}: {e})"
    if not name:
        return None
    if "(" in name:
        target_name, _, param = name[:-1].partition("(")
        target = _lookup(module, target_name)
        if target is _NOTHING:
            return f"{module_name}.{target_name}"
        return None if _takes(target, param) else f"{module_name}.{target_name}({param}=...)"
    if ">" in name:
        target_name, _, glob = name.partition(">")
        target = _lookup(module, target_name)
        if target is _NOTHING:
            return f"{module_name}.{target_name}"
        fn = target.fget if isinstance(target, property) else target
        fn = getattr(fn, "__func__", fn)
        code = getattr(fn, "__code__", None)
        if getattr(fn, "__qualname__", target_name) != target_name:
            # replaced at run time (a mock, a monkeypatch): judge the installed file's definition
            if glob in vars(module) and _file_def_loads(f"{module_name}:{target_name}", glob):
                return None
        elif code is not None and glob in code.co_names and glob in getattr(fn, "__globals__", {}):
            return None
        return f"{module_name}.{target_name} constructing through {glob}"
    if "@" in name:
        cls_name, _, attr = name.partition("@")
        cls = getattr(module, cls_name, None)
        if not isinstance(cls, type):
            return f"{module_name}.{cls_name}"
        if attr in _names_used_by(cls):
            return None
        return f"{module_name}.{cls_name} instances' attribute {attr}"
    return None if _lookup(module, name) is not _NOTHING else f"{module_name}.{name}"


def _file_def_loads(key: str, name: str) -> bool:
    """The ``def`` of ``key`` in its module's file loads the global ``name``."""
    import ast
    import textwrap

    from fastinit import ports

    source = ports.source_in_file(key)
    if source is None:
        return False
    tree = ast.parse(textwrap.dedent(source))
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(tree))


_NOTHING = object()


def _lookup(module: types.ModuleType, dotted: str) -> object:
    """The object at ``module.<dotted>`` (a value of None counts as present), or ``_NOTHING``."""
    obj: object = module
    for part in dotted.split("."):
        obj = getattr(obj, part, _NOTHING)
        if obj is _NOTHING:
            break
    return obj


def _takes(target: object, param: str) -> bool:
    import inspect

    fn = target.__init__ if isinstance(target, type) else target  # type: ignore[misc]
    try:
        return param in inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


@functools.cache
def _names_used_by(cls: type) -> frozenset[str]:
    """Attribute names the methods of ``cls`` and its bases (outside builtins) load or store."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__ == "builtins":
            continue
        for value in vars(klass).values():
            for code in _codes(value):
                names.update(code.co_names)
    return frozenset(names)


def _codes(value: object) -> Iterator[types.CodeType]:
    fn: Callable[..., object] | None = None
    if isinstance(value, staticmethod | classmethod):
        fn = value.__func__
    elif isinstance(value, property):
        for accessor in (value.fget, value.fset, value.fdel):
            if accessor is not None:
                yield from _codes(accessor)
        return
    elif isinstance(value, types.FunctionType):
        fn = value
    stack: list[types.CodeType] = []
    seen: set[int] = set()
    while fn is not None and id(fn) not in seen:  # a decorated method: its wrapper and itself
        seen.add(id(fn))
        code = getattr(fn, "__code__", None)
        if isinstance(code, types.CodeType):
            stack.append(code)
        fn = getattr(fn, "__wrapped__", None)
    while stack:
        c = stack.pop()
        yield c
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
