"""The tying penalty across model sizes, each trained on 10 tokens per parameter at its scheme's own learning rate,
on Tiny Shakespeare and a second corpus; resumable.

    python experiments/scaling.py --out experiments/results/scaling_cpu [--stages a,b,...] [--token-scale F]
        [--sizes 48,96,160] [--seeds 0,1,2] [--corpus FILE] [--second-corpus FILE] [--sampling disjoint] [--plan-only]

Protocol (``size_config``): a GPT-2-style byte-level decoder, 4 layers, 4 heads of width D/4 (``--heads N``: N of
width D/N), MLP 4D, context 128, batch 16, learned positions (``--positions rope``: rotary ones, no table); AdamW
(weight decay 0.1, b2 0.99), 5% warmup, cosine to 10%. A size is its width D (default 48, 96, 160: 0.13M, 0.48M and
1.29M parameters for ``separate``, a 10x span; 160 rather than 192 keeps a large run near 25 minutes on a 2-core CPU
instead of 45). Every run at a size sees the same number of tokens, ``--tokens-per-param`` (10) x ``separate``'s
parameters at that size x ``--token-scale``, so tied schemes, having fewer parameters, see slightly more than 10 per
parameter. The final loss is the mean next-byte cross-entropy over the whole validation split.

Variants (``VARIANTS``: data, not branches): the tying schemes of the registry plus ``gqa`` (``separate`` with N/2
KV heads: ``shared_kv``'s cache) and ``bilinear_params`` (``bilinear`` with the MLP narrowed to ``separate``'s
parameter count). Stages, in this order (``--stages`` picks; each skips what is finished):

  lr-small   every variant at the smallest size at each rate of ``--lr-grid`` (LR_GRID), with the seeds of
             ``--sweep-seeds`` (seed 0; 0,1 picks each rate on the mean of two seeds); a rate at the grid's edge
             that wins is followed by the next factor of 2 beyond it (``--max-extensions`` times at most, 2)
  lr-middle  the same at the middle size
  small      the other seeds at the smallest size, each variant at its own best rate (seed 0 is the sweep's run)
  middle     the same at the middle size
  corpus2    every variant at the middle size on the second corpus, at the middle size's rates, every seed
  more       seeds up to MAX_SEEDS where the first seeds (``--seeds``; ``--minor-seeds``' for the minor variants)
             left a variant's mean difference to ``separate`` under twice the seed spread (the larger of the two
             losses' standard deviations), with ``separate`` at the same seeds, named in ``--variants`` or not;
             decided once, on the first seeds only (no stopping when it looks good), for every variant whose first
             seeds are finished (after ``large`` too, when both are asked)
  lr-large   the sweep at the largest size, ``--large-variants`` only (default: LARGE_VARIANTS; optional: 20-40 min
             a run on a 2-core CPU)
  large      ``--large-variants`` at the largest size at its own rates where ``lr-large`` ran, else the middle size's

``--minor-seeds N`` trains the variants outside LARGE_VARIANTS (the five main ones) at the first N seeds only.
A seeded stage trains a variant once that variant's own rate sweep is finished (its grid and any step past a
winning edge), never at a rate the sweep could still move; the other variants need not be finished.

Every finished run appends one fsynced row to ``runs.csv`` and its curve to ``curves.csv``; a rerun skips finished
runs and resumes a killed one from its checkpoint. The plan and an estimated wall time (from tokens/s measured by
finished runs of each size, else by a short probe of the train step) are printed before anything trains, and a
line with the time left before each run. ``experiments/scaling_report.py`` writes the tables and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import budget
from experiments.build_corpus import sha256_file
from experiments.ladder import (  # noqa: F401  (the ladder's names, read here and by the tests)
    BATCH,
    CONTEXT,
    DEFAULT_SIZES,
    NUM_HEADS,
    NUM_LAYERS,
    POSITIONS,
    SHARED_LR,
    VARIANTS,
    size_config,
)
from experiments.rows import PROTOCOL_FILE, append_rows, blank, csv_list, read_csv, write_json
from qkvjax.config import Config, DataConfig
from qkvjax.models.lm import kv_cache_bytes_per_token, param_count
from qkvjax.train.loop import Interrupted
from qkvjax.workdir import learning_curve

REPO = Path(__file__).resolve().parents[1]
SHARED_CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
SECOND_CORPUS = REPO / "experiments" / "corpora" / "python_docs.txt"

LR_GRID = (1e-3, 2e-3, 4e-3, 8e-3)
MAX_EXTENSIONS = 2
LARGE_VARIANTS = ("separate", "shared_kv", "gqa", "shared_qk", "shared_qkv")
STAGES = ("lr-small", "lr-middle", "small", "middle", "corpus2", "more", "lr-large", "large")
DEFAULT_STAGES = tuple(s for s in STAGES if s != "lr-large")  # the largest size's sweep only when asked
SEED_STAGES = ("small", "middle", "corpus2", "large")  # the stages with every variant at every seed
MAX_SEEDS = 5  # ``more`` trains up to this many seeds where the first ones cannot tell a difference
RUN_COLUMNS = (
    "stage", "corpus", "size", "variant", "scheme", "num_kv_heads", "seed", "learning_rate", "params",
    "kv_cache_bytes_per_token", "tokens", "tokens_per_param", "epochs", "steps", "final_val_loss",
    "best_eval_loss", "last_eval_loss", "bits_per_byte", "tokens_per_s", "wall_s", "run", "finished_at", "device",
)  # fmt: skip
CURVE_COLUMNS = ("run", "step", "tokens", "wall_s", "train_loss", "val_loss")


@dataclasses.dataclass(frozen=True)
class Run:
    stage: str
    corpus: str  # a short name: the corpus file's stem
    size: int
    variant: str
    learning_rate: float
    seed: int
    config: Config

    @property
    def name(self) -> str:
        return f"{self.corpus}-d{self.size}-{self.variant}-lr{self.learning_rate:g}-seed{self.seed}"


class Sweep:
    """The protocol's settings, the results so far, and the runs each stage still needs."""

    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.sizes = sorted(args.sizes)
        self.corpora = {"primary": _corpus(args.corpus or args.source_path or str(SHARED_CORPUS), args)}
        second = args.second_corpus or (str(SECOND_CORPUS) if SECOND_CORPUS.is_file() else None)
        self.corpora["second"] = _corpus(second, args) if second else None
        self.rows = read_csv(self.out / "runs.csv")

    def tokens(self, size: int) -> int:
        reference = size_config(size, "separate", 1e-3, 0, 1, self.corpora["primary"][1], self.args.layers,
                                self.args.context, self.args.positions, self.args.heads)  # fmt: skip
        return max(1, round(self.args.tokens_per_param * param_count(reference.model) * self.args.token_scale))

    def run(self, stage, corpus, size, variant, lr, seed) -> Run:
        name, data = self.corpora[corpus]
        config = size_config(size, variant, lr, seed, self.tokens(size), data, self.args.layers, self.args.context,
                             self.args.positions, self.args.heads)  # fmt: skip
        return Run(stage, name, size, variant, lr, seed, config)

    def done(self, run: Run) -> dict | None:
        for r in self.rows:
            if r["run"] == run.name:
                return r
        return None

    def best_lr(self, size: int, variant: str) -> float | None:
        """The rate whose sweep runs at ``size`` on the primary corpus reached the lowest final loss, averaged over
        the sweep seeds (a rate counts once every sweep seed has finished at it), or the one ``--learning-rate``
        fixes for every run; None before any rate is complete."""
        if self.args.learning_rate is not None:
            return self.args.learning_rate
        loss = self.sweep_losses(size, variant)
        return min(loss, key=loss.get) if loss else None

    def sweep_losses(self, size: int, variant: str) -> dict[float, float]:
        """{rate: mean final loss over the sweep seeds} of the rates every sweep seed has finished at ``size``."""
        corpus, seeds = self.corpora["primary"][0], self.args.sweep_seeds
        by_rate: dict[float, dict[int, float]] = {}
        for r in self.rows:
            if (r["stage"].startswith("lr-") and r["corpus"] == corpus and int(r["size"]) == size
                    and r["variant"] == variant and int(r["seed"]) in seeds):  # fmt: skip
                by_rate.setdefault(float(r["learning_rate"]), {})[int(r["seed"])] = float(r["final_val_loss"])
        return {lr: statistics.fmean(v.values()) for lr, v in by_rate.items() if len(v) == len(seeds)}

    def rates_left(self, size: int, variant: str) -> list[float]:
        """The rates ``variant``'s sweep at ``size`` has still to finish at every sweep seed: the grid, then one
        step past a winning edge; [] once its rate is settled (or ``--learning-rate`` fixes it)."""
        if self.args.learning_rate is not None:
            return []
        grid = self.args.lr_grid
        rates, done = set(grid), set(self.sweep_losses(size, variant))
        if rates <= done:  # the grid is finished: extend past an edge that wins
            best = self.best_lr(size, variant)
            limit = self.args.max_extensions
            if best == min(done) and math.log2(min(grid) / best) < limit:
                rates.add(best / 2)
            elif best == max(done) and math.log2(best / max(grid)) < limit:
                rates.add(best * 2)
        return sorted(rates - done)

    def lr_runs(self, stage: str, size: int) -> list[Run]:
        """The sweep's runs at ``size`` still to train."""
        variants = [v for v in self.args.variants if stage != "lr-large" or v in self.args.large_variants]
        runs = [self.run(stage, "primary", size, variant, lr, seed)
                for variant in variants for seed in self.args.sweep_seeds
                for lr in self.rates_left(size, variant)]  # fmt: skip
        return [r for r in runs if not self.done(r)]

    def group(self, stage: str) -> tuple[int, str, list[str], int]:
        """A seeded stage's size, corpus, variants and the size whose sweep chose their rates."""
        small, middle, large = self.sizes[0], self.sizes[len(self.sizes) // 2], self.sizes[-1]
        return {
            "small": (small, "primary", self.args.variants, small),
            "middle": (middle, "primary", self.args.variants, middle),
            "corpus2": (middle, "second", self.args.variants, middle),
            "large": (large, "primary", [v for v in self.args.variants if v in self.args.large_variants],
                      large if "lr-large" in self.args.stages or any(r.get("stage") == "lr-large" for r in self.rows)
                      else middle),
        }[stage]  # fmt: skip

    def seeded_run(self, stage: str, variant: str, seed: int, label: str | None = None) -> Run:
        size, corpus, _, rate_size = self.group(stage)
        # a rate the sweep may still move is not one to train at: workers running the stages side by side
        # (parallel_sweep.py) start a variant's seeds once its own sweep is finished, not every variant's
        lr = None if self.rates_left(rate_size, variant) else self.best_lr(rate_size, variant)
        run = self.run(label or stage, corpus, size, variant, lr if lr is not None else SHARED_LR, seed)
        return run if lr is not None else dataclasses.replace(run, learning_rate=float("nan"))  # rate not known yet

    def stage_runs(self, stage: str) -> list[Run]:
        """What ``stage`` still has to train, as far as it can be planned now (rates come from the sweeps)."""
        if stage in ("lr-small", "lr-middle", "lr-large"):
            if self.args.learning_rate is not None:  # one fixed rate: nothing to sweep
                return []
            index = {"lr-small": 0, "lr-middle": len(self.sizes) // 2, "lr-large": -1}[stage]
            return self.lr_runs(stage, self.sizes[index])
        if stage == "more":
            return [run for s in SEED_STAGES for run in self.more_runs(s)]
        _, corpus, variants, _ = self.group(stage)
        if corpus == "second" and self.corpora["second"] is None:
            return []
        # Seed-major: a partial stage has every variant for the first seeds. Seed 0 at the best rate is the sweep's
        # own run, found done by its name.
        runs = [self.seeded_run(stage, v, seed) for seed in self.args.seeds for v in variants
                if seed in self.first_seeds(v)]  # fmt: skip
        # a sweep seed at a rate not chosen yet will be the sweep's own run at the winning rate: not one to plan
        pending = self.args.learning_rate is None and corpus == "primary"
        runs = [r for r in runs if not (pending and math.isnan(r.learning_rate) and r.seed in self.args.sweep_seeds)]
        return [r for r in runs if not self.done(r)]

    def first_seeds(self, variant: str) -> list[int]:
        """The seeds a seeded stage trains ``variant`` at: ``--seeds``, or its first ``--minor-seeds`` outside
        LARGE_VARIANTS."""
        minor = self.args.minor_seeds or len(self.args.seeds)
        return self.args.seeds if variant in LARGE_VARIANTS else self.args.seeds[:minor]

    def undecided(self, stage: str) -> list[str]:
        """The variants of a seeded stage whose mean difference to ``separate`` over their first seeds (``separate``
        at the same seeds, whether or not ``--variants`` names it) is under twice the seed spread; a variant is
        decided only once all those runs are finished."""
        _, corpus, variants, _ = self.group(stage)
        if corpus == "second" and self.corpora["second"] is None:
            return []

        def losses(variant: str, seeds: list[int]) -> list[float] | None:
            rows = [self.done(self.seeded_run(stage, variant, seed)) for seed in seeds]
            return [float(r["final_val_loss"]) for r in rows] if len(rows) >= 2 and all(rows) else None

        out = []
        for variant in (v for v in variants if v != "separate"):
            seeds = self.first_seeds(variant)
            mine, ref = losses(variant, seeds), losses("separate", seeds)
            if mine is None or ref is None:
                continue
            delta = statistics.fmean(mine) - statistics.fmean(ref)
            if abs(delta) < 2 * max(statistics.stdev(mine), statistics.stdev(ref)):
                out.append(variant)
        return out

    def more_runs(self, stage: str) -> list[Run]:
        """The extra seeds ``stage`` still needs: up to MAX_SEEDS for each undecided variant and ``separate``."""
        extra = {}  # variant -> the seeds after its first ones, up to MAX_SEEDS in all
        for variant in self.undecided(stage):
            seeds = self.first_seeds(variant)
            extra[variant] = range(max(seeds) + 1, max(seeds) + 1 + MAX_SEEDS - len(seeds))
        runs = []
        for seed in sorted({seed for seeds in extra.values() for seed in seeds}):
            # seed-major, ``separate`` first at each seed: a partial stage pairs every variant it reached
            variants = ["separate", *(v for v, seeds in extra.items() if seed in seeds)]
            runs += [self.seeded_run(stage, v, seed, "more") for v in variants]
        return [r for r in runs if not self.done(r)]


def _corpus(path: str, args) -> tuple[str, DataConfig]:
    """(short name, data config) of a corpus file; Tiny Shakespeare goes through its TFDS builder."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"corpus {path} does not exist; allowed: a UTF-8 text file (--corpus / --second-corpus)")
    data_dir = os.path.abspath(os.path.expanduser(args.data_dir))
    sampling = None if args.sampling == "random" else args.sampling  # None: the byte corpus' default, random
    if Path(path) == SHARED_CORPUS and not args.corpus:
        return "shakespeare", DataConfig(dataset="tiny_shakespeare", source_path=path, data_dir=data_dir,
                                         sampling=sampling)  # fmt: skip
    return Path(path).stem, DataConfig(dataset="text_file", source_path=path, data_dir=data_dir, sampling=sampling)


# ------------------------------------------------------------------------------------------------------------
# Budget: measured tokens/s per size (finished runs, else a probe of the train step), then the runs' sum.


def speeds(sweep: Sweep) -> dict[int, float]:
    """Tokens/s per size: the median of finished runs, else a probe (kept in ``probe.json`` for reruns)."""
    cache_file = sweep.out / "probe.json"
    cache = json.loads(cache_file.read_text()) if cache_file.exists() else {}
    out = {}
    for size in sweep.sizes:
        measured = [float(r["tokens_per_s"]) for r in sweep.rows if int(r["size"]) == size and r["tokens_per_s"]]
        if measured:
            out[size] = statistics.median(measured)
            continue
        key = f"d{size}-L{sweep.args.layers}-T{sweep.args.context}"
        if key not in cache:
            cache[key] = budget.probe(sweep.run("lr-small", "primary", size, "separate", 1e-3, 0).config)
            write_json(cache_file, cache)
        out[size] = cache[key]
    return out


def estimate_s(run: Run, tokens_per_s: dict[int, float]) -> float:
    return budget.run_seconds(run.config, tokens_per_s[run.size])


# ------------------------------------------------------------------------------------------------------------


def check_protocol(sweep: Sweep) -> None:
    """A results folder holds one protocol: sizes may be added, seeds too, but not another model or budget."""
    a = sweep.args
    protocol = {"layers": a.layers, "context": a.context, "heads": a.heads, "batch": BATCH,
                "tokens_per_param": a.tokens_per_param, "token_scale": a.token_scale,
                "primary": sweep.corpora["primary"][0], "lr_grid": list(a.lr_grid),
                "learning_rate": a.learning_rate,
                "sweep_seeds": None if a.sweep_seeds == [0] else list(a.sweep_seeds),
                "positions": None if a.positions == "learned" else a.positions,
                "sampling": None if a.sampling == "random" else a.sampling}  # fmt: skip
    path = sweep.out / PROTOCOL_FILE
    if path.exists():
        old = json.loads(path.read_text())["protocol"]  # a field added since then reads as None (its default)
        changed = ", ".join(f"{k}: {old.get(k)!r} -> {v!r}" for k, v in protocol.items() if old.get(k) != v)
        if changed:
            raise ValueError(f"{sweep.out} holds a sweep of another protocol ({changed}); use another --out")
        recorded = json.loads(path.read_text()).get("corpora", {})
        for name, data in filter(None, sweep.corpora.values()):  # the same name with other text: other runs
            if name in recorded and sha256_file(data.source_path) != recorded[name]["sha256"]:
                raise ValueError(f"{data.source_path} is not the {name} text {sweep.out} was swept on (sha256 "
                                 f"{recorded[name]['sha256'][:12]}...); rebuild it or use another --out")  # fmt: skip
        return
    import jax

    sweep.out.mkdir(parents=True, exist_ok=True)
    corpora = {}
    for name, data in filter(None, sweep.corpora.values()):
        corpora[name] = {"path": data.source_path, "sha256": sha256_file(data.source_path)}
    record = {
        "protocol": protocol,
        "corpora": corpora,
        # the sweep's command: a --plan-only first call (parallel_sweep.py's) plans the same sweep it names
        "command": "python " + shlex.join(["experiments/scaling.py", *(a for a in sys.argv[1:] if a != "--plan-only")]),
        "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, "
        f"jax {jax.__version__} on {jax.devices()[0].device_kind})",
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    write_json(path, record)


def train_split_bytes(data: DataConfig) -> int:
    from qkvjax.data.builders import load_splits

    return len(load_splits(data.dataset, data.source_path, data.data_dir)["train"])


def finish_row(run: Run, workdir: Path, result: dict, train_bytes: int) -> tuple[dict, list[dict]]:
    """The run's row for runs.csv and its curve; ``epochs`` is tokens seen over the training split's bytes."""
    from qkvjax.workdir import read_metrics

    train_records, eval_records = read_metrics(str(workdir))
    c = run.config
    tokens_per_step = c.train.batch_size * c.seq_len
    curve = [{"run": run.name, "step": p["step"], "tokens": p["step"] * tokens_per_step,
              "wall_s": round(p["wall_s"], 3), "train_loss": blank(p["train_loss"]), "val_loss": blank(p["val_loss"])}
             for p in learning_curve(train_records, eval_records, tokens_per_step)]  # fmt: skip
    measured = sorted(r["tokens_per_s"] for r in train_records if r.get("tokens_per_s"))
    tokens = c.train.num_steps * tokens_per_step
    params = param_count(c.model)
    evals = [r["loss"] for r in eval_records if r.get("loss") is not None]
    row = {
        "stage": run.stage, "corpus": run.corpus, "size": run.size, "variant": run.variant,
        "scheme": c.model.attention.scheme, "num_kv_heads": c.model.attention.kv_heads, "seed": run.seed,
        "learning_rate": run.learning_rate, "params": params,
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(c.model), "tokens": tokens,
        "tokens_per_param": round(tokens / params, 2), "epochs": round(tokens / train_bytes, 3),
        "steps": c.train.num_steps,
        "final_val_loss": result["loss"], "best_eval_loss": min(evals) if evals else "",
        "last_eval_loss": evals[-1] if evals else "", "bits_per_byte": result["bits_per_byte"],
        "tokens_per_s": round(measured[len(measured) // 2], 1) if measured else "",
        "wall_s": curve[-1]["wall_s"] if curve else "", "run": run.name,
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": device_label(),
    }  # fmt: skip
    return row, curve


def print_plan(sweep: Sweep, stages, rates: dict[int, float]) -> float:
    total = 0.0
    print("tokens/s per size (measured): " + ", ".join(f"d{s}: {v:,.0f}" for s, v in rates.items()))
    for stage in stages:
        runs = sweep.stage_runs(stage)
        seconds = sum(estimate_s(r, rates) for r in runs)
        total += seconds
        sizes = sorted({r.size for r in runs})
        tokens = sorted({r.config.train.num_steps * r.config.train.batch_size * r.config.seq_len for r in runs})
        print(f"  {stage:9s} {len(runs):3d} runs to go (sizes {sizes}, {tokens[-1] if tokens else 0:,} tokens "
              f"each at most): ~{budget.hms(seconds)}" + (" (rates chosen when the sweeps finish)" if any(
                  math.isnan(r.learning_rate) for r in runs) else "")
              + (" (and those of stages whose first seeds are not done)" if stage == "more" else ""))  # fmt: skip
    if sweep.corpora["second"] is None and "corpus2" in stages:
        print(f"  corpus2: no second corpus ({SECOND_CORPUS} absent): build it with experiments/build_corpus.py")
    print(f"estimated wall time of what is left: ~{budget.hms(total)} (one process)", flush=True)
    return total


def main_sweep(args) -> Path:
    from qkvjax.evaluate import evaluate
    from qkvjax.perf import measure_peak_flops
    from qkvjax.train.loop import train

    sweep = Sweep(args)
    stages = args.stages
    check_protocol(sweep)
    rates = speeds(sweep)
    left = print_plan(sweep, stages, rates)
    if args.plan_only:
        return sweep.out
    peak, started, split_bytes = None, time.monotonic(), {}
    if "more" in stages and "large" in stages[stages.index("more") :]:
        stages = [*stages, "more"]  # the largest size's extra seeds, once its first ones exist
    taken = set()  # runs another worker claimed (--claims)
    for stage in stages:
        while True:  # a sweep stage grows as edges win; others are planned once their rates exist
            runs = [r for r in sweep.stage_runs(stage) if not math.isnan(r.learning_rate) and r.name not in taken]
            if not runs:
                break
            run = runs[0]
            if args.claims and not claim(Path(args.claims), run.name):
                taken.add(run.name)
                continue
            eta = estimate_s(run, rates)
            rest = budget.hms(max(left - (time.monotonic() - started), eta))
            print(f"--- {stage} [{len(runs)} left in stage] {run.name}: {run.config.train.num_steps} steps, "
                  f"~{budget.hms(eta)}; sweep ~{rest} left", flush=True)  # fmt: skip
            peak = peak or measure_peak_flops(run.config.model.attention.dtype)
            config = dataclasses.replace(run.config, train=dataclasses.replace(run.config.train, peak_flops=peak))
            workdir = sweep.out / "runs" / run.name
            train(config, str(workdir))
            result = evaluate(str(workdir), split="validation")
            data = run.config.data
            split_bytes.setdefault(data.source_path, train_split_bytes(data))
            row, curve = finish_row(run, workdir, result, split_bytes[data.source_path])
            _drop_curve(sweep.out / "curves.csv", run)
            append_rows(sweep.out / "curves.csv", CURVE_COLUMNS, curve)
            append_rows(sweep.out / "runs.csv", RUN_COLUMNS, [row])
            sweep.rows.append({k: str(v) for k, v in row.items()})
    print(f"sweep finished: {len(sweep.rows)} runs in {sweep.out / 'runs.csv'}")
    return sweep.out


def claim(folder: Path, name: str) -> bool:
    """True for the one worker that creates ``folder/name`` first (O_EXCL: atomic on a local file system), so
    workers sharing ``--claims`` never train the same run (``experiments/parallel_sweep.py``)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def device_label() -> str:
    """What trained a row: the accelerator's name, or the CPU with its cores ('' in rows written before 2026-11-26,
    all from the 2-core CPU VM that protocol.json names)."""
    import jax

    d = jax.devices()[0]
    return d.device_kind if d.platform != "cpu" else f"cpu ({os.cpu_count()} cores)"


def rebuild_curves(out: Path) -> int:
    """Rewrites ``curves.csv`` (atomically) from the metrics of every finished run's workdir, so curves written
    before evaluations between logged steps were kept gain them. Run it with the sweep stopped."""
    from qkvjax.workdir import load_config, read_metrics

    rows, curve = read_csv(out / "runs.csv"), []
    for row in rows:
        workdir = out / "runs" / row["run"]
        if not (workdir / "metrics.jsonl").exists():
            raise ValueError(f"{workdir} has no metrics.jsonl: its curve cannot be rebuilt (nothing was written)")
        c = load_config(workdir)
        tokens_per_step = c.train.batch_size * c.seq_len
        train_records, eval_records = read_metrics(str(workdir))
        curve += [{"run": row["run"], "step": p["step"], "tokens": p["step"] * tokens_per_step,
                   "wall_s": round(p["wall_s"], 3), "train_loss": blank(p["train_loss"]),
                   "val_loss": blank(p["val_loss"])}
                  for p in learning_curve(train_records, eval_records, tokens_per_step)]  # fmt: skip
    tmp = out / "curves.csv.tmp"
    tmp.unlink(missing_ok=True)
    append_rows(tmp, CURVE_COLUMNS, curve)
    os.replace(tmp, out / "curves.csv")
    return len(rows)


def _drop_curve(path: Path, run: Run) -> None:
    """Drops the curve rows of a run killed between its curve and its row (the file rewritten atomically)."""
    rows = read_csv(path)
    keep = [r for r in rows if r["run"] != run.name]
    if len(keep) != len(rows):
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        append_rows(tmp, CURVE_COLUMNS, keep)
        os.replace(tmp, path)


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}; allowed: a number > 0") from None
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}; allowed: a finite number > 0")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results folder: runs.csv, curves.csv, protocol.json, runs/")
    p.add_argument("--stages", type=csv_list(str), default=list(DEFAULT_STAGES),
                   help="default: " + ",".join(DEFAULT_STAGES))  # fmt: skip
    p.add_argument("--sizes", type=csv_list(int), default=list(DEFAULT_SIZES), help="d_model of each size")
    p.add_argument("--variants", type=csv_list(str), default=list(VARIANTS), help="default: " + ",".join(VARIANTS))
    p.add_argument("--seeds", type=csv_list(int), default=[0, 1, 2], help="default: 0,1,2")
    p.add_argument("--token-scale", type=_positive(float), default=1.0, help="x every run's token budget (1)")
    p.add_argument("--tokens-per-param", type=_positive(float), default=10.0, help="default: 10")
    p.add_argument("--learning-rate", type=_positive(float), default=None, help="one rate for every run: no sweep")
    p.add_argument("--lr-grid", type=csv_list(float), default=list(LR_GRID), help="the sweeps' rates (default: "
                   + ",".join(f"{x:g}" for x in LR_GRID) + ")")  # fmt: skip
    p.add_argument("--sweep-seeds", type=csv_list(int), default=[0], help="seeds a rate is judged on (default: 0)")
    p.add_argument("--max-extensions", type=int, default=MAX_EXTENSIONS,
                   help=f"factors of 2 a winning edge may be extended by (default: {MAX_EXTENSIONS})")  # fmt: skip
    p.add_argument(
        "--large-variants",
        type=csv_list(str),
        default=list(LARGE_VARIANTS),
        help=f"the variants the largest size trains, of --variants (default: {','.join(LARGE_VARIANTS)})",
    )
    p.add_argument("--minor-seeds", type=_positive(int), default=None,
                   help="seeds for the variants outside the five main ones (default: all of --seeds)")  # fmt: skip
    p.add_argument("--layers", type=_positive(int), default=NUM_LAYERS, help=f"default: {NUM_LAYERS}")
    p.add_argument("--heads", type=_positive(int), default=NUM_HEADS,
                   help=f"query heads N per layer, H = D / N (default: {NUM_HEADS}); a variant's K/V heads are its "
                   "fraction of N")  # fmt: skip
    p.add_argument("--context", type=_positive(int), default=CONTEXT, help=f"default: {CONTEXT}")
    p.add_argument("--positions", choices=POSITIONS, default="learned",
                   help="learned: an absolute table (default); rope: rotary positions in every layer, no table, "
                   "a latent's rotary key taken out of its rank")  # fmt: skip
    p.add_argument("--sampling", choices=("random", "disjoint"), default="random",
                   help="training windows at random offsets (default; the sweeps before 2026-12-08), or disjoint: "
                   "each target once per epoch, in a seeded order (data.sampling)")  # fmt: skip
    p.add_argument("--corpus", default=None, help="any UTF-8 text instead of Tiny Shakespeare")
    p.add_argument("--second-corpus", default=None, help=f"default: {SECOND_CORPUS} (build_corpus.py)")
    p.add_argument("--source-path", default=None, help="local Tiny Shakespeare (default: ../shared's copy)")
    p.add_argument("--data-dir", default="~/tensorflow_datasets", help="TFDS data_dir")
    p.add_argument("--plan-only", action="store_true", help="print the plan and the estimate, train nothing")
    p.add_argument("--rebuild-curves", action="store_true", help="rewrite curves.csv from the runs' workdirs")
    p.add_argument("--claims", default=None, help="a folder shared by parallel workers: each run is trained by the "
                   "worker that claims it first (experiments/parallel_sweep.py)")  # fmt: skip
    return p


