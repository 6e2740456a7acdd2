"""README.md's "Train on a real corpus" block runs as written in a fresh clone, with three substitutions: GPT-2's
tokenizer files are copied from ../shared instead of downloaded (no network here), the corpus is this repository's
experiment scripts (a folder of real files) instead of OpenWebText, and the tiny model with GPT-2's padded
vocabulary stands in for gpt2_124m (which takes minutes a step on a CPU)."""

import json
import os
import re
import sys
from pathlib import Path

from benchmarks.first_hour import fresh_clone, run_commands
from tests.helpers import docs_text, xla_flags

README = docs_text()  # README.md, then the docs pages


def _block() -> list[str]:
    m = re.search(r"<!-- real-corpus:.*?-->\s*```bash\n(.*?)```", README, re.S)
    assert m is not None, "README.md has no ```bash block after a <!-- real-corpus: ... --> marker"
    return [line for line in m.group(1).splitlines() if line.strip()]


def test_the_real_corpus_block_prepares_trains_evaluates_and_samples(tmp_path, corpus, gpt2_dir):
    lines = _block()
    assert lines[0].startswith("huggingface-cli download gpt2 vocab.json merges.txt --local-dir gpt2_tokenizer")
    clone = fresh_clone(tmp_path, Path(sys.prefix), Path(corpus).parents[2])
    tiny = (
        "experiments/configs/tiny.py --config.model.vocab_size=50304 --config.data.prepared=corpora/"
        "openwebtext_gpt2 --config.train.num_steps=4 --config.train.eval_every=2 --config.train.peak_flops=1e11"
    )
    commands = ["mkdir -p gpt2_tokenizer && cp ../shared/data/gpt2/encoder.json gpt2_tokenizer/vocab.json && "
                "cp ../shared/data/gpt2/vocab.bpe gpt2_tokenizer/merges.txt"]  # fmt: skip
    for line in lines[1:]:
        line = line.replace("~/data/openwebtext/*.parquet --field text", "'experiments/*.py' --val-fraction 0.2")
        commands.append(
            line.replace("experiments/configs/gpt2_124m.py", tiny).replace("--num-tokens 100", "--num-tokens 20")
        )
    env = {
        **os.environ,
        "XLA_FLAGS": xla_flags(1),
        "PATH": f"{Path(sys.prefix) / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }
    rows = run_commands(commands, clone, env=env)
    failed = [r for r in rows if r["returncode"]]
    assert not failed, f"{failed[0]['command']}\n{failed[0]['stdout'][-2000:]}\n{failed[0]['stderr'][-2000:]}"
    manifest = json.loads((clone / "corpora" / "openwebtext_gpt2" / "manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == "gpt2" and manifest["splits"]["validation"]["documents"] > 0
    result = json.loads(rows[3]["stdout"].strip().splitlines()[-1])
    assert result["step"] == 4 and result["split"] == "validation"
    assert rows[4]["stdout"].startswith("The meaning of life is")
