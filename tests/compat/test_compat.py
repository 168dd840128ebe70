"""fastinit.compat: decided by what torch/TorchRec have, not by the version string."""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

pytest.importorskip("torchrec")

import torchrec  # noqa: E402

from fastinit import compat  # noqa: E402
from fastinit.errors import CompatibilityError  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_compat() -> Iterator[None]:
    """Each test sees ``require`` check again, and leaves no state behind."""
    saved = (set(compat._passed), compat._warned_version)
    compat._passed.clear()
    compat._warned_version = False
    yield None
    compat._passed.clear()
    compat._passed.update(saved[0])
    compat._warned_version = saved[1]


def test_every_component_is_satisfied_by_the_installed_versions() -> None:
    for component in compat.COMPONENTS:
        assert compat.missing(component) == [], component
        compat.require(component)


def test_a_source_build_whose_version_reads_unknown_is_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    saved = torchrec.__version__
    torchrec.__version__ = "unknown"  # what a TorchRec imported from a source checkout reports
    try:
        with caplog.at_level(logging.WARNING, logger="fastinit.compat"):
            for component in compat.COMPONENTS:
                compat.require(component)  # before: CompatibilityError for "unknown"
        assert not caplog.records
    finally:
        torchrec.__version__ = saved


def test_a_local_build_suffix_is_accepted_silently(caplog: pytest.LogCaptureFixture) -> None:
    saved = torchrec.__version__
    torchrec.__version__ = "1.8.0+cu128"
    try:
        with caplog.at_level(logging.WARNING, logger="fastinit.compat"):
            compat.require("setup")
        assert not caplog.records
    finally:
        torchrec.__version__ = saved


def test_another_release_with_everything_present_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    saved = torchrec.__version__
    torchrec.__version__ = "1.9.0"
    try:
        with caplog.at_level(logging.WARNING, logger="fastinit.compat"):
            compat.require("setup")
            compat.require("pg")
        assert len(caplog.records) == 1
        assert "1.9.0" in caplog.records[0].getMessage()
    finally:
        torchrec.__version__ = saved


def test_missing_names_are_each_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchrec.distributed.collective_utils as cu
    import torchrec.distributed.comm as comm

    monkeypatch.delattr(comm, "_INTRA_PG")
    monkeypatch.delattr(comm, "_CROSS_PG")
    monkeypatch.delattr(cu, "_resolve_enablement_on_leader")
    assert compat.missing("pg") == [
        "torchrec.distributed.comm._INTRA_PG",
        "torchrec.distributed.comm._CROSS_PG",
    ]
    with pytest.raises(CompatibilityError, match=r"(?s)\(pg\).*_INTRA_PG.*_CROSS_PG") as info:
        compat.require("pg")
    assert "torchrec 1.8.0" in str(info.value)
    with pytest.raises(CompatibilityError, match="_resolve_enablement_on_leader"):
        compat.require("setup")
    compat.require("warmup")  # unaffected


def test_a_failed_check_is_not_remembered_as_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchrec.distributed.comm as comm

    with monkeypatch.context() as m:
        m.delattr(comm, "_INTRA_PG")
        with pytest.raises(CompatibilityError):
            compat.require("pg")
    compat.require("pg")


