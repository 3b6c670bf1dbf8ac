"""Fail early, with a clear message, on a TRL release whose internals we have not tested; and the checklist of every
TRL internal grpo_ratio reads, for the day TRL is upgraded.

RatioGRPOTrainer wraps four private methods of `trl.GRPOTrainer` (`TRL_HOOKS`, docs/trl_hooks.md) and reads the
private attributes, module globals and output-dict keys listed below. Their names, signatures and the order of the
calls inside TRL change between releases, so an untested release is refused at import. To move to a new TRL release:
go through `TRL_HOOKS`, `TRL_ATTRIBUTES`, `TRL_MODULE_GLOBALS`, `TRL_BATCH_KEYS` and `TRL_CONDITIONS` against its
`grpo_trainer.py`, run the default suite (tests/test_trl_internals.py checks that every name below still exists), then
widen `TESTED_TRL`.
"""

import contextlib

import trl
from packaging.version import Version


TESTED_TRL = (Version("1.16.0"), Version("1.17.0"))  # [low, high)

# private methods of `GRPOTrainer` that `RatioGRPOTrainer` overrides, each calling `super()` (docs/trl_hooks.md)
TRL_HOOKS = {
    "_generate_and_score_completions": "one generation batch: the GenerationRecord, the mode's old pass where TRL "
                                       "skips its own, kept_row_index, lift_sampler, per-batch metrics",
    "_generate_single_turn": "(completion_ids, logprobs) per turn: the generate recording, vLLM's sampling masks",
    "_get_per_token_logps_and_entropies": "every log-prob call: TRL's old pass is the first no-grad call on the "
                                          "policy inside a generation batch (replaced or measured); the training "
                                          "forward inside _compute_loss (fp32_head fused: the norm's input captured, "
                                          "old_per_token_logps set in the micro-batch inputs)",
    "_compute_loss": "one loss micro-batch (model, inputs): the MicroBatchRecord and the first-inner-step diagnostics",
}

# attributes of a built `GRPOTrainer` (set in its __init__) or of transformers' `Trainer` that grpo_ratio reads
TRL_ATTRIBUTES = {
    "use_vllm": "the generation backend (plan); with vllm_importance_sampling_correction, TRL's IS gate in "
                "_compute_loss, opened only through `trl_is_weight_gate` below",
    "vllm_importance_sampling_correction": "TRL's switch for its vLLM old pass and for applying importance_sampling_"
                                           "ratio in _compute_loss (opened only through `trl_is_weight_gate`)",
    "use_transformers_continuous_batching": "the generation backend (plan)",
    "vllm_mode": "colocate vs server (the colocate engine's dtype)",
    "vllm_generation": "`.llm`: the colocate engine (its generate is wrapped; `.llm_engine.model_config.dtype` and "
                       "`.head_dtype`); `.vllm_client.get_server_info()` in server mode: the server's logprobs_mode "
                       "(checks.check_server_logprobs)",
    "vllm_importance_sampling_mode": "the IS weights recomputed after lift_sampler",
    "vllm_importance_sampling_clip_min": "the IS weights recomputed after lift_sampler",
    "vllm_importance_sampling_clip_max": "the IS weights recomputed after lift_sampler",
    "generation_config": "the settings generate uses (with the model's own generation_config)",
    "temperature": "the temperature TRL divides logits by (scoring modes, kept-set log-probs)",
    "eos_token_ids": "the valid-token mask of the diagnostics",
    "tools": "multi-turn generation (kept sets not stitched across turns)",
    "environment_factories": "multi-turn generation (kept sets not stitched across turns)",
    "num_iterations": "TRL's old-pass condition and the first inner step",
    "_step": "the micro-step counter: which micro-batch is the first inner step",
    "_metrics": "TRL's metric buffer `[mode][key]`, where ratio/* metrics are appended",
    "_tokenizer": "the pad id to rebuild generate's sequences from TRL's completion lists",
    "current_gradient_accumulation_steps": "transformers (set in train()): the last micro-step of an update (flush)",
    "model_wrapped": "transformers: the model generate runs on (the recorder is attached to it, unwrapped)",
}

# the attributes above that exist only with vLLM (TRL builds `vllm_generation` for use_vllm=True)
TRL_VLLM_ATTRIBUTES = ("vllm_generation",)

# module-level names of TRL that grpo_ratio uses or patches: (module, name) -> why
TRL_MODULE_GLOBALS = {
    ("trl.generation.vllm_generation", "LLM"): "wrapped while TRL builds the colocate engine (return_sampling_mask)",
    ("trl.models.utils", "disable_gradient_checkpointing"): "no activation checkpointing in the mode's no-grad pass",
    ("trl.kernels", "ChunkedLogProbFunction"): "the old pass's and fused head's log-probs in TRL's token x vocabulary tiles",
    ("trl.trainer.utils", "maybe_gather_lm_head_ctx"): "the ZeRO-3 head gathered for kept-set log-probs outside a forward",
}

