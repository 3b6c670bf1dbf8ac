"""The trainer's side of routing replay: which routes each pass replays or records, and the agreement counts.

Shapes: B = rows of a generation batch, b = rows of a micro-batch, S = P + T positions in TRL's layout, L = decoder
layers, k = experts per token; routes are (B, S, L, k) int16 (`grpo_ratio.routing.layout`).

| `routing_replay` | old pass replays | update forwards replay | removes |
|---|---|---|---|
| `none` | - (routes recorded) | - (routes recorded) | nothing (stock TRL; the routes are only measured) |
| `R2` | - (its routes recorded) | the old pass's routes | route flips between the old and the new policy |
| `R3` | the sampler's routes | the sampler's routes | route mismatch between the sampler and the trainer |

R2: GSPO (arXiv 2507.18071), slime `--use-routing-replay`, verl `router_replay.mode: R2`. R3: arXiv 2510.11370,
slime `--use-rollout-routing-replay`, Megatron-LM `moe_enable_routing_replay`. The agreement counts (`RouteTally`)
give the `ratio/route/*` metrics: `sampler_old` (the sampler's routes vs the old pass's; where no old pass runs, the
first update forward is the old policy's pass) and `old_new` (the old pass's routes vs the update forwards'), each as
the routes the pass used and as the routes its routers chose themselves (`native`: what replay overrode).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .agreement import RouteAgreement, route_agreement, scored_positions
from .families import moe_layout
from .hooks import RouteHooks
from .layout import relayout_routes, vllm_routes


ROUTING_REPLAY_MODES = ("none", "R2", "R3")


@dataclass
class GenerationRoutes:
    """The routes of one generation batch, in TRL's layout (B, S, L, k) int16, or None where not recorded."""

    sampler: torch.Tensor | None = None  # what the sampler routed (generate or vLLM)
    old: torch.Tensor | None = None  # what the old pass used (replayed under R3)
    decoded: list = field(default_factory=list)  # generate: (routes (b, Pg + Tg - 1, L, k), prompt mask (b, Pg))


