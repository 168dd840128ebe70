"""A TorchRec DLRM trainer started with fastinit: sharding, stage graph, fast batch, compile cache.

    torchrun --nproc-per-node 2 -m examples.dlrm_trainer [--steps 5] [--compile-cache DIR]

Built only from TorchRec's own pieces — ``torchrec.models.dlrm.DLRMTrain``,
``torchrec.datasets.random.RandomRecDataset`` (``torchrec.datasets.utils.Batch``),
``TrainPipelineSparseDist`` and a fused EXACT_ROWWISE_ADAGRAD embedding optimizer — and started
as fastinit suggests: the seven start-up stages in a :class:`fastinit.warmup.StageGraph`, so the
data pipeline produces its first batch while the model is sharded (``fastinit.setup``) and
compiled on a fast batch (``pre_train``), with compiled code kept across jobs by a
:class:`fastinit.warmup.CompileCache`.

The data pipeline presents the features in the reverse of the model's table order (as a real
pipeline may): warm-up leaves no trace of its own batch's order, so the losses are those of a run
without warm-up (``tests/examples/test_example_trainer.py`` checks exactly that).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
from typing import Any

#: The compiled part of DLRMTrain (its ``model`` is the DLRM): everything but the sparse arch.
COMPILE_TARGETS: tuple[str, ...] = ("model.dense_arch", "model.inter_arch", "model.over_arch")


@dataclasses.dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """One training run."""

    num_features: int = 4
    """Sparse features (one table each)."""
    num_embeddings: int = 200
    """Rows per table."""
    embedding_dim: int = 8
    """Embedding dimension (also DLRM's dense arch output)."""
    dense_in: int = 13
    """Dense features per sample."""
    batch_size: int = 32
    """Samples per batch and rank."""
    steps: int = 3
    """Training steps after start-up."""
    warmup: bool = True
    """Compile and warm up on a fast batch during start-up."""
    backend: str = "inductor"
    """``torch.compile`` backend ("aot_eager" compiles in a fraction of the time)."""
    compile_cache: str | None = None
    """Directory of the compile cache (None: ``FASTINIT_COMPILE_CACHE`` or off)."""
    precompile: bool = False
    """Keep the compiled targets' ahead-of-time form in the compile cache: a restart runs them
    without a Dynamo trace (``CompileConfig(precompile=True)``)."""
    reverse_pipeline_order: bool = True
    """The data pipeline presents the features in the reverse of the model's table order."""
    seed: int = 0
    """Seed of the model's initial values and of the data."""


def _keys(config: TrainerConfig) -> list[str]:
    return [f"f{i}" for i in range(config.num_features)]


def build_model(config: TrainerConfig) -> Any:
    """TorchRec's DLRMTrain, on the meta device (fastinit materialises it sharded)."""
    import torch
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    tables = [
        EmbeddingBagConfig(
            name=f"t_{key}",
            embedding_dim=config.embedding_dim,
            num_embeddings=config.num_embeddings,
            feature_names=[key],
        )
        for key in _keys(config)
    ]
    meta = torch.device("meta")
    dlrm = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=meta),
        dense_in_features=config.dense_in,
        dense_arch_layer_sizes=[16, config.embedding_dim],
        over_arch_layer_sizes=[16, 1],
        dense_device=meta,
    )
    return DLRMTrain(dlrm)


