"""The kernel table of stage 4 on its own (``qkvjax.attention.kernels``): which kernel each ``applies`` test picks,
each kernel against a float64 numpy reference on inputs it accepts, and the pipeline's shape annotations run as
checks (jaxtyping + beartype) in a fresh interpreter.

Sizes are distinct so a swapped axis fails: B=2, T=7, S=13 (a cache), N=6, K=3 (G=2), H=5, U=9 (value width),
E=11 (a bilinear key side), R=4 (latent), P=2 (rotary part), M=3 (relative-bias radius).
"""

import dataclasses
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax.attention import core, kernels
from qkvjax.attention.cache import CACHED, FRESH, prefix
from qkvjax.attention.config import resolve_implementation

B, T, S, N, K, H, U, E, R, P, M = 2, 7, 13, 6, 3, 5, 9, 11, 4, 2, 3
G = N // K
START = np.array([3, 6])  # a cache's rows: queries at start_b + t, slots 0..start_b + t visible


def rand(key, *shape):
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32)


# ---- building the inputs a module's stages would hand the kernels ------------------------------------------------


def build(
    *,
    q=None,
    k=None,
    v=None,
    layout=FRESH,
    start=None,
    mask=None,
    causal=True,
    bilinear=None,
    self_mask=False,
    rel_table=None,
    dropout=0.0,
    absorbed=None,
    window=0,
    implementation="einsum",
    chunk_size=3,
    causal_block=2,
    collecting=False,
):
    """Inputs over keys ``k`` and values ``v`` laid out as ``layout``; ``bilinear`` = (x_q, w_qk, x_kv) replaces
    q and k; ``start`` makes the slots a decode cache (queries at start_b + t)."""
    t = (q if bilinear is None else bilinear[0]).shape[1]
    length = v.shape[layout.index("S")]
    if start is None:
        index_q = jnp.arange(t)[None]
    else:
        index_q = jnp.asarray(start)[:, None] + jnp.arange(t)[None]
    index_k = jnp.arange(length)[None]
    if bilinear is None:
        queries = kernels.Queries(q, index_q, q.shape[-1])
        keys = k
    else:
        queries = kernels.Queries(None, index_q, H, x=bilinear[0], w_qk=bilinear[1])
        keys = bilinear[2]
    slots = kernels.Slots(
        lambda n: (prefix(keys, n, FRESH if keys.ndim == 3 else layout), prefix(v, n, layout)),
        layout, length, index_k, None if start is None else jnp.asarray(start), K, v.shape[-1], absorbed,
    )  # fmt: skip
    allowed = core.combine_masks(
        mask,
        core.causal_mask(index_q, index_k) if causal else None,
        core.window_mask(index_q, index_k, window) if window else None,
    )
    own = None
    if self_mask:
        own = core.grouped(index_k[:, None, None, :] == index_q[:, None, :, None], K, G)
    rng = jax.random.PRNGKey(9) if dropout else None
    rules = kernels.Rules(mask, causal, allowed, own, rel_table, dropout, rng, window)
    return kernels.Inputs(queries, slots, rules, kernels.How(implementation, chunk_size, causal_block, collecting))


def fresh_qkv(u=U):
    return rand(1, B, T, N, H), rand(2, B, T, K, H), rand(3, B, T, K, u)


def cached_qkv(t=2):
    k, v = rand(2, B, K, S, H), rand(3, B, K, S, U)  # BKSH
    return rand(1, B, t, N, H), k, v


def latent_cache(t=2):
    """An absorbed read: latents (B, S, R), a shared rotary key (B, S, P), up-projections; queries (B, t, N, H+P)."""
    ab = kernels.Absorbed(rand(4, B, S, R), rand(5, B, S, P), rand(6, R, K, H), rand(7, R, K, U))
    q = rand(1, B, t, N, H + P)
    k = jnp.concatenate(  # the same slots, up-projected: (B, S, K, H + P)
        [jnp.einsum("BSR,RKH->BSKH", ab.latent, ab.w_k_up), jnp.broadcast_to(ab.k_rope[:, :, None], (B, S, K, P))], -1
    )
    v = jnp.einsum("BSR,RKU->BSKU", ab.latent, ab.w_v_up)
    return q, k, v, ab


# ---- the float64 reference -----------------------------------------------------------------------------------------


