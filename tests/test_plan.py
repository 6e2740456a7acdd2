"""``qkvjax plan``: per-device bytes equal the shardings of a real 8-device mesh and the parameter accounting."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from qkvjax.config import apply_overrides, load_config_file
from qkvjax.models.lm import REMAT_POLICIES, DecoderLM, param_count
from qkvjax.plan import GIB, activation_bytes, plan
from qkvjax.train.mesh import make_mesh, shardings_for
from qkvjax.train.state import abstract_state, make_optimizer
from tests.helpers import REPO, TINY, run_in_process

STRICT_DTYPE_PROMOTION = False  # optax
GPT = str(REPO / "experiments/configs/gpt2_small.py")
SMALL_GPT = {"model.num_layers": 3, "model.max_len": 64, "model.attention.num_kv_heads": 2, "train.batch_size": 16}


def _config(path, **overrides):
    return apply_overrides(load_config_file(path), {k: str(v) for k, v in overrides.items()})


@pytest.mark.parametrize(
    "path, overrides",
    [
        (TINY, {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2}),
        (GPT, {**SMALL_GPT, "mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}),
    ],
)  # fmt: skip
def test_bytes_per_device_equal_the_real_shardings_on_8_devices(path, overrides):
    config = _config(path, **overrides)
    state = abstract_state(DecoderLM(config.model), config, make_optimizer(config.train))
    mesh = make_mesh(config.mesh)
    boxed = lambda x: isinstance(x, nn.LogicallyPartitioned)  # noqa: E731

    def real(tree):  # bytes of one device's shards, from jax's own NamedSharding.shard_shape
        leaves = jax.tree.leaves(tree, is_leaf=boxed)
        shardings = jax.tree.leaves(shardings_for(tree, mesh), is_leaf=lambda x: isinstance(x, NamedSharding))
        values = [leaf.value if boxed(leaf) else leaf for leaf in leaves]
        return sum(
            int(np.prod(s.shard_shape(v.shape))) * v.dtype.itemsize for v, s in zip(values, shardings, strict=True)
        )

    p = plan(config, 8)
    assert p.mesh == tuple(mesh.shape.values())
    assert p.params == real(state.params) and p.gradients == p.params
    assert p.optimizer == real(state.opt_state)
    # one device holds everything: the accounting's parameter count, in float32
    one = plan(_config(path, **{k: v for k, v in overrides.items() if not k.startswith("mesh")}), 1)
    assert one.params == 4 * param_count(config.model)
    assert p.params < one.params


def test_activation_estimate_scales_with_the_micro_batch_and_remat():
    base = _config(GPT, **SMALL_GPT)
    assert activation_bytes(base, 4, 1) == 2 * activation_bytes(base, 2, 1)
    by_remat = {r: activation_bytes(_config(GPT, **SMALL_GPT, **{"model.remat": r}), 2, 1) for r in REMAT_POLICIES}
    assert by_remat["full"] < by_remat["dots"] < by_remat["none"]
    assert activation_bytes(base, 2, 2) < activation_bytes(base, 2, 1)  # heads and MLP split over tensor


def test_cli_prints_the_table_and_warns_when_it_will_not_fit(capsys):
    assert run_in_process(["plan", f"--config={GPT}", "--devices", "8", "--per-device-memory", "80"]) == 0
    out = capsys.readouterr().out
    assert "on 8 devices as mesh (data 8, fsdp 1, tensor 1)" in out and "parameters (float32)" in out
    assert "warning" not in out
    assert run_in_process(["plan", f"--config={GPT}", "--devices", "8", "--per-device-memory", "2"]) == 0
    assert "warning:" in capsys.readouterr().out
    p = plan(_config(GPT), 8)
    assert p.total / GIB < 80 and p.total / GIB > 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "0"], "--devices=0; allowed"),
        (["--devices", "6", "--config.mesh.fsdp=4"], "does not divide the 6 devices"),
        (["--devices", "64"], "train.batch_size=32 is not divisible by the data-parallel size 64"),
        (["--devices", "8", "--per-device-memory", "-1"], "--per-device-memory=-1.0"),
    ],
)
def test_cli_errors(args, message, capsys):
    assert run_in_process(["plan", f"--config={GPT}", *args]) == 2
    assert message in capsys.readouterr().err
