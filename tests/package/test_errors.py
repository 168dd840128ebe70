"""One error family: every exception and warning class fastinit defines derives from
``FastinitError`` / ``FastinitWarning`` (keeping its standard base), and every public one is
``fastinit.errors``' own class wherever it is exported."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import fastinit
from fastinit import errors

# entry points that run when imported (the writer subprocess, ``python -m fastinit``)
_SCRIPTS = {"fastinit.__main__", "fastinit.checkpoint._writer_main", "fastinit.restart.__main__"}


def _modules() -> list[str]:
    names = ["fastinit"]
    for info in pkgutil.walk_packages(fastinit.__path__, "fastinit."):
        if info.name not in _SCRIPTS:
            names.append(info.name)
    return names


def _defined_classes() -> dict[str, type[BaseException]]:
    """``module.Name`` -> every exception or warning class defined in fastinit (not imported)."""
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == name
            ):
                found[f"{name}.{attr}"] = value
    return found


def test_every_public_exception_and_warning_is_in_the_family() -> None:
    classes = _defined_classes()
    public = {k: c for k, c in classes.items() if not k.rsplit(".", 1)[1].startswith("_")}
    assert len(public) > 20, sorted(public)  # the scan sees them
    outside = sorted(
        k
        for k, c in public.items()
        if not issubclass(c, (errors.FastinitError, errors.FastinitWarning))
    )
    assert outside == [], f"not a FastinitError / FastinitWarning: {outside}"
    warnings = [k for k, c in public.items() if issubclass(c, Warning)]
    assert warnings and all(issubclass(public[k], errors.FastinitWarning) for k in warnings)


def test_errors_exports_every_class_it_defines() -> None:
    mine = sorted(
        k
        for k, c in vars(errors).items()
        if isinstance(c, type) and issubclass(c, BaseException) and c.__module__ == errors.__name__
    )
    assert sorted(errors.__all__) == mine


@pytest.mark.parametrize(
    ("name", "standard"),
    [
        ("StartupError", RuntimeError),
        ("CheckpointError", RuntimeError),
        ("PublishError", RuntimeError),
        ("PlanDecodeError", ValueError),
        ("PlanEncodeError", TypeError),
        ("BatchSchemaError", ValueError),
        ("RanksFailed", AssertionError),
        ("TraceWarning", UserWarning),
    ],
)
def test_the_standard_bases_stay(name: str, standard: type[BaseException]) -> None:
    assert issubclass(getattr(errors, name), standard)


def test_faces_export_the_errors_modules_classes() -> None:
    """A class exported by a package face (or a public module) is ``fastinit.errors``' class."""
    faces = ["fastinit", *(m for m in _modules() if m.count(".") == 1)]
    seen = 0
    for face in faces:
        module = importlib.import_module(face)
        for name in getattr(module, "__all__", ()):
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, (BaseException,)):
                assert value is getattr(errors, name), f"{face}.{name}"
                seen += 1
    assert seen >= 10


def test_except_fastinit_error_catches_them() -> None:
    from fastinit.plan.codec import decode_plan

    with pytest.raises(fastinit.FastinitError):
        decode_plan(b"not a plan")
