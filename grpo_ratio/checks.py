"""Every refusal and warning of grpo_ratio, by what it needs: "is X allowed with Y?" has its answer here.

1. The config alone: `check_trl_fields` (TRL's own fields that would fail later without naming themselves, run
   before TRL's `__post_init__`) and `check_config` (allowed values, ranges, types and combinations of the new fields
   and the TRL fields they meet), both called by `RatioGRPOConfig.__post_init__`.
2. The model and the trainer: `check_train_dataset`, `check_run` (the backend and the sampling generation really
   uses, before the plan resolves), `lint_trainer` (its `check_*`), `check_sharded_mode` and `check_old_pass`, called
   by `RatioGRPOTrainer.__init__` once the model, the generation backend and accelerate's engine are known.
(`grpo-ratio train` checks flags and recipe keys before the heavy imports: `grpo_ratio/cli/precheck.py`.)

Each check either refuses a setup that cannot work or would be silently wrong (`ValueError` or `NotImplementedError`
naming the field, the value and what works) or warns about one that makes the ratio measure something the user may
not expect (`UserWarning` or the `grpo_ratio` logger, naming the fields and the fix). docs/compatibility.md lists them.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from difflib import get_close_matches
from functools import partial
from pathlib import Path

import torch
from torch import nn
from trl import GRPOConfig

from ._compat import is_rloo, trl_field
from .corrections.centering import TAILS, VARIANTS
from .corrections.decoupled import OBJECTIVES
from .corrections.is_correction import PRESETS, resolve_correction
from .corrections.kept_sets import SamplingSettings
from .corrections.processors import MASKS, MODELLED, NO_EFFECT, PROCESSORS, VLLM_PROCESSORS, Processor
from .corrections.trust_region import TRUST_REGIONS
from .diagnostics.gate import training_checks
from .machine import cpu_has_native_bf16
from .modes import (
    COPY_MODES,
    DEFAULT_HEAD_OPERANDS,
    FP16_CLONE,
    FP32_CLONE,
    FP32_HEAD,
    GUIDED_FP32,
    HEAD_OPERANDS,
    INTEGER_MODE,
    MODES,
    OLD_LOGPROB_MODES,
    POLICY_ROLLOUTS,
    ROLLOUT_PRECISIONS,
    SAMPLER_HEAD_OPERANDS,
    SAMPLER_MODE,
    SCORER_MODES,
    SCORING_MODES,
    TRL_MODE,
)
from .old_pass.adapters import has_adapters
from .old_pass.copies import COPY_STORAGES
from .old_pass.forward import active_dropout, attention_refusing_fp32, logit_transforms, model_anatomy
from .old_pass.layer_spec import resolve_layer_spec
from .old_pass.scorer import check_scorer_setup
from .old_pass.sharding.engines import engine_of
from .plan import CONTINUOUS_BATCHING, GENERATE, RECORDED, VLLM, kept_set_origin
from .problems import Problems, collect
from .routing.replay import ROUTING_REPLAY_MODES


TRUNCATION_CORRECTIONS = ("none", "renormalize", "lift_sampler")
KEPT_SET_SOURCES = ("auto", "recorded", "recompute")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
ALL_ROWS = 2**31 - 1  # `ratio_attribution=True`: every row of a generation batch (`args.ratio_attribution_rows`)
# vLLM's `vllm serve` flag (also `trl vllm-serve`, which passes it through) for the engine's LM head in fp32
VLLM_FP32_HEAD_FLAG = """--hf-overrides '{"head_dtype": "float32"}'"""


@dataclass(frozen=True)
class ScoringUse:
    """One mode a run scores with, and the setting that asks for it (`scoring_uses`).

    Attributes:
        mode: a `SCORING_MODES` name.
        field: the config field that asks for it: `"old_logprob_mode"` or `"ratio_attribution"`.
        subject: how a refusal names it (`old_logprob_mode='fp16_clone'`, or `ratio_attribution=True (its fp32
            reference pass, an fp32_clone scorer)`).
        off: what turns the use off, for a refusal's "or ..." (`use old_logprob_mode='bf16'`).
        copy_storage: how the scorer holds a whole-model copy: the `copy_storage` field for the mode's own scorer;
            None for the attribution's reference, which picks its own (`reference_copy_storage`: per-module casts
            unsharded, the engine's shadows sharded).
    """

    mode: str
    field: str
    subject: str
    off: str
    copy_storage: str | None = "resident"


def reference_copy_storage(sharded: bool) -> str:
    """How `ratio_attribution`'s fp32 reference holds the fp32 weights of a policy stored in bf16/fp16: cast module by
    module during its pass (`"per_layer"`, `PerLayerCast`: about the largest module's fp32 bytes alive, none kept) on
    an unsharded policy; the engine's sharded shadows (`"resident"`) under FSDP2/ZeRO-3."""
    return "resident" if sharded else "per_layer"


def scoring_uses(args) -> list[ScoringUse]:
    """Every mode this run scores with, each once: `old_logprob_mode`'s, then, with `ratio_attribution` on and another
    mode, its fp32 reference (an `fp32_clone` scorer, `RatioHooks.reference_scorer`). Every start-up refusal keyed on a mode (`check_sharded_mode`,
    `check_quantized_copy`, `check_fp32_attention`, `check_old_pass`) runs over this list, so a scorer the run builds
    is never one that no check saw.

    Args:
        args: a `RatioGRPOConfig` / `RatioRLOOConfig` (or any object with `old_logprob_mode`; `copy_storage` and
            `ratio_attribution_rows` are read when present).
    Returns:
        `ScoringUse`s, the mode's own first.
    """
    mode = args.old_logprob_mode
    uses = [ScoringUse(mode, "old_logprob_mode", f"old_logprob_mode={mode!r}", f"use old_logprob_mode={TRL_MODE!r}",
                       getattr(args, "copy_storage", "resident"))]
    if getattr(args, "ratio_attribution_rows", None) is not None and mode != FP32_CLONE.name:
        value = getattr(args, "ratio_attribution", True)
        uses.append(ScoringUse(FP32_CLONE.name, "ratio_attribution",
                               f"ratio_attribution={value!r} (its fp32 reference pass, an {FP32_CLONE.name!r} scorer)",
                               "turn ratio_attribution off", None))
    return uses


# ---------------------------------------------------------------------------------------------------------------------
# 1. the config alone (RatioGRPOConfig.__post_init__)


def check_config(args) -> None:
    """Every refusal and warning that needs the config alone (`RatioGRPOConfig.__post_init__` calls it): allowed
    values, ranges and types of the new fields, and which combinations can work. Also resolves what the checks parse:
    `args.guided_fp32_layer_ids`, `args.guided_fp32_calibration`, `args.is_correction_spec`, a single `ratio_gate`
    string into a list, and turns TRL's vLLM IS correction off under `old_logprob_mode="sampler"` (warned).

    Raises:
        Problems (a `ValueError`): every problem found at once, each naming the field, the value and the allowed
            values or the setting that works.
    """
    collect(partial(check, args) for check in (
        _check_choices, _check_sampling_fields, _check_vllm_engine, _check_copy_storage, _check_head_operands,
        _resolve_guided_layers, _check_band, _check_switches, _check_truncation,
        _check_is_correction,  # before _check_sampler_mode, which may turn TRL's vLLM correction off
        _check_trust_region, _check_score_centering, _check_sampler_mode, _check_routing_replay, _check_gate,
        _check_attribution, _check_sampler_logprobs, _check_rollout_precision))


def _not_allowed(name: str, value, allowed) -> str:
    """"NAME=VALUE is not allowed; allowed: A, B (; did you mean 'A'?)"."""
    close = get_close_matches(str(value), [str(a) for a in allowed], n=1, cutoff=0.6)
    return (f"{name}={value!r} is not allowed; allowed: {', '.join(map(str, allowed))}"
            + (f"; did you mean {close[0]!r}?" if close else ""))


def _check_choices(args) -> None:
    """The new fields that take one of a set of values (`old_logprob_mode`, `kept_set_source`, `vllm_dtype`,
    `truncation_correction`), every one. Raises Problems."""
    allowed = {"old_logprob_mode": OLD_LOGPROB_MODES, "kept_set_source": KEPT_SET_SOURCES,
               "truncation_correction": TRUNCATION_CORRECTIONS, "vllm_dtype": VLLM_DTYPES}
    problems = [_not_allowed(name, getattr(args, name), values) for name, values in allowed.items()
                if getattr(args, name) not in values and not (name == "vllm_dtype" and args.vllm_dtype is None)]
    if problems:
        raise Problems(problems)


def _check_vllm_engine(args) -> None:
    """`vllm_dtype` and `vllm_lm_head_fp32` set TRL's colocate engine: refused elsewhere (a server takes flags)."""
    problems = []
    if args.vllm_dtype is not None and not (args.use_vllm and args.vllm_mode == "colocate"):
        problems.append(f"vllm_dtype={args.vllm_dtype!r} sets TRL's colocate engine, but use_vllm={args.use_vllm}, "
                        f"vllm_mode={args.vllm_mode!r}; for a server start `trl vllm-serve --dtype {args.vllm_dtype}`")
    if not isinstance(args.vllm_lm_head_fp32, bool):
        problems.append(f"vllm_lm_head_fp32 must be True or False, got {args.vllm_lm_head_fp32!r}")
    elif args.vllm_lm_head_fp32 and not (args.use_vllm and args.vllm_mode == "colocate"):
        problems.append(f"vllm_lm_head_fp32=True sets TRL's colocate engine, but use_vllm={args.use_vllm}, "
                        f"vllm_mode={args.vllm_mode!r}; for a server start `trl vllm-serve` (or `vllm serve`) with "
                        f"{VLLM_FP32_HEAD_FLAG}")
    if problems:
        raise Problems(problems)


def _check_switches(args) -> None:
    """The new booleans, `clip_flip_every`, and `ratio_full_vocab` against the mode. Raises Problems."""
    problems = [f"{name} must be True or False, got {getattr(args, name)!r}"
                for name in ("record_sampler_logprobs", "sampler_logprobs_in_loss", "ratio_diagnostics",
                             "ratio_full_vocab", "ratio_by_position")
                if not isinstance(getattr(args, name, False), bool)]
    if getattr(args, "ratio_by_position", False) is True and args.ratio_diagnostics is False:
        problems.append("ratio_by_position=True adds to the ratio diagnostics, but ratio_diagnostics=False; set "
                        "ratio_diagnostics=True or unset ratio_by_position")
    if isinstance(args.clip_flip_every, bool) or not isinstance(args.clip_flip_every, int) or args.clip_flip_every < 0:
        problems.append(f"clip_flip_every must be an integer >= 0 (0 = never), got {args.clip_flip_every!r}")
    if args.ratio_full_vocab is True and args.old_logprob_mode not in SCORER_MODES:
        problems.append(f"ratio_full_vocab=True compares a scoring mode's old distribution with the policy's own, but "
                        f"old_logprob_mode={args.old_logprob_mode!r} (bf16: the old pass is the policy's own; "
                        f"sampler: no old distribution); use one of {', '.join(SCORER_MODES)}")
    if problems:
        raise Problems(problems)


def _check_sampler_logprobs(args) -> None:
    """`sampler_logprobs_in_loss`: it needs the recording, a GRPO loss that reads the log-probs (TRL's off-policy
    mask, `off_policy_mask_threshold`) and no vLLM (which hands TRL its own log-probs: warned).

    Raises:
        ValueError: without `record_sampler_logprobs`; on RLOO (its loss reads none); on the `generate` path without
            `off_policy_mask_threshold` (nothing in TRL's loss would read them: a silent no-op).
    """
    if args.sampler_logprobs_in_loss is not True:
        return
    if not args.record_sampler_logprobs:
        raise ValueError("sampler_logprobs_in_loss=True needs record_sampler_logprobs=True (the log-probs it hands "
                         "to TRL are the recorded ones)")
    if is_rloo(args):
        raise ValueError("sampler_logprobs_in_loss=True hands the sampler's log-probs to TRL's loss, but RLOO's loss "
                         "reads none (no off-policy mask, no vLLM IS correction); for an IS correction on RLOO set "
                         "is_correction (docs/rloo.md)")
    if args.use_vllm:
        warnings.warn("sampler_logprobs_in_loss=True has no effect with use_vllm=True: TRL always receives vLLM's "
                      "log-probs as sampling_per_token_logps", stacklevel=6)
    elif trl_field(args, "off_policy_mask_threshold") is None:
        raise ValueError("sampler_logprobs_in_loss=True hands the recorded sampler log-probs to TRL's loss, whose only "
                         "reader on the generate path is the off-policy mask, but off_policy_mask_threshold is unset: "
                         "nothing would read them. Set off_policy_mask_threshold (TRL's off-policy sequence mask, "
                         "e.g. 0.5) or leave sampler_logprobs_in_loss=False; for an IS weight set is_correction "
                         "(docs/corrections.md)")


def _resolve_guided_layers(args) -> None:
    """`guided_fp32_layers` resolved into `args.guided_fp32_layer_ids` (None unless guided_fp32; checked against the
    model's layers when the trainer starts) and `args.guided_fp32_calibration` (a calibration file's metadata, for
    `check_calibration`).

    Raises:
        ValueError: `"guided_fp32"` without layers, or layers with another mode.
    """
    layers, args.guided_fp32_calibration = resolve_layer_spec(args.guided_fp32_layers)
    mode = MODES[args.old_logprob_mode]
    if mode.fp32_layers and not layers:
        raise ValueError(
            "old_logprob_mode='guided_fp32' needs guided_fp32_layers: decoder-layer indices such as '0,1,27' or a "
            "calibration JSON from `grpo-ratio probe layers` (with no layers use old_logprob_mode='fp32_head')"
        )
    if not mode.fp32_layers and layers:
        raise ValueError(
            f"guided_fp32_layers is only used by old_logprob_mode='guided_fp32', but old_logprob_mode="
            f"{args.old_logprob_mode!r}; remove guided_fp32_layers or switch the mode"
        )
    args.guided_fp32_layer_ids = layers


def _check_band(args) -> None:
    """`ratio_band_low` / `ratio_band_high`: numbers with 0 < low < 1 < high.

    Raises:
        ValueError: naming the field (not a number) or the band.
    """
    problems = [f"{name} must be a number, got {getattr(args, name)!r}" for name in ("ratio_band_low", "ratio_band_high")
                if isinstance(getattr(args, name), bool) or not isinstance(getattr(args, name), (int, float))]
    if problems:
        raise Problems(problems)
    if not 0.0 < args.ratio_band_low < 1.0 < args.ratio_band_high:
        raise ValueError(
            f"ratio band must satisfy 0 < ratio_band_low < 1 < ratio_band_high, got "
            f"[{args.ratio_band_low}, {args.ratio_band_high}]"
        )


def check_async_config(args) -> None:
    """Every refusal that needs a `RatioAsyncGRPOConfig` alone (its `__post_init__` calls it), and what it resolves:
    `args.guided_fp32_layer_ids`, `args.guided_fp32_calibration`, `args.is_correction_spec` (docs/async.md).

    Raises:
        Problems (a `ValueError`): every problem at once, each naming the field, the value and the allowed values:
            an unknown `async_objective` or `old_logprob_mode`; `old_logprob_mode` other than "bf16" (or
            `guided_fp32_layers`, `copy_storage`) without
            `async_objective="decoupled"` (only that objective runs a proximal pass); `old_logprob_mode="sampler"`
            (a proximal policy that is the behaviour policy is `"coupled"`); `is_correction` with `"coupled"` (no
            proximal policy to weight towards: TRL's loss); an invalid `is_correction` setting or ratio band.
    """
    collect(partial(check, args) for check in (
        _check_async_objective, _check_copy_storage, _check_head_operands, _resolve_guided_layers,
        _check_async_switches, _check_band,
        _check_async_correction, _check_async_truncation, _check_async_centering))


def _check_async_objective(args) -> None:
    """`async_objective` and `old_logprob_mode` of an asynchronous run (`check_async_config`). Raises Problems."""
    problems = []
    if args.async_objective not in OBJECTIVES:
        problems.append(_not_allowed("async_objective", args.async_objective, OBJECTIVES))
    if args.old_logprob_mode not in SCORING_MODES:
        problems.append(_not_allowed("old_logprob_mode", args.old_logprob_mode,
                                     [m for m in SCORING_MODES if m != SAMPLER_MODE]))
    elif args.old_logprob_mode == SAMPLER_MODE:
        problems.append("old_logprob_mode='sampler' makes the proximal policy the behaviour policy: that is "
                        "async_objective='coupled' (TRL's loss); choose a proximal pass among "
                        f"{', '.join(m for m in SCORING_MODES if m != SAMPLER_MODE)}")
    elif args.async_objective in OBJECTIVES and args.async_objective != "decoupled" and args.old_logprob_mode != TRL_MODE:
        problems.append(f"old_logprob_mode={args.old_logprob_mode!r} chooses the proximal pass, which only "
                        f"async_objective='decoupled' runs, but async_objective={args.async_objective!r}; set "
                        f"async_objective='decoupled' or leave old_logprob_mode at {TRL_MODE!r}")
    if problems:
        raise Problems(problems)


def _check_async_switches(args) -> None:
    """`max_staleness` and `ratio_diagnostics` of an asynchronous run. Raises Problems."""
    problems = []
    if isinstance(args.max_staleness, bool) or not isinstance(args.max_staleness, int) or args.max_staleness < 0:
        problems.append(f"max_staleness must be an integer >= 0 (0: fresh samples only), got {args.max_staleness!r}")
    if not isinstance(args.ratio_diagnostics, bool):
        problems.append(f"ratio_diagnostics must be True or False, got {args.ratio_diagnostics!r}")
    if problems:
        raise Problems(problems)


def _check_async_correction(args) -> None:
    """`is_correction` of an asynchronous run, resolved into `args.is_correction_spec`: refused with the coupled
    objective (no proximal policy to weight towards). Raises Problems."""
    args.is_correction_spec = resolve_correction(args.is_correction, args.is_correction_level,
                                                 args.is_correction_action, args.is_correction_low,
                                                 args.is_correction_high, args.is_correction_rejection,
                                                 args.is_correction_veto)
    if args.is_correction_spec is not None and args.async_objective == "coupled":
        raise ValueError(f"is_correction={args.is_correction!r} weights the behaviour -> proximal ratio, which "
                         "async_objective='coupled' does not have (its loss is TRL's); set async_objective="
                         "'decoupled' or 'decoupled_loglinear'")


def _check_async_truncation(args) -> None:
    """`truncation_correction` of an asynchronous run: none or lift_sampler, with the decoupled objective, on a
    truncated sampler without repetition penalty. Raises ValueError."""
    if args.truncation_correction not in ("none", "lift_sampler"):
        raise ValueError(f"truncation_correction={args.truncation_correction!r} is not allowed on "
                         "RatioAsyncGRPOTrainer; allowed: none, lift_sampler ('renormalize' needs kept-set log-probs "
                         "of the training forward under autograd, which TRL's fused head does not give)")
    if args.truncation_correction == "none":
        return
    if args.async_objective != "decoupled":
        raise ValueError(f"truncation_correction={args.truncation_correction!r} lifts the behaviour log-probs with "
                         "the kept mass of the proximal pass, which only async_objective='decoupled' runs, but "
                         f"async_objective={args.async_objective!r}")
    if not (args.top_p is not None and args.top_p < 1.0) and not (args.top_k or 0) > 0 and not args.min_p:
        raise ValueError(f"truncation_correction={args.truncation_correction!r} corrects top_p/top_k/min_p, but "
                         f"none is on (top_p={args.top_p}, top_k={args.top_k}, min_p={args.min_p}): nothing to "
                         "correct; set truncation_correction='none'")
    if args.repetition_penalty not in (None, 1.0):
        raise ValueError(f"truncation_correction={args.truncation_correction!r} re-applies the server's filter to "
                         f"the proximal logits without its repetition penalty ({args.repetition_penalty}); set "
                         "repetition_penalty=1.0 or truncation_correction='none'")


def _check_sampling_fields(args) -> None:
    """The sampler's temperature / top_p / top_k / min_p, as fields or in `generation_kwargs` (which override
    them): TRL passes any value through, and the kept sets and the corrections are computed from them. Out of
    range, transformers fails at the first generate (temperature <= 0, top_k < 0) or keeps a degenerate set
    silently (top_p = 0 keeps one token, min_p > 1 keeps only the argmax); vLLM reads temperature = 0 as greedy
    decoding, which makes every completion of a group the same (zero advantage).

    Raises:
        ValueError: a value out of range, naming the field (or `generation_kwargs[...]`) and the allowed range.
    """
    gen = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    allowed = {
        "temperature": ("> 0 (GRPO samples; greedy decoding gives every completion of a group the same reward)",
                        lambda v: v > 0),
        "top_p": ("0 < top_p <= 1 (1 = no truncation)", lambda v: 0.0 < v <= 1.0),
        # vLLM also reads -1 as "all tokens"; transformers' TopKLogitsWarper refuses it at the first generate
        "top_k": ("an integer >= 0 (0 = no top-k truncation" + (", as is -1 with vLLM)" if args.use_vllm else
                                                                "; -1 only with vLLM)"),
                  lambda v: isinstance(v, int) and v >= (-1 if args.use_vllm else 0)),
        "min_p": ("0 <= min_p <= 1, or None (no min-p truncation)", lambda v: v is None or 0.0 <= v <= 1.0),
    }
    problems = []
    for name, (rule, ok) in allowed.items():
        where, value = (f"generation_kwargs[{name!r}]", gen[name]) if name in gen else (name, getattr(args, name))
        if value is None and name != "min_p":
            continue  # TRL's own default then applies
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number or value is None) or not ok(value):
            problems.append(f"{where}={value!r} is not allowed; allowed: {rule}")
    if problems:
        raise Problems(problems)


