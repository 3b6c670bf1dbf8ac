"""Ratio diagnostics of RatioGRPOTrainer: accumulate over the first inner step, reduce across processes, log.

What is measured (formulas in docs/metrics.md), on the micro-batches of the first optimizer update after each
generation, where new/old must be 1 (the batch-logprob-gap report: "it is the identity by construction"):
- `ratio/new_old/*`: r = exp(logp_new - logp_old); logp_new is the training forward (the policy's own pass at its
  training precision and batch shape), logp_old whatever anchored the ratio (the scoring mode, or TRL's own pass, or
  logp_new itself when TRL skips the old pass).
- `ratio/old_sampler/*`: r = exp(logp_old - logp_sampler), raw: before any truncation/masking (unlike TRL's
  `sampling/importance_sampling_ratio/*`, trl#5231); present whenever sampler log-probs exist (vLLM, or generate
  with `record_sampler_logprobs`).
- `ratio/clip_flip_rate(_adv_weighted)`: tokens whose PPO-clip decision differs between the mode's old log-probs and
  the policy's own. At the first inner step the policy's own pass *is* logp_new, so the policy's ratio is exactly 1 and
  no extra forward is needed; for `bf16` the two anchors are the same and every decision agrees.
- `ratio/old_sampler_corrected/*`, `ratio/kept_mass_mean`: with a truncation correction, the ratio after it
  (p_old,S(g) / q_S(g) for both corrections) and the old policy's mean mass on the kept sets.
- `ratio/kept_set_added_rate`: with recomputed kept sets, the share of tokens the recomputed filter dropped although
  the sampler drew them (added back to their set): where the trainer's logits disagree with the sampler's boundary.
- `ratio/new_old/kl_*`, `ratio/old_sampler/kl_*` (and `chi2_*`, `log_ppl_*`, `ppl_ratio`): the same two ratios in
  the units other trainers log (`grpo_ratio.diagnostics.mismatch.MismatchStats`).
- `ratio/new_old/full_*` (`ratio_full_vocab`): exact full-vocabulary KL / TV between the scoring mode's old
  distribution and the policy's own, from the scoring pass (`mismatch.FullVocabStats`).
- `ratio/is_*`: of the IS weight in the loss (TRL's vLLM correction, or `is_correction`): the shares truncated, masked
  or rejected, the effective sample size, the raw weights' quantiles (`mismatch.ISWeightStats`).
- `ratio/fp16_fallback_rows`: `fp16_clone` rows re-scored in fp32 after an fp16 overflow, per generation batch.
- `ratio/attribution/*` (`ratio_attribution`): log new - log sampler of the sampled rows split into drift,
  train_precision, precision, routing, truncation and engine terms (`grpo_ratio.diagnostics.attribution`,
  docs/attribution.md).
- `ratio/by_position/*` (`ratio_by_position`): new/old and old/sampler per completion-position bucket, and each
  sequence's log-ratio split into bias and noise (`grpo_ratio.diagnostics.by_position`).
- `ratio/importance_sampling_ratio/{min,mean,max}`: under `lift_sampler` with vLLM's IS correction, the IS weights
  the loss uses (TRL's `sampling/importance_sampling_ratio/*` is computed before the lift).

Every key is in `grpo_ratio.diagnostics.metric_keys` (the table the consumers read too). Token-weighted over valid tokens (`ratios.valid_token_mask`) across micro-batches and processes. An update with no
valid token (every completion masked: `mask_truncated_completions`, tool masks) logs `ratio/new_old/num_tokens` = 0
and nothing else, and warns once.
"""

from __future__ import annotations

import warnings

import torch

from .._compat import trl_field
from ..corrections.is_correction import ISCorrection, importance_weights
from ..modes import MODES
from . import metric_keys as keys
from .attribution import AttributionStats, attribution_terms
from .by_position import PositionStats
from .mismatch import FullVocabStats, ISWeightStats, MismatchStats
from .ratios import MeanStats, RatioStats, clip_flips, valid_token_mask


# batch keys of the scoring pass's full-vocabulary divergences (ratio_full_vocab), in `FullVocabStats.update` order
FULL_VOCAB_KEYS = ("full_vocab_kl", "full_vocab_reverse_kl", "full_vocab_tv")

