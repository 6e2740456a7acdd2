"""qkvjax's LayerNorm (hand-written backward) against a float64 numpy reference, numerical gradients and flax.

Sizes are distinct so a swapped axis fails: (3, 5, 7).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from qkvjax.models.norm import LayerNorm, layer_norm

SHAPE = (3, 5, 7)


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE) * 3.0 + 1.5  # an offset and a scale, so the centring and the rsqrt both matter
    scale = rng.standard_normal(SHAPE[-1])
    return x, scale


def reference(x, scale, eps=1e-6):
    x = np.asarray(x, np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * np.asarray(scale, np.float64)


def test_forward_matches_float64_reference():
    x, scale = data()
    y = layer_norm(jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32))
    assert y.dtype == jnp.float32 and y.shape == SHAPE
    np.testing.assert_allclose(y, reference(x, scale), rtol=1e-5, atol=1e-5)


def test_gradients_match_finite_differences_in_float64():
    x, scale = data(1)
    with jax.enable_x64(True):
        check_grads(lambda x, s: layer_norm(x, s), (x, scale), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
        assert layer_norm(jnp.asarray(x), jnp.asarray(scale)).dtype == jnp.float64  # no silent float32


def test_equals_flax_layernorm_forward_and_backward_with_the_same_parameters():
    x, scale = (jnp.asarray(a, jnp.float32) for a in data(2))
    ours, theirs = LayerNorm(), nn.LayerNorm(use_bias=False)
    params = nn.meta.unbox(ours.init(jax.random.key(0), x))
    assert jax.tree.structure(params) == jax.tree.structure(theirs.init(jax.random.key(0), x))  # checkpoints agree
    params = {"params": {"scale": scale}}
    cot = jnp.asarray(np.random.default_rng(3).standard_normal(SHAPE), jnp.float32)

    def grads(module):
        return jax.grad(lambda p, x: jnp.sum(module.apply(p, x) * cot), (0, 1))(params, x)

    np.testing.assert_allclose(ours.apply(params, x), theirs.apply(params, x), rtol=1e-5, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grads(ours), grads(theirs))


def test_bfloat16_in_bfloat16_out_with_float32_statistics():
    x, scale = data(4)
    xb = jnp.asarray(x, jnp.bfloat16)
    y = layer_norm(xb, jnp.asarray(scale, jnp.float32))
    dx, ds = jax.grad(lambda x, s: jnp.sum(layer_norm(x, s).astype(jnp.float32)), (0, 1))(xb, jnp.float32(scale))
    assert (y.dtype, dx.dtype, ds.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    # the statistics of the rounded input, taken in float32: only the output's rounding to bfloat16 is lost
    np.testing.assert_allclose(np.float32(y), reference(np.float32(xb), scale), rtol=1e-2, atol=1e-2)
    assert LayerNorm(dtype=jnp.float32).apply({"params": {"scale": jnp.float32(scale)}}, xb).dtype == jnp.float32


@pytest.mark.parametrize("eps", [1e-6, 1.0])
def test_epsilon_is_added_to_the_variance(eps):
    x, scale = data(5)
    y = LayerNorm(epsilon=eps).apply({"params": {"scale": jnp.float32(scale)}}, jnp.float32(x))
    np.testing.assert_allclose(y, reference(x, scale, eps), rtol=1e-5, atol=1e-5)


def test_scale_carries_its_logical_axis():
    boxed = LayerNorm().init(jax.random.key(0), jnp.ones(SHAPE))["params"]["scale"]
    assert isinstance(boxed, nn.LogicallyPartitioned) and boxed.names == ("embed",)
    assert boxed.value.shape == (SHAPE[-1],) and np.all(boxed.value == 1.0)