def _check_copy_storage(args) -> None:
    """`copy_storage`: one of `COPY_STORAGES`, and `"per_layer"` only where a whole-model copy can exist.

    Raises:
        ValueError: an unknown value, or `"per_layer"` with a mode that holds no whole-model copy.
    """
    if args.copy_storage not in COPY_STORAGES:
        raise ValueError(f"copy_storage={args.copy_storage!r} is not allowed; allowed: {', '.join(COPY_STORAGES)}")
    if args.copy_storage == "per_layer" and args.old_logprob_mode not in COPY_MODES:
        raise ValueError(f"copy_storage='per_layer' is only used by old_logprob_mode in {', '.join(COPY_MODES)} "
                         f"(the modes with a whole-model copy), but old_logprob_mode={args.old_logprob_mode!r}; "
                         f"remove copy_storage or switch the mode")


def _check_head_operands(args) -> None:
    """`fp32_head_operands`: one of `HEAD_OPERANDS`; `"bf16"` only with `old_logprob_mode="fp32_head"` (the one mode
    whose only fp32 modules are the final norm and the head) and not with `fp16=True` (the policy's head would take
    fp16 operands, the sampler's then too: bf16 ones would be neither's).

    Raises:
        ValueError: naming the field, the value and the allowed values, or the setting that conflicts.
    """
    value = args.fp32_head_operands
    if value not in HEAD_OPERANDS:
        raise ValueError(_not_allowed("fp32_head_operands", value, HEAD_OPERANDS))
    if value == DEFAULT_HEAD_OPERANDS:
        return
    spec = MODES.get(args.old_logprob_mode)
    if spec is None or not spec.takes_head_operands:
        raise ValueError(f"fp32_head_operands={value!r} sets the LM head of old_logprob_mode='fp32_head', but "
                         f"old_logprob_mode={args.old_logprob_mode!r}; remove fp32_head_operands (allowed with this "
                         f"mode: {DEFAULT_HEAD_OPERANDS!r}) or set old_logprob_mode='fp32_head'")
    if value == SAMPLER_HEAD_OPERANDS and getattr(args, "fp16", False):
        raise ValueError("fp32_head_operands='bf16' rounds the head's operands to bf16, but fp16=True trains in fp16 "
                         "(the sampler's head would take fp16 operands); use fp32_head_operands='fp32'")


