"""Importance-ratio diagnostics: pure tensor functions, no model, no trainer.

Shapes: B = sequences (completions), T = completion tokens. Every function takes log-probs or log-ratios of any float
dtype and does its math in fp32 (accumulators in fp64, see below). The metric keys and their formulas are listed in
docs/metrics.md.

- `valid_token_mask`: the one definition of a valid completion token, used by every metric (docs/design.md, "Rules
  of the house").
- `RatioStats`: out-of-band rate, mean |log r| and quantiles of r = exp(log_ratio) over valid tokens; the
  batch-logprob-gap report's definition: out of band means r < 0.9 or r > 1.1, strictly, and a non-finite log-ratio
  counts as out of band (its `selective_fp32` convention).
- `ppo_clip_active`, `clip_flips` / `FlipStats`: where TRL's PPO clip zeroes a token's gradient, and how often two
  choices of old log-probs disagree about it (the batch-logprob-gap report's T5 "clip-status flips", with TRL's real
  advantages).
- `importance_sampling_weights`: TRL 1.16's vLLM importance-sampling weights recomputed from a log-ratio (trl 1.16
  `grpo_trainer.py` L2659-2707); every IS correction, and the statistics of its weights, are
  `grpo_ratio.corrections.is_correction` and `grpo_ratio.diagnostics.mismatch`.

Token weighting. Every rate is (sum over all valid tokens of the numerator) / (number of valid tokens), pooled over
micro-batches and processes: never a mean of per-batch or per-sequence means. The accumulators keep sums and counts as
fp64 scalar tensors (exact for integer counts below 2**53), `merge` adds them and `all_reduce` sums them across
processes with `accelerator.reduce(..., "sum")`. Quantiles need the values themselves: `RatioStats` keeps every finite
valid log-ratio (4 bytes per token) and `all_reduce` gathers them onto every process (4 bytes x all tokens of the
step; 64 completions x 384 tokens = 98 KB), then sorts them once in `as_metrics` (O(N log N)). Because the sort fixes
the order of the values, quantiles and mean |log r| are bit-identical however the tokens were split.

Empty input: `as_metrics` returns `{}` when there is no valid token (a metric is absent, never NaN, never 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch


DEFAULT_BAND = (0.9, 1.1)  # batch-logprob-gap: "what a PPO clip of eps = 0.1 would treat as unchanged"
QUANTILES = {"p1": 0.01, "p50": 0.5, "p99": 0.99}
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _zero() -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64)


def _check_2d_same_shape(**tensors: torch.Tensor) -> None:
    """Raise `ValueError` unless every tensor is 2-D and all have the same (B, T) shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if any(len(s) != 2 for s in shapes.values()) or len(set(shapes.values())) != 1:
        raise ValueError(f"expected (B, T) tensors of one shape, got {shapes}")


def valid_token_mask(
    completion_ids: torch.Tensor, completion_mask: torch.Tensor, eos_token_ids: int | Sequence[int]
) -> torch.Tensor:
    """The one definition of a valid completion token: inside `completion_mask` and at or before the row's first EOS.

    The first EOS itself is valid; everything after it is not, even where `completion_mask` is 1. This makes the mask
    right for tokenizers with pad == eos, whose trailing pads look like EOS tokens (docs/design.md, "Rules of the
    house").

    Args:
        completion_ids (`torch.Tensor` of shape (B, T), integer): completion token ids, right-padded.
        completion_mask (`torch.Tensor` of shape (B, T), bool or 0/1): TRL's completion (x tool) mask.
        eos_token_ids (`int` or sequence of `int`): the EOS id(s); a list for models with several (generation_config).

    Returns:
        `torch.Tensor` of shape (B, T), bool.

    Raises:
        ValueError: shapes differ or are not 2-D, or `eos_token_ids` is empty.
    """
    _check_2d_same_shape(completion_ids=completion_ids, completion_mask=completion_mask)
    eos = torch.as_tensor(eos_token_ids, device=completion_ids.device).reshape(-1)  # (E,)
    if eos.numel() == 0:
        raise ValueError("eos_token_ids must name at least one token id, got an empty sequence")
    is_eos = torch.isin(completion_ids, eos).long()  # (B, T)
    eos_before = is_eos.cumsum(dim=1) - is_eos  # (B, T) number of EOS strictly before each position
    return completion_mask.bool() & (eos_before == 0)  # (B, T)


