"""The scheme-comparison harness end to end on the tiny config: rows, matchings, resume after a kill, plots."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest

from experiments import compare_schemes
from experiments.compare_schemes import MATCHINGS, kv_cache_bytes, matched_config, plan
from experiments.rows import rows_file
from qkvjax import SCHEMES
from qkvjax.config import load_config_file
from qkvjax.models.lm import param_count
from tests.helpers import REPO, TINY, xla_flags

STRICT_DTYPE_PROMOTION = False  # optax

PNG = b"\x89PNG\r\n\x1a\n"


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _args(out, corpus, data_dir, *extra):
    return ["--out", str(out), "--config", TINY, "--corpus", corpus, "--data-dir", data_dir, *extra]


@pytest.mark.parametrize("preset", ["cpu", "gpu"])
def test_matchings_hold_for_every_scheme_of_the_presets(preset):
    base = load_config_file(str(REPO / "experiments" / "configs" / f"compare_{preset}.py"))
    separate = matched_config(base, "separate", "width")
    for scheme in SCHEMES:
        cfg = matched_config(base, scheme, "params")
        assert abs(param_count(cfg.model) - param_count(separate.model)) <= 0.02 * param_count(separate.model)
    runs, notes = plan(base, list(SCHEMES), [0], ["kv_cache"], strict=False)
    assert {r.scheme for r in runs} == {"separate", "shared_kv", "shared_qkv", "mla"}
    assert {kv_cache_bytes(r.config) for r in runs} == {kv_cache_bytes(separate) // 2}
    att = base.model.attention
    assert next(r for r in runs if r.scheme == "mla").config.model.attention.kv_rank == att.num_heads * att.head_dim
    assert len(notes) == len(SCHEMES) - 4 and all("cannot be run at 0.5" in n for n in notes)


@pytest.mark.slow  # ~55 s: trains a real sweep twice (its plan, rows files and bill stay in CI; pytest -m slow)
def test_sweep_end_to_end_and_rerun_skips_finished_runs(tmp_path, small_text, data_dir, capsys):
    out = tmp_path / "cmp"
    args = _args(out, small_text, data_dir, "--schemes", "separate,shared_kv", "--seeds", "0", "--steps", "3")
    assert compare_schemes.main(args) == 0
    rows = _rows(out / "runs.csv")
    assert sorted((r["matching"], r["scheme"], r["seed"]) for r in rows) == sorted(
        (m, s, "0") for m in MATCHINGS for s in ("separate", "shared_kv")
    )
    by = {(r["matching"], r["scheme"], r["seed"]): r for r in rows}
    for seed in ("0",):
        sep, tied = int(by["params", "separate", seed]["params"]), int(by["params", "shared_kv", seed]["params"])
        assert abs(tied - sep) <= 0.02 * sep and int(by["width", "shared_kv", seed]["params"]) < sep
        assert (
            by["kv_cache", "separate", seed]["kv_cache_bytes_per_token"]
            == (by["kv_cache", "shared_kv", seed]["kv_cache_bytes_per_token"])
        )
        assert by["kv_cache", "separate", seed]["num_kv_heads"] == "2"  # GQA with N/2 kv heads
        # one model, trained once, reported under both matchings
        assert by["width", "separate", seed]["run"] == by["params", "separate", seed]["run"]
    assert len({r["run"] for r in rows}) == 4
    curves = _rows(out / "curves.csv")
    assert {(c["matching"], c["scheme"], c["seed"]) for c in curves} == set(by)
    assert all(int(c["step"]) in (1, 2, 3) for c in curves)
    for name in ("curves_step.png", "curves_wall.png", "loss_vs_params.png", "loss_vs_kv_cache.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    summary = (out / "summary.md").read_text()
    assert "## params" in summary and "separate (K=2)" in summary
    capsys.readouterr()
    assert compare_schemes.main(args) == 0  # a rerun trains nothing
    assert "6 runs in the sweep, 6 already finished, 0 to go" in capsys.readouterr().out
    assert _rows(out / "runs.csv") == rows


@pytest.mark.slow  # 20-35 s each: kills a real sweep and reruns it (out of CI for time: pytest -m slow)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_sweep_resumes_without_redoing_finished_runs(tmp_path, small_text, data_dir, sig):
    """SIGKILL: the run in progress loses the steps since its checkpoint. SIGTERM: it saves, and the sweep stops
    with 143 without recording the stopped run as finished (it used to evaluate it and append its row)."""
    out = tmp_path / "killed"
    args = _args(out, small_text, data_dir, "--schemes", "separate,shared_qkv", "--seeds", "0", "--matchings", "width")
    args += ["--steps", "300"]
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(REPO / "experiments" / "compare_schemes.py"), *args]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    second = out / "runs" / "width-shared_qkv-seed0" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not (second.is_dir() and any(p.name.isdigit() for p in second.iterdir())):
        time.sleep(0.1)
    proc.send_signal(sig)  # the second run has a checkpoint and is still training
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), err[-3000:]
    if sig == signal.SIGTERM:
        assert "SIGTERM: saved checkpoint step" in err
    first = _rows(out / "runs.csv")
    assert [r["scheme"] for r in first] == ["separate"]
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 runs in the sweep, 1 already finished, 1 to go" in done.stdout
    assert "resumed from checkpoint step" in done.stdout
    rows = _rows(out / "runs.csv")
    assert [r["scheme"] for r in rows] == ["separate", "shared_qkv"] and rows[0] == first[0]
    assert sorted({c["scheme"] for c in _rows(out / "curves.csv")}) == ["separate", "shared_qkv"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--schemes", "separate,nope"], "unknown scheme 'nope'"),
        (["--seeds", ""], "--seeds is empty"),
        (["--schemes", "shared_qk", "--matchings", "kv_cache"], "'shared_qk' cannot be run at 0.5"),
        (["--matchings", "width,depth"], "unknown matching 'depth'"),
        (["--steps", "0"], "--steps=0"),
        (["--row", "typo=model.attention.schem=shared_kv"], "--row typo: "),
    ],
)
def test_bad_arguments_fail_before_training(tmp_path, small_text, data_dir, capsys, extra, message):
    out = tmp_path / "bad"
    assert compare_schemes.main(_args(out, small_text, data_dir, *extra)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow  # ~20 s: trains two rows (rows files and the bill stay in CI) (out of CI for time: pytest -m slow)
def test_rows_stated_outright_run_as_given_with_their_own_accounting(tmp_path, small_text, data_dir, capsys):
    """Layer patterns and options per row (CLA, K = V with Gemma's norms): params and cache bytes equal the
    accounting of each row's own config; a rerun trains nothing."""
    from qkvjax.config import apply_overrides

    out = tmp_path / "rows"
    rows = {
        "cla2": {"model.layers": "(separate, [kv_from=-1])*"},
        "kv_norms": {"model.attention.scheme": "shared_kv", "model.attention.qk_norm": "true",
                     "model.attention.v_norm": "true"},
    }  # fmt: skip
    flags = [x for name, o in rows.items() for x in ("--row", f"{name}=" + ";".join(f"{k}={v}" for k, v in o.items()))]
    args = _args(out, small_text, data_dir, *flags, "--seeds", "0", "--steps", "2")
    assert compare_schemes.main(args) == 0
    got = {r["scheme"]: r for r in _rows(out / "runs.csv")}
    assert set(got) == set(rows) and {r["matching"] for r in got.values()} == {"given"}
    base = compare_schemes.base_config(compare_schemes.build_parser().parse_args(_args(out, small_text, data_dir)))
    for name, overrides in rows.items():
        config = apply_overrides(base, overrides)
        assert int(got[name]["params"]) == param_count(config.model), name
        assert int(got[name]["kv_cache_bytes_per_token"]) == kv_cache_bytes(config), name
    sep = kv_cache_bytes(base)  # the base model (separate): both rows cache half of it, by different routes
    assert (
        int(got["cla2"]["kv_cache_bytes_per_token"]) * 2 == sep == int(got["kv_norms"]["kv_cache_bytes_per_token"]) * 2
    )
    assert "## given" in (out / "summary.md").read_text()
    capsys.readouterr()
    assert compare_schemes.main(args) == 0
    assert "2 runs in the sweep, 2 already finished, 0 to go" in capsys.readouterr().out


def test_rows_files_and_plan_only_print_the_bill_and_train_nothing(tmp_path, small_text, data_dir, capsys):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("# two rows\nseparate=\nkv_half=model.attention.num_kv_heads=1  # GQA\n")
    second.write_text("separate=\n\ncla2=model.layers=(separate, [kv_from=-1])*\n")
    out = tmp_path / "plan"
    args = _args(out, small_text, data_dir, "--rows", str(first), "--rows", str(second), "--seeds", "0,1")
    assert compare_schemes.main([*args, "--plan-only"]) == 0
    printed = capsys.readouterr().out
    assert "6 runs in the sweep, 0 already finished, 6 to go" in printed
    lines = {line.split()[1]: line for line in printed.splitlines() if line.startswith("  given ")}
    assert set(lines) == {"separate", "kv_half", "cla2"}
    assert "2 runs x ~" in lines["cla2"] and "KV cache 0.5 x separate's" in lines["cla2"]
    assert "KV cache 1 x separate's" in lines["separate"]
    assert "estimated wall time of what is left: ~" in printed
    assert not (out / "runs.csv").exists() and not (out / "runs").exists()
    second.write_text("separate=model.attention.scheme=shared_kv\n")
    assert compare_schemes.main([*args, "--plan-only"]) == 2
    assert "'separate' is given twice, differently" in capsys.readouterr().err
    # a row kept to one seed (a learning-rate sweep beside rows at every seed)
    second.write_text("separate=\nlr_high=seeds=1;train.learning_rate=8e-3\n")
    assert compare_schemes.main([*args, "--plan-only"]) == 0
    printed = capsys.readouterr().out
    assert "5 runs in the sweep, 0 already finished, 5 to go" in printed
    assert [line.split()[1:4] for line in printed.splitlines() if " lr_high " in line] == [["lr_high", "1", "runs"]]
    second.write_text("lr_high=seeds=one;train.learning_rate=8e-3\n")
    assert compare_schemes.main([*args, "--plan-only"]) == 2
    assert "--row lr_high: seeds='one'; allowed: comma-separated integers" in capsys.readouterr().err


def test_the_committed_mechanism_rows_build_at_the_middle_size_with_the_caches_they_claim():
    """experiments/configs/rows_*.txt against scaling_middle.py: every row a valid model, the equal-cache rows at
    exactly 1/2 or 1/4 of separate's cache as their comments say, the Reformer rows at separate's (no training)."""
    from qkvjax.config import apply_overrides

    base = load_config_file(str(REPO / "experiments" / "configs" / "scaling_middle.py"))
    full = kv_cache_bytes(base)
    fractions = {}
    rates = {}
    for name in ("reformer", "equal_cache", "mla_lr"):
        for row, overrides in rows_file(str(REPO / "experiments" / "configs" / f"rows_{name}.txt")):
            config = apply_overrides(base, {k: v for k, v in overrides.items() if k != "seeds"})
            fractions[row], rates[row] = kv_cache_bytes(config) / full, config.train.learning_rate
    assert {r for r, f in fractions.items() if f == 0.5} == {"gqa2", "shared_kv", "shared_kv_norms", "cla2", "mla_r96",
                                                            "mla_r84_rope", "mla_r96_lr1e-3", "mla_r96_lr2e-3",
                                                            "mla_r96_lr8e-3"}  # fmt: skip
    assert sorted(r for k, r in rates.items() if k.startswith("mla_r96")) == [1e-3, 2e-3, 4e-3, 8e-3]
    assert {r for r, f in fractions.items() if f == 0.25} == {"gqa1", "shared_kv_gqa2", "cla2_shared_kv", "gqa2_cla2",
                                                             "mla_r48", "mla_r36_rope"}  # fmt: skip
    assert all(f == 1.0 for r, f in fractions.items() if r.startswith(("separate", "shared_qk", "qk_", "reformer")))


def test_labels_of_a_crowded_column_fan_out_without_overlapping():
    """Fifteen rows at (nearly) one parameter count, as the mechanism study has: every label is written, none
    overlaps another or leaves the axes vertically, each sits right of its own point, and one moved off its point's
    height is tied to it by a leader line, and no two leader lines of one column cross (labels keep their points'
    vertical order)."""
    from experiments import report

    plt = report.pyplot()
    from matplotlib.text import Annotation, Text  # after pyplot(): its backend is chosen first

    fig, ax = plt.subplots(figsize=(7.5, 5))
    points = [(0.443e6 + 300 * (i % 3), 1.58 + 0.003 * i, f"row_with_a_long_name_{i}", "C0") for i in range(15)]
    points += [(0.425e6, 1.62, "left_row_whose_label_reaches_the_column (K=2)", "C1"), (0.52e6, 1.50, "far", "C2")]
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    ax.margins(y=0.08)
    fig.tight_layout()
    report.place_labels(ax, points)
    fig.canvas.draw()  # an annotation knows where its text is once drawn
    renderer = fig.canvas.get_renderer()
    texts = [c for c in ax.get_children() if isinstance(c, Annotation)]
    assert sorted(t.get_text() for t in texts) == sorted(p[2] for p in points)
    boxes = {t.get_text(): Text.get_window_extent(t, renderer) for t in texts}  # the text alone, not its line
    names = sorted(boxes)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not boxes[a].overlaps(boxes[b]), (a, b)
    for t in texts:
        x, y = ax.transData.transform(t.xy)
        box = boxes[t.get_text()]
        assert ax.bbox.y0 <= box.y0 and box.y1 <= ax.bbox.y1 and box.x1 <= fig.bbox.x1
        assert box.x0 > x  # right of its point
        moved = abs((box.y0 + box.y1) / 2 - y) > 1
        assert (t.arrow_patch is not None) == moved, t.get_text()
    at = {t.get_text(): (*ax.transData.transform(t.xy), (boxes[t.get_text()].y0 + boxes[t.get_text()].y1) / 2)
          for t in texts}  # fmt: skip
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            (xa, ya, la), (xb, yb, lb) = at[a], at[b]
            if abs(xa - xb) < 8:  # one column: the labels stand in their points' order
                assert (ya - yb) * (la - lb) >= 0, (a, b)
    plt.close(fig)
