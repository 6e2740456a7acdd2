"""Features combined at random: a scheme, its K/V heads, rotary (either layout, partial), QK- and V-norm, a
relative bias, a learned temperature, a sliding window, causal blocks, a value width of its own, a latent's ranks
and rotary key, biases, cross-layer K/V and a family of norms and MLP, drawn together from a seeded generator.
Each drawn model keeps three invariants that hold whatever the combination:

1. the kernel the config picks, and the chunked one, give the logits of the plainest path (einsum, the full
   (T, S) square masked);
2. a prefill of p tokens then decoding one token at a time gives the full forward's logits;
3. a right-padded batch of prompts of other lengths (``num_valid``) gives each row's logits, and its next token's;
4. the NNX modules (:mod:`qkvjax.nnx`) given the same parameters give the same logits, whole and decoded.

The tests of each feature pin the combinations someone thought of; this one draws the others. Two seeds run in
CI; ``pytest -m slow tests/test_combinations.py`` runs 124 more (120 of them took 402 s on a 2-core VM, 2026-11-30:
all passed, as did 86 other draws of the first three invariants and 30 of the fourth tried while it was written)."""

from __future__ import annotations

import dataclasses
import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qkvjax.nnx
from qkvjax import SCHEMES, AttentionConfig
from qkvjax.models.family import Family
from qkvjax.models.lm import DecodeCache, DecoderLM, ModelConfig

B, T, V = 3, 11, 13
TOLERANCE = 1e-4  # float32 logits of order 1 through 2-3 layers; a wrong mask or position is off by 1e-2 or more
CI_SEEDS = range(2)  # about 11 s each on a 2-core VM; the other 124 are slow
SLOW_SEEDS = range(2, 126)


