"""Multi-head Latent Attention (the ``mla`` scheme): a float64 reference, exact equivalence with separate/GQA,
absorbed decoding against the full forward, the SVD conversion, and the accounting.

Sizes are distinct so a swapped axis fails: B=3, T=5, S=7, D=11, N=6, K=2 (G=3), H=4, Hv=3, R=9, Rq=8, H_r=2.
"""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax import AttentionConfig, DecoderLM, ModelConfig, attention_cost
from qkvjax.analyze import layer_from_params
from qkvjax.attention import KV, Attention, LatentAttention, attention_module
from qkvjax.attention.costs import cost_table
from qkvjax.attention.schemes import SCHEMES
from qkvjax.convert import convert, latent_attention_params, latent_config, rotary_split
from qkvjax.models.lm import DecodeCache, kv_cache_bytes_per_token, param_count
from tests.test_attention import init_params, inputs, np_rotary, np_softmax, padding_mask

B, T, S, D, N, K, H, HV, R, RQ, HR = 3, 5, 7, 11, 6, 2, 4, 3, 9, 8, 2


def mla(kv=K, **kw):
    return AttentionConfig(num_heads=N, head_dim=H, num_kv_heads=kv, scheme="mla", **({"kv_rank": R} | kw))


FULL = dict(rope=True, rope_head_dim=HR, q_rank=RQ, v_head_dim=HV)  # every optional part on
PER_HEAD = dict(rope=True, rope_head_dim=HR, rope_key_per_head=True, v_head_dim=HV)  # MHA2MLA's rotary keys


def np_rms(x, scale):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * scale


