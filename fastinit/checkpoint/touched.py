"""Staging only the rows training touched: the save's copy in proportion to what changed.

A fused TorchRec embedding table (FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen``, the
kernel of ``compute_kernel="fused"``) is updated in its backward, and only in the rows the
forward looked up: the optimizer runs inside the kernel, row by row. So the rows of a table
that differ from the state a staging buffer last received are exactly the rows looked up by
the forwards whose backward ran since. :class:`Touched` records them and
:meth:`Touched.copy_in` copies only those rows of such tables (and their row-wise optimizer
state) into a buffer that already holds the earlier state; everything else is copied whole.

How the rows are known. A forward hook on each table module (an instance hook, removed by
:meth:`Touched.close`) takes the batch's ``indices`` and ``offsets``; when the forward's
output takes part in autograd, a hook on that output records the rows when its gradient
arrives, which is just before the kernel's backward writes them. A forward without a
backward records nothing and writes nothing.

When a slot is copied whole instead (always safe):

- the buffer holds no complete earlier copy made by this process (a new buffer, one taken
  over from a predecessor, a copy that failed half-way);
- the tensor is not a table (or row-wise optimizer state) of a tracked module, lies
  elsewhere than at that copy, is not a contiguous CPU tensor, or has rows under 64 bytes;
- the tensor's version counter moved: torch bumps it on every in-place write through torch
  (``copy_``, ``load_state_dict``, an optimizer's ``add_``); the kernel's own update does not
  bump it, and that update is what the hooks record;
- the module is not tracked: a table not in host memory on CPU, an optimizer outside
  :data:`ROW_SPARSE`, a subclass of the kernel (SSD, dense tables), a forward traced by
  ``torch.compile``, a batch whose offsets or ids do not fit its tables;
- more than :data:`MOST` of the slot's rows were touched (a whole copy is then cheaper).

What it cannot see: a write to a table's memory that neither the kernel's backward nor torch
makes (``tensor.numpy()[...] = ...``, a C extension writing through ``data_ptr``).
:func:`fastinit.checkpoint.load` tells it (a load writes through files). Every copy by rows
first compares a sample of the rows not touched with the buffer's copy of them: a write of
that kind to many rows is caught (one warning, and every later save copies whole); one to a
few rows can escape the sample, and code that makes such writes must turn this off
(``FASTINIT_CHECKPOINT_DELTA=off``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import queue
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["Touched", "ROW_SPARSE", "MOST", "MIN_ROW_BYTES"]

#: FBGEMM's fused optimizers that update only the rows a batch looked up (by name).
ROW_SPARSE = frozenset(
    {
        "sgd",
        "exact_sgd",
        "adagrad",
        "exact_adagrad",
        "row_wise_adagrad",
        "exact_row_wise_adagrad",
        "adam",
        "partial_row_wise_adam",
        "lamb",
        "partial_row_wise_lamb",
    }
)

#: Above this fraction of a slot's rows touched, the slot is copied whole. A row copied on its
#: own costs the memory's latency (150-200 ns for 256 bytes on this project's 2-core host),
#: a row of a whole copy under 20 ns: in ``python -m benchmarks.checkpoint_blocking``, 4% of
#: the rows took 10-14 ms against 27-30 ms for the whole copy, and 15% about as long as it.
MOST = 0.1

#: Rows narrower than this (a row-wise optimizer state: 4 bytes) are copied whole.
MIN_ROW_BYTES = 64

_MIN_SLOT_BYTES = 1 << 20
_SAMPLE = 256  # rows of a slot checked against the buffer at each copy by rows
_CHUNK = 16384  # rows a copy ahead copies between looks at a pause (2-3 ms here)
_LISTED = 64  # batches listed for one hand-over; beyond, it takes its buffer's whole record
_KEEP = 5  # accumulators kept (three buffers in use, and room for a replaced one and a mirror)


@dataclasses.dataclass(frozen=True, slots=True)
class _Rows:
    """A tensor that is (a view of) one table of a tracked module, or its row-wise state."""

    module: int
    start: int
    """The table's first row in the module's row space."""
    rows: int


@dataclasses.dataclass(slots=True)
class _Module:
    ref: Any
    """A weak reference to the module: tracking it does not keep a dropped model alive."""
    rows: int
    table_start: Any
    """``[T]`` int64 (numpy): each table's first row in the module's row space."""
    feature_table: Any
    """``[F]`` int64 (numpy): each feature's table."""
    handle: Any
    hook_id: int = 0
    """Its entry in :data:`_HOOKS`."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Fill:
    """What a buffer holds: the state of every slot at a complete copy."""

    token: int
    slots: tuple[tuple[int, int, int, int], ...]
    """Per slot: (data_ptr, nbytes, version, offset), or all zero where not tracked."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Part:
    """A slot of the buffer rows are copied ahead into: one table, or its row-wise state."""

    offset: int
    nbytes: int
    width: int
    """Bytes of a row."""
    start: int
    """The table's first row in its module's row space."""
    rows: int
    source: Any
    """The tensor (the module's own view of the table)."""
    ptr: int
    version: int
    """``source``'s data_ptr and version counter at the buffer's fill."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    """The free buffer whose touched rows are copied ahead, between saves."""

    segment: Any
    token: int
    """Its fill's record of touched rows."""
    parts: dict[int, tuple[_Part, ...]]
    """Module key -> the slots of its tables that can be copied by rows."""


