"""The scaling sweep (experiments/scaling.py) and the second corpus's builder (experiments/build_corpus.py)."""

import csv
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

import jax
import pytest

from experiments import budget, build_corpus, scaling
from experiments.rows import PROTOCOL_FILE, append_rows
from qkvjax.config import DataConfig
from qkvjax.models.lm import DecoderLM, param_count
from tests.helpers import REPO, xla_flags

STRICT_DTYPE_PROMOTION = False  # optax


@pytest.mark.parametrize("variant", list(scaling.VARIANTS))
def test_size_presets_count_the_parameters_the_model_has(variant):
    """The accounting (param_count, which the budget's 10 tokens per parameter uses) against the parameters
    flax actually creates, at every default size; and the span the docstring promises."""
    for size in scaling.DEFAULT_SIZES:
        config = scaling.size_config(size, variant, 1e-3, 0, 1, DataConfig())
        shapes = jax.eval_shape(DecoderLM(config.model).init, jax.random.PRNGKey(0), jax.numpy.zeros((1, 5), "int32"))
        created = sum(x.size for x in jax.tree.leaves(shapes))
        assert param_count(config.model) == created, (variant, size)
        assert config.model.attention.head_dim * config.model.attention.num_heads == size
    counts = [
        param_count(scaling.size_config(s, "separate", 1e-3, 0, 1, DataConfig()).model) for s in scaling.DEFAULT_SIZES
    ]
    assert counts[-1] / counts[0] >= 8  # the span


def test_ladder_pairs_share_the_cache_or_parameters_their_comparisons_assume():
    """The head-to-head rows of the report compare variants at equal cache bytes (GQA, K = V, MLA) or equal
    parameters (shared_qv against shared_qk); the MLA row's parameter excess is the one the ladder's comment states."""
    from qkvjax.models.lm import kv_cache_bytes_per_token

    model = {v: scaling.size_config(96, v, 1e-3, 0, 1, DataConfig()).model for v in scaling.VARIANTS}
    cache = {v: kv_cache_bytes_per_token(m) for v, m in model.items()}
    assert cache["gqa"] == cache["shared_kv"]  # GQA at shared_kv's cache
    assert cache["mla"] == cache["gqa"]  # MLA's latent at GQA's cache
    # the ladder's comment: attention weights 5 D^2 (mla) against 4 D^2 (separate) per layer, norms and biases aside
    extra = (param_count(model["mla"]) - param_count(model["separate"])) / model["separate"].num_layers
    assert 96**2 <= extra < 96**2 + 4 * 96, extra
    # the head-to-head pair: one tie each, the same parameters, separate's cache for shared_qv
    assert param_count(model["shared_qv"]) == param_count(model["shared_qk"]) < param_count(model["separate"])
    assert cache["shared_qv"] == cache["separate"] > cache["gqa"]
    # below GQA's cache: MQA's one K/V head and MLA's rank-D/2 latent at a quarter of separate's; the ladder's
    # comment: attention weights 3.5 D^2 (mla_half) against 2.5 D^2 (mqa) per layer, and the latent norm's R scales
    assert model["mqa"].attention.kv_heads == 1 and model["mla_half"].attention.latent_dim == 96 // 2
    assert cache["mqa"] == cache["mla_half"] == cache["separate"] // 4 == cache["mla"] // 2
    extra = (param_count(model["mla_half"]) - param_count(model["mqa"])) / model["mqa"].num_layers
    assert extra == 96**2 + 96 // 2, extra


def test_under_rotary_positions_every_variant_rotates_and_keeps_its_cache():
    """``positions="rope"``: rotary positions in every layer and no position table; a latent's decoupled rotary key
    (H_r = H / 2, DeepSeek-V2's) comes out of its rank, so each variant caches what it caches with learned positions
    (the comparisons at equal cache hold under either); the parameters flax creates are the ones counted."""
    from qkvjax.models.lm import kv_cache_bytes_per_token

    for size in (48, 160):
        for variant in (v for v in scaling.VARIANTS if not v.startswith("bilinear")):  # bilinear cannot rotate
            learned = scaling.size_config(size, variant, 1e-3, 0, 1, DataConfig()).model
            rope = scaling.size_config(size, variant, 1e-3, 0, 1, DataConfig(), positions="rope").model
            assert rope.attention.rope and not rope.learned_positions and learned.learned_positions, variant
            assert kv_cache_bytes_per_token(rope) == kv_cache_bytes_per_token(learned), (size, variant)
            if size == 48:
                shapes = jax.eval_shape(DecoderLM(rope).init, jax.random.PRNGKey(0), jax.numpy.zeros((1, 5), "int32"))
                assert param_count(rope) == sum(x.size for x in jax.tree.leaves(shapes)), variant
    half = scaling.size_config(160, "mla_half", 1e-3, 0, 1, DataConfig(), positions="rope").model.attention
    assert (half.kv_rank, half.rope_dim) == (60, 20)  # R = 3 D / 8 beside H / 2: D / 2 per token, as with a table
    with pytest.raises(ValueError, match="positions='alibi'; allowed: learned, rope"):
        scaling.size_config(160, "separate", 1e-3, 0, 1, DataConfig(), positions="alibi")


def test_more_heads_narrow_each_head_and_keep_every_variants_cache_and_parameters():
    """``heads=8``: H = D / 8; a variant's K/V heads are its fraction of N (``mqa``'s quarter: 2 of 8), so each
    caches what it caches at 4 heads and has the same parameters (the projections are D x D either way), under rotary
    positions too, where a latent's rotary key H_r = H / 2 comes out of its rank: a narrower key leaves a wider rank,
    so there the latent has a few more parameters."""
    from qkvjax.models.lm import kv_cache_bytes_per_token

    for positions in ("learned", "rope"):
        for variant in ("separate", "gqa", "mqa", "mla_half", "shared_qk"):
            four = scaling.size_config(96, variant, 1e-3, 0, 1, DataConfig(), positions=positions).model
            eight = scaling.size_config(96, variant, 1e-3, 0, 1, DataConfig(), positions=positions, heads=8).model
            assert (eight.attention.num_heads, eight.attention.head_dim) == (8, 12), variant
            assert kv_cache_bytes_per_token(eight) == kv_cache_bytes_per_token(four), (positions, variant)
            if (positions, variant) == ("rope", "mla_half"):
                assert param_count(four) < param_count(eight) < 1.02 * param_count(four)
            else:
                assert param_count(eight) == param_count(four), (positions, variant)
    mqa = scaling.size_config(96, "mqa", 1e-3, 0, 1, DataConfig(), heads=8).model.attention
    half = scaling.size_config(96, "mla_half", 1e-3, 0, 1, DataConfig(), positions="rope", heads=8).model.attention
    assert mqa.kv_heads == 2 and (half.kv_rank, half.rope_dim) == (42, 6)  # 2 x 2 x 12 = 42 + 6 = D / 2


def test_every_ladder_variant_has_a_place_and_a_colour_of_its_own_in_the_report():
    """The report orders (and colours) only the variants in VARIANT_ORDER: a variant left out would train and
    never be reported; a colour shared by two variants would merge them in the plots; a head-to-head row must
    name two ladder variants."""
    from experiments import scaling_report

    assert set(scaling.VARIANTS) <= set(scaling_report.VARIANT_ORDER)
    colours = [scaling_report.variant_color(v) for v in scaling_report.VARIANT_ORDER]
    assert len(set(colours)) == len(colours), colours
    assert {v for row in scaling_report.HEAD_TO_HEAD for v in row[:2]} <= set(scaling.VARIANTS)


def test_params_matched_bilinear_has_separates_parameters_in_a_narrower_mlp():
    """``bilinear_params``: W_QK's extra (N - 2) D^2 per layer come out of the MLP (F = 3 D at N = 4), so its count
    is ``separate``'s at every size while plain ``bilinear``'s is 14-15% more; compare_schemes's ``params``
    matching picks the same width through the same function."""
    from experiments.compare_schemes import matched_config

    for size in (*scaling.DEFAULT_SIZES, 56):
        model = {v: scaling.size_config(size, v, 1e-3, 0, 1, DataConfig()).model
                 for v in ("separate", "bilinear", "bilinear_params")}  # fmt: skip
        assert model["bilinear_params"].mlp_dim == 3 * size
        assert param_count(model["bilinear_params"]) == param_count(model["separate"]) < param_count(model["bilinear"])
        plain = scaling.size_config(size, "bilinear", 1e-3, 0, 1, DataConfig())
        assert matched_config(plain, "bilinear", "params").model == model["bilinear_params"]


