"""TorchRec's own model-parallel suite, stock and with ``fastinit.setup`` swapped in (``make peer``).

Usage::

    make peer TORCHREC_SRC=/path/to/torchrec        # or FASTINIT_TORCHREC_SRC=/path/to/torchrec
    python -m tools.peer --torchrec-src /path/to/torchrec [--mode both|swap|stock] [-k EXPR]

The tree must be a TorchRec source checkout at the installed version (for torchrec 1.8.0, the
``v1.8.0-rc1`` tag; ``git archive`` of it is enough: nothing is built, fetched or written there).
For torchrec 1.9.2 no release tag or branch is fetchable (the newest commit of the repository's
copy here is ``376cac6``, 2026-08-21, version 1.9.0a0, which differs from the 1.9.2 wheel in 62
non-test files): run it with ``--torchrec-from installed`` (``make peer STACK=1.9`` does). Then
the test files are copied out of the tree and run against the installed TorchRec *and its own
test utilities* (the wheel ships ``torchrec/distributed/test_utils``, 1.9.2's); only the package
the wheel lacks, ``torchrec.distributed.tests`` (which those utilities import), is found in the
tree, after everything installed (a meta-path finder in the run's ``sitecustomize``). Loading the
tree's ``test_utils`` over the wheel instead fails to collect (``module 'torchrec.distributed'
has no attribute 'planner'``).
Its ``torchrec/distributed/tests/test_model_parallel_gloo.py`` is run with pytest, from the tree,
so TorchRec is imported from the tree, as a source checkout is (its version reads ``"unknown"``);
``--torchrec-from installed`` imports the installed TorchRec instead. TorchRec's test utilities
need ``hypothesis``.

In the swapped run, a ``sitecustomize`` in a temporary directory on ``PYTHONPATH`` installs
:mod:`tools.peer.swap` in the pytest process and in every rank it spawns, and the pytest plugin
:mod:`tools.peer.plugin` re-applies it before each test (pytest's own import hook loads the
``test_*.py`` utilities in its process): each ``DistributedModelParallel`` global of TorchRec's
test utilities is replaced, in that process only, by a stand-in that calls ``fastinit.setup``
with the same arguments. The tree is not edited.

``--mode patched`` runs the suite stock on TorchRec with fastinit's upstream patch series
(``patches/torchrec/v<release>``, :mod:`patches.apply`) applied to a copy: of the tree's
``torchrec`` package (``--torchrec-from source``; the release is the tree's ``version.txt``) or of
the installed package (``installed``), first on ``PYTHONPATH``. Neither the tree nor the
installed TorchRec is edited. ``--mode`` takes one mode or several, comma-separated
(``stock,patched``); ``both`` is ``stock,swap``.

Writes ``<out>/<mode>.xml`` (JUnit), ``<out>/<mode>.log``, ``<out>/swap-calls.jsonl``
(one line per ``fastinit.setup`` call made through the swap) and ``<out>/summary.md``; prints the
summary. Exits 0 when the swapped run has no failure or error, made at least one ``setup`` call,
the patched run has no failure or error, and each passes every test stock passes when stock ran
too; 1 otherwise; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["DEFAULT_TESTS", "Outcome", "SuiteResult", "main", "run_suite"]

#: The ways the suite runs: TorchRec as it is, with fastinit.setup swapped in, with the patches.
MODES = ("stock", "swap", "patched")

#: The suite run by default, relative to the tree's root.
DEFAULT_TESTS = ("torchrec/distributed/tests/test_model_parallel_gloo.py",)

REPO_ROOT = Path(__file__).resolve().parents[2]

_SITECUSTOMIZE = """\
# Written by tools.peer.run for one peer run: swap DistributedModelParallel in TorchRec's test
# utilities for fastinit.setup, in this process only.
import sys

sys.path.insert(0, {repo!r})
from tools.peer import swap

