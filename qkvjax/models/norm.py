"""Layer normalisation without a bias (Ba et al. 2016, "Layer Normalization"), with its backward pass written out.

Over the last axis (D), statistics in float32 (or wider):

    mu = mean(x),   r = (mean(x^2) - mu^2 + eps)^(-1/2),   x_hat = (x - mu) r,   y = x_hat * gamma

and, with ``g = dy * gamma``,

    dx = r (g - mean(g) - x_hat mean(g x_hat)),      d_gamma = sum over (B, T) of dy * x_hat.

Why not let JAX differentiate the forward: its linearisation keeps ``gamma`` broadcast to (B, T, D) as a residual
for the backward pass, and XLA's CPU backend materialises that broadcast as a (B, T, D) buffer per norm per step,
beside a chain of small reductions and elementwise passes. Here the only residuals are ``x`` (alive anyway: it is
the residual stream), ``mu`` and ``r`` (B, T), and the backward is two reductions and one elementwise pass;
``benchmarks/levers/elementwise_share.py`` times both at the model level. The variance is ``E[x^2] - E[x]^2``
clipped at 0, as ``flax.linen.LayerNorm`` computes it by default, so the forward matches flax's to float32
rounding and the parameter (``scale: (D,)``) has flax's name: checkpoints are interchangeable.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import Array

from qkvjax import axes


def _stats(x: Array, eps: float) -> tuple[Array, Array]:
    """``mu`` and ``r = 1 / sqrt(var + eps)``, each (..., 1), from one pass over ``x``."""
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.maximum(jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mu), 0.0)
    return mu, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def layer_norm(x: Array, scale: Array, eps: float = 1e-6, dtype=None) -> Array:
    """``(x - mean) / sqrt(var + eps) * scale`` over the last axis; ``x`` (..., D), ``scale`` (D,); the result in
    ``dtype`` (None: ``x``'s). Statistics and arithmetic in float32 at least."""
    return _forward(x, scale, eps, dtype)[0]


def _lead(scale: Array, ndim: int) -> Array:
    return scale.reshape((1,) * (ndim - 1) + scale.shape)  # (D,) -> (1, ..., 1, D): rank-exact broadcasting


def _compute_dtype(x: Array):
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32  # bfloat16 in: float32 statistics


def _forward(x, scale, eps, dtype):
    ct = _compute_dtype(x)
    xc = x.astype(ct)
    mu, r = _stats(xc, eps)
    y = ((xc - mu) * r * _lead(scale.astype(ct), x.ndim)).astype(dtype or x.dtype)
    return y, (x, mu, r, scale)


def _backward(eps, dtype, residuals, dy):
    del eps, dtype
    x, mu, r, scale = residuals
    ct = _compute_dtype(x)
    x_hat = (x.astype(ct) - mu) * r  # recomputed: one fused elementwise op instead of a (B, T, D) residual
    dyc = dy.astype(ct)
    g = dyc * _lead(scale.astype(ct), x.ndim)
    mean_g = jnp.mean(g, axis=-1, keepdims=True)
    mean_gx = jnp.mean(g * x_hat, axis=-1, keepdims=True)
    dx = r * (g - mean_g - x_hat * mean_gx)
    d_scale = jnp.sum((dyc * x_hat).reshape(-1, x.shape[-1]), axis=0)
    return dx.astype(x.dtype), d_scale.astype(scale.dtype)


layer_norm.defvjp(_forward, _backward)


def _feature_param(module: nn.Module, name: str, init, x: Array) -> Array:
    """A (D,) parameter of a norm over ``x``'s last axis (logical axis ``embed``)."""
    return module.param(name, nn.with_logical_partitioning(init, (axes.EMBED,)), (x.shape[-1],), module.param_dtype)


class LayerNorm(nn.Module):
    """:func:`layer_norm` with a learned ``scale: (D,)`` (logical axis ``embed``), initialised to ones, and with
    ``use_bias`` a learned ``bias: (D,)`` added after it (GPT-2's and BERT's LayerNorm).

    Attributes:
      epsilon: added to the variance.
      use_bias: a learned bias (zeros at init).
      dtype: the output's dtype (None: the input's).
      param_dtype: the scale's dtype.
    """

    epsilon: float = 1e-6
    use_bias: bool = False
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        y = layer_norm(x, _feature_param(self, "scale", nn.initializers.ones, x), self.epsilon, self.dtype)
        if self.use_bias:
            y = y + _lead(_feature_param(self, "bias", nn.initializers.zeros, x).astype(y.dtype), x.ndim)
        return y


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis (Zhang & Sennrich 2019, arXiv:1910.07467), in
    float32 at least, with a learned ``scale: (D,)`` initialised to ones (Llama's ``RMSNorm``; JAX differentiates
    it: no mean to subtract, so there is no broadcast residual to avoid).

    Attributes:
      epsilon: added to the mean square.
      dtype: the output's dtype (None: the input's).
      param_dtype: the scale's dtype.
    """

    epsilon: float = 1e-6
    dtype: jnp.dtype | None = None
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        return rms_norm(x, _feature_param(self, "scale", nn.initializers.ones, x), self.epsilon, self.dtype)


def rms_norm(x: Array, scale: Array, eps: float = 1e-6, dtype=None) -> Array:
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis, in float32 at least; the result in ``dtype``
    (None: ``x``'s)."""
    ct = _compute_dtype(x)
    xc = x.astype(ct)
    y = xc * jax.lax.rsqrt(jnp.mean(jnp.square(xc), axis=-1, keepdims=True) + eps)
    return (y * _lead(scale.astype(ct), x.ndim)).astype(dtype or x.dtype)
