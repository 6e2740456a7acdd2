"""``qkvjax prepare``: tokenize a corpus once, in parallel, into token shards and a manifest.

    qkvjax prepare INPUT... --out DIR --tokenizer FILE|bytes [--field text] [--val-fraction 0.005] [--workers N]

INPUT: text files, folders (every regular file under them) and globs; ``.jsonl`` / ``.jsonl.gz`` / ``.parquet``
files hold one document per record (the ``--field`` text), any other file is one document. Documents are joined
with the tokenizer's end-of-text id after each (GPT-2: 50256; bytes: the byte ``--eot`` names, 0 by default).

The folder it writes (the format :mod:`qkvjax.data.shards` reads)::

    DIR/manifest.json          tokenizer (kind, sha256, V, end-of-text id), per split the tokens, documents, bytes
                               and shards (file, tokens, sha256), each source's size and sha256, the split rule
    DIR/tokenizer.json         the tokenizer, for ``sample`` and ``eval`` to decode with (none for bytes)
    DIR/train/00000.bin ...    raw little-endian ids (uint8 for bytes, uint16, uint32 when V > 65,536), documents
                               back to back
    DIR/validation/00000.bin

Why raw fixed-width shards (nanoGPT's ``train.bin``, Levanter's cache) rather than ArrayRecord: the reader takes
windows of packed tokens that cross documents and shards, and a window anywhere is one slice of a memory map, with
no record to decompress and no per-document index to search; a shard's sha256 and length in the manifest catch
truncation and corruption. ArrayRecord stores records (documents), the right unit for per-document reading, not
for packed windows.

The work is cut into *units* before any encoding (consecutive sources up to ``--shard-mb`` of input; a larger
file cut at line boundaries), and unit i writes shard i of each split. The shards are therefore a function of
the inputs and options alone, never of the worker count or the engine: the local process pool here and the Beam
pipeline (:mod:`qkvjax.data.beam`) write the same bytes.

Split: a document goes to validation when ``sha256("{seed}:{name}:{offset}")``'s first 8 bytes, read as a
big-endian integer over 2**64, fall below ``--val-fraction`` (``name``: the source's path under its input
argument; ``offset``: the record's byte offset, row or line in it, 0 for a whole file): seeded, per document,
independent of the order and the machine.

Faults: everything is written into ``DIR.incomplete/`` and renamed to ``DIR`` once the manifest is written, so DIR
is whole or absent. A unit is finished when its record ``units/NNNNN.json`` is written (after its shards are
flushed to disk); a rerun after a kill keeps the finished units and redoes the rest, and refuses to continue a
preparation of other inputs, options or tokenizer (``--overwrite`` starts again).
"""

from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import glob
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import time

import numpy as np

from qkvjax.data.corpus_tokenizer import CorpusTokenizer, resolve

FORMAT = "qkvjax-tokens"
VERSION = 1
SPLITS = ("train", "validation")
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
RECORD_KINDS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".parquet": "parquet"}
BATCH_BYTES = 1 << 20  # text encoded per call: bounds a worker's memory whatever the unit or corpus size
SPLIT_RULE = (
    "a document is in validation when the first 8 bytes of sha256('{seed}:{name}:{offset}'), read as a big-endian "
    "integer divided by 2**64, are below val_fraction; name: the source's path under its input argument, offset: "
    "the record's byte offset (jsonl), row (parquet) or line (jsonl.gz) in it, 0 for a whole file"
)


@dataclasses.dataclass(frozen=True)
class Source:
    """An input file: ``name`` (its path under its input argument: what the split hashes), its kind and stat."""

    path: str
    name: str
    kind: str  # text, jsonl, jsonl.gz, parquet
    size: int
    mtime_ns: int


