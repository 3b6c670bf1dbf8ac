"""`grpo-ratio probe layers`: where the batch-shape divergence enters, layer by layer (the batch-logprob-gap report,
table T8, `attribution.py`), and the guided choice of fp32 layers it supports (`selective_fp32.py`).

The same completions are run at batch 1 (each sequence alone, unpadded) and at batch 8 (the right-padded batch in
TRL's layout) in the bf16 regime. Forward hooks capture the input of the
first decoder layer (depth 0) and the OUTPUT of every decoder layer (depths 1..L), so the final norm is never mixed
into the last layer's increment (HF `hidden_states[-1]` is post-norm, which inflates the last layer's); the final
norm's output is reported separately. At each depth, over the positions whose logits score a valid completion token:

    div[l] = mean_tokens ||h_b1 - h_b8|| / (||h_b1|| + 1e-6),   l = 0..L     (norms in fp32)
    increment[i] = div[i + 1] - div[i],                            i = 0..L-1

The guided fp32 layers are the top-k decoder layers by increment. They must be chosen on prompts disjoint from the
ones they are evaluated on (else they look better than they are): this probe uses the selection split (the LAST
--num-prompts prompts), the other probes the evaluation split (the first ones).
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

from ..old_pass.scorer import OldLogprobScorer, model_anatomy
from . import common
from .common import Completions, recommendation_block


REGIMES = ("autocast", "bf16")  # fp32 weights under bf16 autocast (TRL's default, scoring mode `bf16`) / bf16 weights


def default_top_k(num_layers: int) -> int:
    """ceil(L / 4): the batch-logprob-gap report's budget (8 of 28 layers for Qwen2.5-1.5B)."""
    return max(1, math.ceil(num_layers / 4))


@contextlib.contextmanager
def capture_layer_states(model):
    """Record depth-0 (input of decoder layer 0), depths 1..L (output of each decoder layer) and the final norm's
    output of every forward run inside the context. Yields `{"depths": [[(b, S, H) per call] x (L + 1)],
    "norm": [(b, S, H) per call]}`; the hooks are removed on exit."""
    anatomy = model_anatomy(model)
    store = {"depths": [[] for _ in range(len(anatomy.layers) + 1)], "norm": []}

    def first(x):
        return x[0] if isinstance(x, (tuple, list)) else x

    def pre0(module, args, kwargs):
        store["depths"][0].append(first(args) if args else kwargs["hidden_states"])

    handles = [anatomy.layers[0].register_forward_pre_hook(pre0, with_kwargs=True)]
    for i, layer in enumerate(anatomy.layers):
        handles.append(layer.register_forward_hook(lambda m, a, out, i=i: store["depths"][i + 1].append(first(out))))
    handles.append(anatomy.norm.register_forward_hook(lambda m, a, out: store["norm"].append(first(out))))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def relative_divergence(h_a: torch.Tensor, h_b: torch.Tensor, positions: torch.Tensor | None = None) -> float:
    """mean over positions of ||h_a - h_b|| / (||h_a|| + 1e-6), norms over the hidden size in fp32.

    h_a, h_b: (..., H) any float dtype; positions: bool of shape h_a.shape[:-1], or None for all.
    Returns a float (0.0 when no position).
    """
    a, b = h_a.float(), h_b.float()
    if positions is not None:
        a, b = a[positions], b[positions]  # (N, H)
    if a.numel() == 0:
        return 0.0
    return float(((a - b).norm(dim=-1) / (a.norm(dim=-1) + 1e-6)).mean())


def scored_states_batch(states: list[torch.Tensor], data: Completions) -> list[torch.Tensor]:
    """Per depth, the (N, H) hidden states of the padded-batch run at the N scored positions, rows in order."""
    pos = scored_positions(data)  # (B, S)
    return [h[pos] for h in states]


def scored_states_alone(per_row: list[list[torch.Tensor]], data: Completions) -> list[torch.Tensor]:
    """Per depth, the (N, H) hidden states of the one-sequence-at-a-time run at the same N scored positions.

    per_row[d][i] is (1, p_i + t_i, H): row i alone; its completion token k is scored at position p_i + k - 1."""
    out = []
    for chunks in per_row:
        rows = []
        for i, h in enumerate(chunks):
            _, _, t_i = data.alone(i)
            start = h.size(1) - t_i - 1
            rows.append(h[0, start:start + t_i][data.valid[i, :t_i]])  # (n_i, H)
        out.append(torch.cat(rows))
    return out


