"""Route agreement and route layouts: pure functions on literal tensors."""

import pytest
import torch

from grpo_ratio.routing import (
    NO_ROUTE,
    RouteAgreement,
    decode_routes,
    relayout_routes,
    route_agreement,
    scored_positions,
    top_k_sets_differ,
    vllm_routes,
)


N = NO_ROUTE


def test_top_k_sets_ignore_the_order_of_the_experts():
    a = torch.tensor([[0, 1], [2, 3], [1, 2]])
    b = torch.tensor([[1, 0], [2, 1], [1, 2]])
    assert top_k_sets_differ(a, b).tolist() == [False, True, False]


def test_agreement_per_layer_and_over_any_layer_ignores_no_route():
    # (B=1, S=4, L=3, k=2); layer 0 is dense (NO_ROUTE on both sides)
    a = torch.tensor([[[[N, N], [0, 1], [2, 3]],
                       [[N, N], [0, 1], [2, 3]],
                       [[N, N], [1, 2], [0, 3]],
                       [[N, N], [N, N], [N, N]]]])  # last position: no route
    b = torch.tensor([[[[N, N], [1, 0], [2, 3]],  # same sets
                       [[N, N], [0, 2], [2, 3]],  # layer 1 differs
                       [[N, N], [1, 3], [0, 1]],  # both layers differ
                       [[N, N], [3, 2], [1, 0]]]])  # b routed, a not: does not count
    counts = route_agreement(a, b)
    assert counts.differ.tolist() == [0, 2, 1] and counts.total.tolist() == [0, 3, 3]
    assert int(counts.any_differ) == 2 and int(counts.any_total) == 3
    assert counts.layer_shares() == {1: 2 / 3, 2: 1 / 3} and counts.any_share() == 2 / 3
    masked = route_agreement(a, b, mask=torch.tensor([[True, False, True, True]]))
    assert masked.differ.tolist() == [0, 1, 1] and masked.total.tolist() == [0, 2, 2]
    assert masked.any_share() == 1 / 2


def test_agreement_counts_merge_and_round_trip_as_one_vector():
    a = torch.tensor([[[[0, 1]], [[2, 3]]]])  # (1, 2, 1, 2)
    b = torch.tensor([[[[0, 1]], [[2, 1]]]])
    one = route_agreement(a, b)
    two = one.merge(one)
    assert two.differ.tolist() == [2] and two.total.tolist() == [4] and int(two.any_total) == 4
    back = RouteAgreement.from_vector(two.as_vector())
    assert back.as_vector().tolist() == [2, 4, 2, 4] and back.any_share() == 0.5
    empty = route_agreement(torch.full((1, 2, 1, 2), N), b)
    assert empty.any_share() is None and empty.layer_shares() == {}


def test_agreement_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        route_agreement(torch.zeros(1, 2, 1, 2), torch.zeros(1, 3, 1, 2))
    with pytest.raises(ValueError, match="mask"):
        route_agreement(torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2), mask=torch.ones(2, 1))


def test_scored_positions_drop_padding_and_each_rows_last_token():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert scored_positions(prompt_mask, completion_mask).int().tolist() == [[0, 1, 1, 1, 0, 0],
                                                                            [1, 1, 1, 1, 1, 0]]


def _route(value: int, k: int = 1):
    return [[value] * k]  # one layer


def test_relayout_from_generate_to_trl_padding():
    # generate: prompts left-padded to 3, then 3 decode positions; TRL: prompts padded to 4 (pad_to_multiple_of=4),
    # completions right-padded to 3 with row 0 ending after 2 tokens
    src = torch.arange(2 * 6).view(2, 6, 1, 1).to(torch.int16)  # position id as the "expert"
    src_prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    dst_prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    dst_completion_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = relayout_routes(src, src_prompt_mask, dst_prompt_mask, dst_completion_mask)
    assert out.dtype == torch.int16 and out.shape == (2, 7, 1, 1)
    assert out[..., 0, 0].tolist() == [[N, N, 1, 2, 3, 4, N], [N, 6, 7, 8, 9, 10, 11]]


def test_relayout_marks_completion_positions_the_sampler_never_routed():
    src = torch.arange(4).view(1, 4, 1, 1)  # prompt 2 + 2 routed completion positions (the third never fed)
    out = relayout_routes(src, torch.tensor([[1, 1]]), torch.tensor([[1, 1]]), torch.tensor([[1, 1, 1]]))
    assert out[0, :, 0, 0].tolist() == [0, 1, 2, 3, N]


