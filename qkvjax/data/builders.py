"""TFDS builders for byte-level text, prepared as ``array_record`` so that reading needs no TensorFlow.

Each split is one example holding the split's whole text, as in the TFDS catalog's ``tiny_shakespeare``, with the
same 90/5/5 train/validation/test split. The catalog's own builder reads its file with ``tf.io.gfile`` (and
``tfds.load`` needs TensorFlow), so these builders read with plain Python and are read back through
``builder.as_data_source``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import urllib.request

import numpy as np
import tensorflow_datasets as tfds

from qkvjax.checks import is_disk_full
from qkvjax.data import DATASET_NAMES, SPLITS

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
PROBE_TIMEOUT_S = 10.0


def split_text(text: bytes) -> dict[str, bytes]:
    """The catalog's 90/5/5 split: train = text[:int(0.9 n)], then the rest halved."""
    i = int(len(text) * 0.9)
    train, rest = text[:i], text[i:]
    j = int(len(rest) * 0.5)
    return {"train": train, "validation": rest[:j], "test": rest[j:]}


def read_text_file(path: str) -> bytes:
    """The file's bytes, after checking it exists, is UTF-8 text and is not empty."""
    if not path:
        raise ValueError("data.source_path is empty; pass --config.data.source_path=FILE (a UTF-8 text file)")
    if not os.path.isfile(path):
        raise ValueError(f"data.source_path={path!r} does not exist or is not a file")
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError(f"data.source_path={path!r} is empty; it must hold UTF-8 text")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data.source_path={path!r} is not UTF-8 text ({e})") from None
    return data


class _LocalInfo(tfds.core.DatasetInfo):
    """The builders' info. Their names are qkvjax's own, so TFDS's bucket holds nothing for them and is never
    asked: TFDS (4.9.x) makes a temporary folder before asking it, for each dataset not yet prepared, and leaves
    the folder behind, empty (hundreds in ``/tmp`` after a test suite or a sweep)."""

    def initialize_from_bucket(self) -> None:
        pass


class _ByteTextBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shared body: one example per split holding its bytes. The model is byte-level, so a split is stored as
    bytes (a uint8 tensor), never decoded: a 90% cut inside a multi-byte character is fine."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {"1.1.0": "splits stored as uint8 bytes (1.0.0 stored text, which a cut character broke)"}

    def _info(self) -> tfds.core.DatasetInfo:
        return _LocalInfo(
            builder=self,
            description=self.__doc__,
            features=tfds.features.FeaturesDict({"bytes": tfds.features.Tensor(shape=(None,), dtype=np.uint8)}),
        )

    def _source(self, dl_manager) -> bytes:
        raise NotImplementedError

    # TFDS prints two bold lines (sizes "Unknown") around the preparation; one plain line says what matters.
    def _log_download_bytes(self) -> None:
        print(f"preparing the dataset {self.name} in {self.data_dir} (once; later runs reuse it)", flush=True)

    def _log_download_done(self) -> None:
        pass

    def _split_generators(self, dl_manager):
        parts = split_text(self._source(dl_manager))
        return {name: self._generate_examples(name, text) for name, text in parts.items()}

    def _generate_examples(self, name: str, text: bytes):
        yield name, {"bytes": np.frombuffer(text, dtype=np.uint8)}


class TinyShakespeare(_ByteTextBuilder, skip_registration=True):
    """Tiny Shakespeare (Karpathy's char-rnn corpus, 1,115,394 bytes), from a local copy or the catalog's URL."""

    name = "qkvjax_tiny_shakespeare"

    def __init__(self, *, source_path: str | None = None, **kwargs):
        self._source_path = source_path
        super().__init__(**kwargs)

    def _source(self, dl_manager) -> bytes:
        path = self._source_path
        if not path:
            url = TINY_SHAKESPEARE_URL
            advice = "pass a local copy with --config.data.source_path=PATH/input.txt"
            try:  # one quick try first: TFDS's downloader retries for minutes when there is no network
                urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=PROBE_TIMEOUT_S).close()
            except (OSError, ValueError) as e:  # URLError, timeouts and HTTP errors are OSErrors
                raise ValueError(f"cannot reach {url} ({getattr(e, 'reason', e)}); {advice}") from None
            try:
                path = dl_manager.download(url)
            except Exception as e:  # proxy, HTTP error: all end the same way for the user
                raise ValueError(
                    f"could not download Tiny Shakespeare from {url} ({type(e).__name__}: {e}); {advice}"
                ) from None
        return check_tiny_shakespeare(os.fspath(path))


