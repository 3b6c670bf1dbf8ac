"""The comparison verdict (grpo_ratio/analysis/verdict.py): t quantiles, the two intervals, divergence, and each verdict on
literal reward series.

Run: pytest tests/test_verdict.py
"""

import math

import pytest

from grpo_ratio.analysis.verdict import (
    MIN_BOOTSTRAP_STEPS,
    RunSeries,
    arm_verdict,
    block_bootstrap_interval,
    block_length,
    compare_arms,
    rollout_divergence,
    run_series,
    t_interval,
    t_quantile,
)


@pytest.mark.parametrize("df, expected", [(1, 12.706204736), (2, 4.302652730), (4, 2.776445105), (9, 2.262157163),
                                          (30, 2.042272456)])
def test_t_quantile_matches_the_tables(df, expected):
    assert t_quantile(0.975, df) == pytest.approx(expected, abs=1e-8)
    assert t_quantile(0.025, df) == pytest.approx(-expected, abs=1e-8)


def test_t_interval_literal():
    # mean 0.2, sd 0.1, n 3: half-width 4.302653 * 0.1 / sqrt(3) = 0.248414
    lo, hi = t_interval([0.1, 0.2, 0.3])
    assert (lo, hi) == (pytest.approx(-0.0484138, abs=1e-6), pytest.approx(0.4484138, abs=1e-6))
    with pytest.raises(ValueError, match=">= 2"):
        t_interval([0.1])


def test_block_length_is_the_cube_root_rounded_up():
    assert [block_length(n) for n in (1, 8, 9, 10, 27, 28, 64)] == [1, 2, 3, 3, 3, 4, 4]


def test_a_pure_trend_is_not_noise():
    # the difference grows linearly (the arms' learning curves part): no residual, so no width; a bootstrap of the
    # raw steps would read the trend as noise
    lo, hi = block_bootstrap_interval([i / 10 for i in range(10)])
    assert lo == pytest.approx(0.45, abs=1e-12) and hi == pytest.approx(0.45, abs=1e-12)
    assert block_bootstrap_interval([0.2] * 10) == (pytest.approx(0.2), pytest.approx(0.2))


def test_blocks_keep_autocorrelation_that_single_steps_lose():
    # runs of 5 equal values: resampling single steps (block 1) under-states the noise of the mean
    series = ([0.1] * 5 + [-0.1] * 5) * 2
    lo3, hi3 = block_bootstrap_interval(series)  # blocks of ceil(20^(1/3)) = 3
    lo1, hi1 = block_bootstrap_interval(series, block=1)
    assert hi3 - lo3 > 1.3 * (hi1 - lo1)
    assert block_bootstrap_interval(series) == (lo3, hi3)  # seeded: reproducible
    with pytest.raises(ValueError, match=">= 3"):
        block_bootstrap_interval([0.1, 0.2])


def _run(arm, seed, rewards, lengths=None, fingerprints=None):
    lengths = lengths or [10.0] * len(rewards)
    history = [{"step": i + 1, "reward": r, "completions/mean_length": n} for i, (r, n) in
               enumerate(zip(rewards, lengths, strict=True))]
    return run_series(arm, seed, history + [{"train_runtime": 1.0, "step": len(rewards)}], fingerprints)


def test_identical_rewards_are_not_diverged_yet_not_within_noise():
    bases = {s: _run("bf16", s, [0.1, 0.3, 0.2]) for s in (0, 1)}
    runs = [_run("fp32_clone", s, [0.1, 0.3, 0.2]) for s in (0, 1)]
    v = arm_verdict(runs, bases, last_k=2)
    assert v.verdict == "not diverged yet" and v.estimate == 0.0 and v.interval is None
    assert "rollout statistics identical" in v.reason and "--max_steps" in v.reason
    # the fingerprints show that the rollouts parted at step 2, yet no reward moved
    bases = {0: _run("bf16", 0, [0.1, 0.3, 0.2], fingerprints=["a", "b", "c"])}
    runs = [_run("fp32_clone", 0, [0.1, 0.3, 0.2], fingerprints=["a", "x", "y"])]
    v = arm_verdict(runs, bases, last_k=2)
    assert v.verdict == "not diverged yet" and "rollouts differ from step 2" in v.reason
    assert v.divergence == {0: {"step": 2, "exact": True}}