def reference(a: kernels.Inputs, keys, v, layout):
    """softmax over allowed slots of the scores, values mixed: numpy, float64, head n reading kv head n // G."""
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    qs, r = a.queries, a.rules
    if layout == CACHED:
        keys = keys if keys.ndim == 3 else np.swapaxes(f64(keys), 1, 2)
        v = np.swapaxes(f64(v), 1, 2)
    v = np.repeat(f64(v), G, axis=2)  # BSKU -> BSNU
    if qs.q is None:
        qx = np.einsum("btd,nde->btne", f64(qs.x), f64(qs.w_qk))
        scores = np.einsum("btne,bse->bnts", qx, f64(keys)) / np.sqrt(qs.head_dim)
    else:
        keys = np.repeat(f64(keys), G, axis=2)
        scores = np.einsum("btnh,bsnh->bnts", f64(qs.q), keys) / np.sqrt(qs.q.shape[-1])
    t, s = scores.shape[2:]
    iq, ik = (
        np.broadcast_to(f64(qs.index)[:, :, None], (B, t, s)),
        np.broadcast_to(f64(a.slots.index)[:, None], (B, t, s)),
    )
    if r.rel_table is not None:
        offsets = (np.clip(ik - iq, -M, M) + M).astype(int)  # (B, T, S)
        scores = scores + f64(r.rel_table)[:, offsets].transpose(1, 0, 2, 3)
    if r.self_mask is not None:
        scores = np.where((iq == ik)[:, None], core.SELF_PENALTY, scores)
    allowed = np.ones(scores.shape, bool)
    if r.mask is not None:
        allowed &= np.broadcast_to(np.asarray(r.mask), scores.shape)
    if r.causal:
        allowed &= (ik <= iq)[:, None]
    if r.window:
        allowed &= (np.abs(iq - ik) < r.window)[:, None]
    scores = np.where(allowed, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnu->btnu", w, v)


def check(a, keys, v, layout, name, tol=2e-5):
    assert kernels.choose(a).name == name
    got = np.asarray(kernels.mix(a), np.float64)
    want = reference(a, keys, v, layout)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


# ---- each kernel, on inputs it accepts, against the reference -----------------------------------------------------


def test_absorbed_reads_a_latent_cache_as_its_up_projection():
    q, k, v, ab = latent_cache()
    a = build(q=q, k=k, v=v, start=START, absorbed=ab, causal_block=2)
    check(a, k, v, FRESH, "absorbed")
    check(dataclasses.replace(a, how=kernels.How("einsum", 3, 0)), k, v, FRESH, "absorbed")  # every slot read


def test_absorbed_with_a_rotary_key_per_kv_head():
    q, k, v, ab = latent_cache()
    per_head = rand(8, B, K, S, P)  # BKSP, as a cache holds one per KV head
    ab = dataclasses.replace(ab, k_rope=per_head)
    k = jnp.concatenate([k[..., :H], per_head.transpose(0, 2, 1, 3)], -1)
    check(build(q=q, k=k, v=v, start=START, absorbed=ab), k, v, FRESH, "absorbed")


@pytest.mark.parametrize("masked", [False, True])
def test_chunked(masked):
    q, k, v = fresh_qkv()
    mask = jax.random.bernoulli(jax.random.PRNGKey(4), 0.7, (B, 1, T, T)).at[..., 0].set(True) if masked else None
    check(build(q=q, k=k, v=v, mask=mask, implementation="chunked"), k, v, FRESH, "chunked")


@pytest.mark.parametrize("extra", ["plain", "bilinear", "self_mask", "rel_table"])
def test_blocks(extra):
    q, k, v = fresh_qkv()
    kw = {
        "plain": {},
        "bilinear": {"bilinear": (rand(4, B, T, E), rand(5, N, E, E) / E, rand(6, B, T, E))},
        "self_mask": {"self_mask": True},
        "rel_table": {"rel_table": rand(7, N, 2 * M + 1)},
    }[extra]
    a = build(q=q, k=k, v=v, **kw)
    keys = kw["bilinear"][2] if extra == "bilinear" else k
    check(a, keys, v, FRESH, "blocks")


@pytest.mark.parametrize("extra", ["plain", "bilinear", "rel_table"])
@pytest.mark.parametrize("window", [1, 3, 6])
def test_window(extra, window):
    q, k, v = fresh_qkv()
    kw = {
        "plain": {},
        "bilinear": {"bilinear": (rand(4, B, T, E), rand(5, N, E, E) / E, rand(6, B, T, E))},
        "rel_table": {"rel_table": rand(7, N, 2 * M + 1)},
    }[extra]
    a = build(q=q, k=k, v=v, window=window, **kw)
    check(a, kw["bilinear"][2] if extra == "bilinear" else k, v, FRESH, "window")


def test_a_window_reaches_every_kernel_that_reads_the_combined_mask():
    q, k, v = cached_qkv()
    check(build(q=q, k=k, v=v, layout=CACHED, start=START, window=3), k, v, CACHED, "prefix")
    q, k, v = fresh_qkv(u=H)
    check(build(q=q, k=k, v=v, window=3, implementation="xla"), k, v, FRESH, "xla")
    check(build(q=q, k=k, v=v, window=3, implementation="chunked"), k, v, FRESH, "einsum")
    check(build(q=q, k=k, v=v, window=3, causal=False), k, v, FRESH, "einsum")


def test_prefix_reads_only_the_filled_slots_of_a_cache():
    q, k, v = cached_qkv()
    a = build(q=q, k=k, v=v, layout=CACHED, start=START)
    check(a, k, v, CACHED, "prefix")
    # slots past every row's last query are never read: poison them, the answer stays
    poisoned = build(q=q, k=k.at[:, :, 8:].set(jnp.nan), v=v.at[:, :, 8:].set(jnp.nan), layout=CACHED, start=START)
    np.testing.assert_allclose(kernels.mix(poisoned), kernels.mix(a), rtol=1e-6)


@pytest.mark.parametrize("why", ["mask", "wider_values", "cache_collected", "dropout_free_cross"])
def test_einsum(why):
    q, k, v = fresh_qkv(u=H if why == "mask" else U)
    if why == "mask":
        mask = jax.random.bernoulli(jax.random.PRNGKey(4), 0.7, (B, N, T, T)).at[..., 0].set(True)
        check(build(q=q, k=k, v=v, mask=mask, implementation="xla"), k, v, FRESH, "xla")
        check(build(q=q, k=k, v=v, mask=mask, rel_table=rand(7, N, 2 * M + 1)), k, v, FRESH, "einsum")
    elif why == "wider_values":
        check(build(q=q, k=k, v=v, implementation="xla"), k, v, FRESH, "einsum")
    elif why == "cache_collected":
        q, k, v = cached_qkv()
        check(build(q=q, k=k, v=v, layout=CACHED, start=START, collecting=True), k, v, CACHED, "einsum")
    else:
        check(build(q=q, k=k, v=v, causal=False, implementation="einsum"), k, v, FRESH, "einsum")


def test_xla():
    q, k, v = fresh_qkv(u=H)
    check(build(q=q, k=k, v=v, implementation="xla"), k, v, FRESH, "xla")
    check(build(q=q, k=k, v=v, causal=False, implementation="xla"), k, v, FRESH, "xla")


def test_auto_takes_xlas_attention_where_jax_refuses_cudnn():
    """'auto' (a GPU's default) asks cuDNN's kernel first; this machine has no cuDNN, so jax refuses the call while
    tracing and XLA's attention runs: the same numbers as 'xla', causal, masked and in bfloat16 alike."""
    q, k, v = fresh_qkv(u=H)
    mask = jax.random.bernoulli(jax.random.PRNGKey(4), 0.7, (B, N, T, T)).at[..., 0].set(True)
    for kw in ({}, {"mask": mask, "causal": False}):
        auto = build(q=q, k=k, v=v, implementation="auto", **kw)
        check(auto, k, v, FRESH, "xla")
        xla = build(q=q, k=k, v=v, implementation="xla", **kw)
        np.testing.assert_array_equal(np.asarray(kernels.mix(auto)), np.asarray(kernels.mix(xla)))
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with pytest.raises(kernels.CUDNN_REFUSALS):  # what 'auto' catches: jax's refusal, here for want of cuDNN
        kernels.dot_product(*half, None, True, "cudnn")
    with jax.numpy_dtype_promotion("standard"):  # jax's own XLA attention promotes bf16 logits to float32
        auto = kernels.dot_product(*half, None, True, "auto")
        xla = kernels.dot_product(*half, None, True, "xla")
    assert auto.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(xla, np.float32))


