"""The matmul peak MFU is quoted against: the best timed call, as many calls as the budget allows."""

import types

import jax
import pytest

from qkvjax import perf


@pytest.mark.parametrize("tick, budget_s, timed", [(0.4, 1.0, 3), (0.001, 1.0, 10), (0.4, None, 10)])
def test_the_peak_is_the_best_of_the_calls_that_fit_in_its_budget(monkeypatch, tick, budget_s, timed):
    """A clock that moves ``tick`` seconds per reading: 0.4 s calls leave room for the three at least within 1 s,
    1 ms calls for all ten asked, and no budget (benchmarks) times all ten; two warm-up calls come first each
    time, and FLOP/s is 2 n^3 over a call."""
    now, calls, jit = [0.0], [], jax.jit

    def clock():
        now[0] += tick
        return now[0]

    def counting_jit(f):
        compiled = jit(f)
        return lambda *a: calls.append(1) or compiled(*a)

    monkeypatch.setattr(perf, "time", types.SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(perf.jax, "jit", counting_jit)
    flops = perf.measure_peak_flops(size=5, repeats=10, budget_s=budget_s)
    assert len(calls) == 2 + timed
    assert flops == pytest.approx(2 * 5**3 / tick)


def test_the_peak_of_this_machine_is_positive_and_finite():
    flops = perf.measure_peak_flops(size=33, repeats=4)
    assert 0 < flops < float("inf")


def test_mfu_flop_count_is_nanogpts_for_gpt2_and_counts_a_window_and_gqa_by_hand():
    """One FLOP count for MFU (issue 98): nanoGPT's estimate_mfu, 6 N + 12 L H Q T with N all parameters but the
    position table, for GPT-2 124M's shape; and, by hand, a GQA model with a sliding window."""
    from qkvjax.attention import AttentionConfig
    from qkvjax.models.lm import ModelConfig, mfu_flops_per_token

    d, v, L, t = 768, 50304, 12, 1024
    gpt2 = ModelConfig(attention=AttentionConfig(num_heads=12, head_dim=64), vocab_size=v, d_model=d,
                       num_layers=L, max_len=t)  # fmt: skip
    n = v * d + L * (12 * d * d + 2 * d) + d  # token table, per block q/k/v/o 4 d^2 + MLP 8 d^2 + two norm gains
    assert mfu_flops_per_token(gpt2) == 6 * n + 12 * L * 12 * 64 * t
    # 3 query heads of 5, 1 K/V head (GQA), window 4 < T = 9, two layers, untied, d = 7, V = 11, F = 13
    att = AttentionConfig(num_heads=3, head_dim=5, num_kv_heads=1, sliding_window=4)
    m = ModelConfig(attention=att, vocab_size=11, d_model=7, num_layers=2, max_len=9, mlp_dim=13,
                    tie_embeddings=False)  # fmt: skip
    block = 7 * 15 + 2 * (7 * 5) + 15 * 7 + 2 * 7 * 13 + 2 * 7  # q, k and v (one head), o, MLP, two norm gains
    n = 11 * 7 + 2 * block + 7 + 7 * 11  # embedding, blocks, final norm, unembedding (no position table)
    assert mfu_flops_per_token(m) == 6 * n + 2 * 6 * 3 * (5 + 5) * 4


def test_the_datasheet_peak_is_named_for_known_devices_and_absent_for_a_cpu():
    assert perf.datasheet_peak("NVIDIA H100 80GB HBM3", "bfloat16") == (
        989.4e12,
        "NVIDIA H100 SXM datasheet, bfloat16 dense",
    )
    assert perf.datasheet_peak("NVIDIA H100 PCIe", "bfloat16")[0] == 756e12
    assert perf.datasheet_peak("NVIDIA H200", "bfloat16")[0] == 989.4e12
    assert perf.datasheet_peak("cpu", "float32") is None


def test_the_datasheet_bandwidth_is_named_for_known_devices_and_absent_for_a_cpu():
    assert perf.datasheet_bandwidth("NVIDIA H100 80GB HBM3") == (3.35e12, "NVIDIA H100 SXM datasheet, memory bandwidth")
    assert perf.datasheet_bandwidth("NVIDIA H100 PCIe")[0] == 2.0e12
    assert perf.datasheet_bandwidth("NVIDIA H200")[0] == 4.8e12
    assert perf.datasheet_bandwidth("cpu") is None