def _sweep_command(out, corpus, data_dir):
    return [
        sys.executable, "experiments/scaling.py", "--out", str(out), "--corpus", corpus, "--data-dir", data_dir,
        "--sizes", "8,12,16", "--layers", "1", "--context", "16", "--variants", "separate,shared_kv",
        "--seeds", "0", "--learning-rate", "3e-3", "--stages", "small,middle,large", "--tokens-per-param", "1",
        "--token-scale", "0.6",
    ]  # fmt: skip


def _rows(out):
    with open(out / "runs.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # ~50 s: trains, kills and resumes a real sweep (out of CI for time: pytest -m slow)
def test_the_sweep_end_to_end_survives_a_sigkill_and_resumes(tmp_path, small_text, data_dir):
    """3 sizes x 2 schemes x 1 seed at a tiny budget; SIGKILL while the second run has a checkpoint; the rerun
    keeps the finished row, resumes the killed run from its checkpoint and finishes the rest."""
    out = tmp_path / "sweep"
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "PYTHONUNBUFFERED": "1"}
    command = _sweep_command(out, small_text, data_dir)
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = out / "runs" / "small-d8-shared_kv-lr0.003-seed0" / "checkpoints"
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if (out / "runs.csv").exists() and second.is_dir() and any(p.name.isdigit() for p in second.iterdir()):
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGKILL)
        first_output = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert "estimated wall time of what is left" in first_output and "tokens/s per size" in first_output
    before = _rows(out)
    assert len(before) == 1 and before[0]["variant"] == "separate"
    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "resumed from checkpoint step" in rerun.stdout
    rows = _rows(out)
    assert rows[0] == before[0]  # the finished row kept as it was
    assert sorted((int(r["size"]), r["variant"]) for r in rows) == [
        (s, v) for s in (8, 12, 16) for v in ("separate", "shared_kv")
    ]
    assert len({r["run"] for r in rows}) == 6
    for r in rows:
        assert float(r["tokens"]) >= 0.6 * float(r["params"]) * 0.99 and float(r["final_val_loss"]) > 0
        assert float(r["epochs"]) > 0 and r["corpus"] == "small"
    with open(out / "curves.csv", newline="") as f:
        curves = list(csv.DictReader(f))
    assert {c["run"] for c in curves} == {r["run"] for r in rows}
    steps = [int(c["step"]) for c in curves if c["run"] == "small-d8-shared_kv-lr0.003-seed0"]
    assert steps == sorted(set(steps))  # the killed run's curve once, without duplicates


