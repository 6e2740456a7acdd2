"""What a sampled token is drawn from (:class:`qkvjax.sample.Sampling`): temperature, top-k, the nucleus (top-p),
min-p and the vocabulary limit, against a float64 numpy reference, and the draws themselves."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax.sample import Sampling

B, V = 3, 13  # odd and distinct: a swapped axis fails


def reference_kept(logits: np.ndarray, temperature: float, top_k, top_p, limit=None, min_p=None) -> np.ndarray:
    """(B, V) bool: the ids each row may draw, in float64, token by token in rank order."""
    z = logits.astype(np.float64) / temperature
    kept = np.ones_like(z, bool)
    if limit is not None:
        kept &= np.arange(z.shape[-1]) < limit
    for b in range(z.shape[0]):
        if top_k is not None:
            kth = np.sort(z[b][kept[b]])[::-1][min(top_k, kept[b].sum()) - 1]
            kept[b] &= z[b] >= kth
        if top_p is not None:
            p = np.where(kept[b], np.exp(z[b] - z[b][kept[b]].max()), 0.0)
            p /= p.sum()
            mass = 0.0
            nucleus = np.zeros(z.shape[-1], bool)
            for i in np.argsort(-z[b], kind="stable"):
                if not kept[b, i]:
                    continue  # cut already: no mass
                if mass >= top_p:
                    break
                nucleus[i] = True
                mass += p[i]
            kept[b] &= nucleus
        if min_p is not None:  # probabilities over what is left, each against the likeliest's
            p = np.where(kept[b], np.exp(z[b] - z[b][kept[b]].max()), 0.0)
            p /= p.sum()
            kept[b] &= p >= min_p * p.max()
    return kept


@pytest.fixture
def logits():
    return np.random.default_rng(7).normal(0.0, 2.0, (B, V)).astype(np.float32)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,limit,min_p",
    [
        (1.0, None, None, None, None),
        (0.7, 5, None, None, None),
        (1.0, None, 0.5, None, None),
        (0.7, None, 0.9, None, None),
        (1.3, 5, 0.6, None, None),
        (1.0, None, 1e-6, None, None),  # only the largest
        (1.0, None, 1.0, None, None),  # no cut
        (1.0, None, 0.8, 9, None),
        (1.0, None, None, None, 0.1),
        (0.7, 7, None, None, 0.05),
        (1.3, None, 0.7, 11, 0.2),
        (1.0, None, None, None, 1.0),  # only the largest
    ],
)
def test_filter_keeps_what_the_float64_reference_keeps(logits, temperature, top_k, top_p, limit, min_p):
    out = np.asarray(Sampling(temperature, top_k, top_p, min_p, limit).filter(jnp.asarray(logits)))
    want = reference_kept(logits, temperature, top_k, top_p, limit, min_p)
    np.testing.assert_array_equal(np.isfinite(out), want)
    np.testing.assert_allclose(out[want], logits[want] / temperature, rtol=1e-6)
    for cut, value in (("top_p", top_p), ("min_p", min_p)):  # each cut keeps fewer than the others alone on some row
        if value is not None and value < 1.0:
            without = reference_kept(logits, temperature, top_k, *((None, limit, min_p) if cut == "top_p" else
                                                                  (top_p, limit, None)))  # fmt: skip
            assert want.sum() < without.sum(), cut


def test_min_p_keeps_what_transformers_min_p_warper_keeps(logits):
    """The reference of the ecosystem: transformers' MinPLogitsWarper (after the temperature), row by row."""
    torch = pytest.importorskip("torch", reason="the hf extra has transformers' MinPLogitsWarper")
    warper = pytest.importorskip("transformers.generation.logits_process", reason="the hf extra").MinPLogitsWarper
    for min_p in (0.02, 0.1, 0.3, 0.9):
        theirs = warper(min_p)(None, torch.tensor(logits / 0.8)).numpy()
        ours = np.asarray(Sampling(0.8, None, min_p=min_p).filter(jnp.asarray(logits)))
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs), err_msg=str(min_p))


def test_draws_come_from_the_nucleus_in_its_renormalised_proportions(logits):
    row = jnp.asarray(logits[:1].repeat(4000, axis=0))  # one row's logits, drawn 4000 times
    keys = jax.random.split(jax.random.PRNGKey(3), 4000)
    draws = np.asarray(jax.vmap(lambda lg, k: Sampling(1.0, None, top_p=0.8).pick(lg[None], k)[0])(row, keys))
    kept = reference_kept(logits[:1], 1.0, None, 0.8)[0]
    assert kept.sum() >= 2 and set(np.unique(draws)) == set(np.flatnonzero(kept))
    p = np.where(kept, np.exp(logits[0].astype(np.float64)), 0.0)
    p /= p.sum()
    freq = np.bincount(draws, minlength=V) / draws.size
    sigma = np.sqrt(p * (1 - p) / draws.size)
    assert np.all(np.abs(freq - p) <= 5 * sigma + 1e-12), (freq, p)


