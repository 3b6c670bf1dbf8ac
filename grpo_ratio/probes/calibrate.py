"""`grpo-ratio probe calibrate`: the smallest guided fp32 layer set that meets a target out-of-band rate, and its
cost (the batch-logprob-gap report's `selective_fp32.py`, tables T7/T7b, turned into a search).

Layers are added in decreasing order of their divergence increment (from a `probe layers` calibration file or
layers.json, or measured here on the selection split), always with the final norm and LM head in fp32: k = 0 is
`fp32_head`, k >= 1 is `guided_fp32` with the top-k layers. Each candidate is scored on the held-out evaluation split at batch 1 (each
sequence alone) and batch 8 (the padded batch); the search stops at the first k whose out-of-band rate is <= target.
The cost is the time of the batch-8 pass relative to the `bf16` mode's, on the same data (one timed pass after an
untimed one).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..modes import FP32_HEAD, GUIDED_FP32
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


def measure(model, data: Completions, mode: str, layers: list[int] | None, batch_size: int) -> dict:
    """compare(batch `batch_size`, each sequence alone) for one scoring mode, plus `seconds` of the batch pass."""
    scorer = OldLogprobScorer(model, mode, layers=layers or None)
    b1 = score_alone(lambda ids, mask, t: scorer.score(ids, mask, t, batch_size=1).logps, data)  # (B, T); builds copies
    args = (data.input_ids, data.attention_mask, data.logits_to_keep)
    bn = scorer.score(*args, batch_size=batch_size).logps  # (B, T); untimed: the first pass at a shape pays kernel set-up
    t0 = time.perf_counter()
    scorer.score(*args, batch_size=batch_size)
    return {**compare(bn, b1, data.valid), "seconds": time.perf_counter() - t0}


def run_calibrate(model, data: Completions, ranking: list[int], target: float, batch_size: int = 8,
                  max_layers: int | None = None, progress: bool = True) -> dict:
    """Search k = 0, 1, ... over the top-k layers of `ranking` until the OOB rate is <= `target`.

    Args:
        model: fp32 weights (TRL's regime; `bf16` = bf16 autocast).
        ranking: decoder-layer indices by decreasing divergence increment.
        target: the out-of-band rate to reach, in [0, 1].
        max_layers: stop after this many layers (default all of `ranking`).
    Returns:
        {"bf16": measure(bf16), "steps": [{"k", "layers", **measure, "time_vs_bf16"}], "reached": bool,
        "guided_fp32_layers": the chosen set (sorted; [] = fp32_head suffices), "recommended_mode"}.
    Raises:
        ValueError: target outside [0, 1].
    """
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"--target must be an out-of-band rate in [0, 1], got {target}")
    base = measure(model, data, "bf16", None, batch_size)
    steps, reached = [], False
    limit = len(ranking) if max_layers is None else min(max_layers, len(ranking))
    for k in tqdm(range(limit + 1), desc="calibrate: layers", disable=not progress):
        layers = sorted(ranking[:k])
        res = measure(model, data, GUIDED_FP32.name if k else FP32_HEAD.name, layers, batch_size)
        steps.append({"k": k, "layers": layers, **res, "time_vs_bf16": res["seconds"] / base["seconds"]})
        if res["oob_rate"] <= target:
            reached = True
            break
    chosen = steps[-1]["layers"]
    return {"bf16": base, "steps": steps, "reached": reached, "target": target, "guided_fp32_layers": chosen,
            "recommended_mode": GUIDED_FP32.name if chosen else FP32_HEAD.name}


def plot_payload(payload: dict, path) -> bool:
    """The search: out-of-band rate (percent, Wilson 95% error bars) against the number k of fp32 decoder layers
    (k = 0: fp32_head), with the target and the bf16 mode as horizontal lines; saved as a PNG at `path`. Returns
    True."""
    plt = pyplot()
    r = payload["result"]
    ks = [s["k"] for s in r["steps"]]
    rates, err = rate_errors(r["steps"])
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    ax.errorbar(ks, rates, yerr=err, fmt="o-", capsize=3, label="fp32 head + top-k layers")
    ax.axhline(100 * r["target"], color="tab:red", linestyle="--", label=f"target {pct(r['target'])}")
    ax.axhline(100 * r["bf16"]["oob_rate"], color="tab:gray", linestyle=":", label="bf16 (no fp32)")
    ax.set_xticks(ks)
    ax.set_xlabel("fp32 decoder layers k (+ final norm and LM head)")
    return finish_oob_plot(fig, ax, path, f"out-of-band tokens, b1 vs b{payload['batch_size']} (%)",
                           f"{payload['info']['model']}: guided fp32 calibration")


def markdown(payload: dict) -> str:
    """The search, one row per candidate, and the choice."""
    info, r = payload["info"], payload["result"]
    lines = [(f"### calibrate: {info['model']} (target OOB <= {pct(r['target'])}, {info['num_tokens']} held-out "
             f"tokens, batch 1 vs {payload['batch_size']})"), "",
             "| fp32 decoder layers (+ norm, head) | OOB [95% CI] | max abs dlogp | time vs bf16 |",
             "|---|---|---|---|",
             f"| bf16 (none, no fp32 head) | {pct_ci(r['bf16'])} | {r['bf16']['max_abs_dlogp']:.2g} | 1.00x |"]
    for s in r["steps"]:
        name = ",".join(map(str, s["layers"])) or "none (fp32_head)"
        lines.append(f"| {name} | {pct_ci(s)} | {s['max_abs_dlogp']:.2g} | {s['time_vs_bf16']:.2f}x |")
    verdict = (f"reached with {len(r['guided_fp32_layers'])} layer(s): old_logprob_mode='{r['recommended_mode']}'"
               + (f", guided_fp32_layers='{','.join(map(str, r['guided_fp32_layers']))}'" if r["guided_fp32_layers"]
                  else "") if r["reached"] else "NOT reached with the layers tried")
    lines += ["", f"Target {verdict}. Layer order from {payload['ranking_source']}.", ""]
    return "\n".join(lines + recommendation(payload))


def recommendation(payload: dict) -> list[str]:
    """The conclusion: the chosen set, how much of the bf16 gap it removes and at what (CPU) time, and whether its
    interval clears the target."""
    r = payload["result"]
    last, base = r["steps"][-1], r["bf16"]["oob_rate"]
    layers = ",".join(map(str, r["guided_fp32_layers"]))
    mode = f"`{r['recommended_mode']}`" + (f" with guided_fp32_layers='{layers}'" if layers else "")
    removed = share_removed(last["oob_rate"], base)
    gap = "" if removed is None else f", {removed:.0%} of the bf16 gap removed"
    sentences = [f"On this model, {mode} brings the out-of-band rate from {pct(base)} to {pct(last['oob_rate'])}"
                 f"{gap}, at {last['time_vs_bf16']:.2f}x bf16's time on this CPU (one timed pass)."]
    if not r["reached"]:
        sentences.append(f"It does not reach the target {pct(r['target'])}: raise --max-layers, or use "
                         "`fp32_clone` (no batch-shape gap at all in `probe ladder`).")
    caveats = []
    hi = last["oob_ci95"][1]
    if r["reached"] and hi > r["target"]:
        caveats.append(f"The 95% interval of the chosen set reaches {pct(hi)}, above the target: on "
                       f"{last['num_tokens']} held-out tokens the target is met by the estimate, not beyond doubt; "
                       "more prompts (--num-prompts) decide.")
    caveats += load_caveat({("+".join(map(str, st["layers"])) or FP32_HEAD.name): st["time_vs_bf16"]
                            for st in r["steps"]})
    caveats.append(CPU_TIMING)
    return recommendation_block(sentences, caveats)


# ---------------------------------------------------------------------------------------------------------------------
# command line: `grpo-ratio probe calibrate`

HELP = "smallest fp32 layer set (by increment, plus norm and head) meeting --target on held-out prompts, with its cost"


def add_arguments(p) -> None:
    common.add_common_arguments(p)
    p.add_argument("--target", type=float, default=0.01, help="out-of-band rate to reach (default 0.01 = 1%%)")
    p.add_argument("--calibration", default=None,
                   help="layer order from a `probe layers` calibration JSON or its layers.json; default: measured here "
                        "on the selection split (the last --num-prompts prompts)")
    p.add_argument("--max-layers", type=int, default=None, help="try at most this many decoder layers")
    p.add_argument("--calibration-out", default=None, help="calibration JSON path; default OUT/calibration.json")


def _ranking(args, model, tok) -> tuple[list[int], str]:
    """Layer order by decreasing increment: from --calibration, or a `layers` measurement on the selection split."""
    from .layers import run_layers

    if args.calibration:
        try:
            with open(args.calibration) as f:
                data = json.load(f)
            # a `probe layers` calibration file, or the probe's own result (layers.json: increments under "result")
            inc = data["increments"] if "increments" in data else data["result"]["increments"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise common.ProbeError(f"--calibration {args.calibration!r}: not a `probe layers` calibration JSON or "
                                    f"layers.json with an 'increments' list ({type(err).__name__}: {err})") from None
        if len(inc) != model.config.num_hidden_layers:
            raise common.ProbeError(f"--calibration {args.calibration!r} has {len(inc)} increments, the model has "
                                    f"{model.config.num_hidden_layers} decoder layers")
        return sorted(range(len(inc)), key=lambda i: -inc[i]), args.calibration
    prompts, idx = common.load_prompts(args, split="select")
    data = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=common.is_gsm8k(args))
    return run_layers(model, data, args.batch_size)["ranking"], f"selection prompts {idx[0]}..{idx[-1]}"


def run(args) -> list:
    """Search the smallest fp32 layer set meeting --target; write calibrate.json/.md/.png and a calibration JSON."""
    if not 0.0 <= args.target <= 1.0:
        raise common.ProbeError(f"--target must be an out-of-band rate in [0, 1], got {args.target}")
    prompts, idx = common.load_prompts(args)  # the evaluation split: the first --num-prompts
    if args.calibration is None:
        common.load_prompts(args, split="select")  # fail before loading the model unless a disjoint selection split exists
    common.check_batch_size(args.batch_size, len(prompts))
    model, tok = common.load_model(args.model)
    ranking, source = _ranking(args, model, tok)
    data = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=common.is_gsm8k(args))
    result = run_calibrate(model, data, ranking, args.target, args.batch_size, args.max_layers,
                           progress=not args.no_progress)
    payload = {"probe": "calibrate", "info": common.run_info(args, model, idx, data), "batch_size": args.batch_size,
               "ranking": ranking, "ranking_source": source, "result": result}
    paths = common.write_results(args.out, "calibrate", payload, markdown(payload), plot_payload)
    calib = Path(args.calibration_out or Path(args.out) / "calibration.json")
    calib.parent.mkdir(parents=True, exist_ok=True)
    record = {"guided_fp32_layers": result["guided_fp32_layers"], "model": args.model,
              "num_layers": model.config.num_hidden_layers,  # checked against the trained model (lints)
              "recommended_mode": result["recommended_mode"], "target": args.target, "reached": result["reached"],
              "ranking": ranking, "ranking_source": source, "eval_prompts": {"path": payload["info"]["prompts"],
                                                                             "indices": idx},
              "source": "grpo-ratio probe calibrate"}
    calib.write_text(json.dumps(record, indent=2) + "\n")
    return paths + [calib]
