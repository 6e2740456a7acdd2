"""``qkvjax prepare`` and the prepared-corpus reader: shards equal to encoding each document, the split rule, the
engines agreeing, resume after a kill, whole-or-absent, and every bad input refused in one line."""

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from qkvjax.data.corpus_tokenizer import resolve
from qkvjax.data.pipeline import train_batches
from qkvjax.data.prepare import in_validation, plan, prepare
from qkvjax.data.shards import check_prepared, open_corpus
from tests.helpers import REPO

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "é", "ß", "<|endoftext|>", "\n", "  "]


def _docs(n: int, seed: int = 0, words: int = 40) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(1, words)))) + "\n" for _ in range(n)]


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    for i, doc in enumerate(_docs(37)):
        (root / ("sub" if i % 3 else "") / f"d{i:02d}.txt").write_text(doc, encoding="utf-8")
    return root


def _shard_ids(out, split: str) -> np.ndarray:
    return np.asarray(open_corpus(str(out)).split(split)[:])


def test_bytes_shards_are_the_documents_each_followed_by_the_separator(folder, tmp_path):
    out = tmp_path / "out"
    m = prepare([str(folder)], str(out), "bytes", eot="10", val_fraction=0.3, workers=2, shard_mb=0.0005)
    files = sorted(p for p in folder.rglob("*.txt"))
    names = [str(p.relative_to(folder)) for p in files]
    assert [s["name"] for s in m["sources"]] == sorted(names)
    want = {"train": b"", "validation": b""}
    for name in sorted(names):  # the order of the sources, whatever the worker count
        split = "validation" if in_validation(0, name, 0, 0.3) else "train"
        want[split] += (folder / name).read_bytes() + b"\n"
    for split in ("train", "validation"):
        assert bytes(_shard_ids(out, split).astype(np.uint8)) == want[split]
        assert m["splits"][split]["bytes"] + m["splits"][split]["documents"] == len(want[split])
    assert m["splits"]["validation"]["documents"] not in (0, 37)
    assert len(m["splits"]["train"]["shards"]) > 1  # several units: the small --shard-mb
    assert m["dtype"] == "uint8"
    assert {s["name"]: s["sha256"] for s in m["sources"]} == {
        n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names
    }


def test_gpt2_shards_equal_tiktoken_and_tokenizers_on_every_document(gpt2_dir, tmp_path):
    """The engines agree: the shards (tiktoken) hold, for every document, the ids that the ``tokenizers`` library
    gives it, then 50256; a literal <|endoftext|> in a text is text, not the separator."""
    from tokenizers.implementations import ByteLevelBPETokenizer

    docs = _docs(60, seed=1, words=200)
    lines = tmp_path / "d.jsonl"
    lines.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    out = tmp_path / "out"
    m = prepare([str(lines)], str(out), gpt2_dir, val_fraction=0.2, workers=2)
    assert m["tokenizer"]["vocab_size"] == 50257 and m["tokenizer"]["eot_id"] == 50256 and m["dtype"] == "uint16"
    tok = ByteLevelBPETokenizer.from_file(os.path.join(gpt2_dir, "encoder.json"), os.path.join(gpt2_dir, "vocab.bpe"))
    want = {"train": [], "validation": []}
    offset = 0
    for i, d in enumerate(docs):
        split = "validation" if in_validation(0, "d.jsonl", offset, 0.2) else "train"  # a record's key: its byte
        want[split] += tok.encode(d).ids + [50256]
        offset += len(json.dumps({"text": d, "id": i}).encode("utf-8")) + 1
    for split in ("train", "validation"):
        np.testing.assert_array_equal(_shard_ids(out, split), want[split])
    assert 50256 not in tok.encode("a <|endoftext|> b").ids


