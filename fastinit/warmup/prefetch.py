"""Pay the compile stack's one-off process costs on a thread while other start-up stages wait.

The first ``torch.compile`` of a process imports Inductor (``torch._inductor.compile_fx`` and
about 590 modules behind it, a few seconds of CPU), and on CPU the first Inductor kernel it runs
or loads probes the host's vector ISA (``torch._inductor.cpu_vec_isa.pick_vec_isa``: compile a
test library, ``dlopen`` it in a child Python, under a file lock the ranks of a host share;
answered from the compile cache's record on a warm restart: :mod:`fastinit.warmup.vec_isa`);
the first ``torch.fx`` symbolic trace (TorchRec's train pipeline traces the model at its first
batch) builds ``torch.overrides``' table of overridable functions. None of these depends on the model, the batch or any state the job trains, and all are cached for the
rest of the process. :func:`prefetch_compiler` starts them on a daemon thread; a later
``torch.compile`` or precompiled-artifact load then finds them done (or waits on the import locks
for the part still under way).
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time

__all__ = ["PREFETCH_MODULES", "CompilerPrefetch", "prefetch_compiler"]

#: What the first ``torch.compile`` and a precompiled load import (missing ones are skipped: they
#: move between torch versions).
PREFETCH_MODULES: tuple[str, ...] = (
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch._inductor.codecache",
    "torch._inductor.output_code",
    "torch._inductor.async_compile",
    "torch._dynamo.aot_compile",
    "torch._functorch._aot_autograd.aot_autograd_result",
)


@dataclasses.dataclass(slots=True)
class CompilerPrefetch:
    """A running or finished :func:`prefetch_compiler`."""

    thread: threading.Thread
    seconds: float = float("nan")
    """Wall time the prefetch took (NaN until done)."""
    imported: list[str] = dataclasses.field(default_factory=list)
    """The modules of :data:`PREFETCH_MODULES` that imported."""
    vec_isa: str | None = None
    """The CPU vector ISA Inductor picked (None: not probed)."""
    vec_isa_record: str = ""
    """How the ISA list was filled (:func:`fastinit.warmup.vec_isa.restore_vec_isa`'s status)."""
    error: str | None = None
    """Why a step failed (the prefetch is best effort: the compile does it again if needed)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the prefetch; True if it finished."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


def prefetch_compiler(
    *, cpu_inductor: bool = True, compile_cache: str | None = None
) -> CompilerPrefetch:
    """Start importing the compile stack (and, with ``cpu_inductor``, probing the CPU vector ISA
    Inductor's CPU kernels use) on a daemon thread; returns at once.

    Start it once torch is imported and, where the job forks processes (``DataLoader`` workers
    with ``fork``), only after the forks: a fork while this thread holds an import lock leaves
    the child blocked on it. :meth:`CompilerPrefetch.wait` before compiling is not needed for
    correctness (Python's import locks serialise a module's import) but keeps the two threads
    from importing the same package at once, which packages with import cycles do not always
    survive.

    ``compile_cache`` (default: ``FASTINIT_COMPILE_CACHE``) is the compile cache's root: with
    ``cpu_inductor``, the ISA probe's recorded result there answers it on a warm restart, and a
    probe run here records it (:mod:`fastinit.warmup.vec_isa`).
    """
    from fastinit import knobs

    root = compile_cache if compile_cache is not None else knobs.get_compile_cache()
    holder: list[CompilerPrefetch] = []

    def run() -> None:
        out = holder[0]
        t = time.perf_counter()
        try:
            for name in PREFETCH_MODULES:
                try:
                    importlib.import_module(name)
                except ImportError:
                    continue
                out.imported.append(name)
            import torch.overrides

            # Built at the first torch.fx symbolic trace (TorchRec's train pipeline traces the
            # model at its first batch), cached for the process.
            torch.overrides.get_overridable_functions()
            if cpu_inductor:
                from torch._inductor import cpu_vec_isa

                from fastinit.warmup.vec_isa import restore_vec_isa

                out.vec_isa_record = restore_vec_isa(root).status
                out.vec_isa = str(cpu_vec_isa.pick_vec_isa())
        except Exception as e:  # noqa: BLE001 - best effort; the compile path reports its own
            out.error = f"{type(e).__name__}: {e}"
        finally:
            out.seconds = time.perf_counter() - t

    thread = threading.Thread(target=run, name="fastinit-compile-prefetch", daemon=True)
    prefetch = CompilerPrefetch(thread=thread)
    holder.append(prefetch)
    thread.start()
    return prefetch
