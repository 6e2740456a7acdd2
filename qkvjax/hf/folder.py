"""A Hugging Face model folder on disk: ``config.json`` and the weights in safetensors, read and written with the
``safetensors`` library alone (no torch, no transformers).

Weights are one ``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (its ``weight_map``
names the shard of every tensor). Tensors are read as float32 numpy arrays (bfloat16 and float16 checkpoints
included: ``safetensors``' flax reader decodes them); :class:`Tensors` hands each out once and names any tensor
left unread, so a checkpoint with parts the layout does not know (a feature qkvjax cannot express) is refused
rather than half-loaded.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from qkvjax.workdir import TOKENIZER

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"  # what transformers' generate defaults to (eos ids among them)
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"


MAX_JSON_BYTES = 64 << 20  # config.json, generation_config.json, the index: kB to a few MB on the Hub


def read_config(folder: str) -> dict:
    """The folder's ``config.json`` as a dict; one line naming what is missing otherwise."""
    if not os.path.isdir(folder):
        raise ValueError(f"{folder!r} is not a folder; pass a Hugging Face model folder (config.json + *.safetensors)")
    if not os.path.lexists(os.path.join(folder, CONFIG)):
        raise ValueError(f"{folder} has no {CONFIG}; a Hugging Face model folder holds config.json and *.safetensors")
    return read_json(folder, CONFIG)


def read_json(folder: str, name: str) -> dict | None:
    """The JSON object in ``folder/name`` (None if there is none), read as :func:`read_bounded` reads an untrusted
    folder's files (a regular file inside it, at most MAX_JSON_BYTES); one line naming the file where it is not
    UTF-8 JSON holding an object."""
    data = read_bounded(folder, name, "file", MAX_JSON_BYTES)
    if data is None:
        return None
    file = os.path.join(folder, name)
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{file} is not JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} holds a JSON {type(value).__name__}; allowed: an object")
    return value


def special_ids(folder: str, names: tuple[str, ...]) -> dict:
    """The ids ``names`` (``eos_token_id``, ...) as transformers' ``generate`` takes them: from the folder's
    ``generation_config.json`` where it has one and names them (Llama 3 stops at three ids there, one in
    ``config.json``), else from ``config.json``."""
    ids = {k: v for k, v in read_config(folder).items() if k in names and v is not None}
    return ids | {k: v for k, v in read_generation_config(folder).items() if k in names and v is not None}


def read_generation_config(folder: str) -> dict:
    """The folder's ``generation_config.json`` as a dict ({} where it has none)."""
    return read_json(folder, GENERATION_CONFIG) or {}


