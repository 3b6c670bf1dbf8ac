"""Real FSDP2 and DeepSpeed ZeRO-3 on CPU processes, for tests and benchmarks only (never imported by the library).

- `patch_accelerate_for_cpu_sharding`: lets `accelerate launch` shard for real on gloo CPU processes;
- `cpu_launch_config`: a CPU launch config made from one of `recipes/accelerate_configs/*.yaml`;
- `sharding_evidence`: what shows the model is really sharded (not a silent DDP fallback);
- `full_fp32_weights`, `replica_scorer`: an unsharded replica of the gathered weights, scored by the same mode, to
  compare a sharded old pass with (tests/sharded_modes.py, benchmarks/sharded_old_pass.py).
"""

from __future__ import annotations

import torch

from ..modes import FP16_CLONE, FP32_CLONE


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

        from ..old_pass.sharding.fsdp2 import reshard_all

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
    from ..old_pass.sharding.fsdp2 import reshard_all

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
    from ..old_pass.copies import ModuleCopy, empty_model_like
    from ..old_pass.scorer import OldLogprobScorer, model_anatomy

    fp32 = empty_model_like(model).float().requires_grad_(False)
    with torch.no_grad():
        for name, tensor in [*fp32.named_parameters(), *fp32.named_buffers()]:  # tied weights: one name, as gathered
            tensor.copy_(weights[name])
    fp32.train(model.training)
    if compute_dtype == torch.float32 or mode in (FP32_CLONE.name, FP16_CLONE.name):
        return OldLogprobScorer(fp32, mode, layers=layers, policy_autocast=policy_autocast)
    import copy

    low = copy.deepcopy(fp32)
    for param in low.parameters():
        param.data = param.data.to(compute_dtype)
    scorer = OldLogprobScorer(low, mode, layers=layers, policy_autocast=policy_autocast)
    hi, lo = model_anatomy(fp32), model_anatomy(low)
    for i in list(scorer.layers):  # fp32 modules copied from the fp32 weights, not from their bf16 casts
        scorer._copies[id(lo.layers[i]), torch.float32] = ModuleCopy(hi.layers[i], torch.float32)
    scorer._copies[id(lo.norm), torch.float32] = ModuleCopy(hi.norm, torch.float32)
    scorer._copies[id(lo.head), torch.float32] = ModuleCopy(hi.head, torch.float32)
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
