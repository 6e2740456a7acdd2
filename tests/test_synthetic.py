"""The probes: the encoder, the symmetry of shared-QK scores, the task generators, a short training, the sweep."""

import csv
import os
import signal
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import synthetic
from qkvjax import SCHEMES, AttentionConfig
from qkvjax.data.synthetic import TaskData, check_task, targets
from qkvjax.models.encoder import Encoder, EncoderConfig, encoder_param_count
from tests.helpers import REPO, xla_flags

STRICT_DTYPE_PROMOTION = False  # optax in the training test

B, L, D, N = 3, 7, 12, 3  # H = 4


def encoder(scheme="separate", learned=True, rope=False, relative_bias=0, classes=5):
    att = AttentionConfig(num_heads=N, head_dim=D // N, scheme=scheme, rope=rope, relative_bias=relative_bias)
    return Encoder(EncoderConfig(att, vocab_size=11, num_classes=classes, d_model=D, num_layers=2, max_len=L,
                                 learned_positions=learned))  # fmt: skip


def random_params(model, tokens, seed=0):
    """Every leaf random (the relative bias starts at zero otherwise)."""
    params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(seed), tokens))["params"]  # shapes: drawn below
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, p.shape) for k, p in zip(keys, leaves, strict=True)])


TOKENS = jax.random.randint(jax.random.key(5), (B, L), 0, 11)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "bilinear"] + ["bilinear"])
def test_encoder_without_positions_is_permutation_equivariant(scheme):
    model = encoder(scheme, learned=False)
    params = random_params(model, TOKENS)
    perm = np.array([3, 0, 6, 1, 5, 2, 4])
    forward = jax.jit(model.apply)  # one compile for both orders
    out = forward({"params": params}, TOKENS)
    out_perm = forward({"params": params}, TOKENS[:, perm])
    np.testing.assert_allclose(out_perm, out[:, perm], rtol=1e-5, atol=1e-5)
    # and with learned positions it is not
    model = encoder(scheme, learned=True)
    params = random_params(model, TOKENS)
    forward = jax.jit(model.apply)
    out, out_perm = forward({"params": params}, TOKENS), forward({"params": params}, TOKENS[:, perm])
    assert not np.allclose(out_perm, out[:, perm], atol=1e-3)
    assert sum(p.size for p in jax.tree.leaves(params)) == encoder_param_count(model.config)


def _logits(model, params):
    _, state = model.apply({"params": params}, TOKENS, mutable=["intermediates"])
    return [np.asarray(state["intermediates"][f"block_{i}"]["attention"]["attention_logits"][0]) for i in range(2)]


@pytest.mark.parametrize("scheme", ["shared_qk", "shared_qkv"])
@pytest.mark.parametrize("positions", ["learned", "rope", "both"])
def test_shared_qk_scores_are_symmetric_and_the_relative_bias_breaks_it(scheme, positions):
    kw = {"learned": positions != "rope", "rope": positions != "learned"}
    model = encoder(scheme, **kw)
    for logits in _logits(model, random_params(model, TOKENS)):  # (B, N, T, S)
        np.testing.assert_allclose(logits, logits.swapaxes(-1, -2), rtol=1e-5, atol=1e-5)
    model = encoder(scheme, relative_bias=L - 1, **kw)
    for logits in _logits(model, random_params(model, TOKENS)):
        assert np.abs(logits - logits.swapaxes(-1, -2)).max() > 0.05
    separate = encoder("separate", **kw)
    logits = _logits(separate, random_params(separate, TOKENS))[0]
    assert np.abs(logits - logits.swapaxes(-1, -2)).max() > 0.05  # untied scores were never symmetric


def test_task_targets_on_hand_checked_examples():
    x = np.array([[3, 1, 4, 1, 5, 9], [2, 7, 1, 8, 2, 8]])
    np.testing.assert_array_equal(targets("copy", x), x)
    np.testing.assert_array_equal(targets("sub", x), [[6, 8, 5, 8, 4, 0], [7, 2, 8, 1, 7, 1]])
    np.testing.assert_array_equal(targets("reverse", x), [[9, 5, 1, 4, 1, 3], [8, 2, 8, 1, 7, 2]])
    np.testing.assert_array_equal(targets("sort", x), [[1, 1, 3, 4, 5, 9], [1, 2, 2, 7, 8, 8]])
    np.testing.assert_array_equal(targets("swap", x), [[1, 5, 9, 3, 1, 4], [8, 2, 8, 2, 7, 1]])
    np.testing.assert_array_equal(targets("left", x), [[10, 3, 1, 4, 1, 5], [10, 2, 7, 1, 8, 2]])


