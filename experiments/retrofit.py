"""What a retrofit costs in tokens (experiments/preregistered/retrofit_tokens.md): ``separate`` trained from scratch,
converted with ``qkvjax convert`` to five cheaper attentions, uptrained for 1%, 3%, 10% and 30% of its tokens, and
compared with each cheaper attention trained from scratch on the same total.

    python experiments/retrofit.py --corpus experiments/corpora/linux.txt --scratch /tmp/retrofit \
        [--out experiments/results/retrofit_linux] [--seeds 0,1,2] [--stages base,uptrain,scratch]
        [--targets shared_kv,gqa2,...] [--budget-s S] [--plan-only]

Every run appends one row to ``OUT/runs.csv`` when it finishes (its final validation loss over the whole
validation split); a rerun skips the rows that are there and resumes an unfinished run from its checkpoint in
``--scratch``, so the study can be stopped at any moment and committed row by row. ``--budget-s`` stops before a
run that would not finish in time. The protocol's settings are the module's constants below; ``--plan-only``
prints the runs and their estimated time.

Stages, in the order the answer needs them:

* ``base``: ``separate`` at d=96 of the ladder on N = 10 tokens per parameter, disjoint windows, rate 4e-3;
* ``uptrain``: each base converted to each target (``TARGETS``), then trained on for each budget fraction of N,
  each budget its own run from the converted weights (fresh AdamW moments, 5% warmup to 4e-3, cosine to 10%),
  reading the base's window order where the base stopped (``data.start_batch`` = the base's steps);
* ``scratch``: each target trained from scratch on N x (1 + the budgets the comparison needs), same seeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import budget
from experiments.ladder import size_config
from experiments.rows import append_rows, read_csv

SIZE, RATE = 96, 4e-3
BUDGETS = (0.01, 0.03, 0.1, 0.3)  # uptraining tokens as a fraction of the base's N
EVAL_BATCH = 256  # windows per evaluation call: the same targets as the run's batch of 16, scored ~3x faster here
SCRATCH_SCALES = (1.0, 1.1, 1.3)  # from-scratch lengths: N (compared with the 1% and 3% budgets), 1.1 N, 1.3 N
# each target: how `qkvjax convert` makes it from `separate`, and the ladder variant that is the same model trained
# from scratch (the names are labels; the conversion and the variant are data)
TARGETS = {
    "shared_kv": ({"to": "shared_kv"}, "shared_kv"),
    "gqa2": ({"num_kv_heads": 2}, "gqa"),
    "mqa": ({"num_kv_heads": 1}, "mqa"),
    "mla_quarter": ({"to": "mla", "rank": SIZE // 2, "latent_norm": True}, "mla_half"),
    "shared_qk": ({"to": "shared_qk"}, "shared_qk"),
}
COLUMNS = (
    "stage", "target", "scheme", "num_kv_heads", "seed", "budget", "tokens", "steps", "start_batch", "learning_rate",
    "params", "kv_cache_bytes_per_token", "conversion_error", "final_val_loss", "tokens_per_s", "wall_s",
    "finished_at", "device", "run",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Run:
    stage: str
    target: str  # "separate" for a base
    seed: int
    budget: float  # uptraining fraction of N; for scratch the length's scale of N; 1 for a base
    tokens: int

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.target}-b{self.budget:g}-seed{self.seed}"


def base_tokens(data) -> int:
    from qkvjax.models.lm import param_count

    return round(10 * param_count(size_config(SIZE, "separate", RATE, 0, 1, data).model))


def plan(seeds: list[int], stages: list[str], n: int, targets: list[str] | None = None) -> list[Run]:
    targets = list(TARGETS) if targets is None else targets
    runs = [Run("base", "separate", s, 1.0, n) for s in seeds] if "base" in stages else []
    if "uptrain" in stages:
        runs += [Run("uptrain", t, s, b, round(b * n)) for s in seeds for t in targets for b in BUDGETS]
    if "scratch" in stages:
        runs += [Run("scratch", t, s, k, round(k * n)) for s in seeds for t in targets for k in SCRATCH_SCALES]
    return runs


def _data(corpus: str, data_dir: str):
    from qkvjax.config import DataConfig

    return DataConfig(dataset="text_file", source_path=os.path.abspath(corpus), data_dir=data_dir, sampling="disjoint")


def _base_config(data, seed: int, tokens: int, variant: str = "separate"):
    return size_config(SIZE, variant, RATE, seed, tokens, data)


def _converted(run: Run, data, scratch: Path) -> tuple[Path, float | str]:
    """The base of ``run.seed`` converted to ``run.target`` (once per seed and target) and its mean layer error ("":
    none is measured, as for mean-pooled heads)."""
    from qkvjax.convert import LayerError, convert_workdir

    base = scratch / Run("base", "separate", run.seed, 1.0, 0).name
    out = scratch / f"converted-{run.target}-seed{run.seed}"
    errors: list = []
    if not out.exists():
        kwargs = TARGETS[run.target][0]
        convert_workdir(str(base), str(out), kwargs.get("to"), kwargs.get("num_kv_heads"), rank=kwargs.get("rank"),
                        errors=errors, latent_norm=kwargs.get("latent_norm", False))  # fmt: skip
        measured = [e.error for e in errors if isinstance(e, LayerError)]  # none for mean-pooled GQA/MQA heads
        (out / "conversion_error.txt").write_text(repr(statistics.fmean(measured)) if measured else "")
    text = (out / "conversion_error.txt").read_text()
    return out, float(text) if text else ""


def _uptrain_workdir(run: Run, data, scratch: Path, base_steps: int) -> tuple[Path, object, float]:
    """A params-only workdir holding the converted weights (trained from step 0 with fresh moments), and its
    config: the budget's steps and schedule, the base's window order continued past its steps."""
    from qkvjax.config import to_json
    from qkvjax.evaluate import restore_params
    from qkvjax.workdir import CONFIG_FILE, export_params, load_config, write_text

    converted, error = _converted(run, data, scratch)
    workdir = scratch / run.name
    config = load_config(str(converted))
    steps = max(1, math.ceil(run.tokens / (config.train.batch_size * config.seq_len)))
    every = max(1, steps // 10)
    train = dataclasses.replace(config.train, num_steps=steps, learning_rate=RATE, warmup_steps=max(1, steps // 20),
                                min_lr_ratio=0.1, eval_every=every, checkpoint_every=every,
                                log_every=max(1, steps // 50))  # fmt: skip
    config = dataclasses.replace(config, train=train, data=dataclasses.replace(data, start_batch=base_steps))
    if not workdir.exists():
        _, params, _, _ = restore_params(str(converted), None)
        staging = workdir.with_name(workdir.name + ".incomplete")
        staging.mkdir(parents=True, exist_ok=True)
        export_params(staging, 0, params)
        write_text(staging / CONFIG_FILE, to_json(config))
        staging.rename(workdir)
    return workdir, config, error


def run_one(run: Run, data, scratch: Path, base_steps: int) -> dict:
    from qkvjax.evaluate import evaluate
    from qkvjax.models.lm import kv_cache_bytes_per_token, param_count
    from qkvjax.train.loop import train
    from qkvjax.workdir import read_metrics

    error = ""
    if run.stage == "uptrain":
        workdir, config, error = _uptrain_workdir(run, data, scratch, base_steps)
    else:
        variant = "separate" if run.stage == "base" else TARGETS[run.target][1]
        workdir, config = scratch / run.name, _base_config(data, run.seed, run.tokens, variant)
    started = time.monotonic()
    train(config, str(workdir))
    result = evaluate(str(workdir), split="validation", batch_size=EVAL_BATCH)
    records, _ = read_metrics(str(workdir))
    speeds = sorted(r["tokens_per_s"] for r in records if r.get("tokens_per_s"))
    att = config.model.attention
    return {
        "stage": run.stage, "target": run.target, "scheme": att.scheme, "num_kv_heads": att.kv_heads,
        "seed": run.seed, "budget": run.budget, "tokens": config.train.num_steps * config.train.batch_size
        * config.seq_len, "steps": config.train.num_steps, "start_batch": config.data.start_batch,
        "learning_rate": config.train.learning_rate, "params": param_count(config.model),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(config.model), "conversion_error": error,
        "final_val_loss": result["loss"], "tokens_per_s": round(speeds[len(speeds) // 2], 1) if speeds else "",
        "wall_s": round(time.monotonic() - started, 1), "run": run.name,
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"{os.cpu_count()}-core CPU",
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", required=True, help="the Linux corpus (experiments/build_corpus.py --corpus linux)")
    p.add_argument("--scratch", required=True, type=Path, help="a folder for the runs' workdirs (large)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "retrofit_linux")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--stages", default="base,uptrain,scratch")
    p.add_argument("--targets", default=",".join(TARGETS), help="the conversions run (two processes can split them)")
    p.add_argument("--data-dir", default=os.path.expanduser("~/tensorflow_datasets"))
    p.add_argument("--budget-s", type=float, default=None, help="stop before a run that would not finish in time")
    p.add_argument("--tokens-per-s", type=float, default=11_000.0, help="for the plan's estimate (one process)")
    p.add_argument("--plan-only", action="store_true")
    args = p.parse_args(argv)
    if not os.path.isfile(args.corpus):
        p.error(f"--corpus {args.corpus}: no such file; allowed: a text file (experiments/build_corpus.py builds it)")
    stages = args.stages.split(",")
    if unknown := sorted(set(stages) - {"base", "uptrain", "scratch"}):
        p.error(f"--stages {args.stages}: {unknown} unknown; allowed: base, uptrain, scratch")
    targets = args.targets.split(",")
    if unknown := sorted(set(targets) - set(TARGETS)):
        p.error(f"--targets {args.targets}: {unknown} unknown; allowed: {', '.join(TARGETS)}")
    data = _data(args.corpus, args.data_dir)
    n = base_tokens(data)
    done = {r["run"] for r in read_csv(args.out / "runs.csv")}
    runs = [r for r in plan([int(s) for s in args.seeds.split(",")], stages, n, targets) if r.name not in done]
    total = sum(r.tokens for r in runs) / args.tokens_per_s
    print(f"retrofit: {len(runs)} runs left ({len(done)} done), ~{budget.hms(total)} of one process at "
          f"{args.tokens_per_s:,.0f} tokens/s; N = {n:,} tokens")  # fmt: skip
    for r in runs:
        print(f"  {r.name}: {r.tokens:,} tokens")
    if args.plan_only:
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    base_steps = _base_config(data, 0, n).train.num_steps
    started = time.monotonic()
    for run in runs:
        if args.budget_s is not None and time.monotonic() - started + run.tokens / args.tokens_per_s > args.budget_s:
            print(f"retrofit: stopping before {run.name}: --budget-s {args.budget_s:g} would be exceeded")
            break
        base = Run("base", "separate", run.seed, 1.0, n)
        if run.stage == "uptrain" and not (args.scratch / base.name).exists():
            if base.name not in done:
                print(f"retrofit: skipping {run.name}: its base has not run (stage base first)")
                continue
            # a new machine's scratch: the base's row is kept, its workdir trained again (same seed and data; the
            # weights may differ from the first in the last bits where XLA's build or the CPU differ)
            print(f"retrofit: training {base.name} again for its uptraining runs (its row is kept)", flush=True)
            run_one(base, data, args.scratch, base_steps)
        print(f"--- {run.name}: {run.tokens:,} tokens", flush=True)
        append_rows(args.out / "runs.csv", COLUMNS, [run_one(run, data, args.scratch, base_steps)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