def mla_reference(params, cfg, xq, xkv=None, causal=False, mask=None):
    """DeepSeek-V2's MLA in float64, written from the paper's equations (9)-(19)."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    xq = np.asarray(xq, np.float64)
    xkv = xq if xkv is None else np.asarray(xkv, np.float64)
    t, s, g = xq.shape[1], xkv.shape[1], cfg.group_size
    norm = cfg.latent_norm
    c_kv = xkv @ p["w_kv_down"]
    c_kv = np_rms(c_kv, p["kv_norm_scale"]) if norm else c_kv
    if cfg.q_rank:
        c_q = xq @ p["w_q_down"]
        c_q = np_rms(c_q, p["q_norm_scale"]) if norm else c_q
        q = np.einsum("btr,rnh->btnh", c_q, p["w_q_up"])
    else:
        q = np.einsum("btd,dnh->btnh", xq, p["w_q"])
    k = np.repeat(np.einsum("bsr,rkh->bskh", c_kv, p["w_k_up"]), g, axis=2)
    v = np.repeat(np.einsum("bsr,rkh->bskh", c_kv, p["w_v_up"]), g, axis=2)
    if cfg.rope_dim:
        pos_q, pos_k = np.broadcast_to(np.arange(t), xq.shape[:2]), np.broadcast_to(np.arange(s), xkv.shape[:2])
        q_in = c_q if cfg.q_rank else xq
        q_r = np_rotary(np.einsum("btr,rnh->btnh", q_in, p["w_q_rope_up" if cfg.q_rank else "w_q_rope"]), pos_q)
        if cfg.rope_key_per_head:  # a rotary key per KV head, read by its group's query heads
            k_r = np.repeat(np_rotary(np.einsum("bsd,dkh->bskh", xkv, p["w_k_rope"]), pos_k), g, axis=2)
        else:
            k_r = np_rotary((xkv @ p["w_k_rope"])[:, :, None], pos_k)  # one rotary key for all heads
        q = np.concatenate([q, q_r], -1)
        k = np.concatenate([k, np.broadcast_to(k_r, k.shape[:3] + (cfg.rope_dim,))], -1)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(cfg.head_dim + cfg.rope_dim)
    w = np_softmax(logits, causal, mask)
    return np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", w, v), p["w_o"])


@pytest.mark.parametrize(
    "kv,extra",
    [(None, {}), (K, FULL), (1, dict(rope=True, rope_head_dim=HR)), (K, dict(latent_norm=False)), (K, PER_HEAD)],
)
def test_matches_the_float64_reference(kv, extra):
    cfg = mla(kv, **extra)
    x, y = inputs(0, B, T, D), inputs(1, B, S, D)
    params = init_params(cfg, x, 2)
    model = Attention(cfg)  # the zoo's one module takes a latent scheme as any other
    np.testing.assert_allclose(
        model.apply({"params": params}, x, causal=True),
        mla_reference(params, cfg, x, causal=True),
        rtol=1e-4,
        atol=1e-4,
    )
    mask = padding_mask()
    np.testing.assert_allclose(
        model.apply({"params": params}, x, y, mask=mask),
        mla_reference(params, cfg, x, y, mask=mask),
        rtol=1e-4,
        atol=1e-4,
    )
    for how in (dict(implementation="chunked", chunk_size=3), dict(implementation="xla")):  # xla: values padded
        other = LatentAttention(dataclasses.replace(cfg, **how))  # when narrower than the rotary-widened keys
        np.testing.assert_allclose(
            other.apply({"params": params}, x, causal=True),
            mla_reference(params, cfg, x, causal=True),
            rtol=1e-4,
            atol=1e-4,
        )


@pytest.mark.parametrize("kv,hv", [(None, H), (K, H), (1, HV)])
def test_a_full_rank_latent_holding_wk_wv_is_separate_exactly(kv, hv):
    """R = K (H + Hv), w_kv_down = [W^K, W^V] and identity blocks as up-projections: separate / GQA / MQA."""
    sep = AttentionConfig(num_heads=N, head_dim=H, num_kv_heads=kv, v_head_dim=hv)
    x = inputs(3, B, T, D)
    p = init_params(sep, x, 4)
    k = sep.kv_heads
    rank = k * (H + hv)
    cfg = AttentionConfig(
        num_heads=N, head_dim=H, num_kv_heads=kv, v_head_dim=hv, scheme="mla", kv_rank=rank, latent_norm=False
    )
    eye = np.eye(rank, dtype=np.float32)
    latent = {
        "w_q": p["w_q"],
        "w_kv_down": jnp.concatenate([p["w_k"].reshape(D, k * H), p["w_v"].reshape(D, k * hv)], axis=1),
        "w_k_up": eye[:, : k * H].reshape(rank, k, H),
        "w_v_up": eye[:, k * H :].reshape(rank, k, hv),
        "w_o": p["w_o"],
    }
    want = Attention(sep).apply({"params": p}, x, causal=True)
    np.testing.assert_allclose(
        LatentAttention(cfg).apply({"params": latent}, x, causal=True), want, rtol=1e-5, atol=1e-5
    )
    # qkvjax analyze reads a latent layer's roles as the products of its factors: here W^Q, W^K, W^V themselves
    mine, theirs = layer_from_params(latent, cfg.tying), layer_from_params(p, sep.tying)
    for role in ("q", "k", "v"):
        np.testing.assert_allclose(getattr(mine, role), getattr(theirs, role), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block", [64, 2], ids=["whole_cache", "filled_prefix"])
@pytest.mark.parametrize("extra", [FULL, dict(latent_norm=False), PER_HEAD], ids=["full", "plain", "per_head"])
def test_absorbed_decoding_equals_the_full_forward_token_by_token(extra, block):
    """The cache holds (latent, rotary key) only; every step scores in the latent space. With blocks of 2 a step
    reads cache slots 0..1, 0..3 or all 5, as far as the rows are filled (``core.within_prefix``)."""
    cfg = mla(K, causal_block=block, **extra)
    x = inputs(5, B, T, D)
    params = init_params(cfg, x, 6)
    model = LatentAttention(cfg)
    full = model.apply({"params": params}, x, causal=True)
    names = {"latent": (B, T, R)} | ({"k_rope": (B, K, T, HR) if cfg.rope_key_per_head else (B, T, HR)}
                                     if cfg.rope_dim else {})  # fmt: skip
    cache = KV({n: jnp.zeros(s) for n, s in names.items()}, jnp.zeros((B,), jnp.int32))

    @jax.jit
    def step(cache, tok):
        y, cache = model.apply({"params": params}, tok, cache=cache)
        return y, KV(cache.tensors, cache.start + 1)

    ys = []
    for i in range(T):
        y, cache = step(cache, x[:, i : i + 1])
        ys.append(y)
    np.testing.assert_allclose(jnp.concatenate(ys, 1), full, rtol=2e-5, atol=2e-5)
    # the absorbed path never forms keys: nothing of shape (B, S', K or N, H) or (B, K or N, S', H) over the key
    # slots it may read (the whole cache, T, or a prefix of 2 or 4 slots); the query itself is (B, 1, N, H)
    text = jax.jit(lambda c, t: model.apply({"params": params}, t, cache=c)).lower(cache, x[:, :1]).as_text()
    slots, heads = f"(2|4|{T})", f"({K}|{N})"
    keys = re.findall(rf"tensor<{B}x{slots}x{heads}x{H}x|tensor<{B}x{heads}x{slots}x{H}x", text)
    assert not keys, keys
    assert f"tensor<{B}x1x{N}x{H}x" in text  # the pattern does see tensors of that rank in this program
    assert (text.count("stablehlo.case") == 1) == (block == 2)  # one branch per prefix, or the whole cache


def test_decoder_lm_decodes_ragged_prompts_against_the_full_forward():
    att = mla(K, **FULL)
    model_cfg = ModelConfig(
        att, vocab_size=13, d_model=D, num_layers=2, mlp_dim=7, max_len=T + 2, learned_positions=False
    )
    model = DecoderLM(model_cfg)
    tokens = jax.random.randint(jax.random.key(7), (B, T), 0, 13)
    params = jax.jit(model.init)(jax.random.key(8), tokens)["params"]
    assert sum(p.size for p in jax.tree.leaves(params)) == param_count(model_cfg)
    apply = jax.jit(lambda x: model.apply({"params": params}, x))
    full = apply(tokens)
    lengths = jnp.array([T, 2, 4])
    cache = DecodeCache.empty(model_cfg, B)
    assert cache.nbytes == kv_cache_bytes_per_token(model_cfg) * B * model_cfg.max_len
    assert kv_cache_bytes_per_token(model_cfg) == 2 * (R + HR) * 4  # two layers, float32: the latent and H_r
    cached = jax.jit(lambda x, c, n: model.apply({"params": params}, x, cache=c, num_valid=n))
    logits, cache = cached(tokens, cache, lengths)
    np.testing.assert_allclose(logits[0], full[0], rtol=1e-4, atol=1e-4)
    step_logits, _ = jax.jit(lambda x, c: model.apply({"params": params}, x, cache=c))(tokens[:, :1], cache)
    # row b's next token sits at position lengths[b]: equal to the full forward of that prefix, which is position
    # lengths[b] of any sequence that starts with it (the model is causal), so one forward holds all three
    prefixes = np.zeros((B, T + 1), np.int32)
    for b, n in enumerate(np.asarray(lengths)):
        prefixes[b, : n + 1] = np.r_[np.asarray(tokens[b, :n]), np.asarray(tokens[b, 0])]
    want = apply(jnp.asarray(prefixes))
    for b, n in enumerate(np.asarray(lengths)):
        np.testing.assert_allclose(step_logits[b, 0], want[b, n], rtol=1e-4, atol=1e-4)


def test_parameters_and_cache_match_the_accounting():
    for kv in (None, K, 1):
        for extra in ({}, FULL, dict(rope=True), dict(latent_norm=False, q_rank=RQ), PER_HEAD):
            cfg = mla(kv, **extra)
            params = init_params(cfg, inputs(9, B, T, D), 0)
            cost = attention_cost(cfg, D, T)
            assert sum(p.size for p in jax.tree.leaves(params)) == cost.params, (kv, extra)
            rotary_keys = (kv or N) if extra is PER_HEAD else 1
            assert cost.kv_cache_bytes_per_token == (R + rotary_keys * cfg.rope_dim) * 4
    default = mla(K, rope=True)
    assert default.latent_dim == R and default.rope_dim == H // 2
    assert AttentionConfig(num_heads=N, head_dim=H, scheme="mla").latent_dim == 4 * H  # DeepSeek-V2's d_c = 4 d_h


def test_parameters_carry_logical_axis_names():
    boxed = LatentAttention(mla(K, **FULL)).init(jax.random.key(0), inputs(0, B, T, D))["params"]
    for name, value in boxed.items():
        assert isinstance(value, nn.LogicallyPartitioned), name
        assert len(value.names) == value.value.ndim, name
    assert boxed["w_kv_down"].names == ("embed", "latent")
    assert boxed["w_k_up"].names == ("latent", "kv_heads", "head_dim")


def test_svd_conversion_is_exact_at_full_rank_and_reports_its_error():
    sep = AttentionConfig(num_heads=N, head_dim=H, num_kv_heads=K, v_head_dim=HV)
    x = inputs(10, B, T, D)
    p = init_params(sep, x, 11)
    stacked = np.concatenate([np.asarray(p["w_k"]).reshape(D, -1), np.asarray(p["w_v"]).reshape(D, -1)], axis=1)
    full = min(D, K * (H + HV))
    out, error = latent_attention_params(p, sep, full)
    assert error < 1e-6
    cfg = dataclasses.replace(sep, scheme="mla", kv_rank=full, latent_norm=False)
    np.testing.assert_allclose(
        LatentAttention(cfg).apply({"params": out}, x, causal=True),
        Attention(sep).apply({"params": p}, x, causal=True),
        rtol=1e-4,
        atol=1e-4,
    )
    for rank in (1, 4, full - 1):
        out, error = latent_attention_params(p, sep, rank)
        rebuilt = np.concatenate(
            [
                np.einsum("dr,rkh->dkh", out["w_kv_down"], out["w_k_up"]).reshape(D, -1),
                np.einsum("dr,rkh->dkh", out["w_kv_down"], out["w_v_up"]).reshape(D, -1),
            ],
            axis=1,
        )
        measured = np.linalg.norm(stacked - rebuilt) / np.linalg.norm(stacked)
        assert error > 1e-3 and abs(measured - error) < 1e-5, (rank, measured, error)
    # a model: every layer converted, the config says mla at that rank, the errors are reported per layer
    model_cfg = ModelConfig(sep, vocab_size=13, d_model=D, num_layers=2, mlp_dim=7, max_len=T)
    tokens = jax.random.randint(jax.random.key(12), (B, T), 0, 13)
    params = jax.jit(DecoderLM(model_cfg).init)(jax.random.key(13), tokens)["params"]
    errors: list = []
    new_cfg, new_params = convert(model_cfg, params, to="mla", rank=full, errors=errors)
    assert new_cfg.attention.scheme == "mla" and new_cfg.attention.kv_rank == full and len(errors) == 2
    np.testing.assert_allclose(
        jax.jit(DecoderLM(new_cfg).apply)({"params": new_params}, tokens),
        jax.jit(DecoderLM(model_cfg).apply)({"params": params}, tokens),
        rtol=1e-4,
        atol=1e-4,
    )


def test_each_layers_conversion_error_is_reported_under_its_own_layer_past_ten_layers():
    """Eleven layers: the errors come in layer order, each one the error of that block's own conversion (the
    blocks' names sorted as text put block_10 third, and the CLI printed block_10's error as layer 2's)."""
    sep = AttentionConfig(num_heads=N, head_dim=H, num_kv_heads=K, v_head_dim=HV)
    model_cfg = ModelConfig(sep, vocab_size=13, d_model=D, num_layers=11, mlp_dim=7, max_len=T)
    shapes = jax.eval_shape(DecoderLM(model_cfg).init, jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"]
    rng = np.random.default_rng(14)  # distinct random weights per layer, without compiling an init
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), nn.meta.unbox(shapes))
    errors: list = []
    convert(model_cfg, params, to="mla", rank=R - 4, errors=errors)
    assert [e.layer for e in errors] == list(range(11))
    for e in errors:
        assert e.error == latent_attention_params(params[f"block_{e.layer}"]["attention"], sep, R - 4)[1]
    assert len({e.error for e in errors}) == 11  # distinct: a mislabelled one would fail above


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: mla(kv_rank=0), r"kv_rank=0; allowed: None or an integer >= 1"),
        (lambda: mla(q_rank=-2), r"q_rank=-2; allowed"),
        (lambda: AttentionConfig(num_heads=N, head_dim=H, kv_rank=8), r"kv_rank=8 is for latent schemes \['mla'\]"),
        (lambda: mla(rope_head_dim=2), r"rope_head_dim=2 needs rope=True"),
        (lambda: mla(rope=True, rope_head_dim=3), r"decoupled rotary width .* must be even; got rope_head_dim=3"),
        (lambda: mla(qk_norm=True), r"does not take qk_norm=True"),
        (lambda: mla(latent_norm="yes"), r"latent_norm='yes'; allowed: True or False"),
        (
            lambda: mla(rope_key_per_head=True),
            r"rope_key_per_head=True is for .* \(allowed: a latent scheme with rope=True\)",
        ),
        (
            lambda: AttentionConfig(num_heads=N, head_dim=H, rope=True, rope_key_per_head=True),
            r"scheme 'separate' with rope=True has none",
        ),
        (lambda: mla(v_head_dim=0), r"v_head_dim=0; allowed"),
    ],
)
def test_bad_ranks_and_widths_are_refused_before_compile(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_svd_conversion_carries_biases_exactly_at_full_rank():
    """GPT-2 / Qwen2-style biases: b_q kept, b_k dropped (the softmax removes q . b_k), b_v W^O into b_o; the
    latent layer with a query and an output bias computes the biased separate layer's function, and decodes it."""
    sep = AttentionConfig(num_heads=N, head_dim=H, num_kv_heads=K, v_head_dim=HV, use_bias=True)
    x = inputs(14, B, T, D)
    p = init_params(sep, x, 15)
    rng = np.random.default_rng(16)  # biases start at zero: give every one a value that matters
    p = {k: (v + rng.normal(size=v.shape).astype(np.float32) if k.startswith("b_") else v) for k, v in p.items()}
    full = min(D, K * (H + HV))
    out, error = latent_attention_params(p, sep, full)
    assert error < 1e-6 and set(out) >= {"b_q", "b_o"} and "b_k" not in out and "b_v" not in out
    cfg = dataclasses.replace(sep, scheme="mla", kv_rank=full, latent_norm=False)
    reference = Attention(sep).apply({"params": p}, x, causal=True)
    np.testing.assert_allclose(LatentAttention(cfg).apply({"params": out}, x, causal=True), reference, rtol=1e-4,
                               atol=1e-4)  # fmt: skip
    assert attention_cost(cfg, D, T).params == sum(np.size(v) for v in out.values())
    model, ys = LatentAttention(cfg), []  # the absorbed decode path takes the query bias into the latent space too
    cache = KV({"latent": jnp.zeros((B, T, full))}, jnp.zeros((B,), jnp.int32))
    for i in range(T):
        y, cache = model.apply({"params": out}, x[:, i : i + 1], cache=cache)
        ys.append(y)
        cache = KV(cache.tensors, cache.start + 1)
    np.testing.assert_allclose(jnp.concatenate(ys, 1), reference, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"value biases without an output bias: a rank-R latent cannot carry it"):
        latent_attention_params(p, dataclasses.replace(sep, output_bias=False), 4)


def test_conversion_refuses_bad_ranks_and_models_it_cannot_carry():
    sep = AttentionConfig(num_heads=N, head_dim=H, num_kv_heads=K)
    p = init_params(sep, inputs(0, B, T, D))
    for rank in (0, min(D, 2 * K * H) + 1):
        with pytest.raises(ValueError, match=rf"rank={rank}; allowed: 1 <= rank <= min\(D, K \(H \+ Hv\)\) = 11"):
            latent_attention_params(p, sep, rank)
    with pytest.raises(ValueError, match=r"rope=True: a rank-R latent cannot carry rotated keys whole"):
        latent_attention_params(p, dataclasses.replace(sep, rope=True), 4)
    model_cfg = ModelConfig(sep, vocab_size=13, d_model=D, num_layers=1, mlp_dim=7, max_len=T)
    with pytest.raises(ValueError, match=r"rank=4 goes with a latent target scheme"):
        convert(model_cfg, {}, num_kv_heads=1, rank=4)


def test_one_module_takes_every_scheme_and_the_table_lists_mla():
    """``Attention`` runs a latent config (the old name ``LatentAttention`` is the same computation); decode=True
    and kv= are refused in one line for it, before anything is made."""
    x, cfg = inputs(0, B, T, D), mla(**FULL)
    assert attention_module(cfg) is Attention and issubclass(LatentAttention, Attention)
    params = init_params(cfg, x, 5)
    np.testing.assert_array_equal(
        Attention(cfg).apply({"params": params}, x, causal=True),
        LatentAttention(cfg).apply({"params": params}, x, causal=True),
    )
    refused = r"scheme 'mla' decodes with the functional cache only \(cache=, DecodeCache\) and reads no other layer"
    with pytest.raises(ValueError, match=refused):
        Attention(cfg).init(jax.random.key(0), x, decode=True)
    with pytest.raises(ValueError, match=refused):
        Attention(cfg).apply({"params": params}, x, kv=KV({"latent": jnp.zeros((B, T, R))}))
    table = cost_table(d_model=768, num_heads=12, seq_len=1024)
    row = next(line for line in table.splitlines() if line.startswith("mla ")).split()
    cost = attention_cost(AttentionConfig(num_heads=12, head_dim=64, scheme="mla", dtype="bfloat16"), 768, 1024)
    assert int(row[-2].replace(",", "")) == cost.kv_cache_bytes_per_token == 4 * 64 * 2  # R = 4 H, bfloat16
    assert int(row[2].replace(",", "")) == cost.params
    header, *rows = table.splitlines()[1:]  # every column lines up under its header, the longest names included
    ends = [header.index(name) + len(name) for name in ("params", "FLOPs/token")]
    assert max(map(len, SCHEMES)) > 12 and len(rows) == len(SCHEMES)
    for line in rows:
        assert all(line[end - 1].isdigit() and line[end] == " " for end in ends), line


def np_partial_rotary(x, pos, kept_pairs, interleaved, base=10000.0):
    """Rotary embedding of (B, T, N, H) in float64 with only the first ``kept_pairs`` frequency pairs rotated
    (pair i at base^(-i / (H/2)), as the original model had it); the other pairs left as they are."""
    h = x.shape[-1]
    freq = np.where(np.arange(h // 2) < kept_pairs, base ** (-np.arange(h // 2) / (h // 2)), 0.0)
    ang = pos[:, :, None, None] * freq
    cos, sin = np.cos(ang), np.sin(ang)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return out
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_a_rotary_model_converts_to_partial_rope_mla(layout):
    """MHA2MLA (Ji et al. 2025): at full rank the converted layer is the original with only its H_r / 2
    highest-frequency pairs still rotated, at their own frequencies (a float64 reference); the reported error is
    the one measured on the latent's factors; the decode cache holds the latent and a rotary key per KV head."""
    h, hr = 6, 4  # 3 pairs per head, 2 kept rotated: the kept and freed features interleave in both layouts
    rope = AttentionConfig(num_heads=N, head_dim=h, num_kv_heads=K, v_head_dim=HV, rope=True, rope_layout=layout)
    x = inputs(17, B, T, D)
    p = init_params(rope, x, 18)
    full = min(D, K * (h - hr + HV))
    out, error = latent_attention_params(p, rope, full, rope_dim=hr)
    cfg = latent_config(rope, full, hr)
    assert error < 1e-6 and (cfg.head_dim, cfg.rope_dim, cfg.value_dim, cfg.rope_key_per_head) == (2, hr, HV, True)
    w = {k: np.asarray(v, np.float64) for k, v in p.items()}
    pos = np.broadcast_to(np.arange(T), (B, T))
    xs = np.asarray(x, np.float64)
    q = np_partial_rotary(np.einsum("btd,dnh->btnh", xs, w["w_q"]), pos, hr // 2, layout == "interleaved")
    k = np_partial_rotary(np.einsum("btd,dkh->btkh", xs, w["w_k"]), pos, hr // 2, layout == "interleaved")
    v = np.einsum("btd,dkh->btkh", xs, w["w_v"])
    g = N // K
    weights = np_softmax(np.einsum("btnh,bsnh->bnts", q, np.repeat(k, g, 2)) / np.sqrt(h), causal=True)
    want = np.einsum("btnh,nhd->btd", np.einsum("bnts,bsnh->btnh", weights, np.repeat(v, g, 2)), w["w_o"])
    model = LatentAttention(cfg)
    np.testing.assert_allclose(model.apply({"params": out}, x, causal=True), want, rtol=1e-4, atol=1e-4)
    assert attention_cost(cfg, D, T).kv_cache_bytes_per_token == (full + K * hr) * 4
    # truncated: the reported error is |[W^K_freed, W^V] - down [up_k, up_v]| / |[W^K_freed, W^V]|
    kept, freed = rotary_split(h, hr, layout == "interleaved")
    assert sorted([*kept, *freed]) == list(range(h)) and len(kept) == hr
    stacked = np.concatenate([w["w_k"][..., freed].reshape(D, -1), w["w_v"].reshape(D, -1)], axis=1)
    for rank in (1, 3, full - 1):
        out, error = latent_attention_params(p, rope, rank, rope_dim=hr)
        rebuilt = [np.einsum("dr,rkh->dkh", out["w_kv_down"], out[f"w_{n}_up"]).reshape(D, -1) for n in "kv"]
        measured = np.linalg.norm(stacked - np.concatenate(rebuilt, axis=1)) / np.linalg.norm(stacked)
        assert error > 1e-3 and abs(measured - error) < 1e-5, (rank, measured, error)
    # a model: converted, it decodes from its (latent, per-head rotary key) cache as its full forward computes
    model_cfg = ModelConfig(rope, vocab_size=13, d_model=D, num_layers=2, mlp_dim=7, max_len=T, learned_positions=False)
    tokens = jax.random.randint(jax.random.key(19), (B, T), 0, 13)
    params = jax.jit(DecoderLM(model_cfg).init)(jax.random.key(20), tokens)["params"]
    new_cfg, new_params = convert(model_cfg, params, to="mla", rank=3, rope_dim=hr)
    lm = DecoderLM(new_cfg)
    cache = DecodeCache.empty(new_cfg, B)
    assert cache.nbytes == 2 * (3 + K * hr) * 4 * B * T
    apply = jax.jit(lambda tok, c: lm.apply({"params": new_params}, tok, cache=c))  # one compile per input length
    logits, cache = apply(tokens[:, :2], cache)
    steps = [logits]
    for i in range(2, T):
        logits, cache = apply(tokens[:, i : i + 1], cache)
        steps.append(logits)
    full_logits = jax.jit(lm.apply)({"params": new_params}, tokens)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full_logits, rtol=1e-4, atol=1e-4)
    for bad, match in ((None, r"rope=True: a rank-R latent cannot carry rotated keys whole; keep rope_dim"),
                       (3, r"rope_dim=3; allowed: an even number from 2 to H - 2 = 4"),
                       (6, r"rope_dim=6; allowed: an even number from 2 to H - 2 = 4")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            latent_attention_params(p, rope, 3, rope_dim=bad)
    with pytest.raises(ValueError, match=r"rope_dim=2 is for rotary models; this one has rope=False"):
        latent_attention_params(p, dataclasses.replace(rope, rope=False), 3, rope_dim=2)


def test_a_latent_norm_added_by_convert_has_the_latents_expected_rms_as_its_gains():
    """convert --latent-norm (DeepSeek-V2's form): each gain is the RMS the latent has when the layer's input is
    its input norm's output, gamma u + beta, on isotropic unit-RMS u (a Monte Carlo estimate in float64 within
    2%); a token whose latent has exactly that RMS is computed as without the norm; the norm needs a latent."""
    plain = AttentionConfig(num_heads=N, head_dim=H, num_kv_heads=K, v_head_dim=HV)
    x = inputs(23, B, T, D)
    p = init_params(plain, x, 24)
    rng = np.random.default_rng(25)
    gamma, beta = rng.uniform(0.3, 2.0, D), rng.normal(0, 0.5, D)
    out, _ = latent_attention_params(p, plain, 5, norm_input={"scale": gamma, "bias": beta})
    bare, _ = latent_attention_params(p, plain, 5)
    down = np.asarray(bare["w_kv_down"], np.float64)
    u = rng.standard_normal((200_000, D))
    expected = np.sqrt(np.mean(((gamma * u + beta) @ down) ** 2))
    gains = np.asarray(out["kv_norm_scale"], np.float64)
    assert gains.shape == (5,) and np.ptp(gains) == 0 and abs(gains[0] / expected - 1) < 0.02, (gains, expected)
    assert "kv_norm_scale" not in bare and latent_config(plain, 5, latent_norm=True).latent_norm
    # the input that gives its latent exactly that RMS: the normed layer computes what the bare one does
    cfg = latent_config(plain, 5, latent_norm=True)
    c = np.asarray(x, np.float64) @ down  # BTD,DR->BTR
    scaled = x * jnp.asarray(gains[0] / np.sqrt(np.mean(c**2, -1, keepdims=True)), x.dtype)  # each token's latent
    normed = LatentAttention(cfg).apply({"params": out}, scaled, causal=True)
    np.testing.assert_allclose(normed, LatentAttention(latent_config(plain, 5)).apply({"params": bare}, scaled,
                               causal=True), rtol=2e-4, atol=2e-5)  # fmt: skip
    model_cfg = ModelConfig(plain, vocab_size=13, d_model=D, num_layers=1, mlp_dim=7, max_len=T)
    params = jax.jit(DecoderLM(model_cfg).init)(jax.random.key(26), jnp.zeros((1, T), jnp.int32))["params"]
    with pytest.raises(ValueError, match=r"^latent_norm=True goes with --to mla --rank R"):
        convert(model_cfg, params, num_kv_heads=1, latent_norm=True)
