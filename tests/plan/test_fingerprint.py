"""planner_fingerprint covers what decides the plan (and nothing process-specific)."""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("torchrec")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torchrec.distributed.embedding import EmbeddingCollectionSharder  # noqa: E402
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder  # noqa: E402
from torchrec.distributed.planner import (  # noqa: E402
    EmbeddingShardingPlanner,
    ParameterConstraints,
    Topology,
)

from fastinit.plan.fingerprint import (  # noqa: E402
    planner_fingerprint,
    planner_inputs,
)
from fastinit.testing.models import ModelSpec, build_model  # noqa: E402

SPEC = ModelSpec(num_tables=7, num_ec_tables=7, num_weighted_tables=2, fp16_every=3)
logging.getLogger("torchrec").setLevel(logging.ERROR)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def _sharders(**fused: Any) -> list[Any]:
    return [
        EmbeddingBagCollectionSharder(fused_params=fused or None),
        EmbeddingCollectionSharder(),
    ]


def _topology(**kwargs: Any) -> Topology:
    kwargs.setdefault("world_size", 4)
    kwargs.setdefault("compute_device", "cpu")
    return Topology(**kwargs)


def _fp(spec: ModelSpec = SPEC, **kwargs: Any) -> bytes:
    model = kwargs.pop("model", None) or build_model(spec, device="meta")
    sharders = kwargs.pop("sharders", None) or _sharders()
    topology = kwargs.pop("topology", None) or _topology()
    return planner_fingerprint(model, sharders, topology, **kwargs)


@pytest.fixture(scope="module")
def base() -> bytes:
    return _fp()


def test_deterministic_with_fresh_objects(base: bytes) -> None:
    assert len(base) == 32
    assert _fp() == base  # new model, sharders, topology: no id() or address leaks in


def test_tables_change_it(base: bytes) -> None:
    assert _fp(ModelSpec(num_tables=7, num_ec_tables=7, num_weighted_tables=2)) != base  # dtypes
    assert _fp(ModelSpec(num_tables=6, num_ec_tables=7, num_weighted_tables=2, fp16_every=3)) != (
        base
    )  # a table missing
    model = build_model(SPEC, device="meta")
    model.sparse.ebc.embedding_bag_configs()[3].num_embeddings += 1  # config only: rows differ
    assert _fp(model=model) != base
    model = build_model(SPEC, device="meta")
    model.sparse.ec.embeddings["e2"].weight = nn.Parameter(torch.empty(5, 16, device="meta"))
    assert _fp(model=model) != base  # the parameter's rows
    model = build_model(SPEC, device="meta")
    model.sparse.ebc.embedding_bag_configs()[0].feature_names = ["other"]
    assert _fp(model=model) != base


def test_init_bounds_do_not_change_it(base: bytes) -> None:
    model = build_model(SPEC, device="meta")
    config = model.sparse.ebc.embedding_bag_configs()[0]
    config.weight_init_max, config.weight_init_min = 0.5, -0.5
    config.init_fn = lambda t: t
    assert _fp(model=model) == base


