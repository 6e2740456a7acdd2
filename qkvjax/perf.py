"""The peak that MFU is quoted against: a device's datasheet figure where it is known, else a matmul measured on
the spot (:func:`measure_peak_flops`, always printed beside it as the practical ceiling).

MFU (Chowdhery et al. 2022, appendix B) is model FLOPs over peak FLOPs. qkvjax quotes it the way nanoGPT's
``estimate_mfu`` and PaLM count the model's FLOPs (:func:`qkvjax.models.lm.mfu_flops_per_token`: 6 N plus
attention over every key, not halved for causality) against the vendor's dense peak for the compute dtype, so a
figure compares with theirs; the causal count (what the kernels actually do) is given beside it, labelled.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

# Dense peak FLOP/s per chip from the vendors' datasheets, by a piece of the ``device_kind`` jax reports (the first
# that matches wins: "H100 PCIe" before "H100"). float32 is what XLA runs a float32 matmul as on these chips by
# default (TF32 on NVIDIA's; TPUs' bfloat16 passes).
DATASHEET: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H100 PCIe", "NVIDIA H100 PCIe datasheet", {"bfloat16": 756e12, "float16": 756e12, "float32": 378e12}),
    ("H100", "NVIDIA H100 SXM datasheet", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12}),
    ("H200", "NVIDIA H200 SXM datasheet", {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12}),
    ("A100", "NVIDIA A100 datasheet", {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}),
    ("TPU v4", "Google Cloud TPU v4", {"bfloat16": 275e12, "float32": 275e12}),
    ("TPU v5 lite", "Google Cloud TPU v5e", {"bfloat16": 197e12, "float32": 197e12}),
    ("TPU v5", "Google Cloud TPU v5p", {"bfloat16": 459e12, "float32": 459e12}),
    ("TPU v6 lite", "Google Cloud TPU v6e (Trillium)", {"bfloat16": 918e12, "float32": 918e12}),
)


# Memory bandwidth per chip, bytes/s, from the same datasheets (HBM): the floor a decode step that must read every
# weight and the filled cache once is set against, beside the copy bandwidth a visit measures.
DATASHEET_BANDWIDTH: tuple[tuple[str, str, float], ...] = (
    ("H100 PCIe", "NVIDIA H100 PCIe datasheet", 2.0e12),
    ("H100", "NVIDIA H100 SXM datasheet", 3.35e12),
    ("H200", "NVIDIA H200 SXM datasheet", 4.8e12),
    ("A100", "NVIDIA A100 80GB SXM datasheet", 2.039e12),
    ("TPU v4", "Google Cloud TPU v4", 1.2e12),
    ("TPU v5 lite", "Google Cloud TPU v5e", 0.819e12),
    ("TPU v5", "Google Cloud TPU v5p", 2.765e12),
    ("TPU v6 lite", "Google Cloud TPU v6e (Trillium)", 1.64e12),
)


def datasheet_bandwidth(device_kind: str) -> tuple[float, str] | None:
    """``(bytes/s, source)`` of one chip's memory from :data:`DATASHEET_BANDWIDTH`, or None (a CPU)."""
    for piece, source, bandwidth in DATASHEET_BANDWIDTH:
        if piece in device_kind:
            return bandwidth, f"{source}, memory bandwidth"
    return None


def datasheet_peak(device_kind: str, dtype: str) -> tuple[float, str] | None:
    """``(FLOP/s, source)`` of one chip of ``device_kind`` in ``dtype`` from :data:`DATASHEET`, or None."""
    for piece, source, peaks in DATASHEET:
        if piece in device_kind and dtype in peaks:
            return peaks[dtype], f"{source}, {dtype} dense"
    return None


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
