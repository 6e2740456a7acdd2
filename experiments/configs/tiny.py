"""tiny: a two-layer model for tests and smoke runs (seconds on a CPU)."""

from qkvjax.config import AttentionConfig, Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            attention=AttentionConfig(num_heads=4, head_dim=8, scheme="separate"),
            d_model=32,
            num_layers=2,
            max_len=32,
        ),
        data=DataConfig(dataset="text_file"),  # pass --config.data.source_path=FILE
        train=TrainConfig(
            batch_size=8,
            num_steps=50,
            learning_rate=3e-3,
            warmup_steps=5,
            log_every=5,
            eval_every=25,
            eval_batches=4,
            checkpoint_every=25,
        ),
    )
