"""README.md's Hugging Face section runs as written, each block in one shell in a fresh clone: the MiniLM block
(after its install line, which the test checks instead of running: this venv already holds the extras, and
reinstalling into it from a temporary clone would move the editable install); the tiny-Llama round trip (its
uptraining cut to 20 steps, as the README's marker says) and the engines block, both marked slow."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from benchmarks.first_hour import fresh_clone, run_commands
from tests.helpers import REPO, docs_text, xla_flags

pytestmark = pytest.mark.xdist_group("readme_hf")  # its own worker: the first-hour module holds another

README = docs_text()  # README.md, then the docs pages


def block(marker: str) -> list[str]:
    """The commands of the ```bash block after ``<!-- marker: ... -->``, continuation lines joined."""
    m = re.search(rf"<!-- {marker}:.*?-->\s*```bash\n(.*?)```", README, re.S)
    assert m is not None, f"README.md has no ```bash block after a <!-- {marker}: ... --> marker"
    return [line for line in m.group(1).replace("\\\n", " ").splitlines() if line.strip()]


def test_the_install_line_installs_the_hf_extra_and_cpu_torch_at_the_pinned_version():
    install = block("hf-minilm")[0]
    pinned = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.M).group(1)
    assert "-c constraints.txt" in install and "-e '.[hf]'" in install
    assert f"torch=={pinned}" in install and "--index-url https://download.pytorch.org/whl/cpu" in install


def test_the_minilm_block_runs_as_written(tmp_path, corpus):
    pytest.importorskip("transformers", reason="the hf extra (transformers, the MiniLM wheel) runs this section")
    clone = fresh_clone(tmp_path, Path(sys.prefix), Path(corpus).parents[2])
    commands = block("hf-minilm")[1:]
    assert commands[0].startswith("source .venv/bin/activate") and len(commands) == 5
    rows = run_commands(commands, clone, env={**os.environ, "XLA_FLAGS": xla_flags(1)})
    failed = [r for r in rows if r["returncode"]]
    assert not failed, f"{failed[0]['command']}\n{failed[0]['stdout'][-2000:]}\n{failed[0]['stderr'][-2000:]}"
    assert len(rows) == len(commands)
    runs = clone / "runs"
    assert (runs / "minilm" / "params" / "0").is_dir() and (runs / "minilm_mla" / "config.json").is_file()
    assert json.loads((runs / "hf_minilm_kv" / "config.json").read_text())["model_type"] == "bert"


@pytest.mark.slow  # ~50 s: eight processes; tests/test_hf.py runs the same CLI path in CI (import, sample, uptrain,
# export of a tiny Llama against transformers); run it with `pytest -m slow tests/test_readme_hf.py`
def test_the_tiny_llama_block_runs_as_written(tmp_path, corpus):
    pytest.importorskip("transformers", reason="the hf extra makes the tiny Llama")
    pytest.importorskip("torch", reason="the bench extra (torch) makes the tiny Llama")
    clone = fresh_clone(tmp_path, Path(sys.prefix), Path(corpus).parents[2])
    llama = [c.replace("num_steps=200", "num_steps=20") for c in block("hf-llama")]
    assert any("num_steps=20 " in c for c in llama)  # the uptraining, cut as the README's marker says
    commands = ["source .venv/bin/activate", *llama]
    assert len(commands) == 1 + 8
    rows = run_commands(commands, clone, env={**os.environ, "XLA_FLAGS": xla_flags(1)})
    failed = [r for r in rows if r["returncode"]]
    assert not failed, f"{failed[0]['command']}\n{failed[0]['stdout'][-2000:]}\n{failed[0]['stderr'][-2000:]}"
    assert json.loads((clone / "runs" / "hf_llama_kv" / "config.json").read_text())["model_type"] == "llama"
    out = {r["command"].split()[1]: r["stdout"] for r in rows if r["command"].startswith("qkvjax ")}
    assert json.loads(out["eval"][out["eval"].index("{") :])["loss"] > 0
    assert "ROMEO:" in out["sample"]


@pytest.mark.slow  # ~90 s: ten processes, each importing jax and transformers (tests/test_hf.py checks the same
# layouts in CI, in process, against transformers' logits); run it with `pytest -m slow tests/test_readme_hf.py`
def test_the_engines_block_runs_as_written(tmp_path, corpus):
    pytest.importorskip("transformers", reason="the hf extra makes the tiny Qwen3, DeepSeek-V2 and Gemma 4 folders")
    clone = fresh_clone(tmp_path, Path(sys.prefix), Path(corpus).parents[2])
    commands = ["source .venv/bin/activate", *block("hf-engines")]
    assert len(commands) == 1 + 16
    rows = run_commands(commands, clone, env={**os.environ, "XLA_FLAGS": xla_flags(1)})
    failed = [r for r in rows if r["returncode"]]
    assert not failed, f"{failed[0]['command']}\n{failed[0]['stdout'][-2000:]}\n{failed[0]['stderr'][-2000:]}"
    runs = clone / "runs"
    for folder, model_type in (
        ("hf_gemma4", "gemma4_text"),
        ("hf_deepseek", "deepseek_v2"),
        ("hf_qwen3", "qwen3"),
        ("hf_llama_mla", "deepseek_v2"),
    ):
        assert json.loads((runs / folder / "config.json").read_text())["model_type"] == model_type
    chat = next(r["stdout"] for r in rows if "--chat --system" in r["command"])  # the rendered turns, then the reply
    assert chat.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho is Romeo?<|im_end|>\n"
                           "<|im_start|>assistant\n"), chat  # fmt: skip
    assert "<|im_start|>" in (runs / "hf_qwen3" / "chat_template.jinja").read_text()
    analyze = next(r["stdout"] for r in rows if r["command"].startswith("qkvjax analyze"))
    assert "shared_kv (K = V), reads layer 1's K/V" in analyze  # Gemma 4's last layer, named as it is
