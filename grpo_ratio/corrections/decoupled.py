"""Decoupled PPO for asynchronous RL, on the packed loss terms of TRL's `AsyncGRPOTrainer`: pure functions on tensors.

Three policies meet in an asynchronous step (AReaL, arXiv 2505.24298, "decoupled PPO"): the behaviour policy that
sampled the tokens (vLLM, `k` weight syncs old: the sample's staleness), the proximal policy the trust region is
centred on (the trainer's weights before this optimizer step), and the current policy being optimised. TRL's trainer
folds behaviour and proximal into one: its ratio is exp(logp_theta - logp_behaviour), clipped. The decoupled loss is

    loss_t = -w_t * min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t),
    r_t = exp(logp_theta - logp_prox),   w_t = IS(exp(logp_prox - logp_behaviour))   (detached, >= 0),

with `IS` one of grpo_ratio's `is_correction` presets (`grpo_ratio.corrections.is_correction`). Because w >= 0 is a
per-term constant, TRL's own loss computes it exactly when handed `old_log_probs = logp_prox` and
`advantages = w * A` (`-min(r w A, clip(r) w A) = -w min(r A, clip(r) A)`): the trainer never re-implements the loss.

`loglinear_proximal` is A-3PO's approximation (arXiv 2512.06547, AReaL PR #600 `prox_logp_method="loglinear"`): the
proximal log-probs interpolated between behaviour and current by version, with no proximal forward.
"""

from __future__ import annotations

import torch

from .is_correction import ISCorrection, ISWeights, importance_weights


OBJECTIVES = ("coupled", "decoupled", "decoupled_loglinear")


def loglinear_alpha(staleness: torch.Tensor) -> torch.Tensor:
    """The interpolation weight of `loglinear_proximal` for each term.

    AReaL's arithmetic (`compute_prox_logp_approximations`): alpha = (v_prox - v_behav) / (v_theta - v_behav), with
    TRL's versions: the proximal policy is the trainer's weights before this step (version v, TRL's `model_version`),
    the current policy the one this step produces (v + 1), the behaviour policy version v - k (k = staleness). So
    alpha = k / (k + 1): 0 for a fresh sample (proximal = behaviour: the coupled ratio), 1/2 at k = 1, 2/3 at k = 2.

    Args:
        staleness (`torch.Tensor` of shape (M,), int): k >= 0 per term.
    Returns:
        (M,) fp32 in [0, 1).
    Raises:
        ValueError: a negative staleness (an untagged term) on CPU. On an accelerator no host read per micro-batch:
            such a term gets alpha 0 (its proximal log-prob is the behaviour's: the coupled ratio) and the caller
            refuses it where it reads the host anyway (`RatioAsyncGRPOTrainer` counts the terms on the device and
            raises at log time); a device-side assertion here would leave the CUDA context unusable.
    """
    k = staleness.float()
    if k.device.type == "cpu":  # a host check costs nothing here
        if bool((k < 0).any()):
            raise ValueError("loglinear_alpha: a term has no staleness (negative k); every consumed sample must carry "
                             "its version")
    else:
        k = k.clamp(min=0.0)
    return k / (k + 1.0)


def loglinear_proximal(behaviour: torch.Tensor, current: torch.Tensor, staleness: torch.Tensor) -> torch.Tensor:
    """A-3PO's proximal log-probs: log pi_prox = log pi_behav + alpha * (log pi_theta - log pi_behav), no forward.

    Args:
        behaviour (`torch.Tensor` of shape (M,)): the sampler's log-probs of the trained tokens (nats).
        current (`torch.Tensor` of shape (M,)): the training forward's log-probs of the same tokens (detached here).
        staleness (`torch.Tensor` of shape (M,), int): k per term (`loglinear_alpha`).
    Returns:
        (M,) fp32 proximal log-probs, without gradient.
    """
    alpha = loglinear_alpha(staleness)  # (M,)
    b = behaviour.float()
    return (b + alpha * (current.detach().float() - b)).detach()


