"""Every field of every config dataclass refuses a value of the wrong kind in one line naming the field and the
value (a ValueError, never a TypeError from a comparison further in), and keeps numpy scalars and paths as the
Python values a ``--config.*`` flag would give, so such a config is hashable and round-trips through JSON.

The wrong values are drawn from each field's type hint, so a field added later is covered without a new test."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qkvjax.nnx
from qkvjax import Attention, DecoderLM
from qkvjax.attention.config import AttentionConfig
from qkvjax.attention.schemes import Scheme
from qkvjax.cli import build_parser
from qkvjax.config import Config, DataConfig, MeshConfig, TrainConfig, from_dict, to_json
from qkvjax.models.encoder import EncoderConfig
from qkvjax.models.family import Family
from qkvjax.models.lm import ModelConfig
from tests.helpers import run_in_process, train_args

KEY = jax.random.key(0)
ATTENTION = AttentionConfig(num_heads=5, head_dim=6)
MODEL = ModelConfig(ATTENTION, d_model=30, num_layers=3, max_len=16)
# Each config class with the fewest arguments that build it.
BASES = {
    AttentionConfig: {"num_heads": 5, "head_dim": 6},
    ModelConfig: {"attention": ATTENTION, "d_model": 30, "num_layers": 3, "max_len": 16},
    EncoderConfig: {"attention": ATTENTION, "vocab_size": 7, "num_classes": 3},
    Family: {},
    DataConfig: {},
    TrainConfig: {},
    MeshConfig: {},
    Config: {"model": MODEL},
    Scheme: {"name": "probe", "groups": ("qk", "v"), "summary": "", "reference": ""},
}


class Opaque:
    """An object of no kind a config takes, with a repr that is the same in every pytest-xdist worker."""

    def __repr__(self) -> str:
        return "Opaque()"


def _options(hint) -> tuple:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return typing.get_args(hint) if union else (hint,)


def _wrong_values(hint) -> list:
    """Values no field of this type may hold: other kinds, and None where None is not allowed."""
    options = _options(hint)
    wrong = [[1], {"a": 1}, Opaque()]
    if type(None) not in options:
        wrong.append(None)
    if str not in options:
        wrong += ["3"]
    if int in options:
        wrong += [2.5, True]
    elif float in options:
        wrong += [True, math.nan, math.inf]
    elif bool in options:
        wrong += [1, "yes"]
    elif str in options:
        wrong += [3, 2.5]
    return wrong


CASES = [
    pytest.param(cls, field.name, value, id=f"{cls.__name__}.{field.name}={value!r}")
    for cls in BASES
    for field in dataclasses.fields(cls)
    for value in _wrong_values(typing.get_type_hints(cls)[field.name])
]


@pytest.mark.parametrize(("cls", "name", "value"), CASES)
def test_a_value_of_the_wrong_kind_is_refused_in_one_line_naming_field_and_value(cls, name, value):
    with pytest.raises(ValueError) as error:
        cls(**{**BASES[cls], name: value})
    message = str(error.value)
    assert "\n" not in message and "allowed" in message, message
    assert name in message and repr(value) in message, message


def test_the_wrong_values_cover_every_field():
    """The parametrisation above did not silently shrink: every field of every class has at least three."""
    for cls in BASES:
        for field in dataclasses.fields(cls):
            assert sum(c.values[:2] == (cls, field.name) for c in CASES) >= 3, (cls, field.name)


def test_numpy_scalars_and_paths_are_kept_as_python_values_and_round_trip_through_json(tmp_path):
    attention = AttentionConfig(
        num_heads=np.int64(5), head_dim=np.int32(6), dropout_rate=np.float32(0.25), rope=np.bool_(True)
    )
    model = ModelConfig(attention, d_model=np.int64(30), num_layers=np.int16(3), max_len=np.uint8(16))
    config = Config(
        model=model,
        data=DataConfig(dataset="text_file", source_path=tmp_path / "corpus.txt", seq_len=np.int64(9)),
        train=TrainConfig(learning_rate=np.float32(0.5), batch_size=np.int64(10), skip_nonfinite=np.bool_(False)),
        mesh=MeshConfig(data=np.int64(-1)),
        seed=np.uint32(7),
    )
    assert type(attention.num_heads) is int and type(attention.dropout_rate) is float and attention.rope is True
    assert type(model.max_len) is int and config.data.source_path == str(tmp_path / "corpus.txt")
    assert type(config.train.learning_rate) is float and config.train.learning_rate == 0.5
    assert type(config.seed) is int and type(config.mesh.data) is int and config.train.skip_nonfinite is False
    assert from_dict(Config, json.loads(to_json(config))) == config
    hash(config)


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (TrainConfig, {"b2": 1.0}, r"^train.b2=1.0; allowed: a number in \[0, 1\)$"),
        (TrainConfig, {"learning_rate": 10**400}, r"^train.learning_rate=1000.*; allowed: a finite number > 0$"),
        (TrainConfig, {"grad_clip": 0.0}, r"^train.grad_clip=0.0; allowed: a finite number > 0$"),
        (TrainConfig, {"weight_decay": -0.1}, r"^train.weight_decay=-0.1; allowed: a finite number >= 0$"),
        (TrainConfig, {"warmup_steps": 1.5}, r"^train.warmup_steps=1.5; allowed: an integer >= 0$"),
        (TrainConfig, {"eval_batches": 0}, r"^train.eval_batches=0; allowed: None \(the whole split\) or an integer"),
        (MeshConfig, {"fsdp": 0}, r"^mesh.fsdp=0; allowed: an integer >= 1, or -1 \(the devices left\)$"),
        (MeshConfig, {"data": -1, "tensor": -1}, r"allowed: integers >= 1, at most one -1$"),
        (Config, {"model": MODEL, "seed": 2**32}, r"^seed=4294967296; allowed: an integer in \[0, 4294967295\]$"),
        (ModelConfig, {**BASES[ModelConfig], "attention": {"heads": 5}}, r"\['heads'\] are not AttentionConfig fields"),
        (AttentionConfig, {"num_heads": 5, "head_dim": 6, "scheme": ["separate"]}, r"scheme=\['separate'\] is unknown"),
    ],
)
def test_values_out_of_range_are_refused_with_what_is_allowed(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_a_seed_the_data_order_cannot_take_stops_the_run_before_a_workdir_exists(
    tmp_path, small_text, data_dir, capsys
):
    """grain's shuffle takes seeds in [0, 2^32): -1 used to fail at the first batch, leaving a workdir behind."""
    workdir = tmp_path / "run"
    assert run_in_process(train_args(workdir, small_text, data_dir, **{"data.dataset": "text_file", "seed": -1})) == 2
    assert "seed=-1; allowed: an integer in [0, 4294967295]" in capsys.readouterr().err
    assert not workdir.exists()


