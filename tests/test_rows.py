"""experiments/rows.py: the results files every sweep appends to and resumes from."""

from experiments.rows import append_rows, read_csv, replace_rows


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
