"""Routing replay under a real FSDP2 or ZeRO-3 run: a tiny Qwen3-MoE, every scoring mode, R3 and R2.

Launched by tests/test_sharded.py (2 CPU processes, gloo):
    accelerate launch --config_file CONFIG tests/sharded_routing.py OUT.json ENGINE PRECISION

For each (scoring mode, replay) one `RatioGRPOTrainer` trains 2 steps with two updates per generation
(`num_iterations=2`) while `routing_fixtures.ReplayLog` records every replay session: the routes it was given and the
indices the routers served (the policy's own routers, a whole-model shadow's, or an fp32 runner's). Each rank checks
its own sessions; the route metrics are summed over both ranks (a collective in the flush). Rank 0 writes OUT.json
(one entry per rank).
"""

import json
import os
import sys

import torch.distributed as dist
from routing_fixtures import ReplayLog, near_tie_model, rows_of
from trainer_fixtures import tiny_grpo_args

from grpo_ratio import RatioGRPOTrainer
from grpo_ratio.diagnostics import metric_keys as keys
from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer
from grpo_ratio.testing.ranks import end_rank
from grpo_ratio.testing.sharded import patch_accelerate_for_cpu_sharding, sharding_evidence


RUNS = [(mode, "R3") for mode in ("bf16", "fp32_clone", "fp16_clone", "fp32_head", "guided_fp32", "sampler")]
RUNS += [(mode, "R2") for mode in ("bf16", "fp32_clone")]


def run_one(out_dir, mode, replay, engine, bf16):
    log = ReplayLog(lambda obj, name, value: setattr(obj, name, value))
    args = tiny_grpo_args(out_dir, old_logprob_mode=mode, use_cpu=engine == "fsdp2", bf16=bf16, routing_replay=replay,
                          guided_fp32_layers="0" if mode == "guided_fp32" else None, num_iterations=2, max_steps=2)
    trainer = RatioGRPOTrainer(model=near_tie_model("qwen3_moe"), reward_funcs=letter_reward, args=args,
                               train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer())
    trainer.train()
    try:
        log.assert_served_as_given(trainer.routing.hooks.layout.top_k)
        served_ok = True
    except AssertionError:
        served_ok = False
    routes = trainer._generations["train"].routes
    source = routes.sampler if replay == "R3" else routes.old
    history = trainer.state.log_history
    pair = "sampler_old" if replay == "R3" else "old_new"
    return {
        "mode": mode, "replay": replay,
        "evidence": sharding_evidence(trainer.accelerator, trainer.accelerator.unwrap_model(trainer.model)),
        "sessions": len(log.sessions), "served_ok": served_ok,
        "from_source": all(rows_of(s["routes"], source) for s in log.sessions),  # old pass: rows in order, too
        "used": [row[keys.route_key(pair, "any_layer")] for row in history if keys.route_key(pair, "any_layer") in row],
        "tokens": [row[keys.route_key(pair, "num_tokens")] for row in history
                   if keys.route_key(pair, "num_tokens") in row],
        "local_positions": int((routes.sampler >= 0).all(-1).any(-1).sum()),
    }


def main(out_path: str, engine: str, precision: str) -> None:
    patch_accelerate_for_cpu_sharding()
    rank = int(os.environ["RANK"])
    rows = [run_one(f"{out_path}.runs", mode, replay, engine, precision == "bf16") for mode, replay in RUNS]
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, {"rank": rank, "runs": rows})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    end_rank()  # every trainer gone with main(): the gloo group ends without a deadlock (grpo_ratio/testing/ranks.py)
