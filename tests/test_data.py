"""TFDS builders (array_record, no TensorFlow) and the grain pipeline."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from qkvjax.data.builders import TINY_SHAKESPEARE_SHA256, TinyShakespeare, load_splits, split_text
from qkvjax.data.pipeline import eval_batches, train_batches
from tests.helpers import REPO


def test_tiny_shakespeare_has_the_catalog_split(corpus, data_dir):
    with open(corpus, "rb") as f:
        text = f.read()
    assert hashlib.sha256(text).hexdigest() == TINY_SHAKESPEARE_SHA256
    splits = load_splits("tiny_shakespeare", corpus, data_dir)
    assert {k: len(v) for k, v in splits.items()} == {"train": 1003854, "validation": 55770, "test": 55770}
    assert bytes(np.concatenate([splits[s] for s in ("train", "validation", "test")])) == text


def test_text_file_builder_round_trips_utf8(small_text, data_dir):
    with open(small_text, "rb") as f:
        text = f.read()
    splits = load_splits("text_file", small_text, data_dir)
    assert bytes(np.concatenate(list(splits.values()))) == text
    assert {k: len(v) for k, v in splits.items()} == {k: len(v) for k, v in split_text(text).items()}


def test_preparing_a_corpus_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """TFDS made an empty ``tmp*tfds`` folder per dataset prepared, to hold metadata from its bucket, and left it
    (417 of them in this machine's /tmp after a day of tests)."""
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    text = tmp_path / "t.txt"
    text.write_text("to be or not to be, that is the question\n" * 7)
    splits = load_splits("text_file", str(text), str(tmp_path / "data"))
    assert sum(len(v) for v in splits.values()) == text.stat().st_size
    assert list(scratch.iterdir()) == []


def test_tiny_shakespeare_refuses_another_file(small_text, tmp_path):
    builder = TinyShakespeare(source_path=small_text, data_dir=str(tmp_path), file_format="array_record")
    with pytest.raises(ValueError, match=r"is not the Tiny Shakespeare corpus \(sha256 .*, expected 86c4e6aa"):
        builder.download_and_prepare(file_format="array_record")


def test_a_prepared_tiny_shakespeare_is_never_read_for_another_source_path(corpus, data_dir, small_text, tmp_path):
    """Issue 101, item 1: once data_dir held the prepared Tiny Shakespeare, ``source_path=README.md`` (no
    ``dataset=text_file``) trained on Shakespeare with exit 0, and a path that does not exist was accepted."""
    load_splits("tiny_shakespeare", corpus, data_dir)  # prepared in this data_dir
    with pytest.raises(ValueError, match=r"data.source_path='.*small.txt' is not the Tiny Shakespeare corpus .* "
                       r"pass --config.data.dataset=text_file"):  # fmt: skip
        load_splits("tiny_shakespeare", small_text, data_dir)
    missing = str(tmp_path / "inputs.txt")
    with pytest.raises(ValueError, match=r"data.source_path='.*inputs.txt' does not exist"):
        load_splits("tiny_shakespeare", missing, data_dir)


def test_data_json_holds_the_files_own_sha256(corpus, data_dir):
    """data.json's digest is what ``sha256sum FILE`` prints (it framed each split before)."""
    from qkvjax.workdir import framed_digest, splits_digest

    splits = load_splits("tiny_shakespeare", corpus, data_dir)
    assert splits_digest(splits) == TINY_SHAKESPEARE_SHA256
    assert framed_digest(splits) != TINY_SHAKESPEARE_SHA256  # the older record, still accepted by check_data


def test_unknown_dataset_is_named():
    with pytest.raises(
        ValueError, match=r"data.dataset='wikitext' is unknown; allowed: \['text_file', 'tiny_shakespeare'\]"
    ):
        load_splits("wikitext", None, "/nonexistent")


def test_train_batches_are_windows_of_the_text_and_resume_exactly():
    tokens = np.arange(503, dtype=np.int64).astype(np.uint8)
    it = train_batches(tokens, seq_len=7, batch_size=6, seed=3)
    first = [next(it) for _ in range(5)]
    for b in first:
        assert b["inputs"].shape == (6, 7) and b["inputs"].dtype == np.int32
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
        np.testing.assert_array_equal((b["targets"][:, 0] - b["inputs"][:, 0]) % 256, 1)  # consecutive bytes
    state = it.get_state()
    after = [next(it) for _ in range(3)]
    again = train_batches(tokens, seq_len=7, batch_size=6, seed=3)
    again.set_state(state)
    for a, b in zip(after, [next(again) for _ in range(3)], strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    other_seed = next(train_batches(tokens, seq_len=7, batch_size=6, seed=4))
    assert not np.array_equal(other_seed["inputs"], first[0]["inputs"])


@pytest.mark.parametrize("sampling", ["disjoint", "random"])
def test_start_batch_continues_the_same_order_where_another_run_stopped(sampling):
    """An uptraining run with data.start_batch=S at the same seed reads batch S, S + 1, ... of the order the first
    run read from 0 (past the first epoch too), and resumes exactly from a saved state."""
    tokens = np.arange(503, dtype=np.int64).astype(np.uint8)
    whole = train_batches(tokens, seq_len=7, batch_size=5, seed=3, sampling=sampling)
    order = [next(whole)["inputs"] for _ in range(40)]  # 72 disjoint windows: past the first epoch
    later = train_batches(tokens, seq_len=7, batch_size=5, seed=3, sampling=sampling, start_batch=13)
    for expected in order[13:20]:
        np.testing.assert_array_equal(next(later)["inputs"], expected)
    state = later.get_state()
    again = train_batches(tokens, seq_len=7, batch_size=5, seed=3, sampling=sampling, start_batch=13)
    again.set_state(state)
    for expected in order[20:40]:
        np.testing.assert_array_equal(next(again)["inputs"], expected)


def test_train_batches_split_across_processes_without_overlap():
    tokens = (np.arange(2000) % 251).astype(np.uint8)
    shards = [next(train_batches(tokens, 5, 8, seed=1, process_index=p, process_count=2)) for p in (0, 1)]
    assert shards[0]["inputs"].shape == (4, 5)
    rows = {tuple(r) for s in shards for r in s["inputs"]}
    assert len(rows) == 8


def test_eval_batches_predict_every_byte_once():
    tokens = (np.arange(101) * 7 % 256).astype(np.uint8)
    batches = list(eval_batches(tokens, seq_len=9, batch_size=4))
    assert all(b["inputs"].shape == (4, 9) for b in batches)
    weights = np.concatenate([b["weights"].ravel() for b in batches])
    targets = np.concatenate([b["targets"].ravel() for b in batches])
    assert weights.sum() == len(tokens) - 1
    np.testing.assert_array_equal(targets[weights > 0], tokens[1:])
    assert len(list(eval_batches(tokens, 9, 4, max_batches=2))) == 2
    two = list(eval_batches(tokens[:2], 9, 4))  # the least an evaluation takes: one target after one token
    assert two[0]["weights"].sum() == 1 and two[0]["targets"][0, 0] == tokens[1]
    with pytest.raises(ValueError, match=r"the evaluated split has 1 tokens; evaluation needs at least 2"):
        next(eval_batches(tokens[:1], 9, 4))


@pytest.mark.parametrize("stride", [3, 9])
def test_a_limited_evaluation_samples_windows_across_the_split_not_its_prefix(stride):
    """``max_batches`` of a split that holds more: full batches of distinct windows evenly spread from the first to
    the last (a split keeps its documents in order, so a prefix is one or two of them), each scoring the targets it
    would score in the whole evaluation, and the same windows every time."""
    tokens = (np.arange(211) * 7 % 256).astype(np.uint8)  # 210 targets: 24 windows of 9 at stride 9, 70 at 3
    whole = list(eval_batches(tokens, seq_len=9, batch_size=5, stride=stride))
    scored_in_whole = {}
    for b in whole:
        for t, w in zip(b["targets"], b["weights"], strict=True):
            scored_in_whole[tuple(t[w > 0])] = True
    sample = list(eval_batches(tokens, 9, 5, max_batches=3, stride=stride))
    assert len(sample) == 3 and all(b["inputs"].shape == (5, 9) for b in sample)
    rows = [(i, t, w) for b in sample for i, t, w in zip(b["inputs"], b["targets"], b["weights"], strict=True)]
    assert all(w.sum() > 0 for _, _, w in rows)  # no padding rows: 15 windows of the split's 24 or 70
    firsts = [int(np.flatnonzero(tokens == t[w > 0][0])[0]) for _, t, w in rows]  # each row's first scored place
    assert firsts == sorted(set(firsts)) and firsts[0] == 1  # distinct, in order, from the first target ...
    assert tuple(rows[-1][1][rows[-1][2] > 0])[-1] == tokens[-1]  # ... to the last
    assert max(np.diff(firsts)) < 2 * (210 // 15) + 9  # spread evenly, not bunched at the start
    assert all(tuple(t[w > 0]) in scored_in_whole for _, t, w in rows)  # what the whole evaluation scores there
    again = list(eval_batches(tokens, 9, 5, max_batches=3, stride=stride))
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(sample, again, strict=True) for k in a)


@pytest.mark.parametrize("stride", [1, 4, 8, 9])
def test_strided_eval_scores_every_byte_once_with_the_context_it_promises(stride):
    """Windows ``stride`` apart, each scoring its last ``stride`` targets: every target once, in order, and each
    target past the first window with at least seq_len - stride tokens of its window before it; the window is the
    text itself (inputs and targets one apart); ``stride == seq_len`` is the default, batch for batch."""
    tokens = (np.arange(101) * 7 % 256).astype(np.uint8)  # all distinct: a target names its place
    batches = list(eval_batches(tokens, seq_len=9, batch_size=5, stride=stride))
    scored, contexts = [], []
    for b in batches:
        for inputs, targets, weights in zip(b["inputs"], b["targets"], b["weights"], strict=True):
            for j in np.flatnonzero(weights):
                place = int(np.flatnonzero(tokens == targets[j])[0])
                assert np.array_equal(inputs[: j + 1], tokens[place - 1 - j : place])  # the text before it
                scored.append(place)
                contexts.append((place, j))
    assert scored == list(range(1, 101))
    assert min(j for place, j in contexts if place > 9) == 9 - stride
    if stride == 9:
        plain = list(eval_batches(tokens, seq_len=9, batch_size=5))
        assert all(np.array_equal(a[k], b[k]) for a, b in zip(batches, plain, strict=True) for k in a)
    with pytest.raises(ValueError, match=r"stride=10; allowed: an int in \[1, seq_len=9\]"):
        next(eval_batches(tokens, 9, 5, stride=10))


def test_offline_preparation_fails_fast_naming_the_flag(tmp_path, monkeypatch):
    import time

    from qkvjax.data import builders

    monkeypatch.setattr(builders, "TINY_SHAKESPEARE_URL", "http://127.0.0.1:9/input.txt")  # nothing listens there
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"cannot reach http://127.0.0.1:9/input.txt .*--config.data.source_path="):
        load_splits("tiny_shakespeare", None, str(tmp_path))
    assert time.perf_counter() - start < builders.PROBE_TIMEOUT_S + 5


def test_processes_preparing_one_new_corpus_at_once_all_read_it(tmp_path):
    """Two runs started together on a file no one prepared yet: TFDS renames each one's incomplete folder into
    place, and the second rename finds the first's there (FileExistsError before the fix, on 3 tries of 3)."""
    text = tmp_path / "racing.txt"
    text.write_text("".join(f"line {i}: the same corpus for every process\n" for i in range(20_000)))
    data_dir = tmp_path / "tfds"
    code = (
        "import sys; from qkvjax.data.builders import load_splits; "
        "s = load_splits('text_file', sys.argv[1], sys.argv[2]); print(sorted((k, len(v)) for k, v in s.items()))"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(text), str(data_dir)],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    n = len(text.read_bytes())
    expected = sorted((k, len(v)) for k, v in split_text(text.read_bytes()).items())
    assert {out.strip().splitlines()[-1] for out, _ in outs} == {str(expected)}
    assert sum(length for _, length in expected) == n
    leftovers = [p.name for p in data_dir.rglob("incomplete*")]
    assert not leftovers, leftovers  # each loser's folder is removed


@pytest.mark.parametrize("sampling", ["random", "disjoint"])
def test_repeated_targets_are_counted_from_the_batches_the_run_trains_on(sampling):
    """``targets_repeated`` replays the sampler: equal to counting, batch by batch, the target positions of what
    ``train_batches`` yields (ids that name their position), for both samplings and two processes."""
    from qkvjax.data.pipeline import targets_repeated
    from qkvjax.data.shards import repeated_fraction

    ids = np.arange(203, dtype=np.int64)
    seq_len, batch, steps = 7, 6, 13
    seen, repeated = set(), 0
    for p in range(2):
        it = train_batches(ids, seq_len, batch, seed=5, process_index=p, process_count=2, sampling=sampling)
        for _ in range(steps):
            for row in next(it)["targets"]:
                repeated += sum(int(t) in seen for t in row)
                seen.update(int(t) for t in row)
    assert targets_repeated(len(ids), seq_len, batch, 5, steps, sampling, process_count=2) == (
        repeated, steps * batch * seq_len)  # fmt: skip
    if sampling == "disjoint":  # each target once per epoch: the closed form the training log uses
        windows = (len(ids) - 1) // seq_len
        assert repeated == round(repeated_fraction(steps * batch, windows) * steps * batch * seq_len)
    else:
        assert repeated > 0  # overlapping windows repeat targets within the first epoch