def test_sharders_change_it(base: bytes) -> None:
    assert _fp(sharders=[EmbeddingBagCollectionSharder()]) != base  # EC no longer shardable
    assert _fp(sharders=_sharders(learning_rate=0.1)) != base
    assert _fp(sharders=_sharders(learning_rate=0.2)) != _fp(sharders=_sharders(learning_rate=0.1))

    class RowWiseOnly(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return ["row_wise"]

    assert _fp(sharders=[RowWiseOnly(), EmbeddingCollectionSharder()]) != base


def test_topology_changes_it(base: bytes) -> None:
    assert _fp(topology=_topology(world_size=8)) != base
    assert _fp(topology=_topology(local_world_size=2)) != base
    assert _fp(topology=_topology(ddr_cap=2**30)) != base
    assert _fp(topology=_topology(inter_host_bw=1.0)) != base
    assert _fp(topology=_topology(compute_device="cuda")) != base
    cuda = _fp(topology=_topology(compute_device="cuda", hbm_cap=2**34))
    assert cuda != _fp(topology=_topology(compute_device="cuda", hbm_cap=2**35))


def test_constraints_change_it(base: bytes) -> None:
    tw = {"t0": ParameterConstraints(sharding_types=["table_wise"])}
    assert _fp(constraints=tw) != base
    assert _fp(constraints=tw) != _fp(constraints={"t0": ParameterConstraints()})
    assert _fp(constraints=tw) != _fp(
        constraints={"t0": ParameterConstraints(sharding_types=["row_wise"])}
    )
    assert _fp(constraints={"t0": ParameterConstraints(pooling_factors=[2.0])}) != _fp(
        constraints={"t0": ParameterConstraints(pooling_factors=[3.0])}
    )
    # the planner's own constraints are used when none are passed
    planner = EmbeddingShardingPlanner(topology=_topology(), constraints=tw)
    assert _fp(planner=planner) == _fp(planner=planner, constraints=tw)


def test_planner_settings_change_it() -> None:
    from torchrec.distributed.planner.proposers import GreedyProposer

    def planner(**kwargs: Any) -> EmbeddingShardingPlanner:
        kwargs.setdefault("debug", False)
        return EmbeddingShardingPlanner(topology=_topology(), **kwargs)

    stock = _fp(planner=planner())
    assert stock == _fp(planner=planner())
    assert stock == _fp(planner=planner(debug=True))  # logging only
    assert _fp(planner=planner(batch_size=1024)) != stock
    assert _fp(planner=planner(proposer=GreedyProposer())) != stock
    assert _fp(planner=planner(proposer=GreedyProposer(threshold=3))) != _fp(
        planner=planner(proposer=GreedyProposer(threshold=4))
    )
    assert _fp(planner=planner(timeout_seconds=10)) != stock
    assert _fp(planner=None) != stock

    class MyPlanner(EmbeddingShardingPlanner):
        pass

    assert _fp(planner=MyPlanner(topology=_topology(), debug=False)) != stock


def test_planning_state_does_not_change_it() -> None:
    model = build_model(ModelSpec(num_tables=2), device="meta")
    planner = EmbeddingShardingPlanner(topology=_topology(), debug=False)
    before = _fp(model=model, planner=planner)
    planner.plan(model, _sharders())
    assert _fp(model=model, planner=planner) == before


def test_inputs_cover_tables_and_versions() -> None:
    doc = planner_inputs(build_model(SPEC, device="meta"), _sharders(), _topology())
    assert [m["path"] for m in doc["modules"]] == ["sparse.ebc", "sparse.wbc", "sparse.ec"]
    assert [m["is_weighted"] for m in doc["modules"]] == [False, True, None]
    assert doc["versions"]["torchrec"] == importlib.metadata.version("torchrec")  # the installed
    table = doc["modules"][0]["tables"][0]["fields"]
    assert {"num_embeddings", "embedding_dim", "data_type", "feature_names", "pooling"} <= set(
        table
    )
    assert {"need_pos", "use_virtual_table", "num_embeddings_post_pruning"} <= set(table)
    assert "init_fn" not in table and "weight_init_max" not in table


def _hashseed_inputs() -> tuple[bytes, bytes]:
    """A fingerprint and a plan digest over strings, sets and dicts (what PYTHONHASHSEED moves)."""
    import tests.plan.test_codec as codec_tests
    from fastinit.plan.codec import plan_digest

    topology = _topology()
    constraints = {
        f"t{i}": ParameterConstraints(
            sharding_types=["table_wise", "row_wise"],
            compute_kernels=["fused"],
            feature_names=[f"tf{i}"],
        )
        for i in range(3)
    }
    sharders = [
        EmbeddingBagCollectionSharder(
            fused_params={"a": 1, "b": "x", "c": (1, 2), "d": {"s", "t", "u", "v"}}
        ),
        EmbeddingCollectionSharder(),
    ]
    fp = planner_fingerprint(
        build_model(SPEC, device="meta"),
        sharders,
        topology,
        constraints=constraints,
        planner=EmbeddingShardingPlanner(topology, constraints=constraints, debug=False),
    )
    return fp, plan_digest(codec_tests._hand_plan())


_SCRIPT = """
import logging, warnings
warnings.simplefilter("ignore")
logging.disable(logging.WARNING)
import tests.plan.test_fingerprint as t
print(*(d.hex() for d in t._hashseed_inputs()))
"""


def test_independent_of_pythonhashseed() -> None:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # this process runs with a random hash seed (or the one in the environment): pick another
    seed = "7" if os.environ.get("PYTHONHASHSEED") != "7" else "8"
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [d.hex() for d in _hashseed_inputs()]


# -- inputs without a canonical description disable the plan cache ---------------------------------


def _keep(options: Any) -> Any:
    return options


def _also_keep(options: Any) -> Any:
    return options


class _Keeps:
    def __init__(self, factor: int) -> None:
        self._factor = factor

    def __call__(self, options: Any) -> Any:
        return options


class _Hides:
    def __init__(self, factor: int) -> None:
        self.scale = factor  # not kept under its argument's name

    def __call__(self, options: Any) -> Any:
        return options


def _planner(**kwargs: Any) -> EmbeddingShardingPlanner:
    return EmbeddingShardingPlanner(topology=_topology(), **kwargs)


def test_two_lambdas_share_a_fingerprint_so_they_are_uncacheable() -> None:
    from fastinit.plan.fingerprint import uncacheable_reason

    model = build_model(SPEC, device="meta")
    a = _planner(callbacks=[lambda options: options])
    b = _planner(callbacks=[lambda options: options[:1]])
    fp = [_fp(model=model, planner=p) for p in (a, b)]
    assert fp[0] == fp[1]  # the fingerprint cannot tell them apart (still fine for agreement)
    for p in (a, b):
        reason = uncacheable_reason(p, _sharders(), None)
        assert reason is not None and "lambda" in reason and "callbacks" in reason, reason


def test_uncacheable_inputs_are_named() -> None:
    from fastinit.plan.fingerprint import uncacheable_reason

    factor = 3

    def local(options: Any) -> Any:
        return options[:factor]

    class Local:
        def __call__(self, options: Any) -> Any:
            return options

    cases = {
        "local function or closure": _planner(callbacks=[local]),
        "defined inside a function": _planner(callbacks=[Local()]),
        "bound to a _Keeps instance": _planner(callbacks=[_Keeps(1).__call__]),
        "does not keep its constructor argument(s) ['factor']": _planner(callbacks=[_Hides(2)]),
        "[0].func is a lambda": _planner(callbacks=[functools.partial(lambda o, k: o, k=1)]),
    }
    for words, planner in cases.items():
        reason = uncacheable_reason(planner, _sharders(), None)
        assert reason is not None and words in reason, (words, reason)
        assert "'callbacks'" in reason, reason
    fused = uncacheable_reason(None, _sharders(hook=lambda: None), None)
    assert fused is not None and "fused_params" in fused and "lambda" in fused
    constraint = ParameterConstraints(sharding_types=["table_wise"])
    constraint.bounds_check_mode = lambda: None  # type: ignore[assignment]
    reason = uncacheable_reason(None, _sharders(), {"t0": constraint})
    assert reason is not None and "constraints['t0']" in reason


def test_describable_inputs_keep_the_cache() -> None:
    from torchrec.distributed.planner.partitioners import GreedyPerfPartitioner
    from torchrec.distributed.planner.proposers import GreedyProposer, UniformProposer
    from torchrec.distributed.planner.storage_reservations import (
        HeuristicalStorageReservation,
    )

    from fastinit.plan.fingerprint import uncacheable_reason
    from fastinit.planner import FastPlanner

    for planner in (
        None,
        _planner(),
        FastPlanner(topology=_topology()),
        _planner(callbacks=[_keep, _also_keep, _Keeps(2), functools.partial(_keep)]),
        _planner(
            batch_size=64,
            storage_reservation=HeuristicalStorageReservation(percentage=0.2),
            proposer=[GreedyProposer(), UniformProposer()],
            partitioner=GreedyPerfPartitioner(),
        ),
    ):
        constraints = {"t0": ParameterConstraints(sharding_types=["table_wise"])}
        assert uncacheable_reason(planner, _sharders(), constraints) is None, planner
    assert uncacheable_reason(None, _sharders(learning_rate=0.1), None) is None
    # Module-level callables are told apart by the fingerprint, so they may share a cache.
    assert _fp(planner=_planner(callbacks=[_keep])) != _fp(planner=_planner(callbacks=[_also_keep]))
    assert _fp(planner=_planner(callbacks=[_Keeps(1)])) != _fp(
        planner=_planner(callbacks=[_Keeps(2)])
    )


def test_a_planner_with_arguments_the_key_does_not_cover() -> None:
    from fastinit.plan.fingerprint import uncacheable_reason

    class_body = {
        "__init__": lambda self, topology, temperature=1.0: EmbeddingShardingPlanner.__init__(
            self, topology=topology
        ),
        "__module__": __name__,
        "__qualname__": "TunedPlanner",
    }
    tuned = type("TunedPlanner", (EmbeddingShardingPlanner,), class_body)(_topology())
    reason = uncacheable_reason(tuned, _sharders(), None)
    assert reason is not None and "['temperature']" in reason
