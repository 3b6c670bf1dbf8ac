"""Tiny, random, offline models and tokenizers for tests, benchmarks and probes (no Hugging Face Hub).

Every model is built from a transformers config, so the real architecture code runs; only the sizes are tiny. Trainer
fixtures built on them live with the tests (`tests/trainer_fixtures.py`): this module never imports the trainer.
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


def tiny_prompts(n: int = 8):
    """A `datasets.Dataset` of `n` plain-text prompts (no chat template needed)."""
    from datasets import Dataset

    words = ["the quick", "what is", "solve the", "a b c", "brown fox", "lazy dog", "answer is", "give the"]
    return Dataset.from_dict({"prompt": [words[i % len(words)] + f" {i}" for i in range(n)]})


def letter_reward(completions, **kwargs):
    """Share of characters in 'a'..'m' in each completion: a smooth reward, so a group's std is rarely 0."""
    return [sum("a" <= ch <= "m" for ch in c) / max(len(c), 1) for c in completions]


# ---------------------------------------------------------------------------------------------------------------------
# FSDP2 and ZeRO-3 on CPU processes (tests and benchmarks only)


def patch_accelerate_for_cpu_sharding() -> None:
    """Let `accelerate launch` run real FSDP2 and DeepSpeed ZeRO-3 on CPU processes (gloo). Tests and benchmarks only.

    Read from accelerate 1.15 (`state.py`) and transformers 5.24 (`training_args.py`); each patch undoes one
    GPU-only branch:
    - FSDP: with `use_cpu` accelerate keeps `DistributedType.MULTI_CPU` and trains plain DDP (exit 0, nothing
      sharded); FSDP is set only in its GPU branches. The patch sets FSDP after `AcceleratorState.__init__` when an
      FSDP plugin was given, also in `PartialState`'s shared state (else later `AcceleratorState()` calls copy
      MULTI_CPU back and the model is DDP-wrapped).
    - DeepSpeed: without a GPU `PartialState` gets no backend and counts 1 process although DeepSpeed initialised
      gloo with 2; the patch makes it the gloo multi-process backend (DeepSpeed still takes over afterwards).
    - transformers refuses `bf16=True` without `use_cpu` and a GPU; DeepSpeed needs `use_cpu=False`.
    Callers must assert that sharding is really active (DTensor or partitioned parameters): an unpatched run passes
    while testing nothing. Call once per process, before any `Accelerator` or `TrainingArguments` exists.
    """
    import os

    import transformers.training_args
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    state_init, prepare_backend = AcceleratorState.__init__, PartialState._prepare_backend

    def accelerator_state_init(self, *args, fsdp_plugin=None, **kwargs):
        state_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    def partial_state_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        backend, distributed_type = prepare_backend(self, cpu, sagemaker_dp, backend)
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if distributed_type == DistributedType.NO and deepspeed and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return backend, distributed_type

    AcceleratorState.__init__ = accelerator_state_init
    PartialState._prepare_backend = partial_state_backend
    transformers.training_args.is_torch_bf16_gpu_available = lambda: True


def sharding_evidence(accelerator, model) -> dict:
    """What shows that FSDP2 or ZeRO-3 really shards `model` (not a silent DDP fallback): the distributed type,
    how many parameters are sharded, and the local vs full number of values of the largest parameter."""
    from accelerate.utils import DistributedType

    params = list(model.parameters())
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.tensor import DTensor

        from .sharding import reshard_all

        reshard_all(model)
        params = list(model.parameters())
        sharded = [p for p in params if isinstance(p, DTensor) and p.to_local().numel() < p.numel()]
        largest = max(params, key=lambda p: p.numel())
        local, full = largest.to_local().numel(), largest.numel()
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        sharded = [p for p in params if hasattr(p, "ds_id") and p.data.numel() == 0 and p.ds_tensor.numel() < p.ds_numel]
        largest = max(params, key=lambda p: p.ds_numel if hasattr(p, "ds_numel") else p.numel())
        local, full = largest.ds_tensor.numel(), largest.ds_numel
    else:
        sharded, local, full = [], None, None
    return {"distributed_type": str(accelerator.distributed_type), "num_params": len(params),
            "num_sharded": len(sharded), "largest_local": local, "largest_full": full}


