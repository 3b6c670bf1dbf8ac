"""grpo_ratio: an honest importance ratio for TRL's GRPO.

- `RatioGRPOConfig`, `RatioGRPOTrainer`: drop-in replacements for `trl.GRPOConfig` / `trl.GRPOTrainer` whose old
  log-probs are computed by a selectable scoring mode (`old_logprob_mode`).
- `RatioRLOOConfig`, `RatioRLOOTrainer`: the same for `trl.RLOOConfig` / `trl.RLOOTrainer` (docs/rloo.md).
- `RatioAsyncGRPOConfig`, `RatioAsyncGRPOTrainer`: TRL's experimental `AsyncGRPOTrainer` with a choice of objective
  (`async_objective`: coupled, decoupled, decoupled_loglinear) and per-staleness diagnostics (docs/async.md).
- `grpo_ratio.old_pass`: the scoring modes usable outside any trainer (`OldLogprobScorer`; the probes use it).
- `grpo_ratio.corrections`, `grpo_ratio.diagnostics.ratios`: pure tensor math (kept sets, truncation and
  importance-sampling corrections, ratio statistics).

docs/design.md maps every module. Public names are imported lazily, so `import grpo_ratio.diagnostics.ratios` does
not load the trainer.
"""

from ._compat import check_trl_version


check_trl_version()

__version__ = "0.1.0"
_LAZY = {
    "RatioGRPOConfig": "config",
    "SCORING_MODES": "config",
    "PRECISION_MODES": "config",
    "TRUNCATION_CORRECTIONS": "config",
    "OldLogprobScorer": "old_pass.scorer",
    "score_completion_logprobs": "old_pass.scorer",
    "RatioGRPOTrainer": "trainer",
    "RatioRLOOConfig": "config",
    "RatioRLOOTrainer": "rloo",
    "RatioAsyncGRPOConfig": "async_grpo",
    "RatioAsyncGRPOTrainer": "async_grpo",
    "resolve_model_path": "models",
}
__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'grpo_ratio' has no attribute {name!r}")
