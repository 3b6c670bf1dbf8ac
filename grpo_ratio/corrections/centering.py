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
log p(y_t) - (c_t - sg(c_t)): the same values bit for bit (so ratios, clips and metrics are unchanged), the centred
gradient.

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

In a trainer (`score_centering`, docs/corrections.md): `centering_terms` computes c_t for every completion token of a
(B, T) batch from the logits, or from hidden states through the LM head (`kept_logprobs.HeadLogits`), K cells at a
time, each chunk recomputed in backward (`kept_logprobs.RecomputedCells`): the memory is one chunk's (K, V) tensors,
never (B, T, V). The sampler's distribution of a cell is either given as its top-k log-probs (`"top_k"`) or recomputed
from the same logits (`"exact"`: q = softmax of the detached logits / temperature, over the sampler's kept set when it
truncated), which is the sampler's own distribution where the sampler is these weights (transformers `generate` at the
first inner step; an asynchronous sample of staleness 0).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .kept_logprobs import DEFAULT_CHUNK_CELLS, HeadLogits, RecomputedCells
from .kept_sets import KeptSets


if TYPE_CHECKING:
    from .kept_sets import SamplingSettings


VARIANTS = ("exact", "top_k")  # `score_centering`: where the sampler's distribution comes from
DEFAULT_TOP_K = 20  # `score_centering_top_k` unset
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
    """log p(y_t) - (c_t - sg(c_t)): the values of `logps` bit for bit (ratios, clips and metrics unchanged), the centred score as
    their gradient. Shapes: any, `term` broadcastable to `logps` ((B, T) each in a trainer)."""
    return logps - (term - term.detach())  # term - sg(term) is exactly 0: the values of `logps`, bit for bit


def centering_source(args) -> str | None:
    """What the sampler's distribution of a run's `score_centering` is, in words, for its run record (`run.json`):
    None when off. `args`: any config with `score_centering` (and `truncation_correction`, `top_p`, `top_k`, `min_p`,
    `score_centering_top_k`, `score_centering_tail`, `trl_trainer` where it has them)."""
    kind = getattr(args, "score_centering", None)
    if kind is None:
        return None
    if kind == "top_k":
        k = getattr(args, "score_centering_top_k", None) or DEFAULT_TOP_K
        tail = getattr(args, "score_centering_tail", None) or "proportional"
        where = "vLLM's (logprobs=k)" if getattr(args, "use_vllm", False) else "the generate recording's"
        return f"top_k: {where} top {k} processed log-probs per token, {tail} tail"
    truncated = ((getattr(args, "top_p", None) or 1.0) < 1.0 or (getattr(args, "top_k", None) or 0) > 0
                 or (getattr(args, "min_p", None) or 0.0) > 0)
    if getattr(args, "trl_trainer", None) == "async_grpo":
        how = "the server's filter re-applied in vLLM's order" if truncated else "untruncated (q = p: a zero term)"
        return f"exact: recomputed from the training forward at staleness-0 terms, {how}; stale terms not centred"
    if getattr(args, "truncation_correction", "none") != "none":
        how = "over the correction's kept sets"
    else:
        how = "the sampler's filter re-applied" if truncated else "untruncated (q = p: a zero term)"
    return f"exact: recomputed from the training forward (the weights that sampled, generate), {how}"