def _check_is_correction(args) -> None:
    """Resolve `is_correction` (+ `is_correction_*`) into `args.is_correction_spec` (`ISCorrection` or None).

    Raises:
        ValueError: an invalid setting (`is_correction.resolve_correction`); with the sampler arm (old is the
            sampler: the weight is 1); with vLLM, `vllm_importance_sampling_correction=False` (TRL's switch for
            applying the weight) or TRL's `vllm_importance_sampling_mode` / clip fields moved off their
            defaults (they would be silently unused); without vLLM, no recorded sampler log-probs; a
            sequence-level correction with `loss_type="vespo"` (TRL's own rule for VESPO); on RLOO a token-level
            correction (RLOO's ratio is per sequence, docs/rloo.md).
    """
    args.is_correction_spec = spec = resolve_correction(
        args.is_correction, args.is_correction_level, args.is_correction_action, args.is_correction_low,
        args.is_correction_high, args.is_correction_rejection, args.is_correction_veto)
    if spec is None:
        return
    name = f"is_correction={args.is_correction!r}"
    if args.old_logprob_mode == SAMPLER_MODE:
        raise ValueError(f"{name} with old_logprob_mode='sampler': the old log-probs are the sampler's, so the "
                         f"IS weight old/sampler is 1; unset is_correction or choose a precision mode")
    if is_rloo(args) and not spec.sequence_level:
        raise ValueError(f"{name} is token-level ({spec}), but RLOO's ratio and clip are per sequence, so its weight "
                         f"must be too (docs/rloo.md); use a sequence-level preset ("
                         f"{', '.join(n for n, p in PRESETS.items() if p.correction.sequence_level)}) or "
                         f"is_correction='custom' with is_correction_level='sequence_product' or 'sequence_geometric'")
    if args.use_vllm and not is_rloo(args):  # RLOO has no vLLM IS correction of its own: ours is the only one
        if not args.vllm_importance_sampling_correction:
            raise ValueError(f"{name} needs vllm_importance_sampling_correction=True with vLLM (TRL's switch for "
                             f"its old pass and for applying the weight in the loss)")
        trl = GRPOConfig.__dataclass_fields__
        moved = [f for f in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                             "vllm_importance_sampling_clip_max") if getattr(args, f) != trl[f].default]
        if moved:
            raise ValueError(f"{name} replaces TRL's vLLM correction, so {', '.join(moved)} would be unused; "
                             f"leave them at TRL's defaults (or unset is_correction to use TRL's modes)")
    elif args.use_transformers_continuous_batching or not args.record_sampler_logprobs:
        raise ValueError(f"{name} without vLLM needs the sampler's log-probs recorded during generate: "
                         f"record_sampler_logprobs=True and use_transformers_continuous_batching=False")
    if trl_field(args, "loss_type") == "vespo" and spec.sequence_level:
        raise ValueError(f"{name} is sequence-level ({spec}); loss_type='vespo' needs a token-level weight, as "
                         f"TRL requires token_* modes for VESPO")


def _check_trust_region(args) -> None:
    """`trust_region` (+ `trust_region_low` / `_high`): DPPO's mask on the policy loss
    (`grpo_ratio.corrections.trust_region`).

    Raises:
        ValueError: an unknown value (the allowed ones named); a bound without `trust_region`, or <= 0; on RLOO (its
            ratio is per sequence); with `loss_type="vespo"` (TRL applies no per-token factor there) or
            `importance_sampling_level="sequence"` (DPPO's mask is per token).
    """
    kind = getattr(args, "trust_region", None)
    bounds = {f: getattr(args, f, None) for f in ("trust_region_low", "trust_region_high")}
    if kind is None:
        given = [f for f, v in bounds.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with trust_region "
                             f"set (one of {', '.join(TRUST_REGIONS)})")
        return
    if kind not in TRUST_REGIONS:
        raise ValueError(f"trust_region={kind!r} is not allowed; allowed: {', '.join(TRUST_REGIONS)} (or unset)")
    for name, value in bounds.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if is_rloo(args):
        raise ValueError(f"trust_region={kind!r} masks per token, but RLOO's ratio and clip are per sequence; on RLOO "
                         f"use a sequence-level is_correction rejection (docs/rloo.md)")
    if trl_field(args, "loss_type") == "vespo":
        raise ValueError(f"trust_region={kind!r} reaches TRL's loss as a per-token factor, which loss_type='vespo' "
                         f"does not apply; use loss_type='cispo' (verl's DPPO loss) or a clipped loss type")
    if trl_field(args, "importance_sampling_level") == "sequence":
        raise ValueError(f"trust_region={kind!r} is a per-token mask, but importance_sampling_level='sequence'; use "
                         f"'token'")


def _check_gate(args) -> None:
    """`ratio_gate`: a list of checks (a single string is one check); errors as `gate.training_checks`."""
    if isinstance(args.ratio_gate, str):
        args.ratio_gate = [args.ratio_gate]
    checks = training_checks(args.ratio_gate or [], args.ratio_gate_patience, args.ratio_gate_action)
    ratio_keys = [str(c) for c in checks if c.key.startswith("ratio/")]
    if ratio_keys and not args.ratio_diagnostics:
        raise ValueError(f"ratio_gate checks {', '.join(ratio_keys)} but ratio_diagnostics=False: no ratio/* key "
                         f"is logged; set ratio_diagnostics=True")


def _check_attribution(args) -> None:
    """`ratio_attribution`: off (unset, False, "false"), True / "true" (every row) or a row count >= 1 (an int or its
    digits); resolved into `args.ratio_attribution_rows` (None: off; `ALL_ROWS`: every row). It is logged by the ratio
    diagnostics and needs the sampler's log-probs."""
    value = args.ratio_attribution
    text = value.strip().lower() if isinstance(value, str) else None
    if value is None or value is False or text in ("false", "none", "off", "0"):
        args.ratio_attribution_rows = None
        return
    if value is True or text == "true":
        rows = ALL_ROWS
    elif isinstance(value, int) and value >= 1 or (text is not None and text.isdigit()):
        rows = int(value)
    else:
        raise ValueError(f"ratio_attribution={value!r} is not allowed; allowed: True (every row of each generation "
                         f"batch), a number of rows >= 1 to sample per generation batch, or False/unset (off)")
    if not args.ratio_diagnostics:
        raise ValueError("ratio_attribution is logged with the ratio diagnostics, but ratio_diagnostics=False; set "
                         "ratio_diagnostics=True")
    if not (args.use_vllm or args.record_sampler_logprobs):
        raise ValueError("ratio_attribution splits log(new) - log(sampler), but record_sampler_logprobs=False without "
                         "vLLM: no sampler log-probs; set record_sampler_logprobs=True")
    args.ratio_attribution_rows = rows


def _check_sampler_mode(args) -> None:
    """`old_logprob_mode="sampler"`: the rollout's sampler log-probs anchor the ratio, so they must exist.

    Raises:
        ValueError: no sampler log-probs on the transformers path (`record_sampler_logprobs=False`), or
            `truncation_correction="lift_sampler"` (it needs the old policy's kept mass, i.e. an old pass; with
            `renormalize` both sides are on the kept set already).
    Warns (UserWarning): vLLM's importance-sampling correction is turned off (old == sampler: its ratio is 1).
    """
    if not MODES[args.old_logprob_mode].is_sampler:
        return
    if not args.use_vllm and not args.record_sampler_logprobs:
        raise ValueError("old_logprob_mode='sampler' needs the sampler's log-probs: set "
                         "record_sampler_logprobs=True (transformers generate) or use_vllm=True")
    if args.truncation_correction == "lift_sampler":
        raise ValueError("old_logprob_mode='sampler' with truncation_correction='lift_sampler': lifting needs the "
                         "old policy's kept mass, which only an old pass gives; use truncation_correction="
                         "'renormalize' (new and sampler log-probs both on the kept set)")
    if args.use_vllm and trl_field(args, "vllm_importance_sampling_correction"):
        warnings.warn("old_logprob_mode='sampler': vllm_importance_sampling_correction turned off; the old "
                      "log-probs are the sampler's, so TRL's importance-sampling ratio old/sampler is 1 by "
                      "construction", stacklevel=6)
        args.vllm_importance_sampling_correction = False


def _check_rollout_precision(args) -> None:
    """`rollout_precision` (`grpo_ratio.sampler.precision`) and `old_logprob_mode="integer"`, from the config alone.

    Raises:
        Problems (a `ValueError`): a value outside `ROLLOUT_PRECISIONS`; a copy with vLLM or transformers continuous
            batching (the copy draws on the `generate` path only) or with `routing_replay` (the sampler's routes
            would be the copy's) or with `score_centering="exact"` (its q is the policy's, not the copy's);
            `old_logprob_mode="integer"` without `rollout_precision="integer"` (there is no
            integer model to re-score with) or on RLOO (not wired there); with `rollout_precision="integer"`, a
            truncation correction (the integer sampler keeps its own kept sets, which are not recorded) or
            `ratio_attribution`.
    """
    value = args.rollout_precision
    if value not in ROLLOUT_PRECISIONS:
        raise Problems(_not_allowed("rollout_precision", value, ROLLOUT_PRECISIONS))
    problems = []
    if MODES[args.old_logprob_mode].integer and value != INTEGER_MODE:
        problems.append(f"old_logprob_mode={INTEGER_MODE!r} re-scores the rollouts with the integer model that drew "
                        f"them, but rollout_precision={value!r}; set rollout_precision={INTEGER_MODE!r}, or use "
                        f"another old_logprob_mode")
    if MODES[args.old_logprob_mode].integer and is_rloo(args):
        problems.append(f"old_logprob_mode={INTEGER_MODE!r} is not supported on RLOO; use it with RatioGRPOTrainer, "
                        f"or old_logprob_mode={SAMPLER_MODE!r} (the integer sampler's own log-probs)")
    if value != POLICY_ROLLOUTS:
        drawn = f"rollout_precision={value!r} draws the rollouts from a copy on the transformers generate path"
        allowed = f"allowed with it: {POLICY_ROLLOUTS!r} only"
        if args.use_vllm:
            problems.append(f"{drawn}, but use_vllm=True (vLLM draws them); set use_vllm=False, or rollout_precision="
                            f"{POLICY_ROLLOUTS!r} ({allowed}; vLLM's own quantization is set on its engine)")
        if getattr(args, "use_transformers_continuous_batching", False):
            problems.append(f"{drawn}, but use_transformers_continuous_batching=True; set it to False, or "
                            f"rollout_precision={POLICY_ROLLOUTS!r}")
        if args.routing_replay != "none":
            problems.append(f"{drawn}, but routing_replay={args.routing_replay!r} replays the policy's routes; set "
                            f"routing_replay='none', or rollout_precision={POLICY_ROLLOUTS!r}")
        if getattr(args, "score_centering", None) == "exact":
            problems.append(f"{drawn}, but score_centering='exact' recomputes the sampler's distribution from the "
                            f"policy's own forward, which is not the copy's; set score_centering='top_k' (the copy's "
                            f"recorded top-k log-probs), or rollout_precision={POLICY_ROLLOUTS!r}")
    if value == INTEGER_MODE:
        if getattr(args, "score_centering", None) is not None:
            problems.append(f"rollout_precision={INTEGER_MODE!r} with score_centering="
                            f"{args.score_centering!r}: the integer sampler records no top-k log-probs and its "
                            f"distribution is not the float policy's; unset score_centering, or use a float "
                            f"rollout_precision")
        if args.truncation_correction != "none":
            problems.append(f"rollout_precision={INTEGER_MODE!r} with truncation_correction="
                            f"{args.truncation_correction!r}: the integer sampler applies top_k / top_p in integers "
                            f"and records no kept sets; set truncation_correction='none' (with "
                            f"old_logprob_mode={INTEGER_MODE!r} the old pass applies the same integer filter)")
        if args.ratio_attribution not in (None, False, "false", "False"):
            problems.append(f"rollout_precision={INTEGER_MODE!r} with ratio_attribution is not supported (the "
                            f"attribution's chain has no integer term); unset ratio_attribution")
    if problems:
        raise Problems(problems)


