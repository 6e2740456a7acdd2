"""The chunked output layer and loss (``train.loss_chunk``): the same loss and gradients as the whole logits, and
less memory in XLA's own plan of the compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qkvjax.attention import AttentionConfig
from qkvjax.models.lm import DecoderLM, ModelConfig
from qkvjax.train.state import TrainState
from qkvjax.train.step import chunked_cross_entropy, cross_entropy, make_train_step

STRICT_DTYPE_PROMOTION = False  # optax's Adam bias correction


def _model(tie: bool, cap=None) -> DecoderLM:
    from qkvjax.models.family import Family

    family = Family(logit_softcap=cap) if cap else Family()
    att = AttentionConfig(num_heads=3, head_dim=5, scheme="separate")
    return DecoderLM(ModelConfig(attention=att, vocab_size=37, d_model=15, num_layers=1, max_len=11,
                                 tie_embeddings=tie, family=family))  # fmt: skip


@pytest.mark.parametrize(("tie", "chunk", "cap"), [(True, 3, None), (False, 4, None), (True, 11, 5.0), (True, 1, None)])
def test_chunked_loss_and_gradients_equal_the_whole_logits(tie, chunk, cap):
    model = _model(tie, cap)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 37, (5, 11)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 37, (5, 11)), jnp.int32)
    params = model.init(jax.random.PRNGKey(1), tokens)["params"]

    def whole(p):
        total, count = cross_entropy(model.apply({"params": p}, tokens), targets)
        return total / count

    def chunked(p):
        h, w = model.apply({"params": p}, tokens, hidden=True)
        total, count = chunked_cross_entropy(h, w, targets, chunk, model.config)
        return total / count

    (a, ga), (b, gb) = jax.value_and_grad(whole)(params), jax.value_and_grad(chunked)(params)
    np.testing.assert_allclose(b, a, rtol=1e-6)
    for x, y in zip(jax.tree.leaves(gb), jax.tree.leaves(ga), strict=True):
        np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-7)


def test_the_chunked_step_holds_less_in_xlas_plan():
    """XLA's memory analysis of the compiled train step: the chunked loss's temporaries are smaller where the
    logits dominate (V = 4,099 against D = 15)."""
    att = AttentionConfig(num_heads=3, head_dim=5, scheme="separate")
    model = DecoderLM(ModelConfig(attention=att, vocab_size=4099, d_model=15, num_layers=1, max_len=64))
    tx = optax.adamw(1e-3)
    batch = {"inputs": jnp.zeros((7, 64), jnp.int32), "targets": jnp.zeros((7, 64), jnp.int32)}
    params = model.init(jax.random.PRNGKey(0), batch["inputs"])["params"]
    state = TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(0))
    temp = {}
    for chunk in (None, 8):
        step = jax.jit(make_train_step(model, tx, loss_chunk=chunk))
        temp[chunk] = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
    logits_bytes = 7 * 64 * 4099 * 4
    assert temp[8] < temp[None] - logits_bytes, temp
