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

Private torch/DeepSpeed APIs are used only where no public one exists; each use says which version it was read from.
Peers: NeMo-RL keeps the FSDP2 output in fp32 (`output_dtype=float32`); TRL #4867/#6330 fixed the fp32 LM head
under FSDP2 by casting at call time; no peer keeps an fp32 or fp16 copy for the old pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from collections.abc import Iterable

import torch
from torch import nn

from .adapters import has_adapters
from .copies import VersionedCopy, empty_model_like


logger = logging.getLogger(__name__)


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
# FSDP2 internals (torch 2.13: torch/distributed/fsdp/_fully_shard/_fsdp_state.py, _fsdp_param_group.py,
# _fsdp_param.py). The public API has `fully_shard`, `reshard`, `unshard` and DTensors, but no way to read or change
# the mixed-precision policy of a wrapped module.


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp_states(model: nn.Module) -> list:
    """Every FSDP state under `model`, each once (a grouped `fully_shard([norm, lm_head])` has one state)."""
    states = {}
    for m in fsdp_modules(model):
        state = m._get_fsdp_state()  # private: FSDPModule._get_fsdp_state
        states.setdefault(id(state), state)
    return list(states.values())


def fsdp_state_owning(model: nn.Module, module: nn.Module):
    """The FSDP state whose parameter group holds `module`'s parameters: that of `module` or its nearest wrapped
    ancestor."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n for n, m in model.named_modules()}
    parts = names[id(module)].split(".") if names[id(module)] else []
    for i in range(len(parts), -1, -1):
        candidate = model.get_submodule(".".join(parts[:i]))
        if isinstance(candidate, FSDPModule):
            return candidate._get_fsdp_state()
    raise ValueError(f"no FSDP state holds {names[id(module)] or type(module).__name__}")


def fsdp_layout(model: nn.Module) -> list[list[str]]:
    """The module names of each FSDP state under `model` (one list per `fully_shard` call), deepest first: the
    order in which `fully_shard` must be applied to repeat the layout on a model of the same architecture."""
    names = {id(m): n for n, m in model.named_modules()}
    groups = [[names[id(m)] for m in state._modules] for state in fsdp_states(model)]  # private: FSDPState._modules
    return sorted(groups, key=lambda g: -min(n.count(".") + (n != "") for n in g))


def reshard_all(model: nn.Module) -> None:
    """Reshard every FSDP module: after a forward, `reshard_after_forward=False` groups stay unsharded."""
    for m in fsdp_modules(model):
        m.reshard()


def _set_state_policy(state, policy) -> None:
    """Give one FSDP state a new `MixedPrecisionPolicy`, for its hooks and its parameter group's all-gathers.

    The state must be resharded. Cached all-gather buffers and unsharded parameters were allocated in the old
    `param_dtype`; they are dropped so the next all-gather allocates them in the new one.
    """
    state._mp_policy = policy
    for group in state._fsdp_param_groups:
        if not group.is_sharded:
            raise RuntimeError("grpo_ratio: an FSDP group is still unsharded; reshard before swapping its policy")
        for param in group.fsdp_params:
            if param.unsharded_accumulated_grad is not None or (
                    hasattr(param, "_unsharded_param") and param._unsharded_param.grad is not None):
                raise RuntimeError("grpo_ratio: FSDP2 holds unreduced gradients (a generation inside a gradient "
                                   "accumulation); set steps_per_generation to a multiple of "
                                   "gradient_accumulation_steps")
        group.mp_policy = policy
        group._init_mp_dtypes()
        for param in group.fsdp_params:
            param.mp_policy = policy
            param.all_gather_outputs = []
            if hasattr(param, "_unsharded_param"):
                del param._unsharded_param


@contextlib.contextmanager
def fsdp_policy_swapped(model: nn.Module, states: Iterable, policy):
    """Within the context the given FSDP states (each once) use `policy`; they are resharded and restored on exit."""
    states = list({id(s): s for s in states}.values())
    reshard_all(model)
    saved = [s._mp_policy for s in states]
    for state in states:
        _set_state_policy(state, policy)
    try:
        yield
    finally:
        reshard_all(model)
        for state, old in zip(states, saved):
            _set_state_policy(state, old)


def fsdp_compute_dtype(model: nn.Module, storage_dtype: torch.dtype) -> torch.dtype:
    """The dtype FSDP2 all-gathers the parameters in (the policies' `param_dtype`), not `param.dtype`.

    Raises:
        NotImplementedError: FSDP states with different `param_dtype`s (accelerate applies one policy to all).
    """
    dtypes = {s._mp_policy.param_dtype or storage_dtype for s in fsdp_states(model)}
    if len(dtypes) != 1:
        raise NotImplementedError(f"grpo_ratio: FSDP states with different param_dtype {sorted(map(str, dtypes))}")
    return dtypes.pop()


def fp32_logprob_output(model: nn.Module) -> bool:
    """Keep the training forward's per-token log-probs in fp32 under an FSDP2 mixed-precision policy.

    accelerate's bf16 policy has `output_dtype=bfloat16`, so TRL 1.16's log-probs (fp32 out of its chunked kernel) are
    rounded to bf16 on their way out (up to 1.5e-2 nats on a tiny model): the new side of every ratio, in every mode.
    TRL's fused head reads `lm_head.weight` without calling `lm_head`, so the head group's cast is applied at the
    root's post-forward (`_force_complete_incomplete_states`): both the root's and the head group's `output_dtype`
    must go. They are set to None (no cast), which changes nothing but that rounding: the layers still compute in
    bf16 and the head's input is the norm's bf16 output. NeMo-RL sets `output_dtype=float32` for the same reason.

    Idempotent; a no-op without FSDP2 or without an output cast. Returns True when a policy was changed.
    """
    if not is_fsdp2_wrapped(model):
        return False
    head = model.get_output_embeddings()
    states = [model._get_fsdp_state()] if hasattr(model, "_get_fsdp_state") else []
    states += [fsdp_state_owning(model, head)] if head is not None else []
    changed = False
    for state in {id(s): s for s in states}.values():
        if state._mp_policy.output_dtype not in (None, torch.float32):
            state._mp_policy = dataclasses.replace(state._mp_policy, output_dtype=None)
            for group in state._fsdp_param_groups:
                group.mp_policy = state._mp_policy  # output_dtype is read from the state; kept alike for clarity
            changed = True
    if changed:
        logger.info("grpo_ratio: FSDP2 output_dtype of the root and the LM-head group set to None: training "
                    "log-probs stay fp32 (were rounded to bf16)")
    return changed


class FSDPShadow(VersionedCopy):
    """A copy of an FSDP2-sharded causal LM in `dtype`, sharded like it: each rank holds only its own rows.

    Built from the policy's config on the meta device, `fully_shard` on the same module groups as the policy (same
    mesh, no mixed-precision policy, resharded after each forward), then materialised: only local shards are ever
    allocated. A refresh copies each
    rank's local shard of every policy parameter into the shadow's (cast to `dtype`), with no communication: both
    are `Shard(0)` DTensors on one mesh, so row ranges match whatever the grouping. Bytes per rank: parameters x
    (2 or 4) / N, plus the buffers (rotary tables), which every rank keeps whole.

    A `VersionedCopy` (as `ModuleCopy`): `get(version)`, `refresh(version)`, `num_bytes()`, `dtype`, `version`; eval mode.
    """

    def __init__(self, policy: nn.Module, dtype: torch.dtype):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.source, self.dtype = policy, dtype
        mesh = next(p.device_mesh for p in policy.parameters() if hasattr(p, "device_mesh"))
        device = next(policy.parameters()).device
        with torch.device("meta"):
            module = empty_model_like(policy).to(dtype)
        for names in fsdp_layout(policy):  # the policy's own groups, innermost first, the root last
            group = [module.get_submodule(n) for n in names]
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh, reshard_after_forward=True,
                        mp_policy=MixedPrecisionPolicy())
        self.module = module.to_empty(device=device).requires_grad_(False).eval()

    def refresh_weights(self) -> None:
        reshard_all(self.source)  # parameters of reshard_after_forward=False groups are unsharded after a forward
        reshard_all(self.module)
        policy = dict(self.source.named_parameters())
        for name, dst in self.module.named_parameters():
            dst.to_local().copy_(policy[name].to_local())  # this rank's rows, cast to self.dtype
        buffers = dict(self.source.named_buffers())
        for name, dst in self.module.named_buffers():  # whole on every rank; to_empty left them uninitialised
            dst.copy_(buffers[name])

    def num_bytes(self) -> int:
        """Bytes this rank keeps: its local shards and the (whole) buffers."""
        local = [p.to_local() for p in self.module.parameters()] + list(self.module.buffers())
        return sum(t.numel() * t.element_size() for t in local)


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
    (plus padding to a multiple of N per parameter) and the buffers.

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
        for name, dst in self.module.named_buffers():
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
        self._shadows: dict[torch.dtype, FSDPShadow | ZeroShadow] = {}

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


class FSDP2Policy(ShardedPolicy):
    """FSDP2 (`fully_shard`) policy: fp32 runs the policy's own fp32 shards (policies swapped under bf16), fp16 a
    `FSDPShadow`."""

    engine = "fsdp2"

    def __init__(self, model: nn.Module):
        reshard_all(model)  # an unsharded group's parameters are the all-gathered ones, in the compute dtype
        storage = next(p.dtype for p in model.parameters() if p.is_floating_point())
        super().__init__(model, storage, fsdp_compute_dtype(model, storage))

    @contextlib.contextmanager
    def whole_model(self, dtype: torch.dtype, version: int):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if dtype != self.storage_dtype:
            yield self._shadow(dtype).get(version)
            reshard_all(self._shadows[dtype].module)
        elif dtype == self.compute_dtype:
            yield self.model
        else:
            with fsdp_policy_swapped(self.model, fsdp_states(self.model), MixedPrecisionPolicy()):
                yield self.model

    def fp32_modules(self, modules: list[nn.Module]):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        # the root too: its output cast would round the fp32 logits, its input cast is a no-op on token ids
        root = self.model._get_fsdp_state()
        states = {id(s): s for s in [fsdp_state_owning(self.model, m) for m in modules]}
        states.pop(id(root), None)
        # a module sharing a swapped state without being upcast (the input embedding, tied to the head) would now
        # compute in fp32 too: its output is cast to the compute dtype, where the policy's would be
        upcast = {id(m) for m in modules}
        bystanders = [m for s in states.values() for m in s._modules if id(m) not in upcast]
        stack = contextlib.ExitStack()
        stack.enter_context(fsdp_policy_swapped(self.model, [root, *states.values()], MixedPrecisionPolicy()))
        for module in bystanders:
            stack.enter_context(_output_cast(module, self.compute_dtype))
        return stack

    def _shadow(self, dtype: torch.dtype):
        if dtype not in self._shadows:
            self._shadows[dtype] = FSDPShadow(self.model, dtype)
        return self._shadows[dtype]


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


def sharded_policy(accelerator, model: nn.Module) -> ShardedPolicy | None:
    """The `ShardedPolicy` of an accelerate-prepared model, or None when its weights are not sharded.

    Args:
        accelerator: the trainer's `accelerate.Accelerator`.
        model: the (unwrapped) policy module, after `accelerator.prepare` (which wraps it in place).
    Raises:
        RuntimeError: the engine is FSDP2/ZeRO-3 but the model is not wrapped yet (before `train()`).
    """
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
