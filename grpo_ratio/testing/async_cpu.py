"""TRL's experimental `AsyncGRPOTrainer` on a CPU-only torch build, for tests only (on a GPU, TRL's code is the real
thing): `async_grpo_on_cpu` stands in for the two pieces of CUDA hardware its code asks for."""

from __future__ import annotations

import contextlib

from ..old_pass.tree_attention import torch_tree_attention


@contextlib.contextmanager
def async_grpo_on_cpu():
    """Within the block: TRL's `tree_fa3` attention runs `grpo_ratio.old_pass.tree_attention.flash_attn_varlen_func`
    (the flash-attn3 kernel's signature and contract, in torch) instead of the CUDA kernel, and the trainer's MFU
    set-up, which asks `torch.cuda.get_device_name` at `__init__` (an error without CUDA), gets `None` on a CPU device
    ("peak FLOPs unknown": TRL then logs no MFU). Both are restored after the block."""
    from trl.experimental.async_grpo import async_grpo_trainer

    original = async_grpo_trainer.get_peak_flops_per_device

    def peak_flops(accelerator, dtype):
        return None if accelerator.device.type == "cpu" else original(accelerator, dtype)

    async_grpo_trainer.get_peak_flops_per_device = peak_flops
    try:
        with torch_tree_attention():
            yield
    finally:
        async_grpo_trainer.get_peak_flops_per_device = original
