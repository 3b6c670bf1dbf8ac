"""`RatioGRPOTrainer`: TRL's `GRPOTrainer` with the old log-probs computed by a selectable scoring mode.

The only changes w.r.t. `trl.GRPOTrainer` (1.16):
1. Old log-probs. When `old_logprob_mode != "bf16"`, the old log-probs of every generation batch come from
   `grpo_ratio.old_pass.scorer.OldLogprobScorer` (fp32/fp16 copy, fp32 head, guided fp32 layers), also where TRL would skip
   the old pass (then the first-step ratio is new/old = policy pass / mode pass). TRL's own old pass is replaced, not
   run and thrown away, so vLLM importance-sampling correction uses the mode's old log-probs too. With `"bf16"`
   nothing changes: TRL's pass, bit for bit. `fp32_head` in TRL's on-policy default runs no pass of the body: each
   micro-batch's old log-probs are the fp32 norm and head on its own training forward (`grpo_ratio.old_pass.fused_head`).
2. Sampler log-probs without vLLM: `model.generate` runs with a recording logits processor, so each sampled token's
   log-prob under the distribution it was sampled from is known. They reach the diagnostics as
   `sampler_per_token_logps`; TRL's loss sees them (as `sampling_per_token_logps`) only with
   `sampler_logprobs_in_loss=True`, so by default TRL's loss, metrics and checkpoints are stock TRL's.
3. Truncated-sampling correction (`truncation_correction`): old, new and sampler log-probs on one support.
4. Ratio diagnostics (`ratio/*` metrics, docs/metrics.md), logged in the same step as the reward.
5. MoE routing replay (`routing_replay`, `grpo_ratio.routing`): the sampler's (R3) or the old pass's (R2) expert
   routes replayed in the trainer's forwards; on an MoE policy the routes are measured (`ratio/route/*`) by default,
   which changes no number TRL computes.
6. Score centering (`score_centering`, `grpo_ratio.corrections.centering`): the training forward's log-probs keep their
   values and get the centred score (minus the sampler-expected score) as their gradient.

Wrapped TRL methods (each calls `super()`; none is copied): `_generate_and_score_completions`,
`_generate_single_turn`, `_get_per_token_logps_and_entropies`, `_compute_loss`. They live in `RatioHooks`, which
`RatioGRPOTrainer` mixes into `trl.GRPOTrainer` (and another TRL trainer with the same hooks can mix in). State passes
between them only through two records (`grpo_ratio.records`): a `GenerationRecord` per generation batch, a
`MicroBatchRecord` per loss micro-batch. What the run does (which old pass, where old log-probs and kept sets come from,
which correction) is resolved once at `__init__` into `self.plan` (`grpo_ratio.plan.RunPlan`); the hooks ask the plan.
Every refusal and warning is in `grpo_ratio.checks`. The wrapped methods are private and change between TRL releases,
hence the version pin in `grpo_ratio/_compat.py`, which also lists every TRL internal read here.
"""

from __future__ import annotations

import contextlib
import warnings
from functools import partial

import torch
from trl import GRPOTrainer

from ._compat import trl_field, trl_is_weight_gate
from .checks import (
    check_centering_engine,
    check_old_pass,
    check_rollout_copy,
    check_rollout_run,
    check_run,
    check_sharded_mode,
    check_train_again,
    check_train_dataset,
    lint_trainer,
    reference_copy_storage,
)
from .config import RatioGRPOConfig
from .corrections.centering import center_logps, centering_terms
from .corrections.is_correction import importance_weights
from .corrections.kept_logprobs import lift_sampler_logprobs
from .corrections.processors import RepetitionPenalty
from .corrections.trust_region import trust_region_mask
from .diagnostics.attribution import AttributionReference, row_positions, sample_rows
from .diagnostics.console import quiet_console
from .diagnostics.gate_callback import RatioGateCallback
from .diagnostics.metric_keys import (
    CENTERING_DRIFT_TV,
    CENTERING_TAIL_MASS,
    ROLLOUT_COPY_SECONDS,
    TRUST_REGION_MASKED_FRAC,
)
from .diagnostics.ratio_diagnostics import FULL_VOCAB_KEYS, RatioDiagnostics
from .diagnostics.ratios import importance_sampling_weights
from .diagnostics.run_record_callback import RunRecordCallback
from .diagnostics.trains_nothing_callback import trains_nothing_callback
from .integer.sample import IntSampling
from .models import trainer_model_source
from .modes import DEFAULT_HEAD_OPERANDS, FP32_CLONE, FP32_HEAD, INTEGER_MODE
from .old_pass.copies import WeightsVersion, WeightsVersionCallback
from .old_pass.fused_head import capture_norm_inputs, fused_head_fallback, fused_old_logps, say_fused_head
from .old_pass.integer_pass import integer_old_logps
from .old_pass.kept_head import KeptSetChunks, capture_last_hidden, head_logits
from .old_pass.scorer import OldLogprobScorer, check_text_only, scoring_head_arithmetic
from .old_pass.sharding.engines import engine_of, sharded_policy
from .old_pass.sharding.fsdp2 import fp32_logprob_output
from .plan import CONTINUOUS_BATCHING, GENERATE, VLLM, VLLM_MASKS, RunPlan, kept_set_origin, trl_runs_old_pass
from .records import GenerationRecord, MicroBatchRecord, ReusedISWeights
from .routing.replay import RoutingReplay
from .sampler.generate import SamplerLogprobRecorder, SamplerRecord, finish_recording, recording_sampler
from .sampler.precision import IntegerRollouts, RolloutCopy
from .sampler.settings import sampler_anchor, sampler_logps_key, settings_from_config, settings_from_generation_config
from .sampler.vllm import VLLMLogprobCapture, VLLMOutputCapture, colocate_engine_kwargs, vllm_engine_kwargs


