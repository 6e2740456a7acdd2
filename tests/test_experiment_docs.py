"""The experiments' docs stay what their commands produce: a README table marked as copied from a results
folder's summary is that summary's table, and every script the docs run as ``python experiments/X.py`` (not
``-m``) can import the repository it lives in."""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.helpers import REPO

COPIED = re.compile(r"<!-- copied from (\S+)")  # the marker's path is relative to the README's folder
SCRIPT_FOLDERS = ("experiments", "benchmarks", "benchmarks/levers", "tests/faults")
LOCAL_PACKAGES = {"experiments", "benchmarks", "tests"}


def copied_tables(readme):
    """(source path, the table or list after each marker) for every ``<!-- copied from PATH -->`` in ``readme``:
    the rows after it that start with ``|`` (a table) or ``- `` (a list, e.g. the trend lines)."""
    lines = readme.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if m := COPIED.search(line):
            table = []
            for row in lines[i + 1 :]:
                if not row.startswith(("|", "- ")):
                    if table:
                        break
                    continue
                table.append(row)
            out.append((readme.parent / m.group(1), "\n".join(table)))
    return out


@pytest.mark.parametrize("readme", ["README.md", "experiments/README.md"])
def test_copied_tables_are_their_summaries_tables(readme):
    marked = copied_tables(REPO / readme)
    if readme == "experiments/README.md":  # the Δ tables of the size ladder are marked; a lost marker fails here
        assert len(marked) >= 2, marked
    for source, table in marked:
        assert source.is_file(), f"{readme}: the marker names {source}, which does not exist"
        assert table.count("\n") >= 1, f"{readme}: no table or list follows the marker for {source}"
        assert table in source.read_text(), (
            f"{readme}: the table marked as copied from {source.relative_to(REPO)} is not in it (stale?); "
            f"regenerate the summary and copy the table again:\n{table}"
        )


def test_copied_table_check_catches_a_stale_cell(tmp_path):
    """The check above could fail: a README whose copied table differs from its summary in one cell."""
    (tmp_path / "summary.md").write_text("| a | b |\n|---|---|\n| x | +0.010 |\n")
    readme = "text\n<!-- copied from summary.md -->\n\n| a | b |\n|---|---|\n| x | +0.011 |\n"
    (tmp_path / "README.md").write_text(readme)
    [(source, table)] = copied_tables(tmp_path / "README.md")
    assert source == tmp_path / "summary.md" and table not in source.read_text()


def _scripts():
    for folder in SCRIPT_FOLDERS:
        for path in sorted((REPO / folder).glob("*.py")):
            if 'if __name__ == "__main__"' in path.read_text():
                yield path


def _first_local_import_before_path_insert(tree):
    """The line of the first top-level import of a repository package (experiments, benchmarks, tests) that comes
    before the script puts the repository on ``sys.path``, or None."""
    for node in tree.body:
        if "sys.path.insert" in ast.unparse(node):
            return None
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        if any(n.split(".")[0] in LOCAL_PACKAGES for n in names):
            return node.lineno
    return None


def test_scripts_put_the_repository_on_the_path_before_importing_from_it():
    """``python experiments/report.py DIR`` (as the docs say) has only experiments/ on sys.path: an import of
    ``experiments.*`` above the ``sys.path.insert`` fails with ModuleNotFoundError before main runs."""
    scripts = list(_scripts())
    assert len(scripts) >= 10, scripts
    bad = {}
    for path in scripts:
        line = _first_local_import_before_path_insert(ast.parse(path.read_text()))
        if line is not None:
            bad[str(path.relative_to(REPO))] = line
    assert not bad, f"imports of the repository above the sys.path.insert (script: line): {bad}"


def test_report_runs_as_a_script_as_the_readme_says(tmp_path):
    """The real thing, for the report the README names first: a copy of the committed comparison's rows."""
    folder = tmp_path / "compare_cpu"
    folder.mkdir()
    for name in ("runs.csv", "curves.csv", "protocol.json"):
        shutil.copy(REPO / "experiments/results/compare_cpu" / name, folder)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MPLCONFIGDIR": str(tmp_path / "mpl")}  # no PYTHONPATH
    proc = subprocess.run([sys.executable, "experiments/report.py", str(folder)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = (folder / "summary.md").read_text()
    assert summary.strip() == proc.stdout.strip()
    assert "| 95% interval | d | inside spread |" in summary
    # every Δ row names its detectable difference, a positive number
    for row in (r for r in summary.splitlines() if r.startswith("| shared_kv ")):
        assert float(row.split("|")[9]) > 0, row


INTERVAL = re.compile(r"([+-]\d\.\d{3,4})(?: ± \d\.\d{3,4})? \[([+-]\d\.\d{3,4}), ([+-]\d\.\d{3,4})\]")


def _intervals(text):
    """Every ``m [lo, hi]`` figure in ``text`` (a standard error between them dropped), rounded to 3 decimals."""
    return {tuple(f"{float(v):+.3f}" for v in m.groups()) for m in INTERVAL.finditer(text)}


def quoted_but_missing(answers, results_text):
    """The ``m [lo, hi]`` figures of ``answers`` that no results file holds."""
    held = _intervals(results_text)
    return sorted(f for f in _intervals(answers) if f not in held)


def test_the_answers_quote_only_figures_their_results_hold():
    """Every interval the short answers quote (a Δ or a trend, "m [lo, hi]") is one that a results folder's
    summary prints (3-decimal figures, or 4-decimal ones rounded): an answer cannot keep a figure its report no
    longer gives, e.g. a per-seed trend after the verdict moved to the fit with the size as the unit."""
    text = (REPO / "experiments/README.md").read_text()
    answers = text[text.index("## The answers, in short") : text.index("## Regenerate")]
    results = "\n".join(p.read_text() for p in (REPO / "experiments/results").rglob("*") if p.suffix in (".md", ".txt"))
    assert len(_intervals(answers)) >= 40
    assert quoted_but_missing(answers, results) == []
    # and it could fail: a figure one digit off
    assert quoted_but_missing("+0.036 [+0.026, +0.047]", "+0.036 [+0.026, +0.046] d 0.013") == [
        ("+0.036", "+0.026", "+0.047")
    ]
    assert quoted_but_missing("+0.047 [+0.004, +0.090]", "+0.0471 [+0.0041, +0.0901] d 0.0565") == []


PROTOCOL_TIME = re.compile(r"committed in `([0-9a-f]{7,40})` at\s+(\d{4}-\d\d-\d\d \d\d:\d\d) UTC")


def test_each_protocols_stated_time_is_its_commits():
    """A pre-registration's time is its commit's: every "committed in `HASH` at TIME UTC" in experiments/README.md
    names a commit of this repository whose commit time (UTC, to the minute) is TIME."""
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"], capture_output=True,
                      text=True).stdout.strip() != "false":  # fmt: skip
        pytest.skip("a shallow clone (or no git): the protocols' commits are not here to compare with")
    stated = PROTOCOL_TIME.findall((REPO / "experiments/README.md").read_text())
    assert len(stated) >= 10
    for commit, when in stated:
        show = ["git", "-C", str(REPO), "show", "-s", "--date=format-local:%Y-%m-%d %H:%M", "--format=%cd", commit]
        got = subprocess.run(show, capture_output=True, text=True, env={**os.environ, "TZ": "UTC"})
        assert got.returncode == 0, f"experiments/README.md names {commit}, not a commit here: {got.stderr}"
        assert got.stdout.strip() == when, f"{commit}: the README says {when} UTC, git says {got.stdout.strip()}"
