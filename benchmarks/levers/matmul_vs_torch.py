"""The train step's matmuls alone, XLA against PyTorch: is the gap to PyTorch in the matrix library?

For a preset's shapes (batch B, context T, width D, heads N, MLP F, vocabulary V), each matmul of the forward pass
(projections, MLP, logits, and the batched attention scores / value mixing) is timed as one jitted ``jnp.matmul``
and as ``torch.matmul``, alternately, median of ``--repeats``; float32, the same inputs. Backward passes are the
same shapes transposed, so the forward table stands for them. The cost of dispatching a jitted call (measured on a
call that computes nothing, and reported) is subtracted from XLA's times: inside the train step there is none.

    pip install torch==2.13.0
    python benchmarks/levers/matmul_vs_torch.py --config experiments/configs/compare_cpu.py --batch-size 12
    python benchmarks/levers/matmul_vs_torch.py --batch-size 8 \
        --json benchmarks/results/matmul_vs_torch_shakespeare_b8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository (or this folder) importable
    sys.path.insert(0, str(REPO))

from qkvjax.config import apply_overrides, load_config_file  # noqa: E402


def shapes(cfg) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], int]]:
    """name -> (left shape, right shape, count per forward pass)."""
    m = cfg.model
    b, t, d, f, v = cfg.train.batch_size, cfg.seq_len, m.d_model, m.mlp_width, m.vocab_size
    n, h = m.attention.num_heads, m.attention.head_dim
    rows = b * t
    return {
        "q/k/v/o projection (BT,D)x(D,NH)": ((rows, d), (d, n * h), 4 * m.num_layers),
        "MLP in (BT,D)x(D,F)": ((rows, d), (d, f), m.num_layers),
        "MLP out (BT,F)x(F,D)": ((rows, f), (f, d), m.num_layers),
        "logits (BT,D)x(D,V)": ((rows, d), (d, v), 1),
        "scores (BN,T,H)x(BN,H,T)": ((b * n, t, h), (b * n, h, t), m.num_layers),
        "mix (BN,T,T)x(BN,T,H)": ((b * n, t, t), (b * n, t, h), m.num_layers),
    }


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "experiments/configs/shakespeare_char.py"))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = apply_overrides(load_config_file(args.config), {"train.batch_size": str(args.batch_size)})
    rng = np.random.default_rng(0)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')} | {args.config} batch {args.batch_size} | jax {jax.__version__}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads) | medians of {args.repeats}, alternated"
    )
    noop = jax.jit(lambda a: a + 0.0)
    z = jnp.zeros((1,), jnp.float32)
    jax.block_until_ready(noop(z))
    ticks = []
    for _ in range(5 * args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(noop(z))
        ticks.append(time.perf_counter() - start)
    dispatch = statistics.median(ticks)
    print(f"a jitted call that computes nothing: {1e6 * dispatch:.1f} us (subtracted below)")
    print(f"\n{'matmul':<34} {'count':>5} {'XLA us':>9} {'torch us':>9} {'torch/XLA':>9} {'XLA GFLOP/s':>11}")
    rows, total_xla, total_torch = [], 0.0, 0.0
    for name, (a_shape, b_shape, count) in shapes(cfg).items():
        a = rng.standard_normal(a_shape, dtype=np.float32)
        b = rng.standard_normal(b_shape, dtype=np.float32)
        ja, jb = jnp.asarray(a), jnp.asarray(b)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        f = jax.jit(jnp.matmul)
        jax.block_until_ready(f(ja, jb))
        np.testing.assert_allclose(np.asarray(f(ja, jb)), torch.matmul(ta, tb).numpy(), rtol=2e-3, atol=2e-3)
        tx, tt = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(f(ja, jb))
            tx.append(time.perf_counter() - start)
            start = time.perf_counter()
            torch.matmul(ta, tb)
            tt.append(time.perf_counter() - start)
        x, t = statistics.median(tx) - dispatch, statistics.median(tt)
        flops = 2 * np.prod(a_shape) * b_shape[-1]
        total_xla, total_torch = total_xla + count * x, total_torch + count * t
        rows.append({"matmul": name, "count": count, "xla_s": x, "torch_s": t, "flops": int(flops)})
        print(f"{name:<34} {count:>5} {1e6 * x:>9.1f} {1e6 * t:>9.1f} {t / x:>9.2f} {flops / x / 1e9:>11.1f}")
    print(
        f"{'forward total (x count)':<34} {'':>5} {1e6 * total_xla:>9.0f} {1e6 * total_torch:>9.0f} "
        f"{total_torch / total_xla:>9.2f}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "config": args.config,
                    "batch_size": args.batch_size,
                    "dispatch_s": dispatch,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
