"""The MoE families whose routes can be recorded and replayed, read from transformers 5.24.

Shapes: N = router rows (the router sees `hidden.reshape(-1, H)`: every position of the (b, s) batch, padding
included), E = experts, k = experts per token (top-k), L = decoder layers (all of them, dense ones included).

transformers 5.24 factors every supported family the same way: a router module returns
`(router_logits (N, E), top_k_weights (N, k), top_k_index (N, k))` and the experts consume `(hidden, index, weights)`.
Replay therefore wraps the router module only (a forward hook, `grpo_ratio.routing.hooks`): it keeps the family's
own `router_logits`, substitutes the indices, and recomputes the gate weights at those indices with the family's own
rule (below), so the router keeps its gradient (R3, arXiv 2510.11370; Megatron-LM `moe_enable_routing_replay`).

| family (model_type)       | router class              | gate weights at the chosen indices (read from the router's forward)       |
|---------------------------|---------------------------|---------------------------------------------------------------------------|
| qwen3_moe, qwen2_moe, olmoe | `*TopKRouter`           | softmax(logits, fp32) gathered; / sum if `norm_topk_prob`; cast to logits' dtype |
| mixtral                   | `MixtralTopKRouter`       | softmax(logits.float()) gathered; always / sum; stays fp32                 |
| granitemoe                | `GraniteMoeTopKRouter`    | softmax over the k gathered fp32 logits; cast to the input's dtype         |
| deepseek_v3, glm4_moe     | `*TopkRouter`             | sigmoid(logits) gathered (the bias and the group limit only choose); / (sum + 1e-20) if `norm_topk_prob`; x `routed_scaling_factor` |

Any other MoE family is refused (`moe_layout` raises `ValueError` with this list); a dense model has no layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------------------------------------------------------------
# the gate-weight rules: (router, router_logits (N, E), router input (N, H) or (b, s, H), indices (N, k) int64) -> (N, k)


def _softmax_topk_weights(router: nn.Module, logits: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor):
    """Qwen3-MoE / Qwen2-MoE / OLMoE (`Qwen3MoeTopKRouter.forward`): softmax in fp32 over all experts, the k values,
    renormalised when `norm_topk_prob`, cast back to the logits' dtype."""
    probs = F.softmax(logits, dtype=torch.float, dim=-1)  # (N, E) fp32
    weights = probs.gather(-1, index)  # (N, k)
    if router.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _mixtral_weights(router: nn.Module, logits: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor):
    """Mixtral (`MixtralTopKRouter.forward`): softmax of the fp32 logits, the k values always renormalised, kept in
    fp32 (the router does not cast them back)."""
    probs = F.softmax(logits.float(), dim=-1)  # (N, E) fp32
    weights = probs.gather(-1, index)  # (N, k)
    weights /= weights.sum(dim=-1, keepdim=True)
    return weights


def _granite_weights(router: nn.Module, logits: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor):
    """GraniteMoE (`GraniteMoeTopKRouter.forward`): the logits are fp32; softmax over the k chosen logits only, cast
    to the router input's dtype."""
    return torch.softmax(logits.gather(-1, index), dim=-1).type_as(hidden)  # (N, k)


def _sigmoid_group_weights(router: nn.Module, logits: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor):
    """DeepSeek-V3 / GLM-4-MoE (`DeepseekV3TopkRouter.forward`): sigmoid scores at the chosen experts; the
    `e_score_correction_bias` and the group-limited top-k only choose the experts, they do not enter the weights;
    renormalised (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`; fp32."""
    scores = logits.sigmoid()  # (N, E) fp32
    weights = scores.gather(1, index)  # (N, k)
    if router.norm_topk_prob:
        denominator = weights.sum(dim=-1, keepdim=True) + 1e-20
        weights /= denominator
    return weights * router.routed_scaling_factor


@dataclass(frozen=True)
class RouterFamily:
    """One supported MoE family: where its router is and how its gate weights follow from the router logits."""

    model_type: str  # transformers `config.model_type`
    router_class: str  # class name of the router module inside each MoE decoder layer
    gate_weights: Callable  # (router, logits (N, E), hidden, index (N, k) int64) -> weights (N, k)
    jitter_attr: str | None = None  # the MoE block's input-jitter attribute (Mixtral `jitter_noise`)


