"""The integer-only forward: input ids to int32 logits with integer tensors only (DetLLM's design on I-LLM's operators).

Shapes: B rows, T new tokens, S cache slots (all tokens seen, padding included), C hidden size, H query heads, G key/
value heads, D head dim, N a linear layer's outputs, V vocabulary.

Representation. An activation is an int64 tensor with a per-row power-of-two scale (value = x * 2^-k, k (..., 1)), a
row being one token (or one token's head): nothing is ever shared across rows except the static K/V cache scales, so a
row's bits cannot depend on the batch. Each GEMM input is quantized per token to int8 with a dyadic scale m / 2^k
(m < 2^15+1) taken from that token's own values; weights are int8 per output channel with dyadic scales. Rescaling is
an integer multiply and a `shift_round` (the one rounding rule, `grpo_ratio.integer.arith`).

Operators: RMSNorm fused with the per-token quantization (its gain folded into the next weights; the norm's scale is a
per-token dyadic ratio amax / (127 rms), rms an integer square root), SmoothQuant-style per-channel smoothing at every
GEMM input (a dyadic multiply, its inverse folded into the weights), RoPE from int16 tables, K and V quantized once
into the cache with static per-channel scales (keys' scales multiplied into the queries, so they cancel in the dot
product), a shift-based integer softmax giving 15-bit probabilities, probs x V as two int8 GEMMs, SiLU from the same
integer exp, and logits in fixed point 2^-16 (int32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .arith import (
    FRAC,
    ONE,
    NoFloatMode,
    clamp8,
    div_round,
    exp_neg,
    fit_ratio,
    int_mm,
    isqrt,
    normalize_rows,
    shift_round,
)


I64 = torch.int64
RES_BITS = 32  # the residual stream's precision per token
ACT_BITS = 24  # q, k, v rows after their GEMM
MLP_BITS = 18  # gate and up rows before SwiGLU
SIG_BITS = 20  # sigmoid in fixed point 2^-20
PROB_BITS = 15  # attention probabilities in [0, 2^15 - 1]
ROPE_BITS = 14  # int16 rope tables: cos, sin * 2^14
BIAS_BITS = 24  # biases in fixed point 2^-24
LOGIT_MAX = (1 << 31) - 1
ATTN_TILE = 1 << 20  # score elements per query chunk


@dataclass
class IntLinear:
    """int8 weight w (K, N) (the transpose of torch's (N, K)), per-output-channel scale m (N,) / 2^k, optional int64
    bias (N,) in fixed point 2^-BIAS_BITS."""

    w: torch.Tensor
    m: torch.Tensor
    k: int
    bias: torch.Tensor | None = None

    def __call__(self, x8: torch.Tensor, mx: torch.Tensor, kx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, ky): y (..., N) int64 with value y * 2^-ky, ky (..., 1), from x8 (..., K) int8 with per-row scale
        mx / 2^kx. |acc| <= K * 127^2 < 2^31, times m and mx (each <= 2^15) stays below 2^61."""
        y = int_mm(x8, self.w).to(I64) * self.m * mx
        ky = kx + self.k
        if self.bias is not None:
            y = y + shift_round(self.bias, BIAS_BITS - ky)
        return y, ky


@dataclass
class Smooth:
    """Per-channel smoothing of a GEMM input: x * m (C,) / 2^k (the weights carry the exact inverse)."""

    m: torch.Tensor
    k: int


@dataclass
class IntLayer:
    q: IntLinear
    k: IntLinear
    v: IntLinear
    o: IntLinear
    gate: IntLinear
    up: IntLinear
    down: IntLinear
    attn_in: Smooth
    mlp_in: Smooth
    o_in: Smooth
    down_in: Smooth
    k_mul: Smooth  # (G, D): the keys' static scale, multiplied into the queries
    k_inv: Smooth  # (G, D): its inverse, quantizing keys into the cache
    v_mul: Smooth  # (G, D): the values' static scale
    v_inv: Smooth  # (G, D): its inverse, quantizing values into the cache
    q_norm: Smooth | None = None  # Qwen3's per-head RMSNorm gains (D,), signed
    k_norm: Smooth | None = None


@dataclass
class IntModel:
    """An integer artifact (`grpo_ratio.integer.convert.convert`): int8 weights, integer scales, int16 rope tables and
    Python-int constants; `forward` is integer-only. Its tensors live on one device (`to`)."""

    embed: torch.Tensor  # (V, C) int8
    embed_m: torch.Tensor  # (V,) int64
    embed_k: torch.Tensor  # (V,) int64
    layers: list[IntLayer]
    head_in: Smooth
    head: IntLinear
    cos: torch.Tensor  # (P, D) int16
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inv_sqrt_d: tuple[int, int]
    info: dict = field(default_factory=dict)  # model type, calibration cost, bounds checked: descriptive only

    @property
    def vocab_size(self) -> int:
        return self.head.w.size(1)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def to(self, device) -> IntModel:
        """Move every tensor to `device` (in place); returns self."""
        def move(obj):
            for name, value in vars(obj).items():
                if isinstance(value, torch.Tensor):
                    setattr(obj, name, value.to(device))
                elif isinstance(value, (IntLinear, Smooth, IntLayer)):
                    move(value)
        move(self)
        for layer in self.layers:
            move(layer)
        return self

    # -----------------------------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor | None = None, cache: IntCache | None = None,
                *, logits_at: torch.Tensor | None = None, guard: bool = True) -> torch.Tensor:
        """int32 logits in fixed point 2^-16 (value = logits / 65536).

        Args:
            input_ids: (B, T) int64 new tokens, appended to `cache` when given (prefill, then one token at a time).
            valid: (B, T) bool, False on padding (left or anywhere); default all True. Padding gets no attention and
                takes no position: positions count each row's valid tokens.
            cache: an `IntCache` (`new_cache`), extended in place; None = a fresh one, dropped after the call.
            logits_at: (B, L) int64 indices into the T new tokens whose logits to return (default: all T), so a
                prefill need not build (B, T, V).
            guard: run under `NoFloatMode` (raises `FloatInForwardError` on any float tensor).

        Returns:
            (B, T, V) or (B, L, V) int32.

        Raises:
            ValueError: a position beyond the rope tables (`max_positions` at conversion).
        """
        if guard:
            with NoFloatMode():
                return self._forward(input_ids, valid, cache, logits_at)
        return self._forward(input_ids, valid, cache, logits_at)

    __call__ = forward

    def new_cache(self, batch_size: int) -> IntCache:
        return IntCache.empty(self, batch_size)

    def _forward(self, ids, valid, cache, logits_at):
        B, T = ids.shape
        ids = ids.to(self.device)
        valid = torch.ones_like(ids, dtype=torch.bool) if valid is None else valid.to(self.device)
        cache = self.new_cache(B) if cache is None else cache
        positions = cache.seen.unsqueeze(1) + valid.to(I64).cumsum(1) - 1  # (B, T)
        positions = positions.clamp(min=0)
        if int(positions.max()) >= self.cos.size(0):
            raise ValueError(f"position {int(positions.max())} is beyond the rope tables ({self.cos.size(0)} "
                             f"positions; convert with a larger max_positions)")
        cache.seen = cache.seen + valid.to(I64).sum(1)
        past = cache.valid.size(1)
        cache.valid = torch.cat([cache.valid, valid], 1)  # (B, S)
        S = cache.valid.size(1)
        causal = torch.arange(S, device=self.device)[None, :] <= (past + torch.arange(T, device=self.device))[:, None]
        mask = cache.valid[:, None, None, None, :] & causal[None, None, None]  # (B, 1, 1, T, S)
        cos = self.cos[positions].to(I64).unsqueeze(2)  # (B, T, 1, D)
        sin = self.sin[positions].to(I64).unsqueeze(2)

        h, kh = normalize_rows(self.embed[ids].to(I64) * self.embed_m[ids].unsqueeze(-1),
                               self.embed_k[ids].unsqueeze(-1), RES_BITS)
        for i, layer in enumerate(self.layers):
            h, kh = self._attention(layer, i, h, kh, cache, mask, cos, sin)
            h, kh = self._mlp(layer, h, kh)
        if logits_at is not None:
            index = logits_at.to(self.device).unsqueeze(-1)
            h, kh = h.gather(1, index.expand(-1, -1, h.size(-1))), kh.gather(1, index)
        x8, mx, kx = norm_quant(h, self.head_in)
        acc = int_mm(x8, self.head.w).to(I64) * self.head.m * mx  # (B, L, V)
        return shift_round(acc, kx + self.head.k - FRAC).clamp(-LOGIT_MAX, LOGIT_MAX).to(torch.int32)

    def _attention(self, L: IntLayer, i: int, h, kh, cache: IntCache, mask, cos, sin):
        B, T, _ = h.shape
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        x8, mx, kx = norm_quant(h, L.attn_in)
        q, kq = _heads(*L.q(x8, mx, kx), H)  # (B, T, H, D), (B, T, H, 1)
        k, kk = _heads(*L.k(x8, mx, kx), G)
        v, kv = _heads(*L.v(x8, mx, kx), G)
        if L.q_norm is not None:
            q, kq = head_norm(q, L.q_norm)
            k, kk = head_norm(k, L.k_norm)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        # K and V: quantized once, with static per-channel scales, into the cache
        k8 = clamp8(shift_round(k * L.k_inv.m, kk + L.k_inv.k)).transpose(1, 2)  # (B, G, T, D)
        v8 = clamp8(shift_round(v * L.v_inv.m, kv + L.v_inv.k)).transpose(1, 2)
        K8, V8 = cache.append(i, k8, v8)  # (B, G, S, D)
        # Q: times the keys' scales, then int8 per (token, head)
        group = H // G
        qs = q.view(B, T, G, group, D) * L.k_mul.m.view(G, 1, D)
        qs = qs.permute(0, 2, 3, 1, 4)  # (B, G, g, T, D)
        amax = qs.abs().amax(-1, keepdim=True).clamp(min=1)
        q8 = clamp8(div_round(127 * qs, amax))
        kq = kq.view(B, T, G, group, 1).permute(0, 2, 3, 1, 4)
        ms, es = fit_ratio(amax * self.inv_sqrt_d[0], 127)  # score = S * ms / 2^ks (1/sqrt(D) folded in)
        ks = es + kq + L.k_mul.k + self.inv_sqrt_d[1]
        Kt, V8g = K8.unsqueeze(2).transpose(-1, -2), V8.unsqueeze(2)  # (B, G, 1, D, S), (B, G, 1, S, D)
        # every step is per query row, so query chunks (bounding the (B, H, T, S) int64 temporaries) change no bit,
        # and a chunk's slots past its last query are causally masked (probability 0): they are left out
        chunk = max(1, ATTN_TILE // max(1, B * H * K8.size(2)))
        parts = []
        for a in range(0, T, chunk):
            end = K8.size(2) - T + min(T, a + chunk)  # slots the chunk's queries may see
            scores = int_mm(q8[..., a:a + chunk, :], Kt[..., :end]).to(I64)  # (B, G, g, t, end)
            probs = softmax15(scores, ms[..., a:a + chunk, :], ks[..., a:a + chunk, :], mask[..., a:a + chunk, :end])
            hi, lo = (probs >> 8).to(torch.int8), ((probs & 255) - 128).to(torch.int8)
            # sum_s p * v exactly, as two int8 GEMMs (p = 256 hi + lo + 128); value * 2^-15 * the v scale
            v = V8g[..., :end, :]
            parts.append((int_mm(hi, v).to(I64) << 8) + int_mm(lo, v).to(I64) + 128 * v.to(I64).sum(-2, keepdim=True))
        ctx = torch.cat(parts, 3) if len(parts) > 1 else parts[0]
        ctx = ctx.permute(0, 3, 1, 2, 4).reshape(B, T, H, D) * L.v_mul.m.repeat_interleave(group, 0)
        x8, mx, kx = quant_rows(ctx.reshape(B, T, H * D) * L.o_in.m,
                                torch.full((B, T, 1), PROB_BITS + L.v_mul.k + L.o_in.k, dtype=I64, device=h.device))
        return residual_add(h, kh, *L.o(x8, mx, kx))

    def _mlp(self, L: IntLayer, h, kh):
        x8, mx, kx = norm_quant(h, L.mlp_in)
        g, kg = normalize_rows(*L.gate(x8, mx, kx), MLP_BITS)
        u, ku = normalize_rows(*L.up(x8, mx, kx), MLP_BITS)
        y = silu(g, kg) * u * L.down_in.m
        x8, mx, kx = quant_rows(y, kg + ku + L.down_in.k)
        return residual_add(h, kh, *L.down(x8, mx, kx))


@dataclass
class IntCache:
    """The int8 K/V cache: per layer (B, G, S, D) keys and values, the (B, S) valid slots and each row's count of
    valid tokens (its next position). Values are quantized once, when written, with static scales: prefill and decode
    read the same bits."""

    keys: list
    values: list
    valid: torch.Tensor
    seen: torch.Tensor

    @classmethod
    def empty(cls, model: IntModel, batch_size: int) -> IntCache:
        n = len(model.layers)
        return cls([None] * n, [None] * n, torch.zeros(batch_size, 0, dtype=torch.bool, device=model.device),
                   torch.zeros(batch_size, dtype=I64, device=model.device))

    def append(self, i: int, k8: torch.Tensor, v8: torch.Tensor):
        self.keys[i] = k8 if self.keys[i] is None else torch.cat([self.keys[i], k8], 2)
        self.values[i] = v8 if self.values[i] is None else torch.cat([self.values[i], v8], 2)
        return self.keys[i], self.values[i]


# ---------------------------------------------------------------------------------------------------------------------
# operators


def _heads(y: torch.Tensor, ky: torch.Tensor, heads: int):
    """(B, T, heads * D) with (B, T, 1) scales -> rows per (token, head) at ACT_BITS: (B, T, heads, D), (.., 1)."""
    B, T, N = y.shape
    return normalize_rows(y.view(B, T, heads, N // heads), ky.unsqueeze(2).expand(B, T, heads, 1), ACT_BITS)


def _norm_bits(n: int) -> int:
    """Row precision for a sum of n squares below 2^62."""
    return (61 - n.bit_length()) // 2


def norm_quant(h: torch.Tensor, smooth: Smooth):
    """RMSNorm (gain folded into the next weights) + smoothing + per-token int8: (x8 (..., C) int8, m, k (..., 1)),
    x / rms(x) * smooth ~ x8 * m / 2^k. The input's own scale cancels; eps is dropped (an all-zero row stays zero)."""
    n = h.size(-1)
    hp, _ = normalize_rows(h, torch.zeros_like(h[..., :1]), _norm_bits(n))
    rms = isqrt(div_round((hp * hp).sum(-1, keepdim=True), n)).clamp(min=1)
    y = hp * smooth.m
    amax = y.abs().amax(-1, keepdim=True).clamp(min=1)
    m, e = fit_ratio(amax, 127 * rms)
    return clamp8(div_round(127 * y, amax)), m, e + smooth.k


def quant_rows(y: torch.Tensor, k: torch.Tensor):
    """Per-row int8 of y * 2^-k: (y8, m, k') with y8 * m / 2^k' ~ y * 2^-k (m from the row's own max)."""
    amax = y.abs().amax(-1, keepdim=True).clamp(min=1)
    m, e = fit_ratio(amax, 127)
    return clamp8(div_round(127 * y, amax)), m, e + k


def head_norm(x: torch.Tensor, gain: Smooth):
    """Qwen3's per-head RMSNorm over D with signed gains m / 2^k: rows (..., D) -> (y, ky) at ACT_BITS."""
    D = x.size(-1)
    xp, _ = normalize_rows(x, torch.zeros_like(x[..., :1]), _norm_bits(D))
    rms = isqrt(div_round((xp * xp).sum(-1, keepdim=True), D)).clamp(min=1)
    y = div_round((xp * gain.m) << 8, rms)
    return normalize_rows(y, torch.full_like(rms, gain.k + 8), ACT_BITS)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half pairing, as transformers' Llama/Qwen) with int16 tables in 2^-14; the row scale
    is unchanged. x (B, T, heads, D); cos, sin (B, T, 1, D) int64."""
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return shift_round(x * cos + rotated * sin, ROPE_BITS)


def softmax15(scores: torch.Tensor, m: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Integer softmax of scores * m / 2^k over the last dim, masked slots excluded (probability 0); returns int64
    probabilities in [0, 2^15 - 1] (2^-15 units). Rows with no valid slot are all 0."""
    low = torch.iinfo(I64).min // 2
    top = torch.where(mask, scores, low).amax(-1, keepdim=True)
    e = torch.where(mask, exp_neg((top - scores).clamp(min=0), m, k), 0)  # 2^-30
    total = e.sum(-1, keepdim=True).clamp(min=1)
    return div_round(e << PROB_BITS, total).clamp(max=(1 << PROB_BITS) - 1)


def silu(g: torch.Tensor, kg: torch.Tensor) -> torch.Tensor:
    """g * sigmoid(g) for g * 2^-kg, in the same scale; sigmoid from the integer exp of -|g| (the stable two-branch
    form: no row max, so each element alone). int64."""
    e = exp_neg(g.abs(), torch.full_like(kg, 1 << 14), kg + 14)  # e^-|g| in 2^-30
    one = torch.full_like(e, 1 << ONE)
    sig = div_round(torch.where(g >= 0, one, e) << SIG_BITS, one + e)
    return shift_round(g * sig, SIG_BITS)


def residual_add(h: torch.Tensor, kh: torch.Tensor, d: torch.Tensor, kd: torch.Tensor):
    """h * 2^-kh + d * 2^-kd on the coarser of the two grids, renormalized to RES_BITS per token."""
    d, kd = normalize_rows(d, kd, RES_BITS)
    k = torch.minimum(kh, kd)
    return normalize_rows(shift_round(h, kh - k) + shift_round(d, kd - k), k, RES_BITS)
