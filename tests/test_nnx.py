"""qkvjax.nnx against the linen modules: the same parameter trees (names, shapes), equal outputs with the same
parameters both ways (linen's loaded into NNX, NNX's applied by linen), for every kind of scheme, cross-layer K/V,
cached decoding, the decoder with a layer pattern and each block layout, and gradients."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qkvjax.nnx as qnnx
from qkvjax.attention import KV, AttentionConfig, attention_module
from qkvjax.models.family import Family
from qkvjax.models.lm import DecodeCache, DecoderLM, ModelConfig

D, T, V = 21, 9, 37  # model width, sequence length, vocabulary: odd and distinct from the head sizes below


def _linen(module, *args, **kwargs):
    return nn.meta.unbox(jax.jit(lambda: module.init(jax.random.key(5), *args, **kwargs))()["params"])  # one compile


def _shapes(tree):
    return jax.tree.map(jnp.shape, tree)


ATTENTIONS = {
    "separate_gqa": dict(num_heads=3, head_dim=6, num_kv_heads=1, rope=True, use_bias=True),
    "shared_qk": dict(num_heads=3, head_dim=5, scheme="shared_qk"),
    "reformer_qk": dict(num_heads=3, head_dim=5, scheme="reformer_qk", learned_temperature=True),
    "shared_kv_norms": dict(num_heads=3, head_dim=6, scheme="shared_kv", qk_norm=True, v_norm=True, rope=True),
    "shared_qkv": dict(num_heads=3, head_dim=5, scheme="shared_qkv", relative_bias=2),
    "bilinear": dict(num_heads=3, head_dim=5, scheme="bilinear"),
    "mla_q_lora": dict(num_heads=3, head_dim=6, scheme="mla", kv_rank=7, q_rank=11, rope=True, rope_head_dim=4),
    "window": dict(num_heads=3, head_dim=6, rope=True, sliding_window=3, rope_pairs=2),
}


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_attention_has_the_linen_tree_and_computes_the_same_both_ways(name):
    cfg = AttentionConfig(**ATTENTIONS[name])
    x = jax.random.normal(jax.random.key(1), (2, T, D))
    linen = attention_module(cfg)(cfg)
    linen_params = _linen(linen, x)
    module = qnnx.Attention(cfg, D, rngs=nnx.Rngs(0))
    assert _shapes(qnnx.params(module)) == _shapes(linen_params)
    ours = np.asarray(module(x, causal=True))  # NNX's own initialisation, applied by linen
    np.testing.assert_allclose(ours, linen.apply({"params": qnnx.params(module)}, x, causal=True), atol=1e-6)
    qnnx.load_params(module, linen_params)  # linen's, applied by NNX
    mask = jnp.arange(T)[None, None, None, :] < jnp.array([T, 5])[:, None, None, None]
    want = linen.apply({"params": linen_params}, x, causal=True, mask=mask)
    np.testing.assert_allclose(module(x, causal=True, mask=mask), want, atol=1e-6)


def test_cross_layer_kv_and_the_decode_cache_go_through_the_same_stages():
    cfg = AttentionConfig(num_heads=3, head_dim=6, num_kv_heads=1, rope=True, qk_norm=True)
    x = jax.random.normal(jax.random.key(1), (2, T, D))
    donor, reader = qnnx.Attention(cfg, D, rngs=nnx.Rngs(0)), qnnx.Attention(cfg, D, reads_kv=True, rngs=nnx.Rngs(1))
    linen = attention_module(cfg)(cfg)
    y, kv = donor(x, causal=True, return_kv=True)
    want_y, want_kv = linen.apply({"params": qnnx.params(donor)}, x, causal=True, return_kv=True)
    np.testing.assert_allclose(y, want_y, atol=1e-6)
    want = linen.apply({"params": qnnx.params(reader)}, x, causal=True, kv=want_kv)
    np.testing.assert_allclose(reader(x, causal=True, kv=kv), want, atol=1e-6)
    # a cache of 11 slots: a 4-token prompt, then one token at a time (the caller advances each row's start, as
    # DecodeCache does), equal to the whole-sequence call
    tensors = {"k": jnp.zeros((2, 1, 11, 6)), "v": jnp.zeros((2, 1, 11, 6))}
    out, side = donor(x[:, :4], cache=KV.cached(tensors, jnp.zeros((2,), jnp.int32)))
    steps = [out]
    for t in range(4, T):
        out, side = donor(x[:, t : t + 1], cache=KV.cached(side.tensors, jnp.full((2,), t, jnp.int32)))
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), y, atol=1e-5)
    with pytest.raises(ValueError, match="kv= given to a layer built with reads_kv=False"):
        donor(x, kv=kv)


GEMMA = Family(norm="rmsnorm", norm_position="sandwich", mlp="geglu", embed_scale=True, layer_scale=True,
               logit_softcap=3.0)  # fmt: skip
DECODERS = {
    "gpt2_like": dict(learned_positions=True, family=Family(norm="layernorm", norm_bias=True, mlp_bias=True)),
    "bert_like_post_norm": dict(learned_positions=True, family=Family(norm_position="post", embed_norm=True,
                                                                      norm_bias=True, mlp="gelu", mlp_bias=True)),
    "gemma_like_pattern": dict(
        learned_positions=False, tie_embeddings=False, family=GEMMA,
        layers="[sliding_window=3], shared_kv[kv=1], [sliding_window=3,kv_from=0], [kv_from=1]",
    ),
    "mla_and_gqa": dict(
        learned_positions=False, layers="mla[kv_rank=9,rope_head_dim=2], [kv=1], mla[q_rank=5,rope_head_dim=4], []"
    ),
}  # fmt: skip


# CI runs three: bert_like has gpt2_like's pieces (layer norms and MLP with biases, learned positions) with a
# post-norm layout; `pytest -m slow` runs gpt2_like's pre-norm one as well.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "gpt2_like" else n for n in DECODERS])
def test_decoder_has_the_linen_tree_and_computes_the_same_logits_and_decodes_the_same(name):
    fields = DECODERS[name]
    att = AttentionConfig(num_heads=3, head_dim=6, rope=not fields["learned_positions"],
                          qk_norm="gemma" in name, v_norm="gemma" in name)  # fmt: skip
    config = ModelConfig(att, vocab_size=V, d_model=D, num_layers=4, mlp_dim=13, max_len=17, **fields)
    tokens = jax.random.randint(jax.random.key(2), (2, T), 0, V)
    linen = DecoderLM(config)
    linen_params = _linen(linen, tokens)
    model = qnnx.DecoderLM(config, rngs=nnx.Rngs(0))
    assert _shapes(qnnx.params(model)) == _shapes(linen_params)
    forward, linen_forward = nnx.jit(lambda m, x: m(x)), jax.jit(lambda p, x: linen.apply({"params": p}, x))
    np.testing.assert_allclose(forward(model, tokens), linen_forward(qnnx.params(model), tokens), atol=2e-5)
    qnnx.load_params(model, linen_params)
    want = linen_forward(linen_params, tokens)
    np.testing.assert_allclose(forward(model, tokens), want, atol=2e-5)
    step = nnx.jit(lambda m, x, c: m(x, cache=c))  # one compile for the prefill, one for every single token
    logits, cache = step(model, tokens[:, :5], DecodeCache.empty(config, 2))
    steps = [logits]
    for t in range(5, T):
        logits, cache = step(model, tokens[:, t : t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), want, atol=5e-5)


def test_gradients_equal_the_linen_ones_under_nnx_jit():
    config = ModelConfig(AttentionConfig(num_heads=3, head_dim=6, scheme="shared_kv", rope=True), vocab_size=V,
                         d_model=D, num_layers=2, mlp_dim=13, max_len=17, learned_positions=False)  # fmt: skip
    tokens = jax.random.randint(jax.random.key(3), (2, T), 0, V)
    model = qnnx.DecoderLM(config, rngs=nnx.Rngs(0))

    def loss(logits):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1))

    grads = nnx.jit(nnx.grad(lambda m: loss(m(tokens))))(model)
    want = jax.grad(lambda p: loss(DecoderLM(config).apply({"params": p}, tokens)))(qnnx.params(model))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-6), nnx.to_pure_dict(grads), want)
    with pytest.raises(ValueError, match=rf"cache= holds 3 rows; tokens \(2, {T}\) have B=2"):  # linen's checks
        model(tokens, cache=DecodeCache.empty(config, 3))


def test_a_bad_width_is_refused_in_one_line():
    cfg = AttentionConfig(num_heads=3, head_dim=5)
    with pytest.raises(ValueError, match=r"^d_model=0; allowed: an integer >= 1"):
        qnnx.Attention(cfg, 0, rngs=nnx.Rngs(0))
    module = qnnx.Attention(cfg, D, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=rf"^inputs_q \(2, {T}, {D + 2}\): this layer was built for d_model={D}"):
        module(jnp.ones((2, T, D + 2)))


def test_a_tree_of_another_shape_is_refused_in_one_line():
    module = qnnx.Attention(AttentionConfig(num_heads=3, head_dim=5), D, rngs=nnx.Rngs(0))
    tree = qnnx.params(module) | {"w_q": jnp.zeros((D, 3, 7))}
    with pytest.raises(ValueError, match="^the parameter tree does not fit this module") as error:
        qnnx.load_params(module, tree)
    assert "\n" not in str(error.value)


def test_the_readmes_nnx_block_runs_as_written():
    import re

    from tests.helpers import docs_text

    readme = docs_text()
    block = re.search(r"<!-- nnx-usage:[^>]*-->\n```python\n(.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(compile(block, "README.md (nnx-usage)", "exec"), scope)
    assert scope["y"].shape == (2, 16, 256) and scope["logits"].shape == (2, 16, 256)
