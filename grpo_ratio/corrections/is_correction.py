"""Importance-sampling (IS) corrections of the sampler/trainer mismatch: pure functions over (B, T) log-probs.

The rollout tokens were drawn from the sampler q (vLLM, or `generate` under its own precision and truncation); the
loss is computed under the trainer's old policy p. The IS weight of token t is r_t = p(g_t) / q(g_t) =
exp(log_ratio_t), log_ratio = logp_old - logp_sampler. TRL 1.16 multiplies its per-token loss by a weight built from
r (`importance_sampling_ratio`, `grpo_trainer.py` L2659-2707 and L3146-3147); this module builds that weight for
every correction the peers offer, so the trainer can hand it to TRL's loss through the same input.

An `ISCorrection` is three independent parts, applied in this order:

1. The weight (`level`): `"token"` w_t = r_t (TIS, IcePop); `"sequence_product"` w_b = prod_t r_t = exp(sum_t
   log_ratio_t) (TRL's `sequence_*` modes, verl `rollout_is: sequence`); `"sequence_geometric"` w_b = exp(mean_t
   log_ratio_t), the geometric mean, which does not shrink or grow with the completion's length (AReaL `agg: mean`,
   GSPO's sequence ratio, arXiv 2507.18071); `"none"` w = 1 (rejection only, verl `rollout_is: null`).
2. The bounds (`action`, `low`, `high`) on that weight: `"truncate"` clamps it into [low, high] (TIS: Yao et al.,
   "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl);
   `"mask"` sets it to 0 outside [low, high] (IcePop: Ling Team, "Every Step Evolves: Scaling Reinforcement Learning
   for Trillion-Scale Thinking Model", arXiv 2510.18855, Sec. IcePop: M(k) = k on [alpha, beta], 0 elsewhere).
3. Rejection (`rejections`, `veto`): tokens or whole sequences whose divergence statistic leaves its bounds get weight
   0 (verl `rollout_rs`, AReaL `rejection_sampling`, NeMo-RL `seq_logprob_error_threshold`; Liu, Li et al., "When
   Speed Kills Stability", https://richardli.xyz/rl-collapse). `veto` rejects every sequence holding a token with
   r_t < veto (verl's former `rollout_token_veto_threshold`, slime `rs_veto_threshold`).

A rejected token keeps counting in TRL's loss normaliser (its weight is 0, its mask is not changed), exactly as in
TRL's own `*_mask` modes; verl and SkyRL remove rejected tokens from the normaliser instead (they edit the response
mask). With TRL's default `loss_type="dapo"` the difference is a rescaling of the step by the kept share.

Rejection statistics, per token, with x_t = log_ratio_t (samples from q, KL(q||p) the divergence estimated):
`ratio` r_t (sequence aggregates in log space: sum -> the product, mean -> the geometric mean, max -> max r_t);
`k1` = -x_t (unbiased for KL(q||p); verl's sign; AReaL's `kl_k1` is +x_t); `k2` = x_t^2 / 2; `k3` = r_t - 1 - x_t
(Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html); `prob_error` = exp(|x_t|) (NeMo-RL
`token_mult_prob_error`); `tv` = |r_t - 1| (open-instruct's D_tv, PR #1681: E_q|p/q - 1| = 2 TV(p, q) over the
vocabulary). Rules are named as verl's: `token_k1`, `seq_sum_k1`, `seq_mean_k3`, `seq_max_k2`, and
written with their bounds, `"seq_mean_k3<=0.01"`, `"0.999<=seq_mean_ratio<=1.002"` (`parse_rejections`).

Divergences of the sampled token's Bernoulli (the token vs the rest of the vocabulary), which need the probabilities
themselves, p = p_old(g_t) and q = q(g_t), not only their ratio (`PROB_METRICS`; `importance_weights` takes the
sampler's log-probs for them), after DPPO (Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning",
arXiv 2602.04879): `binary_tv` = p - q, signed (|p - q| is the Bernoulli TV; verl `dppo_tv` and prime-rl's default
loss threshold p - q from above and below); `binary_kl` = KL(Bern(q) || Bern(p)) = q (log q - log p) + (1 - q)
log((1 - q + 1e-8) / (1 - p + 1e-8)), verl `compute_policy_loss_dppo_kl` with the behaviour policy first;
`binary_kl_max` = max(KL(Bern(p) || Bern(q)), KL(Bern(q) || Bern(p))) with p, q clamped to [1e-8, 1 - 1e-8], AReaL's
KPop (`rejection_sampling.metric="binary_kl"`, `compute_binary_kl_divergence`, PR #1405).

Advantage-conditioned rules (`RejectionRule.directional`, written with the suffix `@adv`: `"-0.2<=token_binary_tv<=
0.2@adv"`) reject only where the unconditioned rule rejects and sign(x) * A > 0: where the trainer's old policy already
leans, relative to the sampler, the way the advantage A pushes it (A > 0 and p > q, or A < 0 and p < q), so the
update would widen the gap (open-instruct PR #1681: "advantage * sign(logprob - vllm_logprob) > 0"; DPPO masks only
the bound on the advantage's side; TRL's `off_policy_mask_threshold`, DeepSeek-V3.2's OPSM, is the directional
`seq_mean_k1<=delta@adv` against the current policy). A token rule uses each token's own x_t and A_t; a sequence rule
the sequence's sum of x_t and its advantage, so it stays one decision per sequence. A = 0 is never rejected (its policy
term is 0 either way).

Conventions shared with TRL: a position outside `mask` or with a NaN log-ratio (no sampler log-prob) has weight
exactly 1 and is never rejected; NaN log-ratios are left out of sequence sums and means (TRL's product treats them as
0, which is the same for a sum). Math in fp32; weights in fp32, shape (B, T), or (B, 1) when every part is
sequence-level (TRL's own shapes, which `loss_type="vespo"` relies on). Presets for the peers' recipes: `PRESETS`.
Metrics of the weights: `grpo_ratio.diagnostics.mismatch`. torch is imported inside the functions that compute on
tensors: the settings (`resolve_correction`, `ISCorrection`, `PRESETS`) are judged without it, by the command line
before its heavy imports too (`grpo_ratio/cli/precheck.py`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..problems import Problems


if TYPE_CHECKING:
    import torch


LEVELS = ("token", "sequence_product", "sequence_geometric", "none")
ACTIONS = ("truncate", "mask")
REJECTION_METRICS = ("ratio", "k1", "k2", "k3", "prob_error", "tv", "binary_tv", "binary_kl", "binary_kl_max")
PROB_METRICS = ("binary_tv", "binary_kl", "binary_kl_max")  # need p and q themselves: the sampler's log-probs
DIRECTIONAL = "@adv"  # a rule's suffix: advantage-conditioned (module docstring)
REJECTION_AGGS = ("sum", "mean", "max")
TRL_MODES = {"token_truncate": ("token", "truncate"), "token_mask": ("token", "mask"),
             "sequence_truncate": ("sequence_product", "truncate"), "sequence_mask": ("sequence_product", "mask")}
# statistics >= 0 (prob_error >= 1): a lower bound would reject on-policy
_NONNEGATIVE = ("k2", "k3", "prob_error", "tv", "binary_kl", "binary_kl_max")
BINARY_KL_EPS = 1e-8  # verl's and AReaL's epsilon in the binary KL


def _check_pair(log_ratio: torch.Tensor, mask: torch.Tensor) -> None:
    if log_ratio.dim() != 2 or tuple(log_ratio.shape) != tuple(mask.shape):
        raise ValueError(f"expected (B, T) log_ratio and mask of one shape, got {tuple(log_ratio.shape)} and "
                         f"{tuple(mask.shape)}")


def _check_bounds(name: str, low: float | None, high: float | None, positive: bool) -> None:
    if low is not None and high is not None and not low < high:
        raise ValueError(f"{name}: low ({low}) must be < high ({high})")
    if positive and any(b is not None and b <= 0 for b in (low, high)):
        raise ValueError(f"{name}: ratio bounds must be > 0, got low={low}, high={high}")


# the config fields an `ISCorrection`'s parts come from (`RatioGRPOConfig`'s `is_correction_*`), named in its errors;
# `ISCorrection.from_trl`'s come from TRL's `vllm_importance_sampling_*`
_FIELD_NAMES = {"level": "is_correction_level", "action": "is_correction_action", "low": "is_correction_low",
                "high": "is_correction_high", "veto": "is_correction_veto"}
_TRL_NAMES = {"level": "vllm_importance_sampling_mode", "action": "vllm_importance_sampling_mode",
              "low": "vllm_importance_sampling_clip_min", "high": "vllm_importance_sampling_clip_max",
              "veto": "veto"}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def correction_problems(level: str | None, action: str | None, low, high, veto,
                        names: dict[str, str] = _FIELD_NAMES) -> list[str]:
    """Every problem of an IS correction's weight, bounds and veto (an empty list: none), each naming its field
    (`names`: the `is_correction_*` fields by default): an unknown level or action (the allowed ones named), a bound
    or veto that is not a number, low >= high, a bound <= 0, bounds with level "none", "truncate" without a bound, a
    veto outside (0, 1). A `None` level or action is not judged (the caller says it is missing)."""
    problems = []
    if level is not None and level not in LEVELS:
        problems.append(f"{names['level']}={level!r} is not allowed; allowed: {', '.join(LEVELS)}")
    if action is not None and action not in ACTIONS:
        problems.append(f"{names['action']}={action!r} is not allowed; allowed: {', '.join(ACTIONS)}")
    numbers = {}
    for part, value in (("low", low), ("high", high), ("veto", veto)):
        if value is not None and not _is_number(value):
            problems.append(f"{names[part]}={value!r} must be a number")
        else:
            numbers[part] = value
    low, high, veto = numbers.get("low"), numbers.get("high"), numbers.get("veto")
    if low is not None and high is not None and not low < high:
        problems.append(f"{names['low']} ({low}) must be < {names['high']} ({high})")
    if any(b is not None and b <= 0 for b in (low, high)):
        problems.append(f"{names['low']} / {names['high']}: the weight's bounds are ratios and must be > 0, got "
                        f"low={low}, high={high}")
    bounded = low is not None or high is not None
    if level == "none" and bounded:
        problems.append(f"{names['level']}='none' has weight 1 everywhere: bounds ({names['low']}/{names['high']}) "
                        f"have nothing to act on")
    if level not in (None, "none") and action == "truncate" and "low" in numbers and "high" in numbers and not bounded:
        problems.append(f"action 'truncate' ({names['action']}) needs a bound ({names['low']} and/or "
                        f"{names['high']}); without one use action 'mask' (the raw, unbounded weights)")
    if veto is not None and not 0 < veto < 1:
        problems.append(f"{names['veto']} must be in (0, 1), got {veto}")
    return problems


@dataclass(frozen=True)
class RejectionRule:
    """Reject (weight 0) tokens, or whole sequences, whose divergence statistic leaves [low, high].

    Attributes:
        metric (`str`): one of `REJECTION_METRICS` (module docstring). Bounds are in the metric's own units: ratio
            bounds are ratios (> 0), k1 bounds are nats (signed), k2 / k3 / prob_error take only `high`.
        level (`str`): `"token"` (each token judged alone) or `"sequence"` (the aggregate decides for every token).
        agg (`str`): sequence aggregate, one of `REJECTION_AGGS`; `None` at token level.
        low, high (`float`, *optional*): kept when low <= statistic <= high (a `None` bound is no bound).
        directional (`bool`): advantage-conditioned (module docstring): reject only where sign(x) * A > 0.

    Raises:
        ValueError: an unknown metric/level/agg, no bound, low >= high, a non-positive ratio bound, or a lower bound
            on a non-negative metric.
    """

    metric: str
    level: str = "token"
    agg: str | None = None
    low: float | None = None
    high: float | None = None
    directional: bool = False

    def __post_init__(self):
        if self.metric not in REJECTION_METRICS:
            raise ValueError(f"rejection metric {self.metric!r} is not allowed; allowed: {', '.join(REJECTION_METRICS)}")
        if self.level not in ("token", "sequence"):
            raise ValueError(f"rejection level {self.level!r} is not allowed; allowed: token, sequence")
        if (self.level == "sequence") != (self.agg is not None) or (self.agg and self.agg not in REJECTION_AGGS):
            raise ValueError(f"rejection agg {self.agg!r}: a sequence rule needs one of {', '.join(REJECTION_AGGS)}, "
                             f"a token rule none")
        if self.low is None and self.high is None:
            raise ValueError(f"rejection rule {self.name} needs a bound (low and/or high)")
        if self.metric in _NONNEGATIVE and self.low is not None:
            raise ValueError(f"rejection rule {self.name}: {self.metric} is >= {int(self.metric == 'prob_error')}; "
                             f"give only an upper bound")
        _check_bounds(f"rejection rule {self.name}", self.low, self.high, positive=self.metric == "ratio")

    @property
    def name(self) -> str:
        """verl-style name: `token_k3`, `seq_mean_k1`, `seq_max_ratio`."""
        return f"token_{self.metric}" if self.level == "token" else f"seq_{self.agg}_{self.metric}"

    def __str__(self) -> str:
        low = "" if self.low is None else f"{self.low:g}<="
        high = "" if self.high is None else f"<={self.high:g}"
        return f"{low}{self.name}{high}{DIRECTIONAL if self.directional else ''}"


_RULE = re.compile(r"^\s*(?:(?P<low>[-+.0-9][^<>=\s]*)\s*<=\s*)?(?P<name>[a-z0-9_]+)\s*(?:<=\s*(?P<high>[^<>=\s]+))?\s*$")
_NAME = re.compile(r"^(?:token_(?P<tmetric>[a-z0-9_]+)|seq_(?P<agg>sum|mean|max)_(?P<smetric>[a-z0-9_]+))$")


def parse_rejection(text: str) -> RejectionRule:
    """One rule from `"[LOW<=]NAME[<=HIGH][@adv]"`, NAME = `token_METRIC` or `seq_{sum,mean,max}_METRIC`; the suffix
    `@adv` makes it advantage-conditioned (`RejectionRule.directional`).

    Examples: `"seq_mean_k3<=0.01"` (verl `decoupled_k3_rs`), `"0.999<=seq_mean_ratio<=1.002"` (NeMo-RL
    `seq-mask-tis`), `"-0.1<=token_k1<=0.1"`, `"-0.2<=token_binary_tv<=0.2@adv"` (prime-rl's DPPO mask).

    Raises:
        ValueError: the text does not have that form, or the rule is invalid (`RejectionRule`).
    """
    stripped = text.strip()
    directional = stripped.endswith(DIRECTIONAL)
    match = _RULE.match(stripped[: -len(DIRECTIONAL)] if directional else stripped)
    name = _NAME.match(match["name"]) if match else None
    if name is None:
        raise ValueError(f"rejection rule {text!r}: expected [LOW<=]NAME[<=HIGH][@adv] with NAME token_METRIC or "
                         f"seq_{{sum,mean,max}}_METRIC, METRIC one of {', '.join(REJECTION_METRICS)}")
    try:
        low, high = (None if match[k] is None else float(match[k]) for k in ("low", "high"))
    except ValueError:
        raise ValueError(f"rejection rule {text!r}: a bound is not a number") from None
    if name["tmetric"]:
        return RejectionRule(name["tmetric"], "token", None, low, high, directional)
    return RejectionRule(name["smetric"], "sequence", name["agg"], low, high, directional)


def parse_rejections(text: str | None) -> tuple[RejectionRule, ...]:
    """Comma-separated rules (`parse_rejection`); `None` or `""` gives none."""
    return tuple(parse_rejection(part) for part in (text or "").split(",") if part.strip())


@dataclass(frozen=True)
class ISCorrection:
    """An importance-sampling correction: the weight, its bounds, and rejection (module docstring).

    Attributes:
        level (`str`): one of `LEVELS`.
        action (`str`): `"truncate"` or `"mask"`, what happens to a weight outside [low, high].
        low, high (`float`, *optional*): bounds of the weight (ratios, > 0); `None` = no bound. Refused with
            `level="none"`.
        rejections (`tuple[RejectionRule, ...]`): every rule must pass for a token to keep its weight.
        veto (`float`, *optional*): reject a sequence holding a token with r_t < veto (0 < veto < 1).

    Raises:
        Problems (a `ValueError`): every problem of `correction_problems` at once (a value outside the allowed ones,
            low >= high, a bound <= 0, bounds with `level="none"`, `"truncate"` without a bound, a veto outside
            (0, 1)), each naming its `is_correction_*` field.
    """

    level: str = "token"
    action: str = "truncate"
    low: float | None = None
    high: float | None = None
    rejections: tuple[RejectionRule, ...] = field(default_factory=tuple)
    veto: float | None = None

    def __post_init__(self):
        problems = correction_problems(self.level, self.action, self.low, self.high, self.veto)
        if problems:
            raise Problems(problems)
        object.__setattr__(self, "rejections", tuple(self.rejections))

    @classmethod
    def from_trl(cls, mode: str, clip_min: float | None, clip_max: float | None) -> ISCorrection:
        """TRL 1.16's `vllm_importance_sampling_mode` / `_clip_min` / `_clip_max` as an `ISCorrection`.

        Raises:
            ValueError: an unknown mode (the allowed ones named), or bounds TRL's config refuses.
        """
        if mode not in TRL_MODES:
            raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not allowed; allowed: {', '.join(TRL_MODES)}")
        level, action = TRL_MODES[mode]
        problems = correction_problems(level, action, clip_min, clip_max, None, _TRL_NAMES)
        if problems:
            raise Problems(problems)
        return cls(level, action, clip_min, clip_max)

    @property
    def needs_sampler_logps(self) -> bool:
        """A rule thresholds a Bernoulli divergence (`PROB_METRICS`): `importance_weights` needs `sampler_logps`."""
        return any(r.metric in PROB_METRICS for r in self.rejections)

    @property
    def needs_advantages(self) -> bool:
        """A rule is advantage-conditioned: `importance_weights` needs `advantages`."""
        return any(r.directional for r in self.rejections)

    @property
    def sequence_level(self) -> bool:
        """Every part decides per sequence: the weights have shape (B, 1), as TRL's `sequence_*` modes."""
        return self.level != "token" and all(r.level == "sequence" for r in self.rejections)

    def __str__(self) -> str:
        parts = [self.level if self.level == "none" else f"{self.level} {self.action} [{self.low}, {self.high}]"]
        parts += [str(r) for r in self.rejections] + ([f"veto {self.veto:g}"] if self.veto is not None else [])
        return ", ".join(parts)


@dataclass
class ISWeights:
    """What `importance_weights` computed for one batch.

    Attributes:
        weights (`torch.Tensor`, fp32): the weights for TRL's loss, (B, T), or (B, 1) when the correction is
            sequence-level (`ISCorrection.sequence_level`); 1 outside the mask.
        log_raw (`torch.Tensor`, fp32): log of the weight before bounds and rejection: (B, T) for `"token"`, (B, 1)
            for the sequence levels, `None` for `"none"`.
        raw_mask (`torch.Tensor`, bool): where `log_raw` holds a real value: (B, T) valid tokens with a log-ratio, or
            (B, 1) sequences with at least one.
        truncated, masked, rejected (`torch.Tensor` of shape (B, T), bool): valid tokens whose weight the bounds
            clamped, the bounds set to 0, or a rejection rule / the veto set to 0 (a token can be both masked and
            rejected).
        mask (`torch.Tensor` of shape (B, T), bool): the valid tokens with a log-ratio (NaN log-ratios excluded).
    """

    weights: torch.Tensor
    log_raw: torch.Tensor | None
    raw_mask: torch.Tensor | None
    truncated: torch.Tensor
    masked: torch.Tensor
    rejected: torch.Tensor
    mask: torch.Tensor


def clean_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, has): x = the fp32 log-ratio with 0 outside `mask` or where it is NaN, +-inf -> +-max float (TRL's
    `nan_to_num`); has = valid tokens with a log-ratio. Both (B, T).

    Raises:
        ValueError: shapes differ or are not 2-D.
    """
    import torch  # here, not at the top (module docstring)

    _check_pair(log_ratio, mask)
    has = mask.bool() & ~torch.isnan(log_ratio)  # (B, T)
    x = torch.nan_to_num(torch.where(has, log_ratio.float(), 0.0), nan=0.0)  # (B, T)
    return x, has


def sequence_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor, geometric: bool) -> torch.Tensor:
    """log of the sequence IS weight, (B, 1) fp32: sum_t x_t (the product of token ratios, TRL's `sequence_*`) or
    its mean over the sequence's tokens with a log-ratio (the geometric mean; 0 for a sequence with none).

    Arguments: `log_ratio` (B, T) logp_old - logp_sampler, any float dtype; `mask` (B, T) bool or 0/1 valid tokens.
    """
    x, has = clean_log_ratio(log_ratio, mask)
    total = x.sum(dim=-1, keepdim=True)  # (B, 1)
    if not geometric:
        return total
    return total / has.sum(dim=-1, keepdim=True).clamp(min=1)  # (B, 1)


def apply_bounds(weights: torch.Tensor, low: float | None, high: float | None, action: str):
    """(bounded weights, affected): `"truncate"` clamps into [low, high], `"mask"` sets weights outside it to 0;
    affected = weights strictly outside (what `clamp` changes, what the mask zeroes). Any shape; `None` = no bound."""
    import torch  # here, not at the top (module docstring)

    lo = -math.inf if low is None else low
    hi = math.inf if high is None else high
    affected = (weights < lo) | (weights > hi)
    if action == "truncate":
        return torch.clamp(weights, min=low, max=high), affected
    return weights.masked_fill(affected, 0.0), affected


def binary_tv(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """p - q of the sampled token, signed (its absolute value is the TV distance of the two Bernoullis), any shape,
    from log-probs. verl `compute_policy_loss_dppo_tv` and prime-rl's default loss threshold it from both sides."""
    import torch  # here, not at the top (module docstring)

    return torch.exp(log_q) * torch.expm1(log_p - log_q)  # p - q without cancellation near p = q


def binary_kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(Bern(q) || Bern(p)) = q (log q - log p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8)), any shape, from
    log-probs: verl `compute_policy_loss_dppo_kl`'s `binary_kl` with q the anchor (its old policy; here the sampler)."""
    import torch  # here, not at the top (module docstring)

    p, q = torch.exp(log_p), torch.exp(log_q)
    return q * (log_q - log_p) + (1 - q) * torch.log((1.0 - q + BINARY_KL_EPS) / (1.0 - p + BINARY_KL_EPS))


