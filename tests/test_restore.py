"""Restoring checkpoints: eval, sample, info, convert, the Python API, and the README's code."""

import dataclasses
import json
import logging
import os
import re
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qkvjax
from qkvjax import AttentionConfig, DecoderLM, ModelConfig
from qkvjax.convert import convert
from qkvjax.evaluate import evaluate, restore_params
from qkvjax.models.lm import DecodeCache, param_count
from qkvjax.sample import _common_prefix, generate, generate_batch
from tests.helpers import REPO, exported_params, flat, metrics, run_in_new_process, run_in_process, train_args

pytestmark = pytest.mark.xdist_group("restore")  # one worker builds the module's fixture once

STRICT_DTYPE_PROMOTION = False  # optax inside the training runs


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_text, data_dir):
    """A tiny run on 8 devices with FSDP, evaluated on the whole validation split at steps 2 and 4."""
    w = tmp_path_factory.mktemp("run")
    args = train_args(
        w,
        small_text,
        data_dir,
        **{
            "train.num_steps": 4,
            "train.checkpoint_every": 2,
            "train.eval_every": 2,
            "train.eval_batches": "none",
            "mesh.fsdp": 2,
        },
    )
    assert run_in_process(args) == 0
    return w


def test_eval_matches_the_evaluation_logged_in_training(run):
    for record in metrics(run, evals=True):
        result = evaluate(str(run), step=record["step"])
        assert result["step"] == record["step"] and result["tokens"] == record["tokens"]
        np.testing.assert_allclose(result["loss"], record["loss"], rtol=1e-5)
        np.testing.assert_allclose(result["perplexity"], np.exp(record["loss"]), rtol=1e-5)
        assert result["scheme"] == "separate" and result["split"] == "validation"


def test_eval_batch_size_scores_the_same_targets_to_the_same_loss_and_refuses_what_cannot_fit(run):
    """--batch-size changes the windows per call, not which targets count: the loss of 3 and 7 windows a call is the
    default's (padding weighs 0); a batch that cannot fit in memory is refused before anything is restored."""
    import jax

    default, n = evaluate(str(run)), jax.device_count()
    for size in (3, 29):  # rounded up to the devices' multiple (8 here): 8 and 32 windows a call
        result = evaluate(str(run), batch_size=size)
        assert result["tokens"] == default["tokens"] and result["batch_size"] == -(-size // n) * n
        np.testing.assert_allclose(result["loss"], default["loss"], rtol=1e-6)
    too_many = r"^batch_size=1,099,511,627,776: about .* GiB .* allowed: at most [0-9,]+ windows$"
    with pytest.raises(ValueError, match=too_many):
        evaluate(str(run), batch_size=2**40)
    with pytest.raises(ValueError, match=r"^batch_size=0; allowed: an integer >= 1"):
        evaluate(str(run), batch_size=0)


def test_strided_eval_is_the_sliding_window_loss_of_a_float64_reference(run):
    """eval --stride S: windows S apart (the last one shorter), each scoring the targets after the previous
    window's end, as Hugging Face's perplexity guide loops; checked against float64 log-softmax of the model's
    logits window by window (S = seq_len giving the default's batches: tests/test_data.py)."""
    from qkvjax.data.builders import load_splits
    from qkvjax.evaluate import load

    model, params, config = load(str(run))
    seq_len, stride = config.seq_len, 5
    strided = evaluate(str(run), stride=stride)
    assert strided["stride"] == stride
    tokens = load_splits(config.data.dataset, config.data.source_path, config.data.data_dir)["validation"]
    n, windows, done = len(tokens) - 1, [], 0  # n targets; (start, end, first scored target) per window
    for start in range(0, n, stride):
        end = min(start + seq_len, n)
        windows.append((start, end, done))
        done = end
        if end == n:
            break
    batch = np.zeros((len(windows), seq_len), np.int32)
    for row, (start, end, _) in enumerate(windows):
        batch[row, : end - start] = tokens[start:end]
    logits = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(batch)), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = [-logp[row, t - start, tokens[t + 1]] for row, (start, end, first) in enumerate(windows)
           for t in range(first, end)]  # fmt: skip
    assert len(nll) == n == strided["tokens"]
    np.testing.assert_allclose(strided["loss"], np.mean(nll), rtol=2e-6)


