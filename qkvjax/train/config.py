"""The run config moved to :mod:`qkvjax.config` (the ground level of the imports: workdir.py and the tools read it
without importing train/). This module re-exports it, so ``from qkvjax.train.config import Config`` and config files
written against it keep working."""

from qkvjax.config import (  # noqa: F401
    PARALLELISMS,
    AttentionConfig,
    Config,
    DataConfig,
    EncoderConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    describe_fields,
    field_meanings,
    format_fields,
    from_dict,
    load_config_file,
    require_decoder,
    to_dict,
    to_json,
)