def test_relayout_refuses_other_prompts_or_right_padded_prompts():
    src = torch.zeros(1, 4, 1, 1, dtype=torch.int16)
    with pytest.raises(ValueError, match="prompt lengths differ"):
        relayout_routes(src, torch.tensor([[1, 1]]), torch.tensor([[0, 1]]), torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match="not left-padded"):
        relayout_routes(src, torch.tensor([[1, 0]]), torch.tensor([[0, 1]]), torch.tensor([[1, 1]]))


def test_decode_routes_lay_generate_forwards_along_the_positions():
    prefill = {1: torch.tensor([[[0, 1], [1, 2]]])}  # (b=1, s=2, k=2) at layer 1 of 2
    steps = [{1: torch.tensor([[[2, 3]]])}, {1: torch.tensor([[[3, 0]]])}]
    out = decode_routes([prefill, *steps], num_layers=2, top_k=2)
    assert out.shape == (1, 4, 2, 2) and (out[:, :, 0] == N).all()
    assert out[0, :, 1].tolist() == [[0, 1], [1, 2], [2, 3], [3, 0]]
    with pytest.raises(ValueError, match="beam search"):
        decode_routes([prefill, {1: torch.zeros(2, 1, 2)}], num_layers=2, top_k=2)


def test_vllm_routes_follow_trl_padding_and_drop_dense_layers():
    # vLLM: int16 [seq_len - 1, num_layers, top_k]; row 0: prompt 2 + completion 2 (3 rows), row 1: 3 + 1 (3 rows)
    row0 = torch.tensor([[[9], [0]], [[9], [1]], [[9], [2]]], dtype=torch.int16)  # layer 0 dense: the engine's 9
    row1 = torch.tensor([[[9], [3]], [[9], [4]], [[9], [5]]], dtype=torch.int16)
    out = vllm_routes([row0.numpy(), row1], [2, 3], dst_prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                      dst_completion_mask=torch.tensor([[1, 1], [1, 0]]), moe_layers=[1], num_layers=2, top_k=1)
    assert (out[:, :, 0] == N).all()
    assert out[:, :, 1, 0].tolist() == [[N, 0, 1, 2, N], [3, 4, 5, N, N]]
    with pytest.raises(ValueError, match="expected"):
        vllm_routes([row0[:, :1]], [2], torch.tensor([[1, 1]]), torch.tensor([[1, 1]]), [1], 2, 1)


def test_vllm_routes_of_a_truncated_row_that_trl_masked_out():
    # mask_truncated_completions: TRL zeroes the whole completion mask of a row that hit max_completion_length.
    # Row 0 (prompt 2, completion 3, truncated: mask all 0) has 4 routed positions; row 1 (prompt 3 + 1) 3.
    # Before, row 0 counted 0 completion tokens from the mask and raised "4 positions for 2 prompt + 0 completion".
    row0 = torch.tensor([[[9], [0]], [[9], [1]], [[9], [2]], [[9], [3]]], dtype=torch.int16)
    row1 = torch.tensor([[[9], [4]], [[9], [5]], [[9], [6]]], dtype=torch.int16)
    out = vllm_routes([row0, row1], [2, 3], dst_prompt_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                      dst_completion_mask=torch.tensor([[0, 0, 0], [1, 0, 0]]), moe_layers=[1], num_layers=2, top_k=1)
    assert out[:, :, 1, 0].tolist() == [[N, 0, 1, 2, 3, N], [4, 5, 6, N, N, N]]  # the sampler's routes, in place
    assert (out[:, :, 0] == N).all()
    # a masked-out row is still bounded by TRL's width: more positions than prompt + T is a wrong buffer
    with pytest.raises(ValueError, match="6 positions for 2 prompt \\+ 3 completion tokens"):
        vllm_routes([torch.zeros(6, 2, 1, dtype=torch.int16)], [2], torch.tensor([[1, 1]]),
                    torch.tensor([[0, 0, 0]]), [1], 2, 1)
    # an unmasked row keeps its own count: a buffer longer than its tokens is refused as before
    with pytest.raises(ValueError, match="4 positions for 2 prompt \\+ 1 completion tokens"):
        vllm_routes([row0], [2], torch.tensor([[1, 1]]), torch.tensor([[1, 0, 0]]), [1], 2, 1)
