"""The instrument every fastinit claim is measured with.

One :class:`Tracer` per process records, with wall-clock timestamps:

* every c10d op (``c10d::broadcast_``, ``c10d::allgather_``, ``c10d::barrier``, functional
  collectives, ...) with the bytes this rank contributes, seen at the dispatcher through a
  :class:`~torch.utils._python_dispatch.TorchDispatchMode`, so ops issued from C++ (DDP's
  reducer, ``ShardedTensor``) are counted as well as ours;
* every process group created (``new_group``, ``split_group``, ``new_subgroups``, device meshes):
  its ranks and whether this rank is a member. This is the one thing a tracer patches:
  ``distributed_c10d._new_group_with_tag`` and ``split_group`` are wrapped while it runs and
  restored by :meth:`Tracer.stop`, because torch keeps nothing of a group a rank is not a member
  of (no hook, no registry entry: only a counter), so a non-member's creation and its ranks are
  seen nowhere else;
* every store operation (set/get/add/wait/compare_set/...) with bytes, through
  :class:`CountingStore`, a Python store that wraps the real one (C++ callers such as gloo's
  rendezvous go through it too);
* named spans: :func:`span`, one primitive used as a context manager or a decorator.

Nothing is installed unless a tracer is started: with no active tracer, :func:`span` costs one
global lookup and nothing is patched or pushed.

Example::

    with trace.Tracer(rank=rank, out_dir="bench-out/trace") as tracer:
        store = tracer.wrap_store(dist.TCPStore(...))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        with trace.span("train_module_creation"):
            model = fastinit.setup(module)
    print(tracer.summary()["c10d_total"])
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from fastinit.errors import TraceWarning

__all__ = [
    "TraceWarning",
    "Tracer",
    "CountingStore",
    "span",
    "active",
    "to_chrome_trace",
    "read_jsonl",
    "traced_to",
]

F = TypeVar("F", bound=Callable[..., Any])

_ACTIVE: Tracer | None = None

# c10d ops whose first argument is the output buffer: their bytes are those of the inputs only.
_OUTPUT_FIRST = frozenset(
    {
        "allgather_",
        "_allgather_base_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
        "alltoall_",
        "alltoall_base_",
        "reduce_scatter_",
        "_reduce_scatter_base_",
        "reduce_scatter_tensor_coalesced_",
        "gather_",
        "recv_",
        "recv_any_source_",
    }
)
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})


def _now_us() -> float:
    return time.time_ns() / 1000.0


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.device.type == "meta":
            return 0
        return obj.numel() * obj.element_size()
    if isinstance(obj, list | tuple):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


def active() -> Tracer | None:
    """The tracer recording in this process, or None."""
    return _ACTIVE


class span:  # noqa: N801 - reads as a keyword, like contextlib's helpers
    """A named, timed interval; a context manager and a decorator.

    With no active tracer it does nothing. Attributes given as keywords are stored with the event.

    Example::

        with span("pre_train", model="small"):
            warm_up()

        @span("get_first_batch_data")
        def first_batch(): ...
    """

    __slots__ = ("name", "attrs", "_t0", "_ts")

    def __init__(self, name: str, **attrs: Any) -> None:
        self.name = name
        self.attrs = attrs
        self._t0 = 0.0
        self._ts = 0.0

    def __enter__(self) -> span:
        if _ACTIVE is not None:
            self._ts = _now_us()
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        tracer = _ACTIVE
        if tracer is None or self._t0 == 0.0:
            return
        event: dict[str, Any] = {
            "kind": "span",
            "name": self.name,
            "ts": self._ts,
            "dur": (time.perf_counter() - self._t0) * 1e6,
            "tid": threading.get_ident(),
            "thread": threading.current_thread().name,
        }
        if exc_type is not None:
            event["error"] = exc_type.__name__
        if self.attrs:
            event["attrs"] = self.attrs
        tracer.record(event)

    def __call__(self, fn: F) -> F:
        """``fn`` run inside this span on every call."""
        name, attrs = self.name, self.attrs

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with span(name, **attrs):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def _make_dispatch_mode(tracer: Tracer) -> Any:
    from torch.utils._python_dispatch import TorchDispatchMode

    class _CollectiveCounter(TorchDispatchMode):
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            # Without this, Dynamo skips every frame (runs eagerly) while the mode is active;
            # the counter only looks at c10d ops, so compiling through it changes no count.
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace not in _COLLECTIVE_NAMESPACES:
                return func(*args, **kwargs)
            name = func._opname
            sent = args[1:] if name in _OUTPUT_FIRST else args
            ts = _now_us()
            t0 = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                tracer.record(
                    {
                        "kind": "c10d",
                        "name": name,
                        "ns": func.namespace,
                        "bytes": _tensor_bytes(list(sent)),
                        "ts": ts,
                        "dur": (time.perf_counter() - t0) * 1e6,
                        "tid": threading.get_ident(),
                        "thread": threading.current_thread().name,
                    }
                )

    return _CollectiveCounter()


class Tracer:
    """Records spans, c10d ops, process-group creations and store operations for one process.

    Args:
        rank: this process's global rank; read from ``RANK`` when None.
        out_dir: where ``trace-rank<rank>.jsonl`` is written on :meth:`stop` (None: nowhere).
        comm: count c10d ops and patch group creation (spans only when False).
    """

    def __init__(self, rank: int | None = None, out_dir: str | None = None, *, comm: bool = True):
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.out_dir = out_dir
        self.comm = comm
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._modes: dict[int, Any] = {}
        self._patches: list[tuple[Any, str, Any]] = []
        self._stores: list[Any] = []
        self._started = False

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> Tracer:
        """Make this the process's active tracer (and count collectives if asked); returns self."""
        global _ACTIVE
        if _ACTIVE is not None:
            raise RuntimeError("a fastinit Tracer is already active in this process")
        _ACTIVE = self
        self._started = True
        if self.comm:
            self._patch_group_creation()
            self._push_mode()
        return self

    def stop(self) -> None:
        """Stop recording (a no-op if not started)."""
        global _ACTIVE
        if not self._started:
            return
        self._started = False
        if self.comm:
            self._pop_mode()
            for obj, attr, old in reversed(self._patches):
                setattr(obj, attr, old)
            self._patches.clear()
        _ACTIVE = None
        if self.out_dir is not None:
            self.write(self.out_dir)

    def __enter__(self) -> Tracer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @contextlib.contextmanager
    def attach_thread(self) -> Iterator[None]:
        """Count the c10d ops issued by the calling (non-main) thread too.

        Dispatch modes are thread-local: a worker thread that issues collectives enters this.
        """
        if not (self._started and self.comm):
            yield
            return
        self._push_mode()
        try:
            yield
        finally:
            self._pop_mode()

    def _push_mode(self) -> None:
        mode = _make_dispatch_mode(self)
        mode.__enter__()
        self._modes[threading.get_ident()] = mode

    def _pop_mode(self) -> None:
        mode = self._modes.pop(threading.get_ident(), None)
        if mode is not None:
            mode.__exit__(None, None, None)

    # -- recording -----------------------------------------------------------------------------

    def record(self, event: dict[str, Any]) -> None:
        """Append ``event`` (thread-safe)."""
        with self._lock:
            self.events.append(event)

    @contextlib.contextmanager
    def window(self, name: str | None = None) -> Iterator[dict[str, Any]]:
        """Yield a dict that, on exit, holds :func:`summarize` of the events recorded inside.

        With ``name``, the window is also a span. Events of other threads recorded meanwhile count.
        """
        out: dict[str, Any] = {}
        with self._lock:
            start = len(self.events)
        try:
            if name is None:
                yield out
            else:
                with span(name):
                    yield out
        finally:
            with self._lock:
                events = self.events[start:]
            out.update(summarize(events))

    def mark(self, name: str, **attrs: Any) -> None:
        """Record an instant (a point in time, such as "first batch consumed")."""
        self.record({"kind": "mark", "name": name, "ts": _now_us(), "attrs": attrs})

    def wrap_store(self, store: Any) -> Any:
        """Wrap a c10d store so every operation on it (from Python or C++) is recorded.

        The tracer keeps the wrapper alive: C++ holds only a pointer to the Python object.
        """
        wrapped = CountingStore(store, self)
        self._stores.append(wrapped)
        return wrapped

    def _patch_group_creation(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        tracer = self

        def patch(name: str, api: str) -> None:
            original = getattr(c10d, name)

            @functools.wraps(original)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                ts, t0 = _now_us(), time.perf_counter()
                group = original(*args, **kwargs)
                tracer._record_group(api, args, kwargs, group, ts, t0)
                return group

            self._patches.append((c10d, name, original))
            setattr(c10d, name, wrapper)

        patch("_new_group_with_tag", "new_group")
        patch("split_group", "split_group")

    def _record_group(
        self, api: str, args: tuple, kwargs: dict, group: Any, ts: float, t0: float
    ) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else self.rank
        if api == "new_group":
            ranks = kwargs.get("ranks", args[0] if args else None)
            ranks_list = list(range(dist.get_world_size())) if ranks is None else sorted(ranks)
            groups = [ranks_list]
            local_sync = bool(kwargs.get("use_local_synchronization", False))
        else:
            groups = [
                sorted(r)
                for r in (kwargs.get("split_ranks", args[1] if len(args) > 1 else []) or [])
            ]
            ranks_list = next((g for g in groups if rank in g), [])
            local_sync = True
        member = group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER
        self.record(
            {
                "kind": "group",
                "name": api,
                "ranks": ranks_list,
                "splits": len(groups),
                "member": member,
                "local_sync": local_sync,
                "ts": ts,
                "dur": (time.perf_counter() - t0) * 1e6,
                "tid": threading.get_ident(),
            }
        )

    # -- results -------------------------------------------------------------------------------

    def summary(self, since: float | None = None) -> dict[str, Any]:
        """Counts per kind of event; ``since`` (an event timestamp in µs) keeps only later events."""
        with self._lock:
            events = [e for e in self.events if since is None or e["ts"] >= since]
        return summarize(events)

    def write(self, out_dir: str) -> str:
        """Write the events and their summary as ``trace-rank<rank>.jsonl``; returns the path."""
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"trace-rank{self.rank}.jsonl")
        tmp = f"{path}.tmp.{os.getpid()}"
        with self._lock:
            events = list(self.events)
        try:
            with open(tmp, "w") as f:
                f.write(json.dumps({"kind": "meta", "rank": self.rank, "pid": os.getpid()}) + "\n")
                for event in events:
                    f.write(json.dumps(event, default=str) + "\n")
                f.write(json.dumps({"kind": "summary", **summarize(events)}) + "\n")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # a full disk leaves no partial file behind
            raise
        return path


