"""The scenarios and the caches each mode keeps: one set of rules for every mode.

Every (model, mode) has two directories, standing for the two kinds of storage a job has:

* ``shared/``: storage that outlives the hosts (a network file system, a bucket). What a mode
  keeps there: fastinit its cache root (plan cache, compile-cache entries with their Inductor
  directory and MegaCache file); stock-best its ``TORCHINDUCTOR_CACHE_DIR``, the
  ``torch.compiler.save_cache_artifacts`` file and the ``torch.save``-d plan; stock nothing.
* ``host/``: the host's local disk: ``TORCHINDUCTOR_CACHE_DIR`` of stock and fastinit (fastinit
  points Inductor into its compile-cache entry while the entry is active).

The scenarios, for every mode alike (:data:`RULES`):

* ``cold``: both empty;
* ``new-hosts``: a restart on other hosts: ``shared/`` as the previous run left it, ``host/``
  empty;
* ``same-hosts``: a restart on the same hosts: both as the previous run left them.
* ``recover``: a failure mid-job (:data:`RECOVER`): the job starts with everything kept (as
  same-hosts) under torchrun ``--max-restarts 1``, checkpoints after step K, one rank is
  SIGKILLed after step K + j (:mod:`benchmarks.ttfb.faults`), torchrun restarts every worker on the
  same hosts, which find the caches the first attempt left and resume from the checkpoint
  (``checkpoints/`` beside ``shared/``, emptied before each run). Only stock-best and fastinit
  run it (:data:`RECOVER_MODES`).

A restart scenario needs a previous run: :func:`prime` (a cold run, untimed) leaves the caches,
and a snapshot of ``shared/`` (``shared.primed/``) so that every new-hosts run starts from the
shared storage exactly as primed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

__all__ = [
    "SCENARIOS",
    "RULES",
    "RECOVER",
    "RECOVER_MODES",
    "Recover",
    "Layout",
    "prepare",
    "snapshot_primed",
    "is_primed",
]

SCENARIOS: tuple[str, ...] = ("cold", "new-hosts", "same-hosts", "recover")

#: The modes the recover scenario compares.
RECOVER_MODES: tuple[str, ...] = ("stock-best", "fastinit")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Recover:
    """The failure of the recover scenario."""

    checkpoint_step: int = 2
    """K: the checkpoint is saved after this step (its write overlaps step K + 1)."""
    kill_step: int = 4
    """K + j: the rank is killed right after this step."""
    steps: int = 6
    """Steps of the job in all: the restarted workers train K + 1 ... steps."""
    max_restarts: int = 1
    """torchrun's ``--max-restarts``."""

    def __post_init__(self) -> None:
        if not 1 <= self.checkpoint_step < self.kill_step <= self.steps:
            raise ValueError("need 1 <= checkpoint_step < kill_step <= steps")

    def kill_rank(self, nproc: int) -> int:
        """The rank killed: the last (rank 0 may host the store; a failure elsewhere is the
        common case)."""
        return nproc - 1


RECOVER = Recover()

#: The rules, as the report states them.
RULES: dict[str, str] = {
    "cold": "nothing anywhere: shared storage and host-local directories empty",
    "new-hosts": "shared storage kept as the previous run left it, host-local directories empty",
    "same-hosts": "everything kept: shared storage and host-local directories",
    "recover": (
        f"a failure: the job (everything kept, as same-hosts) runs under torchrun --max-restarts "
        f"{RECOVER.max_restarts}, checkpoints after step {RECOVER.checkpoint_step}, the last rank "
        f"is SIGKILLed after step {RECOVER.kill_step}, torchrun restarts every worker on the same "
        "hosts, which resume from the checkpoint; time to recover: from the kill to the first "
        "batch after the resume (stock-best and fastinit only)"
    ),
}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    """Where one (model, mode) keeps its caches."""

    root: str
    """This (model, mode)'s directory."""
    mode: str
    """"stock", "stock-best" or "fastinit"."""

    @property
    def shared(self) -> str:
        return os.path.join(self.root, "shared")

    @property
    def host(self) -> str:
        return os.path.join(self.root, "host")

    @property
    def primed(self) -> str:
        return os.path.join(self.root, "shared.primed")

    @property
    def cache_dir(self) -> str | None:
        """The trainer's ``--cache-dir`` (None for stock)."""
        return None if self.mode == "stock" else self.shared

    @property
    def inductor_dir(self) -> str:
        """``TORCHINDUCTOR_CACHE_DIR`` of the ranks."""
        if self.mode == "stock-best":
            return os.path.join(self.shared, "inductor")
        return os.path.join(self.host, "inductor")

    @property
    def checkpoint_dir(self) -> str:
        """The job's checkpoints (the recover scenario), beside ``shared/`` so that the snapshot
        of ``shared/`` never holds one."""
        return os.path.join(self.root, "checkpoints")

    @property
    def plan_file(self) -> str:
        """stock-best's saved plan (the floor builds from it)."""
        return os.path.join(self.shared, "plan.pt")


def _empty(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def prepare(layout: Layout, scenario: str) -> None:
    """Put the layout's directories in the scenario's state before a run."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}; one of {SCENARIOS}")
    if scenario == "cold":
        _empty(layout.shared)
        _empty(layout.host)
    elif scenario == "new-hosts":
        if os.path.isdir(layout.primed):
            shutil.rmtree(layout.shared, ignore_errors=True)
            shutil.copytree(layout.primed, layout.shared, symlinks=True)
        os.makedirs(layout.shared, exist_ok=True)
        _empty(layout.host)
    else:  # same-hosts, and recover: the job starts with everything kept
        os.makedirs(layout.shared, exist_ok=True)
        os.makedirs(layout.host, exist_ok=True)
    if scenario == "recover":  # no checkpoint of an earlier job
        _empty(layout.checkpoint_dir)
    os.makedirs(layout.inductor_dir, exist_ok=True)


def snapshot_primed(layout: Layout) -> None:
    """Keep ``shared/`` as the priming run left it (new-hosts runs start from this copy)."""
    shutil.rmtree(layout.primed, ignore_errors=True)
    shutil.copytree(layout.shared, layout.primed, symlinks=True)


def is_primed(layout: Layout) -> bool:
    """Whether :func:`snapshot_primed` ran for this layout."""
    return os.path.isdir(layout.primed)
