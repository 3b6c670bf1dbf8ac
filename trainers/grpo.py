"""Train one arm from a recipe: the runnable script the README and the recipes launch.

    python trainers/grpo.py --config recipes/smollm2-135m/arithmetic/fp32_clone.yaml
    python trainers/grpo.py --config recipes/smollm2-135m/arithmetic/bf16.yaml --max_steps 3 --seed 1
    accelerate launch --multi_gpu --num_processes 2 trainers/grpo.py --config recipes/smollm2-135m/gsm8k/fp16_clone.yaml

The same as `grpo-ratio train ...`; the logic lives in `grpo_ratio/cli/train.py` (`--help` lists every flag).
"""

import sys

from grpo_ratio.cli.precheck import run_or_exit


if __name__ == "__main__":
    run_or_exit("train", sys.argv[1:])  # recipe keys and flags, before the heavy imports
    from grpo_ratio.cli.train import cli_main

    cli_main()
