"""Score centering (Marek & Ryabinin, "Score Centering Stabilizes Off-policy RL", arXiv 2609.20807): pure functions on
logits, tiled over the vocabulary.

The policy-gradient estimator sums A_t * grad log p(y_t | s_t) over tokens y_t drawn from the sampler q, not from the
trained policy p. Under p the score has expectation zero; under q it does not: E_{y~q}[grad log p(y|s)] is the drift
term, a persistent bias between trainer and sampler that the estimator accumulates step after step. Score centering
subtracts it at each prefix s_t:

    g_t = A_t * (grad log p(y_t|s_t) - E_{y~q(.|s_t)}[grad log p(y|s_t)]),     E_{y_t~q}[g_t / A_t] = 0 exactly,

with no ratio, mask or clip (it composes with IS: the IS weight multiplies g_t). On the logits z of one position
(p = softmax(z)): grad_z log p(y) = e_y - p, the drift is E_q[e_y - p] = q - p, and the centred logit gradient is
e_y - q.

As a surrogate: the centring term c_t = sum_v sg(q_v) log p_v (minus the cross-entropy of p under q) has gradient
E_q[grad log p], so log p(y_t) - c_t has the centred score as its gradient. `center_logps` returns
log p(y_t) - c_t + sg(c_t): the same values (so ratios, clips and metrics are unchanged), the centred gradient.

Two ways to get c_t:
- `exact_centering_term`: the sampler's full next-token distribution is known (the `generate` path, where the sampler
  is the policy's own forward with its logits processors, or a recomputed distribution of the old weights). Tiled over
  V: a (N, tile) slice at a time in the forward and the backward (a custom autograd function whose backward writes
  q - p tile by tile), never a second (N, V) tensor beside the logits and their gradient.
- `topk_centering_term`: vLLM returns the sampler's top-k log-probs only (`logprobs=k`; SkyRL PR #2244 and miles PR
  #3317 do this). The k known terms plus the tail: `"proportional"` (miles' "proportional-tail" centring) takes the
  sampler's tail proportional to the policy's, q_v = p_v (1 - Q_K) / (1 - P_K) off the top-k set K, whose sum is
  sg(1 - Q_K) log(1 - P_K) (its gradient is that tail's score expectation exactly under that assumption); `"drop"`
  leaves the tail out. Either way the centred gradient differs from the exact one by at most 2 (1 - Q_K) in L1 over
  the logits (`tests/test_centering.py`), Q_K = the sampler's top-k mass.
"""

from __future__ import annotations

import torch


TAILS = ("proportional", "drop")
DEFAULT_TILE = 8192  # vocabulary columns per tile


