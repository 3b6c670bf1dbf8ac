"""Fake CUDA tensors on a CPU-only build, for the device tests (tests/test_device.py, tests/test_precision.py).

`FakeTensorMode` (torch._subclasses.fake_tensor) creates `cuda:0` tensors without a GPU and checks devices as CUDA
does: `cpu0d += cuda` raises (`meta` tensors would not catch it). Two gaps of a CPU-only build are filled here, for
the duration of the block only:
- Python indexing and a few methods (`x[...]`, `x[...] = v`, `x.T`, `~x`, `x.contiguous()`, `x.nonzero()`) open a CUDA device guard before it dispatches,
  and a CPU-only build has none ("PyTorch is not linked with support for cuda devices"): these calls are routed to
  the aten ops they stand for (torch's own `applySlicing`: basic indices as views, tensor indices to `aten.index`).
- What CUDA computes only after a host sync is refused, which makes the mode a sync detector too: `.item()`,
  `int(t)`, `bool(t)`, `.tolist()` raise `DataDependentOutputException`, and ops whose output size depends on the
  data (`nonzero`, boolean-mask indexing, `repeat_interleave` without `output_size`) raise
  `DynamicOutputShapeException`. `fake_cuda(data_dependent=True)` allows the latter (sizes become symbols), for code
  that may sync but must not mix devices.

Use: `with fake_cuda(): x = torch.zeros(3, device=CUDA)`. Devices must carry an index (`cuda:0`: `"cuda"` alone asks
for the current device, which needs the missing guard).
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.overrides import TorchFunctionMode


CUDA = torch.device("cuda:0")
HOST_SYNC = (DataDependentOutputException, DynamicOutputShapeException)  # what a CUDA host sync raises here
aten = torch.ops.aten


def _apply_slicing(x: torch.Tensor, index) -> tuple[torch.Tensor, list]:
    """torch's `applySlicing`: ints, slices, None, Ellipsis and bools applied as views; tensor indices (and lists)
    collected at the dimension of the result they index, for `aten.index` / `aten.index_put_`."""
    index = index if isinstance(index, tuple) else (index,)
    index = tuple(torch.as_tensor(i, device=x.device) if isinstance(i, list) else i for i in index)

    def width(i):
        if i is None or i is Ellipsis or isinstance(i, bool):
            return 0
        return i.dim() if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) else 1

    consumed = sum(width(i) for i in index)
    out, dim, tensors = x, 0, []
    for i in index:
        if i is Ellipsis:
            skip = x.dim() - consumed
            tensors += [None] * skip
            dim += skip
        elif i is None or isinstance(i, bool):
            out = out.unsqueeze(dim)
            if i is False:
                out = aten.slice.Tensor(out, dim, 0, 0)
            tensors.append(None)
            dim += 1
        elif isinstance(i, (int, torch.SymInt)):
            out = aten.select.int(out, dim, i)
        elif isinstance(i, slice):
            out = aten.slice.Tensor(out, dim, 0 if i.start is None else i.start, i.stop, i.step or 1)
            tensors.append(None)
            dim += 1
        elif isinstance(i, torch.Tensor):
            tensors.append(i)
            dim += width(i)
        else:
            raise NotImplementedError(f"fake_cuda indexing with {type(i).__name__}")
    while tensors and tensors[-1] is None:
        tensors.pop()
    return out, tensors


def _getitem(x, index):
    out, tensors = _apply_slicing(x, index)
    if tensors:
        return aten.index.Tensor(out, tensors)
    return aten.alias.default(out) if out is x else out


def _setitem(x, index, value):
    out, tensors = _apply_slicing(x, index)
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=x.dtype, device=x.device)
    if tensors:
        aten.index_put_.default(out, tensors, value.to(x.dtype))
    else:
        aten.copy_.default(out, value)


class HostCopy(RuntimeError):
    """A CUDA tensor copied to the host inside `fake_cuda(allow_host_copies=False)` (a blocking copy: a sync)."""


class _GuardFreeIndexing(TorchFunctionMode):
    """Python indexing routed to aten ops (no CUDA device guard); copies to the host refused when asked."""

    def __init__(self, allow_host_copies: bool):
        super().__init__()
        self.allow_host_copies = allow_host_copies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.cpu, torch.Tensor.to) and not self.allow_host_copies:
            out = func(*args, **kwargs)
            if args[0].device.type == "cuda" and out.device.type == "cpu":
                raise HostCopy(f"a {tuple(args[0].shape)} CUDA tensor copied to the host")
            return out
        if func is torch.Tensor.__getitem__:
            return _getitem(*args)
        if func is torch.Tensor.__setitem__:
            return _setitem(*args)
        if func == torch.Tensor.T.__get__:  # a new method-wrapper at each attribute read
            return args[0].permute(*range(args[0].dim() - 1, -1, -1))
        if func is torch.Tensor.__invert__:
            return torch.bitwise_not(args[0])
        if func is torch.Tensor.contiguous:
            return args[0] if args[0].is_contiguous() else aten.clone.default(args[0], memory_format=torch.contiguous_format)
        return func(*args, **kwargs)


def _nonzero(self, *, as_tuple: bool = False):
    out = aten.nonzero.default(self)
    return out.unbind(1) if as_tuple else out


def _scalar(self):
    """A tensor's one value on the host: what `.item()`, `int(t)`, `bool(t)` ask (refused by the mode: a sync)."""
    return aten._local_scalar_dense.default(self)


def _values(self):
    """`.tolist()` / `.numpy()`: every value on the host (refused by the mode: a sync)."""
    return [_scalar(v) for v in self.reshape(-1).unbind(0)] if self.numel() else []


# the bindings of these open a device guard before they dispatch; replaced for the block by their aten meaning
PATCHES = {"nonzero": _nonzero, "item": _scalar, "__int__": lambda t: int(_scalar(t)),
           "__index__": lambda t: int(_scalar(t)), "__float__": lambda t: float(_scalar(t)),
           "__bool__": lambda t: bool(_scalar(t)), "tolist": _values, "numpy": _values}


@contextlib.contextmanager
def fake_cuda(data_dependent: bool = False, allow_host_copies: bool = True):
    """A `FakeTensorMode` in which `torch.zeros(..., device=CUDA)` is a fake CUDA tensor (see the module docstring).

    Args:
        data_dependent: allow ops whose output size depends on the data (symbolic sizes); `.item()` and friends
            still cannot be used in Python control flow.
        allow_host_copies: False raises `HostCopy` when a CUDA tensor is copied to the CPU (`.cpu()`, `.to(cpu)`).
    """
    # real tensors made before the block (a CPU KeptSets) take part as fake ones of their own device
    mode = FakeTensorMode(shape_env=ShapeEnv() if data_dependent else None, allow_non_fake_inputs=True)
    # the meta kernel of boolean-mask indexing calls `Tensor.nonzero` itself: a class patch, not the function mode
    saved = {name: torch.Tensor.__dict__.get(name) for name in PATCHES}
    for name, method in PATCHES.items():
        setattr(torch.Tensor, name, method)
    try:
        with mode, _GuardFreeIndexing(allow_host_copies):
            yield mode
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