def test_greedy_ignores_the_cuts_but_not_the_limit(logits):
    key = jax.random.PRNGKey(0)
    greedy = np.asarray(Sampling(0.0, 3, top_p=0.1).pick(jnp.asarray(logits), key))
    np.testing.assert_array_equal(greedy, logits.argmax(-1))
    limited = np.asarray(Sampling(0.0, None, vocab_limit=4).pick(jnp.asarray(logits), key))
    np.testing.assert_array_equal(limited, logits[:, :4].argmax(-1))


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("temperature", -0.5, "a finite number >= 0"),
        ("temperature", float("inf"), "a finite number >= 0"),
        ("top_k", 0, "None or an integer >= 1"),
        ("top_k", 2.5, "None or an integer >= 1"),
        ("temperature", "0.5", "a finite number >= 0"),
        ("top_p", "0.9", r"None or a number in \(0, 1\]"),
        ("top_p", 0.0, r"None or a number in \(0, 1\]"),
        ("top_p", 1.5, r"None or a number in \(0, 1\]"),
        ("min_p", -0.1, r"None or a number in \[0, 1\]"),
        ("min_p", 1.01, r"None or a number in \[0, 1\]"),
        ("vocab_limit", 0, "None or an integer >= 1"),
        ("repetition_penalty", 0.0, "None or a finite number > 0"),
        ("repetition_penalty", float("inf"), "None or a finite number > 0"),
    ],
)
def test_sampling_refuses_a_setting_out_of_range_in_one_line(field, value, allowed):
    with pytest.raises(ValueError, match=rf"^{field}={value!r}; allowed: {allowed}") as e:
        Sampling(**{field: value})
    assert "\n" not in str(e.value)


def _seen_ids() -> tuple[np.ndarray, np.ndarray]:
    """Each row's earlier ids (9, with repeats) and the (B, V) mask of them."""
    ids = np.random.default_rng(5).integers(0, V, (B, 9))
    seen = np.zeros((B, V), bool)
    np.put_along_axis(seen, ids, True, axis=1)
    return ids, seen


def test_repetition_penalty_divides_a_seen_ids_positive_logit_and_multiplies_a_negative_one(logits):
    """The float64 reference of CTRL's penalty, on the seen ids only, and greedy picks the largest penalised logit."""
    ids, seen = _seen_ids()
    z = logits.astype(np.float64)
    for p in (0.7, 1.3, 2.5):
        ours = np.asarray(Sampling(repetition_penalty=p).penalised(jnp.asarray(logits), jnp.asarray(seen)))
        want = np.where(seen, np.where(z > 0, z / p, z * p), z)
        np.testing.assert_allclose(ours, want, rtol=1e-6)
        assert (ours != logits)[seen].mean() > 0.9 and np.all(ours[~seen] == logits[~seen])
        greedy = Sampling(0.0, None, repetition_penalty=p).pick(jnp.asarray(logits), None, jnp.asarray(seen))
        np.testing.assert_array_equal(np.asarray(greedy), want.argmax(-1))
    assert not np.array_equal(want.argmax(-1), logits.argmax(-1))  # the penalty changed some row's pick
    unmarked = Sampling(repetition_penalty=2.5).penalised(jnp.asarray(logits), None)  # nothing seen: as given
    np.testing.assert_array_equal(np.asarray(unmarked), logits)


def test_repetition_penalty_is_transformers_repetition_penalty_processor(logits):
    """The reference of the ecosystem: transformers' RepetitionPenaltyLogitsProcessor on the rows' input ids."""
    torch = pytest.importorskip("torch", reason="the hf extra has transformers' RepetitionPenaltyLogitsProcessor")
    process = pytest.importorskip("transformers.generation.logits_process", reason="the hf extra")
    ids, seen = _seen_ids()
    for p in (0.7, 1.3, 2.5):
        theirs = process.RepetitionPenaltyLogitsProcessor(p)(torch.tensor(ids), torch.tensor(logits)).numpy()
        ours = np.asarray(Sampling(repetition_penalty=p).penalised(jnp.asarray(logits), jnp.asarray(seen)))
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, err_msg=str(p))


