"""Every scoring mode under a real FSDP2 or ZeRO-3 run, checked against an unsharded replica of the same weights.

Launched by tests/test_sharded.py (2 CPU processes, gloo), once per engine and precision (one process cannot switch:
accelerate keeps the first FSDP mixed-precision policy):
    accelerate launch --config_file CONFIG tests/sharded_modes.py OUT.json ENGINE PRECISION

PRECISION `bf16` is TRL's `bf16=True` (accelerate's bf16 FSDP2 policy, or DeepSpeed bf16), `fp32` is `bf16=False`.
For each mode and each head (untied Qwen2, tied Llama), one `RatioGRPOTrainer` trains 2 steps, then (FSDP2) `train()` runs
again (2 more steps, the step counter restarts; under ZeRO-3 a second `train()` fails in stock TRL as well:
`accelerator.deepspeed_engine_wrapped` is None after the first). At every old pass the mode's (B, T) log-probs are
compared with what the same mode gives on an unsharded replica of the gathered weights, and the copies' versions and
refresh counts are recorded. Then: the fp16 fallback with an overflow forced on rank 0 only, the training forward's
log-prob dtype with and without the fp32 output fix (FSDP2) and the PEFT refusal. Rank 0 writes OUT.json (a list
with one entry per rank).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from trainer_fixtures import tiny_grpo_args, tiny_trainer, trl_logged_values
from trl import GRPOTrainer

from grpo_ratio import RatioGRPOTrainer
from grpo_ratio.old_pass.sharding.fsdp2 import fp32_logprob_output, fsdp_state_owning
from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer
from grpo_ratio.testing.ranks import end_rank
from grpo_ratio.testing.sharded import (
    full_fp32_weights,
    patch_accelerate_for_cpu_sharding,
    replica_scorer,
    sharding_evidence,
)


MODES = tuple(os.environ.get("SHARDED_MODES", "fp32_clone,fp16_clone,fp32_head,guided_fp32").split(","))
HEADS = (("qwen2", False), ("llama", True))  # (architecture, tied head)


class CheckedTrainer(RatioGRPOTrainer):
    """Compares every old pass with the unsharded replica (a collective: all ranks score at the same points)."""

    checks: list

    def _score_old(self, generation, input_ids, attention_mask, logits_to_keep, batch_size):
        logps = super()._score_old(generation, input_ids, attention_mask, logits_to_keep, batch_size)
        reference = self.replica().score(input_ids, attention_mask, logits_to_keep, temperature=self.temperature,
                                         batch_size=batch_size).logps
        policy_pass = self.replica("bf16").score(input_ids, attention_mask, logits_to_keep, temperature=self.temperature,
                                                 batch_size=batch_size).logps  # what TRL's own pass would give
        valid = attention_mask[:, -logits_to_keep:].bool()  # (B, T) completion tokens
        self.checks.append({
            "version": self.weights_version.value,
            "max_abs": (logps - reference)[valid].abs().max().item(),
            "gap_to_bf16_mode": (logps - policy_pass)[valid].abs().max().item(),
            "copies": [(c.version, c.num_refreshes) for c in self.scorer.copies()],
        })
        return logps

    def replica(self, mode=None):
        policy = self.accelerator.unwrap_model(self.model)
        weights = full_fp32_weights(policy, self.scorer.sharded.engine)
        return replica_scorer(policy, weights, mode or self.args.old_logprob_mode, self.scorer.sharded.compute_dtype,
                              layers=self.args.guided_fp32_layer_ids if (mode or self.args.old_logprob_mode)
                              == "guided_fp32" else None, policy_autocast=self.accelerator.autocast)


def make_trainer(out_dir, mode, arch, tie, engine, bf16, **kwargs):
    args = tiny_grpo_args(out_dir, old_logprob_mode=mode, use_cpu=engine == "fsdp2", bf16=bf16,
                          guided_fp32_layers="0" if mode == "guided_fp32" else None, **kwargs)
    trainer = CheckedTrainer(model=tiny_model(arch, tie_word_embeddings=tie), reward_funcs=letter_reward, args=args,
                          train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer())
    trainer.checks = []
    return trainer


def batch(seed: int, rows: int = 4):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 300, (rows, 12), generator=g)  # (B, P+T)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded prompt, as TRL builds them
    return ids, mask


def trl_logps(trainer, ids, mask, T):
    """TRL's own training-forward log-probs (the new side of every ratio), without gradients."""
    with torch.no_grad():
        logps, _, _ = super(RatioGRPOTrainer, trainer)._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, T, batch_size=2)
    return logps


