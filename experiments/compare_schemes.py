"""Every tying scheme on the same data, token budget and seeds, under three matchings; resumable.

    python experiments/compare_schemes.py --out DIR [--preset cpu|gpu] [--schemes a,b,...] [--seeds 0,1,2]
        [--matchings width,params,kv_cache] [--steps N] [--corpus FILE] [--config FILE]
        [--row NAME=KEY=VALUE;KEY=VALUE ...] [--rows FILE] [--plan-only]

Matchings (each a column of the results):
  width     the preset's d_model and heads for every scheme; tied schemes have fewer parameters.
  params    each scheme gets the attention parameters it saves (or costs) back in the MLP width F, so the whole
            model has ``separate``'s parameter count to within 2%.
  kv_cache  every scheme at the same KV-cache size, ``--kv-fraction`` (default 1/2) of ``separate``'s: each
            scheme takes the number of KV heads that lands exactly on it (``separate`` with N/2 KV heads, i.e.
            GQA; ``shared_kv`` and ``shared_qkv`` with N, since they cache one tensor). Schemes that cannot land on
            it (shared QK/QV need K = N and cache two tensors) are left out of the default sweep and refused when
            named in ``--schemes``. A latent scheme (``mla``, named in ``--schemes``) takes the latent rank R that
            lands on it.

Rows (``--row``, repeatable) are models stated outright rather than matched: a name and ``;``-separated config
overrides, e.g. ``--row "cla2=model.layers=(separate, [kv_from=-1])*"`` or ``--row "kv_norms=model.attention.
scheme=shared_kv;model.attention.qk_norm=true;model.attention.v_norm=true"``; they are reported under the matching
``given`` with the parameters and cache bytes of their own accounting (a row named ``separate``, with no
overrides, is the reference of the Δ column). A row's ``seeds=0,1`` item (not a config field) keeps it to those of
``--seeds``: a learning-rate sweep at one seed beside rows at three. ``--rows FILE`` reads such lines from a file
(``#`` comments, e.g. ``experiments/configs/rows_*.txt``). With rows and no ``--schemes``, only the rows run.
``--plan-only`` prints the runs to go and their estimated wall time (printed before every sweep too) and trains
nothing.

Each run trains through the library's own loop (a real workdir under ``DIR/runs/``, real checkpoints), then is
evaluated on the whole validation split. A finished run appends one row to ``DIR/runs.csv`` and its curve to
``DIR/curves.csv``; rerunning skips finished runs and resumes an interrupted one from its checkpoint, so a killed
sweep loses at most the steps since that run's last checkpoint. Runs whose configs coincide (``separate`` is the
same model under ``width`` and ``params``) are trained once and reported under each matching. At the end
``experiments/report.py`` writes ``DIR/summary.md`` and the plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import budget, report
from experiments.ladder import params_matched_mlp_dim
from experiments.rows import (
    PROTOCOL_FILE,
    append_rows,
    blank,
    csv_list,
    read_csv,
    replace_rows,
    row_spec,
    rows_file,
    write_json,
)
from qkvjax.attention import SCHEMES
from qkvjax.config import Config, apply_overrides, from_dict, load_config_file, to_dict
from qkvjax.models.lm import kv_cache_bytes_per_token, param_count
from qkvjax.train.loop import Interrupted
from qkvjax.workdir import learning_curve

REPO = Path(__file__).resolve().parents[1]
MATCHINGS = ("width", "params", "kv_cache")
GIVEN = "given"  # the matching of --row models: their own config, nothing matched
# The tying schemes; latent ones (MLA, a low-rank factorisation rather than a tying) run when named in --schemes.
DEFAULT_SCHEMES = [name for name, scheme in SCHEMES.items() if not scheme.latent]
PARAMS_TOLERANCE = 0.02
RUN_COLUMNS = (
    "scheme",
    "matching",
    "seed",
    "num_kv_heads",
    "mlp_dim",
    "params",
    "kv_cache_bytes_per_token",
    "steps",
    "tokens",
    "final_val_loss",
    "bits_per_byte",
    "tokens_per_s",
    "wall_s",
    "run",
    "finished_at",
)
CURVE_COLUMNS = ("scheme", "matching", "seed", "step", "wall_s", "train_loss", "val_loss")


# ------------------------------------------------------------------------------------------------------------
# Matchings: one model config per (scheme, matching), decided before anything trains.


def kv_cache_bytes(config: Config) -> int:
    """KV-cache bytes per token of the whole model (every layer)."""
    return kv_cache_bytes_per_token(config.model)


def _with_attention(config: Config, **changes) -> Config:
    attention = dataclasses.replace(config.model.attention, **changes)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, attention=attention))


def matched_config(base: Config, scheme: str, matching: str, kv_fraction: float = 0.5) -> Config:
    """The model ``scheme`` trains under ``matching``; ValueError (naming scheme and matching) if it cannot."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; allowed: {sorted(SCHEMES)}")
    if matching not in MATCHINGS:
        raise ValueError(f"unknown matching {matching!r}; allowed: {list(MATCHINGS)}")
    reference = _with_attention(base, scheme="separate", num_kv_heads=None)
    config = _with_attention(base, scheme=scheme, num_kv_heads=None)
    if matching == "width":
        return config
    m = config.model
    if matching == "params":
        mlp_dim = params_matched_mlp_dim(m, reference.model.attention)
        if mlp_dim == m.mlp_width:
            return config
        if mlp_dim < 1:
            raise ValueError(f"scheme {scheme!r} cannot be params-matched: the MLP width would be {mlp_dim}")
        config = dataclasses.replace(config, model=dataclasses.replace(m, mlp_dim=mlp_dim))
        target, got = param_count(reference.model), param_count(config.model)
        if abs(got - target) > PARAMS_TOLERANCE * target:
            raise ValueError(
                f"scheme {scheme!r} cannot be params-matched within {PARAMS_TOLERANCE:.0%}: "
                f"{got:,} parameters against separate's {target:,}"
            )
        return config
    target = kv_fraction * kv_cache_bytes(reference)
    if SCHEMES[scheme].latent:  # the cache is the latent (and a rotary key), linear in R: solve for the target
        one, two = (kv_cache_bytes(_with_attention(base, scheme=scheme, num_kv_heads=None, kv_rank=r)) for r in (1, 2))
        rank = 1 + (target - one) / (two - one)
        if rank == int(rank) and rank >= 1:
            return _with_attention(base, scheme=scheme, num_kv_heads=None, kv_rank=int(rank))
        raise ValueError(
            f"scheme {scheme!r} cannot be run at {kv_fraction:g} x separate's KV cache: its latent rank "
            f"would be {rank:g}; leave it out of --schemes or of --matchings"
        )
    n = m.attention.num_heads
    options = {}
    for k in sorted((k for k in range(1, n + 1) if n % k == 0), reverse=True):
        try:
            candidate = _with_attention(base, scheme=scheme, num_kv_heads=None if k == n else k)
        except ValueError:  # the scheme ties queries to keys or values: K must be N
            continue
        options[k] = kv_cache_bytes(candidate)
        if options[k] == target:
            return candidate
    raise ValueError(
        f"scheme {scheme!r} cannot be run at {kv_fraction:g} x separate's KV cache ({int(target):,} bytes/token): "
        f"its cache is {', '.join(f'{b:,} with {k} kv heads' for k, b in options.items())}; "
        f"leave it out of --schemes or of --matchings"
    )


