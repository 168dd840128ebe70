"""A torch with the upstream patch applied, without touching the installed one.

    python patches/torch/overlay.py DIR            # DIR/torch: the installed torch, patched
    PYTHONPATH=DIR torchrun ...                    # runs the patched torch

``DIR/torch`` mirrors the installed package with symbolic links, except the files the patch
changes, which are copied and patched with ``git apply`` (no fuzz). Nothing of the installed
torch is modified; delete DIR to drop it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PATCH = HERE / "0001-elastic-a-new-worker-store-for-every-rendezvous-round.patch"


def build(target: Path, patch: Path = PATCH) -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise SystemExit("no torch installed in this interpreter")
    real = Path(spec.origin).parent
    touched = sorted(set(re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), re.M)))
    if (target / "torch").exists():
        raise SystemExit(f"{target / 'torch'} exists; remove it first")
    # Directories on the way to a patched file are real; everything else is a link.
    real_dirs = {Path(*Path(t).parts[1:i]) for t in touched for i in range(1, len(Path(t).parts))}
    for rel in sorted(real_dirs, key=lambda p: len(p.parts)):
        (target / "torch" / rel).mkdir(parents=True, exist_ok=True)
        for entry in os.scandir(real / rel):
            dest = target / "torch" / rel / entry.name
            child = rel / entry.name
            if (
                child in real_dirs
                or str(Path("torch") / child) in touched
                or entry.name == "__pycache__"  # bytecode of the patched files stays here
                or dest.exists()
            ):
                continue
            dest.symlink_to(entry.path)
    for t in touched:
        shutil.copyfile(real / Path(*Path(t).parts[1:]), target / t)
    subprocess.run(["git", "apply", "-p1", "--verbose", str(patch)], cwd=target, check=True)
    return target


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--patch", type=Path, default=PATCH)
    args = p.parse_args()
    build(args.dir, args.patch)
    print(f"PYTHONPATH={args.dir} runs the patched torch", file=sys.stderr)


if __name__ == "__main__":
    main()
