"""DPPO's trust region on the divergence, as a per-token mask of the policy loss: pure functions over (B, T) tensors.

DPPO (Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879) replaces PPO's clip of
the ratio r = pi(y) / mu(y) by a mask on a divergence between the two Bernoullis of the sampled token (y vs the rest of
the vocabulary): a token stops receiving gradient once the current policy pi has moved further than delta from the
anchor mu in the direction its advantage pushes. verl's implementation (`verl/trainer/ppo/core_algos.py`,
`compute_policy_loss_dppo_tv` / `compute_policy_loss_dppo_kl`, PR #5397), with p = pi(y), p_old = mu(y):

    dppo_tv:  valid = where(A > 0, p - p_old <= delta_high, p - p_old >= -delta_low)
    dppo_kl:  kl = p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))
              valid = where(A > 0, (kl <= delta_high) | (p <= p_old), (kl <= delta_low) | (p >= p_old))
    loss_t = -A_t * sg(min(r_t, C)) * log p_t * valid_t          (C = clip_ratio_c; verl's examples use 10000)

prime-rl's default loss uses the same binary-TV mask against the sampler (`dppo_mask_low` / `dppo_mask_high`, 0.2).
TRL 1.16's `loss_type="cispo"` term is -sg(min(r, epsilon_high)) * A * log p, verl's DPPO term without the mask, so
`trust_region` with `loss_type="cispo"` is verl's DPPO loss with C = epsilon_high; with TRL's clipped losses the mask
applies on top of TRL's clip. The mask reaches TRL's loss as a per-token factor (`grpo_ratio.trainer`), so no TRL method
is copied. Where an `is_correction` weight (or TRL's vLLM one) is applied too, the two multiply.

The anchor mu is the batch's old log-probs (TRL's `old_per_token_logps`: the scoring mode's pass, or the sampler's
log-probs under `old_logprob_mode="sampler"`, which is verl's bypass mode and prime-rl's setting).
"""

from __future__ import annotations

import torch


TRUST_REGIONS = ("dppo_tv", "dppo_kl")
# the divergence bound of each, both sides, from verl's examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh
DEFAULT_DELTAS = {"dppo_tv": 0.15, "dppo_kl": 0.05}
_EPS = 1e-8  # verl's, in the binary KL


def trust_region_mask(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, kind: str,
                      low: float | None = None, high: float | None = None) -> torch.Tensor:
    """DPPO's valid-token mask (module docstring), detached.

    Args:
        logps (`torch.Tensor` of shape (B, T)): the current policy's log-probs of the sampled tokens (p).
        old_logps (`torch.Tensor` of shape (B, T)): the anchor's (p_old); NaN (no log-prob) keeps the token.
        advantages (`torch.Tensor` of shape (B,), (B, 1) or (B, T)): A; A <= 0 takes the lower branch, as verl.
        kind (`str`): one of `TRUST_REGIONS`.
        low, high (`float`, *optional*): delta_low / delta_high (> 0); None: `DEFAULT_DELTAS[kind]`.

    Returns:
        (B, T) fp32, 1.0 where the token keeps its gradient, 0.0 where the trust region masks it.

    Raises:
        ValueError: an unknown kind (the allowed ones named), a non-positive bound, or shapes that do not match.
    """
    if kind not in TRUST_REGIONS:
        raise ValueError(f"trust_region={kind!r} is not allowed; allowed: {', '.join(TRUST_REGIONS)}")
    if tuple(logps.shape) != tuple(old_logps.shape) or logps.dim() != 2:
        raise ValueError(f"expected (B, T) logps and old_logps of one shape, got {tuple(logps.shape)} and "
                         f"{tuple(old_logps.shape)}")
    low = DEFAULT_DELTAS[kind] if low is None else low
    high = DEFAULT_DELTAS[kind] if high is None else high
    if not (low > 0 and high > 0):
        raise ValueError(f"trust_region bounds must be > 0, got low={low}, high={high}")
    B, T = logps.shape
    a = advantages.detach().float()
    a = (a.unsqueeze(1) if a.dim() == 1 else a).expand(B, T)  # (B, T)
    log_p = logps.detach().float()  # (B, T)
    known = ~torch.isnan(old_logps)
    log_old = torch.where(known, old_logps.detach().float(), log_p)  # (B, T): no anchor, no move
    p, p_old = torch.exp(log_p), torch.exp(log_old)
    if kind == "dppo_tv":
        diff = p - p_old
        valid = torch.where(a > 0, diff <= high, diff >= -low)
    else:
        kl = p_old * (log_old - log_p) + (1 - p_old) * torch.log((1.0 - p_old + _EPS) / (1.0 - p + _EPS))
        valid = torch.where(a > 0, (kl <= high) | (p <= p_old), (kl <= low) | (p >= p_old))
    return valid.float()  # (B, T)
