"""gpt2_medium: GPT-2 355M's shape (24 layers, 16 heads, d_model 1024, context 1024), byte-level vocabulary
(about 300M parameters: the byte vocabulary has no 50k-entry embedding)."""

from qkvjax.config import AttentionConfig, Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            attention=AttentionConfig(num_heads=16, head_dim=64, scheme="separate", dtype="bfloat16"),
            d_model=1024,
            num_layers=24,
            max_len=1024,
        ),
        data=DataConfig(dataset="tiny_shakespeare"),
        train=TrainConfig(
            batch_size=64,
            num_steps=10000,
            learning_rate=3e-4,
            warmup_steps=500,
            b2=0.95,
            log_every=10,
            eval_every=500,
            eval_batches=20,
            checkpoint_every=500,
        ),
    )
