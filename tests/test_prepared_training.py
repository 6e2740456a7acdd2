"""Training on a prepared corpus (``data.prepared``): GPT-2's vocabulary end to end with a tiny model, an exact
resume in a new process, grain workers giving the same batches, the loss chunked, eval and sample on the run."""

import json

import numpy as np
import pytest

from tests.helpers import REPO, TINY, exported_params, flat, metrics, run_in_new_process, run_in_process
from tests.test_prepare import _docs

pytestmark = pytest.mark.xdist_group("prepared_training")
STRICT_DTYPE_PROMOTION = False  # optax's Adam bias correction (as in test_train.py)


@pytest.fixture(scope="module")
def gpt2_corpus(tmp_path_factory, gpt2_dir) -> str:
    from qkvjax.data.prepare import prepare

    root = tmp_path_factory.mktemp("prep")
    lines = root / "docs.jsonl"
    lines.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs(400, seed=5, words=120)))
    prepare([str(lines)], str(root / "out"), gpt2_dir, val_fraction=0.1, workers=2)
    return str(root / "out")


def _args(workdir, corpus, **overrides) -> list[str]:
    base = {"data.prepared": corpus, "model.vocab_size": 50304, "train.log_every": 1, "train.eval_batches": 2,
            "train.peak_flops": 1e11, "data.seq_len": 16}  # fmt: skip
    base.update(overrides)
    return ["train", f"--config={TINY}", f"--workdir={workdir}"] + [f"--config.{k}={v}" for k, v in base.items()]


def test_gpt2_vocabulary_trains_resumes_exactly_evaluates_and_samples(tmp_path, gpt2_corpus):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = {"train.checkpoint_every": 3, "train.loss_chunk": 5}
    assert run_in_process(_args(straight, gpt2_corpus, **common, **{"train.num_steps": 6})) == 0
    assert run_in_process(_args(resumed, gpt2_corpus, **common, **{"train.num_steps": 3})) == 0
    proc = run_in_new_process(_args(resumed, gpt2_corpus, **common, **{"train.num_steps": 6}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from checkpoint step 3" in proc.stdout
    a, b = flat(exported_params(straight, 6)), flat(exported_params(resumed, 6))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    records = metrics(resumed)
    assert [r["loss"] for r in metrics(straight)] == [r["loss"] for r in records]
    # disjoint windows: the epochs and the share of targets seen before are logged, and add up
    manifest = json.loads((REPO.parent / gpt2_corpus / "manifest.json").read_text())
    windows = (manifest["splits"]["train"]["tokens"] - 1) // 16
    assert [r["epochs"] for r in records] == pytest.approx([s * 8 / windows for s in range(1, 7)])
    assert all(r["repeated"] == max(0, s * 8 - windows) / (s * 8) for s, r in enumerate(records, 1))
    data = json.loads((straight / "data.json").read_text())
    assert data["source"].endswith("manifest.json")
    assert (straight / "tokenizer.json").is_file()
    ev = run_in_new_process(["eval", f"--workdir={straight}"])
    assert ev.returncode == 0, ev.stderr[-2000:]
    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["split"] == "validation" and result["tokens"] > 0 and result["loss"] < 11.0
    out = run_in_new_process(["sample", f"--workdir={straight}", "--prompt", "the quick", "--num-tokens", "5"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("the quick") and "\ufffd" not in out.stdout


def test_grain_workers_deliver_the_batches_of_the_training_process(tmp_path, gpt2_corpus):
    args = {"train.num_steps": 3}
    assert run_in_process(_args(tmp_path / "inline", gpt2_corpus, **args)) == 0
    proc = run_in_new_process(_args(tmp_path / "workers", gpt2_corpus, **args, **{"data.workers": 2}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["loss"] for r in metrics(tmp_path / "inline")] == [r["loss"] for r in metrics(tmp_path / "workers")]


def test_a_model_too_small_for_the_corpus_or_a_second_source_is_refused_in_one_line(tmp_path, gpt2_corpus, capsys):
    assert run_in_process(_args(tmp_path / "w", gpt2_corpus, **{"model.vocab_size": 256})) == 2
    assert "model.vocab_size=256 is smaller than the vocabulary of the prepared corpus" in capsys.readouterr().err
    assert run_in_process(_args(tmp_path / "w", gpt2_corpus, **{"data.source_path": "README.md"})) == 2
    err = capsys.readouterr().err
    assert "data.prepared=" in err and "data.source_path='README.md' are both given" in err
    assert not (tmp_path / "w").exists()