def test_a_large_file_is_cut_where_gpt2_encodes_it_as_a_whole(gpt2_dir, tmp_path):
    """A file larger than a unit is cut at line starts that are not whitespace; its pieces encode to the ids of
    the whole file (GPT-2's pre-tokenizer never joins such a line to what precedes it)."""
    from tokenizers.implementations import ByteLevelBPETokenizer

    # runs of whitespace before a line's first character: "\n\n#" split inside the text as "\n", "\n" but at a
    # piece's end as "\n\n" (found on the Linux tree, 2026-12-07), indented lines, a no-break space after a newline
    text = "".join(_docs(400, seed=2, words=30)).replace("\n", "\n\n  ", 50).replace("\n", "\n\n#", 60)
    text = text.replace("\n", "\n\u00a0x", 30).replace("\n", "\r\nb", 30)
    big = tmp_path / "in" / "big.txt"
    big.parent.mkdir()
    big.write_text(text, encoding="utf-8")
    (tmp_path / "in" / "other.txt").write_text("another document\n", encoding="utf-8")
    out = tmp_path / "out"
    p, _ = plan([str(big.parent)], resolve(gpt2_dir), shard_mb=0.002)
    assert sum(len(u) for u in p.units) > 3  # the big file is in several pieces
    seed = next(s for s in range(100) if in_validation(s, "big.txt", 0, 0.5) != in_validation(s, "other.txt", 0, 0.5))
    m = prepare([str(big.parent)], str(out), gpt2_dir, shard_mb=0.002, val_fraction=0.5, seed=seed, workers=2)
    tok = ByteLevelBPETokenizer.from_file(os.path.join(gpt2_dir, "encoder.json"), os.path.join(gpt2_dir, "vocab.bpe"))
    split = "validation" if in_validation(seed, "big.txt", 0, 0.5) else "train"
    whole = tok.encode(text).ids + [50256]
    np.testing.assert_array_equal(_shard_ids(out, split)[: len(whole)], whole)
    assert m["sources"][0]["sha256"] == hashlib.sha256(text.encode()).hexdigest()


def test_jsonl_gz_and_parquet_records_are_documents(tmp_path):
    import pyarrow as pa  # a dependency of qkvjax (Parquet inputs)
    import pyarrow.parquet as pq

    docs = _docs(30, seed=4)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"body": d}) + "\n" for d in docs[:15])
    pq.write_table(pa.table({"body": docs[15:]}), tmp_path / "b.parquet", row_group_size=4)
    m = prepare([str(tmp_path / "*.jsonl.gz"), str(tmp_path / "b.parquet")], str(tmp_path / "out"), "bytes",
                field="body", val_fraction=0.3, workers=1)  # fmt: skip
    assert m["splits"]["train"]["documents"] + m["splits"]["validation"]["documents"] == 30
    total = sum(m["splits"][s]["bytes"] for s in ("train", "validation"))
    assert total == sum(len(d.encode()) for d in docs)


@pytest.mark.parametrize(
    ("make", "args", "error"),
    [
        (lambda p: None, {}, r"INPUT '.*nothing.txt' does not exist"),
        (lambda p: p.write_text(""), {}, r"INPUT '.*nothing.txt' is empty"),
        (lambda p: p.write_bytes(b"ok\n\xff\xfe bad\n"), {}, r"nothing.txt is not UTF-8 text \(byte 3: .*--errors"),
        (lambda p: p.write_text("x\n"), {"tokenizer": "/no/such/tokenizer.json"}, r"--tokenizer='/no/such/tok"),
        (lambda p: p.write_text("x\n"), {"val_fraction": 1.5}, r"--val-fraction=1.5; allowed: a number in \(0, 1\)"),
        (lambda p: p.write_text("x\n"), {"eot": "300"}, r"--eot='300' for a byte-level corpus; allowed: a byte"),
    ],
)
def test_bad_inputs_are_refused_in_one_line_and_leave_nothing(tmp_path, make, args, error):
    src = tmp_path / "nothing.txt"
    make(src)
    out = tmp_path / "out"
    kwargs = {"tokenizer": "bytes"} | args
    with pytest.raises(ValueError, match=error):
        prepare([str(src)], str(out), kwargs.pop("tokenizer"), workers=1, **kwargs)
    assert not out.exists()