def engine_evidence(trainer, policy) -> dict:
    """`sharding_evidence` plus, under DeepSpeed, the ZeRO stage the engine really runs (not only the config's)."""
    evidence = sharding_evidence(trainer.accelerator, policy)
    engine = trainer.model_wrapped
    if hasattr(engine, "zero_optimization_stage"):  # the DeepSpeedEngine accelerate built
        evidence["zero_stage"] = engine.zero_optimization_stage()
        evidence["optimizer"] = type(engine.optimizer).__name__
    return evidence


def check_mode(out_dir, mode, arch, tie, engine, bf16, rank):
    trainer = make_trainer(out_dir, mode, arch, tie, engine, bf16)
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    evidence = engine_evidence(trainer, policy)  # after the old passes of 2 steps: still sharded
    first = len(trainer.checks)
    if engine == "fsdp2":  # under ZeRO-3 a second train() fails in stock TRL too (transformers 5.24, accelerate 1.15)
        trainer.train()  # global_step restarts at 0; the copies must still follow the weights
    ids, mask = batch(seed=10 + rank)
    before = trl_logps(trainer, ids, mask, T=5)
    trainer.scorer.score(ids, mask, 5, batch_size=2, version=trainer.weights_version.value)
    after = trl_logps(trainer, ids, mask, T=5)  # a policy swap (FSDP2) must leave the training forward unchanged
    return trainer, {
        "evidence": evidence,
        "checks": trainer.checks, "first_train_checks": first,
        "extra_bytes": trainer.scorer.extra_bytes(), "num_params": sum(p.numel() for p in policy.parameters())
        if engine == "fsdp2" else sum(p.ds_numel for p in policy.parameters()),
        "policy_forward_unchanged": torch.equal(before, after),
        "fused_head": trainer.plan.fused_head, "fused_head_fallback": trainer.plan.fused_head_fallback,
    }


def forced_fp16_overflow(trainer, rank):
    """fp16_clone with non-finite fp16 activations on rank 0 only: every rank must run the fp32 re-score."""
    ids, mask = batch(seed=20 + rank)
    version = trainer.weights_version.value
    trainer.scorer.score(ids, mask, 5, batch_size=2, version=version)  # shadow synced at `version`
    (shadow,) = trainer.scorer.copies()
    embedding = shadow.module.get_input_embeddings()
    handle = embedding.register_forward_hook(lambda m, i, out: out.index_fill(0, torch.tensor([0]), float("inf")))
    try:
        if rank != 0:
            handle.remove()
        result = trainer.scorer.score(ids, mask, 5, batch_size=2, version=version)
    finally:
        handle.remove()
    fp32 = trainer.replica("fp32_clone").score(ids, mask, 5, batch_size=2).logps
    fp16 = trainer.replica("fp16_clone").score(ids, mask, 5, batch_size=2).logps
    expected = fp32 if rank == 0 else fp16
    rows = [0, 2] if rank == 0 else []  # the first row of each chunk of 2 overflowed on rank 0
    if rows:
        expected = fp16.clone()
        expected[rows] = fp32[rows]
    valid = mask[:, -5:].bool()
    return {"fallback_rows": result.fallback_rows, "finite": bool(torch.isfinite(result.logps[valid]).all()),
            "max_abs": (result.logps - expected)[valid].abs().max().item()}


