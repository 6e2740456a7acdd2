"""XLA CPU options at the model level: the train step's speed and its numbers under each option, against no option.

XLA reads ``XLA_FLAGS`` once per process, so each option runs in a process of its own; options and the baseline
take turns (round r runs every option once, in an order rotated by r), and each option's ratio is taken against
the baseline of its own round, then the median over rounds is reported: drift of the machine's speed between
rounds cancels. Correctness: every process runs the same first steps from the same state and batch; the table
gives the largest relative difference of the losses from the baseline's (an option that changes results beyond
float32 reassociation shows up there, and a NaN fails it outright).

    python benchmarks/levers/xla_flags.py --config experiments/configs/compare_cpu.py --batch-size 12 --rounds 5
    python benchmarks/levers/xla_flags.py --batch-size 8 --rounds 3 \
        --json benchmarks/results/xla_flags_shakespeare_b8.json
    python benchmarks/levers/xla_flags.py --decode --batch-size 8 --rounds 5 --options ynn_dot_fusions

``--decode`` times greedy decoding on the device instead (``--tokens`` per row; the check values are the first
steps' largest logits, so an option that changes the generated tokens shows up there too).
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

REPO = Path(__file__).resolve().parents[2]

# Options this jaxlib accepts that could change a CPU train step's speed (names from the XLA flag registry).
CANDIDATES = {
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "onednn": "--xla_cpu_use_onednn=true",
    "fast_math": "--xla_cpu_enable_fast_math=true",
    "vector_512": "--xla_cpu_prefer_vector_width=512",
    "vector_128": "--xla_cpu_prefer_vector_width=128",
    "no_fusion_emitters": "--xla_cpu_use_fusion_emitters=false",
    "concurrency_scheduler": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
    "no_multi_thread_eigen": "--xla_cpu_multi_thread_eigen=false",
    # library fusions: hand dots (or whole subgraphs) to XNNPACK, oneDNN or YNNPACK instead of XLA's own emitters
    "xnn_dots": "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "xnn_dot_fusions": "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "xnn_graph_greedy": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "onednn_dots": "--xla_cpu_experimental_onednn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "ynn_dots": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "no_ynn": "--xla_cpu_experimental_ynn_fusion_type=",  # no YNNPACK fusions: XLA's own dot emitters
    "ynn_dot_fusions": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_DOT",
    "ynn_eltwise": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_ELTWISE",
    "ynn_dot_eltwise_reduce": "--xla_cpu_experimental_ynn_fusion_type="
    "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_ELTWISE,LIBRARY_FUSION_TYPE_REDUCE",
}


def child(args) -> None:
    """One process: compile, the correctness steps, then timed steps; prints one JSON line."""
    sys.path.insert(0, str(REPO))
    import jax
    import jax.numpy as jnp

    from qkvjax.config import apply_overrides, load_config_file
    from qkvjax.models.lm import DecoderLM
    from qkvjax.train.state import create_state, make_optimizer
    from qkvjax.train.step import make_train_step

    overrides = {"model.dropout_rate": "0.0", "train.grad_accum_steps": "1", "train.batch_size": str(args.batch_size)}
    cfg = apply_overrides(load_config_file(args.config), overrides)
    model = DecoderLM(cfg.model)
    tx = make_optimizer(cfg.train)
    state = create_state(model, cfg, tx, None)
    b, t = cfg.train.batch_size, cfg.seq_len
    if args.decode:
        return decode_child(args, model, cfg, state.params)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (b, t + 1), 0, cfg.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    start = time.perf_counter()
    step = make_train_step(model, tx, 1, loss_chunk=cfg.train.loss_chunk)  # the config's own loss (chunked or not)
    step = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    losses = []
    for _ in range(args.check_steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
        times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "median_s": statistics.median(times),
                "losses": losses,
                "compile_s": compile_s,
                "tokens": b * t,
                "finite": bool(jnp.isfinite(metrics["loss"])),
            }
        )
    )


def decode_child(args, model, cfg, params) -> None:
    """``--decode``: greedy on-device generation of ``--tokens`` per row from an empty cache (``lax.scan``, params
    passed in as ``qkvjax sample`` does); the check values are row 0's largest logit at each of the first steps."""
    import functools

    import jax
    import jax.numpy as jnp

    from qkvjax.models.lm import DecodeCache

    b, n = args.batch_size, min(args.tokens, cfg.model.max_len)

    @functools.partial(jax.jit, donate_argnums=1)
    def generate(params, cache, tok):
        def body(carry, _):
            cache, tok = carry
            logits, cache = model.apply({"params": params}, tok, cache=cache)
            last = logits[:, -1]
            return (cache, jnp.argmax(last, -1)[:, None].astype(jnp.int32)), jnp.max(last[0])

        (cache, _), peaks = jax.lax.scan(body, (cache, tok), None, length=n)
        return cache, peaks

    def fresh():
        return DecodeCache.empty(cfg.model, b), jnp.zeros((b, 1), jnp.int32)

    start = time.perf_counter()
    compiled = generate.lower(params, *fresh()).compile()
    compile_s = time.perf_counter() - start
    _, peaks = compiled(params, *fresh())
    times = []
    for _ in range(args.steps):
        cache, tok = fresh()
        jax.block_until_ready(cache)
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, cache, tok))
        times.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "median_s": statistics.median(times),
                "losses": [float(x) for x in peaks[: args.check_steps]],
                "compile_s": compile_s,
                "tokens": b * n,
                "finite": bool(jnp.isfinite(peaks).all()),
            }
        )
    )


