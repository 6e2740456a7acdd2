"""The tokenizer a corpus is prepared with: GPT-2's BPE pair, a ``tokenizer.json``, or bytes.

One :class:`CorpusTokenizer` names the tokenizer (its kind, its sha256, its vocabulary V and end-of-text id) and
encodes batches of documents to ids. It is a small picklable description: every worker process (or Beam worker)
rebuilds the encoder from it, so the local and the Beam preparation encode with the same code.

Engines. GPT-2's pair (``encoder.json`` + ``vocab.bpe``) is encoded by tiktoken (OpenAI's BPE, 3-6x faster than
the ``tokenizers`` library on one core) when it is installed, else by ``tokenizers``; the two give the same ids
(tests/test_prepare.py checks them on every document of a sample). A ``tokenizer.json`` is encoded by
``tokenizers``. Text is encoded *ordinarily*: a literal ``<|endoftext|>`` in a document is text, never the
separator id (nanoGPT's ``encode_ordinary``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

KINDS = ("bytes", "gpt2", "tokenizer.json")
GPT2_FILES = ("encoder.json", "vocab.bpe")  # OpenAI's names; Hugging Face's gpt2 calls the same two files:
HF_GPT2_FILES = ("vocab.json", "merges.txt")
# GPT-2's pre-tokenizer split (tiktoken's ``gpt2`` encoding uses this pattern).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def _sha256_files(files: list[str]) -> str:
    h = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class CorpusTokenizer:
    """What a corpus is tokenized with.

    Attributes:
      kind: 'bytes', 'gpt2' (an ``encoder.json`` + ``vocab.bpe`` pair) or 'tokenizer.json'.
      files: the tokenizer's files (none for bytes).
      sha256: of the files (each file's sha256, hashed in order); for bytes, of the word 'bytes' and the separator.
      vocab_size: V, the ids' range.
      eot_id: the id written after every document.
    """

    kind: str
    files: tuple[str, ...]
    sha256: str
    vocab_size: int
    eot_id: int

    @property
    def dtype(self) -> np.dtype:
        """The narrowest that holds every id: uint8 for bytes, uint16 for V <= 65,536 (GPT-2's 50,257), else uint32."""
        return np.dtype(np.uint8 if self.vocab_size <= 256 else np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    def describe(self) -> dict:
        return {"kind": self.kind, "sha256": self.sha256, "vocab_size": self.vocab_size, "eot_id": self.eot_id,
                "files": [os.path.basename(f) for f in self.files], "dtype": self.dtype.name}  # fmt: skip

    def encoder(self):
        """``encode(list[str]) -> list[np.ndarray]`` (ids of each text, no separator), built in the calling process."""
        if self.kind == "bytes":
            return lambda texts: [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
        if self.kind == "gpt2":
            try:
                enc = _tiktoken_gpt2(*self.files)
                one = enc.encode_ordinary  # per text: encode_ordinary_batch hands each batch to a thread pool
                return lambda texts: [np.array(one(t), np.uint32) for t in texts]
            except ImportError:
                pass
        tok = self.hf_tokenizer()
        return lambda texts: [np.asarray(e.ids, np.uint32) for e in tok.encode_batch(texts, add_special_tokens=False)]

    def hf_tokenizer(self):
        """The ``tokenizers.Tokenizer`` (GPT-2's pair becomes a byte-level BPE with ``<|endoftext|>`` special)."""
        from tokenizers import AddedToken, Tokenizer
        from tokenizers.implementations import ByteLevelBPETokenizer

        if self.kind == "gpt2":
            tok = ByteLevelBPETokenizer.from_file(*self.files)
            tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
            return tok._tokenizer
        return Tokenizer.from_file(self.files[0])

    def save_json(self, path: str) -> None:
        """The tokenizer as a ``tokenizer.json`` (what ``sample`` and ``eval`` decode with); none for bytes."""
        if self.kind != "bytes":
            self.hf_tokenizer().save(path)


def _tiktoken_gpt2(encoder_json: str, vocab_bpe: str):
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json)
    return tiktoken.Encoding(
        name="gpt2_local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": 50256}
    )


def resolve(spec: str, eot: str | None = None) -> CorpusTokenizer:
    """``--tokenizer``: 'bytes'; a folder holding GPT-2's ``encoder.json`` and ``vocab.bpe`` (Hugging Face's
    ``vocab.json`` and ``merges.txt``), or either file (the other beside it); or a ``tokenizer.json``. ``eot``: for
    bytes, the separator byte (0-255, default 0); for a ``tokenizer.json``, the separator token's text (default:
    the first of :data:`EOT_NAMES` it has)."""
    if spec == "bytes":
        byte = 0 if eot is None else _byte(eot)
        return CorpusTokenizer("bytes", (), hashlib.sha256(f"bytes:{byte}".encode()).hexdigest(), 256, byte)
    if not isinstance(spec, str) or not os.path.exists(spec):
        raise ValueError(
            f"--tokenizer={spec!r} does not exist; allowed: 'bytes', a tokenizer.json, or GPT-2's encoder.json + "
            "vocab.bpe (their folder or either file)"
        )
    folder = spec if os.path.isdir(spec) else os.path.dirname(os.path.abspath(spec))
    if os.path.isdir(spec) or os.path.basename(spec) in GPT2_FILES + HF_GPT2_FILES:
        names = next((n for n in (GPT2_FILES, HF_GPT2_FILES) if os.path.isfile(os.path.join(folder, n[0]))), None)
        files = [os.path.join(folder, name) for name in names or GPT2_FILES]
        if missing := [f for f in files if not os.path.isfile(f)]:
            raise ValueError(
                f"--tokenizer={spec!r}: GPT-2's BPE needs {' and '.join(GPT2_FILES)} (or Hugging Face's "
                f"{' and '.join(HF_GPT2_FILES)}) in one folder; missing {missing}"
            )
        vocab = _json(files[0])
        if eot not in (None, "<|endoftext|>") or "<|endoftext|>" not in vocab:
            raise ValueError(f"--tokenizer={spec!r}: GPT-2's encoder.json has no {eot or '<|endoftext|>'!r} entry")
        return CorpusTokenizer("gpt2", tuple(files), _sha256_files(files), len(vocab), int(vocab["<|endoftext|>"]))
    data = _json(spec)
    if not isinstance(data, dict) or "model" not in data:
        raise ValueError(f"--tokenizer={spec!r} is not a tokenizer.json (no 'model' entry)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(spec)
    names = [eot] if eot is not None else list(EOT_NAMES)
    found = [n for n in names if tok.token_to_id(n) is not None]
    if not found:
        raise ValueError(
            f"--tokenizer={spec!r} has no end-of-text token among {names}; name the separator with --eot TOKEN"
        )
    size = tok.get_vocab_size(with_added_tokens=True)
    return CorpusTokenizer("tokenizer.json", (os.path.abspath(spec),), _sha256_files([spec]), size,
                           int(tok.token_to_id(found[0])))  # fmt: skip


def _byte(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        value = -1
    if not 0 <= value <= 255:
        raise ValueError(f"--eot={text!r} for a byte-level corpus; allowed: a byte value 0-255 (0x0a is a newline)")
    return value


def _json(file: str):
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not JSON ({e})") from None
