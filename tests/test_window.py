"""Sliding-window attention (``AttentionConfig.sliding_window``): the ``window`` kernel equals full attention under
the window's mask for every scheme family, a windowed layer decodes token by token as its full forward, per-layer
windows come from a pattern, and bad windows are refused in one line.

Sizes are distinct so a swapped axis fails: B=2, T=11, D=15, N=3, H=4 (MLA: R=7), W=3, causal blocks of 2.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax import AttentionConfig, DecoderLM, ModelConfig
from qkvjax.attention import attention_module, core, kernels
from qkvjax.models.lm import DecodeCache

B, T, D, N, H, W = 2, 11, 15, 3, 4, 3


def config(scheme: str, **kw) -> AttentionConfig:
    extra = {"kv_rank": 7} if scheme == "mla" else {}
    rope = scheme not in ("bilinear",)
    return AttentionConfig(num_heads=N, head_dim=H, scheme=scheme, rope=rope, causal_block=2, **extra | kw)


@pytest.mark.parametrize("scheme", ["separate", "shared_kv", "shared_qk", "reformer_qk", "bilinear", "mla"])
def test_a_window_is_full_attention_under_the_window_mask(scheme, monkeypatch):
    windowed = config(scheme, sliding_window=W)
    module = attention_module(windowed)
    x = jax.random.normal(jax.random.PRNGKey(0), (B, T, D))
    params = module(windowed).init(jax.random.PRNGKey(1), x, causal=True)
    picked = []
    choose = kernels.choose
    monkeypatch.setattr(kernels, "choose", lambda a: picked.append(choose(a).name) or choose(a))
    got = module(windowed).apply(params, x, causal=True)
    assert picked == ["window"]  # reformer_qk's self-mask and bilinear scores included: any score function
    index = jnp.arange(T)[None]
    mask = core.window_mask(index, index, W)  # (1, 1, T, T), with causal=True: keys t - W + 1 .. t
    full = dataclasses.replace(windowed, sliding_window=None, causal_block=0)  # the whole square, masked
    want = module(full).apply(params, x, causal=True, mask=mask)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # and the window matters: without it the outputs differ
    assert not np.allclose(got, module(full).apply(params, x, causal=True), atol=1e-3)


def test_a_windowed_stack_decodes_token_by_token_as_its_full_forward():
    """Layers alternate a window of 3 and the whole context (a pattern); prompts of 5 and 2 tokens, then one
    token at a time: every position's logits equal the full forward's."""
    att = AttentionConfig(num_heads=N, head_dim=H, num_kv_heads=1, rope=True, causal_block=2)
    cfg = ModelConfig(
        attention=att, vocab_size=13, d_model=D, num_layers=2, max_len=2 * T, learned_positions=False,
        layers=f"[sliding_window={W}], []",
    )  # fmt: skip
    assert [layer.config.sliding_window for layer in cfg.layer_attention] == [W, None]
    model = DecoderLM(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 1, 13)
    params = jax.jit(model.init)(jax.random.PRNGKey(3), tokens)
    want = jax.jit(model.apply)(params, tokens)
    prompt = np.array([5, 2])
    prefill = jax.jit(lambda x, c, n: model.apply(params, x, cache=c, num_valid=n))
    one = jax.jit(lambda x, c: model.apply(params, x, cache=c))  # compiled once, every step the same shapes
    logits, cache = prefill(tokens[:, :5], DecodeCache.empty(cfg, B), jnp.asarray(prompt))
    got = [[logits[b, i] for i in range(prompt[b])] for b in range(B)]
    pos = prompt.copy()
    while pos.min() < T:
        step = jnp.asarray([tokens[b, min(pos[b], T - 1)] for b in range(B)])[:, None]
        logits, cache = one(step, cache)
        for b in range(B):
            if pos[b] < T:
                got[b].append(logits[b, 0])
        pos += 1
    np.testing.assert_allclose(np.stack([np.stack(g) for g in got]), want, rtol=1e-4, atol=1e-4)


def _decode_in_calls(model, params, cache, tokens, calls) -> np.ndarray:
    """Logits of every position of ``tokens`` (B, T) decoded with ``cache`` in calls of ragged lengths: each of
    ``calls`` gives the tokens per row for one call (right-padded to the longest, ``num_valid``), then one token
    at a time to the end."""
    step = jax.jit(lambda x, c, n: model.apply(params, x, cache=c, num_valid=n))
    t = tokens.shape[1]
    pos, got = np.zeros(len(tokens), int), [[] for _ in tokens]
    for valid in [*calls, *[None] * t]:
        valid = np.minimum(t - pos, 1) if valid is None else np.asarray(valid)
        if not valid.any():
            break
        width = int(valid.max())
        x = np.zeros((len(tokens), width), np.int32)
        for b, (p, n) in enumerate(zip(pos, valid, strict=True)):
            x[b, :n] = tokens[b, p : p + n]
        logits, cache = step(jnp.asarray(x), cache, jnp.asarray(valid, jnp.int32))
        for b, n in enumerate(valid):
            got[b] += list(np.asarray(logits[b, :n]))
        pos += valid
    return np.stack([np.stack(g) for g in got]), cache


@pytest.mark.parametrize(
    ("scheme", "layers", "rings"),
    [
        ("separate", f"[sliding_window={W}], []", (W, 0)),
        ("shared_kv", f"[sliding_window={W}], []", (W, 0)),  # K = V: raw in the ring, rotated by slot position
        ("shared_qk", f"[sliding_window={W}], []", (W, 0)),
        ("reformer_qk", f"[sliding_window={W}], []", (W, 0)),
        ("bilinear", f"[sliding_window={W}], []", (W, 0)),  # the ring holds the key side's inputs
        ("mla", f"[sliding_window={W}], []", (W, 0)),  # the latent and the shared rotary key, absorbed
        ("mla_per_head", f"[sliding_window={W}], []", (W, 0)),
        ("separate", f"[sliding_window={W}], [kv_from=-1, sliding_window=2], []", (W, 0)),  # a reader within W
        ("separate", f"[sliding_window={W}], [kv_from=-1], [sliding_window=2]", (0, 2)),  # a reader of it all
    ],
)
def test_a_windowed_layer_caches_a_ring_of_its_window_and_decodes_as_the_full_forward(scheme, layers, rings):
    """DecodeCache.empty gives a layer whose readers all have windows a ring of the widest (W slots, not
    max_len); prompts of 5 and 2 tokens, a ragged call of 3 and 4 more (longer than W: it reads the ring and its
    own tokens), then one token at a time past several turns of the ring: every position's logits equal the full
    forward's, and the ring's entry keeps W slots throughout."""
    extra = {"mla_per_head": {"rope_key_per_head": True}, "separate": {"num_kv_heads": 1}}.get(scheme, {})  # GQA
    att = config("mla" if scheme == "mla_per_head" else scheme, **extra)
    n_layers = len(layers.split("], ["))
    cfg = ModelConfig(
        attention=att, vocab_size=13, d_model=D, num_layers=n_layers, max_len=2 * T, learned_positions=False,
        layers=layers,
    )  # fmt: skip
    model = DecoderLM(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (B, T), 1, 13)
    params = jax.jit(model.init)(jax.random.PRNGKey(5), tokens)
    want = jax.jit(model.apply)(params, tokens)
    cache = DecodeCache.empty(cfg, B)
    assert cache.rings == rings
    slots = [max(x.shape[1:-1]) if x.ndim == 3 else x.shape[2] for x in (next(iter(e.values())) for e in cache.kv)]
    assert slots == [r or 2 * T for r in rings]
    got, cache = _decode_in_calls(model, params, cache, np.asarray(tokens), [[5, 2], [3, 4]])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert cache.rings == rings and [int(x) for x in cache.lengths] == [T, T]
    assert jax.tree.map(jnp.shape, cache.kv) == jax.tree.map(jnp.shape, DecodeCache.empty(cfg, B).kv)


def test_a_ring_saves_what_the_window_leaves_out():
    """A stack of windowed layers holds W slots per row whatever the context: the cache's bytes are W / max_len
    of a cache of every position, and a row decodes past max_len's worth of the ring's slots."""
    att = AttentionConfig(num_heads=N, head_dim=H, rope=True, sliding_window=W)
    cfg = ModelConfig(attention=att, vocab_size=13, d_model=D, num_layers=2, max_len=T, learned_positions=False)
    ring = DecodeCache.empty(cfg, B)
    every = DecodeCache.empty(dataclasses.replace(cfg, attention=dataclasses.replace(att, sliding_window=None)), B)
    assert ring.rings == (W, W) and every.rings == (0, 0) and ring.nbytes * T == every.nbytes * W


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_a_bad_window_is_refused_in_one_line(bad):
    message = rf"^AttentionConfig.sliding_window={bad!r}; allowed: None or an integer >= 1$"
    with pytest.raises(ValueError, match=message):
        AttentionConfig(num_heads=N, head_dim=H, sliding_window=bad)


@pytest.mark.parametrize("t, w", [(11, 3), (11, 11), (7, 20), (9, 1)])
def test_the_flop_count_sees_only_the_window(t, w):
    from qkvjax.attention.costs import attention_cost, causal_keys_seen

    windowed, full = config("separate", sliding_window=w), config("separate")
    seen = [min(i + 1, w) for i in range(t)]  # query i sees keys max(0, i - w + 1) .. i
    assert causal_keys_seen(windowed, t) == pytest.approx(np.mean(seen))
    assert causal_keys_seen(full, t) == pytest.approx((t + 1) / 2)
    per_key = attention_cost(full, D, t).score_flops / t
    assert attention_cost(windowed, D, t).score_flops == pytest.approx(per_key * min(t, w))