@pytest.mark.parametrize(
    "flag, value, match",
    [
        ("--token-scale", "0", "allowed: a finite number > 0"),
        ("--token-scale", "nan", "allowed: a finite number > 0"),
        ("--token-scale", "-1", "allowed: a finite number > 0"),
        ("--sizes", "8,8,16", "three distinct widths"),
        ("--sizes", "8,10,16", "10; allowed: a multiple of --heads 4"),
        (
            "--sizes",
            "8,12,16 --variants separate --positions rope",
            "--sizes 12, variant separate, --positions rope, --heads 4: rope=True needs an even head_dim; got "
            "head_dim=3",
        ),
        (
            "--sizes",
            "16,32,56 --variants separate,mla --positions rope",
            "--sizes 56, variant mla, --positions rope, --heads 4: "
            "the decoupled rotary width of scheme 'mla' must be even; got rope_head_dim=7",
        ),
        ("--variants", "separate,bilinear --positions rope", "variant bilinear, --positions rope, --heads 4:"),
        ("--sizes", "16,32,60 --heads 8", "--sizes: 60; allowed: a multiple of --heads 8, at least 8"),
        (
            "--sizes",
            "48,64,96 --heads 8 --variants separate,mla_half --positions rope",
            "--sizes 48, variant mla_half, --positions rope, --heads 8: the decoupled rotary width of scheme 'mla' "
            "must be even; got rope_head_dim=3",
        ),
        ("--heads", "0", "argument --heads"),
        ("--positions", "relative", "argument --positions: invalid choice: 'relative'"),
        ("--sizes", "8,16", "three distinct widths"),
        ("--stages", "lr-huge", "unknown stage 'lr-huge'"),
        ("--large-variants", "separate,bilinear_param", "unknown --large-variants value 'bilinear_param'"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_written(tmp_path, capsys, flag, value, match):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        code = scaling.main(["--out", str(out), flag, *value.split()])
        raise SystemExit(code)
    assert e.value.code == 2
    assert match in capsys.readouterr().err
    assert not out.exists()


def test_the_corpus_builder_gives_a_known_sha256(tmp_path, capsys):
    source = tmp_path / "src"
    (source / "library").mkdir(parents=True)
    (source / "library" / "os.rst.txt").write_text("The os module.\n\n", encoding="utf-8")
    (source / "zen.rst.txt").write_text("A tutorial — with a dash.\n", encoding="utf-8")
    (source / "skipped.html").write_text("<p>not a source</p>")
    out = tmp_path / "corpus.txt"
    assert build_corpus.main(["--source-dir", str(source), "--out", str(out)]) == 0
    # in the order of the sha256 of the relative paths (153... before 871...), not alphabetical
    expected = "A tutorial — with a dash.\n\nThe os module.\n\n".encode()
    assert out.read_bytes() == expected
    assert hashlib.sha256(expected).hexdigest() == KNOWN_SHA256
    assert f'"sha256": "{KNOWN_SHA256}"' in (tmp_path / "corpus.txt.json").read_text()
    assert build_corpus.main(["--source-dir", str(source), "--out", str(tmp_path / "again.txt")]) == 0
    assert (tmp_path / "again.txt").read_bytes() == expected  # reproducible
    (source / "bad.rst.txt").write_bytes(b"\xff\xfe not utf-8")
    assert build_corpus.main(["--source-dir", str(source), "--out", str(tmp_path / "bad.txt")]) == 2
    assert "bad.rst.txt is not UTF-8" in capsys.readouterr().err


KNOWN_SHA256 = "88410188a7f30c6d528dde9805a1107a3d2327d441e298af179243b1433efd11"


def test_a_corpus_takes_its_patterns_in_hash_order_up_to_its_byte_budget(tmp_path):
    """The linux corpus' rules on a small tree: every pattern matched, other files and folders left out, files in
    the order of their path's sha256, and the one that crosses the budget is the last."""
    tree = {"Documentation/a.rst": "x" * 40, "Documentation/sub/b.txt": "y" * 40, "kernel/c.c": "z" * 40,
            "kernel/d.h": "w" * 40, "drivers/e.c": "skipped", "kernel/f.py": "skipped"}  # fmt: skip
    for name, text in tree.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_text(text)
    order = sorted((n for n in tree if "skipped" not in tree[n]), key=lambda n: hashlib.sha256(n.encode()).hexdigest())
    linux = build_corpus.CORPORA["linux"]
    whole = build_corpus.build(tmp_path / "src", tmp_path / "all.txt", {}, dataclasses.replace(linux, max_bytes=None))
    assert (tmp_path / "all.txt").read_text() == "".join(tree[n] + "\n\n" for n in order) and whole["files"] == 4
    cut = build_corpus.build(tmp_path / "src", tmp_path / "cut.txt", {}, dataclasses.replace(linux, max_bytes=50))
    assert (tmp_path / "cut.txt").read_text() == "".join(tree[n] + "\n\n" for n in order[:2]) and cut["files"] == 2


def test_more_seeds_go_where_the_first_seeds_cannot_tell_a_difference(tmp_path, small_text):
    """The ``more`` stage: a variant whose mean difference to separate is under twice the seed spread gets seeds 3
    and 4, with separate beside it; a clear one gets none; nothing is decided while a first seed is missing."""
    argv = ["--out", str(tmp_path), "--corpus", small_text, "--sizes", "8,12,16", "--learning-rate", "3e-3",
            "--variants", "separate,shared_kv,gqa", "--seeds", "0,1,2"]  # fmt: skip
    args = scaling.build_parser().parse_args(argv)
    sweep = scaling.Sweep(args)
    losses = {"separate": (1.50, 1.56, 1.53), "shared_kv": (1.62, 1.64, 1.63), "gqa": (1.55, 1.49, 1.57)}
    for variant, values in losses.items():
        for seed, loss in enumerate(values):
            if (variant, seed) == ("gqa", 2):
                assert sweep.undecided("middle") == []  # a first seed still missing: nothing decided yet
            run = sweep.seeded_run("middle", variant, seed)
            sweep.rows.append({"run": run.name, "final_val_loss": str(loss)})
    # gqa: mean +0.007, spread 0.042 -> undecided; shared_kv: +0.100 against a spread of 0.030 -> clear
    assert sweep.undecided("middle") == ["gqa"]
    assert sweep.undecided("small") == []
    planned = sweep.stage_runs("more")
    assert [(r.variant, r.seed, r.size, r.stage) for r in planned] == [
        ("separate", 3, 12, "more"), ("gqa", 3, 12, "more"), ("separate", 4, 12, "more"), ("gqa", 4, 12, "more")
    ]  # fmt: skip
    sweep.rows.append({"run": planned[0].name, "final_val_loss": "1.52"})  # finished runs leave the plan
    assert [r.name for r in sweep.stage_runs("more")] == [r.name for r in planned[1:]]


def test_more_seeds_reach_a_minor_variant_and_need_not_name_separate(tmp_path, small_text):
    """A sweep asked for one variant alone still decides against ``separate``'s finished seeds, and a minor variant
    (``--minor-seeds``: fewer first seeds than the main ones) is decided on its own first seeds and extended from
    there to MAX_SEEDS, instead of being waited for at seeds it never trains (which left ``more`` empty)."""
    argv = ["--out", str(tmp_path), "--corpus", small_text, "--sizes", "8,12,16", "--learning-rate", "3e-3",
            "--variants", "bilinear_params", "--seeds", "0,1,2", "--minor-seeds", "2"]  # fmt: skip
    sweep = scaling.Sweep(scaling.build_parser().parse_args(argv))
    assert [r.seed for r in sweep.stage_runs("middle")] == [0, 1]
    done = {("separate", 0): 1.50, ("separate", 1): 1.56, ("separate", 2): 1.53, ("bilinear_params", 0): 1.52}
    for (variant, seed), loss in done.items():
        sweep.rows.append({"run": sweep.seeded_run("middle", variant, seed).name, "final_val_loss": str(loss)})
    assert sweep.undecided("middle") == []  # its seed 1 still missing
    sweep.rows.append({"run": sweep.seeded_run("middle", "bilinear_params", 1).name, "final_val_loss": "1.55"})
    assert sweep.undecided("middle") == ["bilinear_params"]  # +0.005 against a spread of 0.042
    planned = [(r.variant, r.seed) for r in sweep.stage_runs("more")]
    assert planned == [("bilinear_params", 2), ("separate", 3), ("bilinear_params", 3), ("separate", 4),
                       ("bilinear_params", 4)]  # fmt: skip


def test_the_report_pairs_two_ties_with_each_other_by_seed():
    """The head-to-head table (K = V against GQA): ``shared_kv - gqa`` paired by seed, with its t interval, only
    at the sizes where both ran; each seed's own offset, shared by both, leaves the paired interval narrow."""
    import numpy as np
    from scipy import stats

    from experiments import scaling_report

    rng = np.random.default_rng(7)
    offsets = {"separate": 0.0, "gqa": 0.011, "shared_kv": 0.037}
    rows = []
    for size, variants in ((48, offsets), (96, {"separate": 0.0, "shared_kv": 0.05})):  # d=96: no gqa ran
        for seed in range(5):
            base = 1.9 + 0.05 * rng.standard_normal()
            for variant, off in variants.items():
                loss = base + off + 0.002 * rng.standard_normal()
                rows.append({"stage": "final", "corpus": "python_docs", "size": str(size), "variant": variant,
                             "seed": str(seed), "learning_rate": "0.004", "params": "1000", "epochs": "0.5",
                             "tokens": "9", "kv_cache_bytes_per_token": "48", "final_val_loss": repr(loss),
                             "best_eval_loss": repr(loss), "last_eval_loss": repr(loss),
                             "run": f"{variant}-{size}-{seed}", "tokens_per_s": "1"})  # fmt: skip
    loss = {(r["size"], r["variant"], r["seed"]): float(r["final_val_loss"]) for r in rows}
    d = np.array([loss["48", "shared_kv", str(s)] - loss["48", "gqa", str(s)] for s in range(5)])
    half = stats.t.ppf(0.975, 4) * d.std(ddof=1) / np.sqrt(5)
    e = scaling_report.paired(scaling_report.finals(rows), "python_docs", 48, "shared_kv", against="gqa")
    np.testing.assert_allclose([e["delta"], *e["ci"]], [d.mean(), d.mean() - half, d.mean() + half], rtol=1e-9)
    assert e["ci"][0] > 0  # 0.026 apart, seed spread 0.05 shared: the pairing tells them apart
    summary = scaling_report.summary_markdown(rows)
    table = summary.split("`shared_kv` - `gqa`")[1].split("\n## ")[0]
    assert f"| python_docs | 48 | {d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}]" in table
    assert "| python_docs | 96 |" not in table  # no gqa at d=96: no row


def test_the_report_sets_another_sweeps_variants_beside_its_own(tmp_path, capsys):
    """``--beside FOLDER``: each variant both sweeps ran at a size both ran, with its mean loss in each, here minus
    there, and each sweep's own paired Δ vs separate; then a head-to-head difference both ran (``mla_half`` -
    ``mqa``) in each; a variant or size only one sweep ran has no row."""
    from experiments import scaling_report

    def rows(offsets: dict, sizes: tuple, shift: float) -> list[dict]:
        out = []
        for size in sizes:
            for seed in range(3):
                for variant, off in offsets.items():
                    loss = 2.0 - size / 1000 + shift + off + 0.01 * seed * (variant == "mqa")
                    out.append({"stage": "final", "corpus": "python_docs", "size": str(size), "variant": variant,
                                "seed": str(seed), "learning_rate": "0.004", "params": "1000", "epochs": "0.5",
                                "tokens": "9", "kv_cache_bytes_per_token": "48", "final_val_loss": repr(loss),
                                "best_eval_loss": repr(loss), "last_eval_loss": repr(loss),
                                "run": f"{variant}-{size}-{seed}", "tokens_per_s": "1"})  # fmt: skip
        return out

    here = rows({"separate": 0.0, "mqa": 0.03, "mla_half": 0.05}, (48, 96), -0.2)
    there = rows({"separate": 0.0, "mqa": 0.01, "shared_qk": 0.04, "mla_half": 0.025}, (48, 160), 0.0)
    lines = scaling_report.beside_markdown(here, there, "rope", "learned")
    table = [line for line in lines if line.startswith("| python_docs")]
    pairs = [line for line in lines if line.startswith("| `")]
    # mqa's loss grows by 0.01 a seed (mean +0.01 over seeds 0-2): mla_half - mqa is 0.025 - 0.01 - 0.01 there, 0.05 -
    # 0.03 - 0.01 here
    assert [line.split(" | ")[:3] for line in pairs] == [["| `mla_half` - `mqa`", "python_docs", "48"]]
    assert pairs[0].split(" | ")[3].startswith("+0.005 [") and pairs[0].split(" | ")[4].startswith("+0.010 [")
    assert lines[lines.index(pairs[0]) - 2] == "| difference | corpus | d | `learned` | `rope` |"
    mqa_here = statistics.fmean(2.0 - 0.048 - 0.2 + 0.03 + 0.01 * s for s in range(3))
    mqa_there = statistics.fmean(2.0 - 0.048 + 0.01 + 0.01 * s for s in range(3))
    assert [line.split(" | ")[1:3] for line in table] == [["48", "separate"], ["48", "mqa"], ["48", "mla_half"]]
    cols = table[1].split(" | ")
    assert cols[3:6] == [f"{mqa_there:.3f} (3)", f"{mqa_here:.3f} (3)", f"{mqa_here - mqa_there:+.3f}"]
    assert cols[6].startswith("+0.020 [") and cols[7].startswith("+0.040 [")  # each sweep's own paired Δ
    for folder, data in (("a", here), ("b", there)):
        (tmp_path / folder).mkdir()
        append_rows(tmp_path / folder / "runs.csv", tuple(data[0]), data)
    summary = scaling_report.write_report(tmp_path / "a", speed=None, beside=tmp_path / "b").read_text()
    assert "## Beside `b`" in summary and table[1] in summary
    assert scaling_report.main([str(tmp_path / "a"), "--beside", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("scaling_report: error: --beside ") and err.count("\n") == 1


def test_the_report_pairs_seeds_and_fits_the_trend_through_every_seed(tmp_path):
    """scaling_report on constructed rows: Δ paired by seed with its t interval, the trend through every seed's
    Δ equal to numpy's least squares (float64), a penalty built to shrink reported as shrinking, PNGs written."""
    import numpy as np
    from scipy import stats

    from experiments import scaling_report

    rng = np.random.default_rng(5)
    sizes = {48: 129_456, 96: 480_096, 160: 1_291_680}
    rows, truth = [], []
    for size, params in sizes.items():
        for seed in range(3):
            base = 2.0 - 0.3 * np.log10(params) + 0.02 * rng.standard_normal()  # shared by both: paired
            delta = 0.40 - 0.06 * np.log10(params) + 0.003 * rng.standard_normal()
            truth.append((np.log10(params), delta))
            for variant, loss, kv in (("separate", base, 96), ("shared_kv", base + delta, 48)):
                rows.append({"stage": "final", "corpus": "shakespeare", "size": str(size), "variant": variant,
                             "seed": str(seed), "learning_rate": "0.004", "params": str(params), "epochs": "1.5",
                             "tokens": str(10 * params), "kv_cache_bytes_per_token": str(kv),
                             "final_val_loss": str(loss), "best_eval_loss": str(loss), "last_eval_loss": str(loss),
                             "run": f"{variant}-{size}-{seed}", "tokens_per_s": "1000"})  # fmt: skip
    cells = scaling_report.finals(rows)
    e = scaling_report.paired(cells, "shakespeare", 96, "shared_kv")
    d = [x for lp, x in truth[3:6]]
    half = stats.t.ppf(0.975, 2) * np.std(d, ddof=1) / np.sqrt(3)
    np.testing.assert_allclose([e["delta"], *e["ci"]], [np.mean(d), np.mean(d) - half, np.mean(d) + half])
    deltas = [x for _, x in truth]  # in the rows' order: size, then seed
    fit = scaling_report.trend([(sizes[int(r["size"])], x) for r, x in zip(rows[1::2], deltas, strict=True)])
    x, y = np.array(truth).T
    (slope, intercept), cov = np.polyfit(x, y, 1, cov="unscaled")
    se = np.sqrt(np.sum((y - np.polyval([slope, intercept], x)) ** 2) / (len(x) - 2) * cov[0, 0])
    np.testing.assert_allclose([fit["slope"], fit["se"]], [slope, se], rtol=1e-9)
    assert fit["sizes"] == 3 and fit["n"] == 9 and fit["ci"][1] < 0
    s2 = np.sum((y - np.polyval([slope, intercept], x)) ** 2) / (len(x) - 2)  # the band: a mean's 95% interval
    half = stats.t.ppf(0.975, len(x) - 2) * np.sqrt(
        s2 * (1 / len(x) + (6.5 - x.mean()) ** 2 / np.sum((x - x.mean()) ** 2))
    )
    at = np.polyval([slope, intercept], 6.5)
    np.testing.assert_allclose(scaling_report.trend_band(fit, 6.5), [at, at - half, at + half], rtol=1e-9)
    summary = scaling_report.summary_markdown(rows)
    assert f"per seed {slope:+.3f} ± {se:.3f}" in summary and "(9 paired runs at 3 sizes)" in summary
    by_size = scaling_report.trend_by_size([(10**lp, d) for lp, d in truth])
    assert f"- shared_kv: by size {by_size['slope']:+.3f} ± {by_size['se']:.3f}" in summary
    assert "3 sizes of 3/3/3 seeds): **shrinks**" in summary
    cut = scaling_report.trend([(10**lp, d) for lp, d in zip(x, y, strict=True) if lp < max(x)])  # largest left out
    assert "- shared_kv; without the largest size: by size " in summary
    assert f"per seed {cut['slope']:+.3f} ± {cut['se']:.3f}" in summary
    assert "(6 paired runs at 2 sizes)" in summary and "## Trend of Δ with size (Tiny Shakespeare)" in summary
    docs = [r | {"corpus": "python_docs"} for r in rows]  # each corpus its own trend, under its own heading
    docs_summary = scaling_report.summary_markdown(docs)
    assert docs_summary.count("## Trend of Δ with size") == 1 and "(Python documentation)" in docs_summary
    one_seed = [r for r in rows if r["size"] != "160" or r["seed"] == "0"]  # a size begun: one seed so far
    assert "nan" not in scaling_report.summary_markdown(one_seed)
    # the plot's panels: the schemes keeping separate's cache, and those shrinking it (named with the fraction)
    rows += [r | {"variant": "shared_qk"} for r in rows if r["variant"] == "separate"]  # a tie keeping the cache
    fractions = scaling_report.cache_fractions(scaling_report.finals(rows), "shakespeare")
    assert fractions == {"shared_kv": 0.5, "shared_qk": 1.0}
    for png in scaling_report.plot(rows, tmp_path):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the folder's protocol names its positions at the summary's top (a folder without the field: learned)
    fields = (
        "stage",
        "corpus",
        "size",
        "variant",
        "seed",
        "learning_rate",
        "params",
        "epochs",
        "tokens",
        "kv_cache_bytes_per_token",
        "final_val_loss",
        "best_eval_loss",
        "last_eval_loss",
        "run",
        "tokens_per_s",
    )
    append_rows(tmp_path / "runs.csv", fields, rows)  # fmt: skip
    for positions, text in ((None, "learned absolute positions"), ("rope", "rotary positions in every layer")):
        (tmp_path / PROTOCOL_FILE).write_text(json.dumps({"protocol": {"positions": positions, "heads": 4}}))
        summary = scaling_report.write_report(tmp_path, speed=None).read_text()
        assert summary.split("\n")[2] == f"Models with {text}" + ("." if positions is None else ", no position table.")
    (tmp_path / PROTOCOL_FILE).write_text(json.dumps({"protocol": {"positions": "rope", "heads": 8}}))  # not the 4
    summary = scaling_report.write_report(tmp_path, speed=None).read_text()
    assert summary.split("\n")[2] == (
        "Models with rotary positions in every layer, no position table; 8 heads per layer of width D / 8 (each "
        "variant's K/V heads its fraction of them: `mqa`'s quarter is 2 of 8, `gqa`'s half 4)."
    )


def test_the_report_copies_speed_from_a_benchmark_file_and_refuses_a_missing_one(tmp_path, capsys):
    """summary.md's speed table comes from benchmarks/scaling_speed.py's JSON (command, machine, date named)."""
    from experiments import scaling_report

    bench = {"date": "2026-11-24 20:53", "machine": "vm (cpu, 2 cores)", "command": "python benchmarks/x.py",
             "rows": [{"size": 48, "variant": v, "tokens_per_s": t, "x_separate": t / 3000, "flop_ratio_predicts": f}
                      for v, t, f in (("separate", 3000.0, 1.0), ("shared_kv", 3300.0, 1.067))]}  # fmt: skip
    (tmp_path / "speed.json").write_text(json.dumps(bench))
    text = scaling_report.speed_markdown(tmp_path / "speed.json")
    assert "`python benchmarks/x.py` on vm (cpu, 2 cores), 2026-11-24 20:53" in text
    assert "| shared_kv | 3,300 | x1.100 (x1.067) |" in text
    assert scaling_report.main([str(tmp_path), "--speed", str(tmp_path / "nope.json")]) == 2
    assert "--speed" in capsys.readouterr().err


def test_the_report_sets_training_loss_beside_validation_loss():
    """The tail training loss (mean over the last 5% of logged steps, not the last batch alone), its paired Δ to
    separate and the generalisation gap val - train per size, from constructed curves with known values."""
    from experiments import scaling_report

    rows, curves = [], []
    for seed, (sep_val, kv_val) in enumerate(((1.50, 1.53), (1.56, 1.57), (1.52, 1.58))):
        for variant, val, train_end in (("separate", sep_val, 1.20 + 0.01 * seed), ("shared_kv", kv_val, 1.31)):
            run = f"{variant}-{seed}"
            rows.append({"stage": "final", "corpus": "shakespeare", "size": "160", "variant": variant,
                         "seed": str(seed), "learning_rate": "0.004", "params": "1000", "epochs": "12.9",
                         "tokens": "10000", "kv_cache_bytes_per_token": "96", "final_val_loss": str(val),
                         "best_eval_loss": str(val - 0.005 * (variant == "shared_kv")), "last_eval_loss": str(val),
                         "run": run, "tokens_per_s": "1000", "wall_s": str(600 * (seed + 1)),
                         "finished_at": f"2026-11-2{4 + seed}T0{seed}:00:00+00:00",
                         "device": "cpu (2 cores)" if seed == 2 else ""})  # fmt: skip
            # steps 0..1000 by 10: the last 5% (steps 950..1000, 6 points) hold train_end, the 7th from last an
            # outlier that a tail of 5% must leave out; the validation column is empty as in the real file
            curves += [{"run": run, "step": str(step), "train_loss": str(train_end if step >= 950 else 9.0),
                        "val_loss": ""} for step in range(0, 1001, 10)]  # fmt: skip
    train = scaling_report.tail_train_loss(curves)
    assert train["separate-2"] == pytest.approx(1.22) and train["shared_kv-0"] == pytest.approx(1.31)
    cells = scaling_report.finals(rows)
    assert scaling_report.train_delta(cells, train, "shakespeare", 160, "shared_kv") == pytest.approx(0.10)
    (gen,) = scaling_report.generalisation(cells, train)
    gaps = [1.50 - 1.20, 1.56 - 1.21, 1.52 - 1.22, 1.53 - 1.31, 1.57 - 1.31, 1.58 - 1.31]
    assert gen["runs"] == 6 and gen["rising"] == 3
    assert gen["gap"] == pytest.approx(statistics.fmean(gaps)) and gen["gap_std"] == pytest.approx(
        statistics.stdev(gaps)
    )
    summary = scaling_report.summary_markdown(rows, curves)
    assert "| shared_kv | 1,000 | 96 | 0.004 | 3 | " in summary and " | +0.100 | 10,000 | 12.90 |" in summary
    assert "| shared_kv | +0.033 [" in summary and "| shared_kv | +0.100 |" in summary
    assert re.search(r"\] d 0\.\d{3} \(3\) \|", summary), summary  # the detectable difference, then the seeds
    # time spent per device: seeds 0-1 (600 + 1200 s per variant) unrecorded, seed 2 (1800 s each) on the CPU
    assert "| 160 | cpu (2 cores) | 2 | 1.0 | 1,000 | 2026-11-26 02:00 to 2026-11-26 02:00 UTC |" in summary
    assert "| 160 | not recorded | 4 | 1.0 | 1,000 | 2026-11-24 00:00 to 2026-11-25 01:00 UTC |" in summary


def test_rates_are_chosen_on_the_mean_of_the_sweep_seeds_at_every_size(tmp_path, small_text):
    """--sweep-seeds 0,1: a rate counts once both seeds finished and wins on their mean; lr-large sweeps the
    largest size (main variants only) and sets its rates; --minor-seeds trains the others at fewer seeds."""
    argv = ["--out", str(tmp_path), "--corpus", small_text, "--sizes", "8,12,16", "--lr-grid", "1e-3,2e-3,4e-3",
            "--sweep-seeds", "0,1", "--seeds", "0,1,2,3", "--minor-seeds", "3",
            "--variants", "separate,bilinear", "--stages", "lr-large,large"]  # fmt: skip
    args = scaling.build_parser().parse_args(argv)
    scaling.check_args(args)
    sweep = scaling.Sweep(args)
    assert {(r.variant, r.learning_rate, r.seed) for r in sweep.stage_runs("lr-large")} == {
        ("separate", lr, seed) for lr in (1e-3, 2e-3, 4e-3) for seed in (0, 1)
    }  # bilinear is not one of the five main variants: no sweep at the largest size
    # seed 0 alone would pick 1e-3; the mean of seeds 0 and 1 picks 2e-3; 4e-3 has one seed only: not counted
    losses = {(1e-3, 0): 1.40, (1e-3, 1): 1.70, (2e-3, 0): 1.45, (2e-3, 1): 1.47, (4e-3, 0): 1.30}
    for (lr, seed), loss in losses.items():
        run = sweep.run("lr-large", "primary", 16, "separate", lr, seed)
        sweep.rows.append({"run": run.name, "stage": "lr-large", "corpus": run.corpus, "size": "16",
                           "variant": "separate", "seed": str(seed), "learning_rate": str(lr),
                           "final_val_loss": str(loss)})  # fmt: skip
    assert sweep.best_lr(16, "separate") == 2e-3
    assert [(r.learning_rate, r.seed) for r in sweep.stage_runs("lr-large")] == [(4e-3, 1)]
    # 4e-3 may still win: the seeded runs wait for the sweep (NaN: planned, not trained), whatever leads now
    assert [(r.variant, r.seed) for r in sweep.stage_runs("large") if math.isnan(r.learning_rate)] == [
        ("separate", 2), ("separate", 3)]  # fmt: skip
    run = sweep.run("lr-large", "primary", 16, "separate", 4e-3, 1)
    row = {"run": run.name, "stage": "lr-large", "corpus": run.corpus, "size": "16", "variant": "separate"}
    sweep.rows.append({**row, "seed": "1", "learning_rate": "0.004", "final_val_loss": "1.65"})
    assert sweep.stage_runs("lr-large") == [] and sweep.rates_left(16, "separate") == []  # 2e-3 wins inside
    large = sweep.stage_runs("large")  # at the largest size's own rate; seeds 0 and 1 are the sweep's runs
    assert [(r.variant, r.learning_rate, r.seed) for r in large] == [("separate", 2e-3, 2), ("separate", 2e-3, 3)]
    args.stages = ["small"]
    assert {(r.variant, r.seed) for r in scaling.Sweep(args).stage_runs("small")} >= {("bilinear", 2)}
    assert ("bilinear", 3) not in {(r.variant, r.seed) for r in scaling.Sweep(args).stage_runs("small")}
    with pytest.raises(ValueError, match="--sweep-seeds"):
        scaling.check_args(scaling.build_parser().parse_args([*argv, "--sweep-seeds", "0,7"]))
    # --large-variants takes a minor variant to the largest size, at its first --minor-seeds seeds only
    args = scaling.build_parser().parse_args([*argv, "--large-variants", "separate,bilinear"])
    sweep = scaling.Sweep(args)
    assert {(r.variant, r.learning_rate, r.seed) for r in sweep.stage_runs("lr-large")} == {
        (v, lr, seed) for v in ("separate", "bilinear") for lr in (1e-3, 2e-3, 4e-3) for seed in (0, 1)
    }
    for seed in (0, 1):
        for variant in ("separate", "bilinear"):
            run = sweep.run("lr-large", "primary", 16, variant, 2e-3, seed)
            sweep.rows.append({"run": run.name, "stage": "lr-large", "corpus": run.corpus, "size": "16",
                               "variant": variant, "seed": str(seed), "learning_rate": "0.002",
                               "final_val_loss": "1.0"})  # fmt: skip
    assert {(r.variant, r.seed) for r in sweep.stage_runs("large")} == {
        ("separate", 2), ("separate", 3), ("bilinear", 2)}  # fmt: skip


def test_a_variant_seeds_once_its_own_sweep_settles_while_another_extends_past_an_edge(tmp_path, small_text):
    """Workers taking the stages side by side (parallel_sweep.py): a variant whose sweep is finished gets its
    seeded runs at once; one whose grid is finished but won at the edge waits for the step past it, and then for
    that step's verdict (its seeds never train at a rate the sweep could still move)."""
    argv = ["--out", str(tmp_path), "--corpus", small_text, "--sizes", "8,12,16", "--lr-grid", "2e-3,4e-3,8e-3",
            "--sweep-seeds", "0,1", "--seeds", "0,1,2", "--variants", "separate,shared_qk",
            "--stages", "lr-large,large"]  # fmt: skip
    sweep = scaling.Sweep(scaling.build_parser().parse_args(argv))

    def finish(variant, lr, losses):
        for seed, loss in enumerate(losses):
            run = sweep.run("lr-large", "primary", 16, variant, lr, seed)
            sweep.rows.append({"run": run.name, "stage": "lr-large", "corpus": run.corpus, "size": "16",
                               "variant": variant, "seed": str(seed), "learning_rate": repr(lr),
                               "final_val_loss": str(loss)})  # fmt: skip

    for lr, loss in ((2e-3, 1.31), (4e-3, 1.27), (8e-3, 1.29)):
        finish("separate", lr, (loss, loss + 0.01))  # 4e-3 wins inside the grid: settled
    for lr, loss in ((2e-3, 1.21), (4e-3, 1.23), (8e-3, 1.26)):
        finish("shared_qk", lr, (loss, loss - 0.01))  # 2e-3 wins at the low edge: 1e-3 next
    assert sweep.rates_left(16, "separate") == [] and sweep.rates_left(16, "shared_qk") == [1e-3]
    assert [(r.variant, r.learning_rate, r.seed) for r in sweep.stage_runs("lr-large")] == [
        ("shared_qk", 1e-3, 0), ("shared_qk", 1e-3, 1)]  # fmt: skip

    def large():
        return {(r.variant, r.seed): r.learning_rate for r in sweep.stage_runs("large")}

    plan = large()
    assert plan[("separate", 2)] == 4e-3 and math.isnan(plan[("shared_qk", 2)]) and len(plan) == 2
    finish("shared_qk", 1e-3, (1.25, 1.24))  # the step past the edge loses: 2e-3 is settled
    assert sweep.rates_left(16, "shared_qk") == [] and large() == {("separate", 2): 4e-3, ("shared_qk", 2): 2e-3}


@pytest.mark.parametrize("n", [2, 3, 5])
def test_detectable_difference_has_the_power_it_claims(n):
    """Simulated paired t tests (two-sided, 5%) of n seeds whose true mean difference is the detectable one reject
    in 80% of 200,000 trials (Monte Carlo standard error 0.0009); the shortcut t_0.975 + t_0.8 it replaced
    rejects in under 78% at n <= 3."""
    import math

    import numpy as np
    from scipy import stats

    from experiments.report import detectable, power_factor

    sd, t = 0.03, stats.t.ppf(0.975, n - 1)
    rng = np.random.default_rng(n)
    diffs = rng.normal(size=n)
    diffs = (diffs - diffs.mean()) / diffs.std(ddof=1) * sd  # sample sd exactly sd: detectable() reads it as the truth
    delta = detectable(list(diffs))
    assert delta == pytest.approx(power_factor(n) * sd / math.sqrt(n), rel=1e-12)

    def rejected(mean):
        x = rng.normal(mean, sd, size=(200_000, n))
        return float(np.mean(np.abs(x.mean(1) / (x.std(1, ddof=1) / math.sqrt(n))) > t))

    assert rejected(delta) == pytest.approx(0.8, abs=0.005)
    shortcut = (t + stats.t.ppf(0.8, n - 1)) * sd / math.sqrt(n)
    if n <= 3:
        assert rejected(shortcut) < 0.78
    assert math.isnan(detectable([0.1]))


def test_a_claim_goes_to_one_worker_and_rows_gain_columns_added_since(tmp_path):
    """scaling.claim is exclusive; append_rows rewrites a file whose header is a leading part of the columns (the
    old rows' new cells blank) and refuses one that is not."""
    from experiments import rows
    from experiments.scaling import claim

    assert claim(tmp_path / "claims", "run-a") and not claim(tmp_path / "claims", "run-a")
    assert claim(tmp_path / "claims", "run-b")
    path = tmp_path / "runs.csv"
    rows.append_rows(path, ("run", "loss"), [{"run": "old", "loss": 1.5}])
    rows.append_rows(path, ("run", "loss", "device"), [{"run": "new", "loss": 2.5, "device": "gpu"}])
    assert rows.read_csv(path) == [{"run": "old", "loss": "1.5", "device": ""},
                                   {"run": "new", "loss": "2.5", "device": "gpu"}]  # fmt: skip
    with pytest.raises(ValueError, match=r"has columns \['run', 'loss', 'device'\]; allowed: \['loss'"):
        rows.append_rows(path, ("loss", "run", "device"), [])


def test_parallel_sweep_merges_each_workers_new_rows_once(tmp_path):
    from experiments import parallel_sweep, rows
    from experiments.scaling import CURVE_COLUMNS, RUN_COLUMNS

    out, w0, w1 = tmp_path / "out", tmp_path / "w0", tmp_path / "w1"
    for folder in (out, w0, w1):
        folder.mkdir()

    def row(name):
        return {"run": name, "final_val_loss": "1.0"}

    rows.append_rows(out / "runs.csv", RUN_COLUMNS, [row("a")])
    for folder, names in ((w0, ("a", "b")), (w1, ("a", "c", "d"))):  # each worker starts from out's rows
        rows.append_rows(folder / "runs.csv", RUN_COLUMNS, [row(n) for n in names])
        curve = [{"run": n, "step": s, "val_loss": 2.0} for n in names for s in (1, 2)]
        rows.append_rows(folder / "curves.csv", CURVE_COLUMNS, curve)
    assert parallel_sweep.merge(out, w0) == 1 and parallel_sweep.merge(out, w1) == 2
    assert parallel_sweep.merge(out, w1) == 0  # merged once
    assert [r["run"] for r in rows.read_csv(out / "runs.csv")] == ["a", "b", "c", "d"]
    assert [(c["run"], c["step"]) for c in rows.read_csv(out / "curves.csv")] == [
        (n, s) for n in "bcd" for s in ("1", "2")
    ]
    # a row the worker is still writing (no newline yet) waits for a later merge, whole
    rows.append_rows(w0 / "curves.csv", CURVE_COLUMNS, [{"run": "e", "step": 1, "val_loss": 2.0}])
    full = (w0 / "runs.csv").read_text()
    with open(w0 / "runs.csv", "a") as f:
        f.write("lr-small,docs,48")
    assert parallel_sweep.merge(out, w0) == 0
    (w0 / "runs.csv").write_text(full)
    rows.append_rows(w0 / "runs.csv", RUN_COLUMNS, [row("e")])
    assert parallel_sweep.merge(out, w0) == 1 and rows.read_csv(out / "runs.csv")[-1]["run"] == "e"


def test_parallel_sweep_estimates_its_wall_time_as_the_one_process_plan_over_its_workers(tmp_path, small_text, capsys):
    from experiments import parallel_sweep

    argv = ["--out", str(tmp_path), "--corpus", small_text, "--sizes", "8,12,16", "--lr-grid", "2e-3,8e-3",
            "--variants", "separate,shared_kv", "--stages", "lr-small,lr-large"]  # fmt: skip
    args = scaling.build_parser().parse_args(argv)
    sweep, stages = scaling.Sweep(args), ["lr-small", "lr-large"]
    probe = json.dumps({f"d{d}-L{args.layers}-T{args.context}": 1000.0 + d for d in (8, 12, 16)})
    (tmp_path / "probe.json").write_text(probe)  # the speeds the plan would have probed
    one = scaling.print_plan(sweep, stages, scaling.speeds(sweep))
    assert one > 0 and f"what is left: ~{budget.hms(one)} (one process)" in capsys.readouterr().out
    assert parallel_sweep.workers_estimate_s(sweep, stages, 3) == pytest.approx(one / 3)
    assert (tmp_path / "probe.json").read_text() == probe  # read, not probed again


def test_parallel_sweep_pools_run_folders_so_any_worker_resumes_a_stopped_run(tmp_path):
    """Each worker's runs/ becomes a link to scratch/runs; folders of the older layout are folded in, and where
    two workers hold the same run the one further on stays (finished, then the later checkpoint)."""
    from experiments.parallel_sweep import pool_runs

    def run(worker, name, step, finished=False):
        folder = tmp_path / worker / "runs" / name
        (folder / "checkpoints" / str(step)).mkdir(parents=True)
        (folder / "checkpoints" / f"{step + 7}.orbax-checkpoint-tmp-3").mkdir()  # a save cut short: not a step
        if finished:
            (folder / "params").mkdir()
        (folder / "who").write_text(f"{worker}:{step}")

    run("w0", "a", 630), run("w1", "a", 241), run("w0", "b", 9, finished=True), run("w1", "b", 11)
    run("w1", "c", 5), run("w5", "d", 3)  # w5: a worker of an earlier, wider sweep
    shared = pool_runs(tmp_path, workers=3)
    assert shared == tmp_path / "runs"
    assert {r.name: (r / "who").read_text() for r in shared.iterdir()} == {
        "a": "w0:630", "b": "w0:9", "c": "w1:5", "d": "w5:3"}  # fmt: skip
    for w in ("w0", "w1", "w2", "w5"):
        assert (tmp_path / w / "runs").is_symlink() and (tmp_path / w / "runs").resolve() == shared.resolve()
    assert sorted(p.name for p in (tmp_path / "w2" / "runs").iterdir()) == ["a", "b", "c", "d"]
    assert pool_runs(tmp_path, workers=3) == shared and len(list(shared.iterdir())) == 4  # again: nothing moves


def test_parallel_sweep_stops_workers_with_sigterm_then_sigkill(tmp_path, monkeypatch):
    """At the deadline a worker gets SIGTERM (the training loop saves a checkpoint and exits 143); one that has
    not exited after TERM_GRACE_S gets SIGKILL."""
    from experiments import parallel_sweep

    monkeypatch.setattr(parallel_sweep, "TERM_GRACE_S", 3.0)
    head = "import signal, sys, time; signal.signal(signal.SIGTERM, {}); print('up', flush=True); time.sleep(60)"
    saves, ignores = head.format("lambda *a: sys.exit(143)"), head.format("signal.SIG_IGN")
    procs = [(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True), None)
             for code in (saves, ignores)]  # fmt: skip
    for proc, _ in procs:
        assert proc.stdout.readline() == b"up\n"  # its handler is installed
    parallel_sweep._stop(procs)
    assert [p.returncode for p, _ in procs] == [143, -signal.SIGKILL]


@pytest.mark.slow  # ~2 min: two workers train a real sweep, stopped by SIGTERM once, then resumed (pytest -m slow)
def test_parallel_sweep_trains_every_run_once_across_workers(tmp_path, small_text, data_dir):
    out = tmp_path / "sweep"
    sweep_args = _sweep_command(out, small_text, data_dir)[4:]  # without the interpreter, the script and --out
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "experiments/parallel_sweep.py", "--out", str(out), "--workers", "2",
               "--budget-s", "400", "--scratch", str(tmp_path / "scratch"), "--", *sweep_args]  # fmt: skip
    logs = [tmp_path / "scratch" / f"w{i}" / "worker.log" for i in (0, 1)]
    first = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # SIGTERM to the parent once a worker trains: it stops the workers (each saving its run) and exits 143
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and first.poll() is None:
            if any(p.exists() and "compiled and ran the first step" in p.read_text() for p in logs):
                break
            time.sleep(0.05)
        first.send_signal(signal.SIGTERM)
        first_output = first.communicate(timeout=120)[0]
    finally:
        first.kill()
    assert first.returncode == 128 + signal.SIGTERM, first_output
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "scratch")], capture_output=True, text=True).stdout
    assert not leftover, f"workers outlived their parent: {leftover}"
    saved = sum(p.read_text().count("scaling: SIGTERM: saved checkpoint step") for p in logs)  # one a run
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = sum(p.read_text().count("resumed from checkpoint step") for p in logs)
    assert resumed >= saved, (saved, resumed)  # each run stopped mid-training resumed, in whichever worker took it
    rows = _rows(out)
    assert sorted((int(r["size"]), r["variant"]) for r in rows) == [
        (s, v) for s in (8, 12, 16) for v in ("separate", "shared_kv")
    ]
    assert len({r["run"] for r in rows}) == 6 and all(r["device"].startswith("cpu (") for r in rows)
    trained = [line.split("] ", 1)[1].split(":")[0] for p in logs for line in p.read_text().splitlines()
               if line.startswith("--- ")]  # fmt: skip
    assert saved >= 1 and len(trained) <= 6 + 2  # a run the SIGTERM cut is taken again, each by one worker
    assert sorted(set(trained)) == sorted(r["run"] for r in rows)  # (which worker is a race: each claims the next)
    assert sorted(r.name for r in (tmp_path / "scratch" / "runs").iterdir()) == sorted(r["run"] for r in rows)
    merged = [n for line in proc.stdout.splitlines() if line.startswith("parallel_sweep: merged ")
              for n in line.removeprefix("parallel_sweep: merged ").rsplit(" from w", 1)[0].split(", ")]  # fmt: skip
    assert sorted(merged) == sorted(r["run"] for r in rows)  # each row merged once, as its run finished
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 runs added" in again.stdout and len(_rows(out)) == 6


