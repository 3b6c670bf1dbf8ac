"""Tiny, random, offline models and tokenizers for tests, benchmarks and probes (no Hugging Face Hub).

Every model is built from a transformers config, so the real architecture code runs; only the sizes are tiny. Trainer
fixtures built on them live with the tests (`tests/trainer_fixtures.py`), the CPU-sharding harness in
`grpo_ratio.testing.sharded`: this module holds tiny models, tokenizers, prompts and a reward only.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Glm4MoeConfig,
    GPT2Config,
    GPTNeoXConfig,
    GraniteMoeConfig,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)


SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "what is 12 + 7 ? the answer is 19",
    "solve the problem and give the final answer #### 42",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9 + - * = ?",
]

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gpt_neox", "qwen3_moe")
# one tiny model per MoE family that routing replay supports (grpo_ratio.routing.families); the DeepSeek-V3-style
# ones (sigmoid router, bias, group-limited top-k) have a dense first layer (`first_k_dense_replace=1`)
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "granitemoe", "olmoe", "deepseek_v3", "glm4_moe")


def tiny_tokenizer(vocab_size: int = 300, pad_is_eos: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in memory on a few sentences (left padding, like TRL's generation).

    Args:
        vocab_size: target vocabulary size V (the 256 byte symbols + merges + 3 special tokens).
        pad_is_eos: when True the pad token is `<eos>` (as in many chat models), to test pad == eos handling.
    """
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<eos>" if pad_is_eos else "<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_config(arch: str = "qwen2", vocab_size: int = 300, tie_word_embeddings: bool = False, **overrides):
    """A 2-layer config of `arch` (one of ARCHITECTURES, or "gpt2": absolute positions) with hidden size 64 and pad/eos
    ids 0/1."""
    common = dict(vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings, pad_token_id=0, eos_token_id=1,
                  bos_token_id=None)
    if arch == "llama":
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, **common)
    elif arch == "qwen2":
        cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, **common)
    elif arch == "qwen3":
        cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, **common)
    elif arch == "gpt_neox":
        cfg = GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            **common)
    elif arch == "gpt2":  # learned absolute position embeddings (`wpe`)
        cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=128, **common)
    elif arch == "qwen3_moe":
        cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                             num_experts_per_tok=2, decoder_sparse_step=1, **common)
    elif arch in MOE_ARCHITECTURES:
        return _tiny_moe_config(arch, common, overrides)
    else:
        raise ValueError(f"Unknown tiny architecture {arch!r}; allowed: {', '.join(ARCHITECTURES + MOE_ARCHITECTURES)}, "
                         f"gpt2")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _tiny_moe_config(arch: str, common: dict, overrides: dict):
    """2 layers, 4 experts, top-2 (3 layers, 8 experts in 4 or 2 groups for the DeepSeek-V3-style routers, the first
    layer dense). `overrides` go to the config's constructor, so derived fields (`layer_types`) follow them."""
    attention = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    deepseek = dict(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                    n_shared_experts=1, first_k_dense_replace=1, hidden_size=64, num_hidden_layers=3,
                    num_attention_heads=4)
    configs = {
        "qwen2_moe": (Qwen2MoeConfig, dict(intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                                           shared_expert_intermediate_size=32, num_experts_per_tok=2,
                                           decoder_sparse_step=1, **attention)),
        "mixtral": (MixtralConfig, dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                                        **attention)),
        "granitemoe": (GraniteMoeConfig, dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                              **attention)),
        "olmoe": (OlmoeConfig, dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2, **attention)),
        "deepseek_v3": (DeepseekV3Config, dict(n_group=4, topk_group=2, kv_lora_rank=16, q_lora_rank=None,
                                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                               num_key_value_heads=4, **deepseek)),  # multi-head latent attention
        "glm4_moe": (Glm4MoeConfig, dict(n_group=2, topk_group=1, head_dim=16, num_key_value_heads=2, **deepseek)),
    }
    config_class, kwargs = configs[arch]
    return config_class(**(kwargs | common | overrides))


def tiny_model(arch: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32, **config_kwargs):
    """A randomly initialised tiny causal LM of `arch`, seeded, with generation pad/eos set, in `dtype`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **config_kwargs))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 1
    return model.to(dtype)


def peaked_model(arch: str = "qwen2", scale: float = 50.0, eos_token_id: int = 1, never_eos: bool = False, **kwargs):
    """A tiny untied model whose LM head is `scale` times the random one: peaked next-token distributions (logits
    with a standard deviation of about 0.16 x `scale` nats), as a trained model has, where a tiny random one is
    nearly uniform. With `never_eos` the EOS row of the head is zero, so EOS gets logit 0 against a top logit of
    about 0.45 x `scale`: never sampled (probability below 1e-9 at the default scale), and every completion runs to
    `max_completion_length` (truncated)."""
    model = tiny_model(arch, **kwargs)
    head = model.get_output_embeddings().weight
    with torch.no_grad():
        head.mul_(scale)
        if never_eos:
            head[eos_token_id] = 0.0
    return model


def tiny_prompts(n: int = 8, start: int = 0):
    """A `datasets.Dataset` of `n` plain-text prompts (no chat template needed): prompt i is one of 8 short phrases
    followed by its number i, for i = start .. start + n - 1 (a held-out set: another `start`, no shared prompt)."""
    from datasets import Dataset

    words = ["the quick", "what is", "solve the", "a b c", "brown fox", "lazy dog", "answer is", "give the"]
    return Dataset.from_dict({"prompt": [words[i % len(words)] + f" {i}" for i in range(start, start + n)]})


def letter_reward(completions, **kwargs):
    """Share of characters in 'a'..'m' in each completion: a smooth reward, so a group's std is rarely 0. A
    conversational completion (a list of messages, as TRL's async rollout worker passes) is read by its last
    message's content."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum("a" <= ch <= "m" for ch in t) / max(len(t), 1) for t in texts]
