"""The mechanism studies' report from a results folder: paired differences, the early phase, the plots."""

import csv

import pytest

from experiments import compare_schemes, mechanisms_report

PNG = b"\x89PNG\r\n\x1a\n"


def _write(path, columns, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


@pytest.fixture
def folder(tmp_path):
    """Three rows x two seeds; `tied` is ahead of separate until step 20 and behind after, `half` caches half."""
    final = {("separate", 0): 2.0, ("separate", 1): 2.2, ("tied", 0): 2.3, ("tied", 1): 2.7,
             ("half", 0): 2.1, ("half", 1): 2.5}  # fmt: skip
    cache = {"separate": 1000, "tied": 1000, "half": 500}
    runs = [{"scheme": s, "matching": "given", "seed": seed, "num_kv_heads": 4, "mlp_dim": 7, "params": 11,
             "kv_cache_bytes_per_token": cache[s], "steps": 30, "tokens": 90, "final_val_loss": loss,
             "bits_per_byte": 1.0, "tokens_per_s": 5.0, "wall_s": 1.0, "run": f"{s}-{seed}", "finished_at": "t"}
            for (s, seed), loss in final.items()]  # fmt: skip
    _write(tmp_path / "runs.csv", compare_schemes.RUN_COLUMNS, runs)
    ahead = {10: -0.7, 20: -0.5, 30: 0.0}  # tied - separate: -0.3, -0.1, +0.4 (mean over the seeds)
    curves = [{"scheme": s, "matching": "given", "seed": seed, "step": step, "wall_s": step, "train_loss": "",
               "val_loss": final[s, seed] + (ahead[step] if s == "tied" else 0.0) + (30 - step) / 10}
              for (s, seed) in final for step in (10, 20, 30)]  # fmt: skip
    _write(tmp_path / "curves.csv", compare_schemes.CURVE_COLUMNS, curves)
    (tmp_path / "rows_ties.txt").write_text("# reference: tied\nseparate=\ntied=model.attention.scheme=shared_qk\n")
    (tmp_path / "rows_cache.txt").write_text(
        "# control: half = tied\nseparate=\nhalf=model.attention.num_kv_heads=2\nmissing=\ntied=\n"
    )
    return tmp_path


def test_tables_give_paired_differences_the_early_phase_and_rows_not_run(folder, capsys):
    args = [str(folder), "--rows", str(folder / "rows_ties.txt"), "--rows", str(folder / "rows_cache.txt")]
    assert mechanisms_report.main(args) == 0
    text = (folder / "mechanisms.md").read_text()
    lines = {}  # each row's first line: its line in the study's main table
    for line in (x for x in text.splitlines() if x.startswith("| ")):
        lines.setdefault(line.split(" | ")[0].strip("| "), line)
    tied = lines["tied"].split(" | ")
    assert tied[4] == "2.5000 ± 0.2828"  # mean ± sample std over seeds
    assert tied[5] == "+0.4000"  # (0.3 + 0.5) / 2, paired by seed
    assert tied[10:12] == ["-0.100", "+0.400"]  # Δ vs separate at the early evaluations after the first
    assert tied[-1].strip(" |") == "20"  # the last evaluation with the row ahead of separate
    assert tied[9] == "—"  # the study's reference has no control
    # against its control, paired by seed, with a t interval: half - tied is (-0.2, -0.2), half - separate
    # (+0.1, +0.3): mean +0.2, t(1) = 12.706 x std 0.1414 / sqrt(2) = 1.2706; detectable at 80% power: the
    # noncentrality 16.334 of two pairs (report.power_factor) x 0.1414 / sqrt(2) = 1.6334; against the control the
    # spread is 0, so is d
    half = lines["half"].split(" | ")
    assert half[9] == "-0.2000 [-0.2000, -0.2000] d 0.0000 (tied, n=2)"
    assert half[5:8] == ["+0.2000", "[-1.0706, +1.4706]", "1.6334"]
    assert "Δ vs its control [95%] d" in text and "Δ sep. @20" in text
    assert "| missing | | | 0 | not run yet |" in text
    # steps to separate's mean loss at step 10 (4.1) and at the end (2.1): separate's seed 1 needs step 20 for the
    # first and never gets to the second; tied is there at step 10 on both seeds, and never at 2.1
    assert "| row | to 4.100 (separate's @10) | to 2.100 (separate's @30) |" in text
    assert "| separate | 15 | 30 (1 of 2 seeds) |" in text and "| tied | 10 | not reached |" in text
    assert (folder / "ties_delta.png").read_bytes().startswith(PNG)
    assert (folder / "cache_cache.png").read_bytes().startswith(PNG)
    assert not (folder / "ties_cache.png").exists()  # one cache size: nothing to plot


def test_a_reference_that_names_no_row_is_refused(folder, capsys):
    (folder / "rows_bad.txt").write_text("# reference: nope\nseparate=\n")
    assert mechanisms_report.main([str(folder), "--rows", str(folder / "rows_bad.txt")]) == 2
    assert "'# reference: nope' names no row" in capsys.readouterr().err
    (folder / "rows_bad.txt").write_text("# control: tied = nope\nseparate=\ntied=\n")
    assert mechanisms_report.main([str(folder), "--rows", str(folder / "rows_bad.txt")]) == 2
    assert "'# control: tied = nope' names no row" in capsys.readouterr().err
