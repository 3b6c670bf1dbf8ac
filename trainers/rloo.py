"""Train one RLOO arm from a recipe (`RatioRLOOTrainer`, trl.RLOOTrainer + grpo_ratio; docs/rloo.md).

    python trainers/rloo.py --config recipes/smollm2-135m/rloo/arithmetic/fp32_clone.yaml
    python trainers/rloo.py --config recipes/smollm2-135m/rloo/arithmetic/bf16.yaml --max_steps 3 --seed 1

The same as `grpo-ratio train --trainer rloo ...` (the RLOO recipes also say `trainer: rloo`); the logic lives in
`grpo_ratio/cli/train.py` (`--trainer rloo --help` lists every flag).
"""

import sys


if __name__ == "__main__":
    from grpo_ratio.cli.precheck import run_or_exit

    argv = sys.argv[1:] if any(a.split("=")[0] == "--trainer" for a in sys.argv[1:]) else ["--trainer", "rloo",
                                                                                         *sys.argv[1:]]
    run_or_exit("train", argv)  # recipe keys and flags, before the heavy imports
    from grpo_ratio.cli.train import cli_main

    cli_main(argv)