def _unusable_dir(out_dir: str) -> str | None:
    """Why ``out_dir`` cannot take trace files (created if missing), or None when it can."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if not os.path.isdir(out_dir):
        return "not a directory"
    if not os.access(out_dir, os.W_OK | os.X_OK):
        return "not writable"
    return None


@contextlib.contextmanager
def traced_to(out_dir: str, rank: int) -> Iterator[Tracer | None]:
    """Trace the block and write ``trace-rank<rank>.jsonl`` into ``out_dir`` at its end.

    A trace is a diagnostic, never a reason for a job to fail: a directory that cannot be created
    or written (a file, a read-only mount) means no tracer, and a write that fails at the end (a
    full disk) leaves no file; each is one :class:`TraceWarning` and the block's own result or
    exception is untouched. Yields the tracer, or None when tracing is off.
    """
    problem = _unusable_dir(out_dir)
    if problem is not None:
        warnings.warn(
            f"fastinit trace: cannot write traces to {out_dir!r} ({problem}); continuing untraced",
            TraceWarning,
            stacklevel=3,
        )
        yield None
        return
    tracer = Tracer(rank=rank).start()
    try:
        yield tracer
    finally:
        tracer.stop()
        try:
            tracer.write(out_dir)
        except OSError as e:
            warnings.warn(
                f"fastinit trace: could not write rank {rank}'s trace to {out_dir!r} "
                f"({type(e).__name__}: {e}); the job goes on untraced",
                TraceWarning,
                stacklevel=3,
            )


def summarize(events: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Aggregate a list of events into counts and bytes (the numbers tests assert on)."""
    c10d: Counter[str] = Counter()
    store: Counter[str] = Counter()
    spans: dict[str, float] = {}
    c10d_bytes = store_bytes = 0
    groups: list[dict[str, Any]] = []
    for e in events:
        kind = e.get("kind")
        if kind == "c10d":
            c10d[e["name"]] += 1
            c10d_bytes += e.get("bytes", 0)
        elif kind == "store":
            store[e["name"]] += 1
            store_bytes += e.get("bytes", 0)
        elif kind == "group":
            groups.append({k: e[k] for k in ("name", "ranks", "member", "local_sync", "splits")})
        elif kind == "span":
            spans[e["name"]] = spans.get(e["name"], 0.0) + e["dur"] / 1e6
    return {
        "c10d_ops": dict(c10d),
        "c10d_total": sum(c10d.values()),
        "c10d_bytes": c10d_bytes,
        "barriers": c10d.get("barrier", 0) + c10d.get("monitored_barrier", 0),
        "groups": groups,
        "new_groups": len(groups),
        "member_groups": sum(1 for g in groups if g["member"]),
        "store_ops": dict(store),
        "store_total": sum(store.values()),
        "store_bytes": store_bytes,
        "spans_s": spans,
    }


