"""`grpo-ratio probe greedy`: does greedy decoding agree across precisions? (seed 000, "Greedy decoding has a
precision clause", after Du et al.: Exact Agreement Rate and top-two logit margins.)

Each prompt is decoded greedily, alone (batch 1, so the batch shape plays no part), with the model's weights cast to
each dtype and run natively. Reported per pair of dtypes:

- EAR, the exact agreement rate: the share of prompts whose complete generated token sequences are identical
  (one differing token makes a pair divergent), with a Wilson 95% interval;
- the first divergent step of each divergent pair, and the top-two logit margin of the FIRST dtype at that step
  (z(v1) - z(v2) of its own logits, in fp32): the seed's account is that flips happen where this margin is small;
- the within-format control: the first dtype decoded twice must agree on every prompt (EAR 100%).
"""

from __future__ import annotations

import copy
import statistics

import torch
from tqdm.auto import tqdm

from .common import DTYPES, format_prompt, pct, wilson_interval


@torch.no_grad()
def greedy_decode(model, tokenizer, texts: list[str], max_new_tokens: int) -> list[dict]:
    """Greedy-decode each prompt alone. Returns per prompt {"tokens": [int], "margins": [float]}: generated ids and the
    fp32 top-two logit margin at each step (the raw logits: no sampling processors are active under greedy)."""
    out = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        gen = model.generate(**ids, do_sample=False, temperature=None, top_p=None, top_k=None,
                             max_new_tokens=max_new_tokens, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tokenizer.pad_token_id)
        tokens = gen.sequences[0, ids["input_ids"].size(1):].tolist()
        top2 = torch.stack(gen.logits).float()[:, 0].topk(2, dim=-1).values  # (steps, 2)
        out.append({"tokens": tokens, "margins": (top2[:, 0] - top2[:, 1]).tolist()})
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


def run_greedy(model, tokenizer, prompts: list[str], max_new_tokens: int, dtypes=("bf16", "fp16", "fp32"),
               gsm8k: bool = False, progress: bool = True) -> dict:
    """Greedy decodings per dtype (the first dtype twice), and the agreement of every pair with the first dtype and
    of fp16 with fp32. `model` holds fp32 weights and is not modified."""
    texts = [format_prompt(tokenizer, p, gsm8k) for p in prompts]
    runs = {}
    for name in tqdm(dtypes, desc="greedy: dtypes", disable=not progress):
        m = model if DTYPES[name] == torch.float32 else copy.deepcopy(model).to(DTYPES[name])
        runs[name] = greedy_decode(m, tokenizer, texts, max_new_tokens)
        if name == dtypes[0]:
            runs[f"{name}_rerun"] = greedy_decode(m, tokenizer, texts, max_new_tokens)
    first = dtypes[0]
    pairs = {f"{first}_vs_{first}_rerun": agreement(runs[first], runs[f"{first}_rerun"])}
    for other in dtypes[1:]:
        pairs[f"{first}_vs_{other}"] = agreement(runs[first], runs[other])
    if "fp16" in dtypes and "fp32" in dtypes and first != "fp16":
        pairs["fp16_vs_fp32"] = agreement(runs["fp16"], runs["fp32"])
    return {"pairs": pairs, "tokens": {k: [r["tokens"] for r in v] for k, v in runs.items()}}


def markdown(payload: dict) -> str:
    """One row per pair of decodings."""
    info, pairs = payload["info"], payload["result"]["pairs"]
    lines = [(f"### greedy: {info['model']} ({len(info['prompt_indices'])} prompts, {info['max_new_tokens']} new "
             "tokens, each prompt alone)"), "",
             ("| pair | EAR [95% CI] | divergent | median first divergent step | median top-2 margin there | "
             "median top-2 margin, all steps |"), "|---|---|---|---|---|---|"]
    for name, p in pairs.items():
        lo, hi = p["ear_ci95"]
        steps = p["first_divergence"]
        med_step = f"{statistics.median(steps):g}" if steps else "-"
        med_margin = f"{p['median_margin_at_divergence']:.3g}" if p["median_margin_at_divergence"] is not None else "-"
        lines.append(f"| {name} | {pct(p['ear'])} [{100 * lo:.0f}, {100 * hi:.0f}] | "
                     f"{p['num_prompts'] - p['num_agree']} | {med_step} | {med_margin} | "
                     f"{p['median_margin_all_steps']:.3g} |")
    lines += ["", ("EAR: share of prompts whose complete greedy token sequences are identical. Margins: top-two "
                   "logits "
              "of the first decoding of the pair, fp32."), ""]
    return "\n".join(lines)
