"""Generation with the functional decode cache: one prefill call for the prompts (of any lengths), then the new
tokens, on the device in one call or one call per token when streaming."""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from qkvjax import checks
from qkvjax.data.tokenizer import ByteTokenizer
from qkvjax.models.lm import DecodeCache, DecoderLM


def encode(text: str, tokenizer=None, add_special_tokens: bool = True) -> np.ndarray:
    """Tokens of a prompt (byte-level unless a :mod:`qkvjax.data.tokenizer` is given, whose special tokens a prompt
    gets as in transformers: Llama's BOS; none for a rendered chat template, which writes its own); an empty prompt
    is refused (there is nothing to condition on)."""
    tokenizer = tokenizer or ByteTokenizer()
    tokens = tokenizer.encode_prompt(text) if add_special_tokens else tokenizer.encode(text)
    if tokens.size == 0:
        raise ValueError("the prompt has no tokens; pass a non-empty --prompt")
    return tokens


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a token is drawn from a row's logits z (..., V): greedy (argmax) when ``temperature`` is 0, else a draw
    from softmax(z / temperature) over what the cuts keep, in this order: only the ``top_k`` largest; then the
    nucleus of ``top_p`` (Holtzman et al. 2020, arXiv:1904.09751), the fewest largest that hold at least ``top_p``
    of the probability left (the largest always kept; ties with the last one kept stay); then only the tokens at
    least ``min_p`` times as likely as the likeliest (min-p sampling, Nguyen et al. 2024, arXiv:2407.01082:
    p_i >= min_p p_max, i.e. z_i >= z_max + log min_p, whatever the earlier cuts left). ``vocab_limit``: only ids
    below it, greedy included (text that is bytes needs ids < 256 from a table padded wider).
    ``repetition_penalty`` p, before all of them, greedy included (CTRL's penalty, Keskar et al. 2019,
    arXiv:1909.05858, as transformers' ``repetition_penalty``): the logit of every id the row has seen so far (its
    prompt, the tokens its cache holds, those drawn) becomes z / p where z > 0 and z p where not, so p > 1 makes a
    seen token less likely whatever its sign. None turns a cut or the penalty off. Hashable: the compiled decode
    programs are kept per model and settings."""

    temperature: float = 0.8
    top_k: int | None = 40
    top_p: float | None = None
    min_p: float | None = None
    vocab_limit: int | None = None
    repetition_penalty: float | None = None

    LABEL: ClassVar[str] = ""  # errors name the settings as generate's arguments: "top_p=1.5; allowed: ..."

    def __post_init__(self):
        checks.number(self, "temperature", low=0, allowed="a finite number >= 0 (0 is greedy)")
        checks.integer(self, "top_k", none="")
        checks.number(
            self, "top_p", low=0, high=1, open_low=True, none="", allowed="a number in (0, 1] (1 keeps every token)"
        )
        checks.number(self, "min_p", low=0, high=1, none="", allowed="a number in [0, 1] (0 keeps every token)")
        checks.integer(self, "vocab_limit", none="", allowed="an integer >= 1 (ids below it are drawn)")
        checks.number(self, "repetition_penalty", low=0, open_low=True, none="",
                      allowed="a finite number > 0 (1 changes nothing, above 1 penalises the ids seen)")  # fmt: skip

    def filter(self, logits: jax.Array) -> jax.Array:
        """The logits a token is drawn from, (..., V) -> (..., V): divided by the temperature (> 0), the cut ones
        set to -inf."""
        limit, top_k, top_p, min_p = self.vocab_limit, self.top_k, self.top_p, self.min_p
        if limit is not None and limit < logits.shape[-1]:
            logits = jnp.where(jnp.arange(logits.shape[-1]) < limit, logits, -jnp.inf)
        logits = logits / self.temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if top_p is not None and top_p < 1.0:
            ranked = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)  # (..., V), largest first
            probs = jax.nn.softmax(ranked.astype(jnp.float32), axis=-1)
            above = jnp.cumsum(probs, axis=-1) - probs  # the mass of the tokens ranked above each
            # kept: a token while the mass above it is short of top_p; the smallest kept logit is the cut
            cut = jnp.min(jnp.where(above < top_p, ranked, jnp.inf), axis=-1, keepdims=True)
            logits = jnp.where(logits < cut, -jnp.inf, logits)
        if min_p is not None and min_p > 0.0:
            floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(jnp.float32(min_p))
            logits = jnp.where(logits < floor, -jnp.inf, logits)
        return logits

    def penalised(self, logits: jax.Array, seen: jax.Array | None) -> jax.Array:
        """``logits`` (..., V) with the repetition penalty applied to the ids ``seen`` (..., V) bool marks; as
        given where there is no penalty or nothing is marked."""
        p = self.repetition_penalty
        if p is None or seen is None:
            return logits
        return jnp.where(seen, jnp.where(logits > 0, logits / p, logits * p), logits)

    def pick(self, logits: jax.Array, key: jax.Array, seen: jax.Array | None = None) -> jax.Array:
        """The token drawn from each row of ``logits`` (..., V) -> (...,) int32; ``key`` unused when greedy;
        ``seen`` (..., V) bool: the ids the repetition penalty applies to (None: none)."""
        logits = self.penalised(logits, seen)
        if self.temperature == 0.0:  # the largest logit below the limit; the cuts keep it anyway
            greedy = Sampling(1.0, None, vocab_limit=self.vocab_limit)
            return jnp.argmax(greedy.filter(logits), axis=-1).astype(jnp.int32)
        return jax.random.categorical(key, self.filter(logits), axis=-1).astype(jnp.int32)


def describe_sampling(settings: dict) -> str:
    """Sampling fields as a reader is told them: 'temperature 0.6, top_k off, top_p 0.95'."""
    return ", ".join(f"{k} {'off' if v is None else v}" for k, v in settings.items())


def check_request(model: DecoderLM, prompts: list[np.ndarray], num_tokens: int, held=None) -> None:
    """Refuses in one line what :func:`generate_batch` cannot do with these prompts (a :class:`Sampling` checks
    its own settings); ``held`` (B,): the tokens a cache already holds before each prompt (they count against the
    context too)."""
    max_len = model.config.max_len
    if not prompts:
        raise ValueError("no prompts; pass at least one")
    checks.integer_value("num_tokens", num_tokens)
    for i, prompt in enumerate(prompts):
        which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
        check_ids(model, prompt, which)
        before = 0 if held is None else int(held[i])
        if before:  # a continuation: the tokens the cache holds come first
            which = f"{which} after the {before} tokens its cache holds"
        if before + len(prompt) >= max_len:
            raise ValueError(
                f"{which} has {before + len(prompt)} tokens, but the model's context is max_len={max_len} tokens in "
                f"all: shorten it to at most {max_len - 1} tokens"
            )
        if before + len(prompt) + num_tokens > max_len:
            n = before + len(prompt)
            raise ValueError(
                f"{which} ({n} tokens) + num_tokens ({num_tokens}) = {n + num_tokens} exceeds the model's context "
                f"length max_len={max_len}; ask for at most {max_len - n} tokens"
            )


def _stop_set(stop_ids) -> set[int]:
    """``stop_ids`` as a set of ints, or one line saying they are not token ids. An id past the vocabulary is
    kept: no row draws it (an imported model's ``eos_token_id`` can lie past a cut table)."""
    ids = np.asarray(stop_ids, object).ravel()
    if isinstance(stop_ids, str | bytes) or not all(checks.is_integer(i) and i >= 0 for i in ids):
        raise ValueError(f"stop_ids={stop_ids!r}; allowed: a sequence of token ids (integers >= 0)")
    return {int(i) for i in ids}


def as_ids(tokens, what: str) -> np.ndarray:
    """``tokens`` as a 1-D int32 array, or one line saying why not (a float or a batch would be cast or mis-read)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{what} is a {arr.dtype} array of shape {arr.shape}; allowed: 1-D integer token ids (one "
                         "array per prompt)")  # fmt: skip
    return arr.astype(np.int32)


def check_ids(model: DecoderLM, tokens: np.ndarray, what: str) -> None:
    """Refuses in one line token ids outside the model's vocabulary (an embedding lookup would clamp them)."""
    vocab = model.config.vocab_size
    bad = tokens[(tokens < 0) | (tokens >= vocab)]
    if bad.size:
        raise ValueError(f"{what} has token id {int(bad[0])}; allowed: ids in [0, {vocab}), the model's vocabulary")


@functools.lru_cache(maxsize=8)
def _programs(model: DecoderLM, sampling: Sampling, scan_unroll: int) -> tuple:
    """The jitted prefill, one-token step and on-device loops of a model and its sampling settings, made once and
    kept (a model is hashable by its config): a second call with the same shapes, as a conversation's next turn,
    reuses their compiled programs instead of compiling them again. ``seen`` (B, V) bool, the ids each row has
    seen, goes through every program beside the cache: None (an empty tree, nothing compiled for it) without a
    repetition penalty."""

    def draw(logits, key, seen):  # (B, V) -> (B,), the drawn id marked seen for the next draw
        token = sampling.pick(logits, key, seen)
        return token, None if seen is None else seen.at[jnp.arange(token.shape[0]), token].set(True)

    @functools.partial(jax.jit, donate_argnums=(1, 5))  # the cache and the seen ids are updated in place
    def prefill(params, cache, tokens, lengths, key, seen):
        logits, cache = model.apply({"params": params}, tokens, cache=cache, num_valid=lengths)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # each row's last prompt token
        return *draw(last, key, seen), cache

    def one(params, cache, token, key, seen):
        logits, cache = model.apply({"params": params}, token[:, None], cache=cache)
        return *draw(logits[:, -1], key, seen), cache

    step = jax.jit(one, donate_argnums=(1, 4))

    @functools.partial(jax.jit, donate_argnums=1)  # the seen ids are not returned: nothing to donate them to
    def decode_all(params, cache, token, keys, seen):
        def body(carry, key):
            token, cache, seen = carry
            token, seen, cache = one(params, cache, token, key, seen)
            return (token, cache, seen), token

        (_, cache, _), tokens = jax.lax.scan(body, (token, cache, seen), keys, unroll=min(scan_unroll, len(keys)))
        return tokens.T, cache, len(keys)  # (num_tokens - 1, B) -> (B, num_tokens - 1)

    @functools.partial(jax.jit, donate_argnums=1)
    def decode_until_stop(params, cache, token, keys, seen, stop):
        # the scan above, ending once every row has drawn a stop id: a while loop with one more condition
        def cond(carry):
            i, _, _, _, done, _ = carry
            return (i < len(keys)) & ~jnp.all(done)

        def body(carry):
            i, token, cache, seen, done, out = carry
            token, seen, cache = one(params, cache, token, keys[i], seen)
            return i + 1, token, cache, seen, done | jnp.isin(token, stop), out.at[:, i].set(token)

        out = jnp.zeros((token.shape[0], len(keys)), jnp.int32)  # (B, num_tokens - 1); after every row's stop: 0
        start = (0, token, cache, seen, jnp.isin(token, stop), out)
        i, _, cache, _, _, out = jax.lax.while_loop(cond, body, start)
        return out, cache, i

    return prefill, step, decode_all, decode_until_stop


KEPT_IN_PARAM_DTYPE = ("rel_bias",)  # 2-D parameters the model reads in its parameter dtype, not cast to compute


def compute_params(model: DecoderLM, params):
    """``params`` with every weight matrix (two dimensions or more) cast to the model's compute dtype once, as each
    layer casts it at every call (``astype(dtype)`` of a kernel, an embedding's rows, the unembedding): the same
    function, bit for bit, and a decoding loop no longer reads float32 weights and converts them per token (a
    bfloat16 model's matmuls then read half the bytes). Norm scales, biases and other vectors stay as they are:
    the model computes with them in their own dtype. A model whose compute and parameter dtypes agree is returned
    unchanged."""
    dtype = model.config.dtype
    if dtype == model.config.param_dtype:
        return params

    def cast(path, leaf):
        name = str(getattr(path[-1], "key", path[-1]))
        matrix = getattr(leaf, "ndim", 0) >= 2 and jnp.issubdtype(leaf.dtype, jnp.floating)
        return leaf.astype(dtype) if matrix and name not in KEPT_IN_PARAM_DTYPE else leaf

    return jax.tree_util.tree_map_with_path(cast, params)


def generate_batch(
    model: DecoderLM,
    params,
    prompts: list[np.ndarray],
    num_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    top_p: float | None = None,
    min_p: float | None = None,
    seed: int = 0,
    on_token: Callable[[int], None] | None = None,
    vocab_limit: int | None = None,
    repetition_penalty: float | None = None,
    scan_unroll: int = 1,
    stop_ids: Sequence[int] = (),
    prompt_bucket: int = 1,
    cache: DecodeCache | None = None,
    share_prefix: bool = False,
    cached_tokens: Sequence[np.ndarray] | None = None,
) -> tuple[np.ndarray, dict]:
    """Continues each prompt (1-D int tokens, lengths may differ) by ``num_tokens``, all rows in one batch.

    The prompts are right-padded into one prefill call; each row's cache then holds exactly its own prompt
    (:class:`~qkvjax.models.lm.DecodeCache` keeps a length per row), so a row decodes as it would alone. With
    ``on_token`` (one prompt only) every token is streamed as it is made, one jitted call per token; otherwise
    all tokens are made on the device in one call (``lax.scan``), with no host round trip per token.
    ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``vocab_limit``, ``repetition_penalty``: what a token is
    drawn from, the fields of a :class:`Sampling` (``temperature`` 0 is greedy; ``**dataclasses.asdict(sampling)``
    passes one). The penalty's seen ids are each row's prompt, the tokens it drew, and with ``cache``,
    ``cached_tokens``: the tokens row b's cache holds (``lengths[b]`` of them, needed with the penalty), as
    transformers' ``generate`` penalises every id of ``input_ids``.
    The tokens are made in one program whose layers pick the key prefix they read at run time (a ``lax.switch`` per
    layer and token; why not fixed prefixes: benchmarks/README.md, "GPU: the third visit").
    ``scan_unroll``: decode steps per iteration of the on-device loop (``lax.scan``'s ``unroll``): fewer loop
    iterations for a longer compile (the loop with stop ids takes one); measured slower so far: 8 on an H200 was
    x0.36 the tokens/s of 1 at batch 1 (benchmarks/README.md, "GPU: the fourth visit"), so the default is 1.
    ``stop_ids``: a row ends at the first of them it draws (an imported model's ``eos_token_id``, as transformers'
    ``generate`` stops): its later places hold that id, ``stats["lengths"]`` counts each row's tokens before it,
    and ``on_token`` is not called for it; both loops end once every row has stopped (the batched one is then a
    ``lax.while_loop``, the scan without stop ids; a row that stopped before the others goes on drawing,
    discarded: rows decode independently).
    ``prompt_bucket``: the prefill's width is the longest prompt rounded up to a multiple of it (at most the
    context), so prompts of other lengths in the same bucket reuse one compiled prefill (a conversation's turns).
    The compiled programs are kept per model and sampling settings (:func:`_programs`): a second call with the
    same shapes compiles nothing.
    ``cache``: a :class:`~qkvjax.models.lm.DecodeCache` of B rows from an earlier call (``stats["cache"]``, or
    :meth:`~qkvjax.models.lm.DecodeCache.rewound` to a prefix of it) whose row b holds ``lengths[b]`` tokens; each
    prompt then holds only the tokens after them (a conversation's new turn after the ones it has already read),
    and only those are run through the prefill. The cache is consumed (donated to the call); ``stats["cache"]`` is
    the one after it, whose row b holds its earlier tokens, its prompt and every new token it fed back (all but the
    last drawn; streaming, up to the first stop id; in a batch, a row that stopped early went on feeding what it drew,
    which the returned tokens show as its stop id: :meth:`~qkvjax.models.lm.DecodeCache.rewound` it to its own end
    before continuing it). Without ``cache``, a fresh one; ``stats`` then holds none.
    ``share_prefix`` (without ``cache``): the tokens every prompt begins with (all but each row's last: a row needs
    one to draw from) are run through the model once, in a batch of one, and its cache copied to every row
    (:meth:`~qkvjax.models.lm.DecodeCache.select`); the prefill then reads only what follows them: n samples of
    one prompt, or prompts behind one system turn, read the shared part once instead of B times, as a server's
    prefix cache does, for one more prefill to compile. ``stats["shared_prefix"]``: the tokens shared (0: none).
    Returns the new tokens (B, num_tokens) and statistics.
    """
    prompts = [as_ids(p, "the prompt" if len(prompts) == 1 else f"prompt {i}") for i, p in enumerate(prompts)]
    sampling = Sampling(temperature, top_k, top_p, min_p, vocab_limit, repetition_penalty)
    held = _check_generate(model, prompts, num_tokens, cache, cached_tokens, scan_unroll, prompt_bucket, seed,
                           on_token, share_prefix)  # fmt: skip
    seen = _seen(model, prompts, held, cached_tokens) if repetition_penalty is not None else None
    stops = _stop_set(stop_ids)
    shared, lengths, padded = _prefill_layout(model, prompts, held, share_prefix, prompt_bucket)
    programs, params = _programs(model, sampling, scan_unroll), compute_params(model, params)  # weights cast once
    base = jax.random.PRNGKey(seed)
    start = time.perf_counter()
    given = cache is not None
    token, seen, cache = _prefill(model, programs[0], params, prompts, cache, shared, lengths, padded, base, seen,
                                  prompt_bucket)  # fmt: skip
    tokens, cache, made, first, end = _decode(programs, params, cache, token, seen, base, num_tokens, stops, on_token)
    tokens, ends = _cut_at_stops(tokens, stops)
    b = len(prompts)
    stats = {
        "prompt_tokens": [len(p) for p in prompts],
        "shared_prefix": shared,
        "new_tokens": num_tokens,
        "lengths": ends,  # each row's new tokens before its stop id (num_tokens: none drawn)
        "decode_steps": made,  # tokens per row made: fewer than new_tokens once every row has stopped
        "prefill_and_compile_s": first - start,  # the prompts' forward pass and the compiles
        "tokens_per_s": b * (made - 1) / (end - first) if made > 1 else float("nan"),
        "cache_bytes": cache.nbytes,
    }
    if given:
        stats["cache"] = cache
    return tokens, stats


def _check_generate(model, prompts, num_tokens, cache, cached_tokens, scan_unroll, prompt_bucket, seed, on_token,
                    share_prefix) -> np.ndarray | None:  # fmt: skip
    """:func:`generate_batch`'s refusals, before anything compiles; returns the tokens each row's ``cache`` holds
    already (None without one)."""
    held = None if cache is None else np.asarray(cache.lengths)
    if held is not None:
        want = jax.eval_shape(lambda: DecodeCache.empty(model.config, len(prompts)))
        if jax.tree.map(lambda x: (x.shape, x.dtype), cache) != jax.tree.map(lambda x: (x.shape, x.dtype), want):
            shapes = f"{len(held)} rows" if len(held) != len(prompts) else "other shapes"
            raise ValueError(f"the cache has {shapes}; allowed: DecodeCache.empty(model.config, {len(prompts)}) or "
                             "a cache a call with as many prompts returned")  # fmt: skip
    check_request(model, prompts, num_tokens, held)
    _check_cached(model, held, cached_tokens)
    for name, value, unit in (("scan_unroll", scan_unroll, "decode steps per loop iteration"),
                              ("prompt_bucket", prompt_bucket, "the prefill's width a multiple of it")):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; allowed: an int >= 1 ({unit})")
    checks.seed("seed", seed)
    if on_token is not None and len(prompts) > 1:
        raise ValueError("on_token streams one prompt; pass one prompt, or no on_token for several")
    if share_prefix and held is not None:
        raise ValueError("share_prefix reads the prompts' common start into a fresh cache; allowed: without cache")
    return held


def _prefill_layout(model, prompts, held, share_prefix: bool, prompt_bucket: int):
    """``(shared, lengths, padded)``: the tokens every prompt begins with that are read once (0 without
    ``share_prefix``), each row's length after them, and those rows right-padded to the bucketed width (each row's
    length is passed: the padding is never read)."""
    shared = _common_prefix(prompts) if share_prefix else 0
    rest = [p[shared:] for p in prompts]  # what the batched prefill reads after the shared start
    lengths = np.array([len(p) for p in rest], np.int32)
    held_max = shared if held is None else int(held.max())
    room = model.config.max_len - held_max  # a wider prefill would overflow a row
    if lengths.max() > room:  # one prefill writes the longest prompt's width after every row's cached tokens
        raise ValueError(f"the longest prompt has {lengths.max()} tokens and a cache holds {held_max}: together "
                         f"over max_len={model.config.max_len}; allowed: those rows in separate calls")  # fmt: skip
    width = min(room, -(-int(lengths.max()) // prompt_bucket) * prompt_bucket)
    padded = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(rest):
        padded[i, : len(p)] = p
    return shared, lengths, padded


def _prefill(model, prefill, params, prompts, cache, shared, lengths, padded, base, seen, prompt_bucket):
    """The shared start once (its cache copied to every row; the token it draws is not used), then the batched
    prefill; returns the first new token of each row, the penalty's seen ids and the cache."""
    b = len(prompts)
    if shared:
        start_width = min(model.config.max_len, -(-shared // prompt_bucket) * prompt_bucket)  # bucketed as below
        head = np.zeros((1, start_width), np.int32)
        head[0, :shared] = prompts[0][:shared]
        _, _, one = prefill(params, DecodeCache.empty(model.config, 1), jnp.asarray(head), jnp.asarray([shared]), base,
                            None)  # fmt: skip
        cache = one.select([0] * b)
    cache = cache if cache is not None else DecodeCache.empty(model.config, b)
    return prefill(params, cache, jnp.asarray(padded), jnp.asarray(lengths), jax.random.fold_in(base, 0), seen)


def _decode(programs, params, cache, token, seen, base, num_tokens: int, stops: set, on_token):
    """The tokens after the first: streamed one jitted call per token (``on_token``), else all on the device in one
    call (a scan, or a while loop that ends once every row drew a stop id). Returns ``(tokens (B, num_tokens),
    cache, tokens made per row, the clock after compiling, the clock at the end)``."""
    _, step, decode_all, decode_until_stop = programs
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(1, num_tokens)) if num_tokens > 1 else None
    out = [np.asarray(token)]
    run = None  # compiled before the clock starts (the scan's length is static)
    stop = (jnp.asarray(sorted(stops), jnp.int32),) if stops else ()
    if num_tokens > 1:
        args = (keys[0], seen) if on_token else (keys, seen, *stop)
        run = (step if on_token else decode_until_stop if stops else decode_all).lower(params, cache, token, *args)
        run = run.compile()
    first = time.perf_counter()
    if on_token:
        for i in range(num_tokens):
            if i > 0:
                token, seen, cache = run(params, cache, token, keys[i - 1], seen)
                out.append(np.asarray(token))  # the host needs each token to stream it
            if int(out[-1][0]) in stops:
                break
            on_token(int(out[-1][0]))
        tokens = np.stack(out + [out[-1]] * (num_tokens - len(out)), axis=1)  # after a stop: the stop id
        made = len(out)
    elif run is not None:
        rest, cache, steps = run(params, cache, token, keys, seen, *stop)
        tokens = np.concatenate([out[0][:, None], np.asarray(rest)], axis=1)
        made = 1 + int(steps)  # the prefill's token too
    else:
        tokens, made = out[0][:, None], 1
    return tokens, cache, made, first, time.perf_counter()


def _cut_at_stops(tokens: np.ndarray, stops: set) -> tuple[np.ndarray, list[int]]:
    """Each row's places from its first stop id on hold that id; and each row's tokens before it."""
    tokens = np.array(tokens, np.int32)  # a writable copy
    ends = [tokens.shape[1]] * len(tokens)
    for r in range(len(tokens)):
        hits = np.flatnonzero(np.isin(tokens[r], list(stops)))
        if hits.size:
            ends[r] = int(hits[0])
            tokens[r, ends[r] :] = tokens[r, ends[r]]
    return tokens, ends


def _check_cached(model: DecoderLM, held, cached_tokens) -> None:
    """Refuses in one line ``cached_tokens`` that are not the tokens the cache's rows hold (``held``: how many)."""
    if cached_tokens is None:
        return
    if held is None:
        raise ValueError("cached_tokens are the tokens a cache holds; allowed: with cache only")
    if len(cached_tokens) != len(held):
        raise ValueError(f"cached_tokens has {len(cached_tokens)} rows, the cache {len(held)}; allowed: one a row")
    for b, earlier in enumerate(cached_tokens):
        if len(earlier) != held[b]:
            raise ValueError(f"cached_tokens[{b}] has {len(earlier)} tokens, but its cache row holds {held[b]}; "
                             "allowed: the tokens it holds")  # fmt: skip
        check_ids(model, np.asarray(earlier, np.int32), f"cached_tokens[{b}]")


def _seen(model: DecoderLM, prompts: list[np.ndarray], held, cached_tokens) -> jax.Array:
    """(B, V) bool: the ids each row has seen before its first draw, for the repetition penalty: its prompt and,
    with a cache, the tokens it holds (``cached_tokens``, required then)."""
    if held is not None and cached_tokens is None:
        raise ValueError("repetition_penalty with a cache penalises the tokens it holds too; allowed: pass them as "
                         "cached_tokens (row b's lengths[b] tokens)")  # fmt: skip
    seen = np.zeros((len(prompts), model.config.vocab_size), bool)
    for b, prompt in enumerate(prompts):
        seen[b, prompt] = True
        if cached_tokens is not None:
            seen[b, np.asarray(cached_tokens[b], np.int32)] = True
    return jnp.asarray(seen)


def _common_prefix(prompts: list[np.ndarray]) -> int:
    """How many tokens every prompt begins with, all but each row's last (the prefill draws from it); 0 for one
    prompt (nothing to share)."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts) - 1
    first = prompts[0][:n]
    for p in prompts[1:]:
        same = np.flatnonzero(p[:n] != first)
        n = int(same[0]) if same.size else n
        first = first[:n]
    return n


def generate(model: DecoderLM, params, prompt: np.ndarray, num_tokens: int, **kw) -> tuple[np.ndarray, dict]:
    """One prompt: :func:`generate_batch` with a batch of one; returns the new tokens (num_tokens,)."""
    tokens, stats = generate_batch(model, params, [prompt], num_tokens, **kw)
    stats["prompt_tokens"] = stats["prompt_tokens"][0]
    stats["lengths"] = stats["lengths"][0]
    return tokens[0], stats
