"""A GPU's default attention ('auto') when cuDNN's kernel passes jax's checks but fails to compile.

jax refuses cuDNN's kernel while tracing for the reasons it knows (dtype, head width, no cuDNN), which 'auto' turns
into XLA's attention; other failures come only when XLA compiles the program (jax's tracker: a stride check under
some shardings, "No valid engine configs" on some cuDNN builds). This machine has no cuDNN, so the fault is made
real the one way it can be here: jax's cuDNN attention is replaced, while tracing, by XLA's plus a custom call named
as cuDNN's (``__cudnn$fmha...``) that this machine cannot compile, the same failure at the same moment.
"""

import jax
import pytest

from qkvjax.attention import kernels
from qkvjax.config import apply_overrides, load_config_file
from qkvjax.evaluate import evaluate
from qkvjax.train.loop import train
from tests.helpers import TINY, metrics

STRICT_DTYPE_PROMOTION = False  # optax


@pytest.fixture
def cudnn_that_does_not_compile(monkeypatch):
    """jax's ``implementation='cudnn'`` traces (no refusal) into a program XLA cannot compile here; a fresh
    record of what 'auto' did (so no other test sees this one's fallback)."""
    real = jax.nn.dot_product_attention

    def attention(q, k, v, *, implementation=None, **kw):
        out = real(q, k, v, implementation=None if implementation == "cudnn" else implementation, **kw)
        if implementation != "cudnn":
            return out
        shape = jax.ShapeDtypeStruct(out.shape, out.dtype)
        held = jax.ffi.ffi_call("__cudnn$fmhaSoftmax", shape)(jax.lax.stop_gradient(out))  # no handler here
        return out + (0 * held).astype(out.dtype)

    monkeypatch.setattr(jax.nn, "dot_product_attention", attention)
    monkeypatch.setattr(kernels, "AUTO_CUDNN", kernels._AutoCudnn())
    jax.clear_caches()
    yield
    jax.clear_caches()


def _config(source, data_dir, implementation):
    overrides = {
        "data.source_path": source,
        "data.data_dir": data_dir,
        "train.peak_flops": "1e11",
        "train.num_steps": "3",
        "train.log_every": "1",
        "train.eval_every": "3",
        "train.eval_batches": "2",
        "model.attention.implementation": implementation,
        "model.attention.causal_block": "0",  # XLA's attention, not this package's blocks, on this CPU
    }
    return apply_overrides(load_config_file(TINY), overrides)


def test_auto_trains_and_evaluates_with_xlas_attention_when_cudnns_fails_to_compile(
    tmp_path, small_text, data_dir, cudnn_that_does_not_compile, capsys
):
    auto = train(_config(small_text, data_dir, "auto"), str(tmp_path / "auto"))
    said = capsys.readouterr()
    assert "cuDNN's attention failed to compile" in said.out + said.err
    assert "__cudnn$fmha" in said.out + said.err  # the compiler's own first line, for a bug report
    assert kernels.AUTO_CUDNN.taken and not kernels.AUTO_CUDNN.allowed
    # the same losses as a run that asked for XLA's attention from the start
    xla = train(_config(small_text, data_dir, "xla"), str(tmp_path / "xla"))
    assert auto["loss"] == xla["loss"]
    assert [r["loss"] for r in metrics(tmp_path / "auto")] == [r["loss"] for r in metrics(tmp_path / "xla")]
    # a later process (eval) meets the failure again at its own first compile, and falls back the same way
    kernels.AUTO_CUDNN.allowed, kernels.AUTO_CUDNN.taken = True, False
    jax.clear_caches()
    result = evaluate(str(tmp_path / "auto"), split="validation")
    assert result["loss"] == evaluate(str(tmp_path / "xla"), split="validation")["loss"]
    assert "cuDNN's attention failed to compile" in capsys.readouterr().err


def test_an_explicit_cudnn_that_fails_to_compile_is_not_hidden(
    tmp_path, small_text, data_dir, cudnn_that_does_not_compile
):
    with pytest.raises(jax.errors.JaxRuntimeError, match="__cudnn"):
        train(_config(small_text, data_dir, "cudnn"), str(tmp_path))
    assert kernels.AUTO_CUDNN.allowed  # the user asked for cuDNN's kernel: no fallback
