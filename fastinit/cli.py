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
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastinit import __version__
from fastinit.errors import CliError, CompatibilityError, PlanCacheError

__all__ = [
    "main",
    "load_factory",
    "EXIT_OK",
    "EXIT_OUTPUT_DIFFERS",
    "EXIT_BAD_INPUT",
    "EXIT_NOT_VERIFIED",
    "EXIT_INCOMPATIBLE",
]

logger = logging.getLogger("fastinit.cli")
_T = TypeVar("_T")

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


# -- plan ---------------------------------------------------------------------------------------


def _cmd_plan(args: argparse.Namespace) -> int:
    from fastinit import compat, knobs

    compat.require_stack()  # before the user's module imports torchrec (and fbgemm)
    import torch

    from fastinit.plan.summary import format_summary
    from fastinit.startup import plan_ahead

    cache_dir = args.cache or knobs.get_plan_cache()
    if not cache_dir:
        raise CliError("no plan cache: pass --cache DIR or set FASTINIT_PLAN_CACHE")
    local_world_size = args.local_world_size or args.world_size
    if args.world_size < 1 or local_world_size < 1 or args.world_size % local_world_size:
        raise CliError(
            f"--world-size ({args.world_size}) must be a positive multiple of "
            f"--local-world-size ({local_world_size})"
        )
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
    try:
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
    except PlanCacheError as e:
        raise CliError(str(e)) from e
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
    parser = argparse.ArgumentParser(
        prog="fastinit",
        description="Plan a TorchRec job's sharding ahead of time; picture its start-up.",
    )
    parser.add_argument("--version", action="version", version=f"fastinit {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log lines (-vv: debug)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _command(
        sub,
        "plan",
        _cmd_plan,
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
    _json_flag(p, "the summary")

    r = _command(
        sub,
        "report",
        _cmd_report,
        help="timeline, per-stage table and Perfetto trace of a job's start-up",
        description="Turn the trace-rank<N>.jsonl files a job wrote with FASTINIT_TRACE_DIR into "
        "timeline.png, stages.md and trace.json (open it in ui.perfetto.dev).",
    )
    r.add_argument("trace_dir", help="the job's FASTINIT_TRACE_DIR")
    r.add_argument("-o", "--out", help="output directory (default: TRACE_DIR/report)")
    r.add_argument("--title", help="title of the picture and the table")

    c = sub.add_parser(
        "checkpoint", help="checkpoint tools: the interval, consolidate for DCP, verify"
    )
    csub = c.add_subparsers(dest="checkpoint_command", required=True, metavar="SUBCOMMAND")
    ci = _command(
        csub,
        "interval",
        _cmd_checkpoint_interval,
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
    _json_flag(ci, "the result")
    cc = _command(
        csub,
        "consolidate",
        _cmd_consolidate,
        help="write DCP's global .metadata so stock torch.distributed.checkpoint.load reads it",
        description="Write DIR/.metadata (DCP's global metadata) from the fastinit index and "
        "every rank's metadata. CPU only, no process group; can run while training goes on.",
    )
    cc.add_argument("dir", help="a committed fastinit checkpoint directory")
    cv = _command(
        csub,
        "verify",
        _cmd_verify,
        help="read every file of a checkpoint and check it against the digests the commit proves",
        description="Read every file of a committed fastinit checkpoint (every rank's part) and "
        "check its size and digest against its manifest, each manifest against the commit "
        "marker. Exit status 0 when every byte is proven; an error names the first file that "
        "is missing, of another size or of another digest.",
    )
    cv.add_argument("dir", help="a committed fastinit checkpoint directory")

    pub = _command(
        sub,
        "publish",
        _cmd_publish,
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
    _json_flag(pub, "the report")
    return parser


def _command(
    sub: Any, name: str, run: Callable[[argparse.Namespace], int], *, help: str, description: str
) -> argparse.ArgumentParser:
    """A (sub)command ``name`` of ``sub`` (an ``add_subparsers`` result) that ``run`` carries out."""
    command: argparse.ArgumentParser = sub.add_parser(name, help=help, description=description)
    command.set_defaults(run=run)
    return command


def _json_flag(command: argparse.ArgumentParser, what: str) -> None:
    command.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def _cmd_consolidate(args: argparse.Namespace) -> int:
    from fastinit.checkpoint import consolidate

    print(_on_checkpoint(consolidate, args.dir))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from fastinit.checkpoint import verify

    got = _on_checkpoint(verify, args.dir)
    print(
        f"{args.dir}: save {got['save_id']}, {got['files']} files, {got['bytes']:,} bytes verified"
    )
    return 0


def _on_checkpoint(tool: Callable[[str], _T], directory: str) -> _T:
    """``tool(directory)``, a checkpoint's error as the command's (its message alone)."""
    from fastinit.checkpoint import CheckpointError

    try:
        return tool(directory)
    except CheckpointError as e:
        raise CliError(str(e)) from None


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
