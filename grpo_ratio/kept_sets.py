"""Kept sets and the truncated-sampling correction math: pure tensor functions, no model, no trainer.

With top_p / top_k / min_p the sampler draws token g from the distribution renormalised over the kept set S of that
step, q(g) = p(g) / M_S with kept mass M_S = sum_{v in S} p(v), while the trainer scores g over the full vocabulary.
The importance ratio old/sampler then carries the factor M_S for an unchanged policy: at top_p=0.8 on
Qwen2.5-1.5B-Instruct it averages 0.896 and leaves [0.9, 1.1] for 51.8% of tokens (the batch-logprob-gap report,
"The other term in the ratio"; trl#6789). The two corrections of docs/truncation.md, one implementation each:

1. `renormalize` (DeepSeek-V3.2 "Keep Sampling Mask", arXiv 2512.02556): trainer log-probs over S,
   `kept_set_logprobs`.
2. `lift_sampler` (trl#6789, TRL PR #7269; verl `support_size_replay`): sampler log-probs + log M_S,
   `log_kept_mass` / `log_kept_mass_top_prefix` then `lift_sampler_logprobs`.

Where S comes from (generate's recording, vLLM's sampling masks) is `grpo_ratio.rollouts`; how the trainer applies
the corrections is `grpo_ratio.corrections`.

Shapes: N or B = sequences (rows), T = completion tokens (generation steps), V = vocabulary, K = cells in a chunk,
nnz = kept ids stored. A "cell" is one (row, position) pair; cells are numbered row-major, `row * T + position`.
All log-probs are natural-log fp32. Every function takes raw logits and divides by `temperature` itself
(pass `temperature=1.0` for logits that TRL has already divided in place).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


DEFAULT_CHUNK_CELLS = 1024  # fp32 working set per chunk: K * V * 4 B, 622 MB at V = 151,936 (Qwen2.5)

# ---------------------------------------------------------------------------------------------------------------------
# Kept sets
# ---------------------------------------------------------------------------------------------------------------------


def _range_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenate the integer ranges [starts[k], starts[k] + lengths[k]) into one (sum(lengths),) int64 tensor."""
    lengths = lengths.long()
    cell = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)  # (nnz,)
    first = torch.cumsum(lengths, 0) - lengths  # (K,) position of each range in the output
    within = torch.arange(len(cell), device=lengths.device) - first[cell]  # (nnz,)
    return starts.long()[cell] + within


def _offsets_from_sizes(sizes: torch.Tensor) -> torch.Tensor:
    """CSR offsets (numel + 1,) int64 of the row-major flattened `sizes`."""
    flat = sizes.reshape(-1).long()
    return torch.cat([flat.new_zeros(1), torch.cumsum(flat, 0)])


