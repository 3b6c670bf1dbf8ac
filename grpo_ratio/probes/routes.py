"""`grpo-ratio probe routes`: how often an MoE model's routes flip between two ways of running the same tokens.

Completions are sampled once with `generate` (fp32 weights, KV cache) while `grpo_ratio.routing.RouteHooks` records
the experts every router chose; the same tokens are then scored teacher-forced in TRL's padded layout (rows chunked by
--batch-size) and the routes recorded again. A route flips when a token's top-k expert *set* differs at a layer
(`grpo_ratio.routing.route_agreement`); counted over the positions whose route moves a scored log-prob
(`routing.scored_positions`), per layer and over any layer. Pairs:

- `decode_vs_prefill`: generate's routes (one position per decoding step, attention over the KV cache) vs the
  full-sequence pass, both fp32: what R3 with `generate` as the sampler removes from the trainer's passes;
- `fp32_vs_bf16_autocast`: the full-sequence pass in fp32 vs under bf16 autocast (TRL's `bf16=True` trainer);
- `fp32_vs_bf16_weights`: the same vs bf16 weights (an inference engine's usual dtype).

A flip is discrete: no precision mode removes it, routing replay does (docs/moe.md). Megatron-LM#4168 reports about
10% of routers disagreeing per forward between engine and trainer on Qwen3-30B-A3B.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from ..routing import RouteHooks, route_agreement, scored_positions
from . import common
from .batch import score_native
from .common import Completions, ProbeError


def prefill_routes(hooks: RouteHooks, model, data: Completions, batch_size: int, autocast: bool = False):
    """(B, P+T, L, k) int16 routes of `model` scoring `data` teacher-forced in TRL's layout (chunks of `batch_size`
    rows), optionally under bf16 autocast. `hooks` must sit on `model`."""
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with hooks.recording() as recording, context:
        score_native(model, data, batch_size)
    return recording.used()


def routes_alone(recording, data: Completions) -> torch.Tensor:
    """(B, P+T, L, k) int16: the routes of scoring each row of `data` alone, unpadded (one forward per row, as
    `common.score_alone` runs them), laid into the padded layout (`NO_ROUTE` at padding)."""
    from ..routing import ROUTE_DTYPE, no_routes

    if len(recording.calls) != data.input_ids.size(0):
        raise ValueError(f"{len(recording.calls)} forwards recorded for {data.input_ids.size(0)} rows")
    out = no_routes(*data.input_ids.shape, recording.num_layers, recording.top_k)
    for i, call in enumerate(recording.calls):
        keep = data.attention_mask[i].bool()  # (P+T,) the row's own tokens, as `Completions.alone` keeps them
        for layer, index in call.used.items():
            out[i, keep, layer] = index[0].to(ROUTE_DTYPE)
    return out


def recorded(hooks: RouteHooks | None, score):
    """`score()` and, when `hooks` is given, the `RouteRecording` of its forwards (else None)."""
    if hooks is None:
        return score(), None
    with hooks.recording() as recording:
        return score(), recording


def flips(a: torch.Tensor, b: torch.Tensor, data: Completions) -> dict:
    """The route flips between two (B, P+T, L, k) route tensors of `data`: per-layer and any-layer share and counts."""
    P = data.input_ids.size(1) - data.logits_to_keep
    mask = scored_positions(data.attention_mask[:, :P], data.attention_mask[:, P:])  # (B, P+T)
    counts = route_agreement(a, b, mask)
    return {"any_layer": counts.any_share(), "any_differ": int(counts.any_differ), "tokens": int(counts.any_total),
            "per_layer": {str(k): v for k, v in counts.layer_shares().items()}}


def run_routes(model, data: Completions, batch_size: int) -> dict:
    """The three pairs of the module docstring on fp32 `model` (an MoE model; not modified); `data.routes` are the
    routes recorded while sampling."""
    hooks = RouteHooks(model)
    try:
        fp32 = prefill_routes(hooks, model, data, batch_size)
        autocast = prefill_routes(hooks, model, data, batch_size, autocast=True)
    finally:
        hooks.remove()
    low = copy.deepcopy(model).to(torch.bfloat16)
    low_hooks = RouteHooks(low)
    bf16 = prefill_routes(low_hooks, low, data, batch_size)
    low_hooks.remove()
    return {"decode_vs_prefill": flips(data.routes, fp32, data), "fp32_vs_bf16_autocast": flips(fp32, autocast, data),
            "fp32_vs_bf16_weights": flips(fp32, bf16, data)}


LABELS = {"decode_vs_prefill": "decode (KV cache) vs prefill, fp32",
          "fp32_vs_bf16_autocast": "prefill fp32 vs bf16 autocast",
          "fp32_vs_bf16_weights": "prefill fp32 vs bf16 weights"}


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def markdown(payload: dict) -> str:
    """One row per pair: tokens, share flipped at any layer, per-layer shares."""
    info, r = payload["info"], payload["results"]
    lines = [f"### routes: {info['model']} ({info['num_sequences']} sequences, <= {info['max_new_tokens']} new "
             f"tokens, MoE layers {payload['moe_layers']}, top-{payload['top_k']} of {payload['num_experts']})", "",
             "| pair | tokens | flipped at any layer | per layer |", "|---|---|---|---|"]
    for key, res in r.items():
        layers = ", ".join(f"{k}: {_pct(v)}" for k, v in res["per_layer"].items())
        lines.append(f"| {LABELS[key]} | {res['tokens']} | {_pct(res['any_layer'])} ({res['any_differ']}) | "
                     f"{layers} |")
    lines += ["", "A flipped token's top-k expert set differs at a layer; R3 replays the sampler's routes in the "
                  "trainer's passes, R2 the old pass's in the updates (docs/moe.md).", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# command line: `grpo-ratio probe routes`

HELP = "MoE route flips: decode (KV cache) vs prefill, fp32 vs bf16 (share of tokens whose top-k set differs)"


def add_arguments(p) -> None:
    common.add_common_arguments(p, num_prompts=8, max_new_tokens=32)


def run(args) -> list:
    """Sample with routes recorded, score in fp32 / bf16 autocast / bf16 weights, write routes.json/.md."""
    from ..routing import moe_layout

    prompts, idx = common.load_prompts(args)
    common.check_batch_size(args.batch_size, len(prompts))
    model, tok = common.load_model(args.model)
    try:
        layout = moe_layout(model)
    except ValueError as err:
        raise ProbeError(f"--model {args.model!r}: {err}") from None
    if layout is None:
        raise ProbeError(f"--model {args.model!r} has no MoE layers; route flips need an MoE model (e.g. "
                         f"tiny:qwen3_moe, or Qwen/Qwen3-30B-A3B)")
    hooks = RouteHooks(model)
    data = common.sample_completions(model, tok, prompts, args.max_new_tokens, args.seed, gsm8k=common.is_gsm8k(args),
                                     batch_size=args.batch_size, route_hooks=hooks)
    hooks.remove()
    results = run_routes(model, data, args.batch_size)
    payload = {"probe": "routes", "info": common.run_info(args, model, idx, data), "batch_size": args.batch_size,
               "moe_layers": layout.moe_layers, "top_k": layout.top_k, "num_experts": layout.num_experts,
               "results": results}
    return common.write_results(args.out, "routes", payload, markdown(payload))