swap.install({log!r})
"""

_TREE_TESTS = """\
# Written by tools.peer.run for one peer run against the installed TorchRec: the wheel ships
# torchrec/distributed/test_utils but not torchrec/distributed/tests, which its test utilities
# import; that one package is found in the source tree, after everything installed.
import sys
from importlib.machinery import PathFinder


class _TreeTests:
    def find_spec(self, name, path=None, target=None):
        if name == "torchrec.distributed.tests":
            return PathFinder.find_spec(name, [{tree!r}])
        return None


sys.meta_path.append(_TreeTests())
"""


@dataclasses.dataclass(frozen=True, slots=True)
class Outcome:
    """One test's result."""

    test: str
    """``Class::method``."""
    outcome: str
    """"passed", "failed", "error" or "skipped"."""
    message: str
    """First line of the failure, error or skip message ("" when passed)."""


@dataclasses.dataclass(slots=True)
class SuiteResult:
    """One run of the suite."""

    mode: str
    """"stock", "swap" or "patched" (stock on TorchRec with the patch series)."""
    outcomes: list[Outcome]
    seconds: float
    returncode: int
    torchrec: str
    """Where TorchRec was imported from, and its version, in this run."""
    setup_calls: int = 0
    """``fastinit.setup`` calls made through the swap (0 for stock)."""
    setup_failures: list[str] = dataclasses.field(default_factory=list)
    """Distinct errors raised by those calls."""

    def count(self, outcome: str) -> int:
        return sum(o.outcome == outcome for o in self.outcomes)

    def counts(self) -> str:
        parts = [f"{self.count(k)} {k}" for k in ("passed", "failed", "error", "skipped")]
        return ", ".join(p for p in parts if not p.startswith("0 ")) or "nothing ran"


def _parse_junit(path: Path) -> list[Outcome]:
    if not path.is_file():
        return []
    out: list[Outcome] = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            child = case.find(kind)
            if child is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                text = child.get("message") or (child.text or "")
                message = text.strip().splitlines()[0][:300] if text.strip() else ""
                break
        out.append(Outcome(test, outcome, message))
    return out


