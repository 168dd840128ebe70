"""Apply the fastinit TorchRec patch series to a pristine copy of an installed torchrec.

Usage::

    python patches/apply.py --target DIR [--source SITE_PACKAGES_TORCHREC] [--upto N]

copies the installed ``torchrec`` package (default: the one ``import torchrec`` finds, which must
be 1.8.0) to ``DIR/torchrec`` and applies ``patches/torchrec/*.patch`` in order with ``git apply``
(``patch -p1 --fuzz=0`` where git is missing), so ``PYTHONPATH=DIR`` runs the patched TorchRec.
``DIR`` must not hold a ``torchrec`` already. Exits non-zero, naming the patch, if one does not
apply cleanly. In a TorchRec git checkout at v1.8.0 use ``git am patches/torchrec/*.patch``.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

SERIES_DIR = Path(__file__).resolve().parent / "torchrec"
TORCHREC_VERSION = "1.8.0"


def series(upto: int | None = None) -> list[Path]:
    """The patch files, in order (the first ``upto`` of them when given)."""
    patches = sorted(SERIES_DIR.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    return patches if upto is None else patches[:upto]


def installed_torchrec() -> Path:
    """The directory of the torchrec package this interpreter would import (not imported)."""
    spec = importlib.util.find_spec("torchrec")
    if spec is None or spec.origin is None:
        raise SystemExit("torchrec is not installed")
    return Path(spec.origin).parent


def _check_version(source: Path) -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchrec")
    except PackageNotFoundError:
        return
    if found != TORCHREC_VERSION and source == installed_torchrec():
        raise SystemExit(f"the series is against torchrec {TORCHREC_VERSION}, found {found}")


def _apply_one(patch: Path, target: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("git"):
        # Outside a git repository `git apply` patches the files under the current directory;
        # it refuses fuzz and offsets beyond the exact context.
        cmd = ["git", "apply", "--whitespace=nowarn", str(patch)]
    else:
        cmd = ["patch", "-p1", "--forward", "--fuzz=0", "--batch", "-i", str(patch)]
    return subprocess.run(cmd, cwd=target, capture_output=True, text=True, check=False)


def apply(target: Path, source: Path | None = None, upto: int | None = None) -> list[str]:
    """Copy ``source`` (default: the installed torchrec) to ``target/torchrec`` and patch it.

    Returns the names of the applied patches.

    Raises:
        RuntimeError: a patch did not apply cleanly (its output is in the message).
    """
    source = source or installed_torchrec()
    _check_version(source)
    dest = target / "torchrec"
    if dest.exists():
        raise RuntimeError(f"{dest} exists; give an empty target")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    applied = []
    for patch in series(upto):
        result = _apply_one(patch, target)
        if result.returncode != 0:
            raise RuntimeError(
                f"{patch.name} does not apply to {dest}:\n{result.stdout}{result.stderr}"
            )
        applied.append(patch.name)
    return applied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, type=Path, help="directory to create")
    parser.add_argument("--source", type=Path, help="a pristine torchrec package directory")
    parser.add_argument("--upto", type=int, help="apply only the first N patches")
    args = parser.parse_args(argv)
    try:
        applied = apply(args.target, args.source, args.upto)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    for name in applied:
        print(f"applied {name}")
    print(f"PYTHONPATH={args.target.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
