"""Rollout recording: what the sampler drew each token from, on the transformers `generate` path and from vLLM.

- transformers `generate`: `SamplerLogprobRecorder`, made the last logits processor by `recording_sampler`, records
  log q(g) of every sampled token under the processed distribution (temperature, top_k, top_p, min_p applied) and the
  kept set S of every step, streaming (no (T, N, V) scores kept).
- vLLM: `kept_sets_from_vllm` reads S from `CompletionOutput.sampling_mask`; `VLLMOutputCapture` keeps the engine's
  outputs of TRL's colocate call; `vllm_engine_kwargs` adds engine flags to TRL's `LLM(...)`.

Shapes: N = sequences (rows), P = prompt tokens, T = completion tokens (generation steps), V = vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from transformers import GenerationMixin, LogitsProcessor, LogitsProcessorList

from .adapters import base_model
from .kept_sets import KeptSets, _offsets_from_sizes, _range_index
from .processors import PROCESSORS, VLLM_PROCESSORS, active_processors


# ---------------------------------------------------------------------------------------------------------------------
# Kept sets from vLLM
# ---------------------------------------------------------------------------------------------------------------------


def _completions(outputs) -> list:
    """Flatten RequestOutputs (each with `.outputs`) and/or CompletionOutputs into a list of CompletionOutputs."""
    flat = []
    for out in outputs:
        inner = getattr(out, "outputs", None)  # RequestOutput has .outputs; CompletionOutput does not
        flat.extend(inner if inner is not None else [out])
    return flat


def _mask_cells(mask, where: str) -> list[np.ndarray]:
    """One int32 array of kept ids per generated token, from any of the three sampling-mask layouts."""
    token_ids = getattr(mask, "token_ids", None)
    offsets = getattr(mask, "offsets", None)
    if token_ids is not None and offsets is None:
        # vLLM 0.28 / 0.33 `SamplingMask(token_ids: list[list[int]])`: one list per generated token
        if len(token_ids) and np.ndim(token_ids[0]) == 0:
            raise ValueError(f"{where}: sampling_mask.token_ids is flat but has no `offsets` (CSR layout needs both)")
        return [np.asarray(cell, dtype=np.int32) for cell in token_ids]
    if token_ids is not None:
        # vLLM PR #49577 (Mask Replay) CSR: flat `token_ids` + `offsets` (num_tokens + 1)
        flat, bounds = np.asarray(token_ids, dtype=np.int32), np.asarray(offsets, dtype=np.int64)
    elif getattr(mask, "ids", None) is not None and getattr(mask, "counts", None) is not None:
        # flat `ids` + per-token `counts` (the transport of PrimeIntellect prime-rl PR #3431 / verifiers PR #2460)
        flat = np.asarray(mask.ids, dtype=np.int32)
        bounds = np.concatenate([[0], np.cumsum(np.asarray(mask.counts, dtype=np.int64))])
    else:
        raise ValueError(f"{where}: sampling_mask of type {type(mask).__name__} has neither `token_ids` (list of "
                         f"lists, or flat with `offsets`) nor `ids` + `counts`")
    if len(bounds) == 0 or bounds[0] != 0 or bounds[-1] != len(flat) or bool(np.any(np.diff(bounds) < 0)):
        raise ValueError(f"{where}: sampling_mask offsets must rise from 0 to len(token_ids)={len(flat)}")
    return [flat[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]


def kept_sets_from_vllm(outputs, num_steps: int | None = None, support_size_only: bool = False) -> KeptSets:
    """Kept sets of vLLM completions, one row per `CompletionOutput` (RequestOutputs are flattened in order).

    Each `CompletionOutput.sampling_mask` (engine flag `return_sampling_mask=True`, vLLM >= 0.28; needs Model Runner
    V2, temperature > 0 and top_k > 0; vLLM 0.33 `vllm/outputs.py`) may be laid out as
    - `SamplingMask(token_ids: list[list[int]])`, one list per generated token (vllm/outputs.py), or
    - the CSR of vLLM PR #49577 (Mask Replay): flat `token_ids` plus `offsets` (num_tokens + 1), or
    - flat `ids` plus per-token `counts`.

    Args:
        outputs: a sequence of vLLM `RequestOutput` and/or `CompletionOutput`.
        num_steps: T of the result (default: the longest completion); shorter completions get empty cells.
        support_size_only: keep only |S| (see `KeptSets`).

    Returns:
        `KeptSets` with N = number of completions.

    Raises:
        ValueError: a completion has no sampling_mask, or its mask does not have one set per generated token.
    """
    rows = []
    for n, comp in enumerate(_completions(outputs)):
        where = f"completion {n} (index={getattr(comp, 'index', '?')})"
        if comp.sampling_mask is None:
            raise ValueError(f"{where} has sampling_mask=None: start vLLM with return_sampling_mask=True and sample "
                             f"with top_k > 0 to get the kept sets")
        cells = _mask_cells(comp.sampling_mask, where)
        if len(cells) != len(comp.token_ids):
            raise ValueError(f"{where}: sampling_mask has {len(cells)} kept sets for {len(comp.token_ids)} "
                             f"generated tokens")
        rows.append(cells)
    kept = KeptSets.from_lists(rows, num_steps)
    return kept.size_only() if support_size_only else kept


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
    """

    logprobs: torch.Tensor
    kept: KeptSets | None


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

    Source: the batch-logprob-gap report's `grpo_effect.py` takes the rollout log-probs from
    `generate(output_scores=True)`;
    this computes the same `log_softmax(scores)[g]` streaming.
    """

    def __init__(self, support_size_only: bool = False, storage_device: torch.device | str | None = None):
        self.support_size_only = support_size_only
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

    @property
    def prompt_length(self) -> int | None:
        """P, the (padded) prompt length of the recorded generate call; None before the first step."""
        return self._prompt_len

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
        logprobs = torch.stack(logps, 1) if T else torch.zeros(N, 0)  # (N, T)
        kept = self._kept_sets(T)
        self._prev_logsm = None  # free the (N, V) buffer
        if completion_mask is not None:
            mask = completion_mask.to(device=logprobs.device, dtype=torch.bool)  # (N, T)
            logprobs = torch.where(mask, logprobs, 0.0)
            kept = kept.masked(mask.to(kept.sizes.device))
        return SamplerRecord(logprobs=logprobs.float(), kept=kept)

    def _kept_sets(self, T: int) -> KeptSets:
        """Reorder the step-major recording of the first T steps into row-major CSR."""
        N = self._sizes[0].shape[0]
        sizes_sm = torch.stack(self._sizes[:T]) if T else torch.zeros(0, N, dtype=torch.int32)  # (T, N)
        sizes = sizes_sm.T.contiguous()  # (N, T)
        if self.support_size_only:
            return KeptSets(sizes, support_size_only=True)
        ids_sm = torch.cat(self._ids[:T]) if T else torch.zeros(0, dtype=torch.int32)  # (nnz,) step-major
        starts_sm = _offsets_from_sizes(sizes_sm)[:-1].reshape(T, N)  # (T, N)
        ids = ids_sm[_range_index(starts_sm.T.reshape(-1), sizes.reshape(-1))]  # (nnz,) row-major
        return KeptSets(sizes, ids, _offsets_from_sizes(sizes))


def _generation_model(model):
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
    target = _generation_model(model)
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
    N, T = len(completion_ids), max((len(c) for c in completion_ids), default=0)
    sequences = torch.full((N, recorder.prompt_length + T), pad_token_id, dtype=torch.long)  # (N, P+T)
    mask = torch.zeros(N, T, dtype=torch.bool)  # (N, T)
    for i, ids in enumerate(completion_ids):
        sequences[i, recorder.prompt_length : recorder.prompt_length + len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[i, : len(ids)] = True
    return recorder.finalize(sequences, mask)


# ---------------------------------------------------------------------------------------------------------------------
# vLLM colocate: the engine's outputs (kept sets from `CompletionOutput.sampling_mask`)
# ---------------------------------------------------------------------------------------------------------------------


def colocate_engine_kwargs(args, sampling_masks: bool) -> dict:
    """The `vllm.LLM(...)` arguments of TRL's colocate engine that TRL does not pass, from a `RatioGRPOConfig`:
    `return_sampling_mask` (the kept sets, `sampling_masks`), `enable_return_routed_experts` (R3's sampler routes,
    vLLM #28284), `dtype` (`vllm_dtype`) and `hf_overrides={"head_dtype": "float32"}` (`vllm_lm_head_fp32`, vLLM's
    `ModelConfig.head_dtype`). Needed before TRL builds the engine, hence read from the config, not the plan."""
    kwargs = {"return_sampling_mask": True} if sampling_masks else {}
    if args.use_vllm and args.routing_replay == "R3":
        kwargs["enable_return_routed_experts"] = True
    if args.vllm_dtype is not None:
        kwargs["dtype"] = args.vllm_dtype
    if args.vllm_lm_head_fp32:
        kwargs["hf_overrides"] = {"head_dtype": "float32"}
    return kwargs


@contextlib.contextmanager
def vllm_engine_kwargs(**extra):
    """Within the block, TRL's colocate engine is built as `vllm.LLM(..., **extra)` (TRL passes a fixed kwargs list)."""
    import trl.generation.vllm_generation as vllm_generation

    original = vllm_generation.LLM
    vllm_generation.LLM = functools.partial(original, **extra)
    try:
        yield
    finally:
        vllm_generation.LLM = original


