"""qkvjax's train step against the same model in PyTorch eager (``torch_reference.py``), each in a process of its
own, the two processes taking turns for ``--rounds`` rounds; the ratio is taken within each round and its median
reported.

Why processes and not steps alternated in one process (as ``bench.py`` does against Flax): PyTorch's OpenMP
threads keep spinning for a while after each of its steps, and XLA's thread pool does too, so in one process each
framework's step runs while the other's workers still hold the cores. On this 2-core machine that cost qkvjax
about 20% of its speed (11,644 tok/s alternated with Flax, 9,484 alternated with PyTorch, same step, same run).

    pip install torch==2.13.0
    python benchmarks/vs_torch.py --config experiments/configs/compare_cpu.py --batch-size 12 --steps 30 --rounds 5
    python benchmarks/vs_torch.py --batch-size 8 --steps 8 --rounds 3
    python benchmarks/vs_torch.py --scaling-sizes 48,96,160 --steps 20 --rounds 3   # the scaling sweep's models

``--scaling-sizes`` times the ``separate`` model of each size of ``experiments/scaling.py`` (its batch, context,
depth and heads; the config is written to a temporary config.json that both processes read).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str]) -> dict:
    # each side on the machine's own device (a GPU where there is one): the environment as the caller set it
    proc = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"vs_torch: {' '.join(cmd[1:3])} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(config: str, batch_size: int, steps: int, rounds: int, log=print, torch_args: tuple = ()) -> dict:
    """Median tokens/s of each side and the median of the per-round ratios (qkvjax over PyTorch); ``torch_args``:
    torch_reference.py's --compile, --mode, --sdpa."""
    common = ["--config", config, "--batch-size", str(batch_size), "--steps", str(steps)]
    ours_cmd = [sys.executable, str(REPO / "benchmarks" / "levers" / "xla_flags.py"), "--child", *common,
                "--check-steps", "0"]  # fmt: skip
    torch_cmd = [sys.executable, str(REPO / "benchmarks" / "torch_reference.py"), *common, *torch_args, "--json"]
    ours, theirs, ratios = [], [], []
    for r in range(rounds):
        pair = (ours_cmd, torch_cmd) if r % 2 == 0 else (torch_cmd, ours_cmd)  # who goes first alternates too
        out = {id(c): _run(c) for c in pair}
        o, t = out[id(ours_cmd)], out[id(torch_cmd)]
        ours.append(o["tokens"] / o["median_s"])
        theirs.append(t["tokens"] / t["median_s"])
        ratios.append(ours[-1] / theirs[-1])
        log(f"  round {r}: qkvjax {ours[-1]:,.0f} tok/s, PyTorch {theirs[-1]:,.0f} tok/s, x{ratios[-1]:.2f}")
    return {
        "qkvjax_tokens_per_s": statistics.median(ours),
        "torch_tokens_per_s": statistics.median(theirs),
        "x_torch": statistics.median(ratios),
        "x_torch_min": min(ratios),
        "x_torch_max": max(ratios),
        "torch": t["torch"],
        "rounds": rounds,
    }


def scaling_sizes(sizes: list[int], steps: int, rounds: int, json_path: str | None) -> int:
    """One row per size of the scaling protocol: its ``separate`` model at its batch and context."""
    import tempfile

    sys.path.insert(0, str(REPO))
    from experiments.ladder import BATCH, SHARED_LR, size_config
    from qkvjax.config import DataConfig, to_json
    from qkvjax.models.lm import param_count

    print(f"{time.strftime('%Y-%m-%d %H:%M')} | scaling sizes {sizes}, batch {BATCH} | {rounds} rounds")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for d in sizes:
            cfg = size_config(d, "separate", SHARED_LR, 0, tokens=10**6, data=DataConfig())
            path = Path(tmp) / f"d{d}.json"
            path.write_text(to_json(cfg))
            out = compare(str(path), BATCH, steps, rounds)
            rows.append({"d_model": d, "params": param_count(cfg.model), "batch_size": BATCH, "seq_len": cfg.seq_len,
                         **out})  # fmt: skip
            print(f"d={d} ({rows[-1]['params']:,} params): qkvjax {out['qkvjax_tokens_per_s']:,.0f} tok/s, PyTorch "
                  f"{out['torch_tokens_per_s']:,.0f} tok/s: x{out['x_torch']:.2f} (rounds {out['x_torch_min']:.2f}.."
                  f"{out['x_torch_max']:.2f})", flush=True)  # fmt: skip
    if json_path:
        Path(json_path).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "experiments/configs/shakespeare_char.py"))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per process")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--scaling-sizes", default=None, help="comma-separated d_model of experiments/scaling.py's sizes")
    p.add_argument(
        "--torch-compile",
        default="off",
        choices=("off", "model", "step"),
        help="the PyTorch side: eager, the model compiled, or the whole step compiled",
    )
    p.add_argument("--torch-mode", default="default", help="torch.compile's mode (reduce-overhead, max-autotune)")
    p.add_argument("--torch-sdpa", default="auto", help="scaled_dot_product_attention's backend, forced")
    args = p.parse_args(argv)
    torch_args = ("--compile", args.torch_compile, "--mode", args.torch_mode, "--sdpa", args.torch_sdpa)
    if args.scaling_sizes:
        return scaling_sizes([int(x) for x in args.scaling_sizes.split(",")], args.steps, args.rounds, args.json)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} | {args.config} batch {args.batch_size} | {args.rounds} rounds")
    out = compare(args.config, args.batch_size, args.steps, args.rounds, torch_args=torch_args)
    how = "eager" if args.torch_compile == "off" else f"compile={args.torch_compile} mode={args.torch_mode}"
    print(
        f"qkvjax {out['qkvjax_tokens_per_s']:,.0f} tok/s, PyTorch {out['torch']} {how} "
        f"{out['torch_tokens_per_s']:,.0f} tok/s: qkvjax x{out['x_torch']:.2f} "
        f"(rounds {out['x_torch_min']:.2f}..{out['x_torch_max']:.2f})"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"date": time.strftime("%Y-%m-%d"), "config": args.config, "batch_size": args.batch_size, **out},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
