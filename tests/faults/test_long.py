"""The long fault trials, kept out of CI (``pytest -m slow tests/faults``): SIGKILL at random moments over seeded
trials, and a 20-minute soak. Their scripts print the figures: ``python tests/faults/kill_trials.py --trials 20``,
``python tests/faults/soak.py --minutes 20``."""

import signal

import pytest

from tests.faults import kill_trials, soak


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes_bit_exactly():
    rows = kill_trials.run_trials(trials=9, seed=0)
    assert [r["moment"].split(":")[0] for r in rows] == list(kill_trials.MOMENTS) * 3
    bad = [r for r in rows if not r["bit_exact"]]
    assert not bad, bad


@pytest.mark.slow  # 20 minutes (conftest's hour-long limit for slow tests); its throughput check wants a quiet machine
def test_a_20_minute_soak_keeps_memory_disk_and_speed_flat():
    result = soak.soak(minutes=20, every=30)
    (r0, r1), (d0, d1) = result["rss_mib"], result["checkpoints_mib"]
    t0, t1 = result["tokens_per_s_first_last_quarter"]
    # stopped by SIGTERM: saved, then 128 + 15 (a stopped run, not a finished one)
    assert result["exit_code"] == 128 + signal.SIGTERM and len(result["checkpoints_kept"]) == 3
    assert r1 <= 1.2 * r0, result["rss_mib"]
    assert result["rss_slope_mib_per_min_second_half"] * 20 <= 0.2 * r0, result["rss_slope_mib_per_min_second_half"]
    assert d1 <= 1.5 * d0, result["checkpoints_mib"]
    assert t1 >= 0.75 * t0, result["tokens_per_s_first_last_quarter"]
