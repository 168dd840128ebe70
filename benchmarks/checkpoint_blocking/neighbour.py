"""What writing a checkpoint costs the other processes on the host.

    python -m benchmarks.checkpoint_blocking.neighbour [--gb 1] [--repeats 2] [--results DIR]

Two writer processes (two ranks' writers on one host) each write ``--gb`` GB of page-aligned
memory into a new file of the scratch directory, fsync'd, one of three ways:

* ``cached``: through the page cache in 16 MiB writes (what DCP's ``FileSystemWriter`` does);
* ``direct-64``: ``O_DIRECT`` in 64 MiB writes;
* ``direct-1``: ``O_DIRECT`` in 1 MiB writes (fastinit's writer: ``fastinit.checkpoint.direct``);
* ``direct-N``: ``O_DIRECT`` in N MiB writes (``--ways``).

Meanwhile a neighbour does a trainer's per-step file work every 20 ms (30 KB written to a
temporary file and renamed over the last, a line appended to a log), timed. Reported per way:
the writers' wall and CPU seconds (the CPU is what they take from trainers on the host), and the
file work's latency (median before the writers start; median, 90th percentile and worst while
they write).
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

WAYS = ("cached", "direct-64", "direct-1")


def _fill(nbytes: int) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes)
    chunk = bytes(range(256)) * 4096
    for at in range(0, nbytes, len(chunk)):
        m[at : at + len(chunk)] = chunk[: nbytes - at]
    return m


def _writer(way: str, nbytes: int, path: str) -> dict[str, float]:
    from fastinit.checkpoint.direct import AlignedFile

    m = _fill(nbytes)
    print("ready", flush=True)
    sys.stdin.readline()
    c0, t0 = os.times(), time.perf_counter()
    if way == "cached":
        with open(path, "wb", buffering=0) as f:
            for at in range(0, nbytes, 16 << 20):
                f.write(memoryview(m)[at : at + (16 << 20)])
            os.fsync(f.fileno())
    else:
        out = AlignedFile(path, piece=int(way.split("-")[1]) << 20)
        out.write_data(memoryview(m), 0)
        out.close()
    c1 = os.times()
    return {
        "wall_s": time.perf_counter() - t0,
        "cpu_s": (c1.user + c1.system) - (c0.user + c0.system),
    }


def _child(cmd: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.checkpoint_blocking.neighbour", "--child", *cmd],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"child {cmd} did not start")
    return proc


def _say(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def _file_work(directory: str) -> float:
    t = time.perf_counter()
    tmp, final = os.path.join(directory, "losses.tmp"), os.path.join(directory, "losses.json")
    with open(tmp, "wb") as f:
        f.write(b"x" * 30_000)
    os.replace(tmp, final)
    with open(os.path.join(directory, "steps.log"), "a") as f:
        f.write("y" * 80 + "\n")
        f.flush()
    return time.perf_counter() - t


def one(way: str, nbytes: int, directory: str) -> dict[str, Any]:
    """Two writers of ``nbytes`` each, the ``way`` given, beside the two neighbours."""
    writers = [
        _child(["writer", way, str(nbytes), os.path.join(directory, f"w{k}.bin")]) for k in (0, 1)
    ]
    base = []
    for _ in range(40):
        base.append(_file_work(directory))
        time.sleep(0.02)
    for w in writers:
        _say(w, "go")
    during = []
    while any(w.poll() is None for w in writers):
        during.append(_file_work(directory))
        time.sleep(0.02)
    out = [json.loads(w.stdout.read()) for w in writers if w.stdout is not None]
    for k in (0, 1):
        os.unlink(os.path.join(directory, f"w{k}.bin"))
    during.sort()
    return {
        "way": way,
        "writers_wall_s": max(o["wall_s"] for o in out),
        "writers_cpu_s": sum(o["cpu_s"] for o in out),
        "file_work_base_ms": statistics.median(base) * 1e3,
        "file_work_ms": statistics.median(during) * 1e3,
        "file_work_p90_ms": during[max(0, math.ceil(0.9 * len(during)) - 1)] * 1e3,
        "file_work_max_ms": during[-1] * 1e3,
    }


def report(summary: dict[str, Any]) -> str:
    rows = [
        f"# A checkpoint writer's neighbours\n\nCommand: `{summary['command']}`; "
        f"{summary['started']} UTC; {summary['cpus']} CPUs; two writers of "
        f"{summary['gb']:g} GB each.\n",
        "| way | writers' wall s | writers' CPU s (both) | file work ms: median before "
        "| median | p90 | worst |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["runs"]:
        rows.append(
            f"| {r['way']} | {r['writers_wall_s']:.2f} | {r['writers_cpu_s']:.2f} "
            f"| {r['file_work_base_ms']:.1f} | {r['file_work_ms']:.1f} "
            f"| {r['file_work_p90_ms']:.1f} | {r['file_work_max_ms']:.1f} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        kind = argv[1]
        if kind != "writer":
            raise SystemExit(f"unknown child {kind!r}")
        print(json.dumps(_writer(argv[2], int(argv[3]), argv[4])), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--scratch", default=None, help="a directory on the disk to measure")
    p.add_argument("--results", default=None, help="summary.json and report.md here")
    args = p.parse_args(argv)
    nbytes = int(args.gb * 1e9) // 4096 * 4096
    started = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    runs = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as d:
        for _ in range(args.repeats):
            for way in args.ways.split(","):
                runs.append(one(way, nbytes, d))
                print(json.dumps(runs[-1]), flush=True)
    summary = {
        "command": " ".join(["python -m benchmarks.checkpoint_blocking.neighbour", *argv]),
        "started": started,
        "cpus": os.cpu_count(),
        "gb": args.gb,
        "runs": runs,
    }
    text = report(summary)
    print(text)
    if args.results:
        out = pathlib.Path(args.results)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        (out / "report.md").write_text(text)


if __name__ == "__main__":
    main()
