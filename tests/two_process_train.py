"""Two-process CPU training run used by tests/test_distributed.py (launched with `accelerate launch`).

Writes, on the main process, a JSON with the world size, the logged history and a checksum of the final weights.
Usage: accelerate launch --multi_gpu --num_processes 2 tests/two_process_train.py OUT_DIR MODE
"""

import json
import os
import sys

import torch
from trainer_fixtures import tiny_grpo_args

from grpo_ratio import RatioGRPOTrainer
from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer
from grpo_ratio.testing.ranks import end_rank


def main(out_dir: str, mode: str) -> None:
    args = tiny_grpo_args(out_dir, old_logprob_mode=mode, per_device_train_batch_size=2, num_generations=4)
    trainer = RatioGRPOTrainer(model=tiny_model("qwen2"), reward_funcs=letter_reward, args=args,
                               train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer())
    trainer.train()
    # the scorer's fp32 view of the weights must agree on every rank after the refresh
    policy = trainer.accelerator.unwrap_model(trainer.model)
    checksum = torch.tensor([sum(p.double().sum().item() for p in policy.parameters())])
    checksums = trainer.accelerator.gather(checksum).tolist()
    if trainer.accelerator.is_main_process:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"world_size": trainer.accelerator.num_processes, "history": trainer.state.log_history,
                       "checksums": checksums, "fused_head": trainer.plan.fused_head}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # the trainer (and its DDP model) is gone with main(): now the gloo group can end without a deadlock at exit
    # (grpo_ratio/testing/ranks.py says why; with the group destroyed inside main() rank 0 hung under load)
    end_rank()
