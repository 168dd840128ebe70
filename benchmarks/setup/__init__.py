"""Sharding-setup time, stock (``collective_plan`` + DMP) against ``fastinit.setup``.

python -m benchmarks.setup --help
"""
