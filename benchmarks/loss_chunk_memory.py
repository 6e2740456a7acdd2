"""XLA's own memory plan of gpt2_124m's train step with and without the chunked loss (``train.loss_chunk``).

    python benchmarks/loss_chunk_memory.py MICRO_BATCH

Compiles (does not run) the step for a micro-batch of MICRO_BATCH x 1024 on this machine's backend and prints
``compiled.memory_analysis()``: the temporaries are where the float32 logits and their gradient live.
"""

import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from qkvjax.config import load_config_file
from qkvjax.models.lm import DecoderLM
from qkvjax.train.state import abstract_state, make_optimizer
from qkvjax.train.step import make_train_step

cfg = load_config_file("experiments/configs/gpt2_124m.py")
micro = int(sys.argv[1])
model = DecoderLM(cfg.model)
tx = make_optimizer(cfg.train)
state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nn.meta.unbox(abstract_state(model, cfg, tx)))
batch = {
    "inputs": jax.ShapeDtypeStruct((micro, 1024), jnp.int32),
    "targets": jax.ShapeDtypeStruct((micro, 1024), jnp.int32),
}
for chunk in (None, 256):
    t = time.perf_counter()
    m = jax.jit(make_train_step(model, tx, loss_chunk=chunk)).lower(state, batch).compile().memory_analysis()
    print(
        f"micro-batch {micro} x 1024, loss_chunk={chunk}: XLA temp {m.temp_size_in_bytes / 2**30:.2f} GiB, "
        f"arguments {m.argument_size_in_bytes / 2**30:.2f} GiB, outputs {m.output_size_in_bytes / 2**30:.2f} GiB "
        f"(compiled in {time.perf_counter() - t:.0f} s)",
        flush=True,
    )
