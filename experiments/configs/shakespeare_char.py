"""shakespeare_char: nanoGPT's character-level Shakespeare model (6 layers, 6 heads, d_model 384, context 256)."""

from qkvjax.config import AttentionConfig, Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            attention=AttentionConfig(num_heads=6, head_dim=64, scheme="separate"),
            d_model=384,
            num_layers=6,
            max_len=256,
            dropout_rate=0.2,
        ),
        data=DataConfig(dataset="tiny_shakespeare"),
        train=TrainConfig(
            batch_size=64,
            num_steps=5000,
            learning_rate=1e-3,
            min_lr_ratio=0.1,
            warmup_steps=100,
            weight_decay=0.1,
            b2=0.99,
            log_every=10,
            eval_every=250,
            eval_batches=20,
            checkpoint_every=250,
        ),
    )
