"""The train state, the optimizer, and their sharded initialisation."""

from __future__ import annotations

import contextlib
import functools
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from qkvjax.config import Config, TrainConfig


@struct.dataclass
class TrainState:
    """Everything a step changes. ``rng`` is the run's base key; step ``i`` uses ``fold_in(rng, i)``."""

    step: jax.Array
    params: dict
    opt_state: optax.OptState
    rng: jax.Array


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup to the peak (the first step already moves), then cosine decay to ``min_lr_ratio`` x peak."""
    return optax.warmup_cosine_decay_schedule(
        init_value=cfg.learning_rate / (cfg.warmup_steps + 1),
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.num_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW (Loshchilov & Hutter 2019); no weight decay on vectors (norms, biases)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            learning_rate_schedule(cfg),
            b1=cfg.b1,
            b2=cfg.b2,
            weight_decay=cfg.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
        ),
    )


def init_fn(model: nn.Module, config: Config, tx: optax.GradientTransformation):
    """rng -> TrainState with logically boxed params (under eval_shape it gives the sharding annotations)."""

    def init(rng):
        params_rng, state_rng = jax.random.split(rng)
        tokens = jnp.zeros((1, config.seq_len), jnp.int32)
        params = model.init(params_rng, tokens)["params"]
        return TrainState(step=jnp.array(0, jnp.int32), params=params, opt_state=tx.init(params), rng=state_rng)

    return init


def abstract_state(model: nn.Module, config: Config, tx: optax.GradientTransformation):
    """The boxed abstract state (shapes, dtypes, logical axis names), computed without allocating anything."""
    return jax.eval_shape(init_fn(model, config, tx), jax.random.PRNGKey(config.seed))


def create_state(model, config: Config, tx, shardings) -> TrainState:
    """Initialises the state directly into its shardings (no full copy on any one device); ``shardings=None``: on
    the default device.

    On a GPU, with every array whole on each device, the random draws are lowered to jax's ThreeFry kernel (see
    ``uses_threefry_kernel``): the same parameters, compiled in a fraction of the time."""
    init = init_fn(model, config, tx)
    kernel = uses_threefry_kernel(shardings)
    with jax._src.config.threefry_gpu_kernel_lowering(True) if kernel else contextlib.nullcontext():
        return jax.jit(lambda rng: nn.meta.unbox(init(rng)), out_shardings=shardings)(jax.random.PRNGKey(config.seed))


def uses_threefry_kernel(shardings) -> bool:
    """Whether ``create_state`` lowers ThreeFry2x32 (Salmon et al. 2011, jax.random's hash) to jax's CUDA/ROCm
    kernel (``jax_threefry_gpu_kernel_lowering``) for these output shardings.

    Why: XLA inlines the hash into every draw, so initialising ``gpt2_small`` compiles ~1,000 fusions; on an H200 the
    jitted init took 19-36 s against the train step's 5-10 s (``benchmarks/README.md``, "GPU: the fourth visit").
    The kernel computes the same integers, so a seed gives the same parameters; it is used only when
    - the default device is a GPU (other backends ignore the flag; the CPU has its own lowering),
    - every output is whole on each device (``shardings`` None or fully replicated): the kernel is one custom call
      that XLA's SPMD partitioner cannot split, so a sharded parameter would be drawn whole on every device,
    - a probe on this device gives the same bits with and without it (``_kernel_agrees``), else a warning and the
      default lowering."""
    return whole_on_a_gpu(shardings, jax.default_backend()) and _kernel_agrees()


def whole_on_a_gpu(shardings, backend: str) -> bool:
    """Whether ``uses_threefry_kernel`` may apply: a GPU backend, a jax with the flag, every output whole on each
    device."""
    if backend != "gpu" or not hasattr(jax._src.config, "threefry_gpu_kernel_lowering"):  # a State, no public alias
        return False
    return all(s.is_fully_replicated for s in jax.tree.leaves(shardings))


@functools.cache
def _kernel_agrees() -> bool:
    """Whether jax's ThreeFry kernel gives the bits of the default lowering here (odd shape, fresh compile each)."""
    state = jax._src.config.threefry_gpu_kernel_lowering
    draw = lambda key: jax.random.bits(key, (3, 1031))  # noqa: E731
    key = jax.random.PRNGKey(20261130)
    default = np.asarray(jax.jit(draw)(key))
    try:
        with state(True):
            kernel = np.asarray(jax.jit(draw)(key))
    except Exception as e:  # a plugin without the kernel: the default lowering still works
        logging.warning("jax's ThreeFry GPU kernel failed here (%s); the init keeps XLA's lowering", e)
        return False
    if not np.array_equal(default, kernel):
        logging.warning("jax's ThreeFry GPU kernel gave other bits than XLA's lowering; the init keeps XLA's")
        return False
    return True