def test_none_for_a_field_that_takes_no_none_is_refused_not_kept_as_the_word(tmp_path, monkeypatch, capsys):
    """``--config.data.data_dir=None`` made a folder named "None" in the current folder and prepared the data
    there; Optional fields still take None, and remat's value "none" is still a value."""
    from qkvjax.config import apply_overrides, load_config_file
    from tests.helpers import REPO

    monkeypatch.chdir(tmp_path)
    config = load_config_file(str(REPO / "experiments/configs/tiny.py"))
    for raw in ("None", "null"):
        with pytest.raises(ValueError, match=rf"^--config.data.data_dir='{raw}': this field cannot be None; allowed"):
            apply_overrides(config, {"data.data_dir": raw})
    assert run_in_process(["train", f"--config={REPO / 'experiments/configs/tiny.py'}", "--workdir=w",
                           "--config.data.data_dir=None"]) == 2  # fmt: skip
    assert "data_dir='None': this field cannot be None" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    kept = apply_overrides(config, {"data.source_path": "None", "model.remat": "none", "data.data_dir": "./None"})
    assert (kept.data.source_path, kept.model.remat, kept.data.data_dir) == (None, "none", "./None")


@pytest.mark.parametrize("command", ["sample", "analyze"])
@pytest.mark.parametrize("seed", ["-1", "4294967296", "99999999999999999999"])
def test_a_seed_option_out_of_range_is_refused_by_the_parser_naming_the_flag(command, seed, capsys):
    """``sample --seed 10^20`` was an OverflowError traceback after the prompt was echoed; ``analyze --seed -1``
    numpy's "expected non-negative integer", naming no flag."""
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(
            [command, "--workdir", "w", "--prompt", "a"][: 5 if command == "sample" else 3] + ["--seed", seed]
        )
    assert exit.value.code == 2
    assert f"argument --seed: '{seed}'; allowed: an integer in [0, 4294967295]" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: Attention({"num_heads": 5, "head_dim": 6}).init(KEY, jnp.ones((1, 3, 30))),
            "Attention's config is of type FrozenDict; allowed: a qkvjax AttentionConfig",
        ),
        (
            lambda: DecoderLM(ATTENTION).init(KEY, jnp.zeros((1, 3), jnp.int32)),
            "DecoderLM's config is of type AttentionConfig; allowed: a qkvjax ModelConfig",
        ),
        (
            lambda: qkvjax.nnx.Attention(None, 30, rngs=nnx.Rngs(0)),
            "Attention's config is of type NoneType; allowed: a qkvjax AttentionConfig",
        ),
        (
            lambda: qkvjax.nnx.DecoderLM(ATTENTION, rngs=nnx.Rngs(0)),
            "DecoderLM's config is of type AttentionConfig; allowed: a qkvjax ModelConfig",
        ),
    ],
    ids=["linen-attention-dict", "linen-lm-attention-config", "nnx-attention-none", "nnx-lm-attention-config"],
)
def test_a_module_given_the_wrong_config_says_which_it_takes(make, message):
    """These were AttributeErrors from deep inside ('FrozenDict' object has no attribute 'tying')."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        make()


def test_get_scheme_refuses_a_name_that_is_not_a_string_in_one_line():
    """``convert_workdir(..., to=["mla"])`` reached ``SCHEMES[["mla"]]``: an unhashable-type TypeError."""
    from qkvjax import get_scheme

    for bad in (["mla"], None, 3):
        with pytest.raises(ValueError, match=rf"^unknown attention scheme {re.escape(repr(bad))}; allowed: \["):
            get_scheme(bad)


@pytest.mark.parametrize("call", ["export format", "safetensors format", "dataset", "synthetic task"])
def test_a_name_given_as_a_list_is_refused_in_one_line_not_as_unhashable(call, tmp_path):
    """Each of these looked a name up in a dict: a list was a TypeError ("unhashable type: 'list'")."""
    from qkvjax.data.builders import load_splits
    from qkvjax.data.synthetic import check_task
    from qkvjax.hf.layouts import check_exportable
    from qkvjax.sources import load_safetensors

    make, message = {
        "export format": (lambda: check_exportable(MODEL, ["llama"]), "--format ['llama']; allowed: ["),
        "safetensors format": (lambda: load_safetensors("x", ["llama"]), "--format=['llama']; allowed: ["),
        "dataset": (lambda: load_splits(["x"], None, str(tmp_path)), "data.dataset=['x'] is unknown; allowed: ["),
        "synthetic task": (lambda: check_task(["copy"], 5), "unknown task ['copy']; allowed: "),
    }[call]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        make()
