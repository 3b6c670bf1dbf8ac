"""The gap by completion position, and each sequence's log-ratio sum split into bias and noise (`ratio_by_position`).

Two questions no peer answers per step (ISEEKYAN/Megatron-LM PR #76: verl's `ppo_kl` 0.22 at ~460 tokens, 1.2-1.4 at
~3,400, identical weights; tunix PR #2129, work in progress: "iid token noise, whose per-sequence spread falls as
1/sqrt(T), vs a systematic within-sequence bias, which does not shrink at any length"):

1. How the distance grows with position. Completion positions t = 1, 2, ... (1-based) fall into power-of-two buckets:
   bucket P (P = 1, 2, 4, 8, ...) holds positions P .. 2P - 1. Per bucket and ratio family (`new_old`, `old_sampler`,
   x_t = log p - log q as in `ratio/<family>/*`): the valid tokens, mean |x_t| and the k3 estimate mean(e^x - 1 - x).
   Keys `ratio/by_position/<P>/<family>/{num_tokens,mean_abs_log_ratio,kl_k3}`.
2. Bias or noise. For each sequence b with n_b >= 2 valid tokens: m_b = mean_t x_t (the per-token bias), s_b^2 =
   sum_t (x_t - m_b)^2 / (n_b - 1) (the within-sequence spread, unbiased), and the split of the squared sum
   S_b^2 = (sum_t x_t)^2 = B_b + N_b with N_b = n_b s_b^2 (what iid per-token noise of that spread gives: it grows as
   n_b) and B_b = S_b^2 - N_b (what a per-token bias gives: it grows as n_b^2). Keys
   `ratio/by_position/seq/<family>/{num_seqs,bias,abs_bias,noise,noise_of_mean,bias_share}`: the mean over sequences
   of m_b, |m_b|, s_b and s_b / sqrt(n_b) (the |m_b| that noise alone would give), and sum_b B_b / sum_b S_b^2: about
   0 for zero-mean iid token noise (E[B_b] = n_b^2 mu^2 = 0), 1 for a constant per-token bias; it can dip below 0 by
   chance on a small batch.

Log-ratios are clamped to +-20 (as `mismatch.MismatchStats`), NaN ones (no sampler log-prob) are left out. The sums of
one optimizer update live in one (2, 3K + 7) fp64 tensor on the loss's device: no host read per micro-batch, one
all-reduce and one read at log time (K = the number of buckets of `max_completion_length`).
"""

from __future__ import annotations

import torch

from .metric_keys import BY_POSITION_FAMILIES as FAMILIES
from .metric_keys import by_position_key, by_position_seq_key


_SEQ_SUMS = ("seqs", "sum_m", "sum_abs_m", "sum_s", "sum_s_over_sqrt_n", "sum_b", "sum_s2")  # 7 per family
_CLAMP = 20.0


def num_buckets(max_len: int) -> int:
    """Buckets 1, 2, 4, ... that cover completion positions 1 .. max_len (>= 1)."""
    return max(int(max_len), 1).bit_length()


def bucket_labels(max_len: int) -> list[int]:
    """The buckets' first positions: [1, 2, 4, ..., 2^(K-1)]."""
    return [1 << k for k in range(num_buckets(max_len))]


def position_buckets(T: int, K: int, device=None) -> torch.Tensor:
    """(T,) int64 bucket of each 0-based completion index t: floor(log2(t + 1)), capped at K - 1 (exact integers)."""
    positions = torch.arange(1, T + 1, device=device)  # 1-based
    boundaries = torch.tensor([1 << k for k in range(1, K)], device=device)  # 2, 4, ..., 2^(K-1)
    return torch.bucketize(positions, boundaries, right=True).clamp(max=K - 1)


