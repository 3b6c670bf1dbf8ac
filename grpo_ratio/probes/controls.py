"""`grpo-ratio probe controls`: padding, batch size, or batch membership (the batch-logprob-gap report, table T2,
`pad_control.py`).

Four comparisons, all with the model's weights cast to one dtype (default bf16) and run natively, log-softmax in fp32:

- A padded ragged: each sequence alone vs the right-padded batch of 8 (TRL's layout; as `probe batch`);
- B equal-length, no padding: completions of exactly --max-new-tokens (EOS disabled), prompts left-truncated to the
  shortest prompt, so no row is padded; alone vs batch of 8. B ~ A means padding is not the explanation;
- C the same sequence x8: sequence 0 of B scored alone vs 8 identical copies scored together. C > 0 means batch size
  alone suffices;
- D two groupings of one batch: 2 x 8 sequences of B scored as rows (0..7), (8..15) and as (0, 2, .., 14),
  (1, 3, .., 15). D > 0 means batch membership matters (the report found this only for MoE routing).

On an MoE model (`grpo_ratio.routing`) each control also counts route flips: the share of scored tokens whose top-k
expert set differs between the two scorings at any layer (`probe routes`). Membership acts on an MoE model through its
routes: a D log-prob gap with D route flips is the membership channel; D flips of 0 mean the experts' kernels do not
depend on which rows share a batch (transformers' experts on CPU).
"""

from __future__ import annotations

import copy

import torch
from tqdm.auto import tqdm

from ..routing import RouteHooks, moe_layout
from . import common
from .batch import score_native, score_native_alone
from .common import Completions, compare, pct, pct_ci, recommendation_block
from .routes import flips, recorded, routes_alone


def regrouped(model, data: Completions, batch_size: int, hooks=None):
    """(B, T) log-probs with the rows grouped by stride 2 (even rows, then odd rows) into batches of `batch_size`,
    returned in the original row order; with `hooks` (an MoE model's `RouteHooks`) also the (B, P+T, L, k) routes in
    the original row order (else None)."""
    B = data.input_ids.size(0)
    order = torch.cat([torch.arange(0, B, 2), torch.arange(1, B, 2)])  # (B,)
    logps, recording = recorded(hooks, lambda: score_native(model, data.rows(order), batch_size))  # in `order`
    out = torch.empty_like(logps)
    out[order] = logps
    if recording is None:
        return out, None
    routes = torch.empty_like(recording.used())
    routes[order] = recording.used()
    return out, routes


def _batch_vs_alone(model, data: Completions, batch_size: int, hooks) -> dict:
    """compare(batch of `batch_size`, each row alone), with the route flips between the two on an MoE model."""
    batch, batch_rec = recorded(hooks, lambda: score_native(model, data, batch_size))
    alone, alone_rec = recorded(hooks, lambda: score_native_alone(model, data))
    result = compare(batch, alone, data.valid)
    if hooks is not None:
        result["route_flips"] = flips(batch_rec.used(), routes_alone(alone_rec, data), data)
    return result


def run_controls(model, padded: Completions, equal: Completions, batch_size: int = 8, progress: bool = True) -> dict:
    """The four controls on `model` in its own dtype; `padded` and `equal` hold >= 2 * batch_size sequences.

    Returns:
        {"A_padded_ragged", "B_equal_length_no_pad", "C_same_sequence_x8", "D_two_groupings"}: compare(...) each,
        plus "route_flips" (`probe routes`' `flips`) on an MoE model.
    """
    layout = moe_layout(model)
    hooks = RouteHooks(model) if layout is not None else None
    results = {}
    with tqdm(total=4, desc="controls", disable=not progress) as bar:
        results["A_padded_ragged"] = _batch_vs_alone(model, padded, batch_size, hooks)
        bar.update()
        results["B_equal_length_no_pad"] = _batch_vs_alone(model, equal, batch_size, hooks)
        bar.update()
        copies = equal.rows([0] * batch_size)  # (batch_size, P+T): one sequence repeated
        together, together_rec = recorded(hooks, lambda: score_native(model, copies, batch_size))
        alone, alone_rec = recorded(hooks, lambda: score_native_alone(model, equal.rows([0])))
        results["C_same_sequence_x8"] = compare(together, alone.expand(batch_size, -1), copies.valid)
        if hooks is not None:
            alone_routes = routes_alone(alone_rec, equal.rows([0])).expand(batch_size, -1, -1, -1)
            results["C_same_sequence_x8"]["route_flips"] = flips(together_rec.used(), alone_routes, copies)
        bar.update()
        grouped, grouped_routes = regrouped(model, equal, batch_size, hooks)
        in_order, in_order_rec = recorded(hooks, lambda: score_native(model, equal, batch_size))
        results["D_two_groupings"] = compare(grouped, in_order, equal.valid)
        if hooks is not None:
            results["D_two_groupings"]["route_flips"] = flips(grouped_routes, in_order_rec.used(), equal)
        bar.update()
    if hooks is not None:
        hooks.remove()
    return results


