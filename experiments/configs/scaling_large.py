"""scaling_large: the scaling protocol's largest size (experiments/scaling.py, d_model 160) as one base config, at
``separate``'s rate there (4e-3); see scaling_middle.py. For ``benchmarks/bench.py --config`` and
``compare_schemes.py --config``."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scaling_middle import config_at  # noqa: E402

from qkvjax.config import Config  # noqa: E402


def get_config() -> Config:
    return config_at(160, 4e-3)
