"""How much of the train step the elementwise work costs: the step as it is, beside variants with one piece made
(almost) free, timed alternately in one process. Not models to train: ablations that bound what a faster
kernel for that piece could save.

    python benchmarks/levers/elementwise_share.py [--config experiments/configs/shakespeare_char.py] [--batch-size 8]

Variants: ``gelu=relu`` (the MLP's tanh-GELU replaced by a ReLU: same shapes, no transcendental);
``gelu=sigmoid`` (GELU's sigmoid form x * sigmoid(1.702 x), one transcendental instead of tanh's polynomial);
``layernorm=none`` (every LayerNorm an identity); ``layernorm=flax`` (``flax.linen.LayerNorm`` differentiated by
JAX instead of qkvjax's norm with its written-out backward, ``qkvjax.models.norm``; same function). The ratio is
the variant's tokens/s over the real step's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import flax.linen as nn
import jax

if __package__ in (None, ""):  # run as a script: make the repository (or this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import alternate, prepare_train, timing_config  # noqa: E402

from qkvjax.models import lm  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402


class _Identity(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x


@contextlib.contextmanager
def patched(variant: str):
    """Swaps one piece of the LM while the step is traced (compiled programs keep what they were traced with)."""
    gelu, layer_norm = lm.nn.gelu, lm._layer_norm
    if variant == "gelu=relu":
        lm.nn.gelu = jax.nn.relu
    elif variant == "gelu=sigmoid":
        lm.nn.gelu = lambda x: x * jax.nn.sigmoid(1.702 * x)
    elif variant == "layernorm=none":
        lm._layer_norm = lambda cfg, name: _Identity(name=name)
    elif variant == "layernorm=flax":
        lm._layer_norm = lambda cfg, name: nn.LayerNorm(
            use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name
        )
    try:
        yield
    finally:
        lm.nn.gelu, lm._layer_norm = gelu, layer_norm


VARIANTS = ("as is", "gelu=relu", "gelu=sigmoid", "layernorm=none", "layernorm=flax")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/configs/shakespeare_char.py")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant, alternated")
    others = VARIANTS[1:]
    p.add_argument("--variants", default=",".join(others), help="comma-separated, from: " + ", ".join(others))
    args = p.parse_args(argv)
    cfg = timing_config(args.config, args.batch_size)
    chosen = ["as is"] + [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in chosen[1:]:
        if v not in others:
            p.error(f"--variants: {v!r} is not a variant; allowed: {', '.join(others)}")
    runners = {}
    for variant in chosen:
        with patched(variant):
            runners[variant] = prepare_train(DecoderLM(cfg.model), cfg)  # traced and compiled inside
    times = alternate({v: r["step"] for v, r in runners.items()}, args.steps)
    base = statistics.median(times["as is"])
    tokens = runners["as is"]["tokens"]
    print(f"config {args.config} batch {args.batch_size} | {jax.devices()[0].device_kind} | median of {args.steps}")
    for v in chosen:
        t = statistics.median(times[v])
        print(f"  {v:<16} {1e3 * t:8.1f} ms/step {tokens / t:9,.0f} tok/s   x{base / t:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
