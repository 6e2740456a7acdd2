"""gpt2_124m: GPT-2 124M as its users train it: GPT-2's own vocabulary, context 1024, nanoGPT's OpenWebText recipe.

Shape: 12 layers, 12 heads of 64, d_model 768, learned positions, tied embeddings, GPT-2's 50,257 tokens padded to
50,304 (a multiple of 64, as nanoGPT does: the padding ids are never targets and ``sample`` never draws them).
Recipe (nanoGPT's ``config/train_gpt2.py``): 480 sequences of 1,024 tokens per step (491,520 tokens; nanoGPT: 12 per
GPU x 5 accumulation steps x 8 GPUs), AdamW with peak 6e-4 after 2,000 warmup steps, cosine to 6e-5 at 600,000
steps, weight decay 0.1, betas (0.9, 0.95), gradient clip 1.0, no dropout, bf16.

The 480 sequences are 40 micro-batches of 12 (``grad_accum_steps=40``) for one device; on 8 GPUs pass
``--config.train.grad_accum_steps=5`` (micro-batches of 96, 12 per GPU). The output layer and its loss run 256
positions at a time (``train.loss_chunk``): the float32 logits of a 12 x 1024 micro-batch would be 2.5 GiB, and
their gradient as much again.

The corpus: ``qkvjax prepare`` with GPT-2's tokenizer, then ``--config.data.prepared=DIR`` (README.md, "Train on
a real corpus"); the default folder below is where that section puts it.
"""

from qkvjax.config import AttentionConfig, Config, DataConfig, ModelConfig, TrainConfig

GPT2_VOCAB = 50257
PADDED_VOCAB = -(-GPT2_VOCAB // 64) * 64  # 50,304


def get_config() -> Config:
    return Config(
        model=ModelConfig(
            attention=AttentionConfig(num_heads=12, head_dim=64, scheme="separate", dtype="bfloat16"),
            vocab_size=PADDED_VOCAB,
            d_model=768,
            num_layers=12,
            max_len=1024,
        ),
        data=DataConfig(prepared="corpora/openwebtext_gpt2"),
        train=TrainConfig(
            batch_size=480,
            grad_accum_steps=40,
            loss_chunk=256,
            num_steps=600_000,
            learning_rate=6e-4,
            min_lr_ratio=0.1,
            warmup_steps=2000,
            weight_decay=0.1,
            b1=0.9,
            b2=0.95,
            grad_clip=1.0,
            log_every=10,
            eval_every=1000,
            eval_batches=5,
            checkpoint_every=1000,
        ),
    )
