"""The checkpoint-heavy scenario: 1 GB of state per rank, saved every few seconds, a rank killed.

The ``ckpt`` model (:data:`benchmarks.ttfb.trainer.MODELS`: 8 tables of ~1M rows x 64, fp32, with
the fused row-wise Adagrad state: 2.1 GB, 1.04 GB per rank on 2 ranks) trains under torchrun
``--max-restarts 1`` and saves after every :attr:`Heavy.every` steps; after :attr:`Heavy.saves`
saves, its last rank is SIGKILLed (:mod:`benchmarks.ttfb.faults`) just before the next save is
due; torchrun restarts every worker, which resume from the latest checkpoint, train to the next
save and save once more. Three checkpointers run it, one after the other, each from the same
state of the scenario (:data:`CHECKPOINTERS`): stock-best (``dcp.async_save``, DCP's best stager
here), torch_checkpointing 0.1.1 (stock-best's start-up, its checkpoints), and fastinit
(``fastinit.checkpoint``: prepared staging buffers, a writer process, the host-memory tier).

Reported per checkpointer (:func:`analyse`, pure): every save's blocking (the slowest rank's)
and seconds per GB against a copy of the same bytes into a warm buffer (timed by every rank at
the end of its run); the median step while a save is being written against the median step with
none in flight; what the resume read from storage and from host memory; the time to recover
(kill to the first batch after the resume) and the losses of the steps trained twice (before the
kill and after the resume), which must be equal bit for bit. :func:`ett_at_scale` feeds the
blocking and the time to recover into the ETT model at 4,096 ranks.

**The interval.** A save's write must finish before the next save is due, or the next save
waits for it (and the comparison is with the disk, not the copy). Here a save of 1 GB per rank
(both ranks writing at once, fsync'd) takes fastinit's writer processes 4-6 s and stock-best's
writer thread 15-25 s (it shares the trainer's interpreter; the steps meanwhile take 0.1-0.2 s),
against a steady step of 0.03-0.05 s: a save every 300 steps leaves the slowest writer time to
finish before the next save and before the kill, so every checkpointer resumes from the save
before the kill. On a real host the steps are longer and the interval minutes (Young's, below);
the ratios that matter are the same.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "Heavy",
    "HEAVY",
    "MODEL",
    "CHECKPOINTERS",
    "read_run",
    "analyse",
    "summarize",
    "ett_at_scale",
    "section",
    "run",
    "main",
    "write",
]

#: The scenario's model (a key of :data:`benchmarks.ttfb.trainer.MODELS`).
MODEL = "ckpt"

#: label -> (trainer mode, trainer checkpointer).
CHECKPOINTERS: dict[str, tuple[str, str]] = {
    "stock-best": ("stock-best", "mode"),
    "torch_checkpointing": ("stock-best", "torch-checkpointing"),
    "fastinit": ("fastinit", "mode"),
}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Heavy:
    """The scenario's schedule."""

    every: int = 300
    """Save after every this many steps (see the module's docstring for why 300)."""
    saves: int = 3
    """Saves before the kill."""
    kill_before_next: int = 10
    """The rank is killed this many steps before the next save is due (its write is done)."""
    max_restarts: int = 1
    """torchrun's ``--max-restarts``."""
    skip_steps: int = 10
    """Steps after each (re)start left out of the step statistics (compilation, warm-up)."""
    timeout_s: float = 900.0
    """A run's limit: a restart that hangs (stock's torchrun restart can read the dead
    attempt's store keys: patches/torch) is counted as not recovered."""

    def __post_init__(self) -> None:
        if self.every < 2 or self.saves < 1 or not 0 < self.kill_before_next < self.every:
            raise ValueError("need every >= 2, saves >= 1, 0 < kill_before_next < every")

    @property
    def kill_step(self) -> int:
        """The step after which the last rank is killed."""
        return (self.saves + 1) * self.every - self.kill_before_next

    @property
    def steps(self) -> int:
        """Steps of the job: the restarted workers train to the next save and save it."""
        return (self.saves + 1) * self.every


