"""The ``fastinit`` command: plan ahead of the job, and picture a job's start-up.

::

    fastinit plan my_trainer:build_model --world-size 2 --local-world-size 2 --cache plans/
    fastinit report traces/ --out traces/report
    fastinit checkpoint interval --blocking-s 2.5 --mtbf-h 7.9
    fastinit checkpoint consolidate /ckpt/step-1000
    fastinit publish ckpt/step-1000 --out serving/step-1000 --model my_trainer:build_model

``fastinit plan`` builds the model from a factory, runs the planner the job would run (fastinit's
``FastPlanner`` for the job's topology, or the planner a factory returns), and stores the plan in
the plan cache under the key ``fastinit.setup`` computes in the job, so the job finds it and nobody
plans at start-up. Beside the entry goes a description of what it was planned for, so that a job
whose inputs differ logs which one (the key is never bent: a different input is a cache miss).

``fastinit report`` turns the ``trace-rank<N>.jsonl`` files a job wrote with ``FASTINIT_TRACE_DIR``
into a timeline picture, a per-stage table and a Perfetto trace (:func:`fastinit.report.render`).

``fastinit checkpoint interval`` gives the checkpoint interval minimising the work failures lose
plus the time checkpoints block the loop (:mod:`fastinit.checkpoint.interval`).

``fastinit checkpoint consolidate DIR`` writes DCP's global ``.metadata`` for a fastinit
checkpoint (:func:`fastinit.checkpoint.consolidate`), after which stock ``dcp.load`` reads it.

``fastinit publish`` loads a checkpoint of any world size into the unsharded model on a CPU host,
writes its state_dict and its dense part (``torch.export``) and verifies them against the batch
the trainer recorded (:mod:`fastinit.checkpoint.publishing`).

The command configures logging for the ``fastinit`` logger only; nothing here touches the root
logger, so importing this module from a trainer changes nothing.

Exit statuses (every subcommand): 0 done; 1 ``publish``: the recorded batch gave another output
(the files are written, for inspection); 2 bad input (a one-line message); 3 ``publish``:
published, but nothing to verify against (the trainer recorded no batch: the message says what
was not checked); 4 the installed torch, fbgemm and TorchRec cannot run fastinit (an unsupported
torch/fbgemm pair, or a TorchRec without what fastinit relies on: a message naming the versions
and the supported stacks, no traceback).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import logging
import os
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastinit.errors import CliError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingPlanner

__all__ = [
    "main",
    "plan_ahead",
    "PlanSummary",
    "summarize_plan",
    "table_layouts",
    "load_factory",
    "EXIT_OK",
    "EXIT_OUTPUT_DIFFERS",
    "EXIT_BAD_INPUT",
    "EXIT_NOT_VERIFIED",
    "EXIT_INCOMPATIBLE",
]

logger = logging.getLogger("fastinit.cli")

#: Exit statuses (the module docstring; docs/usage.md, docs/publish.md).
EXIT_OK = 0
EXIT_OUTPUT_DIFFERS = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_VERIFIED = 3
EXIT_INCOMPATIBLE = 4


# -- factories ----------------------------------------------------------------------------------


def load_factory(ref: str) -> Callable[..., Any]:
    """The callable named by ``module:function`` or ``path/to/file.py:function``.

    Modules are imported with the current directory first on ``sys.path`` (as ``python -m``
    does), so a trainer's own module can be named from its directory.

    Raises:
        CliError: the reference is malformed, or names nothing callable.
    """
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise CliError(f"expected module:function or file.py:function, got {ref!r}")
    if target.endswith(".py") or os.sep in target:
        path = pathlib.Path(target).resolve()
        if not path.is_file():
            raise CliError(f"{ref!r}: no such file {path}")
        if str(path.parent) not in sys.path:  # its sibling modules import, as under `python file`
            sys.path.insert(0, str(path.parent))
        name = f"_fastinit_factory_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise CliError(f"{ref!r}: cannot load {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name and target.startswith(e.name):
                raise CliError(f"{ref!r}: no module named {e.name!r} (from {cwd})") from e
            raise
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"{ref!r}: {target} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CliError(f"{ref!r} is not callable")
    return obj


def _parse_args(pairs: Sequence[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as keyword arguments; values are Python literals, else strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.isidentifier():
            raise CliError(f"--arg takes KEY=VALUE, got {pair!r}")
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            out[name] = text
    return out


def _call_with(factory: Callable[..., Any], available: dict[str, Any]) -> Any:
    """Call ``factory`` with those of ``available`` its signature names (all with ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return factory(**available)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return factory(**available)
    return factory(**{k: v for k, v in available.items() if k in params})


def _topology(world_size: int, local_world_size: int, compute_device: str) -> Any:
    from torchrec.distributed.planner import Topology

    return Topology(
        world_size=world_size, local_world_size=local_world_size, compute_device=compute_device
    )


# -- summary ------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True, slots=True)
class PlanSummary:
    """What ``fastinit plan`` planned and where it put it."""

    key: str
    """The plan-cache key, hex."""
    entry: str
    """The cache entry written (or found identical)."""
    inputs: str | None
    """The description written beside it (None if it could not be written)."""
    status: str
    """"written", "unchanged" (an identical entry was there) or "replaced"."""
    planner: str
    """The planner's class."""
    seconds: float
    """Planning time."""
    world_size: int
    """Ranks planned for."""
    local_world_size: int
    """Ranks per host planned for."""
    device: str
    """Compute device type planned for."""
    tables_by_type: dict[str, int]
    """Tables per sharding type."""
    tables_by_kernel: dict[str, int]
    """Tables per compute kernel."""
    rank_shards: list[int]
    """Shards held by each rank (a data-parallel table counts once per rank)."""
    rank_bytes: list[int]
    """Bytes of embedding weights held by each rank."""
    tables: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Each table's layout (:func:`table_layouts`): ``module``, ``table``, ``sharding_type``,
    ``compute_kernel``, ``ranks`` and ``shards`` (``[rank, offsets, sizes]`` each; None for a
    data-parallel table, and for every table of a plan with more than
    :data:`MAX_LISTED_SHARDS` shards)."""


def _shardable(module: nn.Module, sharders: Sequence[Any], path: str) -> dict[str, Any]:
    sub = module.get_submodule(path)
    for sharder in sharders:
        if type(sub) is sharder.module_type or isinstance(sub, sharder.module_type):
            return dict(sharder.shardable_parameters(sub))
    return {}


def summarize_plan(
    plan: ShardingPlan, module: nn.Module, sharders: Sequence[Any], world_size: int
) -> tuple[dict[str, int], dict[str, int], list[int], list[int]]:
    """Tables per sharding type and per kernel, then shards and weight bytes per rank."""
    by_type: dict[str, int] = {}
    by_kernel: dict[str, int] = {}
    shards = [0] * world_size
    nbytes = [0] * world_size
    for path, module_plan in plan.plan.items():
        params = _shardable(module, sharders, path)
        for table, ps in module_plan.items():
            by_type[ps.sharding_type] = by_type.get(ps.sharding_type, 0) + 1
            by_kernel[ps.compute_kernel] = by_kernel.get(ps.compute_kernel, 0) + 1
            param = params.get(table)
            item = param.element_size() if param is not None else 0
            if ps.sharding_spec is None:  # data parallel: the whole table on each of its ranks
                numel = param.numel() if param is not None else 0
                for rank in ps.ranks or range(world_size):
                    shards[rank] += 1
                    nbytes[rank] += numel * item
                continue
            for shard in ps.sharding_spec.shards:
                rank = shard.placement.rank()
                numel = 1
                for n in shard.shard_sizes:
                    numel *= n
                shards[rank] += 1
                nbytes[rank] += numel * item
    return by_type, by_kernel, shards, nbytes


#: ``fastinit plan --json`` lists every shard's offsets and sizes up to this many shards in all
#: (a row-wise table has one per rank: at thousands of ranks the list would be the plan again).
MAX_LISTED_SHARDS = 65_536


def table_layouts(plan: ShardingPlan, world_size: int) -> list[dict[str, Any]]:
    """Each table's layout in ``plan``, in the plan's order: module path, table, sharding type,
    compute kernel, the ranks holding it, and its shards (``[rank, offsets, sizes]``; None for a
    data-parallel table, or when the plan has more than :data:`MAX_LISTED_SHARDS` shards)."""
    total = sum(
        len(ps.sharding_spec.shards)
        for module_plan in plan.plan.values()
        for ps in module_plan.values()
        if ps.sharding_spec is not None
    )
    out = []
    for path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():
            spec = ps.sharding_spec
            shards = None
            if spec is not None and total <= MAX_LISTED_SHARDS:
                shards = [
                    [s.placement.rank(), list(s.shard_offsets), list(s.shard_sizes)]
                    for s in spec.shards
                ]
            if ps.ranks is not None:
                ranks = sorted(set(ps.ranks))
            elif spec is not None:
                ranks = sorted({s.placement.rank() for s in spec.shards})
            else:
                ranks = list(range(world_size))
            out.append(
                {
                    "module": path,
                    "table": table,
                    "sharding_type": ps.sharding_type,
                    "compute_kernel": ps.compute_kernel,
                    "ranks": ranks,
                    "shards": shards,
                }
            )
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def format_summary(s: PlanSummary) -> str:
    """The human-readable summary ``fastinit plan`` prints."""
    lines = [
        f"planned for {s.world_size} ranks ({s.local_world_size} per host) on {s.device} by "
        f"{s.planner} in {s.seconds:.2f} s",
        "",
        f"{'sharding type':<20} {'tables':>7}",
    ]
    lines += [f"{st:<20} {n:>7}" for st, n in sorted(s.tables_by_type.items())]
    lines.append(f"{'total':<20} {sum(s.tables_by_type.values()):>7}")
    lines += ["", f"{'compute kernel':<20} {'tables':>7}"]
    lines += [f"{k:<20} {n:>7}" for k, n in sorted(s.tables_by_kernel.items())]
    lines += ["", f"{'rank':<8} {'shards':>7} {'weights MiB':>12}"]
    ranks = list(range(s.world_size))
    if len(ranks) > 16:
        lines += [f"{r:<8} {s.rank_shards[r]:>7} {_mib(s.rank_bytes[r]):>12}" for r in ranks[:4]]
        lines.append(f"{'...':<8}")
        b = s.rank_bytes
        lines.append(
            f"min/median/max MiB: {_mib(min(b))} / {_mib(statistics.median(b))} / {_mib(max(b))}"
        )
    else:
        lines += [f"{r:<8} {s.rank_shards[r]:>7} {_mib(s.rank_bytes[r]):>12}" for r in ranks]
    lines += [
        "",
        f"cache key: {s.key}",
        f"cache entry ({s.status}): {s.entry}",
    ]
    if s.inputs:
        lines.append(f"planned-for inputs: {s.inputs}")
    cache_dir = os.path.dirname(s.entry) or "."
    lines.append(
        f"the job hits it with fastinit.setup(..., plan_cache={cache_dir!r}) (or "
        f"FASTINIT_PLAN_CACHE) on {s.world_size} ranks, {s.local_world_size} per host, {s.device}"
    )
    return "\n".join(lines)


# -- plan ---------------------------------------------------------------------------------------


def plan_ahead(
    module: nn.Module,
    cache_dir: str | os.PathLike[str],
    *,
    world_size: int,
    local_world_size: int,
    device: torch.device,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    planner: ShardingPlanner | None = None,
    force: bool = False,
) -> PlanSummary:
    """Plan ``module`` as ``fastinit.setup`` would in a job of that shape; store it in the cache.

    Args:
        module: the model, built as the job builds it (same factory, same device: "meta").
        cache_dir: the plan-cache directory the job will use (``plan_cache=`` or
            ``FASTINIT_PLAN_CACHE``).
        world_size: the job's ranks.
        local_world_size: the job's ranks per host.
        device: the job's compute device.
        sharders: the sharders the job passes to ``setup`` (default TorchRec's).
        planner: the planner the job passes to ``setup`` (default ``FastPlanner`` for the job's
            topology).
        force: replace an entry of the same key that holds a different plan.

    Returns:
        A :class:`PlanSummary`.

    Raises:
        CliError: the key cannot be cached, or an entry with a different plan is in the way.
    """
    from fastinit import compat
    from fastinit.plan.cache import PlanCache
    from fastinit.plan.codec import encode_plan
    from fastinit.plan.provenance import record_inputs
    from fastinit.plan.validate import validate_plan
    from fastinit.startup import plan_key

    compat.require("planner")
    compat.require("sharders")
    if world_size < 1 or local_world_size < 1 or world_size % local_world_size:
        raise CliError(
            f"--world-size ({world_size}) must be a positive multiple of --local-world-size "
            f"({local_world_size})"
        )
    key = plan_key(
        module,
        world_size=world_size,
        local_world_size=local_world_size,
        device=device,
        sharders=sharders,
        planner=planner,
    )
    if key.uncacheable is not None:
        raise CliError(f"this job's plan cannot be cached: {key.uncacheable}")
    cache = PlanCache(cache_dir)
    t0 = time.perf_counter()
    plan = key.planner.plan(module, list(key.sharders))
    seconds = time.perf_counter() - t0
    validate_plan(module, plan, list(key.sharders), world_size=world_size)
    existing = cache.get(key.fingerprint)
    status = "written"
    if existing is not None:
        if encode_plan(existing) == encode_plan(plan):
            status = "unchanged"
        elif not force:
            raise CliError(
                f"{cache.path(key.fingerprint)} holds a different plan for the same inputs "
                "(a nondeterministic planner?); pass --force to replace it"
            )
        else:
            status = "replaced"
    if status != "unchanged" and not cache.put(key.fingerprint, plan):
        raise CliError(f"cannot write the plan cache in {cache_dir} (see the warning above)")
    try:
        inputs: str | None = os.fspath(
            record_inputs(cache_dir, module, key, written_by="fastinit plan")
        )
    except OSError as e:
        logger.warning("cannot describe the entry's inputs beside it: %s", e)
        inputs = None
    by_type, by_kernel, shards, nbytes = summarize_plan(plan, module, key.sharders, world_size)
    return PlanSummary(
        key=key.fingerprint.hex(),
        entry=cache.path(key.fingerprint),
        inputs=inputs,
        status=status,
        planner=f"{type(key.planner).__module__}.{type(key.planner).__qualname__}",
        seconds=seconds,
        world_size=world_size,
        local_world_size=local_world_size,
        device=device.type,
        tables_by_type=by_type,
        tables_by_kernel=by_kernel,
        rank_shards=shards,
        rank_bytes=nbytes,
        tables=table_layouts(plan, world_size),
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from fastinit import compat, knobs

    compat.require_stack()  # before the user's module imports torchrec (and fbgemm)
    import torch

    cache_dir = args.cache or knobs.get_plan_cache()
    if not cache_dir:
        raise CliError("no plan cache: pass --cache DIR or set FASTINIT_PLAN_CACHE")
    local_world_size = args.local_world_size or args.world_size
    device = torch.device(args.device)
    module = load_factory(args.model)(**_parse_args(args.arg))
    if not isinstance(module, torch.nn.Module):
        raise CliError(f"{args.model} returned {type(module).__name__}, not a torch.nn.Module")
    shape = {
        "world_size": args.world_size,
        "local_world_size": local_world_size,
        "device": device,
        "compute_device": device.type,
    }
    sharders = None
    if args.sharders:
        sharders = list(_call_with(load_factory(args.sharders), dict(shape)))
    planner = None
    if args.planner:
        available = dict(shape, topology=_topology(args.world_size, local_world_size, device.type))
        planner = _call_with(load_factory(args.planner), available)
    summary = plan_ahead(
        module,
        cache_dir,
        world_size=args.world_size,
        local_world_size=local_world_size,
        device=device,
        sharders=sharders,
        planner=planner,
        force=args.force,
    )
    if args.json:
        print(json.dumps(dataclasses.asdict(summary), indent=1))
    else:
        print(format_summary(summary))
    return 0


# -- report -------------------------------------------------------------------------------------


def _cmd_report(args: argparse.Namespace) -> int:
    from fastinit.report import render

    trace_dir = pathlib.Path(args.trace_dir)
    if not trace_dir.is_dir():
        raise CliError(f"{trace_dir} is not a directory")
    out_dir = pathlib.Path(args.out) if args.out else trace_dir / "report"
    try:
        paths = render(trace_dir, out_dir, title=args.title)
    except FileNotFoundError as e:
        raise CliError(f"{e} (set FASTINIT_TRACE_DIR in the job to write them)") from e
    print(paths["stages"].read_text().rstrip())
    print()
    for name, path in paths.items():
        print(f"{name}: {path}")
    if "timeline" not in paths:
        print("timeline: not drawn (needs matplotlib: pip install 'fastinit[report]')")
    return EXIT_OK


# -- checkpoint -----------------------------------------------------------------------------------


#: What ``--blocking-s`` is, as ``fastinit checkpoint interval`` prints it.
BLOCKING_MEANS = (
    "  blocking = the seconds the training loop is held per checkpoint: the time save() takes "
    "to return\n  (SaveHandle.blocking_s) plus any time handle.wait() holds the loop where the "
    "loop calls it\n  (joining the background write, then the commit). Measure both in your "
    "loop (time.perf_counter()\n  around each call, on the slowest rank) and enter their sum; "
    "the background write itself is not blocking."
)


def _cmd_checkpoint_interval(args: argparse.Namespace) -> int:
    from fastinit.checkpoint.interval import choose_interval, format_choice

    try:
        choice = choose_interval(
            args.blocking_s, args.mtbf_h * 3600.0, loop_s=args.loop_s, step_s=args.step_s
        )
    except ValueError as e:
        raise CliError(str(e)) from e
    if args.json:
        out = dataclasses.asdict(choice)
        out.update(
            overhead_s=choice.overhead_s,
            overhead_pct=choice.overhead_pct,
            interval_steps=choice.interval_steps,
        )
        print(json.dumps(out, indent=1))
    else:
        print(format_choice(choice))
        print(BLOCKING_MEANS)
    return 0


def _cmd_publish(args: argparse.Namespace) -> int:
    from fastinit import compat

    compat.require_stack()  # before the user's module imports torchrec (and fbgemm)
    import torch

    from fastinit.checkpoint.publishing import PublishError, publish

    module = load_factory(args.model)(**_parse_args(args.arg))
    if not isinstance(module, torch.nn.Module):
        raise CliError(f"{args.model} returned {type(module).__name__}, not a torch.nn.Module")
    try:
        report = publish(
            args.checkpoint,
            args.out,
            module,
            batch_file=args.batch,
            export=not args.no_export,
        )
    except PublishError as e:
        raise CliError(str(e)) from e
    if args.json:
        print(json.dumps(dataclasses.asdict(report), indent=1))
    else:
        if report.verified is True:
            verdict = (
                "verified: the recorded batch gives the recorded output (max diff "
                f"{report.max_abs_diff:.2e})"
            )
        elif report.verified is False:
            verdict = (
                "NOT VERIFIED: the output differs from the recorded one (max diff "
                f"{report.max_abs_diff})"
            )
        else:
            verdict = f"not verified: {report.not_verified}"
        print(f"published {report.checkpoint} ({report.load}) to {report.out}")
        print(f"  {report.format}: {report.state_dict_file} ({report.tensors} tensors, "
              f"{report.bytes / 1e6:.1f} MB)")  # fmt: skip
        for name, path in report.exported.items():
            print(f"  torch.export {name}: {path}")
        for name, why in report.export_errors.items():
            print(f"  not exported {name}: {why}")
        print(f"  {verdict}")
    if report.verified is None:
        return EXIT_NOT_VERIFIED
    return EXIT_OK if report.verified else EXIT_OUTPUT_DIFFERS


# -- entry point --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``fastinit`` argument parser (``fastinit -h``)."""
    from fastinit import __version__

    parser = argparse.ArgumentParser(
        prog="fastinit",
        description="Plan a TorchRec job's sharding ahead of time; picture its start-up.",
    )
    parser.add_argument("--version", action="version", version=f"fastinit {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log lines (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "plan",
        help="plan offline into the plan cache, so the job's fastinit.setup does not plan",
        description="Build the model, plan it as fastinit.setup would for the given job shape, "
        "and store the plan in the plan cache under the key the job will look up. Prints the "
        "plan summary and the cache key.",
    )
    p.add_argument("model", help="model factory, module:function or file.py:function")
    p.add_argument("-a", "--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the model factory (a Python literal or a string); "
                   "repeatable")  # fmt: skip
    p.add_argument("-n", "--world-size", type=int, required=True, help="ranks in the job")
    p.add_argument("--local-world-size", "--nproc-per-node", type=int, default=None,
                   help="ranks per host (default: --world-size, one host)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="the job's compute device: cpu or cuda")
    p.add_argument("--planner", metavar="MODULE:FUNCTION",
                   help="planner factory, called with those of world_size, local_world_size, "
                   "device, compute_device, topology it names (default: fastinit's FastPlanner)")  # fmt: skip
    p.add_argument("--sharders", metavar="MODULE:FUNCTION",
                   help="factory of the sharders the job passes to setup (default: TorchRec's)")  # fmt: skip
    p.add_argument("--cache", help="plan-cache directory (default: $FASTINIT_PLAN_CACHE)")
    p.add_argument("--force", action="store_true",
                   help="replace an entry of the same key that holds a different plan")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(run=_cmd_plan)

    r = sub.add_parser(
        "report",
        help="timeline, per-stage table and Perfetto trace of a job's start-up",
        description="Turn the trace-rank<N>.jsonl files a job wrote with FASTINIT_TRACE_DIR into "
        "timeline.png, stages.md and trace.json (open it in ui.perfetto.dev).",
    )
    r.add_argument("trace_dir", help="the job's FASTINIT_TRACE_DIR")
    r.add_argument("-o", "--out", help="output directory (default: TRACE_DIR/report)")
    r.add_argument("--title", help="title of the picture and the table")
    r.set_defaults(run=_cmd_report)

    c = sub.add_parser(
        "checkpoint", help="checkpoint tools: the interval, consolidate for DCP, verify"
    )
    csub = c.add_subparsers(dest="checkpoint_command", required=True, metavar="SUBCOMMAND")
    ci = csub.add_parser(
        "interval",
        help="the checkpoint interval minimising unsaved work plus blocking (Young)",
        description="The interval minimising the work failures lose (failures x interval / 2) "
        "plus the time checkpoints block the loop (loop / interval x blocking): "
        "I* = sqrt(2 x blocking x MTBF), with the costs at I* and Daly's higher-order estimate. "
        "Blocking is every second the loop is held per checkpoint: the time save() takes to "
        "return plus any time handle.wait() holds the loop (its join of the background write "
        "and the commit); time both around the calls in the loop and enter the sum.",
    )
    ci.add_argument("--blocking-s", type=float, required=True,
                    help="seconds the training loop is held per checkpoint: save() until it "
                    "returns (SaveHandle.blocking_s) plus any time handle.wait() holds the loop; "
                    "measured on the slowest rank")  # fmt: skip
    ci.add_argument("--mtbf-h", type=float, required=True,
                    help="the job's mean time between failures, hours")  # fmt: skip
    ci.add_argument("--loop-s", type=float, default=86_400.0,
                    help="training-loop seconds to total the costs over (default: a day)")  # fmt: skip
    ci.add_argument("--step-s", type=float, default=None,
                    help="seconds per training step: the interval in steps too")  # fmt: skip
    ci.add_argument("--json", action="store_true", help="print the result as JSON")
    ci.set_defaults(run=_cmd_checkpoint_interval)
    cc = csub.add_parser(
        "consolidate",
        help="write DCP's global .metadata so stock torch.distributed.checkpoint.load reads it",
        description="Write DIR/.metadata (DCP's global metadata) from the fastinit index and "
        "every rank's metadata. CPU only, no process group; can run while training goes on.",
    )
    cc.add_argument("dir", help="a committed fastinit checkpoint directory")
    cc.set_defaults(run=_cmd_consolidate)
    cv = csub.add_parser(
        "verify",
        help="read every file of a checkpoint and check it against the digests the commit proves",
        description="Read every file of a committed fastinit checkpoint (every rank's part) and "
        "check its size and digest against its manifest, each manifest against the commit "
        "marker. Exit status 0 when every byte is proven; an error names the first file that "
        "is missing, of another size or of another digest.",
    )
    cv.add_argument("dir", help="a committed fastinit checkpoint directory")
    cv.set_defaults(run=_cmd_verify)

    pub = sub.add_parser(
        "publish",
        help="the unsharded model from a checkpoint, on a CPU host, verified",
        description="Load a checkpoint of any world size into the unsharded model (a world of "
        "one; the checkpoint is only read, so training may go on), write its state_dict "
        "(safetensors, else torch.save) and its dense part via torch.export to a fresh OUT, and "
        "verify that the batch the trainer recorded at save time gives the recorded output. "
        "Exit status 0 verified, 1 the output differs, 2 bad input, 3 published but nothing to "
        "verify against (no recorded batch), 4 an unsupported torch/fbgemm/TorchRec.",
    )
    pub.add_argument("checkpoint", help="the checkpoint directory")
    pub.add_argument("-o", "--out", required=True, help="output directory (new or empty)")
    pub.add_argument("--model", required=True, metavar="MODULE:FUNCTION",
                     help="factory of the unsharded model (module:function or file.py:function)")  # fmt: skip
    pub.add_argument("-a", "--arg", action="append", default=[], metavar="KEY=VALUE",
                     help="keyword argument for the model factory; repeatable")  # fmt: skip
    pub.add_argument("--batch", help="the recorded batch (default: CHECKPOINT/fastinit-verify.pt)")
    pub.add_argument("--no-export", action="store_true", help="skip torch.export")
    pub.add_argument("--json", action="store_true", help="print the report as JSON")
    pub.set_defaults(run=_cmd_publish)
    return parser


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from fastinit.checkpoint import CheckpointError, consolidate

    try:
        path = consolidate(args.dir)
    except CheckpointError as e:
        raise CliError(str(e)) from None
    print(path)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from fastinit.checkpoint import CheckpointError, verify

    try:
        got = verify(args.dir)
    except CheckpointError as e:
        raise CliError(str(e)) from None
    print(
        f"{args.dir}: save {got['save_id']}, {got['files']} files, {got['bytes']:,} bytes verified"
    )
    return 0


def _configure_logging(verbose: int) -> None:
    """Log fastinit's own lines to stderr; the root logger and other libraries are left alone."""
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    log = logging.getLogger("fastinit")
    if not any(getattr(h, "_fastinit_cli", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        handler._fastinit_cli = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fastinit`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    from fastinit.errors import CompatibilityError

    try:
        return int(args.run(args))
    except CliError as e:
        print(f"fastinit {args.command}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except CompatibilityError as e:
        print(f"fastinit {args.command}: {e}", file=sys.stderr)
        return EXIT_INCOMPATIBLE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
