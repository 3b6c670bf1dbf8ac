"""Corrections: the math that changes the loss. `kept_sets.py` (the sampler's filter and its kept sets),
`kept_logprobs.py` (truncation corrections on logits), `processors.py` (the logits processors they model),
`is_correction.py` (importance weights). Pure math on tensors: the trainer feeds it
through `grpo_ratio.old_pass.kept_head`."""
