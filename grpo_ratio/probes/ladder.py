"""`grpo-ratio probe ladder`: the precision ladder of the old-logprob scoring modes (the batch-logprob-gap report,
tables T7/T7b).

Every scoring mode of `grpo_ratio.old_pass.scorer.OldLogprobScorer` scores the same sampled completions at batch 1 (each
sequence alone, unpadded) and at batch 8 (the right-padded batch in TRL's layout), on a model with fp32 weights
(TRL's default regime: fp32 weights, bf16 autocast, so `bf16` is the trainer's own pass). Reported per mode: the
out-of-band rate of exp(logp_b8 - logp_b1) with a Wilson 95% interval, max |dlogp|, the time of the batch-8 pass
relative to `bf16` (median of `repeats` passes timed round-robin so that machine load hits every mode alike, as
benchmarks/old_pass.py), and the memory the mode's copies add, relative to the policy held in bf16.
"""

from __future__ import annotations

import statistics
import time

from tqdm.auto import tqdm

from ..modes import GUIDED_FP32, PRECISION_MODES
from ..old_pass.scorer import OldLogprobScorer
from . import common
from .common import (
    CPU_TIMING,
    Completions,
    compare,
    finish_oob_plot,
    load_caveat,
    pct,
    pct_ci,
    pyplot,
    rate_errors,
    recommendation_block,
    score_alone,
    share_removed,
)


def run_ladder(model, data: Completions, batch_size: int = 8, layers: list[int] | None = None, repeats: int = 1,
               modes=PRECISION_MODES, progress: bool = True) -> dict:
    """Batch 1 vs `batch_size` for each scoring mode; `guided_fp32` only when `layers` is given.

    Args:
        model: a causal LM with fp32 weights (not modified).
        data: completions in TRL's layout.
        layers: decoder-layer indices for `guided_fp32` (e.g. from a `probe layers` calibration file).
        repeats: timed batch-`batch_size` passes per mode, after one untimed pass that gives the log-probs.
    Returns:
        {mode: {**compare(b{batch_size}, b1), "seconds": median s of the batch-size pass, "time_vs_bf16",
        "extra_bytes", "extra_vs_bf16_model"}} in ladder order.
    """
    modes = [m for m in modes if m != GUIDED_FP32.name or layers]
    scorers = {m: OldLogprobScorer(model, m, layers=layers if m == GUIDED_FP32.name else None) for m in modes}
    args = (data.input_ids, data.attention_mask, data.logits_to_keep)
    b1 = {}
    for mode, scorer in tqdm(scorers.items(), desc="ladder: batch 1", disable=not progress):
        # each sequence alone; this also warms up and builds the mode's copies before anything is timed
        b1[mode] = score_alone(lambda ids, mask, t, s=scorer: s.score(ids, mask, t, batch_size=1).logps, data)  # (B, T)
    # untimed first pass at the batch shape (kernel set-up); its log-probs are the ones compared
    bn = {m: s.score(*args, batch_size=batch_size).logps for m, s in scorers.items()}  # (B, T) each
    times = {m: [] for m in modes}
    for _ in tqdm(range(repeats), desc=f"ladder: batch {batch_size}", disable=not progress):
        for mode, scorer in scorers.items():
            t0 = time.perf_counter()
            scorer.score(*args, batch_size=batch_size)
            times[mode].append(time.perf_counter() - t0)
    bf16_model_bytes = sum(p.numel() * 2 for p in model.state_dict().values())  # the policy held in bf16
    t_bf16 = statistics.median(times["bf16"]) if "bf16" in times else float("nan")
    results = {}
    for mode in modes:
        t = statistics.median(times[mode])
        extra = scorers[mode].extra_bytes()
        results[mode] = {**compare(bn[mode], b1[mode], data.valid), "seconds": t, "time_vs_bf16": t / t_bf16,
                         "extra_bytes": extra, "extra_vs_bf16_model": extra / bf16_model_bytes}
    return results