# The autograd node of a fused lookup: the kernel's update of the rows runs inside it.
_LOOKUP_NODE = "SplitLookupFunction"


def _optimizer_name(module: Any) -> str:
    opt = getattr(module, "optimizer", None)
    return str(getattr(opt, "value", opt)).lower()


def _trackable(module: Any) -> bool:
    # fbgemm-gpu never imported: no fused table exists. A dense model (or a host without
    # fbgemm-gpu) neither pays for its import nor needs it.
    if sys.modules.get("fbgemm_gpu") is None:
        return False
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    if type(module) is not SplitTableBatchedEmbeddingBagsCodegen:
        return False
    if _optimizer_name(module) not in ROW_SPARSE:
        return False
    specs = getattr(module, "embedding_specs", None) or []
    return bool(specs) and all(
        s[2] == EmbeddingLocation.HOST and s[3] == ComputeDevice.CPU for s in specs
    )


def _walk(model: Any) -> Any:
    """Every module of ``model``, the lookups of TorchRec's sharded modules included (they
    keep them in a plain list, outside ``modules()``)."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        top = stack.pop()
        for m in top.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            yield m
            lookups = getattr(m, "_lookups", None)
            if isinstance(lookups, (list, tuple)):
                stack.extend(x for x in lookups if hasattr(x, "modules"))


_HOOK_IDS = itertools.count(1)
_HOOKS: dict[int, tuple[Any, int]] = {}
"""hook id -> (weak reference to its :class:`Touched`, module key). The hooks on modules are
``functools.partial(_on_forward, hook id)``: a model that carries them still pickles (a hook
whose id is not here, in another process or after :meth:`Touched.close`, does nothing), and a
deep copy's forwards mark the original's rows (more rows copied, never fewer)."""


def _on_written(tracker: Any, key: int, grad_inputs: Any, grad_outputs: Any) -> None:
    """The post-hook of a fused lookup's autograd node: the rows it recorded are written."""
    t = tracker()
    if t is not None:
        t._written(key)


def _on_forward(
    hook_id: int, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
) -> None:
    entry = _HOOKS.get(hook_id)
    if entry is None:
        return
    tracker = entry[0]()
    if tracker is not None:
        tracker._forward(entry[1], args, kwargs, output)