def test_one_seed_and_two_steps_is_unknown_with_the_reason_and_what_to_run():
    v = arm_verdict([_run("fp32_clone", 0, [0.1, 0.4])], {0: _run("bf16", 0, [0.1, 0.2])}, last_k=10)
    assert v.verdict == "unknown" and v.window == 2 and v.estimate == pytest.approx(0.1)  # (0 + 0.2) / 2
    assert "1 seed and 2 step(s)" in v.reason and "--seeds 0 1 2" in v.reason
    assert f"--last_k {MIN_BOOTSTRAP_STEPS}" in v.reason
    v = arm_verdict([_run("fp32_clone", 3, [0.1])], {0: _run("bf16", 0, [0.1])}, last_k=1)
    assert v.verdict == "unknown" and "no baseline run at seed(s) [3]" in v.reason


def test_seeds_give_a_t_interval_over_paired_differences():
    # per-seed last-2 mean differences: s0 (0.1 + 0.2) / 2 = 0.15, s1 0.25, s2 0.35 -> mean 0.25, sd 0.1
    bases = {s: _run("bf16", s, [0.0, 0.0, 0.0]) for s in (0, 1, 2)}
    runs = [_run("fp32_clone", 0, [0.0, 0.1, 0.2]), _run("fp32_clone", 1, [0.0, 0.2, 0.3]),
            _run("fp32_clone", 2, [0.0, 0.3, 0.4])]
    v = arm_verdict(runs, bases, last_k=2)
    half = 4.302652730 * 0.1 / math.sqrt(3)
    assert v.estimate == pytest.approx(0.25)
    assert v.interval == (pytest.approx(0.25 - half), pytest.approx(0.25 + half))
    assert v.verdict == "beyond noise" and v.method == "t-interval over 3 seeds"
    # two seeds: valid but wide, and said so
    v2 = arm_verdict(runs[:2], bases, last_k=2)
    assert v2.verdict == "within noise" and "t_{0.975,1} = 12.7" in v2.reason
    assert v.divergence[0] == {"step": 2, "exact": False}  # rewards differ at step 2: rollouts differ by then


def test_one_seed_long_enough_gives_a_block_bootstrap():
    base = [0.2] * 12
    shifted = [0.2 + d for d in (0, 0, 0.05, 0.1, 0.05, 0.1, 0.15, 0.1, 0.05, 0.1, 0.1, 0.15)]
    v = arm_verdict([_run("x", 0, shifted)], {0: _run("bf16", 0, base)}, last_k=10)
    assert v.window == 10 and v.estimate == pytest.approx(0.095)
    assert v.method == "block bootstrap over 10 steps of seed 0 (blocks of 3)"
    assert v.verdict == "beyond noise" and v.interval[0] > 0 and "another seed" in v.reason
    noisy = [0.2 + d for d in (0, 0, 0.1, -0.1, 0.05, -0.05, 0.1, -0.1, 0.0, 0.05, -0.05, 0.0)]
    assert arm_verdict([_run("x", 0, noisy)], {0: _run("bf16", 0, base)}, last_k=10).verdict == "within noise"


def test_divergence_from_fingerprints_or_rollout_statistics():
    base = RunSeries("bf16", 0, [1, 2, 3], [0.1, 0.2, 0.3], [(0.1, 5), (0.2, 6), (0.3, 7)], ["a", "b", "c"])
    run = RunSeries("x", 0, [1, 2, 3], [0.1, 0.2, 0.3], [(0.1, 5), (0.2, 6), (0.3, 8)], ["a", "q", "c"])
    assert rollout_divergence(run, base) == {"step": 2, "exact": True}
    run.fingerprints = None  # not stored: the length statistic at step 3 is the first sign
    assert rollout_divergence(run, base) == {"step": 3, "exact": False}


def test_compare_arms_skips_the_baseline_in_first_seen_order():
    series = [_run("bf16", 0, [0.1]), _run("b", 0, [0.1]), _run("a", 0, [0.2])]
    assert [v.arm for v in compare_arms(series, "bf16", 1)] == ["b", "a"]
