"""`RatioRLOOTrainer`: TRL's `RLOOTrainer` with grpo_ratio's hooks (`grpo_ratio.trainer.RatioHooks`, not copied),
configured by `RatioRLOOConfig`. docs/rloo.md says what differs from GRPO.

The changes w.r.t. `trl.RLOOTrainer` (1.16) are `RatioGRPOTrainer`'s (scoring modes, truncation corrections,
`is_correction`, routing replay, `ratio/*` diagnostics, the gate), through the same four wrapped hooks. Where RLOO's
TRL code differs from GRPO's, four small adapters (`_compat.TRL_RLOO_READS`):
1. `_generate_single_turn` returns completion ids only: the hooks get GRPO's `(completion_ids, logprobs)`, and the
   sampler's log-probs (the `generate` recording or vLLM's) go to the `GenerationRecord`, not to TRL.
2. RLOO's batch keeps the old pass's sum (`old_logps`, (B,)) only: the per-token old log-probs and the sampler's
   are put into it (`old_per_token_logps`, `sampling_per_token_logps`, (B, T)), for the corrections and diagnostics;
   RLOO's loss reads neither.
3. The sampler arm: TRL computes `old_logps` and the KL penalty from the old pass before it returns, so the old pass
   returns the sampler's log-probs themselves (GRPO: zeros, replaced afterwards).
4. An IS weight (`is_correction`, sequence-level only on RLOO): RLOO's loss is the per-sequence PPO clip
   -min(r A, clip(r) A), with no IS factor; a weight w >= 0 enters as the advantage w A, which is the same loss as
   w times the sequence's clipped loss (`weighted_advantages`, docs/rloo.md for the derivation and sources).
With vLLM, RLOOTrainer asks for no log-probs (`logprobs=None`); they are asked for (`logprobs=0`, processed) only
when a setting computes with them (`checks.sampler_logprob_uses`, or a truncation correction): with defaults RLOO is
stock TRL bit for bit.

Shapes: B = rows of the generation batch (or of a micro-batch in `_compute_loss`), T = completion tokens.
"""

from __future__ import annotations

import contextlib

import torch
from trl import RLOOTrainer
from trl.trainer.utils import pad

from .checks import sampler_logprob_uses
from .config import RatioRLOOConfig
from .records import GenerationRecord
from .sampler.settings import sampler_anchor
from .sampler.vllm import VLLMLogprobCapture
from .trainer import RatioHooks


