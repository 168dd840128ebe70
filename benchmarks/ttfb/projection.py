"""Time to first batch at 1,024 and 4,096 ranks, projected: stock, stock-best and fastinit.

    python -m benchmarks.ttfb.projection [--summary bench-out/summary.json] [--out bench-out]
                                    [--scale-json scale.json]

Time to first batch at N ranks, per mode and scenario (cold, restart on new hosts), is the
measured single-host time with its scale-dependent parts taken out and projected at N put back:

    ttfb(N) = [measured ttfb − process_group_init − train_module_creation]   (launch, imports,
              data, compilation: per host, the same at any N; measured in the same bench run)
            + rendezvous(N)    store operations per rank × N × one store round trip (rank 0's
                               store serves them one at a time)
            + planning(N)      stock always; stock-best and fastinit only when cold (a restart
                               passes the saved plan / hits the plan cache)
            + collectives(N)   the mode's exact start-up ops (α-β, below)
            + groups(N)        process-group creation for a plan with table_row_wise tables
            + local(N)         per-rank local work building the sharded model: from
                               ``--scale-json`` (``make scale``: the fake backend, one real rank
                               of N; stock-best uses stock's rows) when given, else fastinit's
                               own fake-backend measurement below for every mode (for stock a
                               lower bound: it favours stock)

The components:

Inputs are exact, per rank, from the benchmark's traces (``summary.json``): every c10d op issued
before the first step, with the bytes this rank sent. Each op is priced at N ranks with the
α-β (Hockney) model and the collective algorithms of Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005), m = bytes a rank
contributes, n = bytes of the whole message:

* broadcast (binomial tree):        ceil(lg N) × (α + n β)
* all_gather (ring):                (N − 1) α + (N − 1) m β
* all_reduce (ring):                2 (N − 1) α + 2 (N − 1)/N n β
* all_to_all (pairwise exchange):   (N − 1) α + (N − 1)/N n β
* barrier (dissemination):          ceil(lg N) α

plus a fixed software cost per call (``op_overhead``: launch, pickling, host/device copies).
Bytes that grow with N — the plan (row-wise and data-parallel tables have a shard per rank) —
are measured at N by encoding a plan for N ranks (pickle for stock's ``broadcast_object_list``,
fastinit's codec for its one broadcast).

Process groups: a plan with table_row_wise or grid_shard tables makes stock create every
intra- and cross-host group on every rank, each with a store-based barrier (N store operations on
rank 0's TCPStore, served one at a time), then 2 barriers; fastinit creates only the 2 groups a
rank belongs to, synchronising members only. A store operation costs ``store_op`` (measured here
on 127.0.0.1, TCPStore ``add`` round trip).

Planning: timed in this process for the benchmark's models at growing world sizes (stock
``EmbeddingShardingPlanner.plan`` and fastinit's ``FastPlanner``; no process group needed) and
extrapolated with a power law fitted in log-log space.

Local per-rank work: ``fastinit.setup`` run as the last rank of N (64 to 4,096) in a single process
on torch's fake process-group backend (``init_process_group("fake")`` with ``FakeStore``; its
all_gather hands every rank's slot this rank's record, so the start-up exchange agrees), with an
explicit plan mixing table-wise, row-wise, column-wise and data-parallel tables, so an
O(tables × ranks) cost in plan decoding or shard-metadata construction would show.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "TTFB_RANKS",
    "read_scale_json",
    "ttfb_components",
    "Fabric",
    "FABRICS",
    "collective_time",
    "ops_time",
    "group_creation_time",
    "fit_power",
    "project",
    "main",
]

RANKS: tuple[int, ...] = (8, 32, 128, 512, 1024, 2048, 4096)
#: World sizes of the time-to-first-batch projection.
TTFB_RANKS: tuple[int, ...] = (1024, 4096)
_TTFB_MODES: tuple[str, ...] = ("stock", "stock-best", "fastinit")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Fabric:
    """Constants of the α-β model."""

    name: str
    """What the constants describe."""
    alpha_s: float
    """Latency of one message between two ranks (one step of an algorithm)."""
    beta_s_per_byte: float
    """Seconds per byte on one link (1 / bandwidth)."""
    op_overhead_s: float
    """Fixed software cost of one collective call (launch, pickling, copies, sync)."""
    source: str
    """Where the numbers come from."""


FABRICS: dict[str, Fabric] = {
    "ib": Fabric(
        name="NCCL over 200 Gb/s HDR InfiniBand",
        alpha_s=10e-6,
        beta_s_per_byte=1.0 / 25e9,
        op_overhead_s=50e-6,
        source=(
            "β: HDR InfiniBand signalling rate, 200 Gb/s = 25 GB/s per port (InfiniBand Trade "
            "Association roadmap). α: 10 µs per algorithm step, the order of NCCL's small-message "
            "latency across nodes (MPI ping-pong on HDR is ~1-2 µs; NCCL's proxy/protocol steps "
            "add several µs; nccl-tests report tens of µs for 8-byte collectives across nodes). "
            "Per-call overhead 50 µs: kernel launch, stream sync and the pickling and "
            "host-device copies of *_object collectives (an assumption; the gloo traces here "
            "show larger per-op costs)."
        ),
    ),
    "tcp": Fabric(
        name="gloo over 25 GbE TCP",
        alpha_s=50e-6,
        beta_s_per_byte=1.0 / 3.1e9,
        op_overhead_s=100e-6,
        source=(
            "β: 25 Gb/s Ethernet ≈ 3.1 GB/s; α: 50 µs, a typical kernel-TCP round trip inside a "
            "data centre (assumption); per-call overhead 100 µs (assumption)."
        ),
    ),
}


def _lg(n: int) -> int:
    return max(1, math.ceil(math.log2(max(2, n))))


def collective_time(op: str, sent_bytes: float, n: int, fabric: Fabric) -> float:
    """Seconds for one c10d op at ``n`` ranks, ``sent_bytes`` being what the tracer recorded for
    one rank (the input: the whole buffer for broadcast/all_reduce/all_to_all, this rank's part
    for all_gather)."""
    a, b = fabric.alpha_s, fabric.beta_s_per_byte
    if n <= 1:
        return 0.0
    if op.startswith("broadcast"):
        t = _lg(n) * (a + sent_bytes * b)
    elif op.startswith(("allgather", "_allgather", "all_gather")):
        t = (n - 1) * a + (n - 1) * sent_bytes * b
    elif op.startswith(("allreduce", "all_reduce")):
        t = 2 * (n - 1) * a + 2 * (n - 1) / n * sent_bytes * b
    elif op.startswith(("alltoall", "all_to_all")):
        t = (n - 1) * a + (n - 1) / n * sent_bytes * b
    elif "barrier" in op:
        t = _lg(n) * a
    else:  # reduce_scatter, gather, ...: price as a ring
        t = (n - 1) * a + sent_bytes * b
    return t + fabric.op_overhead_s


def ops_time(
    by_op: dict[str, dict[str, int]],
    n: int,
    fabric: Fabric,
    broadcast_bytes: dict[str, float] | None = None,
) -> float:
    """Seconds for a rank's measured ops at ``n`` ranks. ``broadcast_bytes`` overrides the mean
    bytes of an op (for the plan, whose size grows with ``n``)."""
    total = 0.0
    for op, rec in by_op.items():
        count = rec["count"]
        if not count:
            continue
        mean = rec["bytes"] / count
        if broadcast_bytes and op in broadcast_bytes:
            mean = broadcast_bytes[op]
        total += count * collective_time(op, mean, n, fabric)
    return total


def group_creation_time(
    n: int, local: int, mode: str, fabric: Fabric, store_op_s: float
) -> tuple[float, int]:
    """(seconds, groups created per rank) for a plan with table_row_wise/grid_shard tables.

    Stock (``comm.intra_and_cross_node_pg``): every rank creates all ``n/local`` intra-host and
    ``local`` cross-host groups; each creation is a store-based barrier over the world (``n``
    store operations served by rank 0's store), then 2 barriers over the world. fastinit: the 2
    groups this rank belongs to, synchronising only their members.
    """
    hosts = max(1, n // local)
    if mode == "stock":
        groups = hosts + local
        store_ops = groups * n
        t = store_ops * store_op_s + 2 * collective_time("barrier", 0, n, fabric)
        return t, groups
    store_ops = local + hosts  # members of this rank's two groups
    return store_ops * store_op_s, 2


def fit_power(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares of ``log y = log c + k log x``: returns ``(c, k)``."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        y = pts[0][1] if pts else 0.0
        return math.exp(y), 0.0
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    k = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
    return math.exp(my - k * mx), k


def read_scale_json(path: str) -> dict[str, dict[int, float]]:
    """``make scale``'s output: ``{"model", "rows": [{"world_size", "mode", "setup_s",
    "peak_rss_mb"}]}`` as ``{mode: {world_size: setup_s}}``.

    Raises:
        ValueError: the file does not have that schema.
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path}: expected an object with a 'rows' list")
    out: dict[str, dict[int, float]] = {}
    for i, row in enumerate(data["rows"]):
        try:
            mode, n, t = str(row["mode"]), int(row["world_size"]), float(row["setup_s"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: row {i} lacks mode/world_size/setup_s: {row!r}") from e
        if mode not in ("stock", "fastinit"):
            raise ValueError(f"{path}: row {i}: mode must be stock or fastinit, got {mode!r}")
        out.setdefault(mode, {})[n] = t
    return out


def ttfb_components(
    measured: dict[str, Any],
    *,
    mode: str,
    scenario: str,
    n: int,
    fabric: Fabric,
    store_op_s: float,
    plan_fit: tuple[float, float] | None,
    plan_bytes: int | None,
    local_s: float,
    groups: bool = False,
) -> dict[str, float]:
    """Projected time to first batch at ``n`` ranks, by component (see the module docstring).

    Args:
        measured: the bench summary's result of (mode, scenario) (``ttfb_s``, ``stages_s``,
            ``setup``, ``setup_by_op``).
        plan_fit: ``(c, k)`` of the planning-time power law when this mode plans in this
            scenario, else None.
        plan_bytes: the plan message's size at ``n`` when this mode sends the plan, else None.
        local_s: per-rank local work building the sharded model at ``n``.
        groups: the plan has table_row_wise / grid_shard tables (process groups are created);
            ``groups_s`` is reported either way, ``ttfb_s`` counts it only then, and
            ``ttfb_twrw_s`` always.
    """
    stages = measured["stages_s"]
    fixed = measured["ttfb_s"] - stages["process_group_init"] - stages["train_module_creation"]
    by_op = measured["setup_by_op"]
    scaled = _scaled_broadcast(by_op, plan_bytes) if plan_bytes is not None else {}
    groups_s, _ = group_creation_time(
        n, 8, "fastinit" if mode == "fastinit" else "stock", fabric, store_op_s
    )
    parts = {
        "single_host_fixed_s": max(0.0, fixed),
        "rendezvous_s": measured["setup"]["store_ops"] * n * store_op_s,
        "planning_s": plan_fit[0] * n ** plan_fit[1] if plan_fit else 0.0,
        "collectives_s": ops_time(by_op, n, fabric, scaled),
        "groups_s": groups_s,
        "local_s": local_s,
    }
    total = sum(parts.values())
    parts["ttfb_s"] = total if groups else total - groups_s
    parts["ttfb_twrw_s"] = total
    return parts


# -- measurements ------------------------------------------------------------------------------


def measure_store_op_s(ops: int = 2000) -> float:
    """Mean TCPStore ``add`` round trip on 127.0.0.1 (server in this process)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", store.port, 1, is_master=False)
    t = time.perf_counter()
    for _ in range(ops):
        client.add("k", 1)
    return (time.perf_counter() - t) / ops


def _planner_topology(n: int, local: int) -> Any:
    from torchrec.distributed.planner import Topology

    return Topology(local_world_size=min(local, n), world_size=n, compute_device="cpu")


def measure_planning(model: str, n: int, which: str) -> float:
    """Seconds of one ``plan()`` for ``model`` on ``n`` ranks (8 per host), in this process."""
    import logging

    from torchrec.distributed.planner import EmbeddingShardingPlanner

    from benchmarks.ttfb.trainer import _sharders, model_spec
    from fastinit.planner import FastPlanner
    from fastinit.testing.models import build_model

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    module = build_model(model_spec(model), device="meta")
    cls = EmbeddingShardingPlanner if which == "stock" else FastPlanner
    planner = cls(topology=_planner_topology(n, 8))
    t = time.perf_counter()
    planner.plan(module, _sharders())
    return time.perf_counter() - t


def _mixed_plan(module: Any, n: int, local: int) -> Any:
    """``make scale``'s 4-layout plan (``benchmarks.scale.main``, "mixed4") for ``n`` ranks."""
    from benchmarks.scale.main import plan_types
    from fastinit.testing.models import build_plan

    return build_plan(module, plan_types(module, "mixed4"), world_size=n, local_world_size=local)


def plan_sizes(model: str, n: int) -> dict[str, int]:
    """Bytes of the mixed plan for ``n`` ranks: pickled (stock) and fastinit's encoding."""
    from benchmarks.ttfb.trainer import model_spec
    from fastinit.plan.codec import encode_plan
    from fastinit.testing.models import build_model

    module = build_model(model_spec(model), device="meta")
    plan = _mixed_plan(module, n, min(8, n))
    return {"pickle": len(pickle.dumps(plan)), "codec": len(encode_plan(plan))}


def fake_rank_setup(model: str, n: int) -> dict[str, float]:
    """``fastinit.setup`` as rank n-1 of n on the fake backend, as ``make scale`` measures it
    (run in a fresh process)."""
    import tempfile

    from benchmarks.scale.main import measure_rank, write_plan

    local = min(8, n)
    with tempfile.TemporaryDirectory(prefix="fastinit-projection-") as tmp:
        path = os.path.join(tmp, "plan.bin")
        write_plan(model, "mixed4", n, local, False, path)
        got = measure_rank(model, n, local, "fastinit", path, False)
    return {"n": n, "decode_s": got["decode_s"], "setup_s": got["setup_s"]}


def _in_subprocess(fn: str, *args: str, timeout: float = 900) -> Any:
    from fastinit.testing.dist import call_fresh

    return call_fresh(
        "benchmarks.ttfb.projection",
        fn,
        args,
        timeout,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )


# -- the projection ----------------------------------------------------------------------------


#: The stated checkpoint read bandwidth per host (GB/s): a conservative share of a parallel
#: file system or a local NVMe read, the floor of every resume below.
DEFAULT_READ_GBPS = 2.0


def _at(points: dict[int, float], n: int) -> float:
    """``points[n]`` if measured, else the power law fitted through every point."""
    if n in points:
        return points[n]
    c, k = fit_power(list(points), list(points.values()))
    return c * n**k


def read_resume_json(path: str) -> dict[str, dict[int, float]]:
    """``make resume-scale``'s per-N measurements: fastinit's same-plan load seconds, stock
    DCP's metadata read + load planning seconds, the measured rank's own bytes, the global
    ``.metadata`` bytes."""
    with open(path) as f:
        data = json.load(f)
    out: dict[str, dict[int, float]] = {
        "fastinit_s": {},
        "stock_s": {},
        "own_bytes": {},
        "metadata_bytes": {},
    }
    for row in data["rows"]:
        n = int(row["world_size"])
        same, stock = row.get("same_plan"), row.get("stock")
        if isinstance(same, dict) and "seconds" in same:
            out["fastinit_s"][n] = same["seconds"]
            out["own_bytes"][n] = same["own_bytes"]
        if isinstance(stock, dict) and "seconds" in stock:
            out["stock_s"][n] = stock["seconds"]
            out["metadata_bytes"][n] = stock["metadata_bytes"]
    return out


def recover_rows(
    ttfb_rows: Sequence[dict[str, Any]],
    resume: dict[str, dict[int, float]],
    *,
    read_gbps: float,
    local_world_size: int,
    ranks: Sequence[int] = (1024, 4096),
) -> list[dict[str, Any]]:
    """Time to recover = the projected restart (new hosts) + the resume, per mode and N.

    resume = floor + the measured per-rank load work: the floor is the checkpoint bytes per host
    (the measured rank's own bytes × ranks per host) over ``read_gbps``; fastinit's work is
    ``make resume-scale``'s same-plan load (it also read its data, from the page cache: counted
    twice, so conservative); stock-best's is DCP's ``.metadata`` read + load planning (no plan
    gather, no data path: a lower bound) plus the ``.metadata`` itself read once per host.
    """
    restart = {
        (r["mode"], r["ranks"]): r["ttfb_s"] for r in ttfb_rows if r["scenario"] == "new-hosts"
    }
    out = []
    for n in ranks:
        if not resume["own_bytes"]:
            break
        per_host = _at(resume["own_bytes"], n) * local_world_size
        floor = per_host / (read_gbps * 1e9)
        for mode, work_key in (("stock-best", "stock_s"), ("fastinit", "fastinit_s")):
            if (mode, n) not in restart or not resume[work_key]:
                continue
            work = _at(resume[work_key], n)
            extra = 0.0
            if mode == "stock-best":
                extra = _at(resume["metadata_bytes"], n) / (read_gbps * 1e9)
            resume_s = floor + work + extra
            total = restart[(mode, n)] + resume_s
            out.append(
                {
                    "mode": mode,
                    "ranks": n,
                    "restart_s": restart[(mode, n)],
                    "bytes_per_host": per_host,
                    "floor_s": floor,
                    "load_work_s": work,
                    "metadata_read_s": extra,
                    "resume_s": resume_s,
                    "recover_s": total,
                    "beyond_floor_s": total - floor,
                    "measured": n in resume[work_key],
                }
            )
    return out


def format_recover(p: dict[str, Any]) -> str:
    """Time to recover at scale: restart + resume, beside the bytes-over-bandwidth floor."""
    rows = p.get("recover_rows") or []
    if not rows:
        return ""
    lines = [
        f"## Time to recover at scale, projected ({p['model']} model)\n",
        "Time to recover = the restart on new hosts projected above + the resume: the floor "
        f"(checkpoint bytes per host over {p['read_gbps']:g} GB/s, the stated read bandwidth; "
        f"bytes per host = the measured rank's own bytes × {p['local_world_size']} ranks) + one "
        f"rank's load work measured by `make resume-scale` ({p.get('resume_json')}; fastinit: "
        "its same-plan `fastinit.checkpoint.load`, which also read its data; stock-best: DCP's "
        "`.metadata` read and load planning, a lower bound, plus the `.metadata` read once per "
        "host). A value past the measured world sizes is a power-law fit.\n",
        "| mode | ranks | restart s | bytes per host | floor s | load work s "
        "| .metadata read s | resume s | **time to recover s** | beyond the floor s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['ranks']} | {r['restart_s']:.1f} | {r['bytes_per_host']:,.0f} "
            f"| {r['floor_s']:.3f} | {r['load_work_s']:.2f}{'' if r['measured'] else ' (fit)'} "
            f"| {r['metadata_read_s']:.2f} | {r['resume_s']:.2f} | **{r['recover_s']:.1f}** "
            f"| {r['beyond_floor_s']:.1f} |"
        )
    by = {(r["mode"], r["ranks"]): r for r in rows}
    goal = by.get(("fastinit", 4096))
    best = by.get(("stock-best", 4096))
    if goal is not None:
        lines.append(
            f"\nfastinit's restart + resume at 4,096 ranks: {goal['beyond_floor_s']:.1f} s beyond "
            f"the {goal['floor_s']:.3f} s floor (goal: under 20 s: "
            f"{'met' if goal['beyond_floor_s'] < 20 else 'not met'})"
            + (f"; stock-best {best['beyond_floor_s']:.1f} s." if best else ".")
        )
    return "\n".join(lines) + "\n"


@dataclasses.dataclass(kw_only=True, slots=True)
class ProjectionConfig:
    """What is measured and projected."""

    summary: str = "bench-out/summary.json"
    """The benchmark's summary (the per-rank op counts)."""
    out: str = "bench-out"
    """Where projection.json/.md/.png go."""
    ranks: tuple[int, ...] = RANKS
    """World sizes projected."""
    fake_ranks: tuple[int, ...] = (64, 256, 1024, 4096)
    """World sizes of the fake-backend measurement."""
    planner_ranks_stock: tuple[int, ...] = (2, 4, 8)
    """World sizes the stock planner is timed at (it gets slow)."""
    planner_ranks_fast: tuple[int, ...] = (2, 8, 32, 128)
    """World sizes FastPlanner is timed at."""
    model: str | None = None
    """Model whose traces are projected (default: the largest in the summary)."""
    fabric: str = "ib"
    """A key of :data:`FABRICS`."""
    remeasure: bool = False
    """Measure again even when ``projection-measurements.json`` matches."""
    scale_json: str | None = None
    """``make scale``'s ``scale.json`` (per-rank local setup on the fake backend, stock and
    fastinit); None: fastinit's own fake-backend measurement here, for every mode."""
    resume_json: str | None = None
    """``make resume-scale``'s ``resume-scale.json`` (one rank's checkpoint load, fastinit and
    stock DCP); None: no time to recover in the report."""
    read_gbps: float = DEFAULT_READ_GBPS
    """Checkpoint read bandwidth per host, GB/s (the floor of any resume)."""
    local_world_size: int = 8
    """Ranks per host (bytes per host = the measured rank's bytes × this)."""


def measurements(model: str, config: ProjectionConfig, *, fake: bool) -> dict[str, Any]:
    """What the projection measures on this machine for ``model`` (store round trip, plan sizes,
    planning times, fastinit's local setup on the fake backend), each in a fresh process. Kept in
    ``<out>/projection-measurements.json`` and reused when model and world sizes match
    (``--remeasure`` measures again)."""
    path = os.path.join(config.out, "projection-measurements.json")
    key = {
        "model": model,
        "ranks": sorted({*config.ranks, *TTFB_RANKS}),
        "planner_ranks_stock": list(config.planner_ranks_stock),
        "planner_ranks_fast": list(config.planner_ranks_fast),
        "fake_ranks": list(config.fake_ranks) if fake else [],
    }
    if not config.remeasure and os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
        if kept.get("key") == key:
            kept["sizes"] = {int(n): v for n, v in kept["sizes"].items()}
            kept["planning"] = {
                k: {int(n): t for n, t in v.items()} for k, v in kept["planning"].items()
            }
            return kept
    planning: dict[str, dict[int, float]] = {"stock": {}, "fastinit": {}}
    for n in config.planner_ranks_stock:
        planning["stock"][n] = _in_subprocess("measure_planning", model, n, "stock")
    for n in config.planner_ranks_fast:
        planning["fastinit"][n] = _in_subprocess("measure_planning", model, n, "fastinit")
    out = {
        "key": key,
        "store_op_s": measure_store_op_s(),
        "sizes": {n: _in_subprocess("plan_sizes", model, n) for n in key["ranks"]},
        "planning": planning,
        "fake": [_in_subprocess("fake_rank_setup", model, n) for n in key["fake_ranks"]],
    }
    os.makedirs(config.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return out


def project(config: ProjectionConfig) -> dict[str, Any]:
    """Measure what must be measured and project; returns everything (also written as JSON)."""
    with open(config.summary) as f:
        summary = json.load(f)
    results = summary["results"]
    order = ["tiny", "small", "medium", "large"]
    model = config.model or max(results, key=lambda m: order.index(m) if m in order else -1)
    scenario = "cold" if "cold" in results[model] else next(iter(results[model]))
    stock_ops = results[model][scenario]["stock"]["setup_by_op"]
    fast_ops = results[model][scenario]["fastinit"]["setup_by_op"]
    fabric = FABRICS[config.fabric]
    scale = read_scale_json(config.scale_json) if config.scale_json else None
    meas = measurements(model, config, fake=scale is None or "fastinit" not in scale)
    store_op_s = meas["store_op_s"]
    sizes = meas["sizes"]
    planning = meas["planning"]
    fits = {k: fit_power(list(v), list(v.values())) for k, v in planning.items()}
    if scale is not None and "fastinit" in scale:
        fake = [
            {"n": n, "setup_s": t, "decode_s": float("nan")}
            for n, t in sorted(scale["fastinit"].items())
        ]
    else:
        fake = meas["fake"]
    fake_fit = fit_power([r["n"] for r in fake], [r["setup_s"] for r in fake])
    local_fits = {"fastinit": fake_fit, "stock": fake_fit}
    local_source = "fastinit's fake-backend measurement here (for stock a lower bound)"
    if scale is not None:
        for mode, points in scale.items():
            local_fits[mode] = fit_power(list(points), list(points.values()))
        local_source = f"{config.scale_json} (make scale)"
    ttfb_rows = []
    for case in ("cold", "new-hosts"):
        if case not in results[model]:
            continue
        twrw = results[model][case]["stock"]["setup"]["new_groups"] > 0
        for mode in _TTFB_MODES:
            measured = results[model][case].get(mode)
            if measured is None:
                continue
            plans = mode == "stock" or case == "cold"
            fit_key = "fastinit" if mode == "fastinit" else "stock"
            local_key = "fastinit" if mode == "fastinit" else "stock"
            for n in TTFB_RANKS:
                c, k = local_fits[local_key]
                parts = ttfb_components(
                    measured,
                    mode=mode,
                    scenario=case,
                    n=n,
                    fabric=fabric,
                    store_op_s=store_op_s,
                    plan_fit=fits[fit_key] if plans else None,
                    plan_bytes=sizes[n]["codec" if mode == "fastinit" else "pickle"]
                    if plans
                    else None,
                    local_s=c * n**k,
                    groups=twrw,
                )
                ttfb_rows.append(
                    {
                        "scenario": case,
                        "mode": mode,
                        "ranks": n,
                        **parts,
                        "measured_ttfb_s": measured["ttfb_s"],
                    }
                )

    rows = []
    for n in config.ranks:
        # Stock sends the pickled plan in its second broadcast_object_list message; fastinit
        # sends its encoding once. Other broadcasts keep their measured size.
        stock_bytes = _scaled_broadcast(stock_ops, sizes[n]["pickle"])
        fast_bytes = _scaled_broadcast(fast_ops, sizes[n]["codec"])
        comm_s = ops_time(stock_ops, n, fabric, stock_bytes)
        comm_f = ops_time(fast_ops, n, fabric, fast_bytes)
        grp_s, groups_s = group_creation_time(n, 8, "stock", fabric, store_op_s)
        grp_f, groups_f = group_creation_time(n, 8, "fastinit", fabric, store_op_s)
        plan_s = fits["stock"][0] * n ** fits["stock"][1]
        plan_f = fits["fastinit"][0] * n ** fits["fastinit"][1]
        local_f = fake_fit[0] * n ** fake_fit[1]
        rows.append(
            {
                "ranks": n,
                "stock_comm_s": comm_s,
                "fastinit_comm_s": comm_f,
                "stock_groups_s": grp_s,
                "fastinit_groups_s": grp_f,
                "stock_groups": groups_s,
                "fastinit_groups": groups_f,
                "stock_plan_s": plan_s,
                "fastinit_plan_s": plan_f,
                "fastinit_local_s": local_f,
                "plan_pickle_bytes": sizes[n]["pickle"],
                "plan_codec_bytes": sizes[n]["codec"],
            }
        )
    out = {
        "model": model,
        "scenario": scenario,
        "fabric": dataclasses.asdict(fabric),
        "store_op_s": store_op_s,
        "stock_ops": stock_ops,
        "fastinit_ops": fast_ops,
        "planning_measured_s": {k: {str(n): t for n, t in v.items()} for k, v in planning.items()},
        "planning_fit": {k: {"c": c, "k": k_} for k, (c, k_) in fits.items()},
        "fake_backend": fake,
        "fake_fit": {"c": fake_fit[0], "k": fake_fit[1]},
        "local_fits": {m: {"c": c, "k": k} for m, (c, k) in local_fits.items()},
        "local_source": local_source,
        "nproc": summary["config"]["nproc"],
        "rows": rows,
        "ttfb_rows": ttfb_rows,
    }
    if config.resume_json:
        out["resume_json"] = config.resume_json
        out["read_gbps"] = config.read_gbps
        out["local_world_size"] = config.local_world_size
        out["recover_rows"] = recover_rows(
            ttfb_rows,
            read_resume_json(config.resume_json),
            read_gbps=config.read_gbps,
            local_world_size=config.local_world_size,
        )
    os.makedirs(config.out, exist_ok=True)
    with open(os.path.join(config.out, "projection.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(config.out, "projection.md"), "w") as f:
        f.write(format_ttfb_projection(out) + "\n" + format_recover(out) + format_projection(out))
    plot_projection(out, os.path.join(config.out, "projection.png"))
    return out


def _scaled_broadcast(by_op: dict[str, dict[str, int]], plan_bytes: int) -> dict[str, float]:
    """Mean broadcast bytes with the largest broadcast (the plan) resized to ``plan_bytes``."""
    rec = by_op.get("broadcast_")
    if not rec or not rec["count"]:
        return {}
    # The plan message dominates the broadcast bytes; keep the others (sizes, flags) as measured.
    measured = rec["bytes"] / rec["count"]
    return {"broadcast_": max(measured, (rec["bytes"] - measured + plan_bytes) / rec["count"])}


def format_ttfb_projection(p: dict[str, Any]) -> str:
    """Time to first batch at scale, projected, beside the measured single-host figure."""
    rows = p.get("ttfb_rows") or []
    if not rows:
        return ""
    lines = [
        f"## Time to first batch at scale, projected ({p['model']} model)\n",
        f"Measured on this host at {p.get('nproc', '?')} ranks, projected with the components "
        "of `benchmarks/ttfb/projection.py` (fabric "
        f"{p['fabric']['name']}; local work per rank from {p.get('local_source', '?')}; planning "
        "only where the mode plans: stock always, stock-best and fastinit when cold). Not "
        "projected: the scheduler, container start and checkpoint load, the same for every mode. "
        "*projected s* counts process-group creation only if the measured plan created groups "
        "(table_row_wise / grid_shard tables); the last column adds it for such a plan.\n",
        "| scenario | mode | ranks | measured here s | per-host fixed s | rendezvous s "
        "| planning s | collectives s | groups s (TW-RW plan) | local s | **projected s** "
        "| with a TW-RW plan s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['mode']} | {r['ranks']} | {r['measured_ttfb_s']:.1f} "
            f"| {r['single_host_fixed_s']:.1f} | {r['rendezvous_s']:.2f} | {r['planning_s']:.1f} "
            f"| {r['collectives_s']:.2f} | {r['groups_s']:.2f} | {r['local_s']:.2f} "
            f"| **{r['ttfb_s']:.1f}** | {r['ttfb_twrw_s']:.1f} |"
        )
    by = {(r["scenario"], r["mode"], r["ranks"]): r["ttfb_s"] for r in rows}
    goal = by.get(("new-hosts", "fastinit", 4096))
    best = by.get(("new-hosts", "stock-best", 4096))
    if goal is not None:
        lines.append(
            f"\nfastinit restarting on new hosts at 4,096 ranks: {goal:.1f} s projected "
            f"(goal: under 20 s: {'met' if goal < 20 else 'not met'})"
            + (f"; stock-best {best:.1f} s ({goal / best:.2f}×)." if best else ".")
        )
    return "\n".join(lines) + "\n"


def format_projection(p: dict[str, Any]) -> str:
    """The projection as Markdown."""
    fab = p["fabric"]
    ops = ", ".join(f"{k}×{v['count']}" for k, v in sorted(p["stock_ops"].items()))
    fops = ", ".join(f"{k}×{v['count']}" for k, v in sorted(p["fastinit_ops"].items()))
    lines = [
        f"## Projection to scale ({p['model']} model, {p['scenario']} traces)\n",
        f"Per-rank start-up ops measured (before the first step): stock {ops}; fastinit {fops}.",
        f"Fabric: {fab['name']}: α = {fab['alpha_s'] * 1e6:.0f} µs, "
        f"β = 1/{1 / fab['beta_s_per_byte'] / 1e9:.1f} GB/s, per-call overhead "
        f"{fab['op_overhead_s'] * 1e6:.0f} µs. {fab['source']} Store operation "
        f"{p['store_op_s'] * 1e6:.0f} µs (TCPStore add round trip measured here). Algorithms: "
        "Thakur, Rabenseifner & Gropp 2005 (binomial broadcast, ring all_gather/all_reduce, "
        "pairwise all_to_all, dissemination barrier).",
        "Group creation: a plan with table_row_wise/grid tables, 8 ranks per host (stock: every "
        "intra/cross-host group on every rank, each a world store barrier; fastinit: 2 member-only "
        "groups). Planning: power law fitted to timings here (stock "
        + ", ".join(f"{n}: {t:.2f} s" for n, t in p["planning_measured_s"]["stock"].items())
        + f" → k = {p['planning_fit']['stock']['k']:.2f}; FastPlanner "
        + ", ".join(f"{n}: {t:.2f} s" for n, t in p["planning_measured_s"]["fastinit"].items())
        + f" → k = {p['planning_fit']['fastinit']['k']:.2f}); a plan-cache hit removes it. "
        "fastinit local work: `fastinit.setup` as the last rank of N on the fake backend ("
        + ", ".join(
            f"{r['n']}: {r['setup_s']:.2f} s"
            + ("" if r["decode_s"] != r["decode_s"] else f" (decode {r['decode_s'] * 1e3:.0f} ms)")
            for r in p["fake_backend"]
        )
        + f" → k = {p['fake_fit']['k']:.2f}).\n",
        "| ranks | stock comm s | fastinit comm s | stock groups (s) | fastinit groups (s) "
        "| stock planning s | FastPlanner s | fastinit local setup s | plan bytes pickle / codec |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        lines.append(
            f"| {r['ranks']} | {r['stock_comm_s']:.3f} | {r['fastinit_comm_s']:.4f} "
            f"| {r['stock_groups']} ({r['stock_groups_s']:.2f}) "
            f"| {r['fastinit_groups']} ({r['fastinit_groups_s']:.4f}) "
            f"| {r['stock_plan_s']:.1f} | {r['fastinit_plan_s']:.2f} | {r['fastinit_local_s']:.2f} "
            f"| {r['plan_pickle_bytes']} / {r['plan_codec_bytes']} |"
        )
    return "\n".join(lines) + "\n"


def plot_projection(p: dict[str, Any], path: str) -> None:
    """Log-log plot of the projected costs against ranks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["ranks"] for r in p["rows"]]
    fig, ax = plt.subplots(figsize=(8, 5))
    series = [
        ("stock_comm_s", "stock: start-up collectives", "C0", "-"),
        ("fastinit_comm_s", "fastinit: start-up collectives", "C0", "--"),
        ("stock_groups_s", "stock: group creation (TWRW/grid plan)", "C1", "-"),
        ("fastinit_groups_s", "fastinit: group creation", "C1", "--"),
        ("stock_plan_s", "stock: planning (fit)", "C2", "-"),
        ("fastinit_plan_s", "FastPlanner (fit; 0 on a cache hit)", "C2", "--"),
        ("fastinit_local_s", "fastinit: local setup per rank (fake backend fit)", "C3", "--"),
    ]
    for key, label, color, style in series:
        ax.plot(ranks, [max(r[key], 1e-6) for r in p["rows"]], style, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks")
    ax.set_ylabel("seconds per start-up")
    ax.set_title(f"Projected start-up costs, {p['model']} model, {p['fabric']['name']}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", default="bench-out/summary.json")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--model", default=None)
    parser.add_argument("--fabric", choices=sorted(FABRICS), default="ib")
    parser.add_argument("--fake-ranks", default="64,256,1024,4096")
    parser.add_argument(
        "--scale-json", default=None, help="make scale's scale.json (per-rank local setup)"
    )
    parser.add_argument(
        "--resume-json",
        default=None,
        help="make resume-scale's resume-scale.json (time to recover)",
    )
    parser.add_argument("--read-gbps", type=float, default=DEFAULT_READ_GBPS)
    parser.add_argument("--remeasure", action="store_true", help="ignore kept measurements")
    args = parser.parse_args(argv)
    config = ProjectionConfig(
        summary=args.summary,
        out=args.out,
        model=args.model,
        fabric=args.fabric,
        fake_ranks=tuple(int(x) for x in args.fake_ranks.split(",")),
        scale_json=args.scale_json,
        resume_json=args.resume_json,
        read_gbps=args.read_gbps,
        remeasure=args.remeasure,
    )
    result = project(config)
    print(format_ttfb_projection(result))
    print(format_recover(result))
    print(format_projection(result))
    report = os.path.join(config.out, "report.md")
    if os.path.exists(report):
        with open(report) as f:
            text = f.read()
        for marker in (
            "\n## Time to first batch at scale",
            "\n## Time to recover at scale",
            "\n## Projection to scale",
        ):
            text = text.split(marker)[0]
        text = (
            text.rstrip("\n")
            + "\n\n"
            + format_ttfb_projection(result)
            + "\n"
            + format_recover(result)
            + format_projection(result)
        )
        with open(report, "w") as f:
            f.write(text)
    return result


if __name__ == "__main__":
    main()
