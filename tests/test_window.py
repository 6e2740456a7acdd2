"""Sliding-window attention (``AttentionConfig.sliding_window``): the ``window`` kernel equals full attention under
the window's mask for every scheme family, windowed layers of every family decode from rings of their last W
tokens as their full forward computes, per-layer windows come from a pattern, and bad windows are refused in one
line.

Sizes are distinct so a swapped axis fails: B=2, T=11, D=15, N=3, H=4 (MLA: R=7), W=3, causal blocks of 2.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax import AttentionConfig, DecoderLM, ModelConfig
from qkvjax.attention import attention_module, core, kernels
from qkvjax.models.lm import DecodeCache, kv_cache_bytes_per_row

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


# every scheme family windowed in one stack (one compile): a GQA layer and a reader of its K/V with a narrower
# window (a ring of the wider), K = V (raw in the ring, rotated by slot position on read), QK-tied, Reformer's,
# bilinear (the ring holds the key side's inputs), MLA with a shared rotary key and with one per head (latent and
# rotary keys, read by the absorbed kernel), then a layer whose reader has no window (no ring) and a last window
ZOO = (
    f"[sliding_window={W}, kv=1], [kv_from=-1, sliding_window=2], shared_kv[sliding_window={W}], "
    f"shared_qk[sliding_window={W}], reformer_qk[sliding_window={W}], bilinear[sliding_window={W}, rope=false], "
    f"mla[sliding_window={W}, kv_rank=7], mla[sliding_window={W}, kv_rank=7, rope_key_per_head=true], "
    f"[sliding_window={W}], [kv_from=-1], [sliding_window=2]"
)


def test_windowed_layers_cache_rings_of_their_windows_and_decode_as_the_full_forward():
    """DecodeCache.empty gives a layer whose readers all have windows a ring of the widest (W slots, not
    max_len), and none to one read by a layer without a window; prompts of 4 and 2 tokens, a ragged call of 3 and 4
    more (longer than W: it reads the ring and its own tokens), then one token at a time past several turns of the
    ring: every position's logits equal the full forward's, and each entry keeps its slots throughout."""
    att = AttentionConfig(num_heads=N, head_dim=H, rope=True, causal_block=2)
    cfg = ModelConfig(attention=att, vocab_size=13, d_model=D, num_layers=11, max_len=2 * T, learned_positions=False,
                      layers=ZOO)  # fmt: skip
    model = DecoderLM(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (B, T), 1, 13)
    params = jax.jit(model.init)(jax.random.PRNGKey(5), tokens)
    want = jax.jit(model.apply)(params, tokens)
    cache = DecodeCache.empty(cfg, B)
    rings = (W,) * 7 + (0, 2)
    assert cache.rings == rings
    slots = [x.shape[1] if x.ndim == 3 else x.shape[2] for x in (next(iter(e.values())) for e in cache.kv)]
    assert slots == [r or 2 * T for r in rings]
    got, cache = _decode_in_calls(model, params, cache, np.asarray(tokens), [[4, 2], [3, 4]])
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
    per_token = 2 * N * H * 4  # K and V, float32, per layer
    assert kv_cache_bytes_per_row(cfg) == ring.nbytes // B == 2 * W * per_token  # what info reports, from shapes


@pytest.mark.parametrize("bad", [0, -2, 2.5, True])
def test_a_bad_window_is_refused_in_one_line(bad):
    message = rf"^AttentionConfig.sliding_window={bad!r}; allowed: None \(the whole context\) or an integer >= 1$"
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
