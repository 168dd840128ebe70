"""Kill-and-restart cycles under torchrun: stock-best against fastinit, recoveries, failures, hangs.

python -m benchmarks.restarts --help
"""