def plot_payload(payload: dict, path) -> bool:
    """Cost against accuracy: one labelled point per scoring mode, out-of-band rate (percent, Wilson 95% error bar)
    against the batch pass's time relative to `bf16`; saved as a PNG at `path`. Returns True."""
    plt = pyplot()
    r = payload["results"]
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for mode, res in r.items():
        rates, err = rate_errors([res])
        ax.errorbar([res["time_vs_bf16"]], rates, yerr=err, fmt="o", capsize=3)
        ax.annotate(mode, (res["time_vs_bf16"], rates[0]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel(f"time of the batch-{payload['batch_size']} pass / bf16's")
    return finish_oob_plot(fig, ax, path, f"out-of-band tokens, b1 vs b{payload['batch_size']} (%)",
                           f"{payload['info']['model']}: precision ladder of the old-logprob modes", legend=False)


def markdown(payload: dict) -> str:
    """One row per scoring mode: OOB rate [CI], max |dlogp|, time and extra memory relative to bf16."""
    info, r = payload["info"], payload["results"]
    bs = payload["batch_size"]
    layers = payload.get("guided_fp32_layers")
    lines = [(f"### ladder: {info['model']} ({info['num_sequences']} sequences, {info['num_tokens']} completion "
              "tokens, "
             f"fp32 weights, batch 1 vs {bs})"), "",
             f"| mode | OOB b1 vs b{bs} [95% CI] | max abs dlogp | time vs bf16 | extra memory vs bf16 model |",
             "|---|---|---|---|---|"]
    for mode, res in r.items():
        lines.append(f"| {mode} | {pct_ci(res)} | {res['max_abs_dlogp']:.2g} | {res['time_vs_bf16']:.2f}x | "
                     f"{res['extra_vs_bf16_model']:.2f}x |")
    lines += ["", "Modes of `old_logprob_mode` on a model stored in fp32 (TRL's default: bf16 autocast). "
              + (f"guided_fp32 layers: {layers}. " if layers else "guided_fp32 not run (no --layers). ")
              + f"Time: median of {payload['repeats']} batch-{bs} pass(es), timed round-robin.", ""]
    return "\n".join(lines + recommendation(payload))


ENOUGH = 0.9  # a mode "removes the gap" when it removes at least this share of bf16's out-of-band tokens


def recommendation(payload: dict) -> list[str]:
    """The conclusion from the ladder's numbers: which mode removes how much of the bf16 gap at what cost (the
    cheapest, by this run's time, of the modes that remove >= 90% of it), with the caveats that apply."""
    r, bs = payload["results"], payload["batch_size"]
    caveats = [("The gap measured here is the old pass's batch-shape noise (batch 1 vs batch "
                f"{bs}). In training the arm's old log-probs meet the bf16 training forward: a mode that removes "
                "this gap moves the precision gap into new/old, by design. Whether that changes the reward is a "
                "comparison's question: `grpo-ratio compare` with `bf16` and this mode (docs/reading.md)."),
               CPU_TIMING, *load_caveat({m: x["time_vs_bf16"] for m, x in r.items() if m != "bf16"})]
    if payload["repeats"] < 3:
        caveats.append(f"{payload['repeats']} timed pass(es) per mode: noisy; --repeats 5 for a median worth reading.")
    base = r.get("bf16", {}).get("oob_rate")
    if not base:
        return recommendation_block([f"On this model bf16 moves no token between batch 1 and batch {bs}: no mode "
                                     "has a gap to remove; keep old_logprob_mode='bf16' (TRL's default)."], caveats)
    removed = {m: share_removed(x["oob_rate"], base) for m, x in r.items() if m != "bf16"}
    enough = [m for m in removed if removed[m] >= ENOUGH]
    best = min(enough, key=lambda m: r[m]["time_vs_bf16"]) if enough else max(removed, key=removed.get)
    x = r[best]
    sentences = [f"On this model, `{best}` removes {removed[best]:.0%} of the bf16 gap (out of band {pct(base)} -> "
                 f"{pct(x['oob_rate'])}) at {x['time_vs_bf16']:.2f}x bf16's time on this CPU and "
                 + ("no extra memory" if not x["extra_vs_bf16_model"] else
                    f"{x['extra_vs_bf16_model']:.2f}x the bf16 model's memory in copies")
                 + (f", the cheapest here of the modes that remove >= {ENOUGH:.0%} of it." if enough else
                    f"; no mode removes {ENOUGH:.0%} of it."),
                 "All modes: " + "; ".join(f"`{m}` {removed[m]:.0%} at {r[m]['time_vs_bf16']:.2f}x"
                                           for m in removed) + "."]
    return recommendation_block(sentences, caveats)


# ---------------------------------------------------------------------------------------------------------------------
# command line: `grpo-ratio probe ladder`

HELP = "every scoring mode, batch 1 vs 8: OOB rate, time and memory vs bf16"


def add_arguments(p) -> None:
    common.add_common_arguments(p)
    p.add_argument("--layers", default=None,
                   help="guided_fp32 layers: comma-separated indices or a calibration JSON (probe layers/calibrate); "
                        "without it guided_fp32 is skipped")
    p.add_argument("--repeats", type=int, default=1, help="timed batch passes per mode (median)")


def run(args) -> list:
    """Sample once, score with every mode at batch 1 / 8, write ladder.json, ladder.md and ladder.png."""
    prompts, idx = common.load_prompts(args)
    common.check_batch_size(args.batch_size, len(prompts))
    model, tok = common.load_model(args.model)
    layers = common.guided_layers(args.layers, model)
    data = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=common.is_gsm8k(args))
    results = run_ladder(model, data, args.batch_size, layers, args.repeats, progress=not args.no_progress)
    payload = {"probe": "ladder", "info": common.run_info(args, model, idx, data), "batch_size": args.batch_size,
               "guided_fp32_layers": layers, "layers_source": args.layers, "repeats": args.repeats,
               "results": results}
    return common.write_results(args.out, "ladder", payload, markdown(payload), plot_payload)
