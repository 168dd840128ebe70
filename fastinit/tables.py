"""Embedding tables left for a checkpoint load: ``fastinit.setup(init_tables=False)``.

A restarted job builds its model and then loads its checkpoint over every table, so the random
initialisation ``setup`` gives the tables is thrown away: on a host with a core per rank it is
the largest piece of building a large model (1 GB of tables a rank: about a second of
``uniform_``). With ``init_tables=False`` the sharded tables stay as TorchRec allocated them
(zeros) and are *pending*:

* :func:`fastinit.checkpoint.load` (and ``CheckpointManager.load_latest``) takes each pending
  table it wrote off the list, and initialises the ones the checkpoint does not hold, as
  ``setup`` would have;
* :func:`init_tables` initialises every pending table (no checkpoint to load);
* until none is pending, the model refuses a forward and :func:`fastinit.checkpoint.save`
  refuses to save it, on every rank: no step trains, and no checkpoint records, tables that
  were never initialised.

The values a table gets later are those ``setup`` would have given it: a function of
``(seed, table FQN)`` alone (:mod:`fastinit.seeding`). Data-parallel tables are initialised by
``setup`` either way, so every replicated value is still verified equal across ranks at
construction. No collective: whether a table is pending is the same on every rank (the load's
missing values are decided from the checkpoint's index).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["pending_tables", "init_tables", "tables_loaded", "refuse_pending"]


def _pending(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if getattr(m, "_fastinit_pending", None)]


def _prefix(module: Any) -> str:
    fqn = getattr(module, "_fastinit_fqn", "")
    return f"{fqn}." if fqn else ""


def pending_tables(model: nn.Module) -> list[str]:
    """The FQNs of the tables ``setup(init_tables=False)`` left that nothing has filled yet."""
    return [_prefix(m) + n for m in _pending(model) for n in sorted(m._fastinit_pending)]


def init_tables(model: nn.Module) -> list[str]:
    """Initialise every pending table as ``setup`` would have; returns their FQNs. Local to
    this rank (no collective); call it on every rank."""
    done = pending_tables(model)
    for m in _pending(model):
        m.reset_parameters(m._fastinit_pending)
    return done


def _weight_keys(prefix: str, name: str) -> tuple[str, ...]:
    # the flat checkpoint FQNs of a table's weight: an EmbeddingBagCollection's, an
    # EmbeddingCollection's
    return (
        f"model.{prefix}embedding_bags.{name}.weight",
        f"model.{prefix}embeddings.{name}.weight",
    )


def tables_loaded(model: nn.Module, missing: Collection[str]) -> list[str]:
    """After a load that wrote every value of the model but ``missing`` (flat FQNs, as
    :attr:`fastinit.checkpoint.LoadReport.missing`): the pending tables it wrote are done, and
    those it did not are initialised as ``setup`` would have; returns the FQNs initialised."""
    absent = set(missing)
    initialised: list[str] = []
    for m in _pending(model):
        prefix = _prefix(m)
        left = [n for n in m._fastinit_pending if absent.intersection(_weight_keys(prefix, n))]
        if left:
            m.reset_parameters(left)
            initialised.extend(prefix + n for n in sorted(left))
        m._fastinit_pending = frozenset()
    return initialised


def refuse_pending(model: nn.Module, what: str) -> str | None:
    """The message that refuses ``what`` while tables are pending, else None."""
    names = pending_tables(model)
    if not names:
        return None
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"{what}: fastinit.setup(init_tables=False) left {len(names)} table(s) uninitialised "
        f"({shown}); load a checkpoint into the model first (fastinit.checkpoint.load or "
        "CheckpointManager.load_latest) or call fastinit.init_tables(model)"
    )
