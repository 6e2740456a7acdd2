"""compare_gpu: the scheme comparison's GPU model (8 layers, 8 heads, d_model 512, context 1024, about 25M
parameters, bfloat16) for one H100/H200-class GPU: 5,000 steps of 32 x 1024 tokens per run."""

from qkvjax.config import AttentionConfig, Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            attention=AttentionConfig(num_heads=8, head_dim=64, scheme="separate", dtype="bfloat16"),
            d_model=512,
            num_layers=8,
            max_len=1024,
        ),
        data=DataConfig(dataset="tiny_shakespeare"),
        train=TrainConfig(
            batch_size=32,
            num_steps=5000,
            learning_rate=1e-3,
            min_lr_ratio=0.1,
            warmup_steps=200,
            weight_decay=0.1,
            b2=0.95,
            log_every=50,
            eval_every=250,
            eval_batches=16,
            checkpoint_every=500,
            max_to_keep=1,
        ),
    )
