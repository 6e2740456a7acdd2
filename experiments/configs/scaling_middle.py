"""scaling_middle: the scaling protocol's middle size as one base config, for studies run with
``compare_schemes.py --config`` (the mechanism studies, experiments/README.md questions 1-4).

The model and training are ``experiments/scaling.py``'s ``size_config`` at d_model 96 (4 layers, 4 heads of 24,
context 128, batch 16, 10 tokens per parameter of ``separate``: 2,345 steps, 4.8M tokens) at 4e-3, the rate the
middle size's learning-rate sweep chose for ``separate`` (and for shared_kv, gqa, shared_qk, shared_qkv,
bilinear; reformer_qk's was 8e-3: experiments/results/scaling_cpu/summary.md). One change, to evaluation only:
every 47 steps (50 points) instead of 234, so the early phase of a curve can be read; it trains the same model on
the same batches as the sweep's run.
"""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: experiments.scaling

from experiments.scaling import size_config  # noqa: E402
from qkvjax.config import Config, DataConfig  # noqa: E402
from qkvjax.models.lm import param_count  # noqa: E402

D_MODEL, LEARNING_RATE, TOKENS_PER_PARAM = 96, 4e-3, 10.0


def config_at(d_model: int, learning_rate: float, evaluations: int = 50) -> Config:
    """``separate`` at width ``d_model`` as the scaling protocol trains it, evaluated ``evaluations`` times."""
    data = DataConfig(dataset="tiny_shakespeare")
    probe = size_config(d_model, "separate", learning_rate, 0, 1, data)
    tokens = round(TOKENS_PER_PARAM * param_count(probe.model))
    config = size_config(d_model, "separate", learning_rate, 0, tokens, data)
    every = -(-config.train.num_steps // evaluations)  # ceil: 47 at the middle size
    return dataclasses.replace(config, train=dataclasses.replace(config.train, eval_every=every))


def get_config() -> Config:
    return config_at(D_MODEL, LEARNING_RATE)
