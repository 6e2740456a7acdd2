"""Where one train step's time goes, by kind of XLA operation: a ``jax.profiler`` trace of a few steps, its
operation events summed per kind (the name without its number: ``ynn_fusion`` = matrix products through YNNPACK,
``dot``/``dot_general`` = XLA's own, ``multiply_tanh_fusion`` = GELU, ``transpose_copy_fusion`` = layout copies).

    python benchmarks/levers/profile_step.py --config experiments/configs/scaling_middle.py --steps 10

Operations on the two cores overlap, so the kinds' times add up to more than the step's wall time; the shares
are of the operations' total. Run it on a quiet machine: under load every operation stretches unevenly.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from qkvjax.models.lm import DecoderLM  # noqa: E402

RUNTIME = ("ThunkExecutor", "$", "PjitFunction", "CommonPjRt", "ParseArguments", "SlinkyThreadPool")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "experiments/configs/scaling_middle.py"))
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cfg = bench.timing_config(args.config, args.batch_size)
    runner = bench.prepare_train(DecoderLM(cfg.model), cfg)
    wall = sorted(runner["step"]() for _ in range(5))[2]  # warm, and the median step's wall time
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(args.steps):
            runner["step"]()
        jax.profiler.stop_trace()
        (trace,) = Path(trace_dir).rglob("perfetto_trace.json.gz")
        events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    kinds: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(RUNTIME):
            kinds[re.sub(r"\.\d+$", "", e["name"])] += e.get("dur", 0) / 1e3 / args.steps  # ms per step
    total = sum(kinds.values())
    print(f"{args.config} batch {cfg.train.batch_size}: step {1e3 * wall:.1f} ms wall, operations {total:.1f} ms")
    for kind, ms in kinds.most_common(args.top):
        print(f"  {ms:8.2f} ms  {100 * ms / total:5.1f}%  {kind}")
    if args.json:
        out = {"config": args.config, "batch_size": cfg.train.batch_size, "step_ms": 1e3 * wall,
               "operations_ms": dict(kinds.most_common())}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