def test_a_checkpoint_from_8_devices_evaluates_on_1(run, tmp_path):
    out = tmp_path / "eval.json"
    proc = run_in_new_process(["eval", f"--workdir={run}", "--split=validation", f"--output={out}"], devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed == json.loads(out.read_text())
    np.testing.assert_allclose(printed["loss"], metrics(run, evals=True)[-1]["loss"], rtol=1e-5)
    assert printed["step"] == 4 and set(printed) >= {"tokens", "bits_per_byte", "perplexity"}


def _lm(scheme, kv=None, rope=False, causal_block=64):
    att = AttentionConfig(num_heads=2, head_dim=6, num_kv_heads=kv, scheme=scheme, rope=rope, causal_block=causal_block)
    return ModelConfig(attention=att, vocab_size=256, d_model=10, num_layers=2, mlp_dim=14, max_len=13)


# Generation's own code is the same for every scheme; each scheme's cached decoding is checked against its full
# forward in test_attention (every scheme, ragged rows), test_lm (a model of bilinear's key-side cache, Reformer's
# self-mask with rotary) and test_window (a model of every family). Here in CI: GQA with rotary and MLA's absorbed
# reading, each with the generation options only it takes; bilinear and Reformer are `pytest -m slow`.
SAMPLE_CASES = [("separate", 1, True), pytest.param("bilinear", None, False, marks=pytest.mark.slow),
                pytest.param("reformer_qk", None, True, marks=pytest.mark.slow), ("mla", None, False)]  # fmt: skip
# the prefix and the absorbed kernel, reading key prefixes of 2, 4, 8 or all 13 slots as the rows grow
PREFIXES = (("separate", 1, True), ("mla", None, False))


@pytest.mark.parametrize("scheme,kv,rope", SAMPLE_CASES)
def test_greedy_sampling_with_cache_equals_recomputing_the_full_forward(scheme, kv, rope):
    model = DecoderLM(_lm(scheme, kv, rope, causal_block=2 if (scheme, kv, rope) in PREFIXES else 64))
    params = jax.jit(model.init)(jax.random.PRNGKey(3), jnp.zeros((1, 13), jnp.int32))["params"]  # one compile
    prompt = np.array([72, 101, 121], np.int32)
    cached, stats = generate(model, params, prompt, 9, temperature=0.0)
    if scheme == "mla":  # streamed, one call per token: the same tokens as the one on-device loop
        streamed, _ = generate(model, params, prompt, 9, temperature=0.0, on_token=lambda t: None)
        assert streamed.tolist() == cached.tolist()
    if scheme == "separate":  # the on-device loop unrolled: 8 steps as 3 iterations of 3, the last one partial
        unrolled, _ = generate(model, params, prompt, 9, temperature=0.0, scan_unroll=3)
        assert unrolled.tolist() == cached.tolist()
        for bad in (0, 2.0, True):
            with pytest.raises(ValueError, match=rf"scan_unroll={bad!r}; allowed: an int >= 1"):
                generate(model, params, prompt, 9, scan_unroll=bad)
        for bad in ("a", [7, -1], [2.0]):  # 'a' was int()'s message, naming no argument; 2.0 was taken as 2
            with pytest.raises(
                ValueError, match=rf"^stop_ids={re.escape(repr(bad))}; allowed: a sequence of token ids"
            ):
                generate(model, params, prompt, 9, stop_ids=bad)
        for bad in (-1, 2**64, 1.0):  # 2^64 was an OverflowError from jax's PRNGKey, with a traceback
            with pytest.raises(ValueError, match=rf"^seed={bad!r}; allowed: an integer in \[0, 4294967295\]$"):
                generate(model, params, prompt, 9, seed=bad)
    # Without a cache: the whole (zero-padded, causal so the padding is never seen) sequence each time.
    forward = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
    tokens = list(prompt)
    for _ in range(9):
        padded = jnp.zeros((1, 13), jnp.int32).at[0, : len(tokens)].set(jnp.asarray(tokens))
        tokens.append(int(jnp.argmax(forward(padded)[0, len(tokens) - 1])))
    assert cached.tolist() == tokens[3:]
    assert stats["cache_bytes"] > 0


def test_a_row_ends_at_its_first_stop_id_batched_and_streamed():
    model = DecoderLM(_lm("separate"))
    params = jax.jit(model.init)(jax.random.PRNGKey(3), jnp.zeros((1, 13), jnp.int32))["params"]
    prompts = [np.array([72, 101, 121], np.int32), np.array([5, 9], np.int32)]
    free, stats = generate_batch(model, params, prompts, 9, temperature=1.0, seed=4)
    assert stats["lengths"] == [9, 9]
    stop = int(free[0, 4])  # row 0 draws it at place 4 at the latest
    stopped, stats = generate_batch(model, params, prompts, 9, temperature=1.0, seed=4, stop_ids=[stop, 999])
    for r in range(2):
        hits = np.flatnonzero(free[r] == stop)
        end = int(hits[0]) if hits.size else 9
        assert stats["lengths"][r] == end and stopped[r, :end].tolist() == free[r, :end].tolist()
        assert (stopped[r, end:] == stop).all()
    assert stats["lengths"][0] <= 4 and stats["decode_steps"] == min(9, max(stats["lengths"]) + 1)
    both = [stop, int(free[1, 2])]  # every row stops by place 4: the loop ends there, its tokens unchanged
    early, stats = generate_batch(model, params, prompts, 9, temperature=1.0, seed=4, stop_ids=both)
    assert max(stats["lengths"]) <= 4 and stats["decode_steps"] == max(stats["lengths"]) + 1
    for r in range(2):
        end = int(np.flatnonzero(np.isin(free[r], both))[0])
        assert stats["lengths"][r] == end and early[r, :end].tolist() == free[r, :end].tolist()
        assert (early[r, end:] == free[r, end]).all()
    alone, _ = generate(model, params, prompts[0], 9, temperature=1.0, seed=4)  # one row draws other samples
    end = int(np.flatnonzero(alone == alone[3])[0])
    seen = []
    streamed, stats = generate(
        model, params, prompts[0], 9, temperature=1.0, seed=4, stop_ids=[int(alone[3])], on_token=seen.append
    )
    assert stats["lengths"] == end and seen == alone[:end].tolist()  # the stop id itself is not streamed
    assert streamed[:end].tolist() == seen and (streamed[end:] == alone[3]).all()


@pytest.mark.parametrize("scheme,kv,rope", PREFIXES)
def test_a_returned_cache_continues_rows_as_one_call_of_their_whole_tokens(scheme, kv, rope):
    """generate_batch given a cache prefills only the prompts' new tokens after what each row holds: ragged rows,
    one rewound into its prompt, give the greedy tokens of a call on each row's whole sequence; what a cache
    cannot take is refused in one line."""
    cfg = _lm(scheme, kv, rope, causal_block=2)
    model = DecoderLM(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(7), jnp.zeros((1, 13), jnp.int32))["params"]
    rng = np.random.default_rng(3)
    first = [rng.integers(0, 256, n).astype(np.int32) for n in (3, 5)]
    new, stats = generate_batch(model, params, first, 3, temperature=0.0, cache=DecodeCache.empty(cfg, 2))
    cache = stats["cache"]
    assert np.asarray(cache.lengths).tolist() == [3 + 2, 5 + 2]  # the last drawn token is not fed back yet
    held = [[*p.tolist(), *n.tolist()][:h] for p, n, h in zip(first, new, [5, 7], strict=True)]
    whole, plain = generate_batch(model, params, first, 3, temperature=0.0)
    assert new.tolist() == whole.tolist() and "cache" not in plain  # without a cache: the same tokens, none returned
    then = [rng.integers(0, 256, n).astype(np.int32) for n in (2, 4)]
    keep = [5, 4]  # row 1 rewound into its prompt
    went, stats = generate_batch(model, params, then, 4, temperature=0.0, prompt_bucket=3,
                                 cache=cache.rewound(keep))  # fmt: skip
    rows = [np.array([*h[:k], *t], np.int32) for h, k, t in zip(held, keep, then, strict=True)]
    assert went.tolist() == generate_batch(model, params, rows, 4, temperature=0.0)[0].tolist()
    assert stats["prompt_tokens"] == [2, 4] and np.asarray(stats["cache"].lengths).tolist() == [5 + 2 + 3, 4 + 4 + 3]
    with pytest.raises(ValueError, match=r"the cache has 2 rows; allowed: DecodeCache.empty\(model.config, 1\)"):
        generate(model, params, then[0], 2, cache=DecodeCache.empty(cfg, 2))
    nine = DecodeCache.empty(cfg, 1).replace(lengths=jnp.array([9], jnp.int32))  # as if 9 tokens were held
    with pytest.raises(ValueError, match=r"after the 9 tokens its cache holds \(11 tokens\) \+ num_tokens \(3\)"):
        generate(model, params, then[0], 3, cache=nine)
    with pytest.raises(ValueError, match=r"rewinding to lengths \[11, 1\]; allowed: 2 integer lengths, each between"):
        stats["cache"].rewound([11, 1])
    for bad, shown in (([2.5, 1], r"\[2.5, 1.0\]"), (None, "None"), ("x", "x")):  # 2.5 was cast to 2; None a TypeError
        with pytest.raises(ValueError, match=rf"^rewinding to lengths {shown}; allowed: 2 integer lengths"):
            stats["cache"].rewound(bad)
    with pytest.raises(ValueError, match=r"the longest prompt has 4 tokens and a cache holds 10: together over"):
        generate_batch(model, params, then, 1, cache=stats["cache"].rewound([10, 1]))


@pytest.mark.parametrize("scheme,kv,rope,window", [("separate", 1, True, 3), ("mla", None, False, None)])
def test_a_shared_prefix_is_read_once_and_every_row_draws_as_it_would_alone(scheme, kv, rope, window):
    """share_prefix: the prompts' common start (all but each row's last token) goes through the model once and its
    cache is copied to every row; the tokens sampled are those of the unshared call with the same seed, ragged rows,
    a prompt that is the whole common start, MLA's absorbed reading and a sliding window's ring (GQA with rotary,
    window 3, a start of 5) and a start padded to the prompt bucket included."""
    cfg = dataclasses.replace(_lm(scheme, kv, rope, causal_block=2), max_len=15)
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, sliding_window=window))
    model = DecoderLM(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(7), jnp.zeros((1, 15), jnp.int32))["params"]
    rng = np.random.default_rng(5)
    start = rng.integers(0, 256, 5).astype(np.int32)
    prompts = [np.concatenate([start, rng.integers(0, 256, n).astype(np.int32)]) for n in (0, 3, 1, 0)]
    alone, plain = generate_batch(model, params, prompts, 4, temperature=1.0, seed=1)
    # sampled, the same draws: the same logits; the start's prefill padded to 6 too, its padding never read
    once, stats = generate_batch(model, params, prompts, 4, temperature=1.0, seed=1, share_prefix=True, prompt_bucket=3)
    assert once.tolist() == alone.tolist()
    assert stats["shared_prefix"] == 4 and plain["shared_prefix"] == 0  # the 5-token prompt keeps its last
    assert stats["prompt_tokens"] == plain["prompt_tokens"] == [5, 8, 6, 5]
    assert once[0].tolist() != once[3].tolist()  # one prompt twice, sampled: rows draw independently
    for rows, shared in (([start, start[::-1]], 0), ([start], 0), ([start[:3], start], 2), ([start, start], 4)):
        assert _common_prefix(rows) == shared  # all but the shortest row's last token, at most
    with pytest.raises(ValueError, match=r"share_prefix reads the prompts' common start into a fresh cache"):
        generate_batch(model, params, prompts[:2], 1, share_prefix=True, cache=DecodeCache.empty(cfg, 2))
    with pytest.raises(ValueError, match=r"selecting rows \[0, 2\]; allowed: a non-empty list of row indices in"):
        DecodeCache.empty(cfg, 2).select([0, 2])


