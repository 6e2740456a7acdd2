"""Pure step functions: ``train_step(state, batch) -> (state, metrics)`` and ``eval_step(params, batch)``."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from qkvjax.train.state import TrainState


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array | None = None):
    """Sum of per-token negative log-likelihoods (nats) and the number of tokens counted."""
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if weights is None:
        return jnp.sum(nll), jnp.float32(nll.size)
    weights = weights.astype(jnp.float32)
    return jnp.sum(nll * weights), jnp.sum(weights)


def chunked_cross_entropy(h: jax.Array, w: jax.Array, targets: jax.Array, chunk: int, cfg):
    """``cross_entropy(unembed(h, w), targets)`` without the (B, T, V) float32 logits: the positions are taken
    ``chunk`` at a time by a ``lax.scan`` whose body is rematerialised, so forward and backward hold one chunk's
    (B, chunk, V) logits; the sum over chunks is the same sum (Liger kernel's and MaxText's vocabulary tiling
    do this for the same reason: at GPT-2's V = 50,304, batch 64 x 1024, the full logits and their gradient are
    12 GiB each). ``h``: (B, T, D) final hidden states; ``w``: (D, V); ``cfg``: the model's config (dtype,
    soft cap). Positions past T in the last chunk are padding, weighted 0."""
    from qkvjax.models.lm import unembed

    b, t, d = h.shape
    n = -(-t // chunk)
    pad = n * chunk - t
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, d).swapaxes(0, 1)  # (n, B, C, D)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)  # (n, B, C)
    mask = (jnp.arange(n * chunk) < t).astype(jnp.float32).reshape(n, 1, chunk)  # (n, 1, C)

    @jax.checkpoint
    def piece(h_c, t_c, m_c):
        nll = optax.softmax_cross_entropy_with_integer_labels(unembed(h_c, w, cfg), t_c)  # BCD,DV->BCV -> BC
        return jnp.sum(nll * m_c)

    total, _ = jax.lax.scan(lambda acc, xs: (acc + piece(*xs), None), jnp.float32(0.0), (h, targets, mask))
    return total, jnp.float32(b * t)


def make_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    grad_accum_steps: int = 1,
    axis_name: str | None = None,
    loss_chunk: int | None = None,
):
    """Builds ``train_step(state, batch) -> (state, metrics)``.

    ``batch`` is ``{"inputs": (B, T), "targets": (B, T)}`` int32. ``loss_chunk``: the output layer and loss
    over that many positions at a time (:func:`chunked_cross_entropy`). With ``grad_accum_steps`` > 1 the batch is
    split into that many micro-batches whose gradients are averaged by a ``lax.scan`` (one micro-batch of
    activations alive at a time). With ``axis_name`` (pmap) gradients and metrics are averaged over that axis.
    A step whose loss or gradient norm is not finite leaves params and optimizer state unchanged and reports
    ``metrics["nonfinite"]`` > 0; the loop decides whether that stops the run.
    """

    def loss_fn(params, inputs, targets, rng):
        if loss_chunk is None:
            logits = model.apply({"params": params}, inputs, deterministic=False, rngs={"dropout": rng})
            total, count = cross_entropy(logits, targets)
        else:
            h, w = model.apply({"params": params}, inputs, deterministic=False, rngs={"dropout": rng}, hidden=True)
            total, count = chunked_cross_entropy(h, w, targets, loss_chunk, model.config)
        return total / count

    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(state.rng, state.step)
        if axis_name is not None:
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axis_name))
        inputs, targets = batch["inputs"], batch["targets"]
        if grad_accum_steps == 1:
            loss, grads = grad_fn(state.params, inputs, targets, rng)
        else:
            micro = inputs.shape[0] // grad_accum_steps
            split = lambda x: x.reshape(grad_accum_steps, micro, *x.shape[1:])  # noqa: E731

            def body(carry, xs):
                i, mb_inputs, mb_targets = xs
                loss, grads = grad_fn(state.params, mb_inputs, mb_targets, jax.random.fold_in(rng, i))
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = (jnp.float32(0.0), jax.tree.map(jnp.zeros_like, state.params))
            (loss, grads), _ = jax.lax.scan(body, zeros, (jnp.arange(grad_accum_steps), split(inputs), split(targets)))
            loss, grads = jax.tree.map(lambda x: x / grad_accum_steps, (loss, grads))
        if axis_name is not None:
            loss, grads = jax.lax.pmean((loss, grads), axis_name)
        grad_norm = optax.tree.norm(grads)
        # A non-finite loss or gradient never reaches the state: the update is dropped (the step still counts,
        # so the data stream and the step number stay in step) and ``nonfinite`` says why: 1 loss, 2 gradient.
        nonfinite = jnp.where(jnp.isfinite(loss), jnp.where(jnp.isfinite(grad_norm), 0, 2), 1).astype(jnp.int32)

        def update(_):
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state

        # A branch rather than a select of old and new: selecting needs the old params and moments alive beside
        # the new ones, and XLA copied every donated state buffer for it (the step x1.02-1.03 at the small CPU shape).
        params, opt_state = jax.lax.cond(nonfinite == 0, update, lambda _: (state.params, state.opt_state), None)
        metrics = {"loss": loss, "grad_norm": grad_norm, "bits_per_byte": loss / math.log(2), "nonfinite": nonfinite}
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(model: nn.Module):
    """``eval_step(params, batch) -> {"nll_sum", "tokens"}`` over a batch with per-token ``weights``."""

    def eval_step(params, batch: dict) -> dict:
        logits = model.apply({"params": params}, batch["inputs"], deterministic=True)
        total, count = cross_entropy(logits, batch["targets"], batch["weights"])
        return {"nll_sum": total, "tokens": count}

    return eval_step


def mean_loss(
    eval_step, params, tokens: np.ndarray, seq_len: int, batch_size: int, put_batch, max_batches=None, stride=None
):
    """Mean next-byte loss over ``tokens`` (every target once, or the first ``max_batches`` batches; ``stride``:
    overlapping windows, :func:`qkvjax.data.pipeline.eval_batches`) and the number of targets counted;
    ``put_batch`` places a host batch where ``eval_step`` wants it."""
    from qkvjax.data.pipeline import eval_batches  # grain: only where data is read (the step functions need none)

    total = count = 0.0
    for batch in eval_batches(tokens, seq_len, batch_size, max_batches, stride):
        out = jax.device_get(eval_step(params, put_batch(batch)))
        total += float(np.sum(out["nll_sum"]))
        count += float(np.sum(out["tokens"]))
    return total / count, int(count)
