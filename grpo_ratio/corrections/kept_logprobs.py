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

Shapes: N or B = sequences (rows), T = completion tokens (generation steps), V = vocabulary, K = cells in a chunk,
H = hidden size. A "cell" is one (row, position) pair; cells are numbered row-major, `row * T + position`. All
log-probs are natural-log fp32. Every function takes raw logits and divides by `temperature` itself (pass
`temperature=1.0` for logits that TRL has already divided in place).

Memory. The logits may be a (B, T, V) tensor or a `HeadLogits`: hidden states (B, T, H) and the LM head, projected K
cells at a time, so no (B, T, V) tensor exists at all (TRL 1.16 builds none either: its fused head,
`trl.kernels.ChunkedLogProbFunction`). Under autograd `kept_set_logprobs` on `HeadLogits` keeps nothing of a chunk for
backward: `RecomputedCells` recomputes each chunk's (K, V) logits in backward, one chunk at a time, so the memory is
one chunk's whatever the number of chunks (chunking a differentiable (B, T, V) tensor saves nothing: autograd keeps
every chunk's fp32 copy and mask until backward).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .kept_sets import KeptSets, concat_kept_sets, offsets_from_sizes


if TYPE_CHECKING:
    from .kept_sets import SamplingSettings
    from .processors import RepetitionPenalty


DEFAULT_CHUNK_CELLS = 1024  # fp32 working set per chunk: K * V * 4 B, 622 MB at V = 151,936 (Qwen2.5)


