"""Apply the fastinit TorchRec patch series to a pristine copy of an installed torchrec.

Usage::

    python patches/apply.py --target DIR [--source SITE_PACKAGES_TORCHREC] [--version V] [--upto N]

copies the installed ``torchrec`` package (default: the one ``import torchrec`` finds) to
``DIR/torchrec`` and applies the series for its release, ``patches/torchrec/v<version>/*.patch``
(:data:`SERIES`: 1.8.0 and 1.9.2), in order with ``git apply`` (``patch -p1 --fuzz=0`` where git is
missing), so ``PYTHONPATH=DIR`` runs the patched TorchRec. The release is the installed
distribution's version, or, for ``--source``, the ``__version__`` in that tree's ``version.py``;
``--version`` overrides both. ``DIR`` must not hold a ``torchrec`` already. Exits non-zero, naming
the patch, if one does not apply cleanly, and naming the releases there are series for if the
release has none. In a TorchRec git checkout at the release use
``git am patches/torchrec/v<version>/*.patch``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

SERIES_ROOT = Path(__file__).resolve().parent / "torchrec"
#: TorchRec release -> its series directory under patches/torchrec.
SERIES = {"1.8.0": "v1.8.0", "1.9.2": "v1.9.2"}


def _release(version: str) -> str:
    """``1.9.2+cu128`` -> ``1.9.2``."""
    return version.split("+", 1)[0]


def series_dir(version: str) -> Path:
    """The series directory for a TorchRec release.

    Raises:
        SystemExit: there is no series for it (the message names those there are).
    """
    name = SERIES.get(_release(version))
    if name is None:
        have = ", ".join(sorted(SERIES))
        raise SystemExit(f"no patch series for torchrec {version} (series: {have})")
    return SERIES_ROOT / name


def series(upto: int | None = None, version: str | None = None) -> list[Path]:
    """The patch files for ``version`` (default: the installed torchrec's), in order (the first
    ``upto`` of them when given)."""
    directory = series_dir(version or installed_version())
    patches = sorted(directory.glob("[0-9][0-9][0-9][0-9]-*.patch"))
    return patches if upto is None else patches[:upto]


def installed_torchrec() -> Path:
    """The directory of the torchrec package this interpreter would import (not imported)."""
    spec = importlib.util.find_spec("torchrec")
    if spec is None or spec.origin is None:
        raise SystemExit("torchrec is not installed")
    return Path(spec.origin).parent


def installed_version() -> str:
    """The installed torchrec distribution's version (not imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchrec")
    except PackageNotFoundError:
        return tree_version(installed_torchrec())


def tree_version(source: Path) -> str:
    """``__version__`` of a torchrec package directory's ``version.py`` (not imported)."""
    path = source / "version.py"
    try:
        tree = ast.parse(path.read_text())
    except OSError as e:
        raise SystemExit(f"cannot tell the torchrec version of {source}: {e}; give --version") from e
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets
        ):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
    raise SystemExit(f"{path} has no __version__ string; give --version")


def _apply_one(patch: Path, target: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("git"):
        # Outside a git repository `git apply` patches the files under the current directory;
        # it refuses fuzz and offsets beyond the exact context.
        cmd = ["git", "apply", "--whitespace=nowarn", str(patch)]
    else:
        cmd = ["patch", "-p1", "--forward", "--fuzz=0", "--batch", "-i", str(patch)]
    return subprocess.run(cmd, cwd=target, capture_output=True, text=True, check=False)


def apply(
    target: Path,
    source: Path | None = None,
    upto: int | None = None,
    version: str | None = None,
) -> list[str]:
    """Copy ``source`` (default: the installed torchrec) to ``target/torchrec`` and patch it
    with the series of ``version`` (default: the release of ``source``).

    Returns the names of the applied patches.

    Raises:
        RuntimeError: a patch did not apply cleanly (its output is in the message).
        SystemExit: there is no series for the release.
    """
    if version is None:
        version = installed_version() if source is None else tree_version(source)
    source = source or installed_torchrec()
    patches = series(upto, version)
    dest = target / "torchrec"
    if dest.exists():
        raise RuntimeError(f"{dest} exists; give an empty target")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    applied = []
    for patch in patches:
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
    parser.add_argument("--version", help="the torchrec release whose series to apply")
    args = parser.parse_args(argv)
    try:
        applied = apply(args.target, args.source, args.upto, args.version)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    for name in applied:
        print(f"applied {name}")
    print(f"PYTHONPATH={args.target.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
