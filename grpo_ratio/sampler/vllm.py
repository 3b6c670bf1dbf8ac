"""vLLM: what TRL's vLLM path does not give the corrections: the kept sets of each sampled token (vLLM's
`CompletionOutput.sampling_mask`, `kept_sets_from_vllm`), the engine's outputs of TRL's colocate call
(`VLLMOutputCapture`: sampling masks, routed experts), the log-probs TRL does not keep (`VLLMLogprobCapture`: RLOO's
sampled tokens', the top-k of score centering) and the engine flags TRL does not pass (`colocate_engine_kwargs`,
`vllm_engine_kwargs`).

Shapes: N = sequences (rows), T = completion tokens (generation steps), V = vocabulary.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math

import numpy as np

from ..corrections.centering import DEFAULT_TOP_K
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
    `ModelConfig.head_dtype`), `max_logprobs` (`score_centering="top_k"`: k top log-probs per step). Needed before TRL builds the engine, hence read from the config, not the plan."""
    kwargs = {"return_sampling_mask": True} if sampling_masks else {}
    if args.use_vllm and getattr(args, "score_centering", None) == "top_k":  # vLLM allows 20 log-probs by default
        kwargs["max_logprobs"] = max(20, args.score_centering_top_k or DEFAULT_TOP_K)
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


def split_top_logprobs(completion_ids, logprobs, token_ids, k: int):
    """The sampled tokens' log-probs and the top-k of each step, from TRL's `VLLMGeneration.generate` answer with
    `logprobs=k` (`extract_logprobs`: per token up to k + 1 entries sorted by vLLM's rank; the sampled token is among
    the first k, or appended as entry k + 1 when it is not in the top k).

    Args:
        completion_ids (`list[list[int]]`): N completions, T_n tokens each.
        logprobs, token_ids (`list[list[list]]`): N x T_n x (k or k + 1) processed log-probs (float, `None` for NaN,
            `-inf` outside the sampler's kept set) and their token ids, rank order.
        k (`int`): how many of the top entries make the top k (>= 1).

    Returns:
        sampled (`list[list[float | None]]`): N x T_n, the sampled token's log-prob (TRL's `logprobs=0` answer,
            entry 0 of each step); top (`tuple`): ids (N, T, k) int64 and log-probs (N, T, k) fp32 CPU tensors, T = the
            longest completion; padding steps and missing entries (fewer than k returned) get distinct unused ids
            and log-prob -inf (q = 0), NaN read as -inf.

    Raises:
        RuntimeError: a step whose entries do not contain the sampled token, or row counts that differ.
    """
    import torch

    if not (len(completion_ids) == len(logprobs) == len(token_ids)):
        raise RuntimeError(f"grpo_ratio: vLLM returned {len(logprobs)} log-prob rows and {len(token_ids)} id rows "
                           f"for {len(completion_ids)} completions")
    T = max((len(c) for c in completion_ids), default=0)
    pad_ids, pad_lp = list(range(k)), [-math.inf] * k  # padding steps: distinct ids, q = 0
    sampled, top_ids, top_lps = [], [], []
    for n, (comp, row_lp, row_ids) in enumerate(zip(completion_ids, logprobs, token_ids)):
        row, row_top_ids, row_top_lps = [], [], []
        for t, (token, lps, tids) in enumerate(zip(comp, row_lp, row_ids)):
            try:
                row.append(lps[list(tids).index(token)])
            except ValueError:
                raise RuntimeError(f"grpo_ratio: vLLM's top log-probs of completion {n}, step {t} do not contain the "
                                   f"sampled token {token}") from None
            cell_ids, cell_lps = list(tids[:k]), [-math.inf if x is None else x for x in lps[:k]]
            if len(cell_ids) < k:  # fewer returned (a vocabulary under k): distinct unused ids, q = 0
                used = set(cell_ids)
                cell_ids += [i for i in range(k + len(used)) if i not in used][: k - len(cell_ids)]
                cell_lps += [-math.inf] * (k - len(cell_lps))
            row_top_ids.append(cell_ids)
            row_top_lps.append(cell_lps)
        pad = T - len(row_top_ids)
        top_ids.append(row_top_ids + [pad_ids] * pad)
        top_lps.append(row_top_lps + [pad_lp] * pad)
        sampled.append(row)
    # one tensor per batch from the nested lists (N, T, k), not one per step
    ids = torch.tensor(top_ids, dtype=torch.int64).reshape(len(completion_ids), T, k)
    logq = torch.tensor(top_lps, dtype=torch.float32).reshape(len(completion_ids), T, k)
    return sampled, (ids, logq)


class VLLMLogprobCapture:
    """Asks TRL's vLLM generation for log-probs and keeps those of the last `VLLMGeneration.generate` call (wraps it on
    the instance).

    - The sampled tokens' log-probs, for a TRL trainer that drops them (RLOOTrainer: `_, completion_ids, _, _ =
      self.vllm_generation.generate(...)`): `vllm_generation.logprobs = 0`, the sampled token's log-prob only, which
      TRL's colocate engine computes as `processed_logprobs` (after temperature, penalties and top_k/top_p/min_p; a
      server must run with `--logprobs-mode processed_logprobs`, `checks.check_server_logprobs`).
    - With `top_k`: the sampler's top-k log-probs of every step (`score_centering="top_k"`, arXiv 2609.20807, as SkyRL
      PR #2244 and miles PR #3317 read vLLM's `logprobs=k`): `vllm_generation.logprobs = top_k`; the caller (TRL's
      trainer) still gets the `logprobs=0` answer, the sampled token's log-prob as entry 0 (`split_top_logprobs`), so
      TRL's own IS correction reads what it reads without us, bit for bit.

    Args:
        vllm_generation: TRL's `VLLMGeneration` (`trainer.vllm_generation`).
        top_k (`int`, defaults to 0): how many top log-probs per step to keep (0: none).
    """

    def __init__(self, vllm_generation, top_k: int = 0):
        self.logprobs = None
        self.top = None
        self.top_k = top_k
        vllm_generation.logprobs = top_k
        generate = vllm_generation.generate

        def capturing_generate(*args, **kwargs):
            prompt_ids, completion_ids, logprobs, token_ids = generate(*args, **kwargs)
            if top_k and logprobs is not None:
                logprobs, self.top = split_top_logprobs(completion_ids, logprobs, token_ids, top_k)
                logprobs = [[[lp] for lp in row] for row in logprobs]  # (N, T_n, 1) as with logprobs=0
                token_ids = [[[tok] for tok in row] for row in completion_ids]
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
        rows, self.logprobs = [[top[0] for top in row] for row in self.logprobs], None  # entry 0 = the sampled token
        if len(rows) != num_rows:
            raise RuntimeError(f"grpo_ratio: vLLM returned log-probs for {len(rows)} completions, TRL kept {num_rows}")
        return rows

    def take_top(self, num_rows: int, device=None) -> tuple:
        """The top-k of the last call: ids (N, T, k) int64 and log-probs (N, T, k) fp32 on `device`; cleared after.

        Raises:
            RuntimeError: nothing captured (no `top_k`, or vLLM returned no log-probs), or the row count differs from
                TRL's completions.
        """
        if self.top is None:
            raise RuntimeError("grpo_ratio: no vLLM top-k log-probs captured for this generation batch")
        (ids, logq), self.top = self.top, None
        if ids.size(0) != num_rows:
            raise RuntimeError(f"grpo_ratio: vLLM returned top-k log-probs for {ids.size(0)} completions, TRL kept "
                               f"{num_rows}")
        return ids.to(device), logq.to(device)
