"""The real-corpus data path, measured: tokenizing (qkvjax prepare against tiktoken and the tokenizers library),
the loader's ready batches, and the time and host memory to the first training step as the corpus grows.

    python benchmarks/data_path.py tokenize --corpus DIR --gpt2 ../shared/data/gpt2 [--sample-mb 100] [--rounds 3]
    python benchmarks/data_path.py loader --prepared DIR [--seconds 20]
    python benchmarks/data_path.py first-step --prepared SMALL --prepared LARGE [--rounds 2]

Each prints a table with ratios and writes JSON (``--json``). ``tokenize`` times, in alternating rounds on every core,
``qkvjax prepare`` of the whole corpus folder (reading, splitting, encoding, writing and hashing shards; process
start-up included) against tiktoken's ``encode_ordinary`` over the same documents already in memory, in a warm pool
of one process per core (OpenAI's fast BPE, loaded from the same ``encoder.json`` / ``vocab.bpe``; nothing but
encoding timed); then, on a sample of the files (in the order of the sha256 of their path, up to ``--sample-mb``),
``tokenizers``' ``encode_batch`` (its own threads on every core) against tiktoken, and every document's ids from the
two compared.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import hashlib
import json
import multiprocessing
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _machine() -> dict:
    return {"cores": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}  # fmt: skip


def sample_files(corpus: Path, megabytes: float) -> list[Path]:
    """Files of ``corpus`` that are UTF-8 text, in the order of their relative path's sha256, up to the budget."""
    files = [p for p in corpus.rglob("*") if p.is_file() and not p.is_symlink()]
    files.sort(key=lambda p: hashlib.sha256(str(p.relative_to(corpus)).encode()).hexdigest())
    out, total = [], 0
    for p in files:
        data = p.read_bytes()
        if not data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(p)
        total += len(data)
        if total >= megabytes * 1e6:
            break
    return out


_ENC = {}


def _tiktoken_init(encoder_json: str, vocab_bpe: str) -> None:
    from qkvjax.data.corpus_tokenizer import _tiktoken_gpt2

    _ENC["enc"] = _tiktoken_gpt2(encoder_json, vocab_bpe)


def _tiktoken_encode(texts: list[str]) -> int:
    """Per text: faster than ``encode_ordinary_batch(num_threads=1)``, which hands each call to a thread pool
    (6.3 against 5.0 MB/s a core here, 2026-12-07)."""
    one = _ENC["enc"].encode_ordinary
    return sum(len(one(t)) for t in texts)


def _tiktoken_ids(texts: list[str]) -> list[list[int]]:
    return [_ENC["enc"].encode_ordinary(t) for t in texts]


def _read_texts(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in files]


def _pool(tok, cores: int):
    ctx = multiprocessing.get_context("spawn")
    pool = futures.ProcessPoolExecutor(cores, mp_context=ctx, initializer=_tiktoken_init,
                                       initargs=(tok.files[0], tok.files[1]))  # fmt: skip
    list(pool.map(_tiktoken_encode, [["warm"]] * cores))  # started and loaded before any timing
    return pool


def _time_prepare(corpus: Path, out: Path, gpt2: Path, cores: int) -> tuple[float, dict]:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "qkvjax.cli", "prepare", str(corpus), "--out", str(out), "--tokenizer", str(gpt2),
           "--workers", str(cores), "--errors", "skip"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return time.perf_counter() - start, json.loads((out / "manifest.json").read_text())


