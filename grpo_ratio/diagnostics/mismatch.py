"""Mismatch metrics in the units other RL trainers log, as accumulators that add up across micro-batches and processes.

Three accumulators, each a `grpo_ratio.diagnostics.ratios.SumStats` (fp64 sums, `merge` in place, `all_reduce` with one
`accelerator.reduce(..., "sum")`), so `RatioDiagnostics` reduces them like the rest of `ratio/*`:

- `MismatchStats`: for a pair (p, q) with log_ratio x = logp_p - logp_q on tokens sampled from q (p = old, q =
  sampler; or p = new, q = old): the KL(q||p) estimates k1 = -x, k2 = x^2 / 2 and k3 = e^x - 1 - x (Schulman,
  http://joschu.net/blog/kl-approx.html; verl `rollout_corr/kl`, `k3_kl`; prime-rl `mismatch_kl` is k3), the
  outlier-robust k3 with each token's k3 clamped to [-10, 10] (miles PR #1067 `train_rollout_kl`, which is slime's
  and miles' `compute_approx_kl(kl_loss_type="low_var_kl")`: `torch.clamp(k3, min=-10, max=10)` per token), verl's
  log-PPL difference and PPL ratio, chi-square at token and sequence level (verl `chi2_token`, `chi2_seq`).
- `ISWeightStats`: of one IS correction (`grpo_ratio.corrections.is_correction`): the effective sample size of the weights the
  loss uses (verl `rollout_is_eff_sample_size`), the quantiles of the raw weights before truncation (trl#5231), and
  the shares truncated, masked and rejected, per token and per sequence.
- `FullVocabStats`: the exact full-vocabulary KL (both directions) and total variation from a pass that holds both
  distributions (`full_vocab_divergence`, chunked over tokens so memory stays bounded).

Weighting. Token metrics are pooled over valid tokens (sum over every micro-batch and process / number of valid
tokens), as every `ratio/*` rate. Three metrics are per-sequence quantities and are averaged over sequences (sequences
with at least one valid token), because that is their definition in verl, whose units they are for: the log-PPL
difference, the PPL ratio and chi2_seq. (The token-weighted log-PPL difference would be k1 itself.)

Overflow. Each log-ratio, and each sequence sum of them, is clamped to +-20 before it is exponentiated or averaged
(verl's `SAFETY_BOUND`; e^20 = 4.9e8), so one overflowing token cannot make a metric inf; such tokens are counted by
`ratio/*/nonfinite_rate` or show as a p99 near e^20. NaN log-ratios (no sampler log-prob) are left out. With no valid
token, `as_metrics` returns `{}`: absent, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from ..corrections.is_correction import ISWeights
from ..corrections.kept_logprobs import HeadLogits
from .ratios import QUANTILES, SumStats, gather_finite_values, sorted_quantiles


SAFETY_LOG = 20.0  # verl rollout_corr_helper.SAFETY_BOUND
K3_CLAMP = 10.0  # miles/slime `low_var_kl`: each token's k3 clamped to [-10, 10] (miles PR #1067)


def _zero() -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64)


def _valid(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, has): fp64 log-ratio clamped to +-SAFETY_LOG, 0 outside; has = valid tokens with a log-ratio. (B, T)."""
    if log_ratio.dim() != 2 or tuple(log_ratio.shape) != tuple(mask.shape):
        raise ValueError(f"expected (B, T) log_ratio and mask of one shape, got {tuple(log_ratio.shape)} and "
                         f"{tuple(mask.shape)}")
    has = mask.bool() & ~torch.isnan(log_ratio)  # (B, T)
    x = torch.where(has, log_ratio.double().clamp(-SAFETY_LOG, SAFETY_LOG), 0.0)  # (B, T)
    return x, has


