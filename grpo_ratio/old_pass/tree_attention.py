"""Tree attention in plain torch, for what TRL's flash-attention-3 kernel cannot run: fp32 passes and CPU.

TRL's `AsyncGRPOTrainer` packs each rank's samples into a prefix trie and attends with its `tree_fa3` attention
(`trl.experimental.async_grpo.packing.tree_attention`), which gathers every segment's root-to-segment K/V path and calls
`flash_attn_varlen_func` of the `kernels-community/flash-attn3` CUDA kernel: fp16/bf16 only. `flash_attn_varlen_func`
below has that function's signature and contract (varlen layout, bottom-right-aligned causal mask, sliding window,
softcap, GQA) in plain torch, fp32 scores, the queries in tiles (at most `SCORE_TILE_BYTES` of scores at a time, not a
segment's (H, Lq, Lk) rectangle) and one host read of the segment boundaries per forward; `torch_tree_attention`
swaps it in for TRL's kernel, and only the kernel
(TRL's own `tree_attention` still gathers the K/V). Uses: the fp32 proximal passes of `RatioAsyncGRPOTrainer`
(`OldLogprobScorer.score_packed`: a whole fp32 copy or fp32 layers on a packed row, where transformers' usual
fallback, `sdpa`, would attend across the samples of the row), and CPU tests of TRL's trainer
(`grpo_ratio.testing.async_cpu`). Tested against the unpacked forward (tests/test_async_grpo.py).
"""

from __future__ import annotations

import contextlib
import types
import weakref

import torch


# bytes of fp32 attention scores one query tile may hold, (H, tile, Lk) x 4 B: the full (H, Lq, Lk) rectangle of a
# segment was 7.9 GiB at 28 heads over a 1,024-token prompt and an 8,192-token completion
SCORE_TILE_BYTES = 256 * 2**20

# the host copy of a forward's segment boundaries, read once: every layer's attention gets the same tensors
_BOUNDS: dict[int, tuple[weakref.ref, int, list[int]]] = {}


