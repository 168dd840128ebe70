"""The README a newcomer reads: short, its knobs table generated from ``knobs.KNOBS``, its commands
those CI runs, and every link in it and in ``docs/`` pointing at something that exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastinit import knobs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The README stays readable in ten minutes.
MAX_LINES = 200
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES})"


def test_the_readme_holds_the_generated_knobs_table() -> None:
    """A knob added, removed, or whose default or words changed fails here until the README is
    regenerated (``python -m fastinit.knobs --markdown``)."""
    table = knobs.markdown_table()
    assert table in README.read_text(), (
        "README.md's knobs table differs from fastinit.knobs.KNOBS: paste the output of "
        "`python -m fastinit.knobs --markdown`"
    )
    for name in knobs.KNOBS:
        assert f"| `{name}` |" in table


def test_the_knobs_table_is_one_row_per_knob_and_escapes_pipes() -> None:
    lines = knobs.markdown_table().splitlines()
    assert len(lines) == 2 + len(knobs.KNOBS)
    with pytest.MonkeyPatch.context() as mp:  # fastinit.knobs' own dict, restored on exit
        mp.setitem(knobs.KNOBS, "FASTINIT_X", "a | b")
        assert "| `FASTINIT_X` | a \\| b |" in knobs.markdown_table()


def test_python_m_fastinit_knobs_prints_the_table() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fastinit.knobs", "--markdown"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert out == knobs.markdown_table()


def test_the_two_commands_are_those_ci_runs() -> None:
    """The README's test command is what ``.ci/run`` runs; both commands are Makefile targets."""
    text = README.read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for command in re.findall(r"^step (make .*)$", ci, flags=re.M):
        assert command in text, f"README.md does not show CI's `{command}`"
    for target in ("bench", "test"):
        assert f"make {target}" in text
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"no `{target}` target"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            out.add(_anchor(m.group(1)))
    return out


def test_anchor_slugs() -> None:
    assert _anchor("What each part gives") == "what-each-part-gives"
    assert _anchor("`fastinit.setup`: the one-line change") == "fastinitsetup-the-one-line-change"


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(doc: Path) -> None:
    """Every relative link names a file or folder that exists, and its ``#anchor`` a heading."""
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{doc.relative_to(ROOT)}: broken links: {broken}"
