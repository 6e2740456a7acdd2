"""Where tying should hurt: every scheme on synthetic sequence tasks, with a bidirectional encoder.

    python experiments/synthetic.py --out DIR [--preset cpu|gpu] [--grids main,rope,size] [--tasks ...]
        [--schemes ...] [--seeds ...] [--steps N] [--report-only]

Tasks (``qkvjax/data/synthetic.py``): copy, sub, reverse, sort, swap and the directional probe ``left``, on digit
sequences generated from the seed; accuracy is measured on 1,000 held-out sequences never seen in training.
A scheme label ``NAME+asym`` is scheme NAME with the learned asymmetric relative bias (``relative_bias`` = L - 1,
every offset its own parameter). Grids of the preset (``--tasks/--schemes/--seeds`` narrow them):

  main  every task x every scheme (+ shared_qk+asym, shared_qkv+asym), learned absolute positions;
  rope  the order-sensitive tasks with rotary positions only (bilinear cannot rotate; it is left out);
  size  one axis at a time around the base model (width, depth, heads, length) for a few schemes and tasks.

Each finished run appends a row to ``DIR/results.csv``; rerunning skips finished rows, so a killed sweep loses at
most the run in progress (runs take seconds to a minute; they are not checkpointed). At the end (or with
``--report-only``) it writes ``DIR/summary.md`` (mean ± std over seeds) and ``DIR/heatmap.png`` (tasks x schemes).
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from experiments import report
from experiments.rows import append_rows
from qkvjax.attention import SCHEMES, AttentionConfig
from qkvjax.data.synthetic import TASKS, TaskData, check_task, num_classes
from qkvjax.models.encoder import Encoder, EncoderConfig, encoder_param_count

COLUMNS = ("task", "scheme", "seed", "d_model", "layers", "heads", "length", "positions", "steps",
           "token_acc", "seq_acc", "params", "wall_s", "finished_at")  # fmt: skip
KEY = COLUMNS[:9]
ASYM = "+asym"
GRIDS = ("main", "rope", "size")


@dataclasses.dataclass(frozen=True)
class Probe:
    task: str
    scheme: str  # a registered scheme, or NAME+asym
    seed: int
    d_model: int
    layers: int
    heads: int
    length: int
    positions: str  # "learned" | "rope"
    steps: int

    def key(self) -> tuple[str, ...]:
        return tuple(str(getattr(self, k)) for k in KEY)

    def encoder_config(self) -> EncoderConfig:
        """The model; ValueError naming what does not fit."""
        check_task(self.task, self.length)
        name, asym = (self.scheme[: -len(ASYM)], True) if self.scheme.endswith(ASYM) else (self.scheme, False)
        if name not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}; allowed: {sorted(SCHEMES)} (each also as NAME{ASYM})")
        if self.positions not in ("learned", "rope"):
            raise ValueError(f"positions={self.positions!r}; allowed: learned, rope")
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by heads={self.heads}")
        attention = AttentionConfig(
            num_heads=self.heads,
            head_dim=self.d_model // self.heads,
            scheme=name,
            rope=self.positions == "rope",
            relative_bias=self.length - 1 if asym else 0,
        )
        return EncoderConfig(
            attention=attention, vocab_size=10, num_classes=num_classes(self.task), d_model=self.d_model,
            num_layers=self.layers, max_len=self.length, learned_positions=self.positions == "learned",
        )  # fmt: skip


PRESETS = {
    # 400 steps: ~5-10 s a run on a 2-core CPU, the whole default sweep (282 runs) 30-40 minutes.
    "cpu": {"d_model": 64, "layers": 2, "heads": 4, "length": 16, "steps": 400, "batch_size": 64, "lr": 3e-3,
            "seeds": [0, 1, 2], "size_seeds": [0],
            "size": {"d_model": [32, 128], "layers": [1, 4], "heads": [2, 8], "length": [8, 32]},
            "size_tasks": ["reverse", "sort", "left"], "size_schemes": ["separate", "shared_qk", "shared_qkv"],
            "rope_tasks": ["reverse", "left"]},
    "gpu": {"d_model": 256, "layers": 4, "heads": 8, "length": 32, "steps": 10000, "batch_size": 256, "lr": 1e-3,
            "seeds": [0, 1, 2, 3, 4], "size_seeds": [0, 1, 2],
            "size": {"d_model": [128, 512], "layers": [2, 8], "heads": [4, 16], "length": [16, 64]},
            "size_tasks": ["reverse", "sort", "swap", "left"],
            "size_schemes": ["separate", "shared_qk", "shared_kv", "shared_qkv", "shared_qk+asym"],
            "rope_tasks": ["reverse", "sort", "swap", "left"]},
}  # fmt: skip
# The tying schemes (latent ones, such as mla, run when named in --schemes), plus the asymmetric variants.
DEFAULT_SCHEMES = [*(n for n, s in SCHEMES.items() if not s.latent), f"shared_qk{ASYM}", f"shared_qkv{ASYM}"]


def plan(preset: dict, grids, tasks=None, schemes=None, seeds=None, steps=None, length=None) -> list[Probe]:
    """Every probe of the requested grids, seed-major; validated before anything trains."""
    for name, values, allowed in (("grid", grids, GRIDS), ("task", tasks or [], TASKS)):
        for value in values:
            if value not in allowed:
                raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")
    if seeds is not None and not seeds:
        raise ValueError("--seeds is empty; give at least one integer seed")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps={steps}; allowed: an integer >= 1")
    base = {k: preset[k] for k in ("d_model", "layers", "heads", "length")} | {"steps": steps or preset["steps"]}
    if length is not None:
        base["length"] = length
    want_tasks = lambda ts: [t for t in ts if tasks is None or t in tasks]  # noqa: E731
    want_schemes = lambda ss: [s for s in ss if schemes is None or s in schemes]  # noqa: E731
    cells = []  # (seeds, Probe without seed)
    for grid in grids:
        if grid == "main":
            for t in want_tasks(TASKS):
                for s in schemes or DEFAULT_SCHEMES:
                    cells.append((seeds or preset["seeds"], dict(base, task=t, scheme=s, positions="learned")))
        elif grid == "rope":
            for t in want_tasks(preset["rope_tasks"]):
                for s in schemes or DEFAULT_SCHEMES:
                    spec = dict(base, task=t, scheme=s, positions="rope")
                    if schemes is None and not _fits(spec):
                        continue  # a scheme that cannot rotate (bilinear) leaves the default grid; named, it errs
                    cells.append((seeds or preset["seeds"], spec))
        else:
            for axis, values in preset["size"].items():
                for value in values:
                    for t in want_tasks(preset["size_tasks"]):
                        for s in want_schemes(preset["size_schemes"]) if schemes is None else schemes:
                            spec = dict(base, task=t, scheme=s, positions="learned") | {axis: value}
                            cells.append((seeds or preset["size_seeds"], spec))
    probes, seen = [], set()
    for seed in sorted({s for ss, _ in cells for s in ss}):
        for ss, spec in cells:
            probe = Probe(seed=seed, **spec)
            if seed in ss and probe.key() not in seen:
                probe.encoder_config()  # raises on anything that does not fit
                seen.add(probe.key())
                probes.append(probe)
    return probes


def _fits(spec: dict) -> bool:
    try:
        Probe(seed=0, **spec).encoder_config()
        return True
    except ValueError:
        return False


def train_probe(probe: Probe, batch_size: int, lr: float) -> dict:
    """Trains one encoder on one task; accuracy on the held-out set."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    cfg = probe.encoder_config()
    model = Encoder(cfg)
    data = TaskData(probe.task, probe.length, probe.seed)
    params = nn.meta.unbox(model.init(jax.random.key(probe.seed), jnp.zeros((1, probe.length), jnp.int32)))["params"]
    schedule = optax.warmup_cosine_decay_schedule(lr / 10, lr, max(probe.steps // 20, 1), probe.steps, lr / 10)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = tx.init(params)

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    start = time.perf_counter()
    for _ in range(probe.steps):
        params, opt_state, _ = step(params, opt_state, *data.batch(batch_size))
    predict = jax.jit(lambda p, x: jnp.argmax(model.apply({"params": p}, x), axis=-1))
    correct = np.asarray(predict(params, data.eval_inputs)) == data.eval_targets
    return {
        "token_acc": float(correct.mean()),
        "seq_acc": float(correct.all(axis=1).mean()),
        "params": encoder_param_count(cfg),
        "wall_s": round(time.perf_counter() - start, 2),
    }


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def sweep(args) -> Path:
    out = Path(args.out)
    preset = PRESETS[args.preset]
    probes = plan(preset, args.grids, args.tasks, args.schemes, args.seeds, args.steps, args.length)
    base = {k: preset[k] for k in ("d_model", "layers", "heads")}
    base |= {"length": args.length or preset["length"], "steps": args.steps or preset["steps"]}
    protocol = {"preset": args.preset, "base": base, "batch_size": preset["batch_size"], "lr": preset["lr"]}
    meta = out / "protocol.json"
    if meta.exists():
        old = json.loads(meta.read_text())
        if {k: old.get(k) for k in protocol} != protocol:
            raise ValueError(f"{out} holds probes of another protocol ({meta}); use another --out")
    else:
        import jax

        out.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({
            **protocol,
            "command": "python " + shlex.join(["experiments/synthetic.py", *sys.argv[1:]]),
            "machine": f"{platform.node()} ({platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
                       f"on {jax.devices()[0].device_kind})",
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }, indent=2) + "\n")  # fmt: skip
    results = out / "results.csv"
    done = {tuple(r[k] for k in KEY) for r in read_results(results)}
    todo = [p for p in probes if p.key() not in done]
    print(f"{len(probes)} probes, {len(probes) - len(todo)} already finished, {len(todo)} to go", flush=True)
    for i, probe in enumerate(todo, 1):
        result = train_probe(probe, preset["batch_size"], preset["lr"])
        row = {**dataclasses.asdict(probe), **result}
        row["finished_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        append_rows(results, COLUMNS, [row])
        print(f"[{i}/{len(todo)}] {probe.task:<8} {probe.scheme:<16} seed {probe.seed} d{probe.d_model} "
              f"l{probe.layers} h{probe.heads} L{probe.length} {probe.positions:<7} token {result['token_acc']:.3f} "
              f"seq {result['seq_acc']:.3f} ({result['wall_s']:.1f}s)", flush=True)  # fmt: skip
    write_report(out)
    return out


# ------------------------------------------------------------------------------------------------------------
# Report


def _cells(rows: list[dict], where) -> dict:
    """(task, scheme) -> {"token": [...], "seq": [...]} over the rows ``where`` accepts."""
    cells = collections.defaultdict(lambda: {"token": [], "seq": []})
    for r in rows:
        if where(r):
            cells[r["task"], r["scheme"]]["token"].append(float(r["token_acc"]))
            cells[r["task"], r["scheme"]]["seq"].append(float(r["seq_acc"]))
    return cells


def _ms(values: list[float]) -> str:
    if not values:
        return ""
    std = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.3f}{std}"


def _table(cells: dict, metric: str) -> list[str]:
    tasks = [t for t in TASKS if any(k[0] == t for k in cells)]
    schemes = [s for s in DEFAULT_SCHEMES if any(k[1] == s for k in cells)]
    schemes += sorted({k[1] for k in cells} - set(schemes))
    lines = ["| task | " + " | ".join(schemes) + " |", "|---|" + "---:|" * len(schemes)]
    for t in tasks:
        lines.append(f"| {t} | " + " | ".join(_ms(cells.get((t, s), {metric: []})[metric]) for s in schemes) + " |")
    return lines


def write_report(out: Path) -> Path:
    rows = read_results(out / "results.csv")
    if not rows:
        raise ValueError(f"{out} has no finished probes (no rows in {out / 'results.csv'})")
    meta = json.loads((out / "protocol.json").read_text())
    base = {k: str(meta["base"][k]) for k in ("d_model", "layers", "heads", "length")}
    is_base = lambda r: all(r[k] == v for k, v in base.items())  # noqa: E731
    main = _cells(rows, lambda r: is_base(r) and r["positions"] == "learned")
    rope = _cells(rows, lambda r: is_base(r) and r["positions"] == "rope")
    lines = [
        f"# Synthetic probes: {out.name}",
        "",
        f"- command: `{meta.get('command', '?')}`",
        f"- machine: {meta.get('machine', '?')}; started {meta.get('started', '?')}; {len(rows)} runs finished",
        f"- base model: bidirectional encoder, d_model {base['d_model']}, {base['layers']} layers, {base['heads']} "
        f"heads, length {base['length']}; batch {meta.get('batch_size')}, AdamW lr {meta.get('lr')}, "
        f"{meta['base']['steps']} steps; accuracy on 1,000 held-out sequences, mean ± std over seeds",
        "",
    ]
    for title, cells in (("learned absolute positions", main), ("rotary positions only", rope)):
        if cells:
            lines += [f"## Per-token accuracy, {title}", "", *_table(cells, "token"), ""]
            lines += [f"## Whole-sequence accuracy, {title}", "", *_table(cells, "seq"), ""]
    sized = [r for r in rows if not is_base(r)]
    if sized:
        lines += ["## Size sweep (one axis changed from the base; per-token accuracy)", ""]
        for axis in ("d_model", "layers", "heads", "length"):
            for value in sorted({int(r[axis]) for r in sized if r[axis] != base[axis]}):
                cells = _cells(sized, lambda r, a=axis, v=value: r[a] == str(v))
                lines += [f"### {axis} = {value}", "", *_table(cells, "token"), ""]
    (out / "summary.md").write_text("\n".join(lines))
    plot_heatmap(main, rope, out / "heatmap.png")
    return out / "summary.md"


def plot_heatmap(main: dict, rope: dict, path: Path) -> None:
    plt = report.pyplot()

    panels = [(f"{m} accuracy, {t}", c, m) for t, c in (("learned positions", main), ("rotary only", rope)) if c
              for m in ("token", "seq")]  # fmt: skip
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 2.6 * len(panels) + 0.6), squeeze=False)
    for ax, (title, cells, metric) in zip(axes[:, 0], panels, strict=True):
        tasks = [t for t in TASKS if any(k[0] == t for k in cells)]
        schemes = [s for s in DEFAULT_SCHEMES if any(k[1] == s for k in cells)]
        grid = np.full((len(tasks), len(schemes)), np.nan)
        for i, t in enumerate(tasks):
            for j, s in enumerate(schemes):
                if cells.get((t, s), {metric: []})[metric]:
                    grid[i, j] = statistics.fmean(cells[t, s][metric])
        im = ax.imshow(grid, cmap="viridis", vmin=0, vmax=1, aspect="auto")
        for i in range(len(tasks)):
            for j in range(len(schemes)):
                if np.isfinite(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8,
                            color="black" if grid[i, j] > 0.6 else "white")  # fmt: skip
        ax.set_xticks(range(len(schemes)), schemes, fontsize=8, rotation=20)
        ax.set_yticks(range(len(tasks)), tasks, fontsize=8)
        ax.set_title(title + " (mean over seeds)", fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.02)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _csv(kind):
    def parse(text):
        items = [x.strip() for x in text.split(",") if x.strip()]
        try:
            return [kind(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {kind.__name__}") from None

    return parse


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="results folder: results.csv, summary.md, heatmap.png")
    p.add_argument("--preset", default="cpu", choices=sorted(PRESETS))
    p.add_argument("--grids", type=_csv(str), default=list(GRIDS), help="default: main,rope,size")
    p.add_argument("--tasks", type=_csv(str), default=None, help=f"default: all ({','.join(TASKS)})")
    p.add_argument("--schemes", type=_csv(str), default=None, help="default: every scheme + shared_qk(v)+asym")
    p.add_argument("--seeds", type=_csv(int), default=None, help="default: the preset's")
    p.add_argument("--steps", type=int, default=None, help="training steps per probe (default: the preset's)")
    p.add_argument("--length", type=int, default=None, help="sequence length of the base model (default: the preset's)")
    p.add_argument("--report-only", action="store_true", help="rewrite summary.md and heatmap.png, train nothing")
    args = p.parse_args(argv)
    try:
        if args.report_only:
            print(write_report(Path(args.out)).read_text())
        else:
            sweep(args)
    except ValueError as e:
        print(f"synthetic: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