def full_fp32_weights(model, engine: str) -> dict[str, torch.Tensor]:
    """The policy's whole fp32 weights (FSDP2: the fp32 shards; ZeRO-3: the optimizer's fp32 master) and buffers,
    gathered on every rank. A collective: every rank calls it at the same point."""
    from .sharding import reshard_all

    if engine == "fsdp2":
        reshard_all(model)
        weights = {n: p.full_tensor().float() for n, p in model.named_parameters()}
    elif engine == "zero3":
        from deepspeed.utils import safe_get_full_fp32_param

        weights = {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()}
    else:
        weights = {n: p.detach().float() for n, p in model.named_parameters()}
    return weights | {n: b.detach().clone() for n, b in model.named_buffers()}


def replica_scorer(model, weights: dict, mode: str, compute_dtype: torch.dtype, layers=None, policy_autocast=None):
    """An unsharded `OldLogprobScorer` that computes what `mode` gives on a single-process replica of the policy.

    The replica holds `weights` (`full_fp32_weights`) in fp32; when the engine computes in bf16 the modes that run
    part of the policy as it trains (`fp32_head`, `guided_fp32`) get a replica whose parameters are the bf16 casts
    (buffers kept, as FSDP and DeepSpeed keep them), with their fp32 modules copied from the fp32 weights.
    """
    from .copies import ModuleCopy
    from .scoring import OldLogprobScorer, model_anatomy
    from .sharding import empty_model_like

    fp32 = empty_model_like(model).float().requires_grad_(False)
    with torch.no_grad():
        for name, tensor in [*fp32.named_parameters(), *fp32.named_buffers()]:  # tied weights: one name, as gathered
            tensor.copy_(weights[name])
    fp32.train(model.training)
    if compute_dtype == torch.float32 or mode in ("fp32_clone", "fp16_clone"):
        return OldLogprobScorer(fp32, mode, layers=layers, policy_autocast=policy_autocast)
    import copy

    low = copy.deepcopy(fp32)
    for param in low.parameters():
        param.data = param.data.to(compute_dtype)
    scorer = OldLogprobScorer(low, mode, layers=layers, policy_autocast=policy_autocast)
    hi, lo = model_anatomy(fp32), model_anatomy(low)
    for i in list(scorer.layers):  # fp32 modules copied from the fp32 weights, not from their bf16 casts
        scorer._copies[id(lo.layers[i])] = ModuleCopy(hi.layers[i], torch.float32)
    scorer._copies[id(lo.norm)] = ModuleCopy(hi.norm, torch.float32)
    scorer._copies[id(lo.head)] = ModuleCopy(hi.head, torch.float32)
    return scorer


def cpu_launch_config(recipe: str, out_dir, bf16: bool, num_processes: int = 2) -> str:
    """An `accelerate launch` config for CPU processes made from one of `recipes/accelerate_configs/*.yaml`; returns
    its path (written to `out_dir`, with the DeepSpeed JSON it points to for ZeRO-3).

    Changed from the recipe: `num_processes`; FSDP2: `use_cpu` (the sharding itself needs
    `patch_accelerate_for_cpu_sharding`) and `mixed_precision` from `bf16` (accelerate builds the FSDP policy from
    the config's, whatever the trainer's `bf16` says); ZeRO-3: the inline `deepspeed_config` becomes a JSON file with
    `stage3_param_persistence_threshold: 0` (at the default, a tiny model's parameters are all "persistent": whole on
    every rank) and the mixed precision left to the trainer's `bf16` ("auto").
    """
    import json
    from pathlib import Path

    import yaml

    config = yaml.safe_load(Path(recipe).read_text())
    config["num_processes"] = num_processes
    config.pop("gpu_ids", None)
    if config["distributed_type"] == "FSDP":
        config["use_cpu"] = True
        config["mixed_precision"] = "bf16" if bf16 else "no"
    if config["distributed_type"] == "DEEPSPEED":
        inline = config.pop("deepspeed_config")
        ds = {"zero_optimization": {"stage": inline["zero_stage"], "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
              "train_micro_batch_size_per_gpu": "auto"}
        ds_path = Path(out_dir) / "deepspeed.json"
        ds_path.write_text(json.dumps(ds, indent=1))
        config["deepspeed_config"] = {"deepspeed_config_file": str(ds_path),
                                      "zero3_init_flag": inline.get("zero3_init_flag", False)}
        config.pop("mixed_precision", None)
    path = Path(out_dir) / f"{Path(recipe).stem}_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)
