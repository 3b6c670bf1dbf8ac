"""`RunPlan`: what one `RatioGRPOTrainer` run does, resolved once when the trainer is built.

The config names modes; the plan says what they mean for this run's generation backend (transformers `generate`,
continuous batching, vLLM) and the sampling settings `generate` really uses, so the trainer's hooks ask the plan a
question (`plan.corrects`, `plan.anchor_is_sampler`, ...) instead of comparing config strings.

| field | values | resolved from |
|---|---|---|
| `old_logprobs` | `"trl"` (TRL's own pass, bf16, bit for bit), `"scorer"` (an `OldLogprobScorer`), `"sampler"` (no old pass), `"integer"` (the integer model re-scores) | `old_logprob_mode` |
| `scorer_mode` | one of `config.SCORER_MODES`, or None | `old_logprob_mode` |
| `trl_old_pass` | whether TRL 1.16 runs its own old-logprob pass (the hook replaces it, or measures it) | TRL's condition |
| `fused_head` | `fp32_head`'s old log-probs from each micro-batch's training forward, no body pass (`grpo_ratio.old_pass.fused_head`) | mode, TRL's condition, model, engine |
| `fused_head_fallback` | why `fp32_head` keeps its separate pass (None: fused, or not `fp32_head`) | `fused_head.fused_head_fallback` |
| `correction` | `config.TRUNCATION_CORRECTIONS` | `truncation_correction` |
| `kept_sets` | `"none"`, `"recorded"` (the `generate` recording), `"vllm_masks"`, `"recompute"` | `kept_set_source`, backend |
| `record_generate` | whether `generate` rollouts run under the recorder | `record_sampler_logprobs`, backend, sampling |
| `sampler_in_loss` | the recorded sampler log-probs reach TRL's loss as `sampling_per_token_logps` | `sampler_logprobs_in_loss` |
| `sampling` | the `SamplingSettings` generation uses (also the filter the `"recompute"` source re-applies, and the repetition penalty a correction re-applies) | backend, model |
| `routing_replay` | `"none"`, `"R2"`, `"R3"` (`grpo_ratio.routing.replay`) | `routing_replay` |
| `sampler_routes` | where the sampler's MoE routes come from: `"generate"` (recorded), `"vllm"` (`routed_experts`), `"none"` | `routing_replay`, `ratio_diagnostics`, backend |
| `is_correction` | the `ISCorrection` the loss's IS weight comes from, or None (TRL's behaviour) | `is_correction(_*)` |
| `attribution_rows` | rows per generation batch whose log(new) - log(sampler) is attributed to its causes, or None (off) | `ratio_attribution` |
| `rollout_precision` | what `generate` draws from: `"policy"` (stock TRL), a float copy (`"bf16"`, `"fp16"`, `"int8"`, `"int4"`, `"int2"`) or `"integer"` (`grpo_ratio.sampler.precision`) | `rollout_precision`, backend |
| `centering` | `"exact"`, `"top_k"` (`grpo_ratio.corrections.centering`), or None (off: TRL's loss) | `score_centering` |
| `centering_top_k`, `centering_tail` | `"top_k"`: how many sampler log-probs per token are recorded (0 otherwise), the tail rule | `score_centering_top_k`, `score_centering_tail` |

To add a setting (routing replay, an IS correction): add a field with a default that means "off", resolve it in
`RunPlan.resolve` (one line, or one `_resolve_*` function), put its refusals in `grpo_ratio.checks` (the plan
resolves, never raises: `checks.check_run` runs before it), and read `self.plan.<field>` in the hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ._compat import is_rloo, trl_field
from .corrections.centering import DEFAULT_TOP_K
from .corrections.is_correction import ISCorrection
from .corrections.kept_sets import SamplingSettings
from .modes import FP32_HEAD, INTEGER, MODES, POLICY_ROLLOUTS, SAMPLER, SAMPLER_MODE, SCORER_MODES


# generation backends of TRL 1.16's GRPOTrainer
GENERATE, CONTINUOUS_BATCHING, VLLM = "generate", "continuous_batching", "vllm"
# where the kept sets of a truncation correction come from
NO_KEPT_SETS, RECORDED, VLLM_MASKS, RECOMPUTE = "none", "recorded", "vllm_masks", "recompute"


def kept_set_origin(args) -> str:
    """Where the kept sets come from, from the config alone: `"none"` (no truncation correction), `"recompute"`,
    `"vllm_masks"` (vLLM's sampling masks: needs the engine flag, hence known before TRL builds the engine) or
    `"recorded"` (the transformers `generate` recording)."""
    if args.truncation_correction == "none":
        return NO_KEPT_SETS
    if args.resolved_kept_set_source == "recompute":
        return RECOMPUTE
    return VLLM_MASKS if args.use_vllm else RECORDED


def trl_runs_old_pass(args) -> bool:
    """TRL 1.16's own condition for computing old log-probs (grpo_trainer.py, `_generate_and_score_completions`;
    RLOOTrainer always computes them, `_compat.TRL_RLOO_CONDITIONS`); the trainer checks at run time that TRL really
    ran the pass where this says it does."""
    if is_rloo(args):
        return True
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every != 0 or (
        args.use_vllm and trl_field(args, "vllm_importance_sampling_correction"))


@dataclass(frozen=True)
class RunPlan:
    """The resolved plan of a run (module docstring: fields and where each comes from). Build with `resolve`."""

    old_logprobs: str = "trl"
    scorer_mode: str | None = None
    trl_old_pass: bool = False
    fused_head: bool = False
    fused_head_fallback: str | None = None
    correction: str = "none"
    kept_sets: str = NO_KEPT_SETS
    record_generate: bool = False
    sampler_in_loss: bool = False
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    routing_replay: str = "none"
    sampler_routes: str = "none"
    is_correction: ISCorrection | None = None
    attribution_rows: int | None = None
    rollout_precision: str = POLICY_ROLLOUTS
    centering: str | None = None
    centering_top_k: int = 0
    centering_tail: str = "proportional"

    @classmethod
    def resolve(cls, args, sampling: SamplingSettings, backend: str = GENERATE, multi_turn: bool = False,
                fused_head_fallback: str | None = None) -> RunPlan:
        """The plan of a `RatioGRPOConfig` on a backend (`"generate"`, `"continuous_batching"`, `"vllm"`) with the
        sampling settings generation really uses; `multi_turn`: tools or an environment factory;
        `fused_head_fallback`: under `fp32_head`, why the fused path cannot run (`fused_head.fused_head_fallback`,
        which needs the model and the engine), None when it can.

        Never raises: what cannot work is refused before (`grpo_ratio.checks.check_run`).
        """
        mode = args.old_logprob_mode
        kept_sets = kept_set_origin(args)
        return cls(
            old_logprobs=(SAMPLER.name if mode == SAMPLER_MODE else INTEGER.name if MODES[mode].integer
                          else "scorer" if mode in SCORER_MODES else "trl"),
            scorer_mode=mode if mode in SCORER_MODES else None,
            trl_old_pass=trl_runs_old_pass(args),
            fused_head=mode == FP32_HEAD.name and fused_head_fallback is None,
            fused_head_fallback=fused_head_fallback if mode == FP32_HEAD.name else None,
            correction=args.truncation_correction,
            kept_sets=kept_sets,
            record_generate=_resolve_record_generate(args, sampling, backend),
            sampler_in_loss=args.sampler_logprobs_in_loss,
            sampling=sampling,
            routing_replay=args.routing_replay,
            sampler_routes=_resolve_sampler_routes(args, sampling, backend, multi_turn),
            is_correction=getattr(args, "is_correction_spec", None),
            attribution_rows=getattr(args, "ratio_attribution_rows", None),
            rollout_precision=getattr(args, "rollout_precision", POLICY_ROLLOUTS) if backend == GENERATE
            else POLICY_ROLLOUTS,
            centering=getattr(args, "score_centering", None),
            centering_top_k=(args.score_centering_top_k or DEFAULT_TOP_K)
            if getattr(args, "score_centering", None) == "top_k" else 0,
            centering_tail=getattr(args, "score_centering_tail", None) or "proportional",
        )

    # -- questions the hooks ask ----------------------------------------------------------------------------------

    @property
    def anchor_is_policy(self) -> bool:
        """The old log-probs are the policy's own pass at its training precision (`bf16`: TRL's numbers)."""
        return self.old_logprobs == "trl"

    @property
    def anchor_is_sampler(self) -> bool:
        """The old log-probs are the sampler's own (`old_logprob_mode="sampler"`): TRL's old pass is replaced."""
        return self.old_logprobs == SAMPLER.name

    @property
    def anchor_is_integer(self) -> bool:
        """The old log-probs are the integer model's re-scoring of the rollouts (`old_logprob_mode="integer"`)."""
        return self.old_logprobs == INTEGER.name

    @property
    def replaces_old_pass(self) -> bool:
        """No float old pass of the policy: the sampler's log-probs or the integer model's anchor the ratio, set once
        TRL returns its batch (TRL's own pass, where it runs one, gets a stand-in)."""
        return self.anchor_is_sampler or self.anchor_is_integer

    @property
    def draws_from_copy(self) -> bool:
        """`generate` draws the rollouts from a copy of the policy (`rollout_precision` other than `"policy"`)."""
        return self.rollout_precision != POLICY_ROLLOUTS

    @property
    def corrects(self) -> bool:
        """A truncation correction is on (`renormalize` or `lift_sampler`)."""
        return self.correction != "none"

    @property
    def renormalizes(self) -> bool:
        """`renormalize`: the trainer's old and new log-probs are taken over the kept sets."""
        return self.correction == "renormalize"

    @property
    def lifts_sampler(self) -> bool:
        """`lift_sampler`: the sampler's log-probs get + log M_old."""
        return self.correction == "lift_sampler"

    @property
    def records_kept_sets(self) -> bool:
        """The correction's kept sets are the `generate` recording's (the recorder keeps the ids)."""
        return self.kept_sets == RECORDED

    @property
    def recomputes_kept_sets(self) -> bool:
        """The kept sets are recomputed from the old policy's logits by `sampling` (`SamplingSettings.keep_mask`)."""
        return self.kept_sets == RECOMPUTE

    @property
    def vllm_masks(self) -> bool:
        """The kept sets are vLLM's sampling masks of TRL's colocate engine (captured outputs)."""
        return self.kept_sets == VLLM_MASKS

    @property
    def repetition_penalty(self) -> float:
        """The sampler's `repetition_penalty` the correction re-applies to the trainer's logits (1.0: none, or no
        correction; `grpo_ratio.corrections.processors.RepetitionPenalty`)."""
        return self.sampling.repetition_penalty if self.corrects else 1.0

    @property
    def runs_old_pass(self) -> bool:
        """A separate old pass runs per generation: TRL's own, the scoring mode's (not `fp32_head` fused), or the one
        an IS correction needs on the `generate` path (none where it reuses the training forward: on a dense policy,
        `reuses_training_forward`)."""
        scorer_pass = self.scorer_mode is not None and not self.fused_head
        is_pass = self.is_correction is not None and not self.reuses_training_forward
        return self.trl_old_pass or scorer_pass or is_pass

    @property
    def reuses_training_forward(self) -> bool:
        """`is_correction` takes its old log-probs from each micro-batch's training forward, detached, instead of a
        separate no-grad pass of the policy (issue 43; AReaL's `prox_logp_method="reuse_train_logp"`, PR #1453; TRL
        PR #5413): where the old log-probs are the policy's own pass (`bf16`) and TRL skipped its old pass
        (`num_iterations=1`, `steps_per_generation` = gradient accumulation), that pass would compute what TRL's loss
        already uses as old, the training forward detached. With `renormalize` on the recorded kept sets too (the
        training forward scores the same sets, its log M is the old pass's); not where the old pass recomputes the
        kept sets of the whole batch (`kept_set_source="recompute"`), nor under `lift_sampler` (it lifts the whole
        batch's sampler log-probs by the old pass's kept mass before the batch is split), nor with MoE routing replay
        (R2 replays the old pass's routes); the trainer also keeps the pass for an MoE policy whose routes are
        measured (`ratio/route/*` counts the old pass's routes). Those keep the separate pass."""
        return (self.is_correction is not None and self.anchor_is_policy and not self.trl_old_pass
                and (not self.corrects or (self.renormalizes and self.records_kept_sets)) and not self.replays_routes)

    @property
    def replays_routes(self) -> bool:
        """An MoE routing replay is on (`R2` or `R3`)."""
        return self.routing_replay != "none"

    @property
    def weights_is(self) -> bool:
        """An IS correction of ours computes the loss's `importance_sampling_ratio` (vLLM and `generate` alike)."""
        return self.is_correction is not None

    @property
    def attributes(self) -> bool:
        """`ratio_attribution` is on: the fp32 reference passes of sampled rows run at each training generation
        batch and `ratio/attribution/*` is logged (`grpo_ratio.diagnostics.attribution`)."""
        return self.attribution_rows is not None

    def corrected_logps(self, full: torch.Tensor, on_kept: torch.Tensor) -> torch.Tensor:
        """The trainer's log-probs (B, T) as the correction wants them: over the kept sets (`on_kept`) under
        `renormalize`, else the full-vocabulary ones (`full`)."""
        return on_kept if self.renormalizes else full