def _advantages_2d(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Advantages as an fp32 tensor broadcastable to (B, T): (B,) -> (B, 1); (B, 1) and (B, T) are kept."""
    adv = advantages.float()
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)  # (B, 1)
    if adv.dim() != 2 or adv.shape[0] != shape[0] or adv.shape[1] not in (1, shape[1]):
        raise ValueError(
            f"advantages must have shape (B,), (B, 1) or (B, T) with (B, T) = {tuple(shape)}, "
            f"got {tuple(advantages.shape)}"
        )
    return adv


def gather_finite_values(values: torch.Tensor, accelerator) -> torch.Tensor:
    """Every process's finite values (N_p,), concatenated on every process: (sum_p N_p,), fp32.

    Padded to one length with NaN (`accelerator.pad_across_processes`), gathered, and the padding dropped; the values
    must be finite, so NaN cannot be a real value. A collective: every process must call it.
    """
    values = values.to(accelerator.device)  # (N_local,)
    values = accelerator.pad_across_processes(values, dim=0, pad_index=math.nan)  # (N_max,)
    values = accelerator.gather(values)  # (P * N_max,)
    return values[~torch.isnan(values)]  # (N,)


def sorted_quantiles(sorted_log_ratios: torch.Tensor, qs: Sequence[float]) -> list[float]:
    """Quantiles of r = exp(x) from N >= 1 sorted finite log-ratios x (N,).

    Linear interpolation at position q * (N - 1) as in `torch.quantile`, but done on log r and then exponentiated:
    the same order statistics as `torch.quantile(r, q)` (exactly equal when q * (N - 1) is an integer), with geometric
    instead of arithmetic interpolation between two neighbours, so that a huge r cannot produce inf - inf = NaN.
    `torch.quantile` itself is also refused above 2**24 values; this has no such limit.
    """
    n = sorted_log_ratios.numel()
    x = sorted_log_ratios.double()  # (N,)
    pos = torch.tensor(qs, dtype=torch.float64, device=x.device) * (n - 1)  # (Q,)
    lo = pos.floor().long()  # (Q,)
    hi = (lo + 1).clamp(max=n - 1)  # (Q,)
    frac = pos - lo  # (Q,)
    return torch.exp(x[lo] + (x[hi] - x[lo]) * frac).tolist()


@dataclass
class SumStats:
    """Base of the accumulators: the fields named in `_SUMS` are fp64 scalar tensors that add up."""

    _SUMS: ClassVar[tuple[str, ...]] = ()

    def _sums(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self._SUMS]

    def _add(self, parts: Sequence[torch.Tensor]) -> None:
        """Add one scalar per `_SUMS` field, on the device of `parts`: a sum still on the CPU (the 0-d start) is a
        scalar operand of the device's addition, never the target of an in-place one (no copy, no host sync)."""
        for name, part in zip(self._SUMS, parts, strict=True):
            setattr(self, name, part.double() + getattr(self, name))

    def merge(self, other: SumStats) -> SumStats:
        """Add `other`'s sums into this object, in place (e.g. a later micro-batch); returns `self`."""
        if type(other) is not type(self):
            raise ValueError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        device = self._sums()[0].device
        self._add([t.to(device) for t in other._sums()])
        return self

    def _reduced_sums(self, accelerator) -> dict[str, torch.Tensor]:
        """One `accelerator.reduce(..., "sum")` of all sums; every process must call it (a collective)."""
        stacked = torch.stack([t.to(accelerator.device) for t in self._sums()])  # (S,)
        totals = accelerator.reduce(stacked, reduction="sum")  # (S,)
        return dict(zip(self._SUMS, totals.unbind(0), strict=True))

    def all_reduce(self, accelerator) -> SumStats:
        """A new object holding the sums over all processes; `accelerator=None` (one process) returns a copy.

        Every process must call it, also those with no valid token: it is a collective operation.
        """
        if accelerator is None:
            return replace(self)
        return replace(self, **self._reduced_sums(accelerator))


@dataclass
class MeanStats(SumStats):
    """Token-weighted mean of a per-token value over valid tokens (the kept mass M_old, the share of sampled tokens a
    recomputed filter added back), exact across micro-batches and processes.

    Fields (fp64 scalar tensors, on the device of the values once updated): `total` (sum of the values over valid
    tokens), `count` (valid tokens).
    """

    _SUMS: ClassVar[tuple[str, ...]] = ("total", "count")
    total: torch.Tensor = field(default_factory=_zero)
    count: torch.Tensor = field(default_factory=_zero)

    def update(self, values: torch.Tensor, mask: torch.Tensor) -> MeanStats:
        """Add the values (B, T), any dtype (bool counts 1), where `mask` (B, T) is True; returns `self`."""
        _check_2d_same_shape(values=values, mask=mask)
        valid = mask.bool()  # (B, T)
        self._add([torch.where(valid, values.double(), 0.0).sum(), valid.sum()])
        return self

    def mean(self) -> float | None:
        """total / count, or None without a valid token (the metric is then absent)."""
        if self.count.item() == 0:
            return None
        return (self.total / self.count).item()


@dataclass
class RatioStats(SumStats):
    """Token-weighted statistics of an importance ratio r = exp(log_ratio), exact across micro-batches and processes.

    Fields (fp64 scalar tensors unless stated):
        band (`tuple[float, float]`, defaults to `(0.9, 1.1)`): r is out of band when r < band[0] or r > band[1]
            (strict; r and the edges compared in fp32). Config fields `ratio_band_low` / `ratio_band_high`.
        num_tokens: valid tokens seen.
        num_out_of_band: valid tokens out of band, non-finite log-ratios included.
        num_nonfinite: valid tokens whose log-ratio is NaN or +-inf.
        finite_log_ratios (`torch.Tensor` of shape (N,), fp32): every finite valid log-ratio, kept for quantiles and
            mean |log r| (4 bytes per token; see the module docstring for the cost).

    Use: `stats = RatioStats(band); stats.update(log_ratio, mask)` per micro-batch, `stats.all_reduce(accelerator)`
    once per step on every process, then `.as_metrics("ratio/new_old")`.
    """

    _SUMS: ClassVar[tuple[str, ...]] = ("num_tokens", "num_out_of_band", "num_nonfinite")
    band: tuple[float, float] = DEFAULT_BAND
    num_tokens: torch.Tensor = field(default_factory=_zero)
    num_out_of_band: torch.Tensor = field(default_factory=_zero)
    num_nonfinite: torch.Tensor = field(default_factory=_zero)
    finite_log_ratios: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    def __post_init__(self):
        low, high = self.band
        if not 0.0 <= low < high:
            raise ValueError(f"band must satisfy 0 <= low < high (ratio_band_low, ratio_band_high), got {self.band}")

    def update(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> RatioStats:
        """Add one micro-batch in place; returns `self`.

        Args:
            log_ratio (`torch.Tensor` of shape (B, T), any float dtype): log r per token, e.g. logp_new - logp_old.
            mask (`torch.Tensor` of shape (B, T), bool or 0/1): valid tokens (`valid_token_mask`).

        Raises:
            ValueError: shapes differ or are not 2-D.
        """
        _check_2d_same_shape(log_ratio=log_ratio, mask=mask)
        valid = mask.bool()  # (B, T)
        x = log_ratio.float()[valid]  # (n,) valid log-ratios
        r = torch.exp(x)  # (n,)
        in_band = (r >= self.band[0]) & (r <= self.band[1])  # (n,) False for NaN
        finite = torch.isfinite(x)  # (n,)
        self._add([valid.sum(), (~in_band).sum(), (~finite).sum()])  # counted on the device: no host sync
        self.finite_log_ratios = torch.cat([self.finite_log_ratios.to(x.device), x[finite]])  # (N,)
        return self

    def merge(self, other: RatioStats) -> RatioStats:
        """Add `other` (another micro-batch or process) into this object, in place; returns `self`.

        Raises:
            ValueError: `other` is not a `RatioStats` or has a different band.
        """
        if isinstance(other, RatioStats) and other.band != self.band:
            raise ValueError(f"cannot merge RatioStats with band {other.band} into band {self.band}")
        super().merge(other)
        device = self.num_tokens.device
        self.finite_log_ratios = torch.cat([self.finite_log_ratios.to(device), other.finite_log_ratios.to(device)])
        return self

    def all_reduce(self, accelerator) -> RatioStats:
        """A new `RatioStats` over all processes: counts summed with `accelerator.reduce`, values gathered.

        `accelerator` is an `accelerate.Accelerator` (or `None` for one process, which returns a copy). Every process
        must call it. Values are padded to one length with NaN (`pad_across_processes`), gathered, and the padding
        dropped; the stored values are finite, so NaN cannot be a real value.
        """
        if accelerator is None:
            return replace(self)
        values = gather_finite_values(self.finite_log_ratios, accelerator)  # (N,)
        return replace(self, finite_log_ratios=values, **self._reduced_sums(accelerator))

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """Metrics `{prefix}/num_tokens, oob_rate, nonfinite_rate, mean_abs_log_ratio, mean, p1, p50, p99`.

        Returns `{}` without valid tokens. The last four need a finite log-ratio and are absent when every valid
        log-ratio is NaN/inf. Formulas: docs/metrics.md.
        """
        n = self.num_tokens.item()
        if n == 0:
            return {}
        metrics = {
            f"{prefix}/num_tokens": n,
            f"{prefix}/oob_rate": self.num_out_of_band.item() / n,
            f"{prefix}/nonfinite_rate": self.num_nonfinite.item() / n,
        }
        x = torch.sort(self.finite_log_ratios).values  # (N,) sorting fixes the summation order
        if x.numel() == 0:
            return metrics
        metrics[f"{prefix}/mean_abs_log_ratio"] = (x.double().abs().sum() / x.numel()).item()
        metrics[f"{prefix}/mean"] = (x.double().exp().sum() / x.numel()).item()  # mean of r (batch-logprob-gap T11's)
        for key, value in zip(QUANTILES, sorted_quantiles(x, list(QUANTILES.values())), strict=True):
            metrics[f"{prefix}/{key}"] = value
        return metrics


def ppo_clip_active(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """Where TRL's PPO clip makes a token's policy-gradient zero (token-level importance sampling).

    TRL 1.16 `_compute_loss` for `loss_type` in grpo/bnpo/dr_grpo/dapo/luspo (grpo_trainer.py L3112-3120):
    loss = -min(r * A, clamp(r, 1 - epsilon_low, 1 + epsilon_high) * A), with r = exp(logp - old), optionally
    r -> min(r, delta) in the first term. Its gradient w.r.t. logp is zero exactly when
        A > 0 and r > 1 + epsilon_high,   or   A < 0 and r < 1 - epsilon_low,   or   A < 0 and r > delta.
    The comparisons are strict (at r == 1 + epsilon_high the clamp still passes the gradient) and in fp32, as TRL's.
    A == 0 is never reported active: the gradient is zero there anyway, but not because of the clip. A NaN log-ratio
    is never active. These are TRL's `clip_ratio/low_mean` / `high_mean` conditions, plus the `delta` case.

    Args:
        log_ratio (`torch.Tensor` of shape (B, T), any float dtype): logp_new - logp_old.
        advantages (`torch.Tensor` of shape (B,), (B, 1) or (B, T)): TRL's advantages.
        epsilon_low, epsilon_high (`float`): TRL's `epsilon` and `epsilon_high` (defaults 0.2 and = epsilon).
        delta (`float`, *optional*): TRL's `delta` (upper bound of r in the unclipped term), `None` = off. Must be
            > 1 + epsilon_high (TRL's recommendation; below it the zero-gradient set is not the one stated above).

    Returns:
        `torch.Tensor` of shape (B, T), bool.

    Raises:
        ValueError: `log_ratio` is not 2-D, `advantages` has another shape, an epsilon is negative, or
            delta <= 1 + epsilon_high.
    """
    if log_ratio.dim() != 2:
        raise ValueError(f"log_ratio must have shape (B, T), got {tuple(log_ratio.shape)}")
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low and epsilon_high must be >= 0, got {epsilon_low}, {epsilon_high}")
    if delta is not None and delta <= 1 + epsilon_high:
        raise ValueError(f"delta must be > 1 + epsilon_high = {1 + epsilon_high}, got {delta}")
    adv = _advantages_2d(advantages, log_ratio.shape)  # (B, 1) or (B, T)
    r = torch.exp(log_ratio.float())  # (B, T)
    high = (adv > 0) & (r > 1 + epsilon_high)  # (B, T)
    low = (adv < 0) & (r < 1 - epsilon_low)  # (B, T)
    capped = (adv < 0) & (r > delta) if delta is not None else torch.zeros_like(low)  # (B, T)
    return high | low | capped


@dataclass
class FlipStats(SumStats):
    """Token-weighted counts of PPO-clip decisions that differ between two choices of old log-probs.

    Fields (fp64 scalar tensors): `num_tokens` (valid tokens), `num_flips` (valid tokens whose decision differs),
    `sum_abs_adv` (sum of |A| over valid tokens), `sum_abs_adv_flips` (sum of |A| over flipped tokens). The |A| sums are
    fp64 sums of fp32 values: exact across splits whenever they are exactly representable (e.g. dyadic advantages),
    otherwise equal up to fp64 rounding. Build with `clip_flips`; combine with `merge` / `all_reduce`.
    """

    _SUMS: ClassVar[tuple[str, ...]] = ("num_tokens", "num_flips", "sum_abs_adv", "sum_abs_adv_flips")
    num_tokens: torch.Tensor = field(default_factory=_zero)
    num_flips: torch.Tensor = field(default_factory=_zero)
    sum_abs_adv: torch.Tensor = field(default_factory=_zero)
    sum_abs_adv_flips: torch.Tensor = field(default_factory=_zero)

    def as_metrics(self, prefix: str = "ratio") -> dict[str, float]:
        """`{prefix}/clip_flip_rate` = num_flips / num_tokens and `{prefix}/clip_flip_rate_adv_weighted` =
        sum_abs_adv_flips / sum_abs_adv. `{}` without valid tokens; the weighted rate is absent when every valid
        token has A == 0 (no token has a gradient to flip)."""
        n = self.num_tokens.item()
        if n == 0:
            return {}
        metrics = {f"{prefix}/clip_flip_rate": self.num_flips.item() / n}
        if self.sum_abs_adv.item() > 0:
            metrics[f"{prefix}/clip_flip_rate_adv_weighted"] = (self.sum_abs_adv_flips / self.sum_abs_adv).item()
        return metrics


def clip_flips(
    log_ratio_a: torch.Tensor,
    log_ratio_b: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> FlipStats:
    """Count valid tokens whose PPO-clip decision (`ppo_clip_active`) differs between two log-ratios.

    Seed 004, T5: a flip is "clipped under a" != "clipped under b"; here with TRL's real advantages and the trainer's
    epsilons. In RatioGRPOTrainer, at the first inner step: a = logp_new - logp_old(scoring mode) and
    b = logp_new - logp_old(the policy's own pass in training precision, TRL's default). At that step logp_new *is*
    the policy's own pass, so b == 0 (r = 1, never clipped) and a flip is simply a token the scoring mode clips.

    Args:
        log_ratio_a, log_ratio_b (`torch.Tensor` of shape (B, T), any float dtype): the two log-ratios.
        advantages (`torch.Tensor` of shape (B,), (B, 1) or (B, T)): TRL's advantages.
        mask (`torch.Tensor` of shape (B, T), bool or 0/1): valid tokens (`valid_token_mask`).
        epsilon_low, epsilon_high, delta: as in `ppo_clip_active`.

    Returns:
        `FlipStats` of this batch.

    Raises:
        ValueError: shapes differ, or as in `ppo_clip_active`.
    """
    _check_2d_same_shape(log_ratio_a=log_ratio_a, log_ratio_b=log_ratio_b, mask=mask)
    valid = mask.bool()  # (B, T)
    abs_adv = _advantages_2d(advantages, valid.shape).abs().expand(valid.shape)  # (B, T)
    clipped_a = ppo_clip_active(log_ratio_a, advantages, epsilon_low, epsilon_high, delta)  # (B, T)
    clipped_b = ppo_clip_active(log_ratio_b, advantages, epsilon_low, epsilon_high, delta)  # (B, T)
    flip = (clipped_a != clipped_b) & valid  # (B, T)
    stats = FlipStats()
    stats._add([valid.sum(), flip.sum(), abs_adv[valid].double().sum(), abs_adv[flip].double().sum()])
    return stats


def _check_is_mode(mode: str, clip_min: float | None, clip_max: float | None) -> None:
    """Validate TRL's vLLM IS settings as `GRPOConfig.__post_init__` does (grpo_config.py L1152-1171)."""
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not allowed; allowed: {', '.join(IS_MODES)}")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"vllm_importance_sampling_clip_min ({clip_min}) must be < clip_max ({clip_max})")
    if mode.endswith("_truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"mode {mode!r} needs vllm_importance_sampling_clip_min or _clip_max")


def importance_sampling_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, mode: str, clip_min: float | None, clip_max: float | None
) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling weights (grpo_trainer.py L2659-2707), recomputed from a log-ratio.

    d = nan_to_num((old - sampling) * mask, nan=0), summed over tokens in `sequence_*` modes; w = exp(d); `*_truncate`
    clamps w to [clip_min, clip_max], `*_mask` sets w outside it to 0. Used when the sampler log-probs change after
    TRL computed the weights (`truncation_correction="lift_sampler"`).

    Args:
        log_ratio (`torch.Tensor` of shape (B, T)): logp_old - logp_sampler.
        mask (`torch.Tensor` of shape (B, T), bool or 0/1): TRL's completion_mask x tool_mask.
        mode, clip_min, clip_max: TRL's `vllm_importance_sampling_mode` / `_clip_min` / `_clip_max`.

    Returns:
        (B, T) weights in `token_*` modes, (B, 1) in `sequence_*` modes, in log_ratio's dtype.

    Raises:
        ValueError: shapes differ, unknown `mode`, clip_min >= clip_max, or a truncate mode with no bound.
    """
    _check_2d_same_shape(log_ratio=log_ratio, mask=mask)
    _check_is_mode(mode, clip_min, clip_max)
    diff = torch.nan_to_num(log_ratio * mask, nan=0.0)  # (B, T)
    if mode.startswith("sequence_"):
        diff = diff.sum(dim=-1, keepdim=True)  # (B, 1)
    weight = torch.exp(diff)  # (B, T) or (B, 1)
    if mode.endswith("_truncate"):
        return torch.clamp(weight, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return weight.masked_fill((weight < low) | (weight > high), 0.0)