def binary_kl_max(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """max(KL(Bern(p) || Bern(q)), KL(Bern(q) || Bern(p))), p and q clamped to [1e-8, 1 - 1e-8], any shape: AReaL's
    KPop metric (`rejection_sampling.metric="binary_kl"`, `compute_binary_kl_divergence` taken both ways)."""
    import torch  # here, not at the top (module docstring)

    p = torch.clamp(torch.exp(log_p), BINARY_KL_EPS, 1.0 - BINARY_KL_EPS)
    q = torch.clamp(torch.exp(log_q), BINARY_KL_EPS, 1.0 - BINARY_KL_EPS)

    def kl(a, b):
        return a * torch.log(a / b) + (1 - a) * torch.log((1 - a) / (1 - b))

    return torch.maximum(kl(p, q), kl(q, p))


def token_statistic(x: torch.Tensor, metric: str, log_q: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token rejection statistic (module docstring) from a cleaned log-ratio x (B, T); `ratio` stays in log space
    (x itself): its aggregates are taken on logs and compared with log bounds. `PROB_METRICS` also need the sampler's
    cleaned log-probs `log_q` (B, T) (p = exp(log_q + x)).

    Raises:
        ValueError: an unknown metric, or a metric of `PROB_METRICS` without `log_q`.
    """
    import torch  # here, not at the top (module docstring)

    if metric in ("ratio", "k1"):
        return x if metric == "ratio" else -x
    if metric == "k2":
        return 0.5 * x.square()
    if metric == "k3":
        return torch.expm1(x) - x  # r - 1 - log r, without cancellation near r = 1
    if metric == "prob_error":
        return torch.exp(x.abs())
    if metric == "tv":
        return torch.expm1(x).abs()  # |r - 1|
    if metric in PROB_METRICS:
        if log_q is None:
            raise ValueError(f"rejection metric {metric!r} needs the sampler's log-probs (sampler_logps), not only "
                             f"the log-ratio")
        return {"binary_tv": binary_tv, "binary_kl": binary_kl, "binary_kl_max": binary_kl_max}[metric](log_q + x, log_q)
    raise ValueError(f"rejection metric {metric!r} is not allowed; allowed: {', '.join(REJECTION_METRICS)}")


def _clean_sampler(sampler_logps: torch.Tensor | None, has: torch.Tensor) -> torch.Tensor | None:
    """The sampler's log-probs in fp32 with 0 (q = 1, x = 0: no divergence) where no valid log-ratio is."""
    import torch  # here, not at the top (module docstring)

    if sampler_logps is None:
        return None
    if tuple(sampler_logps.shape) != tuple(has.shape):
        raise ValueError(f"sampler_logps {tuple(sampler_logps.shape)} must have the log-ratio's shape {tuple(has.shape)}")
    return torch.nan_to_num(torch.where(has, sampler_logps.float(), 0.0), nan=0.0, neginf=-1e4)


def _advantages_like(advantages: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Advantages (B,), (B, 1) or (B, T) as fp32 (B, T)."""
    B, T = shape
    a = advantages.float()
    a = a.unsqueeze(1) if a.dim() == 1 else a
    if a.dim() != 2 or a.size(0) != B or a.size(1) not in (1, T):
        raise ValueError(f"advantages {tuple(advantages.shape)} must be (B,), (B, 1) or (B, T) with B={B}, T={T}")
    return a.expand(B, T)


def rejected_by(log_ratio: torch.Tensor, mask: torch.Tensor, rule: RejectionRule,
                sampler_logps: torch.Tensor | None = None, advantages: torch.Tensor | None = None) -> torch.Tensor:
    """Valid tokens a rule rejects, (B, T) bool. Sequence rules aggregate over the tokens with a log-ratio; a
    sequence with none is never rejected.

    Args:
        log_ratio (`torch.Tensor` of shape (B, T)): logp_old - logp_sampler (NaN: no sampler log-prob).
        mask (`torch.Tensor` of shape (B, T), bool or 0/1): valid tokens.
        rule (`RejectionRule`): what to test.
        sampler_logps (`torch.Tensor` of shape (B, T), *optional*): the sampler's log-probs, for `PROB_METRICS`.
        advantages (`torch.Tensor` of shape (B,), (B, 1) or (B, T), *optional*): for a directional rule.

    Raises:
        ValueError: shapes differ or are not 2-D; a `PROB_METRICS` rule without `sampler_logps`, a directional rule
            without `advantages`.
    """
    import torch  # here, not at the top (module docstring)

    x, has = clean_log_ratio(log_ratio, mask)
    stat = token_statistic(x, rule.metric, _clean_sampler(sampler_logps, has))  # (B, T)
    if rule.level == "sequence":
        if rule.agg == "max":
            stat = stat.masked_fill(~has, -math.inf).amax(dim=-1, keepdim=True)  # (B, 1)
        else:
            stat = torch.where(has, stat, 0.0).sum(dim=-1, keepdim=True)  # (B, 1)
            stat = stat / has.sum(dim=-1, keepdim=True).clamp(min=1) if rule.agg == "mean" else stat
    low, high = rule.low, rule.high
    if rule.metric == "ratio":  # compared in log space: exp is monotone, and a huge aggregate does not overflow
        low, high = (None if b is None else math.log(b) for b in (low, high))
    out = torch.isnan(stat)  # (B, T) or (B, 1); inf - inf in a sum: no evidence that the sequence is fine
    if low is not None:
        out |= stat < low
    if high is not None:
        out |= stat > high
    if rule.directional:
        if advantages is None:
            raise ValueError(f"rejection rule {rule} is advantage-conditioned: it needs the advantages")
        a = _advantages_like(advantages, tuple(x.shape))  # (B, T)
        if rule.level == "sequence":  # one decision per sequence: its summed log-ratio and its advantage
            direction, a = x.sum(dim=-1, keepdim=True), a[:, :1]  # (B, 1), (B, 1): A is per sequence
        else:
            direction = x  # (B, T)
        out = out & (torch.sign(direction) * torch.sign(a) > 0)
    return out.expand_as(has) & has  # (B, T)


def vetoed(log_ratio: torch.Tensor, mask: torch.Tensor, veto: float) -> torch.Tensor:
    """Valid tokens of sequences holding a token with r_t < veto, (B, T) bool (verl's token veto, slime
    `rs_veto_threshold`)."""
    x, has = clean_log_ratio(log_ratio, mask)
    catastrophic = (x < math.log(veto)) & has  # (B, T)
    return catastrophic.any(dim=-1, keepdim=True) & has  # (B, T)


def importance_weights(log_ratio: torch.Tensor, mask: torch.Tensor, correction: ISCorrection,
                       sampler_logps: torch.Tensor | None = None,
                       advantages: torch.Tensor | None = None) -> ISWeights:
    """The IS weights of `correction` for one batch, with what the bounds and the rejection did.

    Args:
        log_ratio (`torch.Tensor` of shape (B, T), any float dtype): logp_old - logp_sampler; NaN where the sampler
            gave no log-prob (TRL pads them so).
        mask (`torch.Tensor` of shape (B, T), bool or 0/1): valid tokens (TRL: completion_mask x tool_mask).
        correction (`ISCorrection`): what to compute.
        sampler_logps (`torch.Tensor` of shape (B, T), *optional*): logp_sampler itself, needed when a rule
            thresholds a Bernoulli divergence (`ISCorrection.needs_sampler_logps`).
        advantages (`torch.Tensor` of shape (B,), (B, 1) or (B, T), *optional*): needed by advantage-conditioned
            rules (`ISCorrection.needs_advantages`).

    Returns:
        `ISWeights`. For TRL's four modes (`ISCorrection.from_trl`) the weights equal TRL 1.16's
        `importance_sampling_ratio` (tested against `grpo_ratio.diagnostics.ratios.importance_sampling_weights`).

    Raises:
        ValueError: shapes differ or are not 2-D; `sampler_logps` or `advantages` missing where a rule needs them.
    """
    import torch  # here, not at the top (module docstring)

    x, has = clean_log_ratio(log_ratio, mask)
    B, T = x.shape
    if correction.level == "token":
        log_raw, raw_mask = x, has  # (B, T)
    elif correction.level == "none":
        log_raw, raw_mask = None, None
    else:
        log_raw = sequence_log_weights(log_ratio, mask, geometric=correction.level == "sequence_geometric")  # (B, 1)
        raw_mask = has.any(dim=-1, keepdim=True)  # (B, 1)
    if log_raw is None:
        weights, affected = torch.ones(B, 1, device=x.device), torch.zeros(B, 1, dtype=torch.bool, device=x.device)
    else:
        weights, affected = apply_bounds(torch.exp(log_raw), correction.low, correction.high, correction.action)
        weights = torch.where(raw_mask, weights, 1.0)  # (B, T) or (B, 1): neutral where nothing was measured
        affected = affected & raw_mask
    rejected = torch.zeros_like(has)  # (B, T)
    for rule in correction.rejections:
        rejected |= rejected_by(log_ratio, mask, rule, sampler_logps, advantages)
    if correction.veto is not None:
        rejected |= vetoed(log_ratio, mask, correction.veto)
    if not correction.sequence_level:
        weights = weights.expand(B, T).clone()  # (B, T)
        weights[rejected] = 0.0
    else:  # every rule is per sequence: a sequence is rejected as a whole, the weight stays (B, 1)
        weights = weights.masked_fill(rejected.any(dim=-1, keepdim=True), 0.0)  # (B, 1)
    affected_tokens = affected.expand(B, T) & has  # (B, T)
    truncate = correction.action == "truncate"
    return ISWeights(weights=weights, log_raw=log_raw, raw_mask=raw_mask,
                     truncated=affected_tokens if truncate else torch.zeros_like(has),
                     masked=torch.zeros_like(has) if truncate else affected_tokens, rejected=rejected, mask=has)


@dataclass(frozen=True)
class Preset:
    """A named peer recipe: the `correction` and where it comes from (`source`)."""

    correction: ISCorrection
    source: str


PRESETS: dict[str, Preset] = {
    "trl_sequence_mask": Preset(
        ISCorrection("sequence_product", "mask", None, 3.0),
        "TRL 1.16 default: vllm_importance_sampling_mode='sequence_mask', clip_max 3.0 (grpo_config.py)"),
    "tis": Preset(
        ISCorrection("token", "truncate", None, 2.0),
        "token TIS, cap 2: Yao et al., https://fengyao.notion.site/off-policy-rl; verl decoupled_token_is(2.0); "
        "slime --use-tis --tis-clip 2.0; SkyRL tis_ratio_type=token, token_tis_ratio_clip_high 2.0; Oat tis_c=2.0"),
    "icepop": Preset(
        ISCorrection("token", "mask", 0.5, 5.0),
        "IcePop, arXiv 2510.18855 (Ring-1T), bounds 0.5 and 5 as verl decoupled_token_icepop(5.0, 0.5), NeMo-RL "
        "truncated_importance_sampling_type=icepop and OpenRLHF is_correction_type=icepop (threshold 0.5 5.0)"),
    "seq_mask_tis": Preset(
        ISCorrection("token", "mask", None, None, parse_rejections("0.999<=seq_mean_ratio<=1.002")),
        "NeMo-RL / OpenRLHF seq-mask-tis: raw token weights, sequences whose geometric-mean ratio leaves "
        "[0.999, 1.002] dropped (NeMo-RL loss_functions.py reference bounds)"),
    "geo_rs": Preset(
        ISCorrection("none", rejections=(RejectionRule("k1", "sequence", "mean", math.log(0.999), math.log(1.001)),)),
        "verl decoupled_geo_rs(): rollout_rs=seq_mean_k1, rollout_rs_threshold='0.999_1.001', no IS weight"),
    "geometric_mask": Preset(
        ISCorrection("none", rejections=parse_rejections("0.99<=seq_mean_ratio<=1.01")),
        "SkyRL sequence_mask_metric=geometric with geo_mask_low/high 0.99/1.01 (its examples' default)"),
    "geometric_truncate": Preset(
        ISCorrection("sequence_geometric", "truncate", None, 5.0),
        "AReaL rejection_sampling level=sequence, metric=ratio, agg=mean, action=clamp, upper 5.0 (its default)"),
    "k3_rs": Preset(
        ISCorrection("none", rejections=parse_rejections("seq_mean_k3<=0.01")),
        "verl decoupled_k3_rs(): rollout_rs=seq_mean_k3, threshold 0.01, no IS weight"),
    "k3_rs_token_tis": Preset(
        ISCorrection("token", "truncate", None, 2.0, parse_rejections("seq_mean_k3<=0.01")),
        "verl decoupled_k3_rs_token_tis(): token IS cap 2.0 plus rollout_rs=seq_mean_k3, threshold 0.01"),
    "seq_logprob_error": Preset(
        ISCorrection("none", rejections=parse_rejections("seq_mean_prob_error<=1.5")),
        "NeMo-RL grpo.seq_logprob_error_threshold=1.5 (its docstring's example; the default is off): sequences "
        "whose mean exp(abs(log r)) exceeds 1.5 are masked"),
    "kpop": Preset(
        ISCorrection("token", "mask", None, None, parse_rejections("token_binary_kl_max<=2.0")),
        "AReaL KPop (PR #1405): rejection_sampling level=token, action=mask, metric=binary_kl (the Bernoulli KL "
        "both ways, the larger), upper 2.0 (its docs), on the raw token weight (AReaL's behave_imp_weight)"),
    "dppo_tv_mask": Preset(
        ISCorrection("token", "mask", None, None, parse_rejections("-0.2<=token_binary_tv<=0.2@adv")),
        "prime-rl's default loss (default_loss_fn; DPPO-Binary-TV, arXiv 2602.04879): raw token ratio, tokens "
        "with p - q > 0.2 and A > 0 or p - q < -0.2 and A < 0 dropped (dppo_mask_high / dppo_mask_low 0.2)"),
    "dppo_kl_mask": Preset(
        ISCorrection("token", "mask", None, None, parse_rejections("token_binary_kl<=0.05@adv")),
        "verl dppo_kl against the rollout (bypass mode; core_algos.py compute_policy_loss_dppo_kl, DPPO-Binary-KL "
        "arXiv 2602.04879): raw token ratio, tokens with KL(Bern(q)||Bern(p)) > 0.05 dropped where p > q and A > 0 "
        "or p < q and A < 0 (examples/dppo_trainer: clip_ratio 0.05 for dppo_kl, clip_ratio_c 10000)"),
}


def preset(name: str) -> ISCorrection:
    """The `ISCorrection` of a named preset.

    Raises:
        ValueError: an unknown name (the allowed ones named).
    """
    if name not in PRESETS:
        raise ValueError(f"IS correction preset {name!r} is not allowed; allowed: {', '.join(PRESETS)}")
    return PRESETS[name].correction


CUSTOM_FIELDS = ("is_correction_level", "is_correction_action", "is_correction_low", "is_correction_high",
                 "is_correction_rejection", "is_correction_veto")


def resolve_correction(name: str | None, level: str | None = None, action: str | None = None,
                       low: float | None = None, high: float | None = None, rejection: str | None = None,
                       veto: float | None = None) -> ISCorrection | None:
    """The `ISCorrection` of `RatioGRPOConfig`'s `is_correction` and `is_correction_*` fields.

    `name=None` (no correction of ours: TRL's behaviour) and a preset name take none of the other fields;
    `"custom"` takes `level` (required), `action` (required unless level is `"none"`), `low`, `high`, `rejection`
    (`parse_rejections`) and `veto`.

    Raises:
        Problems (a `ValueError`): every problem at once, each naming its field: an unknown name (the presets and
            "custom" named), a field set that the name does not use, a missing level or action, an invalid weight,
            bound or veto (`correction_problems`), an invalid rejection rule (`parse_rejection`).
    """
    given = [f for f, v in zip(CUSTOM_FIELDS, (level, action, low, high, rejection, veto)) if v is not None]
    if name != "custom":
        problems = []
        if name is not None and name not in PRESETS:
            problems.append(f"is_correction={name!r} is not allowed; allowed: {', '.join(PRESETS)}, custom (or unset)")
        if given:
            problems.append(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with "
                            f"is_correction='custom', but is_correction={name!r}")
        if problems:
            raise Problems(problems)
        return None if name is None else PRESETS[name].correction
    problems = []
    if level is None:
        problems.append(f"is_correction='custom' needs is_correction_level, one of {', '.join(LEVELS)}")
    if action is None and level != "none":
        problems.append(f"is_correction='custom'{'' if level is None else f' with is_correction_level={level!r}'} "
                        f"needs is_correction_action, one of {', '.join(ACTIONS)} ('truncate' also needs "
                        f"is_correction_low and/or is_correction_high)")
    problems += correction_problems(level, action, low, high, veto)
    rules = []
    if rejection is not None and not isinstance(rejection, str):
        problems.append(f"is_correction_rejection={rejection!r} must be a string of comma-separated rules, e.g. "
                        f"'seq_mean_k3<=0.01'")
    else:
        for part in (p for p in (rejection or "").split(",") if p.strip()):
            try:
                rules.append(parse_rejection(part))
            except ValueError as err:
                problems.append(f"is_correction_rejection: {err}")
    if problems:
        raise Problems(problems)
    return ISCorrection(level, action or "mask", low, high, tuple(rules), veto)


def presets_table() -> str:
    """Markdown table of `PRESETS` (docs/corrections.md renders it: `python -m grpo_ratio.corrections.is_correction`)."""
    lines = ["| preset | weight | bounds | rejection | source |", "| --- | --- | --- | --- | --- |"]
    for name, entry in PRESETS.items():
        c = entry.correction
        if c.level == "none" or (c.low is None and c.high is None):
            bounds = "-" if c.level == "none" else "none (raw weights)"
        else:
            bounds = f"{c.action} [{'' if c.low is None else c.low}, {'' if c.high is None else c.high}]"
        rules = ", ".join(f"`{r}`" for r in c.rejections) + (f", veto {c.veto:g}" if c.veto is not None else "")
        lines.append(f"| `{name}` | {c.level} | {bounds} | {rules or '-'} | {entry.source} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(presets_table())
