"""What a block is built of around its attention: the norm, where it sits, and the MLP -- as data.

One frozen :class:`Family` covers the layouts of GPT-2 (pre-norm LayerNorm with biases, tanh GELU MLP with
biases; Radford et al. 2019), Llama / Mistral / Qwen2 (pre-norm RMSNorm, SwiGLU MLP without biases; Touvron et al.
2023, Shazeer 2020) and BERT (post-norm LayerNorm, exact GELU, a norm on the embeddings; Devlin et al. 2019).
The default is qkvjax's own model (pre-norm LayerNorm without bias, tanh GELU, no biases), so every checkpoint
written before families existed loads unchanged: a field adds parameters only when it departs from the default.

    pre-norm:   x = x + Attn(Norm(x));   x = x + Mlp(Norm(x));   ...;   Norm(x) at the end
    post-norm:  x = Norm(x + Attn(x));   x = Norm(x + Mlp(x))    (no final norm)
    sandwich:   x = x + Norm'(Attn(Norm(x)));   x = x + Norm'(Mlp(Norm(x)));   ...;   Norm(x) at the end
                (Gemma 2-4: a norm before and one after each sublayer, on its branch)

Gemma also scales the embeddings by sqrt(D) (``embed_scale``), multiplies each block's output by a scalar
(``layer_scale``: the whole residual stream, Gemma 4's ``layer_scalar``) and soft-caps the logits,
``c tanh(logits / c)`` (``logit_softcap``).

    MLP:  gelu(x W_in + b_in) W_out + b_out            w_in: (D, F), w_out: (F, D)
          (silu(x W_gate) * (x W_in)) W_out            SwiGLU, w_gate: (D, F) beside them
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp
from jax import Array

from qkvjax import axes, checks
from qkvjax.attention import core
from qkvjax.models.norm import LayerNorm, RMSNorm

NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post", "sandwich")
# name -> (activation, gated)
MLPS = {
    "gelu_tanh": (lambda x: nn.gelu(x, approximate=True), False),  # GPT-2's gelu_new; flax's default
    "gelu": (lambda x: nn.gelu(x, approximate=False), False),  # the exact erf form (BERT)
    "relu": (nn.relu, False),
    "swiglu": (nn.silu, True),  # Llama, Mistral, Qwen2
    "geglu": (lambda x: nn.gelu(x, approximate=True), True),  # Gemma
}


@dataclasses.dataclass(frozen=True)
class Family:
    """The non-attention parts of a block.

    Attributes:
      norm: 'layernorm' ((x - mean) / std * scale (+ bias)) or 'rmsnorm' (x / rms * scale; Zhang & Sennrich 2019).
      norm_eps: added to the variance (or mean square) inside every norm.
      norm_bias: LayerNorm with a learned bias (GPT-2, BERT); not allowed with 'rmsnorm'.
      norm_position: 'pre' (a norm before attention and MLP, one at the end), 'post' (after each residual
        sum, none at the end: BERT) or 'sandwich' (pre-norm plus a norm on each sublayer's output, ``ln_attention_out``
        and ``ln_mlp_out``: Gemma 2-4).
      embed_norm: a norm on the embeddings before the first block (BERT).
      mlp: the MLP's activation: 'gelu_tanh', 'gelu' (exact), 'relu', or a gated form 'swiglu' / 'geglu'
        (a third kernel ``w_gate``).
      mlp_bias: biases on the MLP's projections.
      embed_scale: multiply the token embeddings by sqrt(D) (Gemma; the table itself is unscaled).
      layer_scale: a learned scalar ``layer_scale: (1,)`` per block, multiplying the block's output (Gemma 4).
      logit_softcap: c > 0 caps the logits smoothly, ``c tanh(logits / c)`` (Gemma 2 and 4); None = off.
    """

    norm: str = "layernorm"
    norm_eps: float = 1e-6
    norm_bias: bool = False
    norm_position: str = "pre"
    embed_norm: bool = False
    mlp: str = "gelu_tanh"
    mlp_bias: bool = False
    embed_scale: bool = False
    layer_scale: bool = False
    logit_softcap: float | None = None

    def __post_init__(self):
        for name, allowed in (("norm", NORMS), ("norm_position", NORM_POSITIONS), ("mlp", tuple(MLPS))):
            checks.choice(self, name, allowed)
        checks.number(self, "norm_eps", low=0, open_low=True)
        checks.number(self, "logit_softcap", low=0, open_low=True, none="off")
        for name in ("norm_bias", "embed_norm", "mlp_bias", "embed_scale", "layer_scale"):
            checks.flag(self, name)
        if self.norm == "rmsnorm" and self.norm_bias:
            raise ValueError("Family.norm_bias=True needs norm='layernorm'; RMSNorm has no bias")

    @property
    def gated(self) -> bool:
        return MLPS[self.mlp][1]

    def norm_params(self, d: int) -> int:
        return d * (2 if self.norm_bias else 1)

    def mlp_params(self, d: int, f: int) -> int:
        kernels = (3 if self.gated else 2) * d * f
        return kernels + ((2 * f if self.gated else f) + d if self.mlp_bias else 0)

    @property
    def final_norm(self) -> bool:
        """A norm after the last block (pre-norm and sandwich layouts)."""
        return self.norm_position != "post"

    def block_params(self, d: int, f: int) -> int:
        """Everything in a block but its attention: two norms (four in the sandwich), the MLP, the layer scale."""
        norms = 4 if self.norm_position == "sandwich" else 2
        return norms * self.norm_params(d) + self.mlp_params(d, f) + self.layer_scale

    def outer_params(self, d: int) -> int:
        """Norms outside the blocks: the final norm (pre-norm, sandwich) and the embedding norm."""
        return self.norm_params(d) * (self.final_norm + self.embed_norm)

    def mlp_flops(self, d: int, f: int) -> int:
        """Forward FLOPs of the MLP per token."""
        return (3 if self.gated else 2) * 2 * d * f


def dense_init(in_axis, out_axis):
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


def norm(family: Family, dtype, param_dtype, name: str) -> nn.Module:
    """The family's norm module (parameters ``scale: (D,)`` and, with ``norm_bias``, ``bias: (D,)``)."""
    if family.norm == "rmsnorm":
        return RMSNorm(epsilon=family.norm_eps, dtype=dtype, param_dtype=param_dtype, name=name)
    return LayerNorm(
        epsilon=family.norm_eps, use_bias=family.norm_bias, dtype=dtype, param_dtype=param_dtype, name=name
    )