def check_rollout_run(args, sampling, multi_turn: bool) -> None:
    """`rollout_precision="integer"` against the sampling settings generation really uses: the integer sampler
    implements temperature, top_k and top_p, sampled one row at a time.

    Raises:
        ValueError: greedy decoding or beam search, min_p, a logits processor (`repetition_penalty`, ...), or tools /
            an environment factory (multi-turn), naming `rollout_precision` and what works.
    """
    if args.rollout_precision != INTEGER_MODE:
        return
    unsupported = [f"num_beams={sampling.num_beams}"] if sampling.num_beams > 1 else []
    unsupported += [] if sampling.do_sample else ["do_sample=False"]
    unsupported += [f"min_p={sampling.min_p}"] if sampling.min_p > 0 else []
    unsupported += [f"{name}={value!r}" for name, value in sampling.processors]
    unsupported += ["tools or environment_factory (multi-turn)"] if multi_turn else []
    if unsupported:
        raise ValueError(f"rollout_precision={INTEGER_MODE!r}: the integer sampler implements temperature, top_k and "
                         f"top_p with single-turn sampling, but generation uses {', '.join(unsupported)}; remove "
                         f"them (generation_kwargs, the model's generation_config) or use another rollout_precision "
                         f"(allowed: {', '.join(ROLLOUT_PRECISIONS)})")


def check_rollout_copy(engine: str, policy: nn.Module, args) -> None:
    """What the copy of `rollout_precision` needs of the model and the engine, when the trainer starts.

    Raises:
        NotImplementedError: a copy under FSDP or DeepSpeed ZeRO-3 (the copy is made from whole parameters, which
            a sharded policy does not hold); a quantized base (the copy would cast quantized weights);
            `"integer"` with a PEFT adapter, or a model family the integer forward does not implement
            (`grpo_ratio.integer.FAMILIES`: Llama, Qwen2, Qwen3 with SiLU).
    """
    value = args.rollout_precision
    if value == POLICY_ROLLOUTS:
        return
    if engine in ("fsdp1", "fsdp2", "zero3"):
        raise NotImplementedError(f"rollout_precision={value!r} under {engine}: the copy is made from whole "
                                  f"parameters, which a sharded policy does not hold; use DDP or ZeRO-1/2, or "
                                  f"rollout_precision={POLICY_ROLLOUTS!r}")
    if is_quantized(policy):
        raise NotImplementedError(f"rollout_precision={value!r} on a quantized base model: the copy would cast "
                                  f"quantized weights; use rollout_precision={POLICY_ROLLOUTS!r}")
    if value != INTEGER_MODE:
        return
    from .integer.convert import FAMILIES

    if has_adapters(policy):
        raise NotImplementedError(f"rollout_precision={INTEGER_MODE!r} with a PEFT adapter is not supported (the "
                                  f"integer conversion reads plain weights); merge the adapter, or use "
                                  f"rollout_precision='bf16', 'fp16', 'int8', 'int4' or 'int2'")
    config = policy.config
    if config.model_type not in FAMILIES or getattr(config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"rollout_precision={INTEGER_MODE!r}: the integer forward implements "
                                  f"{', '.join(FAMILIES)} with SiLU, not model_type={config.model_type!r} "
                                  f"(hidden_act={getattr(config, 'hidden_act', None)!r}); use rollout_precision="
                                  f"'bf16', 'fp16', 'int8', 'int4' or 'int2'")


def _check_routing_replay(args) -> None:
    """Config-only checks of `routing_replay` (the model's family and the generation backend are checked when the
    trainer starts: `grpo_ratio.plan`, `grpo_ratio.routing`).

    Raises:
        ValueError: a value outside `ROUTING_REPLAY_MODES`; R2 with `old_logprob_mode="sampler"` (no old pass
            whose routes could be replayed; verl refuses R2 with its bypass mode, volcengine/verl#7805); R3 with
            vLLM server mode (TRL's `/v1/completions` client does not return vLLM's `routed_experts`) or vLLM
            tensor parallelism > 1 (the captured outputs would hold other ranks' rows).
    """
    mode = args.routing_replay
    if mode not in ROUTING_REPLAY_MODES:
        raise ValueError(f"routing_replay={mode!r} is not allowed; allowed: {', '.join(ROUTING_REPLAY_MODES)}")
    if mode == "R2" and args.old_logprob_mode == SAMPLER_MODE:
        raise ValueError("routing_replay='R2' replays the old pass's routes, but old_logprob_mode='sampler' runs "
                         "no old pass (verl refuses R2 with its bypass mode for the same reason); use "
                         "routing_replay='R3' (the sampler's routes) or a precision mode")
    if mode == "R3" and args.use_vllm and args.vllm_mode != "colocate":
        raise ValueError("routing_replay='R3' with vllm_mode='server': TRL's client calls vLLM's /v1/completions, "
                         "whose response carries no routed_experts; use vllm_mode='colocate' (the engine returns "
                         "them with enable_return_routed_experts) or transformers generate")
    if mode == "R3" and args.use_vllm and args.vllm_tensor_parallel_size != 1:
        raise ValueError(f"routing_replay='R3' with vLLM colocate supports vllm_tensor_parallel_size=1, got "
                         f"{args.vllm_tensor_parallel_size}")


def _check_truncation(args) -> None:
    """Config-only checks of `truncation_correction` against the generation backend and the sampling fields.

    Raises:
        ValueError: a correction without recorded kept sets (`record_sampler_logprobs=False` on the
            transformers path); with vLLM, server mode (TRL calls vLLM's OpenAI `/v1/completions`, whose response
            carries no sampling mask), tensor parallelism > 1 (the captured outputs would hold other ranks'
            rows) or top_k <= 0 (`_check_vllm_mask_top_k`).
    Warns (UserWarning): a `kept_set_source` other than "auto" without a correction (it has no effect).

    Checks that need the sampling settings generation really uses (on the transformers path the model's own
    `generation_config` fills unset fields) run when the trainer is built (`grpo_ratio.checks`).
    """
    correction = args.truncation_correction
    if correction == "none" and args.kept_set_source in ("recorded", "recompute"):
        warnings.warn(f"kept_set_source={args.kept_set_source!r} has no effect with truncation_correction='none': "
                      f"it chooses where a correction's kept sets come from; set truncation_correction="
                      f"'renormalize' or 'lift_sampler', or leave kept_set_source='auto'", stacklevel=6)
    if correction == "none" or args.resolved_kept_set_source == "recompute":
        return  # recomputed kept sets need nothing from the engine
    if not args.use_vllm:
        if not args.record_sampler_logprobs:
            raise ValueError(f"truncation_correction={correction!r} needs the kept sets recorded during "
                             f"generation: set record_sampler_logprobs=True")
        return
    if args.vllm_mode != "colocate":
        raise ValueError(
            f"truncation_correction={correction!r} with kept_set_source='recorded' and vllm_mode="
            f"{args.vllm_mode!r}: TRL talks to the vLLM server through /v1/completions, which returns no kept "
            f"sets. Use kept_set_source='recompute' (or 'auto'), or vllm_mode='colocate'."
        )
    if args.vllm_tensor_parallel_size != 1:
        raise ValueError(f"truncation_correction with vLLM colocate supports vllm_tensor_parallel_size=1, got "
                         f"{args.vllm_tensor_parallel_size}")
    _check_vllm_mask_top_k(args, correction)


def _check_vllm_mask_top_k(args, correction: str) -> None:
    """vLLM's sampling masks (`return_sampling_mask`, the `"recorded"` kept sets with vLLM) exist only for requests
    with top_k > 0: vLLM 0.33/0.34 refuse every other request at the first generation ("sampling distribution replay
    requires top_k > 0", vllm/v1/engine/input_processor.py), after the engine was built. TRL sends the same sampling
    fields for training and evaluation (GRPOConfig has no separate eval generation kwargs), and `generation_kwargs`
    overrides `top_k` in both.

    Raises:
        ValueError: the effective top_k (`generation_kwargs["top_k"]`, else `top_k`) is not > 0, naming where it was
            read and the two fixes.
    """
    gen = args.generation_kwargs if isinstance(args.generation_kwargs, dict) else {}
    where, top_k = ("generation_kwargs['top_k']", gen["top_k"]) if "top_k" in gen else ("top_k", args.top_k)
    if not top_k or top_k < 0:
        raise ValueError(f"truncation_correction={correction!r} with kept_set_source='recorded' on vLLM needs "
                         f"{where} > 0, got {top_k!r}: vLLM returns sampling masks only for requests with top_k > 0 "
                         f"and refuses the first training or evaluation request otherwise. Use "
                         f"kept_set_source='recompute' (the sampler's filter re-applied to the old policy's logits: "
                         f"nothing recorded, no host cost), or sample with a top_k > 0 you mean as part of the "
                         f"sampling: a top_k below the set top_p/min_p keep changes the distribution, and vLLM "
                         f"returns every kept id of every token as a Python int (~36 B each; top_k=1024 with top_p=1 "
                         f"is ~300 MB per 8,192-token completion)")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# TRL fields that TRL takes unchecked and that fail later, far from their cause: num_generations=0 is a
# ZeroDivisionError in GRPOConfig.__post_init__ (which needs >= 2 but divides by it first), learning_rate < 0 torch's
# AdamW error at the first step, max_completion_length=0 transformers' max_new_tokens error at the first generate, a
# batch size, accumulation or generation batch of 0 an empty batch, max_steps=0 whole epochs (transformers reads
# max_steps <= 0 as "train num_train_epochs"). {field: (allowed, test)}; grpo_ratio/cli/precheck.py `RANGES` refuses
# the same on the command line (tests/test_config.py keeps them in agreement).
TRL_FIELD_RULES = {
    "num_generations": ("an integer >= 2 (GRPO's advantage compares the completions of one prompt)",
                        lambda v: _whole(v) and v >= 2),
    "learning_rate": ("a number >= 0 (torch's optimizers refuse a negative one)", lambda v: _number(v) and v >= 0),
    "max_completion_length": ("an integer >= 1, or None", lambda v: v is None or (_whole(v) and v >= 1)),
    "per_device_train_batch_size": ("an integer >= 1", lambda v: _whole(v) and v >= 1),
    "gradient_accumulation_steps": ("an integer >= 1", lambda v: _whole(v) and v >= 1),
    "num_iterations": ("an integer >= 1 (optimizer updates per generation batch)", lambda v: _whole(v) and v >= 1),
    "steps_per_generation": ("an integer >= 1, or None (= gradient_accumulation_steps)",
                             lambda v: v is None or (_whole(v) and v >= 1)),
    "generation_batch_size": ("an integer >= 1, or None (= the effective training batch)",
                              lambda v: v is None or (_whole(v) and v >= 1)),
    "max_steps": ("-1 (train num_train_epochs) or an integer >= 1", lambda v: _whole(v) and (v == -1 or v >= 1)),
}


def check_trl_fields(args) -> None:
    """TRL's own fields that TRL, transformers or torch accept here and fail on later with a traceback that does not
    name them (`TRL_FIELD_RULES`: num_generations, learning_rate, max_completion_length, batch sizes, steps).
    `RatioGRPOConfig.__post_init__` runs it before TRL's own `__post_init__`, whose arithmetic would fail first.

    Raises:
        Problems (a `ValueError`): `<field>=<value> is not allowed; allowed: <rule>`, for every field out of its rule.
    """
    problems = [f"{name}={getattr(args, name)!r} is not allowed; allowed: {rule}"
                for name, (rule, ok) in TRL_FIELD_RULES.items() if not ok(getattr(args, name))]
    if problems:
        raise Problems(problems)


# ---------------------------------------------------------------------------------------------------------------------
# 2. the model and the trainer (RatioGRPOTrainer.__init__)


# module names of learned absolute position embeddings (GPT-2 `wpe`, OPT/BART `embed_positions`, BERT-style)
_ABSOLUTE_POSITION_MODULES = ("wpe", "embed_positions", "position_embeddings")


