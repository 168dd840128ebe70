"""Every environment knob fastinit reads, in one place.

Each knob is read when it is used (never cached at import), and each has an override context
manager that restores the previous value in ``finally``, for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

__all__ = [
    "KNOBS",
    "get_plan_cache",
    "get_trace_dir",
    "get_compile_cache",
    "get_collective_timeout",
    "get_init_timeout",
    "check_seconds",
    "get_torchrec_src",
    "get_port_check",
    "get_vec_isa_record",
    "get_checkpoint_staging",
    "get_checkpoint_tier",
    "get_checkpoint_write_rate",
    "get_checkpoint_delta",
    "get_restart_zygote",
    "get_restart_preload",
    "override",
    "markdown_table",
]

#: name -> one-line description; the README's table is generated from these words
#: (:func:`markdown_table`, ``python -m fastinit.knobs --markdown``) and tested against them.
KNOBS: dict[str, str] = {
    "FASTINIT_PLAN_CACHE": "Directory of the plan cache used when `setup(plan_cache=None)`.",
    "FASTINIT_TRACE_DIR": "When set (and no tracer is running), every `fastinit.setup` call traces "
    "itself (spans, c10d ops, groups, store ops) and writes `trace-rank<N>.jsonl` here.",
    "FASTINIT_COMPILE_CACHE": "Directory of the compiled-artifact cache used by `fastinit.warmup`.",
    "FASTINIT_COLLECTIVE_TIMEOUT": "Seconds a start-up collective may wait for a peer before every "
    "rank raises (default 300; a finite number in (0, 86400]).",
    "FASTINIT_INIT_TIMEOUT": "Seconds `fastinit.init_process_group` may take in all under torchrun or "
    "torchx (agreeing on the restart round, the store, the backend's connections: NCCL's "
    "communicator too, on a group bound to its device) before the worker raises, or exits with "
    "code 124 where torch cannot be interrupted (default 600, torch's NCCL timeout; a finite "
    "number in (0, 86400]).",
    "FASTINIT_TORCHREC_SRC": "A TorchRec source tree at the installed version: `make peer` runs its "
    "model-parallel tests with `fastinit.setup` swapped in, and so does a slow test.",
    "FASTINIT_PORT_CHECK": "What a TorchRec/torch function fastinit mirrors whose installed source "
    "matches no registered hash (fastinit/ports.py) does: `error` (default: a "
    "`CompatibilityError` naming it), `warn` (one warning, then run anyway) or `off`.",
    "FASTINIT_VEC_ISA_RECORD": "`off` stops `fastinit.warmup` from keeping Inductor's CPU "
    "vector-ISA probe result in the compile cache's root (default `on`: a warm restart answers "
    "the probe from that record instead of compiling and loading test libraries).",
    "FASTINIT_CHECKPOINT_STAGING": "How `fastinit.checkpoint.save` stages and writes: `process` "
    "(default: reusable buffers in /dev/shm, written by a writer process per rank that outlives "
    "the trainer), `thread` (reusable buffers in the trainer's memory, written by a thread of "
    "it) or `off` (a fresh copy per save, freed once written).",
    "FASTINIT_CHECKPOINT_TIER": "The host-memory tier: `on` (default: the latest committed "
    "save's staging buffer stays in /dev/shm, and a worker restarted on the same host loads from "
    "it), `off` (no tier: one staging buffer per rank, two with `FASTINIT_CHECKPOINT_AHEAD`; "
    "loads read storage), or the largest buffer kept, "
    "in bytes (`8G`, `512M`).",
    "FASTINIT_CHECKPOINT_WRITE_RATE": "The most bytes per second a rank's writer writes a save at "
    "while its trainer trains on (default `256M`; `max`: as fast as the disk goes). Waiting for "
    "the save, or a trainer gone, lifts it.",
    "FASTINIT_CHECKPOINT_DELTA": "`on` (default): a save copies only the rows of fused CPU "
    "tables that training touched since its buffer's last copy (fastinit/checkpoint/touched.py); "
    "`off`: every save copies the whole state.",
    "FASTINIT_CHECKPOINT_AHEAD": "`on` (default, with `FASTINIT_CHECKPOINT_DELTA=on`): between "
    "saves, a thread copies the rows training touched into the staging buffer the next save "
    "takes, so that save copies only the rows of its last steps; "
    "it costs one more staging buffer (three with the tier: the state's size once more in "
    "/dev/shm). `off`: no copy ahead, no extra buffer.",
    "FASTINIT_RESTART_ZYGOTE": "`on` (default): a worker launched with `python -m fastinit.restart` "
    "under torchrun leaves a zygote per local rank that forks its restarted successor with the "
    "preload modules already imported; `off`: every restart starts a fresh interpreter.",
    "FASTINIT_RESTART_PRELOAD": "Comma-separated modules the zygote imports before it forks "
    "(default `torch,torchrec`); a module that fails to import is left to the worker.",
}


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def get_plan_cache() -> str | None:
    """Directory of the plan cache, or None."""
    return _get("FASTINIT_PLAN_CACHE")


def get_trace_dir() -> str | None:
    """Directory the per-rank trace files are written to, or None (tracing off)."""
    return _get("FASTINIT_TRACE_DIR")


def get_compile_cache() -> str | None:
    """Directory of the compiled-artifact cache, or None."""
    return _get("FASTINIT_COMPILE_CACHE")


def get_torchrec_src() -> str | None:
    """A TorchRec source tree for the peer suite, or None."""
    return _get("FASTINIT_TORCHREC_SRC")


def get_port_check() -> str:
    """``error`` (default), ``warn`` or ``off``: see ``FASTINIT_PORT_CHECK``."""
    value = (_get("FASTINIT_PORT_CHECK") or "error").strip().lower()
    if value not in ("error", "warn", "off"):
        raise ValueError(f"FASTINIT_PORT_CHECK must be error, warn or off, got {value!r}")
    return value


def _on(name: str) -> bool:
    """An ``on``/``off`` knob, ``on`` by default."""
    value = (_get(name) or "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{name} must be on or off, got {value!r}")
    return value == "on"


def get_vec_isa_record() -> bool:
    """Whether the CPU vector-ISA record is used (``FASTINIT_VEC_ISA_RECORD``: ``on``/``off``)."""
    return _on("FASTINIT_VEC_ISA_RECORD")


def get_checkpoint_staging() -> str:
    """``process`` (default), ``thread`` or ``off``: see ``FASTINIT_CHECKPOINT_STAGING``."""
    value = (_get("FASTINIT_CHECKPOINT_STAGING") or "process").strip().lower()
    if value not in ("process", "thread", "off"):
        raise ValueError(
            f"FASTINIT_CHECKPOINT_STAGING must be process, thread or off, got {value!r}"
        )
    return value


def get_checkpoint_delta() -> bool:
    """Whether saves copy only touched rows (``FASTINIT_CHECKPOINT_DELTA``: ``on``/``off``)."""
    return _on("FASTINIT_CHECKPOINT_DELTA")


def get_checkpoint_ahead() -> bool:
    """Whether touched rows are copied ahead between saves (``FASTINIT_CHECKPOINT_AHEAD``)."""
    return _on("FASTINIT_CHECKPOINT_AHEAD")


def get_restart_zygote() -> bool:
    """Whether ``python -m fastinit.restart`` keeps a zygote (``FASTINIT_RESTART_ZYGOTE``)."""
    return _on("FASTINIT_RESTART_ZYGOTE")


def get_restart_preload() -> tuple[str, ...]:
    """The modules the zygote imports before it forks (``FASTINIT_RESTART_PRELOAD``)."""
    value = _get("FASTINIT_RESTART_PRELOAD") or "torch,torchrec"
    return tuple(name.strip() for name in value.split(",") if name.strip())


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def get_checkpoint_tier() -> int | None:
    """The host-memory tier's bound in bytes: None (``on``: no bound), 0 (``off``) or a size.

    Raises:
        ValueError: not ``on``, ``off`` or a size such as ``8G``.
    """
    value = (_get("FASTINIT_CHECKPOINT_TIER") or "on").strip()
    if value.lower() == "on":
        return None
    if value.lower() == "off":
        return 0
    return int(_size("FASTINIT_CHECKPOINT_TIER", value, "on, off or a size such as 8G"))


def get_checkpoint_write_rate() -> float | None:
    """Bytes per second a writer writes a save at while its trainer trains on; None: no limit.

    Raises:
        ValueError: not ``max`` or a positive size such as ``256M``.
    """
    value = (_get("FASTINIT_CHECKPOINT_WRITE_RATE") or "256M").strip()
    if value.lower() == "max":
        return None
    rate = _size("FASTINIT_CHECKPOINT_WRITE_RATE", value, "max or a rate such as 256M")
    if rate <= 0:
        raise ValueError(f"FASTINIT_CHECKPOINT_WRITE_RATE must be positive, got {value!r}")
    return rate


def _size(name: str, value: str, expected: str) -> float:
    """``value`` (``8G``, ``512M``, ``4096``) in bytes, for knob ``name``."""
    number, unit = value.rstrip("KMGTkmgtBb"), value[len(value.rstrip("KMGTkmgtBb")) :]
    unit = unit.upper().removesuffix("B")
    try:
        size = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(f"{name} must be {expected}, got {value!r}") from None
    if not math.isfinite(size) or size < 0:
        raise ValueError(f"{name} must be a non-negative size, got {value!r}")
    return size


#: The longest ``FASTINIT_COLLECTIVE_TIMEOUT`` accepted: one day. A start-up collective that may
#: wait longer is a typo (``inf``, ``1e999``), and torch's ``timedelta`` waits overflow past it.
MAX_COLLECTIVE_TIMEOUT = 86400.0


def get_collective_timeout() -> float:
    """Seconds a start-up collective may wait before raising.

    Raises:
        ValueError: the knob is not a finite number of seconds in ``(0, 86400]`` (``nan``,
            ``inf`` and ``1e999`` included), naming the value.
    """
    return _seconds("FASTINIT_COLLECTIVE_TIMEOUT", 300.0)


def get_init_timeout() -> float:
    """Seconds ``fastinit.init_process_group`` may take in all under torchelastic.

    Raises:
        ValueError: the knob is not a finite number of seconds in ``(0, 86400]``, naming it.
    """
    return _seconds("FASTINIT_INIT_TIMEOUT", 600.0)


def check_seconds(name: str, value: object) -> float:
    """``value`` as seconds, if it is a finite number in ``(0, 86400]``.

    Raises:
        ValueError: anything else (``nan``, ``inf``, ``1e999``, a word), naming ``name``.
    """
    try:
        seconds = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from e
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_COLLECTIVE_TIMEOUT:
        raise ValueError(
            f"{name} must be a finite number of seconds in "
            f"(0, {MAX_COLLECTIVE_TIMEOUT:g}], got {value!r}"
        )
    return seconds


def _seconds(name: str, default: float) -> float:
    value = _get(name)
    return default if value is None else check_seconds(name, value)


@contextlib.contextmanager
def override(**values: str | None) -> Iterator[None]:
    """Temporarily set (or, with None, unset) knobs; the old values come back in ``finally``.

    Example::

        with knobs.override(FASTINIT_PLAN_CACHE="/tmp/plans"):
            fastinit.setup(model)
    """
    unknown = set(values) - set(KNOBS)
    if unknown:
        raise KeyError(f"unknown fastinit knob(s): {sorted(unknown)}; known: {sorted(KNOBS)}")
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def markdown_table() -> str:
    """The README's knobs table: one row per knob of :data:`KNOBS`, in its order."""
    rows = ["| variable | meaning |", "|---|---|"]
    for name, text in KNOBS.items():
        cell = text.replace("|", "\\|")
        rows.append(f"| `{name}` | {cell} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m fastinit.knobs --markdown
    import sys

    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m fastinit.knobs --markdown  (prints the README's knobs table)")
    sys.stdout.write(markdown_table())
