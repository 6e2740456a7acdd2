"""A tiny Hugging Face model folder to try ``qkvjax import`` / ``export`` on: a byte-level BPE tokenizer trained on
a text file with the ``tokenizers`` library, and a model of that vocabulary with random weights (GPT-2, Llama,
Qwen3, DeepSeek-V2 with MLA, or Gemma 4 with K = V full layers and K/V-sharing last layers),
saved with transformers' ``save_pretrained`` (needs the ``hf`` and ``bench`` extras). Stands in for a downloaded
checkpoint (``huggingface-cli download gpt2``, ``Qwen/Qwen2-0.5B``, ...), which works the same way. ``--chat`` makes
it stand in for an instruct one (``Qwen/Qwen2.5-0.5B-Instruct``): ChatML's turn tokens in the vocabulary, their
template and end-of-turn token in ``tokenizer_config.json``, as such folders ship them.

    python experiments/tiny_hf_model.py --arch llama --corpus ../shared/data/tinyshakespeare/input.txt \\
        --out runs/hf_tiny_llama
"""

from __future__ import annotations

import argparse
import json
import os

CHATML = (  # the layout of Qwen2.5-Instruct's turns (its template also handles tools; this one does not)
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tokenizer(corpus: str, vocab_size: int, special_tokens: list[str] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(special_tokens))  # fmt: skip
    tok.train([corpus], trainer)
    return tok


def model(arch: str, vocab_size: int, seed: int):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=vocab_size)
        return tf.GPT2LMHeadModel(cfg)
    common = dict(hidden_size=64, intermediate_size=160, vocab_size=vocab_size, max_position_embeddings=128)
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=16, **common))  # fmt: skip
    if arch == "deepseek_v2":
        return tf.DeepseekV2ForCausalLM(tf.DeepseekV2Config(
            num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, **common))  # fmt: skip
    if arch == "gemma4":
        return tf.Gemma4ForCausalLM(tf.Gemma4TextConfig(
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
            layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
            attention_k_eq_v=True, num_kv_shared_layers=2, global_head_dim=32, num_global_key_value_heads=1,
            final_logit_softcapping=30.0, **common))  # fmt: skip
    cfg = tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **common)
    return tf.LlamaForCausalLM(cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=["gpt2", "llama", "qwen3", "deepseek_v2", "gemma4"], default="llama")
    parser.add_argument("--corpus", required=True, help="a UTF-8 text file to train the tokenizer on")
    parser.add_argument("--out", required=True, help="the model folder to write")
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true", help="an instruct model's files: ChatML tokens and template")
    parser.add_argument("--overwrite", action="store_true", help="write into --out even if it already holds files")
    args = parser.parse_args()
    if os.path.isdir(args.out) and os.listdir(args.out) and not args.overwrite:  # as `qkvjax import` refuses
        parser.exit(2, f"tiny_hf_model.py: error: --out {args.out} already holds files; pass another folder or "
                    "--overwrite\n")  # fmt: skip
    tok = tokenizer(args.corpus, args.vocab_size, CHAT_TOKENS if args.chat else ())
    m = model(args.arch, tok.get_vocab_size(), args.seed)
    if args.chat:  # generate (and qkvjax sample) end a reply at the end-of-turn token
        m.generation_config.eos_token_id = tok.token_to_id("<|im_end|>")
    m.save_pretrained(args.out)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    if args.chat:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                  "pad_token": "<|endoftext|>", "chat_template": CHATML}  # fmt: skip
        with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)
    n = sum(p.numel() for p in m.parameters())
    print(f"wrote {args.out}: {args.arch}, vocabulary {tok.get_vocab_size()}, {n:,} parameters")


if __name__ == "__main__":
    main()
