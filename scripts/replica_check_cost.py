"""What the replica digest check costs inside ``fastinit.setup``, on a reference model.

Runs ``fastinit.setup`` ``--repeats`` times on ``--nproc`` gloo ranks (CPU) with the benchmark's
mixed plan (table-wise, row-wise, column-wise, data-parallel cycled over the tables) and reports,
per repeat and as medians: the whole ``setup``, the verify phase (digests + one all_reduce), the
digests alone, how many replicated tensors and bytes it covers, and the bytes it sends.

Usage::

    .venv/bin/python -m scripts.replica_check_cost --model large --nproc 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _measure(model: str, repeats: int) -> dict[str, Any]:
    import logging
    import warnings

    import torch.distributed as dist

    import fastinit
    from benchmarks.ttfb.trainer import model_spec
    from fastinit import protocol, trace
    from fastinit.testing.models import build_model, build_plan

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    tracer = trace.active()
    assert tracer is not None
    ws = dist.get_world_size()
    types = ["table_wise", "row_wise", "column_wise", "data_parallel"]
    runs = []
    for _ in range(repeats):
        module = build_model(model_spec(model), device="meta")
        plan = build_plan(module, types, ws)
        t0 = time.perf_counter()
        with tracer.window() as counts:
            dmp = fastinit.setup(module, plan=plan, seed=0)
        total = time.perf_counter() - t0
        named = protocol.replicated_tensors(dmp.module, dmp.plan)
        t1 = time.perf_counter()
        protocol.tensor_digests([t for _, t in named])
        digest_s = time.perf_counter() - t1
        runs.append(
            {
                "setup_s": total,
                "verify_s": counts["spans_s"].get("fastinit.verify_replicas", 0.0),
                "digests_s": digest_s,
                "tensors": len(named),
                "bytes_checked": sum(t.numel() * t.element_size() for _, t in named),
                "c10d_ops": counts["c10d_ops"],
                "c10d_bytes": counts["c10d_bytes"],
            }
        )
    return {"runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="large")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from fastinit.testing.dist import run_ranks

    results = run_ranks(
        _measure, args.nproc, args=(args.model, args.repeats), trace=True, timeout=1800
    )
    runs = results[0]["runs"]
    summary = {
        key: statistics.median(r[key] for r in runs)
        for key in ("setup_s", "verify_s", "digests_s", "tensors", "bytes_checked", "c10d_bytes")
    }
    summary["verify_share_of_setup"] = summary["verify_s"] / summary["setup_s"]
    summary["c10d_ops"] = runs[-1]["c10d_ops"]
    print(json.dumps({"model": args.model, "nproc": args.nproc, "rank0": runs}, indent=1))
    print("median:", json.dumps(summary))


if __name__ == "__main__":
    main()
