"""`is_correction` on the `generate` path reuses the training forward (issue 43 item 4): where TRL skipped its old
pass and the old log-probs are the policy's own (`bf16`), each micro-batch's IS weight comes from its training
forward's log-probs, detached, instead of one extra no-grad pass per generation. Checked against the two-pass run it
replaces: the same losses, parameters and logged metrics bit for bit, one forward of the policy fewer per generation.

Run: pytest tests/test_is_reuse.py
"""

import math

import pytest
import torch
from trainer_fixtures import WALL_CLOCK_KEYS, tiny_trainer

from grpo_ratio import RatioGRPOTrainer
from grpo_ratio.corrections.is_correction import importance_weights


class TwoPassTrainer(RatioGRPOTrainer):
    """The trainer as it was before the reuse: the IS correction's separate no-grad old pass of the policy."""

    def _reuses_training_forward(self) -> bool:
        return False


# a sequence-level custom setting that uses every part (geometric weight, a token and a sequence rule, the veto)
CUSTOM = dict(is_correction="custom", is_correction_level="sequence_geometric", is_correction_action="truncate",
              is_correction_high=1.5, is_correction_rejection="token_k2<=0.5, seq_max_k3<=1.0", is_correction_veto=1e-3)
# 2 micro-batches per generation (8 rows shuffled and split by TRL), top_p: old/sampler far from 1 (the kept mass)
RUN = dict(max_steps=2, gradient_accumulation_steps=2, top_p=0.8)


def _train(tmp_path, trainer_cls, **overrides):
    """Train a tiny run; (logged rows without wall-clock keys, final parameters, forwards of the policy, trainer)."""
    trainer = tiny_trainer(tmp_path, trainer_cls=trainer_cls, **RUN, **overrides)
    forwards = []
    handle = trainer.model.register_forward_hook(lambda *a: forwards.append(torch.is_grad_enabled()))
    try:
        trainer.train()
    finally:
        handle.remove()
    rows = [{k: v for k, v in r.items() if k not in WALL_CLOCK_KEYS} for r in trainer.state.log_history if "loss" in r]
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return rows, params, forwards, trainer


@pytest.mark.parametrize("overrides", [pytest.param({"is_correction": "tis"}, id="tis"),
                                       pytest.param(CUSTOM, id="custom_sequence"),
                                       pytest.param({"is_correction": "icepop", "trust_region": "dppo_tv"},
                                                    id="icepop+dppo_tv"),
                                       pytest.param({"is_correction": "geo_rs", "truncation_correction": "renormalize"},
                                                    id="geo_rs+renormalize")])
def test_reused_forward_equals_the_two_pass_run_bit_for_bit(tmp_path, overrides):
    rows_2, params_2, forwards_2, two_pass = _train(tmp_path / "two", TwoPassTrainer, **overrides)
    rows_1, params_1, forwards_1, reused = _train(tmp_path / "one", RatioGRPOTrainer, **overrides)
    assert reused.plan.reuses_training_forward and reused._reuses_training_forward()
    assert len(rows_1) == 2 and rows_1 == rows_2  # loss, TRL's metrics and every ratio/* value: exact floats
    assert all(torch.equal(params_1[n], params_2[n]) for n in params_2)  # the same updates
    # per step: 8 decoding forwards of generate and 2 training forwards (micro-batches of 4 rows); the two-pass run
    # adds its old pass, TRL-chunked into 2 forwards of 4 rows: 12 -> 10 forwards of the policy per step
    assert forwards_1.count(True) == forwards_2.count(True) == 2 * 2
    assert len(forwards_1) == 2 * (8 + 2) and len(forwards_2) == 2 * (8 + 2 + 2)
    for row in rows_1:
        assert math.isfinite(row["loss"]) and row["ratio/new_old/mean_abs_log_ratio"] == 0.0  # r == 1 exactly
        assert {"ratio/importance_sampling_ratio/mean", "ratio/is_weight_ess"} <= set(row)
        assert 0.75 < row["ratio/old_sampler/mean"] < 0.85  # the kept mass of top_p=0.8


def test_the_weight_is_the_training_forwards_and_trl_applies_it(tmp_path, monkeypatch):
    # the weight TRL's loss multiplied by equals a direct computation from the micro-batch's own training forward
    # (the old log-probs) and recorded sampler log-probs, with TRL's gate open; the batch keeps no old log-probs
    from trl import GRPOTrainer

    calls, original = [], GRPOTrainer._compute_loss

    def spy(self, model, inputs):
        loss = original(self, model, inputs)
        gate = self.use_vllm and self.vllm_importance_sampling_correction
        calls.append((dict(inputs), gate, self._micro_batch.train_logps))
        return loss

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", spy)
    trainer = tiny_trainer(tmp_path, is_correction="tis", **RUN)
    trainer.train()
    assert len(calls) == 4
    for inputs, gate, train_logps in calls:
        assert gate and "old_per_token_logps" not in inputs and inputs["is_weight_row"].shape == (4,)
        mask = inputs["completion_mask"].bool()
        expected = importance_weights(train_logps - inputs["sampler_per_token_logps"], mask,
                                      trainer.plan.is_correction, inputs["sampler_per_token_logps"],
                                      inputs["advantages"]).weights
        assert torch.equal(inputs["importance_sampling_ratio"], expected)
    rows = sorted(torch.cat([c[0]["is_weight_row"] for c in calls[:2]]).tolist())
    assert rows == list(range(8))  # the first generation's 8 rows, each in one micro-batch


@pytest.mark.parametrize("overrides", [pytest.param(dict(old_logprob_mode="fp32_clone"), id="fp32_clone"),
                                       pytest.param(dict(truncation_correction="lift_sampler"), id="lift_sampler"),
                                       pytest.param(dict(truncation_correction="renormalize",
                                                         kept_set_source="recompute"), id="renormalize+recompute"),
                                       pytest.param(dict(num_iterations=2), id="num_iterations=2")])
def test_the_separate_pass_stays_where_it_cannot_be_the_training_forward(tmp_path, overrides):
    # a clone's old log-probs are another precision's; the old pass recomputes the kept sets of the whole batch
    # (`recompute`) or lifts the whole batch's sampler log-probs by its kept mass (`lift_sampler`); with TRL's own
    # old pass nothing is added: no reuse (the plan alone decides; nothing trains here)
    mode = overrides.pop("old_logprob_mode", "bf16")
    trainer = tiny_trainer(tmp_path, mode, is_correction="tis", **{**RUN, **overrides})
    assert not trainer.plan.reuses_training_forward


def test_an_moe_policy_whose_routes_are_measured_keeps_the_pass(tmp_path):
    # `ratio/route/*` counts the old pass's routes against the sampler's: on an MoE policy (routes measured by
    # default) the trainer keeps the pass, though the config alone would reuse the training forward
    trainer = tiny_trainer(tmp_path, arch="qwen3_moe", is_correction="tis", **RUN)
    assert trainer.plan.reuses_training_forward and trainer.routing.active
    assert not trainer._reuses_training_forward()