def centering_terms(logits: torch.Tensor | HeadLogits, mask: torch.Tensor, temperature: float = 1.0, *,
                    kept: KeptSets | SamplingSettings | None = None, on_kept: bool = False,
                    topk_ids: torch.Tensor | None = None, topk_logprobs: torch.Tensor | None = None,
                    tail: str = "proportional", chunk_cells: int | None = None,
                    stats: list | None = None) -> torch.Tensor:
    """The centring term c_t of every completion token of a batch, (B, T) fp32, differentiable in the logits (or in
    the hidden states and the LM head's parameters of a `HeadLogits`); `center_logps(logps, term)` then gives the
    centred score. Without `topk_ids`: the `"exact"` variant, the sampler's distribution recomputed from these logits
    (detached; `exact_centering_term`); with them: the `"top_k"` variant (`topk_centering_term`).

    Args:
        logits (`torch.Tensor` (B, T, V), any float dtype, or `HeadLogits`): the policy's raw logits at the completion
            positions (divided by `temperature` here). A `HeadLogits` under autograd is projected K cells at a time and
            each chunk recomputed in backward (`RecomputedCells`): never a (B, T, V) tensor.
        mask (`torch.Tensor` (B, T) bool): the tokens to centre; other cells get 0.0 and no computation.
        temperature (`float`): the sampler's temperature (> 0), TRL's `temperature`.
        kept (`KeptSets` (B, T), `SamplingSettings` or None): `"exact"` only: the sampler's kept set of every cell
            (recorded), or the sampler's filter re-applied to these logits (`SamplingSettings.keep_mask`), or None
            (no truncation: q = p at these weights, the term's gradient q - p is 0).
        on_kept (`bool`): `"exact"` only: the policy's log-probs are taken over the kept sets (`renormalize`), so the
            policy side of c is log p_S too.
        topk_ids, topk_logprobs (`torch.Tensor` (B, T, k), int64 / float): `"top_k"`: the sampler's top-k token ids and
            their processed log-probs per cell (-inf for ids beyond its kept set).
        tail (`str`): `"top_k"`: one of `TAILS`.
        chunk_cells (`int`, *optional*): cells per chunk (`kept_logprobs.DEFAULT_CHUNK_CELLS`); memory K x V x 4 B a
            few times over.
        stats (`list`, *optional*): when given, one (3,) fp32 tensor per call is appended, on the device, no grad:
            the sums over the centred cells of TV(q, p) (`"top_k"`: over the top-k ids and the tail as one outcome, a
            lower bound of the full TV), of the sampler's mass off its top-k (0 for `"exact"`), and the cell count.

    Returns:
        (B, T) c_t (fp32; fp64 for fp64 logits), 0.0 outside `mask`.

    Raises:
        ValueError: shapes that disagree, temperature <= 0, an unknown `tail`, `on_kept` without `kept`, or `kept` on
            the `"top_k"` variant.

    Source: Marek & Ryabinin, "Score Centering Stabilizes Off-policy RL", arXiv 2609.20807; top-k as in SkyRL PR #2244
    and miles PR #3317 ("proportional-tail").
    """
    B, T, V = logits.shape
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"mask must be (B, T) = {(B, T)}, got {tuple(mask.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    top_k = topk_ids is not None
    if top_k:
        if tail not in TAILS:
            raise ValueError(f"tail={tail!r} is not allowed; allowed: {', '.join(TAILS)}")
        if topk_logprobs is None or topk_ids.dim() != 3 or tuple(topk_ids.shape[:2]) != (B, T) or \
                tuple(topk_logprobs.shape) != tuple(topk_ids.shape):
            raise ValueError(f"topk_ids and topk_logprobs must both be (B, T, k) with (B, T) = {(B, T)}, got "
                             f"{tuple(topk_ids.shape)} and {None if topk_logprobs is None else tuple(topk_logprobs.shape)}")
        if kept is not None or on_kept:
            raise ValueError("kept / on_kept apply to the exact variant only (top_k centres the full-vocabulary score)")
        flat_ids = topk_ids.reshape(B * T, -1).to(device=logits.device, dtype=torch.long)  # (B*T, k)
        flat_lq = topk_logprobs.reshape(B * T, -1).to(logits.device)  # (B*T, k)
    elif on_kept and kept is None:
        raise ValueError("on_kept needs the kept sets (kept=KeptSets or SamplingSettings)")
    chunk_cells = DEFAULT_CHUNK_CELLS if chunk_cells is None else chunk_cells
    cells = mask.to(logits.device).reshape(-1).nonzero().squeeze(1)  # (M,)
    chunks = list(cells.split(chunk_cells)) if cells.numel() else []

    def value(c: torch.Tensor, raw: torch.Tensor, check: bool = True) -> torch.Tensor:
        """(K,) c_t of the flat cells c (K,) from their raw logits (K, V); `check` is True in the forward only."""
        z = _up(raw) / temperature  # (K, V) fp32 (fp64 stays fp64)
        if top_k:
            ids, lq = flat_ids[c], flat_lq[c]  # (K, k)
            term = topk_centering_term(z, ids, lq, tail=tail)
            if check and stats is not None:
                with torch.no_grad():
                    q_k = torch.exp(lq.float())  # (K, k)
                    p_k = torch.softmax(z.detach(), -1).gather(1, ids)  # (K, k)
                    tail_q, tail_p = (1 - q_k.sum(-1)).clamp(min=0), (1 - p_k.sum(-1)).clamp(min=0)  # (K,)
                    tv = 0.5 * ((q_k - p_k).abs().sum(-1) + (tail_q - tail_p).abs())
                    stats.append(torch.stack([tv.sum(), tail_q.sum(), torch.tensor(float(c.numel()), device=z.device)]))
            return term
        if kept is None:
            keep = None
        elif isinstance(kept, KeptSets):
            keep = kept.dense_cells(c, z.shape[-1]).to(z.device)  # (K, V)
        else:
            keep = kept.keep_mask(raw.detach()).to(z.device)  # (K, V): the sampler's filter on these logits
        zq = z.detach() if keep is None else z.detach().masked_fill(~keep, -math.inf)  # (K, V) the sampler's
        zp = z.masked_fill(~keep, -math.inf) if on_kept else z  # (K, V) the policy's (over S under `renormalize`)
        if check and stats is not None:
            with torch.no_grad():
                tv = 0.5 * (torch.softmax(zq, -1) - torch.softmax(zp.detach(), -1)).abs().sum(-1)  # (K,)
                stats.append(torch.stack([tv.sum(), tv.new_zeros(()), torch.tensor(float(c.numel()), device=z.device)]))
        return exact_centering_term(zp, zq, tile=z.shape[-1])

    if isinstance(logits, HeadLogits) and logits.requires_grad and chunks:
        def from_hidden(c, h, *params, check):  # (K,) from the cells' hidden states (K, H) and the head's parameters
            return value(c, logits.project(h, *params), check)

        values = [RecomputedCells.apply(from_hidden, chunks, logits.flat, *logits.params)]
    elif isinstance(logits, HeadLogits):
        values = [value(c, logits.cells(c)) for c in chunks]
    else:
        values = [value(c, logits[c // T, c % T]) for c in chunks]  # (K,) each
    flat = torch.cat(values) if values else None  # (M,)
    out = torch.zeros(B * T, dtype=torch.float32 if flat is None else flat.dtype, device=logits.device)  # (B*T,)
    if flat is not None:
        out = out.index_put((cells,), flat)
    return out.reshape(B, T)