class Mlp(nn.Module):
    """``act(x W_in + b_in) W_out + b_out``, or gated ``(act(x W_gate + b_gate) * (x W_in + b_in)) W_out + b_out``.

    ``w_in: (D, F)``, ``w_gate: (D, F)``, ``w_out: (F, D)``; biases only with ``family.mlp_bias``."""

    family: Family
    width: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        fam, d, f = self.family, x.shape[-1], self.width
        activation, gated = MLPS[fam.mlp]

        def linear(name: str, inputs: Array, shape, logical, bias_axis):
            w = self.param(name, nn.with_logical_partitioning(dense_init(0, 1), logical), shape, self.param_dtype)
            y = core.dense(inputs, w.astype(self.dtype))
            if fam.mlp_bias:
                init = nn.with_logical_partitioning(nn.initializers.zeros, (bias_axis,))
                b = self.param("b" + name[1:], init, (shape[1],), self.param_dtype).astype(self.dtype)
                y = y + b.reshape((1,) * (y.ndim - 1) + b.shape)  # (F,) -> (1, 1, F): rank-exact broadcasting
            return y

        h = linear("w_in", x, (d, f), (axes.EMBED, axes.MLP), axes.MLP)  # BTD,DF->BTF
        if gated:
            h = activation(linear("w_gate", x, (d, f), (axes.EMBED, axes.MLP), axes.MLP)) * h
        else:
            h = activation(h)
        return linear("w_out", h, (f, d), (axes.MLP, axes.EMBED), axes.EMBED)  # BTF,FD->BTD


__all__ = ["MLPS", "NORMS", "NORM_POSITIONS", "Family", "Mlp", "dense_init", "norm"]
