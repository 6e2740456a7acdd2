"""experiments/retrofit.py end to end at a toy size: a base, its conversions, an uptraining that starts from the
converted weights at step 0 and reads the base's window order on, a from-scratch reference; a row per run, and a
rerun that skips what is done."""

import dataclasses
import shutil

import numpy as np
import pytest

from experiments import retrofit
from experiments.rows import read_csv
from qkvjax.workdir import load_config

STRICT_DTYPE_PROMOTION = False  # optax inside the training runs


@pytest.mark.slow  # eight tiny training runs, 1-3 minutes on 2 cores: `pytest -m slow tests/test_retrofit_study.py`
def test_the_study_runs_at_a_toy_size_and_resumes(tmp_path, small_text, data_dir, monkeypatch, capsys):
    monkeypatch.setattr(retrofit, "SIZE", 8)
    monkeypatch.setattr(retrofit, "BUDGETS", (0.05,))
    monkeypatch.setattr(retrofit, "SCRATCH_SCALES", (1.05,))
    monkeypatch.setattr(retrofit, "TARGETS", {k: retrofit.TARGETS[k] for k in ("shared_qk", "gqa2")})
    real = retrofit.base_tokens
    monkeypatch.setattr(retrofit, "base_tokens", lambda data: real(data) // 8)  # 1.25 tokens a parameter here
    out, scratch = tmp_path / "out", tmp_path / "scratch"
    args = ["--corpus", small_text, "--scratch", str(scratch), "--out", str(out), "--seeds", "0",
            "--data-dir", data_dir]  # fmt: skip
    assert retrofit.main(args) == 0
    rows = read_csv(out / "runs.csv")
    assert [r["run"] for r in rows] == ["base-separate-b1-seed0", "uptrain-shared_qk-b0.05-seed0",
                                        "uptrain-gqa2-b0.05-seed0", "scratch-shared_qk-b1.05-seed0",
                                        "scratch-gqa2-b1.05-seed0"]  # fmt: skip
    assert all(np.isfinite(float(r["final_val_loss"])) for r in rows)
    base, up = rows[0], rows[1]
    assert 0 < float(up["conversion_error"]) < 2 and up["scheme"] == "shared_qk" and rows[2]["num_kv_heads"] == "2"
    assert int(up["start_batch"]) == int(base["steps"])  # the base's window order, read on past where it stopped
    assert int(up["steps"]) < int(base["steps"])
    config = load_config(str(scratch / "uptrain-shared_qk-b0.05-seed0"))
    assert config.train.num_steps == int(up["steps"]) and config.data.start_batch == int(base["steps"])
    assert dataclasses.asdict(config.data)["sampling"] == "disjoint"
    assert retrofit.main(args) == 0  # everything done: nothing runs again
    assert "0 runs left (5 done)" in capsys.readouterr().out and len(read_csv(out / "runs.csv")) == 5
    # a new machine: the scratch folder is gone and a budget is added; the base is trained again, its row kept
    shutil.rmtree(scratch)
    monkeypatch.setattr(retrofit, "BUDGETS", (0.05, 0.1))
    monkeypatch.setattr(retrofit, "TARGETS", {"gqa2": retrofit.TARGETS["gqa2"]})
    assert retrofit.main(args + ["--stages", "uptrain"]) == 0
    assert "training base-separate-b1-seed0 again" in capsys.readouterr().out
    runs = [r["run"] for r in read_csv(out / "runs.csv")]
    assert runs[5:] == ["uptrain-gqa2-b0.1-seed0"] and runs.count("base-separate-b1-seed0") == 1


def test_the_report_pairs_each_budget_with_its_from_scratch_length_and_answers(tmp_path):
    """retrofit_report on constructed rows: 1% and 3% against scratch on N, 10% against 1.1 N, 30% against 1.3 N,
    the gap paired by seed with its t interval (numpy/scipy in float64), the answer the first budget whose upper
    bound is below the pre-registered d; a target with a budget short of seeds is open."""
    from scipy import stats

    from experiments import retrofit_report
    from experiments.rows import append_rows

    rows = []
    for seed in range(3):
        rows.append({"stage": "base", "target": "separate", "budget": 1.0, "seed": seed, "final_val_loss": 1.7,
                     "tokens": 1000})  # fmt: skip
        for scale, loss in ((1.0, 1.80), (1.1, 1.78), (1.3, 1.75)):
            rows.append({"stage": "scratch", "target": "mqa", "budget": scale, "seed": seed,
                         "final_val_loss": loss + 0.001 * seed, "tokens": 1000})  # fmt: skip
        for budget, gap in ((0.01, 0.30), (0.03, 0.10), (0.1, -0.01), (0.3, -0.02)):
            ref = {0.01: 1.80, 0.03: 1.80, 0.1: 1.78, 0.3: 1.75}[budget]
            loss = ref + 0.001 * seed + gap + 0.003 * (seed - 1) ** 2
            rows.append({"stage": "uptrain", "target": "mqa", "budget": budget, "seed": seed,
                         "final_val_loss": loss, "tokens": 1000})  # fmt: skip
    rows.append({"stage": "uptrain", "target": "gqa2", "budget": 0.01, "seed": 0, "final_val_loss": 2.0,
                 "tokens": 1000})  # fmt: skip
    entries = retrofit_report.gaps(retrofit_report.losses([{k: str(v) for k, v in r.items()} for r in rows]))
    ten = next(e for e in entries if e["target"] == "mqa" and e["budget"] == 0.1)
    diffs = np.array([-0.01 + 0.003 * (s - 1) ** 2 for s in range(3)])
    half = stats.t.ppf(0.975, 2) * diffs.std(ddof=1) / np.sqrt(3)
    want = [diffs.mean(), diffs.mean() - half, diffs.mean() + half, half]
    np.testing.assert_allclose([ten["gap"], *ten["ci"], ten["d"]], want, rtol=1e-9)
    assert ten["ref"] == np.mean([1.78, 1.781, 1.782])  # 10% is read against 1.1 N
    answers = retrofit_report.answer(entries)
    assert answers["mqa"] == "10% of the base's tokens" and answers["gqa2"].startswith("open")
    assert retrofit_report.fourth_seed_due(entries, answers) == {}  # 3%'s interval is far above its d
    # a budget whose interval holds its d could pass with a fourth seed: the answer turns on it
    wide = [dict(e, ci=(e["d"] - 0.01, e["d"] + 0.01)) if e["budget"] == 0.03 else e for e in entries]
    assert retrofit_report.fourth_seed_due(wide, answers) == {"mqa": [0.03]}
    assert retrofit_report.fourth_seed_due(wide, {"mqa": "not within 30%"}) == {"mqa": [0.03]}
    out = tmp_path / "r"
    out.mkdir()
    append_rows(out / "runs.csv", tuple(rows[0]), rows)
    assert retrofit_report.main([str(out)]) == 0
    text = (out / "summary.md").read_text()
    assert "- mqa: 10% of the base's tokens" in text
    assert (out / "loss_vs_uptrain_tokens.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
