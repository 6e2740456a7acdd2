"""Reading a prepared corpus (:mod:`qkvjax.data.prepare`): its manifest, its splits as token sequences over
memory-mapped shards, checks against the manifest, and the windows training draws from it.

Opening a corpus reads the manifest and each shard's size, never the tokens, so the time to the first step and the
host's memory do not grow with the corpus: the operating system pages in the windows read. Each shard's length is
checked at open (a truncated shard is refused in one line); their sha256 are checked by a background thread
(:meth:`PreparedCorpus.verify`) while training runs, and the loop refuses to save a checkpoint after a mismatch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading

import numpy as np
from etils import epath

from qkvjax.data import SAMPLINGS  # noqa: F401  (re-exported: the reader's options)
from qkvjax.data.prepare import FORMAT, MANIFEST, SPLITS, TOKENIZER_FILE, VERSION


class _RemoteShard:
    """A shard on an object store (gs://): ids read by ranged reads of 4 MiB blocks, the last few kept."""

    BLOCK = 1 << 22

    def __init__(self, path: epath.Path, tokens: int, dtype: np.dtype):
        self.path, self.tokens, self.dtype = path, tokens, dtype
        self.blocks: dict[int, bytes] = {}

    def __len__(self) -> int:
        return self.tokens

    def _block(self, i: int) -> bytes:
        if i not in self.blocks:
            with self.path.open("rb") as f:
                f.seek(i * self.BLOCK)
                self.blocks[i] = f.read(self.BLOCK)
            while len(self.blocks) > 8:
                self.blocks.pop(next(iter(self.blocks)))
        return self.blocks[i]

    def __getitem__(self, s: slice) -> np.ndarray:
        a, b = s.start * self.dtype.itemsize, s.stop * self.dtype.itemsize
        data = b"".join(self._block(i)[max(a - i * self.BLOCK, 0) : b - i * self.BLOCK]
                        for i in range(a // self.BLOCK, -(-b // self.BLOCK)))  # fmt: skip
        return np.frombuffer(data, self.dtype)


class TokenSequence:
    """A split's shards as one sequence of ids: ``len()`` and ``seq[a:b]`` (an ndarray, across shard boundaries).

    Pickles as its files (not their contents), so grain's worker processes map the shards themselves."""

    def __init__(self, files: list[tuple[str, int]], dtype: str):
        self.files, self.dtype = files, np.dtype(dtype).newbyteorder("<")
        self.ends = np.cumsum([n for _, n in files], dtype=np.int64)
        self._open()

    def _open(self) -> None:
        self.shards = []
        for file, n in self.files:
            path = epath.Path(file)
            if "://" in file:
                self.shards.append(_RemoteShard(path, n, self.dtype))
            else:
                self.shards.append(np.memmap(file, self.dtype, mode="r", shape=(n,)))

    def __getstate__(self):
        return {"files": self.files, "dtype": self.dtype.str}

    def __setstate__(self, state):
        self.__init__(state["files"], state["dtype"])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, s: slice) -> np.ndarray:
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("a TokenSequence takes contiguous slices, seq[a:b]")
        a, b, _ = s.indices(len(self))
        if b <= a:
            return np.zeros(0, self.dtype)
        first = int(np.searchsorted(self.ends, a, side="right"))
        parts = []
        for i in range(first, len(self.shards)):
            lo = 0 if i == 0 else int(self.ends[i - 1])
            if lo >= b:
                break
            parts.append(self.shards[i][max(a - lo, 0) : min(b, int(self.ends[i])) - lo])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclasses.dataclass
class PreparedCorpus:
    """A prepared corpus folder: its manifest and its splits (:class:`TokenSequence`)."""

    folder: str
    manifest: dict
    sha256: str  # of manifest.json: the corpus' identity in a run's data.json

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def tokenizer_sha256(self) -> str:
        return self.manifest["tokenizer"]["sha256"]

    def split(self, name: str) -> TokenSequence:
        if name not in self.manifest["splits"]:
            raise ValueError(f"split={name!r}; a prepared corpus has {sorted(self.manifest['splits'])}")
        shards = self.manifest["splits"][name]["shards"]
        files = [(str(epath.Path(self.folder) / s["file"]), int(s["tokens"])) for s in shards]
        return TokenSequence(files, self.manifest["dtype"])

    def tokens_per_byte(self, name: str) -> float:
        s = self.manifest["splits"][name]
        return s["tokens"] / max(1, s["bytes"])

    def verify(self) -> _Verification:
        """Starts checking every shard's sha256 against the manifest in a background thread."""
        return _Verification(self)


class _Verification:
    """Every shard's sha256, computed in a daemon thread; :meth:`check` raises once one differs, :meth:`wait`
    waits for all."""

    def __init__(self, corpus: PreparedCorpus):
        self.corpus, self.error, self.done = corpus, None, threading.Event()
        self.thread = threading.Thread(target=self._run, name="qkvjax-verify-shards", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        # One buffer, refilled: reading 4 MiB chunks as new bytes objects grew the process by the corpus' size
        # over time (glibc's malloc raises its mmap threshold after the first free, then keeps the heap), 376 MiB
        # for a 1.4 GB corpus on 2026-12-07; host memory must not grow with the corpus.
        buffer = bytearray(1 << 22)
        view = memoryview(buffer)
        try:
            for split in self.corpus.manifest["splits"].values():
                for shard in split["shards"]:
                    h = hashlib.sha256()
                    with (epath.Path(self.corpus.folder) / shard["file"]).open("rb") as f:
                        while n := f.readinto(buffer):
                            h.update(view[:n])
                    if h.hexdigest() != shard["sha256"]:
                        self.error = ValueError(
                            f"{self.corpus.folder}/{shard['file']} is corrupted: its sha256 {h.hexdigest()[:16]}... "
                            f"is not the manifest's {shard['sha256'][:16]}...; prepare the corpus again "
                            "(qkvjax prepare ... --overwrite)"
                        )
                        return
        except OSError as e:
            self.error = ValueError(f"{self.corpus.folder}: a shard could not be read ({e})")
        finally:
            self.done.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def wait(self) -> None:
        self.done.wait()
        self.check()


def open_corpus(folder: str, what: str = "data.prepared") -> PreparedCorpus:
    """The corpus in ``folder`` after checking its manifest and each shard's presence and length (one line each)."""
    root = epath.Path(folder)
    file = root / MANIFEST
    if not file.exists():
        raise ValueError(
            f"{what}={folder!r} is not a prepared corpus (no {MANIFEST}); make one with `qkvjax prepare INPUT... "
            f"--out {folder} --tokenizer ...`"
        )
    raw = file.read_bytes()
    try:
        manifest = json.loads(raw)
        ok = manifest.get("format") == FORMAT and set(SPLITS) <= set(manifest["splits"])
    except (ValueError, AttributeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{file} is not a {FORMAT} manifest (damaged, or another program's); prepare it again")
    if manifest.get("version") != VERSION:
        raise ValueError(f"{file} is format version {manifest.get('version')}; this qkvjax reads version {VERSION}")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            path = root / shard["file"]
            if not path.exists():
                raise ValueError(f"{path} is missing (listed in {file}); prepare the corpus again")
            size, want = path.stat().length, shard["tokens"] * itemsize
            if size != want:
                raise ValueError(
                    f"{path} holds {size:,} bytes, the manifest says {want:,} ({shard['tokens']:,} tokens): it is "
                    "truncated or was changed; prepare the corpus again (qkvjax prepare ... --overwrite)"
                )
    return PreparedCorpus(str(root), manifest, hashlib.sha256(raw).hexdigest())


def _file_sha256(path: epath.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_prepared(corpus: PreparedCorpus, vocab_size: int, tokenizer: str | None, workdir) -> None:
    """Refuses, in one line, a model whose vocabulary cannot hold the corpus' ids, a ``data.tokenizer`` other than
    the one the corpus was prepared with, a corpus tokenizer file changed since, and a workdir holding another
    tokenizer (an imported model's)."""
    tok = corpus.manifest["tokenizer"]
    if vocab_size < tok["vocab_size"]:
        raise ValueError(
            f"model.vocab_size={vocab_size} is smaller than the vocabulary of the prepared corpus {corpus.folder} "
            f"({tok['vocab_size']:,}, {tok['kind']} tokenizer); allowed: model.vocab_size >= {tok['vocab_size']} "
            "(gpt2_124m pads GPT-2's 50,257 to 50,304)"
        )
    if tok["kind"] == "bytes":
        if tokenizer is not None:
            raise ValueError(f"data.tokenizer={tokenizer!r}, but {corpus.folder} was prepared as bytes; drop it")
        return
    own = epath.Path(corpus.folder) / TOKENIZER_FILE
    if not own.exists() or _file_sha256(own) != tok.get("json_sha256"):
        raise ValueError(f"{own} is missing or was changed since the corpus was prepared (its sha256 is not the "
                         "manifest's); prepare the corpus again")  # fmt: skip
    theirs = {"data.tokenizer": None, "the workdir's": epath.Path(workdir) / TOKENIZER_FILE}
    if tokenizer is not None:
        theirs["data.tokenizer"] = epath.Path(tokenizer if "://" in tokenizer or tokenizer.startswith("/")
                                              else os.path.join(os.fspath(workdir), tokenizer))  # fmt: skip
        if not theirs["data.tokenizer"].exists():
            theirs["data.tokenizer"] = epath.Path(tokenizer)
    for what, path in theirs.items():
        if path is not None and path.exists() and _file_sha256(path) != tok["json_sha256"]:
            raise ValueError(
                f"{what} tokenizer {path} is not the one the prepared corpus {corpus.folder} was made with "
                f"({tok['kind']}, {own}); leave data.tokenizer unset (the corpus' own is used), or prepare the "
                "corpus with that tokenizer"
            )


def copy_tokenizer(folder: str, workdir) -> None:
    """The prepared corpus' tokenizer into the workdir, where ``sample`` and ``eval`` read a run's tokenizer."""
    own, target = epath.Path(folder) / TOKENIZER_FILE, epath.Path(workdir) / TOKENIZER_FILE
    if own.exists() and not target.exists():
        target.write_bytes(own.read_bytes())


# ----------------------------------------------------------------------------------------------------------------
# Windows.


def window_count(tokens: int, seq_len: int, sampling: str) -> int:
    """Windows of ``seq_len + 1`` tokens in a split: disjoint ones (consecutive windows share one token, the last
    target of one being the first input of the next, so every target belongs to one window), or one per offset."""
    return (tokens - 1) // seq_len if sampling == "disjoint" else tokens - seq_len


@dataclasses.dataclass(frozen=True)
class _Gather:
    """A batch of window indices -> ``{"inputs", "targets"}`` (b, T) int32; picklable for grain's workers."""

    tokens: object  # ndarray or TokenSequence
    seq_len: int
    stride: int  # seq_len (disjoint) or 1 (every offset)

    def __call__(self, indices) -> dict:
        rows = np.stack([self.tokens[int(i) * self.stride : int(i) * self.stride + self.seq_len + 1]
                         for i in indices])  # fmt: skip
        return {"inputs": rows[:, :-1].astype(np.int32), "targets": rows[:, 1:].astype(np.int32)}


def repeated_fraction(windows_seen: int, num_windows: int) -> float:
    """Of the targets trained on after ``windows_seen`` disjoint windows (each target once per epoch), the share
    trained on before: every target of a later epoch repeats."""
    return max(0, windows_seen - num_windows) / windows_seen if windows_seen else 0.0
