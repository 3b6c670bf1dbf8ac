"""ratio/* metrics logged by RatioGRPOTrainer next to reward, to wandb (offline) and tensorboard.

Run: pytest tests/test_diagnostics.py
"""

import glob

import pytest
import torch
from trainer_fixtures import tiny_trainer as _trainer
from wandb_offline import read_offline_run

from grpo_ratio.testing import tiny_model


def _steps(trainer):
    return [row for row in trainer.state.log_history if "loss" in row]


def test_bf16_on_policy_ratio_is_exactly_one(tmp_path):
    # num_iterations=1: TRL's old log-probs are the new ones detached, so r == 1 on every token.
    trainer = _trainer(tmp_path, "bf16", max_steps=2)
    trainer.train()
    for row in _steps(trainer):
        assert row["ratio/new_old/oob_rate"] == 0.0 and row["ratio/new_old/mean_abs_log_ratio"] == 0.0
        assert row["ratio/clip_flip_rate"] == 0.0
        assert "reward" in row  # same logged step as the reward
        assert row["ratio/new_old/num_tokens"] == row["completions/mean_length"] * 4  # 4 completions per step


def test_fp32_clone_reports_the_precision_gap(tmp_path):
    # bf16-stored weights: training forward in bf16, old log-probs in fp32 -> a real, non-zero new/old gap.
    trainer = _trainer(tmp_path, "fp32_clone", model=tiny_model("qwen2", dtype=torch.bfloat16), bf16=False)
    trainer.train()
    gaps = [row["ratio/new_old/mean_abs_log_ratio"] for row in _steps(trainer)]
    assert all(g > 1e-4 for g in gaps), gaps  # never silently forced to 0
    assert all(row["ratio/new_old/p1"] < 1.0 < row["ratio/new_old/p99"] for row in _steps(trainer))


def test_sampler_logprobs_without_vllm(tmp_path):
    # fp32 end to end, no truncation: generate's sampling distribution is the trainer's, up to KV-cache rounding.
    trainer = _trainer(tmp_path, "bf16", bf16=False, max_steps=1)
    trainer.train()
    (row,) = _steps(trainer)
    assert row["ratio/old_sampler/mean_abs_log_ratio"] < 1e-4
    assert row["ratio/old_sampler/oob_rate"] == 0.0


def test_truncated_sampling_shows_the_kept_mass(tmp_path):
    # top_p=0.8 on a near-uniform tiny model: the sampler renormalises over ~80% of the mass, so r_old/sampler ~ 0.8.
    trainer = _trainer(tmp_path, "bf16", bf16=False, max_steps=1, top_p=0.8)
    trainer.train()
    (row,) = _steps(trainer)
    assert 0.75 < row["ratio/old_sampler/p50"] < 0.85
    assert row["ratio/old_sampler/oob_rate"] == 1.0  # every token leaves [0.9, 1.1]


def test_clip_flip_every_zero_makes_the_metric_absent(tmp_path):
    trainer = _trainer(tmp_path, "fp32_clone", clip_flip_every=0, max_steps=1)
    trainer.train()
    (row,) = _steps(trainer)
    assert "ratio/clip_flip_rate" not in row and "ratio/new_old/oob_rate" in row


@pytest.mark.parametrize("loss", [dict(loss_type="cispo"), dict(importance_sampling_level="sequence")])
def test_clip_flips_are_absent_for_another_clip(tmp_path, loss):
    # docs/metrics.md: CISPO and sequence-level ratios clip differently from TRL's token-level PPO clip
    trainer = _trainer(tmp_path, "fp32_clone", max_steps=1, **loss)
    trainer.train()
    (row,) = _steps(trainer)
    assert "ratio/new_old/oob_rate" in row
    assert not any(k.startswith("ratio/clip_flip_rate") for k in row)


