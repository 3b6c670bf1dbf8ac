"""The truncated-sampling correction math on logits: pure tensor functions, no model, no trainer.

With top_p / top_k / min_p the sampler draws token g from the distribution renormalised over the kept set S of that
step (`grpo_ratio.corrections.kept_sets.KeptSets`), q(g) = p(g) / M_S with kept mass M_S = sum_{v in S} p(v), while the trainer
scores g over the full vocabulary. The importance ratio old/sampler then carries the factor M_S for an unchanged
policy: at top_p=0.8 on Qwen2.5-1.5B-Instruct it averages 0.896 and leaves [0.9, 1.1] for 51.8% of tokens (the
batch-logprob-gap report, "The other term in the ratio"; trl#6789). The two corrections of docs/truncation.md, one
implementation each:

1. `renormalize` (DeepSeek-V3.2 "Keep Sampling Mask", arXiv 2512.02556): trainer log-probs over S,
   `kept_set_logprobs`.
2. `lift_sampler` (trl#6789, TRL PR #7269; verl `support_size_replay`): sampler log-probs + log M_S,
   `lift_sampler_logprobs`.

The kept mass has one implementation, the one the trainer uses: log M_S = log p(g) - log p_S(g), the full-vocabulary
log-prob minus `kept_set_logprobs` of the same token (`KeptLogprobs.log_mass`). With the sampler's
`repetition_penalty` re-applied to the logits first (`grpo_ratio.corrections.processors.RepetitionPenalty`), p_S is the sampler's
processed distribution over S and log M = log p(g) - log q_S(g) carries the penalty's factor as well as the kept
mass: the whole factor between the trainer's full-vocabulary probability and the sampler's. How the trainer applies the
corrections is `grpo_ratio.old_pass.kept_head`.

Shapes: N or B = sequences (rows), T = completion tokens (generation steps), V = vocabulary, K = cells in a chunk.
A "cell" is one (row, position) pair; cells are numbered row-major, `row * T + position`. All log-probs are
natural-log fp32. Every function takes raw logits and divides by `temperature` itself (pass `temperature=1.0` for
logits that TRL has already divided in place).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .kept_sets import KeptSets, offsets_from_sizes


if TYPE_CHECKING:
    from .kept_sets import SamplingSettings
    from .processors import RepetitionPenalty


DEFAULT_CHUNK_CELLS = 1024  # fp32 working set per chunk: K * V * 4 B, 622 MB at V = 151,936 (Qwen2.5)


def _check_inputs(logits: torch.Tensor, kept_sizes: torch.Tensor, temperature: float, mask) -> torch.Tensor:
    """Validate shapes and temperature; return the (B, T) bool mask of cells to compute."""
    if logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits must be a (B, T, V) float tensor, got {tuple(logits.shape)} {logits.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if tuple(kept_sizes.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"kept sets cover (N, T) = {tuple(kept_sizes.shape)} but logits are (B, T) = "
                         f"{tuple(logits.shape[:2])}; select the micro-batch rows with KeptSets.select_rows and match "
                         f"T with KeptSets.resize_steps")
    if mask is None:
        return torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)
    if tuple(mask.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"mask must be (B, T) = {tuple(logits.shape[:2])}, got {tuple(mask.shape)}")
    return mask.to(device=logits.device, dtype=torch.bool)


def _chunks(mask: torch.Tensor, chunk_cells: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All valid flat cells (M,) int64 and their split into chunks of at most `chunk_cells`."""
    if chunk_cells < 1:
        raise ValueError(f"chunk_cells must be >= 1, got {chunk_cells}")
    cells = mask.reshape(-1).nonzero().squeeze(1)  # (M,)
    return cells, list(cells.split(chunk_cells)) if cells.numel() else []  # split() of nothing gives one empty chunk