@pytest.mark.slow  # ~3 min: two workers take a real rate sweep and its seeds side by side (pytest -m slow)
def test_parallel_workers_seed_each_variant_at_the_rate_its_finished_sweep_chose(tmp_path, small_text, data_dir):
    """Rate sweeps whose edges may win (extensions planned as rows arrive) and the seeded stage, taken by two
    workers at once: every run trains once, and each seed-1 run is at the rate its variant's whole sweep chose."""
    out = tmp_path / "sweep"
    sweep_args = ["--corpus", small_text, "--data-dir", data_dir, "--sizes", "8,12,16", "--layers", "1",
                  "--context", "16", "--variants", "separate,shared_kv", "--seeds", "0,1", "--lr-grid", "2e-3,8e-3",
                  "--stages", "lr-small,small", "--tokens-per-param", "1", "--token-scale", "0.6"]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "experiments/parallel_sweep.py", "--out", str(out), "--workers", "2",
               "--budget-s", "600", "--scratch", str(tmp_path / "scratch"), "--", *sweep_args]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=700)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(out)
    sweep = scaling.Sweep(scaling.build_parser().parse_args([*sweep_args, "--out", str(out)]))
    for variant in ("separate", "shared_kv"):
        assert sweep.rates_left(8, variant) == []  # the sweep finished, extensions included
        seeded = [r for r in rows if r["variant"] == variant and r["stage"] == "small"]
        assert [(float(r["learning_rate"]), r["seed"]) for r in seeded] == [(sweep.best_lr(8, variant), "1")]
    logs = [tmp_path / "scratch" / f"w{i}" / "worker.log" for i in (0, 1)]
    trained = [line.split("] ", 1)[1].split(":")[0] for p in logs for line in p.read_text().splitlines()
               if line.startswith("--- ")]  # fmt: skip
    assert sorted(trained) == sorted(r["run"] for r in rows)  # each run once, by one worker
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "0 runs added" in again.stdout and len(_rows(out)) == len(rows)


