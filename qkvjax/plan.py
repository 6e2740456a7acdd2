"""Memory per device of a training config on a mesh of any size: what ``qkvjax plan`` prints, before paying for one.

Per device, in bytes, for the mesh ``(data, fsdp, tensor)`` the config asks for on ``devices`` devices:

- **parameters**: each array's bytes divided by the mesh axes that shard it, by the same logical-axis rules the
  training uses (:func:`qkvjax.train.mesh.partition_spec`; a dimension an axis does not divide is replicated);
- **optimizer state**: the same for every array of the AdamW state (two moments shaped like the parameters);
- **gradients**: one more copy of the parameters, sharded alike (alive during the update);
- **activations** (an estimate): what the backward pass keeps for the micro-batch on one device,
  ``b = batch / grad_accum / (data * fsdp)`` rows of ``T`` positions. Per layer and position, in the compute dtype:
  two layer norms' inputs and outputs (4 D), queries, keys, values and the attention output ((N + K) (H_k + H_v),
  which is 2 N H + 2 K H unless MLA's keys carry a rotary part; plus MLA's latent, R; a layer that reads another
  layer's K/V keeps only its N queries and outputs; values narrower than keys, padded to their width for jax's
  attention, (N + K) (H_k - H_v) more), the MLP's pre- and
  post-activation (2 F); in float32, N times what the layer's attention kernel keeps per query
  (:func:`kept_scores`: 2 T for the whole scores and probabilities, about half of that in causal blocks, 1 for a
  flash kernel's log-sum-exp). Heads and F are split over ``tensor``. Plus the float32 logits and their gradient
  (2 V per position; per position of one chunk with ``train.loss_chunk``). ``remat='full'`` keeps only each
  block's input (D per layer) plus one block's activations; ``'dots'`` drops the layer-norm and
  activation-function outputs (4 D + F fewer per layer).

Which kernel runs depends on the backend the run will have (``--backend``; this machine's by default): a GPU
takes cuDNN's flash kernel by default where jax accepts it, a CPU the einsum path in causal blocks, a TPU XLA's
attention. Parameters, optimizer state and gradients are exact (the tests check them against the shardings of a
real 8-device mesh); activations are a guide: for ``gpt2_small`` at batch 32 and 64 on an H100 and two H200s the
total was 0.76-0.86x the memory XLA planned with cuDNN's kernel and 1.13-1.15x with XLA's attention
(``tests/test_plan.py``), so leave a quarter of the memory for what it does not count.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import numpy as np

from qkvjax import checks
from qkvjax.attention import AttentionConfig
from qkvjax.attention.config import resolve_implementation
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


FLASH_DTYPES = ("bfloat16", "float16")
FLASH_HEAD_LIMIT = 128  # cuDNN's flash kernel: head widths up to 128 (256 from Hopper on), multiples of 8


def kept_scores(att: AttentionConfig, t: int, backend: str) -> tuple[str, float]:
    """``(kernel, values)``: the attention kernel a causal LM's training step runs in a layer of ``att`` at context
    ``t`` on ``backend`` (the first row of :data:`qkvjax.attention.kernels.KERNELS` that applies to fresh causal
    self-attention, as :func:`~qkvjax.attention.kernels.choose` picks it) and the float32 values per query and
    head it keeps for the backward pass:

    - ``flash``, cuDNN's kernel ('cudnn', or 'auto' on a GPU, with 16-bit compute, keys at most
      :data:`FLASH_HEAD_LIMIT` wide in multiples of 8, and no mask but the causal one): its log-sum-exp, 1;
    - ``xla`` (XLA's attention) and ``einsum``: the (T, T) scores and probabilities, 2 T;
    - ``blocks``: the same below the diagonal only, for blocks of C = ``causal_block`` queries, T + C;
    - ``window``: a band of W keys per block, 2 (W + C);
    - ``chunked``: the scan's carry per block of C = ``chunk_size`` keys (max, sum and output), ceil(T / C) (Hv + 2).
    """
    impl = resolve_implementation(att.implementation, backend)
    tying, window, block = att.tying, att.sliding_window or 0, att.causal_block
    custom = tying.bilinear or tying.mask_self or att.relative_bias > 0 or att.dropout_rate > 0
    in_blocks = (custom or impl == "einsum") and not att.dropout_rate and block and t >= 2 * block
    if impl == "chunked" and not custom and not window:
        return "chunked", -(-t // att.chunk_size) * (att.value_dim + 2)
    if window and in_blocks:
        return "window", 2 * min(t, window + block)
    if in_blocks:
        return "blocks", t + block
    if custom or impl in ("einsum", "chunked") or att.value_dim > att.key_dim:
        return "einsum", 2 * t
    flash = (impl == "cudnn" or (impl == "auto" and att.dtype in FLASH_DTYPES)) and not window
    if flash and att.key_dim % 8 == 0 and att.key_dim <= FLASH_HEAD_LIMIT:
        return "flash", 1
    return "xla", 2 * t


def activation_bytes(config: Config, micro_batch: int, tensor: int, backend: str | None = None) -> int:
    """The estimate described in the module docstring, for ``micro_batch`` rows on one device of ``backend``
    (``jax.default_backend()`` when None)."""
    m, t = config.model, config.seq_len
    backend = backend or jax.default_backend()
    a = np.dtype(m.attention.dtype).itemsize
    f, d = m.mlp_width / tensor, m.d_model
    per_layer = []
    for layer in m.layer_attention:
        att = layer.config
        n, hk, hv = att.num_heads / tensor, att.key_dim, att.value_dim
        # a layer reading another's K/V (cross-layer sharing) keeps no K/V or latent of its own
        k = att.kv_heads / tensor if layer.produces_kv else 0
        latent = att.latent_dim if att.tying.latent and layer.produces_kv else 0  # MLA's compressed K/V, R
        kernel, kept = kept_scores(att, t, backend)
        # jax's attention takes one head width: values narrower than the keys are padded to it, and so is the
        # output before it is cut back (kernels._xla), each kept for the backward pass
        padded = (n + k) * (hk - hv) if kernel in ("flash", "xla") and hv < hk else 0
        per_layer.append(a * (4 * d + (n + k) * (hk + hv) + padded + latent + 2 * f) + 4 * n * kept)
    if m.remat == "full":
        layers = m.num_layers * a * d + max(per_layer)
    elif m.remat == "dots":
        layers = sum(per_layer) - m.num_layers * a * (4 * d + f)
    else:
        layers = sum(per_layer)
    # float32 logits and their gradient: for every position, or (train.loss_chunk) one chunk's at a time
    logits = 4 * 2 * m.vocab_size / tensor
    chunk = config.train.loss_chunk
    if chunk is not None and chunk < t:
        return int(micro_batch * t * layers + micro_batch * chunk * logits)
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
    backend: str = "cpu"  # the kernels the activations assume

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.gradients + self.activations


@functools.lru_cache(maxsize=16)
def _abstract(config: Config):
    """The boxed abstract train state (independent of the mesh; cached: the mesh guide asks for many meshes)."""
    return abstract_state(DecoderLM(config.model), config, make_optimizer(config.train))


BACKENDS = ("cpu", "gpu", "tpu")


def plan(config: Config, devices: int, backend: str | None = None, abstract=None) -> Plan:
    """Bytes per device of training ``config`` on ``devices`` devices of ``backend`` (this machine's when None)
    with the config's mesh (-1 filled in); ``abstract``: the boxed abstract train state, where the caller has it."""
    devices = checks.integer_value("--devices", devices)
    backend = backend or jax.default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"--backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    shape = mesh_shape(config.mesh, devices)
    sizes = dict(zip(("data", "fsdp", "tensor"), shape, strict=True))
    dp = shape[0] * shape[1]
    tc = config.train
    for name, value in (("batch_size", tc.batch_size), ("micro-batch", tc.batch_size // tc.grad_accum_steps)):
        if value % dp:
            raise ValueError(f"train.{name}={value} is not divisible by the data-parallel size {dp} (data x fsdp)")
    # the state's shapes do not depend on the mesh, the kernel (which may need a GPU this machine lacks) or
    # recomputation: configs differing only there share _abstract's cached state
    state = abstract
    if state is None:
        einsum = dataclasses.replace(config.model.attention, implementation="einsum")
        model = dataclasses.replace(config.model, attention=einsum, remat="none")
        state = _abstract(dataclasses.replace(config, mesh=MeshConfig(), model=model))
    params = _sharded_bytes(state.params, sizes)
    micro = tc.batch_size // tc.grad_accum_steps // dp
    return Plan(
        devices=devices,
        mesh=shape,
        micro_batch=micro,
        params=params,
        optimizer=_sharded_bytes(state.opt_state, sizes),
        gradients=params,
        activations=activation_bytes(config, micro, shape[2], backend),
        backend=backend,
    )


def _kernels(config: Config, backend: str) -> str:
    """The layers' attention kernels, as kept_scores names them: 'flash', or 'blocks x4, window x2'."""
    names = [kept_scores(layer.config, config.seq_len, backend)[0] for layer in config.model.layer_attention]
    counts = {name: names.count(name) for name in dict.fromkeys(names)}
    return names[0] if len(counts) == 1 else ", ".join(f"{k} x{v}" for k, v in counts.items())


def format_plan(config: Config, p: Plan, per_device_gib: float | None = None) -> str:
    m = config.model
    rows = [
        (f"parameters ({m.attention.param_dtype})", p.params),
        ("optimizer state (AdamW moments)", p.optimizer),
        ("gradients", p.gradients),
        (
            f"activations, estimate ({p.micro_batch} x {config.seq_len} per device, remat {m.remat}, "
            f"attention {_kernels(config, p.backend)} on {p.backend})",
            p.activations,
        ),
        ("total", p.total),
    ]
    w = max(70, *(len(name) for name, _ in rows))
    lines = [
        f"qkvjax plan: {param_count(m):,} parameters, scheme {m.attention.scheme}, on {p.devices} devices as mesh "
        f"(data {p.mesh[0]}, fsdp {p.mesh[1]}, tensor {p.mesh[2]}); batch {config.train.batch_size} x "
        f"{config.seq_len}, grad_accum {config.train.grad_accum_steps}",
        f"{'per device':{w + 2}s} {'GiB':>9s}",
    ]
    lines += [f"  {name:{w}s} {value / GIB:9.3f}" for name, value in rows]
    if per_device_gib is not None:
        use = p.total / (per_device_gib * GIB)
        lines.append(f"  {'of ' + format(per_device_gib, 'g') + ' GiB per device':{w}s} {100 * use:8.1f}%")
        if use > 0.85:
            lines.append(
                f"warning: {p.total / GIB:.2f} GiB per device leaves less than 15% of {per_device_gib:g} GiB for XLA's "
                "buffers; shard more (--config.mesh.fsdp, --config.mesh.tensor), lower the micro-batch "
                "(--config.train.grad_accum_steps) or recompute activations (--config.model.remat=full)"
            )
    return "\n".join(lines)


def fits(p: Plan, per_device_gib: float) -> bool:
    return p.total <= 0.85 * per_device_gib * GIB and math.isfinite(per_device_gib)
