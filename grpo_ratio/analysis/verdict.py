"""The comparison verdict: does a scoring arm change the reward, against the baseline arm run at the same seeds?

Pure functions over logged reward series; `grpo-ratio compare` and `grpo-ratio report` print their result.

The estimand. For arm a, baseline b and seed s, the paired per-step difference is d_s[t] = reward_a,s[t] -
reward_b,s[t] (same seed: same data order, same sampling RNG, identical step-1 rollouts). The estimate is the mean of
d_s over the last k logged steps, averaged over seeds.

The interval (95%), chosen by what was run:
- **2 or more seeds: a t-interval over per-seed paired differences.** One number per seed, D_s = mean of d_s over
  the last k steps; interval mean(D) +- t_{0.975, n-1} * sd(D) / sqrt(n). Assumes seeds are independent and D is
  roughly normal; it covers the seed-to-seed variation, which is what an arm decision needs. With 2 seeds
  t_{0.975, 1} = 12.7, so the interval is wide; 3 or more seeds give a usable one.
- **1 seed: a block bootstrap over steps of d within that seed** (`block_bootstrap_interval`). The last k differences
  are split into a straight line (the trend: the arms' learning curves drifting apart) and residuals; the residuals
  are resampled in circular blocks of ceil(k^(1/3)) consecutive steps (Politis & Romano 1992, the circular
  moving-block bootstrap), which keeps their autocorrelation up to that lag, and added back to the line. Assumes the
  residuals are stationary and weakly dependent. It says whether this seed's two runs differ beyond their own step
  noise, not whether another seed would agree; it needs >= `MIN_BOOTSTRAP_STEPS` steps in the window.
Steps are never treated as independent draws: rewards trend and neighbouring steps are correlated.

The verdicts:
- "not diverged yet": every paired difference is exactly 0 at every logged step of every seed. The arms' updates
  have not changed a sampled token (or not one that changed a reward): there is no effect to measure yet, which is
  not the same as "no effect". Run longer.
- "within noise" / "beyond noise": the interval contains 0 / excludes 0.
- "unknown": no baseline run at the same seed, or too few seeds and steps for either interval; the reason says what
  to run.

The first step at which an arm's rollouts differ from the baseline's, per seed: from per-step rollout fingerprints
(`grpo-ratio compare` stores a sha256 of each step's prompts and completions in `rollout_fingerprints.json`) when both
runs have them, else an upper bound from the logged statistics that depend on the rollouts only (`ROLLOUT_KEYS`: the
reward, completion lengths, token counts): identical statistics can hide different rollouts, so divergence happened
at that step or before.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field


MIN_SEEDS = 2  # the t-interval over seeds
GOOD_SEEDS = 3  # below this the t-interval is valid but wide (t_{0.975,1} = 12.7)
MIN_BOOTSTRAP_STEPS = 10  # the one-seed block bootstrap: steps in the last-k window
LEVEL = 0.95
BOOTSTRAP_RESAMPLES = 4000

# logged keys that are functions of the rollouts (prompts, completions) alone: equal rollouts give equal values
ROLLOUT_KEYS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
                "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
                "num_tokens")


def needs_text() -> str:
    """What the verdict needs, in one sentence (printed with every comparison and beside docs/arms.md's command)."""
    return (f"needs >= {MIN_SEEDS} seeds (t-interval over per-seed paired differences; {GOOD_SEEDS}+ for a usable "
            f"width), or 1 seed with >= {MIN_BOOTSTRAP_STEPS} logged steps in the last-k window (block bootstrap "
            f"over steps)")


# ---------------------------------------------------------------------------------------------------------------------
# Student's t quantile (no scipy): regularized incomplete beta by Lentz's continued fraction, then bisection


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (Numerical Recipes, betacf), modified Lentz."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for a, b > 0 and x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """CDF of Student's t with `df` degrees of freedom: 1 - I_{df/(df+t^2)}(df/2, 1/2) / 2 for t >= 0."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection on `t_cdf` to 1e-12).

    Raises:
        ValueError: p outside (0, 1) or df <= 0.
    """
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2.0


# ---------------------------------------------------------------------------------------------------------------------
# the two intervals


def t_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float]:
    """mean +- t_{(1+level)/2, n-1} * sd / sqrt(n) of `values` (one per seed).

    Raises:
        ValueError: fewer than 2 values.
    """
    n = len(values)
    if n < 2:
        raise ValueError(f"a t-interval needs >= 2 values, got {n}")
    mean = statistics.fmean(values)
    half = t_quantile((1 + level) / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean - half, mean + half


def block_length(n: int) -> int:
    """ceil(n^(1/3)): the usual order of the block length for a mean (Hall, Horowitz & Jing 1995)."""
    return max(1, math.ceil(n ** (1 / 3) - 1e-12))


def _linear_fit(values: Sequence[float]) -> list[float]:
    """Least-squares straight line through (t, values[t]), t = 0..n-1, evaluated at each t."""
    n = len(values)
    ts = range(n)
    t_mean, v_mean = (n - 1) / 2, statistics.fmean(values)
    sxx = sum((t - t_mean) ** 2 for t in ts)
    slope = sum((t - t_mean) * (v - v_mean) for t, v in zip(ts, values, strict=True)) / sxx if sxx else 0.0
    return [v_mean + slope * (t - t_mean) for t in ts]


def block_bootstrap_interval(values: Sequence[float], level: float = LEVEL, resamples: int = BOOTSTRAP_RESAMPLES,
                             block: int | None = None, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean of a series of paired per-step differences, by a circular block bootstrap of
    its residuals around a straight line.

    mean(values) = mean(line), so each resample's mean is mean(values) + mean(resampled residuals); the residuals
    (mean 0) are drawn as ceil(n / block) circular blocks of `block` consecutive steps (default `block_length(n)`),
    cut to n. `random.Random(seed)`: the same input gives the same interval.

    Raises:
        ValueError: fewer than 3 values (a line and its residuals need them).
    """
    n = len(values)
    if n < 3:
        raise ValueError(f"a block bootstrap over steps needs >= 3 values, got {n}")
    fit = _linear_fit(values)
    resid = [v - f for v, f in zip(values, fit, strict=True)]
    mean = statistics.fmean(values)
    b = block or block_length(n)
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        draw = []
        while len(draw) < n:
            start = rng.randrange(n)
            draw += [resid[(start + j) % n] for j in range(b)]
        means.append(mean + statistics.fmean(draw[:n]))
    means.sort()
    lo_i = max(0, math.floor((1 - level) / 2 * resamples))
    hi_i = min(resamples - 1, math.ceil((1 + level) / 2 * resamples) - 1)
    return means[lo_i], means[hi_i]


# ---------------------------------------------------------------------------------------------------------------------
# divergence and the verdict


def first_difference(a: Sequence, b: Sequence) -> int | None:
    """0-based index of the first position where two step series differ (a length difference does not count); None
    when they agree on every common step."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@dataclass
class RunSeries:
    """What the verdict reads of one (arm, seed) run: per logged step its number, reward and rollout statistics
    (`ROLLOUT_KEYS`), and the rollout fingerprints when stored."""

    arm: str
    seed: int
    steps: list[int]
    rewards: list[float]
    rollout_stats: list[tuple] = field(default_factory=list)
    fingerprints: list[str] | None = None


def run_series(arm: str, seed: int, history: list[dict], fingerprints: list[str] | None = None) -> RunSeries:
    """`RunSeries` of a TRL log history (rows with "reward"; the final summary row has none)."""
    rows = [r for r in history if r.get("reward") is not None and "train_runtime" not in r]
    return RunSeries(arm, seed, [int(r.get("step", i + 1)) for i, r in enumerate(rows)], [r["reward"] for r in rows],
                     [tuple(r.get(k) for k in ROLLOUT_KEYS) for r in rows], fingerprints)


def rollout_divergence(run: RunSeries, base: RunSeries) -> dict:
    """First logged step at which `run`'s rollouts differ from `base`'s.

    Returns:
        {"step": int or None (no difference seen), "exact": True when read from fingerprints (the first step whose
        rollouts differ), False when from `ROLLOUT_KEYS` (the rollouts differ at that step or earlier)}.
    """
    if run.fingerprints and base.fingerprints:
        i = first_difference(run.fingerprints, base.fingerprints)
        return {"step": None if i is None else i + 1, "exact": True}
    i = first_difference(run.rollout_stats, base.rollout_stats)
    return {"step": None if i is None else run.steps[i], "exact": False}


@dataclass
class Verdict:
    """One arm against the baseline: `verdict` in {"beyond noise", "within noise", "not diverged yet", "unknown"},
    the estimate (mean paired last-k difference over seeds), the 95% interval and how it was made, why, and the first
    step of rollout divergence per seed."""

    arm: str
    verdict: str
    seeds: list[int]
    window: int
    estimate: float | None = None
    interval: tuple[float, float] | None = None
    method: str = ""
    reason: str = ""
    divergence: dict[int, dict] = field(default_factory=dict)


def paired_differences(run: RunSeries, base: RunSeries) -> list[float]:
    """d[t] = reward(run) - reward(base) over the steps both logged, in step order."""
    base_at = dict(zip(base.steps, base.rewards, strict=True))
    return [r - base_at[s] for s, r in zip(run.steps, run.rewards, strict=True) if s in base_at]


def arm_verdict(runs: Sequence[RunSeries], bases: dict[int, RunSeries], last_k: int) -> Verdict:
    """The verdict of one arm's runs (one per seed) against `bases` (baseline run per seed), see the module docstring.

    Raises:
        ValueError: `last_k` < 1.
    """
    if last_k < 1:
        raise ValueError(f"last_k must be >= 1, got {last_k}")
    arm = runs[0].arm if runs else "?"
    paired = [(r, bases[r.seed]) for r in runs if r.seed in bases]
    divergence = {r.seed: rollout_divergence(r, b) for r, b in paired}
    diffs = {r.seed: paired_differences(r, b) for r, b in paired}
    diffs = {s: d for s, d in diffs.items() if d}
    window = min([last_k, *(len(d) for d in diffs.values())]) if diffs else 0
    v = Verdict(arm, "unknown", sorted(diffs), window, divergence=divergence)
    if not diffs:
        missing = sorted(r.seed for r in runs if r.seed not in bases)
        v.reason = (f"no baseline run at seed(s) {missing}: run the baseline with the same --seeds" if missing
                    else "no logged reward")
        return v
    per_seed = {s: statistics.fmean(d[-window:]) for s, d in diffs.items()}
    v.estimate = statistics.fmean(per_seed.values())
    if all(x == 0 for d in diffs.values() for x in d):
        v.verdict = "not diverged yet"
        seen = [x["step"] for x in divergence.values() if x["step"] is not None]
        if seen:
            what = f"rewards identical at every step of every seed, although the rollouts differ from step {min(seen)}"
        elif all(x["exact"] for x in divergence.values()):
            what = "rollouts and rewards identical at every step of every seed"
        else:
            what = "rewards and rollout statistics identical at every step of every seed"
        v.reason = f"{what}: the arms' updates have not changed a reward yet, so no effect can be measured; run " \
                   f"longer (--max_steps)"
        return v
    if len(per_seed) >= MIN_SEEDS:
        v.interval = t_interval(list(per_seed.values()))
        v.method = f"t-interval over {len(per_seed)} seeds"
    elif window >= MIN_BOOTSTRAP_STEPS:
        (s, d), = diffs.items()
        v.interval = block_bootstrap_interval(d[-window:])
        v.method = f"block bootstrap over {window} steps of seed {s} (blocks of {block_length(window)})"
    else:
        v.reason = (f"1 seed and {window} step(s) in the last-k window: too few for either interval. Add seeds "
                    f"(--seeds 0 1 2), or run >= {MIN_BOOTSTRAP_STEPS} steps with --last_k {MIN_BOOTSTRAP_STEPS}")
        return v
    lo, hi = v.interval
    v.verdict = "within noise" if lo <= 0 <= hi else "beyond noise"
    if len(per_seed) >= MIN_SEEDS and len(per_seed) < GOOD_SEEDS:
        v.reason = f"{len(per_seed)} seeds: t_{{0.975,{len(per_seed) - 1}}} = " \
                   f"{t_quantile(0.975, len(per_seed) - 1):.1f} makes the interval wide; {GOOD_SEEDS}+ seeds narrow it"
    elif len(per_seed) == 1:
        v.reason = "one seed: says whether these two runs differ beyond their step noise, not whether another seed " \
                   "would agree; add seeds for an arm decision"
    return v


def compare_arms(series: Sequence[RunSeries], baseline: str, last_k: int) -> list[Verdict]:
    """`arm_verdict` of every arm other than `baseline`, in first-seen order."""
    bases = {r.seed: r for r in series if r.arm == baseline}
    arms = [a for a in dict.fromkeys(r.arm for r in series) if a != baseline]
    return [arm_verdict([r for r in series if r.arm == a], bases, last_k) for a in arms]
