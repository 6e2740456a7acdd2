"""Running the real CLI, in this process or in a fresh one with its own device count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "experiments" / "configs" / "tiny.py")
SHARED_CORPUS = REPO.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"
GPT2_FILES = REPO.parent / "shared" / "data" / "gpt2"  # GPT-2's encoder.json and vocab.bpe


def write_varied_text(path, lines: int = 300) -> str:
    """``lines`` lines of nine words drawn (seed 0) from a small vocabulary with two multi-byte characters:
    text for runs that need no real corpus. Returns the path."""
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "to", "be", "or", "not", "é", "ß"]
    Path(path).write_text("\n".join(" ".join(rng.choice(words, size=9)) for _ in range(lines)) + "\n", encoding="utf-8")
    return str(path)


def train_args(workdir, source_path, data_dir, **overrides) -> list[str]:
    base = {
        "data.source_path": source_path,
        "data.data_dir": data_dir,
        "train.log_every": 1,
        "train.eval_batches": 2,
        "train.peak_flops": 1e11,  # skip measuring the matmul peak in tests
    }
    base.update(overrides)
    return ["train", f"--config={TINY}", f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in base.items()]


def run_in_process(args: list[str]) -> int:
    from qkvjax.cli import main

    return main(args)


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process: ``devices`` CPU devices, compiled at backend optimisation level 0 with XLA's
    elemental fusion emitters (the suite is compile-bound; see tests/conftest.py)."""
    return (
        f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0 "
        "--xla_cpu_use_fusion_emitters=false"
    )


def run_in_new_process(args: list[str], devices: int = 8, timeout: float = 240, **popen):
    """The CLI in a fresh interpreter with ``devices`` CPU devices; returns the CompletedProcess."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(devices)
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "qkvjax.cli", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def metrics(workdir, evals: bool = False) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if bool(r.get("eval")) == evals]


def exported_params(workdir, step: int) -> dict:
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(os.path.join(workdir, "params", str(step)))
    return tree


def flat(tree) -> dict[str, np.ndarray]:
    import jax

    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def doc_pages() -> list[Path]:
    """README.md and every page of the documentation site (docs/), README first."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def docs_text() -> str:
    """The text of :func:`doc_pages`, one after another: a test finds a marked block wherever it lives (a marker
    names one block; tests/test_docs_site.py checks that every copy of it is the same)."""
    return "\n".join(page.read_text() for page in doc_pages())
