"""Per-rank start-up work from 64 to 8,192 ranks on the fake backend (``make scale``).

    python -m benchmarks.scale --help

Modules: ``main`` (the benchmark), ``plan`` (the plan's size and codec time at scale: ``python -m
benchmarks.scale.plan``), ``factories`` (a user's own model and plan, for ``--model-factory``).
"""
