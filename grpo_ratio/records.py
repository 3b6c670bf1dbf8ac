"""The two records that carry state between TRL's hooks inside `RatioGRPOTrainer`, so that one training step can be
followed without chasing trainer attributes.

One GRPO step, and who writes and reads what (TRL 1.16's call order):

```
_generate_and_score_completions          creates GenerationRecord (one per generation batch and mode)
    _generate_single_turn                    writes .sampler (recorded log-probs, kept sets) or .kept (vLLM masks)
    _get_per_token_logps_and_entropies       TRL's old pass: replaced by the scoring mode, or measured;
                                             writes .old_log_kept_mass, .fallback_rows
    (TRL: rewards, advantages, IS weights; the batch is shuffled and split into micro-batches)
_compute_loss                            creates MicroBatchRecord (one per loss micro-batch), clears it on return
    _get_per_token_logps_and_entropies       the training forward: reads GenerationRecord.kept for its rows,
                                             writes .train_logps, .train_log_kept_mass
    diagnostics                              read both records
```

A `GenerationRecord` lives until the next generation batch of the same mode (`"train"` / `"eval"`) replaces it: its
kept sets are needed by every micro-batch cut from it, which TRL feeds to `_compute_loss` one optimizer step at a
time. A `MicroBatchRecord` lives for one `_compute_loss` call.

Shapes: B = rows of the local generation batch, b = rows of a micro-batch, T = completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kept_sets import KeptSets
from .rollouts import SamplerRecord


@dataclass
class GenerationRecord:
    """What one generation batch carries from generation to the old pass and to the loss.

    Fields:
        mode (`str`): `"train"` or `"eval"` (the model's mode when the batch was generated).
        old_pass_pending (`bool`): TRL will run its own old-logprob pass within this generation and has not yet:
            the next no-grad log-prob call on the policy is that pass.
        sampler (`SamplerRecord | None`): what the `generate` recording saw on the first turn (sampler log-probs
            (B, T) and kept sets), when `record_sampler_logprobs` is on.
        kept (`KeptSets | None`, (B, T)): the kept set of every completion token, when a truncation correction
            needs them (from the `generate` recording or vLLM's sampling masks).
        kept_added (`torch.Tensor | None`, (B, T) bool): recomputed kept sets only: cells whose sampled token the
            recomputed filter dropped (added back).
        old_log_kept_mass (`torch.Tensor | None`, (B, T) fp32): log M_old, the old policy's log mass on the kept
            sets (0 on padding), when a correction is on.
        fallback_rows (`int`): `fp16_clone` rows re-scored in fp32 in this batch's old pass.
    """

    mode: str
    old_pass_pending: bool = False
    sampler: SamplerRecord | None = None
    kept: KeptSets | None = None
    kept_added: torch.Tensor | None = None
    old_log_kept_mass: torch.Tensor | None = None
    fallback_rows: int = 0


@dataclass
class MicroBatchRecord:
    """One loss micro-batch inside `_compute_loss`.

    Fields:
        inputs (`dict`): the micro-batch TRL passed to `_compute_loss` (rows cut from a shuffled generation batch).
        kept (`KeptSets | None`, (b, T)): the kept sets of its rows (selected by `inputs["kept_row_index"]`).
        train_logps (`torch.Tensor | None`, (b, T) fp32): the training forward's log-probs, detached (over the kept
            sets under `renormalize`).
        train_log_kept_mass (`torch.Tensor | None`, (b, T) fp32): log M of the training forward (kept sets only).
        kept_added (`torch.Tensor | None`, (b, T) bool): when the training forward recomputed the kept sets (no old
            pass ran), the cells whose sampled token the filter dropped.
    """

    inputs: dict
    kept: KeptSets | None = None
    train_logps: torch.Tensor | None = None
    train_log_kept_mass: torch.Tensor | None = None
    kept_added: torch.Tensor | None = None
