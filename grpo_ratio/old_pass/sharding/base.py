"""What every sharded back-end shares: `ShardedPolicy` (the scorer's view of a sharded policy), whether a model is
FSDP2-wrapped or ZeRO-3-partitioned, calling a sharded root through its class forward, casting a module's output.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

from ..copies import VersionedCopy


def is_fsdp2_wrapped(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def is_zero3_partitioned(model: nn.Module) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


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
def output_cast(module: nn.Module, dtype: torch.dtype):
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
