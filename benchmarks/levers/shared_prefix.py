"""Several rows behind one common start (n samples of one prompt, or prompts behind one system turn):
``generate_batch(..., share_prefix=True)`` reads the start once, in a batch of one, and copies its cache to every
row, against the same call reading it B times in the batched prefill. Seconds to the first token (the prefill) and
for the whole call, and the same tokens from both.

A model of ``--layers`` layers (d_model ``--d-model``, heads of 32, GQA, rotary) with random weights and byte
tokens; each of ``--rows`` prompts is one ``--start``-token start and a tail of ``--tail`` tokens of its own; each
row draws ``--num-tokens`` tokens. Both modes first run once untimed (their programs compile then), then take
turns (``--rounds``, the order alternating); the table has the medians and their ratio (shared / unshared). Run:

    python benchmarks/levers/shared_prefix.py [--json benchmarks/results/shared_prefix_cpu.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from qkvjax.sample import generate_batch  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--start", type=int, default=1500, help="tokens every prompt begins with")
    p.add_argument("--tail", type=int, default=16, help="tokens of each prompt's own after the start")
    p.add_argument("--rows", default="1,4,16", help="batch sizes, comma-separated")
    p.add_argument("--num-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, params = bench.decode_model(args.layers, args.d_model, args.max_len)
    att = model.config.attention
    heads = att.num_heads
    rng = np.random.default_rng(0)
    start = rng.integers(32, 127, args.start).astype(np.int32)
    rows = []
    for b in (int(x) for x in args.rows.split(",")):
        prompts = [np.concatenate([start, rng.integers(32, 127, args.tail).astype(np.int32)]) for _ in range(b)]

        def call(share: bool, prompts=prompts) -> tuple[float, float, np.ndarray, int]:
            begin = time.perf_counter()
            tokens, stats = generate_batch(model, params, prompts, args.num_tokens, temperature=1.0, top_k=None,
                                           seed=0, share_prefix=share)  # fmt: skip
            return stats["prefill_and_compile_s"], time.perf_counter() - begin, tokens, stats["shared_prefix"]

        warm = {share: call(share) for share in (True, False)}  # compiles every program either mode uses
        times = {True: [], False: []}
        for r in range(args.rounds):
            for share in (True, False) if r % 2 else (False, True):
                first, whole, _, _ = call(share)
                times[share].append((first, whole))
        row = {"rows": b, "prompt_tokens": args.start + args.tail, "shared": warm[True][3],
               "same_tokens": warm[True][2].tolist() == warm[False][2].tolist()}  # fmt: skip
        for share, name in ((True, "shared"), (False, "unshared")):
            row[f"first_s_{name}"] = statistics.median(t[0] for t in times[share])
            row[f"call_s_{name}"] = statistics.median(t[1] for t in times[share])
        row["first_ratio"] = row["first_s_shared"] / row["first_s_unshared"]
        row["call_ratio"] = row["call_s_shared"] / row["call_s_unshared"]
        rows.append(row)
    print(f"{args.layers} layers, d_model {args.d_model}, {heads} heads / {att.kv_heads} KV heads of 32; prompts of "
          f"{args.start} common + {args.tail} own tokens, {args.num_tokens} new tokens a row; medians of "
          f"{args.rounds}")  # fmt: skip
    bench.print_table(rows, [("rows", "rows", ""), ("shared", "shared", ""), ("same", "same_tokens", ""),
                             ("first shared", "first_s_shared", ".4f"), ("first unshared", "first_s_unshared", ".4f"),
                             ("ratio", "first_ratio", ".2f"), ("call shared", "call_s_shared", ".4f"),
                             ("call unshared", "call_s_unshared", ".4f"), ("ratio", "call_ratio", ".2f")])  # fmt: skip
    bench.write_rows(args.json, "levers/shared_prefix.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
