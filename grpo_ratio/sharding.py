"""Old-logprob scoring on a sharded policy: accelerate's FSDP2 and DeepSpeed ZeRO-3.

Under FSDP2 and ZeRO-3 no rank holds the full weights, and the dtype a forward computes in is set by the engine (an
FSDP `MixedPrecisionPolicy`, DeepSpeed's `bf16` section), not by `param.dtype`: under accelerate's bf16 policy the
parameters report fp32 while every all-gather hands bf16 to the forward. This module gives `OldLogprobScorer` what
it needs there (`ShardedPolicy`): the engine's real compute dtype, a way to call the sharded root, whole-model forwards
in fp32 or fp16 and fp32 runners for single modules, all without a full replica on any rank.

| engine, compute dtype | `fp32_clone` | `fp16_clone` | `fp32_head`, `guided_fp32` |
|---|---|---|---|
| FSDP2, no policy (fp32)   | the policy itself | `FSDPShadow` fp16, 2 B/param / N | the policy itself |
| FSDP2, bf16 policy        | the policy, every FSDP state's policy swapped to fp32 for the call | `FSDPShadow` fp16 | the states owning the fp32 modules and the root swapped to fp32 |
| ZeRO-3, fp32              | the policy itself | `ZeroShadow` fp16, 2 B/param / N | the policy itself |
| ZeRO-3, bf16              | `ZeroShadow` fp32, 4 B/param / N, from the fp32 master partitions | `ZeroShadow` fp16 | fp32 runners that all-gather the master weights of one module at a time (0 B kept) |

Shadows are models built from the policy's config and sharded exactly like it (FSDP2 `Shard(0)` on the same mesh;
ZeRO-3 partitions of the same world size), so a refresh is a local cast-copy of each rank's own shard: no
communication, and the bytes kept per rank are the copy's size divided by the number of ranks.

Rules (each one a failure seen on 2 gloo processes, torch 2.13, deepspeed 0.19):
- call the sharded root through `nn.Module.__call__` (FSDP's and DeepSpeed's root hooks run there), with the class
  forward in place of the instance patches of TRL (fused head) and accelerate (autocast);
- FSDP2 leaves `reshard_after_forward=False` groups (final norm, LM head, tied embeddings) unsharded after a forward:
  `reshard()` before reading or re-typing parameters;
- every rank runs the same sequence of sharded forwards (the fp16 fallback is agreed by an all-reduce);
- an FSDP policy is swapped state by state, each state once (the norm and the head share one state), and swapped
  back before the next training forward; fp32 layers under a bf16 policy get the rotary cos/sin in exact fp32
  (`scoring._rope_fp32_forward`), since the hidden states they come from are bf16.

Three modules: this one (which engine, the start-up refusals, calling a sharded root, `ShardedPolicy` and
`sharded_policy`), `sharding_fsdp2.py` (FSDP2 internals, `FSDPShadow`, `FSDP2Policy`, `fp32_logprob_output`) and
`sharding_zero3.py` (DeepSpeed ZeRO-3 internals, `ZeroShadow`, `MasterFP32Runner`, `Zero3Policy`).

Private torch/DeepSpeed APIs are used only where no public one exists; each use says which version it was read from.
Peers: NeMo-RL keeps the FSDP2 output in fp32 (`output_dtype=float32`); TRL #4867/#6330 fixed the fp32 LM head
under FSDP2 by casting at call time; no peer keeps an fp32 or fp16 copy for the old pass.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

from .adapters import has_adapters
from .copies import VersionedCopy


# ---------------------------------------------------------------------------------------------------------------------
# which engine, and what it refuses


def engine_of(accelerator) -> str:
    """`"fsdp2"`, `"zero3"`, or `"none"` (single process, DDP, FSDP1, DeepSpeed ZeRO-0/1/2: weights not sharded by
    an engine this module handles). Reads accelerate's state, which is known before the model is wrapped."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return "fsdp2" if state.fsdp_plugin.fsdp_version == 2 else "fsdp1"
    if state.distributed_type == DistributedType.DEEPSPEED and state.deepspeed_plugin.zero_stage == 3:
        return "zero3"
    return "none"