def check_sampling(args, sampling: SamplingSettings) -> None:
    """Truncated sampling against `truncation_correction`, with the settings generation really uses (`sampling`:
    on the transformers path unset fields come from the model's `generation_config`, e.g. a shipped `min_p`).

    (Beam search or greedy decoding with a correction is refused before the plan resolves, `check_run`.)

    Warns (UserWarning): a correction where sampling is neither truncated nor processed otherwise (it changes
        nothing; logits processors are `check_processors`'s); truncation that feeds
        the importance ratio (vLLM IS correction, `off_policy_mask_threshold` with `sampler_logprobs_in_loss`)
        uncorrected; truncation with no correction at all (the diagnostics will show the kept mass).
    """
    correction = args.truncation_correction
    if correction != "none" and not sampling.truncated and not sampling.processors:
        warnings.warn(f"truncation_correction={correction!r} has no effect: sampling is not truncated "
                      f"(top_p=1, top_k=0, no min_p in the {sampling.source}); ratio/kept_mass_mean will be 1",
                      stacklevel=3)
        return
    if correction != "none" or not sampling.truncated:
        return
    sampler_in_loss = (args.use_vllm and trl_field(args, "vllm_importance_sampling_correction")) or (
        trl_field(args, "off_policy_mask_threshold") is not None and (args.use_vllm or args.sampler_logprobs_in_loss))
    where = "sampler log-probs feed the importance ratio" if sampler_in_loss else "ratio/old_sampler/* will show it"
    warnings.warn(f"sampling is truncated ({sampling.describe()}, from the {sampling.source}) but "
                  f"truncation_correction='none': the sampler's log-probs are renormalised over the kept tokens, the "
                  f"trainer's are not, so old/sampler carries the kept mass ({where}; at top_p=0.8 about half the "
                  f"tokens leave [0.9, 1.1]). Set truncation_correction='renormalize' or 'lift_sampler'.", stacklevel=3)


def check_train_dataset(dataset) -> None:
    """Refuse a training set TRL would mishandle: an empty one (TRL trains 0 steps and exits 0; checked first, since a
    dataset built from no rows has no columns either) and one without a `prompt` column (TRL fails with a KeyError
    deep inside a step). Streamed datasets whose length or columns are unknown, and anything without
    `column_names`/`len` (TRL's own errors apply), pass.

    Raises:
        ValueError: "train_dataset is empty (0 rows)", no `prompt` column (naming the columns the dataset has), or a
            `prompt` column of non-text values (ints, floats, all-None: the tokenizer's raw error otherwise).
    """
    try:
        rows = len(dataset)
    except TypeError:  # a streamed dataset (or None): its length is not known
        rows = None
    columns = getattr(dataset, "column_names", None)
    if rows == 0:
        has = f"columns {', '.join(map(repr, columns))}" if isinstance(columns, list) and columns else "no columns"
        raise ValueError(f"train_dataset is empty (0 rows): there is nothing to train on ({has}); check what built it "
                         f"(a filter or select that kept no rows, an empty data file)")
    if isinstance(columns, list) and "prompt" not in columns:
        raise ValueError(f"train_dataset has no 'prompt' column (GRPO reads the prompts from it); its columns are: "
                         f"{', '.join(map(repr, columns)) or 'none'}. Rename one, e.g. dataset.rename_column("
                         f"'question', 'prompt'), or map your rows to {{'prompt': ...}}")
    feature = (getattr(dataset, "features", None) or {}).get("prompt")
    dtype = getattr(feature, "dtype", None) if type(feature).__name__ == "Value" else None
    if dtype is not None and dtype not in ("string", "large_string"):
        raise ValueError(f"train_dataset's 'prompt' column holds {dtype} values, not text: TRL's trainers tokenize each "
                         f"prompt, which must be a string or a conversation (a list of {{'role': ..., 'content': ...}} "
                         f"messages). Map the column to text, e.g. dataset.map(lambda row: {{'prompt': "
                         f"str(row['prompt'])}}), or build the prompts from the columns that hold them")


def check_dropout(args, model: nn.Module) -> None:
    """Warn when dropout is active in training (TRL's `disable_dropout=False`): the training forward samples dropout
    masks, so new/old at the first inner step measures dropout noise, not precision. grpo_ratio's scoring modes
    compute old log-probs without dropout (deterministic); TRL's own pass (`bf16` with an old pass) samples it."""
    if args.disable_dropout:
        return
    dropout = active_dropout(model)
    if dropout:
        warnings.warn(f"dropout is active during training ({', '.join(dropout)}) and disable_dropout=False: the "
                      f"training forward draws dropout masks, so new/old at the first inner step carries dropout noise "
                      f"(grpo_ratio's scoring modes score without dropout). Set disable_dropout=True for a ratio that "
                      f"measures precision only.", stacklevel=3)


def uses_absolute_positions(model: nn.Module) -> bool:
    """Whether the model adds learned absolute position embeddings (GPT-2 `wpe`, OPT `embed_positions`, ...)."""
    return any(isinstance(m, nn.Embedding) and name.split(".")[-1] in _ABSOLUTE_POSITION_MODULES
               for name, m in model.named_modules())


def check_positions(args, model: nn.Module) -> None:
    """Warn for models with absolute position embeddings: TRL passes no `position_ids`, so with left-padded prompts
    its own forward (the training forward, and the old pass of `bf16`) puts a completion at positions shifted by
    its prompt's padding, unlike `generate`. grpo_ratio's modes use generate's positions, so new/old shows it."""
    if uses_absolute_positions(model):
        warnings.warn(f"{type(model).__name__} uses absolute position embeddings and TRL passes no position_ids: with "
                      f"left-padded prompts TRL's training forward (and old_logprob_mode='bf16') scores completions at "
                      f"positions shifted by their prompt's padding, while generate and grpo_ratio's other scoring "
                      f"modes count positions from the attention mask. Expect new/old to show this; prompts of one "
                      f"length (no left padding) avoid it (docs/compatibility.md).", stacklevel=3)


def old_side_dtype(args, trainer_dtype: torch.dtype) -> torch.dtype:
    """The precision of the old log-probs' LM head: fp32 for the fp32 modes, fp16 for `fp16_clone`, the training
    forward's for `bf16` and `sampler` (whose new side is the training forward)."""
    if args.old_logprob_mode in (FP32_CLONE.name, FP32_HEAD.name, GUIDED_FP32.name) or trl_field(
            args, "cast_lm_head_to_fp32"):
        return torch.float32
    return torch.float16 if args.old_logprob_mode == FP16_CLONE.name else trainer_dtype


