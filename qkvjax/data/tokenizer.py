"""Text <-> token ids: bytes by default, or a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library.

The corpus splits are stored as bytes (:mod:`qkvjax.data.builders`); with a tokenizer each split is decoded as
UTF-8 (a character cut at a split boundary is dropped) and encoded once, without special tokens, so the windows,
evaluation and sampling see the model's own vocabulary. Bits per byte stay bits per *byte*: evaluation divides
the summed loss by the split's byte count, not its token count.
"""

from __future__ import annotations

import codecs
import os

import numpy as np


def utf8(text: str, raw_bytes: bool) -> bytes:
    """``text`` as UTF-8, or one line naming what is not text. ``raw_bytes``: bytes that are not UTF-8, which
    Python keeps in a command line's arguments as the surrogates U+DC80-U+DCFF (``os.fsencode``'s convention),
    become those bytes again (a byte-level model reads any bytes); a tokenizer of text refuses them."""
    try:
        return text.encode("utf-8", "surrogateescape" if raw_bytes else "strict")
    except UnicodeEncodeError as e:
        kind = "a lone surrogate" if raw_bytes else "a byte that is not UTF-8 (from a command line) or a lone surrogate"
        raise ValueError(
            f"the text holds {text[e.start : e.end]!r} at character {e.start}, {kind}; allowed: UTF-8 text"
        ) from None


class ByteTokenizer:
    """The default: each UTF-8 byte is a token (vocabulary 256)."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(utf8(text, raw_bytes=True), dtype=np.uint8).astype(np.int32)

    def encode_prompt(self, text: str) -> np.ndarray:
        return self.encode(text)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def continuation(self, prompt, new) -> str:
        """The text that ``new`` tokens add after the ``prompt`` tokens."""
        return self.decode(new)

    def streamer(self, write, prompt=()):
        """A callable taking one token at a time that writes text as soon as it forms whole characters; its
        ``flush()`` writes what is left."""
        return _ByteStream(write)


class _ByteStream:
    def __init__(self, write):
        self.write = write
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: int) -> None:
        self.write(self.decoder.decode(bytes([int(token)])))

    def flush(self) -> None:
        self.write(self.decoder.decode(b"", final=True))


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json``; no special tokens added on encode (a corpus is one
    stream), the post-processor's added to a prompt."""

    def __init__(self, file: str):
        from tokenizers import Tokenizer

        self.name = os.path.basename(file)
        self._tok = Tokenizer.from_file(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> np.ndarray:
        utf8(text, raw_bytes=False)  # the library's own error names no position
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def encode_prompt(self, text: str) -> np.ndarray:
        """A prompt as transformers' ``tokenizer(text)`` gives it: with the special tokens of the tokenizer's own
        post-processor (Llama's BOS before the text; none for GPT-2 or Qwen)."""
        utf8(text, raw_bytes=False)
        return np.asarray(self._tok.encode(text, add_special_tokens=True).ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def continuation(self, prompt, new) -> str:
        """The text that ``new`` tokens add after the ``prompt`` tokens (decoded together: a decoder may join
        tokens with spaces or merge bytes across them)."""
        head = self.decode(prompt)
        whole = self.decode([*prompt, *new])
        return whole[len(head) :] if whole.startswith(head) else self.decode(new)

    def streamer(self, write, prompt=()):
        return _TokenStream(self, write, prompt)


class _TokenStream:
    """Writes the decoded text's new suffix after each token (byte-level BPE can need several tokens per char),
    decoding after the prompt so that joins between tokens come out as in the whole text."""

    def __init__(self, tokenizer: HFTokenizer, write, prompt=()):
        self.tokenizer, self.write, self.ids = tokenizer, write, [int(i) for i in prompt]
        self.done = tokenizer.decode(self.ids)

    def __call__(self, token: int) -> None:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd") and text.startswith(self.done):
            self.write(text[len(self.done) :])
            self.done = text

    def flush(self) -> None:
        text = self.tokenizer.decode(self.ids)
        self.write(text[len(self.done) :] if text.startswith(self.done) else "")


def load_tokenizer(name: str | None, workdir=None):
    """``data.tokenizer`` as a tokenizer: None gives bytes; a relative path is looked up in ``workdir`` first."""
    if name is None:
        return ByteTokenizer()
    candidates = [name] if os.path.isabs(name) or workdir is None else [os.path.join(os.fspath(workdir), name), name]
    for file in candidates:
        if os.path.isfile(file):
            return HFTokenizer(file)
    raise ValueError(f"data.tokenizer={name!r}: no such file (looked in {candidates}); allowed: a tokenizer.json")


def run_tokenizer(data, workdir):
    """The tokenizer of a run whose data config is ``data``: ``data.tokenizer``; else, for a prepared corpus, the
    copy of its tokenizer in the workdir (or the corpus' own, or bytes for a byte-level corpus); else bytes."""
    if data.tokenizer is None and data.prepared is not None:
        for folder in (workdir, data.prepared):
            file = os.path.join(os.fspath(folder), "tokenizer.json")
            if os.path.isfile(file):
                return HFTokenizer(file)
        return ByteTokenizer()
    return load_tokenizer(data.tokenizer, workdir)


def check_vocab(tokenizer, vocab_size: int) -> None:
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} tokens but model.vocab_size={vocab_size}; "
            f"allowed: a tokenizer of at most {vocab_size} tokens (data.tokenizer: a tokenizer.json)"
        )


def tokenize_splits(splits: dict[str, np.ndarray], tokenizer) -> dict[str, np.ndarray]:
    """Byte splits -> token splits (unchanged for bytes)."""
    if isinstance(tokenizer, ByteTokenizer):
        return splits
    return {k: tokenizer.encode(v.tobytes().decode("utf-8", errors="ignore")) for k, v in splits.items()}
