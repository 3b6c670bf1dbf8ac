"""The kept-set log-probs of TRL's own forward through the LM head: the truncation corrections inside the trainer.

The math is `grpo_ratio.corrections.kept_logprobs` (one implementation per correction, also what the tests call); this module
feeds it from the trainer's forward passes. TRL's fused head never builds logits, so the kept-set log-probs come
from the backbone's last hidden state (captured by a forward hook during TRL's own call) through the LM head: TRL's
forward is neither copied nor repeated. This materialises the (b, T, V) logits of one forward chunk.

Both corrections make r_old/sampler = p_old,S(g) / q_S(g); they differ in the policy-gradient target
(docs/truncation.md):
- `renormalize`: old and new log-probs both over S (DeepSeek-V3.2, "Keep Sampling Mask", arXiv 2512.02556);
- `lift_sampler`: the trainer keeps full-vocabulary log-probs; the sampler's get + log M_old (TRL PR #7269, verl
  support-size replay).

Shapes: B = sequences, P = prompt tokens, T = completion tokens, H = hidden size, V = vocabulary.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..corrections.kept_logprobs import KeptLogprobs, logprobs_on_kept_sets
from ..corrections.kept_sets import KeptSets, SamplingSettings
from ..corrections.processors import RepetitionPenalty
from .adapters import base_model


@contextlib.contextmanager
def capture_last_hidden(model: nn.Module):
    """Collect the decoder's last hidden state (b, P+T, H) of every forward within the block (one per chunk)."""
    base = base_model(model)
    captured: list[torch.Tensor] = []

    def hook(module, args, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = base.get_decoder().register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def kept_set_logps_from_hidden(model: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                               kept: KeptSets | SamplingSettings, temperature: float, fp32_head: bool, autocast_ctx,
                               mask: torch.Tensor, penalty: RepetitionPenalty | None = None) -> KeptLogprobs:
    """Log-probs of `tokens` renormalised over their kept sets, from hidden states through the model's LM head.

    Args:
        model: the causal LM whose head (`get_output_embeddings()`) projects `hidden`.
        hidden: (B, T, H) hidden states at the positions predicting the T completion tokens (grad flows through).
        tokens: (B, T) completion ids.
        kept: (B, T) kept sets (empty cells = padding, skipped), or the sampler's `SamplingSettings` that recompute them from
            these logits (the "recompute" kept-set source).
        temperature: TRL's `temperature`.
        fp32_head: project in fp32 outside autocast (TRL's `cast_lm_head_to_fp32`), else under `autocast_ctx`.
        autocast_ctx: zero-argument callable returning the trainer's autocast context.
        mask: (B, T) bool completion tokens.
        penalty: the sampler's repetition penalty over the same rows (`grpo_ratio.corrections.processors`), or None.
    Returns:
        `KeptLogprobs`: (B, T) fp32 log-probs over S (0.0 where the cell has no kept set), the sets, the additions.
    Raises:
        ValueError: a sampled token outside its kept set ("inconsistent rollout", naming row and position).
    """
    head = base_model(model).get_output_embeddings()
    if fp32_head:
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float())
    else:
        with autocast_ctx():
            logits = head(hidden)  # (B, T, V)
    return logprobs_on_kept_sets(logits, tokens, kept, temperature, mask, penalty)
