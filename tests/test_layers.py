"""Attention per layer: patterns, cross-layer K/V sharing, QK-norm, the functional decode cache, its accounting."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax import Attention, AttentionConfig
from qkvjax.attention.costs import layout_table, stack_cost
from qkvjax.attention.layers import expand
from qkvjax.config import Config, apply_overrides
from qkvjax.models.lm import DecodeCache, DecoderLM, ModelConfig, kv_cache_bytes_per_token, param_count
from qkvjax.sample import generate, generate_batch

B, T, D, V, L = 3, 7, 10, 11, 4


def lm(layers="", rope=False, kv=None, **kw):
    att = AttentionConfig(num_heads=4, head_dim=6, num_kv_heads=kv, rope=rope)
    return ModelConfig(
        attention=att, vocab_size=V, d_model=D, num_layers=L, mlp_dim=9, max_len=T, layers=layers,
        learned_positions=not rope, **kw,
    )  # fmt: skip


def params_of(cfg):
    tokens = jnp.zeros((1, T), jnp.int32)
    return nn.meta.unbox(jax.jit(DecoderLM(cfg).init)(jax.random.key(0), tokens)["params"])  # one compile


@pytest.mark.parametrize("pattern", ["[kv=4]", "(separate, separate*1)*2"])
def test_a_pattern_of_the_base_is_the_base_model(pattern):
    base, patterned = lm(), lm(pattern)
    a, b = params_of(base), params_of(patterned)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    np.testing.assert_array_equal(
        DecoderLM(base).apply({"params": a}, tokens), DecoderLM(patterned).apply({"params": b}, tokens)
    )


def test_pattern_syntax_expands_per_layer():
    base = AttentionConfig(num_heads=6, head_dim=4)
    layers = expand("separate*2, (shared_kv[kv=2,qk_norm], [kv_from=-1])*2, [v_norm]*1", base, 7)
    assert [x.config.scheme for x in layers] == ["separate"] * 2 + ["shared_kv"] * 4 + ["separate"]  # readers inherit
    assert [x.kv_from for x in layers] == [None, None, None, 2, None, 4, None]
    assert layers[2].config.kv_heads == 2 and layers[2].config.qk_norm and layers[6].config.v_norm
    # a chain resolves to the layer that produces the K/V
    chain = expand("separate, [kv_from=0], [kv_from=1]", base, 3)
    assert [x.kv_from for x in chain] == [None, 0, 0]


def test_the_command_line_sets_a_pattern():
    cfg = Config(model=lm())
    out = apply_overrides(cfg, {"model.layers": "(separate, [kv_from=-1])*2", "model.attention.num_kv_heads": "2"})
    assert [x.kv_from for x in out.model.layer_attention] == [None, 0, None, 2]
    assert all(x.config.kv_heads == 2 for x in out.model.layer_attention)


@pytest.mark.parametrize(
    "pattern,match",
    [
        ("separate*3", r"describes 3 layers but the model has num_layers=4"),
        ("separte*4", r"unknown scheme 'separte'"),
        ("separate*4[kv=2]", r"expected ',' between entries, got '\[kv=2\]'"),
        ("[kv_from=-1]*4", r"layer 0 of pattern .*kv_from=-1: the first layer has no earlier layer to read K/V from"),
        ("separate, [kv_from=1], separate*2", r"layer 1 of pattern .*kv_from=1 is not an earlier layer"),
        ("separate*2, [kv_from=0,kv=2], separate", r"layer 2 of pattern .*layer 0's K/V .*K=4.* this layer's .*K=2"),
        ("separate, shared_kv[kv_from=0], separate*2", r"layer 1 .*groups \('k', 'v'\).*groups \('kv',\)"),
        ("shared_kv, [kv_from=0, kv=2], separate*2", r"layer 1 .*K=4.* this layer's .*K=2"),
        ("separate, shared_qk[kv_from=0], separate*2", r"layer 1 .*'shared_qk' makes keys or values from the query"),
        ("separate, [kv=3]*3", r"layer 1 of pattern .*num_kv_heads=3 does not divide num_heads=4"),
        ("[colour=red]", r"unknown option 'colour'; allowed: kv_from, kv,"),
        ("[qk_norm=maybe]", r"layer 0 of pattern .*qk_norm: 'maybe' is not a boolean; allowed: true, yes, 1, false"),
        ("(separate*4", r"'\(' is never closed"),
        ("separate*0", r"'\*' needs a count >= 1"),
        ("()*", r"an empty group '\(\)'; allowed: one or more entries in it"),  # was a ZeroDivisionError
        ("[rope_base=fast]", r"layer 0 of pattern .*rope_base='fast'; allowed: a number"),  # named no option
        # counts past the stack were multiplied out first: a MemoryError (10^12 entries), or the memory filled
        ("separate*1000000000000", r"'\*1000000000000' makes 1000000000000 or more layers, more than num_layers=4"),
        ("(separate*100000)*100000", r"'\*100000' makes 100000 or more layers, more than num_layers=4"),
        ("separate*2, shared_kv*3", r"'\*3' makes 5 or more layers, more than num_layers=4"),
    ],
)
def test_bad_patterns_are_named_before_anything_compiles(pattern, match):
    with pytest.raises(ValueError, match=match):
        lm(pattern)


def _attention_reference(x_q, x_kv, w_q, w_k, w_v, w_o):
    """Causal multi-head attention in float64 numpy: x (T, D), w_q/w_k/w_v (D, N, H), w_o (N, H, D)."""
    x_q, x_kv = np.float64(x_q), np.float64(x_kv)
    q, k, v = (np.einsum("TD,DNH->TNH", x, np.float64(w)) for x, w in ((x_q, w_q), (x_kv, w_k), (x_kv, w_v)))
    s = np.einsum("TNH,SNH->NTS", q, k) / np.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones(s.shape[1:], bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("NTS,SNH,NHD->TD", p, v, np.float64(w_o))


def test_a_layer_reading_its_donors_kv_attends_over_them():
    cfg = AttentionConfig(num_heads=3, head_dim=5)
    x1, x2 = jax.random.normal(jax.random.key(1), (2, 1, T, D))
    donor, reader = Attention(cfg), Attention(cfg)
    p1 = nn.meta.unbox(donor.init(jax.random.key(2), x1)["params"])
    _, kv = donor.apply({"params": p1}, x1, causal=True, return_kv=True)
    p2 = nn.meta.unbox(reader.init(jax.random.key(3), x2, kv=kv)["params"])
    assert sorted(p2) == ["w_o", "w_q"]  # no K/V kernels of its own
    y, used = reader.apply({"params": p2}, x2, causal=True, kv=kv, return_kv=True)
    jax.tree.map(np.testing.assert_array_equal, used.tensors, kv.tensors)  # it hands on its donor's K/V
    want = _attention_reference(x2[0], x1[0], p2["w_q"], p1["w_k"], p1["w_v"], p2["w_o"])
    np.testing.assert_allclose(y[0], want, rtol=2e-5, atol=2e-5)


MIXED = [  # schemes, GQA, cross-layer K/V, norms, rotary, relative bias: each row of the cache at its own position
    ("separate[v_head_dim=5], [kv_from=-1], shared_kv[kv=2], [kv_from=-1]", False, None),
    ("[qk_norm,v_norm,kv=2], [kv_from=-1,qk_norm], shared_kv[kv=1,qk_norm,v_norm], [kv_from=2,v_norm]", True, None),
    ("reformer_qk, bilinear, shared_qkv, [kv=1,relative_bias=2]", False, None),
]


@pytest.mark.parametrize("pattern,rope,kv", MIXED)
def test_decoding_token_by_token_matches_the_full_forward(pattern, rope, kv):
    cfg = lm(pattern, rope=rope, kv=kv)
    model = DecoderLM(cfg)
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, V)
    params = params_of(cfg)
    assert sum(p.size for p in jax.tree.leaves(params)) == param_count(cfg)
    full = jax.jit(model.apply)({"params": params}, tokens)
    cache = DecodeCache.empty(cfg, B)
    assert cache.nbytes == kv_cache_bytes_per_token(cfg) * B * T  # the accounting is the real cache
    step = jax.jit(lambda p, c, x: model.apply({"params": p}, x, cache=c))
    outs = []
    for i in range(T):
        logits, cache = step(params, cache, tokens[:, i : i + 1])
        outs.append(logits)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)
    # prefill of 3 then single tokens (the same compiled step): the same
    logits, cache = step(params, DecodeCache.empty(cfg, B), tokens[:, :3])
    for i in range(3, T):
        more, cache = step(params, cache, tokens[:, i : i + 1])
        logits = jnp.concatenate([logits, more], 1)
    np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # ~25 s of compiles (out of CI: pytest -m slow; test_latent, test_lm decode ragged rows in CI)
def test_a_ragged_batch_decodes_each_row_as_if_alone():
    cfg = lm("separate, [kv_from=-1], shared_kv[kv=2,qk_norm], [kv=2]", rope=True)
    model, params = DecoderLM(cfg), params_of(cfg)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, V, n) for n in (1, 4, 2)]
    # logits: one right-padded prefill, per-row lengths, then one token for all rows
    padded = np.zeros((3, 4), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lengths = jnp.array([len(p) for p in prompts])
    logits, cache = model.apply({"params": params}, padded, cache=DecodeCache.empty(cfg, 3), num_valid=lengths)
    np.testing.assert_array_equal(cache.lengths, lengths)
    nxt = jnp.array([[3], [5], [7]])
    step, _ = model.apply({"params": params}, nxt, cache=cache)
    for i, p in enumerate(prompts):
        alone = model.apply({"params": params}, jnp.asarray(np.r_[p, nxt[i]])[None])
        np.testing.assert_allclose(logits[i, : len(p)], alone[0, :-1], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(step[i, 0], alone[0, -1], rtol=1e-5, atol=1e-5)
    # generation: the batch gives each row what it gives alone (greedy; on the device in one call)
    batch, stats = generate_batch(model, params, prompts, 3, temperature=0.0)
    assert batch.shape == (3, 3) and stats["cache_bytes"] == kv_cache_bytes_per_token(cfg) * 3 * T
    for i in (0, 1):  # the shortest and the longest prompt
        alone, _ = generate(model, params, prompts[i], 3, temperature=0.0, on_token=lambda t: None)
        np.testing.assert_array_equal(batch[i], alone)


def test_cross_layer_sharing_halves_the_cache_on_top_of_gqa_and_kv_tying():
    sizes = {
        name: sum(c.kv_cache_bytes_per_token for c in stack_cost(expand(p, AttentionConfig(12, 64), 12), 768, 1024))
        for name, p in {
            "separate": "", "gqa6": "[kv=6]", "cla2": "(separate, [kv_from=-1])*6",
            "gqa6_kv": "shared_kv[kv=6]", "gqa6_kv_cla2": "(shared_kv[kv=6], shared_kv[kv=6,kv_from=-1])*6",
        }.items()
    }  # fmt: skip
    assert sizes["gqa6"] * 2 == sizes["cla2"] * 2 == sizes["separate"]
    assert sizes["gqa6_kv_cla2"] * 8 == sizes["separate"]
    table = layout_table({"separate": "", "cla2": "(separate, [kv_from=-1])*6"}, 768, 12, 12, 1024)
    assert "cla2" in table and " 0.50 " in table and "6/12" in table


def test_the_readme_table_is_what_qkvjax_schemes_prints(capsys):

    from qkvjax.cli import main

    assert main(["schemes", "--d-model", "768", "--num-heads", "12", "--num-layers", "12", "--seq-len", "1024"]) == 0
    printed = capsys.readouterr().out
    stacks = printed[printed.index("attention stacks") :].strip()
    for name in ("separate", "shared_kv", "GQA-6 ", "GQA-6 + shared_kv", "CLA2 ", "CLA2 + shared_kv", "Gemma-4-like"):
        assert f"\n{name}" in stacks, name
    from tests.helpers import docs_text

    readme = docs_text()
    assert stacks in readme


STRICT_DTYPE_PROMOTION = False  # optax inside the training run


def test_a_pattern_trains_restores_and_samples_several_prompts(tmp_path, small_text, data_dir, capsys):
    import json

    from tests.helpers import run_in_process, train_args

    w = tmp_path / "w"
    pattern = "shared_kv[kv=2,qk_norm,v_norm,rope], [kv_from=-1,qk_norm,rope]"
    args = train_args(w, small_text, data_dir, **{"train.num_steps": 2, "train.checkpoint_every": 2,
                                                  "model.layers": pattern, "model.learned_positions": "false",
                                                  "train.log_weight_similarity": "true"})  # fmt: skip
    assert run_in_process(args) == 0
    capsys.readouterr()
    assert run_in_process(["info", f"--workdir={w}", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [x["kv_from"] for x in info["attention_by_layer"]] == [None, 0]
    assert info["kv_cache_bytes_per_token"] == 2 * 8 * 4  # one (K=2, H=8) float32 tensor, layer 0 only
    prompts = ["the ", "and so "]
    sample = ["sample", f"--workdir={w}", "--num-tokens=6", "--temperature=0"]
    assert run_in_process(sample + [f"--prompt={p}" for p in prompts]) == 0
    out = capsys.readouterr()
    assert "2 x 6 tokens" in out.err and "layers" in out.err
    expected = ""
    for i, prompt in enumerate(prompts):
        assert run_in_process(sample + [f"--prompt={prompt}"]) == 0  # alone, streamed
        alone = capsys.readouterr().out
        assert alone.startswith(prompt) and len(alone.encode()) >= len(prompt) + 1
        expected += f"{'' if i == 0 else chr(10)}=== prompt {i} ===\n{alone}\n"
    assert out.out == expected  # each row of the batch decodes as it does alone


def test_the_readme_patterns_fit_the_presets_the_first_hour_trains():
    """Each pattern in the README's block expands on shakespeare_char (6 layers, 6 heads); the CLA2 ones, which
    only repeat to fill, on tiny (2 layers, 4 heads) too; and '*' that cannot fill says so."""
    import re

    from qkvjax.config import load_config_file
    from tests.helpers import REPO, TINY, docs_text

    text = docs_text()
    block = text.split("<!-- patterns:")[1].split("```bash")[1].split("```")[0]
    patterns = re.findall(r'--config\.model\.layers="([^"]+)"', block)
    assert len(patterns) == 5
    shakespeare_char = str(REPO / "experiments" / "configs" / "shakespeare_char.py")
    presets = {
        name: load_config_file(path).model for name, path in (("shakespeare_char", shakespeare_char), ("tiny", TINY))
    }
    for pattern in patterns:
        layers = expand(pattern, presets["shakespeare_char"].attention, presets["shakespeare_char"].num_layers)
        assert len(layers) == 6
        if "kv_from=-1])*" in pattern:
            assert len(expand(pattern, presets["tiny"].attention, presets["tiny"].num_layers)) == 2
    with pytest.raises(ValueError, match=r"cannot fill the 0 layer\(s\) the rest leaves of num_layers=2"):
        expand(patterns[0], presets["tiny"].attention, 2)


@pytest.mark.parametrize(
    "pattern, layers, match",
    [
        ("separate*, shared_kv*", 4, "only one item may end in '\\*' without a count"),
        ("(separate*, shared_kv)*2", 4, "without a count only at the top level"),
    ],
)
def test_fill_errors_name_the_pattern(pattern, layers, match):
    with pytest.raises(ValueError, match=match):
        expand(pattern, AttentionConfig(num_heads=4, head_dim=3), layers)


@pytest.mark.parametrize("layers", [0, 65537, 2**40, 2.0, True])
def test_a_stack_deeper_than_max_layers_is_refused_before_it_is_expanded(layers):
    """``qkvjax schemes --num-layers 1099511627776`` filled the memory with per-layer configs (an empty pattern
    expands to one entry per layer); the bound is the one :class:`ModelConfig` keeps."""
    with pytest.raises(ValueError, match=rf"num_layers={layers!r}; allowed: an integer in \[1, 65536\]"):
        expand("", AttentionConfig(num_heads=4, head_dim=3), layers)
