"""The causal-blocks softmax normalised after the value mix instead of before it, the whole train step timed in
turns with the former form in one process.

``weights`` (``core.causal_attention`` before this lever, kept here as the baseline): each block's
probabilities p / sum(p) over its (T G, S) scores, then p @ V. ``deferred`` (the library's since, as
FlashAttention's epilogue): exp(s - max) @ V first, then one division of the (T G, H) result by the row sums, so
the division and its broadcast run over H columns instead of S (XLA's CPU step materialised that broadcast of
1 / sum at the full score shape: ``wrapped_broadcast`` in ``profile_step.py``). The row max is held out of the
gradient (the softmax does not depend on it), so both give the same function and, to float rounding, the same
gradient. This script traces each model once as the library has it and once with the former function put back,
checks that the losses agree, and times them in turns.

    python benchmarks/levers/deferred_norm.py --sizes 48,96,160 --steps 30 \
        --json benchmarks/results/deferred_norm_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax.numpy as jnp

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from experiments.ladder import DEFAULT_SIZES, size_config  # noqa: E402
from qkvjax.attention import core  # noqa: E402
from qkvjax.config import DataConfig  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402


def weights_causal_attention(logits_of, v, block, mask_self=False):
    """``core.causal_attention`` as it was before this lever: each block's weights p / sum(p), then the mix."""
    t = v.shape[1]
    vt = v.transpose(0, 2, 1, 3)  # BSKH -> BKSH
    outs = []
    for lo in range(0, t, block):
        hi = min(t, lo + block)
        logits = logits_of(lo, hi)
        g = logits.shape[2] // (hi - lo)
        rows, cols = jnp.arange(lo, hi)[:, None], jnp.arange(hi)[None, :]
        causal = core._fold_rows(rows >= cols, g)
        own = core._fold_rows(rows == cols, g) if mask_self else None
        weights = core.softmax_weights(logits, causal, own)
        outs.append(jnp.einsum("BKQS,BKSH->BKQH", weights.astype(v.dtype), vt[:, :, :hi]))
    return core.unfold_queries(jnp.concatenate(outs, axis=2), t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="d_model of each size")
    p.add_argument("--variants", default="separate,shared_kv,reformer_qk", help="scaling-sweep variants to time")
    p.add_argument("--config", default=None, help="a config file timed instead of the sizes (its own scheme)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per form (in turns)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rows = []
    if args.config:
        cfg = bench.timing_config(args.config)
        cases = [(cfg.model.d_model, Path(args.config).stem, cfg)]
    else:
        data = DataConfig(dataset="tiny_shakespeare")
        cases = [(int(d), v, size_config(int(d), v, 4e-3, 0, 1, data)) for d in args.sizes.split(",") for v in
                 args.variants.split(",")]  # fmt: skip
    for size, variant, cfg in cases:
        runs = {"deferred": bench.prepare_train(DecoderLM(cfg.model), cfg)}
        with bench.replaced(core, "causal_attention", weights_causal_attention):  # traced with the former one
            runs["weights"] = bench.prepare_train(DecoderLM(cfg.model), cfg)
        times = bench.alternate({v: r["step"] for v, r in runs.items()}, args.steps)
        losses = {v: r["last_loss"]() for v, r in runs.items()}
        if abs(losses["weights"] - losses["deferred"]) > 1e-4 * abs(losses["weights"]):
            raise SystemExit(f"d{size} {variant}: the two forms disagree: {losses}")
        ref = statistics.median(times["weights"])
        for form, t in times.items():
            m = statistics.median(t)
            row = {"size": size, "variant": variant, "form": form, "tokens_per_s": runs[form]["tokens"] / m,
                   "x_weights": ref / m, "last_loss": losses[form]}  # fmt: skip
            rows.append(row)
            print(f"d{size:<4d} {variant:12s} {form:9s} {row['tokens_per_s']:>9,.0f} tok/s  "
                  f"x{row['x_weights']:.3f}", flush=True)  # fmt: skip
    bench.write_rows(args.json, "deferred_norm.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
