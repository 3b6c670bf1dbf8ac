"""`grpo-ratio probe batch`: the bf16 batch-shape gap, dtype x batch size (seed 004 table T1, `hf_only.py`).

The same sampled completions are scored teacher-forced at batch 1 and at batch 8 (and 32), with the model's weights
cast to bf16, fp16 and fp32 and run natively (no autocast), log-softmax in fp32. Reported per dtype: the out-of-band
rate of r = exp(logp_b8 - logp_b1) with its Wilson 95% interval, max |logp_b8 - logp_b1|, and the rerun control
(bf16 batch 1 scored twice; the seed measured 0 tokens moved: the gap is a deterministic function of the batch shape,
not nondeterminism). Rows are chunked in order, exactly as TRL chunks its old pass, so a row carries the same
padding at every batch size and only the batch shape differs.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
from tqdm.auto import tqdm

from ..scoring import score_completion_logprobs
from .common import DTYPES, Completions, compare, pct, pct_ci


def score_native(model, data: Completions, batch_size: int) -> torch.Tensor:
    """(B, T) fp32 log-probs of the completion tokens with `model` run in its own weight dtype (no autocast),
    rows chunked by `batch_size` in order (TRL's old pass)."""
    return score_completion_logprobs(model, data.input_ids, data.attention_mask, data.logits_to_keep, mode="bf16",
                                     batch_size=batch_size, policy_autocast=contextlib.nullcontext)


def run_batch(model, data: Completions, batch_sizes=(8,), dtypes=("bf16", "fp16", "fp32"), rerun_dtype="bf16",
              progress: bool = True) -> dict:
    """Batch 1 vs each of `batch_sizes` for each dtype; `model` holds fp32 weights and is not modified.

    Returns:
        {dtype: {"b1_vs_b{s}": compare(...), "rerun": compare(...) (rerun_dtype only), "seconds": float}};
        `compare` gives num_tokens, num_oob, oob_rate, oob_ci95, max_abs_dlogp, num_nonfinite.
    Raises:
        ValueError: an unknown dtype (allowed: bf16, fp16, fp32).
    """
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"dtypes {bad} unknown; allowed: {', '.join(DTYPES)}")
    results = {}
    for name in tqdm(dtypes, desc="batch: dtypes", disable=not progress):
        t0 = time.perf_counter()
        m = model if DTYPES[name] == torch.float32 else copy.deepcopy(model).to(DTYPES[name])
        b1 = score_native(m, data, 1)  # (B, T)
        res = {}
        for s in batch_sizes:
            res[f"b1_vs_b{s}"] = compare(score_native(m, data, s), b1, data.valid)
        if name == rerun_dtype:
            res["rerun"] = compare(score_native(m, data, 1), b1, data.valid)
        res["seconds"] = time.perf_counter() - t0
        results[name] = res
        del m
    return results


def markdown(payload: dict) -> str:
    """The result as markdown: one row per dtype (seed table T1's columns, transposed)."""
    r, info = payload["results"], payload["info"]
    sizes = payload["batch_sizes"]
    head = ["dtype", "tokens"] + [f"b1 vs b{s} OOB [95% CI]" for s in sizes] + \
        [f"max abs dlogp b1 vs b{s}" for s in sizes] + ["b1 rerun OOB", "rerun max abs dlogp", "seconds"]
    lines = [f"### batch: {info['model']} ({info['num_sequences']} sequences, {info['num_tokens']} completion tokens, "
             f"<= {info['max_new_tokens']} new tokens, seed {info['seed']})", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dtype, res in r.items():
        rerun = res.get("rerun")
        cells = [dtype, str(res[f"b1_vs_b{sizes[0]}"]["num_tokens"])]
        cells += [pct_ci(res[f"b1_vs_b{s}"]) for s in sizes]
        cells += [f"{res[f'b1_vs_b{s}']['max_abs_dlogp']:.2g}" for s in sizes]
        cells += [pct(rerun["oob_rate"]) if rerun else "-", f"{rerun['max_abs_dlogp']:.2g}" if rerun else "-",
                  f"{res['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Share of valid completion tokens whose importance ratio exp(logp_bN - logp_b1) lies outside "
              "[0.9, 1.1] (strict; non-finite counts as out of band), weights cast to the dtype and run without "
              "autocast, log-softmax in fp32. Rerun: batch 1 scored twice.", ""]
    return "\n".join(lines)