def test_wandb_offline_and_tensorboard_hold_the_keys(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    import wandb

    wandb.teardown()  # a wandb singleton left by an earlier test in this process would keep its own run directory
    trainer = _trainer(tmp_path / "out", "fp16_clone", report_to=["wandb", "tensorboard"], run_name="fp16-s0")
    trainer.train()
    wandb.finish()
    wandb.teardown()  # stops wandb-core, which writes the offline run file asynchronously
    config, history = read_offline_run(tmp_path)
    assert (config["old_logprob_mode"], config["ratio_band_low"], config["ratio_band_high"]) == ("fp16_clone", 0.9, 1.1)
    rows = [h for h in history if "train/reward" in h]
    assert len(rows) == 2 and all("train/ratio/new_old/oob_rate" in h and "train/ratio/old_sampler/oob_rate" in h
                                  for h in rows)  # reward and ratio metrics in the same logged step
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = glob.glob(str(tmp_path / "out" / "runs" / "*"))
    acc = EventAccumulator(events)
    acc.Reload()
    assert {"train/reward", "train/ratio/new_old/oob_rate", "train/ratio/fp16_fallback_rows"} <= set(acc.Tags()["scalars"])


def test_diagnostics_report_vllm_importance_sampling_masking(tmp_path):
    # vLLM's IS correction cannot run on CPU; feed RatioDiagnostics the micro-batch TRL would build with it on.
    from trainer_fixtures import config_plan, tiny_grpo_args

    from grpo_ratio.diagnostics.ratio_diagnostics import RatioDiagnostics
    from grpo_ratio.records import MicroBatchRecord

    args = tiny_grpo_args(tmp_path)  # TRL defaults: sequence_mask, clip_max 3.0, clip_min None
    diag = RatioDiagnostics(args, accelerator=type("Acc", (), {"num_processes": 1, "device": "cpu"})(),
                            eos_token_ids=[1], plan=config_plan(args))
    old = torch.zeros(2, 3)
    # row 0: sampler log-probs log(1/2) each -> product of ratios 2^3 = 8 > 3: the whole sequence is masked;
    # row 1: ratios 1 -> kept. 3 valid tokens per row.
    sampler = torch.tensor([[-0.6931472] * 3, [0.0] * 3])
    inputs = {"completion_ids": torch.tensor([[5, 6, 7], [5, 6, 7]]), "completion_mask": torch.ones(2, 3),
              "advantages": torch.tensor([1.0, -1.0]), "old_per_token_logps": old,
              "sampling_per_token_logps": sampler, "importance_sampling_ratio": torch.ones(2, 1)}
    diag.update(MicroBatchRecord(inputs=inputs, train_logps=old), mode_is_policy=True)
    metrics = diag.flush()
    assert metrics["ratio/is_masked_seq_frac"] == 0.5 and metrics["ratio/is_masked_token_frac"] == 0.5
    assert metrics["ratio/old_sampler/oob_rate"] == 0.5  # r = 2 on row 0's 3 tokens, 1 on row 1's
    assert diag.flush() == {}  # reset after a flush: nothing is logged twice


def test_evaluation_logs_no_ratio_diagnostics_but_scores_with_the_mode(tmp_path):
    # docs/metrics.md: ratio/* keys are training-step metrics; evaluation logs only eval_ratio/fp16_fallback_rows
    # (fp16_clone), while the mode's old pass still runs, since TRL's eval loss reads the old log-probs
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    args = tiny_grpo_args(tmp_path, old_logprob_mode="fp16_clone", bf16=True, max_steps=1, eval_strategy="steps",
                          eval_steps=1, per_device_eval_batch_size=4)
    trainer = RatioGRPOTrainer(model=tiny_model("qwen2"), reward_funcs=letter_reward, args=args,
                               train_dataset=tiny_prompts(8), eval_dataset=tiny_prompts(4),
                               processing_class=tiny_tokenizer())
    calls = []
    score = trainer.scorer.score
    trainer.scorer.score = lambda *a, **k: calls.append(trainer.model.training) or score(*a, **k)
    trainer.train()
    (evaluated,) = [row for row in trainer.state.log_history if "eval_loss" in row]
    assert sorted(k for k in evaluated if k.startswith("eval_ratio/")) == ["eval_ratio/fp16_fallback_rows"]
    assert calls.count(False) >= 1 and calls.count(True) == 1  # the mode scored the evaluation batch too
    (trained,) = [row for row in trainer.state.log_history if "loss" in row]
    assert trained["ratio/new_old/num_tokens"] > 0
