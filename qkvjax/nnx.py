"""Flax NNX modules of the zoo: :class:`Attention` (every scheme, latent ones included), :class:`Block` and
:class:`DecoderLM`, running the same stages as the linen modules, not a bridge around them.

The attention stages are shared code: a scheme's parameters are made by one function for both frameworks
(``tied_projections``, ``latent_projections``; :func:`qkvjax.attention.module.stages` picks one), called with a
*maker* whose ``make_kernel``/``make_param`` create ``nnx.Param`` variables here (and ``self.param`` in linen), and
the call goes through the same pipeline (:func:`qkvjax.attention.module.run`: project, finish new keys, cache,
scores, output). The block and the decoder use the same norms, MLP maths, family options and layer patterns as
:mod:`qkvjax.models.lm`.

Parameters carry the linen modules' names and logical axes, and the trees are the same: ``params(module)`` gives
the linen parameter dict of an NNX module, ``load_params(module, params)`` puts a linen dict (a checkpoint,
``qkvjax.hf.load_pretrained``) into one; outputs are equal (``tests/test_nnx.py``). Variables are created without
eager sharding (a module builds outside a mesh); their logical axis names are in each ``nnx.Param``'s
``out_sharding`` metadata for ``nnx.get_partition_spec`` and ``nn.logical_to_mesh_sharding`` under a mesh.

    import jax.numpy as jnp
    from flax import nnx
    import qkvjax.nnx

    attn = qkvjax.nnx.Attention(qkvjax.AttentionConfig(num_heads=4, head_dim=16, scheme="shared_kv"), d_model=64,
                                rngs=nnx.Rngs(0))
    y = attn(jnp.ones((2, 10, 64)), causal=True)                       # (B, T, D)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from qkvjax import axes, checks
from qkvjax.attention import KV, AttentionConfig, core
from qkvjax.attention.base import Call, kernel_init
from qkvjax.attention.module import run, stages
from qkvjax.models.family import MLPS, Family, dense_init
from qkvjax.models.lm import DecodeCache, ModelConfig, as_tokens, check_call, rows_of, unembed
from qkvjax.models.norm import layer_norm, rms_norm

__all__ = ["Attention", "Block", "DecoderLM", "Mlp", "Norm", "load_params", "params"]


class _Maker:
    """``make_param``/``make_kernel`` for an NNX module: with ``rngs`` (construction) each parameter is drawn and
    set as an ``nnx.Param`` attribute named as in linen; without (a call) the stored value is read."""

    def __init__(self, module: nnx.Module, config: AttentionConfig, rngs: nnx.Rngs | None = None):
        self.module, self.config, self.rngs = module, config, rngs

    def make_param(self, name: str, shape, names, init) -> Array:
        if self.rngs is not None:
            value = init(self.rngs.params(), shape, jnp.dtype(self.config.param_dtype))
            setattr(self.module, name, nnx.Param(value, out_sharding=names, eager_sharding=False))
        return getattr(self.module, name)[...]

    def make_kernel(self, name: str, shape, names, in_axis, out_axis, scale: float = 1.0, batch_axis=()) -> Array:
        init = kernel_init(in_axis, out_axis, scale, batch_axis)
        return self.make_param(name, shape, names, init).astype(jnp.dtype(self.config.dtype))


class Attention(nnx.Module):
    """The zoo's attention layer for any ``config`` (a partition scheme, the bilinear form or a latent scheme), as
    :class:`qkvjax.attention.Attention` computes it, with the same parameter names and shapes.

    ``reads_kv=True`` makes a layer that reads another layer's keys and values (``kv=``; Cross-Layer Attention): it
    has no K/V kernels. Called with ``inputs_q`` (B, T, D), ``inputs_kv`` (B, S, D) or None, ``mask``, ``causal``,
    ``positions``, ``deterministic``, ``kv``, ``cache`` (a functional decode cache, :class:`KV`) and
    ``return_kv``, as the linen module is; flax linen's ``decode=True`` collection has no NNX counterpart here (pass
    ``cache=``)."""

    def __init__(self, config: AttentionConfig, d_model: int, *, reads_kv: bool = False, rngs: nnx.Rngs):
        checks.instance("Attention's config", config, AttentionConfig)
        checks.integer_value("d_model", d_model, allowed="an integer >= 1 (the width D of the inputs)")
        self.config, self.d_model, self.reads_kv = config, d_model, reads_kv
        self.rngs = rngs  # attention dropout draws from rngs.dropout()
        stages(config, d_model, reads_kv, _Maker(self, config, rngs))  # creates the parameters

    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None = None,
        *,
        mask: Array | None = None,
        causal: bool = False,
        positions: Array | None = None,
        deterministic: bool = True,
        kv: KV | None = None,
        cache: KV | None = None,
        return_kv: bool = False,
    ):
        cfg = self.config
        if inputs_q.shape[-1:] != (self.d_model,):  # linen makes its parameters from the first call; NNX has them
            raise ValueError(f"inputs_q {inputs_q.shape}: this layer was built for d_model={self.d_model} (B, T, D)")
        call = Call.of(cfg, inputs_q, inputs_kv, mask, causal, positions, False, deterministic, kv, cache, return_kv)
        if (kv is not None) != self.reads_kv:
            raise ValueError(f"kv= given to a layer built with reads_kv={self.reads_kv}; build it as it is called")
        return run(self, call, stages(cfg, self.d_model, self.reads_kv, _Maker(self, cfg)))

    # what the pipeline asks of the module besides its config
    collecting = False

    def make_rng(self, name: str) -> Array:
        return self.rngs[name]()

    def sow(self, collection: str, name: str, value) -> bool:
        """Nothing kept, as linen's ``sow`` keeps nothing outside a mutable collection: analysis collects the
        scores through the linen modules (``qkvjax analyze``)."""
        return False


class Norm(nnx.Module):
    """The family's norm (``scale: (D,)``, and ``bias: (D,)`` for a biased LayerNorm), as :func:`models.family.norm`."""

    def __init__(self, family: Family, d: int, param_dtype):
        self.family = family
        ones = jnp.ones((d,), param_dtype)
        self.scale = nnx.Param(ones, out_sharding=(axes.EMBED,), eager_sharding=False)
        if family.norm_bias:
            self.bias = nnx.Param(jnp.zeros((d,), param_dtype), out_sharding=(axes.EMBED,), eager_sharding=False)

    def __call__(self, x: Array, dtype) -> Array:
        fam = self.family
        if fam.norm == "rmsnorm":
            return rms_norm(x, self.scale[...], fam.norm_eps, dtype)
        y = layer_norm(x, self.scale[...], fam.norm_eps, dtype)
        return y + self.bias[...].astype(y.dtype).reshape((1,) * (x.ndim - 1) + (-1,)) if fam.norm_bias else y


