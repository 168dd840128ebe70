"""``import fastinit`` stays cheap: no torch, no torchrec.distributed until something is used."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys
import types

import pytest


def test_import_fastinit_loads_neither_torch_nor_torchrec() -> None:
    code = (
        "import sys, fastinit, fastinit.sharding, fastinit.plan, fastinit.planner, fastinit.pg\n"
        "import fastinit.warmup\n"
        "import fastinit.knobs\n"
        "import fastinit.checkpoint\n"
        "heavy = [m for m in ('torch', 'torchrec', 'torchrec.distributed') if m in sys.modules]\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import fastinit loaded {out.stdout.strip()}"


def test_public_names_resolve_lazily() -> None:
    import fastinit
    import fastinit.planner

    assert callable(fastinit.setup)
    assert issubclass(fastinit.StartupMismatchError, fastinit.StartupError)
    assert fastinit.planner.FastPlanner.__name__ == "FastPlanner"


_FACES = (
    "fastinit",
    "fastinit.checkpoint",
    "fastinit.pg",
    "fastinit.plan",
    "fastinit.planner",
    "fastinit.sharding",
    "fastinit.warmup",
)


def _type_checking_names(module: types.ModuleType) -> dict[str, str]:
    """Name -> module of every import under the face's ``if TYPE_CHECKING:``."""
    tree = ast.parse(pathlib.Path(module.__file__ or "").read_text())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module, ast.dump(imp)
                out.update({a.name: imp.module for a in imp.names})
    return out


@pytest.mark.parametrize("face", _FACES)
def test_a_faces_three_lists_agree_and_resolve(face: str) -> None:
    """``__all__``, the ``TYPE_CHECKING`` imports and the run-time map name the same things, and
    every name is the object its module defines (one helper, ``fastinit._lazy``, serves them)."""
    module = importlib.import_module(face)
    exports = module._EXPORTS
    public = set(module.__all__) - {"__version__"}
    declared = _type_checking_names(module)
    assert set(declared) == public
    # the map may add submodules reached as attributes (``fastinit.plan``), nothing else
    assert {n for n in exports if n not in public} == {
        n for n, m in exports.items() if m == f".{n}" and n not in public
    }
    assert public <= set(exports)
    for name in sorted(public):
        value = getattr(module, name)
        source = importlib.import_module(exports[name], face)
        expected = source if exports[name] == f".{name}" else getattr(source, name)
        assert value is expected, f"{face}.{name}"
        if not isinstance(value, types.ModuleType):
            assert getattr(importlib.import_module(declared[name]), name) is value, name
    assert public <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        getattr(module, "no_such_name")  # noqa: B009 - the lazy __getattr__'s own error