def old_body_dtype(args, trainer_dtype: torch.dtype) -> torch.dtype:
    """The precision of the old log-probs' body (the decoder layers): fp32 for `fp32_clone`, fp16 for `fp16_clone`,
    the training forward's otherwise (`fp32_head` and `guided_fp32` upcast only the head and a few layers)."""
    return {FP32_CLONE.name: torch.float32, FP16_CLONE.name: torch.float16}.get(args.old_logprob_mode, trainer_dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_vllm(args, engine_dtype: torch.dtype | None, trainer_dtype: torch.dtype,
               engine_head_dtype: torch.dtype | None = None) -> None:
    """Sampler/trainer mismatches that cost a run before it starts, with vLLM.

    Args:
        engine_dtype: the colocate engine's `model_config.dtype`; None in server mode (unknown here).
        engine_head_dtype: its `model_config.head_dtype` (fp32 with `vllm_lm_head_fp32`); None = `engine_dtype`.

    Warns (UserWarning): the engine's body samples in another dtype than the trainer's old log-probs (TRL passes
    none: vLLM downcasts an fp32 checkpoint; on SmolLM2 a bf16 engine is 0.26 nats off an fp32 trainer, an fp32
    engine 3e-5); with the bodies alike, an fp32 LM head on one side only (the trainer's `fp32_head`/`guided_fp32`/
    `cast_lm_head_to_fp32`, or the sampler's `vllm_lm_head_fp32`): it moves the old/sampler gap rather than closing it
    (NeMo-RL #3936; prime-rl runs both heads in fp32), and the message names the other side's switch;
    `lift_sampler` with TRL's own `sampling/importance_sampling_ratio/*`, which TRL computes before the lift (the
    weights the loss uses are logged as `ratio/importance_sampling_ratio/*`); server mode, where the engine's dtypes
    cannot be read here (the message names the `vllm serve` flags).
    """
    if not args.use_vllm:
        return
    body, head = old_body_dtype(args, trainer_dtype), old_side_dtype(args, trainer_dtype)
    if engine_dtype is not None and engine_dtype != body:
        warnings.warn(f"vLLM samples in {engine_dtype} but the old log-probs are computed in {body} "
                      f"(old_logprob_mode={args.old_logprob_mode!r}, bf16={args.bf16}): old/sampler and TRL's "
                      f"importance-sampling ratio carry that precision gap. Set vllm_dtype={_name(body)!r} to sample "
                      f"in the same dtype.", stacklevel=3)
    if engine_dtype is None and args.vllm_mode == "server":
        head_flag = f" {VLLM_FP32_HEAD_FLAG}" if head == torch.float32 and body != torch.float32 else ""
        warnings.warn(f"vLLM server mode: the engine's dtype is set where the server starts; start it with `trl "
                      f"vllm-serve --dtype {_name(body)}{head_flag}` so that the sampler matches the old log-probs "
                      f"({body} body, {head} LM head)", stacklevel=3)
    engine_head = engine_head_dtype or engine_dtype
    if engine_dtype is None or engine_dtype != body or engine_head == head:
        pass  # no engine to compare, the body lint above already names the fix, or the heads agree
    elif head == torch.float32:
        warnings.warn(f"an fp32 LM head on the trainer side only (old_logprob_mode={args.old_logprob_mode!r}, "
                      f"cast_lm_head_to_fp32={trl_field(args, 'cast_lm_head_to_fp32')}) while vLLM runs its head in {engine_head}: "
                      f"an fp32 head on one side moves the old/sampler gap rather than closing it. Set "
                      f"vllm_lm_head_fp32=True (a server: {VLLM_FP32_HEAD_FLAG}) for the sampler-side counterpart",
                      stacklevel=3)
    elif engine_head == torch.float32:
        warnings.warn(f"an fp32 LM head on the sampler side only (vllm_lm_head_fp32=True) while the old log-probs "
                      f"use a {head} head (old_logprob_mode={args.old_logprob_mode!r}): an fp32 head on one side "
                      f"moves the old/sampler gap rather than closing it. Set old_logprob_mode='fp32_head' (or "
                      f"cast_lm_head_to_fp32=True) for the trainer-side counterpart", stacklevel=3)
    if args.truncation_correction == "lift_sampler" and trl_field(args, "vllm_importance_sampling_correction"):
        warnings.warn("truncation_correction='lift_sampler': TRL computes its logged sampling/importance_sampling_"
                      "ratio/* before the lift (it still carries the kept mass); the lifted weights the loss uses "
                      "are logged as ratio/importance_sampling_ratio/*", stacklevel=3)


def _model_key(name: str) -> str:
    """A model's name without owner or location, lower-cased, so that a hub id, its hub-cache snapshot
    (`.../models--Owner--Name/snapshots/<hash>`) and a converted copy (`~/.cache/grpo_ratio/Name`) compare equal."""
    hub_cache = re.search(r"models--([^/\\]+)", name)
    if hub_cache:
        name = hub_cache.group(1).replace("--", "/")
    return Path(name.rstrip("/\\")).name.lower()


def check_calibration(args, model: nn.Module) -> None:
    """A `guided_fp32_layers` calibration file against the model being trained (`args.guided_fp32_calibration`,
    kept by `RatioGRPOConfig` when `guided_fp32_layers` is a file; nothing to check otherwise).

    Raises:
        ValueError: the file was measured on a model with another number of decoder layers: its layer choice (and
            even its indices) belong to another architecture.
    Warns (UserWarning): the file names another model (same layer count): the layers that carry the batch-shape
        divergence differ between models, so its choice may not be the right one for this model.
    """
    calibration = getattr(args, "guided_fp32_calibration", None)
    if not calibration:
        return
    num_layers = len(model_anatomy(model).layers)
    path, recorded = calibration["path"], calibration.get("model")
    fix = (f"measure this model with `grpo-ratio probe calibrate --model <it> --calibration-out FILE` and pass FILE, "
           f"or pass layer indices (guided_fp32_layers='0,{num_layers - 1}')")
    if calibration.get("num_layers") is not None and calibration["num_layers"] != num_layers:
        raise ValueError(f"guided_fp32_layers={path!r} is a calibration for {recorded or 'another model'} with "
                         f"{calibration['num_layers']} decoder layers, but the trained model has {num_layers}; "
                         f"{fix}")
    name = getattr(getattr(model, "config", None), "name_or_path", "") or ""
    if recorded and name and _model_key(recorded) != _model_key(name):
        warnings.warn(f"guided_fp32_layers={path!r} is a calibration for model {recorded!r}, but the trained model is "
                      f"{name!r}: the layers that carry the bf16 batch-shape divergence differ between models, so its "
                      f"choice {args.guided_fp32_layer_ids} may not suit this one; {fix}", stacklevel=3)


def colocate_engine_dtypes(trainer) -> tuple:
    """(dtype, LM head dtype) of a trainer's colocate vLLM engine (vLLM's resolved `model_config.dtype`,
    `.head_dtype`), or (None, None) without one (server mode: unknown here)."""
    if not (trainer.use_vllm and trainer.vllm_mode == "colocate"):
        return None, None
    config = trainer.vllm_generation.llm.llm_engine.model_config
    return config.dtype, getattr(config, "head_dtype", config.dtype)


def training_dtype(args, policy: nn.Module) -> torch.dtype:
    """The dtype the training forward computes in: the autocast dtype (TRL's `bf16`/`fp16`), else the weights'."""
    if args.bf16:
        return torch.bfloat16
    if args.fp16:
        return torch.float16
    return next(policy.parameters()).dtype


def check_fsdp2_rounding(engine: str, args, anchor_is_policy: bool) -> None:
    """Warn that FSDP2 with a bf16 mixed-precision policy rounds TRL's per-token log-probs to bf16 where the old side
    is the policy's own pass (`bf16`, `sampler`); the other modes return fp32 (docs/distributed.md)."""
    if engine == "fsdp2" and args.bf16 and anchor_is_policy:
        warnings.warn("FSDP2 with a bf16 mixed-precision policy returns TRL's per-token log-probs rounded to bf16 "
                      "(up to 1.5e-2 nats, on both sides of every ratio). old_logprob_mode='bf16' keeps TRL's numbers "
                      "bit for bit, rounding included; every other mode returns the training forward's log-probs in "
                      "fp32 (docs/distributed.md)", stacklevel=4)


def check_cpu_precision(args, device_type: str) -> None:
    """Say before training (a `grpo_ratio` logger warning, once per process; not a Python warning, which test suites
    turn into errors) when bf16/fp16 autocast runs on a CPU without native bf16: every step is emulated and many times
    slower than in fp32, which is not the cost a GPU pays."""
    global _said_cpu_precision
    if device_type != "cpu" or not (args.bf16 or args.fp16) or _said_cpu_precision or cpu_has_native_bf16():
        return
    _said_cpu_precision = True
    logging.getLogger("grpo_ratio").warning(
        "%s=True on a CPU without native bf16 (no AVX512-BF16/AMX): autocast is emulated and each step is many times "
        "slower than in fp32 (times do not carry over to a GPU). The ratio is then measured at that precision, as the "
        "precision arms intend; for a quick look at the diagnostics use bf16=False "
        "(recipes/smollm2-135m/quickstart_cpu.yaml)", "bf16" if args.bf16 else "fp16")


_said_cpu_precision = False


def check_mode_precision(args, trainer_dtype: torch.dtype) -> None:
    """Say before training (a `grpo_ratio` logger warning, as `check_cpu_precision`) when the scoring mode cannot close
    a gap because the training forward already runs in fp32 (`bf16=False`, `fp16=False`, fp32 weights): the fp32 modes
    then compute the policy's own log-probs again (the same up to fp32 rounding: cost, no effect), and `fp16_clone`
    rounds them to fp16, which opens a gap (new/old out of band, clip flips) instead of closing one."""
    mode = args.old_logprob_mode
    if trainer_dtype != torch.float32 or mode not in (FP32_CLONE.name, FP32_HEAD.name, GUIDED_FP32.name, FP16_CLONE.name):
        return
    what = ("rounds the old log-probs to fp16: it opens a precision gap (new/old out of band, PPO clip flips) "
            "instead of closing one" if mode == FP16_CLONE.name else
            "computes the policy's own fp32 log-probs again: the same up to fp32 rounding, so the mode adds cost "
            "and no effect")
    logging.getLogger("grpo_ratio").warning(
        "old_logprob_mode=%r with a training forward in fp32 (bf16=False, fp16=False, fp32 weights) %s. The scoring "
        "modes are for bf16/fp16 training; in fp32 use old_logprob_mode='bf16' (TRL's own, r = 1 exactly)", mode, what)


def sampler_logprob_uses(args) -> list[str]:
    """The settings that compute with the sampler's per-token log-probs beyond the diagnostics, as `field=value`: the
    sampler arm (they are the old log-probs), `lift_sampler` (they are lifted by log M_old), an `is_correction`
    (they are the weight's denominator) and `score_centering="top_k"` (the sampler's top-k are q)."""
    uses = [f"old_logprob_mode={SAMPLER_MODE!r}"] if MODES[args.old_logprob_mode].is_sampler else []
    if args.truncation_correction == "lift_sampler":
        uses.append("truncation_correction='lift_sampler'")
    if getattr(args, "is_correction_spec", None) is not None:
        uses.append(f"is_correction={args.is_correction!r}")
    if getattr(args, "score_centering", None) == "top_k":
        uses.append("score_centering='top_k'")
    return uses


def check_server_logprobs(trainer) -> None:
    """vLLM server mode where the run computes with the sampler's log-probs (`sampler_logprob_uses`): refuse a
    server that does not return processed log-probs. `vllm serve` defaults to `--logprobs-mode raw_logprobs` (the
    model's distribution before temperature, penalties and top_k/top_p/min_p); `trl vllm-serve` passes
    `processed_logprobs`. TRL reads the mode only for its own IS correction, and only warns; the sampler arm turns
    that correction off. The main process asks the server (`VLLMClient.get_server_info()`, its `/server_info`), as
    TRL does; every process learns the answer, so all of them stop.

    Raises:
        ValueError: the server's `logprobs_mode` is not `processed_logprobs`, naming the settings that need it and
            the flag.
    """
    args = trainer.args
    uses = sampler_logprob_uses(args)
    if not (args.use_vllm and args.vllm_mode == "server" and uses):
        return
    client = getattr(getattr(trainer, "vllm_generation", None), "vllm_client", None)  # the main process's
    _refuse_unprocessed_logprobs(uses, client, trainer.accelerator.num_processes)


def async_sampler_logprob_uses(args) -> list[str]:
    """The settings of a `RatioAsyncGRPOConfig` that compute with the server's behaviour log-probs beyond TRL's own
    loss, as `field=value`: a decoupled objective (the behaviour -> proximal IS weight exp(proximal - behaviour), and
    A-3PO's proximal interpolated from the behaviour log-probs), `lift_sampler` (they are lifted by log M),
    an `is_correction` (the weight's denominator). `"coupled"` is TRL's loss: none."""
    uses = [f"async_objective={args.async_objective!r}"] if args.decoupled else []
    if args.truncation_correction == "lift_sampler":
        uses.append("truncation_correction='lift_sampler'")
    if getattr(args, "is_correction_spec", None) is not None:
        uses.append(f"is_correction={args.is_correction!r}")
    return uses


def check_async_server_logprobs(trainer) -> None:
    """`RatioAsyncGRPOTrainer`: where the run computes with the server's behaviour log-probs
    (`async_sampler_logprob_uses`), refuse a server that does not return processed log-probs, as
    `check_server_logprobs` does for GRPO/RLOO. TRL's async rollout worker asks `/v1/completions` for the sampled
    tokens' log-probs and reads no `logprobs_mode`; `vllm serve` defaults to `raw_logprobs`. The main process waits
    for the server (`VLLMClient.wait_for_server_ready`, as TRL's own start-up probes do) and asks `/server_info`;
    every process learns the answer, so all of them stop. Nothing is asked with `async_objective="coupled"` and no
    `lift_sampler`.

    Raises:
        ValueError: the server's `logprobs_mode` is not `processed_logprobs`, naming the settings that need it and
            the flag.
    """
    uses = async_sampler_logprob_uses(trainer.args)
    if not uses:
        return
    client = getattr(trainer, "vllm_client", None)  # TRL builds it on the main process only
    if client is not None:
        client.wait_for_server_ready()
    _refuse_unprocessed_logprobs(uses, client, trainer.accelerator.num_processes)


def _refuse_unprocessed_logprobs(uses: list[str], client, num_processes: int) -> None:
    """Ask the server's `logprobs_mode` on the process holding `client` (TRL's GRPO client or its async one: both
    return `/server_info`'s `vllm_config`), broadcast it, raise unless it is `processed_logprobs`."""
    mode = client.get_server_info()["model_config"]["logprobs_mode"] if client is not None else None
    if num_processes > 1:
        from accelerate.utils import broadcast_object_list

        mode = broadcast_object_list([mode], from_process=0)[0]
    if mode != "processed_logprobs":
        url = getattr(client, "base_url", None) or getattr(client, "server_url", None)
        where = f" at {url}" if url else ""
        raise ValueError(f"{', '.join(uses)} computes with the vLLM server's sampler log-probs, but the server{where} "
                         f"runs with --logprobs-mode {mode}: it returns the log-probs of another distribution than "
                         f"the one it sampled from (raw_logprobs, plain `vllm serve`'s default: before temperature, "
                         f"penalties and top_k/top_p/min_p). Restart it with `--logprobs-mode processed_logprobs` "
                         f"(`trl vllm-serve` passes it)")


def check_r2_has_an_old_pass(plan) -> None:
    """Warn when `routing_replay="R2"` has nothing to replay: R2 replays the old pass's routes in the updates, and in
    TRL's on-policy default with `old_logprob_mode="bf16"` (or `fp32_head` fused) no old pass runs; the one update
    per generation is the old policy's forward itself."""
    if plan.routing_replay == "R2" and not plan.runs_old_pass:
        warnings.warn("routing_replay='R2' has nothing to replay in this run: no old pass runs (TRL's on-policy "
                      "default: num_iterations=1, steps_per_generation == gradient_accumulation_steps, and "
                      f"old_logprob_mode={plan.scorer_mode or 'bf16'!r} "
                      "without one), so the only update of each generation routes as the old policy. R2 acts with "
                      "num_iterations > 1 or a scoring mode's old pass; routing_replay='R3' replays the sampler's "
                      "routes (docs/moe.md)", stacklevel=4)


def lint_trainer(trainer, policy: nn.Module) -> None:
    """Every start-up check of a `RatioGRPOTrainer` that needs the model (the config-only ones ran in the config):
    the LM head for a correction, the sampling settings and logits processors the rollouts use, dropout, positions,
    a calibration file made for another model, the vLLM engine's dtypes and the server's log-probs, FSDP2's bf16
    rounding, a scoring mode in an fp32 run, a copy mode on a quantized base, fp32 passes under FlashAttention, an engine
    other than the one the launch asked for. Warns or raises as each check documents."""
    args, sampling, plan = trainer.args, trainer.plan.sampling, trainer.plan
    check_head_is_linear(args.truncation_correction, policy.config)
    check_sampling(args, sampling)
    check_processors(dict(sampling.processors), plan.correction, plan.records_kept_sets, sampling.source,
                     VLLM_PROCESSORS if sampling.engine == "vllm" else PROCESSORS)
    check_dropout(args, policy)
    check_positions(args, policy)
    check_calibration(args, policy)
    engine_dtype, engine_head_dtype = colocate_engine_dtypes(trainer)
    trainer_dtype = training_dtype(args, policy)
    check_vllm(args, engine_dtype, trainer_dtype, engine_head_dtype)
    check_server_logprobs(trainer)
    check_fsdp2_rounding(engine_of(trainer.accelerator), args, plan.anchor_is_policy)
    check_cpu_precision(args, trainer.accelerator.device.type)
    check_mode_precision(args, trainer_dtype)
    for use in scoring_uses(args):  # old_logprob_mode's, and ratio_attribution's fp32 reference
        check_quantized_copy(policy, use.mode, use)
        check_fp32_attention(policy, use.mode, use)
    check_r2_has_an_old_pass(plan)
    check_engine(trainer.accelerator)


def engine_asked() -> list[str]:
    """The sharding engines the launch asked accelerate for: `"FSDP"` / `"DeepSpeed"` where `ACCELERATE_USE_FSDP` /
    `ACCELERATE_USE_DEEPSPEED` is true (`accelerate launch` sets them from its config file; transformers'
    `TrainingArguments` from `fsdp` / `deepspeed`)."""
    import os

    wanted = (("FSDP", "ACCELERATE_USE_FSDP"), ("DeepSpeed", "ACCELERATE_USE_DEEPSPEED"))
    return [name for name, var in wanted if os.environ.get(var, "false").lower() in ("1", "true", "yes")]


def check_engine(accelerator) -> str | None:
    """Say at start (a `grpo_ratio` logger warning) when the launch asked for FSDP or DeepSpeed and accelerate set up
    another engine: on a CPU accelerate 1.16 keeps `MULTI_CPU` under an FSDP config (FSDP is set only in its GPU
    branches) and trains plain DDP, every process holding the whole model, with nothing else said. Accelerate's state
    is final once the trainer is built and decides how `prepare` wraps the model in `train()`, so this is said before
    any step. Returns the message, or None.
    """
    from accelerate.utils import DistributedType

    asked = engine_asked()
    got = accelerator.state.distributed_type
    if not asked or got in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        return None
    n = accelerator.num_processes
    named = {DistributedType.NO: "a single process, no distributed engine",
             DistributedType.MULTI_CPU: f"plain DDP on {n} CPU processes (gloo)",
             DistributedType.MULTI_GPU: f"plain DDP on {n} GPUs"}.get(got, f"{got} on {n} processes")
    message = (f"the launch asked for {' and '.join(asked)} (accelerate config / ACCELERATE_USE_* environment), but "
               f"accelerate set up {named} (distributed_type={got.value}): the model will not be sharded, every "
               f"process holds and trains all of it. On CPU processes accelerate sets up FSDP and DeepSpeed in its "
               f"GPU branches only (docs/distributed.md, 'What is tested, and how'); use a GPU machine, or "
               f"a DDP config to say what runs")
    logging.getLogger("grpo_ratio").warning(message)
    return message


def check_centering_engine(args, engine: str) -> None:
    """Refuse `score_centering` on a sharded policy (FSDP, DeepSpeed ZeRO-3): its centring term projects the hidden
    states through the LM head's weight outside the model's forward, where those engines hold only a shard of it.

    Raises:
        NotImplementedError: naming the field, the engine and what works.
    """
    kind = getattr(args, "score_centering", None)
    if kind is not None and engine in ("fsdp1", "fsdp2", "zero3"):
        raise NotImplementedError(f"score_centering={kind!r} projects the training forward's hidden states through "
                                  f"the LM head outside the model's forward, where {engine} holds only a shard of its "
                                  "weight; train unsharded (DDP or one process) or unset score_centering")


def check_train_again(engine: str, trained: bool) -> None:
    """Refuse a second `train()` of one trainer under DeepSpeed ZeRO-3 before it starts: it fails in stock TRL too,
    deep inside transformers (accelerate's `deepspeed_engine_wrapped` is None after the first run's engine is torn
    down), after the model was re-prepared.

    Raises:
        RuntimeError: naming ZeRO-3 and what works (a new trainer, resuming from a checkpoint).
    """
    if engine == "zero3" and trained:
        raise RuntimeError("train() was already called on this trainer, and under DeepSpeed ZeRO-3 a second train() "
                           "cannot run (stock TRL's GRPOTrainer fails there too: the first run's DeepSpeed engine is "
                           "gone). Build a new trainer for the next run; to continue this one, save checkpoints "
                           "(save_strategy) and pass train(resume_from_checkpoint=...) to the new trainer")


def check_sharded_mode(accelerator, model: nn.Module, args) -> None:
    """Refuse at start-up the sharded combinations in which a mode the run scores with (`scoring_uses`:
    `args.old_logprob_mode`, and `ratio_attribution`'s `fp32_clone` reference) cannot be made exact.

    `bf16` is TRL's own pass and always allowed. Checked before accelerate wraps the model (in the trainer's
    `__init__`), from accelerate's state and the config.

    Raises:
        NotImplementedError: FSDP1 (use `fsdp_version: 2`); a PEFT adapter under FSDP2 or ZeRO-3; fp16 mixed
            precision (`fp16=True`) under FSDP2 or ZeRO-3; parameter offload to CPU (`fsdp_offload_params`, ZeRO-3
            `offload_param`); DeepSpeed's `torch_autocast`; under ZeRO-3, frozen parameters where the mode copies
            from the fp32 masters (bf16 engines, or `fp16_clone`); `copy_storage="per_layer"` (the copies are the
            engine's sharded shadows). Each message names the setting (`old_logprob_mode` or `ratio_attribution`),
            the combination and what works.
    """
    engine = engine_of(accelerator)
    if engine == "none":
        return
    for use in scoring_uses(args):
        if not MODES[use.mode].trl_pass:
            _check_sharded_use(use, engine, accelerator, model, args)


def _check_sharded_use(use: ScoringUse, engine: str, accelerator, model: nn.Module, args) -> None:
    name = {"fsdp1": "FSDP1", "fsdp2": "FSDP2", "zero3": "DeepSpeed ZeRO-3"}[engine]
    if engine == "fsdp1":
        _refuse(use, name, "FSDP1 is not supported", "set `fsdp_version: 2` (recipes/accelerate_configs/fsdp2.yaml)")
    if has_adapters(model):
        _refuse(use, name, "a PEFT adapter is not supported there (the shadows would need the adapters merged "
                "across shards)", f"use DDP or ZeRO-2 (parameters replicated), or {use.off}")
    if args.fp16:
        _refuse(use, name, "fp16 mixed precision (fp16=True) is not supported", "use bf16=True or bf16=False")
    if use.copy_storage == "per_layer":  # the attribution's reference uses the shadows here (None)
        _refuse(use, name, "copy_storage='per_layer' is not supported (the copies are the engine's sharded shadows)",
                "use copy_storage='resident'")
    if engine == "fsdp2":
        _check_fsdp2(use, name, accelerator.state.fsdp_plugin)
    else:
        _check_zero3(use, name, accelerator.state.deepspeed_plugin.deepspeed_config, model)


def _check_fsdp2(use: ScoringUse, name: str, plugin) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):  # the shadows and policy swaps assume on-device shards
        _refuse(use, name, "parameter offload (fsdp_offload_params) is not supported",
                f"turn offload off, or {use.off}")