HEAVY = Heavy()


# -- reading one run's files -----------------------------------------------------------------------


def _jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_run(out: str) -> dict[str, Any]:
    """What a run left in its trace directory besides the traces: every rank's save records and
    step records per attempt, and the first attempt's losses per rank."""
    saves: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    before: dict[int, dict[int, float]] = {}
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        stem, _, ext = name.partition(".")
        if ext not in ("json", "jsonl") or "-a" not in stem:
            continue
        kind, _, rest = stem.partition("-a")
        attempt, _, rank_s = rest.partition("-rank")
        if not (attempt.isdigit() and rank_s.isdigit()):
            continue
        rank = int(rank_s)
        if kind == "saves":  # a "saved" record per save, a "committed" one when it commits
            merged: dict[int, dict[str, Any]] = {}
            for r in _jsonl(path):
                if r.get("event") != "prepared":
                    merged.setdefault(int(r["step"]), {}).update(r)
            saves += [{**r, "attempt": int(attempt), "rank": rank} for r in merged.values()]
        elif kind == "steps":
            steps += [{**r, "attempt": int(attempt), "rank": rank} for r in _jsonl(path)]
        elif kind == "losses" and attempt == "0":
            with open(path) as f:
                before[rank] = {int(k): float(v) for k, v in json.load(f).items()}
    return {"saves": saves, "steps": steps, "before": before}


# -- analysis (pure) ---------------------------------------------------------------------------------


def _nan() -> float:
    return float("nan")


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else _nan()


