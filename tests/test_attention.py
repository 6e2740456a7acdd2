"""The attention zoo against independent references: flax's MHA, a float64 numpy model, and itself untied.

Sizes are distinct so a swapped axis fails: B=3, T=5, S=7, D=11, N=6, K=2 (G=3), H=4.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax import SCHEMES, Attention, AttentionConfig, attention_cost
from qkvjax.attention import attention_module

B, T, S, D, N, K, H = 3, 5, 7, 11, 6, 2, 4
KV_CHOICES = (None, K, 1)


def config(scheme, num_kv_heads=None, **kw):
    return AttentionConfig(num_heads=N, head_dim=H, num_kv_heads=num_kv_heads, scheme=scheme, **kw)


def valid(scheme, num_kv_heads, **kw):
    try:
        config(scheme, num_kv_heads, **kw)
        return True
    except ValueError:
        return False


# Latent schemes (MLA) have a module and a float64 reference of their own: tests/test_latent.py.
VALID = [(s, kv) for s in SCHEMES for kv in KV_CHOICES if valid(s, kv) and not SCHEMES[s].latent]


def test_the_valid_combinations_are_exactly_the_expected_ones():
    """VALID is derived by catching ValueError, so a regression refusing a valid pair would shrink every test
    below silently: the set is pinned here. Schemes whose queries share a projection with keys or values need
    K = N; the others take any K dividing N."""
    any_k = {"separate", "shared_kv", "bilinear"}
    k_is_n = {"shared_qk", "reformer_qk", "shared_qk_unit_keys", "shared_qk_self_mask", "shared_qv", "shared_qkv"}
    assert {s for s in SCHEMES if not SCHEMES[s].latent} == any_k | k_is_n  # a new scheme: add it here
    expected = {(s, kv) for s in any_k for kv in KV_CHOICES} | {(s, None) for s in k_is_n}
    assert set(VALID) == expected
    for s in k_is_n:
        with pytest.raises(ValueError, match=s):
            config(s, K)


PLAIN_PARTITIONS = [
    s
    for s, sc in SCHEMES.items()
    if not (sc.bilinear or sc.normalize_keys or sc.mask_self or sc.latent) and s != "separate"
]


def inputs(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def init_params(cfg, x, seed=0, **kw):
    """Parameters with every leaf random (biases too, so that bias paths are exercised)."""
    module = attention_module(cfg)(cfg)  # shapes only (traced, not run): every leaf is drawn below
    params = nn.meta.unbox(jax.eval_shape(lambda: module.init(jax.random.key(seed), x, **kw)))["params"]
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(
        tree, [0.5 * jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves, strict=True)]
    )


def untie(params, scheme_name, prefix="w_"):
    """The `separate` parameters in which each role gets its group's kernel (and bias)."""
    scheme = SCHEMES[scheme_name]
    out = {"w_o": params["w_o"]}
    for role in "qkv":
        for p in ("w_", "b_"):
            if p + scheme.group_of(role) in params:
                out[p + role] = params[p + scheme.group_of(role)]
    if "b_o" in params:
        out["b_o"] = params["b_o"]
    return out


# ---------------------------------------------------------------------------------------------------------
# An independent float64 model of every scheme, read off the scheme's data.


def np_rotary(x, pos, base=10000.0):
    half = x.shape[-1] // 2
    inv = base ** (-np.arange(half) / half)
    ang = pos[:, :, None, None] * inv
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def np_softmax(logits, causal=False, mask=None):
    """Softmax over keys of (B, N, T, S) float64 logits, with the causal and the user mask (True = allowed)."""
    t, s = logits.shape[-2:]
    allowed = np.ones((1, 1, t, s), bool)
    if causal:
        allowed = allowed & np.tril(np.ones((t, s), bool))
    if mask is not None:
        allowed = allowed & np.asarray(mask)
    logits = np.where(allowed, logits, -1e30)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    return w / w.sum(-1, keepdims=True)


def reference(params, cfg, xq, xkv=None, mask=None, causal=False):
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    scheme = SCHEMES[cfg.scheme]
    self_attn = xkv is None
    xq = np.asarray(xq, np.float64)
    xkv = xq if self_attn else np.asarray(xkv, np.float64)
    g = cfg.num_heads // cfg.kv_heads
    t, s = xq.shape[1], xkv.shape[1]

    def proj(x, role):
        grp = scheme.group_of(role)
        return np.einsum("btd,dch->btch", x, p["w_" + grp]) + p.get("b_" + grp, 0.0)

    if scheme.bilinear:
        logits = np.einsum("btd,nde,bse->bnts", xq, p["w_qk_merged"], xkv)
    else:
        q, k = proj(xq, "q"), proj(xkv, "k")
        if scheme.normalize_keys:
            k = k / np.sqrt((k**2).sum(-1, keepdims=True) + 1e-6)
        if cfg.rope:
            q = np_rotary(q, np.broadcast_to(np.arange(t), (xq.shape[0], t)))
            k = np_rotary(k, np.broadcast_to(np.arange(s), (xq.shape[0], s)))
        logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, g, axis=2))
    logits = logits / np.sqrt(cfg.head_dim)
    if cfg.learned_temperature:
        logits = logits * np.exp(p["temperature"])[None, :, None, None]
    if cfg.relative_bias:  # b_n(clip(s - t, -R, R))
        r = cfg.relative_bias
        offsets = np.clip(np.arange(s)[None, :] - np.arange(t)[:, None], -r, r) + r
        logits = logits + p["rel_bias"][:, offsets][None]
    if scheme.mask_self and self_attn:
        logits = np.where(np.eye(t, dtype=bool), -1e4, logits)
    w = np_softmax(logits, causal, mask)
    v = np.repeat(proj(xkv, "v"), g, axis=2)
    out = np.einsum("bnts,bsnh->btnh", w, v)
    return np.einsum("btnh,nhd->btd", out, p["w_o"]) + p.get("b_o", 0.0)