def _check_zero3(use: ScoringUse, name: str, ds_config: dict, model: nn.Module) -> None:
    offload = ds_config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    if str(offload).lower() not in ("none", "auto"):  # the shadows' refresh reads on-device partitions
        _refuse(use, name, "parameter offload (offload_param) is not supported",
                f"turn offload_param off, or {use.off}")
    if ds_config.get("torch_autocast", {}).get("enabled", False) is True:  # fp32 weights, bf16 compute: untested
        _refuse(use, name, "DeepSpeed's torch_autocast is not supported", "use the bf16 section instead")
    # bf16 engines hold fp32 only as the optimizer's masters; fp16_clone copies from them in any precision
    needs_master = (ds_config.get("bf16", {}).get("enabled", False) is True
                    or MODES[use.mode].whole_model_dtype == "fp16")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if needs_master and frozen:
        _refuse(use, name, f"frozen parameters ({frozen[0]}, ...) have no fp32 master partition to copy from",
                f"train every parameter, or {use.off}")


def _refuse(use: ScoringUse, engine: str, why: str, instead: str):
    raise NotImplementedError(f"{use.subject} under {engine}: {why}; {instead} (docs/distributed.md)")


def check_old_pass(policy: nn.Module, args) -> None:
    """What each scorer the run builds needs of this model (decoder-layer indices, the model's anatomy, the copy
    storage): the scoring mode's and `ratio_attribution`'s `fp32_clone` reference (`scoring_uses`), checked when the
    trainer starts rather than at the first old pass; the scorers themselves are built on first use, after accelerate
    wrapped the model (`grpo_ratio.old_pass.scorer.check_scorer_setup`, which their constructor runs too).

    Raises:
        ValueError, NotImplementedError: as `check_scorer_setup`, the message prefixed by the setting that builds
            the scorer when that is `ratio_attribution`.
    """
    for use in scoring_uses(args):
        if not MODES[use.mode].has_scorer:
            continue
        layers = args.guided_fp32_layer_ids if use.field == "old_logprob_mode" else None
        try:
            check_scorer_setup(policy, use.mode, layers, use.copy_storage or reference_copy_storage(False))
        except (ValueError, NotImplementedError) as err:
            if use.field == "old_logprob_mode":
                raise
            raise type(err)(f"{use.subject}: {err}; or {use.off}") from err


def _check_centering_fields(args, variants=VARIANTS) -> str | None:
    """`score_centering` and its two companions, shared by every trainer: the allowed values, the companions only
    with `"top_k"`, k >= 1. Returns the variant (None: off). Raises ValueError."""
    kind = getattr(args, "score_centering", None)
    companions = {f: getattr(args, f, None) for f in ("score_centering_top_k", "score_centering_tail")}
    given = [f for f, v in companions.items() if v is not None]
    if kind is None:
        if given:
            raise ValueError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with "
                             f"score_centering='top_k'")
        return None
    if kind not in variants:
        raise ValueError(_not_allowed("score_centering", kind, variants) + " (or unset)")
    if kind != "top_k" and given:
        raise ValueError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with "
                         f"score_centering='top_k', but score_centering={kind!r}")
    k = companions["score_centering_top_k"]
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"score_centering_top_k must be an integer >= 1, got {k!r}")
    tail = companions["score_centering_tail"]
    if tail is not None and tail not in TAILS:
        raise ValueError(_not_allowed("score_centering_tail", tail, TAILS))
    return kind


def _check_score_centering(args) -> None:
    """`score_centering` on GRPO / RLOO (`grpo_ratio.corrections.centering`): where the sampler's distribution can
    be had. "exact" recomputes it from the training forward, so that forward must run the weights that sampled, on
    the sampler's own path: `generate` (not vLLM, whose engine is not the trainer's forward), one optimizer update per
    generation. "top_k" records the sampler's top-k during `generate`, or asks vLLM for them (`logprobs=k`,
    `sampler.vllm.VLLMLogprobCapture`; a server must allow k: `trl vllm-serve` passes `--max-logprobs -1`).

    Raises:
        ValueError: an unknown value or companion field (the allowed values named); the combinations above;
            `"exact"` with vLLM (it would recompute the trainer's distribution, not vLLM's); `"top_k"` with
            `truncation_correction="renormalize"` (the policy's log-probs are then over the kept sets, which the
            top-k do not describe), with vLLM and a multi-turn `vllm_generation` (not here: `check_run`), or on the
            generate path without `record_sampler_logprobs`.
    """
    kind = _check_centering_fields(args)
    if kind is None:
        return
    if args.use_vllm and kind == "exact":
        raise ValueError("score_centering='exact' recomputes the sampler's distribution from the training forward, "
                         "which with vLLM is the trainer's, not vLLM's; use score_centering='top_k' (vLLM's own top-k "
                         "log-probs, logprobs=k) or the transformers generate path (use_vllm=False)")
    if getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError(f"score_centering={kind!r} needs the generate path's rows and recording, which transformers "
                         "continuous batching does not give; set use_transformers_continuous_batching=False")
    if kind == "exact":
        if args.num_iterations != 1 or args.steps_per_generation != args.gradient_accumulation_steps:
            raise ValueError(f"score_centering='exact' recomputes the sampler's distribution in the training forward, "
                             f"which runs the weights that sampled only with one optimizer update per generation, but "
                             f"num_iterations={args.num_iterations}, steps_per_generation={args.steps_per_generation}, "
                             f"gradient_accumulation_steps={args.gradient_accumulation_steps}; set num_iterations=1 "
                             f"and steps_per_generation=gradient_accumulation_steps, or use score_centering='top_k'")
        return
    if args.truncation_correction == "renormalize":
        raise ValueError("score_centering='top_k' centres the full-vocabulary score, but "
                         "truncation_correction='renormalize' trains the log-probs over the kept sets; use "
                         "score_centering='exact' (the kept sets known) or truncation_correction='lift_sampler'")
    if not args.record_sampler_logprobs and not args.use_vllm:
        raise ValueError("score_centering='top_k' records the sampler's top-k log-probs during generate, but "
                         "record_sampler_logprobs=False; set record_sampler_logprobs=True")


