"""The experiments' docs stay what their commands produce: a README table marked as copied from a results
folder's summary is that summary's table, and every script the docs run as ``python experiments/X.py`` (not
``-m``) can import the repository it lives in."""

import ast
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
    """(source path, the table after each marker) for every ``<!-- copied from PATH -->`` in ``readme``."""
    lines = readme.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if m := COPIED.search(line):
            table = []
            for row in lines[i + 1 :]:
                if not row.startswith("|"):
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
        assert table.count("\n") >= 2, f"{readme}: no table follows the marker for {source}"
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