def test_a_second_call_with_the_same_shapes_compiles_nothing_and_buckets_share_a_prefill(caplog):
    """The programs are kept per model and sampling settings: a conversation's next turn (another prompt of a
    length in the same bucket) compiles nothing, streamed or batched; the padding a bucket adds is never read
    (greedy tokens equal the unpadded prefill's); a prompt past the bucket compiles its own prefill."""
    model = DecoderLM(_lm("separate", rope=True))
    params = jax.jit(model.init)(jax.random.PRNGKey(5), jnp.zeros((1, 13), jnp.int32))["params"]
    rng = np.random.default_rng(11)
    first, second, longer = (rng.integers(0, 256, n).astype(np.int32) for n in (3, 5, 7))

    def compiles(prompt, **kw) -> tuple[list[int], int]:
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level("WARNING"):
            tokens, _ = generate(model, params, prompt, 4, temperature=0.0, prompt_bucket=6, **kw)
        return tokens.tolist(), sum("Compiling" in r.getMessage() for r in caplog.records)

    for kw in ({}, {"on_token": lambda t: None}, {"stop_ids": [256]}):
        assert compiles(first, **kw)[1] > 0, kw  # the first call of each loop compiles its programs
        tokens, n = compiles(second, **kw)
        assert n == 0, kw  # 5 tokens, the same bucket of 6: nothing new
        assert tokens == generate(model, params, second, 4, temperature=0.0, **kw)[0].tolist(), kw
    assert compiles(longer)[1] > 0  # 7 tokens: the next bucket (12), a prefill of its own


