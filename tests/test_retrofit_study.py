"""experiments/retrofit.py end to end at a toy size: a base, its conversions, an uptraining that starts from the
converted weights at step 0 and reads the base's window order on, a from-scratch reference; a row per run, and a
rerun that skips what is done."""

import dataclasses

import numpy as np

from experiments import retrofit
from experiments.rows import read_csv
from qkvjax.workdir import load_config

STRICT_DTYPE_PROMOTION = False  # optax inside the training runs


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