def _check_async_centering(args) -> None:
    """`score_centering` on the asynchronous trainer: `"exact"` only (the server's filter re-applied to the training
    forward's logits; centred where a term's staleness is 0, where the forward runs the sampling weights), and not
    with a repetition penalty on the server. Raises ValueError."""
    kind = _check_centering_fields(args, variants=("exact",))
    if kind is not None and args.repetition_penalty not in (None, 1.0):
        raise ValueError(f"score_centering={kind!r} recomputes the server's distribution without its repetition "
                         f"penalty ({args.repetition_penalty}); set repetition_penalty=1.0 or unset score_centering")


def check_run(args, sampling, backend: str, multi_turn: bool) -> None:
    """What needs the generation backend and the sampling settings generation really uses (on the transformers path
    the model's own `generation_config` fills unset fields), checked before the trainer resolves its
    `grpo_ratio.plan.RunPlan`.

    Args:
        args: the `RatioGRPOConfig`. sampling: its `SamplingSettings`. backend: `plan.GENERATE`,
            `plan.CONTINUOUS_BATCHING` or `plan.VLLM`. multi_turn: tools or an environment factory.
    Raises:
        ValueError: `old_logprob_mode="sampler"` with continuous batching (no sampler log-probs); a truncation
            correction, `sampler_logprobs_in_loss`, the sampler arm or an IS correction with beam search or greedy
            decoding (no per-token sampling distribution); recorded kept sets with multi-turn `generate` (turns not
            stitched); `routing_replay="R3"` where the sampler's routes cannot be had (continuous batching, beam
            search, multi-turn `generate`).
    Warns (UserWarning): `record_sampler_logprobs` on with beam search or greedy decoding (nothing recorded).
    """
    if backend == CONTINUOUS_BATCHING and MODES[args.old_logprob_mode].is_sampler:
        raise ValueError("old_logprob_mode='sampler' needs the sampler's log-probs, which transformers continuous "
                         "batching does not return; use generate (use_transformers_continuous_batching=False) "
                         "or vLLM")
    recording = backend == GENERATE and args.record_sampler_logprobs
    _check_sampled(args, sampling, recording)
    if recording and (sampling.num_beams > 1 or not sampling.do_sample):
        warnings.warn(f"record_sampler_logprobs: not recording (num_beams={sampling.num_beams}, do_sample="
                      f"{sampling.do_sample}): beam search and greedy decoding have no per-token sampling "
                      f"distribution; ratio/old_sampler/* will be absent", stacklevel=4)
    if multi_turn and kept_set_origin(args) == RECORDED and backend == GENERATE:
        raise ValueError("truncation_correction with tools or environment_factory is not supported on the "
                         "transformers generate path: each tool turn is a separate generate call and the kept sets "
                         "of the turns are not stitched together; set kept_set_source='recompute'")
    why = ("transformers continuous batching (its batches are not the trainer's rows)" if backend == CONTINUOUS_BATCHING
           else f"beam search (num_beams={sampling.num_beams} reorders the rows)" if sampling.num_beams > 1
           else "tools or environment_factory (each turn is a separate generate call)" if multi_turn else None)
    if args.routing_replay == "R3" and backend != VLLM and why is not None:
        raise ValueError(f"routing_replay='R3' needs the sampler's routes, which are not recorded with {why}; use "
                         f"routing_replay='R2' or generate single-turn rollouts by sampling")
    _check_centering_run(args, sampling, multi_turn)


def _check_centering_run(args, sampling, multi_turn: bool) -> None:
    """`score_centering` against the sampling settings generation really uses: "exact" re-applies the sampler's
    temperature and truncation only, so another logits processor (a repetition penalty, ...) is refused; "top_k"
    records the first generate call only, so tools are refused. Raises ValueError."""
    kind = getattr(args, "score_centering", None)
    if kind == "exact" and sampling.processors:
        names = ", ".join(f"{name}={value!r}" for name, value in sampling.processors)
        raise ValueError(f"score_centering='exact' recomputes the sampler's distribution from temperature and "
                         f"top_k/top_p/min_p only, but the sampler also applies {names}; remove it or use "
                         "score_centering='top_k' (recorded from the sampler's processed scores)")
    if kind == "top_k" and multi_turn:
        raise ValueError("score_centering='top_k' records the sampler's top-k in the first generate call only, but "
                         "tools / environment_factory make each turn a separate call; use score_centering='exact'")


def _check_sampled(args, sampling, recording: bool) -> None:
    """Refuse beam search and greedy decoding where a setting needs the per-token sampling distribution: a
    truncation correction (any backend), and on a recorded `generate` path `sampler_logprobs_in_loss` or the sampler
    arm."""
    if sampling.num_beams == 1 and sampling.do_sample:
        return
    needs = [f"truncation_correction={args.truncation_correction!r}"] if args.truncation_correction != "none" else []
    if recording and args.sampler_logprobs_in_loss:
        needs.append("sampler_logprobs_in_loss")
    if recording and MODES[args.old_logprob_mode].is_sampler:
        needs.append(f"old_logprob_mode={SAMPLER_MODE!r}")
    if recording and getattr(args, "is_correction_spec", None) is not None:
        needs.append(f"is_correction={args.is_correction!r}")
    if getattr(args, "score_centering", None) is not None:
        needs.append(f"score_centering={args.score_centering!r}")
    if needs:
        raise ValueError(f"{' / '.join(needs)} need sampled rollouts, but generation uses num_beams="
                         f"{sampling.num_beams}, do_sample={sampling.do_sample} (generation_kwargs); set "
                         f"truncation_correction='none' and old_logprob_mode to a precision mode, or sample")


def check_head_is_linear(correction: str, model_config) -> None:
    """Raise `ValueError` when a correction is on and the model transforms its logits after the LM head
    (softcapping, logit scaling): there head(hidden) is not the logits the kept-set log-probs need."""
    if correction == "none":
        return
    transformed = logit_transforms(model_config)
    if transformed:
        raise ValueError(f"truncation_correction={correction!r} does not support models whose logits "
                         f"are transformed after the LM head ({', '.join(transformed)})")


def check_processors(processors: Mapping[str, object], correction: str, recorded_kept_sets: bool,
                     source: str, table: Mapping[str, Processor] = PROCESSORS) -> list[str]:
    """Warn (UserWarning, one warning) for every active processor the run does not model; returns the fields named.

    Args:
        processors: the active processor fields and values (`active_processors`; `repetition_penalty` included).
        correction: `truncation_correction`.
        recorded_kept_sets: the kept sets are the `generate` recording's (then removal-only processors are modelled).
        source: where the settings were read ("generation config" or "config"), for the message.
        table: `PROCESSORS` (generate) or `VLLM_PROCESSORS` (vLLM).
    """
    named = []
    for name in processors:
        kind = table[name].kind
        if kind == NO_EFFECT or (correction != "none" and (kind == MODELLED or (kind == MASKS and recorded_kept_sets))):
            continue
        named.append(name)
    if not named:
        return named
    parts = "; ".join(f"{n}={processors[n]!r} {table[n].effect}" for n in named)
    if correction == "none":
        why = ("with truncation_correction='none' the old/sampler ratio (ratio/old_sampler/*, and TRL's IS weights "
               "with vLLM) carries what they change; a correction models repetition_penalty, and with kept sets "
               "recorded during generate the processors that only remove tokens")
    else:
        why = (f"truncation_correction={correction!r} does not model them: the corrected old/sampler ratio "
               f"(ratio/old_sampler_corrected/*) carries their factor and leaves 1 where they act (a removed token's "
               f"mass stays in the trainer's kept set; a reweighting is not undone)")
    warnings.warn(f"the sampler applies logits processors that reshape its distribution ({parts}; from the "
                  f"{source}); {why} (docs/truncation.md, 'Logits processors').", stacklevel=3)
    return named


def is_quantized(model: nn.Module) -> bool:
    """A quantized base (bitsandbytes 4/8-bit as QLoRA loads it, GPTQ, AWQ, ...): transformers' `is_quantized` /
    `hf_quantizer`, or a `quantization_config` on the config; a PEFT model is read through its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    return bool(getattr(base, "is_quantized", False) or getattr(base, "hf_quantizer", None) is not None
                or getattr(config, "quantization_config", None) is not None)


def check_quantized_copy(model: nn.Module, mode: str, use: ScoringUse | None = None) -> None:
    """Refuse a scoring mode that copies quantized modules on a quantized base: a whole-model copy (`fp32_clone`,
    `fp16_clone`: `MODES[mode].may_copy_whole_model`) or fp32 copies of decoder layers (`guided_fp32`) would cast
    packed 4/8-bit storage, and would not be the policy in another dtype anyway. `fp32_head` copies only the final norm
    and the LM head, which quantization leaves in their dtype.

    Args:
        use: the `ScoringUse` that asks for `mode` (`scoring_uses`), named in the message; None: `old_logprob_mode`.
    Raises:
        ValueError: naming the setting (`old_logprob_mode`, or `ratio_attribution` for its `fp32_clone` reference),
            the quantization and what works.
    """
    spec = MODES[mode]
    if not (spec.may_copy_whole_model or spec.fp32_layers) or not is_quantized(model):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    quantization = getattr(base.config, "quantization_config", None)
    method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(quantization, "quant_method",
                                                                                             None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    use = use or ScoringUse(mode, "old_logprob_mode", f"old_logprob_mode={mode!r}", "")
    instead = ("Use old_logprob_mode='fp32_head' (final norm and LM head in fp32; quantization leaves them as they "
               "are) or 'bf16'") if use.field == "old_logprob_mode" else f"Turn it off: {use.off}"
    raise ValueError(f"{use.subject} copies the model's modules in another dtype, but the base model is "
                     f"quantized ({method or 'quantization_config'}): a copy would cast its packed weights. "
                     f"{instead} (docs/compatibility.md)")


def check_fp32_attention(model: nn.Module, mode: str, use: ScoringUse | None = None) -> str | None:
    """Say at start (the `grpo_ratio` logger, info) when the mode's passes run attention in fp32 (a whole fp32 forward,
    fp32 decoder layers, `fp16_clone`'s fp32 re-scoring) and the model's `attn_implementation` refuses fp32 inputs
    (FlashAttention): those passes run `sdpa` (`old_pass.forward.ieee_fp32`), the training forward keeps its kernel.
    Returns the refusing implementation's name, or None."""
    spec = MODES[mode]
    name = attention_refusing_fp32(model) if (spec.whole_model_dtype is not None or spec.fp32_layers) else None
    if name is not None:
        logging.getLogger("grpo_ratio").info(
            f"{use.subject if use else f'old_logprob_mode={mode!r}'} runs attention in fp32 and "
            f"attn_implementation={name!r} takes fp16/bf16 only: "
            f"its old passes run attn_implementation='sdpa' (IEEE fp32), the training forward keeps {name!r}")
    return name
