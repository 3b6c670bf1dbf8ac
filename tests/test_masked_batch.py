"""A batch whose completions are all masked (every one truncated, `mask_truncated_completions=True`) trains on with
loss 0 under every scoring mode and every truncation correction, as stock TRL does (grpo_ratio issue 20: under
`renormalize` the first backward raised `element 0 of tensors does not require grad`).

The model is a tiny random Qwen2 whose EOS row of the LM head is zero and whose other rows are scaled up (peaked
logits): EOS is never sampled, so every completion hits `max_completion_length`; TRL's own
`completions/clipped_ratio` = 1 shows it in every run.

Run: pytest tests/test_masked_batch.py
"""

import pytest
import torch
from trainer_fixtures import peaked_model, tiny_trainer, trl_logged_values
from trl import GRPOTrainer

from grpo_ratio.config import SCORING_MODES, TRUNCATION_CORRECTIONS
from grpo_ratio.corrections.kept_logprobs import kept_set_logprobs
from grpo_ratio.corrections.kept_sets import KeptSets


SETTINGS = dict(max_steps=2, max_completion_length=4, mask_truncated_completions=True, top_k=5)


@pytest.fixture(scope="module")
def stock_rows(tmp_path_factory):
    trainer = tiny_trainer(tmp_path_factory.mktemp("stock"), trainer_cls=GRPOTrainer,
                           model=peaked_model(never_eos=True), **SETTINGS)
    trainer.train()
    rows = trl_logged_values(trainer)
    assert [row["completions/clipped_ratio"] for row in rows] == [1.0, 1.0]  # every completion truncated
    assert [row["loss"] for row in rows] == [0.0, 0.0]
    return rows


# every (mode, correction) the config accepts (sampler + lift_sampler is refused: no old pass measures the kept mass)
# with kept sets recorded during generate (the default there), and recomputed from the trainer's logits (vLLM's
# default: the source whose arrival broke renormalize) in the modes with an old pass of each kind and without one
CASES = [(m, c, "auto") for m in SCORING_MODES for c in TRUNCATION_CORRECTIONS if (m, c) != ("sampler", "lift_sampler")]
CASES += [("bf16", "renormalize", "recompute"), ("fp32_clone", "renormalize", "recompute"),
          ("sampler", "renormalize", "recompute"), ("fp32_clone", "lift_sampler", "recompute")]


@pytest.mark.filterwarnings("ignore::UserWarning")  # "no valid completion token", truncation without a correction
@pytest.mark.parametrize("mode,correction,source", CASES)
def test_all_masked_batch_trains_like_stock(tmp_path, mode, correction, source, stock_rows):
    trainer = tiny_trainer(tmp_path, mode, model=peaked_model(never_eos=True), truncation_correction=correction,
                           guided_fp32_layers="0" if mode == "guided_fp32" else None, kept_set_source=source,
                           **SETTINGS)
    trainer.train()
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 2
    assert [row["completions/clipped_ratio"] for row in rows] == [1.0, 1.0]
    assert [row["loss"] for row in rows] == [0.0, 0.0]
    assert [row["ratio/new_old/num_tokens"] for row in rows] == [0.0, 0.0]  # nothing valid to measure
    assert trl_logged_values(trainer) == stock_rows  # reward, lengths, grad_norm 0, clip ratios: stock's


def test_kept_set_logprobs_of_no_valid_cell_keep_the_graph():
    # The pure function under the trainer: no valid cell gives zeros that are still a function of the logits
    # (zero gradient), also where a masked logit is not finite.
    logits = torch.randn(2, 3, 5)
    logits[1, 2, 4] = float("inf")
    logits.requires_grad_(True)
    kept = KeptSets.from_mask(torch.ones(2, 3, 5, dtype=torch.bool))
    logps = kept_set_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), kept, mask=torch.zeros(2, 3, dtype=torch.bool))
    assert logps.grad_fn is not None and torch.equal(logps, torch.zeros(2, 3))
    logps.sum().backward()
    assert torch.equal(logits.grad, torch.zeros(2, 3, 5))
