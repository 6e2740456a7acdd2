"""Retrofitting K = V onto a trained model (``qkvjax convert --to shared_kv``): keys kept, values least squares
through the keys, folded into W^O. Exact when W^V = W^K A; otherwise the reported error is the one measured on
the converted weights' value-output maps, and the least-squares choice beats a perturbed one."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax.attention import AttentionConfig
from qkvjax.convert import convert, shared_kv_attention_params
from qkvjax.models.lm import DecoderLM, ModelConfig, kv_cache_bytes_per_token


def _model(kv_heads, use_bias, rope=False):
    att = AttentionConfig(num_heads=3, head_dim=6 if rope else 5, num_kv_heads=kv_heads, use_bias=use_bias, rope=rope)
    return ModelConfig(att, vocab_size=23, d_model=15, num_layers=2, mlp_dim=13, max_len=11, learned_positions=not rope)


def _params(config, seed=0):
    tokens = jnp.zeros((1, 3), jnp.int32)
    params = nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(seed), tokens)["params"])
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: np.asarray(p) + 0.3 * rng.standard_normal(p.shape).astype(np.float32), params)


def _ov_error(old: dict, new: dict, g: int) -> float:
    """sqrt(sum_n |W^KV_n W'^O_n - W^V_n W^O_n|^2 / sum_n |W^V_n W^O_n|^2), from the two layers' weights."""
    rep = lambda w: np.repeat(np.asarray(w, np.float64), g, axis=1)  # noqa: E731 DKH -> DNH
    approx = np.einsum("DNH,NHE->NDE", rep(new["w_kv"]), np.asarray(new["w_o"], np.float64))
    exact = np.einsum("DNH,NHE->NDE", rep(old["w_v"]), np.asarray(old["w_o"], np.float64))
    return float(np.sqrt(np.sum((approx - exact) ** 2) / np.sum(exact**2)))


@pytest.mark.parametrize(("kv_heads", "use_bias", "rope"), [(None, True, False), (1, False, True), (3, True, True)])
def test_k_equals_v_is_exact_when_values_lie_in_the_keys_span(kv_heads, use_bias, rope):
    config = _model(kv_heads, use_bias, rope)
    params = _params(config)
    rng = np.random.default_rng(7)
    h = config.attention.head_dim
    for i in range(config.num_layers):  # W^V = W^K A per kv head, A invertible (H x H)
        att = params[f"block_{i}"]["attention"]
        a = rng.standard_normal((att["w_k"].shape[1], h, h)).astype(np.float32) + 2 * np.eye(h, dtype=np.float32)
        att["w_v"] = np.einsum("DKH,KHE->DKE", att["w_k"], a)
    errors = []
    new_config, new_params = convert(config, params, to="shared_kv", errors=errors)
    assert new_config.attention.scheme == "shared_kv" and len(errors) == config.num_layers
    assert [e.layer for e in errors] == list(range(config.num_layers)) and max(e.error for e in errors) < 1e-5
    assert kv_cache_bytes_per_token(new_config) * 2 == kv_cache_bytes_per_token(config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 23, (2, 11)))
    before = DecoderLM(config).apply({"params": params}, tokens)
    after = DecoderLM(new_config).apply({"params": new_params}, tokens)
    np.testing.assert_allclose(after, before, atol=2e-4 * float(jnp.abs(before).max()))


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_the_reported_error_is_the_converted_weights_error_and_least_squares_beats_a_perturbed_choice(kv_heads):
    config = _model(kv_heads, use_bias=False)
    att_cfg = config.attention
    att = _params(config)["block_0"]["attention"]
    new, error = shared_kv_attention_params(att, att_cfg)
    assert 0.05 < error < 1.5  # random W^K, W^V: far from K = V
    assert error == pytest.approx(_ov_error(att, new, att_cfg.group_size), rel=1e-5)
    # any other C_n = C + E_n (per query head) is worse: W'^O_n = (C + E_n) W^O_n
    rng = np.random.default_rng(3)
    h = att_cfg.head_dim
    worse = dict(new)
    shift = 0.05 * rng.standard_normal((att_cfg.num_heads, h, h))
    worse["w_o"] = np.asarray(new["w_o"]) + np.einsum("NHV,NVD->NHD", shift, np.asarray(att["w_o"]))
    assert _ov_error(att, worse, att_cfg.group_size) > error  # least squares per head even where heads share C


def test_a_scheme_without_separate_k_and_v_is_refused():
    config = dataclasses.replace(
        _model(None, False), attention=AttentionConfig(num_heads=3, head_dim=5, scheme="shared_qk")
    )
    with pytest.raises(ValueError, match="scheme 'shared_qk' has no separate W\\^K and W\\^V to merge"):
        convert(config, _params(config), to="shared_kv")


def _assert_exact_reader(reader: dict, donor: dict, att_cfg) -> None:
    """The CLA conversion of ``reader`` onto ``donor``'s K/V reports no error, and the converted reader attending
    over the donor's K/V computes what the reader computed with its own (on the donor's input)."""
    from qkvjax.attention import Attention
    from qkvjax.convert import cross_layer_attention_params

    new, key_error, value_error = cross_layer_attention_params(reader, donor, att_cfg)
    assert key_error < 1e-5 and value_error < 1e-5
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 7, 15)), jnp.float32)
    own = Attention(att_cfg).apply({"params": reader}, x, causal=True)
    _, kv = Attention(att_cfg).apply({"params": donor}, x, causal=True, return_kv=True)
    shared = Attention(att_cfg).apply({"params": new}, x, kv=kv, causal=True)
    np.testing.assert_allclose(shared, own, atol=2e-4 * float(jnp.abs(own).max()))


@pytest.mark.parametrize(("kv_heads", "use_bias"), [(None, True), (1, False)])
def test_cross_layer_reader_is_exact_on_the_same_input_when_its_kv_lie_in_the_donors_span(kv_heads, use_bias):
    """A reader whose W^K, W^V are the donor's times invertible maps computes, on the donor's input, what it
    computed with its own K/V; the model-level conversion halves the cache and yields the pattern's tree."""

    config = _model(kv_heads, use_bias)
    att_cfg = config.attention
    params = _params(config)
    donor, reader = params["block_0"]["attention"], dict(params["block_1"]["attention"])
    rng = np.random.default_rng(5)
    h = att_cfg.head_dim
    for name in ("w_k", "w_v"):
        maps = rng.standard_normal((donor[name].shape[1], h, h)).astype(np.float32) + 2 * np.eye(h, dtype=np.float32)
        reader[name] = np.einsum("DKH,KHE->DKE", donor[name], maps)
    _assert_exact_reader(reader, donor, att_cfg)

    errors = []
    new_config, new_params = convert(config, params, num_kv_heads=None, errors=errors, cross_layer=2)
    assert new_config.layers == "(separate, [kv_from=-1])*" and [e[:2] for e in errors] == [(1, 0)]
    assert 0.1 < errors[0].key_error and 0.1 < errors[0].value_error  # random weights: far from one another
    assert kv_cache_bytes_per_token(new_config) * 2 == kv_cache_bytes_per_token(config)
    tokens = jnp.zeros((1, 3), jnp.int32)
    want = jax.eval_shape(DecoderLM(new_config).init, jax.random.key(0), tokens)["params"]  # shapes only
    want = jax.tree.map(np.shape, nn.meta.unbox(want))
    assert jax.tree.map(np.shape, new_params) == want
    with pytest.raises(ValueError, match="--cla 3; allowed: an integer >= 2 dividing the 2 layers"):
        convert(config, params, cross_layer=3)


