"""The integer old pass (`old_logprob_mode="integer"`): the integer model that drew the rollouts
(`rollout_precision="integer"`, `grpo_ratio.sampler.precision`) re-scores them teacher-forced, in TRL's batch layout.

Its log-probs equal the integer sampler's bit for bit, on any batch composition: the integer forward's logits do not
depend on the batch or on the prefill/decode split, and `grpo_ratio.integer.sample.score` applies the sampler's own
integer temperature / top_k / top_p and fixed-point log (docs/integer.md). Both sides leave fixed point through
`to_nats`, one rounding, so old/sampler = 1 exactly. Source: DetLLM (N. Barry, 2026), issue 42 item 3.

Shapes: B rows, P prompt tokens, T completion tokens.
"""

from __future__ import annotations

import torch

from ..integer.model import IntModel
from ..integer.sample import IntSampling, score


FIXED_POINT = 1 << 16  # the integer sampler's log-probs are in 2^-16 nats


def to_nats(fixed: torch.Tensor) -> torch.Tensor:
    """int64 log-probs (any shape) in 2^-16 nats -> fp32 nats: exact in float64, then one rounding to fp32 (the same
    for the sampler's record and the old pass)."""
    return fixed.to(torch.float64).div(FIXED_POINT).to(torch.float32)


def unpadded_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The token ids (B, P) where `mask` (B, P) is set, one list per row (left padding removed)."""
    return [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu(), strict=True)]


@torch.no_grad()
def integer_old_logps(model: IntModel, sampling: IntSampling, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                      completion_ids: torch.Tensor, completion_mask: torch.Tensor, pad_token_id: int = 0,
                      guard: bool = False) -> torch.Tensor:
    """(B, T) fp32 old log-probs (nats; 0 outside `completion_mask`) of TRL's generation batch: prompts (B, P)
    left-padded with `prompt_mask` (B, P), completions (B, T) int64 with `completion_mask` (B, T), each row's
    completion a prefix of valid tokens. One integer forward over prompts and completions; on `completion_ids`'
    device. `guard`: run under `NoFloatMode` (any float op raises `FloatInForwardError`)."""
    lengths = completion_mask.sum(1).to(torch.int64)
    fixed = score(model, unpadded_rows(prompt_ids, prompt_mask), completion_ids, lengths, sampling,
                  pad_token_id=pad_token_id, guard=guard)  # (B, T) int64
    return to_nats(fixed).to(completion_ids.device)