def check_sharded_mode(accelerator, model: nn.Module, args) -> None:
    """Refuse at start-up the sharded combinations in which `args.old_logprob_mode` cannot be made exact.

    `bf16` is TRL's own pass and always allowed. Checked before accelerate wraps the model (in the trainer's
    `__init__`), from accelerate's state and the config.

    Raises:
        NotImplementedError: FSDP1 (use `fsdp_version: 2`); a PEFT adapter under FSDP2 or ZeRO-3; fp16 mixed
            precision (`fp16=True`) under FSDP2 or ZeRO-3; parameter offload to CPU (`fsdp_offload_params`, ZeRO-3
            `offload_param`); DeepSpeed's `torch_autocast`; under ZeRO-3, frozen parameters where the mode copies
            from the fp32 masters (bf16 engines, or `fp16_clone`). Each message names the combination and what works.
    """
    mode = args.old_logprob_mode
    engine = engine_of(accelerator)
    if mode == "bf16" or engine == "none":
        return
    name = {"fsdp1": "FSDP1", "fsdp2": "FSDP2", "zero3": "DeepSpeed ZeRO-3"}[engine]
    if engine == "fsdp1":
        _refuse(mode, name, "FSDP1 is not supported", "set `fsdp_version: 2` (recipes/accelerate_configs/fsdp2.yaml)")
    if has_adapters(model):
        _refuse(mode, name, "a PEFT adapter is not supported there (the shadows would need the adapters merged "
                "across shards)", "use DDP or ZeRO-2 (parameters replicated), or old_logprob_mode='bf16'")
    if args.fp16:
        _refuse(mode, name, "fp16 mixed precision (fp16=True) is not supported", "use bf16=True or bf16=False")
    if engine == "fsdp2":
        _check_fsdp2(mode, name, accelerator.state.fsdp_plugin)
    else:
        _check_zero3(mode, name, accelerator.state.deepspeed_plugin.deepspeed_config, model)


def _check_fsdp2(mode: str, name: str, plugin) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):  # the shadows and policy swaps assume on-device shards
        _refuse(mode, name, "parameter offload (fsdp_offload_params) is not supported",
                "turn offload off, or use old_logprob_mode='bf16'")


def _check_zero3(mode: str, name: str, ds_config: dict, model: nn.Module) -> None:
    offload = ds_config.get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    if str(offload).lower() not in ("none", "auto"):  # the shadows' refresh reads on-device partitions
        _refuse(mode, name, "parameter offload (offload_param) is not supported",
                "turn offload_param off, or use old_logprob_mode='bf16'")
    if ds_config.get("torch_autocast", {}).get("enabled", False) is True:  # fp32 weights, bf16 compute: untested
        _refuse(mode, name, "DeepSpeed's torch_autocast is not supported", "use the bf16 section instead")
    # bf16 engines hold fp32 only as the optimizer's masters; fp16_clone copies from them in any precision
    needs_master = ds_config.get("bf16", {}).get("enabled", False) is True or mode == "fp16_clone"
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if needs_master and frozen:
        _refuse(mode, name, f"frozen parameters ({frozen[0]}, ...) have no fp32 master partition to copy from",
                "train every parameter, or use old_logprob_mode='bf16'")


def _refuse(mode: str, engine: str, why: str, instead: str):
    raise NotImplementedError(f"old_logprob_mode={mode!r} under {engine}: {why}; {instead} (docs/distributed.md)")


