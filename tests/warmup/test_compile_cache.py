"""The compile cache on hostile storage: a read-only entry (a shared cache mounted read-only) is
used without writing to it and never raises out of warm-up; no directory iterator leaks."""

from __future__ import annotations

import builtins
import contextlib
import errno
import gc
import io
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

_FP = "f" * 64


@contextlib.contextmanager
def _read_only_fs(root: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make every write below ``root`` fail with EROFS, as on a read-only mount (root ignores
    permission bits, so ``chmod a-w`` proves nothing when the tests run as root). Covers what
    Python and Inductor write with: ``os.open`` with a writing flag (``tempfile``, ``FileLock``),
    ``open``/``io.open`` in a writing mode, ``mkdir``, ``chmod``, ``replace``/``rename``,
    ``unlink``."""
    root = os.path.realpath(root)

    def below(path: Any) -> bool:
        try:
            p = os.path.realpath(os.fspath(path))
        except TypeError:  # a file descriptor
            return False
        return p == root or p.startswith(root + os.sep)

    def erofs(path: Any) -> OSError:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    real_open, real_io_open = os.open, io.open

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & writing and below(path):
            raise erofs(path)
        return real_open(path, flags, *args, **kwargs)

    def file_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax+") and below(file):
            raise erofs(file)
        return real_io_open(file, mode, *args, **kwargs)

    def refuse(real: Any) -> Any:
        def call(path: Any, *args: Any, **kwargs: Any) -> Any:
            if below(path):
                if real is os.mkdir and os.path.isdir(path):
                    raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path))
                raise erofs(path)
            return real(path, *args, **kwargs)

        return call

    def refuse2(real: Any) -> Any:
        def call(src: Any, dst: Any, *args: Any, **kwargs: Any) -> Any:
            if below(src) or below(dst):
                raise erofs(dst)
            return real(src, dst, *args, **kwargs)

        return call

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", file_open)
    monkeypatch.setattr(io, "open", file_open)
    for name in ("mkdir", "chmod", "unlink", "remove", "rmdir"):
        monkeypatch.setattr(os, name, refuse(getattr(os, name)))
    for name in ("replace", "rename"):
        monkeypatch.setattr(os, name, refuse2(getattr(os, name)))
    try:
        yield
    finally:
        monkeypatch.undo()


def _warm_entry(root: str) -> Any:
    """An entry whose Inductor directory holds compiled code (stand-ins) and a MegaCache file."""
    from fastinit.warmup import CompileCache, CompileCacheConfig

    cache = CompileCache(_FP, CompileCacheConfig(directory=root))
    with cache:
        assert cache.inductor_path is not None
        os.makedirs(os.path.join(cache.inductor_path, "fxgraph", "ab"), mode=0o700)
        with open(os.path.join(cache.inductor_path, "fxgraph", "ab", "graph"), "wb") as f:
            f.write(b"compiled")
    return cache


def test_a_read_only_entry_is_used_through_a_private_copy_and_never_written(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils._filelock import FileLock

    from fastinit.warmup import CompileCache, CompileCacheConfig

    root = str(tmp_path / "cc")
    entry = _warm_entry(root).path
    before = sorted(os.walk(entry))
    saved_env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with _read_only_fs(root, monkeypatch), warnings.catch_warnings():
        warnings.simplefilter("error")  # restoring a read-only entry warns about nothing
        cache = CompileCache(_FP, CompileCacheConfig(directory=root))
        restored = cache.restore()
        assert (restored.status, restored.inductor_warm, restored.read_only) == (
            "pending",
            True,
            True,
        )
        active = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert active != cache.inductor_path and not active.startswith(root)
        with open(os.path.join(active, "fxgraph", "ab", "graph"), "rb") as f:
            assert f.read() == b"compiled"  # what the entry holds, readable where Inductor looks
        os.makedirs(os.path.join(active, "locks"), exist_ok=True)
        with FileLock(os.path.join(active, "locks", "x.lock"), timeout=5):  # as Inductor does
            pass
        with pytest.raises(OSError):  # the simulation holds: the entry itself is not writable
            FileLock(os.path.join(str(cache.inductor_path), "locks", "x.lock"), timeout=1).acquire()
        warnings.simplefilter("default")
        with pytest.warns(RuntimeWarning, match="read-only") as record:
            assert cache.save() is False  # a miss on a read-only entry: one warning, no write
        assert len(record) == 1
        cache.confirm()
        cache.close()
        assert not os.path.exists(active)  # the private copy is removed
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == saved_env
    assert sorted(os.walk(entry)) == before


def test_a_read_only_root_without_the_entry_is_one_warning_and_a_miss(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastinit.warmup import CompileCache, CompileCacheConfig

    root = tmp_path / "cc"
    root.mkdir(mode=0o700)
    with _read_only_fs(str(root), monkeypatch):
        cache = CompileCache(_FP, CompileCacheConfig(directory=str(root)))
        with pytest.warns(RuntimeWarning, match="unusable") as record:
            restored = cache.restore()
        assert len(record) == 1 and restored.status == "miss"
        cache.close()


def test_restore_closes_its_directory_iterator(tmp_path: Any) -> None:
    from fastinit.warmup import CompileCache, CompileCacheConfig

    root = str(tmp_path / "cc")
    _warm_entry(root)
    cache = CompileCache(_FP, CompileCacheConfig(directory=root))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with cache as restored:
            assert restored.inductor_warm
        gc.collect()
    leaks = [w for w in record if issubclass(w.category, ResourceWarning)]
    assert not leaks, [str(w.message) for w in leaks]


# -- a real Inductor compile on a read-only entry (fresh processes) -----------------------------

_JOB = """
import json, sys, warnings
warnings.simplefilter("error", ResourceWarning)
import torch
from torch import nn
from torch._dynamo.utils import counters
from fastinit.warmup import (
    CompileCache, CompileCacheConfig, CompileConfig, WarmupConfig, module_fingerprint, warm_up,
)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
config = CompileConfig(targets=("",))
cache = CompileCache(module_fingerprint(model, {"backend": "inductor"}),
                     CompileCacheConfig(directory=sys.argv[1]))
with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    with cache as restored:
        warm_up(model, torch.randn(4, 8), config=WarmupConfig(compile=config))
        if restored.status != "pending":
            cache.save()
print(json.dumps({"status": restored.status, "read_only": restored.read_only,
                  "hits": int(counters["inductor"]["fxgraph_cache_hit"]),
                  "warnings": [str(w.message) for w in record if "fastinit" in str(w.message)]}))
"""


def _ro_command(root: str) -> list[str] | None:
    """A command prefix that runs the job with ``root`` read-only for real, or None."""
    if os.getuid() != 0:
        subprocess.run(["chmod", "-R", "a-w", root], check=True)
        return []
    unshare, mount = shutil.which("unshare"), shutil.which("mount")
    if unshare is None or mount is None:
        return None
    probe = subprocess.run(
        [unshare, "-m", "sh", "-c", f"mount --bind -o ro {root} {root}"], capture_output=True
    )
    if probe.returncode != 0:
        return None
    return [unshare, "-m", "sh", "-c", f'mount --bind -o ro {root} {root} && exec "$@"', "sh"]


@pytest.mark.slow  # two Inductor compiles in fresh processes (cold: ~45 s on 2 shared cores)
@pytest.mark.timeout(600)
def test_inductor_on_a_read_only_entry(tmp_path: Any) -> None:
    import json

    root = str(tmp_path / "cc")

    def job(prefix: list[str]) -> dict[str, Any]:
        out = subprocess.run(
            [*prefix, sys.executable, "-c", _JOB, root],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = job([])
    assert first["status"] == "miss" and not first["read_only"]
    prefix = _ro_command(root)
    if prefix is None:
        pytest.skip("cannot make a directory read-only here (root without mount namespaces)")
    warm = job(prefix)
    assert (warm["status"], warm["read_only"]) == ("hit", True), warm
    assert warm["hits"] >= 1 and warm["warnings"] == [], warm


# -- precompiled targets -----------------------------------------------------------------------


def _precompile_job(cache_dir: str, swap: bool = False) -> dict[str, Any]:
    """Three training steps of a model with two compile targets, from the same initial state,
    with ``CompileConfig(precompile=True)``; ``swap``: the entry's index names each target's
    artifact as ``dense``'s too (a stale or foreign artifact: its guards must refuse it)."""
    import json

    import torch
    from torch import nn
    from torch._dynamo.utils import counters

    from fastinit.warmup import CompileCache, CompileCacheConfig, CompileConfig, compile_modules

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 8))
            self.over = nn.Sequential(nn.Linear(8, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.over(self.dense(x)).squeeze(-1)

    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    config = CompileConfig(targets=("dense", "over"), backend="aot_eager", precompile=True)
    cache = CompileCache.for_targets(model, config, CompileCacheConfig(directory=cache_dir))
    if swap:
        assert cache.path is not None
        index_path = os.path.join(cache.path, "precompiled.json")
        with open(index_path) as f:
            index = json.load(f)
        targets = index["targets"]
        targets["dense"] = targets["over"]
        with open(index_path, "w") as f:
            json.dump(index, f)
    restored = cache.restore()
    found = restored.precompiled
    compile_modules(model, config, cache)
    generator = torch.Generator().manual_seed(1)
    losses, graphs = [], []
    for step in range(3):
        before = int(counters["stats"]["unique_graphs"])
        loss = (model(torch.randn(16 + step, 13, generator=generator)) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        graphs.append(int(counters["stats"]["unique_graphs"]) - before)
    cache.confirm()
    saved = cache.save()
    cache.close()
    return {
        "losses": losses,
        "graphs": graphs,
        "found": found,
        "served": restored.precompiled_served,
        "status": restored.status,
        "saved": saved,
        "targets": {t.path: t.status for t in cache.precompiled_targets},
        # Plain torch.compile (the fallback) is made only if a call needs it.
        "fallbacks": {t.path: t.fallback.compiled.built for t in cache.precompiled_targets},
    }


def _precompile_jobs(cache_dir: str) -> list[dict[str, Any]]:
    return [
        _precompile_job(cache_dir),
        _precompile_job(cache_dir),
        _precompile_job(cache_dir, True),
    ]


@pytest.mark.parametrize(
    "fresh",
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["one-process", "fresh-processes"],
)
def test_a_warm_restart_runs_the_precompiled_targets_without_tracing(
    tmp_path: Any, fresh: bool
) -> None:
    from fastinit.testing.dist import run_ranks

    cache_dir = str(tmp_path / "cc")
    if fresh:  # each job its own process, as restarts are
        first, warm, swapped = (
            run_ranks(_precompile_job, 1, args=(cache_dir, swap), init_pg=False, timeout=240)[0]
            for swap in (False, False, True)
        )
    else:  # the loaded path never enters Dynamo, so one process shows it as well (and faster)
        first, warm, swapped = run_ranks(
            _precompile_jobs, 1, args=(cache_dir,), init_pg=False, timeout=240
        )[0]
    # The first job compiles both targets ahead of time, trains on them and saves them.
    assert first["found"] == 0 and first["graphs"][0] == 2 and first["saved"], first
    assert first["targets"] == {"dense": "compiled", "over": "compiled"}
    # The next loads them: no Dynamo trace at all, and the same losses bit for bit.
    assert warm["found"] == 2 and warm["graphs"] == [0, 0, 0], warm
    assert (warm["status"], warm["served"]) == ("hit", 2), warm
    assert warm["fallbacks"] == {"dense": False, "over": False}, warm
    assert warm["losses"] == first["losses"], (first["losses"], warm["losses"])
    # ``over``'s artifact named for ``dense`` too: its guards refuse it, dense is compiled anew.
    assert swapped["targets"] == {"dense": "compiled", "over": "hit"}, swapped
    assert swapped["graphs"][0] == 1 and swapped["served"] == 1, swapped
    assert swapped["losses"] == first["losses"]


def _unsupported_job() -> dict[str, Any]:
    """A precompile target with a graph break: plain torch.compile serves it (made then)."""
    import torch
    from torch import nn

    from fastinit.warmup import CompileConfig, compile_modules

    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(13, 8)
            self.b = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h)

    torch.manual_seed(0)
    model = nn.Module()
    model.dense = Dense()
    x = torch.randn(16, 13, generator=torch.Generator().manual_seed(1))
    eager = model.dense(x)
    compile_modules(model, CompileConfig(targets=("dense",), backend="eager", precompile=True))
    target = model.dense.forward
    built_before = target.fallback.compiled.built
    out = model.dense(x)
    return {
        "equal": bool(torch.equal(out, eager)),
        "status": target.status,
        "fallback_calls": target.fallback_calls,
        "built": (built_before, target.fallback.compiled.built),
    }


def test_a_target_that_cannot_be_precompiled_is_served_by_torch_compile() -> None:
    from fastinit.testing.dist import run_ranks

    got = run_ranks(_unsupported_job, 1, init_pg=False, timeout=240)[0]
    assert got["status"] == "unsupported" and got["fallback_calls"] == 1, got
    assert got["built"] == (False, True) and got["equal"], got


def _background_job() -> dict[str, Any]:
    """Four steps with WarmupConfig(compile_in_background=True), swapping the compiled targets
    in after the first step, against the same four steps eager."""
    import math

    import torch
    from torch import nn
    from torch._dynamo.utils import counters

    from fastinit.warmup import CompileConfig, WarmupConfig, swap_in_compiled, warm_up

    def build() -> tuple[nn.Module, Any]:
        torch.manual_seed(0)
        model = nn.Module()
        model.dense = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 8))
        model.over = nn.Sequential(nn.Linear(8, 1))
        return model, torch.optim.Adagrad(model.parameters(), lr=0.1)

    def train(model: nn.Module, optimizer: Any, swap: bool) -> list[float]:
        generator = torch.Generator().manual_seed(1)
        losses = []
        for step in range(4):
            x = torch.randn(16 + step, 13, generator=generator)
            loss = (model.over(model.dense(x)) ** 2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if swap and step == 0:  # a step boundary: the compiled code serves from step 2
                assert sorted(swap_in_compiled(model, wait=None)) == ["dense", "over"]
        return losses

    eager = train(*build(), swap=False)
    model, optimizer = build()
    config = CompileConfig(targets=("dense", "over"), backend="aot_eager")
    report = warm_up(
        model,
        torch.randn(8, 13),
        config=WarmupConfig(compile=config, compile_in_background=True),
    )
    graphs = int(counters["stats"]["unique_graphs"])
    losses = train(model, optimizer, swap=True)
    targets = {path: model.get_submodule(path).forward for path in ("dense", "over")}
    return {
        "eager": eager,
        "losses": losses,
        "warmup_graphs": report.graphs_compiled,
        "graphs": int(counters["stats"]["unique_graphs"]) - graphs,
        "calls": {p: (t.eager_calls, t.calls, t.status) for p, t in targets.items()},
        "close": all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(eager, losses)),
    }


@pytest.mark.slow  # a compile thread beside training: young territory for Dynamo, kept out of CI
@pytest.mark.timeout(600)
def test_compile_in_background_trains_eager_then_swaps_at_a_step_boundary() -> None:
    from fastinit.testing.dist import run_ranks

    out = run_ranks(_background_job, 1, init_pg=False, timeout=240)[0]
    assert out["warmup_graphs"] == 0  # warm-up compiled nothing before the first step
    assert out["graphs"] == 2, out  # both targets compiled, on the background thread
    # Step 1 ran eager (one call each), steps 2-4 on the compiled code (three calls each).
    assert out["calls"] == {"dense": (1, 3, "compiled"), "over": (1, 3, "compiled")}, out
    assert out["losses"][0] == out["eager"][0]  # the eager step is the eager step, bit for bit
    assert out["close"], (out["eager"], out["losses"])  # compiled steps: within rounding