def test_interleaved_rotary_rotates_adjacent_pairs():
    """rope_layout='interleaved' against a float64 reference rotating features (2i, 2i+1) by pos * base^(-2i/H)."""
    from qkvjax.attention import core

    x = np.asarray(inputs(31, B, T, N, H), np.float64)
    pos = np.broadcast_to(np.arange(3, 3 + T), (B, T))
    ang = pos[:, :, None, None] * 10000.0 ** (-np.arange(H // 2) / (H // 2))
    even, odd = x[..., 0::2], x[..., 1::2]
    want = np.empty_like(x)
    want[..., 0::2] = even * np.cos(ang) - odd * np.sin(ang)
    want[..., 1::2] = odd * np.cos(ang) + even * np.sin(ang)
    got = core.rotary(jnp.asarray(x, jnp.float32), jnp.asarray(pos), 10000.0, interleaved=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    half = core.rotary(jnp.asarray(x, jnp.float32), jnp.asarray(pos), 10000.0)
    assert not np.allclose(half, want, atol=1e-3)  # the two layouts differ


def test_interleaved_layout_is_the_half_layout_with_features_permuted():
    """Attention with rope_layout='interleaved' equals the default layout once W^Q's and W^K's head features are
    permuted (pair (2i, 2i+1) -> (i, i + H/2)): how Hugging Face converts Meta's Llama weights."""
    perm = np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)])
    inter = config("separate", K, rope=True, rope_layout="interleaved", use_bias=True)
    x = inputs(32, B, T, D)
    params = init_params(inter, x)
    half = {k: (v[..., perm] if k in ("w_q", "w_k", "b_q", "b_k") else v) for k, v in params.items()}
    want = Attention(config("separate", K, rope=True, use_bias=True)).apply({"params": half}, x, causal=True)
    np.testing.assert_allclose(Attention(inter).apply({"params": params}, x, causal=True), want, rtol=2e-5, atol=2e-5)


def padding_mask():
    q_valid = np.arange(T)[None] < np.array([T, 3, 4])[:, None]
    kv_valid = np.arange(S)[None] < np.array([S, 2, 6])[:, None]
    return jnp.asarray(q_valid[:, None, :, None] & kv_valid[:, None, None, :])


@pytest.mark.parametrize("block", [64, 2], ids=["full_square", "causal_blocks"])
@pytest.mark.parametrize("scheme,kv", VALID)
def test_self_attention_matches_reference(scheme, kv, block):
    rope = valid(scheme, kv, rope=True)
    cfg = config(scheme, kv, rope=rope, use_bias=True, causal_block=block)  # T=5, blocks of 2: 2 + 2 + 1 queries
    x = inputs(0, B, T, D)
    params = init_params(cfg, x)
    y = Attention(cfg).apply({"params": params}, x, causal=True)
    np.testing.assert_allclose(y, reference(params, cfg, x, causal=True), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("scheme,kv", VALID)
def test_cross_attention_with_padding_matches_reference(scheme, kv):
    cfg = config(scheme, kv, use_bias=True)
    xq, xkv, mask = inputs(1, B, T, D), inputs(2, B, S, D), padding_mask()
    params = init_params(cfg, xq, inputs_kv=xkv)
    y = Attention(cfg).apply({"params": params}, xq, xkv, mask=mask)
    np.testing.assert_allclose(y, reference(params, cfg, xq, xkv, mask=mask), rtol=2e-5, atol=2e-5)


REFORMER_PARTS = [s for s, sc in SCHEMES.items() if sc.group_of("q") == "qk"]  # shared QK with and without its parts


@pytest.mark.parametrize("scheme", REFORMER_PARTS + ["separate"])
def test_learned_temperature_matches_reference_self_cross_and_decode(scheme):
    kv = None if scheme in REFORMER_PARTS else K
    cfg = config(scheme, kv, learned_temperature=True, use_bias=True, rope=scheme == "shared_qk")
    x, xkv, mask = inputs(21, B, T, D), inputs(22, B, S, D), padding_mask()
    params = init_params(cfg, x)  # every leaf random: temperatures far from 1
    assert params["temperature"].shape == (N,)
    model = Attention(cfg)
    full = model.apply({"params": params}, x, causal=True)
    np.testing.assert_allclose(full, reference(params, cfg, x, causal=True), rtol=2e-5, atol=2e-5)
    y = model.apply({"params": params}, x, xkv, mask=mask)
    np.testing.assert_allclose(y, reference(params, cfg, x, xkv, mask=mask), rtol=2e-5, atol=2e-5)
    cache = model.init(jax.random.key(0), x, decode=True)["cache"]
    steps = []
    for start in range(T):
        out, mutated = model.apply({"params": params, "cache": cache}, x[:, start : start + 1], decode=True,
                                   mutable=["cache"])  # fmt: skip
        cache = mutated["cache"]
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=2e-5, atol=2e-5)
    assert attention_cost(cfg, D, T).params == sum(np.size(v) for v in params.values())


