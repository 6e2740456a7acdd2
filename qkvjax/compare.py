"""Several training runs side by side: ``qkvjax compare DIR [DIR ...] [--plot FILE.png] [--json FILE]``.

Reads each workdir through :mod:`qkvjax.workdir` (config and metrics.jsonl; no checkpoint is restored, so it is
instant and works while a run is still training).
"""

from __future__ import annotations

import math
import os
import statistics

from qkvjax.models.lm import kv_cache_bytes_per_token, param_count
from qkvjax.workdir import learning_curve, path, read_metrics, recorded_text, replace_file, run_config

COLUMNS = (
    ("run", "run", "{}"),
    ("scheme", "scheme", "{}"),
    ("kv_heads", "K", "{}"),
    ("params", "params", "{:,}"),
    ("kv_cache_bytes_per_token", "KV B/tok", "{:,}"),
    ("steps", "steps", "{:,}"),
    ("tokens", "tokens", "{:,}"),
    ("last_train_loss", "train", "{:.4f}"),
    ("best_val_loss", "best val", "{:.4f}"),
    ("last_val_loss", "last val", "{:.4f}"),
    ("bits_per_byte", "bpb", "{:.3f}"),
    ("tokens_per_s", "tok/s", "{:,.0f}"),
)


def summarize(workdir: str) -> dict:
    """One run's row: what it is (from its config) and how far it got (from its metrics)."""
    config = run_config(workdir)  # the checkpoint's, as info and sample read it
    m = config.model
    train, evals = read_metrics(workdir)
    tokens_per_step = config.train.batch_size * config.seq_len
    steps = train[-1]["step"] if train else 0
    vals = [r["loss"] for r in evals if r.get("loss") is not None]
    speeds = [r["tokens_per_s"] for r in train if r.get("tokens_per_s")]
    points = learning_curve(train, evals, tokens_per_step)
    return {
        "run": path(workdir).name,
        "workdir": os.fspath(path(workdir)),
        "scheme": m.attention.scheme + (f" [{m.layers}]" if m.layers else ""),
        "kv_heads": m.attention.kv_heads,
        "params": param_count(m),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(m),
        "steps": steps,
        "tokens": steps * tokens_per_step,
        "last_train_loss": train[-1]["loss"] if train else None,
        "best_val_loss": min(vals) if vals else None,
        "last_val_loss": vals[-1] if vals else None,
        "bits_per_byte": evals[-1].get("bits_per_byte") if evals else None,
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "text_sha256": recorded_text(workdir),
        "seq_len": config.seq_len,
        "tokenizer": config.data.tokenizer,
        "curve": [{k: p[k] for k in ("step", "wall_s", "val_loss")} for p in points if p["val_loss"] is not None],
        "train_curve": [
            {k: p[k] for k in ("step", "wall_s", "train_loss")} for p in points if p["train_loss"] is not None
        ],
    }


def compare(workdirs: list[str]) -> list[dict]:
    if not workdirs:
        raise ValueError("qkvjax compare needs at least one --workdir")
    missing = [w for w in workdirs if not path(w).is_dir()]
    if missing:
        raise ValueError(f"not a folder: {', '.join(missing)}; pass the workdirs of training runs")
    return [summarize(w) for w in workdirs]


def differences(rows: list[dict]) -> list[str]:
    """Notes for runs whose losses are not on one footing: trained on other text (``data.json``'s sha256), with
    another context or another tokenizer. Empty when they agree (or say nothing)."""
    notes = []
    for key, what in (("text_sha256", "text"), ("seq_len", "context (seq_len)"), ("tokenizer", "tokenizer")):
        seen = {}
        for r in rows:
            if key != "text_sha256" or r[key] is not None:
                seen.setdefault(r[key], []).append(r["run"])
        if len(seen) > 1:
            shown = "; ".join(f"{str(v)[:12] if key == 'text_sha256' else v}: {', '.join(runs)}"
                              for v, runs in seen.items())  # fmt: skip
            notes.append(f"note: these runs differ in {what} ({shown}): their losses are not directly comparable")
    return notes


def format_table(rows: list[dict]) -> str:
    cells = [[head for _, head, _ in COLUMNS]]
    for r in rows:
        cells.append(["—" if r[key] is None else fmt.format(r[key]) for key, _, fmt in COLUMNS])
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    )


MARKERS, LINESTYLES = ("o", "s", "^", "D"), ("-", "--", ":", "-.")


def run_style(i: int) -> tuple[str, str, str]:
    """Run ``i``'s (colour, marker, line style): matplotlib's ten colours, then the same ten with the next marker
    and line style, so no two of the first 40 runs are drawn alike."""
    turn = (i // 10) % len(MARKERS)
    return f"C{i % 10}", MARKERS[turn], LINESTYLES[turn]


def plot(rows: list[dict], path: str) -> None:
    """Loss against step and against training time (each step at its logged tokens/s), one style per run
    (:func:`run_style`): training loss as a thin line, each evaluation as a marked point. The legend gives each
    run's last validation loss and its difference from the first run's, and the title the range of the y-axis, so
    a small gap is read as the number it is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    many = len(rows) > 5  # the legend then goes below the panels, two runs a line
    legend_height = 0.4 + 0.17 * math.ceil(len(rows) / 2) if many else 0.0  # inches
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8 + legend_height), layout="constrained")
    first = rows[0]["last_val_loss"] if rows else None
    for i, r in enumerate(rows):
        color, marker, ls = run_style(i)
        last = r["last_val_loss"]
        label = f"{r['run']} ({r['scheme']}, K={r['kv_heads']})"
        if last is not None:
            label += f": val {last:.3f}" + (f" ({last - first:+.3f})" if i and first is not None else "")
        for ax, x in zip(axes, ("step", "wall_s"), strict=True):
            train = [c for c in r["train_curve"] if c[x] is not None]
            ax.plot([c[x] for c in train], [c["train_loss"] for c in train], color=color, ls=ls, lw=0.8, alpha=0.45)
            val = [c for c in r["curve"] if c[x] is not None]
            ax.plot([c[x] for c in val], [c["val_loss"] for c in val], color=color, marker=marker, ls=ls, ms=5, lw=1.6,
                    label=label)  # fmt: skip
    low, high = axes[0].get_ylim()
    for ax, xlabel in zip(axes, ("step", "training time (s; compile and evaluations left out)"), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats/byte)")
        ax.grid(alpha=0.3)
    legend = dict(fontsize=8, title="validation (points), training (thin line)", title_fontsize=8)
    if not many:
        axes[0].legend(**legend)
    else:  # below the panels, where it hides no curve
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=2, **legend)
    fig.suptitle(
        f"qkvjax compare: {len(rows)} run(s), validation loss (points) and training loss (lines); "
        f"the y-axis runs from {low:.2f} to {high:.2f} nats/byte",
        fontsize=11,
    )
    replace_file(path, lambda target: fig.savefig(target, dpi=110))  # the old plot or the new, never a part
    plt.close(fig)