# keys of the batch dict `_generate_and_score_completions` returns (and `_compute_loss` receives) that grpo_ratio reads;
# True = always present, False = present in some configurations only
TRL_BATCH_KEYS = {
    "prompt_ids": True, "prompt_mask": True, "completion_ids": True, "completion_mask": True, "advantages": True,
    "old_per_token_logps": False,  # when TRL runs its old pass (or ours adds it)
    "sampling_per_token_logps": False,  # vLLM, or generate with logprobs (ours: the recording)
    "importance_sampling_ratio": False,  # vLLM IS correction (ours replaces it under is_correction, or adds it)
    "tool_mask": False,  # tools
}

# TRL 1.16 behaviour that grpo_ratio mirrors or relies on (checked at run time where possible)
TRL_CONDITIONS = (
    "the old pass runs iff gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0 or (use_vllm "
    "and vllm_importance_sampling_correction): grpo_ratio.plan.trl_runs_old_pass; the trainer raises when TRL did not",
    "TRL's fused LM head patches the policy's `forward` on the instance (copies and scoring forwards bypass it)",
    "_generate_single_turn returns per-row python lists; TRL pads sampling_per_token_logps and stitches tool turns",
    "_compute_loss prefers sampling_per_token_logps over old_per_token_logps for its off-policy mask",
    "_compute_loss calls _get_per_token_logps_and_entropies (the training forward) before it reads "
    "inputs.get('old_per_token_logps'): fp32_head's fused path sets that key inside the training forward "
    "(tests/test_fused_head.py fails when the order changes: the loss would fall back to the detached training "
    "log-probs and new/old would be exactly 1)",
    "the training forward calls the policy with no position_ids (fp32_head's separate pass uses that layout too)",
    "_compute_loss multiplies per_token_loss by inputs['importance_sampling_ratio'] iff use_vllm and "
    "vllm_importance_sampling_correction and loss_type != 'vespo' (vespo folds it into its sequence weight), and reads "
    "neither attribute anywhere else: `trl_is_weight_gate`; tests/test_is_training.py checks its source",
    "inside _generate_and_score_completions the old pass is the first no-grad _get_per_token_logps_and_entropies call "
    "on self.model, before the reference pass (which, with PEFT and beta > 0, also calls self.model with the adapter "
    "disabled): the trainer tells the two apart by that order; tests/test_trl_internals.py checks it in TRL's source",
)


# TRL 1.16's RLOOTrainer (`rloo_trainer.py`), which `grpo_ratio.rloo.RatioRLOOTrainer` extends with the same four
# hooks (`TRL_HOOKS`): what differs from GRPOTrainer and what grpo_ratio reads there (docs/rloo.md)
TRL_RLOO_READS = {
    "_generate_single_turn": "returns completion_ids only (GRPO: (completion_ids, logprobs)); RatioRLOOTrainer adapts "
                             "it to GRPO's contract and back (`_trl_generate_single_turn`)",
    "vllm_generation.logprobs": "RLOO builds VLLMGeneration with logprobs=None; set to 0 (the sampled token's "
                                "processed log-prob) when a setting computes with the sampler's log-probs",
    "vllm_generation.generate": "returns (prompt_ids, completion_ids, logprobs, logprob_token_ids); RLOO drops the "
                                "log-probs, RatioRLOOTrainer keeps them (`sampler.vllm.VLLMLogprobCapture`)",
    "old_logps": "batch key, (B,): the sum of the old pass's per-token log-probs over completion_mask; RLOO's loss "
                 "reads it, not old_per_token_logps (which RatioRLOOTrainer adds for the diagnostics)",
    "advantages": "batch key, (B,): leave-one-out advantages; RLOO's loss is -min(r A, clip(r) A) per sequence, so "
                  "an IS weight w >= 0 of a sequence enters as w A (`rloo.weighted_advantages`)",
}

# what RatioAsyncGRPOTrainer reads of TRL 1.16's experimental AsyncGRPOTrainer (trl/experimental/async_grpo)
TRL_ASYNC_READS = {
    "compute_loss": "called twice per micro-batch under the decoupled objectives: first with a probe as the model "
                    "(TRL builds the forward's arguments from the packed batch and calls it; nothing before that call "
                    "changes state), then on the rewritten batch; its loss is -min(r A, clip(r) A) per term with "
                    "r = exp(log_probs - old_log_probs), so old = proximal and A -> w A give the decoupled loss",
    "rollout_queue": "the worker's queue (rank 0), wrapped so each sample carries its staleness; TRL's "
                     "RolloutQueueDataset calls .get(timeout=...) and .qsize() on it",
    "model_version": "the version TRL compares a sample's model_version with (staleness = model_version - "
                     "sample.model_version, its drop rule)",
    "RolloutSample.metrics": "a dict per sample that TRL's collator averages into metrics; the staleness tag rides in "
                             "a copy of it and is removed before TRL's collator reads it",
    "get_train_dataloader": "returns accelerate's DataLoaderDispatcher; its base_dataloader.collate_fn (TRL's "
                            "DataCollatorForRollout) is wrapped to add the per-term staleness",
    "batch keys": "token_index (R, M_max), -1 padding: the loss terms; segment_id: each term's sample in its row (terms "
                  "of a sample contiguous, in TreeRow.samples order); old_log_probs, advantages",
    "_step_forward_s": "the step's forward time TRL accumulates; the log-linear objective adds its probe's forward",
    "_metrics": "TRL's metric sink; the ratio/staleness/* values are added to the logs in log()",
    "packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device": "module globals swapped by "
                                                                         "old_pass.tree_attention and testing.async_cpu",
}

