"""FSDP2 (`fully_shard`) for old-logprob scoring: reading and swapping the mixed-precision policy of a wrapped model,
the fp32 output of the training forward, the sharded fp16 copy (`FSDPShadow`) and the `ShardedPolicy` of FSDP2.

The rules these follow, and the table of what each scoring mode runs on, are in `grpo_ratio.old_pass.sharding.engines`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable

import torch
from torch import nn

from ..copies import VersionedCopy, empty_model_like, persistent_buffer_names, settle_buffers
from .base import ShardedPolicy, is_fsdp2_wrapped, output_cast


logger = logging.getLogger(__name__)


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

    Where accelerate's bf16 policy has `output_dtype=bfloat16` (the version this was written against did; accelerate
    1.16.0's `set_mixed_precision` sets only `param_dtype` and `reduce_dtype`, and then this is a no-op), TRL 1.16's
    log-probs (fp32 out of its chunked kernel) are rounded to bf16 on their way out (up to 1.5e-2 nats on a tiny
    model): the new side of every ratio, in every mode.
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
    (2 or 4) / N, plus the buffers (rotary tables), which every rank keeps whole, fp32 ones in fp32.

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
        # to_empty left the buffers uninitialised: whole on every rank, fp32 ones in fp32 (`copies.float_buffer_dtype`)
        settle_buffers(self.module, policy, dtype)
        self._persistent = persistent_buffer_names(self.module)

    def refresh_weights(self) -> None:
        reshard_all(self.source)  # parameters of reshard_after_forward=False groups are unsharded after a forward
        reshard_all(self.module)
        policy = dict(self.source.named_parameters())
        for name, dst in self.module.named_parameters():
            dst.to_local().copy_(policy[name].to_local())  # this rank's rows, cast to self.dtype
        buffers = dict(self.source.named_buffers())
        for name, dst in self.module.named_buffers():  # the persistent ones; rotary tables were settled at build
            if name in self._persistent:
                dst.copy_(buffers[name])

    def num_bytes(self) -> int:
        """Bytes this rank keeps: its local shards and the (whole) buffers."""
        local = [p.to_local() for p in self.module.parameters()] + list(self.module.buffers())
        return sum(t.numel() * t.element_size() for t in local)


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
            stack.enter_context(output_cast(module, self.compute_dtype))
        return stack

    def _shadow(self, dtype: torch.dtype):
        if dtype not in self._shadows:
            self._shadows[dtype] = FSDPShadow(self.model, dtype)
        return self._shadows[dtype]