def tokenize(args) -> dict:
    """The whole corpus through ``qkvjax prepare`` and through tiktoken (alternating rounds); the ``tokenizers``
    library on a sample of it (at its 1.4 MB/s the whole would take many minutes a round), against tiktoken on
    the same sample; ids checked equal on every document of the sample."""
    from qkvjax.data.corpus_tokenizer import resolve
    from qkvjax.data.prepare import BATCH_BYTES, _safe_cuts

    corpus, gpt2 = Path(args.corpus), Path(args.gpt2)
    cores = os.cpu_count() or 1
    tok = resolve(str(gpt2))
    work = Path(tempfile.mkdtemp(prefix="qkvjax-bench-", dir=args.scratch))
    everything = sample_files(corpus, float("inf"))  # every non-empty UTF-8 file: what prepare keeps
    texts = _read_texts(everything)
    mb = sum(len(t.encode()) for t in texts) / 1e6
    parts = [texts[i::cores] for i in range(cores)]
    pool = _pool(tok, cores)
    whole: dict[str, list[float]] = {"qkvjax prepare": [], "tiktoken": []}
    manifest = None
    for _ in range(args.rounds):
        seconds, manifest = _time_prepare(corpus, work / "out", gpt2, cores)
        whole["qkvjax prepare"].append(seconds)
        start = time.perf_counter()
        tokens = sum(pool.map(_tiktoken_encode, parts))
        whole["tiktoken"].append(time.perf_counter() - start)
    prepared = sum(manifest["splits"][s]["tokens"] - manifest["splits"][s]["documents"] for s in manifest["splits"])
    del texts, parts
    # the sample: tokenizers (documents cut in ~1 MB pieces at line starts that are not whitespace, as prepare cuts
    # them: one multi-MB string is slow in it, 116 s for 17.8 MB, ../shared/ENVIRONMENT.md) against tiktoken
    sample = _read_texts(sample_files(corpus, args.sample_mb))
    sample_mb = sum(len(t.encode()) for t in sample) / 1e6
    sample_parts = [sample[i::cores] for i in range(cores)]

    def pieces(text: str) -> list[str]:
        data = text.encode()
        cuts = _safe_cuts(data, BATCH_BYTES)
        return [data[a:b].decode() for a, b in zip(cuts, cuts[1:], strict=False)]

    split = [pieces(t) for t in sample]
    flat = [p for ps in split for p in ps]
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    hf = tok.hf_tokenizer()
    start = time.perf_counter()
    encoded = hf.encode_batch(flat, add_special_tokens=False)
    hf_s = time.perf_counter() - start
    start = time.perf_counter()
    sum(pool.map(_tiktoken_encode, sample_parts))
    tik_sample_s = time.perf_counter() - start
    tik_ids: list = [None] * len(sample)
    for i, part in enumerate(pool.map(_tiktoken_ids, sample_parts)):  # part i holds documents i, i + cores, ...
        for j, ids in enumerate(part):
            tik_ids[j * cores + i] = ids
    it = iter(encoded)
    hf_ids = [[i for _ in ps for i in next(it).ids] for ps in split]
    mismatched = sum(a != b for a, b in zip(tik_ids, hf_ids, strict=True))
    pool.shutdown()
    shutil.rmtree(work)
    rows = {k: {"median_s": statistics.median(v), "mb_per_s": mb / statistics.median(v), "rounds_s": v}
            for k, v in whole.items()}  # fmt: skip
    base = rows["tiktoken"]["mb_per_s"]
    print(f"tokenizing {corpus} ({mb:,.1f} MB of UTF-8 text in {len(everything):,} files) with GPT-2's BPE on "
          f"{cores} cores; {args.rounds} alternating rounds, median:")  # fmt: skip
    print(f"  {'engine':<16} {'MB/s':>8} {'x tiktoken':>11}")
    for k, r in rows.items():
        print(f"  {k:<16} {r['mb_per_s']:8.2f} {r['mb_per_s'] / base:11.2f}")
    print(f"  the shards hold {prepared:,} tokens besides the separators; tiktoken made {tokens:,}")
    print(f"on a {sample_mb:,.1f} MB sample ({len(sample):,} files): tokenizers' encode_batch {sample_mb / hf_s:.2f} "
          f"MB/s, tiktoken {sample_mb / tik_sample_s:.2f} MB/s (x{tik_sample_s / hf_s:.2f}); ids differ on "
          f"{mismatched} of {len(sample):,} documents")  # fmt: skip
    return {"machine": _machine(), "corpus": str(corpus), "mb": mb, "files": len(everything), "tokens": tokens,
            "prepared_tokens": prepared, "rows": rows,
            "sample": {"mb": sample_mb, "documents": len(sample), "tokenizers_s": hf_s, "tiktoken_s": tik_sample_s,
                       "documents_differing": int(mismatched)}}  # fmt: skip


