"""`grpo-ratio probe batch`: the bf16 batch-shape gap, dtype x batch size (the batch-logprob-gap report, table T1,
`hf_only.py`).

The same sampled completions are scored teacher-forced at batch 1 and at batch 8 (and 32), with the model's weights
cast to bf16, fp16 and fp32 and run natively (no autocast), log-softmax in fp32; and, as `autocast`, with fp32 weights
under bf16 autocast: TRL's default training regime, whose old pass is the `bf16` scoring mode. Reported per dtype: the out-of-band
rate of r = exp(logp_b8 - logp_b1) with its Wilson 95% interval, max |logp_b8 - logp_b1|, and the rerun control
(bf16 batch 1 scored twice; the report measured 0 tokens moved: the gap is a deterministic function of the batch shape,
not nondeterminism).

Batch 1 is each sequence alone, with no padding (the report's definition); batch 8 is the right-padded batch in TRL's
layout, chunked in order as TRL chunks its old pass. A third comparison, `b1_padded`,
scores the rows of the padded batch one at a time (TRL with per_device_train_batch_size=1): it keeps the padding and
changes only the number of rows, so it separates the batch size from the padding (`probe controls` goes further).
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
from tqdm.auto import tqdm

from ..modes import BF16
from ..old_pass.scorer import score_completion_logprobs
from . import common
from .common import (
    CPU_TIMING,
    DTYPES,
    Completions,
    compare,
    finish_oob_plot,
    pct,
    pct_ci,
    pyplot,
    rate_errors,
    recommendation_block,
    score_alone,
    share_removed,
)


AUTOCAST = "autocast"  # fp32 weights under bf16 autocast (TRL's default), next to the weight dtypes of DTYPES
REGIMES = (*DTYPES, AUTOCAST)


def score_native(model, data: Completions, batch_size: int, autocast: bool = False) -> torch.Tensor:
    """(B, T) fp32 log-probs of the completion tokens with `model` run in its own weight dtype (no autocast; with
    `autocast`, fp32 weights under bf16 autocast as TRL trains), rows chunked by `batch_size` in order (TRL's old
    pass)."""
    return score_completion_logprobs(model, data.input_ids, data.attention_mask, data.logits_to_keep, mode=BF16.name,
                                     batch_size=batch_size, policy_autocast=None if autocast else contextlib.nullcontext)


def score_native_alone(model, data: Completions, autocast: bool = False) -> torch.Tensor:
    """(B, T) fp32 log-probs with each sequence scored alone, unpadded, in the model's own dtype (no autocast; with
    `autocast`, fp32 weights under bf16 autocast)."""
    context = None if autocast else contextlib.nullcontext
    return score_alone(lambda ids, mask, t: score_completion_logprobs(
        model, ids, mask, t, mode=BF16.name, policy_autocast=context), data)


def run_batch(model, data: Completions, batch_sizes=(8,), dtypes=("bf16", "fp16", "fp32"), rerun_dtype="bf16",
              progress: bool = True) -> dict:
    """Batch 1 vs each of `batch_sizes` for each dtype (or `autocast`: the fp32 model under bf16 autocast); `model`
    holds fp32 weights and is not modified.

    Returns:
        {dtype: {"b1_vs_b{s}": compare(b{s}, alone), "b1_padded_vs_b{s}": compare(b{s}, padded rows one at a
        time), "rerun": compare(alone, alone again) (rerun_dtype only), "seconds": float}};
        `compare` gives num_tokens, num_oob, oob_rate, oob_ci95, max_abs_dlogp, num_nonfinite.
    Raises:
        ValueError: an unknown dtype (allowed: bf16, fp16, fp32, autocast).
    """
    bad = [d for d in dtypes if d not in REGIMES]
    if bad:
        raise ValueError(f"dtypes {bad} unknown; allowed: {', '.join(REGIMES)}")
    results = {}
    for name in tqdm(dtypes, desc="batch: dtypes", disable=not progress):
        t0 = time.perf_counter()
        auto = name == AUTOCAST
        m = model if auto or DTYPES[name] == torch.float32 else copy.deepcopy(model).to(DTYPES[name])
        b1 = score_native_alone(m, data, auto)  # (B, T)
        b1_padded = score_native(m, data, 1, auto)  # (B, T)
        res = {}
        for s in batch_sizes:
            bs = score_native(m, data, s, auto)  # (B, T)
            res[f"b1_vs_b{s}"] = compare(bs, b1, data.valid)
            res[f"b1_padded_vs_b{s}"] = compare(bs, b1_padded, data.valid)
        if name == rerun_dtype:
            res["rerun"] = compare(score_native_alone(m, data, auto), b1, data.valid)
        res["seconds"] = time.perf_counter() - t0
        results[name] = res
        del m
    return results


def plot_payload(payload: dict, path) -> bool:
    """Grouped bars: per dtype, the out-of-band rate (percent) of batch 1 vs each batch size, with the Wilson 95%
    interval as error bars; saved as a PNG at `path`. Returns True (a figure was written)."""
    plt = pyplot()
    r, sizes = payload["results"], payload["batch_sizes"]
    dtypes = list(r)
    width = 0.8 / len(sizes)
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 * len(dtypes)), 3.5))
    for j, s in enumerate(sizes):
        rates, err = rate_errors([r[d][f"b1_vs_b{s}"] for d in dtypes])
        x = [i + (j - (len(sizes) - 1) / 2) * width for i in range(len(dtypes))]
        ax.bar(x, rates, width, yerr=err, capsize=3, label=f"b1 vs b{s}")
    ax.set_xticks(range(len(dtypes)), dtypes)
    ax.set_xlabel("weight dtype (no autocast; autocast = fp32 weights under bf16 autocast)")
    return finish_oob_plot(fig, ax, path, "out-of-band tokens (%)",
                           f"{payload['info']['model']}\nratio outside [0.9, 1.1], Wilson 95% CI")


def markdown(payload: dict) -> str:
    """The result as markdown: one row per dtype (the report's table T1 columns, transposed)."""
    r, info = payload["results"], payload["info"]
    sizes = payload["batch_sizes"]
    head = ["dtype", "tokens"] + [f"b1 vs b{s} OOB [95% CI]" for s in sizes] + \
        [f"max abs dlogp b1 vs b{s}" for s in sizes] + [f"b1 padded vs b{sizes[0]} OOB", "max abs dlogp"] + \
        ["b1 rerun OOB", "rerun max abs dlogp", "seconds"]
    lines = [(f"### batch: {info['model']} ({info['num_sequences']} sequences, {info['num_tokens']} completion "
              "tokens, "
             f"<= {info['max_new_tokens']} new tokens, seed {info['seed']})"), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dtype, res in r.items():
        rerun = res.get("rerun")
        cells = [dtype, str(res[f"b1_vs_b{sizes[0]}"]["num_tokens"])]
        cells += [pct_ci(res[f"b1_vs_b{s}"]) for s in sizes]
        cells += [f"{res[f'b1_vs_b{s}']['max_abs_dlogp']:.2g}" for s in sizes]
        padded = res[f"b1_padded_vs_b{sizes[0]}"]
        cells += [pct(padded["oob_rate"]), f"{padded['max_abs_dlogp']:.2g}"]
        cells += [pct(rerun["oob_rate"]) if rerun else "-", f"{rerun['max_abs_dlogp']:.2g}" if rerun else "-",
                  f"{res['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", ("Share of valid completion tokens whose importance ratio exp(logp_bN - logp_b1) lies outside "
              "[0.9, 1.1] (strict; non-finite counts as out of band), weights cast to the dtype and run without "
              "autocast, log-softmax in fp32. b1: each sequence alone, unpadded; bN: the right-padded batch in "
              "TRL's layout; "
              "b1 padded: the padded rows one at a time (TRL at per_device_train_batch_size=1). Rerun: b1 twice. "
              "autocast: fp32 weights under bf16 autocast (TRL's default regime)."), ""]
    return "\n".join(lines + recommendation(payload))


def recommendation(payload: dict) -> list[str]:
    """The conclusion from the numbers: how much of the bf16 gap each other dtype removes and at what (CPU) time,
    whether the gap is deterministic (the rerun) and whether padding or the row count moves it, and what the
    no-autocast regime means for a TRL run."""
    r, s = payload["results"], payload["batch_sizes"][0]
    key = f"b1_vs_b{s}"
    sentences, caveats = [], []
    base = r.get("bf16", {}).get(key, {}).get("oob_rate")
    if base:
        others = [d for d in r if d not in ("bf16", AUTOCAST)]
        parts = [f"{d} removes {share_removed(r[d][key]['oob_rate'], base):.0%} of it" for d in others]
        sentences.append(f"On this model bf16 weights move {pct(base)} of tokens out of band between batch 1 and "
                         f"batch {s}" + (f"; {'; '.join(parts)}." if parts else "."))
    elif base == 0:
        sentences.append(f"On this model bf16 weights move no token out of band between batch 1 and batch {s}: "
                         "there is no batch-shape gap to remove.")
    rerun = next((x["rerun"] for x in r.values() if "rerun" in x), None)
    if rerun is not None:
        sentences.append("The rerun moves no token: the gap is a deterministic function of the batch shape, not "
                         "nondeterminism." if rerun["num_oob"] == 0 and rerun["max_abs_dlogp"] == 0 else
                         f"The rerun moves {pct(rerun['oob_rate'])} of tokens: part of the gap is nondeterminism.")
    padded = [d for d in r if r[d][f"b1_padded_vs_b{s}"]["max_abs_dlogp"] == 0]
    if padded and len(padded) == len(r):
        sentences.append(f"Scoring the padded rows one at a time equals batch {s} bit for bit in every regime: the "
                         "padding, not the number of rows, moves the log-probs (`probe controls` separates them).")
    if AUTOCAST in r:
        sentences.append(f"In TRL's regime (fp32 weights, bf16 autocast) the gap is {pct(r[AUTOCAST][key]['oob_rate'])}"
                         ": that is what `old_logprob_mode` acts on (`probe ladder` has every mode).")
    else:
        caveats.append("The weights were cast without autocast: the regime of a model loaded in bf16 "
                       "(`model_init_kwargs={'dtype': 'bfloat16'}`) or of a bf16 inference engine (vLLM's default "
                       "for an fp32 checkpoint). TRL's default trains fp32 weights under bf16 autocast, whose gap "
                       "can differ: add `--dtypes bf16,fp16,fp32,autocast` to measure it here, or read `probe "
                       "ladder`'s `bf16` row.")
    caveats.append("The seconds column is each regime's whole measurement (copy, batch-1, padded and batch passes, "
                   "the rerun for bf16), not the cost of a mode: `probe ladder` times the scoring modes. " + CPU_TIMING)
    return recommendation_block(sentences, caveats)


# ---------------------------------------------------------------------------------------------------------------------
# command line: `grpo-ratio probe batch`

HELP = "dtype x batch size: OOB rate of batch 1 vs 8 (and 32) in bf16/fp16/fp32"


def add_arguments(p) -> None:
    common.add_common_arguments(p)
    p.add_argument("--with-32", action="store_true", help="also batch 1 vs 32 (needs 32 prompts)")
    p.add_argument("--dtypes", default="bf16,fp16,fp32,autocast",
                   help="comma-separated subset of bf16,fp16,fp32 (weights cast, no autocast) and autocast (fp32 "
                        "weights under bf16 autocast, TRL's default)")


def run(args) -> list:
    """Sample once, score at batch 1 / 8 (/ 32) per dtype, write batch.json, batch.md and batch.png."""
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in REGIMES for d in dtypes):
        raise common.ProbeError(f"--dtypes {args.dtypes!r}: expected a comma-separated subset of "
                                f"{', '.join(REGIMES)}")
    sizes = [args.batch_size] + ([32] if args.with_32 else [])
    prompts, idx = common.load_prompts(args)
    for s in sizes:
        common.check_batch_size(s, len(prompts), "--batch-size" if s == args.batch_size else "--with-32")
    model, tok = common.load_model(args.model)
    data = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=common.is_gsm8k(args))
    results = run_batch(model, data, sizes, dtypes, progress=not args.no_progress)
    payload = {"probe": "batch", "info": common.run_info(args, model, idx, data), "batch_sizes": sizes,
               "results": results}
    return common.write_results(args.out, "batch", payload, markdown(payload), plot_payload)