class VLLMOutputCapture:
    """Keeps the `RequestOutput`s of the last `llm.generate` call of a vLLM engine (wraps it on the instance)."""

    def __init__(self, llm):
        self.outputs = None
        generate = llm.generate

        def capturing_generate(*args, **kwargs):
            self.outputs = generate(*args, **kwargs)
            return self.outputs

        llm.generate = capturing_generate

    def routed_experts(self, num_rows: int) -> tuple[list, list[int]]:
        """The MoE routes of the captured completions (vLLM `enable_return_routed_experts`): per completion, in TRL's
        order, `CompletionOutput.routed_experts` (an int array (seq_len - 1, num_layers, top_k), or None) and the
        length of its prompt (`RequestOutput.prompt_token_ids`). Keeps the outputs (`kept_sets` reads them too).

        Raises:
            RuntimeError: nothing captured, or the row count differs from TRL's completions.
        """
        if self.outputs is None:
            raise RuntimeError("grpo_ratio: no vLLM outputs captured for this generation batch")
        routes, lengths = [], []
        for request in self.outputs:
            for completion in request.outputs:
                routes.append(completion.routed_experts)
                lengths.append(len(request.prompt_token_ids))
        if len(routes) != num_rows:
            raise RuntimeError(f"grpo_ratio: vLLM returned {len(routes)} completions, TRL kept {num_rows}")
        return routes, lengths

    def kept_sets(self, num_rows: int) -> KeptSets:
        """KeptSets of the captured completions (one row per CompletionOutput, in TRL's order).

        Raises:
            RuntimeError: nothing captured, or the row count differs from TRL's completions.
        """
        if self.outputs is None:
            raise RuntimeError("grpo_ratio: no vLLM outputs captured for this generation batch")
        kept = kept_sets_from_vllm(self.outputs)
        self.outputs = None
        if kept.num_rows != num_rows:
            raise RuntimeError(f"grpo_ratio: vLLM returned kept sets for {kept.num_rows} completions, TRL kept "
                               f"{num_rows}")
        return kept


