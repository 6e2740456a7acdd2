"""Each tying scheme's train step against `separate`'s, alternated directly in one process, beside the speedup
its FLOPs predict.

    python benchmarks/levers/tied_vs_separate.py                       # shakespeare_char, batch 8
    python benchmarks/levers/tied_vs_separate.py --config experiments/configs/compare_cpu.py --batch-size 12 --steps 40

`bench.py`'s `x sep` column divides two ratios against Flax taken at different moments, so it carries the noise
of two Flax timings; here every scheme takes turns with a `separate` step of its own (separate, scheme, separate,
scheme, ...) and the ratio of the medians is reported, with the spread over the steps' pairwise ratios.
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

from bench import alternate, prepare_train, timing_config  # noqa: E402

from qkvjax import SCHEMES  # noqa: E402
from qkvjax.models.lm import DecoderLM, train_flops_per_token  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="experiments/configs/shakespeare_char.py")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=16, help="timed steps per scheme (and as many of separate's)")
    p.add_argument("--schemes", default=",".join(s for s in SCHEMES if s != "separate"))
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = [s.strip() for s in args.schemes.split(",") if s.strip()]
    for name in names:
        if name not in SCHEMES or name == "separate":
            p.error(f"--schemes: {name!r}; allowed: {', '.join(s for s in SCHEMES if s != 'separate')}")

    def config_of(scheme):
        return timing_config(args.config, args.batch_size, {"model.attention.scheme": scheme})

    sep_cfg = config_of("separate")
    sep = prepare_train(DecoderLM(sep_cfg.model), sep_cfg)
    sep_flops = train_flops_per_token(sep_cfg.model, sep_cfg.seq_len)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} | {args.config} batch {args.batch_size} | {jax.devices()[0].device_kind}")
    print(f"{'scheme':<14} {'ms/step':>8} {'sep ms':>8} {'x sep':>6} {'(pairs p25..p75)':>17} {'FLOP speedup':>12}")
    rows = []
    for name in names:
        cfg = config_of(name)
        run = prepare_train(DecoderLM(cfg.model), cfg)
        times = alternate({"separate": sep["step"], name: run["step"]}, args.steps)  # separate first in each pair
        tsep, ts = times["separate"], times[name]
        pairs = sorted(a / b for a, b in zip(tsep, ts, strict=True))
        quart = statistics.quantiles(pairs, n=4)
        ratio = statistics.median(tsep) / statistics.median(ts)
        predicted = sep_flops / train_flops_per_token(cfg.model, cfg.seq_len)
        print(
            f"{name:<14} {1e3 * statistics.median(ts):8.1f} {1e3 * statistics.median(tsep):8.1f} {ratio:6.2f} "
            f"{f'{quart[0]:.2f}..{quart[2]:.2f}':>17} {predicted:12.2f}"
        )
        rows.append({"scheme": name, "x_sep": ratio, "pairs_p25": quart[0], "pairs_p75": quart[2],
                     "flop_speedup": predicted, "ms": 1e3 * statistics.median(ts),
                     "separate_ms": 1e3 * statistics.median(tsep)})  # fmt: skip
        del run
    if args.json:
        meta = {"config": args.config, "batch_size": args.batch_size, "steps": args.steps,
                "device": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