def test_the_report_picks_rates_on_the_sweep_seeds_mean_and_counts_their_runs_as_seeds():
    """Sweep seeds 0 and 1: the rate is the best mean of the two (not seed 0's, nor the best single run), and each
    sweep seed's run at that rate is that seed's final run, beside the seeded stage's seeds 2 and 3."""
    from experiments import scaling_report

    def row(stage, variant, lr, seed, loss):
        return {"stage": stage, "corpus": "docs", "size": "48", "variant": variant, "seed": str(seed),
                "learning_rate": str(lr), "final_val_loss": str(loss), "params": "100", "tokens": "1000",
                "epochs": "0.1", "kv_cache_bytes_per_token": "8", "run": f"{stage}-{variant}-{lr}-{seed}",
                "best_eval_loss": str(loss), "last_eval_loss": str(loss), "tokens_per_s": "1"}  # fmt: skip

    # 4e-3: seed 0 best on its own (2.00), but the mean over both seeds is 2.15; 8e-3's mean is 2.10
    sweep = [(0.004, 0, 2.00), (0.004, 1, 2.30), (0.008, 0, 2.05), (0.008, 1, 2.15)]
    rows = [row("lr-small", v, lr, s, x + (0.1 if v == "shared_kv" else 0)) for v in ("separate", "shared_kv")
            for lr, s, x in sweep]  # fmt: skip
    rows += [row("small", v, 0.008, s, 2.1 + s / 100 + (0.1 if v == "shared_kv" else 0))
             for v in ("separate", "shared_kv") for s in (2, 3)]  # fmt: skip
    assert scaling_report.best_rates(rows)[("docs", 48, "separate")] == 0.008
    cells = scaling_report.finals(rows)
    assert sorted(cells["docs", 48, "separate"]) == [0, 1, 2, 3]  # seeds 0 and 1 from the sweep at 8e-3
    assert float(cells["docs", 48, "separate"][1]["final_val_loss"]) == 2.15
    e = scaling_report.paired(cells, "docs", 48, "shared_kv")
    assert e["n"] == 4 and e["delta"] == pytest.approx(0.1)
    # 8e-3 wins and is the highest rate tried: the sweep does not bracket it, and the table says so; with 1.6e-2
    # tried and worse, the same winner is bracketed
    assert "| docs | 48 | separate | 2.150 | **2.100** edge |" in scaling_report.summary_markdown(rows)
    rows += [row("lr-small", "separate", 0.016, s, 2.4) for s in (0, 1)]
    summary = scaling_report.summary_markdown(rows)
    assert "| docs | 48 | separate | 2.150 | **2.100** | 2.400 |" in summary
    # the shared-rate table reads seed 0's sweep runs, as its title says, though seed 1's come later in the file
    rows += [row("lr-small", v, 0.002, s, x) for v, s, x in
             (("separate", 0, 2.5), ("separate", 1, 2.6), ("shared_kv", 0, 2.55), ("shared_kv", 1, 2.75))]  # fmt: skip
    assert "| docs | 48 | shared_kv | +0.050 | +0.100 |" in scaling_report.summary_markdown(rows)  # seed 1: +0.150