def loader(args) -> dict:
    """Ready batches per second from ``train_batches`` at gpt2_124m's shapes (T = 1024), per host."""
    from qkvjax.data.pipeline import train_batches
    from qkvjax.data.shards import open_corpus

    seq = open_corpus(args.prepared).split("train")
    rows = {}
    for workers in (0, os.cpu_count() or 1):
        for batch in (12, 96):
            it = train_batches(seq, 1024, batch, seed=0, sampling="disjoint", workers=workers)
            next(it)  # workers started
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < args.seconds:
                b = next(it)
                n += 1
            elapsed = time.perf_counter() - start
            assert b["inputs"].shape == (batch, 1024)
            rows[f"workers={workers} batch={batch}"] = {"tokens_per_s": n * batch * 1024 / elapsed, "batches": n}
            del it
    target = 10 * 750_000
    print(f"loader: {args.prepared} ({len(seq):,} training tokens), batches of 1,024-token windows, "
          f"{args.seconds:g} s each")  # fmt: skip
    print(f"  {'reader':<22} {'tokens/s':>14} {'x target':>9}  (target: 10 x one H100's 750k tokens/s)")
    for k, r in rows.items():
        print(f"  {k:<22} {r['tokens_per_s']:14,.0f} {r['tokens_per_s'] / target:9.2f}")
    return {"machine": _machine(), "prepared": args.prepared, "tokens": len(seq), "rows": rows,
            "target_tokens_per_s": target}  # fmt: skip


def first_step(args) -> dict:
    """Seconds from the process start to the first step's end, and its peak RSS, training the tiny model with
    GPT-2's vocabulary on each prepared corpus (the data path is what could grow with the corpus)."""
    rows = {}
    for _ in range(args.rounds):
        for folder in args.prepared:
            work = Path(tempfile.mkdtemp(prefix="qkvjax-first-"))
            cmd = [sys.executable, "-c", _FIRST_STEP, str(REPO / "experiments" / "configs" / "tiny.py"),
                   str(work / "run"), folder]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True).stdout
            seconds, rss = (float(x) for x in out.strip().splitlines()[-1].split())
            rows.setdefault(folder, []).append({"seconds": seconds, "peak_rss_mib": rss / 1024})
            shutil.rmtree(work)
    sizes = {f: sum(s["tokens"] for s in json.loads((Path(f) / "manifest.json").read_text())["splits"].values())
             for f in args.prepared}  # fmt: skip
    print("time to the first step's end and peak host memory (tiny model, GPT-2's vocabulary, batch 8 x 32), median:")
    base = None
    for f, rs in rows.items():
        s, m = statistics.median(x["seconds"] for x in rs), statistics.median(x["peak_rss_mib"] for x in rs)
        base = base or (s, m)
        print(f"  {f:<40} {sizes[f]:>14,} tokens {s:7.1f} s (x{s / base[0]:.2f}) {m:8,.0f} MiB (x{m / base[1]:.2f})")
    return {"machine": _machine(), "rows": rows, "tokens": sizes}


_FIRST_STEP = """
import resource, sys, time
start = time.perf_counter()
from qkvjax.cli import main
import qkvjax.train.loop as loop
seen = []
original = loop.Loop.run
def run(self):
    orig_step = self.train_step
    def step(*a):
        out = orig_step(*a)
        if not seen:
            import jax
            jax.block_until_ready(out)
            seen.append(time.perf_counter() - start)
        return out
    self.train_step = step
    return original(self)
loop.Loop.run = run
config, workdir, prepared = sys.argv[1:4]
args = ["train", "--config", config, "--workdir", workdir, "--config.data.prepared=" + prepared,
        "--config.model.vocab_size=50304", "--config.train.num_steps=1", "--config.train.peak_flops=1e11",
        "--config.train.eval_batches=1", "--config.train.tensorboard=false"]
assert main(args) == 0
print(seen[0], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("tokenize")
    t.add_argument("--corpus", required=True)
    t.add_argument("--gpt2", required=True)
    t.add_argument("--sample-mb", type=float, default=100)
    t.add_argument("--rounds", type=int, default=2)
    t.add_argument("--scratch", default=None, help="where the prepared copies go (default: the temporary folder)")
    t.add_argument("--json", default=None)
    lo = sub.add_parser("loader")
    lo.add_argument("--prepared", required=True)
    lo.add_argument("--seconds", type=float, default=20)
    lo.add_argument("--json", default=None)
    f = sub.add_parser("first-step")
    f.add_argument("--prepared", action="append", required=True)
    f.add_argument("--rounds", type=int, default=2)
    f.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = {"tokenize": tokenize, "loader": loader, "first-step": first_step}[args.what](args)
    result["command"] = "python benchmarks/data_path.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