def _host_bounds(cu_seqlens: torch.Tensor) -> list[int]:
    """`cu_seqlens.tolist()`, read from the device once per tensor (and per in-place change of it): the layers of one
    forward pass the same boundary tensors, so a forward costs one host read, not one per layer."""
    try:
        version = cu_seqlens._version
    except RuntimeError:  # an inference-mode tensor keeps no version counter: read it every time
        return cu_seqlens.tolist()
    key = id(cu_seqlens)
    ref, seen_version, bounds = _BOUNDS.get(key, (None, -1, None))
    if ref is not None and ref() is cu_seqlens and seen_version == version:
        return bounds
    for stale in [k for k, (r, _, _) in _BOUNDS.items() if r() is None]:
        del _BOUNDS[stale]
    bounds = cu_seqlens.tolist()
    _BOUNDS[key] = (weakref.ref(cu_seqlens), version, bounds)
    return bounds


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, **_) -> torch.Tensor:
    """Variable-length attention with flash-attn's `flash_attn_varlen_func` contract, one segment at a time, its
    queries in tiles: at most `SCORE_TILE_BYTES` of fp32 scores (H, tile, Lk) per tile, never a segment's whole
    (H, Lq, Lk) rectangle; grouped-query heads share their K/V head without copies of it.

    Args:
        q: (total_q, H, d) queries of all segments laid end to end.
        k, v: (total_k, H_kv, d) keys and values, H a multiple of H_kv (grouped-query attention).
        cu_seqlens_q, cu_seqlens_k: (S + 1,) int32 segment boundaries in `q` and in `k`/`v`; read to the host once
            per tensor (the layers of a forward share them).
        max_seqlen_q, max_seqlen_k: longest segment (unused: the loop reads the boundaries).
        softmax_scale: scale of q.k (default 1/sqrt(d)).
        causal: query i of a segment of Lq queries over Lk keys sees key j iff j <= i + Lk - Lq (flash-attn aligns
            the causal mask to the bottom right).
        window_size: (left, right) sliding window; -1 is unbounded.
        softcap: tanh soft-capping of the scores (0 = off).
    Returns:
        (total_q, H, d) in `q`'s dtype; scores and softmax in fp32, as the kernel accumulates.
    """
    scale = q.size(-1) ** -0.5 if softmax_scale is None else softmax_scale
    heads, kv_heads, d = q.size(1), k.size(1), q.size(2)
    groups = heads // kv_heads
    out = torch.empty_like(q)
    bounds_q, bounds_k = _host_bounds(cu_seqlens_q), _host_bounds(cu_seqlens_k)
    left, right = window_size
    for (q0, q1), (k0, k1) in zip(zip(bounds_q[:-1], bounds_q[1:]), zip(bounds_k[:-1], bounds_k[1:])):
        lq, lk = q1 - q0, k1 - k0
        ks = k[k0:k1].transpose(0, 1).float()  # (H_kv, Lk, d)
        vs = v[k0:k1].transpose(0, 1).float()  # (H_kv, Lk, d)
        j = torch.arange(lk, device=q.device)[None, :]  # (1, Lk)
        tile = max(1, SCORE_TILE_BYTES // max(1, heads * lk * 4))
        for t0 in range(0, lq, tile):
            t1 = min(t0 + tile, lq)
            # (H_kv, groups * n, d): query head h uses K/V head h // groups, as flash-attn pairs them
            qs = q[q0 + t0:q0 + t1].transpose(0, 1).float().reshape(kv_heads, groups * (t1 - t0), d)
            scores = torch.bmm(qs, ks.transpose(1, 2)).mul_(scale)  # (H_kv, groups * n, Lk)
            if softcap:
                scores = scores.div_(softcap).tanh_().mul_(softcap)
            i = torch.arange(t0, t1, device=q.device)[:, None] + (lk - lq)  # (n, 1) the queries' places among the keys
            allowed = torch.ones(t1 - t0, lk, dtype=torch.bool, device=q.device)  # (n, Lk)
            if causal:
                allowed &= j <= i
            elif right >= 0:
                allowed &= j <= i + right
            if left >= 0:
                allowed &= j >= i - left
            scores = scores.view(kv_heads, groups, t1 - t0, lk).masked_fill_(~allowed, float("-inf"))
            probs = scores.softmax(-1).view(kv_heads, groups * (t1 - t0), lk)
            del scores
            tile_out = torch.bmm(probs, vs).view(heads, t1 - t0, d)  # (H, n, d)
            out[q0 + t0:q0 + t1] = tile_out.transpose(0, 1).to(q.dtype)  # (n, H, d)
    return out


def _torch_kernel():
    """What TRL's `packing._flash_attn()` returns inside `torch_tree_attention`: the torch kernel above."""
    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def torch_tree_attention_active() -> bool:
    """Whether TRL's tree attention runs the torch kernel (inside `torch_tree_attention`) rather than the flash-attn3
    CUDA kernel."""
    from trl.experimental.async_grpo import packing

    return packing._flash_attn is _torch_kernel


@contextlib.contextmanager
def torch_tree_attention():
    """Within the block, TRL's `tree_fa3` attention calls `flash_attn_varlen_func` above instead of the flash-attn3
    kernel (`trl.experimental.async_grpo.packing._flash_attn` replaced, then restored). TRL's own `tree_attention`
    still runs around it, with its cast of the inputs to the kernel's dtype (CPU tests of TRL's trainer)."""
    from trl.experimental.async_grpo import packing

    original = packing._flash_attn
    packing._flash_attn = _torch_kernel
    try:
        yield
    finally:
        packing._flash_attn = original


def tree_attention_in_input_dtype(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                                  tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k, scaling=None,
                                  sliding_window=None, softcap=None, **kwargs):
    """TRL's `tree_attention` (the same signature, the same K/V gather along each segment's root-to-segment path) on
    `flash_attn_varlen_func` above, without TRL's cast to a flash-attention dtype: fp32 inputs are attended in fp32,
    whatever dtype the module's other weights hold (a per-layer cast, `copy_storage="per_layer"`, holds them in bf16
    until each runs). Shapes: query (1, H, N, d), key/value (1, H_kv, N, d); returns ((1, N, H, d), None)."""
    q, k, v = (x.transpose(1, 2)[0] for x in (query, key, value))  # (N, H, d), (N, H_kv, d) x 2
    out = flash_attn_varlen_func(q, k.index_select(0, tree_kv_index), v.index_select(0, tree_kv_index),
                                 tree_cu_seqlens_q, tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k,
                                 softmax_scale=scaling, causal=True,
                                 window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
                                 softcap=softcap or 0.0)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def fp32_tree_attention():
    """Within the block, the `tree_fa3` attention implementation is `tree_attention_in_input_dtype` (transformers'
    `AttentionInterface` entry replaced, then TRL's restored): the fp32 proximal passes of `RatioAsyncGRPOTrainer`."""
    from transformers import AttentionInterface
    from trl.experimental.async_grpo import packing

    AttentionInterface.register(packing.TREE_ATTENTION, tree_attention_in_input_dtype)
    try:
        yield
    finally:
        AttentionInterface.register(packing.TREE_ATTENTION, packing.tree_attention)
