"""What each part of fastinit gives: time to first batch, part by part, in one run.

    python -m benchmarks.parts --models small,medium --nproc 2 --repeats 3 --out parts-out
    python -m benchmarks.parts --models small --nproc 4 --repeats 3 --out parts-out-4

For each model, every variant of :data:`benchmarks.parts.report.VARIANTS` (stock, stock-best,
``fastinit.setup`` alone, + its plan cache — a trainer without ``torch.compile`` — then
stock-best and all of fastinit with the dense arch compiled) runs once cold, which leaves its
caches (untimed for the table), then ``--repeats`` restarts on new hosts (shared storage as the
cold run left it, host-local directories empty: :mod:`benchmarks.ttfb.scenarios`), the variants' order
rotating with the repeat so that drift in the machine's load favours none. The 1-minute load
average is recorded before each run. Each run is the benchmark trainer under torchrun
(:mod:`benchmarks.ttfb.launch`), analysed as ``make bench`` analyses it (:mod:`benchmarks.ttfb.analysis`).

With ``--measurements`` (``make projection``'s ``projection-measurements.json`` for the model)
and ``--scale-json`` (``make scale``'s), each variant's restart is also projected to 1,024 and
4,096 ranks (:func:`benchmarks.parts.report.project_parts`).

Writes ``OUT/parts.json`` and ``OUT/parts.md``; prints the tables. ``--render OUT/parts.json``
writes ``parts.md`` again from the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from benchmarks.parts.report import VARIANTS, Variant, format_parts, parts_rows, project_parts
from benchmarks.ttfb.analysis import analyse_run, summarize
from benchmarks.ttfb.launch import RunSpec, run_trainer
from benchmarks.ttfb.scenarios import Layout, prepare, snapshot_primed

__all__ = ["run_parts", "render", "main"]

#: The restart the table reports (a restart on other hosts, shared storage kept).
RESTART = "new-hosts"


def _load() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def _run(
    v: Variant, model: str, scenario: str, out: str, layout: Layout, args: argparse.Namespace
) -> dict[str, Any]:
    prepare(layout, scenario)
    load = _load()
    spec = RunSpec.in_layout(
        layout,
        data_root=args.out,
        mode=v.mode,
        model=model,
        cache=scenario,
        out=out,
        nproc=args.nproc,
        compile=v.compile,
        launcher="torchrun",
        timeout_s=args.timeout,
        trainer_args=v.trainer_args,
    )
    t = time.monotonic()
    result = analyse_run(run_trainer(spec))
    result["load_avg"] = load
    print(
        f"  {model:<7}{scenario:<10}{v.name:<17} first batch {result['ttfb_s']:6.1f} s "
        f"(load {load:.1f}; run {time.monotonic() - t:5.1f} s)",
        flush=True,
    )
    return result


def render(path: str) -> str:
    """``parts.md`` again from a ``parts.json`` (its runs and projection), written beside it."""
    with open(path) as f:
        result = json.load(f)
    nproc = result["config"]["nproc"]
    text = "\n".join(
        format_parts(
            parts_rows(got["restarts"]),
            got.get("projected") or [],
            title=f"{model} model, {nproc} ranks, restart on new hosts",
        )
        for model, got in result["models"].items()
    )
    with open(os.path.join(os.path.dirname(path), "parts.md"), "w") as f:
        f.write(text)
    return text


def _slim(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("ttfb_s", "stages_s", "setup", "load_avg")
    return {k: run[k] for k in keys}


def _local_fits(scale_json: str) -> dict[str, tuple[float, float]]:
    from benchmarks.ttfb.projection import fit_power, read_scale_json

    scale = read_scale_json(scale_json)
    return {mode: fit_power(list(p), list(p.values())) for mode, p in scale.items()}


def run_parts(args: argparse.Namespace) -> dict[str, Any]:
    """Run every variant of every model; write and return the results."""
    from benchmarks.ttfb.data import DatasetConfig, ensure_dataset
    from benchmarks.ttfb.trainer import model_spec

    variants = [v for v in VARIANTS if v.name in args.variants.split(",")]
    os.makedirs(args.out, exist_ok=True)
    result: dict[str, Any] = {
        "config": {
            "models": args.models,
            "nproc": args.nproc,
            "repeats": args.repeats,
            "restart": RESTART,
            "variants": [v.name for v in variants],
        },
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else [],
        "models": {},
    }
    markdown = []
    for model in args.models.split(","):
        ensure_dataset(DatasetConfig(spec=model_spec(model)), os.path.join(args.out, "data"))
        layouts = {
            v.name: Layout(root=os.path.join(args.out, "caches", model, v.name), mode=v.mode)
            for v in variants
        }
        runs_dir = os.path.join(args.out, "runs", model)
        cold = {}
        for v in variants:
            cold[v.name] = _run(
                v, model, "cold", os.path.join(runs_dir, "cold", v.name), layouts[v.name], args
            )
            snapshot_primed(layouts[v.name])
        restarts: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
        for r in range(args.repeats):
            order = variants[r % len(variants) :] + variants[: r % len(variants)]
            for v in order:
                out = os.path.join(runs_dir, RESTART, v.name, f"r{r}")
                restarts[v.name].append(_run(v, model, RESTART, out, layouts[v.name], args))
        rows = parts_rows(restarts)
        projected: list[dict[str, Any]] = []
        if args.measurements and args.scale_json:
            with open(args.measurements) as f:
                measurements = json.load(f)
            if measurements.get("key", {}).get("model") == model:
                projected = project_parts(
                    {name: summarize(rs) for name, rs in restarts.items()},
                    measurements=measurements,
                    local_fits=_local_fits(args.scale_json),
                )
        title = f"{model} model, {args.nproc} ranks, restart on new hosts"
        markdown.append(format_parts(rows, projected, title=title))
        result["models"][model] = {
            "cold": {name: _slim(run) for name, run in cold.items()},
            "restarts": {name: [_slim(run) for run in rs] for name, rs in restarts.items()},
            "rows": rows,
            "projected": projected,
        }
    result["load_avg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else []
    with open(os.path.join(args.out, "parts.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = "\n".join(markdown)
    with open(os.path.join(args.out, "parts.md"), "w") as f:
        f.write(text)
    print(text)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,medium", help="comma-separated")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--variants", default=",".join(v.name for v in VARIANTS), help="comma-separated"
    )
    parser.add_argument("--out", default="parts-out")
    parser.add_argument("--timeout", type=float, default=1200.0, help="per run, seconds")
    parser.add_argument(
        "--measurements", default=None, help="make projection's projection-measurements.json"
    )
    parser.add_argument("--scale-json", default=None, help="make scale's scale.json")
    parser.add_argument("--render", metavar="PARTS_JSON", help="only write parts.md again")
    args = parser.parse_args(argv)
    if args.render:
        print(render(args.render))
        return {}
    return run_parts(args)