class Trainer:
    """The start-up stages as methods (each a node of the stage graph)."""

    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.info: dict[str, Any] = {}

    def device_init(self) -> Any:
        import torch

        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")

    def process_group_init(self, device: Any) -> None:
        import torch.distributed as dist

        import fastinit

        if not dist.is_initialized():  # under torchrun: this restart round's keys only
            if device.type == "cuda":  # torch 2.15's nccl backend needs each rank's device here
                fastinit.init_process_group("nccl", device_id=device)
            else:
                fastinit.init_process_group("gloo")

    def preproc_creation(self) -> Any:
        """The data pipeline: TorchRec's RandomRecDataset, its features in the pipeline's order."""
        import torch.distributed as dist
        from torchrec.datasets.random import RandomRecDataset

        keys = _keys(self.config)
        if self.config.reverse_pipeline_order:
            keys = keys[::-1]
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        dataset = RandomRecDataset(
            keys=keys,
            batch_size=self.config.batch_size,
            hash_size=self.config.num_embeddings,
            ids_per_feature=3,
            num_dense=self.config.dense_in,
            manual_seed=self.config.seed * 1000 + rank,
        )
        return iter(dataset)

    def train_module_creation(self, device: Any) -> tuple[Any, Any]:
        """``fastinit.setup`` in place of ``DistributedModelParallel``; the optimizers."""
        import torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
        from torchrec.optim.optimizers import in_backward_optimizer_filter

        import fastinit

        sharder = EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
        )
        model = fastinit.setup(
            build_model(self.config), device=device, sharders=[sharder], seed=self.config.seed
        )
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(model.named_parameters())),
            lambda params: torch.optim.Adagrad(params, lr=0.05),
        )
        return model, CombinedOptimizer([model.fused_optimizer, dense])

    def init_plugins(self, built: tuple[Any, Any], device: Any) -> Any:
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        model, optimizer = built
        return TrainPipelineSparseDist(model, optimizer, device)

    def pre_train(self, built: tuple[Any, Any], pipeline: Any, device: Any) -> Any:
        """Compile on a fast batch (TorchRec's ``Batch``, from the model's schema), cached."""
        from fastinit.warmup import (
            CompileCache,
            CompileCacheConfig,
            CompileConfig,
            WarmupConfig,
            fast_batch,
            schema_from_model,
            warm_up,
        )

        model, optimizer = built
        schema = schema_from_model(model)
        self.info["schema"] = schema
        if not self.config.warmup:
            return None
        compile_config = CompileConfig(
            targets=COMPILE_TARGETS, backend=self.config.backend, precompile=self.config.precompile
        )
        cache = CompileCache.for_targets(
            model,
            compile_config,
            CompileCacheConfig(directory=self.config.compile_cache, device=device.type),
        )
        batch = fast_batch(schema, 8, device)
        with cache as restored:
            report = warm_up(
                model,
                batch,
                pipeline=pipeline,
                config=WarmupConfig(compile=compile_config),
                compile_cache=cache,
            )
            cache.save()
        self.info["compile_cache"] = restored.status
        self.info["precompiled"] = {t.path: t.status for t in cache.precompiled_targets}
        self.info["precompiled_reasons"] = {t.path: t.reason for t in cache.precompiled_targets}
        self.info["warmup_s"] = report.seconds
        self.info["snapshot_bytes"] = report.snapshot_bytes
        return report

    def get_first_batch_data(self, it: Any) -> Any:
        return next(it)

    def start(self) -> tuple[Any, Any, Any]:
        """The stage graph; returns ``(pipeline, data iterator, first batch)``."""
        # Import what the stages use before they run on threads: two threads importing one
        # package with circular imports for the first time can see it half-initialised.
        import torchrec.datasets.random  # noqa: F401
        import torchrec.distributed.train_pipeline  # noqa: F401
        import torchrec.models.dlrm  # noqa: F401

        import fastinit.startup  # noqa: F401
        from fastinit.warmup import GraphConfig, StageGraph

        graph = StageGraph(GraphConfig(max_workers=3))
        graph.add("device_init", self.device_init)
        graph.add(
            "process_group_init",
            self.process_group_init,
            {"device": "device_init"},
            collective=True,
        )
        graph.add("preproc_creation", self.preproc_creation, after=("process_group_init",))
        graph.add("get_first_batch_data", self.get_first_batch_data, {"it": "preproc_creation"})
        graph.add(
            "train_module_creation",
            self.train_module_creation,
            {"device": "device_init"},
            after=("process_group_init",),
            collective=True,
        )
        graph.add(
            "init_plugins",
            self.init_plugins,
            {"built": "train_module_creation", "device": "device_init"},
        )
        graph.add(
            "pre_train",
            self.pre_train,
            {"built": "train_module_creation", "pipeline": "init_plugins", "device": "device_init"},
            collective=True,
        )
        results = graph.run()
        return (
            results["init_plugins"],
            results["preproc_creation"],
            results["get_first_batch_data"],
        )


def train(config: TrainerConfig) -> dict[str, Any]:
    """Start up, then train ``config.steps`` steps; returns the losses and start-up facts."""
    from fastinit.warmup import BatchSchemaError, check_batch

    trainer = Trainer(config)
    pipeline, it, first = trainer.start()
    try:
        check_batch(trainer.info["schema"], first)
        trainer.info["schema_check"] = "same"
    except BatchSchemaError as e:  # warm-up compiled for another order: say so, training is safe
        trainer.info["schema_check"] = str(e)
    data = itertools.chain([first], it)
    losses = [float(pipeline.progress(data)[0]) for _ in range(config.steps)]
    info = {k: v for k, v in trainer.info.items() if k != "schema"}
    return {"losses": losses, **info}


def main() -> None:
    """Command-line entry point (under torchrun)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--compile-cache", default=None)
    parser.add_argument("--no-warmup", action="store_true")
    parser.add_argument("--precompile", action="store_true", help="keep the AOT-compiled form")
    args = parser.parse_args()
    config = TrainerConfig(
        steps=args.steps,
        backend=args.backend,
        compile_cache=args.compile_cache,
        warmup=not args.no_warmup,
        precompile=args.precompile,
    )
    result = train(config)
    print(f"rank {os.environ.get('RANK', '0')}: {result}")


if __name__ == "__main__":
    main()
