"""Recording on the transformers `generate` path: what the sampler drew each token from.

`SamplerLogprobRecorder`, made the last logits processor by `recording_sampler`, records log q(g) of every sampled
token under the processed distribution (temperature, top_k, top_p, min_p applied) and the kept set S of every step,
streaming (no (T, N, V) scores kept); `finish_recording` turns one recorded call into a `SamplerRecord`.
(vLLM's side: `grpo_ratio.sampler.vllm`; the settings: `grpo_ratio.sampler.settings`.)

Shapes: N = sequences (rows), P = prompt tokens, T = completion tokens (generation steps), V = vocabulary.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import GenerationMixin, LogitsProcessor, LogitsProcessorList

from ..corrections.kept_sets import KeptSets, offsets_from_sizes, range_index
from ..old_pass.adapters import base_model


# ---------------------------------------------------------------------------------------------------------------------
# Recording sampler log-probs and kept sets in transformers `generate`
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class SamplerRecord:
    """What `SamplerLogprobRecorder.finalize` returns.

    Fields:
        logprobs (`torch.Tensor`, (N, T) fp32): log q(g_t), the sampled token's log-prob under the processed
            distribution it was drawn from (temperature, top_k, top_p, min_p applied). 0.0 outside the
            completion mask; -inf for a forced pad outside the kept set when no mask is given.
        kept (`KeptSets | None`): the kept set of every cell (empty outside the completion mask); None when the
            generate call was not recorded (its log-probs are then NaN).
        top_k (`tuple | None`): with a recorder's `top_k`: (ids (N, T, k) int64, log-probs (N, T, k) fp32), the k
            most probable tokens of every step's processed distribution (-inf beyond its kept set), for
            `score_centering="top_k"`; None otherwise.
    """

    logprobs: torch.Tensor
    kept: KeptSets | None
    top_k: tuple | None = None


class SamplerLogprobRecorder(LogitsProcessor):
    """Record, per generation step, the kept set and the sampled token's processed log-prob, without keeping scores.

    Use it through `recording_sampler(model, recorder)`, which makes it the **last** logits processor, so that it sees
    the scores exactly as the sampler does (`softmax(scores)` is what `torch.multinomial` draws from). Passing it as
    `generate(logits_processor=...)` is not enough: transformers (5.x, `GenerationMixin._get_logits_processor`) merges
    user processors *before* it appends temperature / top_k / top_p / min_p, so the recorder would see unwarped
    scores; an unattached recorder therefore raises.

    Per call it returns `scores` unchanged (same object) and draws no random numbers. It keeps the (N, V) fp32
    log-softmax of the previous step only: the token sampled at step t is `input_ids[:, -1]` at step t + 1, and the
    last step's token comes from the final sequences in `finalize`. Memory: one (N, V) fp32 buffer plus the kept
    sets (see `KeptSets`), against T x N x V for `output_scores=True` (8,192 x 64 x 151,936 x 4 B = 318 GB).

    Args:
        support_size_only (`bool`, defaults to `False`): record only |S| (no `nonzero`, no ids).
        storage_device (`torch.device | str`, *optional*): where recorded ids / log-probs live (default: the device
            of the scores). `"cpu"` moves them off the accelerator each step.
        top_k (`int`, defaults to 0): also record the k most probable tokens of each step's processed distribution
            and their log-probs ((N, k) per step; `score_centering="top_k"`, arXiv 2609.20807); 0: none.

    Source: the batch-logprob-gap report's `grpo_effect.py` takes the rollout log-probs from
    `generate(output_scores=True)`;
    this computes the same `log_softmax(scores)[g]` streaming.
    """

    def __init__(self, support_size_only: bool = False, storage_device: torch.device | str | None = None,
                 top_k: int = 0):
        self.support_size_only = support_size_only
        self.top_k = top_k
        self.storage_device = storage_device
        self.attached = False
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded (called on entering `recording_sampler`)."""
        self._prompt_len: int | None = None
        self._prev_logsm: torch.Tensor | None = None  # (N, V) fp32, previous step
        self._logps: list[torch.Tensor] = []  # (N,) fp32 per step, one step behind
        self._sizes: list[torch.Tensor] = []  # (N,) int32 per step
        self._ids: list[torch.Tensor] = []  # (nnz_t,) int32 per step, row-major within the step
        self._top: list[tuple[torch.Tensor, torch.Tensor]] = []  # (N, k) int64 ids, (N, k) fp32 log-probs per step

    @property
    def prompt_length(self) -> int | None:
        """P, the (padded) prompt length of the recorded generate call; None before the first step."""
        return self._prompt_len

    @property
    def device(self) -> torch.device | None:
        """Where the recording lives (the scores' device, or `storage_device`); None before the first step."""
        return self._sizes[0].device if self._sizes else None

    def _store(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.storage_device is None else t.to(self.storage_device)  # blocking: safe to read at once

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.attached:
            raise RuntimeError("SamplerLogprobRecorder must run last: wrap generate in `with recording_sampler(model, "
                               "recorder):` (transformers puts logits_processor= entries before temperature/top_k/top_p"
                               "/min_p, so the recorder would see unwarped scores)")
        if self._prompt_len is None:
            self._prompt_len = input_ids.shape[1]
        else:  # the token drawn from the previous step's distribution is now the last input id
            self._logps.append(self._store(self._prev_logsm.gather(1, input_ids[:, -1:]).squeeze(1)))  # (N,)
        self._prev_logsm = torch.log_softmax(scores.float(), dim=-1)  # (N, V)
        if self.top_k:
            values, ids = self._prev_logsm.topk(min(self.top_k, scores.shape[-1]), dim=-1)  # (N, k) each
            self._top.append((self._store(ids), self._store(values)))
        keep = scores != -math.inf  # (N, V) the kept set: every processor writes -inf outside it
        self._sizes.append(self._store(keep.sum(-1, dtype=torch.int32)))  # (N,)
        if not self.support_size_only:
            self._ids.append(self._store(keep.nonzero()[:, 1].to(torch.int32)))  # (nnz_t,)
        return scores

    def finalize(self, sequences: torch.Tensor, completion_mask: torch.Tensor | None = None) -> SamplerRecord:
        """Turn the recording into (N, T) log-probs and kept sets, T = `sequences.shape[1]` - prompt length.

        Args:
            sequences (`torch.Tensor`, (N, P + T) int64): what `generate` returned (prompt + completion).
            completion_mask (`torch.Tensor`, (N, T) bool, *optional*): True for completion tokens (up to and
                including the first EOS). Cells outside it get log-prob 0.0 and an empty kept set.

        Raises:
            ValueError: nothing was recorded, the shapes disagree with the recording, or fewer steps were recorded
                than tokens generated (the recorder was not called at every step).
        """
        if self._prompt_len is None:
            raise ValueError("finalize: nothing recorded; run generate inside `recording_sampler(model, recorder)`")
        N, T = sequences.shape[0], sequences.shape[1] - self._prompt_len
        if N != self._sizes[0].shape[0] or T < 0 or len(self._sizes) < T:
            raise ValueError(f"finalize: sequences {tuple(sequences.shape)} do not match the recording (N="
                             f"{self._sizes[0].shape[0]}, prompt length {self._prompt_len}, {len(self._sizes)} steps)")
        logps = self._logps[:T]  # calls beyond T are steps generate undid (deferred stop check)
        if len(logps) < T:  # the last step's token is only in the final sequences
            last = sequences[:, -1:].to(self._prev_logsm.device)  # (N, 1)
            logps = logps + [self._store(self._prev_logsm.gather(1, last).squeeze(1))]
        logprobs = torch.stack(logps, 1) if T else torch.zeros(N, 0, device=self._sizes[0].device)  # (N, T)
        kept = self._kept_sets(T)
        self._prev_logsm = None  # free the (N, V) buffer
        if completion_mask is not None:
            mask = completion_mask.to(device=logprobs.device, dtype=torch.bool)  # (N, T)
            logprobs = torch.where(mask, logprobs, 0.0)
            kept = kept.masked(mask.to(kept.sizes.device))
        return SamplerRecord(logprobs=logprobs.float(), kept=kept, top_k=self._top_k(T))

    def _top_k(self, T: int) -> tuple | None:
        """(ids (N, T, k), log-probs (N, T, k)) of the first T steps, or None without `top_k`."""
        if not self.top_k or not T:
            return None
        ids = torch.stack([i for i, _ in self._top[:T]], 1)  # (N, T, k)
        return ids, torch.stack([v for _, v in self._top[:T]], 1)

    def _kept_sets(self, T: int) -> KeptSets:
        """Reorder the step-major recording of the first T steps into row-major CSR."""
        N, device = self._sizes[0].shape[0], self._sizes[0].device  # the recording's device (scores or storage)
        sizes_sm = torch.stack(self._sizes[:T]) if T else torch.zeros(0, N, dtype=torch.int32, device=device)  # (T, N)
        sizes = sizes_sm.T.contiguous()  # (N, T)
        if self.support_size_only:
            return KeptSets(sizes, support_size_only=True)
        ids_sm = torch.cat(self._ids[:T]) if T else torch.zeros(0, dtype=torch.int32, device=device)  # (nnz,)
        starts_sm = offsets_from_sizes(sizes_sm)[:-1].reshape(T, N)  # (T, N)
        ids = ids_sm[range_index(starts_sm.T.reshape(-1), sizes.reshape(-1))]  # (nnz,) row-major
        return KeptSets(sizes, ids, offsets_from_sizes(sizes))


def generation_model(model):
    """The GenerationMixin whose `generate` actually runs (PEFT forwards generate to its base model)."""
    target = base_model(model)
    if isinstance(target, GenerationMixin):
        return target
    raise ValueError(f"recording_sampler: {type(model).__name__} is not a transformers GenerationMixin (or a PEFT "
                     f"model around one)")


@contextlib.contextmanager
def recording_sampler(model, recorder: SamplerLogprobRecorder) -> Iterator[SamplerLogprobRecorder]:
    """Within the block, every `model.generate` call runs `recorder` as its last logits processor.

    It wraps `model._get_logits_processor` on the instance (transformers 5.x), appending the recorder after
    everything generate builds (repetition penalty, temperature, top_k, top_p, min_p, ...). No generate call has to
    change, so TRL's `_generate_single_turn` can run unmodified inside the block. The recorder is reset on entry and
    records one generate call per block (a second call raises RuntimeError).

    Args:
        model: the model whose `generate` is called (the unwrapped model; a PEFT model is resolved to its base).
        recorder: the `SamplerLogprobRecorder` to attach.
    """
    target = generation_model(model)
    own = target.__dict__.get("_get_logits_processor")  # an instance-level override to restore afterwards
    build = target._get_logits_processor

    def build_with_recorder(*args, **kwargs) -> LogitsProcessorList:
        if recorder._prompt_len is not None:  # a second generate would interleave with the first recording
            raise RuntimeError("recording_sampler records one generate call; finalize it and open a new block")
        processors = LogitsProcessorList(p for p in build(*args, **kwargs) if p is not recorder)
        processors.append(recorder)
        return processors

    recorder.reset()
    recorder.attached = True
    target._get_logits_processor = build_with_recorder
    try:
        yield recorder
    finally:
        recorder.attached = False
        if own is None:
            del target._get_logits_processor
        else:
            target._get_logits_processor = own


def finalize_from_completions(recorder: SamplerLogprobRecorder, completion_ids: list[list[int]],
                              pad_token_id: int) -> SamplerRecord:
    """`recorder.finalize` from TRL's per-row completion lists (cut after the first EOS): rebuild the (N, P+T)
    sequences and the (N, T) completion mask; the prompt part is never read, only its length."""
    lengths = [len(c) for c in completion_ids]
    N, T, device = len(completion_ids), max(lengths, default=0), recorder.device
    padded = [list(ids) + [pad_token_id] * (T - len(ids)) for ids in completion_ids]
    completion = torch.tensor(padded, dtype=torch.long, device=device).reshape(N, T)  # (N, T): one copy to the device
    prompt = torch.full((N, recorder.prompt_length), pad_token_id, dtype=torch.long, device=device)  # (N, P)
    mask = torch.arange(T, device=device) < torch.tensor(lengths, dtype=torch.long, device=device)[:, None]  # (N, T)
    return recorder.finalize(torch.cat([prompt, completion], dim=1), mask)



def finish_recording(recorder: SamplerLogprobRecorder, completion_ids: list, pad_token_id: int | None,
                     needs_kept_sets: bool) -> tuple[SamplerRecord, bool]:
    """(record, seen) of one recorded `generate` call: the recording (`finalize_from_completions`) and True, or
    NaN log-probs (B, T) without kept sets and False when generate did not run the logits processors as recorded (a
    replaced or mocked `generate`: other rows, or fewer steps than tokens returned).

    Raises:
        RuntimeError: nothing was recorded but a truncation correction needs the kept sets (`needs_kept_sets`).
    """
    if recorder.prompt_length is not None:
        try:
            return finalize_from_completions(recorder, completion_ids, pad_token_id), True
        except ValueError:  # other rows or fewer steps than tokens returned: not the generate we recorded
            pass
    if needs_kept_sets:
        raise RuntimeError("truncation_correction needs the kept sets recorded during generate, but this generate "
                           "call did not run transformers' logits processors as recorded (a replaced generate?)")
    T = max((len(c) for c in completion_ids), default=0)
    return SamplerRecord(logprobs=torch.full((len(completion_ids), T), math.nan), kept=None), False
