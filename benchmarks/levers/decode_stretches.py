"""Generation in stretches whose programs each read a key prefix fixed when traced (``generate_batch(...,
fixed_prefixes=True)``) against one program whose layers pick their prefix per token with a ``lax.switch`` (the
default): decode tokens/s with the compiles left out, the prompt's forward pass and compiles in seconds, and the
same tokens from both.

Why it is a lever: XLA on a GPU decides a conditional on the host, so the switch costs a device-to-host round
trip per layer and token; on a CPU a branch is cheap, and the stretches pay one compile of the whole step each.
Each round generates once each way (in turns, the same prompts, the same seed: sampled tokens must agree);
the figures are medians over ``--rounds``. Run on a quiet machine:

    python benchmarks/levers/decode_stretches.py [--config experiments/configs/shakespeare_char.py] \
        [--batches 1,8] [--prompt 32] [--tokens 128] [--json benchmarks/results/decode_stretches_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(REPO))

from qkvjax.config import load_config_file  # noqa: E402
from qkvjax.models.lm import DecoderLM  # noqa: E402
from qkvjax.sample import generate_batch, stretches  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "experiments/configs/shakespeare_char.py"))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per row")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = load_config_file(args.config).model
    model = DecoderLM(cfg)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    plan = stretches(cfg, args.prompt, args.tokens - 1)
    rng = np.random.default_rng(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [rng.integers(0, min(cfg.vocab_size, 256), args.prompt) for _ in range(batch)]
        speed: dict[bool, list[float]] = {False: [], True: []}
        setup: dict[bool, list[float]] = {False: [], True: []}
        made = {}
        for _ in range(args.rounds):
            for fixed in (False, True):
                tokens, stats = generate_batch(model, params, prompts, args.tokens, seed=1, fixed_prefixes=fixed)
                made[fixed] = tokens
                speed[fixed].append(stats["tokens_per_s"])
                setup[fixed].append(stats["prefill_and_compile_s"])
        assert (made[False] == made[True]).all(), "the stretches and the one program made different tokens"
        tps = {k: statistics.median(v) for k, v in speed.items()}
        sec = {k: statistics.median(v) for k, v in setup.items()}
        rows.append({"batch": batch, "tok_s_switch": tps[False], "tok_s_stretches": tps[True],
                     "speed_ratio": tps[True] / tps[False], "setup_s_switch": sec[False],
                     "setup_s_stretches": sec[True], "setup_ratio": sec[True] / sec[False]})  # fmt: skip
    print(f"{Path(args.config).stem}: prompt {args.prompt}, {args.tokens} new tokens (sampled, seed 1), "
          f"stretches {[(j0, j1, limit) for j0, j1, limit in plan]} (steps j0..j1-1, key prefix covering limit); "
          f"same tokens both ways; medians of {args.rounds} rounds")  # fmt: skip
    print(f"{'batch':>5} {'tok/s switch':>13} {'tok/s stretches':>16} {'ratio':>6} {'setup s switch':>15} "
          f"{'setup s stretches':>18} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['batch']:>5} {r['tok_s_switch']:>13,.0f} {r['tok_s_stretches']:>16,.0f} {r['speed_ratio']:>6.2f} "
              f"{r['setup_s_switch']:>15.2f} {r['setup_s_stretches']:>18.2f} {r['setup_ratio']:>6.2f}")  # fmt: skip
    if args.json:
        meta = {"machine": platform.node(), "processor": platform.processor(), "device": str(jax.devices()[0]),
                "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args)}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