@dataclasses.dataclass(frozen=True)
class Piece:
    """Part of a source in a unit: bytes [start, end) of a text or jsonl file, rows [start, end) of a Parquet
    file, or the whole of a ``.jsonl.gz`` (0, size). ``whole``: the piece is the whole source."""

    source: int
    start: int
    end: int
    whole: bool


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything that decides the output bytes; two preparations with equal plans write equal shards."""

    sources: tuple[Source, ...]
    units: tuple[tuple[Piece, ...], ...]
    tokenizer: CorpusTokenizer
    field: str
    val_fraction: float
    seed: int
    shard_bytes: int
    errors: str  # strict: a non-UTF-8 document stops; skip: it is left out and listed in the manifest

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["tokenizer"] = self.tokenizer.describe() | {"files": list(self.tokenizer.files)}
        return d

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# Planning: inputs -> sources -> units (no encoding yet).


def find_sources(inputs: list[str]) -> tuple[list[Source], list[dict]]:
    """The input arguments as sources, in a fixed order, and the files left out (empty ones under a folder)."""
    if not inputs:
        raise ValueError("no INPUT given; allowed: text, .jsonl, .jsonl.gz or .parquet files, folders and globs")
    found: dict[str, Source] = {}
    skipped = []
    for arg in inputs:
        if glob.has_magic(arg):
            root = _glob_root(arg)
            files = [f for f in sorted(glob.glob(arg, recursive=True)) if os.path.isfile(f)]
            if not files:
                raise ValueError(f"INPUT {arg!r} matches no file")
        elif os.path.isdir(arg):
            root, files = arg, _walk(arg)
            if not files:
                raise ValueError(f"INPUT {arg!r} is a folder with no file in it")
        elif os.path.isfile(arg):
            root, files = os.path.dirname(arg), [arg]
            if os.path.getsize(arg) == 0:
                raise ValueError(f"INPUT {arg!r} is empty; allowed: a file holding UTF-8 text or records")
        else:
            raise ValueError(f"INPUT {arg!r} does not exist; allowed: files, folders and globs")
        for file in files:
            st = os.stat(file)
            name = os.path.relpath(file, root or ".")
            if st.st_size == 0:
                skipped.append({"name": name, "reason": "empty"})
                continue
            source = Source(os.path.abspath(file), name, _kind(file), st.st_size, st.st_mtime_ns)
            if name in found and found[name].path != source.path:
                raise ValueError(f"two inputs have the name {name!r} ({found[name].path}, {source.path}); rename one")
            found[name] = source
    if not found:
        raise ValueError(f"INPUT {inputs} holds only empty files")
    return sorted(found.values(), key=lambda s: s.name), skipped


def _walk(folder: str) -> list[str]:
    """Every regular file under ``folder`` (symbolic links are not followed), sorted."""
    out = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        out += [os.path.join(root, f) for f in sorted(files) if not os.path.islink(os.path.join(root, f))]
    return out


def _glob_root(pattern: str) -> str:
    parts = pattern.split(os.sep)
    fixed = [p for p in parts[: next(i for i, p in enumerate(parts) if glob.has_magic(p))]]
    return os.sep.join(fixed) or "."


def _kind(file: str) -> str:
    for suffix, kind in RECORD_KINDS.items():
        if file.endswith(suffix):
            return kind
    return "text"


def plan(inputs: list[str], tokenizer: CorpusTokenizer, field: str = "text", val_fraction: float = 0.005,
         seed: int = 0, shard_mb: float = 32, errors: str = "strict") -> tuple[Plan, list[dict]]:  # fmt: skip
    """The units of work (and the files left out). Checks the options first, each in one line."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"--val-fraction={val_fraction!r}; allowed: a number in (0, 1)")
    if not 0 < shard_mb <= 1 << 20:  # nan and inf fail too
        raise ValueError(f"--shard-mb={shard_mb!r}; allowed: megabytes of input per shard, in (0, 1048576]")
    if errors not in ("strict", "skip"):
        raise ValueError(f"--errors={errors!r}; allowed: strict, skip")
    if not isinstance(field, str) or not field:
        raise ValueError(f"--field={field!r}; allowed: the name of the records' text field")
    sources, skipped = find_sources(inputs)
    target = int(shard_mb * (1 << 20))
    units: list[tuple[Piece, ...]] = []
    group: list[Piece] = []
    size = 0
    for i, src in enumerate(sources):
        pieces = _pieces(i, src, target)
        if len(pieces) > 1:  # a large file: its pieces are units of their own
            units += [(p,) for p in pieces] if not group else [tuple(group)] + [(p,) for p in pieces]
            group, size = [], 0
            continue
        group.append(pieces[0])
        size += src.size
        if size >= target:
            units.append(tuple(group))
            group, size = [], 0
    if group:
        units.append(tuple(group))
    return Plan(tuple(sources), tuple(units), tokenizer, field, float(val_fraction), int(seed), target, errors), skipped