def _raw(logits: torch.Tensor, cells: torch.Tensor, penalty: RepetitionPenalty | None = None) -> torch.Tensor:
    """fp32 logits (K, V) of the flat cells `cells` (K,), with the sampler's repetition penalty applied when given
    (before temperature, as generate and vLLM apply it); only this chunk is converted."""
    T = logits.shape[1]
    z = logits[cells // T, cells % T].float()  # (K, V) a fresh copy
    return z if penalty is None else penalty(z, cells, T)


def _scaled(logits: torch.Tensor, cells: torch.Tensor, temperature: float,
            penalty: RepetitionPenalty | None = None) -> torch.Tensor:
    """fp32 (penalised) logits / temperature of the flat cells `cells` (K,) -> (K, V)."""
    z = _raw(logits, cells, penalty)  # (K, V) a fresh tensor: safe to divide in place
    return z.div_(temperature) if temperature != 1.0 else z


def _scatter(cells: torch.Tensor, values: list[torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    """(B, T) fp32 zeros with `values` (concatenated, (M,)) at the flat `cells` (M,); differentiable.

    Always a function of `logits` when they require grad, also with no valid cell (every completion masked: TRL's
    `mask_truncated_completions` on an all-truncated batch): the loss is then 0 with a zero gradient that reaches
    every parameter, as TRL's own full-vocabulary log-probs give, instead of a tensor without `grad_fn` (backward
    raised "element 0 of tensors does not require grad"; DDP/ZeRO would also miss every parameter's gradient)."""
    B, T = logits.shape[:2]
    out = torch.zeros(B * T, dtype=torch.float32, device=logits.device)  # (B*T,)
    if values:
        return out.index_put((cells,), torch.cat(values)).reshape(B, T)
    if logits.requires_grad and logits.numel():
        never = torch.zeros(1, dtype=torch.bool, device=logits.device)
        out = out + logits.reshape(-1)[:1].float().where(never, 0.0)  # (B*T,) value 0, gradient 0 (finite or not)
    return out.reshape(B, T)


def _empty_cell_error(kept_sizes: torch.Tensor, cells: torch.Tensor, T: int) -> None:
    sizes = kept_sizes.reshape(-1)[cells.to(kept_sizes.device)]  # (K,)
    if bool((sizes <= 0).any()):
        c = int(cells[(sizes <= 0).nonzero()[0, 0].to(cells.device)])
        raise ValueError(f"no kept set at row {c // T}, position {c % T} (size 0) although the mask marks it as a "
                         f"completion token; pass the completion mask, or record/return the sampling mask for it")


def _lse_top_prefix(z: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """log of the summed exp of the top-|S| entries of each row of z (K, V), sizes (K,) >= 1 (verl support-size)."""
    sizes = sizes.clamp(max=z.shape[-1])  # (K,) a set cannot exceed the vocabulary
    top = z.topk(int(sizes.max()), dim=-1).values  # (K, k) descending
    return torch.logcumsumexp(top, dim=-1).gather(1, (sizes.long() - 1)[:, None].to(z.device)).squeeze(1)  # (K,)


def kept_set_logprobs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    kept: KeptSets,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk_cells: int = DEFAULT_CHUNK_CELLS,
    penalty: RepetitionPenalty | None = None,
) -> torch.Tensor:
    """Log-probs of `tokens` renormalised over the kept sets: log p_S(g) = z_g - logsumexp_{v in S} z_v, z = logits/T
    (z = penalised logits / T with the sampler's `repetition_penalty`: the sampler's own processed distribution).

    The `renormalize` correction (the batch-logprob-gap README; DeepSeek-V3.2 "Keep Sampling Mask", arXiv
    2512.02556): used for
    both old and new log-probs, it puts the trainer on the sampler's support. Differentiable (new log-probs); a
    token's gradient reaches only the logits in its kept set. A kept set of size 1 gives 0.0.

    Args:
        logits (`torch.Tensor`, (B, T, V), any float dtype): trainer logits at the completion positions.
        tokens (`torch.Tensor`, (B, T) int): sampled token ids.
        kept (`KeptSets`, (B, T)): kept sets of the same rows and positions. With `support_size_only` the set is the
            trainer's own top-|S| (a token outside it is not an error then: support-size replay cannot tell).
        temperature (`float`): sampling temperature (> 0); 1.0 when the logits are already divided.
        mask (`torch.Tensor`, (B, T) bool, *optional*): completion tokens; other cells are not computed and give 0.0.
        chunk_cells (`int`): cells per fp32 chunk (memory K x V x 4 B; the (B, T, V) fp32 tensor is never built).
        penalty (`grpo_ratio.corrections.processors.RepetitionPenalty`, *optional*): the sampler's repetition penalty over the same
            rows, re-applied to the logits before temperature and the kept set (differentiable).

    Returns:
        (B, T) fp32 log-probs (<= 0), 0.0 outside `mask`.

    Raises:
        ValueError: shapes disagree, temperature <= 0, a masked-in cell has no kept set, or a sampled token is outside
            its kept set ("inconsistent rollout", naming row and position).
    """
    valid = _check_inputs(logits, kept.sizes, temperature, mask)
    if tuple(tokens.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"tokens must be (B, T) = {tuple(logits.shape[:2])}, got {tuple(tokens.shape)}")
    T = logits.shape[1]
    cells, chunks = _chunks(valid, chunk_cells)
    flat_tokens = tokens.reshape(-1).to(logits.device)  # (B*T,)
    values = []
    for c in chunks:
        _empty_cell_error(kept.sizes, c, T)
        z = _scaled(logits, c, temperature, penalty)  # (K, V)
        g = flat_tokens[c][:, None]  # (K, 1)
        if kept.support_size_only:
            lse = _lse_top_prefix(z, kept.sizes.reshape(-1)[c.to(kept.sizes.device)])  # (K,)
        else:
            keep = kept.dense_cells(c, z.shape[-1]).to(z.device)  # (K, V)
            _inconsistent_rollout_error(keep, g, c, T)
            lse = torch.logsumexp(z.masked_fill(~keep, -math.inf), dim=-1)  # (K,)
        values.append(z.gather(1, g).squeeze(1) - lse)  # (K,)
    return _scatter(cells, values, logits)


def _inconsistent_rollout_error(keep: torch.Tensor, g: torch.Tensor, cells: torch.Tensor, T: int) -> None:
    """Raise when a sampled token g (K, 1) is outside its kept set keep (K, V)."""
    inside = keep.gather(1, g).squeeze(1)  # (K,)
    if not bool(inside.all()):
        k = int((~inside).nonzero()[0, 0])
        c = int(cells[k])
        raise ValueError(f"inconsistent rollout: sampled token {int(g[k, 0])} at row {c // T}, position {c % T} is not "
                         f"in its kept set (size {int(keep[k].sum())}); the kept sets do not belong to these "
                         f"completions (row order, padding side or step offset differ)")


def is_top_prefix(
    logits: torch.Tensor,
    kept: KeptSets,
    mask: torch.Tensor | None = None,
    chunk_cells: int = DEFAULT_CHUNK_CELLS,
) -> torch.Tensor:
    """Whether each kept set is a top-|S| prefix of `logits`: min over S >= max over the rest (ties count as prefix).

    When True everywhere, `support_size_only` replay gives the same kept mass as the explicit sets. Temperature does
    not change the order, so it is not an argument.

    Args:
        logits (`torch.Tensor`, (B, T, V)), kept (`KeptSets` with ids, (B, T)), mask (`torch.Tensor`, (B, T) bool,
        *optional*), chunk_cells (`int`).

    Returns:
        (B, T) bool; True outside `mask` and for empty cells (nothing to check).

    Raises:
        ValueError: shapes disagree, or `kept` is support_size_only.
    """
    kept._need_ids("is_top_prefix")
    valid = _check_inputs(logits, kept.sizes, 1.0, mask) & (kept.sizes > 0).to(logits.device)
    out = torch.ones(logits.shape[0] * logits.shape[1], dtype=torch.bool, device=logits.device)  # (B*T,)
    _, chunks = _chunks(valid, chunk_cells)
    for c in chunks:
        z = _scaled(logits, c, 1.0)  # (K, V)
        keep = kept.dense_cells(c, z.shape[-1]).to(z.device)  # (K, V)
        low_in = z.masked_fill(~keep, math.inf).amin(-1)  # (K,)
        high_out = z.masked_fill(keep, -math.inf).amax(-1)  # (K,)
        out[c] = low_in >= high_out
    return out.reshape(logits.shape[:2])


def lift_sampler_logprobs(sampler_logps: torch.Tensor, log_kept_mass: torch.Tensor) -> torch.Tensor:
    """The `lift_sampler` correction: sampler log-probs + log kept mass, (B, T) fp32.

    log q(g) + log M_S puts the sampler's kept-set-normalised log-prob on the trainer's full-vocabulary support, so the
    importance ratio old/sampler no longer carries M_S (trl#6789, TRL PR #7269; verl support_size_replay.patch,
    `rollout_logp += log_kept_mass`). log M_S comes from the trainer's old pass: full-vocabulary minus kept-set
    log-probs of the sampled token (`KeptLogprobs.log_mass`).

    Args:
        sampler_logps (`torch.Tensor`, (B, T)): log q(g) from vLLM (processed_logprobs) or `SamplerLogprobRecorder`.
        log_kept_mass (`torch.Tensor`, (B, T)): log M_S of the old policy (0.0 on padding).

    Raises:
        ValueError: the shapes differ.
    """
    if sampler_logps.shape != log_kept_mass.shape:
        raise ValueError(f"sampler_logps {tuple(sampler_logps.shape)} and log_kept_mass "
                         f"{tuple(log_kept_mass.shape)} must have the same (B, T) shape")
    return sampler_logps.float() + log_kept_mass.float()


def recompute_kept_sets(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    sampling: SamplingSettings,
    mask: torch.Tensor | None = None,
    chunk_cells: int = DEFAULT_CHUNK_CELLS,
    penalty: RepetitionPenalty | None = None,
) -> tuple[KeptSets, torch.Tensor]:
    """Kept sets of every masked-in cell recomputed from `logits` by the sampler's truncation (`sampling.keep_mask`,
    transformers' own warpers; the "recompute" kept-set source, NeMo-RL's approach); a sampled token the filter drops
    (the trainer's logits put it just outside the set the sampler kept) is added to its set, and reported.

    Args:
        logits (`torch.Tensor`, (B, T, V), any float dtype): the old policy's raw logits at the completion positions.
        tokens (`torch.Tensor`, (B, T) int): sampled token ids.
        sampling (`grpo_ratio.sampler.generate.SamplingSettings`): the sampler's temperature / top_k / top_p / min_p.
        mask (`torch.Tensor`, (B, T) bool, *optional*): completion tokens; other cells get empty sets.
        chunk_cells (`int`): cells per fp32 chunk (memory K x V x 4 B).
        penalty (`grpo_ratio.corrections.processors.RepetitionPenalty`, *optional*): the sampler's repetition penalty, applied
            before the truncation (generate's and vLLM's order).

    Returns:
        (`KeptSets` (B, T), `torch.Tensor` (B, T) bool: cells whose sampled token was outside and was added).

    Raises:
        ValueError: shapes disagree.
    """
    valid = _check_inputs(logits, torch.zeros(logits.shape[:2], dtype=torch.int32), 1.0, mask)
    if tuple(tokens.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"tokens must be (B, T) = {tuple(logits.shape[:2])}, got {tuple(tokens.shape)}")
    B, T = logits.shape[:2]
    sizes = torch.zeros(B * T, dtype=torch.int32)  # (B*T,)
    added = torch.zeros(B * T, dtype=torch.bool)  # (B*T,)
    ids = []
    cells, chunks = _chunks(valid, chunk_cells)
    flat_tokens = tokens.reshape(-1).to(logits.device)  # (B*T,)
    for c in chunks:  # ascending cells: the ids come out row-major, as CSR needs
        keep = sampling.keep_mask(_raw(logits, c, penalty))  # (K, V)
        g = flat_tokens[c][:, None]  # (K, 1)
        outside = ~keep.gather(1, g).squeeze(1)  # (K,)
        keep.scatter_(1, g, True)
        sizes[c.cpu()] = keep.sum(-1, dtype=torch.int32).cpu()
        added[c.cpu()] = outside.cpu()
        ids.append(keep.nonzero()[:, 1].to(torch.int32).cpu())  # (nnz_chunk,) row-major, ascending ids
    sizes = sizes.reshape(B, T)
    flat_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
    return KeptSets(sizes, flat_ids, offsets_from_sizes(sizes)), added.reshape(B, T)


@dataclass
class KeptLogprobs:
    """Log-probs over the kept sets, and the sets they were taken over.

    Fields:
        logps (`torch.Tensor`, (B, T) fp32): log p_S(g), 0.0 outside the mask.
        kept (`KeptSets`, (B, T)): the sets used (given, or recomputed).
        added (`torch.Tensor | None`, (B, T) bool): recomputed sets only: cells whose sampled token the filter
            dropped and that were added back.
        log_mass (`torch.Tensor | None`, (B, T) fp32): log M = full-vocabulary log-prob - `logps`, detached, where
            the caller has the full-vocabulary log-probs of the same forward.
    """

    logps: torch.Tensor
    kept: KeptSets
    added: torch.Tensor | None = None
    log_mass: torch.Tensor | None = None


def logprobs_on_kept_sets(logits: torch.Tensor, tokens: torch.Tensor, kept: KeptSets | SamplingSettings,
                          temperature: float, mask: torch.Tensor,
                          penalty: RepetitionPenalty | None = None) -> KeptLogprobs:
    """`kept_set_logprobs` over given kept sets, or over sets recomputed from these same logits by a
    `SamplingSettings` (`recompute_kept_sets`), the sampler's repetition penalty re-applied first when given. Shapes
    as there: logits (B, T, V), tokens and mask (B, T)."""
    added = None
    if not isinstance(kept, KeptSets):  # the sampler's settings: recompute the sets from these logits
        kept, added = recompute_kept_sets(logits, tokens, kept, mask, penalty=penalty)
    mask = mask.to(logits.device) & (kept.sizes.to(logits.device) > 0)  # (B, T) cells with a kept set
    return KeptLogprobs(kept_set_logprobs(logits, tokens, kept, temperature, mask=mask, penalty=penalty), kept, added)