def test_sample_cli_draws_several_samples_of_each_prompt_reading_their_common_start_once(run, capsys):
    prompts = ["the cat ", "the dog "]
    args = ["sample", f"--workdir={run}", "--num-tokens=10", "--temperature=1", "--num-samples=3"]
    assert run_in_process(args + [f"--prompt={p}" for p in prompts]) == 0
    captured = capsys.readouterr()
    assert "6 x 10 tokens" in captured.err and "the first 4 prompt tokens read once for all rows" in captured.err
    parts = captured.out.split("=== ")[1:]
    names = [f"prompt {i}, sample {j} ===" for i in range(2) for j in range(3)]
    assert [part.split("\n", 1)[0] for part in parts] == names
    texts = [part.split("\n", 1)[1] for part in parts]
    assert all(t.startswith(prompts[i // 3]) for i, t in enumerate(texts))
    assert len(set(texts[:3])) > 1  # a prompt's samples draw independently


def test_sample_cli_streams_and_greedy_is_deterministic(run, capsys, tmp_path):
    outs = []
    for _ in range(2):
        args = ["sample", f"--workdir={run}", "--prompt=the ", "--num-tokens=12", "--temperature=0"]
        assert run_in_process(args) == 0
        captured = capsys.readouterr()
        outs.append(captured.out)
        assert "tokens/s" in captured.err and "KV cache" in captured.err
    assert outs[0] == outs[1] and outs[0].startswith("the ")
    nucleus_of_one = ["sample", f"--workdir={run}", "--prompt=the ", "--num-tokens=12", "--top-p=1e-9", "--seed=5"]
    assert run_in_process(nucleus_of_one) == 0  # a sample from the likeliest token alone is the greedy text
    assert capsys.readouterr().out == outs[0]
    min_p_of_one = [*nucleus_of_one[:4], "--min-p=1", "--seed=6"]  # only tokens as likely as the likeliest
    assert run_in_process(min_p_of_one) == 0
    assert capsys.readouterr().out == outs[0]
    imported = tmp_path / "imported"  # as `qkvjax import` leaves a model whose config names an eos_token_id
    shutil.copytree(run, imported)
    model, params, _, _ = restore_params(str(run))
    new = generate(model, params, np.frombuffer(b"the ", np.uint8).astype(np.int32), 12, temperature=0.0)[0].tolist()
    (imported / "special_tokens.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [new[5]]}))
    args = ["sample", f"--workdir={imported}", "--prompt=the ", "--num-tokens=12", "--temperature=0"]
    assert run_in_process(args) == 0
    captured = capsys.readouterr()  # the text of the bytes before the stop (a cut character shown as U+FFFD)
    assert captured.out == "the " + bytes(new[: new.index(new[5])]).decode("utf-8", errors="replace")
    assert "end-of-sequence" in captured.err
    assert run_in_process([*args, "--ignore-eos"]) == 0
    assert capsys.readouterr().out == outs[0]
    seeded = []
    for seed in (1, 1, 2):
        args = ["sample", f"--workdir={run}", "--prompt=a", "--num-tokens=30", f"--seed={seed}", "--temperature=1"]
        assert run_in_process(args) == 0
        seeded.append(capsys.readouterr().out)
    assert seeded[0] == seeded[1]  # same seed, same text
    assert seeded[0] != seeded[2]  # another seed, another text (30 draws over 256 bytes)


def test_complete_is_the_sample_command_in_python_on_the_streams_it_is_given(run, capsys):
    import io

    from qkvjax.complete import Request, complete

    args = ["sample", f"--workdir={run}", "--prompt=the ", "--prompt=a", "--num-tokens=9", "--temperature=0"]
    assert run_in_process(args) == 0
    command = capsys.readouterr()
    out, err = io.StringIO(), io.StringIO()
    complete(Request(str(run), ("the ", "a"), num_tokens=9, temperature=0.0), out=out, err=err)
    assert capsys.readouterr().out == ""  # nothing on the process's streams
    assert out.getvalue() == command.out and out.getvalue().startswith("=== prompt 0 ===\nthe ")
    assert "2 x 9 tokens" in err.getvalue()
    # flags that cannot go together are refused when the request is made, before the workdir is read
    for fields, said in (({"system": "be brief"}, "--system gives chat turns"),
                         ({"chat": True, "interactive": True}, "allowed: without --prompt"),
                         ({"num_samples": 0}, "--num-samples 0; allowed"), ({"seed": -1}, "--seed")):  # fmt: skip
        with pytest.raises(ValueError, match=said):
            Request("no/such/workdir", ("a",), **fields)
    with pytest.raises(ValueError, match="sample needs a --prompt"):
        Request("no/such/workdir")


def test_info_lists_checkpoints_parameters_and_metrics(run, capsys):
    assert run_in_process(["info", f"--workdir={run}", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in info["checkpoints"]] == [2, 4]
    assert all(c["bytes"] > 0 for c in info["checkpoints"])
    by = info["parameters"]["by_component"]
    assert sum(by.values()) == info["parameters"]["total"]
    assert {"attention/w_q", "attention/w_k", "attention/w_v", "attention/w_o", "embed"} <= set(by)
    assert info["last_train_metrics"]["step"] == 4 and info["last_eval_metrics"]["eval"]
    assert run_in_process(["info", f"--workdir={run}"]) == 0  # for a person: one line per row, 5 digits
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("last train metrics: "))
    assert (
        line.startswith("last train metrics: step 4  loss ")
        and f"loss {info['last_train_metrics']['loss']:.5g}  " in line
    )


def test_python_load_gives_the_trained_model_ready_to_apply(run, caplog):
    with caplog.at_level(logging.WARNING, logger="absl"):
        model, params, config = qkvjax.load(str(run))
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # orbax's notices to a reader
    logits = model.apply({"params": params}, jnp.zeros((2, config.seq_len), jnp.int32))
    assert logits.shape == (2, config.seq_len, 256)
    assert sum(p.size for p in jax.tree.leaves(params)) == param_count(config.model)
    trained = flat(exported_params(run, 4))  # what the training loop wrote at its last step
    loaded = flat(params)
    assert loaded.keys() == trained.keys()
    for name, value in trained.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    fresh = jax.jit(model.init)(jax.random.PRNGKey(config.seed), jnp.zeros((1, 5), jnp.int32))["params"]
    fresh = flat(nn.meta.unbox(fresh))
    assert any(not np.array_equal(fresh[k], trained[k]) for k in trained)  # training moved them
    for bad in ("4", 4.0, True, -4):  # "4" once said "step 4 does not exist; available steps: [..., 4]"
        with pytest.raises(ValueError, match=rf"^step={re.escape(repr(bad))}; allowed: None \(the newest\) or an"):
            qkvjax.load(str(run), step=bad)


def test_convert_to_bilinear_is_exact_and_to_gqa_pools_heads(run, tmp_path):
    model, params, config = qkvjax.load(str(run))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, config.seq_len), 0, 256)
    before = model.apply({"params": params}, tokens)
    out = str(tmp_path / "bilinear")
    assert run_in_process(["convert", f"--workdir={run}", f"--out={out}", "--to=bilinear"]) == 0
    model_b, params_b, config_b = qkvjax.load(out)
    assert config_b.model.attention.scheme == "bilinear"
    np.testing.assert_allclose(model_b.apply({"params": params_b}, tokens), before, rtol=1e-4, atol=1e-4)

    n = config.model.attention.num_heads
    same_cfg, same = convert(config.model, params, num_kv_heads=n)  # K = N: nothing pooled, exactly the model
    np.testing.assert_array_equal(DecoderLM(same_cfg).apply({"params": same}, tokens), before)
    gqa_cfg, gqa = convert(config.model, params, num_kv_heads=1)
    w_k = params["block_0"]["attention"]["w_k"]
    np.testing.assert_allclose(gqa["block_0"]["attention"]["w_k"][:, 0], w_k.mean(axis=1), rtol=1e-6)
    assert gqa_cfg.attention.kv_heads == 1
    logits = DecoderLM(gqa_cfg).apply({"params": gqa}, tokens)
    # The expectation, built independently: the original model with every head's K and V kernels replaced by
    # the mean over its group (here all N heads) gives the same logits as the one pooled head shared by all.
    pooled = jax.tree.map(lambda x: x, params)
    for name, block in pooled.items():
        if name.startswith("block_"):
            for key in ("w_k", "w_v"):
                w = np.asarray(block["attention"][key])
                block["attention"][key] = np.repeat(w.mean(axis=1, keepdims=True), n, axis=1)
    np.testing.assert_allclose(logits, model.apply({"params": pooled}, tokens), rtol=2e-5, atol=2e-5)
    assert not np.allclose(logits, before, atol=1e-3)  # pooling four trained heads into one changes the model
    with pytest.raises(ValueError, match=r"no conversion from 'separate' to 'reformer_qk'"):
        convert(config.model, params, to="reformer_qk")  # unit keys and a self-mask: no least-squares form


def test_convert_to_mla_reports_errors_and_uptrains_from_its_config_json(run, tmp_path, capsys):
    out = tmp_path / "mla"
    assert run_in_process(["convert", f"--workdir={run}", f"--out={out}", "--to=mla", "--rank=8"]) == 0
    printed = capsys.readouterr().out
    errors = [float(x) for x in re.findall(r"relative error \|W - W_R\|_F / \|W\|_F = ([0-9.]+)", printed)]
    assert len(errors) == 2 and all(0 < e < 1 for e in errors), printed  # tiny: D = 32, full rank 32
    assert f"qkvjax train --config {out}/config.json --workdir {out}" in printed
    _, _, config = qkvjax.load(str(out))
    assert (config.model.attention.scheme, config.model.attention.kv_rank) == ("mla", 8)
    # uptraining: the converted run's own config.json, more steps
    assert (
        run_in_process(["train", f"--config={out}/config.json", f"--workdir={out}", "--config.train.num_steps=6"]) == 0
    )
    assert metrics(out)[-1]["step"] == 6


@pytest.mark.parametrize(
    "args,match",
    [
        (["eval", "--workdir={empty}"], r"holds no run"),
        (["eval", "--workdir={run}", "--step=3"], r"checkpoint step 3 does not exist .* available steps: \[2, 4\]"),
        (["sample", "--workdir={run}", "--prompt="], r"the prompt has no tokens"),
        (
            ["sample", "--workdir={run}", "--prompt=abc", "--num-tokens=40"],
            r"exceeds the model's context length max_len=32; ask for at most 29",
        ),
        (["sample", "--workdir={run}", "--prompt=abc", "--temperature=nan"], r"temperature=nan; allowed: a finite"),
        (["sample", "--workdir={run}", "--prompt=hi", "--temperature=-1"], r"temperature=-1.0; allowed: a finite"),
        (["sample", "--workdir={run}", "--prompt=hi", "--top-k=-2"], r"top_k=-2; allowed"),
        (["sample", "--workdir={run}", "--prompt=hi", "--top-p=0"], r"top_p=0.0; allowed: None or a number in \(0, 1"),
        (["sample", "--workdir={run}", "--prompt=hi", "--top-p=1.5"], r"top_p=1.5; allowed"),
        (["sample", "--workdir={run}", "--prompt=hi", "--min-p=-0.1"], r"min_p=-0.1; allowed: None or a number in \[0"),
        (
            ["sample", "--workdir={run}", "--prompt=hi", "--repetition-penalty=0"],
            r"repetition_penalty=0.0; allowed: None or a finite number > 0",
        ),
        (["sample", "--workdir={run}", "--prompt=hi", "--chat"], r"--chat: .* has no chat template.*allowed: a prompt"),
        (["sample", "--workdir={run}", "--prompt=hi", "--system=be brief"], r"--system .*allowed: with --chat only"),
        (["sample", "--workdir={run}", "--prompt=hi", "--messages=c.json"], r"--messages .*allowed: with --chat only"),
        (["sample", "--workdir={run}"], r"needs a --prompt TEXT \(or, with --chat, a --messages FILE or --interac"),
        (["sample", "--workdir={run}", "--interactive"], r"--interactive gives chat turns; allowed: with --chat only"),
        (["sample", "--workdir={run}", "--chat", "--interactive"], r"--chat: .* has no chat template"),
        (
            ["sample", "--workdir={run}", "--chat", "--interactive", "--prompt=hi"],
            r"--interactive reads the user's turns from standard input; allowed: without --prompt",
        ),
        (
            ["sample", "--workdir={run}", "--chat", "--interactive", "--messages=-"],
            r"--interactive reads .*; allowed: without --messages -",
        ),
        (["sample", "--workdir={run}", "--prompt=" + "x" * 40], r"the prompt has 40 tokens.*at most 31 tokens"),
        (["sample", "--workdir={run}", "--prompt=hi", "--num-samples=0"], r"--num-samples 0; allowed: an int >= 1"),
        (["eval", "--workdir={run}", "--stride=0"], r"stride=0; allowed: an int in \[1, seq_len=32\] \(the windows"),
        (
            ["sample", "--workdir={run}", "--prompt=hi", "--num-samples=3", "--temperature=0"],
            r"--num-samples 3 with --temperature 0 \(greedy: one continuation\); allowed: 1, or a temperature > 0",
        ),
        (["eval", "--workdir={run}", "--output={empty}/no/such/folder/r.json"], r"folder .* does not exist"),
        # found by giving every option of every command odd values (2026-11-30): the rows were made before any
        # check, filling the memory (10^12 references); a plot's name without a format was written elsewhere, as
        # NAME.png, under a message naming NAME; a folder given as a file was written into, or refused after the work
        (
            ["sample", "--workdir={run}", "--prompt=hi", "--prompt=ho", "--num-samples=1000000000000"],
            r"--num-samples 1000000000000 x 2 prompt\(s\): a decode cache of 2,000,000,000,000 rows x 32 positions "
            r"needs [\d,.]+ GiB .*; the device has [\d,.]+ GiB available; allowed: fewer rows",
        ),
        (["compare", "{run}", "--plot={empty}/curves"], r"--plot=.*/curves' names no image format; allowed: .*png"),
        (["compare", "{run}", "--plot={empty}"], r"--plot=.* is a folder; allowed: a file's path in it"),
        (["compare", "{run}", "--json={empty}"], r"--json=.* is a folder; allowed: a file's path in it"),
        (["analyze", "--workdir={run}", "--plot={empty}/heat"], r"--plot=.*/heat' names no image format"),
        (["eval", "--workdir={run}", "--output={empty}"], r"--output=.* is a folder; allowed: a file's path in it"),
        # eval's own --source-path and --data-dir skipped the config's checks: a codec error, array_record's traceback
        (["eval", "--workdir={run}", "--source-path=in\udcff.txt"], r"data.source_path='in\\udcff.txt'; allowed"),
        (["eval", "--workdir={run}", "--data-dir=td\udcff"], r"data.data_dir='td\\udcff'; allowed: UTF-8 text"),
    ],
)
def test_clear_errors(args, match, run, tmp_path, capsys):
    args = [a.format(run=run, empty=tmp_path) for a in args]
    assert run_in_process(args) == 2
    captured = capsys.readouterr()
    assert re.search(match, captured.err)
    assert captured.out == ""  # nothing (not the prompt) printed before the error


def test_an_output_file_is_the_old_one_or_the_new_one_never_a_part(run, tmp_path, monkeypatch, capsys):
    """``--json``, ``--output`` and ``--plot`` were opened in place: a full disk or a kill while writing left a part
    of the new file where the old one was. Now each is written beside it and renamed over it; ``/dev/null`` (not a
    regular file) is still written, not replaced."""
    import errno

    import matplotlib.figure

    out, plot = tmp_path / "rows.json", tmp_path / "curves.svg"
    out.write_text("old rows\n")
    plot.write_text("old plot\n")
    real = matplotlib.figure.Figure.savefig

    def full_disk(self, fname, **kwargs):
        with open(fname, "w") as f:
            f.write("<svg")
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    assert run_in_process(["compare", str(run), f"--json={out}", f"--plot={plot}"]) != 0
    assert plot.read_text() == "old plot\n" and json.loads(out.read_text())[0]["workdir"]  # the JSON came first
    assert sorted(os.listdir(tmp_path)) == ["curves.svg", "rows.json"]  # no temporary left beside them
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", real)
    assert run_in_process(["compare", str(run), f"--json={out}", f"--plot={plot}"]) == 0
    assert plot.read_text().startswith("<?xml") and sorted(os.listdir(tmp_path)) == ["curves.svg", "rows.json"]
    link = tmp_path / "latest.json"
    link.symlink_to(out)
    assert run_in_process(["compare", str(run), f"--json={link}"]) == 0
    assert link.is_symlink() and json.loads(out.read_text())[0]["workdir"]  # the link's file was replaced
    link.unlink()
    assert run_in_process(["eval", f"--workdir={run}", "--output=/dev/null"]) == 0
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    capsys.readouterr()


def test_a_replaced_file_is_flushed_to_disk_before_its_rename_and_the_rename_after(tmp_path, monkeypatch):
    """The rename over the old file published bytes still in the page cache: after a power loss a file system may
    keep the new name with no data (XFS; ext4 mounted without auto_da_alloc), so the metrics log a resume cuts back,
    config.json or a checkpoint's inventory could come back empty. The temporary's bytes are now flushed before the
    rename and the folder after it (a published output folder's too); a flush that fails (EIO: the bytes may not be
    there) leaves the old file, as any failed write does; a file system that cannot sync (EINVAL) is written as
    before."""
    import errno

    from qkvjax import workdir

    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    folder = os.path.realpath(tmp_path)
    target = os.path.join(folder, "metrics.jsonl")
    with open(target, "w") as f:
        f.write("old\n")
    workdir.write_text(target, "new\n")
    [tmp] = [e[1] for e in events if e[0] == "replace"]
    assert events == [("fsync", tmp), ("replace", tmp, target), ("fsync", folder)]
    assert open(target).read() == "new\n" and os.listdir(folder) == ["metrics.jsonl"]

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output error while writing .*metrics.jsonl"):
        workdir.write_text(target, "newer\n")
    assert open(target).read() == "new\n" and os.listdir(folder) == ["metrics.jsonl"]

    def cannot_sync(fd):  # a file system without fsync (EINVAL): written as before, not refused
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "fsync", cannot_sync)
    workdir.write_text(target, "newest\n")
    assert open(target).read() == "newest\n" and os.listdir(folder) == ["metrics.jsonl"]

    events.clear()
    monkeypatch.setattr(os, "fsync", fsync)
    with workdir.whole_or_absent(os.path.join(folder, "out"), "files") as staging:
        (staging / "a.txt").write_text("a")
    assert ("fsync", os.path.join(staging, "a.txt")) in events and events[-1] == ("fsync", folder)
    assert open(os.path.join(folder, "out", "a.txt")).read() == "a"


def test_json_to_dev_stdout_redirected_into_a_file_follows_the_table_instead_of_truncating_it(run, tmp_path):
    """``compare --json /dev/stdout > out.txt`` opened /dev/stdout again, which truncated out.txt: the table printed
    before the JSON was lost. The JSON now goes through the process's own descriptor, after the table."""
    import subprocess
    import sys

    out = tmp_path / "out.txt"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with open(out, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "qkvjax.cli", "compare", str(run), "--json=/dev/stdout"],
                              cwd=REPO, env=env, stdout=f, stderr=subprocess.PIPE, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    table, _, rest = text.partition("\n[")
    assert "scheme" in table and json.loads("[" + rest)[0]["workdir"] == str(run)


def test_a_prompt_of_bytes_that_are_not_utf8_is_bytes_to_a_byte_model_and_refused_by_a_text_tokenizer(
    run, tmp_path, capsys
):
    """Bytes on a command line that are not UTF-8 reach Python as the surrogates U+DC80-U+DCFF: ``sample --prompt``
    stopped on "'utf-8' codec can't encode characters in position 0-1: surrogates not allowed". A byte-level model
    now reads them as the bytes they were; a tokenizer of text, and any lone surrogate, is refused naming it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from qkvjax.data.tokenizer import ByteTokenizer, HFTokenizer

    assert ByteTokenizer().encode("ab\udcff\udcfe").tolist() == [97, 98, 255, 254]
    assert run_in_process(["sample", f"--workdir={run}", "--prompt=ab\udcff\udcfe", "--num-tokens=3"]) == 0
    assert run_in_process(["sample", f"--workdir={run}", "--prompt=a\ud800b"]) == 2
    assert "the text holds '\\ud800' at character 1, a lone surrogate; allowed: UTF-8 text" in capsys.readouterr().err
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    text = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert text.encode("a b").tolist() == [0, 1]
    for encode in (text.encode, text.encode_prompt):
        with pytest.raises(ValueError, match=r"^the text holds '\\udcff' at character 2, a byte that is not UTF-8"):
            encode("a \udcff")


def test_corrupted_checkpoint_names_the_step_and_the_file(run, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    data = copy / "checkpoints" / "4" / "state" / "ocdbt.process_0" / "d"
    victim = sorted(os.listdir(data))[0]
    os.remove(data / victim)
    with pytest.raises(ValueError, match=rf"checkpoint step 4 .*corrupted.*{victim}"):
        evaluate(str(copy), step=4)
    os.remove(copy / "checkpoints" / "2" / "state" / "_METADATA")
    with pytest.raises(ValueError, match=r"checkpoint step 2 .*_METADATA"):
        evaluate(str(copy), step=2)


def test_compare_puts_runs_side_by_side(run, tmp_path, small_text, data_dir, capsys):
    other = tmp_path / "gqa"
    overrides = {"train.num_steps": 2, "model.attention.scheme": "shared_kv", "model.attention.num_kv_heads": 2}
    assert run_in_process(train_args(other, small_text, data_dir, **overrides)) == 0
    capsys.readouterr()
    out_json, out_png = tmp_path / "c.json", tmp_path / "c.png"
    assert run_in_process(["compare", str(run), str(other), f"--json={out_json}", f"--plot={out_png}"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out_png}" in captured.err  # says where the picture went
    assert "note:" not in captured.err  # the same text, context and tokenizer: nothing to warn of
    table = captured.out.splitlines()
    assert table[0].split()[:3] == ["run", "scheme", "K"] and len(table) == 3
    rows = json.loads(out_json.read_text())
    first, second = rows
    assert (first["scheme"], first["kv_heads"], first["steps"]) == ("separate", 4, 4)
    assert (second["scheme"], second["kv_heads"], second["steps"]) == ("shared_kv", 2, 2)
    # shared_kv with half the kv heads caches a quarter of separate's bytes
    assert second["kv_cache_bytes_per_token"] * 4 == first["kv_cache_bytes_per_token"]
    assert first["params"] == param_count(qkvjax.load(str(run))[2].model)
    assert first["best_val_loss"] == min(r["loss"] for r in metrics(run, evals=True))
    assert [c["step"] for c in first["curve"]] == [2, 4]
    assert [c["step"] for c in first["train_curve"]] == [r["step"] for r in metrics(run)]  # the training loss too
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_draws_more_than_ten_runs_each_in_its_own_style(tmp_path):
    """matplotlib has ten colours: the eleventh run was drawn in the first one's, indistinguishable from it."""
    from qkvjax.compare import plot, run_style

    assert len({run_style(i) for i in range(40)}) == 40
    assert run_style(10)[0] == run_style(0)[0] and run_style(10)[1:] != run_style(0)[1:]
    curve = [{"step": s, "wall_s": 2.0 * s, "train_loss": 3.0 - s / 9, "val_loss": 3.1 - s / 9} for s in (1, 2, 3)]
    rows = [{"run": f"r{i}", "scheme": "separate", "kv_heads": 3, "last_val_loss": 2.8 + i / 100, "curve": curve,
             "train_curve": curve} for i in range(13)]  # fmt: skip
    plot(rows, str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_notes_runs_whose_losses_are_on_other_footings():
    from qkvjax.compare import differences

    def row(run, sha, seq_len=32, tokenizer=None):
        return {"run": run, "text_sha256": sha, "seq_len": seq_len, "tokenizer": tokenizer}

    assert differences([row("a", "f" * 64), row("b", "f" * 64), row("imported", None)]) == []
    (note,) = differences([row("a", "a" * 64), row("b", "b" * 64), row("c", "a" * 64)])
    assert note == ("note: these runs differ in text (aaaaaaaaaaaa: a, c; bbbbbbbbbbbb: b): their losses are not "
                    "directly comparable")  # fmt: skip
    notes = differences([row("a", None, 32), row("b", None, 64, "gpt2.json")])
    assert [n.split(" (")[0] for n in notes] == ["note: these runs differ in context", "note: these runs differ in "
                                                 "tokenizer"]  # fmt: skip


def test_every_cli_option_is_documented_with_its_default(capsys):
    import argparse

    from qkvjax.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, sp in sub.choices.items():
        undocumented = [a.option_strings for a in sp._actions if a.option_strings and a.dest != "help" and not a.help]
        assert not undocumented, (name, undocumented)
        with pytest.raises(SystemExit):
            sp.parse_args(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        formatter = sp._get_formatter()
        for action in sp._actions:
            if not action.option_strings or action.dest == "help":
                continue
            shown = " ".join((formatter._get_help_string(action) % {"default": action.default}).split())
            assert shown in text, (name, action.option_strings)
            assert shown.lower().count("default") <= 1, (name, shown)  # never "(default: x) (default: x)"
            if action.default is not None and action.default is not False and not action.required:  # 0 named too
                assert "default" in shown.lower(), (name, action.option_strings)  # a value is always named
                if "(default: " in shown:
                    assert f"(default: {action.default})" in shown, (name, shown)
    with pytest.raises(SystemExit):
        parser.parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"qkvjax {qkvjax.__version__}"


def test_convert_cli_to_k_equals_v_and_to_cla_prints_errors_and_the_cache_saved(run, tmp_path, capsys):
    for flags, line in ((["--to=shared_kv"], "layer 0: K = V keeps the value-output maps W^V W^O to a relative "),
                        (["--cla=2"], "layer 1 reads layer 0's K/V: relative error of its keys ")):  # fmt: skip
        out = tmp_path / flags[0].strip("-").replace("=", "_")
        assert run_in_process(["convert", f"--workdir={run}", f"--out={out}", *flags]) == 0
        printed = capsys.readouterr().out
        assert line in printed and "KV cache: " in printed and "(0.50x)" in printed
        assert run_in_process(["eval", f"--workdir={out}"]) == 0  # the converted run restores and evaluates
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"] > 0