# TRL 1.16 RLOO behaviour grpo_ratio relies on
TRL_RLOO_CONDITIONS = (
    "RLOOTrainer always runs its old pass (no num_iterations condition), the first no-grad "
    "_get_per_token_logps_and_entropies call on self.model, before the reference pass: grpo_ratio.plan.trl_runs_old_pass",
    "the ratio of RLOO's loss is per sequence: exp(sum_t logp_t - old_logps), clipped per sequence; the per-token "
    "ratio/* diagnostics measure its terms, and ratio/clip_flip_rate (a per-token clip) is not logged",
    "the KL penalty enters the reward as beta * sum_t (old - ref): a scoring mode's (or the sampler arm's) old "
    "log-probs are the ones it uses",
)

# GRPOConfig fields (and GRPOTrainer attributes) grpo_ratio reads that RLOOConfig / RLOOTrainer (TRL 1.16) lack,
# with the value that means "off" there: RLOO has no vLLM IS correction, no off-policy mask, no loss_type (its loss
# is the sequence-level PPO clip), no fp32 head cast, no tools
GRPO_ONLY_FIELDS = {
    "vllm_importance_sampling_correction": False,
    "vllm_importance_sampling_mode": "sequence_mask",  # GRPOConfig's default; unused while the correction is off
    "vllm_importance_sampling_clip_min": None,
    "vllm_importance_sampling_clip_max": 3.0,
    "off_policy_mask_threshold": None,
    "loss_type": None,  # none of the token-level PPO clip losses of ratio_diagnostics.PPO_CLIP_LOSSES
    "importance_sampling_level": "sequence",  # RLOO's ratio is one per sequence
    "delta": None,
    "cast_lm_head_to_fp32": False,
    "tools": (),
    "environment_factories": None,
}


def trl_field(obj, name: str):
    """`obj.name` for a config or trainer field of `GRPO_ONLY_FIELDS`, or its "off" value where `obj` (an RLOO config
    or trainer) has no such field.

    Raises:
        KeyError: `name` is not in `GRPO_ONLY_FIELDS` (read every other field directly).
    """
    return getattr(obj, name, GRPO_ONLY_FIELDS[name])


def is_rloo(args) -> bool:
    """The config is TRL's `RLOOConfig` (a `RatioRLOOConfig` too): RLOO's semantics (`TRL_RLOO_CONDITIONS`)."""
    return isinstance(args, trl.RLOOConfig)


@contextlib.contextmanager
def trl_is_weight_gate(trainer):
    """Within the context, TRL's `_compute_loss` applies `inputs["importance_sampling_ratio"]`.

    The contract (TRL 1.16, `grpo_trainer.py` L3146, the last entry but one of `TRL_CONDITIONS`): `_compute_loss`
    multiplies the per-token loss by that weight iff `self.use_vllm and self.vllm_importance_sampling_correction`
    (and `loss_type != "vespo"`), and reads neither attribute anywhere else. On the `generate` path with an
    `is_correction` the trainer puts its weight where TRL's vLLM path puts its own and opens the gate for that one call,
    so TRL's own multiplication applies it (no copy of TRL's loss). The attributes are restored on exit, also on error.

    Args:
        trainer: a `trl.GRPOTrainer`; where TRL's vLLM correction already opened the gate, nothing changes.
    """
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        yield
        return
    saved = trainer.use_vllm, trainer.vllm_importance_sampling_correction
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    try:
        yield
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = saved


def check_trl_version(version: str = trl.__version__) -> None:
    """Raise `ImportError` unless `version` is in the tested TRL range `[1.16.0, 1.17.0)`.

    Set the environment variable `GRPO_RATIO_SKIP_TRL_CHECK=1` to try an untested release at your own risk.
    """
    import os

    if os.environ.get("GRPO_RATIO_SKIP_TRL_CHECK") == "1":
        return
    low, high = TESTED_TRL
    if not (low <= Version(version) < high):
        raise ImportError(
            f"grpo_ratio is tested with trl>={low},<{high} but found trl=={version}. It wraps private GRPOTrainer "
            f"methods ({', '.join(TRL_HOOKS)}) and reads TRL internals (grpo_ratio/_compat.py lists them) whose "
            f"behaviour changes between releases. Install a tested release: pip install 'trl>={low},<{high}' "
            f"(or set GRPO_RATIO_SKIP_TRL_CHECK=1 to try anyway)."
        )