def check_args(args) -> None:
    """Everything refused before a file is written or a probe compiles."""
    for name, values, allowed in (
        ("stage", args.stages, STAGES),
        ("variant", args.variants, VARIANTS),
        ("--large-variants value", args.large_variants, VARIANTS),
    ):
        for value in values:
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; allowed: {','.join(allowed)}")
    if not args.stages or not args.variants or not args.seeds:
        raise ValueError("--stages, --variants and --seeds each need at least one value")
    if len(args.sizes) != 3 or len(set(args.sizes)) != 3:
        raise ValueError(f"--sizes={args.sizes}; allowed: three distinct widths (small, middle, large)")
    for size in args.sizes:
        if size < args.heads or size % args.heads:
            raise ValueError(f"--sizes: {size}; allowed: a multiple of --heads {args.heads}, at least {args.heads}")
    for size in args.sizes:  # every model the sweep may build, built now: its config's own check, before any write
        for variant in dict.fromkeys([*args.variants, *args.large_variants]):
            try:
                size_config(size, variant, 1e-3, 0, 1, DataConfig(), args.layers, args.context, args.positions,
                            args.heads)  # fmt: skip
            except ValueError as e:
                raise ValueError(f"--sizes {size}, variant {variant}, --positions {args.positions}, --heads "
                                 f"{args.heads}: {e}") from None  # fmt: skip
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        raise ValueError(f"--seeds={args.seeds}; allowed: distinct integers >= 0")
    if not args.sweep_seeds or not set(args.sweep_seeds) <= set(args.seeds):
        raise ValueError(f"--sweep-seeds={args.sweep_seeds}; allowed: some of --seeds {args.seeds}")
    if args.max_extensions < 0:
        raise ValueError(f"--max-extensions={args.max_extensions}; allowed: an integer >= 0")
    if not args.lr_grid or min(args.lr_grid) <= 0 or len(set(args.lr_grid)) != len(args.lr_grid):
        raise ValueError(f"--lr-grid={args.lr_grid}; allowed: distinct rates > 0")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        if args.rebuild_curves:
            print(f"scaling: rebuilt the curves of {rebuild_curves(Path(args.out))} runs in {args.out}/curves.csv")
            return 0
        main_sweep(args)
    except Interrupted as e:  # the run in progress saved its checkpoint; no row for it: rerun to continue
        print(f"scaling: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:
        print(f"scaling: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