def test_a_results_folder_refuses_a_sweep_under_other_positions(tmp_path, small_text):
    """protocol.json pins the positions (and the heads, the window sampling, the corpus' bytes): a rotary sweep
    into a folder of learned-position runs would pair runs of two protocols by name; a folder written before the
    field existed reads as learned."""
    argv = ["--out", str(tmp_path), "--corpus", small_text, "--sizes", "8,16,24", "--variants", "separate"]
    learned = scaling.build_parser().parse_args(argv)
    scaling.check_protocol(scaling.Sweep(learned))
    record = json.loads((tmp_path / PROTOCOL_FILE).read_text())
    assert record["protocol"]["positions"] is None
    rope = scaling.build_parser().parse_args([*argv, "--positions", "rope"])
    with pytest.raises(ValueError, match=r"another protocol \(positions: None -> 'rope'\)"):
        scaling.check_protocol(scaling.Sweep(rope))
    del record["protocol"]["positions"]  # a folder from before the field: learned positions
    (tmp_path / PROTOCOL_FILE).write_text(json.dumps(record))
    scaling.check_protocol(scaling.Sweep(learned))
    assert record["protocol"]["heads"] == 4  # and the heads: another count is another protocol
    more = scaling.build_parser().parse_args([*argv, "--heads", "8"])
    with pytest.raises(ValueError, match=r"another protocol \(heads: 4 -> 8\)"):
        scaling.check_protocol(scaling.Sweep(more))
    # and the sampling: disjoint windows are another protocol, and every run of such a sweep reads them
    disjoint = scaling.build_parser().parse_args([*argv, "--sampling", "disjoint"])
    with pytest.raises(ValueError, match=r"another protocol \(sampling: None -> 'disjoint'\)"):
        scaling.check_protocol(scaling.Sweep(disjoint))
    assert scaling.Sweep(disjoint).corpora["primary"][1].sampling == "disjoint"
    assert scaling.Sweep(learned).corpora["primary"][1].window_sampling == "random"
    # the corpus is pinned by its sha256: a resumed sweep (another machine's copy) must read the same text
    copy = tmp_path / "elsewhere" / os.path.basename(small_text)
    copy.parent.mkdir()
    shutil.copyfile(small_text, copy)
    argv[argv.index(small_text)] = str(copy)
    scaling.check_protocol(scaling.Sweep(scaling.build_parser().parse_args(argv)))  # the same bytes elsewhere
    copy.write_text(copy.read_text() + "one line more\n")
    with pytest.raises(ValueError, match=r"is not the \S+ text .* was swept on \(sha256 [0-9a-f]{12}\.\.\.\)"):
        scaling.check_protocol(scaling.Sweep(scaling.build_parser().parse_args(argv)))


