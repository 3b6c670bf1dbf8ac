"""Record and replay MoE routes with forward hooks on the family's own router modules.

Shapes: b = rows of one model forward, s = its positions, N = b * s router rows, L = decoder layers (absolute), k =
experts per token, E = experts; a route tensor is (B, S, L, k) int (`grpo_ratio.routing.layout`).

`RouteHooks(model)` puts one forward hook on every router (`grpo_ratio.routing.families`) and one forward pre-hook on
the decoder (it sees each forward's (b, s)). Outside a session the hooks do nothing: the model is the family's own.

- `recording()`: every forward's routes, as the routers chose them, per layer.
- `replaying(routes)`: the forwards in the session take the rows of `routes` in order (TRL scores a batch in chunks of
  `batch_size` rows, in order); each router keeps its own `router_logits`, takes the given indices (its own choice at
  `NO_ROUTE` positions) and recomputes the gate weights at them with the family's rule, so gradients reach the router
  weights through the logits (R3: arXiv 2510.11370; Megatron-LM `moe_enable_routing_replay`). The session also
  records the routes used and the ones the router would have chosen (`native`), for the agreement metrics.

Activation checkpointing: transformers checkpoints each decoder layer's `forward`, so its router fires again in the
backward recompute, after the session may have moved on (or ended). In a session, a forward that will be recomputed
(checkpointed layer, train mode, grad on) leaves the indices it served on a per-layer stack; the recompute
(recognised by running inside autograd's backward) takes them back, matched by row count and a fingerprint of the
router input, and serves the same indices; it records nothing (verl records only a router's first firing).
Mixtral's `router_jitter_noise` in train mode multiplies the MoE input by fresh noise in every forward: replay is
refused there (set `router_jitter_noise=0`), because the replayed old pass would still be random.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from .families import MoeLayout, decoder_layers, moe_layout, peft_base_model
from .layout import ROUTE_DTYPE, decode_routes, no_routes


@dataclass
class _Call:
    """One model forward inside a session."""

    rows: int  # b
    positions: int  # s
    target: torch.Tensor | None  # (b, s, L, k) routes to replay, or None
    grad_enabled: bool  # outside the layers: a reentrant checkpoint runs the layer's forward under no_grad
    used: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (b, s, k) int64
    native: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (b, s, k) int64


@dataclass
class RouteRecording:
    """What the routers did during one session: one `_Call` per model forward, in order."""

    num_layers: int
    top_k: int
    calls: list[_Call] = field(default_factory=list)

    def _stack(self, which: str) -> torch.Tensor:
        """(B, S, L, k) int16: the calls stacked along the rows (every call has the same positions)."""
        if not self.calls:
            raise ValueError("routes: no forward was recorded")
        positions = {c.positions for c in self.calls}
        if len(positions) != 1:
            raise ValueError(f"routes: forwards of different lengths {sorted(positions)}; use decode()")
        parts = []
        for call in self.calls:
            part = no_routes(call.rows, call.positions, self.num_layers, self.top_k,
                             device=next(iter(getattr(call, which).values())).device)
            for layer, index in getattr(call, which).items():
                part[:, :, layer] = index.to(ROUTE_DTYPE)
            parts.append(part)
        return torch.cat(parts, dim=0)

    def used(self) -> torch.Tensor:
        """(B, S, L, k) int16: the routes the forwards used (replayed, or the routers' own), rows in call order."""
        return self._stack("used")

    def native(self) -> torch.Tensor:
        """(B, S, L, k) int16: the routes the routers themselves chose (equal to `used()` without replay)."""
        return self._stack("native")

    def decode(self) -> torch.Tensor:
        """(b, sum of s, L, k) int16: the forwards of one `generate` call laid along the positions (prefill, then one
        per decoding step); see `layout.decode_routes`."""
        return decode_routes([c.used for c in self.calls], self.num_layers, self.top_k)


def _in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread (where checkpoint recomputes happen)."""
    return torch._C._current_graph_task_id() != -1


def _fingerprint(hidden: torch.Tensor) -> torch.Tensor:
    """A 0-d fp64 summary of a router's input, left on its device: taken in every checkpointed MoE layer's forward,
    where a host sync would stall the layer; compared only when a recompute has several candidates."""
    return hidden.detach().double().sum()


class RouteHooks:
    """Hooks on every router of `model` that record and replay routes inside sessions (see the module docstring).

    Args:
        model: a transformers causal LM of a supported MoE family (PEFT-wrapped or not); the hooks sit on its
            modules, so they also act on the same modules reached through an accelerate/FSDP2/DeepSpeed wrapper.
    Raises:
        ValueError: a dense model ("no MoE") or an unsupported MoE family (`families.moe_layout`).
    """

    def __init__(self, model: nn.Module):
        layout = moe_layout(model)
        if layout is None:
            raise ValueError(f"routing replay: {type(peft_base_model(model)).__name__} has no MoE layers (no MoE)")
        self.layout: MoeLayout = layout
        self._layers = decoder_layers(model)
        self._session: RouteRecording | None = None
        self._routes: torch.Tensor | None = None  # (B, S, L, k) replayed by the session's forwards
        self._cursor = 0  # rows of `_routes` already served
        self._call: _Call | None = None
        self._pending: dict[int, list[tuple[int, torch.Tensor, torch.Tensor | None]]] = {}  # checkpoint recomputes
        self._rows: torch.Tensor | None = None  # rows of `_routes` the next forward takes (`serving_rows`)
        self._handles = []
        self._attached: set[int] = set()
        self.attach(model)

    def attach(self, module: nn.Module, layer: int | None = None) -> None:
        """Make the routers of another module follow this object's sessions: a whole copy of the model (a
        `ModuleCopy` of the policy, a sharded shadow), or with `layer` a copy of decoder layer `layer` (the fp32 layers
        of `fp32_head` / `guided_fp32`). Idempotent per module.

        Raises:
            ValueError: the copy's routers are not of this model's family, or the copy of a decoder layer holds
                no router where the model's layer `layer` has one.
        """
        if id(module) in self._attached:
            return
        if layer is None:
            routers = moe_layout(module).routers if moe_layout(module) is not None else {}
            if set(routers) != set(self.layout.routers):
                raise ValueError(f"routing: the copy's MoE layers {sorted(routers)} differ from the model's "
                                 f"{self.layout.moe_layers}")
            decoder = peft_base_model(module).get_decoder()
            self._handles.append(decoder.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        else:
            name = self.layout.family.router_class
            found = [m for m in module.modules() if type(m).__name__ == name]
            if len(found) != (layer in self.layout.routers):
                raise ValueError(f"routing: a copy of decoder layer {layer} holds {len(found)} {name} routers")
            routers = {layer: found[0]} if found else {}
        self._handles += [router.register_forward_hook(self._router_hook(i)) for i, router in routers.items()]
        self._attached.add(id(module))

    def remove(self) -> None:
        """Take every hook off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._attached = [], set()

    # -----------------------------------------------------------------------------------------------------------------
    # sessions

    @contextlib.contextmanager
    def recording(self):
        """Record the routes of every forward in the block; yields the `RouteRecording`."""
        with self._open(None) as recording:
            yield recording

    @contextlib.contextmanager
    def replaying(self, routes: torch.Tensor):
        """Replay `routes` (B, S, L, k) int in the forwards of the block, rows in order; yields the `RouteRecording`
        (routes used and native).

        Raises:
            ValueError: Mixtral with `router_jitter_noise > 0` in train mode; at a forward: more rows than `routes`
                holds, or positions other than S.
        """
        from .layout import validate_routes

        lay = self.layout
        validate_routes(routes, lay.num_layers, lay.num_experts, lay.top_k, lay.moe_layers)
        self._check_jitter()
        with self._open(routes) as recording:
            yield recording

    @contextlib.contextmanager
    def _open(self, routes):
        if self._session is not None:
            raise RuntimeError("routing: a recording or replay session is already open on this model")
        self._pending = {}  # recomputes of an earlier session's forwards have run (TRL: backward before next loss)
        self._session = RouteRecording(self.layout.num_layers, self.layout.top_k)
        self._routes, self._cursor = routes, 0
        try:
            yield self._session
        finally:
            self._session, self._routes, self._call = None, None, None

    @contextlib.contextmanager
    def serving_rows(self, rows: torch.Tensor):
        """Within the block, forwards of the open replay session take the rows `rows` (int64 indices into the
        routes, e.g. the rows an fp16 pass re-scores in fp32) instead of the next rows in order; the cursor stays."""
        self._rows = rows
        try:
            yield
        finally:
            self._rows = None

    @property
    def rows_served(self) -> int:
        """Rows of the open replay session's routes that forwards have taken so far."""
        return self._cursor

    def refuse_jitter(self) -> None:
        """Refuse router input jitter whatever the mode (a trainer runs its passes in train mode, where it acts).

        Raises:
            ValueError: Mixtral with `router_jitter_noise > 0`.
        """
        self._check_jitter(train_mode_only=False)

    def _check_jitter(self, train_mode_only: bool = True) -> None:
        jitter_attr = self.layout.family.jitter_attr
        if jitter_attr is None:
            return
        for block in self.layout.blocks.values():
            active = block.training or not train_mode_only
            if active and float(getattr(block, jitter_attr, 0.0) or 0.0) > 0:
                raise ValueError(
                    f"routing replay: {type(block).__name__}.{jitter_attr}={getattr(block, jitter_attr)} "
                    f"(config.router_jitter_noise) multiplies the MoE input by fresh noise in train mode, where TRL "
                    f"scores the old pass, so a replayed forward would still be random; set router_jitter_noise=0 "
                    f"(on the config before loading, or on every MoE block's `{jitter_attr}`)"
                )

    # -----------------------------------------------------------------------------------------------------------------
    # hooks

    def _on_forward(self, module, args, kwargs):
        """Decoder pre-hook: open a `_Call` for this forward, with its rows of the replayed routes."""
        if self._session is None:
            return None
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        x = args[0] if x is None and args else x
        rows, positions = int(x.shape[0]), int(x.shape[1])
        target = None
        if self._routes is not None and self._rows is not None:
            if self._rows.numel() != rows or self._routes.size(1) != positions:
                raise ValueError(f"routing replay: a forward of ({rows}, {positions}) positions for rows "
                                 f"{self._rows.tolist()} of routes {tuple(self._routes.shape[:2])}")
            target = self._routes[self._rows.to(self._routes.device)]
        elif self._routes is not None:
            if self._cursor + rows > self._routes.size(0) or self._routes.size(1) != positions:
                raise ValueError(f"routing replay: a forward of ({rows}, {positions}) positions after "
                                 f"{self._cursor} rows served, but the routes are {tuple(self._routes.shape[:2])}")
            target = self._routes[self._cursor : self._cursor + rows]
            self._cursor += rows
        self._call = _Call(rows=rows, positions=positions, target=target, grad_enabled=torch.is_grad_enabled())
        self._session.calls.append(self._call)
        return None

    def _router_hook(self, layer: int):
        def hook(router, args, output):
            return self._on_router(layer, router, args[0], output)

        return hook

    def _will_recompute(self, layer: int, call: _Call) -> bool:
        """transformers' own condition for checkpointing a decoder layer (`GradientCheckpointingLayer`), with grad
        mode as the layer's caller sees it."""
        module = self._layers[layer]
        return bool(getattr(module, "gradient_checkpointing", False)) and module.training and call.grad_enabled

    def _on_router(self, layer: int, router: nn.Module, hidden: torch.Tensor, output):
        logits, weights, native = output  # (N, E), (N, k), (N, k)
        if _in_backward():
            return self._recompute(layer, router, hidden, output)
        call = self._call
        if self._session is None:
            return None
        if call is None:
            raise RuntimeError("routing: a router fired in a session outside a model forward")
        n, k = native.shape
        if n != call.rows * call.positions:
            raise RuntimeError(f"routing: layer {layer}'s router saw {n} rows, the forward has "
                               f"{call.rows} x {call.positions}")
        call.native[layer] = native.detach().view(call.rows, call.positions, k)
        used = None
        if call.target is not None:
            self._check_jitter()
            target = call.target[:, :, layer].reshape(n, k).to(native.device)
            given = (target >= 0).all(-1, keepdim=True)  # (N, 1) NO_ROUTE rows keep the router's own choice
            used = torch.where(given, target.to(native.dtype), native)  # (N, k)
            weights = self.layout.family.gate_weights(router, logits, hidden, used)
        call.used[layer] = (native if used is None else used).detach().view(call.rows, call.positions, k)
        if self._will_recompute(layer, call):
            self._pending.setdefault(layer, []).append((n, _fingerprint(hidden), used))
        return None if used is None else (logits, weights, used)

    def _recompute(self, layer: int, router: nn.Module, hidden: torch.Tensor, output):
        """A checkpoint recompute: serve the indices the forward served (matched by rows, then fingerprint)."""
        stack = self._pending.get(layer, [])
        logits, _, native = output
        candidates = [i for i, (n, _, _) in enumerate(stack) if n == native.size(0)]
        if not candidates:
            return None  # a forward outside any session: the router's own routes, as in the forward
        best = candidates[0]
        if len(candidates) > 1:  # several forwards of this row count: the nearest fingerprint (one sync, in backward)
            fingerprint = _fingerprint(hidden)
            distances = torch.stack([(stack[i][1].to(fingerprint.device) - fingerprint).abs() for i in candidates])
            best = candidates[int(distances.argmin())]
        _, _, used = stack.pop(best)
        if used is None:
            return None
        return logits, self.layout.family.gate_weights(router, logits, hidden, used), used
