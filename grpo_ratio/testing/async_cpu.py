"""TRL's experimental `AsyncGRPOTrainer` on a CPU-only torch build, for tests only (on a GPU, TRL's code is the real
thing): `async_grpo_on_cpu` stands in for the two pieces of CUDA hardware its code asks for."""

from __future__ import annotations

import contextlib
import types

import torch

from ..old_pass.tree_attention import flash_attn_varlen_func, torch_tree_attention


# what the flash-attn3 kernel accepts (its `flash_attn_varlen_func` refuses any other dtype)
FA3_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


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


@contextlib.contextmanager
def dtype_strict_tree_kernel():
    """Within the block, TRL's `tree_fa3` attention calls a stand-in of the flash-attn3 kernel with its signature
    (`flash_attn_interface.flash_attn_varlen_func` of flash-attention's `hopper/`, which TRL loads from
    `kernels-community/flash-attn3`) and its dtype contract: q, k, v of one dtype among `FA3_DTYPES`, else
    `RuntimeError` as the kernel raises; it computes with `grpo_ratio.old_pass.tree_attention.flash_attn_varlen_func`.
    Yields the list of q dtypes the kernel was called with, in call order. What a CPU can show of a pass that would
    hand the CUDA kernel fp32 (the kernel itself needs a Hopper GPU)."""
    from trl.experimental.async_grpo import packing

    seen: list[torch.dtype] = []

    def strict_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                      seqused_k=None, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None,
                      v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                      pack_gqa=None, deterministic=False, sm_margin=0):
        seen.append(q.dtype)
        if q.dtype not in FA3_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
            raise RuntimeError(f"FlashAttention only supports fp16, bf16 and fp8_e4m3 data type (got q {q.dtype}, "
                               f"k {k.dtype}, v {v.dtype})")
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                      softcap=softcap)

    original = packing._flash_attn
    packing._flash_attn = lambda: types.SimpleNamespace(flash_attn_varlen_func=strict_varlen)
    try:
        yield seen
    finally:
        packing._flash_attn = original