LABELS = {"A_padded_ragged": "A padded ragged, b1 vs b8", "B_equal_length_no_pad": "B equal-length, no pad, b1 vs b8",
          "C_same_sequence_x8": "C same sequence x8 vs alone", "D_two_groupings": "D two groupings of batch 8"}


def markdown(payload: dict) -> str:
    """One row per control."""
    info, r = payload["info"], payload["results"]
    lines = [(f"### controls: {info['model']} ({payload['dtype']}, {info['num_sequences']} sequences, "
             f"<= {info['max_new_tokens']} new tokens)"), "",
             "| control | tokens | OOB [95% CI] | max abs dlogp |", "|---|---|---|---|"]
    moe = all("route_flips" in res for res in r.values())
    if moe:  # the membership channel of an MoE model: its routes
        lines[-2:] = ["| control | tokens | OOB [95% CI] | max abs dlogp | routes flipped (any layer) |",
                      "|---|---|---|---|---|"]
    for key, res in r.items():
        row = f"| {LABELS[key]} | {res['num_tokens']} | {pct_ci(res)} | {res['max_abs_dlogp']:.2g} |"
        if moe:
            f = res["route_flips"]
            row += f" {f['any_differ']} of {f['tokens']} |"
        lines.append(row)
    lines += ["", ("Reading: B ~ A means padding is not the cause, B << A that it is; C > 0 means batch size alone "
                   "suffices; D > 0 means batch membership matters (the batch-logprob-gap report, on GPUs: B ~ A, "
                   "C > 0, D > 0 only under MoE routing)."), ""]
    return "\n".join(lines + recommendation(payload))


def recommendation(payload: dict) -> list[str]:
    """The reading of A-D computed from their counts and Wilson intervals, and what it means for a TRL run."""
    r = payload["results"]
    a, b, c, d = (r[k] for k in LABELS)
    sentences = []
    if a["num_oob"] == 0:
        sentences.append(f"On this model ({payload['dtype']}) the padded batch moves no token: there is no "
                         "batch-shape gap to explain.")
    elif b["oob_ci95"][1] < a["oob_ci95"][0]:
        sentences.append(f"On this model ({payload['dtype']}) padding is the cause: the padded ragged batch moves "
                         f"{pct(a['oob_rate'])} of tokens, equal-length unpadded rows {pct(b['oob_rate'])} (B << A, "
                         "the intervals apart).")
    else:
        sentences.append(f"Padding is not the explanation: equal-length unpadded rows move {pct(b['oob_rate'])} "
                         f"against the padded batch's {pct(a['oob_rate'])} (B ~ A, the intervals overlap).")
    sentences.append(f"The batch size alone {'moves' if c['num_oob'] else 'moves no token'}"
                     + (f" {pct(c['oob_rate'])} of tokens" if c["num_oob"] else "") + " (C), and batch membership "
                     + (f"moves {pct(d['oob_rate'])} (D)." if d["num_oob"] else "moves none (D)."))
    if a["num_oob"] and b["oob_ci95"][1] < a["oob_ci95"][0] and not c["num_oob"]:
        sentences.append("For a TRL run: the trainer's old pass and its training forward pad the same way, so the "
                         "padding gap does not enter new/old; it enters old/sampler wherever the sampler scores "
                         "sequences unpadded or token by token (vLLM, or generate's KV cache).")
    caveats = ["Kernels differ between devices: on GPUs the batch-logprob-gap report found B ~ A and C > 0 (the row "
               "count itself mattered); these probes run on the CPU, so repeat the reading on the training GPU's "
               "kernels before relying on it there."]
    return recommendation_block(sentences, caveats)


# ---------------------------------------------------------------------------------------------------------------------
# command line: `grpo-ratio probe controls`

HELP = "padding vs batch size vs batch membership (padded ragged, equal-length, same sequence x8, two groupings)"


def add_arguments(p) -> None:
    common.add_common_arguments(p, num_prompts=16)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="weights cast to this dtype")


def run(args) -> list:
    """Sample ragged and equal-length completions, run the four controls, write controls.json/.md."""
    prompts, idx = common.load_prompts(args)
    common.check_batch_size(2 * args.batch_size, len(prompts), "2 x --batch-size (control D)")
    model, tok = common.load_model(args.model)
    gsm8k = common.is_gsm8k(args)
    padded = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=gsm8k)
    equal = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=gsm8k,
                                      fixed_length=True)
    m = model if args.dtype == "fp32" else copy.deepcopy(model).to(common.DTYPES[args.dtype])
    results = run_controls(m, padded, equal, args.batch_size, progress=not args.no_progress)
    payload = {"probe": "controls", "info": common.run_info(args, model, idx, padded), "dtype": args.dtype,
               "batch_size": args.batch_size, "equal_length_tokens": equal.num_tokens, "results": results}
    return common.write_results(args.out, "controls", payload, markdown(payload))
