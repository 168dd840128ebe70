"""How long ``fastinit.checkpoint.save(blocking=False)`` holds the training loop.

python -m benchmarks.checkpoint_blocking --help
"""