def _resolve_record_generate(args, sampling: SamplingSettings, backend: str) -> bool:
    """Whether `generate` rollouts are recorded: asked for, on the transformers `generate` path, and sampled (beam
    search and greedy decoding have no per-token sampling distribution to record; `checks.check_run` says so)."""
    recording = backend == GENERATE and args.record_sampler_logprobs
    return recording and sampling.num_beams == 1 and sampling.do_sample


def _resolve_sampler_routes(args, sampling: SamplingSettings, backend: str, multi_turn: bool) -> str:
    """Where the sampler's MoE routes come from: `"vllm"` (colocate `routed_experts`, asked of the engine under R3
    only), `"generate"` (recorded, under R3 or for the `ratio/route/*` diagnostics) or `"none"`.

    Where R3 cannot have them it is refused before (`grpo_ratio.checks.check_run`).
    """
    r3 = args.routing_replay == "R3"
    if backend == VLLM:
        return "vllm" if r3 else "none"
    why = ("transformers continuous batching (its batches are not the trainer's rows)" if backend == CONTINUOUS_BATCHING
           else f"beam search (num_beams={sampling.num_beams} reorders the rows)" if sampling.num_beams > 1
           else "tools or environment_factory (each turn is a separate generate call)" if multi_turn else None)
    if why is not None:  # R3 is refused there (`checks.check_run`)
        return "none"
    if getattr(args, "rollout_precision", POLICY_ROLLOUTS) != POLICY_ROLLOUTS:  # the copy's routes are not the policy's
        return "none"
    return "generate" if r3 or args.ratio_diagnostics else "none"
