"""`old_logprob_mode="sampler"`: the rollout's own log-probs anchor the ratio, with no old pass at all.

Run: pytest tests/test_sampler_mode.py
"""

import pytest
import torch
from trainer_fixtures import tiny_trainer
from trl import GRPOTrainer

from grpo_ratio import RatioGRPOConfig


def _first_row(trainer):
    return next(row for row in trainer.state.log_history if "loss" in row)


def test_sampler_anchor_equals_the_fp32_clone_arms_old_sampler_ratio(tmp_path):
    # fp32 end to end, untruncated, same seed -> same rollouts. At step 1 the sampler arm's new/old is
    # policy/sampler; the fp32_clone arm's old/sampler is (fp32 old pass)/sampler and its old pass equals the
    # training forward (fp32, same weights) up to rounding: the two ratios agree.
    rows = {}
    for mode in ("sampler", "fp32_clone"):
        trainer = tiny_trainer(tmp_path / mode, mode, bf16=False, max_steps=1)
        trainer.train()
        rows[mode] = _first_row(trainer)
    sampler, clone = rows["sampler"], rows["fp32_clone"]
    for stat in ("mean", "mean_abs_log_ratio", "p1", "p50", "p99"):
        assert sampler[f"ratio/new_old/{stat}"] == pytest.approx(clone[f"ratio/old_sampler/{stat}"], abs=1e-6), stat
    assert sampler["ratio/new_old/num_tokens"] == clone["ratio/old_sampler/num_tokens"]
    # old/sampler is the identity by construction in this arm: exactly 1, not noise
    assert sampler["ratio/old_sampler/mean_abs_log_ratio"] == 0.0 and sampler["ratio/old_sampler/oob_rate"] == 0.0


def test_with_top_p_and_renormalize_new_old_stays_in_band(tmp_path):
    trainer = tiny_trainer(tmp_path, "sampler", bf16=False, max_steps=2, top_p=0.8,
                           truncation_correction="renormalize")
    trainer.train()
    for row in (r for r in trainer.state.log_history if "loss" in r):
        assert row["ratio/new_old/oob_rate"] < 0.02
        assert row["ratio/kept_mass_mean"] < 0.9  # truncation really happened


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_the_sampler_arm_runs_no_old_pass(tmp_path, monkeypatch, num_iterations):
    # Counted: TRL's log-prob helper never runs while a generation batch is scored (beta=0: no reference pass
    # either), also when num_iterations=2 makes TRL ask for an old pass.
    trainer = tiny_trainer(tmp_path, "sampler", num_iterations=num_iterations)
    calls = []
    original = GRPOTrainer._get_per_token_logps_and_entropies
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    out = trainer._generate_and_score_completions(batch)
    assert calls == []
    valid = out["completion_mask"].bool()
    assert torch.equal(out["old_per_token_logps"][valid], out["sampler_per_token_logps"][valid])
    assert trainer.scorer is None  # no copy, no scorer


def test_without_sampler_logprobs_the_arm_is_refused():
    with pytest.raises(ValueError, match="record_sampler_logprobs=True"):
        RatioGRPOConfig(output_dir="unused", use_cpu=True, old_logprob_mode="sampler", record_sampler_logprobs=False)
    with pytest.raises(ValueError, match="lift_sampler"):
        RatioGRPOConfig(output_dir="unused", use_cpu=True, old_logprob_mode="sampler", top_p=0.8,
                        truncation_correction="lift_sampler")


def test_beam_search_refuses_the_sampler_arm(tmp_path):
    with pytest.raises(ValueError, match="old_logprob_mode='sampler'"):
        tiny_trainer(tmp_path, "sampler", generation_kwargs={"num_beams": 2})


def test_vllm_importance_sampling_is_turned_off_and_said(tmp_path):
    with pytest.warns(UserWarning, match="vllm_importance_sampling_correction turned off"):
        args = RatioGRPOConfig(output_dir="unused", use_cpu=True, old_logprob_mode="sampler", use_vllm=True)
    assert args.vllm_importance_sampling_correction is False
