"""A conversation with the decode cache kept from turn to turn (``qkvjax.chat.Session``: a turn prefills only what
follows the longest prefix of the re-rendered conversation that the last reply's cache holds) against the same
conversation with the cache dropped before each turn (the whole conversation prefilled again, as the session did
before): seconds to the first token and per turn as the conversation grows, and the same replies from both.

A model of ``--layers`` layers (d_model ``--d-model``, heads of 32, GQA, rotary) with random weights, a ChatML-like
template, byte tokens; ``--turns`` user lines of ``--line`` bytes each, replies of ``--reply`` tokens (ASCII, no
stop id: every reply has its full length). Each mode first runs the whole conversation untimed (every program it
uses compiles then), then the two take turns (``--rounds``), every turn timed on its own; the table has each
turn's medians and their ratio (kept / dropped). Run:

    python benchmarks/levers/chat_prefix.py [--json benchmarks/results/chat_prefix_cpu.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):  # run as a script: make the repository and this folder importable
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "benchmarks"))

import bench  # noqa: E402

from qkvjax.chat import Session  # noqa: E402
from qkvjax.data.tokenizer import ByteTokenizer  # noqa: E402

TEMPLATE = (  # ChatML's layout: the generation prompt is how the next assistant turn begins
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def conversation(session: Session, lines: list[str], keep: bool) -> list[dict]:
    """Every turn of ``lines`` from a fresh start: its seconds to the first token and in all, the conversation's
    tokens before it, the tokens its prefill read, and the reply."""
    session.history, session.cache, session.held = [], None, []
    turns = []
    for line in lines:
        if not keep:  # the baseline: nothing carried over, the whole conversation prefilled again
            session.cache, session.held = None, []
        first = []
        start = time.perf_counter()
        text = session.reply(line, lambda piece, first=first: first or first.append(time.perf_counter()))
        end = time.perf_counter()
        held = len(session.held)  # the prompt and all but the reply's last token
        prompt = held - (session.num_tokens - 1)
        turns.append({"tokens": prompt, "prefilled": prompt - session.reused, "ttft_s": first[0] - start,
                      "turn_s": end - start, "reply": text})  # fmt: skip
    return turns


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--line", type=int, default=80, help="bytes per user line")
    p.add_argument("--reply", type=int, default=24, help="tokens per reply")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model, params = bench.decode_model(args.layers, args.d_model, args.max_len)
    att = model.config.attention
    heads = att.num_heads
    rng = np.random.default_rng(0)
    words = ["the", "cache", "turn", "reply", "model", "keys", "values", "prefix", "again", "token"]
    lines = [" ".join(rng.choice(words, args.line))[: args.line] for _ in range(args.turns)]
    session = Session(model, params, ByteTokenizer(), TEMPLATE, {}, system="be brief", num_tokens=args.reply,
                      seed=0, temperature=1.0, top_k=None, vocab_limit=128)  # fmt: skip
    modes = {"kept": True, "dropped": False}
    warm = {name: conversation(session, lines, keep) for name, keep in modes.items()}  # compiles every program
    same = [a["reply"] == b["reply"] for a, b in zip(warm["kept"], warm["dropped"], strict=True)]
    times = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, keep in modes.items():
            times[name].append(conversation(session, lines, keep))
    rows = []
    for i in range(args.turns):
        row = {"turn": i, "tokens": warm["kept"][i]["tokens"], "prefilled_kept": warm["kept"][i]["prefilled"],
               "prefilled_dropped": warm["dropped"][i]["prefilled"], "same_reply": same[i]}  # fmt: skip
        for name in modes:
            for what in ("ttft_s", "turn_s"):
                row[f"{what}_{name}"] = statistics.median(run[i][what] for run in times[name])
        row["ttft_ratio"] = row["ttft_s_kept"] / row["ttft_s_dropped"]
        row["turn_ratio"] = row["turn_s_kept"] / row["turn_s_dropped"]
        rows.append(row)
    print(f"{args.layers} layers, d_model {args.d_model}, {heads} heads / {att.kv_heads} KV heads of 32, max_len "
          f"{args.max_len}; {args.turns} turns of {args.line} bytes, replies of {args.reply} tokens; medians of "
          f"{args.rounds}; the same replies from both: {sum(same)}/{len(same)}")  # fmt: skip
    bench.print_table(rows, [("turn", "turn", ""), ("tokens", "tokens", ""), ("prefill kept", "prefilled_kept", ""),
                             ("ttft kept", "ttft_s_kept", ".4f"), ("ttft dropped", "ttft_s_dropped", ".4f"),
                             ("ratio", "ttft_ratio", ".2f"), ("turn kept", "turn_s_kept", ".4f"),
                             ("turn dropped", "turn_s_dropped", ".4f"), ("ratio", "turn_ratio", ".2f")])  # fmt: skip
    bench.write_rows(args.json, "levers/chat_prefix.py", argv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
