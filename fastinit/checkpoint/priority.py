"""CPU priority of checkpoint work that runs beside the training loop.

The writer process and the threads that fill staging buffers do work no step waits for; on a
host whose cores the trainers keep busy they take CPU from the steps. They run at a lower
priority, so a step that wants a core gets it first and they use what is left.

Linux schedules by thread: a thread's nice value is its own (``setpriority(2)``, "BUGS"), and
threads inherit their creator's. Where autogroup is on (``/proc/sys/kernel/sched_autogroup_enabled``),
every session is a scheduling group of its own, and a nice value ranks a thread only inside its
group: the writer, which leads a session of its own so that it outlives the trainer's process
group, lowers its group's nice too (``/proc/self/autogroup``). Neither is raised again: an
unprivileged process cannot, so the calls are made only on threads and processes that do
nothing else.

A process in the boot session's group (a container's processes that never called ``setsid``)
reads an empty ``/proc/self/autogroup``: that group has no nice of its own to lower.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading

__all__ = ["BACKGROUND_NICE", "autogroup_nice", "lower_priority"]

#: How many nice steps below the trainer checkpoint work off the loop runs. At 10 a busy
#: background thread gets about a tenth of what a busy trainer thread gets on a shared core
#: (CFS weights 110 against 1024), and all of a core no step wants.
BACKGROUND_NICE = 10


def lower_priority(*, session: bool = False, below: int | None = None) -> bool:
    """Set the calling thread's CPU priority :data:`BACKGROUND_NICE` below its own, or below
    that of thread or process ``below`` (the writer: its trainer's, whatever thread of the
    trainer started it and so whatever nice it inherited); with ``session`` (a process that
    leads its own session) lower its autogroup's too. Best effort: returns whether the thread's
    priority is there."""
    lowered = False
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        base = now if below is None else os.getpriority(os.PRIO_PROCESS, below)
        target = min(19, base + BACKGROUND_NICE)
        if target > now:  # never raised (an unprivileged process cannot)
            os.setpriority(os.PRIO_PROCESS, tid, target)
        lowered = True
    if session:
        with contextlib.suppress(OSError):
            with open("/proc/self/autogroup") as f:
                group = autogroup_nice(f.read())
            if group is not None:
                with open("/proc/self/autogroup", "w") as f:
                    f.write(str(min(19, group + BACKGROUND_NICE)))
    return lowered


def autogroup_nice(text: str) -> int | None:
    """The nice value in a ``/proc/<pid>/autogroup`` text (``/autogroup-42 nice 0``), or None
    where it shows none (the boot session's group, which the kernel does not list)."""
    m = re.search(r"\bnice\s+(-?\d+)", text)
    return int(m.group(1)) if m else None