def weighted_advantages(advantages: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """RLOO's advantages with a sequence-level IS weight folded in: `w_i * A_i`.

    For w_i >= 0, -min(r_i (w_i A_i), clip(r_i) (w_i A_i)) = w_i * -min(r_i A_i, clip(r_i) A_i): the weighted
    advantage gives RLOO's own per-sequence clipped loss times w_i (the TIS/MIS weight of the sequence, Yao et al.
    2025 https://fengyao.notion.site/off-policy-rl; IcePop arXiv 2510.18855), with no copy of TRL's loss.

    Args:
        advantages: (B,) fp32, RLOO's leave-one-out advantages (Kool et al. 2019; Ahmadian et al. 2024,
            arXiv 2402.14740).
        weights: (B, 1) or (B,) fp32 sequence weights >= 0 (`importance_weights(...).weights` at a sequence level).
    Returns:
        (B,) fp32, `advantages * weights`.
    Raises:
        ValueError: `weights` is token-level (B, T > 1) or negative (the identity above needs w >= 0).
    """
    if weights.dim() == 2 and weights.size(1) != 1:
        raise ValueError(f"RLOO's ratio is per sequence; a token-level IS weight {tuple(weights.shape)} has no place "
                         f"in its loss (sequence-level is_correction only, docs/rloo.md)")
    if bool((weights < 0).any()):
        raise ValueError("an IS weight must be >= 0")
    return advantages * weights.reshape(-1)  # (B,)


@contextlib.contextmanager
def rloo_is_weight_gate(inputs: dict):
    """Within the context, the micro-batch's `advantages` (B,) are `weighted_advantages(advantages,
    importance_sampling_ratio)`, so RLOO's `_compute_loss` applies the IS weight; restored on exit, also on error."""
    saved = inputs["advantages"]
    inputs["advantages"] = weighted_advantages(saved, inputs["importance_sampling_ratio"])
    try:
        yield
    finally:
        inputs["advantages"] = saved


class RatioRLOOTrainer(RatioHooks, RLOOTrainer):
    """Drop-in replacement for `trl.RLOOTrainer` (same constructor), configured by [`RatioRLOOConfig`].

    Example:
        ```python
        from grpo_ratio import RatioRLOOConfig, RatioRLOOTrainer

        args = RatioRLOOConfig(output_dir="out", old_logprob_mode="fp16_clone")
        trainer = RatioRLOOTrainer(model="HuggingFaceTB/SmolLM2-135M-Instruct", reward_funcs=my_reward,
                                   args=args, train_dataset=dataset)
        trainer.train()
        ```

    Raises:
        TypeError: `args` is a plain `RLOOConfig` (use `RatioRLOOConfig`, which has every RLOOConfig field).
        ValueError, OSError, NotImplementedError, RuntimeError: as `RatioGRPOTrainer` (trainer.py); the config's own
            (`RatioRLOOConfig`: a token-level `is_correction`, `sampler_logprobs_in_loss`).
    """

    _tag_names = ["trl", "rloo", "grpo-ratio"]
    config_class = RatioRLOOConfig

    def _vllm_logprob_capture(self):
        # RLOO asks vLLM for no log-probs; ask (processed, the sampled token's, and the top-k for score centering)
        # where a setting computes with them
        wants = self.use_vllm and (sampler_logprob_uses(self.args) or self.plan.corrects)  # incl. top-k centering
        return VLLMLogprobCapture(self.vllm_generation, top_k=self.plan.centering_top_k) if wants else None

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        # RLOO's `_generate` wants the completion ids only; the hooks answer in GRPO's contract (adapter 1)
        completion_ids, logprobs = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        generation = self._generations.get(self._mode())
        if generation is not None and logprobs is not None:
            generation.sampler_logprobs = logprobs
        return completion_ids

    def _trl_generate_single_turn(self, prompt_ids, *args, **kwargs):
        completion_ids = super()._trl_generate_single_turn(prompt_ids, *args, **kwargs)  # RLOO's: ids only
        logprobs = None if self._vllm_logprobs is None else self._vllm_logprobs.take(len(completion_ids))
        return completion_ids, logprobs

    def _sampler_logps(self, generation: GenerationRecord, num_steps: int) -> torch.Tensor | None:
        """(B, num_steps) fp32 sampler log-probs of the batch, right-padded with 0 as GRPOTrainer pads them (vLLM's
        None -> NaN), or None when none were recorded."""
        if generation.sampler_logprobs is None:
            return None
        rows = [torch.tensor([float("nan") if x is None else x for x in row], dtype=torch.float32)
                for row in generation.sampler_logprobs]
        padded = pad(rows, padding_value=0.0, padding_side="right")  # (B, max length)
        out = torch.zeros(len(rows), num_steps, dtype=torch.float32)  # (B, T): TRL may pad_to_multiple_of
        width = min(num_steps, padded.size(1))
        out[:, :width] = padded[:, :width]
        return out.to(self.accelerator.device)

    def _complete_trl_output(self, output: dict, generation: GenerationRecord) -> None:
        # adapter 2: RLOO's batch keeps only sum_t old; the hooks and diagnostics read them per token
        output["old_per_token_logps"] = generation.old_logps  # (B, T)
        sampler = self._sampler_logps(generation, output["completion_ids"].size(1))
        if sampler is not None:
            output["sampling_per_token_logps"] = sampler  # (B, T); renamed for the diagnostics as on GRPO

    def _sampler_old_pass(self, generation: GenerationRecord, input_ids, logits_to_keep: int) -> torch.Tensor:
        # adapter 3: RLOO sums the old pass into old_logps and its KL penalty before returning: the sampler's own
        # log-probs (B, T), checked as the GRPO path checks them (`sampler_anchor`: none recorded, or a NaN)
        sampler = self._sampler_logps(generation, logits_to_keep)
        batch = {} if sampler is None else {"sampler_per_token_logps": sampler,
                                            "completion_mask": torch.ones_like(sampler, dtype=torch.long)}
        return sampler_anchor(batch)

    def _is_weight_gate(self, inputs: dict):
        return rloo_is_weight_gate(inputs)  # adapter 4
