"""experiments/analyze_table.py: one markdown row per `qkvjax analyze --json` file, trained / initial / random."""

import json

from experiments import analyze_table


def _analysis(source, mean, num_kv_heads=5, drift=None):
    controls = {"qk_cos": 0.43, "kv_cos": 0.44, "symmetry": 0.5, "trace_ratio": 0.0, "effective_rank": 11.0,
                "kv_rank_err": 0.7}  # fmt: skip
    return {"source": source, "num_heads": 5, "num_kv_heads": num_kv_heads, "max_rank": 13, "mean": mean,
            "initial": dict(controls, kv_rank_err=0.6), "random": controls, "drift": drift or []}  # fmt: skip


def test_rows_tell_training_from_initialisation_and_mark_ties(tmp_path, capsys):
    free = {"qk_cos": 0.55, "qk_cos_std": 0.07, "kv_cos": 0.52, "kv_cos_std": 0.03, "symmetry": 0.53,
            "symmetry_std": 0.07, "trace_ratio": 0.066, "trace_ratio_std": 0.2, "effective_rank": 9.25,
            "effective_rank_std": 2.0, "kv_rank_err": 0.481, "kv_rank_err_std": 0.07}  # fmt: skip
    tied = dict(free, kv_cos=1.0, kv_cos_std=0.0)
    drift = [{"layer": 0, "w_q": 0.5, "w_k": 1.5, "w_v": 1.0, "w_o": 9.0}, {"layer": 1, "w_q": 0.7, "w_k": 1.3}]
    files = []
    for name, a in {"gqa": _analysis("run step 7 (separate)", free, 1, drift) | {"drift_decay_only": {"drift": 0.4}},
                    "kv": _analysis("run step 7 (shared_kv)", tied)}.items():  # fmt: skip
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(a))
    assert analyze_table.main([str(f) for f in files]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    # drift: w_o left out, mean of (0.5, 1.5, 1.0, 0.7, 1.3) = 1.0, range over kernels and layers
    assert rows[0][:4] == ["| separate (K=1)", "1.00 (0.50-1.50); decay alone 0.40", "0.550 / 0.430 / 0.430",
                           "0.520 / 0.440 / 0.440"]  # fmt: skip
    assert rows[0][6] == "9.2 / 11.0 / 11.0 (of 13)"
    assert rows[1][0] == "| shared_kv" and rows[1][3] == "(1)"  # fixed by the tie
    assert rows[1][7] == "0.481 / 0.600 / — |"  # the Gaussian control draws K and V apart: not K = V's control


def test_a_file_that_is_not_an_analysis_is_refused(tmp_path, capsys):
    (tmp_path / "x.json").write_text("{}")
    assert analyze_table.main([str(tmp_path / "x.json")]) == 2
    assert "has no 'mean'/'source'" in capsys.readouterr().err


def test_a_ladder_runs_decay_control_comes_from_its_name():
    """--ladder: a scaling run's file gets the control of its own size, rate and step (the d=160 and d=96 runs'
    0.75 and 0.40 in experiments/README.md); a name that is not the ladder's gets none."""
    from experiments.ladder import BATCH, CONTEXT, size_config
    from qkvjax.config import DataConfig
    from qkvjax.sources import decay_only_drift

    got = analyze_table.ladder_decay_only("shakespeare-d96-reformer_qk-lr0.008-seed0 step 2345 (reformer_qk)")
    train = size_config(96, "reformer_qk", 0.008, 0, 2345 * BATCH * CONTEXT, DataConfig()).train
    assert train.num_steps == 2345 and got == decay_only_drift(train, 2345)
    assert analyze_table.ladder_decay_only("my-run step 9 (separate)") is None


def test_over_seeds_gives_one_row_per_scheme_with_the_seed_spread(tmp_path, capsys):
    """--over-seeds: the files of one scheme (its seeds) become one row, each trained value as mean ± sample std
    over them, the controls (initial / random / mismatched heads) averaged; a tie stays (1) and K = V has no
    Gaussian control of its rank error."""
    import statistics

    files = []
    for seed, (qk, rank) in enumerate(((0.55, 9.0), (0.58, 11.0), (0.52, 10.0))):
        mean = {"qk_cos": qk, "qk_cos_std": 0.1, "kv_cos": 0.51, "kv_cos_std": 0.0, "symmetry": 0.5,
                "symmetry_std": 0.1, "trace_ratio": 0.1, "trace_ratio_std": 0.2, "effective_rank": rank,
                "effective_rank_std": 1.0, "kv_rank_err": 0.5, "kv_rank_err_std": 0.1}  # fmt: skip
        a = _analysis(f"run-seed{seed} step 7 (separate)", mean, drift=[{"layer": 0, "w_q": 0.5 + seed, "w_o": 9}])
        a["mismatched"] = {"qk_cos": 0.40 + 0.01 * seed, "kv_cos": 0.47, "symmetry": 0.5, "trace_ratio": 0.0,
                           "effective_rank": 12.0, "kv_rank_err": None}  # fmt: skip
        files.append(tmp_path / f"sep{seed}.json")
        files[-1].write_text(json.dumps(a))
    tied = _analysis("kv-seed0 step 7 (shared_kv)", dict(mean, kv_cos=1.0, kv_cos_std=0.0))
    (tmp_path / "kv.json").write_text(json.dumps(tied))
    assert analyze_table.main(["--over-seeds", *map(str, files), str(tmp_path / "kv.json")]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 2 and rows[0][:2] == ["| separate", "3"]
    assert rows[0][2] == f"1.50 ± {statistics.stdev([0.5, 1.5, 2.5]):.2f}"  # w_o left out
    sd = statistics.stdev([0.55, 0.58, 0.52])
    assert rows[0][3] == f"0.550 ± {sd:.3f} / 0.430 / 0.430 / 0.410"
    assert rows[0][7] == "10.0 ± 1.0 / 11.0 / 11.0 / 12.0 (of 13)"
    assert rows[0][8] == "0.500 ± 0.000 / 0.600 / 0.700 / — |"  # mismatched heads have no rank error
    assert rows[1][:2] == ["| shared_kv", "1"] and rows[1][4] == "(1)" and rows[1][8] == "0.500 / 0.600 / — / — |"


def test_two_ladder_variants_of_one_scheme_stay_two_rows(tmp_path, capsys):
    """A scaling-ladder run is labelled by its variant, so ``bilinear`` and ``bilinear_params`` (one scheme, two
    models) and ``gqa`` (``separate`` with fewer K/V heads) are never averaged as seeds of one row; a run named
    otherwise keeps its scheme."""
    mean = {"symmetry": 0.5, "symmetry_std": 0.1, "effective_rank": 9.0, "effective_rank_std": 1.0}
    sources = ["shakespeare-d96-bilinear-lr0.004-seed0 step 7 (bilinear)",
               "shakespeare-d96-bilinear_params-lr0.004-seed0 step 7 (bilinear)",
               "shakespeare-d96-bilinear_params-lr0.004-seed1 step 7 (bilinear)",
               "python_docs-d160-gqa-lr0.004-seed1 step 7 (separate)", "my-run step 7 (shared_qk)"]  # fmt: skip
    for i, source in enumerate(sources):
        (tmp_path / f"{i}.json").write_text(json.dumps(_analysis(source, mean, 1 if "gqa" in source else 5)))
    assert analyze_table.main(["--over-seeds", *(str(tmp_path / f"{i}.json") for i in range(5))]) == 0
    rows = [line.split(" | ")[:2] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [["| bilinear", "1"], ["| bilinear_params", "2"], ["| gqa (K=1)", "1"], ["| shared_qk", "1"]]
