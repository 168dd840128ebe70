"""The blocking benchmark's report: its targets and tables, from the summary (pure)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Target", "SAVERS", "targets", "format_targets", "format_saves", "markdown", "write"]

#: The savers, as the summary keys them, and their names in the report.
SAVERS: tuple[tuple[str, str], ...] = (
    ("fastinit", "fastinit"),
    ("stock_best", "stock-best"),
    ("torch_checkpointing", "torch_checkpointing"),
)

#: Every save's blocking at most this many warm copies of the same bytes.
WARM_LIMIT = 2.0
#: fastinit's blocking at most this share of stock-best's, save by save.
STOCK_LIMIT = 0.5
#: The checksums' share of a same-plan load from storage.
VERIFY_LIMIT = 0.10


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    what: str
    measured: float
    limit: float
    met: bool


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def targets(summary: Mapping[str, Any]) -> list[Target]:
    """The targets, checked on one summary."""
    out: list[Target] = []
    fast = summary.get("fastinit") or []
    for s in fast:
        out.append(
            Target(
                f"fastinit save {s['save']}: blocking / warm copy",
                _num(s["vs_warm_copy"]),
                WARM_LIMIT,
                False,
            )
        )
    stock = {s["save"]: s for s in summary.get("stock_best") or []}
    for s in fast:
        b = stock.get(s["save"])
        if b is not None and b["blocking_s"]:
            out.append(
                Target(
                    f"fastinit save {s['save']}: blocking / stock-best's",
                    s["blocking_s"] / b["blocking_s"],
                    STOCK_LIMIT,
                    False,
                )
            )
    load = (summary.get("load") or {}).get("storage")
    if load and load.get("verify_share") is not None:
        out.append(
            Target(
                "same-plan load from storage: checksum seconds / load seconds",
                float(load["verify_share"]),
                VERIFY_LIMIT,
                False,
            )
        )
    return [dataclasses.replace(t, met=t.measured <= t.limit) for t in out]


def _f(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def format_targets(ts: Sequence[Target]) -> str:
    lines = ["| target | measured | limit | met |", "|---|---:|---:|---|"]
    lines += [
        f"| {t.what} | {t.measured:.2f} | ≤ {t.limit:.2f} | {'yes' if t.met else '**no**'} |"
        for t in ts
    ]
    return "\n".join(lines) + "\n"


def format_saves(summary: Mapping[str, Any]) -> str:
    """Every save of every saver: blocking, per GB, against the warm copy timed before it."""
    head = (
        "| saver | save | blocking s | s / GB | warm copy s (just before) | blocking / warm copy "
        "| staging copy s | copied MB | ahead MB | writer s | checksums s | written (wait) s |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for key, name in SAVERS:
        for s in summary.get(key) or []:
            done = s.get("wait_s", s.get("written_s"))
            copied = s.get("copied_bytes")
            ahead = s.get("ahead_bytes")
            lines.append(
                f"| {name} | {s['save']} | {_f(s['blocking_s'])} | {_f(s['blocking_s_per_gb'])} "
                f"| {_f(s['warm_copy_s'])} | **{_f(s['vs_warm_copy'], 2)}** "
                f"| {_f(s.get('stage_s'))} | {_f(None if copied is None else copied / 1e6, 0)} "
                f"| {_f(None if ahead is None else ahead / 1e6, 0)} "
                f"| {_f(s.get('writer_s'), 2)} | {_f(s.get('digest_s'), 2)} | {_f(done, 2)} |"
            )
    return head + "\n".join(lines) + "\n"


def _opt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def _limits(summary: Mapping[str, Any]) -> str:
    lim = summary["limits"]
    gb = summary["bytes"] / 1e9
    warm = statistics.median(lim["warm_copy_s"])
    fresh = statistics.median(lim["fresh_copy_s"])
    f = lim["file"]
    return (
        "| limit | seconds | GB/s | CPU s |\n|---|---:|---:|---:|\n"
        f"| copy into a warm buffer (median of {len(lim['warm_copy_s'])}) | {warm:.3f} "
        f"| {gb / warm:.1f} | |\n"
        f"| copy into fresh memory (median of {len(lim['fresh_copy_s'])}) | {fresh:.3f} "
        f"| {gb / fresh:.1f} | |\n"
        f"| file write + fsync, through the page cache | {f['write_s']:.2f} "
        f"| {f['write_gb_s']:.2f} | {_opt(f.get('write_cpu_s'))} |\n"
        f"| file write + fsync, O_DIRECT (fastinit's writer) | {_opt(f.get('direct_write_s'))} "
        f"| {_opt(f.get('direct_write_gb_s'))} | {_opt(f.get('direct_write_cpu_s'))} |\n"
        f"| file read, page cache dropped | {f['read_device_s']:.2f} "
        f"| {f['read_device_gb_s']:.2f} | |\n"
        f"| file read, from the page cache | {f['read_cache_s']:.2f} "
        f"| {f['read_cache_gb_s']:.2f} | |\n"
    )


def _loads(summary: Mapping[str, Any]) -> str:
    head = (
        "| load | mode | tier | seconds | checksums s | checksums / load | from storage MB "
        "| from memory MB |\n|---|---|---|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for name, r in (summary.get("load") or {}).items():
        lines.append(
            f"| {name} | {r['mode']} | {r['tier']} | {r['seconds']:.2f} | {r['verify_s']:.3f} "
            f"| {_f(r['verify_share'], 3)} | {r['storage_bytes'] / 1e6:.0f} "
            f"| {r['memory_bytes'] / 1e6:.0f} |"
        )
    return head + "\n".join(lines) + "\n"


def markdown(summary: Mapping[str, Any], command: str = "") -> str:
    """``report.md``."""
    cfg = summary["config"]
    m = summary["machine"]
    v = summary["versions"]
    stock = summary.get("stock_best_info") or {}
    tc = summary.get("torch_checkpointing_info") or {}
    refusals = "; ".join(
        f"`{name}`: " + (f"refused ({why})" if why else "accepted")
        for name, why in (stock.get("dcp_stagers") or {}).items()
    )
    text = [
        "# Checkpoint blocking: fastinit, stock-best and torch_checkpointing against the limits\n",
        f"{summary['date']}; one rank on {summary['device']}; {cfg['tables']} tables x "
        f"{cfg['rows']:,} rows x {cfg['dim']} (fp32) with their fused row-wise Adagrad state: "
        f"**{summary['bytes'] / 1e6:.0f} MB** per save; {cfg['saves']} saves per saver, "
        f"{cfg.get('steps', 0)} training steps (256 samples) before each; "
        f"{m['cpus']} CPUs, load average {m['load_avg_at_start'][0]:.1f} at the start, "
        f"{m.get('load_avg_at_end', [math.nan])[0]:.1f} at the end; torch {v.get('torch')}, "
        f"torchrec {v.get('torchrec')}, torch_checkpointing {v.get('torch_checkpointing')}.\n",
        f"Command: `{command}`\n" if command else "",
        "## Targets\n",
        format_targets(targets(summary)),
        "\n## The limits (same process, same bytes)\n",
        _limits(summary),
        "\n## Every save\n",
        "blocking: what the call held the loop (fastinit: `save`; stock-best: `dcp.async_save`; "
        "torch_checkpointing: `save` and the wait its staging lock imposes on the next in-place "
        "update). Each save is set against a warm copy of the same bytes timed just before it "
        "(the machine's load moves both). writer s and checksums s: fastinit's writer process "
        "(files written, fsync'd, hashed, manifest); written: until the save is durable "
        "(fastinit: `wait`, the verdict). copied MB: what fastinit's staging copy moved: only "
        "the rows the steps since its buffer's last copy (or `prepare`'s fill) touched, where few "
        "enough were "
        "(fastinit/checkpoint/touched.py); the other savers copy every byte. ahead MB: the "
        "touched rows fastinit copied into the buffer ahead of the save, off the loop, since the "
        "previous save (`FASTINIT_CHECKPOINT_AHEAD`).\n",
        format_saves(summary),
        f"\nfastinit's `prepare` (buffers allocated and filled with the state, the writer "
        "started; off the loop): "
        f"{summary['prepare_s']:.2f} s; staging writer: {summary['staging']['writer']}, "
        f"{summary['staging']['allocated_bytes'] / 1e6:.0f} MB of buffers.\n",
        f"\n**stock-best**: {stock.get('how', 'not run')}. DCP's own stagers on TorchRec's state "
        f"here: {refusals or '–'}.\n",
        "\n**torch_checkpointing**: "
        + (
            tc["skipped"]
            if "skipped" in tc
            else f"{tc.get('how', 'not run')}; its prewarm and writer start (off the loop) "
            f"{_f(tc.get('prepare_s'), 2)} s. TorchRec's state as it is (a ShardedTensor per "
            "table): "
            + (f"refused ({tc['sharded_tensor']})" if tc.get("sharded_tensor") else "accepted")
            + "."
        )
        + "\n",
        "\n## Loads of the last fastinit checkpoint\n",
        "Same plan from storage (host-memory tier off, the files' page cache dropped), same plan "
        "from the host-memory tier, and resharded (every table in two column shards) from "
        "storage; checksums: `LoadReport.verify_s`.\n",
        _loads(summary),
    ]
    return "\n".join(text)


def write(summary: Mapping[str, Any], directory: str, command: str = "") -> None:
    """``summary.json`` and ``report.md`` in ``directory``."""
    with open(os.path.join(directory, "summary.json"), "w") as f:
        json.dump(
            {**summary, "targets": [dataclasses.asdict(t) for t in targets(summary)]},
            f,
            indent=1,
            default=str,
        )
    with open(os.path.join(directory, "report.md"), "w") as f:
        f.write(markdown(summary, command))
