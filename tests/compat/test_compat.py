"""fastinit.compat: decided by what torch/TorchRec have, not by the version string."""

from __future__ import annotations

import logging
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