@pytest.mark.parametrize(
    "configured, backend, resolved",
    [(None, "cpu", "einsum"), (None, "gpu", "auto"), (None, "tpu", "xla"), ("xla", "gpu", "xla"),
     ("cudnn", "gpu", "cudnn"), ("einsum", "tpu", "einsum"), ("chunked", "cpu", "chunked")],
)  # fmt: skip
def test_an_unset_implementation_resolves_per_backend(configured, backend, resolved):
    assert resolve_implementation(configured, backend) == resolved


def test_einsum_applies_alone_hands_out_the_weights():
    """The einsum kernel sows the (T, S) logits and weights; the weights rows sum to 1 over allowed slots."""
    q, k, v = fresh_qkv()
    got = {}
    a = build(q=q, k=k, v=v, collecting=True)
    a = dataclasses.replace(a, how=dataclasses.replace(a.how, sow=lambda name, value: got.setdefault(name, value)))
    assert kernels.choose(a).name == "einsum"
    kernels.mix(a)
    assert got["attention_weights"].shape == (B, K, T * G, T)
    np.testing.assert_allclose(got["attention_weights"].sum(-1), 1.0, rtol=1e-6)


# ---- each applies test: what it accepts and what it turns away --------------------------------------------------


def picks(**kw) -> str:
    q, k, v = kw.pop("qkv", None) or fresh_qkv()
    return kernels.choose(build(q=q, k=k, v=v, **kw)).name