def new_side(trainer, rank):
    """The training forward's log-probs with the fp32 output fix and with accelerate's output cast restored."""
    import dataclasses

    policy = trainer.accelerator.unwrap_model(trainer.model)
    ids, mask = batch(seed=30 + rank)
    fixed = trl_logps(trainer, ids, mask, T=5)
    states = [policy._get_fsdp_state(), fsdp_state_owning(policy, policy.get_output_embeddings())]
    saved = [s._mp_policy for s in states]
    accelerate_policy = trainer.accelerator.state.fsdp_plugin.mixed_precision_policy  # None without bf16
    for state in states:  # what accelerate set up, before the fix
        output_dtype = accelerate_policy.output_dtype if accelerate_policy is not None else None
        state._mp_policy = dataclasses.replace(state._mp_policy, output_dtype=output_dtype)
    try:
        rounded = trl_logps(trainer, ids, mask, T=5)
    finally:
        for state, policy_ in zip(states, saved):
            state._mp_policy = policy_
    valid = mask[:, -5:].bool()
    accelerate_output = getattr(accelerate_policy, "output_dtype", None)  # accelerate 1.16 sets none
    return {"dtype_fixed": str(fixed.dtype), "dtype_unfixed": str(rounded.dtype),
            "accelerate_output_dtype": str(accelerate_output),
            "max_abs_rounding": (fixed.float() - rounded.float())[valid].abs().max().item(),
            "unfixed_is_bf16_of_fixed": torch.equal(fixed.to(torch.bfloat16).float(), rounded.float()),
            "fix_idempotent": not fp32_logprob_output(policy)}


def peft_refusal(out_dir, engine, bf16):
    import peft

    args = tiny_grpo_args(out_dir, old_logprob_mode="fp16_clone", use_cpu=engine == "fsdp2", bf16=bf16)
    try:
        RatioGRPOTrainer(model=tiny_model("qwen2"), reward_funcs=letter_reward, args=args,
                         train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer(),
                         peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    except NotImplementedError as e:
        return str(e)
    return None


def stock_and_trl_modes(out_dir, engine, bf16):
    """Stock `trl.GRPOTrainer` and `RatioGRPOTrainer` in the modes that run TRL's own pass (`bf16`) or none
    (`sampler`), 2 steps each on the same tiny model, data and seed: TRL's logged values of each, and the evidence
    that the engine really sharded them."""
    result = {}
    for name, mode, trainer_cls in (("stock", "bf16", GRPOTrainer), ("bf16", "bf16", None),
                                    ("sampler", "sampler", None)):
        trainer = tiny_trainer(f"{out_dir}/{name}", mode, model=tiny_model("qwen2"), trainer_cls=trainer_cls,
                               use_cpu=engine == "fsdp2", bf16=bf16)
        trainer.train()
        policy = trainer.accelerator.unwrap_model(trainer.model)
        result[name] = {"rows": trl_logged_values(trainer), "evidence": engine_evidence(trainer, policy)}
        if name != "stock":
            result[name]["ratio_keys"] = sorted({k for row in trainer.state.log_history for k in row
                                                 if k.startswith("ratio/")})
        del trainer
    return result


def check_precision(out_dir, engine, precision, rank):
    bf16 = precision == "bf16"
    result = {"engine": engine, "precision": precision, "modes": {}}
    for mode in MODES:
        for arch, tie in HEADS:
            trainer, row = check_mode(out_dir, mode, arch, tie, engine, bf16, rank)
            result["modes"].setdefault(mode, {})["tied" if tie else "untied"] = row
            if mode == "fp16_clone" and not tie:
                result["fp16_fallback"] = forced_fp16_overflow(trainer, rank)
            if mode == "fp32_clone" and not tie and engine == "fsdp2":
                result["new_side"] = new_side(trainer, rank)
            result["compute_dtype"] = str(trainer.scorer.sharded.compute_dtype)
            result["world_size"] = trainer.accelerator.num_processes
            del trainer
    result["peft_refused"] = peft_refusal(out_dir, engine, bf16)
    if engine == "zero3":
        result["trl_modes"] = stock_and_trl_modes(out_dir, engine, bf16)
    return result


def main(out_path: str, engine: str, precision: str) -> None:
    patch_accelerate_for_cpu_sharding()
    rank = int(os.environ["RANK"])
    result = check_precision(f"{out_path}.runs", engine, precision, rank)
    results = [None] * dist.get_world_size()  # one entry per rank
    dist.all_gather_object(results, result)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    end_rank()  # every trainer gone with main(): the gloo group ends without a deadlock (grpo_ratio/testing/ranks.py)
