"""gpt2_small: GPT-2 124M's shape (12 layers, 12 heads, d_model 768, context 1024), byte-level vocabulary."""

from qkvjax.config import AttentionConfig, Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            attention=AttentionConfig(num_heads=12, head_dim=64, scheme="separate", dtype="bfloat16"),
            d_model=768,
            num_layers=12,
            max_len=1024,
        ),
        data=DataConfig(dataset="tiny_shakespeare"),
        train=TrainConfig(
            batch_size=32,
            num_steps=5000,
            learning_rate=6e-4,
            warmup_steps=200,
            b2=0.95,
            log_every=10,
            eval_every=500,
            eval_batches=20,
            checkpoint_every=500,
        ),
    )
