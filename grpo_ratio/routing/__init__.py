"""MoE routing replay (R2, R3) and route agreement for transformers MoE models.

- R2 (GSPO, arXiv 2507.18071; slime `--use-routing-replay`): the old pass's routes replayed in every update forward of
  that generation, so route flips between the old and the new policy are not counted by the PPO clip as policy change.
- R3 (rollout routing replay, arXiv 2510.11370; slime `--use-rollout-routing-replay`, Megatron-LM
  `moe_enable_routing_replay`): the sampler's routes replayed in the old pass and every update, so the trainer routes
  each token as the sampler did.

Only the discrete top-k expert indices are replayed; the gate weights are recomputed from the live router logits at
those indices with the family's own rule, so the router keeps its gradient.

Modules: `families` (supported families, their routers by absolute layer, the gate-weight rules), `hooks`
(`RouteHooks`: recording and replay sessions, activation-checkpoint recomputes), `layout` (route tensors, `NO_ROUTE`,
the sampler's layout to TRL's), `agreement` (share of tokens whose top-k set differs, per layer and over any layer).
"""

from .agreement import RouteAgreement, route_agreement, scored_positions, top_k_sets_differ
from .families import FAMILIES, SUPPORTED_FAMILIES, MoeLayout, RouterFamily, is_moe_model, moe_layout
from .hooks import RouteHooks, RouteRecording
from .layout import NO_ROUTE, ROUTE_DTYPE, decode_routes, no_routes, relayout_routes, validate_routes, vllm_routes


__all__ = [
    "FAMILIES", "NO_ROUTE", "ROUTE_DTYPE", "SUPPORTED_FAMILIES", "MoeLayout", "RouteAgreement", "RouteHooks",
    "RouteRecording", "RouterFamily", "decode_routes", "is_moe_model", "moe_layout", "no_routes", "relayout_routes",
    "route_agreement", "scored_positions", "top_k_sets_differ", "validate_routes", "vllm_routes",
]
