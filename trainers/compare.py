"""Compare scoring arms over seeds with matched step-1 rollouts: the runnable script the README launches.

    python trainers/compare.py --recipes recipes/smollm2-135m/arithmetic/{bf16,fp32_clone}.yaml --seeds 0 1 \\
        --name arith-arms --max_steps 30

The same as `grpo-ratio compare ...`; the logic lives in `grpo_ratio/scripts/compare.py` (`--help` for the flags).
"""

from grpo_ratio.scripts.compare import main


if __name__ == "__main__":
    main()
