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