def test_training_never_sees_held_out_sequences():
    data = TaskData("copy", 3, seed=0, eval_size=500)  # 1,000 sequences in all: collisions are certain
    held = {row.tobytes() for row in data.eval_inputs}
    for _ in range(20):
        x, y = data.batch(64)
        assert not {row.tobytes() for row in x} & held
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "task, length, match",
    [("rotate", 8, "unknown task 'rotate'"), ("copy", 1, "length 1; allowed: an integer >= 2"),
     ("swap", 7, "needs an even length; got 7")],
)  # fmt: skip
def test_bad_tasks_and_lengths(task, length, match):
    with pytest.raises(ValueError, match=match):
        check_task(task, length)


def test_a_few_steps_of_separate_learn_copy_far_above_chance():
    probe = synthetic.Probe("copy", "separate", 0, d_model=32, layers=1, heads=2, length=8, positions="learned",
                            steps=150)  # fmt: skip
    result = synthetic.train_probe(probe, batch_size=32, lr=3e-3)
    assert result["token_acc"] > 0.5  # chance: 0.1


def test_plan_and_cli_errors(tmp_path, capsys):
    preset = synthetic.PRESETS["cpu"]
    probes = synthetic.plan(preset, ["rope"], tasks=["left"], seeds=[0])
    assert {p.scheme for p in probes} == set(synthetic.DEFAULT_SCHEMES) - {"bilinear"}
    for args, match in (
        (["--tasks", "copy,rotate"], "unknown task 'rotate'"),
        (["--grids", "main", "--length", "7", "--tasks", "swap"], "needs an even length; got 7"),
        (["--grids", "rope", "--schemes", "bilinear"], "bilinear"),
        (["--length", "1"], "allowed: an integer >= 2"),
        (["--seeds", ""], "--seeds is empty"),
    ):
        assert synthetic.main(["--out", str(tmp_path / "x"), *args]) == 2, args
        assert match in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # 20-35 s: kills a real sweep and reruns it (out of CI for time: pytest -m slow)
def test_a_killed_sweep_resumes(tmp_path):
    out = tmp_path / "probes"
    args = ["--out", str(out), "--grids", "main", "--tasks", "copy", "--schemes", "separate,shared_qk,shared_kv",
            "--seeds", "0", "--steps", "150", "--length", "8"]  # fmt: skip
    env = {**os.environ, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, str(REPO / "experiments" / "synthetic.py"), *args]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "results.csv").exists():
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with open(out / "results.csv") as f:
        first = list(csv.DictReader(f))
    assert 1 <= len(first) < 3
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"3 probes, {len(first)} already finished, {3 - len(first)} to go" in done.stdout
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["scheme"] for r in rows] == ["separate", "shared_qk", "shared_kv"] and rows[: len(first)] == first
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG" and "| copy |" in (out / "summary.md").read_text()


def test_encoder_rejects_bad_config():
    with pytest.raises(ValueError, match="num_classes=-1; allowed: 0 \\(no head\\) or an integer >= 1"):
        EncoderConfig(AttentionConfig(num_heads=2, head_dim=4), vocab_size=10, num_classes=-1)
    with pytest.raises(ValueError, match="max_len=7"):
        encoder().init(jax.random.key(0), jnp.zeros((1, 9), jnp.int32))


def test_the_encoder_refuses_bad_tokens_and_masks_in_one_line():
    model = encoder()
    params = random_params(model, TOKENS)
    with pytest.raises(ValueError, match=rf"^Encoder takes integer tokens \(B, T\) with T <= max_len={L}; got float32"):
        model.apply({"params": params}, TOKENS.astype(jnp.float32))
    with pytest.raises(ValueError, match=rf"^mask is the tokens' padding, \(B, T\) = \({B}, {L}\) .* got \({B}, 1, 1"):
        model.apply({"params": params}, TOKENS, mask=jnp.ones((B, 1, 1, L), bool))