@pytest.mark.parametrize(("kv_heads", "layout"), [(None, "half"), (1, "interleaved")])
def test_cross_layer_under_rotary_positions_fits_maps_that_commute_with_every_rotation(kv_heads, layout):
    """Rotary keys arrive at a reader already rotated: its key map must commute with every rotation (a complex
    number per frequency pair). With the reader's W^K = the donor's times such a map the conversion is exact on
    the donor's input; with a generic map (which does not commute) the reported key error is the one measured."""
    from qkvjax.convert import cross_layer_attention_params

    config = _model(kv_heads, use_bias=False, rope=True)
    att_cfg = dataclasses.replace(config.attention, rope_layout=layout)
    params = _params(config)
    donor, reader = params["block_0"]["attention"], dict(params["block_1"]["attention"])
    rng = np.random.default_rng(9)
    k, h = donor["w_k"].shape[1], att_cfg.head_dim
    first = np.arange(0, h, 2) if layout == "interleaved" else np.arange(h // 2)
    second = first + 1 if layout == "interleaved" else first + h // 2
    turn = np.zeros((k, h, h), np.float32)  # a scale and a rotation per frequency pair and kv head
    c = rng.standard_normal((k, h // 2)) + 1j * rng.standard_normal((k, h // 2))
    for j in range(k):
        turn[j, first, first] = turn[j, second, second] = c[j].real
        turn[j, second, first], turn[j, first, second] = -c[j].imag, c[j].imag
    reader["w_k"] = np.einsum("DKH,KHE->DKE", donor["w_k"], turn)
    generic = rng.standard_normal((k, h, h)).astype(np.float32) + 2 * np.eye(h, dtype=np.float32)
    reader["w_v"] = np.einsum("DKH,KHE->DKE", donor["w_v"], generic)  # values are not rotated: any map
    _assert_exact_reader(reader, donor, att_cfg)

    reader["w_k"] = np.einsum("DKH,KHE->DKE", donor["w_k"], generic)  # no commuting map reaches this exactly
    new, key_error, _ = cross_layer_attention_params(reader, donor, att_cfg)
    w_q, w_k, w_kd = (np.asarray(a, np.float64) for a in (reader["w_q"], reader["w_k"], donor["w_k"]))
    # the map the conversion chose, read back from the queries it absorbed into (q' = q B^T, per query head)
    g = att_cfg.group_size
    b = np.stack([np.linalg.lstsq(w_q[:, n * g], np.asarray(new["w_q"], np.float64)[:, n * g], rcond=None)[0].T
                  for n in range(k)])  # fmt: skip
    measured = np.linalg.norm(np.einsum("DKH,KHE->DKE", w_kd, b) - w_k) / np.linalg.norm(w_k)
    assert 0.05 < key_error and abs(measured - key_error) < 1e-4
    with pytest.raises(ValueError, match="query/key biases under rotary positions: the least-squares cross-layer"):
        cross_layer_attention_params(reader, donor, dataclasses.replace(att_cfg, use_bias=True))


def test_shared_qk_is_exact_when_every_heads_score_matrix_is_psd():
    """W^K_n = W^Q_n M_n with M_n symmetric positive definite (H x H): A_n = W^Q M W^Q^T is PSD of rank H, so
    the shared head W_n W_n^T equals it and the converted model computes the same logits."""
    config = _model(None, use_bias=False)
    params = _params(config)
    rng = np.random.default_rng(11)
    h = config.attention.head_dim
    for i in range(config.num_layers):
        att = params[f"block_{i}"]["attention"]
        b = rng.standard_normal((config.attention.num_heads, h, h))
        m = (np.einsum("NHE,NFE->NHF", b, b) + np.eye(h)).astype(np.float32)  # SPD per head
        att["w_k"] = np.einsum("DNH,NHE->DNE", att["w_q"], m)
    errors = []
    new_config, new_params = convert(config, params, to="shared_qk", errors=errors)
    assert new_config.attention.scheme == "shared_qk" and max(e.error for e in errors) < 1e-5
    assert set(new_params["block_0"]["attention"]) == {"w_qk", "w_v", "w_o"}
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 23, (2, 11)))
    before = DecoderLM(config).apply({"params": params}, tokens)
    after = DecoderLM(new_config).apply({"params": new_params}, tokens)
    np.testing.assert_allclose(after, before, atol=2e-4 * float(jnp.abs(before).max()))


def test_shared_qk_is_the_nearest_psd_rank_h_form_in_float64():
    """Against a direct float64 reference: the symmetric part of each head's D x D score matrix, its H largest
    positive eigenpairs; the reported error is |A - W W^T| / |A| over heads, and a perturbed W is worse."""
    from qkvjax.convert import shared_qk_attention_params

    config = _model(None, use_bias=False)
    att = _params(config)["block_0"]["attention"]
    new, error = shared_qk_attention_params(att, config.attention)
    w_q, w_k = (np.asarray(att[k], np.float64) for k in ("w_q", "w_k"))
    h, num, den = w_q.shape[2], 0.0, 0.0
    for n in range(w_q.shape[1]):
        a = w_q[:, n] @ w_k[:, n].T
        values, vectors = np.linalg.eigh((a + a.T) / 2)  # D x D, ascending
        top = np.clip(values[-h:], 0, None)
        best = (vectors[:, -h:] * top) @ vectors[:, -h:].T
        w = np.asarray(new["w_qk"], np.float64)[:, n]
        np.testing.assert_allclose(w @ w.T, best, atol=1e-5 * np.abs(best).max())
        num, den = num + np.sum((a - best) ** 2), den + np.sum(a**2)
    assert error == pytest.approx(np.sqrt(num / den), rel=1e-5) and 0.3 < error < 1.2  # random: far from tied
    worse = np.asarray(new["w_qk"], np.float64) + 0.05 * np.random.default_rng(4).standard_normal(w_q.shape)
    worse_num = sum(np.sum((w_q[:, n] @ w_k[:, n].T - worse[:, n] @ worse[:, n].T) ** 2) for n in range(w_q.shape[1]))
    assert np.sqrt(worse_num / den) > error


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"rope": True, "head_dim": 6}, "rope=True"), ({"num_kv_heads": 1}, "num_kv_heads=1 < num_heads=3"),
     ({"use_bias": True}, "use_bias=True"), ({"qk_norm": True}, "qk_norm=True")],
)  # fmt: skip
def test_shared_qk_refuses_what_a_psd_form_cannot_carry(overrides, message):
    base = _model(None, use_bias=False)
    att = dataclasses.replace(base.attention, **overrides)
    config = dataclasses.replace(base, attention=att, learned_positions=not att.rope)
    with pytest.raises(ValueError, match=f"^{message.replace('(', '.').replace(')', '.')}: --to shared_qk"):
        convert(config, _params(config), to="shared_qk")
