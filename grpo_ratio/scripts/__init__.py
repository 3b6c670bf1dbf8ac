"""Entry points: `grpo-ratio train` (`train.py`) and `grpo-ratio compare` (`compare.py`). They use the package's
public face (`from grpo_ratio import RatioGRPOTrainer`), as a user's script would; no library module imports them."""
