"""What each setting does to the loss, as docs/truncation.md states it (issue 24: "what the corrections do to the loss is
hidden"): on a real RatioGRPOTrainer against stock `trl.GRPOTrainer`, tiny model, transformers `generate` (no vLLM).

- `lift_sampler` changes only the diagnostics: TRL's logged metrics and the trained weights equal stock TRL's;
- `renormalize` changes the objective: the gradient lives on the kept set, so the update differs from stock TRL's;
- `ratio/clip_flip_rate` equals TRL's `clip_ratio/region_mean` with `num_iterations=1`, at every update it is logged.

Run: pytest tests/test_loss_effect.py
"""

import pytest
import torch
from trainer_fixtures import tiny_trainer
from trl import GRPOTrainer

from grpo_ratio import RatioGRPOTrainer


TRUNCATED = dict(top_p=0.8, max_steps=2)  # a near-uniform tiny model keeps ~80% of the mass per token


def _train(tmp_path, cls, **overrides):
    trainer = tiny_trainer(tmp_path / cls.__name__, trainer_cls=cls, **overrides)
    trainer.train()
    rows = [{k: v for k, v in row.items() if not k.startswith("ratio/") and k not in ("step_time", "train_runtime",
             "train_samples_per_second", "train_steps_per_second")} for row in trainer.state.log_history]
    return rows, {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def stock_truncated(tmp_path_factory):
    """Stock TRL under top_p=0.8 (the reference of both corrections)."""
    return _train(tmp_path_factory.mktemp("stock"), GRPOTrainer, **TRUNCATED)


def test_lift_sampler_without_vllm_leaves_trls_loss_bit_for_bit(tmp_path, stock_truncated):
    rows, weights = _train(tmp_path, RatioGRPOTrainer, truncation_correction="lift_sampler", **TRUNCATED)
    stock_rows, stock_weights = stock_truncated
    assert len(rows) == 3 and rows == stock_rows  # every metric TRL logs, == not approx
    assert all(torch.equal(weights[k], stock_weights[k]) for k in weights)


def test_renormalize_changes_the_update(tmp_path, stock_truncated):
    rows, weights = _train(tmp_path, RatioGRPOTrainer, truncation_correction="renormalize", **TRUNCATED)
    stock_rows, stock_weights = stock_truncated
    # step 1 draws the same rollouts (same seed), so the reward is the same; the gradient is not: log p_S(g) has no
    # gradient through the logits outside the kept set (tests/test_sampling.py checks that on literal logits). On a
    # near-uniform tiny model the norms differ by ~0.1% (1.9358 vs 1.9371 at seed 0)
    assert rows[0]["reward"] == stock_rows[0]["reward"]
    assert rows[0]["grad_norm"] != stock_rows[0]["grad_norm"]
    moved = sum(not torch.equal(weights[k], stock_weights[k]) for k in weights)
    assert moved > 0


@pytest.mark.parametrize("overrides", [
    {},  # one micro-batch per update
    {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},  # two micro-batches of equal token counts
    {"steps_per_generation": 2},  # two updates per generation: the flip rate is logged at the first only
], ids=["one-micro-batch", "accumulation", "two-updates-per-generation"])
def test_clip_flip_rate_equals_trls_region_mean_at_one_inner_step(tmp_path, overrides):
    # epsilon 2e-4: the tiny model's bf16-vs-fp32 gap (~1e-3 nats) makes the clip fire on a share of the tokens
    trainer = tiny_trainer(tmp_path, "fp32_clone", max_steps=4, epsilon=2e-4, **overrides)
    trainer.train()
    steps = [row for row in trainer.state.log_history if "loss" in row]
    logged = [row for row in steps if "ratio/clip_flip_rate" in row]
    assert len(logged) == (2 if "steps_per_generation" in overrides else 4)
    assert any(row["clip_ratio/region_mean"] > 0 for row in logged)  # the clip did fire: the equality is not 0 == 0
    for row in logged:
        assert row["ratio/clip_flip_rate"] == pytest.approx(row["clip_ratio/region_mean"], abs=1e-7)
