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
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .config import sampling_truncated
from .sampling import KeptSets, kept_set_logprobs


_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                     "lm_head_multiplier")


def check_truncation_setup(args) -> None:
    """Validate `truncation_correction` against the rest of the config, before the trainer builds anything.

    Raises:
        ValueError: a correction without recorded kept sets (`record_sampler_logprobs=False`).
        ValueError: see `check_vllm_truncation_setup` (vLLM server mode, tensor parallelism).
    Warns (UserWarning): truncation is on, sampler log-probs feed the ratio, and the correction is `none`.
    """
    correction = args.truncation_correction
    if correction == "none":
        sampler_in_ratio = (args.use_vllm and args.vllm_importance_sampling_correction) or (
            args.off_policy_mask_threshold is not None
        )
        if sampling_truncated(args) and sampler_in_ratio:
            warnings.warn(
                "top_p/top_k/min_p truncate sampling and sampler log-probs feed the importance ratio, but "
                "truncation_correction='none': the ratio carries the kept mass (seed 004 T11: 51.8% of tokens out of "
                "[0.9, 1.1] at top_p=0.8). Set truncation_correction='renormalize' or 'lift_sampler'.",
                stacklevel=3,
            )
        return
    if args.use_vllm:
        check_vllm_truncation_setup(args)
        return
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


# ---------------------------------------------------------------------------------------------------------------------
# vLLM colocate: kept sets from `CompletionOutput.sampling_mask` (engine flag `return_sampling_mask=True`)


def check_vllm_truncation_setup(args) -> None:
    """Start-up checks for a truncation correction with vLLM (trl_grpo_internals.md §8).

    Raises:
        ValueError: server mode (TRL calls vLLM's OpenAI `/v1/completions`, whose response carries no sampling mask),
            or tensor parallelism > 1 (the captured outputs would hold other ranks' rows).
    Warns: top_k is 0: vLLM returns sampling masks only for requests with top_k > 0 (seed notes 1(c)); set e.g.
        top_k=1024 together with top_p.
    """
    if args.truncation_correction == "none" or not args.use_vllm:
        return
    if args.vllm_mode != "colocate":
        raise ValueError(
            f"truncation_correction={args.truncation_correction!r} with vllm_mode={args.vllm_mode!r}: TRL talks to the "
            f"vLLM server through /v1/completions, which returns no kept sets. Use vllm_mode='colocate' or "
            f"truncation_correction='none'."
        )
    if args.vllm_tensor_parallel_size != 1:
        raise ValueError(f"truncation_correction with vLLM colocate supports vllm_tensor_parallel_size=1, got "
                         f"{args.vllm_tensor_parallel_size}")
    top_k = (args.generation_kwargs or {}).get("top_k", args.top_k)
    if not top_k or top_k < 0:
        warnings.warn("vLLM returns sampling masks only for requests with top_k > 0; set top_k (e.g. 1024) with top_p",
                      stacklevel=3)


@contextlib.contextmanager
def vllm_engine_kwargs(**extra):
    """Within the block, TRL's colocate engine is built as `vllm.LLM(..., **extra)` (TRL passes a fixed kwargs list)."""
    import trl.generation.vllm_generation as vllm_generation

    original = vllm_generation.LLM
    vllm_generation.LLM = functools.partial(original, **extra)
    try:
        yield
    finally:
        vllm_generation.LLM = original


class VLLMOutputCapture:
    """Keeps the `RequestOutput`s of the last `llm.generate` call of a vLLM engine (wraps it on the instance)."""

    def __init__(self, llm):
        self.outputs = None
        generate = llm.generate

        def capturing_generate(*args, **kwargs):
            self.outputs = generate(*args, **kwargs)
            return self.outputs

        llm.generate = capturing_generate

    def kept_sets(self, num_rows: int) -> KeptSets:
        """KeptSets of the captured completions (one row per CompletionOutput, in TRL's order).

        Raises:
            RuntimeError: nothing captured, or the row count differs from TRL's completions.
        """
        from .sampling import kept_sets_from_vllm

        if self.outputs is None:
            raise RuntimeError("grpo_ratio: no vLLM outputs captured for this generation batch")
        kept = kept_sets_from_vllm(self.outputs)
        self.outputs = None
        if kept.num_rows != num_rows:
            raise RuntimeError(f"grpo_ratio: vLLM returned kept sets for {kept.num_rows} completions, TRL kept "
                               f"{num_rows}")
        return kept
