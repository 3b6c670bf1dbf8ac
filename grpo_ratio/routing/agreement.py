"""Route agreement: the share of tokens whose top-k expert set differs between two forwards (pure tensor math).

Shapes: (..., L, k) int route tensors (`grpo_ratio.routing.layout`), e.g. (B, S, L, k); `NO_ROUTE` (-1) marks a
position without a route. The order of the k experts does not matter (a set): vLLM, `generate` and the trainer need
not list them in the same order.

A token counts at layer l when both sides routed it there (and the optional `mask` keeps it); it counts "over any
layer" when it counts at one layer at least, and differs over any layer when it differs at one of the layers where it
counts. Asked for as a per-layer routing-agreement metric in NVIDIA/TensorRT-LLM#19501; Megatron-LM#4168 reports
about 10% of routers disagreeing per forward and 94% of tokens differing in at least one layer (Qwen3-30B-A3B).

The counts are integers (`RouteAgreement`): `merge` adds them, and a sum over processes gives the exact global share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def top_k_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(...,) bool: whether the k experts of `a` and `b` differ as sets, per (..., k) row (either side NO_ROUTE:
    compared as is; `route_agreement` leaves such rows out)."""
    if a.shape != b.shape:
        raise ValueError(f"route tensors differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1)


@dataclass
class RouteAgreement:
    """Integer counts of two forwards' route agreement.

    Attributes:
        differ: (L,) int64, tokens whose top-k set differs at each layer.
        total: (L,) int64, tokens routed on both sides at each layer (0 at dense layers).
        any_differ: () int64, tokens that differ at one layer at least.
        any_total: () int64, tokens routed on both sides at one layer at least.
    """

    differ: torch.Tensor
    total: torch.Tensor
    any_differ: torch.Tensor
    any_total: torch.Tensor

    def merge(self, other: RouteAgreement) -> RouteAgreement:
        return RouteAgreement(self.differ + other.differ, self.total + other.total,
                              self.any_differ + other.any_differ, self.any_total + other.any_total)

    def as_vector(self) -> torch.Tensor:
        """(2L + 2,) int64: every count in one tensor, for one all-reduce (sum) across processes."""
        return torch.cat([self.differ, self.total, self.any_differ[None], self.any_total[None]])

    @classmethod
    def from_vector(cls, vector: torch.Tensor) -> RouteAgreement:
        L = (vector.numel() - 2) // 2
        return cls(vector[:L], vector[L : 2 * L], vector[2 * L], vector[2 * L + 1])

    def layer_shares(self) -> dict[int, float]:
        """{layer: share of its tokens whose set differs}, layers with at least one token only."""
        return {int(i): float(self.differ[i]) / float(self.total[i]) for i in torch.nonzero(self.total).flatten()}

    def any_share(self) -> float | None:
        """Share of tokens that differ at one layer at least; None without tokens."""
        return float(self.any_differ) / float(self.any_total) if int(self.any_total) > 0 else None


def route_agreement(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None = None) -> RouteAgreement:
    """Count where the top-k expert sets of two route tensors differ, per layer and over any layer.

    Args:
        a, b: (..., L, k) int routes of the same positions (e.g. the sampler's and the old pass's, (B, S, L, k)).
        mask: (...) bool, the positions to count (e.g. the completion tokens and the prompt tokens that predict them);
            None counts every position both sides routed.
    Returns:
        `RouteAgreement` with (L,) counts; positions where either side has `NO_ROUTE` at a layer do not count there.
    Raises:
        ValueError: a and b differ in shape, or mask does not match their leading shape.
    """
    differ = top_k_sets_differ(a, b)  # (..., L)
    both = (a >= 0).all(-1) & (b >= 0).all(-1)  # (..., L)
    if mask is not None:
        if tuple(mask.shape) != tuple(a.shape[:-2]):
            raise ValueError(f"mask {tuple(mask.shape)} does not match routes {tuple(a.shape)}")
        both = both & mask.bool()[..., None]
    differ = differ & both
    flat_differ, flat_both = differ.reshape(-1, a.size(-2)), both.reshape(-1, a.size(-2))  # (N, L)
    return RouteAgreement(
        differ=flat_differ.sum(0, dtype=torch.int64),
        total=flat_both.sum(0, dtype=torch.int64),
        any_differ=flat_differ.any(-1).sum(dtype=torch.int64),
        any_total=flat_both.any(-1).sum(dtype=torch.int64),
    )


def scored_positions(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B, P + T) bool: the positions whose route changes a scored log-prob, in TRL's layout.

    The log-prob of completion token j comes from the position before it (the last prompt token for j = 0), and a
    route at position t moves the hidden states of t and of every later position. So every real position up to the
    second-to-last completion token counts; the last completion token of each row and padding do not.
    """
    real = torch.cat([prompt_mask, completion_mask], dim=1).bool()  # (B, P + T)
    last = real.size(1) - 1 - real.flip(1).int().argmax(1)  # (B,) index of each row's last real position
    positions = torch.arange(real.size(1), device=real.device)
    return real & (positions[None] < last[:, None])
