"""Stock TorchRec's start-up, per phase (``make baseline``).

python -m benchmarks.baseline --help
"""
