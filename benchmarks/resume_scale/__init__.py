"""One rank's checkpoint load at 64 to 8,192 ranks, fastinit against stock DCP (``make resume-scale``).

python -m benchmarks.resume_scale --help
"""
