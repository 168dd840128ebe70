"""Per-rank start-up work from 64 to 8,192 ranks: stock TorchRec against fastinit.

    python -m benchmarks.scale [--ranks 64,256,1024,4096,8192] [--stock-max 1024] [--repeats 3]
                               [--model-factory MOD:FN] [--plan-factory MOD:FN]
                               [--paths compact,explicit] [--quick] [--profile N [--explicit]]

One process is one rank (the last of N) on torch's fake process-group backend; each world size
and mode runs in its own process. The rank receives the plan as bytes, as a real receiving rank
would (fastinit's codec), then times:

* ``fastinit``: ``fastinit.setup(module, plan=decoded plan, ...)`` — validation, digest, the
  start-up exchange, process groups, the sharded model (DMP) from the compact plan.
* ``explicit``: ``fastinit.setup(module, plan=explicit plan, ...)`` where the plan is the
  user's own objects — one ``ShardMetadata`` per shard, as TorchRec's
  ``construct_module_sharding_plan`` (or ``torch.load`` of a saved plan) gives them. The
  plan factory runs in the measured process, before and outside the timing: its seconds are
  reported as ``torchrec_plan_s`` (TorchRec's time, the user's, not fastinit's).
* ``stock``: ``DistributedModelParallel(module, plan=..., sharders=...)`` with the plan expanded to
  TorchRec's own objects (what ``broadcast_object_list`` hands a stock rank). Stock cannot build an
  ``EmbeddingCollection`` on the fake backend (its per-table ``all_gather_object`` gets no
  answers), so stock runs on the model's ``EmbeddingBagCollection`` part only; fastinit is
  measured on that same part too (``same_as_stock``) besides the whole model.

``--model-factory module:function`` (called with no arguments; the model on the meta device) and
``--plan-factory module:function`` (called as ``fn(module, world_size, local_world_size)``,
returning an explicit ``ShardingPlan``) measure a model and plan of the user's; the defaults are
``--model`` and ``--plan`` built with ``fastinit.testing.models.build_plan`` (TorchRec's
``sharding_plan`` helpers). :func:`reference_model` / :func:`reference_plan` are the 288-table
model and six-layout plan of issue 23 (``--model-factory benchmarks.scale.main:reference_model
--plan-factory benchmarks.scale.main:reference_plan``).

Peak RSS is the process's ``ru_maxrss`` (imports included; ``rss_before_mb`` is the same before
setup). Results: ``scale.json`` (schema ``{"model", "rows": [{"world_size", "mode", "setup_s",
"peak_rss_mb"}]}``, read by ``benchmarks.ttfb.projection``), ``scale.md`` and a log-log ``scale.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["ScaleConfig", "measure_rank", "fit_exponent", "run", "format_table", "main"]

RANKS: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: Plans: the projection's mix, and every layout TorchRec has.
PLANS: dict[str, tuple[str, ...]] = {
    "mixed4": ("table_wise", "row_wise", "column_wise", "data_parallel"),
    "all7": (
        "table_wise",
        "row_wise",
        "column_wise",
        "table_column_wise",
        "table_row_wise",
        "grid_shard",
        "data_parallel",
    ),
}


@dataclasses.dataclass(kw_only=True, slots=True)
class ScaleConfig:
    """One ``make scale`` run."""

    model: str = "medium"
    """A model of ``benchmarks.ttfb.trainer.MODELS`` (medium: 192 EBC + 64 EC tables)."""
    plan: str = "mixed4"
    """A key of :data:`PLANS`."""
    ranks: tuple[int, ...] = RANKS
    """World sizes."""
    stock_max: int = 1024
    """Largest world size stock is run at (its O(shards × ranks) checks take minutes beyond)."""
    repeats: int = 3
    """fastinit measurements per point, each in a fresh process; the median is reported (when
    the garbage collector runs a full collection is one source of their spread)."""
    local_world_size: int = 8
    """Ranks per host."""
    timeout_s: float = 1500.0
    """Per measurement."""
    out: str = "benchmarks/results/scale"
    """Where scale.json/.md/.png go."""
    model_factory: str | None = None
    """``module:function`` building the model (on meta); None: :attr:`model`."""
    plan_factory: str | None = None
    """``module:function``: ``fn(module, world_size, local_world_size)`` -> an explicit plan;
    None: :attr:`plan` through ``build_plan``."""
    paths: tuple[str, ...] = ("compact",)
    """fastinit's paths: ``compact`` (the plan as a receiving rank decodes it) and
    ``explicit`` (the plan factory's own objects)."""


def _resolve(ref: str) -> Any:
    """The function named ``module:function``."""
    import importlib

    module, sep, fn = ref.partition(":")
    if not sep or not module or not fn:
        raise ValueError(f"expected module:function, got {ref!r}")
    return getattr(importlib.import_module(module), fn)


def _model(name: str, ebc_only: bool, factory: str | None = None) -> Any:
    if factory is not None:
        if ebc_only:
            raise ValueError("a factory model has no EBC-only variant (use --stock-max 0)")
        return _resolve(factory)()
    from benchmarks.ttfb.trainer import model_spec
    from fastinit.testing.models import build_model

    spec = model_spec(name)
    if ebc_only:
        spec = dataclasses.replace(spec, num_ec_tables=0)
    return build_model(spec, device="meta")


def _plan(module: Any, plan: str, n: int, local: int, factory: str | None = None) -> Any:
    """The explicit plan: the factory's, else ``PLANS[plan]`` through ``build_plan``."""
    if factory is not None:
        return _resolve(factory)(module, n, local)
    from fastinit.testing.models import build_plan

    return build_plan(module, plan_types(module, plan), world_size=n, local_world_size=local)


def reference_model() -> Any:
    """Issue 23's model: 288 tables, in an EmbeddingBagCollection (192), a weighted one (32) and
    an EmbeddingCollection (64), on the meta device."""
    from fastinit.testing.models import ModelSpec, build_model

    spec = ModelSpec(num_tables=192, num_weighted_tables=32, num_ec_tables=64, rows=2000)
    return build_model(spec, device="meta")


def explicit_plan(
    module: Any,
    world_size: int,
    local_world_size: int,
    choose: Callable[[Any, int, bool], Any],
) -> Any:
    """An explicit plan through TorchRec's ``construct_module_sharding_plan``: for each
    EmbeddingBagCollection / EmbeddingCollection of ``module``, ``choose(config, index, is_ec)``
    gives each table's ``sharding_plan`` generator (``index`` counts the tables over all the
    modules); every sharded table gets the fused kernel."""
    from torchrec.distributed import sharding_plan as sp
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    index = 0
    plan: dict[str, Any] = {}
    for path, m in module.named_modules():
        if not isinstance(m, EmbeddingBagCollection | EmbeddingCollection):
            continue
        is_ec = isinstance(m, EmbeddingCollection)
        configs = m.embedding_configs() if is_ec else m.embedding_bag_configs()
        per_param: dict[str, Any] = {}
        for c in configs:
            per_param[c.name] = choose(c, index, is_ec)
            index += 1
        plan[path] = sp.construct_module_sharding_plan(
            m,
            per_param,
            local_size=local_world_size,
            world_size=world_size,
            device_type="cpu",
        )
        for ps in plan[path].values():
            if ps.sharding_type != "data_parallel":
                ps.compute_kernel = "fused"
    return ShardingPlan(plan)


def reference_plan(module: Any, world_size: int, local_world_size: int) -> Any:
    """Issue 23's explicit plan, through TorchRec's ``construct_module_sharding_plan``: row-wise,
    table-row-wise on one host, grid over one host, column-wise over 4 ranks, table-wise and
    data-parallel, cycled over the tables (the EmbeddingCollection: its four types)."""
    from torchrec.distributed import sharding_plan as sp

    hosts = max(1, world_size // local_world_size)
    kinds = ("row_wise", "table_row_wise", "grid_shard", "column_wise", "table_wise")
    kinds += ("data_parallel",)

    def choose(c: Any, i: int, is_ec: bool) -> Any:
        usable = [k for k in kinds if not is_ec or k in EC_TYPES]
        kind = usable[i % len(usable)]
        if kind == "row_wise":
            return sp.row_wise(compute_kernel="fused")
        if kind == "table_row_wise":
            return sp.table_row_wise(host_index=i % hosts)
        if kind == "grid_shard":
            return sp.grid_shard(host_indexes=[i % hosts])
        if kind == "column_wise":
            ranks = [(i + k) % world_size for k in range(min(4, world_size))]
            return sp.column_wise(ranks=ranks, compute_kernel="fused")
        if kind == "table_wise":
            return sp.table_wise(rank=i % world_size, compute_kernel="fused")
        return sp.data_parallel()

    return explicit_plan(module, world_size, local_world_size, choose)


#: The sharding types TorchRec's EmbeddingCollection supports.
EC_TYPES: tuple[str, ...] = ("table_wise", "row_wise", "column_wise", "data_parallel")


def plan_types(module: Any, plan: str) -> dict[str, str]:
    """Table name → sharding type: ``PLANS[plan]`` cycled over the EmbeddingBagCollection tables,
    the types of it that an EmbeddingCollection supports cycled over its tables."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    kinds = PLANS[plan]
    ec_kinds = [k for k in kinds if k in EC_TYPES]
    out: dict[str, str] = {}
    i = 0
    for m in module.modules():
        if isinstance(m, EmbeddingBagCollection):
            for c in m.embedding_bag_configs():
                out[c.name] = kinds[i % len(kinds)]
                i += 1
        elif isinstance(m, EmbeddingCollection):
            for c in m.embedding_configs():
                out[c.name] = ec_kinds[i % len(ec_kinds)]
                i += 1
    return out


def write_plan(
    model: str,
    plan: str,
    n: int,
    local: int,
    ebc_only: bool,
    path: str,
    model_factory: str | None = None,
    plan_factory: str | None = None,
) -> int:
    """Encode the plan for ``n`` ranks into ``path`` (what the planning rank sends)."""
    from fastinit.plan.codec import encode_plan

    module = _model(model, ebc_only, model_factory)
    data = encode_plan(_plan(module, plan, n, local, plan_factory))
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure_rank(
    model: str,
    n: int,
    local: int,
    mode: str,
    plan_path: str,
    ebc_only: bool,
    model_factory: str | None = None,
    plan_factory: str | None = None,
    plan_name: str = "mixed4",
) -> dict[str, Any]:
    """Set up rank ``n - 1`` of ``n`` on the fake backend (run in a fresh process); ``mode``:
    ``fastinit`` (the compact plan, decoded from ``plan_path``), ``explicit`` (the plan
    factory's objects, built here outside the timing) or ``stock``."""
    import logging
    import warnings

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import fake_pg
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.ttfb.trainer import _sharders
    from fastinit.plan.codec import decode_plan

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    os.environ.update(
        {"LOCAL_WORLD_SIZE": str(local), "LOCAL_RANK": str((n - 1) % local), "RANK": str(n - 1)}
    )
    # TorchRec skips the sharded modules' state on a backend named "fake"; the same fake group
    # under another name makes it build it (the part that could be O(tables x ranks)).
    if "fakestate" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "fakestate", fake_pg._create_fake_pg, extended_api=True, devices=["cpu"]
        )
    dist.init_process_group("fakestate", store=FakeStore(), rank=n - 1, world_size=n)
    module = _model(model, ebc_only, model_factory)
    torchrec_plan_s = None
    if mode == "explicit":
        t0 = time.perf_counter()
        plan = _plan(module, plan_name, n, local, plan_factory)
        torchrec_plan_s = time.perf_counter() - t0
        data = b""
    else:
        with open(plan_path, "rb") as f:
            data = f.read()
    rss_before = _rss_mb()
    t0 = time.perf_counter()
    if mode != "explicit":
        plan = decode_plan(data)
    decode_s = time.perf_counter() - t0
    device = torch.device("cpu")
    import gc

    collecting = [0.0, 0.0, 0, 0.0]  # start, total seconds, full collections, their seconds
    # what a full collection walks: every object the collector tracks (the user's explicit
    # plan included), counted outside the timing
    heap_objects = len(gc.get_objects())

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting[0] = time.perf_counter()
        else:
            took = time.perf_counter() - collecting[0]
            collecting[1] += took
            if info["generation"] == 2:
                collecting[2] += 1
                collecting[3] += took

    gc.callbacks.append(on_gc)
    if mode in ("fastinit", "explicit"):
        import fastinit

        t = time.perf_counter()
        fastinit.setup(module, device=device, plan=plan, sharders=_sharders(), seed=0)
        setup_s = time.perf_counter() - t
    else:
        from torchrec.distributed.model_parallel import DistributedModelParallel

        from fastinit.plan.compact import expanded_plan
        from fastinit.sharding import _torchrec_modules as _trc
        from fastinit.sharding.mirror.collective_utils import set_collective_validation

        plan = expanded_plan(plan)  # TorchRec's own objects, as broadcast_object_list gives
        # init_collective_validation's broadcast_object_list gets no real answer on the fake
        # backend (garbage sizes): configure it as rank 0 would have, outside the timing.
        set_collective_validation(_trc.collective_validation_on_leader())
        t = time.perf_counter()
        DistributedModelParallel(module, device=device, plan=plan, sharders=_sharders())
        setup_s = time.perf_counter() - t
    gc.callbacks.remove(on_gc)
    return {
        "gc_s": collecting[1],
        "gc_full": collecting[2],
        "gc_full_s": collecting[3],
        "heap_objects": heap_objects,
        "world_size": n,
        "mode": mode,
        "setup_s": setup_s,
        "peak_rss_mb": _rss_mb(),
        "rss_before_mb": rss_before,
        "decode_s": decode_s,
        "plan_bytes": len(data),
        "torchrec_plan_s": torchrec_plan_s,
    }


def _in_subprocess(fn: str, args: Sequence[Any], timeout: float) -> Any:
    """``benchmarks.scale.main.<fn>(*args)`` in a fresh process; ``{"error": ...}`` if it fails."""
    from fastinit.testing.dist import FreshProcessError, call_fresh

    try:
        return call_fresh("benchmarks.scale.main", fn, args, timeout, cwd=ROOT)
    except FreshProcessError as e:
        return {"error": str(e).splitlines()[-1:]}


def fit_exponent(points: Sequence[tuple[float, float]], lo: float, hi: float) -> float | None:
    """Least-squares slope of log(seconds) on log(ranks) for ``lo <= ranks <= hi``."""
    pts = [(math.log(x), math.log(y)) for x, y in points if lo <= x <= hi and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if not sxx:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def run(config: ScaleConfig) -> dict[str, Any]:
    """Measure every (world size, mode) in its own process; write and return the results."""
    rows: list[dict[str, Any]] = []
    same: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fastinit-scale-") as tmp:
        for n in config.ranks:
            local = min(config.local_world_size, n)
            factories = (config.model_factory, config.plan_factory)
            stock = n <= config.stock_max and config.model_factory is None
            for ebc_only in (False, True) if stock else (False,):
                path = os.path.join(tmp, f"plan-{n}-{int(ebc_only)}.bin")
                _in_subprocess(
                    "write_plan",
                    (config.model, config.plan, n, local, ebc_only, path, *factories),
                    config.timeout_s,
                )
            jobs = [("fastinit", False, rows)] if "compact" in config.paths else []
            if "explicit" in config.paths:
                jobs.append(("explicit", False, rows))
            if stock:  # stock, and fastinit on the same (EBC) part
                jobs += [("fastinit", True, same), ("stock", True, rows)]
            for mode, ebc_only, into in jobs:
                path = os.path.join(tmp, f"plan-{n}-{int(ebc_only)}.bin")
                samples = []
                for _ in range(max(1, config.repeats) if mode != "stock" else 1):
                    got = _in_subprocess(
                        "measure_rank",
                        (config.model, n, local, mode, path, ebc_only, *factories, config.plan),
                        config.timeout_s,
                    )
                    if "error" in got:
                        break
                    samples.append(got)
                if samples and "error" not in got:
                    samples.sort(key=lambda r: r["setup_s"])
                    got = dict(samples[len(samples) // 2])  # the median run
                    got["samples_s"] = [r["setup_s"] for r in samples]
                    got["samples_gc_s"] = [r["gc_s"] for r in samples]
                    got["samples_gc_full"] = [r["gc_full"] for r in samples]
                if "error" in got:
                    errors.append({"world_size": n, "mode": mode, "error": got["error"]})
                    print(f"{n:>6} {mode:<8} failed: {got['error']}", flush=True)
                    continue
                into.append(got)
                part = "EBC part" if ebc_only else "whole model"
                spread = "/".join(f"{x:.2f}" for x in got.get("samples_s", [got["setup_s"]]))
                extra = (
                    f"  (TorchRec's plan {got['torchrec_plan_s']:.2f} s)"
                    if got.get("torchrec_plan_s") is not None
                    else f"  plan {got['plan_bytes']:>9} B"
                )
                print(
                    f"{n:>6} {mode:<8} {part:<11} setup {got['setup_s']:7.2f} s ({spread}; "
                    f"GC {got['gc_s']:.2f} s)  peak RSS {got['peak_rss_mb']:7.0f} MB{extra}",
                    flush=True,
                )
    fast = [(r["world_size"], r["setup_s"]) for r in rows if r["mode"] == "fastinit"]
    explicit = [(r["world_size"], r["setup_s"]) for r in rows if r["mode"] == "explicit"]
    result = {
        "model": config.model_factory or config.model,
        "plan": config.plan_factory or config.plan,
        "rows": [{k: r[k] for k in ("world_size", "mode", "setup_s", "peak_rss_mb")} for r in rows],
        "details": rows,
        "same_as_stock": same,
        "errors": errors,
        "exponent_512_8192": fit_exponent(fast, 512, 8192),
        "exponent_64_8192": fit_exponent(fast, 64, 8192),
        "explicit_exponent_64_8192": fit_exponent(explicit, 64, 8192),
        "notes": (
            "fake process-group backend, rank N-1 of N, one process per (N, mode) and run; "
            f"fastinit: the median of {config.repeats} runs; fastinit = the compact plan as "
            "decoded by a receiving rank, explicit = the plan factory's own objects (TorchRec's "
            "time to build them, torchrec_plan_s, is not in setup_s); stock rows are "
            "the model's EmbeddingBagCollection part (stock cannot build an EmbeddingCollection "
            "on the fake backend), fastinit rows the whole model; same_as_stock: fastinit on "
            "the EBC part. Machine: " + _machine()
        ),
    }
    os.makedirs(config.out, exist_ok=True)
    with open(os.path.join(config.out, "scale.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(config.out, "scale.md"), "w") as f:
        f.write(format_table(result))
    plot(result, os.path.join(config.out, "scale.png"))
    return result


def _machine() -> str:
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = (float("nan"),) * 3
    return (
        f"{os.cpu_count()} CPUs, load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} at the end"
    )


def format_table(result: dict[str, Any]) -> str:
    """The results as Markdown."""
    by: dict[int, dict[str, Any]] = {}
    for r in result["details"]:
        by.setdefault(r["world_size"], {})[r["mode"]] = r
    for r in result["same_as_stock"]:
        by.setdefault(r["world_size"], {})["same"] = r
    lines = [
        f"## Per-rank setup at scale ({result['model']} model, {result['plan']} plan)\n",
        result["notes"] + "\n",
        "| ranks | fastinit s | fastinit runs s | of which GC s | fastinit peak RSS MB "
        "| plan bytes | explicit plan: fastinit s | explicit runs s | of which GC s "
        "| TorchRec's plan s | fastinit (EBC part) s | stock (EBC part) s | stock peak RSS MB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(r: dict[str, Any] | None, key: str, fmt: str) -> str:
        return format(r[key], fmt) if r else "—"

    for n in sorted(by):
        f, s, e = by[n].get("fastinit"), by[n].get("stock"), by[n].get("same")
        x = by[n].get("explicit")
        runs = "/".join(f"{v:.2f}" for v in f.get("samples_s", [])) if f else "—"
        gcs = "/".join(f"{v:.2f}" for v in f.get("samples_gc_s", [])) if f else "—"
        xruns = "/".join(f"{v:.2f}" for v in x.get("samples_s", [])) if x else "—"
        xgcs = "/".join(f"{v:.2f}" for v in x.get("samples_gc_s", [])) if x else "—"
        lines.append(
            f"| {n} | {cell(f, 'setup_s', '.2f')} | {runs or '—'} | {gcs or '—'} "
            f"| {cell(f, 'peak_rss_mb', '.0f')} "
            f"| {cell(f, 'plan_bytes', 'd')} | {cell(x, 'setup_s', '.2f')} | {xruns or '—'} "
            f"| {xgcs or '—'} | {cell(x, 'torchrec_plan_s', '.2f')} | {cell(e, 'setup_s', '.2f')} "
            f"| {cell(s, 'setup_s', '.2f')} | {cell(s, 'peak_rss_mb', '.0f')} |"
        )
    for label, key in (
        ("512 to 8,192", "exponent_512_8192"),
        ("64 to 8,192", "exponent_64_8192"),
        ("64 to 8,192, explicit plan", "explicit_exponent_64_8192"),
    ):
        k = result.get(key)
        if k is not None:
            lines.append(f"\nfastinit growth exponent (setup s ∝ ranks^k), {label}: k = {k:.3f}")
    for err in result["errors"]:
        lines.append(f"\n{err['mode']} at {err['world_size']} ranks: {err['error']}")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    """Log-log plot of per-rank setup seconds against ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [
        ([r for r in result["details"] if r["mode"] == "fastinit"], "fastinit (whole model)", "-o"),
        (
            [r for r in result["details"] if r["mode"] == "explicit"],
            "fastinit, explicit plan (whole model)",
            "-^",
        ),
        (result["same_as_stock"], "fastinit (EBC part)", "--o"),
        ([r for r in result["details"] if r["mode"] == "stock"], "stock (EBC part)", "-s"),
    ]
    for rows, label, style in series:
        if rows:
            ax.plot(
                [r["world_size"] for r in rows], [r["setup_s"] for r in rows], style, label=label
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks (world size)")
    ax.set_ylabel("per-rank setup seconds (fake backend)")
    ax.set_title(f"Per-rank setup, {result['model']} model, {result['plan']} plan")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile(
    model: str,
    plan: str,
    n: int,
    local: int,
    top: int = 25,
    mode: str = "fastinit",
    model_factory: str | None = None,
    plan_factory: str | None = None,
) -> str:
    """cProfile of ``fastinit.setup`` as rank ``n - 1`` of ``n`` (imports done first, outside
    the profile; with ``mode="explicit"`` the plan factory runs inside it, its time reported
    apart); the ``top`` functions by own time, then fastinit's phases by total time."""
    import cProfile
    import io
    import pstats

    import torchrec.distributed.model_parallel  # noqa: F401

    import benchmarks.ttfb.trainer  # noqa: F401  (imports outside the profile)
    import fastinit.sharding.kernels  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="fastinit-scale-") as tmp:
        path = os.path.join(tmp, "plan.bin")
        write_plan(model, plan, n, local, False, path, model_factory, plan_factory)
        prof = cProfile.Profile()
        prof.enable()
        got = measure_rank(model, n, local, mode, path, False, model_factory, plan_factory, plan)
        prof.disable()
    out = io.StringIO()
    out.write(f"setup {got['setup_s']:.2f} s under cProfile, {got['gc_full']} full GC")
    if got.get("torchrec_plan_s") is not None:
        out.write(
            f"; TorchRec's plan (in the profile, not in setup) {got['torchrec_plan_s']:.2f} s"
        )
    out.write("\n")
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(r"fastinit/startup\.py", 12)
    return out.getvalue()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="medium")
    parser.add_argument("--plan", choices=sorted(PLANS), default="mixed4")
    parser.add_argument("--ranks", default=",".join(map(str, RANKS)))
    parser.add_argument("--stock-max", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/scale")
    parser.add_argument("--repeats", type=int, default=3, help="fastinit runs per point")
    parser.add_argument("--quick", action="store_true", help="small model, 16 and 64 ranks")
    parser.add_argument(
        "--profile", type=int, default=None, metavar="N", help="cProfile setup at N ranks only"
    )
    parser.add_argument(
        "--explicit", action="store_true", help="with --profile: the explicit-plan path"
    )
    parser.add_argument("--model-factory", default=None, metavar="MODULE:FUNCTION")
    parser.add_argument("--plan-factory", default=None, metavar="MODULE:FUNCTION")
    parser.add_argument(
        "--paths", default="compact,explicit", help="fastinit's paths: compact, explicit or both"
    )
    args = parser.parse_args(argv)
    if args.profile is not None:
        print(
            profile(
                args.model,
                args.plan,
                args.profile,
                min(8, args.profile),
                mode="explicit" if args.explicit else "fastinit",
                model_factory=args.model_factory,
                plan_factory=args.plan_factory,
            )
        )
        return {}
    paths = tuple(p for p in args.paths.split(",") if p)
    if not paths or set(paths) - {"compact", "explicit"}:
        parser.error(f"--paths: compact and/or explicit, got {args.paths!r}")
    config = ScaleConfig(
        model_factory=args.model_factory,
        plan_factory=args.plan_factory,
        paths=paths,
        model="small" if args.quick else args.model,
        plan=args.plan,
        ranks=(16, 64) if args.quick else tuple(int(x) for x in args.ranks.split(",")),
        stock_max=args.stock_max,
        out=args.out,
        repeats=1 if args.quick else args.repeats,
    )
    result = run(config)
    print(format_table(result))
    return result


if __name__ == "__main__":
    main()
