"""experiments/attention_stats.py: its statistics against a float64 loop, the grouped layout unfolded per query
head, and the weights it collects from a trained run (rows of a causal softmax, one map per head)."""

import re
import shutil

import numpy as np
import pytest

from experiments import attention_stats
from experiments.rows import read_csv, replace_rows
from qkvjax.attention import core
from tests.helpers import run_in_process, train_args

STRICT_DTYPE_PROMOTION = False  # the run trains through optax

B, N, K, T = 3, 6, 2, 7  # G = 3; odd and distinct where the layout allows


def causal_weights(rng, b=B, n=N, t=T) -> np.ndarray:
    """Random rows of a causal softmax: (b, n, t, t), zero above the diagonal, each row summing to 1."""
    logits = rng.normal(size=(b, n, t, t)) * 2
    logits = np.where(np.tril(np.ones((t, t), bool)), logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def test_head_stats_equal_a_float64_loop():
    w = causal_weights(np.random.default_rng(3))
    got = attention_stats.head_stats(w)
    for head in range(N):
        rows = [(b, t) for b in range(B) for t in range(1, T)]
        want = {
            "self": np.mean([w[b, head, t, t] for b, t in rows]),
            "previous": np.mean([w[b, head, t, t - 1] for b, t in rows]),
            "distance": np.mean([sum(w[b, head, t, s] * (t - s) for s in range(t + 1)) for b, t in rows]),
            "entropy": np.mean([-sum(w[b, head, t, s] * np.log(w[b, head, t, s]) for s in range(t + 1))
                                for b, t in rows]),
        }  # fmt: skip
        for name, value in want.items():
            np.testing.assert_allclose(got[name][head], value, rtol=1e-12, err_msg=f"{name} of head {head}")


def test_a_one_hot_read_of_the_token_itself_or_the_one_before():
    eye = np.broadcast_to(np.eye(T), (1, 1, T, T))
    stats = attention_stats.head_stats(eye)
    assert (stats["self"], stats["previous"], stats["distance"], stats["entropy"]) == (1, 0, 0, 0)
    before = np.broadcast_to(np.eye(T, k=-1) + np.diag([1.0] + [0] * (T - 1)), (1, 1, T, T))
    stats = attention_stats.head_stats(before)
    assert (stats["self"], stats["previous"], stats["distance"]) == (0, 1, 1)


def test_unfold_undoes_the_grouped_query_fold_head_by_head():
    x = np.random.default_rng(5).normal(size=(B, T, N, T))  # (B, T, N, S): one (T, S) map per head
    folded = np.asarray(core.fold_queries(x, K))  # (B, K, T G, S)
    np.testing.assert_array_equal(attention_stats.unfold(folded, N), x.transpose(0, 2, 1, 3))


@pytest.fixture(scope="module")
def gqa_run(tmp_path_factory, small_text, data_dir):
    """Two steps of the tiny model with rotary positions and 2 K/V heads for 4 query heads, in a folder named as
    the scaling sweep names its runs."""
    w = tmp_path_factory.mktemp("runs") / "text-d32-gqa-lr0.003-seed0"
    args = {"train.num_steps": 2, "train.eval_every": 100, "model.attention.num_kv_heads": 2,
            "model.attention.rope": "true", "model.learned_positions": "false"}  # fmt: skip
    assert run_in_process(train_args(w, small_text, data_dir, **args)) == 0
    return w


def test_a_runs_weights_are_causal_softmax_rows_one_map_per_head(gqa_run):
    layers = attention_stats.run_weights(str(gqa_run), windows=3, batch=2)
    assert len(layers) == 2
    for w in layers:
        assert w.shape == (3, 4, 32, 32)
        np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
        assert np.all(np.triu(w, k=1) == 0)
        assert not np.allclose(w[:, 0], w[:, 1])  # the two query heads that read one K/V head differ


def test_a_per_layer_pattern_gives_each_layer_its_own_maps_whatever_the_implementation(tmp_path, small_text, data_dir):
    # Layer 0 has 2 K/V heads for 4 query heads, layer 1 reads them (Cross-Layer Attention) with 4 queries of its
    # own; trained with XLA's kernel, which hands out no weights: collecting them takes the einsum kernel instead.
    w = tmp_path / "pattern"
    args = {"train.num_steps": 2, "train.eval_every": 100, "model.layers": "[kv=2], [kv_from=-1]",
            "model.attention.implementation": "xla", "model.attention.head_dim": "7"}  # fmt: skip
    assert run_in_process(train_args(w, small_text, data_dir, **args)) == 0
    layers = attention_stats.run_weights(str(w), windows=3, batch=2)
    assert [x.shape for x in layers] == [(3, 4, 32, 32)] * 2
    for x in layers:
        np.testing.assert_allclose(x.sum(-1), 1.0, atol=1e-5)
        assert np.all(np.triu(x, k=1) == 0)
    assert not np.allclose(layers[0], layers[1])  # one K/V, two layers' queries
    assert attention_stats.describe(str(w))["variant"] == "[kv=2], [kv_from=-1]"


@pytest.fixture
def unfinished(gqa_run, tmp_path):
    """The run as it was before its last step: no params/ export."""
    copy = tmp_path / "unfinished"
    shutil.copytree(gqa_run, copy, ignore=shutil.ignore_patterns("params"))
    return copy


def test_the_cli_writes_a_row_per_layer_and_head_keeps_other_runs_and_reports_again(
    gqa_run, unfinished, tmp_path, capsys
):
    other = {"run": "another", "positions": "learned", "size": "7", "variant": "mqa", "learning_rate": "0.01",
             "seed": "1", "windows": "5", "layer": "0", "head": "0"}  # fmt: skip
    stale = dict(other, run=gqa_run.name, positions="rope", size="32", variant="gqa", learning_rate="0.003", seed="0")
    for name in attention_stats.STATS:
        other[name] = stale[name] = "0.5"
    replace_rows(tmp_path / "attention.csv", attention_stats.COLUMNS, [other, stale])
    assert attention_stats.main([str(gqa_run), str(unfinished), "--out", str(tmp_path), "--windows", "2"]) == 0
    assert f"skipped {unfinished}: not finished" in capsys.readouterr().err
    rows = read_csv(tmp_path / "attention.csv")
    assert rows[0] == other  # another run's rows stay; this run's stale row is replaced
    mine = rows[1:]
    assert [(r["layer"], r["head"]) for r in mine] == [(str(i), str(h)) for i in range(2) for h in range(4)]
    assert {(r["positions"], r["variant"], r["size"], r["learning_rate"], r["seed"], r["windows"]) for r in mine} == {
        ("rope", "gqa", "32", "0.003", "0", "2")
    }
    assert all(float(r["self"]) != 0.5 for r in mine)
    report = (tmp_path / "attention.md").read_text()
    assert "## d_model 32, positions: rope\n\n| variant" in report and "## d_model 7, positions: learned" in report
    assert "| gqa | 0.003 | 0 |" in report and "| mqa | 0.01 | 1 |" in report and "first 2 or 5 windows" in report
    assert (tmp_path / "attention_self.png").stat().st_size > 0
    (tmp_path / "attention.md").unlink()
    assert attention_stats.main(["--out", str(tmp_path)]) == 0  # the report again from the table alone
    assert (tmp_path / "attention.md").read_text() == report


@pytest.mark.parametrize(
    "args, match",
    [
        (["--windows", "0"], r"--windows=0; allowed"),
        (["RUN", "--windows", "99999"], r"needs 3199968 tokens"),
        (["NOTHING"], r"holds no run"),
        (["UNFINISHED"], r"none of the 1 runs has finished"),
        ([], r"no runs given and no .*attention.csv to report"),
    ],
)
def test_errors_are_one_line(args, match, gqa_run, unfinished, tmp_path, capsys):
    runs = {"RUN": str(gqa_run), "NOTHING": str(tmp_path / "nothing"), "UNFINISHED": str(unfinished)}
    args = [runs.get(a, a) for a in args]
    assert attention_stats.main([*args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(match, err[-1]) and all("skipped" in line for line in err[:-1])
