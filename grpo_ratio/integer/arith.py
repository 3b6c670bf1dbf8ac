"""Integer arithmetic of the integer forward: one rounding rule, dyadic ratios, shift-based exp and log, the integer
GEMM (the only operation that dispatches per device) and the float guard.

Every function takes and returns integer tensors (int8 .. int64); none creates a floating tensor, which
`NoFloatMode` checks. The one rounding rule is round to nearest, ties away from zero: `shift_round(x, s)` =
sign(x) * ((|x| + 2^(s-1)) >> s) and `div_round(a, b)` = sign(a) * ((|a| + b // 2) // b), b > 0.

Sources: the integer operators follow I-LLM (Hu et al., "I-LLM: Efficient Integer-Only Inference for Fully-Quantized
Low-Bit Large Language Models", arXiv 2405.17849: dyadic scales m / 2^k, shift-based exp) and DetLLM (N. Barry,
"Eliminating Nondeterminism in LLM Inference with Integer-Only Arithmetic", 2026: one backend-divergent GEMM, a
TorchDispatchMode float guard). Where this module differs (a quartic for 2^-f instead of I-LLM's linear one) is said
in docs/integer.md.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


I64 = torch.int64
ONE = 30  # fixed point of exp outputs: 1.0 = 2^30
FRAC = 16  # fractional bits of exponents in log2 units, and of log-probs / logits
# 2^g on [0, 1] as a quartic in fixed point 2^-30 (least squares on Chebyshev nodes; max relative error 3.6e-6)
EXP2_POLY = (14693079, 55531593, 259438748, 744070464, 1073745679)
LOG2E = (23637, 14)  # log2(e) ~ 23637 / 2^14 (relative error 4.9e-6)
LN2 = (22713, 15)  # ln(2) ~ 22713 / 2^15 (relative error 2.1e-6)


class FloatInForwardError(RuntimeError):
    """A floating-point tensor was consumed or produced inside the integer forward."""


class NoFloatMode(TorchDispatchMode):
    """Raise `FloatInForwardError` on any aten op that reads or returns a floating tensor (DetLLM's float guard).

    Every tensor operation dispatches through this mode while it is active, so a `.float()`, a float constant
    tensor or a float kernel anywhere inside the forward is an error naming the op."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                raise FloatInForwardError(f"integer forward: {func} read a {t.dtype} tensor")
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                raise FloatInForwardError(f"integer forward: {func} produced a {t.dtype} tensor")
        return out


def _as_shift(s, like: torch.Tensor) -> torch.Tensor:
    return s.to(I64) if isinstance(s, torch.Tensor) else torch.full((), int(s), dtype=I64, device=like.device)


def shift_round(x: torch.Tensor, s) -> torch.Tensor:
    """x * 2^-s rounded to nearest, ties away from zero (s > 0); x * 2^-s exactly (s <= 0). int64.

    Args:
        x: an integer tensor; s: an int or an integer tensor broadcastable to x (signed shift amounts).
    """
    x = x.to(I64)
    if not isinstance(s, torch.Tensor):
        if s <= 0:
            return x << -s
        s = min(s, 62)  # the same result for every |x| < 2^61 (0); shifts >= 64 are undefined in C++
        mag = (x.abs() + (1 << (s - 1))) >> s
        return torch.where(x < 0, -mag, mag)
    s = s.to(I64)
    down, up = s.clamp(min=0, max=62), (-s).clamp(min=0)
    half = torch.where(down > 0, torch.ones_like(down) << (down - 1).clamp(min=0), torch.zeros_like(down))
    mag = ((x.abs() + half) >> down) << up
    return torch.where(x < 0, -mag, mag)


def div_round(a: torch.Tensor, b) -> torch.Tensor:
    """a / b rounded to nearest, ties away from zero; b > 0 (an int or a broadcastable integer tensor). int64."""
    a = a.to(I64)
    b = b.to(I64) if isinstance(b, torch.Tensor) else int(b)
    mag = torch.div(a.abs() + b // 2, b, rounding_mode="floor")
    return torch.where(a < 0, -mag, mag)


def ilog2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2(x)) of int64 x >= 1 (the position of the highest set bit); 0 where x < 1."""
    v = x.to(I64).clamp(min=1)
    r = torch.zeros_like(v)
    for s in (32, 16, 8, 4, 2, 1):
        hit = (v >> s) > 0
        r = r + torch.where(hit, s, 0)
        v = torch.where(hit, v >> s, v)
    return r


def isqrt(x: torch.Tensor) -> torch.Tensor:
    """floor(sqrt(x)) of int64 x >= 0, digit by digit (exact over the whole non-negative int64 range)."""
    rem = x.to(I64).clamp(min=0)
    res = torch.zeros_like(rem)
    bit = 1 << 62
    for _ in range(32):
        t = res + bit
        ge = rem >= t
        rem = torch.where(ge, rem - t, rem)
        res = torch.where(ge, (res >> 1) + bit, res >> 1)
        bit >>= 2
    return res


def fit_ratio(num: torch.Tensor, den, bits: int = 15) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, e), int64, with m / 2^e ~ num / den and 2^(bits-1) <= m <= 2^bits (one rounding; relative error
    <= 2^-bits). num >= 1 and den >= 1, broadcastable (den may be an int)."""
    num = num.to(I64).clamp(min=1)
    den = (den.to(I64) if isinstance(den, torch.Tensor) else torch.full((), int(den), dtype=I64,
                                                                         device=num.device)).clamp(min=1)
    e = (bits - 1) - (ilog2(num) - ilog2(den))

    def at(e):
        return div_round(num << e.clamp(min=0), den << (-e).clamp(min=0))

    m = at(e)
    low = m < (1 << (bits - 1))
    e = torch.where(low, e + 1, e)
    m = torch.where(low, at(e), m)
    return m, e


def normalize_rows(x: torch.Tensor, k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale each row (last dim) so its largest magnitude has `bits` bits: (x', k') with x' * 2^-k' ~ x * 2^-k.

    Up-shifts are exact, down-shifts round; all-zero rows are left as they are. x: (..., C) int; k: (..., 1) int64."""
    x = x.to(I64)
    top = ilog2(x.abs().amax(dim=-1, keepdim=True)) + 1  # bit length of the row's max
    s = torch.where(x.abs().amax(dim=-1, keepdim=True) > 0, top - bits, torch.zeros_like(top))
    return shift_round(x, s), k.to(I64) - s


def shift_round_nonneg(x: torch.Tensor, s) -> torch.Tensor:
    """`shift_round` for x >= 0 (the same rule, without the sign handling): (x + 2^(s-1)) >> s, or x << -s. int64."""
    s = _as_shift(s, x)
    down, up = s.clamp(min=0, max=62), (-s).clamp(min=0)
    return ((x.to(I64) << up) + ((torch.ones_like(down) << down) >> 1)) >> down


def exp2_neg(z: torch.Tensor) -> torch.Tensor:
    """2^-(z / 2^FRAC) in fixed point 2^-ONE, for int64 z >= 0: the integer part a shift, the fraction a quartic
    (2^-f = 2^(1-f) / 2, whose polynomial has positive coefficients, so every intermediate is non-negative).

    Returns int64 in [0, 2^ONE]; exactly 0 once z / 2^FRAC > 61."""
    z = z.to(I64).clamp(min=0)
    q, g = z >> FRAC, (1 << FRAC) - (z & ((1 << FRAC) - 1))  # g = 1 - f in (0, 1], 2^-FRAC units
    acc = torch.full_like(g, EXP2_POLY[0])
    for c in EXP2_POLY[1:]:
        acc = ((acc * g + (1 << (FRAC - 1))) >> FRAC) + c  # 2^g in 2^-ONE, in [2^30, 2^31]
    s = q + 1
    return torch.where(s > 62, torch.zeros_like(acc), shift_round_nonneg(acc, s.clamp(max=62)))


def exp_neg(d: torch.Tensor, m: torch.Tensor, k) -> torch.Tensor:
    """e^-(d * m / 2^k) in fixed point 2^-ONE, for d >= 0 (a distance below a row's max, in raw units) and a
    per-row dyadic scale m / 2^k (m < 2^16). Shift-based as I-LLM's DI-Exp: the exponent is turned into log2 units
    by the dyadic log2(e), then `exp2_neg`. int64, same shape as d."""
    mm = shift_round(m.to(I64) * LOG2E[0], 15)  # m * log2(e) * 2^(15 - LOG2E[1]), one 16-bit mantissa
    z = shift_round_nonneg(d.to(I64) * mm, _as_shift(k, d) + LOG2E[1] - 15 - FRAC)
    return exp2_neg(z)


def log2_fixed(x: torch.Tensor) -> torch.Tensor:
    """log2(x) in fixed point 2^-FRAC for int64 x >= 1: the integer part from the highest bit, FRAC fraction bits by
    repeated squaring (each bit truncated). int64."""
    x = x.to(I64).clamp(min=1)
    n = ilog2(x)
    y = shift_round(x, n - ONE)  # in [2^30, 2^31]
    over = y >= (1 << (ONE + 1))
    y, n = torch.where(over, y >> 1, y), n + over.to(I64)
    out = n << FRAC
    for i in range(FRAC - 1, -1, -1):
        y = (y * y) >> ONE
        hit = y >= (1 << (ONE + 1))
        out = out + torch.where(hit, 1 << i, 0)
        y = torch.where(hit, y >> 1, y)
    return out


def ln_fixed(x: torch.Tensor) -> torch.Tensor:
    """ln(x) in fixed point 2^-FRAC for int64 x >= 1 (`log2_fixed` times the dyadic ln 2). int64."""
    return shift_round(log2_fixed(x) * LN2[0], LN2[1])


# ---------------------------------------------------------------------------------------------------------------------
# the GEMM: the one operation whose kernel differs per device


def _pad_to(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    extra = size - x.size(dim)
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int8 x int8 -> int32 matrix product of a (..., M, K) and b (K, N) or (..., K, N) (broadcast batch).

    On CPU an int32 `torch.matmul` (integer accumulation: exact, in any order, while |sum| < 2^31, which the
    converter checks: K * 127 * 127 < 2^31); on CUDA `torch._int_mm` (cuBLASLt int8 -> int32) per matrix, operands
    zero-padded to its shape rules (M > 16, K and N multiples of 8), which adds exact zeros.

    Raises:
        TypeError: an operand is not int8.
    """
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int_mm takes int8 operands, got {a.dtype} and {b.dtype}")
    if a.device.type != "cuda":
        return torch.matmul(a.to(torch.int32), b.to(torch.int32))
    M, K = a.shape[-2:]
    N = b.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, M, K).reshape(-1, M, K)
    b = b.expand(*batch, K, N).reshape(-1, K, N)
    Mp, Kp, Np = max(M, 17), -(-K // 8) * 8, max(-(-N // 8) * 8, 16)
    a = _pad_to(_pad_to(a, 1, Mp), 2, Kp)
    b = _pad_to(_pad_to(b, 1, Kp), 2, Np)
    out = torch.stack([torch._int_mm(a[i].contiguous(), b[i].contiguous()) for i in range(a.size(0))])
    return out[:, :M, :N].reshape(*batch, M, N)


def clamp8(x: torch.Tensor) -> torch.Tensor:
    """Saturate to [-127, 127] and cast to int8 (symmetric: -128 is never used)."""
    return x.clamp(-127, 127).to(torch.int8)