def test_equal_settings_are_one_key_for_the_compiled_programs():
    """generate_batch keeps its compiled programs per model and Sampling: equal settings must hash alike."""
    assert Sampling(0.7, None, top_p=0.9) == Sampling(temperature=0.7, top_k=None, top_p=0.9)
    assert len({Sampling(0.7, None, top_p=0.9), Sampling(0.7, None, top_p=0.9), Sampling(0.7, None)}) == 2


def test_weights_are_cast_to_the_compute_dtype_once_and_the_decode_step_converts_less():
    """A bfloat16-compute model with float32 parameters: compute_params casts every weight matrix once (vectors and
    the relative bias stay float32), the logits are the same bit for bit, and the compiled one-token step holds
    fewer converts than with float32 weights (each layer cast its kernels at every token; issue 98, item 4)."""
    import flax.linen as nn

    from qkvjax.attention import AttentionConfig
    from qkvjax.models.lm import DecodeCache, DecoderLM, ModelConfig
    from qkvjax.sample import compute_params

    att = AttentionConfig(num_heads=3, head_dim=6, num_kv_heads=1, dtype="bfloat16", rope=True, relative_bias=2)
    model = DecoderLM(ModelConfig(att, vocab_size=37, d_model=15, num_layers=2, mlp_dim=13, max_len=11,
                                  learned_positions=False))  # fmt: skip
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 37, (2, 7)), jnp.int32)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), tokens)["params"])
    cast = compute_params(model, params)
    dtypes = {"/".join(str(getattr(k, "key", k)) for k in path): leaf.dtype
              for path, leaf in jax.tree_util.tree_flatten_with_path(cast)[0]}  # fmt: skip
    assert dtypes["block_0/attention/w_q"] == jnp.bfloat16 and dtypes["embed"] == jnp.bfloat16
    assert dtypes["block_0/attention/rel_bias"] == jnp.float32 and dtypes["ln_final/scale"] == jnp.float32
    np.testing.assert_array_equal(model.apply({"params": cast}, tokens), model.apply({"params": params}, tokens))

    def step(p, cache, token):
        return model.apply({"params": p}, token, cache=cache)

    cache, token = DecodeCache.empty(model.config, 2), tokens[:, :1]
    compiled = {name: jax.jit(step).lower(p, cache, token).compile() for name, p in (("f32", params), ("cast", cast))}
    hlo = {name: c.as_text() for name, c in compiled.items()}
    converts = {name: text.count(" convert(") for name, text in hlo.items()}
    assert converts["cast"] < converts["f32"], converts
    same = ModelConfig(AttentionConfig(num_heads=3, head_dim=5), vocab_size=37, d_model=15, num_layers=1, max_len=11)
    plain = nn.meta.unbox(jax.jit(DecoderLM(same).init)(jax.random.key(1), tokens)["params"])
    assert compute_params(DecoderLM(same), plain) is plain  # float32 compute: nothing to cast


def test_the_decode_floor_benchmark_counts_the_bytes_each_variant_reads(tmp_path, capsys):
    """benchmarks/decode_floor.py on a bfloat16 model: the weights cast once (after) are stored in half the bytes
    of the float32 matrices the step casts per token (before), the floor follows the bytes, and each row gives the
    compiled step's kernels per layer (speed itself is a benchmark's, not a test's)."""
    import importlib.util
    import json

    from tests.helpers import REPO

    spec = importlib.util.spec_from_file_location("decode_floor", REPO / "benchmarks" / "decode_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "floor.json"
    argv = ["--config", str(REPO / "experiments/configs/tiny.py"), "--set", "model.attention.dtype=bfloat16",
            "--batches", "1,3", "--tokens", "3", "--rounds", "1", "--json", str(out)]  # fmt: skip
    assert module.main(argv) == 0
    result = json.loads(out.read_text())
    before, after = result["weight_bytes"]["before"], result["weight_bytes"]["after"]
    assert after < 0.6 * before  # the matrices in bfloat16; norm scales and biases stay float32
    rows = {(r["batch"], r["variant"]): r for r in result["rows"]}
    assert set(rows) == {(b, v) for b in (1, 3) for v in ("before", "after")}
    for b in (1, 3):
        assert rows[b, "after"]["floor_ms"] < rows[b, "before"]["floor_ms"]
        assert rows[b, "before"]["kernels"]["dot"] > 0 and rows[b, "after"]["kernels_per_layer"] > 0
    assert "kernels/layer" in capsys.readouterr().out
