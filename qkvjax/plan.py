"""Memory per device of a training config on a mesh of any size: what ``qkvjax plan`` prints, before paying for one.

Per device, in bytes, for the mesh ``(data, fsdp, tensor)`` the config asks for on ``devices`` devices:

- **parameters**: each array's bytes divided by the mesh axes that shard it, by the same logical-axis rules the
  training uses (:func:`qkvjax.train.mesh.partition_spec`; a dimension an axis does not divide is replicated);
- **optimizer state**: the same for every array of the AdamW state (two moments shaped like the parameters);
- **gradients**: one more copy of the parameters, sharded alike (alive during the update);
- **activations** (an estimate): what the backward pass keeps for the micro-batch on one device,
  ``b = batch / grad_accum / (data * fsdp)`` rows of ``T`` positions. Per layer and position, in the compute dtype:
  two layer norms' inputs and outputs (4 D), queries, keys and values and the attention output
  (2 N H + 2 K H), the MLP's pre- and post-activation (2 F); in float32, the attention scores and probabilities
  (2 N T). Heads and F are split over ``tensor``. Plus the float32 logits and their gradient (2 V per position).
  ``remat='full'`` keeps only each block's input (D per layer) plus one block's activations; ``'dots'`` drops the
  layer-norm and activation-function outputs (4 D + F fewer per layer). XLA's own buffers come on top: plan for
  about 10-20% headroom.

Parameters, optimizer state and gradients are exact (the tests check them against the shardings of a real
8-device mesh); activations are an order-of-magnitude guide.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import numpy as np

from qkvjax.config import Config, MeshConfig
from qkvjax.models.lm import DecoderLM, param_count
from qkvjax.train.mesh import mesh_shape, partition_spec
from qkvjax.train.state import abstract_state, make_optimizer

GIB = 2**30


def _sharded_bytes(tree, sizes: dict[str, int]) -> int:
    """Bytes one device holds of a boxed abstract tree on a mesh of axis ``sizes``."""
    total = 0
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    for leaf in leaves:
        if isinstance(leaf, nn.LogicallyPartitioned):
            names, value = leaf.names, leaf.value
        else:
            names, value = (None,) * len(leaf.shape), leaf
        spec = partition_spec(names, value.shape, sizes)
        shard = list(value.shape)
        for i, axis in enumerate(spec):
            for a in (axis,) if isinstance(axis, str) else tuple(axis or ()):
                shard[i] //= sizes[a]
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(value.dtype).itemsize
    return total


def activation_bytes(config: Config, micro_batch: int, tensor: int) -> int:
    """The estimate described in the module docstring, for ``micro_batch`` rows on one device."""
    m, t = config.model, config.seq_len
    att = m.attention
    a = np.dtype(att.dtype).itemsize
    n, k, h, f, d = att.num_heads / tensor, att.kv_heads / tensor, att.head_dim, m.mlp_width / tensor, m.d_model
    full_layer = a * (4 * d + 2 * n * h + 2 * k * h + 2 * f) + 4 * 2 * n * t
    if m.remat == "full":
        layers = m.num_layers * a * d + full_layer
    elif m.remat == "dots":
        layers = m.num_layers * (full_layer - a * (4 * d + f))
    else:
        layers = m.num_layers * full_layer
    logits = 4 * 2 * m.vocab_size / tensor
    return int(micro_batch * t * (layers + logits))


@dataclasses.dataclass(frozen=True)
class Plan:
    devices: int
    mesh: tuple[int, int, int]
    micro_batch: int
    params: int  # bytes per device
    optimizer: int
    gradients: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.gradients + self.activations


@functools.lru_cache(maxsize=16)
def _abstract(config: Config):
    """The boxed abstract train state (independent of the mesh; cached: the mesh guide asks for many meshes)."""
    return abstract_state(DecoderLM(config.model), config, make_optimizer(config.train))


def plan(config: Config, devices: int) -> Plan:
    """Bytes per device of training ``config`` on ``devices`` devices with the config's mesh (-1 filled in)."""
    if devices < 1:
        raise ValueError(f"--devices={devices}; allowed: an integer >= 1")
    shape = mesh_shape(config.mesh, devices)
    sizes = dict(zip(("data", "fsdp", "tensor"), shape, strict=True))
    dp = shape[0] * shape[1]
    tc = config.train
    for name, value in (("batch_size", tc.batch_size), ("micro-batch", tc.batch_size // tc.grad_accum_steps)):
        if value % dp:
            raise ValueError(f"train.{name}={value} is not divisible by the data-parallel size {dp} (data x fsdp)")
    state = _abstract(dataclasses.replace(config, mesh=MeshConfig()))
    params = _sharded_bytes(state.params, sizes)
    micro = tc.batch_size // tc.grad_accum_steps // dp
    return Plan(
        devices=devices,
        mesh=shape,
        micro_batch=micro,
        params=params,
        optimizer=_sharded_bytes(state.opt_state, sizes),
        gradients=params,
        activations=activation_bytes(config, micro, shape[2]),
    )


def format_plan(config: Config, p: Plan, per_device_gib: float | None = None) -> str:
    m = config.model
    rows = [
        (f"parameters ({m.attention.param_dtype})", p.params),
        ("optimizer state (AdamW moments)", p.optimizer),
        ("gradients", p.gradients),
        (f"activations, estimate ({p.micro_batch} x {config.seq_len} per device, remat {m.remat})", p.activations),
        ("total", p.total),
    ]
    lines = [
        f"qkvjax plan: {param_count(m):,} parameters, scheme {m.attention.scheme}, on {p.devices} devices as mesh "
        f"(data {p.mesh[0]}, fsdp {p.mesh[1]}, tensor {p.mesh[2]}); batch {config.train.batch_size} x "
        f"{config.seq_len}, grad_accum {config.train.grad_accum_steps}",
        f"{'per device':72s} {'GiB':>9s}",
    ]
    lines += [f"  {name:70s} {value / GIB:9.3f}" for name, value in rows]
    if per_device_gib is not None:
        use = p.total / (per_device_gib * GIB)
        lines.append(f"  {'of ' + format(per_device_gib, 'g') + ' GiB per device':70s} {100 * use:8.1f}%")
        if use > 0.85:
            lines.append(
                f"warning: {p.total / GIB:.2f} GiB per device leaves less than 15% of {per_device_gib:g} GiB for XLA's "
                "buffers; shard more (--config.mesh.fsdp, --config.mesh.tensor), lower the micro-batch "
                "(--config.train.grad_accum_steps) or recompute activations (--config.model.remat=full)"
            )
    return "\n".join(lines)


def fits(p: Plan, per_device_gib: float) -> bool:
    return p.total <= 0.85 * per_device_gib * GIB and math.isfinite(per_device_gib)