def _per_save(
    saves: Sequence[Mapping[str, Any]], warm: Mapping[int, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """One row per save (attempt, step): the slowest rank's blocking, its seconds per GB, and
    that against the same rank's warm copy of its bytes."""
    by_save: dict[tuple[int, int], list[Mapping[str, Any]]] = {}
    for s in saves:
        by_save.setdefault((int(s["attempt"]), int(s["step"])), []).append(s)
    rows = []
    for (attempt, step), recs in sorted(by_save.items()):
        worst = max(recs, key=lambda r: float(r["blocking_s"]))
        rank = int(worst["rank"])
        w = warm.get(rank, {})
        nbytes = int(worst.get("staged_bytes") or w.get("bytes") or 0)
        warm_s = _median([float(x) for x in w.get("seconds", [])])
        gb = nbytes / 1e9
        blocking = float(worst["blocking_s"])
        rows.append(
            {
                "attempt": attempt,
                "step": step,
                "rank": rank,
                "blocking_s": blocking,
                "bytes": nbytes,
                "blocking_s_per_gb": blocking / gb if gb else _nan(),
                "warm_copy_s": warm_s,
                "warm_copy_s_per_gb": warm_s / gb if gb else _nan(),
                "vs_warm_copy": blocking / warm_s if warm_s == warm_s and warm_s else _nan(),
                "wait_before_s": max(float(r.get("wait_before_s", 0.0)) for r in recs),
                "wait_s": max(float(r.get("wait_s", _nan())) for r in recs),
                "commit_s": max(float(r.get("commit_s", _nan())) for r in recs),
                "stage_s": max(float(r.get("stage_s", _nan())) for r in recs),
                "copied_bytes": float(worst.get("copied_bytes", _nan())),
                "ahead_bytes": float(worst.get("ahead_bytes", _nan())),
                "agree_s": float(worst.get("agree_s", _nan())),
                "writer_s": max(float(r.get("writer_s", _nan())) for r in recs),
                "writer_cpu_s": max(float(r.get("writer_cpu_s", _nan())) for r in recs),
                "writer_paced_s": max(float(r.get("writer_paced_s", _nan())) for r in recs),
                "digest_s": max(float(r.get("digest_s", _nan())) for r in recs),
                "how": str(worst.get("how", "")),
            }
        )
    return rows


def _steps(steps: Sequence[Mapping[str, Any]], skip: int) -> dict[str, Any]:
    """The median step with a save being written (on any rank) against one with none, each
    step counted once as its slowest rank's, leaving out the first ``skip`` of each attempt."""
    by_step: dict[tuple[int, int], list[Mapping[str, Any]]] = {}
    for s in steps:
        by_step.setdefault((int(s["attempt"]), int(s["step"])), []).append(s)
    first = {a: min(st for (att, st) in by_step if att == a) for a, _ in by_step}
    writing, steady = [], []
    for (attempt, step), recs in by_step.items():
        if step - first[attempt] < skip:
            continue
        took = max(float(r["s"]) for r in recs)
        (writing if any(r.get("saving") for r in recs) else steady).append(took)
    w, s = _median(writing), _median(steady)
    return {
        "writing_step_s": w,
        "steady_step_s": s,
        "writing_vs_steady": w / s if s == s and s else _nan(),
        "writing_steps": len(writing),
        "steady_steps": len(steady),
    }


def analyse(
    recover: Mapping[str, Any],
    files: Mapping[str, Any],
    heavy: Heavy = HEAVY,
) -> dict[str, Any]:
    """One run of one checkpointer: ``recover`` is :func:`benchmarks.ttfb.analysis.
    analyse_recover` of the restarted workers' traces (with the kill, saves and losses),
    ``files`` :func:`read_run` of the run's directory."""
    warm: dict[int, Mapping[str, Any]] = {}
    reads: dict[int, Mapping[str, Any]] = {}
    for rank in recover["ranks"]:
        info = rank.get("bench", {})
        if "warm_copy" in info:
            warm[int(rank["rank"])] = info["warm_copy"]
        if "resume_read" in info:
            reads[int(rank["rank"])] = info["resume_read"]
    saves = _per_save(files["saves"], warm)
    return {
        "recover_s": recover["recover_s"],
        "restart_s": recover["restart_s"],
        "startup_s": recover["startup_s"],
        "resume_s": recover["resume_s"],
        "resumed_from_step": recover["resumed_from_step"],
        "losses_equal": recover["losses_equal"],
        "losses_compared": recover["losses_compared"],
        "saves": saves,
        "first_save_blocking_s": saves[0]["blocking_s"] if saves else _nan(),
        "median_blocking_s": _median([s["blocking_s"] for s in saves]),
        "max_vs_warm_copy": max((s["vs_warm_copy"] for s in saves), default=_nan()),
        **_steps(files["steps"], heavy.skip_steps),
        "storage_bytes": sum(int(r.get("storage_bytes", 0)) for r in reads.values()),
        "memory_bytes": sum(int(r.get("memory_bytes", 0)) for r in reads.values()),
        "resume_how": str(recover["ranks"][0].get("bench", {}).get("resume_how", "")),
        "stages_s": dict(recover["stages_s"]),
    }


_KEYS = (
    "recover_s",
    "restart_s",
    "startup_s",
    "resume_s",
    "first_save_blocking_s",
    "median_blocking_s",
    "max_vs_warm_copy",
    "writing_step_s",
    "steady_step_s",
    "writing_vs_steady",
    "storage_bytes",
    "memory_bytes",
)


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one checkpointer; every save of every repeat kept."""
    out: dict[str, Any] = {k: _median([float(r[k]) for r in runs]) for k in _KEYS}
    out.update(
        repeats=len(runs),
        recover_all_s=[r["recover_s"] for r in runs],
        saves=[dict(s, repeat=i) for i, r in enumerate(runs) for s in r["saves"]],
        losses_equal=all(r["losses_equal"] for r in runs),
        losses_compared=sum(int(r["losses_compared"]) for r in runs),
        resumed_from_step=runs[0]["resumed_from_step"],
        resume_how=runs[0]["resume_how"],
        stages_s={
            k: _median([float(r["stages_s"].get(k, 0.0)) for r in runs])
            for k in runs[0]["stages_s"]
        },
    )
    return out


# -- ETT at scale ---------------------------------------------------------------------------------

#: Meta's quoted mean time between failures of a 1,024-GPU job (Kokolis et al., 2024), hours.
MTBF_1024_H = 7.9
#: The job the ETT model prices: ranks (a GPU each).
RANKS = 4096


def ett_at_scale(
    blocking_s: float, recover_s: float, ranks: int = RANKS, mtbf_1024_h: float = MTBF_1024_H
) -> dict[str, float]:
    """ETT% of a ``ranks``-rank job whose mean time between failures is the 1,024-GPU one scaled
    by 1,024 / ``ranks`` (failures independent per GPU), checkpointing at Young's interval with
    the measured blocking per save and paying the measured time to recover per failure."""
    from benchmarks.ttfb.ett import DAY_S, JobProfile, ett, optimal_interval

    mtbf_s = mtbf_1024_h * 3600.0 * 1024 / ranks
    profile = JobProfile(
        time_to_start_s=recover_s,
        failures_per_day=DAY_S / mtbf_s,
        checkpoint_blocking_s=blocking_s,
    )
    day = ett(profile)
    return {
        "ranks": float(ranks),
        "mtbf_h": mtbf_s / 3600.0,
        "failures_per_day": DAY_S / mtbf_s,
        "interval_s": optimal_interval(profile),
        "ett_pct": day.ett_pct,
        "restart_s_per_day": day.restart_s,
        "unsaved_s_per_day": day.unsaved_s,
        "blocking_s_per_day": day.blocking_s,
    }


# -- report ----------------------------------------------------------------------------------------


def _f(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def targets(heavy: Mapping[str, Any]) -> list[tuple[str, float, float]]:
    """``(what, measured, limit)`` of the scenario's targets (met: measured <= limit)."""
    fast, best = heavy.get("fastinit"), heavy.get("stock-best")
    out: list[tuple[str, float, float]] = []
    if fast is None:
        return out
    for s in fast["saves"]:
        out.append(
            (
                f"checkpoint-heavy: fastinit save at step {s['step']} (attempt {s['attempt']}, "
                f"repeat {s['repeat']}): blocking / warm copy",
                s["vs_warm_copy"],
                2.0,
            )
        )
    if best is not None:
        by = {(s["repeat"], s["attempt"], s["step"]): s for s in best["saves"]}
        for s in fast["saves"]:
            b = by.get((s["repeat"], s["attempt"], s["step"]))
            if b is not None and b["blocking_s"]:
                out.append(
                    (
                        f"checkpoint-heavy: fastinit save at step {s['step']} (attempt "
                        f"{s['attempt']}, repeat {s['repeat']}): blocking / stock-best's",
                        s["blocking_s"] / b["blocking_s"],
                        0.5,
                    )
                )
    out.append(
        (
            "checkpoint-heavy: fastinit median step while a save is written / steady step",
            fast["writing_vs_steady"],
            1.15,
        )
    )
    out.append(
        ("checkpoint-heavy: fastinit bytes read from storage at resume", fast["storage_bytes"], 0)
    )
    if best is not None:
        out.append(
            (
                "checkpoint-heavy: time to recover, fastinit / stock-best",
                fast["recover_s"] / best["recover_s"],
                0.5,
            )
        )
    return out


def _labels(heavy: Mapping[str, Any]) -> list[str]:
    return [label for label in CHECKPOINTERS if label in heavy]


def section(summary: Mapping[str, Any]) -> str:
    """The report's section on the checkpoint-heavy scenario."""
    from benchmarks.ttfb.report import stock_restart_text

    heavy = summary.get("heavy") or {}
    results = heavy.get("results") or {}
    labels = _labels(results)
    if not labels:
        return ""
    plan = heavy.get("plan", {})
    head = [
        "\n## Checkpoint-heavy: 1 GB of state per rank, saved every few seconds, a rank killed\n",
        f"The `{MODEL}` model ({heavy.get('state_mb', 0):.0f} MB of state per rank, 2 ranks) "
        f"trains under torchrun `--max-restarts {plan.get('max_restarts')}`, saving after every "
        f"{plan.get('every')} steps; after {plan.get('saves')} saves its last rank is SIGKILLed "
        f"after step {plan.get('kill_step')} (the last save's write done), torchrun restarts "
        f"every worker, they resume from the latest checkpoint, train to step "
        f"{plan.get('steps')} and save it. Why {plan.get('every')} steps: a save's write (1 GB "
        "per rank, both ranks at once, fsync'd) must finish before the next is due "
        "(`benchmarks/ttfb/heavy.py`). Medians of the runs that came back ("
        + ", ".join(f"{lb}: {results[lb]['repeats']}" for lb in labels)
        + "); every save of every run below. "
        + stock_restart_text(summary.get("config", {}))
        + "\n",
        "| | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]

    def row(name: str, key: str, digits: int = 2, scale: float = 1.0) -> str:
        cells = [_f(float(results[lb][key]) * scale, digits) for lb in labels]
        return f"| {name} | " + " | ".join(cells) + " |"

    rows = [
        row("time to recover s (kill → first batch after the resume)", "recover_s"),
        row("  kill → restarted processes s", "restart_s"),
        row("  their start-up to the first batch s", "startup_s"),
        row("  of which the load s", "resume_s"),
        row("read from storage at resume MB (both ranks)", "storage_bytes", 0, 1e-6),
        row("read from host memory at resume MB (both ranks)", "memory_bytes", 0, 1e-6),
        row("first save's blocking s", "first_save_blocking_s", 3),
        row("median save's blocking s", "median_blocking_s", 3),
        row("worst save's blocking / warm copy", "max_vs_warm_copy"),
        row("median step while a save is written s", "writing_step_s", 3),
        row("median step with none in flight s", "steady_step_s", 3),
        row("step while written / steady", "writing_vs_steady"),
    ]
    text = [*head, *rows, ""]
    for lb, fails in (heavy.get("not_recovered") or {}).items():
        text.append(
            f"**{lb}: {len(fails)} run(s) did not recover** (not in the medians): "
            + "; ".join(f"run {f['repeat']}: {f['outcome']}" for f in fails)
            + ".\n"
        )
    text.append(
        "How each saves and resumes: "
        + "; ".join(
            f"**{lb}**: {results[lb]['saves'][0]['how'] if results[lb]['saves'] else '–'}, "
            f"resumed with {results[lb]['resume_how']}"
            for lb in labels
        )
        + ".\n"
    )
    text.append(
        "Losses after the resume against the same steps trained before the kill: "
        + "; ".join(
            f"{lb}: {results[lb]['losses_compared']} compared, "
            + ("all equal bit for bit" if results[lb]["losses_equal"] else "**not all equal**")
            for lb in labels
        )
        + ".\n"
    )
    text.append(
        "\nEvery save (the slowest rank's blocking; warm copy: the same rank's copy of its "
        "bytes into a warm buffer, median of 3 at the end of its run; wait: the verdict or "
        "the future before the next save; peers s: of the blocking, the slowest rank's wait in "
        "the save's start message for the last rank to arrive; writer s: from the job to its "
        "report, of which paced s asleep to keep to `FASTINIT_CHECKPOINT_WRITE_RATE`; copied MB: what "
        "the staging copy moved (fastinit copies only the rows trained since its buffer's last "
        "copy, where few enough were); ahead MB: the touched rows fastinit copied into that buffer "
        "off the loop since the previous save; commit: from the save to its commit):\n"
    )
    text.append(
        "| checkpointer | run | attempt | step | blocking s | s / GB | warm copy s | "
        "blocking / warm copy | peers s | staging copy s | copied MB | ahead MB | writer s | "
        "paced s | writer CPU s | checksums s | commit s |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for lb in labels:
        for s in results[lb]["saves"]:
            text.append(
                f"| {lb} | {s['repeat']} | {s['attempt']} | {s['step']} "
                f"| {_f(s['blocking_s'], 3)} | {_f(s['blocking_s_per_gb'], 3)} "
                f"| {_f(s['warm_copy_s'], 3)} | **{_f(s['vs_warm_copy'])}** "
                f"| {_f(s.get('agree_s', _nan()), 3)} "
                f"| {_f(s['stage_s'], 3)} | {_f(s.get('copied_bytes', _nan()) / 1e6, 0)} "
                f"| {_f(s.get('ahead_bytes', _nan()) / 1e6, 0)} "
                f"| {_f(s['writer_s'])} "
                f"| {_f(s.get('writer_paced_s', _nan()))} "
                f"| {_f(s.get('writer_cpu_s', _nan()))} | {_f(s['digest_s'])} "
                f"| {_f(s['commit_s'])} |"
            )
    text.append("")
    ett_rows = heavy.get("ett") or {}
    if ett_rows:
        any_row = next(iter(ett_rows.values()))
        text.append(
            f"\n**ETT at {any_row['ranks']:,.0f} ranks** (MTBF {MTBF_1024_H} h at 1,024 GPUs, as "
            f"quoted from Meta (Kokolis et al., 2024), scaled to {any_row['mtbf_h']:.2f} h: "
            f"{any_row['failures_per_day']:.1f} failures a day), each checkpointer at Young's "
            "interval sqrt(2 × blocking × MTBF) with its measured median blocking per save, "
            "paying its measured time to recover per failure (this host's; at scale the restart "
            "is the projected one, `make projection`):\n"
        )
        text.append(
            "| checkpointer | blocking s | time to recover s | Young's interval s "
            "| restarts s/day | unsaved work s/day | blocking s/day | ETT % |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|"
        )
        for lb in labels:
            e = ett_rows.get(lb)
            if e is None:
                continue
            text.append(
                f"| {lb} | {_f(results[lb]['median_blocking_s'], 3)} "
                f"| {_f(results[lb]['recover_s'], 1)} | {_f(e['interval_s'], 0)} "
                f"| {_f(e['restart_s_per_day'], 0)} | {_f(e['unsaved_s_per_day'], 0)} "
                f"| {_f(e['blocking_s_per_day'], 0)} | **{_f(e['ett_pct'], 3)}** |"
            )
        if "fastinit" in ett_rows and "stock-best" in ett_rows:
            gain = ett_rows["fastinit"]["ett_pct"] - ett_rows["stock-best"]["ett_pct"]
            text.append(
                f"\nfastinit against stock-best: **{gain:+.3f} ETT points** "
                f"({gain / 100 * 86_400:+.0f} s of training a day per job).\n"
            )
    stages = [lb for lb in labels if results[lb].get("stages_s")]
    if stages:
        names = list(dict.fromkeys(n for lb in stages for n in results[lb]["stages_s"]))
        text.append(
            "\nThe restarted workers' start-up stages (s, median; fastinit's overlap, "
            "`checkpoint_prepare` adopts the buffers a killed predecessor left, and allocates "
            "and fills the others on a thread of its own):\n"
        )
        text.append("| stage | " + " | ".join(stages) + " |")
        text.append("|---|" + "---:|" * len(stages))
        for n in names:
            text.append(
                f"| {n} | "
                + " | ".join(_f(results[lb]["stages_s"].get(n, _nan())) for lb in stages)
                + " |"
            )
        text.append("")
    return "\n".join(text)


# -- running it ------------------------------------------------------------------------------------


def run(
    config: Any,
    heavy: Heavy = HEAVY,
    labels: Sequence[str] = tuple(CHECKPOINTERS),
    model: str = MODEL,
) -> dict[str, Any]:
    """Every checkpointer of ``labels``, ``config.heavy_repeats`` times (rotating their order),
    on ``model`` (another than :data:`MODEL` only for tests); the summary's ``heavy`` entry."""
    from benchmarks.ttfb.analysis import analyse_recover
    from benchmarks.ttfb.faults import KillAt, read_kill
    from benchmarks.ttfb.launch import RunSpec, run_trainer
    from benchmarks.ttfb.scenarios import Layout, prepare

    labels = list(labels)
    runs: dict[str, list[dict[str, Any]]] = {lb: [] for lb in labels}
    failed: dict[str, list[dict[str, Any]]] = {lb: [] for lb in labels}
    caches = os.path.join(config.out, "caches", model)
    for r in range(config.heavy_repeats):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            mode, checkpointer = CHECKPOINTERS[label]
            layout = Layout(root=os.path.join(caches, label), mode=mode)
            prepare(layout, "recover")  # caches kept, no checkpoint of an earlier job
            out = os.path.join(config.out, "runs", model, "checkpoint-heavy", label, f"r{r}")
            kill_file = os.path.abspath(os.path.join(out, "kill.json"))
            kill = KillAt(rank=config.nproc - 1, step=heavy.kill_step, record=kill_file)
            spec = RunSpec.in_layout(
                layout,
                data_root=config.out,
                mode=mode,
                model=model,
                cache="recover",
                out=out,
                nproc=config.nproc,
                batch_size=config.batch_size,
                compile=config.compile,
                launcher=config.launcher,
                timeout_s=min(config.timeout_s, heavy.timeout_s),
                steps=heavy.steps,
                checkpoint_dir=layout.checkpoint_dir,
                checkpoint_every=heavy.every,
                checkpointer=checkpointer,
                max_restarts=heavy.max_restarts,
                store_per_round=config.store_per_round(mode),
                env=kill.env(),
            )
            t = time.monotonic()
            try:
                paths = run_trainer(spec)
            except RuntimeError as e:  # a restart that did not come back: counted, not fatal
                outcome = "hang" if "timed out" in str(e) else "failed"
                print(
                    f"  {model:<7}{'ckpt-heavy':<11}{label:<20}r{r}  NOT RECOVERED ({outcome}; "
                    f"run {time.monotonic() - t:.0f} s): {e}",
                    flush=True,
                )
                failed[label].append({"repeat": r, "outcome": outcome, "detail": str(e)})
                _clear(layout.checkpoint_dir)
                continue
            if not os.path.exists(kill_file):
                raise RuntimeError(f"checkpoint-heavy {label}: no rank was killed ({kill_file})")
            files = read_run(out)
            last = [s for s in files["saves"] if int(s["attempt"]) == 0 and "commit_s" in s]
            recover = analyse_recover(paths, read_kill(kill_file), last, files["before"])
            for rank, trace_rank in zip(recover["ranks"], _benches(paths), strict=True):
                rank["bench"] = trace_rank
            recover["stages_s"] = _stages(paths)
            result = analyse(recover, files, heavy)
            runs[label].append(result)
            print(
                f"  {model:<7}{'ckpt-heavy':<11}{label:<20}r{r}  recovered "
                f"{result['recover_s']:6.1f} s, saves blocked "
                + ", ".join(f"{s['blocking_s']:.3f}" for s in result["saves"])
                + f" s; step while written / steady {result['writing_vs_steady']:.2f}; "
                f"resume read {result['storage_bytes'] / 1e6:.0f} MB storage, "
                f"{result['memory_bytes'] / 1e6:.0f} MB memory (run {time.monotonic() - t:.0f} s)",
                flush=True,
            )
            _clear(layout.checkpoint_dir)
    results = {lb: summarize(rs) for lb, rs in runs.items() if rs}
    state = [s["bytes"] for res in results.values() for s in res["saves"] if s.get("bytes")]
    return {
        "plan": {**dataclasses.asdict(heavy), "kill_step": heavy.kill_step, "steps": heavy.steps},
        "state_mb": max(state, default=0) / 1e6,
        "results": results,
        "not_recovered": {lb: f for lb, f in failed.items() if f},
        "ett": {
            lb: ett_at_scale(res["median_blocking_s"], res["recover_s"])
            for lb, res in results.items()
        },
    }


def _stages(paths: Sequence[str]) -> dict[str, float]:
    """The restarted workers' start-up stages with the load and the staging preparation:
    seconds, max over ranks, in the order they started."""
    from benchmarks.ttfb.analysis import TIMELINE
    from fastinit.report import load

    names = (*TIMELINE, "resume", "checkpoint_prepare")
    out: dict[str, tuple[float, float]] = {}
    for trace in load(paths):
        for e in trace.events:
            if e.get("kind") == "span" and e["name"] in names:
                ts, dur = float(e["ts"]), float(e["dur"]) / 1e6
                old = out.get(e["name"])
                out[e["name"]] = (min(ts, old[0]), max(dur, old[1])) if old else (ts, dur)
    return {k: v[1] for k, v in sorted(out.items(), key=lambda kv: kv[1][0])}


def _benches(paths: Sequence[str]) -> list[dict[str, Any]]:
    from fastinit.report import load

    return [dict(t.bench or {}) for t in load(paths)]


def _clear(path: str) -> None:
    """Free the disk a run's checkpoints took (several GB)."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# -- on its own ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m benchmarks.ttfb.heavy --out DIR [--results DIR]``: the scenario alone (``make
    bench`` runs it inside the suite), its summary.json and report.md in ``--results``."""
    import argparse
    import platform
    import sys

    from benchmarks.ttfb.data import DatasetConfig, ensure_dataset
    from benchmarks.ttfb.main import STOCK_RESTARTS, BenchConfig
    from benchmarks.ttfb.trainer import model_spec

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="bench-out/heavy")
    parser.add_argument("--results", default=None, help="summary.json and report.md here")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--labels", default=",".join(CHECKPOINTERS), help="checkpointers")
    parser.add_argument("--compile", action="store_true", help="compile the dense arch")
    parser.add_argument(
        "--stock-restart",
        choices=STOCK_RESTARTS,
        default="store-per-round",
        help="stock's restarts: a store per rendezvous round (torch's workaround) or torchrun's "
        "shared store",
    )
    args = parser.parse_args(argv)
    config = BenchConfig(
        models=(),
        out=args.out,
        launcher="torchrun",
        compile=args.compile,
        heavy_repeats=args.repeats,
        stock_restart=args.stock_restart,
    )
    start = time.time()
    load_start = list(os.getloadavg())
    ensure_dataset(DatasetConfig(spec=model_spec(MODEL)), os.path.join(config.out, "data"))
    heavy = run(config, labels=[lb for lb in args.labels.split(",") if lb])
    command = " ".join(["python -m benchmarks.ttfb.heavy", *argv])
    summary = {
        "command": command,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(start)),
        "wall_s": time.time() - start,
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_at_start": load_start,
            "load_avg_at_end": list(os.getloadavg()),
            "python": platform.python_version(),
        },
        "config": {
            "nproc": config.nproc,
            "compile": config.compile,
            "stock_restart": config.stock_restart,
        },
        "heavy": heavy,
    }
    write(summary, args.results)
    return summary


def write(summary: Mapping[str, Any], results: str | None) -> str:
    """The report of a :func:`main` summary (printed; with ``results``: summary.json and
    report.md there)."""
    from benchmarks.ttfb.report import Target, format_targets

    heavy = summary["heavy"]
    machine = summary["machine"]
    ts = [
        Target(w, float(m), float(lim), float(m) <= lim) for w, m, lim in targets(heavy["results"])
    ]
    text = [
        "# Checkpoint-heavy scenario\n",
        f"Command: `{summary['command']}`; started {summary['started']} UTC, "
        f"{summary['wall_s']:.0f} s; {machine['cpus']} CPUs, load average "
        f"{machine['load_avg_at_start'][0]:.1f} at the start, {machine['load_avg_at_end'][0]:.1f} "
        f"at the end; dense arch {'compiled' if summary['config']['compile'] else 'eager'}.\n",
        "## Targets\n",
        format_targets(ts),
        section(summary),
    ]
    print("\n".join(text), flush=True)
    if results:
        os.makedirs(results, exist_ok=True)
        with open(os.path.join(results, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1, default=str)
        with open(os.path.join(results, "report.md"), "w") as f:
            f.write("\n".join(text) + "\n")
    return "\n".join(text)


if __name__ == "__main__":
    main()