@dataclasses.dataclass(frozen=True)
class Run:
    matching: str
    scheme: str
    seed: int
    config: Config
    name: str  # the workdir under DIR/runs/, shared by runs whose configs coincide


def plan(
    base: Config,
    schemes: list[str],
    seeds: list[int],
    matchings: list[str],
    *,
    strict: bool,
    kv_fraction: float = 0.5,
    rows: dict[str, dict[str, str]] | None = None,
) -> tuple[list[Run], list[str]]:
    """Every run of the sweep, seed-major (so a partial sweep has all schemes for the first seeds), and notes on
    (scheme, matching) pairs left out. With ``strict`` (schemes named by the user) a pair that cannot be matched
    is an error instead. ``rows``: name -> config overrides, each run as stated under the matching ``given``."""
    if not schemes and not rows:
        raise ValueError("--schemes is empty; allowed: a comma-separated subset of " + ",".join(SCHEMES))
    if not seeds:
        raise ValueError("--seeds is empty; give at least one integer seed, e.g. --seeds 0,1,2")
    if not matchings:
        raise ValueError(f"--matchings is empty; allowed: a comma-separated subset of {','.join(MATCHINGS)}")
    for name, values, allowed in (("scheme", schemes, SCHEMES), ("matching", matchings, MATCHINGS)):
        for value in values:
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; allowed: {','.join(allowed)}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds has repeats: {seeds}")
    configs, notes, row_seeds = {}, [], {}
    for name, overrides in (rows or {}).items():
        overrides = dict(overrides)
        if "seeds" in overrides:
            text = overrides.pop("seeds")
            try:
                row_seeds[name] = {int(x) for x in text.split(",") if x.strip()}
            except ValueError:
                raise ValueError(f"--row {name}: seeds={text!r}; allowed: comma-separated integers") from None
        try:
            configs[GIVEN, name] = apply_overrides(base, overrides)
        except ValueError as e:
            raise ValueError(f"--row {name}: {e}") from None
    for matching in matchings if schemes else []:
        for scheme in schemes:
            try:
                configs[matching, scheme] = matched_config(base, scheme, matching, kv_fraction)
            except ValueError as e:
                if strict:
                    raise
                notes.append(f"left out: {e}")
    runs, names = [], {}
    for seed in seeds:
        for (matching, scheme), config in configs.items():
            if matching == GIVEN and seed not in row_seeds.get(scheme, {seed}):
                continue
            config = dataclasses.replace(config, seed=seed)
            key = json.dumps(to_dict(config), sort_keys=True)
            name = names.setdefault(key, f"{matching}-{scheme}-seed{seed}")
            runs.append(Run(matching, scheme, seed, config, name))
    return runs, notes