def test_the_report_counts_each_sizes_repeated_targets_by_replaying_the_windows(tmp_path):
    """Issue 99, item 1: the share of a run's targets it had trained on before, from the sampler itself."""
    from experiments import scaling_report
    from experiments.build_corpus import sha256_file
    from qkvjax.data.pipeline import targets_repeated

    corpus = tmp_path / "tiny.txt"
    corpus.write_text("".join(f"line {i} of a small corpus\n" for i in range(300)))
    row = {"stage": "final", "corpus": "tiny", "size": "48", "variant": "separate", "learning_rate": "0.004",
           "steps": "9", "final_val_loss": "1.0"}  # fmt: skip
    rows = [row | {"seed": str(s), "run": f"r{s}"} for s in (0, 1)]
    protocol = {"corpora": {"tiny": {"path": str(corpus), "sha256": sha256_file(corpus)}}}
    train = scaling_report.corpus_train_tokens(protocol)
    assert train == {"tiny": int(corpus.stat().st_size * 0.9)}
    (rep,) = scaling_report.repetition(scaling_report.finals(rows), train, batch=16, context=128)
    want = [r / t for r, t in (targets_repeated(train["tiny"], 128, 16, s, 9) for s in (0, 1))]
    assert rep["repeated"] == sum(want) / 2 and rep["seeds"] == 2 and 0 < rep["low"] <= rep["high"] < 1
    assert scaling_report.corpus_train_tokens({"corpora": {"tiny": {"path": str(corpus), "sha256": "0" * 64}}}) == {}