class Mlp(nnx.Module):
    """``act(x W_in) W_out`` or gated ``(act(x W_gate) * (x W_in)) W_out``, biases with ``family.mlp_bias``, as
    :class:`qkvjax.models.family.Mlp`."""

    def __init__(self, family: Family, d: int, f: int, param_dtype, *, rngs: nnx.Rngs):
        self.family = family

        def linear(name: str, shape, logical, bias_axis) -> None:
            w = dense_init(0, 1)(rngs.params(), shape, param_dtype)
            setattr(self, name, nnx.Param(w, out_sharding=logical, eager_sharding=False))
            if family.mlp_bias:
                b = jnp.zeros((shape[1],), param_dtype)
                setattr(self, "b" + name[1:], nnx.Param(b, out_sharding=(bias_axis,), eager_sharding=False))

        linear("w_in", (d, f), (axes.EMBED, axes.MLP), axes.MLP)
        if MLPS[family.mlp][1]:
            linear("w_gate", (d, f), (axes.EMBED, axes.MLP), axes.MLP)
        linear("w_out", (f, d), (axes.MLP, axes.EMBED), axes.EMBED)

    def __call__(self, x: Array) -> Array:
        activation, gated = MLPS[self.family.mlp]

        def linear(name: str, inputs: Array) -> Array:
            y = core.dense(inputs, getattr(self, name)[...].astype(x.dtype))
            if self.family.mlp_bias:
                y = y + getattr(self, "b" + name[1:])[...].astype(x.dtype).reshape((1,) * (y.ndim - 1) + (-1,))
            return y

        h = linear("w_in", x)  # BTD,DF->BTF
        h = activation(linear("w_gate", x)) * h if gated else activation(h)
        return linear("w_out", h)  # BTF,FD->BTD


class Block(nnx.Module):
    """A transformer block as :class:`qkvjax.models.lm.Block` computes it (pre-, post- or sandwich norms, the
    family's MLP, the layer scale); returns ``(x, KV)`` with the K/V its attention used."""

    def __init__(self, config: ModelConfig, attention: AttentionConfig, *, reads_kv: bool = False, rngs: nnx.Rngs):
        d, fam, pd = config.d_model, config.family, config.param_dtype
        self.config, self.causal = config, True
        self.attention = Attention(attention, d, reads_kv=reads_kv, rngs=rngs)
        self.ln_attention, self.ln_mlp = Norm(fam, d, pd), Norm(fam, d, pd)
        if fam.norm_position == "sandwich":
            self.ln_attention_out, self.ln_mlp_out = Norm(fam, d, pd), Norm(fam, d, pd)
        self.mlp = Mlp(fam, d, config.mlp_width, pd, rngs=rngs)
        if fam.layer_scale:
            self.layer_scale = nnx.Param(jnp.ones((1,), pd), out_sharding=(None,), eager_sharding=False)
        self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)

    def __call__(self, x, positions=None, kv=None, cache=None, mask=None, deterministic: bool = True):
        cfg, dt = self.config, self.config.dtype
        position, drop = cfg.family.norm_position, lambda h: self.dropout(h, deterministic=deterministic)  # noqa: E731
        branch = (lambda name, h: getattr(self, name)(h, dt)) if position == "sandwich" else (lambda name, h: h)  # noqa: E731
        h_in = x if position == "post" else self.ln_attention(x, dt)
        h, used = self.attention(h_in, mask=mask, causal=self.causal, positions=positions, deterministic=deterministic,
                                 kv=kv, cache=cache, return_kv=True)  # fmt: skip
        x = x + drop(branch("ln_attention_out", h))
        if position == "post":  # x = Norm(x + Attn(x)); x = Norm(x + Mlp(x))
            x = self.ln_attention(x, dt)
            return self.ln_mlp(x + drop(self.mlp(x)), dt), used
        x = x + drop(branch("ln_mlp_out", self.mlp(self.ln_mlp(x, dt))))
        if cfg.family.layer_scale:
            x = x * self.layer_scale[...].astype(x.dtype).reshape((1,) * x.ndim)
        return x, used


