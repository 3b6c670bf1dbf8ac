"""Helpers of the real-vLLM lane: the skip rule, the tiny models loaded into vLLM, engine set-up and HF reference
log-probs. (A separate module, not conftest.py: tests/conftest.py already owns the module name `conftest`.)"""

from __future__ import annotations

import gc

import pytest
import torch


def vllm_importable() -> bool:
    """True when the real vLLM engine imports (the lane's venv, `.venv-vllm`). `find_spec("vllm")` is not enough: it
    also finds namespace directories of that name."""
    try:
        from vllm import LLM, SamplingParams  # noqa: F401
    except Exception:  # ImportError, or a broken install (e.g. a CUDA torchvision): skip rather than error
        return False
    return True


requires_vllm = pytest.mark.skipif(not vllm_importable(), reason="needs vLLM: run bash scripts/test_vllm.sh")

TINY_VOCAB = 300  # the tiny tokenizer's vocabulary (grpo_ratio.testing.tiny_tokenizer)
MAX_MODEL_LEN = 128  # prompts of a few tokens plus <= 16 generated ones; keeps the CPU KV cache small


def save_tiny_llama(path, tied: bool, head_scale: float = 1.0) -> str:
    """A random 2-layer Llama (hidden 64, 2 heads of head_dim 32, 1 KV head) and the tiny tokenizer, written with
    `save_pretrained` so vLLM can load the directory. head_dim >= 32: vLLM's CPU attention has no smaller kernels.
    `head_scale` multiplies the (untied) LM head: peaked next-token distributions, as a trained model has."""
    from grpo_ratio.testing import tiny_model, tiny_tokenizer

    model = tiny_model("llama", vocab_size=TINY_VOCAB, tie_word_embeddings=tied, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=32)
    if head_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(head_scale)
    model.save_pretrained(path)
    tiny_tokenizer(vocab_size=TINY_VOCAB).save_pretrained(path)
    return str(path)


def make_llm(model_dir: str, dtype: str | None = None, **kwargs):
    """A `vllm.LLM` configured like TRL's colocate engine (processed_logprobs, max_num_batched_tokens=4096) plus the
    CPU settings that work: eager mode (no torch.compile warm-up) and a short max_model_len. `dtype=None` leaves
    vLLM its "auto" choice, as TRL does (an fp32 checkpoint then runs in bf16 on this CPU)."""
    from vllm import LLM

    if dtype is not None:
        kwargs["dtype"] = dtype
    return LLM(model=model_dir, enforce_eager=True, logprobs_mode="processed_logprobs", max_model_len=MAX_MODEL_LEN,
               max_num_batched_tokens=4096, seed=0, **kwargs)


def close_llm(llm) -> None:
    """Shut a uni-process engine down and free its KV cache before the next engine is built."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()


def completions(outputs) -> list:
    """The `CompletionOutput`s of `llm.generate` outputs, request by request (TRL's row order)."""
    return [c for out in outputs for c in out.outputs]


def sampled_logprobs(comp) -> list[float]:
    """The sampler's log-prob of each generated token of one `CompletionOutput` (its own entry in each dict)."""
    return [step[tok].logprob for tok, step in zip(comp.token_ids, comp.logprobs, strict=True)]


@torch.no_grad()
def hf_logits(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """(T, V) fp32 logits of an HF causal LM at the T positions that predict `completion_ids` (no temperature)."""
    ids = torch.tensor([prompt_ids + completion_ids])  # (1, P+T)
    logits = model(ids).logits[0].float()  # (P+T, V)
    return logits[len(prompt_ids) - 1 : -1]  # (T, V)


def hf_token_logprobs(model, prompt_ids, completion_ids, temperature: float) -> torch.Tensor:
    """(T,) fp32 full-vocabulary log-softmax(logits / temperature) of the completion tokens: what TRL's trainer
    computes (trl_grpo_internals.md 1.3: no top_p/top_k in the trainer's log-probs)."""
    logits = hf_logits(model, prompt_ids, completion_ids)  # (T, V)
    logps = torch.log_softmax(logits / temperature, dim=-1)  # (T, V)
    return logps.gather(1, torch.tensor(completion_ids)[:, None]).squeeze(1)


def load_hf(model_dir: str):
    """The HF model of a saved directory in fp32, eval mode (dropout off)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompts_from(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token-id prompts (no special tokens), the form TRL sends to vLLM."""
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
