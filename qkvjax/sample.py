"""Generation with the decode cache: one prefill call for the prompt, then one jitted call per new token."""

from __future__ import annotations

import codecs
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from qkvjax.models.lm import DecoderLM


def encode(text: str) -> np.ndarray:
    """Byte-level tokens of a prompt; an empty prompt is refused (there is nothing to condition on)."""
    tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    if tokens.size == 0:
        raise ValueError("the prompt has no tokens; pass a non-empty --prompt")
    return tokens


def empty_cache(model: DecoderLM, batch: int) -> dict:
    """A zero cache of the model's full context, built from shapes alone (no forward pass)."""
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((batch, model.config.max_len), jnp.int32), decode=True)
    )["cache"]
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def cache_bytes(cache) -> int:
    """Bytes of the cached keys/values (the index counters excluded)."""
    return sum(x.nbytes for x in jax.tree.leaves(cache) if x.ndim > 0)


def pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None) -> jax.Array:
    """Greedy when ``temperature`` is 0, else a sample from softmax(logits / temperature) over the top k."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def generate(
    model: DecoderLM,
    params,
    prompt: np.ndarray,
    num_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 40,
    seed: int = 0,
    on_token: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, dict]:
    """Continues ``prompt`` (1-D int tokens) by ``num_tokens``; returns the new tokens and timing statistics."""
    max_len = model.config.max_len
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens}; allowed: >= 1")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"temperature={temperature}; allowed: a finite number >= 0 (0 is greedy)")
    if len(prompt) >= max_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens, but the model's context is max_len={max_len} tokens in all: "
            f"shorten the prompt to at most {max_len - 1} tokens"
        )
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}; allowed: None or >= 1")
    if len(prompt) + num_tokens > max_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + num_tokens ({num_tokens}) = {len(prompt) + num_tokens} exceeds the "
            f"model's context length max_len={max_len}; ask for at most {max_len - len(prompt)} tokens"
        )

    def apply(params, cache, tokens):
        logits, mutated = model.apply({"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"])
        return logits[:, -1], mutated["cache"]

    @functools.partial(jax.jit, donate_argnums=1)  # the cache is updated in place
    def prefill(params, cache, tokens, key):
        logits, cache = apply(params, cache, tokens)
        return pick(logits, key, temperature, top_k), cache

    @functools.partial(jax.jit, donate_argnums=1)
    def step(params, cache, token, key):
        logits, cache = apply(params, cache, token[:, None])
        return pick(logits, key, temperature, top_k), cache

    base = jax.random.PRNGKey(seed)
    start = time.perf_counter()
    token, cache = prefill(params, empty_cache(model, 1), jnp.asarray(prompt)[None], jax.random.fold_in(base, 0))
    out = [int(token[0])]
    step = step.lower(params, cache, token, base).compile()  # compile before the clock starts
    first = time.perf_counter()
    if on_token:
        on_token(out[-1])
    for i in range(1, num_tokens):
        token, cache = step(params, cache, token, jax.random.fold_in(base, i))
        out.append(int(token[0]))  # the host needs each token to stream it
        if on_token:
            on_token(out[-1])
    end = time.perf_counter()
    stats = {
        "prompt_tokens": int(len(prompt)),
        "new_tokens": num_tokens,
        "prefill_and_compile_s": first - start,  # the prompt's forward pass and both compiles
        "tokens_per_s": (num_tokens - 1) / (end - first) if num_tokens > 1 else float("nan"),
        "cache_bytes": cache_bytes(cache),
    }
    return np.asarray(out, np.int32), stats


def byte_streamer(write: Callable[[str], None]) -> Callable[[int], None]:
    """Writes bytes as text as soon as they form complete UTF-8 characters."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return lambda token: write(decoder.decode(bytes([token])))