class RatioHooks:
    """The hooks grpo_ratio adds to a TRL trainer that generates, scores the old policy and clips a ratio: wrapped
    with `super()`, none copied. `RatioGRPOTrainer` mixes them into `trl.GRPOTrainer`; another TRL trainer with the
    same four hooks (`_generate_and_score_completions`, `_generate_single_turn`, `_get_per_token_logps_and_entropies`,
    `_compute_loss`: RLOOTrainer, the experimental AsyncGRPOTrainer) reuses them by mixing this class in first and
    naming its `config_class` (`grpo_ratio.rloo.RatioRLOOTrainer`); where its TRL methods differ from GRPOTrainer's,
    it overrides the small adapters `_trl_generate_single_turn`, `_complete_trl_output`, `_sampler_old_pass` and
    `_is_weight_gate`. What they read of the trainer is listed in
    `grpo_ratio._compat` (`TRL_ATTRIBUTES`, `TRL_BATCH_KEYS`, `TRL_CONDITIONS`).
    """

    config_class: type  # the trainer's config: TRL's config + `config.RatioFields` (RatioGRPOConfig, RatioRLOOConfig)

    def __init__(self, model, reward_funcs=None, args=None, *pargs, **kwargs):
        """TRL's constructor (same arguments), then `_init_ratio`; see the trainer classes for what it raises."""
        config_class, trl_name = self.config_class, self._name  # e.g. RatioGRPOConfig, "GRPO" (TRL's `_name`)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = config_class(f"{str(name).split('/')[-1]}-{trl_name}-ratio")
        if not isinstance(args, config_class):
            raise TypeError(
                f"{type(self).__name__} needs args={config_class.__name__}(...), got {type(args).__name__}; "
                f"{config_class.__name__} accepts every {trl_name}Config field plus old_logprob_mode, "
                f"guided_fp32_layers, ..."
            )
        if isinstance(model, str):  # resolved as the command line resolves it (offline: the converted SmolLM2)
            model = trainer_model_source(model, (args.model_init_kwargs or {}).get("revision"))
        check_train_dataset(kwargs["train_dataset"] if "train_dataset" in kwargs else (pargs[0] if pargs else None))
        engine_kwargs = colocate_engine_kwargs(args, kept_set_origin(args) == VLLM_MASKS)  # what TRL does not pass
        with vllm_engine_kwargs(**engine_kwargs) if engine_kwargs else contextlib.nullcontext():
            super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self._init_ratio(args)
        self._train_calls = 0  # a second train() under ZeRO-3 is refused up front (`checks.check_train_again`)

    def train(self, *args, **kwargs):
        """TRL's `train`; under DeepSpeed ZeRO-3 only once per trainer (`checks.check_train_again`)."""
        check_train_again(engine_of(self.accelerator), self._train_calls > 0)
        self._train_calls += 1
        return super().train(*args, **kwargs)

    def _init_ratio(self, args) -> None:
        """Everything grpo_ratio needs once TRL built the trainer: the plan, routing, the start-up checks that need
        the model, the weights version, the diagnostics and the gate, the two records."""
        policy = self.accelerator.unwrap_model(self.model)
        multi_turn = bool(trl_field(self, "tools")) or trl_field(self, "environment_factories") is not None
        # what this run does (which old pass, where old log-probs and kept sets come from, which correction):
        # resolved once; the hooks below ask it instead of comparing config strings
        fused_fallback = self._fused_head_fallback() if args.old_logprob_mode == FP32_HEAD.name else None
        sampling, backend = self._sampling_settings(policy), self._backend()
        check_run(args, sampling, backend, multi_turn)  # what cannot work on this backend and sampling: refused here
        check_rollout_run(args, sampling, multi_turn)
        check_rollout_copy(engine_of(self.accelerator), policy, args)
        self.plan = RunPlan.resolve(args, sampling, backend, multi_turn, fused_fallback)
        self.rollout_copy = self._new_rollout_copy(policy) if self.plan.draws_from_copy else None
        say_fused_head(self.plan)  # fp32_head: fused or not, and why, once
        # the MoE policy's routes: replayed (R2/R3) and measured (ratio/route/*); inactive for a dense policy
        self.routing = RoutingReplay(policy, args.routing_replay, measure=args.ratio_diagnostics)
        capture = self.plan.vllm_masks or self.plan.sampler_routes == VLLM
        self._vllm_capture = VLLMOutputCapture(self.vllm_generation.llm, self.accelerator.device) if capture else None
        self._vllm_logprobs = self._vllm_logprob_capture()  # vLLM log-probs TRL does not keep (top-k, RLOO's)
        lint_trainer(self, policy)  # start-up checks that need the model (config-only ones ran in the config)
        # copies are refreshed whenever the policy's weights may have changed (copies.WeightsVersion)
        self.weights_version = WeightsVersion()
        self.add_callback(WeightsVersionCallback(self.weights_version, self.accelerator))
        self.diagnostics = RatioDiagnostics(args, self.accelerator, self.eos_token_ids,
                                            plan=self.plan) if args.ratio_diagnostics else None
        if self.diagnostics is not None:  # a warning when the IS correction zeroes (nearly) every token of a step
            self.add_callback(trains_nothing_callback(args, self.diagnostics.is_correction))
            quiet_console(self)  # the console prints a few headline ratio/* keys; every key is still logged
        if args.ratio_gate:  # the tolerance gate on logged metrics (grpo_ratio/diagnostics/gate.py)
            self.add_callback(RatioGateCallback(args.ratio_gate, args.ratio_gate_patience, args.ratio_gate_action))
        # run.json + log_history.json in output_dir: what the report reads (and what the old pass's fp32 head computed)
        self.add_callback(RunRecordCallback(partial(scoring_head_arithmetic, self.args, self.accelerator.device)))
        check_sharded_mode(self.accelerator, self.model, args)  # FSDP2/ZeRO-3 combinations that cannot be exact
        check_centering_engine(args, engine_of(self.accelerator))  # score_centering: an unsharded LM head
        check_old_pass(policy, args)  # layer indices, anatomy, copy storage: here, not at step 1
        self._scorer = None  # built on first use (`scorer`): accelerate wraps FSDP2/ZeRO-3 models inside train()
        self._reference_scorer = None  # ratio_attribution's fp32 reference, built on first use (`reference_scorer`)
        # The two records between TRL's hooks (grpo_ratio/records.py): one per generation batch and mode, one per
        # loss micro-batch. No other attribute is written in one hook and read in another.
        self._generations: dict[str, GenerationRecord] = {}
        self._micro_batch: MicroBatchRecord | None = None
        self._warned_unrecorded = False  # one warning for generate calls the recorder did not see
        self._trust_region_counts = None  # trust_region: (masked, valid) tokens of this update, on the device
        self._centering_sums = None  # score_centering: (3,) sums of this update (`centering_terms`' stats), on the device

    # ------------------------------------------------------------------------------------------------------------
    # setup checks

    @property
    def scorer(self) -> OldLogprobScorer | None:
        """The scoring mode's `OldLogprobScorer` (None for `bf16` and `sampler`), built on first use, after accelerate wrapped the
        model: under FSDP2/ZeRO-3 its shadows and compute dtype come from the wrapped model (`grpo_ratio.old_pass.sharding.engines`)."""
        if self._scorer is None and self.plan.scorer_mode is not None:
            self._scorer = self._new_scorer(self.plan.scorer_mode, self.args.guided_fp32_layer_ids,
                                            head_operands=self.args.fp32_head_operands)
        return self._scorer

    @property
    def reference_scorer(self) -> OldLogprobScorer:
        """`ratio_attribution`'s fp32 reference (`fp32_clone`): the run's own scorer under `fp32_clone`, else one built
        on first use: no copy on fp32-stored weights; on bf16/fp16-stored ones the fp32 weights cast module by module
        during its pass (`checks.reference_copy_storage`: about the largest module's fp32 bytes alive, nothing kept
        between passes; PEFT adapters merged one tuner layer at a time), the engine's shadows under FSDP2/ZeRO-3.
        `checks.scoring_uses` puts it through every start-up check of a scoring mode."""
        if self.plan.scorer_mode == FP32_CLONE.name:
            return self.scorer
        if self._reference_scorer is None:
            sharded = engine_of(self.accelerator) in ("fsdp2", "zero3")  # sharded_policy's engines
            self._reference_scorer = self._new_scorer(FP32_CLONE.name, copy_storage=reference_copy_storage(sharded))
        return self._reference_scorer

    def _new_scorer(self, mode: str, layers=None, copy_storage: str | None = None,
                    head_operands: str = DEFAULT_HEAD_OPERANDS) -> OldLogprobScorer:
        policy = self.accelerator.unwrap_model(self.model)
        return OldLogprobScorer(policy, mode, layers=layers, policy_autocast=self.accelerator.autocast,
                                sharded=sharded_policy(self.accelerator, policy),
                                copy_storage=copy_storage or self.args.copy_storage, route_hooks=self.routing.hooks,
                                head_operands=head_operands)

    def _fused_head_fallback(self) -> str | None:
        """Why `fp32_head` must keep its separate old pass in this run, or None (`fused_head.fused_head_fallback`)."""
        return fused_head_fallback(self.args, self.accelerator.unwrap_model(self.model), engine_of(self.accelerator),
                                   trl_runs_old_pass(self.args))

    def _new_rollout_copy(self, policy) -> RolloutCopy:
        """`rollout_precision`'s copy (`grpo_ratio.sampler.precision`); made at the first generation, then re-made
        whenever the weights moved."""
        integer = None
        if self.plan.rollout_precision == INTEGER_MODE:
            s = self.plan.sampling
            integer = IntegerRollouts(IntSampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p),
                                      eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
                                      pad_token_id=self._tokenizer.pad_token_id)
        return RolloutCopy(self.plan.rollout_precision, policy, integer, seed=self.args.seed)

    def _drawing(self, recorder=None):
        """Within the block, TRL's `generate` draws from `rollout_precision`'s copy (synced at this step's weights);
        the copy's re-make cost is logged (`ratio/rollout_copy_seconds`). A no-op context under `"policy"`."""
        if self.rollout_copy is None:
            return contextlib.nullcontext()
        config = getattr(self, "generation_config", None)
        max_new = getattr(config, "max_new_tokens", None) or self.args.max_completion_length
        return _LoggingDraw(self, self.rollout_copy.drawing(self.accelerator.unwrap_model(self.model_wrapped),
                                                            self.weights_version.value, max_new, recorder))

    @property
    def sampling(self):
        """The `SamplingSettings` the rollouts really use (`self.plan.sampling`)."""
        return self.plan.sampling

    def _vllm_logprob_capture(self) -> VLLMLogprobCapture | None:
        """What this run asks TRL's vLLM generation for beyond TRL's own request: the sampler's top-k log-probs of
        every step with `score_centering="top_k"` (GRPOTrainer keeps the sampled token's itself). `RatioRLOOTrainer`
        also asks for the sampled tokens' log-probs, which RLOOTrainer drops."""
        if not self.use_vllm or not self.plan.centering_top_k:
            return None
        return VLLMLogprobCapture(self.vllm_generation, top_k=self.plan.centering_top_k)

    def _backend(self) -> str:
        """TRL's generation backend: vLLM, transformers continuous batching, or `generate`."""
        if self.use_vllm:
            return VLLM
        return CONTINUOUS_BATCHING if self.use_transformers_continuous_batching else GENERATE

    def _sampling_settings(self, policy):
        """The sampling settings the rollouts really use: on the transformers path, TRL's generation config with the
        model's own `generation_config` filling unset fields (what `generate` does); with vLLM, the config's."""
        if self.use_vllm or self.use_transformers_continuous_batching:
            return settings_from_config(self.args, vllm=self.use_vllm)
        return settings_from_generation_config(policy, self.generation_config)

    def _mode(self) -> str:
        return "train" if self.model.training else "eval"

    # ------------------------------------------------------------------------------------------------------------
    # one generation batch: generation, old pass, correction

    def _generate_and_score_completions(self, inputs):
        if not self.plan.anchor_is_policy:  # bf16 keeps TRL's numbers, bf16 rounding included (warned at init)
            fp32_logprob_output(self.accelerator.unwrap_model(self.model))  # FSDP2: no bf16 rounding of log-probs
        generation = GenerationRecord(mode=self._mode(), old_pass_pending=self.plan.trl_old_pass)
        self._generations[generation.mode] = generation  # replaces the previous batch's record of this mode
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            missed, generation.old_pass_pending = generation.old_pass_pending, False
        if missed:
            raise RuntimeError("grpo_ratio: TRL did not run its old-logprob pass where 1.16 does; untested TRL?")
        self._complete_trl_output(output, generation)
        if generation.recorded and not self.plan.sampler_in_loss:
            # ours, for the diagnostics only: TRL's loss reads `sampling_per_token_logps` (off_policy_mask_threshold)
            output["sampler_per_token_logps"] = output.pop("sampling_per_token_logps")
        if self.plan.corrects:
            # a row index that TRL shuffles and splits with the batch: micro-batches find their rows' kept sets
            output["kept_row_index"] = torch.arange(output["completion_ids"].size(0), device=self.accelerator.device)
        if self.plan.centering_top_k:  # micro-batches find their rows' recorded top-k
            output["centering_row_index"] = torch.arange(output["completion_ids"].size(0), device=self.accelerator.device)
        if self.routing.active:  # the sampler's routes in TRL's layout; micro-batches find their rows' routes
            generation.routes.finish(output["prompt_mask"], output["completion_mask"])
            output["route_row_index"] = torch.arange(output["completion_ids"].size(0), device=self.accelerator.device)
        if self.plan.anchor_is_sampler:
            output["old_per_token_logps"] = sampler_anchor(output)
        elif self.plan.anchor_is_integer:  # the integer old pass: the integer model that drew them re-scores them
            integer = self.rollout_copy.integer  # the model and sampling settings that drew this batch
            output["old_per_token_logps"] = integer_old_logps(
                integer.model, integer.sampling, output["prompt_ids"], output["prompt_mask"], output["completion_ids"],
                output["completion_mask"], integer.pad_token_id)
        if self.scorer is not None and "old_per_token_logps" not in output and not self.plan.fused_head:
            # TRL skipped the old pass (on-policy default): the mode still provides the anchor of the ratio (fp32_head
            # fused: each micro-batch's training forward provides it, `_fused_old_logps`)
            input_ids, attention_mask, T, batch_size = self._scoring_inputs(output, generation.mode)
            output["old_per_token_logps"] = self._score_old(generation, input_ids, attention_mask, T, batch_size)
        reuse = self.plan.weights_is and "old_per_token_logps" not in output and self._reuses_training_forward()
        if reuse:  # no old pass: each micro-batch's training forward, detached, is its old log-probs (`_weigh_rows`)
            self._defer_weights(output, generation)
        elif self.plan.weights_is and "old_per_token_logps" not in output:
            # TRL skipped its old pass (generate, on-policy) but the IS weight needs one: run it as TRL's vLLM path
            # does, through the hook below, so its log-probs also anchor the PPO ratio as there
            output["old_per_token_logps"] = self._trl_old_pass(output, generation)
        if self.plan.lifts_sampler:
            self._lift_sampler(output, generation)
        if self.plan.weights_is and not reuse:
            self._weigh(output, generation)
        if self.plan.attributes and generation.mode == "train":  # ratio_attribution: the fp32 reference passes
            self._score_reference(output, generation)
        if generation.old_log_kept_mass is not None:
            output["old_log_kept_mass"] = generation.old_log_kept_mass  # (B, T), for the diagnostics
        if generation.kept_added is not None:
            output["kept_set_added"] = generation.kept_added.to(self.accelerator.device)  # (B, T) recomputed sets
        if generation.full_vocab is not None:  # (B, T) each: split with the batch, read at the first inner step
            output.update(zip(FULL_VOCAB_KEYS, generation.full_vocab, strict=True))
        if self.scorer is not None and self.diagnostics is not None:
            for key, value in self.diagnostics.generation_metrics(generation.fallback_rows).items():
                self._metrics[generation.mode][key].append(value)
        return output

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        # the rest of TRL's arguments (images, multimodal fields, ...; GRPO's and RLOO's differ) pass through as is
        generation = self._generations.get(self._mode())
        if generation is None:  # called outside a generation batch (not by TRL 1.16): nothing to record
            return self._trl_generate_single_turn(prompt_ids, *args, **kwargs)
        with self._recording_routes(generation, prompt_ids):
            return self._generate_recorded(generation, prompt_ids, *args, **kwargs)

    def _trl_generate_single_turn(self, prompt_ids, *args, **kwargs):
        """TRL's `_generate_single_turn` as (completion_ids, logprobs): GRPOTrainer's own contract (per-row lists;
        logprobs None where the backend gave none). A trainer whose TRL method returns something else adapts it here
        (`RatioRLOOTrainer`)."""
        return super()._generate_single_turn(prompt_ids, *args, **kwargs)

    def _complete_trl_output(self, output: dict, generation: GenerationRecord) -> None:
        """What TRL's batch lacks and the hooks below read, added in place right after TRL returned it. GRPOTrainer's
        batch has it all (`_compat.TRL_BATCH_KEYS`); `RatioRLOOTrainer` adds its per-token keys."""

    def _sampler_old_pass(self, generation: GenerationRecord, input_ids, logits_to_keep: int) -> torch.Tensor:
        """The sampler arm's stand-in for TRL's old pass, (B, T): zeros, replaced by the sampler's log-probs once TRL
        returns its batch (`sampler_anchor`). A trainer whose TRL code computes with the old pass's values before
        returning (RLOO: `old_logps`, the KL penalty) returns the sampler's log-probs here (`RatioRLOOTrainer`)."""
        return torch.zeros(input_ids.size(0), logits_to_keep, device=input_ids.device)

    def _is_weight_gate(self, inputs: dict):
        """Within the context, TRL's `_compute_loss` applies the micro-batch's `importance_sampling_ratio`: GRPO's own
        multiplication, opened by `_compat.trl_is_weight_gate` (RLOO: `rloo.rloo_is_weight_gate`)."""
        return trl_is_weight_gate(self)

    def _recording_routes(self, generation, prompt_ids):
        """The MoE policy's routes while `generate` decodes (R3's sampler routes, and `ratio/route/sampler_old`),
        over the prompts left-padded as TRL pads them for `generate`."""
        if self.plan.sampler_routes != GENERATE or not self.routing.active:
            return contextlib.nullcontext()
        from trl.trainer.utils import pad

        prompt_mask = pad([torch.ones(len(p), dtype=torch.long) for p in prompt_ids], padding_value=0,
                          padding_side="left", pad_to_multiple_of=self.pad_to_multiple_of)  # (B, Pg)
        return self.routing.recording_generate(generation.routes, prompt_mask)

    def _generate_recorded(self, generation, prompt_ids, *args, **kwargs):
        if self._vllm_capture is not None:  # vLLM colocate: keep the sampling masks and/or the routes
            completion_ids, logprobs = self._trl_generate_single_turn(prompt_ids, *args, **kwargs)
            if self.plan.sampler_routes == VLLM:
                self.routing.expect_vllm(generation.routes, *self._vllm_capture.routed_experts(len(completion_ids)))
            if self.plan.vllm_masks:
                generation.kept = self._vllm_capture.kept_sets(len(completion_ids))
            self._keep_vllm_top_k(generation, len(completion_ids))
            return completion_ids, logprobs
        if not self.plan.record_generate:
            with self._drawing():
                completion_ids, logprobs = self._trl_generate_single_turn(prompt_ids, *args, **kwargs)
            self._keep_vllm_top_k(generation, len(completion_ids))
            return completion_ids, logprobs
        keep_sets = self.plan.records_kept_sets
        recorder = SamplerLogprobRecorder(support_size_only=not keep_sets, top_k=self.plan.centering_top_k)
        integer = self.rollout_copy is not None and self.rollout_copy.is_integer
        if integer:  # the integer sampler's own fixed-point log-probs (no logits processor runs)
            with self._drawing():
                completion_ids, _ = self._trl_generate_single_turn(prompt_ids, *args, **kwargs)
            record = self.rollout_copy.integer.record(completion_ids)
        else:  # the recorder runs on the model that draws: the policy, or rollout_precision's copy
            with (self._drawing(recorder) if self.rollout_copy is not None
                  else recording_sampler(self.accelerator.unwrap_model(self.model_wrapped), recorder)):
                completion_ids, _ = self._trl_generate_single_turn(prompt_ids, *args, **kwargs)
            record = self._finish_recording(recorder, completion_ids)
        if not generation.recorded:  # the first turn; later tool turns only extend the log-probs TRL stitches
            generation.recorded = True
            generation.kept = record.kept if keep_sets else None
            generation.sampler_top_k = record.top_k
        # TRL pads these into `sampling_per_token_logps` (B, T) and stitches tool turns; NaN = not recorded
        logprobs = record.logprobs.cpu()  # (B, T): TRL takes Python lists here; one copy, not one per row
        return completion_ids, [logprobs[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]

    def _keep_vllm_top_k(self, generation, num_rows: int) -> None:
        """`score_centering="top_k"` on vLLM: the top-k log-probs vLLM returned for this call (B, T, k), as the
        generate recorder's (`generation.sampler_top_k`); nothing otherwise."""
        if self._vllm_logprobs is not None and self.plan.centering_top_k:
            generation.sampler_top_k = self._vllm_logprobs.take_top(num_rows, self.accelerator.device)

    def _finish_recording(self, recorder, completion_ids) -> SamplerRecord:
        """The recording of one generate call (`rollouts.finish_recording`); warns once when it saw none."""
        record, seen = finish_recording(recorder, completion_ids, self._tokenizer.pad_token_id,
                                        self.plan.records_kept_sets)
        if not seen and not self._warned_unrecorded:
            self._warned_unrecorded = True
            warnings.warn("record_sampler_logprobs: generate returned completions the recorder did not see (a "
                          "replaced or mocked generate?); their sampler log-probs are NaN and ratio/old_sampler/* "
                          "skips them", stacklevel=4)
        return record

    def _scoring_inputs(self, output, mode):
        """(input_ids, attention_mask, T, batch_size) of a generation batch, as TRL builds them for its old pass."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)  # (B, P+T)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)  # (B, P+T)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        return input_ids, attention_mask, output["completion_ids"].size(1), batch_size

    def _score_old(self, generation, input_ids, attention_mask, logits_to_keep, batch_size) -> torch.Tensor:
        """(B, T) fp32 old log-probs from the scoring mode, in TRL's chunking, with copies synced at this step
        (over the kept sets under `renormalize`); records log M_old and the fp16 fallback rows in `generation`."""
        kept = self._kept_rows(generation, None, input_ids.size(0), logits_to_keep)
        routes = self._routes(generation, None, attention_mask, logits_to_keep, True)
        with torch.no_grad(), self._no_gradient_checkpointing(), routes:
            result = self.scorer.score(
                input_ids, attention_mask, logits_to_keep,
                temperature=self.temperature, batch_size=batch_size, version=self.weights_version.value, kept=kept,
                penalty=None if kept is None else self._penalty(input_ids, attention_mask),
                compare_policy=self.args.ratio_full_vocab,
            )
        generation.fallback_rows += result.fallback_rows
        generation.full_vocab = result.full_vocab
        if kept is None:
            return result.logps
        self._keep_old_sets(generation, result.on_kept)
        return self.plan.corrected_logps(result.logps, result.on_kept.logps)

    def _score_reference(self, output, generation) -> None:
        """`ratio_attribution`: the fp32 reference passes (`reference_scorer`) of the sampled rows, at the weights that
        generated them, kept on `generation` (`AttributionReference`); the rows' positions go with the batch
        (`attribution_row`) to the micro-batches, where the diagnostics add the drift and train_precision terms
        (docs/attribution.md)."""
        input_ids, attention_mask, T, batch_size = self._scoring_inputs(output, generation.mode)
        rows = sample_rows(input_ids.size(0), self.plan.attribution_rows, input_ids.device)  # (n,)
        ids, mask = input_ids[rows], attention_mask[rows]  # (n, P+T)
        # the correction's kept sets, else the sampler's filter re-applied to the reference's logits
        kept = generation.kept.select_rows(rows).resize_steps(T) if generation.kept is not None else (
            self.plan.sampling if self.plan.sampling.truncated else None)
        penalty = None if kept is None else self._penalty(ids, mask)

        def reference(routes):  # (n, T) on the loss's support, (n, T) on the sampler's kept set
            with torch.no_grad(), self._no_gradient_checkpointing(), self.routing.reference_pass(routes):
                result = self.reference_scorer.score(ids, mask, T, temperature=self.temperature, batch_size=batch_size,
                                                     version=self.weights_version.value, kept=kept, penalty=penalty)
            if result.on_kept is None:
                return result.logps, result.logps  # one tensor: the truncation term is exactly 0
            return self.plan.corrected_logps(result.logps, result.on_kept.logps), result.on_kept.logps

        own_routes, sampler_routes = self.routing.reference_routes(generation.routes, rows)
        on_support, on_kept = reference(sampler_routes)
        own = on_support if own_routes is sampler_routes else reference(own_routes)[0]
        generation.attribution = AttributionReference(own, on_support, on_kept)
        output["attribution_row"] = row_positions(rows, input_ids.size(0))  # (B,) shuffled and split with the batch

    def _trl_old_pass(self, output, generation) -> torch.Tensor:
        """(B, T) old log-probs of the policy's own pass, as TRL runs it: TRL's helper on the whole batch in TRL's
        chunking, no grad, no activation checkpointing; routed through `_get_per_token_logps_and_entropies` as TRL's
        own old pass (kept sets and log M_old recorded as there)."""
        input_ids, attention_mask, T, batch_size = self._scoring_inputs(output, generation.mode)
        generation.old_pass_pending = True
        try:
            with torch.no_grad(), self._no_gradient_checkpointing():
                logps, *_ = self._get_per_token_logps_and_entropies(self.model, input_ids, attention_mask, T,
                                                                    batch_size=batch_size)
        finally:
            generation.old_pass_pending = False
        return logps

    def _weigh(self, output, generation) -> None:
        """`is_correction`: the loss's IS weight, put where TRL's vLLM path puts its own (`importance_sampling_ratio`,
        which TRL shuffles and splits with the batch), from old - sampler after any truncation correction."""
        key = sampler_logps_key(output)
        mask = output["completion_mask"].bool()  # (B, T)
        mask = mask if "tool_mask" not in output else mask & output["tool_mask"].bool()
        weights = importance_weights(output["old_per_token_logps"] - output[key], mask, self.plan.is_correction,
                                     sampler_logps=output[key], advantages=output["advantages"])
        output["importance_sampling_ratio"] = weights.weights  # (B, T), or (B, 1) when sequence-level
        self._log_is_weights(generation.mode, weights.weights, mask)  # TRL's sampling/importance_sampling_ratio/*

    def _reuses_training_forward(self) -> bool:
        """`RunPlan.reuses_training_forward` on this policy: not for an MoE policy whose routes the hooks replay or
        measure (`ratio/route/*` counts the old pass's routes against the sampler's), which keeps the old pass."""
        return self.plan.reuses_training_forward and not self.routing.active

    def _defer_weights(self, output, generation) -> None:
        """`is_correction` without an old pass (`RunPlan.reuses_training_forward`): each micro-batch's training forward
        computes its rows' IS weight from its own log-probs, detached (`_weigh_rows`), which is what TRL's loss takes as
        the old log-probs when the batch has none. A row index goes with the batch (TRL shuffles and splits it) so that
        the weights' metrics are computed on the whole batch in its row order once every micro-batch ran."""
        mask = output["completion_mask"].bool()  # (B, T)
        mask = mask if "tool_mask" not in output else mask & output["tool_mask"].bool()
        generation.is_weights = ReusedISWeights(mask=mask, rows_left=mask.size(0))
        output["is_weight_row"] = torch.arange(mask.size(0), device=self.accelerator.device)  # (B,)

    @staticmethod
    def _reused_as_old(generation, inputs: dict) -> bool:
        """This micro-batch's training forward is its old log-probs for the IS weight: its generation batch deferred
        the weight (`_defer_weights`) and the micro-batch holds no old log-probs (TRL's own condition for taking the
        training forward, detached, as old)."""
        return generation is not None and generation.is_weights is not None and "old_per_token_logps" not in inputs

    def _weigh_rows(self, micro_batch, logps) -> None:
        """`RunPlan.reuses_training_forward`: the micro-batch's IS weight (b, T), or (b, 1) when sequence-level, from
        this training forward's log-probs (b, T), detached, as the old ones, put where `_weigh` puts the whole batch's
        (`importance_sampling_ratio`, read by TRL's `_compute_loss` after this forward returns). Every part of an
        `ISCorrection` is per token or per row, so these are the rows of the whole-batch weight bit for bit."""
        inputs = micro_batch.inputs
        key = sampler_logps_key(inputs)
        mask = inputs["completion_mask"].bool()  # (b, T)
        mask = mask if "tool_mask" not in inputs else mask & inputs["tool_mask"].bool()
        old = logps.detach()  # (b, T): TRL's loss uses the same tensor as old (no old_per_token_logps in the batch)
        weights = importance_weights(old - inputs[key], mask, self.plan.is_correction, sampler_logps=inputs[key],
                                     advantages=inputs["advantages"]).weights
        inputs["importance_sampling_ratio"] = micro_batch.is_weights = weights

    def _log_reused_weights(self, micro_batch, generation) -> None:
        """Once the last micro-batch of a generation batch ran: TRL's `sampling/importance_sampling_ratio/*`-style
        metrics of the whole batch's reused IS weights, computed as `_weigh` computes them (the same (B, T) tensor)."""
        reused = generation.is_weights
        if reused.fill(micro_batch.inputs["is_weight_row"], micro_batch.is_weights):
            self._log_is_weights(generation.mode, reused.weights, reused.mask)

    def _lift_sampler(self, output, generation) -> None:
        """`lift_sampler`: sampler log-probs + log M_old, M_old = the old policy's mass on the kept set."""
        if generation.old_log_kept_mass is None:  # no old pass ran (on-policy bf16): one no-grad pass measures M
            input_ids, attention_mask, T, batch_size = self._scoring_inputs(output, generation.mode)
            kept = self._kept_rows(generation, None, input_ids.size(0), T)
            routes = self._routes(generation, None, attention_mask, T, True)
            with torch.no_grad(), self._no_gradient_checkpointing(), routes:
                *_, on_kept = self._policy_logps(self.model, input_ids, attention_mask, T, batch_size, kept)
            self._keep_old_sets(generation, on_kept)
        valid = output["completion_mask"].bool()  # (B, T)
        key = sampler_logps_key(output)
        lifted = lift_sampler_logprobs(output[key], generation.old_log_kept_mass * valid)
        output[key] = lifted  # (B, T)
        if "importance_sampling_ratio" in output and not self.plan.weights_is:  # TRL's, from the unlifted log-probs
            mask = valid if "tool_mask" not in output else valid & output["tool_mask"].bool()
            output["importance_sampling_ratio"] = importance_sampling_weights(
                output["old_per_token_logps"] - lifted, mask, self.vllm_importance_sampling_mode,
                self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max)
            # TRL logged its IS metrics before the lift; these are the loss's
            self._log_is_weights(generation.mode, output["importance_sampling_ratio"], mask)

    def _log_is_weights(self, mode: str, weights, mask) -> None:
        """TRL's `sampling/importance_sampling_ratio/*` keys of the weights (B, T) or (B, 1) the loss uses."""
        if self.diagnostics is not None:
            for key, value in self.diagnostics.importance_sampling_metrics(weights, mask).items():
                self._metrics[mode][key].append(value)

    # ------------------------------------------------------------------------------------------------------------
    # every log-prob call of TRL: the old pass (replaced or measured), the training forward, the reference pass

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           *args, **kwargs):
        generation = self._generations.get(self._mode())
        micro_batch = self._micro_batch  # set inside _compute_loss only: this call is the training forward
        is_old_pass = (micro_batch is None and generation is not None and generation.old_pass_pending
                       and model is self.model and not torch.is_grad_enabled())
        if is_old_pass:  # TRL's old pass is the first no-grad call on the policy inside a generation
            generation.old_pass_pending = False
        if is_old_pass and self.plan.replaces_old_pass:  # no float old pass: the sampler's (or integer) log-probs
            generation.old_logps = self._sampler_old_pass(generation, input_ids, logits_to_keep)
            return generation.old_logps, None, None
        if is_old_pass and self.scorer is not None:
            check_text_only(args, kwargs)
            generation.old_logps = self._score_old(generation, input_ids, attention_mask, logits_to_keep, batch_size)
            return generation.old_logps, None, None
        kept = self._kept_rows(generation, micro_batch, input_ids.size(0), logits_to_keep)
        # TRL's own old pass (bf16): R3 replays the sampler's routes, R2 keeps its routes; the training forward: R3/R2
        # replay at the micro-batch's rows
        routes = self._routes(generation, micro_batch, attention_mask, logits_to_keep, is_old_pass)
        fused = micro_batch is not None and self.plan.fused_head
        if fused:
            check_text_only(args, kwargs)
        capture = capture_norm_inputs(self.accelerator.unwrap_model(model)) if fused else contextlib.nullcontext()
        centres = micro_batch is not None and self.plan.centering is not None and torch.is_grad_enabled()
        last_hidden = capture_last_hidden(self.accelerator.unwrap_model(model)) if centres else contextlib.nullcontext()
        with routes, capture as norm_inputs, last_hidden as hidden:
            logps, entropies, aux, on_kept = self._policy_logps(model, input_ids, attention_mask, logits_to_keep,
                                                                 batch_size, kept, *args, **kwargs)
        if centres:  # the same values, the centred gradient: TRL's loss reads them after this call returns
            logps = self._centre(model, generation, micro_batch, logps, hidden, attention_mask, logits_to_keep)
        if fused:  # TRL's `_compute_loss` reads the micro-batch's old log-probs after this call returns
            micro_batch.inputs["old_per_token_logps"] = fused_old_logps(self.scorer, norm_inputs, input_ids[:, -logits_to_keep:],
                                                                       self.temperature, self.weights_version.value)
        if is_old_pass:
            self._keep_old_sets(generation, on_kept)
            generation.old_logps = logps
        if micro_batch is not None:
            self._keep_training_forward(micro_batch, logps, on_kept, generation)
        if micro_batch is not None and self._reused_as_old(generation, micro_batch.inputs):
            self._weigh_rows(micro_batch, logps)  # before the trust region, which multiplies this weight
        if micro_batch is not None and self.args.trust_region is not None:  # read by TRL after this call returns
            self._trust_region(micro_batch.inputs, logps)
        return logps, entropies, aux

    def _centre(self, model, generation, micro_batch, logps, hidden, attention_mask, logits_to_keep: int):
        """`score_centering`: the training forward's log-probs (b, T) with the centred score as their gradient
        (`corrections.centering`): c_t from the forward's last hidden states through the LM head, K cells at a time
        (no (b, T, V) tensor), the sampler's distribution recomputed (`"exact"`: temperature and the kept sets or
        the sampler's filter) or recorded (`"top_k"`); the (3,) statistics summed on the device."""
        T = logits_to_keep
        unwrapped = self.accelerator.unwrap_model(model)
        h = torch.cat([x[:, -T - 1:-1] for x in hidden])  # (b, T, H): the positions predicting the T tokens
        logits = head_logits(unwrapped, h, bool(trl_field(self.args, "cast_lm_head_to_fp32")), self.accelerator.autocast)
        mask = attention_mask[:, -T:].bool()  # (b, T)
        stats: list = []
        if self.plan.centering_top_k:
            ids, logq = generation.sampler_top_k  # (B, T_rec, k) each
            rows = micro_batch.inputs["centering_row_index"]  # (b,)
            ids, logq = ids[rows.to(ids.device)], logq[rows.to(logq.device)]  # (b, T_rec, k)
            if ids.size(1) < T:  # TRL pads completions beyond the recording (pad_to_multiple_of): masked cells
                pad = T - ids.size(1)
                ids = torch.nn.functional.pad(ids, (0, 0, 0, pad))
                logq = torch.nn.functional.pad(logq, (0, 0, 0, pad), value=-torch.inf)
            term = centering_terms(logits, mask, self.temperature, topk_ids=ids[:, :T], topk_logprobs=logq[:, :T],
                                   tail=self.plan.centering_tail, stats=stats)
        else:
            kept = self._kept_rows(generation, micro_batch, h.size(0), T)
            if kept is None or getattr(kept, "support_size_only", False):  # no sets (or sizes only): the filter
                kept = self.plan.sampling if self.plan.sampling.truncated else None
            term = centering_terms(logits, mask, self.temperature, kept=kept,
                                   on_kept=self.plan.renormalizes and kept is not None, stats=stats)
        if self.model.training and stats:
            sums = torch.stack(stats).sum(0)  # (3,)
            self._centering_sums = sums if self._centering_sums is None else self._centering_sums + sums
        return center_logps(logps, term.to(logps.dtype))

    def _flush_centering(self) -> None:
        """At the last micro-step of an update: `ratio/centering/*` (one read per optimizer step)."""
        if (self._step + 1) % self.current_gradient_accumulation_steps != 0 or self._centering_sums is None:
            return
        tv, tail, count = self.accelerator.reduce(self._centering_sums, "sum").tolist()
        self._centering_sums = None
        if count > 0:
            self._metrics["train"][CENTERING_DRIFT_TV].append(tv / count)
            if self.plan.centering_top_k:
                self._metrics["train"][CENTERING_TAIL_MASS].append(tail / count)

    def _routes(self, generation, micro_batch, attention_mask, logits_to_keep: int, old_pass: bool):
        """The routing session of one forward (`RoutingReplay.old_pass` / `update_forward`): an old pass over the
        whole generation batch, a training forward over its micro-batch's rows; none for the reference pass, a call
        outside TRL's steps or a dense policy (the routers route themselves)."""
        if generation is None or not self.routing.active:
            return contextlib.nullcontext()
        T = logits_to_keep
        prompt_mask, completion_mask = attention_mask[:, :-T], attention_mask[:, -T:]  # (B, P), (B, T)
        if old_pass:
            return self.routing.old_pass(generation.routes, prompt_mask, completion_mask)
        if micro_batch is None or "route_row_index" not in micro_batch.inputs:
            return contextlib.nullcontext()
        first_inner = self.model.training and self._first_inner_step()
        return self.routing.update_forward(generation.routes, micro_batch.inputs["route_row_index"], prompt_mask,
                                           completion_mask, first_inner)

    def _first_inner_step(self) -> bool:
        """This micro-step is in the first optimizer update of its generation (the weights that generated it)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        micro_step = self._step % generate_every  # position in this generation's cycle (before the increment)
        return micro_step < min(self.args.gradient_accumulation_steps, self.args.steps_per_generation)

    @staticmethod
    def _keep_old_sets(generation, on_kept) -> None:
        """The old pass's log M_old and, when it recomputed them, its kept sets (the loss uses the same sets): the
        one writer of these fields, for TRL's pass, the scoring mode's and the `lift_sampler` measuring pass."""
        if on_kept is None:
            return
        generation.old_log_kept_mass = on_kept.log_mass
        if on_kept.added is not None:
            generation.kept, generation.kept_added = on_kept.kept, on_kept.added

    def _keep_training_forward(self, micro_batch, logps, on_kept, generation) -> None:
        """What the diagnostics read of a micro-batch, each value from one place: the training forward's log-probs;
        log M_old and the recomputed additions from the old pass (in the batch TRL split), or, where no old pass ran
        (on-policy, the sampler arm), from this forward, which at the first inner step runs the old policy's weights;
        the attribution's reference passes of its rows (`ratio_attribution`)."""
        inputs = micro_batch.inputs
        micro_batch.train_logps = logps.detach()
        train_mass, train_added = (None, None) if on_kept is None else (on_kept.log_mass, on_kept.added)
        no_old_pass = "old_per_token_logps" not in inputs or self.plan.replaces_old_pass
        micro_batch.old_log_kept_mass = inputs.get("old_log_kept_mass", train_mass if no_old_pass else None)
        micro_batch.kept_added = inputs.get("kept_set_added", train_added)
        if "attribution_row" in inputs and generation is not None and generation.attribution is not None:
            micro_batch.attribution = generation.attribution.for_rows(inputs["attribution_row"])  # (b, T)

    def _policy_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size, kept, *args, **kwargs):
        """TRL's own call; with kept sets (or a filter that recomputes them), plus the log-probs over them from the
        same forward's last hidden states.

        Returns (logps, entropies, aux, on_kept): logps (B, T) as the correction needs them (over S under
        `renormalize`); on_kept = `KeptLogprobs` of this forward (log-probs over S, the sets, recomputed additions),
        or None without kept sets.
        """
        if kept is None:
            return *super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs), None
        unwrapped = self.accelerator.unwrap_model(model)
        # one forward chunk of TRL's at a time, each projected K cells at a time: never the batch's (B, T, V) logits;
        # without grad (the old pass) each chunk as its forward returns it, so one chunk's hidden states are alive at a
        # time (under grad autograd keeps them for backward anyway)
        chunks = KeptSetChunks(unwrapped, input_ids, attention_mask, logits_to_keep, kept, self.temperature,
                               trl_field(self.args, "cast_lm_head_to_fp32"), self.accelerator.autocast,
                               self._penalty(input_ids, attention_mask))
        with capture_last_hidden(unwrapped, None if torch.is_grad_enabled() else chunks.add) as hidden:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, *args, **kwargs)
        for h in hidden:
            chunks.add(h)
        on_kept = chunks.result()
        on_kept.log_mass = (logps - on_kept.logps).detach()  # (B, T) log M = log p_full(g) - log p_S(g)
        return self.plan.corrected_logps(logps, on_kept.logps), entropies, aux, on_kept

    def _penalty(self, input_ids, attention_mask) -> RepetitionPenalty | None:
        """The sampler's repetition penalty over these rows (B, P+T), which the correction re-applies to the trainer's
        logits (None when the plan has none)."""
        penalty = self.plan.repetition_penalty
        return None if penalty == 1.0 else RepetitionPenalty(penalty, input_ids, attention_mask)

    def _kept_rows(self, generation, micro_batch, num_rows: int, logits_to_keep: int):
        """KeptSets (num_rows, T) of the rows a log-prob call scores, or None when no correction is active: the
        whole generation batch, or a micro-batch's rows (TRL shuffled and split them; `kept_row_index` follows).
        With the "recompute" source and no sets yet, the sampler's `SamplingSettings`: this pass recomputes them."""
        if not self.plan.corrects or generation is None:
            return None
        if generation.kept is None:  # not recorded and not yet recomputed: this pass recomputes them from its logits
            return self.plan.sampling if self.plan.recomputes_kept_sets else None
        kept = generation.kept
        if micro_batch is not None:
            kept = kept.select_rows(micro_batch.inputs["kept_row_index"])  # on the sets' device: no copy up front
        if kept.num_rows != num_rows:
            raise RuntimeError(f"grpo_ratio: {num_rows} rows scored but {kept.num_rows} kept-set rows recorded")
        return kept.resize_steps(logits_to_keep)

    def _no_gradient_checkpointing(self):
        """No activation checkpointing in a no-grad pass (TRL does the same around its own old pass)."""
        from trl.models.utils import disable_gradient_checkpointing

        if not self.args.gradient_checkpointing:
            return contextlib.nullcontext()
        return disable_gradient_checkpointing(self.accelerator.unwrap_model(self.model),
                                              self.args.gradient_checkpointing_kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # one loss micro-batch: diagnostics at the first inner step

    def _compute_loss(self, model, inputs):
        trust = self.args.trust_region is not None
        generation = self._generations.get(self._mode())
        reuse = self._reused_as_old(generation, inputs)  # the IS weight comes from the training forward
        if trust or reuse:  # the mask and the weight join this micro-batch's own dict, never TRL's buffered batch
            inputs = dict(inputs)
            had_weight, weight = "importance_sampling_ratio" in inputs, inputs.get("importance_sampling_ratio")
        micro_batch = self._micro_batch = MicroBatchRecord(inputs=inputs)
        try:
            # is_correction on `generate`, or trust_region: TRL's own multiplication applies our factor
            # (grpo_ratio._compat); a weight already in the batch is one TRL applies (vLLM's) or ours (is_correction);
            # reused, ours joins the batch during the training forward (`_weigh_rows`)
            weighs = (self.plan.weights_is and "importance_sampling_ratio" in inputs) or trust or reuse
            with self._is_weight_gate(inputs) if weighs else contextlib.nullcontext():
                loss = super()._compute_loss(model, inputs)
        finally:
            self._micro_batch = None
            if micro_batch.is_weights is not None:  # reused: the weight the loss got (before any trust-region mask)
                had_weight, weight = True, micro_batch.is_weights
            if trust or reuse:  # the diagnostics read the batch's IS weight, not the mask
                if had_weight:
                    inputs["importance_sampling_ratio"] = weight
                else:
                    inputs.pop("importance_sampling_ratio", None)
        if reuse and micro_batch.is_weights is not None and self.diagnostics is not None:
            self._log_reused_weights(micro_batch, generation)
        if trust and self.model.training:
            self._flush_trust_region()
        if self.plan.centering is not None and self.model.training:
            self._flush_centering()
        if self.diagnostics is not None and self.model.training:
            self._update_diagnostics(micro_batch)
        return loss

    def _trust_region(self, inputs: dict, logps: torch.Tensor) -> None:
        """`trust_region`: DPPO's mask of this micro-batch's tokens (`corrections.trust_region`), from the training
        forward's log-probs (B, T) against the batch's old log-probs (the forward's own where TRL kept none: the
        on-policy default, where the mask keeps every token), put into the per-token factor TRL's `_compute_loss`
        multiplies its loss by (times any IS weight already there); the masked share is counted on the device."""
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        keep = trust_region_mask(logps, old, inputs["advantages"], self.args.trust_region,
                                 self.args.trust_region_low, self.args.trust_region_high)  # (B, T) fp32
        weight = inputs.get("importance_sampling_ratio")  # (B, T) or (B, 1)
        inputs["importance_sampling_ratio"] = keep if weight is None else weight * keep
        if self.model.training:
            valid = inputs["completion_mask"].bool()  # (B, T)
            valid = valid if "tool_mask" not in inputs else valid & inputs["tool_mask"].bool()
            counts = torch.stack([(valid & (keep == 0)).sum(), valid.sum()]).double()  # (2,)
            self._trust_region_counts = counts if self._trust_region_counts is None else self._trust_region_counts + counts

    def _flush_trust_region(self) -> None:
        """At the last micro-step of an update: `ratio/trust_region_masked_frac` (one read per optimizer step)."""
        if (self._step + 1) % self.current_gradient_accumulation_steps != 0 or self._trust_region_counts is None:
            return
        masked, total = self.accelerator.reduce(self._trust_region_counts, "sum").tolist()
        self._trust_region_counts = None
        if total > 0:
            self._metrics["train"][TRUST_REGION_MASKED_FRAC].append(masked / total)

    def _update_diagnostics(self, micro_batch: MicroBatchRecord) -> None:
        if self._first_inner_step() and micro_batch.train_logps is not None:
            self.diagnostics.update(micro_batch, mode_is_policy=self.plan.anchor_is_policy)
        if (self._step + 1) % self.current_gradient_accumulation_steps == 0:  # last micro-step of this update
            routes = self.routing.metrics(lambda v: self.accelerator.reduce(v, "sum"), self.accelerator.device)
            for key, value in (self.diagnostics.flush() | routes).items():
                self._metrics["train"][key].append(value)


class _LoggingDraw:
    """`RolloutCopy.drawing` that logs the copy's re-make seconds of the call (`ratio/rollout_copy_seconds`)."""

    def __init__(self, trainer, drawing):
        self.trainer, self.drawing = trainer, drawing

    def __enter__(self):
        return self.drawing.__enter__()

    def __exit__(self, *exc):
        out = self.drawing.__exit__(*exc)
        seconds = self.trainer.rollout_copy.last_seconds
        if exc[0] is None and seconds is not None:
            self.trainer._metrics[self.trainer._mode()][ROLLOUT_COPY_SECONDS].append(seconds)
        return out


class RatioGRPOTrainer(RatioHooks, GRPOTrainer):
    """Drop-in replacement for `trl.GRPOTrainer` (same constructor), configured by [`RatioGRPOConfig`].

    Example:
        ```python
        from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer

        args = RatioGRPOConfig(output_dir="out", old_logprob_mode="fp16_clone")
        trainer = RatioGRPOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=my_reward,
                                   args=args, train_dataset=dataset)
        trainer.train()
        ```

    Raises:
        TypeError: `args` is a plain `GRPOConfig` (use `RatioGRPOConfig`, which has every GRPOConfig field).
        ValueError: `guided_fp32_layers` names a layer the model does not have; an empty `train_dataset`, or one
            without a `prompt` column (`grpo_ratio.checks.check_train_dataset`).
        OSError: a model id that neither the hub, its cache nor (SmolLM2-135M-Instruct) the GGUF fallback provides
            (`grpo_ratio.models.trainer_model_source`).
        NotImplementedError: a sharded combination a mode cannot be exact in (`grpo_ratio.checks.check_sharded_mode`:
            FSDP1, PEFT or fp16 under FSDP2/ZeRO-3, parameter offload).
        RuntimeError (`train`): a second `train()` of one trainer under DeepSpeed ZeRO-3
            (`grpo_ratio.checks.check_train_again`).
    """

    _tag_names = ["trl", "grpo", "grpo-ratio"]
    config_class = RatioGRPOConfig
