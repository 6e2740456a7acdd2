"""The run's configuration: frozen dataclasses, validated on construction, loaded from a Python file and
overridden from the command line with ``--config.a.b=value`` (ml_collections style)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import os
import types
import typing
from typing import Any, ClassVar

from qkvjax import checks
from qkvjax.attention import AttentionConfig
from qkvjax.data import DATASET_NAMES, SAMPLINGS
from qkvjax.models.encoder import EncoderConfig
from qkvjax.models.lm import ModelConfig
from qkvjax.parse import BOOLEAN_SPELLINGS, parse_bool

PARALLELISMS = ("jit", "pmap")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the text comes from.

    Attributes:
      dataset: 'tiny_shakespeare' (the TFDS catalog's split) or 'text_file' (any UTF-8 file, split 90/5/5).
      source_path: a local copy of the corpus (required for 'text_file'); None downloads Tiny Shakespeare.
      data_dir: where TFDS keeps the prepared datasets.
      seq_len: the training window in tokens; None means the model's ``max_len``.
      tokenizer: a Hugging Face ``tokenizer.json`` (read with the ``tokenizers`` library; a relative path is
        looked up in the workdir, where ``qkvjax import`` copies the model's own); None: bytes are the tokens, or
        a prepared corpus' own tokenizer.
      prepared: a corpus made by ``qkvjax prepare`` (a local or gs:// folder), streamed from its token shards;
        ``dataset`` is then not read (and ``source_path`` is refused). None: the byte corpus ``dataset`` names.
      sampling: how training windows are drawn: 'disjoint' (windows at multiples of seq_len, each target once per
        epoch) or 'random' (a window at every offset, shuffled); None: disjoint for a prepared corpus, random for
        the byte corpora (as before).
      workers: grain worker processes reading training batches (0: in the training process).
      start_batch: batches of the seeded window order to skip before the first step, so that a run trained on from
        another's weights (an uptraining after ``qkvjax convert``) reads the text that run had not reached:
        ``start_batch`` = that run's steps at the same seed and batch size. Epochs and repeated targets are counted
        from the order's start. 0: from the start.
    """

    dataset: str = "tiny_shakespeare"
    source_path: str | None = None
    data_dir: str = "~/tensorflow_datasets"
    seq_len: int | None = None
    tokenizer: str | None = None
    prepared: str | None = None
    sampling: str | None = None
    workers: int = 0
    start_batch: int = 0

    LABEL: ClassVar[str] = "data"

    def __post_init__(self):
        checks.choice(self, "dataset", sorted(DATASET_NAMES))
        checks.text(self, "source_path", none="download Tiny Shakespeare")
        checks.text(self, "data_dir")
        checks.integer(self, "seq_len", none="the model's max_len")
        checks.text(self, "tokenizer", none="bytes")
        checks.text(self, "prepared", none="the byte corpus data.dataset names")
        checks.choice(self, "sampling", SAMPLINGS, none="disjoint for a prepared corpus, random for a byte corpus")
        checks.integer(self, "workers", minimum=0, allowed="an integer >= 0 (grain worker processes)")
        checks.integer(self, "start_batch", minimum=0, allowed="an integer >= 0 (batches of the window order skipped)")
        if self.prepared is not None and self.source_path is not None:
            raise ValueError(
                f"data.prepared={self.prepared!r} and data.source_path={self.source_path!r} are both given; a "
                "prepared corpus holds its own text: drop one"
            )

    @property
    def window_sampling(self) -> str:
        """``sampling``, its default resolved."""
        return self.sampling or ("disjoint" if self.prepared is not None else "random")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Optimisation (AdamW, linear warmup then cosine decay to ``min_lr_ratio`` x peak) and the loop's cadence.

    ``log_weight_similarity`` adds each layer's head-averaged ``symmetry/layer_i`` and ``qk_cos/layer_i`` of
    W^Q (W^K)^T (see ``qkvjax.analyze``) to every evaluation record. A step whose loss or gradient norm is not
    finite is never applied; it stops the run (named, nothing saved after it) unless ``skip_nonfinite``, which
    skips such batches and counts them in ``skipped_steps``.

    Attributes:
      batch_size: sequences per step, over all devices.
      num_steps: optimiser steps of the whole run (the cosine schedule's length).
      learning_rate: the peak learning rate, reached after the warmup.
      min_lr_ratio: the cosine decay's floor, as a fraction of the peak.
      warmup_steps: linear warmup from 0 to the peak.
      weight_decay: AdamW's decoupled weight decay (on every parameter of two or more dimensions).
      b1: Adam's first-moment decay.
      b2: Adam's second-moment decay.
      grad_clip: the global gradient norm is clipped to this.
      grad_accum_steps: micro-batches per step (the batch is split; gradients averaged).
      loss_chunk: the output layer and cross-entropy over this many positions at a time, so the float32 logits
        (B, T, V) are never held whole (with GPT-2's vocabulary, 12 GiB at batch 64 x 1024); None: all at once.
      log_every: steps between training records in metrics.jsonl and the progress line.
      eval_every: steps between evaluations on the validation split.
      eval_batches: batches per evaluation (windows spread evenly over the split, the same each time); None
        evaluates the whole split.
      checkpoint_every: steps between checkpoints (one is also saved at the end and on SIGTERM/Ctrl-C).
      max_to_keep: checkpoints kept (the oldest are deleted).
      peak_flops: FLOP/s that MFU is measured against; None measures a matmul at start.
      log_weight_similarity: add W^Q (W^K)^T statistics and each attention kernel's drift ||W - W_0|| / ||W_0|| per
        layer to every evaluation record.
      skip_nonfinite: skip a batch whose loss or gradient is not finite instead of stopping.
      tensorboard: also write TensorBoard events under ``WORKDIR/tensorboard`` (tensorboardX is imported only
        then); metrics.jsonl is written either way.
    """

    batch_size: int = 64
    num_steps: int = 5000
    learning_rate: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.99
    grad_clip: float = 1.0
    grad_accum_steps: int = 1
    loss_chunk: int | None = None
    log_every: int = 10
    eval_every: int = 250
    eval_batches: int | None = None
    checkpoint_every: int = 500
    max_to_keep: int = 3
    peak_flops: float | None = None
    log_weight_similarity: bool = False
    skip_nonfinite: bool = False
    tensorboard: bool = True

    LABEL: ClassVar[str] = "train"

    def __post_init__(self):
        for name in ("batch_size", "num_steps", "grad_accum_steps", "log_every", "eval_every", "checkpoint_every"):
            checks.integer(self, name)
        checks.integer(self, "warmup_steps", minimum=0)
        checks.integer(self, "max_to_keep", allowed="an integer >= 1 (checkpoints kept)")
        checks.integer(self, "eval_batches", none="the whole split")
        checks.integer(self, "loss_chunk", none="the whole sequence at once")
        checks.number(self, "learning_rate", low=0, open_low=True)
        checks.number(self, "min_lr_ratio", low=0, high=1)
        checks.number(self, "weight_decay", low=0)
        for name in ("b1", "b2"):  # a decay of 1 never forgets, and Adam's bias correction divides by 1 - b^t
            checks.number(self, name, low=0, high=1, open_high=True)
        checks.number(self, "grad_clip", low=0, open_low=True)  # 0 would clip every update to nothing
        checks.number(self, "peak_flops", low=0, open_low=True, none="measure a matmul at start")
        for name in ("log_weight_similarity", "skip_nonfinite", "tensorboard"):
            checks.flag(self, name)
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(
                f"train.batch_size={self.batch_size} is not divisible by grad_accum_steps={self.grad_accum_steps}"
            )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes on the axes (data, fsdp, tensor); one of them may be -1 to take the remaining devices.

    Attributes:
      data: data-parallel replicas (batch split).
      fsdp: parameter and optimizer-state shards over the model width (and the batch).
      tensor: shards over heads and the MLP width.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    LABEL: ClassVar[str] = "mesh"

    def __post_init__(self):
        allowed = "an integer >= 1, or -1 (the devices left)"
        for name in ("data", "fsdp", "tensor"):
            checks.integer(self, name, minimum=-1, allowed=allowed)
            if getattr(self, name) == 0:
                checks.refuse(self, name, allowed)
        sizes = (self.data, self.fsdp, self.tensor)
        if sizes.count(-1) > 1:
            raise ValueError(f"mesh sizes (data, fsdp, tensor) = {sizes}; allowed: integers >= 1, at most one -1")


@dataclasses.dataclass(frozen=True)
class Config:
    """A training run.

    Attributes:
      model: the model (its ``attention`` section is the attention layer); an ``EncoderConfig`` only in a workdir
        that ``qkvjax import`` wrote from a BERT folder (info, analyze, convert and export read it).
      data: the corpus.
      train: optimisation and the loop's cadence.
      mesh: the device mesh (with ``parallelism='jit'``).
      parallelism: 'jit' (sharded on the mesh) or 'pmap' (data parallel).
      seed: initialisation, data order and dropout.
    """

    model: ModelConfig | EncoderConfig
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    mesh: MeshConfig = MeshConfig()
    parallelism: str = "jit"
    seed: int = 0

    LABEL: ClassVar[str] = ""

    def __post_init__(self):
        sections = {"model": (ModelConfig, EncoderConfig), "data": (DataConfig,), "train": (TrainConfig,),
                    "mesh": (MeshConfig,)}  # fmt: skip
        for name, kinds in sections.items():
            if not isinstance(getattr(self, name), kinds):
                checks.refuse(self, name, " or ".join(f"a {kind.__name__}" for kind in kinds))
        checks.choice(self, "parallelism", PARALLELISMS)
        object.__setattr__(self, "seed", checks.seed("seed", self.seed))
        if self.data.seq_len is not None and self.data.seq_len > self.model.max_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_len={self.model.max_len}; allowed: at most "
                f"{self.model.max_len} (or a larger model.max_len)"
            )

    @property
    def seq_len(self) -> int:
        return self.model.max_len if self.data.seq_len is None else self.data.seq_len


def require_decoder(config: Config, command: str) -> None:
    """Refuses ``command`` in one line for an encoder (an imported BERT: hidden states, no LM head to train,
    score or sample with)."""
    if isinstance(config.model, EncoderConfig):
        raise ValueError(
            f"qkvjax {command} needs a decoder LM; this run's model is an encoder (EncoderConfig, an imported BERT "
            "without an LM head); on an encoder workdir: info, analyze, convert, export --format bert"
        )


# ------------------------------------------------------------------------------------------------------------
# Serialisation and overrides, driven by the dataclasses' type hints.


def to_dict(config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def to_json(config) -> str:
    return json.dumps(to_dict(config), indent=2, sort_keys=True)


def from_dict(cls, data: dict[str, Any]):
    """Rebuilds a (nested) config dataclass; unknown keys are an error."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields {sorted(unknown)}; allowed: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        sub = _dataclass_of(hints[key], value)
        kwargs[key] = from_dict(sub, value) if sub is not None and isinstance(value, dict) else value
    return cls(**kwargs)


def load_config_file(path: str) -> Config:
    """Imports a config file and calls its ``get_config()``; a ``.json`` file is a run's saved ``config.json``
    (what ``qkvjax convert`` writes: uptrain a converted run with ``--config OUT/config.json``)."""
    if not os.path.isfile(path):
        raise ValueError(f"--config={path!r} is not a file; pass a Python file defining get_config()")
    if path.endswith(".json"):
        try:
            return from_dict(Config, json.loads(open(path).read()))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"--config={path!r} is not a run's config.json ({type(e).__name__}: {e})") from None
    spec = importlib.util.spec_from_file_location(f"qkvjax_config_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--config={path!r} is not a Python file; pass a .py file defining get_config()")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # a syntax error in a README, a typo in a preset: say which file, in one line
        raise ValueError(f"--config={path!r} could not be run as Python ({type(e).__name__}: {e})") from None
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path} has no get_config() function")
    config = module.get_config()
    if not isinstance(config, Config):
        raise ValueError(f"{path}: get_config() returned {type(config).__name__}, expected qkvjax Config")
    return config


