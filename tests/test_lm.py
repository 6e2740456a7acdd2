"""The decoder LM: parameter accounting, causal decoding through the whole stack, sharding rules on a mesh."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax import SCHEMES, AttentionConfig
from qkvjax.config import MeshConfig
from qkvjax.models.lm import DecodeCache, DecoderLM, ModelConfig, param_count
from qkvjax.train.mesh import make_mesh, shardings_for

B, T, D, V = 3, 7, 10, 11


def lm(scheme="separate", kv=None, rope=False, block=64, **kw):
    att = AttentionConfig(
        num_heads=2, head_dim=5 if not rope else 6, num_kv_heads=kv, scheme=scheme, rope=rope, causal_block=block
    )
    return ModelConfig(attention=att, vocab_size=V, d_model=D, num_layers=2, mlp_dim=13, max_len=T, **kw)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("tie", [True, False])
def test_param_count_matches_the_tree(scheme, tie):
    cfg = lm(scheme, tie_embeddings=tie, learned_positions=not tie)
    params = jax.eval_shape(DecoderLM(cfg).init, jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"]
    assert sum(p.size for p in jax.tree.leaves(nn.meta.unbox(params))) == param_count(cfg)


@pytest.mark.parametrize(
    "scheme,kv,rope",
    [("separate", 1, True), ("shared_kv", None, False), ("bilinear", 1, False), ("reformer_qk", None, True)],
)
def test_cached_decoding_matches_the_full_forward(scheme, kv, rope):
    cfg = lm(scheme, kv, rope, block=2, learned_positions=not rope)  # the full forward in causal blocks of 2
    model = DecoderLM(cfg)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    full = jax.jit(model.apply)({"params": params}, tokens)
    cache = DecodeCache.empty(cfg, B)
    step = jax.jit(lambda p, x, c: model.apply({"params": p}, x, cache=c))  # compiled once, T steps
    outs = []
    for i in range(T):
        logits, cache = step(params, tokens[:, i : i + 1], cache)
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [T] * B)


def test_causal_lm_ignores_future_tokens():
    cfg = lm("shared_qkv")
    model = DecoderLM(cfg)
    tokens = jax.random.randint(jax.random.key(2), (B, T), 0, V)
    params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
    forward = jax.jit(model.apply)  # one compile for both
    a = forward({"params": params}, tokens)
    b = forward({"params": params}, tokens.at[:, 4].set((tokens[:, 4] + 1) % V))
    np.testing.assert_array_equal(a[:, :4], b[:, :4])
    assert not np.allclose(a[:, 4:], b[:, 4:])


def test_too_long_input_is_refused():
    with pytest.raises(ValueError, match=r"sequence length 8 exceeds the model's max_len=7"):
        DecoderLM(lm()).init(jax.random.key(0), jnp.zeros((1, T + 1), jnp.int32))


def test_an_empty_cache_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^DecodeCache.empty: batch=0; allowed: an integer >= 1$"):
        DecodeCache.empty(lm(), 0)
    with pytest.raises(ValueError, match=r"^DecodeCache.empty: max_len=0; allowed"):
        DecodeCache.empty(lm(), B, max_len=0)


def test_ids_outside_the_vocabulary_or_positions_outside_the_context_give_nan_rows_and_lists_are_taken():
    """An id >= V was a NaN row (jnp.take fills past the end), so the loss says so and the train step drops the
    batch; a negative id wrapped to row V + id and trained on someone else's row, silently. Token lists are taken
    as arrays (they were an AttributeError); text is refused in one line. The NNX model alike."""
    import flax.nnx

    import qkvjax.nnx

    cfg = lm()
    model = DecoderLM(cfg)
    params = model.init(jax.random.key(0), jnp.zeros((1, T), jnp.int32))
    ids = [[1, 2, -1, 4], [1, 2, V, 4], [1, 2, 3, 4]]
    for logits in (model.apply(params, ids), qkvjax.nnx.DecoderLM(cfg, rngs=flax.nnx.Rngs(0))(ids)):
        finite = np.isfinite(np.asarray(logits)).all((1, 2))  # a NaN value times a masked-out weight is NaN
        np.testing.assert_array_equal(finite, [False, False, True])
    np.testing.assert_array_equal(model.apply(params, ids[2:]), model.apply(params, jnp.asarray(ids[2:])))
    assert cfg.learned_positions  # learned positions are rows of a table too: outside [0, max_len) NaN, not wrapped
    for positions, finite in (([[0, 1, 2, 3]], True), ([[0, 1, -1, 3]], False), ([[0, 1, T, 3]], False)):
        assert np.isfinite(model.apply(params, ids[2:], positions=jnp.asarray(positions))).all() == finite
    with pytest.raises(ValueError, match=r"^tokens given as a str; allowed: integer ids \(B, T\) \(encode text first"):
        model.apply(params, "ROMEO:")


def test_a_cache_larger_than_the_available_memory_is_refused_before_it_is_allocated(monkeypatch):
    """Its bytes are the product of its shapes, so they are known before anything is allocated: on a CPU a cache
    that cannot fit was a RESOURCE_EXHAUSTED traceback, or, where the allocation was granted, a process the
    operating system killed without a message once the zeros were written. It is checked against the memory still
    available, with decoding's working copy (round 4: a cache under the machine's total but over what was free
    passed, and the process grew to 1.7x the cache and was killed)."""
    from qkvjax import checks
    from qkvjax.models.lm import DECODE_MEMORY_FACTOR

    cfg = lm()
    row = DecodeCache.empty(cfg, 1).nbytes  # the K/V of one row
    assert 0 < checks.available_memory() <= checks.device_memory()
    rows = checks.available_memory() // (DECODE_MEMORY_FACTOR * row) + 1
    match = (
        rf"^a decode cache of {rows:,} rows x 7 positions needs .* GiB \({row:,} bytes a row\) and decoding about "
        rf"{DECODE_MEMORY_FACTOR}x that; the device has .* GiB available; allowed: fewer rows \(at most "
        rf"{rows - 1:,}\) or a shorter context$"
    )
    with pytest.raises(ValueError, match=match):
        DecodeCache.empty(cfg, rows)
    # what counts is what is free, not the total: 50 rows fit a machine's total, not 3 rows' worth of free memory
    monkeypatch.setattr(checks, "available_memory", lambda device=None: 3 * DECODE_MEMORY_FACTOR * row)
    DecodeCache.empty(cfg, 3)
    with pytest.raises(ValueError, match=r"allowed: fewer rows \(at most 3\)"):
        DecodeCache.empty(cfg, 50)


@pytest.mark.parametrize(
    "tokens,kw,match",
    [
        (jnp.zeros((B, 5)), {}, r"integer tokens of shape \(B, T\); got float32 \(3, 5\)"),
        (jnp.zeros((B, 5), jnp.int32), {"num_valid": 2}, r"num_valid= says .* goes with cache= only"),
        (jnp.zeros((B + 2, 1), jnp.int32), {"cache": B}, r"cache= holds 3 rows; tokens \(5, 1\) have B=5"),
        (jnp.zeros((B, 5), jnp.int32), {"cache": B, "num_valid": jnp.ones((2, B))}, r"num_valid has shape \(2, 3\)"),
        (jnp.zeros((B, 5), jnp.int32), {"cache": B, "num_valid": jnp.array([5, 6, 0])},
         r"num_valid=\[5, 6, 0\]; allowed: 0 <= num_valid <= T=5 per row"),
    ],
)  # fmt: skip
def test_bad_calls_are_refused_in_one_line_before_compiling(tokens, kw, match):
    cfg = lm()
    if "cache" in kw:
        kw = kw | {"cache": DecodeCache.empty(cfg, kw["cache"])}
    params = jax.eval_shape(DecoderLM(cfg).init, jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"]
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda p: DecoderLM(cfg).apply({"params": p}, tokens, **kw), params)  # traced, not compiled


def test_logical_axes_shard_heads_and_replicate_what_does_not_divide():
    cfg = ModelConfig(
        attention=AttentionConfig(num_heads=4, head_dim=3, num_kv_heads=1, scheme="shared_kv"),
        vocab_size=16,
        d_model=8,
        num_layers=1,
        max_len=5,
    )
    abstract = jax.eval_shape(DecoderLM(cfg).init, jax.random.key(0), jnp.zeros((1, 5), jnp.int32))["params"]
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    shard = nn.meta.unbox(shardings_for(abstract, mesh))
    att = shard["block_0"]["attention"]
    assert att["w_q"].spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    assert att["w_kv"].spec == jax.sharding.PartitionSpec("fsdp", None, None)  # one kv head: replicated on tensor
    assert shard["embed"].spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert shard["block_0"]["mlp"]["w_in"].spec == jax.sharding.PartitionSpec("fsdp", "tensor")


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_changes_memory_not_maths(remat):
    tokens = jax.random.randint(jax.random.key(4), (B, T), 0, V)
    # blocks of 3 causal queries (T = 7): the remat policies see the blocked attention's products too
    base, rematted = DecoderLM(lm("shared_kv", block=3)), DecoderLM(lm("shared_kv", block=3, remat=remat))
    params = jax.jit(base.init)(jax.random.key(0), tokens)["params"]

    def loss(model, p):
        return jnp.mean(model.apply({"params": p}, tokens) ** 2)

    g0 = jax.jit(jax.grad(lambda p: loss(base, p)))(params)  # jitted, as training runs remat
    g1 = jax.jit(jax.grad(lambda p: loss(rematted, p)))(params)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_decoding_on_a_mesh_equals_one_device_with_the_prefix_branches():
    """Params sharded by their logical axes on (data 2, fsdp 2, tensor 2), the cache's rows over data: each step's
    prefix branch (blocks of 2 over 7 slots) is picked by a max over sharded rows, and nothing changes."""
    cfg = ModelConfig(
        attention=AttentionConfig(num_heads=4, head_dim=3, num_kv_heads=2, scheme="shared_kv", causal_block=2),
        vocab_size=16,
        d_model=8,
        num_layers=2,
        max_len=T,
    )
    model, rows = DecoderLM(cfg), 4
    tokens = jax.random.randint(jax.random.key(5), (rows, T), 0, 16)
    boxed = jax.jit(model.init)(jax.random.key(6), tokens)["params"]
    params = nn.meta.unbox(boxed)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = jax.device_put(params, nn.meta.unbox(shardings_for(boxed, mesh)))
    by_row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    @jax.jit
    def step(p, cache, tok):
        return model.apply({"params": p}, tok, cache=cache)

    lengths = jnp.array([3, 1, 5, 2], jnp.int32)  # ragged rows: the branch follows the longest (5 + 1 -> 7 slots)
    plain = DecodeCache.empty(cfg, rows)
    prefill = jax.jit(lambda p, cache: model.apply({"params": p}, tokens[:, :5], cache=cache, num_valid=lengths))
    _, plain = prefill(params, plain)
    spread = jax.device_put(plain, by_row)
    assert len(spread.kv[0]["kv"].sharding.device_set) == 8
    want, _ = step(params, plain, tokens[:, 5:6])
    got, after = step(sharded, spread, jax.device_put(tokens[:, 5:6], by_row))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(after.lengths, lengths + 1)


def test_the_training_loss_is_the_float64_cross_entropy_of_the_model_logits():
    """The loss the train step minimises, against an independent float64 numpy cross-entropy of the model's own
    logits (log-sum-exp written out), for a batch of odd sizes."""
    from qkvjax.train.step import cross_entropy, make_eval_step

    cfg = lm()
    model = DecoderLM(cfg)
    tokens = jax.random.randint(jax.random.key(3), (B, T + 1), 0, V)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), inputs)["params"])
    logits = np.asarray(jax.jit(model.apply)({"params": params}, inputs), np.float64)  # (B, T, V)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    reference = (log_z - picked).mean()
    total, count = cross_entropy(jnp.asarray(logits, jnp.float32), targets)
    assert int(count) == B * T
    np.testing.assert_allclose(float(total) / int(count), reference, rtol=1e-6)
    batch = {"inputs": inputs, "targets": targets, "weights": jnp.ones(targets.shape, jnp.float32)}
    sums = make_eval_step(model)(params, batch)  # the evaluation's sums, from the model's float32 logits
    np.testing.assert_allclose(float(sums["nll_sum"]) / float(sums["tokens"]), reference, rtol=1e-5)


def test_training_learns_a_deterministic_sequence_below_the_bound_of_its_alphabet():
    """Bytes that step through a cycle of 5 symbols from a random offset: 120 steps of the real train step
    must take the loss from about ln V to well below ln 5, what knowing only the alphabet would give."""
    from qkvjax.config import Config, TrainConfig
    from qkvjax.train.state import create_state, make_optimizer
    from qkvjax.train.step import make_train_step

    cfg = lm()
    tc = TrainConfig(batch_size=B, num_steps=120, learning_rate=1e-2, warmup_steps=5, weight_decay=0.0)
    config = Config(model=cfg, train=tc)
    model, tx = DecoderLM(cfg), make_optimizer(tc)
    state = create_state(model, config, tx, None)
    step = jax.jit(make_train_step(model, tx))
    rng = np.random.default_rng(0)
    losses = []
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes a float with an int32 count
        for _ in range(tc.num_steps):
            offsets = rng.integers(0, 5, (B, 1))
            seq = ((offsets + np.arange(T + 1)[None]) % 5 + 3).astype(np.int32)  # symbols 3..7 of V = 11
            state, metrics = step(state, {"inputs": seq[:, :-1], "targets": seq[:, 1:]})
            losses.append(float(metrics["loss"]))
    assert losses[0] > np.log(5) + 0.5  # it starts near ln V = 2.4
    # Every target follows from the byte before it, so a model that learned the cycle scores 0, one that learned
    # only the alphabet ln 5 = 1.61: the last steps must sit below a quarter of that.
    assert np.mean(losses[-5:]) < np.log(5) / 4, (losses[0], losses[-5:])
