"""Truncated-sampling correction in the trainer: put sampler and trainer log-probs on one support (the kept set S).

With top_p/top_k/min_p the sampler's log-prob of a token is normalised over S, the trainer's over the vocabulary,
so r_old/sampler carries the kept mass M = sum_{v in S} p(v) (seed 004 "The other term in the ratio", T11: at
top_p=0.8 the ratio averaged 0.896 and 51.8% of tokens left [0.9, 1.1]; trl#6789). Two corrections, chosen by
`RatioGRPOConfig.truncation_correction` (docs/truncation.md for the gradient they give):
- `renormalize`: old and new log-probs both over S, log p_S(g) = z_g - logsumexp_{v in S} z_v (DeepSeek-V3.2,
  "Keep Sampling Mask", arXiv 2512.02556);
- `lift_sampler`: the trainer keeps full-vocabulary log-probs; the sampler's get + log M_old (TRL PR #7269, verl
  support-size replay).
Both make r_old/sampler = p_old,S(g) / q_S(g); they differ in the policy-gradient target.

The trainer's log-probs come from TRL's fused head, which never builds logits; the kept-set log-probs are computed
from the backbone's last hidden state (captured by a forward hook during TRL's own call) and the LM head, so TRL's
forward is neither copied nor repeated. This materialises the (b, T, V) logits of one forward chunk.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .sampling import KeptSets, kept_set_logprobs


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                     "lm_head_multiplier")


def truncation_active(args) -> bool:
    """Whether sampling truncates the distribution (top_p < 1, top_k > 0 or min_p > 0, in the config or in
    `generation_kwargs`)."""
    gen = args.generation_kwargs or {}
    top_p = gen.get("top_p", args.top_p)
    top_k = gen.get("top_k", args.top_k)
    min_p = gen.get("min_p", args.min_p)
    return (top_p is not None and top_p < 1.0) or bool(top_k) or bool(min_p)


def check_truncation_setup(args) -> None:
    """Validate `truncation_correction` against the rest of the config, before the trainer builds anything.

    Raises:
        ValueError: a correction without recorded kept sets (`record_sampler_logprobs=False`).
        NotImplementedError: a correction with vLLM (the kept sets need vLLM's `return_sampling_mask`, which this
            release does not wire; the correction is refused rather than silently dropped).
    Warns (UserWarning): truncation is on, sampler log-probs feed the ratio, and the correction is `none`.
    """
    correction = args.truncation_correction
    if correction == "none":
        sampler_in_ratio = (args.use_vllm and args.vllm_importance_sampling_correction) or (
            args.off_policy_mask_threshold is not None
        )
        if truncation_active(args) and sampler_in_ratio:
            warnings.warn(
                "top_p/top_k/min_p truncate sampling and sampler log-probs feed the importance ratio, but "
                "truncation_correction='none': the ratio carries the kept mass (seed 004 T11: 51.8% of tokens out of "
                "[0.9, 1.1] at top_p=0.8). Set truncation_correction='renormalize' or 'lift_sampler'.",
                stacklevel=3,
            )
        return
    if args.use_vllm:
        raise NotImplementedError(
            f"truncation_correction={correction!r} with use_vllm=True needs vLLM's per-token kept sets "
            f"(return_sampling_mask), which grpo_ratio does not wire yet; use transformers generation "
            f"(use_vllm=False) or truncation_correction='none' (docs/truncation.md)"
        )
    if not args.record_sampler_logprobs:
        raise ValueError(f"truncation_correction={correction!r} needs the kept sets recorded during generation: set "
                         f"record_sampler_logprobs=True")


def check_head_is_linear(args, model_config) -> None:
    """Raise `ValueError` when a correction is on and the model transforms its logits after the LM head
    (softcapping, logit scaling): there head(hidden) is not the logits the kept-set log-probs need."""
    if args.truncation_correction == "none":
        return
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    transformed = [k for k in _LOGIT_TRANSFORMS if getattr(text_config, k, None) not in (None, 1, 1.0)]
    if transformed:
        raise ValueError(f"truncation_correction={args.truncation_correction!r} does not support models whose logits "
                         f"are transformed after the LM head ({', '.join(transformed)})")


@contextlib.contextmanager
def capture_last_hidden(model: nn.Module):
    """Collect the decoder's last hidden state (b, P+T, H) of every forward within the block (one per chunk)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    captured: list[torch.Tensor] = []

    def hook(module, args, output):
        captured.append(output[0] if isinstance(output, tuple) else output.last_hidden_state)

    handle = base.get_decoder().register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def kept_set_logps_from_hidden(model: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, kept: KeptSets,
                               temperature: float, fp32_head: bool, autocast_ctx) -> torch.Tensor:
    """Log-probs of `tokens` renormalised over their kept sets, from hidden states through the model's LM head.

    Args:
        model: the causal LM whose head (`get_output_embeddings()`) projects `hidden`.
        hidden: (B, T, H) hidden states at the positions predicting the T completion tokens (grad flows through).
        tokens: (B, T) completion ids.
        kept: (B, T) kept sets (empty cells = padding, skipped).
        temperature: TRL's `temperature`.
        fp32_head: project in fp32 outside autocast (TRL's `cast_lm_head_to_fp32`), else under `autocast_ctx`.
        autocast_ctx: zero-argument callable returning the trainer's autocast context.
    Returns:
        (B, T) fp32 log-probs over S (0.0 where the cell has no kept set).
    Raises:
        ValueError: a sampled token outside its kept set ("inconsistent rollout", naming row and position).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if fp32_head:
        with torch.autocast(hidden.device.type, enabled=False):
            logits = F.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float())
    else:
        with autocast_ctx():
            logits = head(hidden)  # (B, T, V)
    mask = kept.sizes.to(logits.device) > 0  # (B, T)
    return kept_set_logprobs(logits, tokens, kept, temperature, mask=mask)
