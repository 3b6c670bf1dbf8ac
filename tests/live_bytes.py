"""`LiveBytes`: the most bytes of storages created inside a block that were alive at once (a CPU stand-in for
`torch.cuda.max_memory_allocated` minus what was allocated before the block), for memory budgets in tests.

Every storage an op creates inside the block (outputs that alias an input, views and `out=` writes, are not
allocations) is counted from its creation until it is freed (a finalizer on the storage object, which torch keeps
one-to-one with the storage), so the peak sees what is held at once, not only the largest single tensor
(tests/test_memory.py `Largest`).
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Attributes: `peak` (bytes), `live` (bytes still alive of those created in the block), `count` (storages)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.count = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in inputs:
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._seen or storage.nbytes() == 0:
                continue
            self._seen.add(key)
            self.count += 1
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out
