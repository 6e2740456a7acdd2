"""Three levers of the performance issue at the scaling sizes, each the whole train step of ``separate`` timed in
turns with the library's step in one process (nothing in the library changes; each variant is traced with one
function replaced, then put back):

- ``xent_vjp``: the loss and its gradient in one pass: a ``jax.custom_vjp`` cross-entropy whose backward writes
  (softmax(z) - onehot(y)) / n straight from the logits z (a small vocabulary, V = 256), instead of autodiff
  through optax's ``softmax_cross_entropy_with_integer_labels``;
- ``precision_highest``: the step traced under ``jax.default_matmul_precision("highest")`` (every
  ``dot_general`` asks for full float32; on this CPU the default is float32 already, so this checks that no
  product runs at a lower precision that a GPU/TPU default would pick);
- ``opt_flat``: the optimizer's state as one flat buffer per moment (``optax.flatten``), so AdamW's update is a
  few long elementwise loops instead of one per parameter.

    python benchmarks/levers/step_levers.py --sizes 48,96,160 --steps 30 --json benchmarks/results/step_levers_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from experiments.ladder import DEFAULT_SIZES, size_config  # noqa: E402
from qkvjax.config import DataConfig  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402
from qkvjax.train import step  # noqa: E402
from qkvjax.train.state import learning_rate_schedule  # noqa: E402


@jax.custom_vjp
def _nll_sum(logits, targets):
    z = logits.astype(jnp.float32)
    return jnp.sum(jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, targets[..., None], -1)[..., 0])


def _nll_fwd(logits, targets):
    return _nll_sum(logits, targets), (logits, targets)


def _nll_bwd(res, g):
    logits, targets = res
    grad = jax.nn.softmax(logits.astype(jnp.float32), -1) - jax.nn.one_hot(targets, logits.shape[-1])
    return ((g * grad).astype(logits.dtype), None)


_nll_sum.defvjp(_nll_fwd, _nll_bwd)


def xent_vjp(logits, targets, weights=None):
    """``step.cross_entropy`` (unweighted, as in training) with the hand-written backward."""
    if weights is not None:
        raise ValueError("xent_vjp is for the train step (weights=None)")
    return _nll_sum(logits, targets), jnp.float32(targets.size)


VARIANTS = {
    "base": contextlib.nullcontext,
    "xent_vjp": lambda: bench.replaced(step, "cross_entropy", xent_vjp),
    "precision_highest": lambda: jax.default_matmul_precision("highest"),
    "opt_flat": lambda: bench.replaced(bench, "make_optimizer", flat_optimizer),
}


def flat_optimizer(cfg) -> optax.GradientTransformation:
    """``state.make_optimizer`` with Adam's moments as flat buffers: AdamW written out (scale by Adam, decay the
    matrices, scale by the rate), the Adam part under ``optax.flatten``; the decay mask still sees the tree."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.flatten(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2)),
        optax.add_decayed_weights(cfg.weight_decay, mask=lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)),
        optax.scale_by_learning_rate(learning_rate_schedule(cfg)),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="d_model of each size")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)} (base always)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant (in turns)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = ["base"] + [v for v in args.variants.split(",") if v != "base"]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants {','.join(bad)}: allowed {', '.join(VARIANTS)}")
    rows = []
    for size in [int(x) for x in args.sizes.split(",")]:
        cfg = size_config(size, "separate", 4e-3, 0, 1, DataConfig(dataset="tiny_shakespeare"))
        runs = {}
        for name in names:
            with VARIANTS[name]():  # traced and compiled inside
                runs[name] = bench.prepare_train(DecoderLM(cfg.model), cfg)
        times = bench.alternate({v: r["step"] for v, r in runs.items()}, args.steps)
        ref = statistics.median(times["base"])
        base_loss = runs["base"]["last_loss"]()
        for name, t in times.items():
            m = statistics.median(t)
            loss = runs[name]["last_loss"]()
            row = {"size": size, "variant": name, "tokens_per_s": runs[name]["tokens"] / m, "x_base": ref / m,
                   "last_loss": loss, "loss_diff": loss - base_loss}  # fmt: skip
            rows.append(row)
            print(f"d{size:<4d} {name:18s} {row['tokens_per_s']:>9,.0f} tok/s  x{row['x_base']:.3f}  "
                  f"loss {loss:.6f} ({loss - base_loss:+.1e})", flush=True)  # fmt: skip
    bench.write_rows(args.json, "step_levers.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