@dataclass(eq=False)
class KeptSets:
    """The kept set S of every (row, step) cell of N rows x T generation steps, in CSR layout.

    Fields:
        sizes (`torch.Tensor`, (N, T) int32): |S| per cell. 0 means "no set" (padding, post-EOS, or not recorded).
        ids (`torch.Tensor | None`, (nnz,) int32): kept vocabulary ids, cell after cell (row-major), ascending within
            a cell. None when `support_size_only`.
        offsets (`torch.Tensor | None`, (N * T + 1,) int64): the ids of cell c are `ids[offsets[c]:offsets[c + 1]]`.
            None when `support_size_only`.
        support_size_only (`bool`): only |S| is kept. Valid when S is the top-|S| prefix of the trainer's distribution
            (top_k / top_p / min_p keep a prefix of the sorted distribution; the batch-logprob-gap repository's
            verl `support_size_replay.py`: sets identical 99.5% of the time at top_p=0.8, 72% at top_k=20, ratios
            equal to four decimals).

    Memory: 4 B per kept id + 8 B per cell of offsets + 4 B per cell of sizes. top_k=1024 over 8,192 tokens is
    8,388,608 ids = 32 MiB per sequence (2 GiB for 64 sequences); `support_size_only` keeps 32 KiB per sequence.

    Raises:
        ValueError: a field has the wrong shape or dtype, or offsets and ids disagree.
    """

    sizes: torch.Tensor
    ids: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    support_size_only: bool = False

    def __post_init__(self):
        if self.sizes.dim() != 2 or self.sizes.dtype != torch.int32:
            raise ValueError(f"KeptSets.sizes must be an (N, T) int32 tensor, got {tuple(self.sizes.shape)} "
                             f"{self.sizes.dtype}")
        if self.support_size_only:
            self.ids = self.offsets = None
            return
        if self.ids is None or self.offsets is None:
            raise ValueError("KeptSets.ids and KeptSets.offsets are required unless support_size_only=True")
        if self.ids.dim() != 1 or self.ids.dtype != torch.int32:
            raise ValueError(f"KeptSets.ids must be a (nnz,) int32 tensor, got {tuple(self.ids.shape)} {self.ids.dtype}")
        if self.offsets.shape != (self.sizes.numel() + 1,) or self.offsets.dtype != torch.int64:
            raise ValueError(f"KeptSets.offsets must be an (N*T+1,) = ({self.sizes.numel() + 1},) int64 tensor, got "
                             f"{tuple(self.offsets.shape)} {self.offsets.dtype}")
        if int(self.offsets[-1]) != self.ids.numel():
            raise ValueError(f"KeptSets.offsets[-1] = {int(self.offsets[-1])} but ids holds {self.ids.numel()} ids")

    # -- construction -------------------------------------------------------------------------------------------------
    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[Sequence[int]]], num_steps: int | None = None) -> KeptSets:
        """Build from nested lists: `rows[n][t]` is the list of kept ids of row n at step t.

        Rows shorter than `num_steps` (default: the longest row) get empty cells (size 0).

        Raises:
            ValueError: a row is longer than `num_steps`.
        """
        T = max((len(r) for r in rows), default=0) if num_steps is None else num_steps
        sizes = np.zeros((len(rows), T), dtype=np.int32)
        chunks = []
        for n, row in enumerate(rows):
            if len(row) > T:
                raise ValueError(f"kept sets: row {n} has {len(row)} steps but num_steps={T}")
            for t, cell in enumerate(row):
                sizes[n, t] = len(cell)
                chunks.append(np.asarray(cell, dtype=np.int32))
        ids = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
        sizes_t = torch.from_numpy(sizes)
        return cls(sizes=sizes_t, ids=torch.from_numpy(ids), offsets=_offsets_from_sizes(sizes_t))

    @classmethod
    def from_mask(cls, keep: torch.Tensor) -> KeptSets:
        """Build from a dense (N, T, V) bool mask (True = kept). For tests and small batches only."""
        if keep.dim() != 3 or keep.dtype != torch.bool:
            raise ValueError(f"keep must be an (N, T, V) bool tensor, got {tuple(keep.shape)} {keep.dtype}")
        sizes = keep.sum(-1).to(torch.int32)  # (N, T)
        ids = keep.reshape(-1, keep.shape[-1]).nonzero()[:, 1].to(torch.int32)  # (nnz,) row-major, ascending
        return cls(sizes=sizes, ids=ids, offsets=_offsets_from_sizes(sizes))

    # -- shape and access ---------------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.sizes.shape[0]

    @property
    def num_steps(self) -> int:
        return self.sizes.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the three tensors."""
        return sum(t.numel() * t.element_size() for t in (self.sizes, self.ids, self.offsets) if t is not None)

    def cell_ids(self, row: int, step: int) -> torch.Tensor:
        """Kept ids (|S|,) int32 of one cell. Raises ValueError when `support_size_only`."""
        self._need_ids("cell_ids")
        c = row * self.num_steps + step
        return self.ids[self.offsets[c]:self.offsets[c + 1]]

    def to(self, device) -> KeptSets:
        """A copy on `device`."""
        ids, offsets = (None, None) if self.support_size_only else (self.ids.to(device), self.offsets.to(device))
        return KeptSets(self.sizes.to(device), ids, offsets, self.support_size_only)

    def size_only(self) -> KeptSets:
        """Drop the ids, keep |S| (support-size replay)."""
        return KeptSets(self.sizes, support_size_only=True)

    def _need_ids(self, what: str) -> None:
        if self.support_size_only:
            raise ValueError(f"KeptSets.{what} needs the kept ids, but these kept sets are support_size_only")

    def _select_cells(self, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids (nnz_sel,) int32 and sizes (K,) int64 of the flat cells `cells` (K,), in that order."""
        lengths = self.sizes.reshape(-1)[cells].long()  # (K,)
        return self.ids[_range_index(self.offsets[cells], lengths)], lengths

    def _rebuild(self, sizes: torch.Tensor, cells: torch.Tensor) -> KeptSets:
        """KeptSets of new `sizes` (N', T') whose row-major cells are this object's flat `cells` (N'*T',)."""
        sizes = sizes.to(torch.int32)
        if self.support_size_only:
            return KeptSets(sizes, support_size_only=True)
        ids, _ = self._select_cells(cells)
        return KeptSets(sizes, ids, _offsets_from_sizes(sizes))

    # -- row / step / mask selection ---------------------------------------------------------------------------------
    def select_rows(self, index: torch.Tensor | Sequence[int]) -> KeptSets:
        """The kept sets of rows `index` (R,), in that order: use it to follow TRL's shuffle and micro-batch split."""
        index = torch.as_tensor(index, dtype=torch.long, device=self.sizes.device)
        T = self.num_steps
        cells = (index[:, None] * T + torch.arange(T, device=index.device)).reshape(-1)  # (R*T,)
        return self._rebuild(self.sizes[index], cells)

    def resize_steps(self, num_steps: int) -> KeptSets:
        """Pad with empty cells or crop to `num_steps` steps (to match the trainer's padded completion length).

        Raises:
            ValueError: cropping would drop a non-empty cell.
        """
        N, T = self.sizes.shape
        if num_steps < T and bool((self.sizes[:, num_steps:] > 0).any()):
            raise ValueError(f"resize_steps({num_steps}) would drop non-empty kept sets beyond step {num_steps}")
        sizes = self.sizes.new_zeros(N, num_steps)
        keep_T = min(T, num_steps)
        sizes[:, :keep_T] = self.sizes[:, :keep_T]
        cells = (torch.arange(N, device=sizes.device)[:, None] * T
                 + torch.arange(keep_T, device=sizes.device)).reshape(-1)  # (N*keep_T,) source cells, row-major
        if self.support_size_only:
            return KeptSets(sizes, support_size_only=True)
        ids, _ = self._select_cells(cells)
        return KeptSets(sizes, ids, _offsets_from_sizes(sizes))

    def masked(self, mask: torch.Tensor) -> KeptSets:
        """Empty every cell where `mask` (N, T) bool is False (padding, post-EOS): they then cost no memory."""
        if mask.shape != self.sizes.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} != kept sets shape {tuple(self.sizes.shape)}")
        sizes = torch.where(mask.to(self.sizes.device), self.sizes, 0)  # (N, T)
        if self.support_size_only:
            return KeptSets(sizes.to(torch.int32), support_size_only=True)
        cells = torch.arange(self.sizes.numel(), device=sizes.device)
        lengths = sizes.reshape(-1).long()
        ids = self.ids[_range_index(self.offsets[cells], lengths)]
        return KeptSets(sizes.to(torch.int32), ids, _offsets_from_sizes(sizes))

    def dense_cells(self, cells: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Dense (K, V) bool membership mask of the flat cells `cells` (K,)."""
        self._need_ids("dense_cells")
        ids, lengths = self._select_cells(cells.to(self.sizes.device))
        keep = torch.zeros(len(cells), vocab_size, dtype=torch.bool, device=self.sizes.device)  # (K, V)
        rows = torch.repeat_interleave(torch.arange(len(cells), device=keep.device), lengths)  # (nnz_sel,)
        keep[rows, ids.long()] = True
        return keep

    def to_dense(self, vocab_size: int) -> torch.Tensor:
        """Dense (N, T, V) bool mask. For tests and small batches only."""
        cells = torch.arange(self.sizes.numel(), device=self.sizes.device)
        return self.dense_cells(cells, vocab_size).reshape(*self.sizes.shape, vocab_size)

    def __eq__(self, other) -> bool:
        if not isinstance(other, KeptSets) or self.support_size_only != other.support_size_only:
            return False
        pairs = [(self.sizes, other.sizes), (self.ids, other.ids), (self.offsets, other.offsets)]
        return all(a is b if a is None or b is None else torch.equal(a.cpu(), b.cpu()) for a, b in pairs)


# ---------------------------------------------------------------------------------------------------------------------
# Corrections on trainer logits
# ---------------------------------------------------------------------------------------------------------------------


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


def _scaled(logits: torch.Tensor, cells: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / temperature of the flat cells `cells` (K,) -> (K, V); only this chunk is converted."""
    T = logits.shape[1]
    z = logits[cells // T, cells % T].float()  # (K, V) a fresh copy: safe to divide in place
    return z.div_(temperature) if temperature != 1.0 else z


def _scatter(cells: torch.Tensor, values: list[torch.Tensor], shape, device) -> torch.Tensor:
    """(B, T) fp32 zeros with `values` (concatenated, (M,)) at the flat `cells` (M,); differentiable."""
    out = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=device)  # (B*T,)
    if values:
        out = out.index_put((cells,), torch.cat(values))
    return out.reshape(shape)


def _empty_cell_error(kept_sizes: torch.Tensor, cells: torch.Tensor, T: int) -> None:
    sizes = kept_sizes.reshape(-1)[cells.to(kept_sizes.device)]  # (K,)
    if bool((sizes <= 0).any()):
        c = int(cells[(sizes <= 0).nonzero()[0, 0].to(cells.device)])
        raise ValueError(f"no kept set at row {c // T}, position {c % T} (size 0) although the mask marks it as a "
                         f"completion token; pass the completion mask, or record/return the sampling mask for it")


def _lse_kept(z: torch.Tensor, kept: KeptSets, cells: torch.Tensor) -> torch.Tensor:
    """log sum_{v in S} exp(z_v) (K,) of the chunk `z` (K, V) with the explicit kept sets of `cells`."""
    keep = kept.dense_cells(cells, z.shape[-1]).to(z.device)  # (K, V)
    return torch.logsumexp(z.masked_fill(~keep, -math.inf), dim=-1)


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
) -> torch.Tensor:
    """Log-probs of `tokens` renormalised over the kept sets: log p_S(g) = z_g - logsumexp_{v in S} z_v, z = logits/T.

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
        z = _scaled(logits, c, temperature)  # (K, V)
        g = flat_tokens[c][:, None]  # (K, 1)
        if kept.support_size_only:
            lse = _lse_top_prefix(z, kept.sizes.reshape(-1)[c.to(kept.sizes.device)])  # (K,)
        else:
            keep = kept.dense_cells(c, z.shape[-1]).to(z.device)  # (K, V)
            _inconsistent_rollout_error(keep, g, c, T)
            lse = torch.logsumexp(z.masked_fill(~keep, -math.inf), dim=-1)  # (K,)
        values.append(z.gather(1, g).squeeze(1) - lse)  # (K,)
    return _scatter(cells, values, logits.shape[:2], logits.device)


def _inconsistent_rollout_error(keep: torch.Tensor, g: torch.Tensor, cells: torch.Tensor, T: int) -> None:
    """Raise when a sampled token g (K, 1) is outside its kept set keep (K, V)."""
    inside = keep.gather(1, g).squeeze(1)  # (K,)
    if not bool(inside.all()):
        k = int((~inside).nonzero()[0, 0])
        c = int(cells[k])
        raise ValueError(f"inconsistent rollout: sampled token {int(g[k, 0])} at row {c // T}, position {c % T} is not "
                         f"in its kept set (size {int(keep[k].sum())}); the kept sets do not belong to these "
                         f"completions (row order, padding side or step offset differ)")


def log_kept_mass(
    logits: torch.Tensor,
    kept: KeptSets,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk_cells: int = DEFAULT_CHUNK_CELLS,
) -> torch.Tensor:
    """log M_S = log sum_{v in S} softmax(logits / temperature)_v per cell, <= 0 (batch-logprob-gap
    `trunc_bias.py`).

    `kept_set_logprobs = full-vocab log-prob - log_kept_mass`. With `support_size_only` kept sets this is
    `log_kept_mass_top_prefix`. Differentiable.

    Args:
        logits (`torch.Tensor`, (B, T, V), any float dtype), kept (`KeptSets`, (B, T)), temperature (`float`, > 0),
        mask (`torch.Tensor`, (B, T) bool, *optional*), chunk_cells (`int`): as in `kept_set_logprobs`.

    Returns:
        (B, T) fp32, 0.0 outside `mask`.

    Raises:
        ValueError: shapes disagree, temperature <= 0, or a masked-in cell has no kept set.
    """
    if kept.support_size_only:
        return log_kept_mass_top_prefix(logits, kept.sizes, temperature, mask, chunk_cells)
    valid = _check_inputs(logits, kept.sizes, temperature, mask)
    cells, chunks = _chunks(valid, chunk_cells)
    values = []
    for c in chunks:
        _empty_cell_error(kept.sizes, c, logits.shape[1])
        z = _scaled(logits, c, temperature)  # (K, V)
        values.append(_lse_kept(z, kept, c) - torch.logsumexp(z, dim=-1))  # (K,)
    return _scatter(cells, values, logits.shape[:2], logits.device)


def log_kept_mass_top_prefix(
    logits: torch.Tensor,
    sizes: torch.Tensor,
    temperature: float = 1.0,
    mask: torch.Tensor | None = None,
    chunk_cells: int = DEFAULT_CHUNK_CELLS,
) -> torch.Tensor:
    """log kept mass when S is the top-|S| prefix: logcumsumexp(top-|S| of z)[|S| - 1] - logsumexp(z), z = logits/T.

    Support-size replay (the batch-logprob-gap repository's verl `support_size_replay.py`,
    `log_kept_mass_from_logits`): only |S| travels
    from the sampler; the trainer takes its own top-|S|. Equals `log_kept_mass` whenever the sampler's S is the
    trainer's top-|S| (see `is_top_prefix`).

    Args:
        logits (`torch.Tensor`, (B, T, V), any float dtype): trainer logits.
        sizes (`torch.Tensor`, (B, T) int): |S| per cell (>= 1 on masked-in cells).
        temperature, mask, chunk_cells: as in `kept_set_logprobs`.

    Returns:
        (B, T) fp32, <= 0, 0.0 outside `mask`.

    Raises:
        ValueError: shapes disagree, temperature <= 0, or a masked-in cell has size 0.
    """
    valid = _check_inputs(logits, sizes, temperature, mask)
    cells, chunks = _chunks(valid, chunk_cells)
    values = []
    for c in chunks:
        _empty_cell_error(sizes, c, logits.shape[1])
        z = _scaled(logits, c, temperature)  # (K, V)
        k = sizes.reshape(-1)[c.to(sizes.device)]  # (K,)
        values.append(_lse_top_prefix(z, k) - torch.logsumexp(z, dim=-1))  # (K,)
    return _scatter(cells, values, logits.shape[:2], logits.device)


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
    `rollout_logp += log_kept_mass`). Compute `log_kept_mass` from the trainer's old logits.

    Args:
        sampler_logps (`torch.Tensor`, (B, T)): log q(g) from vLLM (processed_logprobs) or `SamplerLogprobRecorder`.
        log_kept_mass (`torch.Tensor`, (B, T)): from `log_kept_mass` / `log_kept_mass_top_prefix` (0.0 on padding).

    Raises:
        ValueError: the shapes differ.
    """
    if sampler_logps.shape != log_kept_mass.shape:
        raise ValueError(f"sampler_logps {tuple(sampler_logps.shape)} and log_kept_mass "
                         f"{tuple(log_kept_mass.shape)} must have the same (B, T) shape")
    return sampler_logps.float() + log_kept_mass.float()