@dataclass
class MismatchStats(SumStats):
    """KL estimates, PPL and chi-square of one pair of log-probs (module docstring), exact across splits.

    Use: `stats = MismatchStats(); stats.update(logp_p - logp_q, mask)` per micro-batch, `stats.all_reduce(acc)` once
    per step on every process, then `.as_metrics("ratio/old_sampler")`. Fields are fp64 scalar tensors.
    """

    _SUMS: ClassVar[tuple[str, ...]] = ("num_tokens", "sum_k1", "sum_k2", "sum_k3", "sum_r2", "num_seqs",
                                        "sum_log_ppl_diff", "sum_abs_log_ppl_diff", "sum_ppl_ratio", "sum_seq_r2",
                                        "sum_k3_clamped")
    num_tokens: torch.Tensor = field(default_factory=_zero)
    sum_k1: torch.Tensor = field(default_factory=_zero)
    sum_k2: torch.Tensor = field(default_factory=_zero)
    sum_k3: torch.Tensor = field(default_factory=_zero)
    sum_r2: torch.Tensor = field(default_factory=_zero)
    num_seqs: torch.Tensor = field(default_factory=_zero)
    sum_log_ppl_diff: torch.Tensor = field(default_factory=_zero)
    sum_abs_log_ppl_diff: torch.Tensor = field(default_factory=_zero)
    sum_ppl_ratio: torch.Tensor = field(default_factory=_zero)
    sum_seq_r2: torch.Tensor = field(default_factory=_zero)
    sum_k3_clamped: torch.Tensor = field(default_factory=_zero)

    def update(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> MismatchStats:
        """Add one micro-batch in place; returns `self`.

        Args:
            log_ratio (`torch.Tensor` of shape (B, T), any float dtype): logp_p - logp_q, tokens sampled from q.
            mask (`torch.Tensor` of shape (B, T), bool or 0/1): valid tokens (`ratios.valid_token_mask`).

        Raises:
            ValueError: shapes differ or are not 2-D.
        """
        x, has = _valid(log_ratio, mask)
        n_b = has.sum(dim=-1)  # (B,) tokens per sequence
        seqs = n_b > 0  # (B,)
        k3 = torch.where(has, torch.expm1(x) - x, 0.0)  # (B, T) r - 1 - log r
        r2 = torch.where(has, torch.exp(2 * x), 0.0)  # (B, T)
        log_ppl_diff = (-x.sum(dim=-1) / n_b.clamp(min=1))[seqs]  # (S,) log PPL_p - log PPL_q per sequence
        seq_sum = x.sum(dim=-1).clamp(-SAFETY_LOG, SAFETY_LOG)[seqs]  # (S,) log prod_t r_t
        self._add([has.sum(), -x.sum(), 0.5 * x.square().sum(), k3.sum(), r2.sum(), seqs.sum(), log_ppl_diff.sum(),
                   log_ppl_diff.abs().sum(), torch.exp(log_ppl_diff).sum(), torch.exp(2 * seq_sum).sum(),
                   k3.clamp(-K3_CLAMP, K3_CLAMP).sum()])
        return self

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """`{prefix}/kl_k1, kl_k2, kl_k3, kl_k3_clamped, chi2_token` (token means), `{prefix}/log_ppl_diff, log_ppl_abs_diff,
        ppl_ratio, chi2_seq` (sequence means); `{}` without valid tokens. Formulas: docs/metrics.md."""
        n, s = self.num_tokens.item(), self.num_seqs.item()
        if n == 0:
            return {}
        return {
            f"{prefix}/kl_k1": (self.sum_k1 / n).item(),
            f"{prefix}/kl_k2": (self.sum_k2 / n).item(),
            f"{prefix}/kl_k3": (self.sum_k3 / n).item(),
            f"{prefix}/kl_k3_clamped": (self.sum_k3_clamped / n).item(),
            f"{prefix}/chi2_token": (self.sum_r2 / n).item() - 1.0,
            f"{prefix}/log_ppl_diff": (self.sum_log_ppl_diff / s).item(),
            f"{prefix}/log_ppl_abs_diff": (self.sum_abs_log_ppl_diff / s).item(),
            f"{prefix}/ppl_ratio": (self.sum_ppl_ratio / s).item(),
            f"{prefix}/chi2_seq": (self.sum_seq_r2 / s).item() - 1.0,
        }


@dataclass
class ISWeightStats(SumStats):
    """Statistics of one IS correction's weights (`is_correction.ISWeights`), exact across splits.

    Fields (fp64 scalar tensors unless stated): token and sequence counts (`num_tokens`, `num_seqs`: valid tokens with
    a log-ratio, sequences with one), how many of them were truncated / masked by the bounds or rejected (a sequence
    counts when any of its tokens does), `sum_w` and `sum_w2` of the applied weights over valid tokens (sequence
    weights count once per token, as in the loss), `zero_tokens` (valid tokens whose applied weight is exactly 0,
    by the bounds, a rejection rule or the veto: they train nothing), and `raw_log_weights` (`torch.Tensor` (N,), fp32): every finite
    raw log-weight, one per token (`level="token"`) or per sequence, for the quantiles (gathered in `all_reduce`).
    `action` (`"truncate"`, `"mask"` or `None` for `level="none"`) and `rejects` (`bool`) say which shares exist.
    """

    _SUMS: ClassVar[tuple[str, ...]] = ("num_tokens", "num_seqs", "truncated_tokens", "truncated_seqs",
                                        "masked_tokens", "masked_seqs", "rejected_tokens", "rejected_seqs", "sum_w",
                                        "sum_w2", "zero_tokens")
    action: str | None = None
    rejects: bool = False
    num_tokens: torch.Tensor = field(default_factory=_zero)
    num_seqs: torch.Tensor = field(default_factory=_zero)
    truncated_tokens: torch.Tensor = field(default_factory=_zero)
    truncated_seqs: torch.Tensor = field(default_factory=_zero)
    masked_tokens: torch.Tensor = field(default_factory=_zero)
    masked_seqs: torch.Tensor = field(default_factory=_zero)
    rejected_tokens: torch.Tensor = field(default_factory=_zero)
    rejected_seqs: torch.Tensor = field(default_factory=_zero)
    sum_w: torch.Tensor = field(default_factory=_zero)
    sum_w2: torch.Tensor = field(default_factory=_zero)
    zero_tokens: torch.Tensor = field(default_factory=_zero)
    raw_log_weights: torch.Tensor = field(default_factory=lambda: torch.zeros(0))

    @classmethod
    def of(cls, correction) -> ISWeightStats:
        """An empty accumulator for an `is_correction.ISCorrection`."""
        action = None if correction.level == "none" else correction.action
        return cls(action=action, rejects=bool(correction.rejections) or correction.veto is not None)

    def update(self, result: ISWeights) -> ISWeightStats:
        """Add one micro-batch's `ISWeights` in place; returns `self`."""
        has = result.mask  # (B, T)
        w = result.weights.expand(has.shape)[has].double()  # (n,) applied weights of the valid tokens
        parts = [has.sum(), has.any(dim=-1).sum()]
        for flags in (result.truncated, result.masked, result.rejected):
            parts += [flags.sum(), flags.any(dim=-1).sum()]
        self._add(parts + [w.sum(), w.square().sum(), (w == 0).sum()])
        if result.log_raw is not None:
            raw = result.log_raw[result.raw_mask].float()  # (n_units,)
            self.raw_log_weights = torch.cat([self.raw_log_weights.to(raw.device), raw[torch.isfinite(raw)]])
        return self

    def merge(self, other: ISWeightStats) -> ISWeightStats:
        """Add `other` in place; returns `self`. Raises `ValueError` for another correction's stats."""
        if isinstance(other, ISWeightStats) and (other.action, other.rejects) != (self.action, self.rejects):
            raise ValueError("cannot merge ISWeightStats of different IS corrections")
        super().merge(other)
        device = self.num_tokens.device
        self.raw_log_weights = torch.cat([self.raw_log_weights.to(device), other.raw_log_weights.to(device)])
        return self

    def all_reduce(self, accelerator) -> ISWeightStats:
        """Sums over all processes (`accelerator.reduce`), raw weights gathered; `None` (one process) copies."""
        if accelerator is None:
            return replace(self)
        values = gather_finite_values(self.raw_log_weights, accelerator)  # (N,)
        return replace(self, raw_log_weights=values, **self._reduced_sums(accelerator))

    def as_metrics(self, prefix: str = "ratio") -> dict[str, float]:
        """`{prefix}/is_weight_ess` = (sum w)^2 / (N sum w^2) in [0, 1] (0 when every weight is 0),
        `{prefix}/is_weight_mean` = sum w / N, `{prefix}/is_zero_weight_token_frac` = #{w = 0} / N (tokens that
        train nothing), `{prefix}/is_weight_raw/{p1,p50,p99}` (before bounds and rejection),
        `{prefix}/is_{truncated|masked}_{token,seq}_frac` (the word follows `action`) and
        `{prefix}/is_rejected_{token,seq}_frac` (with rejection rules or a veto). `{}` without valid tokens."""
        n, s = self.num_tokens.item(), self.num_seqs.item()
        if n == 0:
            return {}
        w2 = self.sum_w2.item()
        metrics = {f"{prefix}/is_weight_ess": (self.sum_w.square() / (n * self.sum_w2)).item() if w2 > 0 else 0.0,
                   f"{prefix}/is_weight_mean": (self.sum_w / n).item(),
                   f"{prefix}/is_zero_weight_token_frac": (self.zero_tokens / n).item()}
        x = torch.sort(self.raw_log_weights).values  # (N,)
        if x.numel():
            for key, value in zip(QUANTILES, sorted_quantiles(x, list(QUANTILES.values())), strict=True):
                metrics[f"{prefix}/is_weight_raw/{key}"] = value
        kinds = ([self.action] if self.action else []) + (["rejected"] if self.rejects else [])
        for kind in kinds:
            word = {"truncate": "truncated", "mask": "masked"}.get(kind, kind)
            metrics[f"{prefix}/is_{word}_token_frac"] = (getattr(self, f"{word}_tokens") / n).item()
            metrics[f"{prefix}/is_{word}_seq_frac"] = (getattr(self, f"{word}_seqs") / s).item()
        return metrics


def _log_probs(x: torch.Tensor, are_logprobs: bool, temperature: float) -> torch.Tensor:
    return x.double() if are_logprobs else torch.log_softmax(x.double() / temperature, dim=-1)


def _token_rows(x: torch.Tensor | HeadLogits, rows: slice) -> torch.Tensor:
    """(n, V) rows `rows` of the flattened (B*T, V) tokens: a view of a tensor, or computed for these rows only."""
    if isinstance(x, HeadLogits):
        return x.cells(torch.arange(rows.start, rows.stop, device=x.device))  # (n, V)
    return x.reshape(-1, x.shape[-1])[rows]  # (n, V)


def full_vocab_divergence(
    p: torch.Tensor | HeadLogits, q: torch.Tensor | HeadLogits, *, are_logprobs: bool = False,
    temperature: float = 1.0, chunk_tokens: int = 128
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact per-token KL(q||p), KL(p||q) and total variation between two full next-token distributions.

    KL(q||p) = sum_v q_v (log q_v - log p_v) is the quantity the sampled-token estimates k1/k3 estimate when the
    tokens are drawn from q; TV = 1/2 sum_v |q_v - p_v|. Terms with q_v = 0 (p_v = 0) add 0 to KL(q||p) (KL(p||q));
    p_v = 0 where q_v > 0 gives inf. The math is fp64: a precision mismatch puts the KL near 1e-7 nats, where fp32
    log-softmax rounding (about 1e-7 of |log q|, summed over V) moves the result by tens of percent (tested). The B*T
    rows are done `chunk_tokens` at a time, so the extra memory is a few (chunk_tokens, V) fp64 tensors whatever B
    and T are (chunk_tokens=128, V=151,936: 156 MB each); given as `HeadLogits` (the scoring pass's, from hidden
    states through the LM head) neither distribution exists whole: each is projected for those rows only.

    Args:
        p, q (`torch.Tensor` of shape (B, T, V), any float dtype, or `HeadLogits` (B, T, V)): logits (or log-probs
            with `are_logprobs=True`) of the target (trainer, new) and behaviour (sampler, old) distributions, on
            the same tokens.
        are_logprobs (`bool`): the inputs are already normalised log-probs (e.g. top-k masked with -inf).
        temperature (`float`): logits are divided by it before the softmax (TRL's `temperature`); ignored for
            log-probs.
        chunk_tokens (`int`): rows per chunk.

    Returns:
        (kl_qp, kl_pq, tv), each (B, T) fp32 (rounded from fp64 at the end).

    Raises:
        ValueError: shapes differ or are not 3-D, temperature <= 0 or chunk_tokens < 1.
    """
    if p.dim() != 3 or tuple(p.shape) != tuple(q.shape):
        raise ValueError(f"expected (B, T, V) p and q of one shape, got {tuple(p.shape)} and {tuple(q.shape)}")
    if temperature <= 0 or chunk_tokens < 1:
        raise ValueError(f"temperature must be > 0 and chunk_tokens >= 1, got {temperature}, {chunk_tokens}")
    B, T, V = p.shape
    out = torch.empty(3, B * T, dtype=torch.float64, device=p.device)  # (3, N)
    for start in range(0, B * T, chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, B * T))
        lp = _log_probs(_token_rows(p, rows), are_logprobs, temperature)  # (n, V) fp64
        lq = _log_probs(_token_rows(q, rows), are_logprobs, temperature)  # (n, V) fp64
        prob_p, prob_q = lp.exp(), lq.exp()  # (n, V)
        out[0, rows] = torch.where(prob_q > 0, prob_q * (lq - lp), 0.0).sum(dim=-1)  # KL(q||p)
        out[1, rows] = torch.where(prob_p > 0, prob_p * (lp - lq), 0.0).sum(dim=-1)  # KL(p||q)
        out[2, rows] = 0.5 * (prob_q - prob_p).abs().sum(dim=-1)
    kl_qp, kl_pq, tv = out.float().reshape(3, B, T).unbind(0)
    return kl_qp, kl_pq, tv


@dataclass
class FullVocabStats(SumStats):
    """Token means of the exact divergences of `full_vocab_divergence` over valid tokens, exact across splits.

    Fields (fp64 scalar tensors): `num_tokens`, `sum_kl` (KL(q||p)), `sum_reverse_kl` (KL(p||q)), `sum_tv`.
    """

    _SUMS: ClassVar[tuple[str, ...]] = ("num_tokens", "sum_kl", "sum_reverse_kl", "sum_tv")
    num_tokens: torch.Tensor = field(default_factory=_zero)
    sum_kl: torch.Tensor = field(default_factory=_zero)
    sum_reverse_kl: torch.Tensor = field(default_factory=_zero)
    sum_tv: torch.Tensor = field(default_factory=_zero)

    def update(self, kl: torch.Tensor, reverse_kl: torch.Tensor, tv: torch.Tensor, mask: torch.Tensor):
        """Add one micro-batch's (B, T) divergences at its (B, T) valid tokens; returns `self`."""
        valid = mask.bool()  # (B, T)
        self._add([valid.sum(), kl.double()[valid].sum(), reverse_kl.double()[valid].sum(),
                   tv.double()[valid].sum()])
        return self

    def as_metrics(self, prefix: str) -> dict[str, float]:
        """`{prefix}/full_kl` (KL(q||p)), `{prefix}/full_reverse_kl`, `{prefix}/full_tv`; `{}` without tokens."""
        n = self.num_tokens.item()
        if n == 0:
            return {}
        return {f"{prefix}/full_kl": (self.sum_kl / n).item(), f"{prefix}/full_reverse_kl":
                (self.sum_reverse_kl / n).item(), f"{prefix}/full_tv": (self.sum_tv / n).item()}