def is_fsdp2_wrapped(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def is_zero3_partitioned(model: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


# ---------------------------------------------------------------------------------------------------------------------
# calling a sharded model


@contextlib.contextmanager
def class_forward(module: nn.Module):
    """Make `module(...)` run the class forward, the instance patches of TRL (fused head) and accelerate (autocast)
    set aside and restored afterwards, while `nn.Module.__call__` still runs FSDP's and DeepSpeed's hooks."""
    saved = module.__dict__.get("forward")
    module.forward = types.MethodType(type(module).forward, module)
    try:
        yield module
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved


@contextlib.contextmanager
def _output_cast(module: nn.Module, dtype: torch.dtype):
    """Within the context, `module`'s floating-point tensor output is cast to `dtype` (a forward hook)."""

    def cast(mod, args, output):
        return output.to(dtype) if isinstance(output, torch.Tensor) and output.is_floating_point() else output

    handle = module.register_forward_hook(cast)
    try:
        yield
    finally:
        handle.remove()


def _sum_over_ranks(value: int, device) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t.item())


# ---------------------------------------------------------------------------------------------------------------------
# what the scorer asks of a sharded policy


class ShardedPolicy:
    """The sharded policy as `OldLogprobScorer` sees it. Built after accelerate wrapped the model.

    Attributes:
        engine (`str`): `"fsdp2"` or `"zero3"`.
        storage_dtype (`torch.dtype`): dtype of the parameters as held (fp32 under accelerate's FSDP2 policy).
        compute_dtype (`torch.dtype`): dtype the policy's forward computes in (FSDP `param_dtype`, DeepSpeed bf16).
    """

    engine = "none"

    def __init__(self, model: nn.Module, storage_dtype: torch.dtype, compute_dtype: torch.dtype):
        self.model = model
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.device = next(model.parameters()).device
        self._shadows: dict[torch.dtype, VersionedCopy] = {}  # FSDPShadow / ZeroShadow by dtype

    def forward(self, model: nn.Module, **kwargs):
        """`model(**kwargs)` through `nn.Module.__call__` with the class forward (the sharded root's hooks run)."""
        with class_forward(model):
            return model(**kwargs)

    def sum_over_ranks(self, value: int) -> int:
        return _sum_over_ranks(value, self.device)

    def scoring(self) -> contextlib.AbstractContextManager:
        """Context around one whole old pass (all its chunks); ZeRO-3 cleans up after it."""
        return contextlib.nullcontext()

    def copies(self) -> list:
        return list(self._shadows.values())

    @contextlib.contextmanager
    def whole_model(self, dtype: torch.dtype, version: int):
        """The model to run a whole forward in `dtype` on (outside autocast): the policy or a shadow."""
        raise NotImplementedError

    def fp32_modules(self, modules: list[nn.Module]) -> contextlib.AbstractContextManager:
        """Context within which `modules` can run in fp32 (FSDP2: their states' policy swapped)."""
        return contextlib.nullcontext()

    def fp32_runner(self, module: nn.Module) -> nn.Module:
        """What runs `module` in fp32 inside `fp32_modules`: the module itself unless its fp32 weights live elsewhere."""
        return module

    def _shadow(self, dtype: torch.dtype):
        raise NotImplementedError


def sharded_policy(accelerator, model: nn.Module) -> ShardedPolicy | None:
    """The `ShardedPolicy` of an accelerate-prepared model, or None when its weights are not sharded.

    Args:
        accelerator: the trainer's `accelerate.Accelerator`.
        model: the (unwrapped) policy module, after `accelerator.prepare` (which wraps it in place).
    Raises:
        RuntimeError: the engine is FSDP2/ZeRO-3 but the model is not wrapped yet (before `train()`).
    """
    from .sharding_fsdp2 import FSDP2Policy  # the engine modules build on this one's ShardedPolicy
    from .sharding_zero3 import Zero3Policy

    engine = engine_of(accelerator)
    if engine == "fsdp2":
        if not is_fsdp2_wrapped(model):
            raise RuntimeError("grpo_ratio: the scorer of an FSDP2 run exists once train() has wrapped the model")
        return FSDP2Policy(model)
    if engine == "zero3":
        wrapped = accelerator.deepspeed_engine_wrapped
        if wrapped is None or not is_zero3_partitioned(model):
            raise RuntimeError("grpo_ratio: the scorer of a ZeRO-3 run exists once train() has wrapped the model")
        return Zero3Policy(model, wrapped.engine)
    return None
