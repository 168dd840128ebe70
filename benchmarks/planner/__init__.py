"""Cold planning time: TorchRec's ``EmbeddingShardingPlanner`` against ``FastPlanner``.

python -m benchmarks.planner --help
"""
