"""Inputs that once escaped as raw errors or misled: each is a warning and the job goes on, or a
clear error on every rank (issue 23: trace directory, timeouts, ``plan_cache=""``, a model that
is already sharded)."""

from __future__ import annotations

from typing import Any

import pytest

from fastinit import knobs
from fastinit.testing.dist import run_ranks


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999", "0", "-5", "86401", "soon"])
def test_collective_timeout_must_be_finite_positive_and_bounded(value: str) -> None:
    with knobs.override(FASTINIT_COLLECTIVE_TIMEOUT=value), pytest.raises(ValueError) as info:
        knobs.get_collective_timeout()
    assert "FASTINIT_COLLECTIVE_TIMEOUT" in str(info.value) and repr(value) in str(info.value)


def test_collective_timeout_accepts_sane_values() -> None:
    with knobs.override(FASTINIT_COLLECTIVE_TIMEOUT=None):
        assert knobs.get_collective_timeout() == 300.0
    for value, seconds in (("0.5", 0.5), ("20", 20.0), ("86400", 86400.0)):
        with knobs.override(FASTINIT_COLLECTIVE_TIMEOUT=value):
            assert knobs.get_collective_timeout() == seconds


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("FASTINIT_CHECKPOINT_WRITE_RATE", v) for v in ("0", "-1M", "fast", "nan", "inf", "1X")
    ] + [("FASTINIT_CHECKPOINT_TIER", v) for v in ("-1", "big", "nanG")],
)  # fmt: skip
def test_checkpoint_sizes_must_be_sizes(knob: str, value: str) -> None:
    get = {
        "FASTINIT_CHECKPOINT_WRITE_RATE": knobs.get_checkpoint_write_rate,
        "FASTINIT_CHECKPOINT_TIER": knobs.get_checkpoint_tier,
    }[knob]
    with knobs.override(**{knob: value}), pytest.raises(ValueError) as info:
        get()
    assert knob in str(info.value) and repr(value) in str(info.value)


def test_checkpoint_delta_is_on_or_off() -> None:
    for value, on in ((None, True), ("on", True), (" OFF ", False), ("off", False)):
        with knobs.override(FASTINIT_CHECKPOINT_DELTA=value):
            assert knobs.get_checkpoint_delta() is on, value
    with knobs.override(FASTINIT_CHECKPOINT_DELTA="no"), pytest.raises(ValueError) as info:
        knobs.get_checkpoint_delta()
    assert "FASTINIT_CHECKPOINT_DELTA" in str(info.value) and "'no'" in str(info.value)


def test_checkpoint_write_rate_accepts_sizes_and_max() -> None:
    cases = ((None, 256 << 20), ("max", None), ("MAX", None), ("1G", 1 << 30), ("100", 100))
    for value, rate in cases:
        with knobs.override(FASTINIT_CHECKPOINT_WRITE_RATE=value):
            assert knobs.get_checkpoint_write_rate() == rate, value


def _inputs(work: str) -> dict[str, Any]:
    import errno
    import os
    import warnings

    import torch
    import torch.distributed as dist
    from torch import nn

    import fastinit
    from fastinit import trace
    from fastinit.testing.models import ModelSpec, build_model

    rank = dist.get_rank()
    spec = ModelSpec(num_tables=2)
    out: dict[str, Any] = {}

    def run(name: str, fn: Any, **knob: str | None) -> Any:
        with warnings.catch_warnings(record=True) as caught, knobs.override(**knob):
            warnings.simplefilter("always")
            try:
                result = fn()
                out[name] = "ok"
            except Exception as e:  # noqa: BLE001 - the test reports what escaped
                result = None
                out[name] = f"{type(e).__name__}: {e}"
        out[name + "_warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        return result

    def model() -> nn.Module:
        return build_model(spec, device="meta")

    # The trace directory: a file, a path under a file, a disk that fills up at the write.
    blocker = os.path.join(work, f"file{rank}")
    with open(blocker, "w") as f:
        f.write("not a directory")
    run("trace_file", lambda: fastinit.setup(model(), seed=1), FASTINIT_TRACE_DIR=blocker)
    under = os.path.join(blocker, "missing", "traces")
    run("trace_missing", lambda: fastinit.setup(model(), seed=1), FASTINIT_TRACE_DIR=under)
    full = os.path.join(work, "full")

    def no_space(self: Any, out_dir: str) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    original_write = trace.Tracer.write
    trace.Tracer.write = no_space  # type: ignore[method-assign]
    try:
        run("trace_full", lambda: fastinit.setup(model(), seed=1), FASTINIT_TRACE_DIR=full)
    finally:
        trace.Tracer.write = original_write  # type: ignore[method-assign]
    out["trace_full_files"] = sorted(os.listdir(full)) if os.path.isdir(full) else []
    with open(blocker) as f:
        out["still_a_file"] = f.read()

    # Timeouts that are not a finite, positive, bounded number of seconds.
    for value in ("nan", "inf", "1e999"):
        run(
            f"timeout_{value}",
            lambda: fastinit.setup(model(), seed=1),
            FASTINIT_COLLECTIVE_TIMEOUT=value,
        )

    # plan_cache="" is off, like the empty knob: nothing read from or written to the cwd.
    cwd = os.path.join(work, f"cwd{rank}")
    os.makedirs(cwd)
    old_cwd = os.getcwd()
    os.chdir(cwd)
    try:
        run("empty_cache", lambda: fastinit.setup(model(), plan_cache="", seed=1))
    finally:
        os.chdir(old_cwd)
    out["empty_cache_files"] = sorted(os.listdir(cwd))

    # A model that is already sharded: the DMP itself, a model holding it, one holding a part.
    dmp = run("first", lambda: fastinit.setup(model(), seed=1))

    class Holder(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    run("again", lambda: fastinit.setup(dmp, seed=1))
    run("holder", lambda: fastinit.setup(Holder(dmp), seed=1))
    run("part", lambda: fastinit.setup(Holder(dmp.module), seed=1))

    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works after all of that
    out["after"] = int(t.item())
    return out


def test_bad_environment_and_inputs_warn_or_fail_clearly_on_every_rank(tmp_path) -> None:
    results = run_ranks(_inputs, 2, args=(str(tmp_path),), timeout=300, pg_timeout=60)
    for r in results:
        for case in ("trace_file", "trace_missing", "trace_full"):
            assert r[case] == "ok", (case, r[case])
            warned = [w for w in r[case + "_warnings"] if w.startswith("TraceWarning")]
            assert len(warned) == 1, (case, r[case + "_warnings"])
        assert "No space left" in r["trace_full_warnings"][-1]
        assert r["trace_full_files"] == []  # no partial trace left behind
        assert r["still_a_file"] == "not a directory"
        for value in ("nan", "inf", "1e999"):
            message = r[f"timeout_{value}"]
            assert message.startswith("ValueError: FASTINIT_COLLECTIVE_TIMEOUT"), message
            assert repr(value) in message, message
        assert r["empty_cache"] == "ok" and r["empty_cache_files"] == []
        cache_warnings = [w for w in r["empty_cache_warnings"] if "plan cache" in w]
        assert not cache_warnings, cache_warnings
        assert r["first"] == "ok"
        for case, where in (
            ("again", "the module itself"),
            ("holder", "submodule 'inner'"),
            ("part", "submodule 'inner."),
        ):
            message = r[case]
            assert message.startswith("StartupError") and "Mismatch" not in message, message
            assert f"{where}" in message and "already sharded" in message, message
            assert "ranks [0, 1]" in message, message  # the same error, raised on every rank
        assert r["after"] == 2
    assert results[0]["again"] == results[1]["again"]