def test_the_trend_by_size_is_weighted_least_squares_of_the_means_with_welch_satterthwaite_df():
    """trend_by_size (experiments/preregistered/trend_by_size.md) against numpy's weighted polyfit in float64: the
    slope and its standard error from the sizes' own variances, the Welch-Satterthwaite df computed by hand, the
    residual χ², the unweighted line through the means; a size with one seed left out; None below two sizes."""
    import numpy as np
    from scipy import stats

    from experiments import scaling_report

    rng = np.random.default_rng(7)
    params, spread, seeds = (129_456, 480_096, 1_291_680, 4_000_000), (0.05, 0.01, 0.003, 0.02), (3, 5, 7, 1)
    points = [(p, 0.3 - 0.05 * np.log10(p) + s * rng.standard_normal())
              for p, s, n in zip(params, spread, seeds, strict=True) for _ in range(n)]  # fmt: skip
    fit = scaling_report.trend_by_size(points)
    groups = [[d for q, d in points if q == p] for p in params[:3]]  # the one-seed size is left out
    x = np.log10(params[:3])
    m = np.array([np.mean(g) for g in groups])
    se = np.array([np.std(g, ddof=1) / np.sqrt(len(g)) for g in groups])
    (slope, intercept), cov = np.polyfit(x, m, 1, w=1 / se, cov="unscaled")
    np.testing.assert_allclose([fit["slope"], fit["se"]], [slope, np.sqrt(cov[0, 0])], rtol=1e-9)
    w = 1 / se**2
    c = w * (x - np.average(x, weights=w)) / np.sum(w * (x - np.average(x, weights=w)) ** 2)
    nu = np.sum(c**2 * se**2) ** 2 / np.sum((c**2 * se**2) ** 2 / (np.array(seeds[:3]) - 1))
    half = stats.t.ppf(0.975, nu) * np.sqrt(cov[0, 0])
    np.testing.assert_allclose([fit["df"], *fit["ci"]], [nu, slope - half, slope + half], rtol=1e-9)
    chi2 = np.sum(w * (m - np.polyval([slope, intercept], x)) ** 2)
    np.testing.assert_allclose([fit["chi2"], fit["chi2_p"]], [chi2, stats.chi2.sf(chi2, 1)], rtol=1e-9)
    np.testing.assert_allclose(fit["ols"]["slope"], np.polyfit(x, m, 1)[0], rtol=1e-9)
    assert fit["sizes"] == 3 and fit["seeds"] == [3, 5, 7]
    assert scaling_report.trend_verdict(fit) == ("shrinks" if fit["ci"][1] < 0 else "not told apart from zero")
    assert scaling_report.trend_by_size([(p, d) for p, d in points if p in params[2:]]) is None  # 7 seeds and 1


def test_the_report_joins_a_lower_folders_sizes_as_one_ladder_and_refuses_another_protocol(tmp_path, capsys):
    """``--lower FOLDER``: the GPU rungs (disjoint windows) with the CPU rungs below them (random windows), one
    ladder: the lower sizes' cells and the trend through all sizes in the summary, where they come from said; a
    folder of other models (another context) is refused in one line naming the field."""
    from experiments import scaling_report

    def rows(sizes: tuple, penalty: dict) -> list[dict]:
        out = []
        for size in sizes:
            for seed in range(3):
                for variant in ("separate", "shared_kv"):
                    loss = 2.0 - size / 1000 + (penalty[size] + 0.003 * seed if variant == "shared_kv" else 0.0)
                    out.append({"stage": "final", "corpus": "linux", "size": str(size), "variant": variant,
                                "seed": str(seed), "learning_rate": "0.004", "params": str(40 * size * size),
                                "epochs": "0.5", "tokens": "9", "kv_cache_bytes_per_token": "48",
                                "final_val_loss": repr(loss), "best_eval_loss": repr(loss),
                                "last_eval_loss": repr(loss), "run": f"{variant}-{size}-{seed}",
                                "tokens_per_s": "1"})  # fmt: skip
        return out

    base = {"layers": 4, "context": 128, "heads": 4, "batch": 16, "tokens_per_param": 10.0, "token_scale": 1.0,
            "primary": "linux", "lr_grid": [0.001, 0.002], "learning_rate": None, "sweep_seeds": None,
            "positions": None}  # fmt: skip
    folders = {"cpu": (rows((48, 96), {48: 0.05, 96: 0.04}), base),
               "gpu": (rows((160,), {160: 0.03}), base | {"sampling": "disjoint", "sweep_seeds": [0, 1]})}  # fmt: skip
    for name, (data, protocol) in folders.items():
        (tmp_path / name).mkdir()
        append_rows(tmp_path / name / "runs.csv", tuple(data[0]), data)
        (tmp_path / name / "protocol.json").write_text(json.dumps({"protocol": protocol}))
    summary = scaling_report.write_report(tmp_path / "gpu", speed=None, lower=tmp_path / "cpu").read_text()
    assert "Sizes d=48, 96 are `cpu`'s (12 rows, random windows; this folder's own: disjoint)" in summary
    alone = scaling_report.summary_markdown(folders["gpu"][0])
    joined = scaling_report.summary_markdown(folders["cpu"][0] + folders["gpu"][0])
    assert joined.split("\n", 1)[1] in summary and joined != alone  # the three sizes' cells and trend
    assert scaling_report.trend_by_size([(40 * d * d, p + 0.003 * s) for d, p in ((48, 0.05), (96, 0.04), (160, 0.03))
                                         for s in range(3)])["slope"] < 0  # fmt: skip
    other = base | {"context": 256}
    (tmp_path / "cpu" / "protocol.json").write_text(json.dumps({"protocol": other}))
    assert scaling_report.main([str(tmp_path / "gpu"), "--lower", str(tmp_path / "cpu")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another protocol (context: 256 there, 128 here)" in err