def scored_positions(data: Completions) -> torch.Tensor:
    """(B, P+T) bool: the input positions whose next-token logits score a valid completion token (position P+k-1
    scores completion token k)."""
    B, S = data.input_ids.shape
    T = data.logits_to_keep
    pos = torch.zeros((B, S), dtype=torch.bool)
    pos[:, S - T - 1:S - 1] = data.valid
    return pos


def regime_model(model, regime: str):
    """The model and scorer of `regime`: `autocast` = the fp32 model under bf16 autocast, `bf16` = a bf16 copy.

    Raises:
        ValueError: unknown regime.
    """
    if regime not in REGIMES:
        raise ValueError(f"--regime {regime!r} unknown; allowed: {', '.join(REGIMES)}")
    if regime == "bf16":
        import copy

        model = copy.deepcopy(model).to(torch.bfloat16)
    return model, OldLogprobScorer(model, "bf16")  # fp32 weights: bf16 autocast; bf16 weights: native


def run_layers(model, data: Completions, batch_size: int = 8, regime: str = "autocast",
               top_k: int | None = None) -> dict:
    """Per-depth divergence between batch 1 and `batch_size`, per-layer increments and the top-k layers.

    Returns:
        {"divergence": [L + 1 floats], "increments": [L floats], "norm_divergence": float (after the final norm),
        "ranking": layer indices by decreasing increment, "guided_fp32_layers": sorted top-k, "top_k": k,
        "num_positions": int}.
    """
    m, scorer = regime_model(model, regime)
    with capture_layer_states(m) as store:
        for i in range(data.input_ids.size(0)):
            ids, mask, t_i = data.alone(i)
            scorer.score(ids, mask, t_i, batch_size=1)
    alone = scored_states_alone(store["depths"] + [store["norm"]], data)  # L + 2 of (N, H)
    with capture_layer_states(m) as store:
        scorer.score(data.input_ids, data.attention_mask, data.logits_to_keep, batch_size=batch_size)
    batch = scored_states_batch([torch.cat(c) for c in store["depths"] + [store["norm"]]], data)  # L + 2 of (N, H)
    divs = [relative_divergence(a, b) for a, b in zip(alone, batch, strict=True)]
    div, norm_div = divs[:-1], divs[-1]
    inc = [div[i + 1] - div[i] for i in range(len(div) - 1)]
    k = top_k or default_top_k(len(inc))
    ranking = sorted(range(len(inc)), key=lambda i: -inc[i])
    return {"divergence": div, "increments": inc,
            "norm_divergence": norm_div, "ranking": ranking, "guided_fp32_layers": sorted(ranking[:k]), "top_k": k,
            "num_positions": int(alone[0].size(0))}