def test_absorbed_applies_only_to_a_latent_cache():
    q, k, v, ab = latent_cache()
    assert picks(qkv=(q, k, v), start=START, absorbed=ab) == "absorbed"
    assert picks(qkv=(q, k, v), start=START, absorbed=ab, implementation="chunked") == "absorbed"
    assert picks(qkv=(q, k, v), start=START) == "prefix"  # the same slots without the latents: read up-projected


def test_chunked_applies_to_plain_fresh_scores_only():
    assert picks(implementation="chunked") == "chunked"
    assert picks(implementation="chunked", rel_table=rand(7, N, 2 * M + 1)) == "blocks"  # custom scores
    assert picks(implementation="chunked", dropout=0.25) == "einsum"
    assert picks(implementation="chunked", collecting=True) == "einsum"  # analysis needs the whole (T, S) rows
    assert picks(qkv=cached_qkv(), layout=CACHED, start=START, implementation="chunked") == "prefix"


def test_window_applies_where_blocks_would_with_a_window():
    assert picks(window=3) == "window"
    assert picks(window=3, causal_block=4) == "einsum"  # T = 7 < 2 blocks
    assert picks(window=3, mask=jnp.ones((1, 1, T, T), bool)) == "einsum"
    assert picks(window=3, collecting=True) == "einsum"
    assert picks(window=3, implementation="xla", qkv=fresh_qkv(u=H)) == "xla"  # the window goes as a mask


def test_blocks_applies_to_unmasked_causal_self_attention_of_two_blocks_or_more():
    assert picks() == "blocks"
    assert picks(causal_block=4) == "einsum"  # T = 7 < 2 blocks
    assert picks(causal_block=0) == "einsum"
    assert picks(causal=False) == "einsum"
    assert picks(mask=jnp.ones((1, 1, T, T), bool)) == "einsum"
    assert picks(collecting=True) == "einsum"
    assert picks(dropout=0.25) == "einsum"
    assert picks(implementation="xla", qkv=fresh_qkv(u=H)) == "xla"  # plain scores go to XLA's kernel instead


def test_prefix_applies_to_a_cache_read_in_blocks_without_dropout_or_collection():
    cache = dict(qkv=cached_qkv(), layout=CACHED, start=START)
    assert picks(**cache) == "prefix"
    assert picks(**cache, causal_block=0) == "einsum"
    assert picks(**cache, dropout=0.25) == "einsum"
    assert picks(**cache, collecting=True) == "einsum"


def test_einsum_and_xla_split_on_what_dot_product_attention_takes():
    assert picks(implementation="xla", qkv=fresh_qkv(u=H), causal=False) == "xla"
    assert picks(implementation="cudnn", qkv=fresh_qkv(u=H), causal=False) == "xla"
    assert picks(implementation="xla", causal=False) == "einsum"  # values wider than keys
    assert picks(implementation="xla", qkv=fresh_qkv(u=H - 2), causal=False) == "xla"  # narrower: padded
    for fused in ("xla", "cudnn", "auto"):  # no fused kernel hands out the weights analysis collects
        assert picks(implementation=fused, qkv=fresh_qkv(u=H), causal=False, collecting=True) == "einsum"
    assert picks(implementation="xla", qkv=fresh_qkv(u=H), causal=False, self_mask=True) == "einsum"
    assert picks(implementation="einsum", qkv=fresh_qkv(u=H), causal=False) == "einsum"


def test_every_kernel_is_reached():
    """No row of the table is dead: each one is the first to apply somewhere above."""
    q, k, v, ab = latent_cache()
    reached = {
        picks(qkv=(q, k, v), start=START, absorbed=ab),
        picks(implementation="chunked"),
        picks(window=3),
        picks(),
        picks(qkv=cached_qkv(), layout=CACHED, start=START),
        picks(causal=False),
        picks(implementation="xla", qkv=fresh_qkv(u=H)),
    }
    assert reached == {kernel.name for kernel in kernels.KERNELS}