def _pieces(i: int, src: Source, target: int) -> list[Piece]:
    """A source's pieces: one unless it is a text or jsonl file larger than ``target`` bytes, cut at line starts."""
    if src.kind == "parquet":
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(src.path).metadata.num_rows
        return [Piece(i, 0, rows, True)]
    if src.kind == "jsonl.gz" or src.size <= target:
        return [Piece(i, 0, src.size, True)]
    cuts = [0]
    with open(src.path, "rb") as f:
        while cuts[-1] + target < src.size:
            cut = _next_cut(f, cuts[-1] + target, src.kind == "text")
            if cut is None or cut >= src.size:
                break
            cuts.append(cut)
    cuts.append(src.size)
    return [Piece(i, a, b, len(cuts) == 2) for a, b in zip(cuts, cuts[1:], strict=False)]


# Bytes that may be part of a whitespace run (ASCII whitespace, the separators \x1c-\x1f, and every byte of a
# multi-byte character, which may be a Unicode space such as U+00A0)
_NOT_PLAIN = frozenset(b" \t\r\n\x0b\x0c\x1c\x1d\x1e\x1f") | frozenset(range(0x80, 0x100))


def _cuttable(data: bytes, j: int) -> bool:
    """Whether a text may be cut after the newline at ``j``: GPT-2's pre-tokenizer then splits the two sides as it
    splits the whole. It does when the newline is a whitespace run of its own, between two plain ASCII characters
    that are not whitespace: a longer run before a non-space ("\n\n#") is split differently at the end of a piece
    ("\n\n" as one token) than inside the text ("\n", "\n"), and a Unicode space after it could join it."""
    return 0 < j < len(data) - 1 and data[j - 1] not in _NOT_PLAIN and data[j + 1] not in _NOT_PLAIN


def _safe_cuts(data: bytes, size: int) -> list[int]:
    """Offsets cutting ``data`` into parts of about ``size`` bytes, each cut after a newline where
    :func:`_cuttable` allows it; a part runs on to the next such newline, or to the end."""
    cuts = [0]
    while len(data) - cuts[-1] > size:
        at = cuts[-1] + size
        while (j := data.find(b"\n", at)) != -1 and not _cuttable(data, j):
            at = j + 1
        if j == -1:
            break
        cuts.append(j + 1)
    return cuts + [len(data)]


def _next_cut(f, at: int, text: bool) -> int | None:
    """The first line start at or after byte ``at`` where a file may be cut: for a text document where
    :func:`_cuttable` allows it (tested: its pieces encode as the whole file does); a jsonl file's lines are
    records, cut at any line start."""
    f.seek(max(0, at - 1))
    pos = max(0, at - 1)
    while True:
        block = f.read(1 << 16)
        if len(block) < 3:
            return None
        for j in range(1, len(block) - 1):
            if block[j] == 0x0A and pos + j >= at - 1 and (not text or _cuttable(block, j)):
                return pos + j + 1
        pos += len(block) - 2
        f.seek(pos)


# ----------------------------------------------------------------------------------------------------------------
# Encoding one unit: its documents -> the shards of each split (the same function in a process pool and in Beam).


