"""Time to first batch: stock, stock-best and fastinit against the floor, per scenario (``make bench``).

    python -m benchmarks.ttfb --help

Modules: ``main`` (the runs, the summary), ``launch``, ``scenarios``, ``trainer`` (the reference
trainer), ``floor``, ``data``, ``recovery`` and ``faults`` (the recover scenario), ``analysis`` (pure),
``report``, ``ett``, ``projection`` (``make projection``), ``components`` (torchx), ``testdata/``.
"""