class HeadLogits:
    """Logits (B, T, V) of hidden states through an LM head that are never held whole: `cells` computes the (K, V)
    logits of K cells on demand, so whoever reads them chunk by chunk (the functions of this module,
    `grpo_ratio.diagnostics.mismatch.full_vocab_divergence`) holds one chunk of cells whatever B and T are. At
    B x T = 32 x 4,096 and V = 151,936 the (B, T, V) fp32 tensor they replace is 80 GB.

    Args:
        hidden (`torch.Tensor`, (B, T, H), any float dtype): the head's input at the positions whose logits these are
            (grad may flow through it).
        project (`Callable`): `project(h, *params)` maps (K, H) hidden states to their (K, V) logits (any float dtype),
            taking the head's parameters `params` as arguments, so that `RecomputedCells` can recompute a chunk with
            autograd in backward.
        vocab_size (`int`): V.
        params (`Sequence[torch.Tensor]`): the parameters `project` takes (empty when it closes over its weights: no
            gradient to them then).

    Attributes:
        shape (`torch.Size`): (B, T, V). `dim()`, `numel()`, `is_floating_point()`, `device` and `requires_grad` read as
            those of the tensor it stands for.
    """

    def __init__(self, hidden: torch.Tensor, project: Callable[..., torch.Tensor], vocab_size: int,
                 params: Sequence[torch.Tensor] = ()):
        if hidden.dim() != 3:
            raise ValueError(f"hidden must be (B, T, H), got {tuple(hidden.shape)}")
        self.hidden = hidden
        self.flat = hidden.reshape(-1, hidden.shape[-1])  # (B*T, H): one copy of a strided slice, not one per chunk
        self.project = project
        self.params = tuple(params)
        self.shape = torch.Size((*hidden.shape[:2], vocab_size))
        self._rows: torch.Tensor | None = None  # (B,) int64: row in `_other` of every row taken from it, else -1
        self._other: HeadLogits | None = None

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    @property
    def requires_grad(self) -> bool:
        """Whether the logits would carry a gradient: grad mode is on and the hidden states or parameters need one."""
        return torch.is_grad_enabled() and (self.hidden.requires_grad or any(p.requires_grad for p in self.params))

    def dim(self) -> int:
        return 3

    def numel(self) -> int:
        return self.shape.numel()

    def is_floating_point(self) -> bool:
        return True

    def cells(self, cells: torch.Tensor) -> torch.Tensor:
        """(K, V) logits of the flat cells `cells` (K,) int64, a fresh tensor in the projection's dtype (fp32 where
        rows of two projections of different dtypes meet)."""
        if self._other is None:
            return self.project(self.flat[cells], *self.params)  # (K, V)
        T = self.shape[1]
        local = self._rows[cells // T]  # (K,) the row in `_other`, or -1
        own, moved = (local < 0).nonzero().squeeze(1), (local >= 0).nonzero().squeeze(1)  # (K1,), (K2,)
        parts = [self.project(self.flat[cells[own]], *self.params),
                 self._other.cells(local[moved] * T + cells[moved] % T)]  # (K1, V), (K2, V)
        out = torch.empty(cells.numel(), self.shape[2], dtype=torch.promote_types(parts[0].dtype, parts[1].dtype),
                          device=parts[0].device)  # (K, V)
        out[own], out[moved] = (part.to(out.dtype) for part in parts)  # an fp16 pass's rows beside fp32 fallback rows
        return out

    def with_rows(self, rows: torch.Tensor, other: HeadLogits) -> HeadLogits:
        """These logits with the rows `rows` (r,) int64 taken from `other` (r, T, V), in that order: e.g. the rows an
        fp16 pass overflowed on, re-scored in fp32. Not differentiable.

        Raises:
            ValueError: `other` is not (r, T, V) over the same T and V.
        """
        if tuple(other.shape) != (rows.numel(), *self.shape[1:]):
            raise ValueError(f"rows {rows.numel()} x {tuple(self.shape[1:])} expected, got {tuple(other.shape)}")
        out = HeadLogits(self.hidden, self.project, self.shape[2], self.params)
        out._rows = torch.full((self.shape[0],), -1, dtype=torch.long, device=self.device)  # (B,)
        out._rows[rows.to(self.device)] = torch.arange(rows.numel(), device=self.device)
        out._other = other
        return out

    def anchor(self) -> torch.Tensor:
        """A (1,) fp32 zero that depends on the hidden states and the parameters: a value 0 with a gradient 0 for all
        of them (finite or not), where no cell is computed but a loss must stay connected (`_scatter`)."""
        never = torch.zeros(1, dtype=torch.bool, device=self.device)
        total = torch.zeros(1, dtype=torch.float32, device=self.device)
        for t in (self.hidden, *self.params):
            if t.numel():
                total = total + t.reshape(-1)[:1].float().where(never, 0.0).to(self.device)
        return total

    def materialize(self) -> torch.Tensor:
        """The whole (B, T, V) tensor, for tests and small inputs only (what this class exists to avoid)."""
        B, T, V = self.shape
        return self.cells(torch.arange(B * T, device=self.device)).reshape(B, T, V)


class RecomputedCells(torch.autograd.Function):
    """`torch.cat([value(c, hidden[c], *params) for c in chunks])` (M,), keeping only `hidden` and `params` for
    backward: backward recomputes each chunk's graph from them in turn (`torch.autograd.grad` per chunk) and
    accumulates the gradients in fp32, as TRL's `ChunkedLogProbFunction` accumulates its head gradients. The peak is
    one chunk's (K, V) tensors, whatever the number of chunks.

    `value(c, h, *params, check)` -> (K,): the flat cells `c` (K,) with their hidden states h (K, H); `check` is
    True in forward only (raise on an inconsistent rollout once, not again in backward).
    """

    @staticmethod
    def forward(ctx, value, chunks, hidden, *params):
        ctx.value, ctx.chunks = value, chunks
        ctx.save_for_backward(hidden, *params)
        return torch.cat([value(c, hidden[c], *params, check=True) for c in chunks])  # (M,)

    @staticmethod
    def backward(ctx, grad):
        inputs = ctx.saved_tensors  # hidden (N, H), *params
        wants = ctx.needs_input_grad[2:]
        sums = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if w else None
                for t, w in zip(inputs, wants, strict=True)]
        start = 0
        for c in ctx.chunks:
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(w) for t, w in zip((inputs[0][c], *inputs[1:]), wants, strict=True)]
                out = ctx.value(c, *leaves, check=False)  # (K,)
                grads = iter(torch.autograd.grad(out, [x for x, w in zip(leaves, wants, strict=True) if w],
                                                 grad[start:start + c.numel()]))
            for i, w in enumerate(wants):
                if w and i == 0:
                    sums[0].index_add_(0, c, next(grads).float())  # (N, H): this chunk's rows
                elif w:
                    sums[i].add_(next(grads).float())
            start += c.numel()
        return None, None, *(None if s is None else s.to(t.dtype) for s, t in zip(sums, inputs, strict=True))


def _check_inputs(logits: torch.Tensor | HeadLogits, kept_sizes: torch.Tensor, temperature: float, mask) -> torch.Tensor:
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