# TRL loss types whose objective is the PPO clip -min(r A, clip(r) A) (grpo_trainer.py `_compute_loss`)
PPO_CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


class RatioDiagnostics:
    """Accumulator for one optimizer update's `ratio/*` metrics.

    Args:
        args: the trainer's `RatioGRPOConfig` (band, clip_flip_every, epsilon(s), delta, loss_type, vLLM IS fields).
        accelerator: the trainer's `accelerate.Accelerator` (for the cross-process reduction).
        eos_token_ids: TRL's `eos_token_ids` (list of ints), for the valid-token mask.
        plan: the trainer's `grpo_ratio.plan.RunPlan` (read, never built here: which anchor, which correction, where
            the kept sets come from, which IS correction).
    """

    def __init__(self, args, accelerator, eos_token_ids, plan):
        self.args = args
        self.plan = plan
        self.accelerator = accelerator
        self.eos_token_ids = list(eos_token_ids)
        self.band = (args.ratio_band_low, args.ratio_band_high)
        eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.epsilons = (args.epsilon, eps_high)
        delta = trl_field(args, "delta")
        self.flips_supported = (  # RLOO (no loss_type, a per-sequence clip): not supported
            trl_field(args, "loss_type") in PPO_CLIP_LOSSES
            and trl_field(args, "importance_sampling_level") == "token"
            and (delta is None or delta > 1 + eps_high)  # ratios.ppo_clip_active's domain
        )
        # the correction behind the loss's `importance_sampling_ratio`: ours, else TRL's vLLM mode
        self.is_correction = self.plan.is_correction or ISCorrection.from_trl(
            trl_field(args, "vllm_importance_sampling_mode"), trl_field(args, "vllm_importance_sampling_clip_min"),
            trl_field(args, "vllm_importance_sampling_clip_max"))
        self.num_updates = 0  # optimizer updates that carried a first inner step (for clip_flip_every)
        self.warned_no_tokens = False
        self._reset()

    def _reset(self):
        self.new_old = RatioStats(self.band)
        self.old_sampler = RatioStats(self.band)
        self.old_sampler_corrected = RatioStats(self.band)
        self.new_old_units, self.old_sampler_units = MismatchStats(), MismatchStats()
        self.full_vocab = FullVocabStats()
        self.kept_mass = MeanStats()  # M_old on the kept sets, on the device of the log-probs
        self.kept_set_added = MeanStats()  # recomputed kept sets: share of sampled tokens added back
        self.attribution = AttributionStats()  # ratio_attribution: the six terms of log new - log sampler
        # ratio_by_position: per-position buckets and the bias/noise split, on the device until flush
        self.by_position = PositionStats(self.args.max_completion_length) \
            if getattr(self.args, "ratio_by_position", False) else None
        self.flips = None
        self.is_stats = None
        self.touched = False

    def generation_metrics(self, fallback_rows: int) -> dict[str, float]:
        """Metrics of one generation batch (every process must call it): `ratio/fp16_fallback_rows`, summed across
        processes, under `fp16_clone`; nothing otherwise."""
        if self.plan.scorer_mode is None or not MODES[self.plan.scorer_mode].overflows:
            return {}
        rows = torch.tensor(float(fallback_rows), device=self.accelerator.device)
        return {keys.FP16_FALLBACK_ROWS: self.accelerator.reduce(rows, reduction="sum").item()}

    def importance_sampling_metrics(self, weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
        """`ratio/importance_sampling_ratio/{min,mean,max}` of the IS weights the loss really uses (after
        `lift_sampler`), computed and gathered as TRL computes its `sampling/importance_sampling_ratio/*` (which it
        logs before the lift). Every process must call it.

        Args:
            weights: (B, T) token-level or (B, 1) sequence-level IS weights. mask: (B, T) bool valid tokens.
        """
        flat = weights.flatten() if weights.size(1) == 1 else weights[mask]  # (n,)
        zero = torch.zeros((), device=weights.device)
        local = [flat.min() if flat.numel() else zero, flat.mean() if flat.numel() else zero,
                 flat.max() if flat.numel() else zero]
        gathered = [self.accelerator.gather(x.reshape(1)) for x in local]  # (P,) each
        return {keys.IS_WEIGHTS_MIN: gathered[0].min().item(), keys.IS_WEIGHTS_MEAN: gathered[1].nanmean().item(),
                keys.IS_WEIGHTS_MAX: gathered[2].max().item()}

    def update(self, micro_batch, mode_is_policy: bool) -> None:
        """Add one first-inner-step micro-batch.

        Args:
            micro_batch: the loss micro-batch (a `grpo_ratio.records.MicroBatchRecord`): `inputs` as TRL's `_compute_loss` got them (completion_ids/mask
                (B, T), advantages (B,), and optionally old_per_token_logps, sampling_per_token_logps,
                importance_sampling_ratio), `train_logps` (B, T) fp32 of the training forward, detached (over S
                under `renormalize`), `old_log_kept_mass` (B, T) log M_old and `kept_added` (B, T) bool.
            mode_is_policy: True when the old log-probs are the policy's own (`bf16` mode).
        """
        inputs, train_logps, log_mass = micro_batch.inputs, micro_batch.train_logps, micro_batch.old_log_kept_mass
        mask = valid_token_mask(inputs["completion_ids"], inputs["completion_mask"], self.eos_token_ids)  # (B, T)
        if "tool_mask" in inputs:
            mask &= inputs["tool_mask"].bool()
        old = inputs.get("old_per_token_logps")
        old = train_logps if old is None else old  # TRL skipped the old pass: old := new.detach(), r == 1
        new_old = train_logps - old  # (B, T)
        self.new_old.update(new_old, mask)
        self.new_old_units.update(new_old, mask)
        if self.by_position is not None:
            self.by_position.update("new_old", new_old, mask)
        if FULL_VOCAB_KEYS[0] in inputs:  # the scoring pass held both distributions (ratio_full_vocab)
            self.full_vocab.update(*(inputs[k] for k in FULL_VOCAB_KEYS), mask)
        # the generate recording (ours, kept out of TRL's loss by default), else what TRL holds (vLLM, rollout_func)
        sampler = inputs.get("sampler_per_token_logps", inputs.get("sampling_per_token_logps"))
        if sampler is not None and self.plan.anchor_is_sampler:  # old IS the sampler: r == 1 exactly, measured as such
            self.old_sampler.update(old - sampler, mask & ~torch.isnan(sampler))
            self.old_sampler_units.update(old - sampler, mask)
            self._update_kept_mass(log_mass, mask & ~torch.isnan(sampler))
            if self.by_position is not None:
                self.by_position.update("old_sampler", old - sampler, mask & ~torch.isnan(sampler))
        elif sampler is not None:
            self._update_old_sampler(old, sampler, log_mass, mask, inputs)
        if micro_batch.attribution is not None and sampler is not None:
            self._update_attribution(micro_batch, old, sampler, log_mass, mask)
        added = micro_batch.kept_added  # (B, T) bool | None
        if added is not None:
            self.kept_set_added.update(added.bool(), mask)
        every = self.args.clip_flip_every
        if self.flips_supported and every and self.num_updates % every == 0:
            policy_log_ratio = new_old if mode_is_policy else torch.zeros_like(new_old)  # policy anchor: r == 1
            stats = clip_flips(new_old, policy_log_ratio, inputs["advantages"], mask, *self.epsilons,
                               delta=trl_field(self.args, "delta"))
            self.flips = stats if self.flips is None else self.flips.merge(stats)
        self.touched = True

    def _update_old_sampler(self, old, sampler, log_mass, mask, inputs):
        """old/sampler before correction (raw, full vocabulary vs the sampler's renormalised log-prob) and after."""
        has_sampler = mask & ~torch.isnan(sampler)  # vLLM gives NaN where it had no log-prob
        if not self.plan.corrects or log_mass is None:
            raw = old - sampler  # (B, T)
        else:
            old_full = old + log_mass if self.plan.renormalizes else old  # (B, T)
            sampler_raw = sampler - log_mass if self.plan.lifts_sampler else sampler  # (B, T)
            raw = old_full - sampler_raw  # (B, T)
            self.old_sampler_corrected.update(raw - log_mass, has_sampler)  # both corrections: p_old,S / q_S
            self._update_kept_mass(log_mass, has_sampler)
        self.old_sampler.update(raw, has_sampler)
        self.old_sampler_units.update(raw, mask)  # NaN sampler log-probs are left out there too
        if self.by_position is not None:
            self.by_position.update("old_sampler", raw, has_sampler)
        if "importance_sampling_ratio" in inputs:  # the weight as the loss got it, from the same log-probs (rows whole)
            weights = importance_weights(old - sampler, mask, self.is_correction, sampler_logps=sampler,
                                         advantages=inputs["advantages"])
            stats = ISWeightStats.of(self.is_correction).update(weights)
            self.is_stats = stats if self.is_stats is None else self.is_stats.merge(stats)

    def _update_attribution(self, micro_batch, old, sampler, log_mass, mask) -> None:
        """`ratio/attribution/*`: the micro-batch's sampled rows, log new - log sampler (the sampler's log-probs as the
        loss's side processed them: + log M_old under `lift_sampler`) split into its six terms. Called at the first
        inner step only, where the training forward runs the weights that generated the batch: it is its own
        `new_at_generation`, so the drift term is exactly 0 and `train_precision` holds new - old."""
        reference = micro_batch.attribution
        lift = log_mass if self.plan.lifts_sampler else None  # (B, T) | None: what the lift added
        new = micro_batch.train_logps  # (B, T)
        terms = attribution_terms(new, old, sampler, reference, lift, new_at_generation=new)
        rows = reference.present.to(mask.device).unsqueeze(1)  # (B, 1) the rows that were sampled
        self.attribution.update(terms, mask & rows & ~torch.isnan(sampler))

    def _update_kept_mass(self, log_mass, mask) -> None:
        if log_mass is not None and self.plan.corrects:
            self.kept_mass.update(torch.exp(log_mass.double()), mask)

    def flush(self) -> dict[str, float]:
        """Reduce across processes and return this update's metrics (every process must call it); then reset."""
        if not self.touched:
            return {}
        acc = self.accelerator if self.accelerator.num_processes > 1 else None
        metrics = {}
        new_old = self.new_old.all_reduce(acc)
        metrics.update(new_old.as_metrics(keys.NEW_OLD.prefix))
        if new_old.num_tokens.item() == 0:
            metrics[keys.NEW_OLD.num_tokens] = 0.0
            if not self.warned_no_tokens:
                self.warned_no_tokens = True
                warnings.warn("ratio diagnostics: an optimizer update had no valid completion token (every completion "
                              "masked, e.g. by mask_truncated_completions); ratio/new_old/num_tokens = 0 and no other "
                              "ratio/* metric for such updates", stacklevel=2)
        metrics.update(self.old_sampler.all_reduce(acc).as_metrics(keys.OLD_SAMPLER.prefix))
        metrics.update(self.old_sampler_corrected.all_reduce(acc).as_metrics(keys.OLD_SAMPLER_CORRECTED.prefix))
        metrics.update(self.new_old_units.all_reduce(acc).as_metrics(keys.NEW_OLD.prefix))
        if self.args.ratio_full_vocab:
            metrics.update(self.full_vocab.all_reduce(acc).as_metrics(keys.NEW_OLD.prefix))
        metrics.update(self.old_sampler_units.all_reduce(acc).as_metrics(keys.OLD_SAMPLER.prefix))
        if self.plan.corrects:
            kept_mass = self.kept_mass.all_reduce(acc).mean()
            if kept_mass is not None:
                metrics[keys.KEPT_MASS_MEAN] = kept_mass
        if self.plan.recomputes_kept_sets:
            added_rate = self.kept_set_added.all_reduce(acc).mean()
            if added_rate is not None:
                metrics[keys.KEPT_SET_ADDED_RATE] = added_rate
        if self.plan.attributes:
            metrics.update(self.attribution.all_reduce(acc).as_metrics())
        if self.flips is not None:
            metrics.update(self.flips.all_reduce(acc).as_metrics(keys.PREFIX))
        if self.is_stats is not None:
            metrics.update(self.is_stats.all_reduce(acc).as_metrics(keys.PREFIX))
        if self.by_position is not None:
            metrics.update(self.by_position.flush(acc))
        self.num_updates += 1
        self._reset()
        return metrics

