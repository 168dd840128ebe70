"""Start-up stages run as soon as their inputs are ready, with collectives in one fixed order.

A trainer's start-up is a handful of stages (Meta names seven: ``device_init``,
``process_group_init``, ``preproc_creation``, ``train_module_creation``, ``init_plugins``,
``pre_train``, ``get_first_batch_data``). Several are independent: the data pipeline can start
while the model is sharded, and compilation can run on a synthetic batch while the pipeline still
produces the real first batch. :class:`StageGraph` runs each stage on a thread as soon as the
stages it depends on have finished, and passes it their results.

Collectives: ranks must issue collectives in the same order. Stages declared ``collective=True``
run one at a time on a single dedicated thread (the *collective lane*), in declaration order, each
waiting for its own dependencies. That order is fixed when the graph is defined, so it is the same
on every rank whatever order the local stages finish in. Local stages never share that thread, so
a slow local stage delays a collective stage only if the collective stage depends on it.

Failures: the first stage that raises cancels every stage that has not started and the graph
raises :class:`StageError` naming the stage and the rank, chained to the original exception.
Stages already running on other threads cannot be killed (Python has no safe way to stop a
thread): the graph waits for them at most :attr:`GraphConfig.drain_timeout_s` and then raises
anyway, leaving them behind. Stages run on daemon threads (not a ``ThreadPoolExecutor``, whose
threads the interpreter joins at exit), so a stage stuck forever cannot keep the process alive
after the error has been raised. A peer blocked in a collective whose
partner failed is released by the process group's own timeout. Every rank's error also names the
stage (and rank) that failed first, published through a c10d store: ``GraphConfig.store``, or by
default the store of the default process group, looked up when a failure happens, so a stage of the
graph itself may create the process group.

Inputs: ``deps`` names the stages whose results a stage takes: a mapping ``{parameter: stage}``
passes them by keyword, a sequence passes them positionally in order; ``after`` names stages that
must finish first without passing their results (ordering only).

CUDA: the current device is per thread. Before each stage, its thread sets
:attr:`GraphConfig.device` (by default ``cuda:$LOCAL_RANK`` when torch is loaded and CUDA is
available; nothing on CPU).

Example (a torchrun trainer; the process group is created by a stage)::

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    graph = StageGraph()
    graph.add(
        "process_group_init",
        lambda: dist.init_process_group("nccl", device_id=device),  # torch 2.15's nccl needs it
        collective=True,
    )
    graph.add("preproc_creation", make_dataloader)
    graph.add("train_module_creation", shard, after=("process_group_init",), collective=True)
    graph.add("get_first_batch_data", next, deps=("preproc_creation",))
    graph.add("pre_train", warm, deps={"model": "train_module_creation"}, collective=True)
    results = graph.run()
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastinit import trace
from fastinit.errors import StageError

__all__ = ["Stage", "StageError", "GraphConfig", "StageGraph"]

_FAILURE_KEY = "fastinit/warmup/{graph}/failed"


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Stage:
    """One start-up stage."""

    name: str
    """Unique name; also the name of the stage's :class:`fastinit.trace.span`."""
    fn: Callable[..., Any]
    """Called with the results of ``deps`` (positionally) and ``inputs`` (by keyword)."""
    deps: tuple[str, ...] = ()
    """Stages whose results are passed positionally, in this order."""
    inputs: tuple[tuple[str, str], ...] = ()
    """``(parameter, stage)`` pairs: that stage's result is passed as that keyword argument."""
    after: tuple[str, ...] = ()
    """Stages that must finish first; their results are not passed (ordering only)."""
    collective: bool = False
    """Issues collectives: runs on the collective lane, in declaration order."""

    @property
    def requires(self) -> tuple[str, ...]:
        """Every stage that must finish before this one."""
        return (*self.deps, *(stage for _, stage in self.inputs), *self.after)


@dataclasses.dataclass(kw_only=True, slots=True)
class GraphConfig:
    """How a :class:`StageGraph` runs."""

    max_workers: int = 4
    """Daemon threads for local (non-collective) stages; the collective lane has its own."""
    timeout_s: float | None = None
    """The whole graph fails with a ``TimeoutError`` if it has not finished by then (None: no bound)."""
    drain_timeout_s: float = 30.0
    """After a failure, how long to wait for stages already running before raising anyway."""
    rank: int | None = None
    """Rank named in errors; default: the process group's rank, else ``RANK``, else 0."""
    store: Any = None
    """A c10d store shared by the ranks, or a callable returning one (called on failure): on
    failure this rank publishes ``stage@rank`` there, and reads the first published failure so its
    error names it. None: the default process group's store, if one exists by then. Touched only
    on failure (no store traffic when start-up succeeds)."""
    device: Any = "auto"
    """The CUDA device each stage's thread makes current before the stage runs (the current
    device is per thread). "auto": ``cuda:$LOCAL_RANK`` when torch is already loaded and CUDA is
    available, else nothing; None: never set."""
    name: str = "startup"
    """Names the store key, so several graphs in one job do not mix their failures."""

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")