# ---------------------------------------------------------------------------------------------------------------------
# The sampling settings generation actually uses
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling settings of the rollouts, as the sampler applies them, and the sampler's truncation to re-apply
    to the trainer's logits (`keep_mask`, the "recompute" kept-set source).

    Fields: `temperature` (> 0), `top_k` (0 = off), `top_p` (1.0 = off), `min_p` (0.0 = off), `num_beams`,
    `do_sample`, `source` (where they were read: "generation config" or "config"), `repetition_penalty` (1.0 =
    off; the one reweighting processor the corrections re-apply, `grpo_ratio.processors.RepetitionPenalty`),
    `processors` (every other logits processor the sampler applies, as (field, value) pairs, repetition_penalty
    included when on: `grpo_ratio.processors.active_processors`) and `engine` ("generate", or "vllm": which field
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
        own warpers (`TemperatureLogitsWarper`, then `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`,
        generate's order; `min_tokens_to_keep=1`).

        The "recompute" kept-set source (NeMo-RL's approach) re-applies them to the old policy's logits: it works
        with any engine (vLLM server mode, vLLM versions without sampling masks, CPU), at the price that the
        recomputed set can differ from the sampler's at the boundary, where the trainer's and the sampler's logits
        disagree. vLLM applies the same filters in its own order and tie rules; docs/truncation.md reports how often
        the sets differ.
        """
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        warper_of = {"top_k": lambda v: TopKLogitsWarper(top_k=v), "top_p": lambda v: TopPLogitsWarper(top_p=v),
                     "min_p": lambda v: MinPLogitsWarper(min_p=v)}
        warpers = [TemperatureLogitsWarper(self.temperature)] if self.temperature != 1.0 else []
        warpers += [warper_of[name](value) for name, value in self.truncating().items()]
        scores = logits.float()  # (K, V)
        for warper in warpers:
            scores = warper(None, scores)
        return scores != -math.inf


def settings_from_config(args, vllm: bool = False) -> SamplingSettings:
    """The sampling settings a `GRPOConfig` asks for (its fields, overridden by `generation_kwargs`), as TRL passes
    them to vLLM (`vllm=True`: `generation_kwargs` are vLLM `SamplingParams`) or to transformers continuous batching;
    the `generate` path also fills unset fields from the model (`settings_from_generation_config`)."""
    gen = args.generation_kwargs or {}
    fields = {"repetition_penalty": args.repetition_penalty, **gen}
    if vllm:
        fields.setdefault("vllm_structured_outputs_regex", getattr(args, "vllm_structured_outputs_regex", None))
    table = VLLM_PROCESSORS if vllm else PROCESSORS
    return SamplingSettings(
        temperature=float(gen.get("temperature", args.temperature)),
        top_k=int(gen.get("top_k", args.top_k) or 0),
        top_p=float(gen.get("top_p", args.top_p) if gen.get("top_p", args.top_p) is not None else 1.0),
        min_p=float(gen.get("min_p", args.min_p) or 0.0),
        num_beams=int(gen.get("num_beams", 1) or 1),
        do_sample=bool(gen.get("do_sample", True)),
        source="config",
        repetition_penalty=float(fields["repetition_penalty"] or 1.0),
        processors=tuple(active_processors(fields, table).items()),
        engine="vllm" if vllm else "generate",
    )


def settings_from_generation_config(model, generation_config) -> SamplingSettings:
    """The settings transformers' `generate` will use for `model.generate(generation_config=generation_config)`:
    fields left unset (None) there are filled from the model's own `generation_config` (e.g. a `min_p` or a
    `no_repeat_ngram_size` the model ships), exactly as `GenerationMixin._prepare_generation_config` does
    (transformers 5.x)."""
    target = _generation_model(model)
    effective, _ = target._prepare_generation_config(generation_config)
    return SamplingSettings(
        temperature=float(effective.temperature if effective.temperature is not None else 1.0),
        top_k=int(effective.top_k or 0),
        top_p=float(effective.top_p if effective.top_p is not None else 1.0),
        min_p=float(effective.min_p or 0.0),
        num_beams=int(effective.num_beams or 1),
        do_sample=bool(effective.do_sample),
        source="generation config",
        repetition_penalty=float(effective.repetition_penalty or 1.0),
        processors=tuple(active_processors({n: getattr(effective, n, None) for n in PROCESSORS}).items()),
    )


def sampler_logps_key(output: dict) -> str:
    """The key of the sampler's (B, T) log-probs in a generation batch: TRL's `sampling_per_token_logps` (vLLM, or
    `sampler_logprobs_in_loss`), else the recorded `sampler_per_token_logps` the diagnostics read."""
    return "sampling_per_token_logps" if "sampling_per_token_logps" in output else "sampler_per_token_logps"


def sampler_anchor(output: dict) -> torch.Tensor:
    """`old_logprob_mode="sampler"`: the old log-probs (B, T) are the sampler's own, as recorded (generate) or
    returned (vLLM), padded with 0 like TRL pads them; over the kept set under `renormalize`, as the sampler's are.

    Raises:
        RuntimeError: a completion token without a sampler log-prob (NaN: generate was not recorded, or vLLM
            could not score it); the loss would be NaN.
    """
    key = sampler_logps_key(output)
    if key not in output:
        raise RuntimeError("old_logprob_mode='sampler': this generation returned no sampler log-probs "
                           "(a rollout_func without logprobs?)")
    sampler = output[key]  # (B, T)
    missing = torch.isnan(sampler) & output["completion_mask"].bool()  # (B, T)
    if missing.any():
        raise RuntimeError(f"old_logprob_mode='sampler': {int(missing.sum())} completion tokens have no sampler "
                           f"log-prob (NaN); they cannot anchor the ratio")
    return sampler.clone()


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
