"""One shape legend: every axis letter the package spells (einsum strings, arrow comments such as ``BSKH -> BKSH``,
shape annotations) is a letter of :data:`qkvjax.axes.LEGEND`, and the legend's table lists exactly those letters."""

import re
from pathlib import Path

import pytest

import qkvjax
from qkvjax import axes

PACKAGE = Path(qkvjax.__file__).parent
EINSUM = re.compile(r"einsum\(\s*f?\"([^\"]+)\"")
ANNOTATION = re.compile(r"(?:Float|Int|Bool|Shaped)\[Array, \"([^\"]*)\"\]")
ARROW = re.compile(r"([A-Z][A-Z(),]*)\s*->\s*([A-Z][A-Z(),]*)")  # BSKH -> BKSH, BTD,DNH->BTNH, KU -> NU


def spelled(path: Path) -> list[tuple[int, str, str]]:
    """(line, where, letters) of every shape spelling in one file."""
    found = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for m in EINSUM.finditer(line):
            found.append((n, "einsum", re.sub(r"\{[^}]*\}", "", m.group(1))))
        for m in ANNOTATION.finditer(line):
            found.append((n, "annotation", "".join(d.lstrip("#") for d in m.group(1).split() if not d.isdigit())))
        comment = line.split("#", 1)[1] if "#" in line else ""
        for m in ARROW.finditer(comment):
            found.append((n, "comment", m.group(1) + m.group(2)))
    return found


def test_every_spelled_axis_is_in_the_legend():
    spellings = [(p, *s) for p in sorted(PACKAGE.rglob("*.py")) for s in spelled(p)]
    assert len(spellings) > 50  # the scan sees the package's einsums, annotations and comments
    stray = lambda letters: sorted(set(re.sub("[^A-Z]", "", letters)) - set(axes.LEGEND))  # noqa: E731
    unknown = [
        f"{p.relative_to(PACKAGE)}:{n} {where} {letters!r}: {stray(letters)}"
        for p, n, where, letters in spellings
        if stray(letters)
    ]
    assert not unknown, "letters outside qkvjax.axes' legend:\n" + "\n".join(unknown)


def test_the_legend_table_lists_each_letter_once():
    rows = re.findall(r"^([A-Z])\s{2,}\S", axes.__doc__, flags=re.M)
    assert len(rows) == len(set(rows)), f"a letter with two rows: {rows}"
    assert "".join(rows) == axes.LEGEND


@pytest.mark.parametrize("bad", ['jnp.einsum("BTX,XNH->BTNH", x, w)', "y = x.T  # BTZ -> BZT"])
def test_the_scan_catches_a_stray_letter(tmp_path, bad):
    f = tmp_path / "m.py"
    f.write_text(bad + "\n")
    assert set("".join(s[2] for s in spelled(f))) - set(axes.LEGEND)