def _chunks(mask: torch.Tensor, chunk_cells: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All valid flat cells (M,) int64 and their split into chunks of at most `chunk_cells` (None:
    `DEFAULT_CHUNK_CELLS`, read at the call)."""
    chunk_cells = DEFAULT_CHUNK_CELLS if chunk_cells is None else chunk_cells
    if chunk_cells < 1:
        raise ValueError(f"chunk_cells must be >= 1, got {chunk_cells}")
    cells = mask.reshape(-1).nonzero().squeeze(1)  # (M,)
    return cells, list(cells.split(chunk_cells)) if cells.numel() else []  # split() of nothing gives one empty chunk


def _raw(logits: torch.Tensor | HeadLogits, cells: torch.Tensor, penalty: RepetitionPenalty | None = None,
         T: int | None = None) -> torch.Tensor:
    """fp32 logits (K, V) of the flat cells `cells` (K,), with the sampler's repetition penalty applied when given
    (before temperature, as generate and vLLM apply it); only this chunk is converted. `logits` may also be the (K, V)
    logits of these cells already (then `T`, the grid's number of steps, is given)."""
    if T is not None:
        z = logits.float()  # (K, V) a fresh tensor (projected for these cells)
    elif isinstance(logits, HeadLogits):
        T, z = logits.shape[1], logits.cells(cells).float()  # (K, V) projected for this chunk only
    else:
        T = logits.shape[1]
        z = logits[cells // T, cells % T].float()  # (K, V) a fresh copy
    return z if penalty is None else penalty(z, cells, T)


def _scaled(logits: torch.Tensor | HeadLogits, cells: torch.Tensor, temperature: float,
            penalty: RepetitionPenalty | None = None, T: int | None = None) -> torch.Tensor:
    """fp32 (penalised) logits / temperature of the flat cells `cells` (K,) -> (K, V)."""
    z = _raw(logits, cells, penalty, T)  # (K, V) a fresh tensor: safe to divide in place
    return z.div_(temperature) if temperature != 1.0 else z


def _scatter(cells: torch.Tensor, values: list[torch.Tensor], logits: torch.Tensor | HeadLogits) -> torch.Tensor:
    """(B, T) fp32 zeros with `values` (concatenated, (M,)) at the flat `cells` (M,); differentiable.

    Always a function of `logits` when they require grad, also with no valid cell (every completion masked: TRL's
    `mask_truncated_completions` on an all-truncated batch): the loss is then 0 with a zero gradient that reaches
    every parameter, as TRL's own full-vocabulary log-probs give, instead of a tensor without `grad_fn` (backward
    raised "element 0 of tensors does not require grad"; DDP/ZeRO would also miss every parameter's gradient)."""
    B, T = logits.shape[:2]
    out = torch.zeros(B * T, dtype=torch.float32, device=logits.device)  # (B*T,)
    if values:
        return out.index_put((cells,), torch.cat(values)).reshape(B, T)
    if isinstance(logits, HeadLogits) and logits.requires_grad and logits.numel():
        out = out + logits.anchor()  # (B*T,) value 0, gradient 0 to the hidden states and the head
    elif logits.requires_grad and logits.numel():
        never = torch.zeros(1, dtype=torch.bool, device=logits.device)
        out = out + logits.reshape(-1)[:1].float().where(never, 0.0)  # (B*T,) value 0, gradient 0 (finite or not)
    return out.reshape(B, T)


def _empty_cell_error(kept_sizes: torch.Tensor, cells: torch.Tensor, T: int) -> None:
    sizes = kept_sizes.reshape(-1)[cells.to(kept_sizes.device)]  # (K,)
    if bool((sizes <= 0).any()):
        c = int(cells[(sizes <= 0).nonzero()[0, 0].to(cells.device)])
        raise ValueError(f"no kept set at row {c // T}, position {c % T} (size 0) although the mask marks it as a "
                         f"completion token; pass the completion mask, or record/return the sampling mask for it")


def _lse_top_prefix(z: torch.Tensor, sizes: torch.Tensor, k: int) -> torch.Tensor:
    """log of the summed exp of the top-|S| entries of each row of z (K, V), sizes (K,) >= 1 (verl support-size);
    k >= max(sizes): the widest set of the call (read once per call, not once per chunk: one host sync)."""
    sizes = sizes.clamp(max=z.shape[-1])  # (K,) a set cannot exceed the vocabulary
    top = z.topk(min(k, z.shape[-1]), dim=-1).values  # (K, k) descending
    return torch.logcumsumexp(top, dim=-1).gather(1, (sizes.long() - 1)[:, None].to(z.device)).squeeze(1)  # (K,)


def kept_set_logprobs(
    logits: torch.Tensor | HeadLogits,
    tokens: torch.Tensor,
    kept: KeptSets,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk_cells: int | None = None,
    penalty: RepetitionPenalty | None = None,
) -> torch.Tensor:
    """Log-probs of `tokens` renormalised over the kept sets: log p_S(g) = z_g - logsumexp_{v in S} z_v, z = logits/T
    (z = penalised logits / T with the sampler's `repetition_penalty`: the sampler's own processed distribution).

    The `renormalize` correction (the batch-logprob-gap README; DeepSeek-V3.2 "Keep Sampling Mask", arXiv
    2512.02556): used for
    both old and new log-probs, it puts the trainer on the sampler's support. Differentiable (new log-probs); a
    token's gradient reaches only the logits in its kept set. A kept set of size 1 gives 0.0.

    Args:
        logits (`torch.Tensor`, (B, T, V), any float dtype, or `HeadLogits`): trainer logits at the completion
            positions. `HeadLogits` under autograd: each chunk is recomputed in backward (`RecomputedCells`), so no
            chunk's (K, V) tensors are kept for it.
        tokens (`torch.Tensor`, (B, T) int): sampled token ids.
        kept (`KeptSets`, (B, T)): kept sets of the same rows and positions. With `support_size_only` the set is the
            trainer's own top-|S| (a token outside it is not an error then: support-size replay cannot tell).
        temperature (`float`): sampling temperature (> 0); 1.0 when the logits are already divided.
        mask (`torch.Tensor`, (B, T) bool, *optional*): completion tokens; other cells are not computed and give 0.0.
        chunk_cells (`int`, *optional*): cells per fp32 chunk (memory K x V x 4 B; the (B, T, V) fp32 tensor is never
            built); `DEFAULT_CHUNK_CELLS` by default.
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
    # the checks and the widest set read once per call, not per chunk (each read is a host sync on an accelerator)
    _empty_cell_error(kept.sizes, cells, T)
    widest = int(kept.sizes.max()) if kept.support_size_only and cells.numel() else 0
    outside: list[torch.Tensor] = []  # per chunk (K,) bool: sampled token outside its kept set, checked at the end

    def value(c: torch.Tensor, z: torch.Tensor, check: bool = True) -> torch.Tensor:
        """(K,) log p_S(g) of the cells c (K,) from their scaled logits z (K, V)."""
        g = flat_tokens[c][:, None]  # (K, 1)
        if kept.support_size_only:
            lse = _lse_top_prefix(z, kept.sizes.reshape(-1)[c.to(kept.sizes.device)], widest)  # (K,)
        else:
            keep = kept.dense_cells(c, z.shape[-1]).to(z.device)  # (K, V)
            if check:
                outside.append(~keep.gather(1, g).squeeze(1))
            lse = torch.logsumexp(z.masked_fill(~keep, -math.inf), dim=-1)  # (K,)
        return z.gather(1, g).squeeze(1) - lse  # (K,)

    if isinstance(logits, HeadLogits) and logits.requires_grad and chunks:
        # under autograd every chunk's (K, V) fp32 logits, mask and log-sum-exp would live until backward: recompute
        def from_hidden(c, h, *params, check):  # (K,) from the cells' hidden states (K, H) and the head's parameters
            return value(c, _scaled(logits.project(h, *params), c, temperature, penalty, T), check)

        values = [RecomputedCells.apply(from_hidden, chunks, logits.flat, *logits.params)]
    else:
        values = [value(c, _scaled(logits, c, temperature, penalty)) for c in chunks]  # (K,) each
    _inconsistent_rollout_error(outside, flat_tokens, cells, kept, T)
    return _scatter(cells, values, logits)


def _inconsistent_rollout_error(outside: list[torch.Tensor], flat_tokens: torch.Tensor, cells: torch.Tensor,
                                kept: KeptSets, T: int) -> None:
    """Raise when a sampled token is outside its kept set: `outside` holds each chunk's (K,) bool flags, in the order
    of `cells` (M,); one host sync for the whole call."""
    if not outside:
        return
    flags = torch.cat(outside)  # (M,)
    if bool(flags.any()):
        c = int(cells[flags.nonzero()[0, 0]])
        raise ValueError(f"inconsistent rollout: sampled token {int(flat_tokens[c])} at row {c // T}, position "
                         f"{c % T} is not in its kept set (size {int(kept.sizes.reshape(-1)[c])}); the kept sets do "
                         f"not belong to these completions (row order, padding side or step offset differ)")


def is_top_prefix(
    logits: torch.Tensor | HeadLogits,
    kept: KeptSets,
    mask: torch.Tensor | None = None,
    chunk_cells: int | None = None,
) -> torch.Tensor:
    """Whether each kept set is a top-|S| prefix of `logits`: min over S >= max over the rest (ties count as prefix).

    When True everywhere, `support_size_only` replay gives the same kept mass as the explicit sets. Temperature does
    not change the order, so it is not an argument.

    Args:
        logits (`torch.Tensor`, (B, T, V)), kept (`KeptSets` with ids, (B, T)), mask (`torch.Tensor`, (B, T) bool,
        *optional*), chunk_cells (`int`, *optional*: `DEFAULT_CHUNK_CELLS`).

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
    logits: torch.Tensor | HeadLogits,
    tokens: torch.Tensor,
    sampling: SamplingSettings,
    mask: torch.Tensor | None = None,
    chunk_cells: int | None = None,
    penalty: RepetitionPenalty | None = None,
) -> tuple[KeptSets, torch.Tensor]:
    """Kept sets of every masked-in cell recomputed from `logits` by the sampler's truncation (`sampling.keep_mask`,
    transformers' own warpers; the "recompute" kept-set source, NeMo-RL's approach); a sampled token the filter drops
    (the trainer's logits put it just outside the set the sampler kept) is added to its set, and reported.

    Args:
        logits (`torch.Tensor`, (B, T, V), any float dtype, or `HeadLogits`): the old policy's raw logits at the
            completion positions.
        tokens (`torch.Tensor`, (B, T) int): sampled token ids.
        sampling (`grpo_ratio.sampler.generate.SamplingSettings`): the sampler's temperature / top_k / top_p / min_p.
        mask (`torch.Tensor`, (B, T) bool, *optional*): completion tokens; other cells get empty sets.
        chunk_cells (`int`, *optional*): cells per fp32 chunk (memory K x V x 4 B); `DEFAULT_CHUNK_CELLS` by default.
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
    # built on the logits' device: no per-chunk copy to the host (the CSR ids still size themselves by `nonzero`)
    sizes = torch.zeros(B * T, dtype=torch.int32, device=logits.device)  # (B*T,)
    added = torch.zeros(B * T, dtype=torch.bool, device=logits.device)  # (B*T,)
    ids = []
    cells, chunks = _chunks(valid, chunk_cells)
    flat_tokens = tokens.reshape(-1).to(logits.device)  # (B*T,)
    for c in chunks:  # ascending cells: the ids come out row-major, as CSR needs
        with torch.no_grad():  # a mask: no gradient, and no chunk's graph kept
            keep = sampling.keep_mask(_raw(logits, c, penalty))  # (K, V)
        g = flat_tokens[c][:, None]  # (K, 1)
        outside = ~keep.gather(1, g).squeeze(1)  # (K,)
        keep.scatter_(1, g, True)
        sizes[c] = keep.sum(-1, dtype=torch.int32)
        added[c] = outside
        ids.append(keep.nonzero()[:, 1].to(torch.int32))  # (nnz_chunk,) row-major, ascending ids
    sizes = sizes.reshape(B, T)
    flat_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32, device=logits.device)
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


def concat_kept_logprobs(parts: Sequence[KeptLogprobs]) -> KeptLogprobs:
    """The `KeptLogprobs` of consecutive row blocks (forward chunks), concatenated along rows: logps and log_mass
    (B, T) (log_mass only where every part has one), the sets (`concat_kept_sets`), the additions where recomputed.

    Raises:
        ValueError: no part.
    """
    if not parts:
        raise ValueError("concat_kept_logprobs needs at least one part")
    added = [p.added for p in parts]
    masses = [p.log_mass for p in parts]
    return KeptLogprobs(torch.cat([p.logps for p in parts], dim=0), concat_kept_sets([p.kept for p in parts]),
                        added=None if any(a is None for a in added) else torch.cat(added, dim=0),
                        log_mass=None if any(m is None for m in masses) else torch.cat(masses, dim=0))


def logprobs_on_kept_sets(logits: torch.Tensor | HeadLogits, tokens: torch.Tensor, kept: KeptSets | SamplingSettings,
                          temperature: float, mask: torch.Tensor,
                          penalty: RepetitionPenalty | None = None) -> KeptLogprobs:
    """`kept_set_logprobs` over given kept sets, or over sets recomputed from these same logits by a
    `SamplingSettings` (`recompute_kept_sets`), the sampler's repetition penalty re-applied first when given. Shapes
    as there: logits (B, T, V) or `HeadLogits`, tokens and mask (B, T)."""
    added = None
    if not isinstance(kept, KeptSets):  # the sampler's settings: recompute the sets from these logits
        kept, added = recompute_kept_sets(logits, tokens, kept, mask, penalty=penalty)
    mask = mask.to(logits.device) & (kept.sizes.to(logits.device) > 0)  # (B, T) cells with a kept set
    return KeptLogprobs(kept_set_logprobs(logits, tokens, kept, temperature, mask=mask, penalty=penalty), kept, added)