class _Cancelled(Exception):
    """Raised inside the lane when the graph was cancelled before a stage could start."""


def _thread_device(setting: Any) -> Any:
    """The device stage threads make current, resolved once per run (None: leave as is)."""
    if setting is None:
        return None
    if setting != "auto":
        return setting
    torch = sys.modules.get("torch")  # never import torch just to learn the device
    if torch is None or not torch.cuda.is_available():
        return None
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"


def _set_device(device: Any) -> None:
    if device is None:
        return
    from fastinit.warmup.warmup import set_thread_device

    set_thread_device(device)


def _default_store() -> Any:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


def _default_rank() -> int:
    dist = sys.modules.get("torch.distributed")  # never import torch just to learn the rank
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return int(os.environ.get("RANK", "0"))


class StageGraph:
    """A DAG of start-up stages; see the module docstring.

    Args:
        config: how the graph runs (default :class:`GraphConfig`).
    """

    def __init__(self, config: GraphConfig | None = None) -> None:
        self.config = config or GraphConfig()
        self._stages: dict[str, Stage] = {}

    @property
    def stages(self) -> list[Stage]:
        """The stages in declaration order."""
        return list(self._stages.values())

    def add(
        self,
        name: str,
        fn: Callable[..., Any],
        deps: Sequence[str] | Mapping[str, str] = (),
        *,
        after: Sequence[str] = (),
        collective: bool = False,
    ) -> StageGraph:
        """Declare a stage; returns the graph so declarations can chain.

        Args:
            name: unique stage name.
            fn: the stage; called with the results of ``deps``.
            deps: the stages whose results ``fn`` takes: ``{parameter: stage}`` passes each by
                keyword; a sequence of stage names passes them positionally, in order.
            after: stages that must finish first, whose results ``fn`` does not take.
            collective: the stage issues collectives (runs on the collective lane).

        Raises:
            ValueError: duplicate name or a dependency not declared yet.
        """
        if isinstance(deps, str) or isinstance(after, str):
            raise TypeError("deps and after take stage names in a sequence, not one string")
        if isinstance(deps, Mapping):
            positional: tuple[str, ...] = ()
            inputs = tuple((str(k), str(v)) for k, v in deps.items())
        else:
            positional, inputs = tuple(deps), ()
        stage = Stage(
            name=name,
            fn=fn,
            deps=positional,
            inputs=inputs,
            after=tuple(after),
            collective=collective,
        )
        return self.add_stage(stage)

    def add_stage(self, stage: Stage) -> StageGraph:
        """Declare a prepared :class:`Stage` (e.g. from :func:`fastinit.warmup.resume_stage`)."""
        if stage.name in self._stages:
            raise ValueError(f"stage {stage.name!r} is declared twice")
        missing = [d for d in stage.requires if d not in self._stages]
        if missing:
            raise ValueError(f"stage {stage.name!r} depends on undeclared stage(s) {missing}")
        self._stages[stage.name] = stage
        return self

    def stage(
        self,
        name: str | None = None,
        deps: Sequence[str] | Mapping[str, str] = (),
        *,
        after: Sequence[str] = (),
        collective: bool = False,
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator form of :meth:`add` (the name defaults to the function's)."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.add(name or fn.__name__, fn, deps, after=after, collective=collective)
            return fn

        return decorate

    def collective_order(self) -> list[str]:
        """The order the collective stages run in: declaration order, the same on every rank."""
        return [s.name for s in self._stages.values() if s.collective]

    def run(self) -> dict[str, Any]:
        """Run every stage; returns ``{stage name: result}``.

        Raises:
            StageError: the first stage to fail, on this rank (chained to its exception).
        """
        return _Run(self.stages, self.config).run()


class _Run:
    """One execution of a graph (a graph can be run more than once)."""

    def __init__(self, stages: list[Stage], config: GraphConfig) -> None:
        self.stages = stages
        self.config = config
        self.device = _thread_device(config.device)
        self.results: dict[str, Any] = {}
        self.cond = threading.Condition()
        self.cancelled = False
        self.events: queue.SimpleQueue[tuple[str, BaseException | None]] = queue.SimpleQueue()
        self.running: set[str] = set()

    # -- stage execution ---------------------------------------------------------------------

    def _call(self, stage: Stage) -> bool:
        """Run one stage; False when it failed (or the graph was cancelled before it started)."""
        with self.cond:
            if self.cancelled:
                return False
            args = [self.results[d] for d in stage.deps]
            kwargs = {param: self.results[d] for param, d in stage.inputs}
            self.running.add(stage.name)
        error: BaseException | None = None
        try:
            _set_device(self.device)
            with trace.span(stage.name, collective=stage.collective):
                value = stage.fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the main thread
            error = e
        with self.cond:
            self.running.discard(stage.name)
            if error is None:
                self.results[stage.name] = value
            self.cond.notify_all()
        self.events.put((stage.name, error))
        return error is None

    def _worker(self, work: queue.SimpleQueue[Stage | None]) -> None:
        while (stage := work.get()) is not None:
            self._call(stage)

    def _lane(self, stages: list[Stage]) -> None:
        tracer = trace.active()
        with tracer.attach_thread() if tracer is not None else contextlib.nullcontext():
            for stage in stages:
                deps = stage.requires

                def ready(deps: tuple[str, ...] = deps) -> bool:
                    return self.cancelled or all(d in self.results for d in deps)

                with self.cond:
                    self.cond.wait_for(ready)
                if not self._call(stage):
                    return  # failed or cancelled: no later collective may start

    # -- driver ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        config = self.config
        local = [s for s in self.stages if not s.collective]
        lane_stages = [s for s in self.stages if s.collective]
        deadline = None if config.timeout_s is None else time.monotonic() + config.timeout_s
        work: queue.SimpleQueue[Stage | None] = queue.SimpleQueue()
        workers = [
            threading.Thread(
                target=self._worker, args=(work,), name=f"fastinit-stage-{i}", daemon=True
            )
            for i in range(min(config.max_workers, len(local)))
        ]
        lane = threading.Thread(
            target=self._lane, args=(lane_stages,), name="fastinit-collective-lane", daemon=True
        )
        threads = [*workers, lane] if lane_stages else workers
        for thread in threads:
            thread.start()
        submitted: set[str] = set()
        finished = 0
        failure: tuple[str, BaseException] | None = None
        try:
            while finished < len(self.stages):
                for stage in local:
                    if stage.name in submitted:
                        continue
                    with self.cond:
                        ready = all(d in self.results for d in stage.requires)
                    if ready:
                        submitted.add(stage.name)
                        work.put(stage)
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    name, error = self.events.get(timeout=wait)
                except queue.Empty:
                    with self.cond:
                        running = sorted(self.running)
                    failure = (
                        running[0] if running else "<graph>",
                        TimeoutError(
                            f"start-up graph did not finish within {config.timeout_s}s; "
                            f"still running: {running}"
                        ),
                    )
                    break
                finished += 1
                if error is not None:
                    failure = (name, error)
                    break
        finally:
            if failure is not None or finished < len(self.stages):  # also on KeyboardInterrupt
                self._cancel()
            for _ in workers:
                work.put(None)
        if failure is None:
            for thread in threads:
                thread.join()
            return dict(self.results)
        self._drain(threads)
        failed, error = failure
        rank = self.config.rank if self.config.rank is not None else _default_rank()
        first = self._publish(failed, rank)
        raise StageError(failed, rank, error, first) from error

    def _cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()

    def _drain(self, threads: list[threading.Thread]) -> None:
        """Wait (bounded) for stages that were already running when the graph failed."""
        end = time.monotonic() + self.config.drain_timeout_s
        for thread in threads:
            thread.join(max(0.0, end - time.monotonic()))

    def _publish(self, stage: str, rank: int) -> tuple[str, int] | None:
        """Record this failure in the shared store (first writer wins) and read the first one."""
        key = _FAILURE_KEY.format(graph=self.config.name)
        mine = f"{stage}@{rank}".encode()
        try:
            store = self.config.store
            if store is None:
                store = _default_store()
            elif callable(store) and not hasattr(store, "compare_set"):
                store = store()
            if store is None:
                return None
            first = store.compare_set(key, "", mine)
        except Exception:  # noqa: BLE001 - the store may be gone with the failing peer
            return None
        text = bytes(first).decode(errors="replace")
        name, _, first_rank = text.rpartition("@")
        try:
            return (name, int(first_rank))
        except ValueError:
            return None
