"""The plan at scale: encoded size, encode + decode + validation time, plan-cache read.

    python -m benchmarks.scale.plan [--ranks 64,1024,4096,8192] [--model medium]

For each world size: the mixed plan of ``benchmarks.scale.main`` (and the plan with every layout),
encoded with fastinit's codec; the times of one encode of the decoded (compact) plan, one decode
and ``validate_plan`` as a receiving rank runs them; and a plan-cache ``put`` / ``get`` round trip
in a temporary directory (what each of N ranks reads from shared storage on a cache hit).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

__all__ = ["measure", "main"]


def measure(model: str, plan_kind: str, n: int, local: int = 8) -> dict[str, Any]:
    """Sizes and times for one world size (run in this process)."""
    import pickle

    from benchmarks.scale.main import PLANS, _model
    from benchmarks.ttfb.trainer import _sharders
    from fastinit.plan.cache import PlanCache
    from fastinit.plan.codec import decode_plan, encode_plan
    from fastinit.plan.validate import validate_plan
    from fastinit.testing.models import build_plan

    module = _model(model, False)
    stock_plan = build_plan(module, list(PLANS[plan_kind]), world_size=n, local_world_size=local)
    data = encode_plan(stock_plan)
    t = time.perf_counter()
    plan = decode_plan(data)
    decode_s = time.perf_counter() - t
    t = time.perf_counter()
    validate_plan(module, plan, _sharders())
    validate_s = time.perf_counter() - t
    t = time.perf_counter()
    again = encode_plan(plan)
    encode_s = time.perf_counter() - t
    assert again == data
    with tempfile.TemporaryDirectory() as d:
        cache = PlanCache(d)
        key = b"k" * 32
        cache.put(key, plan)
        entry = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
        t = time.perf_counter()
        got = cache.get(key)
        get_s = time.perf_counter() - t
        assert got is not None
    return {
        "world_size": n,
        "plan": plan_kind,
        "codec_bytes": len(data),
        "pickle_bytes": len(pickle.dumps(stock_plan)),
        "decode_s": decode_s,
        "validate_s": validate_s,
        "encode_s": encode_s,
        "encode_decode_validate_s": decode_s + validate_s + encode_s,
        "cache_entry_bytes": entry,
        "cache_get_s": get_s,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,1024,4096,8192")
    parser.add_argument("--model", default="medium")
    parser.add_argument("--out", default="benchmarks/results/scale")
    args = parser.parse_args(argv)
    rows = []
    for kind in ("mixed4", "all7"):
        for n in (int(x) for x in args.ranks.split(",")):
            got = _in_subprocess_measure(args.model, kind, n)
            rows.append(got)
            print(json.dumps(got), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "plan.json"), "w") as f:
        json.dump({"model": args.model, "rows": rows}, f, indent=1)
    return rows


def _in_subprocess_measure(model: str, kind: str, n: int) -> dict[str, Any]:
    from fastinit.testing.dist import FreshProcessError, call_fresh

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        return call_fresh(  # type: ignore[no-any-return]
            "benchmarks.scale.plan", "measure", [model, kind, n], 1800, cwd=root
        )
    except FreshProcessError as e:
        return {"world_size": n, "plan": kind, "error": str(e)[-2000:]}


if __name__ == "__main__":
    main()