def apply_overrides(config: Config, overrides: dict[str, str]) -> Config:
    """``{"model.attention.scheme": "shared_kv", ...}`` applied together, then validated once (so the order of
    overrides that must change together, like a scheme and its head count, does not matter)."""
    data = to_dict(config)
    for dotted, raw in overrides.items():
        cls, node, keys = type(config), data, dotted.split(".")
        for depth, key in enumerate(keys):
            names = {f.name for f in dataclasses.fields(cls)}
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"--config.{dotted}: {cls.__name__} has no field {key!r}; {hint}allowed: {sorted(names)}"
                )
            hint = typing.get_type_hints(cls)[key]
            sub = _dataclass_of(hint, node.get(key) if isinstance(node, dict) else None)
            if depth < len(keys) - 1:
                if sub is None:
                    raise ValueError(f"--config.{dotted}: {key!r} is a value, not a section")
                cls, node = sub, node[key]
            elif sub is not None:
                raise ValueError(f"--config.{dotted}: {key!r} is a section; set one of its fields")
            else:
                node[key] = _parse(raw, hint, dotted)
    return from_dict(type(config), data)


def field_meanings(cls) -> dict[str, str]:
    """{field: one-line meaning} from the ``Attributes:`` section of a config dataclass's docstring (the one place
    the fields are documented), continuation lines joined."""
    out, name = {}, None
    lines = (cls.__doc__ or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), len(lines))
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        head, sep, text = line.strip().partition(": ")
        if sep and line.startswith("      ") and not line.startswith("        ") and head.isidentifier():
            name, out[head] = head, text.strip()
        elif name is not None:
            out[name] += " " + line.strip()
    return out