def _store_base() -> type:
    import torch.distributed as dist

    return dist.Store


def _len(value: Any) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, list):
        return sum(_len(v) for v in value)
    return 0


def _counting_store_class() -> type:
    import torch.distributed as dist

    class _CountingStore(dist.Store):
        """A c10d store that forwards to ``inner`` and records each call on ``tracer``."""

        def __init__(self, inner: Any, tracer: Tracer) -> None:
            super().__init__()
            self.inner = inner
            self.tracer = tracer

        def _call(self, op: str, sent: int, fn: Callable[[], Any]) -> Any:
            ts, t0 = _now_us(), time.perf_counter()
            result = fn()
            self.tracer.record(
                {
                    "kind": "store",
                    "name": op,
                    "bytes": sent + _len(result),
                    "ts": ts,
                    "dur": (time.perf_counter() - t0) * 1e6,
                    "tid": threading.get_ident(),
                }
            )
            return result

        def set(self, key: str, value: Any) -> None:
            self._call("set", _len(key) + _len(value), lambda: self.inner.set(key, value))

        def get(self, key: str) -> bytes:
            return self._call("get", _len(key), lambda: self.inner.get(key))

        def add(self, key: str, value: int) -> int:
            return self._call("add", _len(key) + 8, lambda: self.inner.add(key, value))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            sent = _len(key) + _len(expected) + _len(desired)
            return self._call(
                "compare_set", sent, lambda: self.inner.compare_set(key, expected, desired)
            )

        def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
            sent = _len(list(keys))
            if timeout is None:
                self._call("wait", sent, lambda: self.inner.wait(keys))
            else:
                self._call("wait", sent, lambda: self.inner.wait(keys, timeout))

        def check(self, keys: Sequence[str]) -> bool:
            return self._call("check", _len(list(keys)), lambda: self.inner.check(keys))

        def delete_key(self, key: str) -> bool:
            return self._call("delete_key", _len(key), lambda: self.inner.delete_key(key))

        def num_keys(self) -> int:
            return self._call("num_keys", 0, self.inner.num_keys)

        def set_timeout(self, timeout: timedelta) -> None:
            self.inner.set_timeout(timeout)

        @property
        def timeout(self) -> timedelta:
            return self.inner.timeout

        def has_extended_api(self) -> bool:
            return self.inner.has_extended_api()

        def append(self, key: str, value: Any) -> None:
            self._call("append", _len(key) + _len(value), lambda: self.inner.append(key, value))

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return self._call("multi_get", _len(keys), lambda: self.inner.multi_get(keys))

        def multi_set(self, keys: list[str], values: list[Any]) -> None:
            sent = _len(keys) + _len(values)
            self._call("multi_set", sent, lambda: self.inner.multi_set(keys, values))

    return _CountingStore


