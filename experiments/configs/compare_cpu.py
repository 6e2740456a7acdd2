"""compare_cpu: the scheme comparison's CPU model (4 layers, 4 heads, d_model 128, context 64; nanoGPT's CPU
recipe, shortened to 800 steps of 16 windows so 48 runs fit in about 90 minutes on a 2-core CPU).

The learning rate (2e-3, cosine to 10%) was set once for ``separate`` before any scheme was compared, and is the
same for every scheme: nothing here is tuned per scheme.
"""

from qkvjax.config import AttentionConfig, Config, DataConfig, ModelConfig, TrainConfig


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            attention=AttentionConfig(num_heads=4, head_dim=32, scheme="separate"),
            d_model=128,
            num_layers=4,
            max_len=64,
        ),
        data=DataConfig(dataset="tiny_shakespeare"),
        train=TrainConfig(
            batch_size=16,
            num_steps=800,
            learning_rate=2e-3,
            min_lr_ratio=0.1,
            warmup_steps=40,
            weight_decay=0.1,
            b2=0.99,
            log_every=20,
            eval_every=100,
            eval_batches=8,
            checkpoint_every=200,
            max_to_keep=1,
        ),
    )