def test_a_jsonl_record_without_the_field_names_it(tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text('{"text": "fine"}\n{"content": "no text field"}\n')
    with pytest.raises(ValueError, match=r"r.jsonl: byte 17 has no field 'text' \(its fields: \['content'\]\)"):
        prepare([str(src)], str(tmp_path / "out"), "bytes", workers=1)


def test_skip_leaves_out_documents_that_are_not_utf8_and_lists_them(folder, tmp_path):
    (folder / "bad.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff")
    m = prepare([str(folder)], str(tmp_path / "out"), "bytes", errors="skip", val_fraction=0.3, workers=1)
    assert [s["name"] for s in m["skipped"]] == ["bad.bin"]
    assert m["splits"]["train"]["documents"] + m["splits"]["validation"]["documents"] == 37


def test_no_validation_document_is_refused(tmp_path):
    src = tmp_path / "one.txt"
    src.write_text("a single document\n")
    with pytest.raises(ValueError, match=r"no document of the 1 fell in the validation split"):
        prepare([str(src)], str(tmp_path / "out"), "bytes", workers=1)
    assert not (tmp_path / "out").exists()


def _corrupt(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[:-2]))
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def test_a_truncated_shard_is_refused_at_open_and_a_corrupted_one_by_the_check(folder, tmp_path):
    out = tmp_path / "out"
    prepare([str(folder)], str(out), "bytes", val_fraction=0.3, workers=1)
    shard = out / "train" / "00000.bin"
    original = shard.read_bytes()
    _corrupt(shard, "flip")
    corpus = open_corpus(str(out))  # the length is right: only the sha256 tells
    with pytest.raises(ValueError, match=r"train/00000.bin is corrupted: its sha256 .* is not the manifest's"):
        corpus.verify().wait()
    shard.write_bytes(original)
    open_corpus(str(out)).verify().wait()
    _corrupt(shard, "truncate")
    with pytest.raises(ValueError, match=r"00000.bin holds [\d,]+ bytes, the manifest says [\d,]+ .*: it is truncated"):
        open_corpus(str(out))
    with pytest.raises(ValueError, match=r"data.prepared='.*nowhere' is not a prepared corpus \(no manifest.json\)"):
        open_corpus(str(tmp_path / "nowhere"))


def test_a_changed_tokenizer_is_refused(gpt2_dir, folder, tmp_path):
    out = tmp_path / "out"
    prepare([str(folder)], str(out), gpt2_dir, val_fraction=0.3, workers=1)
    corpus = open_corpus(str(out))
    with pytest.raises(ValueError, match=r"model.vocab_size=256 is smaller than the vocabulary .* \(50,257, gpt2"):
        check_prepared(corpus, 256, None, tmp_path / "run")
    other = tmp_path / "other.json"
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(other))
    with pytest.raises(ValueError, match=r"data.tokenizer tokenizer .*other.json is not the one the prepared corpus"):
        check_prepared(corpus, 50304, str(other), tmp_path / "run")
    (out / "tokenizer.json").write_text((out / "tokenizer.json").read_text().replace('"Ġthe"', '"Ġthee"', 1))
    with pytest.raises(ValueError, match=r"tokenizer.json is missing or was changed since the corpus was prepared"):
        check_prepared(corpus, 50304, None, tmp_path / "run")
    # preparing again into the folder with another tokenizer: refused, unless --overwrite
    with pytest.raises(ValueError, match=r"--out=.* holds a corpus prepared from other inputs, options or tokenizer"):
        prepare([str(folder)], str(out), "bytes", val_fraction=0.3, workers=1)


