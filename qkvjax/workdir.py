"""The run folder, as tools see it: file names, the saved config, the metrics log.

Tools (eval, info, convert, analyze, the experiments) read a workdir through this module, never through the
training loop. Layout::

    WORKDIR/config.json            the run's Config (JSON of the frozen dataclasses)
    WORKDIR/metrics.jsonl          one JSON object per logged step; evaluation records carry "eval": true
    WORKDIR/checkpoints/<step>/    orbax: state, data iterator, config (see qkvjax.train.checkpoint)
    WORKDIR/params/<step>/         params only, written when a run finishes
    WORKDIR/tensorboard/           TensorBoard events
"""

from __future__ import annotations

import json
import os

from qkvjax.train.config import Config, from_dict

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


def load_config(workdir: str) -> Config:
    """The Config a run was started with; a clear error when ``workdir`` holds no run."""
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(path):
        raise ValueError(f"workdir {os.path.abspath(workdir)} holds no run (no {CONFIG_FILE})")
    with open(path) as f:
        return from_dict(Config, json.load(f))


def read_metrics(workdir: str) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) from ``metrics.jsonl``, in the order written; ([], []) if absent."""
    path = os.path.join(workdir, METRICS_FILE)
    train, evals = [], []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    (evals if record.get("eval") else train).append(record)
    return train, evals
