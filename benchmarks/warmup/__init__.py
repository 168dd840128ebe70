"""Time to first batch: sequential start-up against fastinit.warmup's concurrent stages.

python -m benchmarks.warmup --help
"""