class DecoderLM(nnx.Module):
    """tokens (B, T) int -> logits (B, T, V) in float32, as :class:`qkvjax.models.lm.DecoderLM` computes them, for
    any ``ModelConfig`` (layer patterns and cross-layer K/V included); with ``cache`` (a :class:`DecodeCache`)
    returns ``(logits, cache)``, each row advanced by ``num_valid`` or T."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        checks.instance("DecoderLM's config", config, ModelConfig)
        d, pd = config.d_model, config.param_dtype
        self.config = config
        embed = jax.random.normal(rngs.params(), (config.vocab_size, d), pd) * 0.02
        self.embed = nnx.Param(embed, out_sharding=(axes.VOCAB, axes.EMBED), eager_sharding=False)
        if config.learned_positions:
            table = jax.random.normal(rngs.params(), (config.max_len, d), pd) * 0.01
            self.pos_embed = nnx.Param(table, out_sharding=(None, axes.EMBED), eager_sharding=False)
        if config.family.embed_norm:
            self.ln_embed = Norm(config.family, d, pd)
        for i, layer in enumerate(config.layer_attention):
            setattr(self, f"block_{i}", Block(config, layer.config, reads_kv=not layer.produces_kv, rngs=rngs))
        if config.family.final_norm:
            self.ln_final = Norm(config.family, d, pd)
        if not config.tie_embeddings:
            w = dense_init(0, 1)(rngs.params(), (d, config.vocab_size), pd)
            self.w_unembed = nnx.Param(w, out_sharding=(axes.EMBED, axes.VOCAB), eager_sharding=False)
        self.dropout = nnx.Dropout(config.dropout_rate, rngs=rngs)

    def __call__(self, tokens: Array, *, positions=None, cache: DecodeCache | None = None, num_valid=None,
                 deterministic: bool = True):  # fmt: skip
        cfg, dt, tokens = self.config, self.config.dtype, as_tokens(tokens)
        check_call(cfg, tokens, positions, cache, num_valid)
        x = rows_of(self.embed[...], tokens, dt)
        if cfg.learned_positions:
            pos = jnp.broadcast_to(jnp.arange(tokens.shape[1])[None], tokens.shape) if positions is None else positions
            if cache is not None:
                pos = jnp.minimum(cache.lengths[:, None] + jnp.arange(tokens.shape[1])[None], cfg.max_len - 1)
            x = x + rows_of(self.pos_embed[...], pos, dt)
        if cfg.family.embed_scale:
            x = x * jnp.asarray(cfg.d_model**0.5, dt)
        if cfg.family.embed_norm:
            x = self.ln_embed(x, dt)
        x = self.dropout(x, deterministic=deterministic)
        made: dict[int, KV] = {}
        entries, new_entries = iter(cache.entries()) if cache is not None else None, []
        for i, layer in enumerate(cfg.layer_attention):
            own = None if cache is None or not layer.produces_kv else next(entries)
            kv = None if layer.produces_kv else made[layer.kv_from]
            x, used = getattr(self, f"block_{i}")(x, positions, kv=kv, cache=own, deterministic=deterministic)
            if layer.produces_kv:
                made[i] = used
                new_entries += [used] if cache is not None else []
        if cfg.family.final_norm:
            x = self.ln_final(x, dt)
        logits = unembed(x, self.embed[...].T if cfg.tie_embeddings else self.w_unembed[...], cfg)
        if cache is None:
            return logits
        return logits, cache.advanced(new_entries, tokens.shape[1] if num_valid is None else num_valid)


def params(module: nnx.Module) -> dict:
    """The linen parameter dict of an NNX module (the tree ``module.init(...)["params"]`` of its linen twin)."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def load_params(module: nnx.Module, tree: dict) -> None:
    """Puts a linen parameter dict (unboxed) into ``module``, refusing in one line a tree of another shape."""
    state = nnx.state(module, nnx.Param)
    want = jax.tree.map(jnp.shape, nnx.to_pure_dict(state))
    got = jax.tree.map(jnp.shape, tree)
    if want != got:
        raise ValueError(f"the parameter tree does not fit this module: it has {got}, the module {want}")
    nnx.replace_by_pure_dict(state, tree)
    nnx.update(module, state)