# ---------------------------------------------------------------------------------------------------------------------
# Kept sets recomputed from the trainer's logits (no sampling mask from the engine)
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeptSetFilter:
    """The sampler's truncation, to re-apply to the trainer's logits: the kept set of a step is what transformers'
    own warpers keep (`TemperatureLogitsWarper`, then `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`,
    generate's order; `min_tokens_to_keep=1`).

    The "recompute" kept-set source (NeMo-RL's approach): works with any engine (vLLM server mode, vLLM versions
    without sampling masks, CPU), at the price that the recomputed set can differ from the sampler's at the
    boundary, where the trainer's and the sampler's logits disagree. vLLM applies the same filters in its own
    order and tie rules; docs/truncation.md reports how often the sets differ.

    Fields: `temperature` (> 0), `top_k` (0 = off), `top_p` (1.0 = off), `min_p` (0.0 = off).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def keep_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """(K, V) bool: the tokens each row's filter keeps, from (K, V) raw logits (any float dtype)."""
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        scores = logits.float()  # (K, V)
        warpers = [TemperatureLogitsWarper(self.temperature)] if self.temperature != 1.0 else []
        if self.top_k and self.top_k > 0:
            warpers.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p))
        if self.min_p > 0.0:
            warpers.append(MinPLogitsWarper(min_p=self.min_p))
        for warper in warpers:
            scores = warper(None, scores)
        return scores != -math.inf


