"""Truncation corrections under a real FSDP2 or ZeRO-3 run; the engine a launch asked for and the one it got.

Launched by tests/test_sharded.py (2 CPU processes, gloo):
    accelerate launch --config_file CONFIG tests/sharded_corrections.py OUT.json ENGINE PRECISION [unpatched]

For each run of `RUNS` (correction, TRL's `cast_lm_head_to_fp32`, kept-set source, scoring mode) one
`RatioGRPOTrainer` trains 3 steps (two generations) with two updates per generation (`num_iterations=2`: TRL runs its own old pass,
whose kept-set log-probs come from the captured hidden states through the LM head, `grpo_ratio/old_pass/kept_head.py`,
and so does every training forward). Under ZeRO-3 the head's weight is an empty partition outside its forward unless
it is gathered (TRL's `maybe_gather_lm_head_ctx`). In fp32 (`bf16=False`) the sampler (`generate` on the same sharded
policy) and the trainer compute the same distribution, so the corrected old/sampler ratio is 1 and the raw one is the
kept mass; each rank records what it logged and the sharding evidence (or the error a run raised). Under ZeRO-3 a
plain run is then trained once and `train()` called again: what that raises is recorded. Rank 0 writes OUT.json (one
entry per rank).

With `unpatched` (FSDP2 config, accelerate left as it is): accelerate runs plain DDP on the CPU processes; one trainer
is built and the warning that names the engine it got is recorded.
"""

import json
import logging
import os
import sys

import torch.distributed as dist
from trainer_fixtures import tiny_grpo_args

from grpo_ratio import RatioGRPOTrainer
from grpo_ratio.diagnostics import metric_keys as keys
from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer
from grpo_ratio.testing.ranks import end_rank
from grpo_ratio.testing.sharded import patch_accelerate_for_cpu_sharding, sharding_evidence


# (old_logprob_mode, truncation_correction, cast_lm_head_to_fp32, kept_set_source)
RUNS = [
    ("bf16", "renormalize", False, "recorded"),
    ("bf16", "renormalize", True, "recorded"),
    ("bf16", "lift_sampler", True, "recorded"),
    ("bf16", "lift_sampler", False, "recompute"),
    ("fp32_clone", "renormalize", False, "recorded"),  # a scoring mode's own kept-set path (sharded: no TRL fp32 head)
]


def make_trainer(out_dir, engine, bf16, mode="bf16", correction="none", fp32_head=False, source="auto"):
    args = tiny_grpo_args(out_dir, old_logprob_mode=mode, use_cpu=engine == "fsdp2", bf16=bf16, top_p=0.8,
                          truncation_correction=correction, cast_lm_head_to_fp32=fp32_head, kept_set_source=source,
                          num_iterations=2, max_steps=3)
    return RatioGRPOTrainer(model=tiny_model("qwen2"), reward_funcs=letter_reward, args=args,
                            train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer())


def run_one(out_dir, engine, bf16, mode, correction, fp32_head, source):
    row = {"mode": mode, "correction": correction, "fp32_head": fp32_head, "source": source}
    try:
        trainer = make_trainer(out_dir, engine, bf16, mode, correction, fp32_head, source)
        before = head_weight(trainer)
        trainer.train()
        row["head_moved"] = (head_weight(trainer) - before).abs().max().item()
    except Exception as err:  # the failure itself is the result (a crash on an empty ZeRO-3 partition)
        row["error"] = f"{type(err).__name__}: {err}"[:500]
        return row, None
    steps = [r for r in trainer.state.log_history if "loss" in r]
    row.update({
        "evidence": sharding_evidence(trainer.accelerator, trainer.accelerator.unwrap_model(trainer.model)),
        "losses": [r["loss"] for r in steps],
        "kept_mass": [r.get(keys.KEPT_MASS_MEAN) for r in steps],
        "old_sampler": [r.get(keys.OLD_SAMPLER.key("mean")) for r in steps],
        "corrected": [r.get(keys.OLD_SAMPLER_CORRECTED.key("mean")) for r in steps],
    })
    return row, trainer


def head_weight(trainer):
    """The LM head's whole fp32 weight (V, H), on every rank (a collective once the engine has sharded it)."""
    weight = trainer.accelerator.unwrap_model(trainer.model).get_output_embeddings().weight
    if hasattr(weight, "ds_id"):  # a ZeRO-3 partition (also before train(): built under zero.Init), gathered
        import deepspeed

        with deepspeed.zero.GatheredParameters([weight]):
            return weight.detach().float().clone()
    if hasattr(weight, "full_tensor"):  # FSDP2 DTensor
        weight = weight.full_tensor()
    return weight.detach().float().clone()


def second_train(trainer):
    """What a second `train()` of the same trainer raises, as `Type: message` (None when it ran)."""
    try:
        trainer.train()
    except Exception as err:  # stock TRL fails here too, deep inside transformers; ours refuses up front
        return f"{type(err).__name__}: {err}"[:500]
    return None


def unpatched(out_path):
    """accelerate left as it is under the FSDP2 config: what it runs, and what the trainer says at start."""
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("grpo_ratio").addHandler(handler)
    trainer = make_trainer(f"{out_path}.runs/unpatched", "fsdp2", False)
    return {"distributed_type": str(trainer.accelerator.distributed_type),
            "num_processes": trainer.accelerator.num_processes,
            "said": [m for m in records if "the launch asked for" in m]}


def main(out_path: str, engine: str, precision: str, variant: str = "") -> None:
    rank = int(os.environ["RANK"])
    if variant == "unpatched":
        result = unpatched(out_path)
    else:
        patch_accelerate_for_cpu_sharding()
        result = {"runs": []}
        for mode, correction, fp32_head, source in RUNS:
            row, _ = run_one(f"{out_path}.runs/{len(result['runs'])}", engine, precision == "bf16", mode, correction,
                             fp32_head, source)
            result["runs"].append(row)
        if engine == "zero3":  # a plain run (no correction), trained once, then train() again
            trainer = make_trainer(f"{out_path}.runs/second", engine, precision == "bf16")
            trainer.train()
            result["second_train"] = second_train(trainer)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, {"rank": rank, **result})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    end_rank()  # every trainer gone with main(): the gloo group ends without a deadlock (grpo_ratio/testing/ranks.py)
