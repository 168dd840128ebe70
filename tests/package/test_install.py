"""fastinit installs like any library into an environment that already has torch and torchrec.

Slow (fresh virtual environments, minutes): ``pytest -m slow tests/package/test_install.py``. Each
supported stack is built from its package files (``requirements/<stack>/``: torch and fbgemm, then
torchrec with ``--no-deps`` as on any CPU host, then torchrec's other requirements); pip's cache
makes a rerun quick. Into each, ``pip install .`` (and ``.[cpu]``) must add fastinit and change
nothing else: no downgrade of torch 2.14 / fbgemm 1.9 to the 1.8 stack's, and ``pip check`` clean.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import tomllib

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = pathlib.Path(__file__).resolve().parents[2]
STACKS = ("1.8", "1.9")
# torchrec's requirements other than fbgemm-gpu (requirements/common.txt).
TORCHREC_DEPS = ["tensordict", "torchmetrics==1.0.3", "tqdm", "pyre-extensions"]


def _requirements(stack: str, name: str) -> list[str]:
    """The requirement lines of requirements/<stack>/<name>.txt, comments dropped."""
    text = (REPO / "requirements" / stack / f"{name}.txt").read_text()
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def _pin(requirement: str) -> tuple[str, str]:
    name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", requirement).groups()  # type: ignore[union-attr]
    return name.lower().replace("_", "-"), version


MODEL_PY = textwrap.dedent(
    """
    from fastinit.testing.models import ModelSpec, build_model

    def build():
        return build_model(ModelSpec(num_tables=4, rows=64), device="meta")
    """
)


def _run(*cmd: str | os.PathLike[str], cwd: os.PathLike[str] | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [os.fspath(c) for c in cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _freeze(venv: pathlib.Path) -> dict[str, str]:
    out = _run(venv / "bin" / "python", "-m", "pip", "list", "--format", "json")
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(out)}


def _would_install(venv: pathlib.Path, *args: str, cwd: pathlib.Path) -> list[str]:
    report = cwd / "pip-report.json"
    pip = (venv / "bin" / "python", "-m", "pip", "install", "--dry-run", "-q")
    _run(*pip, "--report", report, *args, cwd=cwd)
    doc = json.loads(report.read_text())
    return sorted(i["metadata"]["name"].lower().replace("_", "-") for i in doc["install"])


def _pip_check(venv: pathlib.Path) -> list[str]:
    """``pip check``'s complaints, less the one every CPU host has by design: torchrec's wheel
    requires ``fbgemm-gpu`` (the CUDA build), and the host has ``fbgemm-gpu-cpu`` instead."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [os.fspath(venv / "bin" / "python"), "-m", "pip", "check"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return [
        line
        for line in lines
        if not re.fullmatch(r"torchrec \S+ requires fbgemm-gpu, which is not installed\.", line)
        and line != "No broken requirements found."
    ]


def _fresh_copy(dest: pathlib.Path) -> pathlib.Path:
    """The repository's tracked files (what a fresh clone holds), without build outputs."""
    files = _run("git", "-C", REPO, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    for name in filter(None, files.split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module", params=STACKS)
def torch_env(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> pathlib.Path:
    """A new virtual environment holding one stack: torch and fbgemm, torchrec (--no-deps)."""
    stack = request.param
    venv = tmp_path_factory.mktemp(f"venv-{stack}") / "env"
    _run(sys.executable, "-m", "venv", venv)
    pip = (venv / "bin" / "python", "-m", "pip", "install", "-q")
    torch_fbgemm = _requirements(stack, "cpu")
    _run(*pip, *torch_fbgemm, "numpy", "xxhash")
    _run(*pip, "--no-deps", *_requirements(stack, "torchrec"))
    pins = tmp_path_factory.mktemp(f"pins-{stack}") / "pins.txt"
    pins.write_text("".join(f"{r}\n" for r in torch_fbgemm))
    _run(*pip, *TORCHREC_DEPS, "-c", pins)
    installed = _freeze(venv)
    for requirement in torch_fbgemm + _requirements(stack, "torchrec"):
        name, version = _pin(requirement)
        assert installed[name].split("+")[0] == version.split("+")[0], (stack, name, installed)
    return venv


def test_pip_install_keeps_torch_and_torchrec(
    torch_env: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    src = _fresh_copy(tmp_path / "src")
    before = _freeze(torch_env)
    assert "fastinit" not in before and "fbgemm-gpu" not in before
    assert _pip_check(torch_env) == [], "the stack itself is inconsistent"

    # Nothing but fastinit would be installed, with or without the CPU extra.
    for target in (".", ".[cpu]"):
        assert _would_install(torch_env, target, cwd=src) == ["fastinit"], target

    # Why torchrec is an extra and not a dependency: its wheel requires the CUDA fbgemm-gpu, which
    # pip would add next to fbgemm-gpu-cpu on this CPU host.
    project = tomllib.loads((src / "pyproject.toml").read_text())["project"]
    assert not any(d.lower().startswith("torchrec") for d in project["dependencies"])
    scratch = tmp_path / "scratch"
    (scratch / "scratchpkg").mkdir(parents=True)
    (scratch / "scratchpkg" / "__init__.py").write_text("")
    (scratch / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "scratchpkg"\nversion = "0"\ndependencies = ["torchrec=={before["torchrec"]}"]\n'
    )
    assert "fbgemm-gpu" in _would_install(torch_env, ".", cwd=scratch)

    # pip install . : fastinit and its command, from any directory; torch and torchrec untouched.
    _run(torch_env / "bin" / "python", "-m", "pip", "install", "-q", ".", cwd=src)
    after = _freeze(torch_env)
    assert {k: v for k, v in after.items() if k != "fastinit"} == before
    assert after["fastinit"] == project["version"]
    assert _pip_check(torch_env) == []  # nothing fastinit declares conflicts
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "my_model.py").write_text(MODEL_PY)
    where = _run(torch_env / "bin" / "python", "-c", "import fastinit; print(fastinit.__file__)",
                 cwd=elsewhere)  # fmt: skip
    assert "site-packages" in where
    assert project["version"] in _run(torch_env / "bin" / "fastinit", "--version", cwd=elsewhere)
    out = _run(torch_env / "bin" / "fastinit", "plan", "my_model:build", "-n", "2",
               "--cache", elsewhere / "plans", "--json", cwd=elsewhere)  # fmt: skip
    assert json.loads(out)["status"] == "written"
    _run(torch_env / "bin" / "python", "-m", "fastinit", "--help", cwd=elsewhere)

    # pip install -e . --no-deps (what the Makefile does): the source tree is what is imported.
    _run(torch_env / "bin" / "python", "-m", "pip", "uninstall", "-y", "-q", "fastinit")
    _run(torch_env / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "-e", src)
    where = _run(torch_env / "bin" / "python", "-c", "import fastinit; print(fastinit.__file__)",
                 cwd=elsewhere)  # fmt: skip
    assert pathlib.Path(where.strip()).resolve() == (src / "fastinit" / "__init__.py").resolve()
    assert {k: v for k, v in _freeze(torch_env).items() if k != "fastinit"} == before
    assert project["version"] in _run(torch_env / "bin" / "fastinit", "--version", cwd=elsewhere)
