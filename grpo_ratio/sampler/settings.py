"""The sampler's settings as generation really uses them (`SamplingSettings` from a TRL config, or from the
model's `generation_config` on the `generate` path), and where its log-probs sit in TRL's output dict.

Shapes: B = sequences, T = completion tokens.
"""

from __future__ import annotations

import torch

from ..corrections.kept_sets import SamplingSettings
from ..corrections.processors import PROCESSORS, VLLM_PROCESSORS, active_processors
from .generate import generation_model


def settings_from_config(args, vllm: bool = False) -> SamplingSettings:
    """The sampling settings a `GRPOConfig` asks for (its fields, overridden by `generation_kwargs`), as TRL passes
    them to vLLM (`vllm=True`: `generation_kwargs` are vLLM `SamplingParams`) or to transformers continuous batching;
    the `generate` path also fills unset fields from the model (`settings_from_generation_config`)."""
    gen = args.generation_kwargs or {}
    fields = {"repetition_penalty": args.repetition_penalty, **gen}
    if vllm:
        fields.setdefault("vllm_structured_outputs_regex", getattr(args, "vllm_structured_outputs_regex", None))
    table = VLLM_PROCESSORS if vllm else PROCESSORS
    return SamplingSettings(
        temperature=float(gen.get("temperature", args.temperature)),
        top_k=int(gen.get("top_k", args.top_k) or 0),
        top_p=float(gen.get("top_p", args.top_p) if gen.get("top_p", args.top_p) is not None else 1.0),
        min_p=float(gen.get("min_p", args.min_p) or 0.0),
        num_beams=int(gen.get("num_beams", 1) or 1),
        do_sample=bool(gen.get("do_sample", True)),
        source="config",
        repetition_penalty=float(fields["repetition_penalty"] or 1.0),
        processors=tuple(active_processors(fields, table).items()),
        engine="vllm" if vllm else "generate",
    )


def settings_from_generation_config(model, generation_config) -> SamplingSettings:
    """The settings transformers' `generate` will use for `model.generate(generation_config=generation_config)`:
    fields left unset (None) there are filled from the model's own `generation_config` (e.g. a `min_p` or a
    `no_repeat_ngram_size` the model ships), exactly as `GenerationMixin._prepare_generation_config` does
    (transformers 5.x)."""
    target = generation_model(model)
    effective, _ = target._prepare_generation_config(generation_config)
    return SamplingSettings(
        temperature=float(effective.temperature if effective.temperature is not None else 1.0),
        top_k=int(effective.top_k or 0),
        top_p=float(effective.top_p if effective.top_p is not None else 1.0),
        min_p=float(effective.min_p or 0.0),
        num_beams=int(effective.num_beams or 1),
        do_sample=bool(effective.do_sample),
        source="generation config",
        repetition_penalty=float(effective.repetition_penalty or 1.0),
        processors=tuple(active_processors({n: getattr(effective, n, None) for n in PROCESSORS}).items()),
    )


def sampler_logps_key(output: dict) -> str:
    """The key of the sampler's (B, T) log-probs in a generation batch: TRL's `sampling_per_token_logps` (vLLM, or
    `sampler_logprobs_in_loss`), else the recorded `sampler_per_token_logps` the diagnostics read."""
    return "sampling_per_token_logps" if "sampling_per_token_logps" in output else "sampler_per_token_logps"


def sampler_anchor(output: dict) -> torch.Tensor:
    """`old_logprob_mode="sampler"`: the old log-probs (B, T) are the sampler's own, as recorded (generate) or
    returned (vLLM), padded with 0 like TRL pads them; over the kept set under `renormalize`, as the sampler's are.

    Raises:
        RuntimeError: a completion token without a sampler log-prob (NaN: generate was not recorded, or vLLM
            could not score it); the loss would be NaN.
    """
    key = sampler_logps_key(output)
    if key not in output:
        raise RuntimeError("old_logprob_mode='sampler': this generation returned no sampler log-probs "
                           "(a rollout_func without logprobs?)")
    sampler = output[key]  # (B, T)
    missing = torch.isnan(sampler) & output["completion_mask"].bool()  # (B, T)
    if missing.any():
        raise RuntimeError(f"old_logprob_mode='sampler': {int(missing.sum())} completion tokens have no sampler "
                           f"log-prob (NaN); they cannot anchor the ratio")
    return sampler.clone()