def test_a_killed_preparation_resumes_its_finished_units_and_the_folder_is_whole_or_absent(folder, tmp_path):
    """Killed after some units: DIR is absent; a rerun keeps the finished units (their files untouched) and gives
    the shards of an uninterrupted run; a rerun with other inputs is refused."""
    for i in range(200):
        (folder / f"more{i:03d}.txt").write_text("".join(_docs(30, seed=i)), encoding="utf-8")
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = [sys.executable, "-m", "qkvjax.cli", "prepare", str(folder), "--out", str(out), "--tokenizer", "bytes",
            "--shard-mb", "0.01", "--workers", "1", "--val-fraction", "0.3"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=REPO, stderr=subprocess.PIPE, text=True)
    units = out.parent / "out.incomplete" / "units"
    deadline = time.time() + 120
    while time.time() < deadline and not (units.is_dir() and len(list(units.glob("*.json"))) >= 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    kept = {p.name: p.stat().st_mtime_ns for p in units.glob("*.json")}
    assert kept
    assert subprocess.run(args, cwd=REPO, capture_output=True, text=True).returncode == 0
    assert not (out.parent / "out.incomplete").exists()
    prepare([str(folder)], str(clean), "bytes", shard_mb=0.01, workers=2, val_fraction=0.3)
    for split in ("train", "validation"):
        for f in (clean / split).iterdir():
            assert (out / split / f.name).read_bytes() == f.read_bytes(), f
    assert json.loads((out / "manifest.json").read_text()) == json.loads((clean / "manifest.json").read_text())


def test_disjoint_windows_cover_every_target_once_per_epoch_across_processes():
    """Ids that name their own position: each batch row's first target says which window it is."""
    t, b = 5, 4
    ids = np.arange(1 + 7 * 12 * t, dtype=np.int64)  # 84 disjoint windows: 21 global batches of 4
    n = (len(ids) - 1) // t
    for epoch_steps in (n // b, 2 * n // b):
        starts = []
        for p in range(2):
            it = train_batches(ids, t, b, seed=7, process_index=p, process_count=2, sampling="disjoint")
            for _ in range(epoch_steps):
                batch = next(it)
                np.testing.assert_array_equal(batch["targets"], batch["inputs"] + 1)
                starts += list(batch["inputs"][:, 0])
        assert all(s % t == 0 for s in starts)  # every window at a multiple of seq_len: disjoint targets
        counts = np.bincount(np.asarray(starts) // t, minlength=n)
        assert set(counts) == {epoch_steps * b // n}  # each window once per epoch, over both processes


def test_prepared_windows_resume_exactly_and_read_the_same_through_workers(folder, tmp_path):
    out = tmp_path / "out"
    prepare([str(folder)], str(out), "bytes", val_fraction=0.3, workers=1, shard_mb=0.0005)
    seq = open_corpus(str(out)).split("train")
    it = train_batches(seq, 6, 3, seed=1, sampling="disjoint")
    [next(it) for _ in range(4)]
    state = it.get_state()
    after = [next(it)["inputs"] for _ in range(3)]
    again = train_batches(seq, 6, 3, seed=1, sampling="disjoint")
    again.set_state(state)
    for a in after:
        np.testing.assert_array_equal(a, next(again)["inputs"])
    # a window across two shards reads the ids on both sides
    assert len(open_corpus(str(out)).manifest["splits"]["train"]["shards"]) > 2


def test_beam_writes_the_same_shards_as_the_local_processes(folder, tmp_path):
    """The Beam pipeline (Beam's local multi-process runner) and the process pool give identical folders."""
    try:
        import apache_beam  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true but apache-beam is missing: pip install -e '.[dev]' (dev holds the beam extra)")
        pytest.skip("needs the beam extra: pip install -e '.[beam]'")
    from qkvjax.data.beam import main as beam_main

    local, beam = tmp_path / "local", tmp_path / "beam"
    prepare([str(folder)], str(local), "bytes", val_fraction=0.3, shard_mb=0.0005, workers=2)
    runner = ["--runner=DirectRunner", "--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    argv = [str(folder), "--out", str(beam), "--tokenizer", "bytes", "--val-fraction", "0.3", "--shard-mb", "0.0005"]
    argv += ["--", *runner]
    assert beam_main(argv) == 0
    files = sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(beam) for p in beam.rglob("*") if p.is_file())
    assert len(files) > 5
    for f in files:
        assert (local / f).read_bytes() == (beam / f).read_bytes(), f