def test_warm_up_requires_the_warmup_component(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from fastinit.warmup import warm_up

    absent = "torch.compiler:no_such_capability_fastinit_checks"
    monkeypatch.setitem(compat.COMPONENTS, "warmup", (*compat.COMPONENTS["warmup"], absent))
    with pytest.raises(CompatibilityError, match="no_such_capability_fastinit_checks"):
        warm_up(torch.nn.Linear(2, 1), torch.zeros(1, 2))


def test_instance_attributes_and_keyword_arguments_are_read_from_code() -> None:
    assert compat._missing("torchrec.optim.keyed:CombinedOptimizer@_optims") is None
    assert compat._missing("torchrec.optim.keyed:CombinedOptimizer@_no_such_attr") == (
        "torchrec.optim.keyed.CombinedOptimizer instances' attribute _no_such_attr"
    )
    # A decorated constructor (TorchRec's planner logs its calls): the wrapped code is read.
    assert (
        compat._missing("torchrec.distributed.planner.planners:EmbeddingShardingPlanner@_proposers")
        is None
    )
    assert compat._missing("torch.nn.parallel:DistributedDataParallel(init_sync)") is None
    assert compat._missing("torch.nn.parallel:DistributedDataParallel(no_such_kw)") == (
        "torch.nn.parallel.DistributedDataParallel(no_such_kw=...)"
    )
    assert compat._missing(
        "no_such_module_fastinit:x",
    ).startswith("module no_such_module_fastinit")


def test_unknown_component() -> None:
    with pytest.raises(ValueError, match="unknown fastinit component 'nope'"):
        compat.require("nope")


def test_importing_compat_stays_light() -> None:
    code = "import sys, fastinit.compat; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_setup_accepts_a_source_build_in_a_fresh_process() -> None:
    # The whole import path of setup as a source checkout would see it, in a clean process.
    code = (
        "import torchrec\n"
        "torchrec.__version__ = 'unknown'\n"
        "from fastinit import compat\n"
        "for c in compat.COMPONENTS: compat.require(c)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# -- the torch/fbgemm pair: an unsupported one is named before fbgemm's own error ----------------

REPO = pathlib.Path(__file__).resolve().parents[2]

# What `import fbgemm_gpu` raises with torch 2.15.0 and fbgemm-gpu-cpu 1.9.0 (issue 34).
BROKEN_FBGEMM = (
    "raise OSError('/venv/lib/python3.11/site-packages/fbgemm_gpu/fbgemm_gpu_py.so: "
    "undefined symbol: _ZN3c1015report_overflowEPKc')\n"
)
MODEL_PY = (
    "from fastinit.testing.models import ModelSpec, build_model\n\n"
    "def build():\n    return build_model(ModelSpec(num_tables=2, rows=16), device='meta')\n"
)
SETUP_PY = (
    "import torch, fastinit\n"
    "try:\n    fastinit.setup(torch.nn.Linear(2, 2))\n"
    "except Exception as e:\n    print(type(e).__name__)\n    print(e)\n"
)


def _fake_stack(root: pathlib.Path, versions: dict[str, str]) -> pathlib.Path:
    """A directory to put first on ``sys.path``: an ``fbgemm_gpu`` whose import fails as the
    real one does on a torch it was not built for, and distribution metadata claiming
    ``versions`` ({distribution: version}) for whatever it names."""
    (root / "fbgemm_gpu").mkdir(parents=True)
    (root / "fbgemm_gpu" / "__init__.py").write_text(BROKEN_FBGEMM)
    for dist, version in versions.items():
        info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return root


def _run(
    args: list[str], fake: pathlib.Path, cwd: pathlib.Path
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{fake}{os.pathsep}{REPO}")
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def test_an_unsupported_torch_fbgemm_pair_is_named_before_fbgemm_fails(
    tmp_path: pathlib.Path,
) -> None:
    fake = _fake_stack(tmp_path / "fake", {"torch": "2.15.0", "fbgemm-gpu-cpu": "1.9.0"})
    (tmp_path / "my_model.py").write_text(MODEL_PY)
    # The command: a clear message and exit status 4, no traceback, fbgemm never imported.
    done = _run(["-m", "fastinit", "plan", "my_model:build", "-n", "2", "--cache", "plans"],
                fake, tmp_path)  # fmt: skip
    assert done.returncode == 4, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "undefined symbol" not in done.stderr
    err = " ".join(done.stderr.split())
    assert "torch 2.15.0" in err and "fbgemm-gpu-cpu 1.9.0" in err, err
    assert "torch 2.13.x with fbgemm-gpu(-cpu) 1.8.x" in err
    assert "torch 2.14.x with fbgemm-gpu(-cpu) 1.9.x" in err
    # fastinit.setup: CompatibilityError, the same names.
    done = _run(["-c", SETUP_PY], fake, tmp_path)
    lines = done.stdout.splitlines()
    assert lines and lines[0] == "CompatibilityError", done.stdout + done.stderr[-3000:]
    assert "torch 2.15.0" in done.stdout and "fbgemm-gpu-cpu 1.9.0" in done.stdout
    assert "torch 2.14.x" in done.stdout


def test_a_supported_pair_whose_fbgemm_does_not_load_is_named_with_its_error(
    tmp_path: pathlib.Path,
) -> None:
    fake = _fake_stack(tmp_path / "fake", {})  # the installed (supported) versions' metadata
    (tmp_path / "my_model.py").write_text(MODEL_PY)
    installed = compat.installed_versions()
    done = _run(["-m", "fastinit", "plan", "my_model:build", "-n", "2", "--cache", "plans"],
                fake, tmp_path)  # fmt: skip
    assert done.returncode == 4 and "Traceback" not in done.stderr, done.stderr[-3000:]
    err = " ".join(done.stderr.split())
    assert f"torch {installed['torch']}" in err and f"{installed['fbgemm']}" in err, err
    assert "`import fbgemm_gpu` failed (OSError:" in err
    assert "undefined symbol: _ZN3c1015report_overflowEPKc" in err
    done = _run(["-c", SETUP_PY], fake, tmp_path)
    assert done.stdout.splitlines()[:1] == ["CompatibilityError"], done.stderr[-3000:]
    assert "`import fbgemm_gpu` failed" in done.stdout


def test_the_installed_stack_is_supported_and_versions_are_read_without_importing() -> None:
    installed = compat.installed_versions()
    assert installed["torch"] is not None and installed["fbgemm"] is not None
    compat.require_stack()
    code = (
        "import sys; from fastinit import compat; v = compat.installed_versions(); "
        "print(v['torch'] is not None, 'torch' in sys.modules, 'fbgemm_gpu' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False", "False"]


@pytest.mark.parametrize(
    ("version", "series"),
    [("2.14.1+cpu", "2.14"), ("1.9.0", "1.9"), ("2.13.0+cu128", "2.13"), ("2.16.0.dev20260101", "2.16"),
     ("2026.1.5", None), ("1.9.0+git1234", None), ("INTERNAL", None), (None, None)],
)  # fmt: skip
def test_release_series(version: str | None, series: str | None) -> None:
    assert compat._series(version) == series


def test_the_declared_torch_range_is_what_the_lanes_test() -> None:
    import tomllib
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(d) for d in project["dependencies"] if d.startswith("torch"))

    def pinned(stack: str, name: str, package: str) -> str:
        for line in (REPO / "requirements" / stack / f"{name}.txt").read_text().splitlines():
            line = line.split("#")[0].strip()
            if line.startswith(f"{package}=="):
                return line.split("==")[1]
        raise AssertionError(f"no {package} pin in requirements/{stack}/{name}.txt")

    def series(version: str) -> str:
        return ".".join(version.split("+")[0].split(".")[:2])

    lanes = sorted(p.name for p in (REPO / "requirements").iterdir() if p.is_dir())
    stacks = {
        (
            series(pinned(lane, "cpu", "torch")),
            series(pinned(lane, "cpu", "fbgemm-gpu-cpu")),
            series(pinned(lane, "torchrec", "torchrec")),
        )
        for lane in lanes
    }
    assert stacks == set(compat.SUPPORTED_STACKS)
    for lane in lanes:  # every lane's torch, CPU and CUDA builds, is in the range
        for flavor in ("cpu", "cuda"):
            assert torch_req.specifier.contains(Version(pinned(lane, flavor, "torch"))), lane
    # ...and nothing else: not the series below the oldest lane's or above the newest's.
    minors = sorted(int(t.split(".")[1]) for t, _, _ in compat.SUPPORTED_STACKS)
    assert minors == list(range(minors[0], minors[-1] + 1))
    assert not torch_req.specifier.contains(Version(f"2.{minors[0] - 1}.0"))
    assert not torch_req.specifier.contains(Version(f"2.{minors[-1] + 1}.0"))