def terms_to_rows(values: torch.Tensor, segment_id: torch.Tensor, num_segments: int, width: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay a packed row's loss terms out as (S, L) rows, one per sample, for the sequence-level IS corrections.

    TRL's `TreeRow.pack` emits each sample's terms contiguously, in sample order (`segment_id` non-decreasing).

    Args:
        values (`torch.Tensor` of shape (M,)): one value per term.
        segment_id (`torch.Tensor` of shape (M,), int64): the sample of each term (0 .. S - 1).
        num_segments: S. width: L >= the most terms of one sample.
    Returns:
        rows (S, L) in `values`' dtype (0 where empty), mask (S, L) bool, and each term's column (M,) int64.
    """
    counts = torch.bincount(segment_id, minlength=num_segments)  # (S,)
    starts = torch.cumsum(counts, 0) - counts  # (S,)
    column = torch.arange(segment_id.numel(), device=segment_id.device) - starts[segment_id]  # (M,)
    rows = values.new_zeros(num_segments, width)
    mask = torch.zeros(num_segments, width, dtype=torch.bool, device=values.device)
    rows[segment_id, column] = values
    mask[segment_id, column] = True
    return rows, mask, column


def proximal_weights(prox: torch.Tensor, behaviour: torch.Tensor, segment_id: torch.Tensor,
                     correction: ISCorrection | None,
                     advantages: torch.Tensor | None = None) -> tuple[torch.Tensor, ISWeights | None]:
    """The behaviour -> proximal IS weight of every term of one packed row.

    Args:
        prox, behaviour (`torch.Tensor` of shape (M,)): proximal and behaviour log-probs (nats).
        segment_id (`torch.Tensor` of shape (M,), int64): the sample of each term (sequence-level levels aggregate
            over it).
        correction: the `ISCorrection` (`is_correction`); None: the raw token weight exp(prox - behaviour),
            unbounded (decoupled PPO as AReaL writes it without a cap).
        advantages (`torch.Tensor` of shape (M,), *optional*): each term's advantage, for advantage-conditioned
            rejection rules (`ISCorrection.needs_advantages`).
    Returns:
        (M,) fp32 weights >= 0 (detached) and the `ISWeights` of the (S, L) layout (None without a correction).
    """
    log_ratio = (prox.float() - behaviour.float()).detach()  # (M,)
    if correction is None:
        return torch.exp(log_ratio), None
    if segment_id.numel() == 0:
        return log_ratio.new_ones(0), None
    # the (S, L) layout needs S and L on the host: one read per micro-batch (TRL's loss reads S the same way)
    num_segments, width = (int(v) for v in torch.stack([segment_id.max() + 1,
                                                        torch.bincount(segment_id).max()]).tolist())
    rows, mask, column = terms_to_rows(log_ratio, segment_id, num_segments, width)
    behaviour_rows = terms_to_rows(behaviour.float(), segment_id, num_segments, width)[0] \
        if correction.needs_sampler_logps else None  # (S, L): the Bernoulli divergences need q itself
    advantage_rows = terms_to_rows(advantages.float(), segment_id, num_segments, width)[0] \
        if advantages is not None and correction.needs_advantages else None  # (S, L)
    result = importance_weights(rows, mask, correction, behaviour_rows, advantage_rows)
    weights = result.weights.expand(num_segments, width)  # (S, L): a sequence-level weight broadcast to its terms
    return weights[segment_id, column].float(), result


def decoupled_inputs(old_log_probs: torch.Tensor, advantages: torch.Tensor, selected: torch.Tensor,
                     prox: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's batch tensors rewritten so that TRL's own PPO-clip loss is the decoupled loss (module docstring).

    Args:
        old_log_probs, advantages (`torch.Tensor` of shape (R, M_max)): the batch's, padded per row.
        selected (`torch.Tensor` of shape (R, M_max), bool): the real terms (`token_index >= 0`).
        prox, weights (`torch.Tensor` of shape (M,)): per selected term, in `selected`'s order.
    Returns:
        new (old_log_probs, advantages): prox and w * A at the selected terms, the padding untouched.
    """
    old = old_log_probs.clone()
    adv = advantages.clone()
    old[selected] = prox.to(old.dtype)
    adv[selected] = (advantages[selected].float() * weights).to(adv.dtype)
    return old, adv
