"""Modules moved to ``fastinit.plan`` still import from their old ``fastinit.sharding`` paths, as
the very same module objects (private names, monkeypatches and mocks included); names moved
between modules are the same objects at the old place."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

MOVED = ("codec", "cache", "fingerprint", "provenance", "validate", "_json")


@pytest.mark.parametrize("name", MOVED)
def test_old_path_is_the_moved_module(name: str) -> None:
    new = importlib.import_module(f"fastinit.plan.{name}")
    old = importlib.import_module(f"fastinit.sharding.{name}")
    assert old is new
    assert sys.modules[f"fastinit.sharding.{name}"] is new
    import fastinit.sharding

    assert getattr(fastinit.sharding, name) is new


def test_old_imports_in_a_fresh_process() -> None:
    # the old path first (nothing of fastinit.plan imported yet), private names included
    code = (
        "import sys\n"
        "from fastinit.sharding.codec import encode_plan, _encode_value\n"
        "from fastinit.sharding import cache, _json\n"
        "import fastinit.sharding.fingerprint as fp\n"
        "import fastinit.plan.codec, fastinit.plan.cache, fastinit.plan.fingerprint\n"
        "assert encode_plan is fastinit.plan.codec.encode_plan\n"
        "assert _encode_value is fastinit.plan.codec._encode_value\n"
        "assert cache is fastinit.plan.cache and fp is fastinit.plan.fingerprint\n"
        "assert _json is sys.modules['fastinit.plan._json']\n"
        "assert encode_plan.__module__ == 'fastinit.plan.codec'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_monkeypatch_through_the_old_path_reaches_the_new(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import fastinit.plan.cache

    monkeypatch.setattr("fastinit.sharding.cache.STALE_TMP_SECONDS", 12345.0)
    assert fastinit.plan.cache.STALE_TMP_SECONDS == 12345.0


def test_compile_config_is_one_class_at_every_path() -> None:
    # moved to fastinit.warmup.targets (no import circle with the compile cache); the old names
    # are the same objects
    import fastinit.warmup
    import fastinit.warmup.targets
    import fastinit.warmup.warmup

    for name in ("CompileConfig", "resolve_targets"):
        new = getattr(fastinit.warmup.targets, name)
        assert getattr(fastinit.warmup.warmup, name) is new
        assert getattr(fastinit.warmup, name) is new
