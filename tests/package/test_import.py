"""``import fastinit`` stays cheap: no torch, no torchrec.distributed until something is used."""

from __future__ import annotations

import subprocess
import sys


def test_import_fastinit_loads_neither_torch_nor_torchrec() -> None:
    code = (
        "import sys, fastinit, fastinit.sharding, fastinit.plan, fastinit.planner, fastinit.pg\n"
        "import fastinit.warmup\n"
        "import fastinit.knobs\n"
        "import fastinit.checkpoint\n"
        "heavy = [m for m in ('torch', 'torchrec', 'torchrec.distributed') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import fastinit loaded {out.stdout.strip()}"


def test_public_names_resolve_lazily() -> None:
    import fastinit
    import fastinit.planner

    assert callable(fastinit.setup)
    assert issubclass(fastinit.StartupMismatchError, fastinit.StartupError)
    assert fastinit.planner.FastPlanner.__name__ == "FastPlanner"