@functools.cache
def _counting_store_type() -> type:
    return _counting_store_class()


def CountingStore(inner: Any, tracer: Tracer) -> Any:  # noqa: N802 - a class, built lazily
    """A ``torch.distributed.Store`` that forwards to ``inner`` and records every operation."""
    return _counting_store_type()(inner, tracer)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The events of one rank's trace file (meta and summary lines included)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def to_chrome_trace(paths: Iterable[str], label: Callable[[int], str] | None = None) -> dict:
    """Merge per-rank JSONL traces into one Chrome/Perfetto trace (``chrome://tracing``).

    Each rank becomes a process; spans, c10d ops, group creations and store ops become complete
    ("X") events on their thread; marks become instants.
    """
    out: list[dict[str, Any]] = []
    for path in paths:
        events = read_jsonl(path)
        meta = next((e for e in events if e.get("kind") == "meta"), {"rank": 0})
        pid = meta["rank"]
        name = label(pid) if label else f"rank {pid}"
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        for e in events:
            kind = e.get("kind")
            if kind in ("span", "c10d", "group", "store"):
                args = {k: v for k, v in e.items() if k not in ("kind", "name", "ts", "dur", "tid")}
                out.append(
                    {
                        "ph": "X",
                        "name": e["name"],
                        "cat": kind,
                        "pid": pid,
                        "tid": e.get("tid", 0),
                        "ts": e["ts"],
                        "dur": e["dur"],
                        "args": args,
                    }
                )
            elif kind == "mark":
                out.append(
                    {"ph": "i", "s": "p", "name": e["name"], "pid": pid, "tid": 0, "ts": e["ts"]}
                )
    return {"traceEvents": out, "displayTimeUnit": "ms"}
