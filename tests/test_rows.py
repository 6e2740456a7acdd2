"""experiments/rows.py: the results files every sweep appends to and resumes from."""

import json
import subprocess
import sys
from pathlib import Path

from experiments.rows import append_rows, read_csv, replace_rows, write_json


def test_rows_append_with_one_header_and_replace_whole(tmp_path):
    path = tmp_path / "runs.csv"
    assert read_csv(path) == []
    append_rows(path, ["run", "loss"], [{"run": "a", "loss": 2.5}])
    append_rows(path, ["run", "loss"], [{"run": "b", "loss": 2.25}, {"run": "c", "loss": 3.0}])
    assert path.read_text().count("run,loss") == 1
    assert [r["run"] for r in read_csv(path)] == ["a", "b", "c"]
    replace_rows(path, ["run", "loss"], [{"run": "b", "loss": 2.25}])
    assert read_csv(path) == [{"run": "b", "loss": "2.25"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.csv"]  # no temporary file left beside it


def test_a_row_cut_by_a_kill_is_skipped_then_dropped_before_the_next_append(tmp_path):
    path = tmp_path / "runs.csv"
    append_rows(path, ["run", "loss"], [{"run": "a", "loss": 2.5}])
    with open(path, "a") as f:
        f.write("b,2.2")  # the writer was killed here: no line end
    assert read_csv(path) == [{"run": "a", "loss": "2.5"}]
    append_rows(path, ["run", "loss"], [{"run": "c", "loss": 3.0}])
    assert path.read_text().splitlines() == ["run,loss", "a,2.5", "c,3.0"]  # the half row gone, not glued to c
    cut_header = tmp_path / "curves.csv"
    cut_header.write_text("ru")
    append_rows(cut_header, ["run", "loss"], [{"run": "d", "loss": 1.0}])
    assert read_csv(cut_header) == [{"run": "d", "loss": "1.0"}]


def test_a_json_record_that_fails_part_way_leaves_the_earlier_one_whole(tmp_path):
    """``write_json`` over an earlier record, failing part-way as on a full disk (a process limited to 200-byte
    files: the kernel's EFBIG, SIGXFSZ ignored; no root needed): the earlier record still reads, nothing is left
    beside it. Until 2026-12-01 protocol.json and probe.json were truncated first, and an empty one stopped the
    sweep's resume at ``json.loads``."""
    path = tmp_path / "probe.json"
    write_json(path, {"d160": 4470.5})
    code = (
        "import resource, signal, sys; from pathlib import Path; from experiments.rows import write_json; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); resource.setrlimit(resource.RLIMIT_FSIZE, (200, 200)); "
        "write_json(Path(sys.argv[1]), {f'd{i}': float(i) for i in range(100)})"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[1])  # fmt: skip
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr[-1000:]
    assert json.loads(path.read_text()) == {"d160": 4470.5}
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]
    write_json(path, {"d48": 1.0})
    assert json.loads(path.read_text()) == {"d48": 1.0}