def run_child(args, flags: str) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--config",
        args.config,
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--check-steps",
        str(args.check_steps),
        "--tokens",
        str(args.tokens),
    ] + (["--decode"] if args.decode else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(REPO / "experiments/configs/shakespeare_char.py"))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per process")
    p.add_argument("--check-steps", type=int, default=3, help="untimed first steps whose losses are compared")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--options", default=",".join(CANDIDATES), help=f"comma-separated, from {sorted(CANDIDATES)}")
    p.add_argument("--decode", action="store_true", help="time on-device greedy decoding instead of the train step")
    p.add_argument("--tokens", type=int, default=64, help="--decode: new tokens per row per timed generation")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    names = [n for n in args.options.split(",") if n]
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        p.error(f"unknown option(s) {unknown}; allowed: {sorted(CANDIDATES)}")
    what = f"decoding {args.tokens} tokens on device" if args.decode else "train step"
    print(
        f"{time.strftime('%Y-%m-%d %H:%M')} | {what} | {args.config} batch {args.batch_size} | {args.rounds} rounds "
        f"x {args.steps} steps | XLA_FLAGS from the environment: {os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    runs: dict[str, list[dict]] = {n: [] for n in ["baseline", *names]}
    order = ["baseline", *names]
    for r in range(args.rounds):
        rotated = order[r % len(order) :] + order[: r % len(order)]
        for name in rotated:
            out = run_child(args, CANDIDATES.get(name, ""))
            out["round"] = r
            runs[name].append(out)
            msg = out.get("error") or f"{out['tokens'] / out['median_s']:,.0f} tok/s"
            print(f"  round {r} {name:<24} {msg}", flush=True)
    base_by_round = {o["round"]: o for o in runs["baseline"] if "error" not in o}
    ref_losses = runs["baseline"][0]["losses"]
    rows = []
    for name in order:
        good = [o for o in runs[name] if "error" not in o]
        if not good:
            rows.append({"option": name, "flag": CANDIDATES.get(name, ""), "error": runs[name][0]["error"]})
            continue
        ratios = [base_by_round[o["round"]]["median_s"] / o["median_s"] for o in good if o["round"] in base_by_round]
        diff = max(abs(a - b) / abs(b) for o in good for a, b in zip(o["losses"], ref_losses, strict=True))
        rows.append(
            {
                "option": name,
                "flag": CANDIDATES.get(name, ""),
                "tokens_per_s": statistics.median(o["tokens"] / o["median_s"] for o in good),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "loss_rel_diff": diff,
                "compile_s": statistics.median(o["compile_s"] for o in good),
                "finite": all(o["finite"] for o in good),
            }
        )
    print(f"\n{'option':<24} {'tok/s':>9} {'x base':>7} {'(min..max)':>13} {'loss rel diff':>13} {'compile s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['option']:<24} error: {r['error'][:90]}")
            continue
        print(
            f"{r['option']:<24} {r['tokens_per_s']:>9,.0f} {r['ratio_median']:>7.3f} "
            f"{r['ratio_min']:>6.2f}..{r['ratio_max']:<5.2f} {r['loss_rel_diff']:>13.1e} {r['compile_s']:>9.1f}"
            + ("" if r["finite"] else "  NON-FINITE")
        )
    if args.json:
        meta = {
            "date": time.strftime("%Y-%m-%d"),
            "config": args.config,
            "batch_size": args.batch_size,
            "rounds": args.rounds,
            "steps": args.steps,
            "measured": "decode" if args.decode else "train_step",
            "new_tokens": args.tokens if args.decode else None,
            "machine": os.uname().machine,
            "cpus": os.cpu_count(),
            "xla_flags_env": os.environ.get("XLA_FLAGS", ""),
        }
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
