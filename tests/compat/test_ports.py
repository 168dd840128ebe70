"""Ports that cannot drift silently (fastinit/ports.py): every upstream function fastinit mirrors
is registered with the hash of its source per supported release, and a source that matches none
is a CompatibilityError naming it."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

from fastinit import compat, knobs, ports
from fastinit._port_hashes import HASHES
from fastinit.errors import CompatibilityError

ROOT = Path(__file__).resolve().parents[2]
ENUMERATE = "torchrec.distributed.planner.enumerators:EmbeddingEnumerator.enumerate"


def test_installed_release_matches_the_registry() -> None:
    found = ports.mismatches()
    assert not found, "\n".join(m.line() for m in found)


def test_every_mirrored_function_is_registered_for_every_supported_release() -> None:
    import torchrec

    keys = set(ports._ports(None))
    assert keys <= set(HASHES), sorted(keys - set(HASHES))
    releases = {r for v in HASHES.values() for r in v if r.startswith("torchrec ")}
    assert f"torchrec {torchrec.__version__.split('+')[0]}" in releases
    for key in keys:
        if key.startswith("torchrec."):
            assert {r for r in HASHES[key] if r.startswith("torchrec ")} == releases, key


def test_sharding_classes_found_on_the_installed_torchrec_are_covered() -> None:
    found = ports.discovered()
    assert any(k.endswith("RwPooledEmbeddingSharding.create_lookup") for k in found)
    assert any(k.endswith("BaseTwEmbeddingSharding.__init__") for k in found)


def test_source_of_is_inspect_getsource() -> None:
    for key in ports._ports(None):
        try:
            obj = inspect.unwrap(ports._resolve(key))
        except AttributeError:  # absent in this release (registered as such)
            assert ports.source_hash(key) == ports.ABSENT
            continue
        assert ports.source_of(obj) == inspect.getsource(obj), key


def test_normalise_ignores_layout_not_code() -> None:
    a = "    def f(x):\n        # a comment\n\n        return x + 1   \n"
    b = "def f(x):\n    return x + 1\n"
    assert ports.normalise(a) == ports.normalise(b)
    assert ports.normalise(b) != ports.normalise(b.replace("1", "2"))


def test_a_changed_hash_is_an_error_naming_the_function(monkeypatch: Any) -> None:
    fake = {k: dict(v) for k, v in HASHES.items()}
    fake[ENUMERATE] = {"torchrec 0.0.1": "0" * 64}
    monkeypatch.setattr(ports, "_registry", lambda: fake)
    monkeypatch.setattr(ports, "_checked", set())
    with pytest.raises(CompatibilityError, match="EmbeddingEnumerator.enumerate") as e:
        ports.check("planner")
    assert "FastEnumerator._enumerate_described" in str(e.value)
    assert "ShardingOption.__deepcopy__" not in str(e.value)  # only what changed
    with knobs.override(FASTINIT_PORT_CHECK="warn"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ports.check("planner")
    assert any("EmbeddingEnumerator.enumerate" in str(x.message) for x in w)
    with knobs.override(FASTINIT_PORT_CHECK="bogus"), pytest.raises(ValueError):
        ports.check("setup")


def test_setup_and_sharders_share_one_check(monkeypatch: Any) -> None:
    # the same mirrored functions (``_ports``): their sources are read and hashed once
    assert ports._ports("sharders") == ports._ports("setup")
    calls: list[str | None] = []
    monkeypatch.setattr(ports, "mismatches", lambda component=None: calls.append(component) or [])
    monkeypatch.setattr(ports, "_checked", set())
    ports.check("setup")
    ports.check("sharders")
    assert calls == ["setup"]
    monkeypatch.setattr(ports, "_checked", set())
    ports.check("sharders")
    ports.check("setup")
    assert calls == ["setup", "setup"]


def test_block_end_keeps_strings_and_brackets_that_sit_left() -> None:
    # a line at or left of the block's indent inside a string or brackets does not end it
    lines = [
        "    def f(x):\n",
        '        s = """\n',
        "text at column 0\n",
        '    """\n',
        "        return (x,\n",
        "    1)\n",
        "    y = 2\n",
    ]
    assert ports._block_end(lines, 0) == 6


def test_compat_require_runs_the_port_check(monkeypatch: Any) -> None:
    calls: list[str] = []
    monkeypatch.setattr(ports, "check", calls.append)
    monkeypatch.setattr(compat, "_passed", set())
    compat.require("planner")
    assert calls == ["planner"]


def test_import_stays_light() -> None:
    code = "import fastinit, sys; print('torchrec' in sys.modules, 'fastinit.ports' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


_CHILD = textwrap.dedent(
    """
    import os, sys, warnings
    import torchrec
    assert torchrec.__file__.startswith(os.environ["SCRATCH"]), torchrec.__file__
    from fastinit import compat, ports
    from fastinit.errors import CompatibilityError
    try:
        compat.require("planner")
    except CompatibilityError as e:
        print("ERROR:", e)
    else:
        print("PASSED")
    os.environ["FASTINIT_PORT_CHECK"] = "warn"
    compat._passed.clear()
    ports._checked.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        compat.require("planner")
    print("WARNED:", any("EmbeddingEnumerator.enumerate" in str(x.message) for x in w))
    """
)


def test_one_byte_edit_of_an_upstream_function_fails_naming_it(tmp_path: Path) -> None:
    """A scratch copy of the installed TorchRec, first on the path, with one byte of a ported
    function changed (a letter of a string in ``EmbeddingEnumerator.enumerate``)."""
    import torchrec

    scratch = tmp_path / "site"
    shutil.copytree(Path(torchrec.__file__).parent, scratch / "torchrec")
    obj = inspect.unwrap(ports._resolve(ENUMERATE))
    path = scratch / "torchrec" / "distributed" / "planner" / "enumerators.py"
    lines = path.read_text().splitlines(keepends=True)
    first = obj.__code__.co_firstlineno - 1
    end = first + len(ports.source_of(obj).splitlines())
    j = next(i for i in range(first, end) if '"No available' in lines[i])
    lines[j] = lines[j].replace('"No available', '"No availablf', 1)
    path.write_text("".join(lines))
    env = dict(os.environ, PYTHONPATH=f"{scratch}{os.pathsep}{ROOT}", SCRATCH=str(scratch))
    env.pop("FASTINIT_PORT_CHECK", None)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR:" in out.stdout, out.stdout
    error = out.stdout.split("ERROR:", 1)[1]
    assert "torchrec.distributed.planner.enumerators.EmbeddingEnumerator.enumerate" in error
    assert "FastEnumerator._enumerate_described" in error
    assert "EmbeddingEnumerator.__init__" not in error  # only the edited function
    assert "WARNED: True" in out.stdout


def test_a_method_replaced_at_run_time_is_judged_by_its_file() -> None:
    """TorchRec's own tests replace methods with ``unittest.mock.patch.object`` while building
    a model: the checks judge the installed file's definition, and fastinit's sharded modules run
    the replacement, as stock does."""
    from unittest import mock

    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection as cls

    from fastinit import compat
    from fastinit.sharding import kernels

    key = "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection._initialize_torch_state"
    expected = ports.source_hash(key)
    assert kernels.replaced_at_run_time(cls, "_initialize_torch_state") is None
    with mock.patch.object(cls, "_initialize_torch_state", lambda self, **kwargs: None):
        assert ports.source_hash(key) == expected
        assert compat._missing(f"{key}>ShardedTensor") is None
        assert kernels.replaced_at_run_time(cls, "_initialize_torch_state") is not None
    assert kernels.replaced_at_run_time(cls, "_initialize_torch_state") is None
