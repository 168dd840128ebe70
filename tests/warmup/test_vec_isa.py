"""Inductor's CPU vector-ISA probe recorded in the compile cache (fastinit/warmup/vec_isa.py).

Each job is a fresh process (Inductor caches the ISA list for the process). In that process only,
the test wraps Inductor's ``VecISA.check_build`` to count the base probes (compile the test
library with the ISA's flags and ``dlopen`` it in a child; torch 2.14 skips the child when its
cache directory holds a marker, so the build step is what is counted on both stacks) and
``VecISA._probe_load`` to count the children.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux"
    or platform.machine() not in ("x86_64", "AMD64")
    or shutil.which("g++") is None,
    reason="Inductor probes vector ISAs on Linux x86 with a C++ compiler",
)


def _isa_job(root: str, knob: str = "on", env: dict[str, str] | None = None) -> dict[str, Any]:
    import warnings

    os.environ.update(env or {})  # this job's own process

    from torch._inductor import cpu_vec_isa

    from fastinit import knobs
    from fastinit.warmup import CompileCache, CompileCacheConfig

    base: list[str] = []
    tests: list[str] = []  # every test built (or found built) for real, base or intrinsics-only
    children: list[str] = []
    check_build = cpu_vec_isa.VecISA.check_build
    probe_load = cpu_vec_isa.VecISA._probe_load

    def counting_check_build(self: Any, code: str) -> bool:
        tests.append(str(self))
        if code == cpu_vec_isa.VecISA._avx_code:
            base.append(str(self))
        return bool(check_build(self, code))

    def counting_probe_load(self: Any, path: str) -> bool:
        children.append(str(self))
        return bool(probe_load(self, path))

    # Installed in this test process only (a fresh one per job).
    cpu_vec_isa.VecISA.check_build = counting_check_build  # type: ignore[method-assign]
    cpu_vec_isa.VecISA._probe_load = counting_probe_load  # type: ignore[method-assign]
    with (
        knobs.override(FASTINIT_VEC_ISA_RECORD=knob),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        # Inductor's own cache directory (warm from earlier runs: the test libraries are found).
        cache = CompileCache("0" * 64, CompileCacheConfig(directory=root, inductor_dir=False))
        restored = cache.restore()
        cache.close()
    at_restore = len(base)
    picked = cpu_vec_isa.pick_vec_isa()
    picked_ok = bool(picked)  # what Inductor's code generation asks
    return {
        "status": restored.vec_isa,
        "isas": [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()],
        "base": base,
        "children": len(children),
        "tests": len(tests),
        "base_after_restore": len(base) - at_restore,
        "picked": (str(picked), picked_ok),
        "warnings": [str(w.message) for w in caught if "vector-ISA" in str(w.message)],
        "allowed": [
            str(isa)
            for isa in cpu_vec_isa.supported_vec_isa_list
            if all(f in cpu_vec_isa.x86_isa_checker() for f in str(isa).split())
        ],
    }


def _job(root: str, knob: str = "on", env: dict[str, str] | None = None) -> dict[str, Any]:
    from fastinit.testing.dist import run_ranks

    return dict(run_ranks(_isa_job, 1, args=(root, knob, env), init_pg=False, timeout=240)[0])


def _record(root: str) -> str:
    (path,) = glob.glob(os.path.join(root, "vec-isa-*.json"))
    return path


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """A compile-cache root after a first job that really probed (and its result)."""
    root = str(tmp_path_factory.mktemp("isa") / "cc")
    first = _job(root)
    return root, first


def _copy_root(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    os.chmod(dst, 0o700)
    return dst


def test_the_first_job_probes_and_records_every_isa_that_passed(
    probed: tuple[str, dict[str, Any]],
) -> None:
    root, first = probed
    assert first["status"] == "probed", first
    assert first["base"] == first["allowed"] and first["allowed"], first
    assert first["isas"] == first["allowed"], first  # this host passes them all
    path = _record(root)
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path) as f:
        record = json.load(f)
    assert record["passed"] == first["isas"] and record["allowed"] == first["allowed"]
    # Every test Inductor ran is recorded, named by ISA, flags and source: the base test of each.
    tested = [isa for (isa, _flags, _digest) in (c["id"] for c in record["checks"])]
    assert set(tested) == set(first["allowed"]) and all(c["ok"] for c in record["checks"])


def test_a_test_not_recorded_as_passed_runs_for_real(
    probed: tuple[str, dict[str, Any]], tmp_path: Any
) -> None:
    """A record that holds a test as failed (or not at all) does not answer it: Inductor runs it,
    and the list is what that test answers now."""
    root, first = probed
    copy = _copy_root(root, str(tmp_path / "cc"))
    path = _record(copy)
    with open(path) as f:
        record = json.load(f)
    record["checks"][0]["ok"] = False
    record["checks"] = record["checks"][:-1] if len(record["checks"]) > 1 else record["checks"]
    with open(path, "w") as f:
        json.dump(record, f)
    job = _job(copy)
    assert job["status"] == "recorded", job
    assert job["tests"] >= 1, job
    assert job["isas"] == first["isas"] and job["picked"] == first["picked"], job


def test_a_restart_with_a_matching_record_runs_no_base_probe(
    probed: tuple[str, dict[str, Any]], tmp_path: Any
) -> None:
    root, first = probed
    warm = _job(_copy_root(root, str(tmp_path / "cc")))
    assert warm["status"] == "recorded", warm
    # Not one base probe (build + child) at restore or when code generation asks the ISA, and
    # not one child at all (the intrinsics-only tests are answered from the record too)...
    assert warm["base"] == [] and warm["base_after_restore"] == 0, warm
    assert warm["tests"] == 0 and warm["children"] == 0, warm
    # ...and the list, the pick and its answer are what the probing job got.
    assert warm["isas"] == first["isas"], (first, warm)
    assert warm["picked"] == first["picked"], (first, warm)
    assert warm["warnings"] == []


def test_the_knob_turns_the_record_off(probed: tuple[str, dict[str, Any]], tmp_path: Any) -> None:
    root, first = probed
    off = _job(_copy_root(root, str(tmp_path / "cc")), knob="off")
    assert off["status"] == "skipped" and off["base"] == first["base"], off
    assert off["isas"] == first["isas"]


@pytest.mark.parametrize(
    "change",
    ["cpu-flags", "torch-version", "compiler", "an-isa-failed"],
)
def test_a_record_for_another_host_or_torch_is_ignored(
    probed: tuple[str, dict[str, Any]], tmp_path: Any, change: str
) -> None:
    root, first = probed
    copy = _copy_root(root, str(tmp_path / "cc"))
    path = _record(copy)
    with open(path) as f:
        record = json.load(f)
    if change == "cpu-flags":
        record["key"]["cpu"] = ["avx2"]
    elif change == "torch-version":
        record["key"]["torch"] = "0.0.1"
    elif change == "compiler":
        record["key"]["compiler"]["mtime_ns"] += 1
    else:
        record["passed"] = record["passed"][1:]
    with open(path, "w") as f:
        json.dump(record, f)
    job = _job(copy)
    assert job["status"] == "probed", job
    assert job["base"] == first["base"] and job["isas"] == first["isas"], job
    assert job["warnings"] == [], job
    with open(path) as f:
        assert json.load(f)["passed"] == first["isas"]  # rewritten by the probe


@pytest.mark.parametrize("junk", [b"{not json", b'{"key": {}, "allowed": 3}'])
def test_a_corrupt_record_warns_and_probes(
    probed: tuple[str, dict[str, Any]], tmp_path: Any, junk: bytes
) -> None:
    root, first = probed
    copy = _copy_root(root, str(tmp_path / "cc"))
    path = _record(copy)
    with open(path, "wb") as f:
        f.write(junk)
    job = _job(copy)
    assert job["status"] == "probed", job
    assert job["base"] == first["base"] and job["isas"] == first["isas"], job
    assert len(job["warnings"]) == 1 and "corrupt" in job["warnings"][0], job
    with open(path) as f:
        assert json.load(f)["passed"] == first["isas"]


def test_a_mistyped_knob_is_an_error_naming_it(tmp_path: Any) -> None:
    from fastinit import knobs
    from fastinit.warmup.vec_isa import restore_vec_isa

    with knobs.override(FASTINIT_VEC_ISA_RECORD="of"), pytest.raises(ValueError) as info:
        restore_vec_isa(str(tmp_path))
    assert "FASTINIT_VEC_ISA_RECORD" in str(info.value) and "'of'" in str(info.value)


def test_local_ranks_probing_together_build_their_share_of_the_tests_first(
    probed: tuple[str, dict[str, Any]], tmp_path: Any
) -> None:
    """With no record, local rank 1 of 2 first builds the second half of the base tests (rank 0
    starts Inductor's pass at the front), then runs Inductor's whole pass: the same list and
    record as a lone probe's."""
    _, first = probed
    allowed = first["allowed"]
    share = allowed[len(allowed) // 2 :]
    job = _job(str(tmp_path / "cc"), env={"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert job["status"] == "probed", job
    assert job["base"] == share + allowed, job
    assert job["isas"] == first["isas"] and job["picked"] == first["picked"], job
    # local rank 0 builds nothing ahead; nor does a lone rank (the first job above)
    job0 = _job(str(tmp_path / "cc0"), env={"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})
    assert job0["base"] == allowed, job0