def recompute_kept_sets(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    kept_filter: KeptSetFilter,
    mask: torch.Tensor | None = None,
    chunk_cells: int = DEFAULT_CHUNK_CELLS,
) -> tuple[KeptSets, torch.Tensor]:
    """Kept sets of every masked-in cell recomputed from `logits` by `kept_filter`; a sampled token the filter drops
    (the trainer's logits put it just outside the set the sampler kept) is added to its set, and reported.

    Args:
        logits (`torch.Tensor`, (B, T, V), any float dtype): the old policy's raw logits at the completion positions.
        tokens (`torch.Tensor`, (B, T) int): sampled token ids.
        kept_filter (`KeptSetFilter`): the sampler's temperature / top_k / top_p / min_p.
        mask (`torch.Tensor`, (B, T) bool, *optional*): completion tokens; other cells get empty sets.
        chunk_cells (`int`): cells per fp32 chunk (memory K x V x 4 B).

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
        keep = kept_filter.keep_mask(logits[c // T, c % T])  # (K, V)
        g = flat_tokens[c][:, None]  # (K, 1)
        outside = ~keep.gather(1, g).squeeze(1)  # (K,)
        keep.scatter_(1, g, True)
        sizes[c.cpu()] = keep.sum(-1, dtype=torch.int32).cpu()
        added[c.cpu()] = outside.cpu()
        ids.append(keep.nonzero()[:, 1].to(torch.int32).cpu())  # (nnz_chunk,) row-major, ascending ids
    sizes = sizes.reshape(B, T)
    flat_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
    return KeptSets(sizes, flat_ids, _offsets_from_sizes(sizes)), added.reshape(B, T)


def concat_kept_sets(parts: Sequence[KeptSets]) -> KeptSets:
    """Stack the rows of kept sets with the same number of steps T (e.g. the chunks of one pass), in order.

    Raises:
        ValueError: no parts, different T, or explicit and size-only sets mixed.
    """
    if not parts:
        raise ValueError("concat_kept_sets needs at least one KeptSets")
    if len({p.num_steps for p in parts}) != 1 or len({p.support_size_only for p in parts}) != 1:
        raise ValueError("concat_kept_sets: parts must share num_steps and support_size_only")
    sizes = torch.cat([p.sizes for p in parts])  # (N, T)
    if parts[0].support_size_only:
        return KeptSets(sizes, support_size_only=True)
    return KeptSets(sizes, torch.cat([p.ids for p in parts]), _offsets_from_sizes(sizes))


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


def logprobs_on_kept_sets(logits: torch.Tensor, tokens: torch.Tensor, kept: KeptSets | KeptSetFilter,
                          temperature: float, mask: torch.Tensor) -> KeptLogprobs:
    """`kept_set_logprobs` over given kept sets, or over sets recomputed from these same logits by a
    `KeptSetFilter` (`recompute_kept_sets`). Shapes as there: logits (B, T, V), tokens and mask (B, T)."""
    added = None
    if isinstance(kept, KeptSetFilter):
        kept, added = recompute_kept_sets(logits, tokens, kept, mask)
    mask = mask.to(logits.device) & (kept.sizes.to(logits.device) > 0)  # (B, T) cells with a kept set
    return KeptLogprobs(kept_set_logprobs(logits, tokens, kept, temperature, mask=mask), kept, added)
