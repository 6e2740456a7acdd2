"""Hardware reference numbers measured on the spot: the matmul peak that MFU is quoted against."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def measure_peak_flops(
    dtype: str = "float32", size: int | None = None, repeats: int = 10, budget_s: float | None = None
) -> float:
    """FLOP/s of a large jitted ``jnp.dot`` on the default device: the best of ``repeats`` timed calls after a
    warm-up; with ``budget_s``, of as many as fit in that many seconds (three at least, unless ``repeats`` asks
    fewer).

    A square matmul of side 2048 on CPU, 8192 on an accelerator, in the compute dtype: the practical peak
    that model FLOPs utilisation (Chowdhery et al. 2022) is measured against. On an accelerator ten calls take
    milliseconds; on a 2-core CPU each takes 0.2-0.5 s, which a training run's start bounds with ``budget_s``.
    """
    device = jax.devices()[0]
    n = size or (2048 if device.platform == "cpu" else 8192)
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.dtype(dtype))
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.dtype(dtype))
    matmul = jax.jit(jnp.dot)
    for _ in range(2):  # compile, then let the thread pool and caches settle
        matmul(a, b).block_until_ready()
    times: list[float] = []
    deadline = time.perf_counter() + (float("inf") if budget_s is None else budget_s)
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() < deadline):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2.0 * n**3 / min(times)
