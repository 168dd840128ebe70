"""The tracer: spans, counts at the dispatcher, groups, store ops, files, zero cost when off."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from fastinit import trace
from fastinit.testing.dist import run_ranks


def test_span_without_tracer_records_nothing_and_pushes_no_mode() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    assert trace.active() is None
    with trace.span("idle"):
        assert _get_current_dispatch_mode_stack() == []

    @trace.span("decorated")
    def f(x: int) -> int:
        return x + 1

    assert f(1) == 2
    assert trace.active() is None


def test_spans_context_and_decorator_are_recorded(tmp_path) -> None:
    @trace.span("decorated", kind="fn")
    def f() -> None:
        with trace.span("inner"):
            pass

    with trace.Tracer(rank=3, out_dir=str(tmp_path), comm=False) as tracer:
        with trace.span("outer"):
            f()
        with pytest.raises(ValueError), trace.span("fails"):
            raise ValueError("x")
        worker = threading.Thread(
            target=lambda: trace.span("threaded").__enter__().__exit__(None, None, None)
        )
        worker.start()
        worker.join()
    names = [e["name"] for e in tracer.events if e["kind"] == "span"]
    assert names == ["inner", "decorated", "outer", "fails", "threaded"]
    failed = next(e for e in tracer.events if e["name"] == "fails")
    assert failed["error"] == "ValueError"
    assert next(e for e in tracer.events if e["name"] == "decorated")["attrs"] == {"kind": "fn"}
    lines = (tmp_path / "trace-rank3.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"kind": "meta", "rank": 3, "pid": json.loads(lines[0])["pid"]}
    assert json.loads(lines[-1])["kind"] == "summary"
    assert set(json.loads(lines[-1])["spans_s"]) == set(names)
    chrome = trace.to_chrome_trace([str(tmp_path / "trace-rank3.jsonl")])
    xs = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in xs) == sorted(names)
    assert all(e["pid"] == 3 for e in xs)


def test_only_one_tracer_at_a_time() -> None:
    with trace.Tracer(comm=False), pytest.raises(RuntimeError, match="already active"):
        trace.Tracer(comm=False).start()
    assert trace.active() is None


def test_window_counts_only_inside() -> None:
    with trace.Tracer(comm=False) as tracer:
        tracer.record({"kind": "c10d", "name": "broadcast_", "bytes": 4, "ts": 0.0, "dur": 1.0})
        with tracer.window() as counts:
            tracer.record({"kind": "c10d", "name": "allgather_", "bytes": 8, "ts": 1.0, "dur": 1.0})
            tracer.record({"kind": "store", "name": "get", "bytes": 3, "ts": 2.0, "dur": 1.0})
    assert counts["c10d_ops"] == {"allgather_": 1}
    assert counts["c10d_bytes"] == 8
    assert counts["store_ops"] == {"get": 1}


def _collectives() -> dict:
    import torch.distributed as dist

    tracer = trace.active()
    assert tracer is not None
    rank = dist.get_rank()
    with tracer.window() as counts:
        t = torch.ones(4)
        dist.all_reduce(t)  # 16 bytes
        out = [torch.empty(2, dtype=torch.float64) for _ in range(2)]
        dist.all_gather(out, torch.zeros(2, dtype=torch.float64))  # 16 bytes sent
        dist.barrier()
        dist.new_group([0, 1])
        dist.new_group([0], use_local_synchronization=True) if rank == 0 else None

        # Issued from a worker thread that attached itself.
        def worker() -> None:
            with tracer.attach_thread():
                dist.broadcast(torch.ones(2), src=0)  # 8 bytes

        th = threading.Thread(target=worker)
        th.start()
        th.join()
        # Issued from C++: DDP verifies and broadcasts parameters at construction.
        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    return counts


def test_counts_c10d_ops_groups_and_store_ops_on_real_ranks() -> None:
    results = run_ranks(_collectives, 2, trace=True, return_failures=True)
    for r in results:
        assert r.ok, r.error
        counts = r.value
        ops = counts["c10d_ops"]
        assert ops["allreduce_"] == 1
        assert ops["allgather_"] >= 2  # ours + DDP's verification (from C++)
        assert ops["broadcast_"] >= 2  # ours + DDP's parameter broadcast (from C++)
        assert counts["barriers"] == 1
        names = {g["name"] for g in counts["groups"]}
        assert names == {"new_group"}
        assert counts["store_total"] > 0
        # The whole run's summary covers init_process_group's store rendezvous too.
        assert r.trace["store_ops"]["set"] >= 1
    g0 = results[0].value["groups"]
    g1 = results[1].value["groups"]
    assert [g["ranks"] for g in g0] == [[0, 1], [0]]
    assert all(g["member"] for g in g0)
    assert [(g["ranks"], g["member"]) for g in g1] == [([0, 1], True)]


def test_torch_compile_still_compiles_under_an_active_tracer() -> None:
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter)
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) + 1

    torch._dynamo.reset()
    with trace.Tracer(comm=True):
        f(torch.ones(3))
    torch._dynamo.reset()
    assert counter.frame_count == 1, "Dynamo skipped the frame: the tracer's mode blocks compile"


def test_a_tracer_wraps_the_group_constructors_only_while_it_runs() -> None:
    from torch.distributed import distributed_c10d as c10d

    names = ("_new_group_with_tag", "split_group")
    before = {name: getattr(c10d, name) for name in names}
    with trace.Tracer(comm=True):
        assert all(getattr(c10d, name) is not before[name] for name in names)
    assert all(getattr(c10d, name) is before[name] for name in names), "not restored"
    with trace.Tracer(comm=False):  # spans only: nothing wrapped
        assert all(getattr(c10d, name) is before[name] for name in names)
