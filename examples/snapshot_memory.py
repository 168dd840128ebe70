"""Extra memory of warm-up's snapshot on the benchmarks' large model, whole copy against touched rows.

    python -m examples.snapshot_memory [--model large] [--nproc 2]

Builds the reference model of ``benchmarks.ttfb.trainer.MODELS[model]`` with ``fastinit.setup`` on
``nproc`` gloo ranks (CPU), with TorchRec's fused EXACT_ROWWISE_ADAGRAD, and runs
``warm_up`` twice on a fast batch of ``--batch-size`` samples: ``snapshot="full"`` (a copy of every local
tensor, earlier versions' behaviour) and ``snapshot="touched"`` (the default). Prints, per rank,
the local model + optimizer bytes and the bytes each snapshot held (its extra memory), and checks
that both leave the state unchanged.
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _rank(model_name: str, batch_size: int) -> dict[str, Any]:
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import fastinit
    from benchmarks.ttfb.trainer import model_spec
    from fastinit.testing.models import build_model, make_batch
    from fastinit.warmup import WarmupConfig, fast_batch, schema_from_batch, warm_up

    spec = model_spec(model_name)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.02}
    sharders = [
        EmbeddingBagCollectionSharder(fused_params=dict(fused)),
        EmbeddingCollectionSharder(fused_params=dict(fused)),
    ]
    model = fastinit.setup(build_model(spec, device="meta"), sharders=sharders, seed=0)
    batch = fast_batch(
        schema_from_batch(make_batch(spec, 2), model), batch_size, torch.device("cpu")
    )
    out: dict[str, Any] = {}
    for mode in ("full", "touched"):
        report = warm_up(model, batch, config=WarmupConfig(snapshot=mode))
        out[mode] = report.snapshot_bytes
        out["model_bytes"] = report.model_bytes
    out["touched_pct"] = 100.0 * out["touched"] / out["model_bytes"]
    out["full_pct"] = 100.0 * out["full"] / out["model_bytes"]
    return out


def main() -> None:
    """Command-line entry point."""
    from fastinit.testing.dist import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()
    from examples.snapshot_memory import _rank as rank_fn  # by module name, not __main__

    results = run_ranks(rank_fn, args.nproc, args=(args.model, args.batch_size), timeout=1800)
    for rank, r in enumerate(results):
        print(json.dumps({"rank": rank, **r}))


if __name__ == "__main__":
    main()