# ------------------------------------------------------------------------------------------------------------
# Results files (experiments/rows.py): appended per finished run, fsynced.


def _drop_curve(path: Path, run: Run) -> None:
    """Removes a curve left by a run killed between its curve and its row."""
    rows = read_csv(path)
    keep = [r for r in rows if (r["scheme"], r["matching"], r["seed"]) != (run.scheme, run.matching, str(run.seed))]
    if len(keep) != len(rows):
        replace_rows(path, CURVE_COLUMNS, keep)


def curve_rows(run: Run, train_records: list[dict], eval_records: list[dict]) -> list[dict]:
    """One row per logged or evaluated step; ``wall_s`` is training time only (:func:`qkvjax.workdir.
    learning_curve`); a loss the step did not record is left empty."""
    tokens_per_step = run.config.train.batch_size * run.config.seq_len
    return [
        {"scheme": run.scheme, "matching": run.matching, "seed": run.seed, "step": p["step"],
         "wall_s": round(p["wall_s"], 3), "train_loss": blank(p["train_loss"]), "val_loss": blank(p["val_loss"])}
        for p in learning_curve(train_records, eval_records, tokens_per_step)
    ]  # fmt: skip


def runrow_spec(run: Run, result: dict, curve: list[dict], train_records: list[dict]) -> dict:
    m = run.config.model
    speeds = sorted(r["tokens_per_s"] for r in train_records if r.get("tokens_per_s"))
    return {
        "scheme": run.scheme,
        "matching": run.matching,
        "seed": run.seed,
        "num_kv_heads": m.attention.kv_heads,
        "mlp_dim": m.mlp_width,
        "params": param_count(m),
        "kv_cache_bytes_per_token": kv_cache_bytes(run.config),
        "steps": run.config.train.num_steps,
        "tokens": run.config.train.num_steps * run.config.train.batch_size * run.config.seq_len,
        "final_val_loss": result["loss"],
        "bits_per_byte": result["bits_per_byte"],
        "tokens_per_s": round(speeds[len(speeds) // 2], 1) if speeds else "",
        "wall_s": curve[-1]["wall_s"] if curve else "",
        "run": run.name,
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


# ------------------------------------------------------------------------------------------------------------


def base_config(args) -> Config:
    path = args.config or str(REPO / "experiments" / "configs" / f"compare_{args.preset}.py")
    config = load_config_file(path)
    data = config.data
    if args.corpus:
        data = dataclasses.replace(data, dataset="text_file", source_path=os.path.abspath(args.corpus))
    elif data.dataset == "tiny_shakespeare" and not data.source_path:
        shared = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
        data = dataclasses.replace(data, source_path=args.source_path or (str(shared) if shared.is_file() else None))
    if args.data_dir:
        data = dataclasses.replace(data, data_dir=os.path.abspath(args.data_dir))
    train = config.train
    if args.steps is not None:
        if args.steps < 1:
            raise ValueError(f"--steps={args.steps}; allowed: an integer >= 1")
        train = dataclasses.replace(train, num_steps=args.steps, warmup_steps=min(train.warmup_steps, args.steps // 10))
    return dataclasses.replace(config, data=data, train=train)


def check_protocol(out: Path, base: Config, args) -> None:
    """A results folder holds one protocol: refuse to mix runs of another base config into it."""

    def normal(config: Config) -> dict:  # what defines the sweep: not the seed, not the measured peak
        d = to_dict(dataclasses.replace(config, seed=0))
        d["train"]["peak_flops"] = None
        return d

    protocol = {**normal(base), "kv_fraction": args.kv_fraction}
    path = out / PROTOCOL_FILE
    if path.exists():
        old = dict(json.loads(path.read_text())["protocol"])
        kv_fraction = old.pop("kv_fraction")
        # Rebuilt through the dataclasses, so fields added to the config since then take their defaults.
        if {**normal(from_dict(Config, old)), "kv_fraction": kv_fraction} != protocol:
            raise ValueError(
                f"{out} holds a sweep of another protocol (see {path}); use another --out, or the same "
                "--preset/--config/--steps/--corpus as before"
            )
        return
    import jax

    out.mkdir(parents=True, exist_ok=True)
    record = {
        "protocol": protocol,
        "command": "python " + shlex.join(["experiments/compare_schemes.py", *sys.argv[1:]]),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__} on {jax.devices()[0].device_kind})",
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    write_json(path, record)


def sweep(args) -> Path:
    from qkvjax.evaluate import evaluate
    from qkvjax.perf import measure_peak_flops
    from qkvjax.train.loop import train
    from qkvjax.workdir import read_metrics

    out = Path(args.out)
    base = base_config(args)
    rows: dict[str, dict[str, str]] = {}
    for name, overrides in [*args.rows, *(args.row or [])]:  # a row may repeat (two files), never differ
        if rows.setdefault(name, overrides) != overrides:
            raise ValueError(f"--row/--rows {name!r} is given twice, differently: {rows[name]} and {overrides}")
    schemes = args.schemes or ([] if rows else DEFAULT_SCHEMES)
    runs, notes = plan(
        base, schemes, args.seeds, args.matchings, strict=bool(args.schemes), kv_fraction=args.kv_fraction, rows=rows
    )
    check_protocol(out, base, args)
    for note in notes:
        print(note)
    runs_csv, curves_csv = out / "runs.csv", out / "curves.csv"
    done = {(r["scheme"], r["matching"], r["seed"]) for r in read_csv(runs_csv)}
    todo = [r for r in runs if (r.scheme, r.matching, str(r.seed)) not in done]
    print(f"{len(runs)} runs in the sweep, {len(runs) - len(todo)} already finished, {len(todo)} to go")
    print_bill(out, base, todo)
    if args.plan_only:
        return out
    peak = base.train.peak_flops or (measure_peak_flops(base.model.attention.dtype) if todo else None)
    for i, run in enumerate(todo, 1):
        print(f"--- [{i}/{len(todo)}] {run.matching} {run.scheme} seed {run.seed} ({run.name})", flush=True)
        config = dataclasses.replace(run.config, train=dataclasses.replace(run.config.train, peak_flops=peak))
        workdir = out / "runs" / run.name
        train(config, str(workdir))
        result = evaluate(str(workdir), split="validation")
        train_records, eval_records = read_metrics(str(workdir))
        curve = curve_rows(run, train_records, eval_records)
        _drop_curve(curves_csv, run)
        append_rows(curves_csv, CURVE_COLUMNS, curve)
        append_rows(runs_csv, RUN_COLUMNS, [runrow_spec(run, result, curve, train_records)])
    report.write_report(out)
    return out


def print_bill(out: Path, base: Config, todo: list[Run]) -> float:
    """Runs to go x minutes per run, per (matching, scheme), from the base model's tokens/s (a probe of its train
    step, kept in ``probe.json`` for reruns) scaled by each model's FLOPs per token."""
    if not todo:
        return 0.0
    cache_file = out / "probe.json"
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    key = json.dumps(to_dict(dataclasses.replace(base, seed=0))["model"], sort_keys=True)
    if key not in cache:
        cache[key] = budget.probe(base)
        write_json(cache_file, cache)
    tokens_per_s, source = cache[key], "a probe of its train step, kept in probe.json"
    print(f"the base model trains at {tokens_per_s:,.0f} tokens/s ({source}); each run scaled by its FLOPs per token")
    groups: dict[tuple[str, str], list[float]] = {}
    configs = {}
    for run in todo:
        groups.setdefault((run.matching, run.scheme), []).append(budget.run_seconds(run.config, tokens_per_s, base))
        configs[run.matching, run.scheme] = run.config
    full = kv_cache_bytes(_with_attention(base, scheme="separate", num_kv_heads=None))
    for (matching, scheme), seconds in groups.items():
        config = configs[matching, scheme]
        print(
            f"  {matching:8s} {scheme:24s} {len(seconds)} runs x ~{budget.hms(statistics.mean(seconds)):7s} "
            f"{param_count(config.model):>10,} params, KV cache {kv_cache_bytes(config) / full:.3g} x separate's"
        )
    total = sum(sum(v) for v in groups.values())
    print(f"estimated wall time of what is left: ~{budget.hms(total)}", flush=True)
    return total


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results folder: runs.csv, curves.csv, summary.md, plots, runs/")
    p.add_argument("--preset", default="cpu", choices=["cpu", "gpu"], help="experiments/configs/compare_PRESET.py")
    p.add_argument("--config", default=None, help="another base config file (overrides --preset)")
    p.add_argument(
        "--schemes",
        type=csv_list(str),
        default=None,
        help="default: every tying scheme (latent ones, such as mla, when named)",
    )
    p.add_argument(
        "--row",
        type=row_spec,
        action="append",
        metavar="NAME=KEY=VALUE;...",
        help="a model stated outright (repeatable): config overrides separated by ';', reported under 'given'",
    )
    p.add_argument(
        "--rows",
        type=rows_file,
        action="extend",
        default=[],
        metavar="FILE",
        help="--row lines from a file (one per line, NAME=KEY=VALUE;...; '#' starts a comment); repeatable",
    )
    p.add_argument("--seeds", type=csv_list(int), default=[0, 1, 2], help="default: 0,1,2")
    p.add_argument("--matchings", type=csv_list(str), default=list(MATCHINGS), help="default: width,params,kv_cache")
    p.add_argument("--kv-fraction", type=float, default=0.5, help="kv_cache matching's budget x separate's (0.5)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default: the preset's)")
    p.add_argument("--corpus", default=None, help="any UTF-8 text file instead of Tiny Shakespeare")
    p.add_argument("--source-path", default=None, help="local Tiny Shakespeare (default: ../shared's copy if any)")
    p.add_argument("--data-dir", default=None, help="TFDS data_dir (default: the config's)")
    p.add_argument("--plan-only", action="store_true", help="print the runs to go and their bill, train nothing")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sweep(args)
    except Interrupted as e:  # the run in progress saved its checkpoint; no row for it: rerun to continue
        print(f"compare_schemes: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:
        print(f"compare_schemes: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