def draw_attention(r: random.Random) -> AttentionConfig:
    """One attention config with every option its scheme can take drawn at random."""
    scheme = SCHEMES[r.choice(sorted(SCHEMES))]
    n = r.choice([2, 4, 6])
    kw = {"num_heads": n, "scheme": scheme.name, "causal_block": r.choice([0, 2, 3, 64])}
    if not scheme.ties_query_to_kv:
        kw["num_kv_heads"] = r.choice([None] + [k for k in range(1, n + 1) if n % k == 0])
    kw["rope"] = rope = not scheme.bilinear and r.random() < 0.6
    kw["head_dim"] = r.choice([4, 6]) if rope and not scheme.latent else r.choice([3, 4, 5, 6])
    plain = not scheme.latent  # the options a latent scheme refuses
    if rope and plain and r.random() < 0.3:
        kw["rope_layout"] = "interleaved"
    if rope and plain and r.random() < 0.2:
        kw["rope_pairs"] = r.randint(0, kw["head_dim"] // 2)
    if plain and not scheme.bilinear and r.random() < 0.3:
        kw["qk_norm"] = True
    if plain and not scheme.bilinear and r.random() < 0.2:
        kw["learned_temperature"] = True
    if plain and r.random() < 0.2:
        kw["v_norm"] = True
    if plain and r.random() < 0.25:
        kw["relative_bias"] = r.choice([2, 3])
    if r.random() < 0.35:
        kw["sliding_window"] = r.choice([1, 2, 3, 5])
    if (scheme.group_of("v") == "v" or scheme.latent) and r.random() < 0.3:
        kw["v_head_dim"] = r.choice([3, 7])
    if scheme.latent:
        kw["kv_rank"] = r.choice([None, 5, 9])
        kw["latent_norm"] = r.random() < 0.5
        if r.random() < 0.3:
            kw["q_rank"] = r.choice([4, 7])
        if rope:
            kw["rope_head_dim"] = r.choice([2, 4])
            kw["rope_key_per_head"] = r.random() < 0.3
    kw["use_bias"] = r.random() < 0.2
    return AttentionConfig(**kw)


def draw_model(seed: int) -> ModelConfig:
    r = random.Random(seed)
    attention = draw_attention(r)
    layers = r.choice([2, 3])
    share = r.random() < 0.3  # layer 1 reads layer 0's keys and values (CLA), where the scheme can hand them on
    family = r.choice([Family(), Family(norm="rmsnorm", mlp="swiglu", norm_position=r.choice(["pre", "sandwich"]))])
    shape = {"vocab_size": V, "d_model": r.choice([8, 10, 12]), "num_layers": layers, "mlp_dim": 9, "max_len": T}
    model = ModelConfig(attention, **shape, learned_positions=not attention.rope, family=family)
    try:
        return dataclasses.replace(model, layers="[],[kv_from=-1]" + ",[]" * (layers - 2)) if share else model
    except ValueError:  # keys made by the query projection (shared QK, bilinear) are not handed on
        return model


def check_invariants(seed: int) -> None:
    cfg = draw_model(seed)
    r = random.Random(seed + 10_000)
    model = DecoderLM(cfg)
    tokens = jax.random.randint(jax.random.key(seed), (B, T), 0, V)
    params = jax.jit(model.init)(jax.random.key(seed + 1), tokens)["params"]

    def forward(attention: AttentionConfig) -> np.ndarray:
        other = DecoderLM(dataclasses.replace(cfg, attention=attention))
        return np.asarray(jax.jit(other.apply)({"params": params}, tokens))

    plain = forward(dataclasses.replace(cfg.attention, implementation="einsum", causal_block=0))
    np.testing.assert_allclose(forward(cfg.attention), plain, atol=TOLERANCE, err_msg=f"{cfg}: its own kernel")
    chunked = dataclasses.replace(cfg.attention, implementation="chunked", chunk_size=r.choice([2, 3, 4]))
    np.testing.assert_allclose(forward(chunked), plain, atol=TOLERANCE, err_msg=f"{cfg}: chunked")

    step = jax.jit(lambda p, x, c, n: model.apply({"params": p}, x, cache=c, num_valid=n))
    p = r.randint(1, T - 1)
    logits, cache = step(params, tokens[:, :p], DecodeCache.empty(cfg, B), None)
    decoded = [np.asarray(logits)]
    for i in range(p, T):
        logits, cache = step(params, tokens[:, i : i + 1], cache, None)
        decoded.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(decoded, 1), plain, atol=TOLERANCE, err_msg=f"{cfg}: decoding after {p}")

    lengths = np.array([r.randint(1, T - 3) for _ in range(B)], np.int32)
    padded = np.where(np.arange(T - 2) < lengths[:, None], np.asarray(tokens[:, : T - 2]), 0)
    logits, cache = step(params, jnp.asarray(padded), DecodeCache.empty(cfg, B), jnp.asarray(lengths))
    following = np.asarray(tokens)[np.arange(B), lengths][:, None]
    after, _ = step(params, jnp.asarray(following), cache, None)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(logits[b, :n], plain[b, :n], atol=TOLERANCE, err_msg=f"{cfg}: row {b} of {lengths}")
        np.testing.assert_allclose(after[b, 0], plain[b, n], atol=TOLERANCE, err_msg=f"{cfg}: after row {b}")

    native = qkvjax.nnx.DecoderLM(cfg, rngs=nnx.Rngs(0))
    qkvjax.nnx.load_params(native, nn.meta.unbox(params))
    np.testing.assert_allclose(native(tokens), plain, atol=TOLERANCE, err_msg=f"{cfg}: NNX")
    logits, cache = native(tokens[:, :p], cache=DecodeCache.empty(cfg, B))
    decoded = [np.asarray(logits)]
    for i in range(p, T):
        logits, cache = native(tokens[:, i : i + 1], cache=cache)
        decoded.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(decoded, 1), plain, atol=TOLERANCE, err_msg=f"{cfg}: NNX decoding")


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_drawn_combinations_keep_the_invariants(seed):
    check_invariants(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_more_drawn_combinations_keep_the_invariants(seed):
    check_invariants(seed)


def test_the_draws_reach_every_scheme_and_option():
    """The generator is not stuck in a corner: over the CI and slow seeds every scheme, and every option, is drawn."""
    drawn = [draw_model(seed) for seed in (*CI_SEEDS, *SLOW_SEEDS)]
    assert {m.attention.scheme for m in drawn} == set(SCHEMES)
    for name in ("rope", "qk_norm", "v_norm", "learned_temperature", "use_bias", "rope_key_per_head"):
        assert any(getattr(m.attention, name) for m in drawn), name
    for name in ("relative_bias", "sliding_window", "v_head_dim", "q_rank", "rope_pairs"):
        assert any(getattr(m.attention, name) for m in drawn), name
    assert any(m.layers for m in drawn) and any(m.family.norm_position == "sandwich" for m in drawn)
    assert any(m.attention.rope_layout == "interleaved" for m in drawn)
