"""Compare scoring arms over seeds with matched step-1 rollouts: the runnable script the README launches.

    python trainers/compare.py --recipes recipes/smollm2-135m/arithmetic/{bf16,fp32_clone}.yaml --seeds 0 1 \\
        --name arith-arms --max_steps 30

The same as `grpo-ratio compare ...`; the logic lives in `grpo_ratio/cli/compare.py` (`--help` for the flags).
"""

import sys

from grpo_ratio.cli.precheck import run_or_exit


if __name__ == "__main__":
    run_or_exit("compare", sys.argv[1:])  # recipe keys and flags, before the heavy imports
    from grpo_ratio.cli.compare import main

    main()
