"""The PyTorch reference (benchmarks/torch_reference.py) is the same model: same parameter count, and with the
qkvjax weights copied in, the same logits. torch is the optional ``bench`` extra, which the README's test command
and CI install: without it these tests skip, except under CI=true, where its absence is a failure."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvjax.config import apply_overrides, load_config_file
from qkvjax.models.lm import DecoderLM, param_count
from tests.helpers import TINY

try:
    import torch
except ImportError:
    if os.environ.get("CI") == "true":
        raise ImportError(
            "CI=true but torch is missing: CI installs the bench extra (pip install -e '.[dev,bench]')"
        ) from None
    pytest.skip("torch is the optional bench extra (pip install -e '.[bench]')", allow_module_level=True)
from benchmarks import torch_reference  # noqa: E402


@pytest.mark.parametrize("kv_heads", [None, 2])
def test_same_parameters_and_logits_as_qkvjax(kv_heads):
    overrides = {"model.d_model": "24", "model.attention.head_dim": "5", "model.max_len": "11"}
    if kv_heads:
        overrides["model.attention.num_kv_heads"] = str(kv_heads)
    config = apply_overrides(load_config_file(TINY), overrides)
    model = DecoderLM(config.model)
    tokens = np.random.default_rng(0).integers(0, 256, (3, 11)).astype(np.int32)
    params = jax.jit(model.init)(jax.random.key(1), jnp.asarray(tokens))["params"]
    params = jax.tree.map(np.asarray, jax.device_get(params))
    params = nn.meta.unbox(params)
    ref = torch_reference.TorchLM(config.model)
    assert sum(p.numel() for p in ref.parameters()) == param_count(config.model)
    torch_reference.load_flax_params(ref, params)
    want = np.asarray(model.apply({"params": params}, jnp.asarray(tokens)))
    with torch.no_grad():
        got = ref(torch.from_numpy(tokens).long()).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_train_steps_are_timed():
    config = apply_overrides(load_config_file(TINY), {"model.max_len": "16"})
    times = torch_reference.time_train_steps(config, batch_size=4, steps=3)
    assert len(times) == 3 and all(t > 0 for t in times)


@pytest.mark.slow  # inductor compiles C++ on a CPU: 1-4 min on 2 cores (pytest -m slow tests/test_torch_reference.py)
def test_the_whole_step_compiled_trains_as_eager_does():
    """compile='step' (forward and loss in one graph, clipping and AdamW in another) gives eager's losses step for
    step, with the SDPA backend forced (math on a CPU); a bad mode is refused in one line."""
    config = apply_overrides(load_config_file(TINY), {"model.max_len": "16", "model.d_model": "32"})
    eager = torch_reference.runner(config, batch_size=3, seed=5)
    compiled = torch_reference.runner(config, batch_size=3, seed=5, compile="step", sdpa="math")
    for _ in range(2):
        eager(), compiled()
    np.testing.assert_allclose(compiled.losses, eager.losses, rtol=2e-4)
    assert len(eager.losses) == 4 and eager.losses[-1] < eager.losses[0]  # it trains
    with pytest.raises(ValueError, match=r"compile='step', mode='fast'.*allowed"):
        torch_reference.runner(config, batch_size=3, compile="step", mode="fast")


def test_vs_torch_alternates_the_two_sides_in_processes_on_the_machines_own_device():
    """benchmarks/vs_torch.py: qkvjax's side (benchmarks/levers/xla_flags.py's child) and torch_reference.py take
    turns, each in a process of its own, and the ratio is theirs (it named a moved script and forced jax onto the
    CPU, so on a GPU machine qkvjax would have run on the CPU beside torch on the GPU)."""
    import sys

    from tests.helpers import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    import vs_torch

    lines = []
    out = vs_torch.compare(TINY, 2, 2, 2, log=lines.append)
    assert out["rounds"] == 2 and len(lines) == 2 and out["x_torch"] > 0
    assert out["x_torch_min"] <= out["x_torch"] <= out["x_torch_max"]