@dataclass
class RouteTally:
    """Agreement counts since the last flush, per pair: {name: RouteAgreement}."""

    counts: dict[str, RouteAgreement] = field(default_factory=dict)

    def add(self, name: str, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> None:
        counts = route_agreement(a.to(b.device), b, mask.to(b.device))
        self.counts[name] = counts if name not in self.counts else self.counts[name].merge(counts)

    def metrics(self, reduce=None) -> dict[str, float]:
        """{`ratio/route/<pair>/any_layer`, `.../layer_<i>`: share of tokens whose top-k set differs}; `reduce`
        sums an int64 vector over processes (e.g. `lambda v: accelerator.reduce(v, "sum")`). Clears the counts."""
        out = {}
        for name, counts in sorted(self.counts.items()):
            if reduce is not None:
                counts = RouteAgreement.from_vector(reduce(counts.as_vector()))
            share = counts.any_share()
            if share is None:
                continue
            out[f"ratio/route/{name}/any_layer"] = share
            if not name.endswith("_native"):
                out |= {f"ratio/route/{name}/layer_{i}": v for i, v in counts.layer_shares().items()}
        self.counts = {}
        return out


def _mask(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    return scored_positions(prompt_mask, completion_mask)  # (B, S) the positions whose route moves a log-prob


class RoutingReplay:
    """Routing replay and route measurement for one trainer and its policy.

    Args:
        model: the policy (unwrapped). A dense model gets no hooks (`active` False).
        mode: one of `ROUTING_REPLAY_MODES`.
    Raises:
        ValueError: `mode` not in `ROUTING_REPLAY_MODES`; R2/R3 on a dense model; an unsupported MoE family (the
            supported list in the message, `families.moe_layout`).
    """

    def __init__(self, model: nn.Module, mode: str = "none"):
        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing_replay={mode!r}; allowed: {', '.join(ROUTING_REPLAY_MODES)}")
        self.mode = mode
        try:
            layout = moe_layout(model)
        except ValueError:
            if mode == "none":  # an unsupported MoE family trains as stock TRL; only its routes go unmeasured
                layout = None
            else:
                raise
        if layout is None and mode != "none":
            raise ValueError(f"routing_replay={mode!r} needs a mixture-of-experts model; "
                             f"{type(model).__name__} has no MoE layers")
        self.hooks = RouteHooks(model) if layout is not None else None
        self.tally = RouteTally()

    @property
    def active(self) -> bool:
        return self.hooks is not None

    # -- the sampler -------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording_generate(self, routes: GenerationRoutes, prompt_mask: torch.Tensor):
        """Record the routes of one `generate` call over prompts left-padded with `prompt_mask` (b, Pg)."""
        if not self.active:
            yield
            return
        with self.hooks.recording() as recording:
            yield
        routes.decoded.append((recording.decode(), prompt_mask))

    def finish_sampler(self, routes: GenerationRoutes, prompt_mask, completion_mask) -> None:
        """Lay the recorded generate routes out as TRL padded the batch (first turn only: tool turns are separate
        generate calls whose routes are not stitched; their tokens keep `NO_ROUTE`)."""
        if not routes.decoded:
            return
        decoded, generate_mask = routes.decoded[0]
        routes.sampler = relayout_routes(decoded, generate_mask.to(prompt_mask.device), prompt_mask, completion_mask)
        routes.decoded = []

    def sampler_from_vllm(self, routes: GenerationRoutes, routed_experts, prompt_lengths, prompt_mask,
                          completion_mask) -> None:
        """The colocate engine's `CompletionOutput.routed_experts` of each row, in TRL's layout."""
        layout = self.hooks.layout
        routes.sampler = vllm_routes(routed_experts, prompt_lengths, prompt_mask, completion_mask,
                                     layout.moe_layers, layout.num_layers, layout.top_k)

    # -- the old pass and the updates --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def old_pass(self, routes: GenerationRoutes, prompt_mask, completion_mask):
        """The old pass over the whole generation batch (rows in order): replays the sampler's routes under R3,
        records its own otherwise; counts sampler vs old."""
        if not self.active:
            yield
            return
        replay = self.mode == "R3" and routes.sampler is not None
        session = self.hooks.replaying(routes.sampler) if replay else self.hooks.recording()
        with session as recording:
            yield
        routes.old = recording.used()
        if routes.sampler is not None:
            mask = _mask(prompt_mask, completion_mask)
            self.tally.add("sampler_old", routes.sampler, routes.old, mask)
            self.tally.add("sampler_old_native", routes.sampler, recording.native(), mask)

    def replay_source(self, routes: GenerationRoutes) -> torch.Tensor | None:
        """The routes the update forwards replay: the sampler's (R3), the old pass's (R2), or None."""
        if self.mode == "R3":
            return routes.sampler
        if self.mode == "R2":
            return routes.old
        return None

    @contextlib.contextmanager
    def update_forward(self, routes: GenerationRoutes, rows: torch.Tensor, prompt_mask, completion_mask,
                       first_inner: bool):
        """One training forward over the generation batch's rows `rows` (b,) int64 (TRL shuffled and split the
        batch): replays R3's or R2's routes at those rows; counts old vs new, and sampler vs old where no old pass
        ran (`first_inner`: the first update is the old policy's pass)."""
        if not self.active:
            yield
            return
        source = self.replay_source(routes)
        rows = rows.to(torch.long)
        session = self.hooks.replaying(source[rows.to(source.device)]) if source is not None else self.hooks.recording()
        with session as recording:
            yield
        used, native = recording.used(), recording.native()
        mask = _mask(prompt_mask, completion_mask)
        if routes.old is not None:
            old = routes.old[rows.to(routes.old.device)]
            self.tally.add("old_new", old, used, mask)
            self.tally.add("old_new_native", old, native, mask)
        elif first_inner and routes.sampler is not None:
            sampler = routes.sampler[rows.to(routes.sampler.device)]
            self.tally.add("sampler_old", sampler, used, mask)
            self.tally.add("sampler_old_native", sampler, native, mask)