class PositionStats:
    """The sums of one optimizer update (module docstring).

    Args:
        max_len: the longest completion (`max_completion_length`); later positions fall into the last bucket.
    """

    def __init__(self, max_len: int):
        self.K = num_buckets(max_len)
        self.labels = bucket_labels(max_len)
        self.width = 3 * self.K + len(_SEQ_SUMS)
        self.sums: torch.Tensor | None = None  # (2, 3K + 7) fp64 on the first update's device

    def update(self, family: str, log_ratio: torch.Tensor, mask: torch.Tensor) -> None:
        """Add one micro-batch of one family.

        Args:
            family: one of `FAMILIES`.
            log_ratio (`torch.Tensor` of shape (B, T)): x = log p - log q (NaN: not measured).
            mask (`torch.Tensor` of shape (B, T), bool or 0/1): valid tokens.

        Raises:
            ValueError: an unknown family, or shapes that differ or are not 2-D.
        """
        if family not in FAMILIES:
            raise ValueError(f"by-position family {family!r} is not allowed; allowed: {', '.join(FAMILIES)}")
        if log_ratio.dim() != 2 or tuple(log_ratio.shape) != tuple(mask.shape):
            raise ValueError(f"expected (B, T) log_ratio and mask of one shape, got {tuple(log_ratio.shape)} and "
                             f"{tuple(mask.shape)}")
        B, T = log_ratio.shape
        has = mask.bool() & ~torch.isnan(log_ratio)  # (B, T)
        x = torch.where(has, log_ratio.double().clamp(-_CLAMP, _CLAMP), 0.0)  # (B, T)
        k3 = torch.where(has, torch.expm1(x) - x, 0.0)  # (B, T)
        bucket = position_buckets(T, self.K, x.device)  # (T,)
        per_position = torch.stack([has.double().sum(0), x.abs().sum(0), k3.sum(0)], dim=1)  # (T, 3)
        buckets = torch.zeros(self.K, 3, dtype=torch.float64, device=x.device).index_add_(0, bucket, per_position)
        n = has.sum(-1).double()  # (B,)
        seqs = n >= 2  # (B,)
        n_safe = n.clamp(min=2)
        total = x.sum(-1)  # (B,) S_b
        m = total / n_safe  # (B,)
        ss = torch.where(has, (x - m[:, None]).square(), 0.0).sum(-1)  # (B,) sum of squared deviations
        s2 = ss / (n_safe - 1)  # (B,) unbiased within-sequence variance
        s = s2.sqrt()
        noise_sq = n_safe * s2  # (B,) N_b
        seq = torch.stack([seqs.double(), m, m.abs(), s, s / n_safe.sqrt(), total.square() - noise_sq,
                           total.square()], dim=1)  # (B, 7)
        seq = torch.where(seqs[:, None], seq, 0.0).sum(0)  # (7,)
        part = torch.zeros(len(FAMILIES), self.width, dtype=torch.float64, device=x.device)
        part[FAMILIES.index(family)] = torch.cat([buckets.flatten(), seq])
        self.sums = part if self.sums is None else self.sums.to(part.device) + part

    def flush(self, accelerator=None) -> dict[str, float]:
        """This update's metrics (`ratio/by_position/*`, `metric_keys.by_position_key`), summed over processes when `accelerator` is
        given (every process must call it), then reset. Buckets without a token and families without a sequence of 2
        tokens are absent; `{}` when nothing was added on any process."""
        sums = self.sums
        if accelerator is not None and accelerator.num_processes > 1:
            sums = torch.zeros(len(FAMILIES), self.width, dtype=torch.float64, device=accelerator.device) \
                if sums is None else sums.to(accelerator.device)
            sums = accelerator.reduce(sums, reduction="sum")
        self.sums = None
        if sums is None:
            return {}
        metrics = {}
        for family, row in zip(FAMILIES, sums.tolist(), strict=True):  # the one host read of the update
            for k, label in enumerate(self.labels):
                tokens, abs_sum, k3_sum = row[3 * k: 3 * k + 3]
                if tokens > 0:
                    metrics |= {by_position_key(label, family, "num_tokens"): tokens,
                                by_position_key(label, family, "mean_abs_log_ratio"): abs_sum / tokens,
                                by_position_key(label, family, "kl_k3"): k3_sum / tokens}
            seq = dict(zip(_SEQ_SUMS, row[3 * self.K:], strict=True))
            if seq["seqs"] > 0:
                c = seq["seqs"]
                metrics |= {by_position_seq_key(family, "num_seqs"): c,
                            by_position_seq_key(family, "bias"): seq["sum_m"] / c,
                            by_position_seq_key(family, "abs_bias"): seq["sum_abs_m"] / c,
                            by_position_seq_key(family, "noise"): seq["sum_s"] / c,
                            by_position_seq_key(family, "noise_of_mean"): seq["sum_s_over_sqrt_n"] / c,
                            by_position_seq_key(family, "bias_share"): seq["sum_b"] / seq["sum_s2"]
                            if seq["sum_s2"] > 0 else 0.0}
        return metrics
