"""Model FLOPs utilisation of one model's train step at several batch sizes, timed in turns in one process
against one matmul peak, so that "MFU at batch 64 against batch 8" is not a comparison across runs.

    python benchmarks/levers/mfu_batch.py                                   # shakespeare_char, batches 8 and 64
    python benchmarks/levers/mfu_batch.py --batch-sizes 8,16,32,64 --steps 4

MFU = ``train_flops_per_token`` x tokens/s over the peak of a 2048x2048 ``jnp.dot`` (the better of a measurement
before and one after the steps), as in ``bench.py``. Each round runs every batch size in turn: one untimed step
after the switch (a batch-64 step leaves the caches and the allocator in a state that slowed the next batch-8
step by a third when single steps alternated), then ``--steps`` timed ones; medians over all rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax

if __package__ in (None, ""):  # run as a script: make the repository (or this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import parse_set, prepare_train, timing_config  # noqa: E402

from qkvjax.models.lm import DecoderLM, train_flops_per_token  # noqa: E402
from qkvjax.perf import measure_peak_flops  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/configs/shakespeare_char.py")
    p.add_argument("--batch-sizes", default="8,64")
    p.add_argument("--steps", type=int, default=3, help="timed steps per batch size and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="a config override KEY=VALUE (repeatable)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    extra = parse_set(p, args.set)
    peak = measure_peak_flops("float32")
    runners = {}
    for b in sizes:
        cfg = timing_config(args.config, b, extra)
        runners[b] = prepare_train(DecoderLM(cfg.model), cfg)
    flops = train_flops_per_token(cfg.model, cfg.seq_len)
    times = {b: [] for b in sizes}
    for _ in range(args.rounds):
        for b in sizes:
            runners[b]["step"]()  # untimed: the first step after another batch size
            times[b] += [runners[b]["step"]() for _ in range(args.steps)]
    peak = max(peak, measure_peak_flops("float32"))
    print(f"{time.strftime('%Y-%m-%d %H:%M')} | {args.config} {extra or ''} | {jax.devices()[0].device_kind} | "
          f"peak {peak / 1e9:.1f} GFLOP/s | median of {args.rounds} x {args.steps} steps")  # fmt: skip
    rows = []
    for b in sizes:
        tok_s = runners[b]["tokens"] / statistics.median(times[b])
        mfu = tok_s * flops / peak
        mem = runners[b]["xla_memory_bytes"]
        print(f"  batch {b:4d}: {tok_s:9,.0f} tok/s  MFU {100 * mfu:5.1f}%  XLA memory plan {mem / 2**20:8,.0f} MiB")
        rows.append({"batch_size": b, "tokens_per_s": tok_s, "mfu": mfu, "xla_memory_bytes": mem})
    if args.json:
        meta = {"config": args.config, "overrides": extra, "peak_flops": peak, "steps": args.steps,
                "rounds": args.rounds, "device": jax.devices()[0].device_kind,
                "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