# ---- the shape annotations, run as checks --------------------------------------------------------------------------

ANNOTATIONS = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from jaxtyping import install_import_hook
    with install_import_hook(["qkvjax.attention"], "beartype.beartype"):
        from qkvjax.attention import Attention, AttentionConfig, LatentAttention, kernels
        from qkvjax.models.lm import DecodeCache, DecoderLM, ModelConfig
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 7, 12))
    for cfg in [
        AttentionConfig(num_heads=6, head_dim=4, num_kv_heads=3, rope=True, qk_norm=True, causal_block=2),
        AttentionConfig(num_heads=6, head_dim=4, scheme="shared_kv", rope=True),
        AttentionConfig(num_heads=6, head_dim=4, scheme="bilinear", relative_bias=3),
        AttentionConfig(num_heads=6, head_dim=4, scheme="reformer_qk", implementation="chunked"),
        AttentionConfig(num_heads=6, head_dim=4, num_kv_heads=2, scheme="mla", rope=True, kv_rank=5),
    ]:
        module = (LatentAttention if cfg.tying.latent else Attention)(cfg)
        # the checks run as the functions are traced (on the tracers' shapes): traced, nothing compiled
        params = jax.eval_shape(lambda k, x: module.init(k, x, causal=True), jax.random.PRNGKey(1), x)
        jax.eval_shape(lambda p, x: module.apply(p, x, causal=True), params, x)
        jax.eval_shape(lambda p, x, y: module.apply(p, x, y, causal=False), params, x, x[:, :5])
    for scheme in ("shared_kv", "mla"):  # decoding: a cache, one token at a time
        att = AttentionConfig(num_heads=6, head_dim=4, num_kv_heads=3 if scheme == "shared_kv" else 2,
                              scheme=scheme, rope=True)
        model = DecoderLM(ModelConfig(attention=att, vocab_size=17, d_model=12, num_layers=2, max_len=16,
                                      learned_positions=False))
        tokens = jnp.ones((2, 5), jnp.int32)
        params = jax.eval_shape(model.init, jax.random.PRNGKey(2), tokens)
        step = lambda p, x, c: model.apply(p, x, cache=c)
        _, cache = jax.eval_shape(step, params, tokens, DecodeCache.empty(model.config, 2, 9))
        jax.eval_shape(step, params, tokens[:, :1], cache)
    from jaxtyping import TypeCheckError
    from qkvjax.attention.module import Positions
    try:  # the annotations are live: queries at 3 positions with mask indices for 4 are refused
        Positions(jnp.zeros((2, 3), int), jnp.zeros((1, 5), int), jnp.zeros((2, 4), int), jnp.zeros((1, 5), int))
    except TypeCheckError:
        print("refused: T bound to 3 and 4")
    else:
        raise SystemExit("mismatched positions passed the annotation check")
    print("annotations hold")
    """
)


def test_pipeline_shape_annotations_hold_when_checked():
    """Run the pipeline with its jaxtyping annotations enforced by beartype (fresh interpreter: the import hook must
    see the modules imported): every scheme family, cross-attention, a cache; and a wrong shape is refused."""
    pytest.importorskip("beartype", reason="beartype (the dev extra) runs the annotations as checks")
    out = subprocess.run([sys.executable, "-c", ANNOTATIONS], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "annotations hold" in out.stdout and "refused:" in out.stdout


def test_kv_stores_its_layout():
    from qkvjax.attention.cache import KV

    t = {"k": jnp.zeros((B, K, S, H))}
    assert KV.cached(t, jnp.zeros((B,), jnp.int32)).layout == CACHED
    assert KV.fresh(t).layout == FRESH and KV(t).layout == FRESH
    assert KV(t, jnp.zeros((B,), jnp.int32)).layout == CACHED  # the positional form: a start makes a cache
    # the layout is static data of the pytree: it survives jit and tree maps
    kv = jax.jit(lambda kv: kv)(KV.cached(t, jnp.zeros((B,), jnp.int32)))
    assert kv.layout == CACHED and jax.tree.map(lambda x: x, kv).layout == CACHED
    with pytest.raises(ValueError, match=r"KV.layout='BSHK'; allowed: 'BSKH' \(fresh\) or 'BKSH' \(cached\)"):
        KV(t, None, "BSHK")
