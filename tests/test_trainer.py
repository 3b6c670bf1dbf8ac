"""RatioGRPOTrainer on tiny models: drop-in behaviour, each scoring mode in the trainer, copies in step.

Run: pytest tests/test_trainer.py
"""

import pytest
import torch
from trainer_fixtures import tiny_trainer
from trl import GRPOConfig, GRPOTrainer

from grpo_ratio import RatioGRPOTrainer
from grpo_ratio.old_pass.scorer import completion_logprobs_from_logits
from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer


def _trainer(tmp_path, mode="bf16", arch="qwen2", cls=None, model=None, **overrides):
    return tiny_trainer(tmp_path, mode, arch, trainer_cls=cls, model=model, **overrides)


def _stock_keys(history):
    return [{k: v for k, v in row.items() if not k.startswith("ratio/") and k not in ("step_time", "train_runtime",
            "train_samples_per_second", "train_steps_per_second")} for row in history]


@pytest.mark.parametrize("overrides", [
    {},  # every default: the generate recording is on and must not reach TRL's loss
    {"off_policy_mask_threshold": 0.5, "top_p": 0.9},  # OPSM reads sampler log-probs when TRL has them
    {"num_iterations": 2, "steps_per_generation": 2},  # TRL runs its own old pass
    # the IS-correction, gate and full-vocabulary fields at their defaults, plus a gate that passes (changes nothing)
    {"is_correction": None, "is_correction_level": None, "is_correction_action": None, "is_correction_low": None,
     "is_correction_high": None, "is_correction_rejection": None, "is_correction_veto": None,
     "ratio_gate": ["ratio/new_old/num_tokens>=0"], "ratio_gate_patience": 1, "ratio_gate_action": "stop",
     "ratio_full_vocab": False},
], ids=["defaults", "opsm", "old-pass", "is-correction-and-gate-fields"])
def test_bf16_mode_reproduces_stock_grpo_bit_for_bit(tmp_path, overrides):
    # Same config, same seed, 3 steps: every metric stock TRL logs is identical (==, not approx), and so are the
    # trained weights.
    runs, weights = [], []
    for cls in (GRPOTrainer, RatioGRPOTrainer):
        trainer = _trainer(tmp_path / cls.__name__, cls=cls, max_steps=3, **overrides)
        trainer.train()
        runs.append(_stock_keys(trainer.state.log_history))
        weights.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    assert len(runs[0]) == 4  # 3 logged steps + the train summary
    assert runs[0] == runs[1]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def _capture_generation(trainer):
    """Run one generation batch through the trainer and return its output dict."""
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    return trainer._generate_and_score_completions(batch)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_fp32_clone_old_logprobs_equal_independent_fp32_forward(tmp_path, temperature):
    trainer = _trainer(tmp_path, "fp32_clone", temperature=temperature)
    out = _capture_generation(trainer)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    T = out["completion_ids"].size(1)
    ref_model = tiny_model("qwen2")  # the same seed-0 weights, never touched by accelerate or TRL
    with torch.no_grad():
        logits = ref_model(input_ids=ids, attention_mask=mask, logits_to_keep=T + 1).logits
    ref = completion_logprobs_from_logits(logits, out["completion_ids"], temperature)
    valid = out["completion_mask"].bool()
    assert (out["old_per_token_logps"] - ref)[valid].abs().max() <= 1e-5


def test_old_pass_is_replaced_not_duplicated(tmp_path, monkeypatch):
    # num_iterations=2 makes TRL compute old log-probs; fp32_clone must replace that pass, not run both.
    trainer = _trainer(tmp_path, "fp32_clone", num_iterations=2)
    calls = []
    original = GRPOTrainer._get_per_token_logps_and_entropies
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    out = _capture_generation(trainer)
    assert calls == []  # TRL's helper never ran for the old pass (beta=0: no reference pass either)
    assert out["old_per_token_logps"].dtype == torch.float32


@pytest.mark.parametrize("mode", ["fp16_clone", "fp32_clone"])
def test_copies_equal_updated_policy_after_optimizer_step(tmp_path, mode):
    # bf16-stored weights force a copy for both modes; after training, a fresh score refreshes it exactly.
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    trainer = _trainer(tmp_path, mode, model=model, bf16=False, max_steps=2)
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    assert trainer.state.global_step == 2
    (copy,) = trainer.scorer.copies()
    version = trainer.weights_version.value
    assert version == 3  # train() began (+1), then two optimizer steps (+1 each)
    module = copy.get(version)
    assert copy.version == 3 and copy.num_refreshes == 3  # generations at versions 1 and 2, and this get()
    for (name, p), q in zip(policy.state_dict().items(), module.state_dict().values(), strict=True):
        assert torch.equal(p.to(copy.dtype), q), name


def test_plain_grpo_config_is_refused(tmp_path):
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(TypeError, match="RatioGRPOConfig"):
        RatioGRPOTrainer(model=tiny_model(), reward_funcs=letter_reward, args=args, train_dataset=tiny_prompts(4),
                         processing_class=tiny_tokenizer())


def test_guided_layer_out_of_range_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"0\.\.1"):
        _trainer(tmp_path, "guided_fp32", guided_fp32_layers="0,5")


@pytest.mark.parametrize("mode", ["fp32_clone", "fp16_clone", "fp32_head"])
def test_each_mode_trains(tmp_path, mode):
    trainer = _trainer(tmp_path, mode)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert "loss" in trainer.state.log_history[0]
    changed = sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert changed > 0


def test_an_empty_dataset_or_one_without_prompts_is_refused(tmp_path):
    # the issue: an empty dataset "trained" 0 steps with exit 0; a dataset without `prompt` failed with a KeyError
    from datasets import Dataset
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_model, tiny_tokenizer

    def build(dataset):
        return RatioGRPOTrainer(model=tiny_model("qwen2"), reward_funcs=letter_reward,
                                args=tiny_grpo_args(tmp_path), train_dataset=dataset, processing_class=tiny_tokenizer())

    with pytest.raises(ValueError, match=r"train_dataset is empty \(0 rows\)"):
        build(Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="no 'prompt' column .* its columns are: 'question', 'answer'"):
        build(Dataset.from_dict({"question": ["2+2?"], "answer": ["4"]}))