def plot(result: dict, path, title: str) -> None:
    """Bar chart of the per-layer increments (top-k highlighted) and the cumulative divergence, saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inc = result["increments"]
    chosen = set(result["guided_fp32_layers"])
    fig, ax = plt.subplots(figsize=(max(6, len(inc) * 0.3), 3.5))
    ax.bar(range(len(inc)), inc, color=["tab:red" if i in chosen else "tab:gray" for i in range(len(inc))])
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("divergence increment")
    ax2 = ax.twinx()
    ax2.plot(range(len(inc)), result["divergence"][1:], color="tab:blue", marker=".")
    ax2.set_ylabel("divergence after layer", color="tab:blue")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(payload: dict) -> str:
    """Per-layer divergence and increment, the chosen layers first."""
    info, r = payload["info"], payload["result"]
    lines = [(f"### layers: {info['model']} ({r['num_positions']} positions, selection prompts "
             f"{info['prompt_indices'][0]}..{info['prompt_indices'][-1]}, regime {payload['regime']}, batch 1 vs "
             f"{payload['batch_size']})"), "",
             f"guided_fp32_layers (top {r['top_k']} by increment): `{','.join(map(str, r['guided_fp32_layers']))}`",
             "", "| layer | divergence after | increment | rank |", "|---|---|---|---|",
             f"| input | {r['divergence'][0]:.3e} | - | - |"]
    rank = {layer: i + 1 for i, layer in enumerate(r["ranking"])}
    for i, inc in enumerate(r["increments"]):
        lines.append(f"| {i} | {r['divergence'][i + 1]:.3e} | {inc:+.3e} | {rank[i]} |")
    lines += [f"| final norm | {r['norm_divergence']:.3e} | - | - |", "",
              ("div = mean over scored positions of ||h_b1 - h_bN|| / (||h_b1|| + 1e-6), captured at each decoder "
              "layer's output (the final norm separately)."), ""]
    return "\n".join(lines + recommendation(payload))


def recommendation(payload: dict) -> list[str]:
    """The conclusion: the share of the divergence the chosen layers add, the largest single layer, what to do with
    the calibration file, and the caveats (selection split, regime, no timing)."""
    r = payload["result"]
    inc, chosen = r["increments"], r["guided_fp32_layers"]
    positive = sum(x for x in inc if x > 0)
    share = sum(inc[i] for i in chosen if inc[i] > 0) / positive if positive else 0.0
    top = r["ranking"][0]
    sentences = [f"On this model the top {r['top_k']} layers ({','.join(map(str, chosen))}) add {share:.0%} of the "
                 f"summed positive divergence increments; layer {top} alone adds "
                 f"{(inc[top] / positive if positive else 0.0):.0%}.",
                 f"Use them as guided_fp32_layers='{','.join(map(str, chosen))}' (the calibration file), and check "
                 "the set on held-out prompts with `probe calibrate` (the smallest set meeting a target, with its "
                 "time) or `probe ladder --layers`."]
    caveats = ["Chosen on the selection split (the last --num-prompts prompts); an increment is not an out-of-band "
               "rate: only `calibrate`/`ladder` say how much of the gap a set removes, on other prompts."]
    if payload["regime"] == "bf16":
        caveats.append("Regime bf16: weights cast to bf16, not TRL's default (fp32 weights under bf16 autocast, "
                       "--regime autocast); the layers where the divergence enters can differ between the two.")
    return recommendation_block(sentences, caveats)


def calibration_record(payload: dict) -> dict:
    """The calibration JSON accepted by `RatioGRPOConfig(guided_fp32_layers=PATH)` (key `guided_fp32_layers`)."""
    info, r = payload["info"], payload["result"]
    return {"guided_fp32_layers": r["guided_fp32_layers"], "model": info["model"], "num_layers": info["num_layers"],
            "increments": r["increments"],
            "divergence": r["divergence"], "ranking": r["ranking"], "top_k": r["top_k"],
            "selection_prompts": {"path": info["prompts"], "indices": info["prompt_indices"]},
            "num_positions": r["num_positions"], "regime": payload["regime"], "batch_size": payload["batch_size"],
            "source": "grpo-ratio probe layers"}


# ---------------------------------------------------------------------------------------------------------------------
# command line: `grpo-ratio probe layers`

HELP = ("per-layer divergence increment, batch 1 vs 8, on the selection split; writes a calibration JSON of the "
        "top-k layers")


def add_arguments(p) -> None:
    common.add_common_arguments(p)
    p.add_argument("--top-k", type=int, default=None, help="layers to choose; default ceil(L / 4)")
    p.add_argument("--regime", choices=["autocast", "bf16"], default="autocast",
                   help="autocast: fp32 weights under bf16 autocast (TRL's default); bf16: weights cast to bf16")
    p.add_argument("--calibration-out", default=None, help="calibration JSON path; default OUT/calibration.json")


def run(args) -> list:
    """Sample on the selection split, measure per-layer increments, write layers.json/.md/.png and calibration.json."""
    prompts, idx = common.load_prompts(args, split="select")
    common.check_batch_size(args.batch_size, len(prompts))
    model, tok = common.load_model(args.model)
    L = model.config.num_hidden_layers
    if args.top_k is not None and not 1 <= args.top_k <= L:
        raise common.ProbeError(f"--top-k={args.top_k} must be between 1 and the number of decoder layers ({L})")
    data = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=common.is_gsm8k(args))
    result = run_layers(model, data, args.batch_size, args.regime, args.top_k)
    payload = {"probe": "layers", "info": common.run_info(args, model, idx, data), "batch_size": args.batch_size,
               "regime": args.regime, "result": result}
    paths = common.write_results(args.out, "layers", payload, markdown(payload))
    png = Path(args.out) / "layers.png"
    plot(result, png, f"{args.model}: batch 1 vs {args.batch_size} divergence increment ({args.regime})")
    calib = Path(args.calibration_out or Path(args.out) / "calibration.json")
    calib.parent.mkdir(parents=True, exist_ok=True)
    calib.write_text(json.dumps(calibration_record(payload), indent=2) + "\n")
    return paths + [png, calib]