FAMILIES: dict[str, RouterFamily] = {
    f.model_type: f
    for f in (
        RouterFamily("qwen3_moe", "Qwen3MoeTopKRouter", _softmax_topk_weights),
        RouterFamily("qwen2_moe", "Qwen2MoeTopKRouter", _softmax_topk_weights),
        RouterFamily("olmoe", "OlmoeTopKRouter", _softmax_topk_weights),
        RouterFamily("mixtral", "MixtralTopKRouter", _mixtral_weights, jitter_attr="jitter_noise"),
        RouterFamily("granitemoe", "GraniteMoeTopKRouter", _granite_weights),
        RouterFamily("deepseek_v3", "DeepseekV3TopkRouter", _sigmoid_group_weights),
        RouterFamily("glm4_moe", "Glm4MoeTopkRouter", _sigmoid_group_weights),
    )
}
SUPPORTED_FAMILIES = tuple(FAMILIES)

# config fields by which transformers MoE configs count their experts (an unsupported family is recognised by them)
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MOE_CLASS_MARKERS = ("Router", "Experts", "SparseMoe", "MoeBlock", "MoELayer")


# ---------------------------------------------------------------------------------------------------------------------
# where the routers are


@dataclass
class MoeLayout:
    """The routers of one model, by absolute decoder-layer index.

    Attributes:
        family: the model's `RouterFamily`.
        num_layers: L, all decoder layers (dense ones included): the layer axis of every route tensor.
        routers: {absolute layer index: router module}, MoE layers only (dense layers, e.g. Qwen's `mlp_only_layers` /
            `decoder_sparse_step`, DeepSeek's `first_k_dense_replace`, have no entry).
        blocks: {absolute layer index: the MoE block holding the router} (for Mixtral's input jitter).
        num_experts: E.  top_k: k.
    """

    family: RouterFamily
    num_layers: int
    routers: dict[int, nn.Module]
    blocks: dict[int, nn.Module]
    num_experts: int
    top_k: int

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.routers)

    def jitter(self) -> float:
        """The largest router input jitter of the MoE blocks (Mixtral `router_jitter_noise`; 0 for other families)."""
        if self.family.jitter_attr is None:
            return 0.0
        return max(float(getattr(b, self.family.jitter_attr, 0.0) or 0.0) for b in self.blocks.values())

    def layer_mask(self, device=None) -> torch.Tensor:
        """(L,) bool: True at the MoE layers."""
        mask = torch.zeros(self.num_layers, dtype=torch.bool, device=device)
        mask[self.moe_layers] = True
        return mask


def peft_base_model(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (`model.get_decoder().layers`)."""
    decoder = peft_base_model(model).get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(peft_base_model(model)).__name__}: no decoder `layers` to find the MoE routers in")
    return layers


def is_moe_model(model: nn.Module) -> bool:
    """Whether a model (any family) routes tokens to experts: a config that counts experts (> 0) or a router /
    experts module. Dense models give False."""
    config = peft_base_model(model).config
    for name in _EXPERT_COUNT_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return True
    return any(any(m in type(mod).__name__ for m in _MOE_CLASS_MARKERS) for mod in model.modules())


def moe_layout(model: nn.Module) -> MoeLayout | None:
    """The routers of `model` by absolute decoder-layer index; None for a dense model ("no MoE").

    Raises:
        ValueError: an MoE family that is not supported (the message lists `SUPPORTED_FAMILIES`), or a supported
            family whose MoE layers disagree on the number of experts or top-k.
    """
    base = peft_base_model(model)
    model_type = getattr(base.config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        if is_moe_model(base):
            raise ValueError(
                f"routing replay: MoE family {model_type!r} ({type(base).__name__}) is not supported; supported "
                f"families (transformers model_type): {', '.join(SUPPORTED_FAMILIES)}"
            )
        return None
    routers, blocks = {}, {}
    for index, layer in enumerate(decoder_layers(base)):
        for block in layer.modules():
            for child in block.children():
                if type(child).__name__ == family.router_class:
                    routers[index], blocks[index] = child, block
    if not routers:  # e.g. a Qwen3-MoE config with num_experts=0: a dense model of an MoE family
        return None
    experts = {int(r.num_experts) for r in routers.values()}
    top_k = {int(r.top_k) for r in routers.values()}
    if len(experts) != 1 or len(top_k) != 1:
        raise ValueError(f"routing replay: MoE layers differ in experts {sorted(experts)} or top-k {sorted(top_k)}")
    return MoeLayout(family=family, num_layers=len(decoder_layers(base)), routers=routers, blocks=blocks,
                     num_experts=experts.pop(), top_k=top_k.pop())