def check_tiny_shakespeare(path: str) -> bytes:
    """The bytes of ``path`` if it is the Tiny Shakespeare corpus (by sha256), else a refusal naming both corpora.

    Called whenever ``data.source_path`` is given with ``dataset='tiny_shakespeare'``, prepared copy or not: once
    a data_dir holds the prepared corpus TFDS never reads the file again, so a wrong path (another text, a typo)
    would otherwise train on Shakespeare while data.json named the other file."""
    data = read_text_file(path)
    digest = hashlib.sha256(data).hexdigest()
    if digest != TINY_SHAKESPEARE_SHA256:
        raise ValueError(
            f"data.source_path={path!r} is not the Tiny Shakespeare corpus (sha256 {digest[:16]}..., expected "
            f"{TINY_SHAKESPEARE_SHA256[:16]}...) that data.dataset='tiny_shakespeare' reads; to train on this "
            "file pass --config.data.dataset=text_file"
        )
    return data


class TextFile(_ByteTextBuilder, skip_registration=True):
    """Any local UTF-8 file, split 90/5/5; one builder config per file content (named by its sha256)."""

    name = "qkvjax_text_file"

    def __init__(self, *, source_path: str, **kwargs):
        self._data = read_text_file(source_path)
        digest = hashlib.sha256(self._data).hexdigest()[:16]
        stem = re.sub(r"[^a-z0-9_]", "_", os.path.splitext(os.path.basename(source_path))[0].lower())
        config = tfds.core.BuilderConfig(name=f"{stem}_{digest}", description=f"bytes of {source_path}")
        super().__init__(config=config, **kwargs)

    def _source(self, dl_manager) -> bytes:
        return self._data


DATASETS = {"tiny_shakespeare": TinyShakespeare, "text_file": TextFile}
assert tuple(DATASETS) == DATASET_NAMES


def _prepared(make, data_dir: str):
    """``make()``'s builder, prepared. Two processes may prepare one new corpus at once (two runs started on it,
    a sweep's workers): each writes its own ``incomplete.*`` folder and the one that renames it into place second
    fails. Its files are the same bytes split the same way, so the loser reads the winner's. A full disk is one
    line naming ``data_dir`` (array_record raises it as a RuntimeError; TFDS removes its incomplete folder)."""
    builder = make()
    try:
        builder.download_and_prepare(file_format="array_record")
    except (OSError, RuntimeError) as e:  # OSError: FileExistsError locally, or another filesystem's "taken"
        if (full := _disk_full(e, data_dir)) is not None:
            raise full from e
        if isinstance(e, RuntimeError):
            raise
        builder = make()
        if not builder.is_prepared():  # a permission, ...: not the race
            raise
    return builder


def _disk_full(e: BaseException, data_dir: str) -> OSError | None:
    if not is_disk_full(e):
        return None
    return OSError(
        errno.ENOSPC,
        f"No space left on device while preparing the dataset in data_dir={data_dir} (written once per corpus, "
        "then read); free space there or pass another --config.data.data_dir",
    )


def load_splits(dataset: str, source_path: str | None, data_dir: str) -> dict[str, np.ndarray]:
    """Prepares the builder (once) and returns each split as a uint8 array of bytes."""
    if not isinstance(dataset, str) or dataset not in DATASETS:
        raise ValueError(f"data.dataset={dataset!r} is unknown; allowed: {sorted(DATASETS)}")
    if dataset == "text_file":
        read_text_file(source_path or "")
    elif source_path:  # checked on every start: a prepared copy in data_dir would otherwise be read instead
        check_tiny_shakespeare(source_path)
    builder = _prepared(
        lambda: DATASETS[dataset](source_path=source_path, data_dir=data_dir, file_format="array_record"), data_dir
    )
    out = {}
    for split in SPLITS:
        source = builder.as_data_source(split=split)
        parts = [np.asarray(source[i]["bytes"], dtype=np.uint8) for i in range(len(source))]
        out[split] = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return out
