"""TorchRec's own model-parallel suite with ``fastinit.setup`` swapped in (the peer suite).

The slow test needs ``FASTINIT_TORCHREC_SRC``: a TorchRec source tree at the installed version
(``make peer`` documents how to get one); without it, it is skipped. The quick tests check the
runner's pieces without a tree.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastinit import knobs
from tools.peer.run import Outcome, SuiteResult, _parse_junit, main, run_suite, verdict


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_torchrec_model_parallel_suite_passes_as_for_stock(tmp_path: Path) -> None:
    src = knobs.get_torchrec_src()
    if src is None:
        pytest.skip("FASTINIT_TORCHREC_SRC is not set (a TorchRec source tree, see make peer)")
    pytest.importorskip("hypothesis")  # TorchRec's test utilities need it
    results = {m: run_suite(Path(src), m, tmp_path) for m in ("stock", "swap")}
    assert results["stock"].count("passed") > 0, (tmp_path / "stock.log").read_text()[-3000:]
    problems = verdict(results)
    assert not problems, (problems, (tmp_path / "swap.log").read_text()[-5000:])


def test_the_swap_replaces_only_the_test_utilities_names(tmp_path: Path) -> None:
    # One of TorchRec's test-utility modules (the installed copy), imported in a child process
    # after the swap is installed: its DistributedModelParallel global becomes the stand-in,
    # whose call reaches fastinit.setup; torchrec's own class is untouched.
    code = textwrap.dedent(
        f"""
        import sys, types
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        import torchrec.distributed.model_parallel as mp
        import torchrec.distributed.test_utils
        from tools.peer import swap
        swap.install({str(tmp_path / "calls.jsonl")!r})
        import torchrec.distributed.test_utils.sharding_config as base
        import fastinit
        assert mp.DistributedModelParallel.__name__ == "DistributedModelParallel"
        assert base.DistributedModelParallel is swap.SwappedDMP
        called = []
        fastinit.setup = lambda *a, **k: called.append((a, k)) or "model"
        assert base.DistributedModelParallel("m", device="cpu") == "model"
        assert called == [(("m",), {{"device": "cpu"}})]
        assert not isinstance(object(), base.DistributedModelParallel)
        print("ok")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
    assert '"ok": true' in (tmp_path / "calls.jsonl").read_text()


def test_junit_parsing_and_verdict(tmp_path: Path) -> None:
    xml = tmp_path / "r.xml"
    xml.write_text(
        """<testsuites><testsuite>
        <testcase classname="a.b.T" name="test_ok"/>
        <testcase classname="a.b.T" name="test_bad"><failure message="boom&#10;more"/></testcase>
        <testcase classname="a.b.T" name="test_skip"><skipped message="no gpu"/></testcase>
        </testsuite></testsuites>"""
    )
    got = _parse_junit(xml)
    assert got == [
        Outcome("T::test_ok", "passed", ""),
        Outcome("T::test_bad", "failed", "boom"),
        Outcome("T::test_skip", "skipped", "no gpu"),
    ]
    stock = SuiteResult("stock", [Outcome("T::test_ok", "passed", "")], 1.0, 0, "src")
    swap = SuiteResult("swap", got, 1.0, 1, "src", setup_calls=2)
    problems = verdict({"stock": stock, "swap": swap})
    assert any("1 failed" in p for p in problems)
    fine = SuiteResult("swap", [Outcome("T::test_ok", "passed", "")], 1.0, 0, "src")
    assert any("no fastinit.setup call" in p for p in verdict({"swap": fine}))
    fine.setup_calls = 1
    assert verdict({"stock": stock, "swap": fine}) == []
    skipped = SuiteResult(
        "swap", [Outcome("T::test_ok", "skipped", "")], 1.0, 0, "src", setup_calls=1
    )
    assert verdict({"stock": stock, "swap": skipped}) == ["1 test(s) pass stock but not swapped"]


def test_the_runner_refuses_a_tree_without_the_suite(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--torchrec-src", str(tmp_path), "--out", str(tmp_path / "out")])
    assert info.value.code == 2


def test_the_patched_run_must_pass_what_stock_passes() -> None:
    ok = Outcome("T::test_ok", "passed", "")
    stock = SuiteResult("stock", [ok, Outcome("T::test_b", "passed", "")], 1.0, 0, "src")
    patched = SuiteResult("patched", [ok, Outcome("T::test_b", "skipped", "")], 1.0, 0, "p")
    assert verdict({"stock": stock, "patched": patched}) == ["1 test(s) pass stock but not patched"]
    broken = SuiteResult("patched", [ok, Outcome("T::test_b", "error", "x")], 1.0, 1, "p")
    assert verdict({"patched": broken}) == ["patched: 1 passed, 1 error"]
    assert verdict({"patched": SuiteResult("patched", [], 1.0, 1, "p")}) == [
        "the patched run produced no results (see patched.log)"
    ]
    fine = SuiteResult("patched", [ok, Outcome("T::test_b", "passed", "")], 1.0, 0, "p")
    assert verdict({"stock": stock, "patched": fine}) == []


def test_the_runner_refuses_an_unknown_mode(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    suite = tmp_path / "torchrec" / "distributed" / "tests" / "test_model_parallel_gloo.py"
    suite.parent.mkdir(parents=True)
    suite.write_text("")
    with pytest.raises(SystemExit) as info:
        main(["--torchrec-src", str(tmp_path), "--mode", "stock,patchd"])
    assert info.value.code == 2
    assert "patchd" in capsys.readouterr().err