def describe_fields(config=None) -> list[dict[str, str]]:
    """Every settable field of a run's config as ``--config.<dotted>``: its type, its value (in ``config``, else
    the dataclass default, or "required") and its meaning, section by section (top-level fields first)."""
    rows = []

    def walk(cls, obj, prefix: str) -> None:
        hints, meanings = typing.get_type_hints(cls), field_meanings(cls)
        fields = dataclasses.fields(cls)
        sections = [f for f in fields if _dataclass_of(hints[f.name]) is not None]
        for f in fields:
            if f in sections:
                continue
            hint = hints[f.name]
            options = typing.get_args(hint) or (hint,)
            kind = " or ".join("None" if t is type(None) else t.__name__ for t in options)
            if bool in options:
                kind += " (" + "/".join(BOOLEAN_SPELLINGS[True] + BOOLEAN_SPELLINGS[False]) + ")"
            if obj is not None:
                value = repr(getattr(obj, f.name))
            else:
                value = "required" if f.default is dataclasses.MISSING else repr(f.default)
            rows.append({"field": prefix + f.name, "type": kind, "default": value, "meaning": meanings.get(f.name, "")})
        for f in sections:
            sub = None if obj is None else getattr(obj, f.name)
            walk(_dataclass_of(hints[f.name]), sub, f"{prefix}{f.name}.")

    walk(Config, config, "")
    return rows


