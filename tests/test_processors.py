"""Logits processors beyond temperature/top_k/top_p/min_p: each one `generate` applies is either modelled by the old
pass and the corrections, or named in a start-up warning (grpo_ratio issue 20; the table in docs/truncation.md).

The model is a tiny random Qwen2 with a scaled-up LM head (peaked logits, as a trained model has), in fp32 end to end:
the corrected old/sampler ratio is then 1 up to float rounding wherever the sampler's distribution is modelled, and
visibly off where it is not.

Run: pytest tests/test_processors.py
"""

import pytest
from trainer_fixtures import peaked_model, tiny_trainer


BAND_TOKENS = 0.01  # at most 1% of tokens out of [0.9, 1.1]


def _row(trainer):
    (row,) = [r for r in trainer.state.log_history if "loss" in r]
    return row


def _train(tmp_path, **kwargs):
    settings = dict(max_steps=1, max_completion_length=16, bf16=False, top_k=20, truncation_correction="renormalize")
    settings.update(kwargs)
    trainer = tiny_trainer(tmp_path, "fp32_clone", model=peaked_model(scale=20.0), **settings)
    trainer.train()
    return _row(trainer)


@pytest.mark.xfail(strict=True, reason="issue 20: repetition_penalty not modelled yet")
@pytest.mark.parametrize("source", ["recorded", "recompute"])
@pytest.mark.parametrize("correction", ["renormalize", "lift_sampler"])
def test_repetition_penalty_is_modelled(tmp_path, correction, source):
    row = _train(tmp_path, repetition_penalty=1.3, truncation_correction=correction, kept_set_source=source)
    assert row["ratio/old_sampler_corrected/num_tokens"] >= 48
    assert abs(row["ratio/old_sampler_corrected/mean"] - 1.0) < 0.01
    assert row["ratio/old_sampler_corrected/oob_rate"] <= BAND_TOKENS
    assert row["ratio/old_sampler/oob_rate"] > 0.2  # the raw ratio does carry the penalty (and the top_k mass)
