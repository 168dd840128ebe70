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

A restart scenario needs a previous run: :func:`prime` (a cold run, untimed) leaves the caches,
and a snapshot of ``shared/`` (``shared.primed/``) so that every new-hosts run starts from the
shared storage exactly as primed.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

__all__ = ["SCENARIOS", "RULES", "Layout", "prepare", "snapshot_primed", "is_primed"]

SCENARIOS: tuple[str, ...] = ("cold", "new-hosts", "same-hosts")

#: The rules, as the report states them.
RULES: dict[str, str] = {
    "cold": "nothing anywhere: shared storage and host-local directories empty",
    "new-hosts": "shared storage kept as the previous run left it, host-local directories empty",
    "same-hosts": "everything kept: shared storage and host-local directories",
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
    else:
        os.makedirs(layout.shared, exist_ok=True)
        os.makedirs(layout.host, exist_ok=True)
    os.makedirs(layout.inductor_dir, exist_ok=True)


def snapshot_primed(layout: Layout) -> None:
    """Keep ``shared/`` as the priming run left it (new-hosts runs start from this copy)."""
    shutil.rmtree(layout.primed, ignore_errors=True)
    shutil.copytree(layout.shared, layout.primed, symlinks=True)


def is_primed(layout: Layout) -> bool:
    """Whether :func:`snapshot_primed` ran for this layout."""
    return os.path.isdir(layout.primed)
