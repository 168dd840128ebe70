"""What each part of fastinit gives, measured against the same trainer's stock-best.

python -m benchmarks.parts --help
"""