def generation_sampling(folder: str) -> dict:
    """The sampling a folder's ``generation_config.json`` asks transformers' ``generate`` for, as
    :class:`~qkvjax.sample.Sampling` fields. Where it sets ``do_sample``: every field, a setting it leaves out taking
    ``generate``'s default (temperature 1, top_k 50, top_p 1: no cut, no min_p, a repetition penalty of 1: none).
    Without it ``generate`` is greedy and ``qkvjax sample`` keeps its own defaults, all but the repetition penalty,
    which ``generate`` applies to greedy decoding too: that one field where the folder sets it (other than 1), else
    {}. One line naming the file where a value is out of range."""
    from qkvjax.sample import Sampling

    given = read_generation_config(folder)

    def value(key, default):  # transformers reads a null as the default
        return default if given.get(key) is None else given[key]

    penalty = value("repetition_penalty", 1.0)
    fields = {"repetition_penalty": None if penalty == 1.0 else penalty}
    if given.get("do_sample") is True:
        top_p = value("top_p", 1.0)
        fields = {"temperature": value("temperature", 1.0), "top_k": value("top_k", 50) or None,  # 0: no cut
                  "top_p": None if top_p == 1.0 else top_p, "min_p": given.get("min_p")} | fields  # fmt: skip
    elif fields["repetition_penalty"] is None:
        return {}  # greedy, no penalty: nothing of the folder's
    try:
        Sampling(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{os.path.join(folder, GENERATION_CONFIG)}: {e}") from None
    return fields


# generate's settings that change which tokens it makes, each with the value that leaves it off (transformers'
# GenerationConfig defaults); qkvjax applies none of them. Those in SAMPLED_ONLY cut only where do_sample is true.
UNAPPLIED = {"typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "num_beams": 1, "no_repeat_ngram_size": 0,
             "bad_words_ids": None, "min_length": 0, "min_new_tokens": 0, "suppress_tokens": None,
             "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
             "sequence_bias": None, "exponential_decay_length_penalty": None, "penalty_alpha": None,
             "guidance_scale": 1.0}  # fmt: skip
SAMPLED_ONLY = ("typical_p", "epsilon_cutoff", "eta_cutoff")


def unapplied_generation(folder: str) -> dict:
    """The settings of a folder's ``generation_config.json`` that change the tokens transformers' ``generate``
    makes and that ``qkvjax sample`` does not apply (:data:`UNAPPLIED`; an off value, null or empty list left
    out): what a user is told on import, since sample's tokens can then differ from generate's."""
    given = read_generation_config(folder)
    sampled = given.get("do_sample") is True
    on = {k: v for k, v in given.items() if k in UNAPPLIED and v not in (UNAPPLIED[k], None, [], {})}
    return {k: v for k, v in on.items() if sampled or k not in SAMPLED_ONLY}


MAX_TOKENIZER_BYTES = 256 << 20  # a tokenizer.json larger than this is not one (Llama 3's is 9 MB)


def hub_blobs(folder: str) -> str | None:
    """The ``blobs/`` folder of the Hugging Face hub cache ``folder`` is a snapshot of
    (``models--ORG--NAME/snapshots/REV``, whose files are links to ``../../blobs/SHA``: what ``huggingface-cli
    download`` makes without ``--local-dir``), or None."""
    snapshots = os.path.dirname(os.path.realpath(folder))
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return blobs if os.path.basename(snapshots) == "snapshots" and os.path.isdir(blobs) else None


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def inside(folder: str, name: str, what: str) -> str:
    """``folder/name``, refused in one line unless it is a regular file whose real path (links resolved) lies
    inside ``folder``: an untrusted folder's index or links may not reach files elsewhere. In a hub cache's
    snapshot, a link from the snapshot to the cache's own ``blobs/`` is the layout, not an escape."""
    file = os.path.join(folder, name)
    real, root = os.path.realpath(file), os.path.realpath(folder)
    blobs = hub_blobs(folder)
    in_cache = (
        blobs is not None
        and _within(real, os.path.realpath(blobs))
        and _within(os.path.realpath(os.path.dirname(os.path.abspath(file))), root)
    )
    if os.path.isabs(name) or not (_within(real, root) or in_cache):
        raise ValueError(f"{what} {name!r} points outside {folder}; allowed: files inside the folder (or, in a "
                         "Hugging Face hub cache's snapshot, links to its blobs/)")  # fmt: skip
    if os.path.islink(file) and not in_cache:
        raise ValueError(f"{what} {file} is a symbolic link; allowed: regular files only")
    if not os.path.isfile(real):  # a folder, a pipe or a device would hang or fail the read later
        raise ValueError(f"{what} {file} is not a regular file; allowed: regular files only")
    return file


def read_bounded(folder: str, name: str, what: str, max_bytes: int) -> bytes | None:
    """The bytes of ``folder/name`` (None if there is none): a regular file inside the folder (:func:`inside`) of
    at most ``max_bytes``; anything else is refused in one line."""
    if not os.path.lexists(os.path.join(folder, name)):
        return None
    file = inside(folder, name, what)
    if (size := os.path.getsize(file)) > max_bytes:
        raise ValueError(f"{file} has {size:,} bytes; allowed: at most {max_bytes:,}")
    with open(file, "rb") as f:
        return f.read()


def checked_tokenizer(folder: str) -> bytes | None:
    """The bytes of ``folder/tokenizer.json`` after parsing them with ``tokenizers`` (None if there is none):
    a regular file inside the folder, under MAX_TOKENIZER_BYTES; anything else is refused in one line."""
    data = read_bounded(folder, TOKENIZER, "tokenizer", MAX_TOKENIZER_BYTES)
    if data is None:
        return None
    file = os.path.join(folder, TOKENIZER)
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # a truncated or foreign file: refused here rather than in `sample` later
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{file} is not a tokenizer the tokenizers library can read: {first}") from None
    return data


def weight_files(folder: str) -> list[str]:
    """The safetensors files holding the folder's weights, after checking every shard the index lists exists."""
    index = os.path.join(folder, INDEX)
    if os.path.lexists(index):
        try:
            shards = sorted(set(read_json(folder, INDEX)["weight_map"].values()))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a weight_map of names to files): {e}") from None
        for shard in shards:
            if not isinstance(shard, str) or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
                raise ValueError(f"{index} names shard {shard!r} outside {folder}; allowed: files inside the folder")
        missing = [s for s in shards if not os.path.isfile(os.path.join(folder, s))]
        if missing:
            raise ValueError(f"{folder}: shard {missing[0]} listed in {INDEX} is missing ({len(missing)} missing)")
        return [inside(folder, s, "shard") for s in shards]
    if os.path.isfile(os.path.join(folder, WEIGHTS)):
        return [inside(folder, WEIGHTS, "weights")]
    others = [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth", ".h5", ".msgpack"))]
    hint = f" (found {others[0]}: save it with save_pretrained(..., safe_serialization=True))" if others else ""
    raise ValueError(f"{folder} has no {WEIGHTS} or {INDEX}{hint}")


@dataclasses.dataclass(frozen=True)
class Stored:
    """One tensor as the file's header describes it; its data is read only when a layout takes it."""

    file: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def read_tensors(folder: str, max_elements: int | None = None) -> dict[str, Stored]:
    """Every tensor of the folder's weights, from the files' headers alone (no tensor data is read here): a
    malformed header, or a tensor of more than ``max_elements`` values (the model's whole parameter count: no
    real tensor is larger), is refused in one line before anything is read."""
    from safetensors import safe_open

    out = {}
    for file in weight_files(folder):
        try:
            with safe_open(file, framework="numpy") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    out[name] = Stored(file, tuple(int(x) for x in view.get_shape()), str(view.get_dtype()))
        except Exception as e:  # safetensors' own errors: a header that does not parse, offsets past the end
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{file} is not a readable safetensors file: {first}") from None
    for name, t in out.items():
        if max_elements is not None and t.size > max_elements:
            raise ValueError(
                f"tensor {name!r} in {t.file} has shape {t.shape} ({t.size:,} values), more than the whole model "
                f"its config describes ({max_elements:,} parameters); nothing was read"
            )
    return out


def _load(name: str, stored: Stored) -> np.ndarray:
    from safetensors import safe_open

    with safe_open(stored.file, framework="flax") as f:  # the flax reader decodes bfloat16; numpy's cannot
        return np.asarray(f.get_tensor(name), dtype=np.float32)


class Tensors:
    """A checkpoint's tensors under an optional name prefix (``transformer.``, ``model.``, ``bert.``), each taken
    once; :meth:`check_all_taken` names what is left."""

    def __init__(self, tensors: dict[str, np.ndarray], prefix: str = ""):
        self._tensors = dict(tensors)
        self.prefix = prefix
        self._taken: set[str] = set()

    def has(self, name: str, prefixed: bool = True) -> bool:
        return (self.prefix + name if prefixed else name) in self._tensors

    def take(self, name: str, shape: tuple[int, ...] | None = None, prefixed: bool = True) -> np.ndarray:
        """The tensor ``prefix + name`` (``name`` alone when not ``prefixed``: a head outside the base model)."""
        key = self.prefix + name if prefixed else name
        if key not in self._tensors:
            raise ValueError(f"the checkpoint has no tensor {key!r}, which this layout needs")
        value = self._tensors[key]
        if shape is not None and tuple(value.shape) != tuple(shape):  # from the header, before reading
            raise ValueError(f"tensor {key!r} has shape {tuple(value.shape)}; the config says {tuple(shape)}")
        self._taken.add(key)
        return _load(key, value) if isinstance(value, Stored) else value

    def check_all_taken(self, ignore: tuple[str, ...] = ()) -> None:
        """Raises if a tensor was not taken, other than those containing one of ``ignore``."""
        left = sorted(k for k in self._tensors if k not in self._taken and not any(s in k for s in ignore))
        if left:
            raise ValueError(
                f"the checkpoint has {len(left)} tensor(s) this layout does not read, e.g. {left[0]!r}: a part "
                "qkvjax cannot express; nothing was imported"
            )


def write_folder(folder: str, config: dict, tensors: dict[str, np.ndarray]) -> None:
    """``config.json`` and ``model.safetensors`` (metadata ``format: pt``, as transformers writes it)."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}
    tmp = os.path.join(folder, WEIGHTS + ".tmp")
    save_file(arrays, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(folder, WEIGHTS))
    with open(os.path.join(folder, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