def format_fields(config: Config | None = None, width: int = 120) -> str:
    """The field list as text: one line per field (type, value), its meaning wrapped below it."""
    import textwrap

    lines, section = [], None
    for row in describe_fields(config):
        here = row["field"].rpartition(".")[0] or "run"
        if here != section:
            section = here
            lines.append(f"\n[{section}]")
        value = "required" if row["default"] == "required" else f"default {row['default']}"
        lines.append(f"  --config.{row['field']}  {row['type']}, {value}")
        lines += textwrap.wrap(row["meaning"], width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines).lstrip("\n")


def _dataclass_of(hint, value=None):
    """The dataclass a field holds; of a union of several (``Config.model``), the first whose fields hold every
    key of ``value`` (an encoder's ``num_classes`` picks ``EncoderConfig``)."""
    classes = [t for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)]
    if len(classes) > 1 and isinstance(value, dict):
        classes = [c for c in classes if set(value) <= {f.name for f in dataclasses.fields(c)}] or classes
    return classes[0] if classes else None


def _parse(raw: str, hint, name: str):
    options = [t for t in (typing.get_args(hint) if _is_union(hint) else (hint,))]
    if type(None) in options and raw.lower() in ("none", "null"):
        return None
    if str in options and raw in ("None", "null"):  # Python's and JSON's None, given to a field that takes none
        # (a folder literally named "None" was made for --config.data.data_dir=None; remat's "none" stays a value)
        raise ValueError(
            f"--config.{name}={raw!r}: this field cannot be None; allowed: a str (a folder named {raw}: ./{raw})"
        )
    for t in options:
        try:
            if t is bool:
                return parse_bool(raw)
            if t in (int, float, str):
                return t(raw)
        except ValueError:
            continue
    allowed = " or ".join(_SPELLED.get(t, getattr(t, "__name__", str(t))) for t in options)
    raise ValueError(f"--config.{name}={raw!r}; allowed: {allowed}")


_SPELLED = {bool: ", ".join(BOOLEAN_SPELLINGS[True] + BOOLEAN_SPELLINGS[False]), int: "an integer", float: "a number",
            type(None): "None"}  # fmt: skip


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


__all__ = [
    "AttentionConfig",
    "Config",
    "DataConfig",
    "MeshConfig",
    "ModelConfig",
    "TrainConfig",
    "apply_overrides",
    "from_dict",
    "load_config_file",
    "to_json",
]