def _up(t: torch.Tensor) -> torch.Tensor:
    """At least fp32 (fp64 stays fp64): the sums over V are taken in it."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _check(logits: torch.Tensor, other: torch.Tensor, name: str) -> None:
    if logits.dim() != 2 or other.dim() != 2 or other.size(0) != logits.size(0):
        raise ValueError(f"expected (N, V) logits and (N, ...) {name}, got {tuple(logits.shape)} and "
                         f"{tuple(other.shape)}")


def logsumexp_tiled(logits: torch.Tensor, tile: int = DEFAULT_TILE) -> torch.Tensor:
    """(N,) logsumexp (fp32, or fp64 for fp64 logits) over the last dim of (N, V) logits, a (N, tile) slice at a
    time (no grad)."""
    with torch.no_grad():
        out = torch.full((logits.size(0),), -torch.inf, dtype=_up(logits).dtype, device=logits.device)
        for start in range(0, logits.size(1), tile):
            out = torch.logaddexp(out, torch.logsumexp(_up(logits[:, start:start + tile]), dim=-1))
        return out


class _ExactCentering(torch.autograd.Function):
    """c = sum_v q_v log p_v for p = softmax(z), q = softmax(zq); grad_z = g (q - p); no grad to zq."""

    @staticmethod
    def forward(ctx, logits, sampler_logits, tile):
        lse_p = logsumexp_tiled(logits, tile)  # (N,)
        lse_q = logsumexp_tiled(sampler_logits, tile)  # (N,)
        out = torch.zeros(logits.size(0), dtype=lse_p.dtype, device=logits.device)
        for start in range(0, logits.size(1), tile):
            zq = _up(sampler_logits[:, start:start + tile])  # (N, tile)
            q = torch.exp(zq - lse_q[:, None])  # (N, tile); 0 where the sampler masked (-inf)
            log_p = _up(logits[:, start:start + tile]) - lse_p[:, None]  # (N, tile)
            out += torch.where(q > 0, q * log_p, 0.0).sum(-1)  # q = 0 contributes nothing (no 0 * -inf)
        ctx.save_for_backward(logits, sampler_logits, lse_p, lse_q)
        ctx.tile = tile
        return out

    @staticmethod
    def backward(ctx, grad):
        logits, sampler_logits, lse_p, lse_q = ctx.saved_tensors
        out = torch.empty_like(logits)
        for start in range(0, logits.size(1), ctx.tile):
            sl = slice(start, start + ctx.tile)
            q = torch.exp(_up(sampler_logits[:, sl]) - lse_q[:, None])  # (N, tile)
            p = torch.exp(_up(logits[:, sl]) - lse_p[:, None])  # (N, tile)
            out[:, sl] = (_up(grad)[:, None] * (q - p)).to(out.dtype)
        return out, None, None


def exact_centering_term(logits: torch.Tensor, sampler_logits: torch.Tensor, tile: int = DEFAULT_TILE) -> torch.Tensor:
    """c = sum_v q_v log p_v per position, with the sampler's full distribution.

    Args:
        logits (`torch.Tensor` of shape (N, V)): the policy's logits (after the same temperature as the sampler's);
            gradient flows to them (grad_z c = q - p).
        sampler_logits (`torch.Tensor` of shape (N, V)): the sampler's processed logits (temperature applied; -inf
            where top-k/top-p/min-p removed a token); no gradient.
        tile (`int`): vocabulary columns per slice.

    Returns:
        (N,) c_t (fp32; fp64 for fp64 logits). Memory: (N, tile) slices beside the inputs; the backward writes the (N, V) logit gradient.

    Raises:
        ValueError: shapes that do not match (N, V), or a tile < 1.
    """
    _check(logits, sampler_logits, "sampler_logits")
    if tuple(sampler_logits.shape) != tuple(logits.shape):
        raise ValueError(f"sampler_logits {tuple(sampler_logits.shape)} must have the logits' shape "
                         f"{tuple(logits.shape)}")
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    return _ExactCentering.apply(logits, sampler_logits.detach(), int(tile))


def topk_centering_term(logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
                        tail: str = "proportional", tile: int = DEFAULT_TILE) -> torch.Tensor:
    """c_t from the sampler's top-k log-probs only (vLLM `logprobs=k`).

    c = sum_{v in K} sg(q_v) log p_v + sg(1 - Q_K) log(1 - P_K)  (`"proportional"`), or without the tail term
    (`"drop"`); Q_K, P_K = the sampler's and the policy's mass on K.

    Args:
        logits (`torch.Tensor` of shape (N, V)): the policy's logits; gradient flows to them.
        topk_ids (`torch.Tensor` of shape (N, k), int64): the sampler's top-k token ids per position (distinct).
        topk_logprobs (`torch.Tensor` of shape (N, k)): their sampler log-probs (no gradient).
        tail (`str`): one of `TAILS`.
        tile (`int`): vocabulary columns per slice of the logsumexp.

    Returns:
        (N,) c_t (fp32; fp64 for fp64 logits).

    Raises:
        ValueError: an unknown tail (the allowed ones named), or shapes that do not match.
    """
    if tail not in TAILS:
        raise ValueError(f"tail={tail!r} is not allowed; allowed: {', '.join(TAILS)}")
    _check(logits, topk_ids, "topk_ids")
    if tuple(topk_logprobs.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_logprobs {tuple(topk_logprobs.shape)} must have topk_ids' shape "
                         f"{tuple(topk_ids.shape)}")
    lse = logsumexp_tiled(logits, tile)  # (N,) no grad: its gradient is added below through the gathered logits
    z_k = _up(logits.gather(1, topk_ids))  # (N, k) with grad
    # log p_v = z_v - lse(z): lse's gradient is p (all of V); sum_{v in K} q_v d(-lse) = -Q_K p, which the trick
    # below reproduces without a (N, V) softmax: log p_v = z_v - lse_st, lse_st's gradient flowing through the full
    # logits via a tiled straight-through function
    lse_st = _LogSumExp.apply(logits, lse, tile)  # (N,) value lse, grad_z = p
    q = torch.exp(_up(topk_logprobs.detach()))  # (N, k)
    log_p_k = z_k - lse_st[:, None]  # (N, k)
    out = (q * log_p_k).sum(-1)  # (N,)
    if tail == "proportional":
        tail_q = (1.0 - q.sum(-1)).clamp(min=0.0)  # (N,)
        p_k = torch.exp(log_p_k).sum(-1).clamp(max=1.0 - 1e-12)  # (N,)
        out = out + tail_q * torch.log1p(-p_k)
    return out


class _LogSumExp(torch.autograd.Function):
    """logsumexp over (N, V) with a precomputed value; the backward writes g * softmax(z) tile by tile."""

    @staticmethod
    def forward(ctx, logits, lse, tile):
        ctx.save_for_backward(logits, lse)
        ctx.tile = tile
        return lse.clone()

    @staticmethod
    def backward(ctx, grad):
        logits, lse = ctx.saved_tensors
        out = torch.empty_like(logits)
        for start in range(0, logits.size(1), ctx.tile):
            sl = slice(start, start + ctx.tile)
            out[:, sl] = (_up(grad)[:, None] * torch.exp(_up(logits[:, sl]) - lse[:, None])).to(out.dtype)
        return out, None, None


def center_logps(logps: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    """log p(y_t) - c_t + sg(c_t): the values of `logps` (ratios, clips and metrics unchanged), the centred score as
    their gradient. Shapes: any, `term` broadcastable to `logps` ((B, T) each in a trainer)."""
    return logps - term + term.detach()