def in_validation(seed: int, name: str, offset: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{name}:{offset}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < fraction


def _documents(plan: Plan, piece: Piece, hasher):
    """``(offset, text bytes, ends_document, position)`` of a piece's documents (``offset``: the document's key in
    the split rule; ``position``: where the text starts, for errors); ``hasher`` sees a whole source's raw bytes."""
    src = plan.sources[piece.source]
    if src.kind == "parquet":
        yield from _parquet_documents(plan, src, piece)
        return
    if src.kind == "jsonl.gz":
        with gzip.open(src.path, "rb") as f:
            for line_no, line in enumerate(f):
                if text := _record_text(plan.field, line, src, f"line {line_no + 1}"):
                    yield line_no, text, True, line_no
        return
    with open(src.path, "rb") as f:
        f.seek(piece.start)
        remaining = piece.end - piece.start
        if src.kind == "text":
            data = f.read(remaining)
            if piece.whole:
                hasher.update(data)
            cuts = _safe_cuts(data, BATCH_BYTES)
            for a, b in zip(cuts, cuts[1:], strict=False):  # encoded in ~1 MB calls (one giant string is slow)
                yield 0, data[a:b], b == len(data) and piece.end == src.size, piece.start + a
            return
        pos = piece.start
        for line in io.BufferedReader(_Limited(f, remaining)):
            if piece.whole:
                hasher.update(line)
            if text := _record_text(plan.field, line, src, f"byte {pos}"):
                yield pos, text, True, pos
            pos += len(line)


class _Limited(io.RawIOBase):
    """The next ``n`` bytes of a file, as a stream."""

    def __init__(self, f, n: int):
        self.f, self.n = f, n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if self.n <= 0:
            return 0
        data = self.f.read(min(len(b), self.n))
        b[: len(data)] = data
        self.n -= len(data)
        return len(data)


def _record_text(field: str, line: bytes, src: Source, where: str) -> bytes | None:
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{src.path}: {where} is not a JSON record ({e})") from None
    if not isinstance(record, dict) or field not in record:
        fields = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{src.path}: {where} has no field {field!r} (its fields: {fields}); pass --field NAME")
    if not isinstance(record[field], str):
        raise ValueError(f"{src.path}: {where}: field {field!r} is a {type(record[field]).__name__}, not text")
    return record[field].encode("utf-8") or None


def _parquet_documents(plan: Plan, src: Source, piece: Piece):
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(src.path)
    if plan.field not in pf.schema_arrow.names:
        raise ValueError(f"{src.path} has no column {plan.field!r} (its columns: {pf.schema_arrow.names}); "
                         "pass --field NAME")  # fmt: skip
    row = 0
    for batch in pf.iter_batches(columns=[plan.field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text:
                yield row, text.encode("utf-8"), True, row
            row += 1


class _ShardWriter:
    """One split's shard of one unit: ids appended as they come, counted and hashed."""

    def __init__(self, path: str, dtype):
        self.path, self.dtype = path, dtype
        self.file = open(path, "wb")
        self.hash, self.tokens, self.documents, self.bytes = hashlib.sha256(), 0, 0, 0

    def write(self, ids: np.ndarray) -> None:
        data = ids.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
        self.file.write(data)
        self.hash.update(data)
        self.tokens += len(ids)

    def close(self) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return {"tokens": self.tokens, "documents": self.documents, "bytes": self.bytes,
                "sha256": self.hash.hexdigest()}  # fmt: skip


def encode_unit(plan: Plan, index: int, folder: str, encode=None) -> dict:
    """Writes unit ``index``'s shard of each split into ``folder`` and returns its record: per split the tokens,
    documents, bytes and sha256; the sha256 of each source it read whole; the documents left out."""
    encode = encode or plan.tokenizer.encoder()
    tok, skipped, hashes = plan.tokenizer, [], {}
    writers = {s: _ShardWriter(os.path.join(folder, s, f"{index:05d}.bin"), tok.dtype) for s in SPLITS}
    batch: list[tuple[str, bytes, bool, str]] = []  # (split, text, ends_document, name)
    size = 0

    def flush():
        texts = [text.decode("utf-8") for _, text, _, _ in batch]
        for (split, text, ends, _), ids in zip(batch, encode(texts), strict=True):
            w = writers[split]
            w.write(np.append(ids, tok.eot_id) if ends else ids)
            w.bytes += len(text)
            w.documents += int(ends)
        batch.clear()

    for piece in plan.units[index]:
        src = plan.sources[piece.source]
        hasher = hashlib.sha256()
        for offset, text, ends, position in _documents(plan, piece, hasher):
            if not _utf8(text, src, offset, position, plan.errors, skipped):
                continue
            split = "validation" if in_validation(plan.seed, src.name, offset, plan.val_fraction) else "train"
            batch.append((split, text, ends, src.name))
            size += len(text)
            if size >= BATCH_BYTES:
                flush()
                size = 0
        if piece.whole and src.kind in ("text", "jsonl"):
            hashes[src.name] = hasher.hexdigest()
    flush()
    return {"unit": index, "splits": {s: w.close() for s, w in writers.items()}, "source_sha256": hashes,
            "skipped": skipped, "input_bytes": sum(_piece_bytes(plan, p) for p in plan.units[index])}  # fmt: skip


def _utf8(text: bytes, src: Source, offset: int, position: int, errors: str, skipped: list) -> bool:
    try:
        text.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        where = f"byte {position + e.start}" if src.kind == "text" else f"the record at {position}, byte {e.start}"
        if errors == "strict":
            raise ValueError(
                f"{src.path} is not UTF-8 text ({where}: {text[e.start : e.start + 4]!r}); fix or remove it, or "
                "pass --errors skip to leave such documents out (they are listed in the manifest)"
            ) from None
        skipped.append({"name": src.name, "offset": offset, "reason": f"not UTF-8 at {where}"})
        return False


def _piece_bytes(plan: Plan, piece: Piece) -> int:
    src = plan.sources[piece.source]
    return piece.end - piece.start if src.kind in ("text", "jsonl") else src.size


def hash_file(path: str) -> str:
    h, buffer = hashlib.sha256(), bytearray(1 << 22)  # one buffer refilled: new 4 MiB objects grow the heap
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def sources_to_hash(plan: Plan) -> list[Source]:
    """Sources no unit reads whole as raw bytes (cut into pieces, gzip, Parquet): hashed on their own."""
    whole = {plan.sources[p.source].name for u in plan.units for p in u if p.whole}
    return [s for s in plan.sources if s.name not in whole or s.kind in ("jsonl.gz", "parquet")]


# ----------------------------------------------------------------------------------------------------------------
# The folder: incomplete -> finished units -> manifest -> renamed into place.


def check_out(out: str) -> None:
    """``--out``: a folder to create, or an existing folder (a prepared corpus, or empty)."""
    if not isinstance(out, str) or not out.strip():
        raise ValueError(f"--out={out!r}; allowed: a folder for the prepared corpus")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out={out!r} exists and is not a folder; allowed: a new or empty folder")


def incomplete_dir(out: str) -> str:
    return os.path.normpath(out) + ".incomplete"


def start(plan: Plan, out: str, overwrite: bool) -> tuple[str, dict[int, dict]] | None:
    """The incomplete folder to write into and the units already finished there; None when ``out`` already holds
    this very preparation. Refuses a folder holding another one unless ``overwrite``."""
    work = incomplete_dir(out)
    if os.path.exists(os.path.join(out, MANIFEST)) and not overwrite:
        with open(os.path.join(out, MANIFEST)) as f:
            if json.load(f).get("plan_sha256") == plan.sha256:
                return None
        raise ValueError(f"--out={out} holds a corpus prepared from other inputs, options or tokenizer; pass "
                         "another --out, or --overwrite to replace it")  # fmt: skip
    if os.path.exists(out) and not os.path.exists(os.path.join(out, MANIFEST)) and os.listdir(out):
        raise ValueError(
            f"--out={out} exists and is not a prepared corpus (no {MANIFEST}); pass an empty or new folder"
        )
    done: dict[int, dict] = {}
    if os.path.isdir(work):
        try:
            with open(os.path.join(work, "plan.json")) as f:
                same = json.load(f).get("sha256") == plan.sha256
        except (OSError, ValueError):
            same = False
        if not same and not overwrite:
            raise ValueError(
                f"{work} holds an unfinished preparation of other inputs, options or tokenizer (the inputs changed "
                "since it was killed?); pass --overwrite to start again"
            )
        if same:
            done = _finished_units(work, len(plan.units))
        else:
            shutil.rmtree(work)
    if not os.path.isdir(work):
        for split in SPLITS:
            os.makedirs(os.path.join(work, split), exist_ok=True)
        os.makedirs(os.path.join(work, "units"), exist_ok=True)
        _write_json(os.path.join(work, "plan.json"), {"sha256": plan.sha256, "plan": plan.to_json()})
    return work, done


def _finished_units(work: str, n: int) -> dict[int, dict]:
    done = {}
    for i in range(n):
        try:
            with open(os.path.join(work, "units", f"{i:05d}.json")) as f:
                done[i] = json.load(f)
        except (OSError, ValueError):
            continue
    return done


def record_unit(work: str, record: dict) -> None:
    _write_json(os.path.join(work, "units", f"{record['unit']:05d}.json"), record)


def _write_json(path: str, data) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def finish(plan: Plan, work: str, out: str, records: dict[int, dict], source_hashes: dict[str, str],
           skipped: list[dict], overwrite: bool) -> dict:  # fmt: skip
    """The manifest from the units' records, written, and the folder renamed into place."""
    splits = {}
    for split in SPLITS:
        shards = []
        for i in range(len(plan.units)):
            r = records[i]["splits"][split]
            file = os.path.join(work, split, f"{i:05d}.bin")
            if r["tokens"] == 0:
                os.remove(file)
                continue
            shards.append({"file": f"{split}/{i:05d}.bin", "tokens": r["tokens"], "documents": r["documents"],
                           "bytes": r["bytes"], "sha256": r["sha256"]})  # fmt: skip
        splits[split] = {k: sum(s[k] for s in shards) for k in ("tokens", "documents", "bytes")} | {"shards": shards}
    for i in range(len(plan.units)):
        source_hashes |= records[i]["source_sha256"]
        skipped = skipped + records[i]["skipped"]
    if splits["validation"]["documents"] == 0 or splits["train"]["documents"] == 0:
        empty = "validation" if splits["validation"]["documents"] == 0 else "train"
        n = splits["train"]["documents"] + splits["validation"]["documents"]
        raise ValueError(
            f"no document of the {n} fell in the {empty} split (--val-fraction {plan.val_fraction}); a corpus needs "
            "documents in both: give more documents (files or records) or another --val-fraction (with --overwrite)"
        )
    plan.tokenizer.save_json(os.path.join(work, TOKENIZER_FILE))
    tokenizer = plan.tokenizer.describe()
    if plan.tokenizer.kind != "bytes":  # the file sample and eval decode with, checked when a run opens the corpus
        tokenizer["json_sha256"] = hash_file(os.path.join(work, TOKENIZER_FILE))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer,
        "dtype": plan.tokenizer.dtype.name,
        "split_rule": SPLIT_RULE,
        "val_fraction": plan.val_fraction,
        "seed": plan.seed,
        "field": plan.field,
        "shard_bytes": plan.shard_bytes,
        "splits": splits,
        "sources": [
            {"name": s.name, "kind": s.kind, "bytes": s.size, "sha256": source_hashes[s.name]} for s in plan.sources
        ],  # fmt: skip
        "skipped": skipped,
        "plan_sha256": plan.sha256,
    }
    _write_json(os.path.join(work, MANIFEST), manifest)
    shutil.rmtree(os.path.join(work, "units"))
    os.remove(os.path.join(work, "plan.json"))
    if overwrite and os.path.exists(out):
        aside = out.rstrip(os.sep) + ".replaced"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(out, aside)
        os.replace(work, out)
        shutil.rmtree(aside)
    else:
        if os.path.isdir(out):
            os.rmdir(out)  # an empty folder the user made for it
        os.replace(work, out)
    _fsync_dir(os.path.dirname(os.path.abspath(out)))
    return manifest


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------------------------------------------
# The local driver: a process pool over the units, a progress line.

_WORKER: dict = {}


def _init_worker(plan: Plan) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process: the pool is the parallelism
    _WORKER["plan"], _WORKER["encode"] = plan, plan.tokenizer.encoder()


def _run_unit(index: int, work: str) -> dict:
    plan = _WORKER["plan"]
    record = encode_unit(plan, index, work, _WORKER["encode"])
    record_unit(work, record)
    return record


def prepare(inputs: list[str], out: str, tokenizer: str, *, field: str = "text", val_fraction: float = 0.005,
            seed: int = 0, shard_mb: float = 32, workers: int | None = None, errors: str = "strict",
            eot: str | None = None, overwrite: bool = False, log=None) -> dict:  # fmt: skip
    """Prepares ``inputs`` into ``out`` (see the module's docstring); returns the manifest. ``log``: a callable
    taking the progress line (stderr by default)."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    check_out(out)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"--workers={workers!r}; allowed: an integer >= 1 (default: every core)")
    the_plan, skipped = plan(inputs, resolve(tokenizer, eot), field, val_fraction, seed, shard_mb, errors)
    started = start(the_plan, out, overwrite)
    if started is None:
        log(f"prepare: {out} already holds this corpus (manifest.json); nothing to do")
        with open(os.path.join(out, MANIFEST)) as f:
            return json.load(f)
    work, done = started
    todo = [i for i in range(len(the_plan.units)) if i not in done]
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo)))  # no more processes than units
    total = sum(_piece_bytes(the_plan, p) for u in the_plan.units for p in u)
    progress = _Progress(total, sum(r["input_bytes"] for r in done.values()), len(the_plan.units), log)
    if done:
        log(f"prepare: resuming {work}: {len(done)} of {len(the_plan.units)} units were finished")
    records = dict(done)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold JAX's or the tokenizer's threads
    with futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(the_plan,)) as pool:
        hashing = {pool.submit(hash_file, s.path): s.name for s in sources_to_hash(the_plan)}
        pending = {pool.submit(_run_unit, i, work) for i in todo}
        try:
            while pending:
                finished, pending = futures.wait(pending, timeout=1.0, return_when=futures.FIRST_COMPLETED)
                for f in finished:
                    r = f.result()
                    records[r["unit"]] = r
                    progress.unit(r)
                progress.show()
            source_hashes = {name: f.result() for f, name in hashing.items()}
        except BaseException:
            for f in pending | set(hashing):
                f.cancel()
            raise
    progress.show(final=True)
    return finish(the_plan, work, out, records, source_hashes, skipped, overwrite)


class _Progress:
    """One line: MB done of the total, MB/s, documents, units, ETA; at most every 2 s (every 30 s off a terminal)."""

    def __init__(self, total: int, done: int, units: int, log):
        self.total, self.done, self.units, self.log = total, done, units, log
        self.docs, self.finished, self.start, self.last = 0, 0, time.perf_counter(), 0.0
        self.resumed = done
        self.every = 2.0 if sys.stderr.isatty() else 30.0

    def unit(self, record: dict) -> None:
        self.done += record["input_bytes"]
        self.docs += sum(s["documents"] for s in record["splits"].values())
        self.finished += 1

    def show(self, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.every:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        rate = (self.done - self.resumed) / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = "done" if final else (f"ETA {eta:,.0f}s" if eta != float("inf") else "ETA ?")
        self.log(f"prepare: {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB, {rate / 1e6:,.2f} MB/s, "
                 f"{self.docs:,} documents, {self.finished} units this run, {elapsed:,.0f}s, {eta_text}")  # fmt: skip
