"""The train state, the optimizer, and their sharded initialisation."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
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
    """Initialises the state directly into its shardings (no full copy on any one device)."""
    init = init_fn(model, config, tx)
    return jax.jit(lambda rng: nn.meta.unbox(init(rng)), out_shardings=shardings)(jax.random.PRNGKey(config.seed))
