"""Route tensors and their layout: what each position of TRL's padded batch was routed to.

Shapes: B = sequences, P = prompt positions, T = completion positions (TRL pads prompts on the left and completions on
the right, to the longest of the local generation batch), S = P + T, L = decoder layers (absolute index over all of
them, dense layers included, as vLLM's `routed_experts` lays them out), k = experts per token.

A route tensor is (B, S, L, k) int16 (2 bytes per expert index: L x k x 2 bytes per token). A position without a
route (padding, the last token of a sequence, which no forward routes before it is scored, tool or environment
tokens the sampler never routed, the dense layers) holds `NO_ROUTE` (-1) in all k slots: never expert 0, which is a
real expert (google/tunix#2046: zero padding "silently detaches every replayed expert from its token"; verl's
duplicate-index test cannot tell a top-1 zero row from expert 0). A replayed forward routes such positions natively.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


NO_ROUTE = -1
ROUTE_DTYPE = torch.int16


def no_routes(batch: int, seq: int, num_layers: int, top_k: int, device=None) -> torch.Tensor:
    """(B, S, L, k) int16 filled with `NO_ROUTE`."""
    return torch.full((batch, seq, num_layers, top_k), NO_ROUTE, dtype=ROUTE_DTYPE, device=device)


def routed(routes: torch.Tensor) -> torch.Tensor:
    """(...,) bool: positions whose route is given (all k slots >= 0) in a (..., k) route tensor."""
    return (routes >= 0).all(dim=-1)


def validate_routes(routes: torch.Tensor, num_layers: int, num_experts: int, top_k: int,
                    moe_layers: Sequence[int] | None = None) -> None:
    """Check a (..., L, k) route tensor before it is replayed.

    Raises:
        ValueError: not an integer tensor; the layer axis is not all `num_layers` decoder layers (a layout over the MoE
            layers only would shift every layer after the first dense one); the last axis is not `top_k`; an index
            outside [0, num_experts) other than `NO_ROUTE`; a row partly `NO_ROUTE`; a routed row (at a MoE layer) that
            names one expert twice (an all-zero row of a top-k > 1 engine buffer).
    """
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise ValueError(f"routes must be an integer tensor, got {routes.dtype}")
    if routes.dim() < 2 or routes.size(-2) != num_layers or routes.size(-1) != top_k:
        raise ValueError(
            f"routes must be (..., L={num_layers}, k={top_k}), one slot per decoder layer by absolute index (dense "
            f"layers included, as NO_ROUTE), got shape {tuple(routes.shape)}"
        )
    given = routes >= 0
    if ((routes < NO_ROUTE) | (routes >= num_experts)).any():
        raise ValueError(f"routes: expert index outside [0, {num_experts}) and not NO_ROUTE ({NO_ROUTE})")
    partial = given.any(-1) & ~given.all(-1)
    if partial.any():
        raise ValueError("routes: a position has NO_ROUTE in some top-k slots only (a row is routed or not)")
    if top_k > 1:
        layers = routes if moe_layers is None else routes[..., list(moe_layers), :]
        ordered = layers.sort(dim=-1).values  # (..., L', k)
        duplicate = (ordered[..., 1:] == ordered[..., :-1]).any(-1) & (ordered[..., 0] >= 0)
        if duplicate.any():
            raise ValueError("routes: a routed position names the same expert twice (an all-zero engine row? mark "
                             "positions without a route with NO_ROUTE)")


# ---------------------------------------------------------------------------------------------------------------------
# from the sampler's layout to TRL's


def _source_index(dst_prompt_mask: torch.Tensor, dst_completion_mask: torch.Tensor, src_prompt_mask: torch.Tensor,
                  src_completion_len: int) -> torch.Tensor:
    """(B, Pd + Td) int64: for each position of the destination layout, its position in the source layout, or -1.

    Both layouts left-pad prompts and put completions right after them; a row's prompt tokens are the last p_i of
    each prompt block (checked), its completion's j-th token is at prompt width + j in both (j < the source width).
    """
    B, Pd = dst_prompt_mask.shape
    Td, Ps = dst_completion_mask.size(1), src_prompt_mask.size(1)
    p_dst, p_src = dst_prompt_mask.sum(1), src_prompt_mask.sum(1)  # (B,)
    if not torch.equal(p_dst, p_src):
        raise ValueError(f"routes: prompt lengths differ between the sampler's layout {p_src.tolist()} and TRL's "
                         f"{p_dst.tolist()}")
    for name, mask, width in (("destination", dst_prompt_mask, Pd), ("source", src_prompt_mask, Ps)):
        left = torch.arange(width, device=mask.device) >= (width - mask.sum(1, keepdim=True))  # (B, width)
        if not torch.equal(mask.bool(), left):
            raise ValueError(f"routes: the {name} prompts are not left-padded")
    device = dst_prompt_mask.device
    prompt_src = torch.arange(Pd, device=device) - Pd + Ps  # (Pd,) same distance from the prompt's end
    prompt_src = prompt_src.expand(B, Pd).masked_fill(~dst_prompt_mask.bool(), -1)  # (B, Pd)
    j = torch.arange(Td, device=device).expand(B, Td)  # (B, Td)
    keep = dst_completion_mask.bool() & (j < src_completion_len)
    completion_src = (Ps + j).masked_fill(~keep, -1)  # (B, Td)
    return torch.cat([prompt_src, completion_src], dim=1)


def relayout_routes(src_routes: torch.Tensor, src_prompt_mask: torch.Tensor, dst_prompt_mask: torch.Tensor,
                    dst_completion_mask: torch.Tensor) -> torch.Tensor:
    """Routes recorded in the sampler's layout, laid out as TRL pads the batch it scores.

    Args:
        src_routes: (B, Ps + Ts, L, k) int, the sampler's positions: prompts left-padded to Ps (e.g. `generate`'s
            input), then the Ts completion positions the sampler routed (a position after the row's end is ignored).
        src_prompt_mask: (B, Ps) 0/1, the sampler's prompt attention mask.
        dst_prompt_mask: (B, P) 0/1 and dst_completion_mask: (B, T) 0/1: TRL's `prompt_mask` / `completion_mask`
            (prompts left-padded, completions right-padded, `pad_to_multiple_of` included).
    Returns:
        (B, P + T, L, k) int16; `NO_ROUTE` at padding and at completion positions the sampler never routed (its last
        token, or one cut by `max_completion_length`).
    Raises:
        ValueError: the rows' prompt lengths differ, or a prompt is not left-padded.
    """
    index = _source_index(dst_prompt_mask, dst_completion_mask, src_prompt_mask, src_routes.size(1) - src_prompt_mask.size(1))
    B, S = index.shape
    gathered = src_routes.to(ROUTE_DTYPE).gather(1, index.clamp(min=0)[:, :, None, None].expand(
        B, S, *src_routes.shape[2:]))  # (B, S, L, k)
    return gathered.masked_fill((index < 0)[:, :, None, None], NO_ROUTE)


def decode_routes(calls: Sequence[dict[int, torch.Tensor]], num_layers: int, top_k: int) -> torch.Tensor:
    """The routes of one `generate` call, from the routers' records of its forwards (the prefill, then one per
    decoding step), in generate's own layout.

    Args:
        calls: one {absolute layer: (b, s, k) indices} per forward, in order; every call has the same b rows, s = the
            positions it fed (the prompt width at the prefill, 1 per decoding step).
    Returns:
        (b, sum of s, L, k) int16: position t is the t-th position fed; dense layers `NO_ROUTE`. The last generated
        token is never fed, so it has no position here.
    Raises:
        ValueError: the calls' row counts differ (beam search or another reordering of the rows), or no call.
    """
    if not calls:
        raise ValueError("routes: no forward was recorded")
    shapes = [next(iter(c.values())).shape[:2] for c in calls]
    rows = {s[0] for s in shapes}
    if len(rows) != 1:
        raise ValueError(f"routes: generate's forwards saw different row counts {sorted(rows)} (beam search?); "
                         f"routes can be recorded from sampling or greedy decoding only")
    out = no_routes(rows.pop(), sum(s[1] for s in shapes), num_layers, top_k, device=next(iter(calls[0].values())).device)
    start = 0
    for call, (_, s) in zip(calls, shapes):
        for layer, index in call.items():
            out[:, start : start + s, layer] = index.to(ROUTE_DTYPE)
        start += s
    return out


def vllm_routes(routed_experts: Sequence, prompt_lengths: Sequence[int], dst_prompt_mask: torch.Tensor,
                dst_completion_mask: torch.Tensor, moe_layers: Sequence[int], num_layers: int, top_k: int) -> torch.Tensor:
    """vLLM's `CompletionOutput.routed_experts` of each row, laid out as TRL pads the batch.

    Args:
        routed_experts: per row, an int array (seq_len - 1, num_layers, k) (vLLM `enable_return_routed_experts`,
            vllm-project/vllm#28284): the experts of the row's prompt + completion tokens but the last, by absolute
            layer index; numpy arrays or tensors.
        prompt_lengths: the rows' prompt lengths p_i (seq_len = p_i + completion length).
        dst_prompt_mask: (B, P), dst_completion_mask: (B, T): TRL's masks. A row's completion length is its mask's
            count, except where TRL zeroed the whole row (`mask_truncated_completions` masks a truncated completion
            out of attention and loss, and vLLM never returns an empty completion): that row's completion ids still
            fill up to TRL's width T, and its routes are laid out all the same (the loss never reads them).
        moe_layers: the model's MoE layers (`MoeLayout.moe_layers`): the engine's rows at dense layers are not routes
            and become `NO_ROUTE`.
    Returns:
        (B, P + T, L, k) int16.
    Raises:
        ValueError: a row's buffer does not have num_layers x k columns, or is longer than its tokens (its prompt and
            its completion, or TRL's width T for a masked-out row).
    """
    B, P = dst_prompt_mask.shape
    T = dst_completion_mask.size(1)
    # assembled on the host, where the engine's buffers are, and copied up once (not one sync and copy per row)
    out = no_routes(B, P + T, num_layers, top_k, device="cpu")
    dense = [i for i in range(num_layers) if i not in set(moe_layers)]
    completion_lengths = dst_completion_mask.sum(1).tolist()  # (B,) one transfer
    for i, (buffer, p) in enumerate(zip(routed_experts, prompt_lengths)):
        row = torch.as_tensor(buffer).to(ROUTE_DTYPE)  # (n, L, k)
        n = row.size(0)
        if row.dim() != 3 or tuple(row.shape[1:]) != (num_layers, top_k):
            raise ValueError(f"routed_experts row {i}: expected (seq_len - 1, {num_layers}, {top_k}), got "
                             f"{tuple(row.shape)}")
        c = int(completion_lengths[i]) or T  # 0: a truncated row TRL masked out; its ids fill up to T
        if n > p + c:
            raise ValueError(f"routed_experts row {i}: {n} positions for {p} prompt + {c} completion tokens")
        row = row.clone()
        row[:, dense] = NO_ROUTE
        n_prompt = min(n, p)
        out[i, P - p : P - p + n_prompt] = row[:n_prompt]
        out[i, P : P + n - n_prompt] = row[n_prompt:]
    return out.to(dst_prompt_mask.device)