class Touched:
    """The rows of fused tables touched since each staging buffer's last complete copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modules: dict[int, _Module] = {}
        self._acc: dict[int, dict[int, Any]] = {}
        """token -> module id -> ``[rows]`` bool: touched since the fill of that token."""
        self._tokens = itertools.count(1)
        self.broken: str | None = None
        """Why rows are no longer tracked (a sampled untouched row had changed), or None."""
        self._lost: set[int] = set()
        """Modules whose forward ran under ``torch.compile``: their rows are not known."""
        self._filled: weakref.WeakSet[Any] = weakref.WeakSet()
        """Every buffer given a fill."""
        # -- copying ahead (copy_ahead) --
        self._provider: Callable[[], Any] | None = None
        """``() -> buffers``: the free buffers that hold a fill (one is copied ahead into, and
        the next save takes it); None: no copying ahead."""
        self._target: _Target | None = None
        self._since: dict[int, list[Any]] = {}
        """Module key -> the rows recorded since its last hand-over to the target (arrays of
        module-space ids); a module not here hands over all its target's record next."""
        self._in_flight: dict[int, int] = {}
        """Module key -> backwards through it between their rows' record and their write."""
        self._no_ahead: set[int] = set()
        """Modules whose write is not known to follow the record at once (an unknown node)."""
        self._paused = 0
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._cancel = threading.Event()
        self._worker: threading.Thread | None = None
        self.ahead_bytes = 0
        """Bytes copied ahead so far."""

    # -- tracking -----------------------------------------------------------------------------

    def attach(self, model: Any) -> int:
        """Track every fused table module of ``model`` not tracked yet; returns how many are."""
        import numpy as np

        self._drop_dead()
        for m in _walk(model):
            known = self._modules.get(id(m))
            if (known is not None and known.ref() is m) or not _trackable(m):
                continue
            rows = [int(s[0]) for s in m.embedding_specs]
            start = np.array([0, *itertools.accumulate(rows)][:-1], dtype=np.int64)
            ftm = np.array(list(m.feature_table_map), dtype=np.int64)
            key = id(m)
            token = next(_HOOK_IDS)
            _HOOKS[token] = (weakref.ref(self), key)
            hook = functools.partial(_on_forward, token)
            handle = m.register_forward_hook(hook, with_kwargs=True)
            with self._lock:
                self._modules[key] = _Module(weakref.ref(m), sum(rows), start, ftm, handle, token)
        return len(self._modules)

    def _drop_dead(self) -> None:
        """Forget modules that are gone (their ids may be another module's next)."""
        with self._lock:
            for key in [k for k, mod in self._modules.items() if mod.ref() is None]:
                self._target = None  # it may hold the dropped module's tables
                self._since = {}
                _HOOKS.pop(self._modules[key].hook_id, None)
                del self._modules[key]
                self._lost.discard(key)
                self._no_ahead.discard(key)
                self._in_flight.pop(key, None)
                for acc in self._acc.values():
                    acc.pop(key, None)

    def _forward(
        self, key: int, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        """A forward of module ``key``: record its rows when its output's gradient arrives."""
        import torch

        if torch.compiler.is_compiling():  # a traced hook may never run: not tracked
            with self._lock:
                self._lost.add(key)
            return
        if self._provider is not None:
            self._step_ahead(key)
        if not (torch.is_grad_enabled() and getattr(output, "requires_grad", False)):
            return
        indices = kwargs.get("indices", args[0] if args else None)
        offsets = kwargs.get("offsets", args[1] if len(args) > 1 else None)
        batches = kwargs.get("batch_size_per_feature_per_rank")
        counted = self._provider is not None and self._count_backward(key, output)

        def record(grad: Any) -> None:
            self._record(key, indices, offsets, batches, counted)

        output.register_hook(record)

    def _rows_of(self, mod: _Module, indices: Any, offsets: Any, batches: Any) -> Any:
        """The module-space rows a batch looks up (an int64 array), or None: every row (an
        unknown layout). In numpy: a backward pays microseconds for it, not torch's per-op
        dispatch."""
        import numpy as np

        idx = indices.detach().numpy()
        offs = offsets.detach().numpy()
        features = len(mod.feature_table)
        n = len(offs) - 1
        if batches is not None:
            sizes = [sum(int(b) for b in per_rank) for per_rank in batches]
            if len(sizes) != features or sum(sizes) != n:
                return None
            bounds = np.array([0, *itertools.accumulate(sizes)], dtype=np.int64)
        else:
            if features == 0 or n % features:
                return None
            bounds = np.arange(0, n + 1, n // features, dtype=np.int64)
        ends = offs[bounds].astype(np.int64, copy=False)
        counts = np.diff(ends)
        if int(ends[-1]) != len(idx) or (counts < 0).any():
            return None
        if not len(idx):
            return idx.astype(np.int64)
        tables = np.repeat(mod.feature_table, counts)
        room = np.diff(np.append(mod.table_start, mod.rows))[tables]
        if idx.min() < 0 or (idx >= room).any():  # a bad id: the kernel refuses it
            return None
        return mod.table_start[tables] + idx

    def _record(
        self, key: int, indices: Any, offsets: Any, batches: Any, counted: bool = False
    ) -> None:
        with self._lock:
            if counted:  # its write follows; :meth:`_written` once it is done
                self._in_flight[key] = self._in_flight.get(key, 0) + 1
            mod = self._modules.get(key)
            if mod is None or not self._acc:
                return
            try:
                rows = self._rows_of(mod, indices, offsets, batches)
            except Exception:  # noqa: BLE001 - an unknown layout: treat every row as touched
                rows = None
            for acc in self._acc.values():
                mask = acc.get(key)
                if mask is None:
                    continue
                if rows is None:
                    mask.fill_(True)
                else:
                    mask.numpy()[rows] = True
            since = self._since.get(key)
            if since is not None:  # listed for the next hand-over (unknown: all it records)
                if rows is None or len(since) >= _LISTED:
                    del self._since[key]
                else:
                    since.append(rows)

    def invalidate(self, model: Any = None) -> None:
        """Something wrote ``model``'s state (None: any state) behind torch's version counters
        (a load): the next copy of every buffer is whole."""
        if model is not None and not any(id(m) in self._modules for m in _walk(model)):
            return
        with self.paused(), self._lock:
            self._acc.clear()
            for segment in self._filled:  # no buffer holds a copy the record still describes
                segment.touched = None

    def close(self) -> None:
        """Remove the hooks, stop copying ahead; forget everything."""
        with self._lock:
            self._provider = None
            self._paused += 1  # for good
            self._cancel.set()
        self._idle.wait()
        if self._worker is not None:
            self._jobs.put(None)
            self._worker = None
        with self._lock:
            for mod in self._modules.values():
                mod.handle.remove()
                _HOOKS.pop(mod.hook_id, None)
            self._modules.clear()
            self._acc.clear()

    # -- copying --------------------------------------------------------------------------------

    def _tables(self) -> dict[tuple[int, int], _Rows]:
        """(data_ptr, nbytes) of every table and row-wise state of a tracked module."""
        return {k: rows for k, (rows, _) in self._sources().items()}

    def _sources(self) -> dict[tuple[int, int], tuple[_Rows, Any]]:
        """As :meth:`_tables`, with each tensor."""
        out: dict[tuple[int, int], tuple[_Rows, Any]] = {}
        for key, mod in self._modules.items():
            m = mod.ref()
            if key in self._lost or m is None:
                continue
            starts = mod.table_start.tolist()
            weights = m.split_embedding_weights()
            try:
                states = m.split_optimizer_states()
            except Exception:  # noqa: BLE001 - no optimizer state to stage by rows
                states = [[] for _ in weights]
            for t, (w, start) in enumerate(zip(weights, starts, strict=True)):
                rows = int(m.embedding_specs[t][0])
                for x in (w, *(states[t] if t < len(states) else ())):
                    nbytes = x.numel() * x.element_size()
                    if rows and x.is_contiguous() and nbytes % rows == 0:
                        out[(x.data_ptr(), nbytes)] = (_Rows(key, start, rows), x)
        return out

    def copy_in(self, segment: Any, layout: Any, tensors: Sequence[Any]) -> int:
        """Copy ``tensors`` into ``segment`` as :func:`~fastinit.checkpoint.staging.copy_in`
        does, but only the touched rows of tables ``segment`` already holds; returns the bytes
        copied."""
        import torch

        from fastinit.checkpoint.staging import copy_in

        fill: _Fill | None = segment.touched
        segment.touched = None  # a copy that fails half-way leaves no fill
        with self._lock:
            acc = self._acc.pop(fill.token, None) if fill is not None else None
            tables = self._tables()
            token = self._open()
        whole: list[int] = []
        sig: list[tuple[int, int, int, int]] = []
        jobs: list[tuple[Any, Any, Any]] = []
        delta = 0
        gen = torch.Generator().manual_seed(token)  # its own: never the global RNG
        with torch.no_grad():
            for i, (slot, t) in enumerate(zip(layout.slots, tensors, strict=True)):
                src = t.detach()
                signed, where = _signature(slot, src, tables)
                now = (src.data_ptr(), slot.nbytes, src._version, slot.offset)
                sig.append(signed)
                touched = self._changed(fill, acc, i, now, where, slot.nbytes)
                if touched is None or where is None:
                    whole.append(i)
                    continue
                width = slot.nbytes // where.rows
                dst = segment.tensor(slot.offset, slot.nbytes, "uint8", (where.rows, width))
                rows_of = src.reshape(-1).view(torch.uint8).view(where.rows, width)
                if not self._untouched_agree(rows_of, dst, touched, gen):
                    whole.append(i)
                    continue
                n = _count(touched)
                if n:
                    jobs.append((rows_of, dst, touched))
                    delta += n * width
        _copy_rows(jobs)
        if whole:
            sub = dataclasses.replace(layout, slots=tuple(layout.slots[i] for i in whole))
            copy_in(segment, sub, [tensors[i] for i in whole])
        whole_bytes = sum(layout.slots[i].nbytes for i in whole)
        with self._lock:
            if token in self._acc and self.broken is None:
                segment.touched = _Fill(token, tuple(sig))
                self._filled.add(segment)
        return delta + whole_bytes

    def _open(self, since: dict[int, Any] | None = None) -> int:
        """A new record of touched rows (a copy of ``since``, else empty); keeps the newest
        :data:`_KEEP`. Under the lock."""
        import torch

        token = next(self._tokens)
        if since is None:
            self._acc[token] = {
                k: torch.zeros(m.rows, dtype=torch.bool) for k, m in self._modules.items()
            }
        else:
            self._acc[token] = {k: m.clone() for k, m in since.items()}
        for old in sorted(self._acc)[:-_KEEP]:
            del self._acc[old]
        return token

    def begin(self, layout: Any, tensors: Sequence[Any]) -> _Fill | None:
        """For a whole copy of ``tensors`` (in ``layout``) to be made off the loop into a
        buffer that holds nothing yet (:func:`fastinit.checkpoint.prepare`): the fill that copy
        will hold, recording the rows touched from this call on. So a row the copy reads while
        a backward writes it is copied again by the next save into that buffer.

        Call it where no backward is in flight (at start-up, between steps): a backward whose
        rows were recorded before this call and written after it would escape. None when no
        slot of ``layout`` is tracked (nothing to gain) or tracking is off."""

        with self._lock:
            if self.broken is not None:
                return None
            tables = self._tables()
            sig = tuple(
                _signature(slot, t.detach(), tables)[0]
                for slot, t in zip(layout.slots, tensors, strict=True)
            )
            if not any(any(s) for s in sig):
                return None
            token = self._open()
        return _Fill(token, sig)

    def fork_fill(self, segment: Any) -> _Fill | None:
        """For a copy of ``segment``'s bytes about to be made into another buffer (off the
        loop, :meth:`~fastinit.checkpoint.staging.Pool.mirror`): a fill that says the same and
        has its own record of the rows touched, from ``segment``'s so far; None when
        ``segment`` holds no fill or no slot of it is tracked (nothing to gain)."""
        with self._lock:
            fill: _Fill | None = segment.touched
            if fill is None or self.broken is not None or fill.token not in self._acc:
                return None
            if not any(any(s) for s in fill.slots):
                return None
            token = self._open(self._acc[fill.token])
            return _Fill(token, fill.slots)

    def adopt_fill(self, fill: _Fill, segment: Any) -> None:
        """The copy :meth:`fork_fill` was for is complete: ``segment`` holds ``fill``."""
        with self._lock:
            if fill.token in self._acc and self.broken is None:
                segment.touched = fill
                self._filled.add(segment)

    def forget(self, fill: _Fill) -> None:
        """No copy is made for ``fill`` (from :meth:`fork_fill`): stop recording its rows."""
        with self._lock:
            self._acc.pop(fill.token, None)

    # -- copying ahead ----------------------------------------------------------------------------

    def copy_ahead(self, provider: Callable[[], Sequence[Any]]) -> None:
        """Between saves, copy the rows recorded for one of the buffers ``provider()`` names
        (the free ones holding a fill: the one with the fewest rows recorded) into it, on a
        thread of its own at the loop's priority (see :meth:`_work`); the next save takes that
        buffer and copies only the rows of its last steps.

        When. At each forward of a tracked module (a forward hook), the rows recorded for that
        module are handed over and the record starts again, unless a backward through the
        module is between its rows' record and their write: the record is made by a hook on
        the lookup's output, the write by the autograd node right after it, and a post-hook on
        that node says it is done. So every row handed over was written before it was, and a
        row written after it (even while the thread copies it) is recorded again: the next
        save, or the next hand-over, copies it once more. A module whose output's node is not
        the fused lookup's is not copied ahead. The thread stops at its next chunk of rows
        whenever the pool hands out, frees or unmaps a buffer (:meth:`paused`); what it did not
        copy goes back to the record."""
        with self._lock:
            self._provider = provider

    def ahead_segment(self) -> Any:
        """The buffer rows are being copied ahead into, or None."""
        with self._lock:
            target = self._target
            return None if target is None or target.token not in self._acc else target.segment

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No rows copied ahead inside: the copy in progress stops at its next chunk of rows and
        the rows it did not copy go back to the record (a buffer is being handed out, freed or
        unmapped)."""
        with self._lock:
            self._paused += 1
            self._target = None
            self._since = {}
            self._cancel.set()
        try:
            self._idle.wait()
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if not self._paused:
                    self._cancel.clear()

    def _count_backward(self, key: int, output: Any) -> bool:
        """Hook the write that follows a record of ``key``'s rows (the fused lookup's node)."""
        node = getattr(output, "grad_fn", None)
        if node is None or _LOOKUP_NODE not in node.name():
            with self._lock:
                self._no_ahead.add(key)
            return False
        node.register_hook(functools.partial(_on_written, weakref.ref(self), key))
        return True

    def _written(self, key: int) -> None:
        with self._lock:
            left = self._in_flight.get(key, 0) - 1
            if left > 0:
                self._in_flight[key] = left
            else:
                self._in_flight.pop(key, None)

    def _step_ahead(self, key: int) -> None:
        """At a forward of module ``key``: hand the rows recorded for the target buffer since
        the last hand-over to the copying thread, and take them off its record."""
        import numpy as np

        if not self._idle.is_set():
            return  # still copying the last ones: these wait for a later forward
        with self._lock:
            if (
                self._paused
                or not self._idle.is_set()  # (again, under the lock: one job at a time)
                or self.broken is not None
                or key in self._no_ahead
                or self._in_flight.get(key)
            ):
                return
            target = self._target
            if target is None or target.token not in self._acc:
                target = self._target = self._aim()
                self._since = {}
            if target is None or not target.parts.get(key):
                return
            mask = self._acc[target.token].get(key)
            if mask is None:
                return
            since = self._since.get(key)
            self._since[key] = []  # from here on, every row recorded is listed too
            if since is None:  # the first hand-over to this buffer: all it has recorded
                rows = np.flatnonzero(mask.numpy())
            elif since:
                rows = np.concatenate(since)
            else:
                return
            if not len(rows):
                return
            mask.numpy()[rows] = False
            self._idle.clear()
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name="fastinit-checkpoint-ahead", daemon=True
                )
                self._worker.start()
            self._jobs.put((target, key, rows))

    def _aim(self) -> _Target | None:
        """The buffer to copy ahead into, and its slots that can be copied by rows. Under
        the lock."""
        assert self._provider is not None
        live = [
            (sum(_count(m) for m in self._acc[seg.touched.token].values()), i, seg)
            for i, seg in enumerate(self._provider())
            if seg.touched is not None and seg.touched.token in self._acc
        ]
        if not live:
            return None
        segment = min(live)[2]  # the one with the fewest rows left to copy
        fill: _Fill = segment.touched
        sources = self._sources()
        parts: dict[int, list[_Part]] = {}
        for ptr, nbytes, version, offset in fill.slots:
            found = sources.get((ptr, nbytes)) if ptr else None
            if found is None:
                continue
            where, x = found
            width = nbytes // where.rows
            if nbytes < _MIN_SLOT_BYTES or width < MIN_ROW_BYTES or x._version != version:
                continue  # the save copies it whole
            part = _Part(offset, nbytes, width, where.start, where.rows, x, ptr, version)
            parts.setdefault(where.module, []).append(part)
        return _Target(segment, fill.token, {k: tuple(v) for k, v in parts.items()})

    def _work(self) -> None:
        """The copying thread: each job is one module's rows (module-space ids) for one buffer.

        It runs at the trainer's priority, unlike the writer and the fills (priority.py): what
        it copies is the save's own copy, moved off the loop, not extra work; 10 nice steps
        below a loop whose steps keep both cores busy it got too little of them to keep up,
        and the saves copied the rows instead."""
        import numpy as np

        while (job := self._jobs.get()) is not None:
            target, key, rows = job
            rows = np.unique(rows)  # sorted: each table's rows are one run of them
            left: list[Any] = []  # module-space rows not copied: the save copies them
            copied = 0
            for part in target.parts.get(key, ()):
                ids = _within(rows, part)
                for lo in range(0, len(ids), _CHUNK):  # a pause waits for one chunk at most
                    chunk = ids[lo : lo + _CHUNK]
                    if left or self._cancel.is_set():
                        left.append(chunk + part.start)
                        continue
                    try:
                        copied += self._copy_ahead(target, part, chunk)
                    except Exception:  # noqa: BLE001 - left for the save
                        left.append(chunk + part.start)
            with self._lock:
                self.ahead_bytes += copied
                mask = self._acc.get(target.token, {}).get(key)
                if mask is not None:
                    for chunk in left:
                        mask.numpy()[chunk] = True
            self._idle.set()

    def _copy_ahead(self, target: _Target, part: _Part, rows: Any) -> int:
        """Copy ``rows`` (of the table) of ``part`` into ``target``; the bytes copied."""
        import torch

        x = part.source
        if not len(rows) or x.data_ptr() != part.ptr or x._version != part.version:
            return 0  # (written through torch since the fill: the save copies it whole)
        dst = target.segment.tensor(part.offset, part.nbytes, "uint8", (part.rows, part.width))
        with torch.no_grad():
            src = x.detach().reshape(-1).view(torch.uint8).view(part.rows, part.width)
        _copy_indexed(src, dst, rows)
        return len(rows) * part.width

    def _untouched_agree(self, src: Any, dst: Any, touched: Any, gen: Any) -> bool:
        """Whether a sample of the rows not touched still equals the buffer's copy of them: the
        check that nothing wrote the table unseen. A difference turns this off for good."""
        import torch

        if self.broken is not None:
            return False
        sample = torch.randint(0, src.shape[0], (_SAMPLE,), generator=gen)
        sample = sample[~touched[sample]]
        if torch.equal(src.index_select(0, sample), dst.index_select(0, sample)):
            return True
        self.broken = (
            "a row no backward touched changed since the buffer's last copy: something writes "
            "the tables where neither torch nor the fused kernel's backward counts it; every save "
            "copies the whole state from now on (set FASTINIT_CHECKPOINT_DELTA=off to say so)"
        )
        warnings.warn(f"fastinit.checkpoint: {self.broken}", stacklevel=4)
        return False

    @staticmethod
    def _changed(
        fill: _Fill | None,
        acc: dict[int, Any] | None,
        i: int,
        now: tuple[int, int, int, int],
        where: _Rows | None,
        nbytes: int,
    ) -> Any:
        """The rows of slot ``i`` to copy, or None: copy it whole."""
        if fill is None or acc is None or where is None or i >= len(fill.slots):
            return None
        if fill.slots[i] != now or nbytes < _MIN_SLOT_BYTES:
            return None
        if nbytes // where.rows < MIN_ROW_BYTES:
            return None
        mask = acc.get(where.module)
        if mask is None:
            return None
        touched = mask[where.start : where.start + where.rows]
        if _count(touched) > MOST * where.rows:
            return None
        return touched


def _signature(
    slot: Any, src: Any, tables: dict[tuple[int, int], _Rows]
) -> tuple[tuple[int, int, int, int], _Rows | None]:
    """What a fill records of ``src`` copied into ``slot`` — (data_ptr, nbytes, version,
    offset), all zero where it is not a tracked table — and the table it is, if one."""
    where = tables.get((src.data_ptr(), slot.nbytes)) if src.device.type == "cpu" else None
    if where is None:
        return (0, 0, 0, 0), None
    return (src.data_ptr(), slot.nbytes, src._version, slot.offset), where


def _count(mask: Any) -> int:
    import numpy as np

    return int(np.count_nonzero(mask.numpy()))


def _within(rows: Any, part: _Part) -> Any:
    """Of sorted module-space ``rows``, those of ``part``'s table, as rows of the table."""
    import numpy as np

    lo, hi = np.searchsorted(rows, (part.start, part.start + part.rows))
    return rows[lo:hi] - part.start


def _copy_indexed(src: Any, dst: Any, rows: Any) -> None:
    """``dst[rows] = src[rows]`` for ``[n, width]`` uint8 tensors and an array of row ids: a
    row as one item, in the ids' order (cost in proportion to the rows, not the table)."""
    import numpy as np

    kind = np.dtype((np.void, src.shape[1]))
    s = src.numpy().view(kind).reshape(-1)
    d = dst.numpy().view(kind).reshape(-1)
    d[rows] = s[rows]


def _copy_rows(jobs: Sequence[tuple[Any, Any, Any]]) -> None:
    """``dst[touched] = src[touched]`` for each ``([rows, width] uint8, same, [rows] bool)``:
    one pass, a row as one ``width``-byte item (one memcpy per row, no gather). Scattered rows
    cost the memory's latency, not its bandwidth: 150-200 ns a row of 256 bytes here. (Two
    threads did not help on this project's 2-core host: torch's OpenMP workers spin on the
    other core after the training step.)"""
    import numpy as np

    for src, dst, touched in jobs:
        kind = np.dtype((np.void, src.shape[1]))
        s = src.numpy().view(kind).reshape(-1)
        d = dst.numpy().view(kind).reshape(-1)
        np.copyto(d, s, where=touched.numpy())