def test_learned_temperature_is_refused_where_there_are_no_queries_to_scale():
    with pytest.raises(ValueError, match="learned_temperature=True needs queries to scale; scheme 'bilinear'"):
        config("bilinear", learned_temperature=True)


@pytest.mark.parametrize("cross", [False, True])
def test_separate_equals_flax_multihead_attention(cross):
    cfg = config("separate", use_bias=True)
    xq, xkv = inputs(3, B, T, D), inputs(4, B, S, D)
    kv_in = xkv if cross else None
    mask = padding_mask() if cross else padding_mask()[:, :, :, :T]
    params = init_params(cfg, xq, inputs_kv=kv_in)
    flax_params = {
        name: {"kernel": params["w_" + role], "bias": params["b_" + role]}
        for name, role in (("query", "q"), ("key", "k"), ("value", "v"), ("out", "o"))
    }
    mha = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=N * H, out_features=D)
    expected = mha.apply({"params": flax_params}, xq, kv_in, mask=mask)
    ours = Attention(cfg).apply({"params": params}, xq, kv_in, mask=mask)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", PLAIN_PARTITIONS)
@pytest.mark.parametrize("cross", [False, True])
def test_tied_scheme_equals_separate_with_copied_weights(scheme, cross):
    cfg = config(scheme, rope=True, use_bias=True)
    xq, xkv = inputs(5, B, T, D), inputs(6, B, S, D) if cross else None
    params = init_params(cfg, xq, inputs_kv=xkv)
    tied = Attention(cfg).apply({"params": params}, xq, xkv, causal=True)
    sep = Attention(config("separate", rope=True, use_bias=True)).apply(
        {"params": untie(params, scheme)}, xq, xkv, causal=True
    )
    np.testing.assert_allclose(tied, sep, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv", [None, K, 1])
def test_bilinear_equals_separate_with_merged_weights(kv):
    sep_cfg = config("separate", kv, use_bias=False)
    x = inputs(7, B, T, D)
    sep = init_params(sep_cfg, x)
    g = N // sep_cfg.kv_heads
    merged = jnp.stack([sep["w_q"][:, n, :] @ sep["w_k"][:, n // g, :].T for n in range(N)])
    bil = {"w_qk_merged": merged, "w_v": sep["w_v"], "w_o": sep["w_o"]}
    ours = Attention(config("bilinear", kv)).apply({"params": bil}, x, causal=True)
    expected = Attention(sep_cfg).apply({"params": sep}, x, causal=True)
    np.testing.assert_allclose(ours, expected, rtol=2e-5, atol=2e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    x = inputs(8, B, T, D)
    gqa_cfg = config("separate", K, rope=True)
    gqa = init_params(gqa_cfg, x)
    mha = dict(gqa, w_k=jnp.repeat(gqa["w_k"], N // K, axis=1), w_v=jnp.repeat(gqa["w_v"], N // K, axis=1))
    ours = Attention(gqa_cfg).apply({"params": gqa}, x, causal=True)
    expected = Attention(config("separate", rope=True)).apply({"params": mha}, x, causal=True)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    # K = N spelled out is multi-head attention itself.
    same = Attention(config("separate", N, rope=True)).apply({"params": mha}, x, causal=True)
    np.testing.assert_array_equal(same, expected)


@pytest.mark.parametrize("scheme", PLAIN_PARTITIONS)
def test_shared_kernel_gradient_is_sum_of_role_gradients(scheme):
    cfg = config(scheme, use_bias=True)
    x = inputs(9, B, T, D)
    params = init_params(cfg, x)
    target = inputs(10, B, T, D)

    def loss(p, c):
        return jnp.sum((Attention(c).apply({"params": p}, x, causal=True) - target) ** 2)

    g_tied = jax.jit(jax.grad(lambda p: loss(p, cfg)))(params)
    separate = config("separate", use_bias=True)
    g_sep = jax.jit(jax.grad(lambda p: loss(p, separate)))(untie(params, scheme))
    for group in SCHEMES[scheme].groups:
        for p in ("w_", "b_"):
            expected = sum(g_sep[p + role] for role in group)
            np.testing.assert_allclose(g_tied[p + group], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme,kv", VALID)
def test_causality(scheme, kv):
    cfg = config(scheme, kv, rope=valid(scheme, kv, rope=True))
    x = inputs(11, B, T, D)
    params = init_params(cfg, x)
    x2 = x.at[:, 3].add(inputs(12, B, D))
    y1 = Attention(cfg).apply({"params": params}, x, causal=True)
    y2 = Attention(cfg).apply({"params": params}, x2, causal=True)
    np.testing.assert_array_equal(y1[:, :3], y2[:, :3])
    assert not np.allclose(y1[:, 3:], y2[:, 3:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reformer_attends_to_itself_only_when_nothing_else_is_allowed(dtype):
    reformer = [s for s, sc in SCHEMES.items() if sc.mask_self]
    assert reformer, "the registry lost Reformer's scheme"
    cfg = config(reformer[0], dtype=dtype)
    x = inputs(13, B, T, D)
    params = init_params(cfg, x)
    y, state = Attention(cfg).apply({"params": params}, x, causal=True, mutable=["intermediates"])
    (w,) = state["intermediates"]["attention_weights"]  # (B, K, T * G, S), here K = N and G = 1
    w = np.asarray(w, np.float32)
    assert np.isfinite(np.asarray(y, np.float32)).all()
    diag = np.diagonal(np.asarray(w), axis1=-2, axis2=-1)
    np.testing.assert_array_equal(diag[..., 0], 1.0)  # position 0 has no other target
    np.testing.assert_array_equal(diag[..., 1:], 0.0)  # everyone else never looks at itself
    np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)


# Decoding: every scheme, with and without GQA and rotary, one token per call and in chunks.
DECODE_CASES = [(s, kv, rope) for s, kv in VALID for rope in (False, True) if valid(s, kv, rope=rope)]


@pytest.mark.parametrize("scheme,kv,rope", DECODE_CASES)
def test_decode_matches_full_causal_forward(scheme, kv, rope):
    cfg = config(scheme, kv, rope=rope, use_bias=True)
    x = inputs(14, B, T, D)
    model = Attention(cfg)
    params = init_params(cfg, x)
    full = model.apply({"params": params}, x, causal=True)
    cache = model.init(jax.random.key(0), x, decode=True)["cache"]
    # The cache holds one tensor per group that makes keys or values (plus x for a bilinear key side).
    scheme_data = SCHEMES[scheme]
    expected_slots = {f"cached_{g}" for g in scheme_data.kv_groups} | ({"cached_x"} if scheme_data.bilinear else set())
    assert set(cache) == expected_slots | {"cache_index"}
    steps = []
    for start, stop in ((0, 2), (2, 3), (3, 4), (4, 5)):  # a 2-token prompt, then one token at a time
        y, mutated = model.apply({"params": params, "cache": cache}, x[:, start:stop], decode=True, mutable=["cache"])
        cache = mutated["cache"]
        steps.append(y)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, rtol=2e-5, atol=2e-5)
    assert int(cache["cache_index"]) == T


def test_decode_under_jit_compiles_once_for_all_steps():
    cfg = config("shared_kv", K, rope=True)
    x = inputs(15, B, T, D)
    model = Attention(cfg)
    params = init_params(cfg, x)
    cache = model.init(jax.random.key(0), x, decode=True)["cache"]
    traces = []

    @jax.jit
    def step(cache, tok):
        traces.append(None)
        return model.apply({"params": params, "cache": cache}, tok, decode=True, mutable=["cache"])

    ys = []
    for i in range(T):
        y, mutated = step(cache, x[:, i : i + 1])
        cache = mutated["cache"]
        ys.append(y)
    assert len(traces) == 1
    np.testing.assert_allclose(
        jnp.concatenate(ys, 1), model.apply({"params": params}, x, causal=True), rtol=2e-5, atol=2e-5
    )


@pytest.mark.parametrize("scheme,kv", VALID)
def test_parameter_count_matches_accounting(scheme, kv):
    for use_bias, relative_bias in ((False, 0), (True, 0), (False, 3)):
        cfg = config(scheme, kv, use_bias=use_bias, relative_bias=relative_bias)
        params = init_params(cfg, inputs(16, B, T, D))
        assert sum(p.size for p in jax.tree.leaves(params)) == attention_cost(cfg, D, T).params


@pytest.mark.parametrize("scheme,kv", VALID)
def test_relative_bias_matches_reference_in_self_cross_and_decode(scheme, kv):
    cfg = config(scheme, kv, relative_bias=3)  # R = 3 < T - 1: offsets are clipped too
    x, y = inputs(30, B, T, D), inputs(31, B, S, D)
    params = init_params(cfg, x)
    assert params["rel_bias"].shape == (N, 7)
    np.testing.assert_allclose(
        Attention(cfg).apply({"params": params}, x, causal=True), reference(params, cfg, x, causal=True),
        rtol=1e-4, atol=1e-4,
    )  # fmt: skip
    np.testing.assert_allclose(
        Attention(cfg).apply({"params": params}, x, y), reference(params, cfg, x, y), rtol=1e-4, atol=1e-4
    )
    model = Attention(cfg)
    cache = model.init(jax.random.key(0), x, decode=True)["cache"]
    steps = []
    for i in range(T):
        out, mutated = model.apply({"params": params, "cache": cache}, x[:, i : i + 1], decode=True, mutable=["cache"])
        cache = mutated["cache"]
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), reference(params, cfg, x, causal=True), rtol=1e-4, atol=1e-4)


def test_kv_cache_accounting_matches_the_real_cache():
    for scheme, kv in VALID:
        cfg = config(scheme, kv)
        x = inputs(17, B, T, D)
        cache = Attention(cfg).init(jax.random.key(0), x, decode=True)["cache"]
        nbytes = sum(v.nbytes for name, v in cache.items() if name != "cache_index")
        assert nbytes == attention_cost(cfg, D, T).kv_cache_bytes_per_token * B * T, scheme


def test_accounting_ratios_follow_the_partition():
    sep = attention_cost(config("separate"), D, T)
    kv = attention_cost(config("shared_kv"), D, T)
    qkv = attention_cost(config("shared_qkv"), D, T)
    mqa = attention_cost(config("separate", 1), D, T)
    assert kv.kv_cache_bytes_per_token * 2 == sep.kv_cache_bytes_per_token
    assert qkv.kv_cache_bytes_per_token * 2 == sep.kv_cache_bytes_per_token
    assert mqa.kv_cache_bytes_per_token * N == sep.kv_cache_bytes_per_token
    assert qkv.projection_flops * 3 == sep.projection_flops


def test_dropout_needs_rng_and_is_off_when_deterministic():
    cfg = config("shared_kv", dropout_rate=0.5)
    x = inputs(18, B, T, D)
    params = init_params(cfg, x)
    model = Attention(cfg)
    base = Attention(config("shared_kv")).apply({"params": params}, x, causal=True)
    np.testing.assert_array_equal(model.apply({"params": params}, x, causal=True), base)
    noisy = model.apply({"params": params}, x, causal=True, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert not np.allclose(noisy, base)


def test_nnx_bridge_wraps_the_module():
    from flax import nnx

    cfg = config("shared_kv", K, rope=True)
    x = inputs(19, B, T, D)
    # The kernels carry logical axis names; without a mesh in context NNX must not try to shard them eagerly.
    with nnx.use_eager_sharding(False):
        model = nnx.bridge.ToNNX(Attention(cfg), rngs=nnx.Rngs(0))
        nnx.bridge.lazy_init(model, x, causal=True)
    y = model(x, causal=True)
    params = {"params": {name: getattr(model, name)[...] for name in ("w_q", "w_kv", "w_o")}}
    assert y.shape == (B, T, D)
    assert model.w_kv[...].shape == (D, K, H)
    np.testing.assert_allclose(y, Attention(cfg).apply(params, x, causal=True), rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Invalid input: ValueError naming the bad value and what is allowed, before anything compiles.


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_heads=0, head_dim=H), r"num_heads=0.*integer >= 1"),
        (dict(num_heads=N, head_dim=-1), r"head_dim=-1"),
        (dict(num_heads=N, head_dim=H, num_kv_heads=4), r"num_kv_heads=4 does not divide num_heads=6.*\[1, 2, 3, 6\]"),
        (dict(num_heads=N, head_dim=H, scheme="qk_shared"), r"scheme='qk_shared'.*allowed.*separate"),
        (dict(num_heads=N, head_dim=H, scheme="shared_qk", num_kv_heads=K), r"w_qk.*num_kv_heads == num_heads"),
        (dict(num_heads=N, head_dim=H, scheme="shared_qv", num_kv_heads=1), r"w_qv.*values.*num_kv_heads"),
        (dict(num_heads=N, head_dim=H, scheme="shared_qkv", num_kv_heads=K), r"w_qkv"),
        (dict(num_heads=N, head_dim=H, scheme="reformer_qk", num_kv_heads=1), r"reformer_qk"),
        (dict(num_heads=N, head_dim=H, scheme="bilinear", rope=True), r"bilinear.*rope=True is not allowed"),
        (dict(num_heads=N, head_dim=5, rope=True), r"even head_dim; got head_dim=5"),
        (dict(num_heads=N, head_dim=H, dropout_rate=1.0), r"dropout_rate=1.0"),
        (dict(num_heads=N, head_dim=H, dtype="int8"), r"dtype='int8'.*float32"),
        (dict(num_heads=N, head_dim=H, implementation="flash"), r"implementation='flash'.*cudnn"),
        (dict(num_heads=N, head_dim=H, causal_block=-1), r"causal_block=-1; allowed: 0 \(off\) or an integer >= 1"),
    ],
)
def test_invalid_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttentionConfig(**kwargs)


ADDITIVE = np.where(np.eye(T, dtype=bool), 0.0, -np.inf)[None, None]  # a concrete additive mask, as transformers makes


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda m, x: m.init(jax.random.key(0), x[0]), r"must be \(B, T, D\)"),
        (lambda m, x: m.init(jax.random.key(0), x, jnp.ones((B, S, D + 1))), r"share batch and model width"),
        (lambda m, x: m.init(jax.random.key(0), x, mask=jnp.ones((B, T, T), bool)), r"broadcastable to"),
        (lambda m, x: m.init(jax.random.key(0), x, mask=jnp.ones((B, 4, T, T), bool)), r"broadcastable to"),
        (lambda m, x: m.init(jax.random.key(0), x, jnp.ones((B, S, D)), decode=True), r"self-attention only"),
        (lambda m, x: m.init(jax.random.key(0), x, positions=jnp.zeros((B, T + 1), jnp.int32)), r"positions"),
        (lambda m, x: m.init(jax.random.key(0), x[:, :0]), rf"T >= 1 queries and S >= 1 keys; got inputs_q \({B}, 0"),
        (lambda m, x: m.init(jax.random.key(0), x, mask=ADDITIVE), r"mask holds negative values"),
        (lambda m, x: m.init(jax.random.key(0), x, x[:, :0]), rf"S >= 1 keys; got .* inputs_kv \({B}, 0, {D}\)"),
        # switches that were read as Python truth (causal='no' was causal, deterministic='no' dropped nothing) and
        # K/V of the wrong kind (an AttributeError from inside), found by giving each argument odd values
        (lambda m, x: m.init(jax.random.key(0), x, causal="no"), r"^causal='no'; allowed: True or False"),
        (lambda m, x: m.init(jax.random.key(0), x, causal=2), r"^causal=2; allowed: True or False"),
        (lambda m, x: m.init(jax.random.key(0), x, deterministic="no"), r"^deterministic='no'; allowed: True or F"),
        (lambda m, x: m.init(jax.random.key(0), x, return_kv=1), r"^return_kv=1; allowed: True or False"),
        (lambda m, x: m.init(jax.random.key(0), x, causal=x[0, 0, 0] > 0), r"^causal is a traced value; allowed: True"),
        (lambda m, x: m.init(jax.random.key(0), x, kv=(x, x)), r"^kv= is of type tuple; allowed: a qkvjax KV"),
        (lambda m, x: m.init(jax.random.key(0), x, cache={}), r"^cache= is of type dict; allowed: a qkvjax KV"),
        (lambda m, x: m.init(jax.random.key(0), "x"), r"^inputs_q is a str; allowed: an array, or nested lists of"),
    ],
)
def test_invalid_input_raises_before_compiling(call, match):
    model = Attention(config("separate"))
    x = jnp.ones((B, T, D))
    with pytest.raises(ValueError, match=match):
        jax.jit(lambda x: call(model, x))(x)  # the error comes from tracing, so nothing was compiled


def test_kv_of_another_layout_is_refused_naming_both():
    """kv= from a layer with more K/V heads was read as this layer's (a GQA layer of K=2 attended over 6 heads,
    silently); another batch was einsum's "Size of label 'B'" error. The layer's own K/V is taken."""
    from qkvjax.attention.cache import KV

    gqa, x = Attention(config("separate", K)), inputs(5, B, T, D)
    params = gqa.init(jax.random.key(0), x)
    _, own = gqa.apply(params, x, return_kv=True)
    np.testing.assert_allclose(gqa.apply(params, x, kv=own), gqa.apply(params, x), rtol=1e-6, atol=1e-6)
    full = Attention(config("separate"))
    _, six = full.apply(full.init(jax.random.key(1), x), x, return_kv=True)  # N = 6 K/V heads
    with pytest.raises(
        ValueError,
        match=r"^kv= holds \{'k': \(3, 5, 6, 4\), 'v': \(3, 5, 6, 4\)\} \(BSKH\); this layer "
        r"\(scheme 'separate', K=2\) reads \{'k': '\(B, S, 2, 4\)', 'v': '\(B, S, 2, 4\)'\} with B=3",
    ):
        gqa.apply(params, x, kv=six)
    with pytest.raises(ValueError, match=r"with B=2; allowed: the K/V of a layer with the same scheme"):
        gqa.apply(params, x[:2], kv=own)
    with pytest.raises(ValueError, match=r"^kv= holds \{'kv': .*reads \{'k': "):
        gqa.apply(params, x, kv=KV({"kv": own.tensors["k"]}))


def test_array_likes_and_concrete_booleans_are_taken_as_flax_layers_take_them():
    """Nested lists and numpy arrays as inputs, mask and positions; numpy and 0-d jax booleans as switches: the
    same output as jax arrays and Python booleans (lists were an AttributeError)."""
    cfg = config("separate", rope=True)
    model, x = Attention(cfg), inputs(3, B, T, D)
    params = model.init(jax.random.key(0), x)
    positions, mask = jnp.arange(T)[None].repeat(B, 0), jnp.tril(jnp.ones((T, T), bool))[None, None]
    want = model.apply(params, x, mask=mask, positions=positions)
    lists = {"mask": np.asarray(mask).tolist(), "positions": np.asarray(positions).tolist()}
    got = model.apply(params, np.asarray(x).tolist(), **lists, causal=np.bool_(False), deterministic=jnp.array(True))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("scheme,kv,vh", [("separate", K, 3), ("shared_qk", None, 9), ("bilinear", 1, 3)])
def test_value_heads_may_be_narrower_or_wider_than_query_heads(scheme, kv, vh):
    cfg = config(scheme, kv, v_head_dim=vh, rope=valid(scheme, kv, rope=True), use_bias=True)
    x = inputs(7, B, T, D)
    params = init_params(cfg, x)
    assert params["w_v"].shape == (D, cfg.kv_heads, vh) and params["w_o"].shape == (N, vh, D)
    assert sum(p.size for p in jax.tree.leaves(params)) == attention_cost(cfg, D, T).params
    full = Attention(cfg).apply({"params": params}, x, causal=True)
    np.testing.assert_allclose(full, reference(params, cfg, x, causal=True), rtol=2e-5, atol=2e-5)
    cache = Attention(cfg).init(jax.random.key(0), x, decode=True)["cache"]
    assert (
        sum(c.nbytes for c in jax.tree.leaves(cache) if c.ndim)
        == attention_cost(cfg, D, T).kv_cache_bytes_per_token * B * T
    )
    steps = []
    for i in range(T):
        y, mutated = Attention(cfg).apply(
            {"params": params, "cache": cache}, x[:, i : i + 1], decode=True, mutable=["cache"]
        )
        cache = mutated["cache"]
        steps.append(y)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("scheme", ["shared_kv", "shared_qv", "shared_qkv"])
def test_a_value_width_other_than_h_is_refused_where_values_share_a_projection(scheme):
    with pytest.raises(
        ValueError,
        match=rf"scheme '{scheme}' makes values with the projection .* must equal head_dim \({H}\); got v_head_dim=3",
    ):
        config(scheme, v_head_dim=3)
    assert config(scheme, v_head_dim=H).value_dim == H


@pytest.mark.parametrize(
    "scheme,kv,chunk,cross", [("separate", K, 2, False), ("shared_kv", 1, 3, True), ("shared_qkv", None, 7, False)]
)
def test_chunked_online_softmax_equals_the_dense_path_forward_and_backward(scheme, kv, chunk, cross):
    kw = {"rope": True, "use_bias": True} | ({"v_head_dim": 3} if scheme == "separate" else {})
    dense = config(scheme, kv, implementation="einsum", **kw)
    chunked = config(scheme, kv, implementation="chunked", chunk_size=chunk, **kw)
    xq, xkv = inputs(8, B, T, D), inputs(9, B, S, D) if cross else None
    mask = padding_mask() if cross else padding_mask()[:, :, :, :T]
    params = init_params(dense, xq, inputs_kv=xkv)
    rows = np.asarray(mask).any(-1)[:, 0]  # (B, T): a query with no allowed key is undefined in both paths
    assert rows.any() and not rows.all()

    def loss(cfg, params):
        y = Attention(cfg).apply({"params": params}, xq, xkv, mask=mask, causal=not cross)
        return jnp.sum(jnp.sin(y) * rows[:, :, None].astype(np.float32)), y

    (_, y1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(dense, p), has_aux=True))(params)
    (_, y2), g2 = jax.jit(jax.value_and_grad(lambda p: loss(chunked, p), has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(y2)[rows], np.asarray(y1)[rows], rtol=2e-5, atol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g2, g1)


@pytest.mark.parametrize("block", [1, 4, 6])
def test_causal_blocks_equal_the_masked_square_forward_and_backward(block):
    from qkvjax.attention import core

    t = 13  # blocks of one query, blocks that leave a shorter last one; G = 3 folded query rows
    q, k, v = inputs(20, B, t, N, H), inputs(21, B, t, K, H), inputs(22, B, t, K, 3)
    idx = jnp.arange(t)[None]

    def full(q, k, v):
        mask = core.grouped(core.causal_mask(idx, idx), K, N // K)
        return core.mix_values(core.softmax_weights(core.qk_logits(q, k), mask), v, t)

    def loss(fn, *args):
        return jnp.sum(jnp.sin(fn(*args)))

    blocked = jax.jit(lambda q, k, v: core.causal_attention(core.block_logits(q, k), v, block))
    np.testing.assert_allclose(blocked(q, k, v), full(q, k, v), rtol=2e-6, atol=2e-6)
    g_blocked = jax.jit(jax.grad(lambda *a: loss(blocked, *a), (0, 1, 2)))(q, k, v)
    g_full = jax.jit(jax.grad(lambda *a: loss(full, *a), (0, 1, 2)))(q, k, v)
    for a, b in zip(g_blocked, g_full, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "scheme,kv,extra",
    [
        ("separate", K, {"v_head_dim": 3, "rope": True}),
        ("shared_kv", 1, {"rope": True}),
        ("shared_qkv", None, {"relative_bias": 2}),
        ("reformer_qk", None, {}),
        ("bilinear", 1, {"relative_bias": 3}),
    ],
)
def test_causal_blocks_change_the_program_not_the_maths(scheme, kv, extra):
    full, blocked = config(scheme, kv, causal_block=0, **extra), config(scheme, kv, causal_block=2, **extra)
    x = inputs(23, B, T, D)
    params = init_params(full, x)  # every leaf random: a relative bias table too

    def loss(cfg, params):
        return jnp.sum(jnp.sin(Attention(cfg).apply({"params": params}, x, causal=True)))

    def dots(cfg):
        return str(jax.make_jaxpr(lambda p: loss(cfg, p))(params)).count("dot_general")

    assert dots(blocked) > dots(full)  # the blocked path was taken: two products per block, not two in all
    g_full = jax.jit(jax.grad(lambda p: loss(full, p)))(params)
    g_blocked = jax.jit(jax.grad(lambda p: loss(blocked, p)))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g_blocked, g_full)
    # analysis collects the (T, S) logits and weights: then the full square is computed, whatever the block
    _, inter = Attention(blocked).apply({"params": params}, x, causal=True, mutable=["intermediates"])
    assert inter["intermediates"]["attention_weights"][0].shape == (B, kv or N, T * (N // (kv or N)), T)


@pytest.mark.parametrize("implementation", ["einsum", "chunked"])
@pytest.mark.parametrize("shape", [(B, 1, 1, S), (B, N, 1, S), (1, 1, T, S), (B, N, T, S)])
def test_a_mask_broadcast_over_heads_or_queries_equals_the_full_mask_with_gqa(implementation, shape):
    # A padding mask (B, 1, 1, S) broadcast over the folded (T * G) rows used to fail with G > 1.
    rng = np.random.default_rng(27)
    mask = rng.random(shape) < 0.7
    mask[..., 0] = True  # every query keeps a key
    full = np.broadcast_to(mask, (B, N, T, S))
    cfg = config("separate", K, implementation=implementation, chunk_size=3)
    xq, xkv = inputs(28, B, T, D), inputs(29, B, S, D)
    params = init_params(cfg, xq, inputs_kv=xkv)
    y = Attention(cfg).apply({"params": params}, xq, xkv, mask=jnp.asarray(mask))
    np.testing.assert_allclose(y, Attention(cfg).apply({"params": params}, xq, xkv, mask=jnp.asarray(full)), atol=1e-6)


# Decoding reads the cache only as far as the longest row is filled (core.within_prefix). The branch is the same
# for every scheme; what differs is how a prefix of the cache is read, one case each: keys finished when written
# (separate: GQA, rotary), finished on read (K = V), shared Q/K with unit keys and the self mask (Reformer), the
# bilinear key side's inputs, and a relative bias (indexed by position).
PREFIX_CASES = [
    ("separate", 1, True),
    ("shared_kv", 1, True),
    ("reformer_qk", None, True),
    ("bilinear", 1, False),
    ("shared_qkv", None, False),
]
assert all(case in DECODE_CASES for case in PREFIX_CASES[:-1])


@pytest.mark.parametrize("scheme,kv,rope", PREFIX_CASES)
def test_decoding_reads_only_the_filled_prefix_and_rows_stay_exact(scheme, kv, rope):
    from qkvjax.attention import core
    from qkvjax.attention.costs import cache_shapes
    from qkvjax.attention.module import KV

    extra = {"relative_bias": 2} if (scheme, kv, rope) == ("shared_qkv", None, False) else {}
    on, off = (config(scheme, kv, rope=rope, use_bias=True, causal_block=c, **extra) for c in (2, 0))
    assert core.prefix_lengths(S, 2) == [2, 4, S]  # slots 0..1, 0..3 or all 7
    x = inputs(30, B, S, D)
    params = init_params(on, x)
    causal = jax.jit(lambda x: Attention(on).apply({"params": params}, x, causal=True))  # the full forward
    full = causal(x)

    def empty():
        return KV({n: jnp.zeros((B, *s)) for n, s in cache_shapes(on, D, S).items()}, jnp.zeros((B,), jnp.int32))

    @jax.jit
    def step(cache, tok, start):
        y, cache = Attention(on).apply({"params": params}, tok, cache=KV(cache.tensors, start))
        return y, cache

    # Every row alike, token by token: the filled slots cross from the 2-slot prefix to 4 and to 7.
    cache, ys = empty(), []
    for i in range(S):
        y, cache = step(cache, x[:, i : i + 1], jnp.full((B,), i, jnp.int32))
        ys.append(y)
    np.testing.assert_allclose(jnp.concatenate(ys, 1), full, rtol=2e-5, atol=2e-5)

    # Ragged rows: row b holds starts[b] tokens; the branch must follow the longest row (4 + 1 slots -> all 7),
    # and each row must equal the full forward of its own prefix followed by the new token.
    starts = jnp.array([1, 4, 0], jnp.int32)
    _, cache = step(empty(), x[:, :5], jnp.zeros((B,), jnp.int32))
    new = x[:, 6:7]
    y, _ = step(cache, new, starts)
    y_off, _ = jax.jit(lambda c: Attention(off).apply({"params": params}, new, cache=c))(KV(cache.tensors, starts))
    np.testing.assert_allclose(y, y_off, rtol=2e-6, atol=2e-6)  # the same softmax as the whole cache
    for b in range(B):
        n = int(starts[b])
        seq = jnp.concatenate([x[b : b + 1, :n], new[b : b + 1]], axis=1)
        want = causal(seq)[0, -1]
        np.testing.assert_allclose(y[b, 0], want, rtol=2e-5, atol=2e-5)

    # The program: one branch per prefix with blocks on, none without.
    def branches(cfg):
        text = str(jax.make_jaxpr(lambda c, t: Attention(cfg).apply({"params": params}, t, cache=c))(cache, new))
        return text.count("cond[")

    assert branches(on) == 1 and branches(off) == 0


def test_a_write_past_the_cache_is_refused_naming_the_index_and_length():
    from qkvjax.attention.costs import cache_shapes
    from qkvjax.attention.module import KV

    cfg = config("separate")
    x = inputs(31, B, S, D)
    params = init_params(cfg, x)
    empty = {n: jnp.zeros((B, *s)) for n, s in cache_shapes(cfg, D, S).items()}
    starts = jnp.array([0, S - 1, 2], jnp.int32)  # row 1 has one slot left; two new tokens overflow it
    call = lambda: Attention(cfg).apply({"params": params}, x[:, :2], cache=KV(empty, starts))  # noqa: E731
    with pytest.raises(ValueError, match=rf"2 more position\(s\) at cache index {S - 1} overflows the cache of {S} "):
        call()
    with pytest.raises(ValueError, match="overflows"):  # also when a traced function closes over the start
        jax.make_jaxpr(call)()
