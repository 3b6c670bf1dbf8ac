"""vLLM: what TRL's vLLM path does not give the corrections: the kept sets of each sampled token (vLLM's
`CompletionOutput.sampling_mask`, `kept_sets_from_vllm`), the engine's outputs of TRL's colocate call
(`VLLMOutputCapture`: sampling masks, routed experts) and the engine flags TRL does not pass (`colocate_engine_kwargs`,
`vllm_engine_kwargs`).

Shapes: N = sequences (rows), T = completion tokens (generation steps), V = vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import itertools

import numpy as np

from ..corrections.kept_sets import KeptSets


def _completions(outputs) -> list:
    """Flatten RequestOutputs (each with `.outputs`) and/or CompletionOutputs into a list of CompletionOutputs."""
    flat = []
    for out in outputs:
        inner = getattr(out, "outputs", None)  # RequestOutput has .outputs; CompletionOutput does not
        flat.extend(inner if inner is not None else [out])
    return flat


def _mask_cells(mask, where: str) -> tuple[np.ndarray, np.ndarray]:
    """The kept ids of one completion in CSR, from any of the three sampling-mask layouts: (nnz,) int32 ids, token
    after token, and (T,) int64 sizes, one per generated token.

    vLLM's nested layout (a Python list of ints per token) is read in one pass over all its ints (`np.fromiter` over
    the chained lists), not one array per token: 8,192 cells of 8 ids take ~2 ms instead of ~18 ms. The ints
    themselves cost what they cost: vLLM builds ~36 B of Python objects per kept id, so a wide set (top_k=1024 at
    top_p=1: 1,024 ids per token) is ~300 MB and ~0.4 s per 8,192-token completion whatever reads it."""
    token_ids = getattr(mask, "token_ids", None)
    offsets = getattr(mask, "offsets", None)
    if token_ids is not None and offsets is None:
        # vLLM 0.28 / 0.33 `SamplingMask(token_ids: list[list[int]])`: one list per generated token
        if len(token_ids) and np.ndim(token_ids[0]) == 0:
            raise ValueError(f"{where}: sampling_mask.token_ids is flat but has no `offsets` (CSR layout needs both)")
        sizes = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))  # (T,)
        flat = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int32, count=int(sizes.sum()))
        return flat, sizes
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
    return flat, np.diff(bounds)


def kept_sets_from_vllm(outputs, num_steps: int | None = None, support_size_only: bool = False,
                        device=None) -> KeptSets:
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
        device: where the sets live (default CPU): the trainer's device, so that every pass densifies them there.

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
        ids, sizes = _mask_cells(comp.sampling_mask, where)
        if len(sizes) != len(comp.token_ids):
            raise ValueError(f"{where}: sampling_mask has {len(sizes)} kept sets for {len(comp.token_ids)} "
                             f"generated tokens")
        rows.append((ids, sizes))
    kept = KeptSets.from_csr_rows(rows, num_steps, device=device)
    return kept.size_only() if support_size_only else kept


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
    """Keeps the `RequestOutput`s of the last `llm.generate` call of a vLLM engine (wraps it on the instance).
    `device`: where `kept_sets` puts the sets (the trainer's device; default CPU)."""

    def __init__(self, llm, device=None):
        self.outputs = None
        self.device = device
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
        kept = kept_sets_from_vllm(self.outputs, device=self.device)
        self.outputs = None
        if kept.num_rows != num_rows:
            raise RuntimeError(f"grpo_ratio: vLLM returned kept sets for {kept.num_rows} completions, TRL kept "
                               f"{num_rows}")
        return kept


class VLLMLogprobCapture:
    """Keeps the sampled tokens' log-probs of the last `VLLMGeneration.generate` call (wraps it on the instance), for
    a TRL trainer that drops them (RLOOTrainer: `_, completion_ids, _, _ = self.vllm_generation.generate(...)`), and
    asks for them: `vllm_generation.logprobs = 0`, the sampled token's log-prob only, which TRL's colocate engine
    computes as `processed_logprobs` (after temperature, penalties and top_k/top_p/min_p; a server must run with
    `--logprobs-mode processed_logprobs`, `checks.check_server_logprobs`).

    Args:
        vllm_generation: TRL's `VLLMGeneration` (`trainer.vllm_generation`).
    """

    def __init__(self, vllm_generation):
        self.logprobs = None
        vllm_generation.logprobs = 0
        generate = vllm_generation.generate

        def capturing_generate(*args, **kwargs):
            prompt_ids, completion_ids, logprobs, token_ids = generate(*args, **kwargs)
            self.logprobs = logprobs
            return prompt_ids, completion_ids, logprobs, token_ids

        vllm_generation.generate = capturing_generate

    def take(self, num_rows: int) -> list[list[float | None]]:
        """The sampled tokens' log-probs of the last call, one list per completion in TRL's order (vLLM's `None` for
        a NaN log-prob kept, as GRPOTrainer keeps it); cleared after.

        Raises:
            RuntimeError: nothing captured, or the row count differs from TRL's completions.
        """
        if self.logprobs is None:
            raise RuntimeError("grpo_ratio: no vLLM log-probs captured for this generation batch")
        rows, self.logprobs = [[top[0] for top in row] for row in self.logprobs], None  # top-1 = the sampled token
        if len(rows) != num_rows:
            raise RuntimeError(f"grpo_ratio: vLLM returned log-probs for {len(rows)} completions, TRL kept {num_rows}")
        return rows
