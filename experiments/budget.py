"""The bill of a sweep before it runs: tokens/s of a config's train step, and a run's wall time from it.

Both harnesses (``scaling.py``, ``compare_schemes.py``) print what is left to train and how long it should take
before anything trains, from tokens/s measured by finished runs where there are some, else by :func:`probe`.
"""

from __future__ import annotations

import time

from qkvjax.config import Config
from qkvjax.models.lm import train_flops_per_token

OVERHEAD_S = 25.0  # per run: compiling, the final evaluation over the whole split, checkpoints


def probe(config: Config, steps: int = 4) -> float:
    """Tokens/s of ``config``'s jitted train step on random bytes, after one compiling step."""
    import jax
    import numpy as np

    from qkvjax.models.lm import DecoderLM
    from qkvjax.train.state import create_state, make_optimizer
    from qkvjax.train.step import make_train_step

    model, tx = DecoderLM(config.model), make_optimizer(config.train)
    state = create_state(model, config, tx, None)
    step = jax.jit(make_train_step(model, tx, 1), donate_argnums=0)
    rng = np.random.default_rng(0)
    shape = (config.train.batch_size, config.seq_len)
    batch = {k: jax.numpy.asarray(rng.integers(0, 256, shape, dtype=np.int32)) for k in ("inputs", "targets")}
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return steps * config.train.batch_size * config.seq_len / (time.perf_counter() - start)


def run_seconds(config: Config, tokens_per_s: float, measured_on: Config | None = None) -> float:
    """Wall seconds of one run of ``config`` at ``tokens_per_s`` (measured on ``measured_on``; scaled by the two
    models' training FLOPs per token when another model was measured), plus :data:`OVERHEAD_S`."""
    tokens = config.train.num_steps * config.train.batch_size * config.seq_len
    if measured_on is not None:
        tokens_per_s *= train_flops_per_token(measured_on.model, measured_on.seq_len) / train_flops_per_token(
            config.model, config.seq_len
        )
    return tokens / tokens_per_s + OVERHEAD_S


def hms(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 5400 else f"{seconds / 60:.0f} min"
