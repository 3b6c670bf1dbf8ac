"""The two records that carry state between TRL's hooks inside `RatioGRPOTrainer`, so that one training step can be
followed without chasing trainer attributes. Every field has one writer, and every value the diagnostics read comes
to them by one route (the `MicroBatchRecord`).

One GRPO step, and who writes and reads what (TRL 1.16's call order):

```
_generate_and_score_completions          creates GenerationRecord (one per generation batch and mode)
    _generate_single_turn                    writes .recorded, and .kept when the sampler's sets are used
                                             (the generate recording's first turn, or vLLM's masks);
                                             RoutingReplay writes .routes (the sampler's MoE routes, then the
                                             old pass's; grpo_ratio.routing.replay)
    _get_per_token_logps_and_entropies       TRL's old pass: replaced by the scoring mode, or measured;
                                             `_keep_old_sets` writes .old_log_kept_mass, and recomputed .kept /
                                             .kept_added; the scoring mode writes .fallback_rows
    (TRL: rewards, advantages, IS weights; the batch is shuffled and split into micro-batches, with
     old_log_kept_mass, kept_set_added and kept_row_index as batch keys)
_compute_loss                            creates MicroBatchRecord (one per loss micro-batch), clears it on return
    _get_per_token_logps_and_entropies       the training forward: reads GenerationRecord.kept for its rows;
                                             `_keep_training_forward` writes every MicroBatchRecord field
    diagnostics                              read the MicroBatchRecord (and the batch keys TRL itself put there)
```

A `GenerationRecord` lives until the next generation batch of the same mode (`"train"` / `"eval"`) replaces it: its
kept sets are needed by every micro-batch cut from it, which TRL feeds to `_compute_loss` one optimizer step at a
time. A `MicroBatchRecord` lives for one `_compute_loss` call.

Shapes: B = rows of the local generation batch, b = rows of a micro-batch, T = completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .corrections.kept_sets import KeptSets
from .diagnostics.attribution import AttributionReference
from .routing.replay import GenerationRoutes


@dataclass
class GenerationRecord:
    """What one generation batch carries from generation to the old pass and to the loss.

    Fields:
        mode (`str`): `"train"` or `"eval"` (the model's mode when the batch was generated).
        old_pass_pending (`bool`): TRL will run its own old-logprob pass within this generation and has not yet:
            the next no-grad log-prob call on the policy is that pass.
        recorded (`bool`): `generate` ran under the sampler recorder (`record_sampler_logprobs`): TRL's
            `sampling_per_token_logps` are the recording's log-probs (NaN where a call was not recorded).
        kept (`KeptSets | None`, (B, T)): the kept set of every completion token, when a truncation correction
            needs them: the sampler's (the `generate` recording's first turn, or vLLM's sampling masks) or, with
            `kept_set_source="recompute"`, those the old pass recomputed. Written by one of the two, as the plan says.
        kept_added (`torch.Tensor | None`, (B, T) bool): recomputed kept sets only: cells whose sampled token the
            recomputed filter dropped (added back).
        old_log_kept_mass (`torch.Tensor | None`, (B, T) fp32): log M_old, the old policy's log mass on the kept
            sets (0 on padding), when a correction is on.
        fallback_rows (`int`): `fp16_clone` rows re-scored in fp32 in this batch's old pass.
        routes (`GenerationRoutes`): an MoE policy's routes of this batch, (B, P+T, L, k) int16: the sampler's and
            the old pass's. Written by the trainer's `RoutingReplay` only; empty for a dense model.
        full_vocab (`tuple | None`, 3 x (B, T) fp32): with `ratio_full_vocab`, the scoring mode's pass's exact
            KL(old||policy), KL(policy||old) and TV per token (`ScoreResult.full_vocab`).
        old_logps (`torch.Tensor | None`, (B, T) fp32): what the old pass returned to TRL (TRL's own, the scoring
            mode's, or the sampler arm's stand-in); written by the old-pass hook. RLOO's batch keeps only their sum,
            so `RatioRLOOTrainer` puts these in as `old_per_token_logps`.
        sampler_logprobs (`list | None`, B lists of floats): RLOO only: the sampler's per-token log-probs of this
            batch (the `generate` recording or vLLM's), which RLOOTrainer drops and `RatioRLOOTrainer` pads into
            the batch as GRPOTrainer does.
        attribution (`AttributionReference | None`, (n, T) fp32): with `ratio_attribution`, the fp32 reference passes
            of the n sampled rows (their positions go with the batch as `attribution_row`, (B,) int64, -1 = not
            sampled); written by the trainer's `_score_reference` after the old pass, read by the micro-batches.
        is_weights (`ReusedISWeights | None`): `is_correction` with the training forward's log-probs reused as the old
            ones (`RunPlan.reuses_training_forward`: no old pass ran): each micro-batch's training forward computes
            its rows' IS weight and puts it here; once every row is in, the trainer logs their metrics. Written at
            generation (created) and by the training forwards (filled), read by the trainer's `_compute_loss`.
        sampler_top_k (`tuple | None`, 2 x (B, T, k)): with `score_centering="top_k"`, the sampler's top-k token ids
            (int64) and processed log-probs (fp32) of every step, from the `generate` recording's first turn; the rows
            go with the batch as `centering_row_index` (B,) int64. Read by the training forward.
    """

    mode: str
    old_pass_pending: bool = False
    recorded: bool = False
    kept: KeptSets | None = None
    kept_added: torch.Tensor | None = None
    old_log_kept_mass: torch.Tensor | None = None
    fallback_rows: int = 0
    routes: GenerationRoutes = field(default_factory=GenerationRoutes)
    full_vocab: tuple | None = None
    old_logps: torch.Tensor | None = None
    sampler_logprobs: list | None = None
    attribution: AttributionReference | None = None
    is_weights: ReusedISWeights | None = None


@dataclass
class ReusedISWeights:
    """A generation batch's IS weights computed one micro-batch at a time, from each training forward's log-probs
    (`RunPlan.reuses_training_forward`), assembled in the batch's row order so that their metrics are computed on the
    same (B, T) tensor, in the same order, as the whole-batch weights of a separate old pass (bit for bit).

    Fields:
        mask (`torch.Tensor`, (B, T) bool): the batch's valid tokens as the IS weight sees them (completion mask,
            and the tool mask where there is one).
        weights (`torch.Tensor | None`, (B, T) or (B, 1) fp32): the rows filled so far (allocated by the first
            micro-batch, in its weights' shape and device).
        rows_left (`int`): rows not yet filled (shapes only: no host read of a device value).
    """

    mask: torch.Tensor
    weights: torch.Tensor | None = None
    rows_left: int = 0

    def fill(self, rows: torch.Tensor, weights: torch.Tensor) -> bool:
        """Put a micro-batch's weights (b, T) or (b, 1) at its rows `rows` (b,) int64 of the batch; True once every
        row of the batch is in."""
        if self.weights is None:
            self.weights = torch.empty((self.mask.size(0), weights.size(1)), dtype=weights.dtype,
                                       device=weights.device)
        self.weights[rows.to(self.weights.device)] = weights
        self.rows_left -= rows.numel()
        return self.rows_left == 0
    sampler_top_k: tuple | None = None


@dataclass
class MicroBatchRecord:
    """One loss micro-batch inside `_compute_loss`: what the diagnostics read (all written by the trainer's
    `_keep_training_forward`, from the training forward of these rows).

    Fields:
        inputs (`dict`): the micro-batch TRL passed to `_compute_loss` (rows cut from a shuffled generation batch).
        train_logps (`torch.Tensor | None`, (b, T) fp32): the training forward's log-probs, detached (over the kept
            sets under `renormalize`).
        old_log_kept_mass (`torch.Tensor | None`, (b, T) fp32): log M_old of these rows: the old pass's, or, where
            no old pass ran (on-policy, the sampler arm), the training forward's (the old policy's weights at the
            first inner step). Kept sets only.
        kept_added (`torch.Tensor | None`, (b, T) bool): recomputed kept sets only: the cells whose sampled token the
            filter dropped (added back), from the pass that recomputed the sets.
        attribution (`AttributionReference | None`, (b, T) fp32): with `ratio_attribution`, the reference passes of
            these rows (NaN and `present` False where a row was not sampled).
        is_weights (`torch.Tensor | None`, (b, T) or (b, 1) fp32): `RunPlan.reuses_training_forward`: the IS weight
            of these rows, computed from this training forward's log-probs (detached) as the old ones.
    """

    inputs: dict
    train_logps: torch.Tensor | None = None
    old_log_kept_mass: torch.Tensor | None = None
    kept_added: torch.Tensor | None = None
    attribution: AttributionReference | None = None
    is_weights: torch.Tensor | None = None