def _environment(extra_path: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    paths = [*extra_path, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _probe(cwd: Path, env: dict[str, str]) -> str:
    code = (
        "import torchrec, importlib.util as u\n"
        "print(torchrec.__file__, getattr(torchrec, '__version__', 'unknown'),"
        " 'hypothesis' if u.find_spec('hypothesis') else 'NO-HYPOTHESIS')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        return f"torchrec does not import: {proc.stderr.strip()[-500:]}"
    return proc.stdout.strip()


def run_suite(
    src: Path,
    mode: str,
    out_dir: Path,
    *,
    tests: tuple[str, ...] = DEFAULT_TESTS,
    keyword: str | None = None,
    per_test_timeout: int = 900,
    torchrec_from: str = "source",
) -> SuiteResult:
    """Run the suite once, stock or swapped, and read its results.

    Args:
        src: the TorchRec source tree.
        mode: "stock", "swap" or "patched" (stock, on a copy of TorchRec with the series).
        out_dir: where the JUnit file, the log and the swap's call log go.
        tests: test files, relative to ``src``.
        keyword: a pytest ``-k`` expression.
        per_test_timeout: pytest-timeout's limit per test, in seconds.
        torchrec_from: "source" (import TorchRec from the tree) or "installed".

    Returns:
        The outcomes, with where TorchRec came from and, swapped, the ``setup`` calls made.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    xml = out_dir / f"{mode}.xml"
    log = out_dir / f"{mode}.log"
    calls = out_dir / "swap-calls.jsonl"
    for stale in (xml, log) + ((calls,) if mode == "swap" else ()):
        stale.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="fastinit-peer-") as tmp:
        extra: list[str] = []
        parts = []
        if torchrec_from == "installed":
            parts.append(_TREE_TESTS.format(tree=str(src / "torchrec" / "distributed")))
        if mode == "swap":
            parts.append(_SITECUSTOMIZE.format(repo=str(REPO_ROOT), log=str(calls)))
        if parts:
            hook = Path(tmp) / "hook"
            hook.mkdir()
            (hook / "sitecustomize.py").write_text("\n".join(parts), encoding="utf-8")
            extra = [str(hook)] + ([str(REPO_ROOT)] if mode == "swap" else [])
        if mode == "patched":
            patched = _patched_torchrec(src, Path(tmp) / "patched", torchrec_from)
            if torchrec_from == "source":
                src = patched  # the tree's copy, its torchrec patched: run the tests from there
            else:
                extra.insert(0, str(patched))
        env = _environment(extra)
        if torchrec_from == "source":
            cwd, paths, mode_args = src, list(tests), ["--import-mode=prepend"]
        else:
            # the test files copied out of the tree (into a directory that is no package), so
            # nothing imports the tree: TorchRec and its test utilities (the wheel ships
            # torchrec/distributed/test_utils) are the installed release's
            cwd = Path(tmp)
            run_dir = cwd / "tests"
            run_dir.mkdir()
            paths = []
            for t in tests:
                shutil.copyfile(src / t, run_dir / Path(t).name)
                paths.append(str(run_dir / Path(t).name))
            mode_args = ["--import-mode=importlib"]
        where = _probe(cwd, env)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            *paths,
            *mode_args,
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--rootdir",
            str(cwd),
            "-rA",
            f"--timeout={per_test_timeout}",
            f"--junitxml={xml}",
        ]
        if mode == "swap":
            cmd += ["-p", "tools.peer.plugin"]
        if keyword:
            cmd += ["-k", keyword]
        start = time.perf_counter()
        with open(log, "w", encoding="utf-8") as f:
            f.write(f"# {' '.join(cmd)}\n# cwd {cwd}\n# torchrec {where}\n")
            f.flush()
            proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - start
    result = SuiteResult(mode, _parse_junit(xml), seconds, proc.returncode, where)
    if mode == "swap" and calls.is_file():
        records = [json.loads(line) for line in calls.read_text().splitlines() if line.strip()]
        result.setup_calls = len(records)
        result.setup_failures = sorted({r["error"] for r in records if not r["ok"]})
    return result


def _patched_torchrec(src: Path, dest: Path, torchrec_from: str) -> Path:
    """A copy of TorchRec with fastinit's patch series for its release applied (patches/apply.py).

    ``source``: ``dest`` is a copy of the tree's ``torchrec`` package and of each test file,
    patched (the release is the tree's ``version.txt``), to run from as the tree. ``installed``:
    ``dest`` holds the installed package, patched, to put first on ``PYTHONPATH``.
    """
    sys.path.insert(0, str(REPO_ROOT))
    from patches import apply

    if torchrec_from == "installed":
        apply.apply(dest)
        return dest
    version_txt = src / "version.txt"
    version = version_txt.read_text().strip() if version_txt.is_file() else None
    apply.apply(dest, source=src / "torchrec", version=version)
    return dest


def _fastinit_revision() -> str:
    try:
        proc = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return proc.stdout.strip() or "unknown"


def _summary(results: dict[str, SuiteResult], src: Path) -> str:
    lines = [
        f"# TorchRec model-parallel suite, stock vs fastinit.setup ({src})",
        "",
        f"fastinit at {_fastinit_revision()}",
        "",
    ]
    for mode, r in results.items():
        lines.append(
            f"- **{mode}**: {r.counts()} in {r.seconds:.0f} s (torchrec: {r.torchrec})"
            + (f"; {r.setup_calls} fastinit.setup calls" if mode == "swap" else "")
        )
    stock, swap = results.get("stock"), results.get("swap")
    rows = []
    names = sorted({o.test for r in results.values() for o in r.outcomes})
    by = {m: {o.test: o for o in r.outcomes} for m, r in results.items()}
    for name in names:
        cells = [by[m].get(name) for m in results]
        if len({c.outcome if c else "-" for c in cells}) > 1 or any(
            c and c.outcome in ("failed", "error") for c in cells
        ):
            row = " | ".join(c.outcome if c else "-" for c in cells)
            note = next((c.message for c in cells if c and c.message), "")
            rows.append(f"| {name} | {row} | {note.replace('|', '/')} |")
    if rows:
        lines += [
            "",
            f"| test | {' | '.join(results)} | message |",
            "|---|" + "---|" * len(results) + "---|",
        ]
        lines += rows
    if swap is not None and swap.setup_failures:
        lines += ["", "fastinit.setup raised (distinct errors):"]
        lines += [f"- {e}" for e in swap.setup_failures]
    for other, label in (("swap", "swapped"), ("patched", "patched")):
        if stock is None or other not in by:
            continue
        lost = [o.test for o in stock.outcomes if o.outcome == "passed"]
        lost = [t for t in lost if by[other].get(t) is None or by[other][t].outcome != "passed"]
        lines += [
            "",
            f"Passing stock but not {label}: {len(lost)}"
            + (f" ({', '.join(lost)})" if lost else ""),
        ]
    return "\n".join(lines) + "\n"


def verdict(results: dict[str, SuiteResult]) -> list[str]:
    """Why the run failed (empty when it passed)."""
    problems: list[str] = []
    stock = results.get("stock")
    if stock is not None and not stock.outcomes:
        problems.append("the stock run produced no results (see stock.log)")
    for mode, label in (("swap", "swapped"), ("patched", "patched")):
        result = results.get(mode)
        if result is None:
            continue
        if not result.outcomes:
            problems.append(f"the {label} run produced no results (see {mode}.log)")
        if result.count("failed") or result.count("error"):
            problems.append(f"{label}: {result.counts()}")
        if mode == "swap" and result.outcomes and result.setup_calls == 0:
            problems.append("the swap made no fastinit.setup call: it did not take effect")
        if stock is not None:
            passed = {o.test for o in result.outcomes if o.outcome == "passed"}
            lost = [
                o.test for o in stock.outcomes if o.outcome == "passed" and o.test not in passed
            ]
            if lost:
                problems.append(f"{len(lost)} test(s) pass stock but not {label}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.peer", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--torchrec-src", default=None, help="TorchRec source tree (default: FASTINIT_TORCHREC_SRC)"
    )
    parser.add_argument(
        "--mode",
        default="both",
        help="stock, swap, patched, or several comma-separated (default both: stock,swap)",
    )
    parser.add_argument("--out", default="peer-out", help="output directory (default peer-out)")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test (default 900)")
    parser.add_argument("--torchrec-from", choices=("source", "installed"), default="source")
    parser.add_argument(
        "tests", nargs="*", default=list(DEFAULT_TESTS), help="test files in the tree"
    )
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO_ROOT))
    from fastinit import knobs

    src_arg = args.torchrec_src or knobs.get_torchrec_src()
    if not src_arg:
        parser.error(
            "give --torchrec-src (or set FASTINIT_TORCHREC_SRC, or make peer TORCHREC_SRC=...)"
        )
    src = Path(src_arg).resolve()
    missing = [t for t in args.tests if not (src / t).is_file()]
    if missing:
        parser.error(f"{src} is not a TorchRec source tree: no {', '.join(missing)}")
    out_dir = Path(args.out).resolve()
    modes = tuple(dict.fromkeys(("stock,swap" if args.mode == "both" else args.mode).split(",")))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}: use {', '.join(MODES)} or both")
    results: dict[str, SuiteResult] = {}
    for mode in modes:
        print(f"peer: running the suite ({mode}) ...", flush=True)
        results[mode] = run_suite(
            src,
            mode,
            out_dir,
            tests=tuple(args.tests),
            keyword=args.keyword,
            per_test_timeout=args.timeout,
            torchrec_from=args.torchrec_from,
        )
    summary = _summary(results, src)
    (out_dir / "summary.md").write_text(summary, encoding="utf-8")
    print(summary)
    problems = verdict(results)
    for p in problems:
        print(f"peer: FAILED: {p}")
    return 1 if problems else 0
