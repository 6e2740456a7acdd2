"""How much of a trained model's K/V survives a rank-R latent, K = V, or pooled heads? MHA -> MLA by truncated SVD,
against GQA pooling and the least-squares K = V retrofit.

    python experiments/mla_convert.py --out experiments/results/mla_convert_cpu [--seeds 0,1,2] [--ranks 16,32,64,128]
        [--kv-heads 2,1] [--shared-kv] [--cla 2] [--uptrain-steps 200] [--config experiments/configs/compare_cpu.py]

For each seed: trains the ``separate`` source run of ``--config`` (or reuses it), then for each conversion —
``qkvjax convert --to mla --rank R``, at the same cache sizes ``--num-kv-heads K`` (GQA by mean-pooling,
Ainslie et al. 2023), and with ``--shared-kv`` ``--to shared_kv`` (keys kept, values least squares through
them; half the cache, as K = N/2) and with ``--cla G`` Cross-Layer Attention in groups of G layers (a reading
layer's W^Q and W^O absorb least-squares maps from its donor's K/V; 1/G of the cache) — writes the converted run,
evaluates it on the whole validation split as converted, uptrains it for ``--uptrain-steps`` with the run's own
optimiser settings (fresh AdamW state, the schedule stretched to the new step count) and evaluates again. The
control ``none`` is the source itself uptrained the same way (a fresh AdamW state too), so it differs from the
others by the conversion alone.
Each finished (seed, conversion) appends a row to ``OUT/results.csv`` (with the relative reconstruction error of
[W^K, W^V] per layer for MLA, of W^V W^O for K = V, of the keys and value-output maps per reading layer for
CLA); a rerun skips finished rows, so a killed sweep loses one conversion at most.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import platform
import shlex
import shutil
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments.rows import append_rows, write_json
from qkvjax.config import apply_overrides, load_config_file
from qkvjax.convert import CrossLayerError, convert_workdir
from qkvjax.evaluate import evaluate
from qkvjax.models.lm import kv_cache_bytes_per_token
from qkvjax.train.loop import Interrupted, train
from qkvjax.workdir import load_config

REPO = Path(__file__).resolve().parents[1]
COLUMNS = (
    "seed",
    "conversion",
    "rank",
    "kv_heads",
    "kv_cache_bytes_per_token",
    "layer_errors",
    "source_val_loss",
    "converted_val_loss",
    "uptrain_steps",
    "uptrained_val_loss",
    "finished_at",
)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}; allowed: comma-separated integers") from None


def _done(path: Path) -> set[tuple[str, str]]:
    if not path.exists():
        return set()
    with path.open() as f:
        return {(r["seed"], r["conversion"]) for r in csv.DictReader(f)}


def summary(path: Path) -> str:
    """A markdown table: per conversion, mean +- standard deviation over seeds (n seeds)."""
    with path.open() as f:
        rows = list(csv.DictReader(f))
    order = list(dict.fromkeys(r["conversion"] for r in rows))
    lines = [
        "| conversion | KV cache B/token | rel. error (layer mean; mla: [W^K, W^V], kv-lsq: W^V W^O, "
        "cla: keys / W^V W^O of the reading layers) | "
        "val loss converted | "
        "val loss after uptraining | Δ after uptraining vs none, paired by seed | seeds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    control = {r["seed"]: float(r["uptrained_val_loss"]) for r in rows if r["conversion"] == "none"}

    def stat(values: list[float], sign: str = "") -> str:
        if not values:
            return "-"
        mean = statistics.fmean(values)
        spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        return f"{mean:{sign}.3f}{spread}"

    for name in order:
        group = [r for r in rows if r["conversion"] == name]
        parts = [[e.split("/") for e in r["layer_errors"].split()] for r in group if r["layer_errors"]]
        errors = " / ".join(stat([statistics.fmean(float(e[i]) for e in p) for p in parts])
                            for i in range(len(parts[0][0]))) if parts else "-"  # fmt: skip
        paired = [r for r in group if r["seed"] in control]
        lines.append(
            f"| {name} | {group[0]['kv_cache_bytes_per_token']} | {errors} | "
            f"{stat([float(r['converted_val_loss']) for r in group])} | "
            f"{stat([float(r['uptrained_val_loss']) for r in group])} | "
            f"{stat([float(r['uptrained_val_loss']) - control[r['seed']] for r in paired], '+')} | "
            f"{len(group)} |"
        )
    source = {r["seed"]: float(r["source_val_loss"]) for r in rows}
    lines.append(
        f"\nSource runs (`separate`, before conversion): val loss {stat(list(source.values()))} "
        f"over {len(source)} seeds."
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    try:
        return sweep(argv)
    except Interrupted as e:  # the run in progress saved its checkpoint; no row for it: rerun to continue
        print(f"mla_convert: {e}", file=sys.stderr)
        return e.exit_code


def sweep(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=str(REPO / "experiments/configs/compare_cpu.py"))
    p.add_argument("--seeds", type=_ints, default=[0, 1, 2])
    p.add_argument("--ranks", type=_ints, default=[16, 32, 64, 128])
    p.add_argument("--kv-heads", type=_ints, default=[2, 1], help="GQA conversions at the same cache sizes")
    p.add_argument("--shared-kv", action="store_true", help="also the least-squares K = V retrofit (--to shared_kv)")
    p.add_argument("--cla", type=_ints, default=[], help="also CLA retrofits in groups of these sizes (e.g. 2)")
    p.add_argument("--uptrain-steps", type=int, default=200)
    p.add_argument("--corpus", default=str(REPO.parent / "shared/data/tinyshakespeare/input.txt"))
    args = p.parse_args(argv)
    out = Path(args.out)
    (out / "work").mkdir(parents=True, exist_ok=True)
    base = apply_overrides(load_config_file(args.config), {"data.source_path": args.corpus})
    # (name, target scheme, rank, kv heads, CLA group)
    conversions = [("none", None, None, None, None)] + [(f"mla-r{r}", "mla", r, None, None) for r in args.ranks]
    conversions += [(f"gqa-k{k}", None, None, k, None) for k in args.kv_heads]
    conversions += [("kv-lsq", "shared_kv", None, None, None)] if args.shared_kv else []
    conversions += [(f"cla-g{g}", None, None, None, g) for g in args.cla]
    att = base.model.attention
    full = min(base.model.d_model, att.kv_heads * (att.head_dim + att.value_dim))
    for rank in args.ranks:  # refused here, before anything trains
        if not 1 <= rank <= full:
            raise SystemExit(f"--ranks: {rank}; allowed: 1 <= R <= min(D, K (H + Hv)) = {full}")
    meta = {
        "command": "python experiments/mla_convert.py " + shlex.join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()}, {platform.node()}",
        "config": args.config,
    }
    previous = json.loads((out / "protocol.json").read_text()) if (out / "protocol.json").exists() else {}
    meta["earlier_commands"] = previous.get("earlier_commands", []) + (
        [previous["command"]] if previous.get("command") not in (None, meta["command"]) else []
    )  # rows appended by other commands (e.g. --shared-kv, --cla) keep theirs on record
    write_json(out / "protocol.json", meta)
    results = out / "results.csv"
    done = _done(results)
    for seed in args.seeds:
        source = out / "work" / f"separate-seed{seed}"
        config = dataclasses.replace(base, seed=seed)
        train(config, str(source))  # trains, or finds the run finished (resumes an interrupted one)
        source_loss = evaluate(str(source))["loss"]
        steps = config.train.num_steps + args.uptrain_steps
        for name, to, rank, kv_heads, group in conversions:
            if (str(seed), name) in done:
                continue
            work = out / "work" / f"{name}-seed{seed}"
            shutil.rmtree(work, ignore_errors=True)  # a half-made conversion from a killed run
            errors: list = []  # LayerError / CrossLayerError records
            # "none" converts to the same head count, a no-op on the weights: every row then uptrains from a fresh
            # AdamW state, as a converted run must, so the control differs from the others only by the conversion
            kv_heads = kv_heads or (None if to else config.model.attention.kv_heads)
            convert_workdir(str(source), str(work), to, kv_heads, rank=rank, errors=errors, cross_layer=group)
            converted = load_config(str(work))
            converted_loss = evaluate(str(work))["loss"]
            train(
                dataclasses.replace(converted, train=dataclasses.replace(converted.train, num_steps=steps)), str(work)
            )
            row = {
                "seed": seed,
                "conversion": name,
                "rank": rank or "",
                "kv_heads": converted.model.attention.kv_heads,
                "kv_cache_bytes_per_token": kv_cache_bytes_per_token(converted.model),
                "layer_errors": " ".join(  # CLA: "key/value-output" per reading layer
                    f"{e.key_error:.4f}/{e.value_error:.4f}" if isinstance(e, CrossLayerError) else f"{e.error:.4f}"
                    for e in errors
                ),
                "source_val_loss": f"{source_loss:.4f}",
                "converted_val_loss": f"{converted_loss:.4f}",
                "uptrain_steps": args.uptrain_steps,
                "uptrained_val_loss": f"{evaluate(str(work))['loss']:.4f}",
                "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            }
            append_rows(results, COLUMNS, [row])  # fsynced: a kill never leaves half a row
            print(
                f"seed {seed} {name}: cache {row['kv_cache_bytes_per_token']} B/tok, errors [{row['layer_errors']}], "
                f"val loss {row['source_val_loss']} -> {row['converted_val_loss']} -> {row['uptrained_val_loss']} "
                f"after {args.uptrain_steps} steps",
                flush=True,
            )
            shutil.rmtree(work / "checkpoints", ignore_errors=True)  # the rows are the result; keep the disk free
    if results.exists():
        (out / "summary.md").write_text(summary(results))
        print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
