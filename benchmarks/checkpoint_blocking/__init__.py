"""How long a checkpoint save holds the training loop: fastinit against the warm copy of the same
bytes (the limit), stock DCP's best and torch_checkpointing; and the load with its checksums.

python -m benchmarks.checkpoint_blocking --help
"""
