"""DeepSpeed ZeRO-3 for old-logprob scoring: cleaning up after an old pass, the engine's compute dtype, the
partitioned copies (`ZeroShadow`), fp32 runners of single modules (`MasterFP32Runner`) and the `ShardedPolicy` of
ZeRO-3.

The rules these follow, and the table of what each scoring mode runs on, are in `grpo_ratio.old_pass.sharding.engines`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..copies import VersionedCopy, empty_model_like, persistent_buffer_names, settle_buffers
from .base import ShardedPolicy


# ---------------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 internals (deepspeed 0.19.8). Public: `deepspeed.initialize`, `deepspeed.zero.Init`,
# `safe_get_local_fp32_param` / `safe_get_full_fp32_param` (deepspeed/utils/tensor_fragment.py). Read from the
# source: a partitioned parameter's local partition is `param.ds_tensor` (flat, this rank's slice of the flattened
# tensor, padded at the end), the same slicing for every parameter of a given size and world size.


def zero3_after_scoring(engine) -> None:
    """After an old pass over the ZeRO-3 policy: release its gathered parameters and drop the module-order trace
    recorded for prefetching, so the next training forward re-records it.

    After a no-grad forward that follows the recorded trace, ZeRO-3 keeps the parameters it expects to reuse
    gathered (on 2 ranks, 26 of 27 tensors of a tiny model: a full replica) until the next forward; the ZeRO-3
    optimizer's `empty_partition_cache()` releases them. Done once per old pass, not per chunk: the chunks' forwards
    follow one order and prefetch from it.

    A scoring forward calls the LM head as a module; TRL's fused head never does (it all-gathers `lm_head.weight`
    itself, `trl.trainer.utils.maybe_gather_lm_head_ctx`). With the scoring order as the trace, the coordinator
    prefetches the head in the training forward, TRL then skips its own gather, and the backward fails in
    `AccumulateGrad` ("size of tensor a (0)"). Private: `PartitionedParameterCoordinator._invalidate_trace`
    (deepspeed 0.19.8, runtime/zero/partitioned_param_coordinator.py).
    """
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    engine.optimizer.empty_partition_cache()  # engine.empty_partition_cache() adds a gc.collect(): 3x the old pass


def zero3_engine_dtype(engine) -> torch.dtype:
    """The dtype a ZeRO-3 engine computes in (its `bf16`/`fp16` section; DeepSpeed casts the module itself)."""
    if engine.bfloat16_enabled():
        return torch.bfloat16
    if engine.fp16_enabled():
        return torch.float16
    return torch.float32


class ZeroShadow(VersionedCopy):
    """A ZeRO-3-partitioned copy of the policy in `dtype`: its own DeepSpeed engine, no optimizer.

    Refreshed from the policy's fp32 master partitions (`safe_get_local_fp32_param`: the optimizer's copy, the only
    fp32 weights under bf16) by a local cast-copy into the shadow's partitions: no communication. Built inside
    `deepspeed.zero.Init`, so no rank ever allocates the whole copy. Bytes per rank: parameters x (2 or 4) / N
    (plus padding to a multiple of N per parameter) and the buffers, the policy's fp32 ones in fp32.

    A `VersionedCopy` (as `ModuleCopy`): `get(version)`, `refresh(version)`, `num_bytes()`, `dtype`, `version`; eval mode.

    Raises:
        NotImplementedError: a frozen parameter (`requires_grad=False`) has no fp32 master partition.
    """

    def __init__(self, policy: nn.Module, dtype: torch.dtype):
        import deepspeed

        frozen = [n for n, p in policy.named_parameters() if not p.requires_grad]
        if frozen:
            raise NotImplementedError(f"grpo_ratio: under ZeRO-3 frozen parameters have no fp32 master to copy "
                                      f"from ({frozen[:3]}...); use old_logprob_mode='bf16'")
        self.source, self.dtype = policy, dtype
        config = {
            "train_micro_batch_size_per_gpu": 1,
            # every parameter partitioned (none kept whole as "persistent"), so a refresh is purely local
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "bf16": {"enabled": dtype == torch.bfloat16},
            "fp16": {"enabled": False},  # no optimizer: nothing to loss-scale (and CPU accelerators refuse fp16 here)
        }
        # Init takes the partitions' dtype from its config (its `dtype=` argument makes every copy bf16 on CPU
        # accelerators: `dtype or fp16 if fp16 supported else bf16`); mem_efficient_linear=False: Init would otherwise
        # swap torch.nn.functional.linear for its own, for good, and the policy's next backward reads released
        # partitions ("size of tensor a (0)")
        init_config = config | {"fp16": {"enabled": dtype == torch.float16}}
        with deepspeed.zero.Init(config_dict_or_path=init_config, mem_efficient_linear=False):
            module = empty_model_like(policy)
        engine, *_ = deepspeed.initialize(model=module, config=config)
        if {p.dtype for p in engine.module.parameters()} != {dtype}:
            raise RuntimeError(f"grpo_ratio: the ZeRO-3 shadow holds {engine.module.dtype}, not {dtype}")
        settle_buffers(engine.module, policy, dtype)  # whole on every rank; rotary inv_freq fresh, in fp32
        self._persistent = persistent_buffer_names(engine.module)
        self.engine = engine
        self.module = engine.module.requires_grad_(False).eval()

    def refresh_weights(self) -> None:
        from deepspeed.utils import safe_get_local_fp32_param

        policy = dict(self.source.named_parameters())
        for name, dst in self.module.named_parameters():
            local = safe_get_local_fp32_param(policy[name])  # (n,) fp32, this rank's partition
            if local.numel() != dst.ds_tensor.numel():
                raise RuntimeError(f"grpo_ratio: ZeRO-3 partitions of {name} differ ({local.numel()} vs "
                                   f"{dst.ds_tensor.numel()} values); the shadow must be partitioned like the policy")
            dst.ds_tensor.copy_(local.view_as(dst.ds_tensor))
        buffers = dict(self.source.named_buffers())
        for name, dst in self.module.named_buffers():  # the persistent ones; rotary tables were settled at build
            if name in self._persistent:
                dst.copy_(buffers[name])

    def num_bytes(self) -> int:
        """Bytes this rank keeps: its partitions and the (whole) buffers."""
        parts = [p.ds_tensor for p in self.module.parameters()] + list(self.module.buffers())
        return sum(t.numel() * t.element_size() for t in parts)


class MasterFP32Runner(nn.Module):
    """Runs one module of a ZeRO-3 bf16 policy in fp32 from the optimizer's fp32 master weights.

    Each call all-gathers the module's master weights (`safe_get_full_fp32_param`, a collective: every rank calls it
    for the same modules in the same order) and runs a parameter-less skeleton of the module (built on the meta
    device) on them with `torch.func.functional_call`. Nothing is kept between calls: 0 bytes per rank; while it runs,
    one module's fp32 weights are whole on each rank, as ZeRO-3 itself does with the bf16 weights.
    """

    def __init__(self, source: nn.Module, skeleton: nn.Module):
        super().__init__()
        self.__dict__["source"] = source  # not registered: neither is a parameter of this runner
        self.__dict__["skeleton"] = skeleton

    def forward(self, *args, **kwargs):
        from deepspeed.utils import safe_get_full_fp32_param

        weights = {n: safe_get_full_fp32_param(p) for n, p in self.source.named_parameters()}
        weights |= {n: b.float() if b.is_floating_point() else b for n, b in self.source.named_buffers()}
        return torch.func.functional_call(self.skeleton, weights, args, kwargs)


class Zero3Policy(ShardedPolicy):
    """ZeRO-3 policy: the policy itself where it already computes in the wanted dtype, else a `ZeroShadow` (whole
    model) or `MasterFP32Runner`s (single modules, bf16 engines)."""

    engine = "zero3"

    def __init__(self, model: nn.Module, engine):
        dtype = zero3_engine_dtype(engine)
        held = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if held != {dtype}:  # never trust one of the two alone
            raise RuntimeError(f"grpo_ratio: ZeRO-3 engine computes in {dtype} but holds parameters in {held}")
        super().__init__(model, dtype, dtype)
        self._engine = engine
        self._skeleton: nn.Module | None = None
        self._runners: dict[int, MasterFP32Runner] = {}

    @contextlib.contextmanager
    def scoring(self):
        try:
            yield
        finally:  # nothing left gathered; the training forward does not prefetch from the scoring order
            zero3_after_scoring(self._engine)

    @contextlib.contextmanager
    def whole_model(self, dtype: torch.dtype, version: int):
        if dtype == self.compute_dtype:
            yield self.model
        else:
            yield self._shadow(dtype).get(version)

    def fp32_runner(self, module: nn.Module) -> nn.Module:
        if self.compute_dtype == torch.float32:
            return module
        if id(module) not in self._runners:
            if self._skeleton is None:
                with torch.device("meta"):
                    self._skeleton = empty_model_like(self.model).float()
            name = {id(m): n for n, m in self.model.named_modules()}[id(module)]
            self._runners[id(module)] = MasterFP32Runner(module, self._skeleton.get_submodule(name))
        return self._runners[id(module)]

    def _shadow(self, dtype: torch.dtype):
        if dtype not in self._shadows:
            self._shadows[dtype] = ZeroShadow(self.model, dtype)
        return self._shadows[dtype]
