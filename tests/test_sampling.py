"""Tests of grpo_ratio.corrections.kept_sets and grpo_ratio.sampler.generate: kept sets, the sampler-logprob recorder and the truncation corrections.

Run: /work/venv/bin/pytest tests/test_sampling.py -q
Hand-derived constants (V = 4 logits [2, 1, 0, -1]):
  e^2 = 7.389056, e^1 = 2.718282, e^0 = 1, e^-1 = 0.367879; sum = 11.475217, sum over {0, 1} = 10.107338.
"""

import math

import pytest
import torch
from fixtures_vllm import RequestOutput, completion
from transformers import LogitsProcessorList

from grpo_ratio.corrections.kept_logprobs import (
    DEFAULT_CHUNK_CELLS,
    is_top_prefix,
    kept_set_logprobs,
    lift_sampler_logprobs,
)
from grpo_ratio.corrections.kept_sets import KeptSets
from grpo_ratio.sampler.generate import SamplerLogprobRecorder, recording_sampler
from grpo_ratio.sampler.vllm import kept_sets_from_vllm
from grpo_ratio.testing import tiny_model


NEG = -math.inf
LOGITS = [2.0, 1.0, 0.0, -1.0]


def _log_kept_mass(logits, tokens, kept, temperature=1.0, mask=None, chunk_cells=DEFAULT_CHUNK_CELLS):
    """log M_S as the trainer computes it (the one implementation): the sampled token's full-vocabulary log-prob
    minus its kept-set log-prob (`kept_set_logprobs`); 0.0 outside `mask`."""
    full = torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)  # (B, T)
    mass = full - kept_set_logprobs(logits, tokens, kept, temperature, mask=mask, chunk_cells=chunk_cells)
    return mass if mask is None else torch.where(mask, mass, 0.0)


def _batch():
    """B=2, T=2, V=4: row 0 truncated twice, row 1 untruncated then padding."""
    logits = torch.tensor([[LOGITS, LOGITS], [[0.0] * 4, [0.0] * 4]])  # (2, 2, 4)
    kept = KeptSets.from_lists([[[0, 1], [2]], [[0, 1, 2, 3], []]])
    tokens = torch.tensor([[0, 2], [3, 0]])  # (2, 2)
    mask = torch.tensor([[True, True], [True, False]])  # (2, 2) row 1, position 1 is padding
    return logits, kept, tokens, mask


# ---------------------------------------------------------------------------------------------------------------------
# corrections: hand-derived values
# ---------------------------------------------------------------------------------------------------------------------


def test_kept_set_logprobs_hand_values():
    logits, kept, tokens, mask = _batch()
    got = kept_set_logprobs(logits, tokens, kept, temperature=1.0, mask=mask)
    expected = torch.tensor([
        # 2 - log(e^2 + e^1) = -log(1 + e^-1) = -0.313262;  size-1 set {2} -> 0.0
        [-math.log(1 + math.exp(-1)), 0.0],
        # uniform over 4 kept tokens: -log 4 = -1.386294;  padding -> 0.0
        [-math.log(4), 0.0],
    ])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert got.dtype == torch.float32


def test_kept_set_logprobs_temperature_and_neg_inf_logits():
    # logits [2, 1, 0, -inf] at temperature 2 -> z = [1, 0.5, 0, -inf]; S = {0, 1}, token 1:
    # 0.5 - log(e^1 + e^0.5) = -log(e^0.5 + 1) = -log(2.648721) = -0.974077
    logits = torch.tensor([[[2.0, 1.0, 0.0, NEG]]])
    kept = KeptSets.from_lists([[[0, 1]]])
    got = kept_set_logprobs(logits, torch.tensor([[1]]), kept, temperature=2.0)
    torch.testing.assert_close(got, torch.tensor([[-math.log(math.exp(0.5) + 1)]]), atol=1e-6, rtol=0)


def test_log_kept_mass_hand_values():
    logits, kept, tokens, mask = _batch()
    got = _log_kept_mass(logits, tokens, kept, temperature=1.0, mask=mask)
    expected = torch.tensor([
        # log(10.107338 / 11.475217) = log(0.880797) = -0.126928;  log(e^0 / 11.475217) = -2.440189
        [math.log(10.107338 / 11.475217), -math.log(11.475217)],
        # the whole vocabulary is kept: log 1 = 0;  padding -> 0.0
        [0.0, 0.0],
    ])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_lift_sampler_makes_on_policy_ratio_one():
    # On-policy, the sampler's log-prob is the kept-set log-prob; lifting it by log M_S gives back the full-vocab
    # log-prob, so old/lifted = 1 where old/sampler = M_S (0.880797 at row 0, position 0).
    logits, kept, tokens, mask = _batch()
    sampler = kept_set_logprobs(logits, tokens, kept, mask=mask)
    full = torch.where(mask, torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1), 0.0)
    lifted = lift_sampler_logprobs(sampler, _log_kept_mass(logits, tokens, kept, mask=mask))
    torch.testing.assert_close(torch.exp(full - lifted), torch.ones(2, 2), atol=1e-6, rtol=0)
    assert abs(math.exp(full[0, 0] - sampler[0, 0]) - 0.880797) < 1e-6
    with pytest.raises(ValueError, match="same"):
        lift_sampler_logprobs(sampler, torch.zeros(2, 3))


def test_out_of_set_token_names_row_and_position():
    logits, kept, tokens, mask = _batch()
    bad = tokens.clone()
    bad[0, 1] = 3  # kept set at row 0, position 1 is {2}
    with pytest.raises(ValueError, match=r"inconsistent rollout: sampled token 3 at row 0, position 1"):
        kept_set_logprobs(logits, bad, kept, mask=mask)


def test_masked_in_cell_without_set_and_bad_arguments():
    logits, kept, tokens, _ = _batch()
    with pytest.raises(ValueError, match=r"no kept set at row 1, position 1"):
        kept_set_logprobs(logits, tokens, kept)  # no mask: the padding cell has size 0
    with pytest.raises(ValueError, match="temperature must be > 0"):
        kept_set_logprobs(logits, tokens, kept, temperature=0.0)
    with pytest.raises(ValueError, match="select_rows"):
        kept_set_logprobs(logits[:1], tokens[:1], kept)


def test_gradient_only_reaches_kept_logits():
    # d/dz [z_0 - logsumexp(z_0, z_1)] = [1 - p0, -p1, 0, 0], p0 = e^2 / (e^2 + e^1) = 0.731059, p1 = 0.268941
    logits = torch.tensor([[LOGITS]], requires_grad=True)
    kept_set_logprobs(logits, torch.tensor([[0]]), KeptSets.from_lists([[[0, 1]]])).sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[0.268941, -0.268941, 0.0, 0.0]]]), atol=1e-6, rtol=0)


def test_chunked_equals_whole_and_accepts_bf16():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 40).bfloat16()  # (B, T, V)
    sizes = torch.randint(1, 40, (3, 5))
    order = logits.float().argsort(-1, descending=True)  # (3, 5, 40)
    kept = KeptSets.from_lists([[order[b, t, :sizes[b, t]].tolist() for t in range(5)] for b in range(3)])
    tokens = order[..., 0]  # the top token is in every set
    a = kept_set_logprobs(logits, tokens, kept, temperature=0.7, chunk_cells=1)
    b = kept_set_logprobs(logits.float(), tokens, kept, temperature=0.7, chunk_cells=1024)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)  # same bf16-rounded values, upcast per chunk
    torch.testing.assert_close(_log_kept_mass(logits, tokens, kept, 0.7, chunk_cells=2),
                               _log_kept_mass(logits.float(), tokens, kept, 0.7), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# support-size replay
# ---------------------------------------------------------------------------------------------------------------------


def test_top_prefix_hand_value():
    # top-2 of [2, 1, 0, -1]: logcumsumexp([2, 1, 0, -1])[1] - logsumexp = log(10.107338 / 11.475217) = -0.126928
    sizes = KeptSets(torch.tensor([[2]], dtype=torch.int32), support_size_only=True)
    got = _log_kept_mass(torch.tensor([[LOGITS]]), torch.tensor([[0]]), sizes)
    torch.testing.assert_close(got, torch.tensor([[math.log(10.107338 / 11.475217)]]), atol=1e-6, rtol=0)


def test_support_size_equals_explicit_sets_on_top_prefix():
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 50)  # (B, T, V)
    sizes = torch.randint(1, 51, (2, 6))
    order = logits.argsort(-1, descending=True)
    kept = KeptSets.from_lists([[order[b, t, :sizes[b, t]].tolist() for t in range(6)] for b in range(2)])
    assert bool(is_top_prefix(logits, kept).all())
    tokens = order[..., 0]
    explicit = _log_kept_mass(logits, tokens, kept, temperature=0.8)
    sizes = KeptSets(kept.sizes, support_size_only=True)
    torch.testing.assert_close(_log_kept_mass(logits, tokens, sizes, 0.8), explicit, atol=1e-6, rtol=0)
    torch.testing.assert_close(_log_kept_mass(logits, tokens, kept.size_only(), 0.8), explicit, atol=1e-6, rtol=0)
    torch.testing.assert_close(kept_set_logprobs(logits, tokens, kept.size_only(), 0.8),
                               kept_set_logprobs(logits, tokens, kept, 0.8), atol=1e-6, rtol=0)


def test_is_top_prefix_detects_a_non_prefix_set():
    # {0, 2} of [2, 1, 0, -1] skips token 1 (logit 1 > 0): not a prefix; {0, 1} is; padding cell -> True
    kept = KeptSets.from_lists([[[0, 2], [0, 1], []]])
    got = is_top_prefix(torch.tensor([[LOGITS, LOGITS, LOGITS]]), kept)
    assert got.tolist() == [[False, True, True]]


# ---------------------------------------------------------------------------------------------------------------------
# KeptSets and vLLM outputs
# ---------------------------------------------------------------------------------------------------------------------


def test_kept_sets_layout_and_selection():
    kept = KeptSets.from_lists([[[3, 1], [2]], [[0], []]])
    assert kept.sizes.tolist() == [[2, 1], [1, 0]]
    assert kept.offsets.tolist() == [0, 2, 3, 4, 4]
    assert kept.ids.tolist() == [3, 1, 2, 0]
    assert kept.nbytes == 4 * 4 + 4 * 4 + 5 * 8  # sizes (2, 2) int32 + 4 ids int32 + 5 offsets int64 = 72 B
    assert kept.cell_ids(0, 1).tolist() == [2]
    assert kept.select_rows([1, 0]) == KeptSets.from_lists([[[0], []], [[3, 1], [2]]])
    assert kept.resize_steps(3) == KeptSets.from_lists([[[3, 1], [2], []], [[0], [], []]])
    assert kept.masked(torch.tensor([[True, False], [True, True]])) == KeptSets.from_lists([[[3, 1], []], [[0], []]])
    assert kept.select_rows([1]).resize_steps(1) == KeptSets.from_lists([[[0]]])
    with pytest.raises(ValueError, match="would drop"):
        kept.resize_steps(1)
    dense = kept.to_dense(4)  # (2, 2, 4)
    assert dense[0, 0].tolist() == [False, True, False, True] and int(dense.sum()) == 4
    assert KeptSets.from_mask(dense) == KeptSets.from_lists([[[1, 3], [2]], [[0], []]])  # ascending within a cell
    assert kept.size_only().ids is None and kept.size_only() != kept


@pytest.mark.parametrize("csr", [False, True], ids=["nested", "csr"])
def test_kept_sets_from_vllm(csr):
    cells = [[[5, 7], [1]], [[2], [2, 3, 4], [9]], [[0, 8]]]
    outputs = [
        RequestOutput("r0", "p", [1, 2], None, [completion(0, [7, 1], cells[0], csr), completion(1, [2, 3, 9],
                                                                                                cells[1], csr)], True),
        RequestOutput("r1", "q", [3], None, [completion(0, [8], cells[2], csr)], True),
    ]
    assert kept_sets_from_vllm(outputs) == KeptSets.from_lists(cells, num_steps=3)
    assert kept_sets_from_vllm(outputs, num_steps=4).sizes.tolist() == [[2, 1, 0, 0], [1, 3, 1, 0], [2, 0, 0, 0]]
    sizes_only = kept_sets_from_vllm([o for r in outputs for o in r.outputs], support_size_only=True)
    assert sizes_only == KeptSets.from_lists(cells).size_only()


def test_vllm_nested_masks_are_read_without_an_array_per_token(monkeypatch):
    # was: one np.asarray per generated token (524k calls per 64 x 8k-token batch); now one pass over the ints of a
    # completion and one array per completion, with the same sets
    import numpy as np

    g = np.random.default_rng(0)
    cells = [[sorted(g.choice(300, size=int(g.integers(1, 9)), replace=False).tolist()) for _ in range(T)]
             for T in (512, 300)]  # 2 completions x up to 512 tokens, 1-8 kept ids each, Python lists as vLLM's
    outputs = [completion(n, [1] * len(row), row) for n, row in enumerate(cells)]
    expected = KeptSets.from_lists(cells, num_steps=512)
    calls = []
    asarray = np.asarray
    monkeypatch.setattr(np, "asarray", lambda *a, **k: calls.append(1) or asarray(*a, **k))
    got = kept_sets_from_vllm(outputs)
    monkeypatch.undo()
    assert got == expected and got.sizes.shape == (2, 512) and int(got.sizes.sum()) == sum(map(len, sum(cells, [])))
    assert len(calls) <= 2  # at most one per completion (812 cells)


def test_kept_sets_from_csr_rows():
    import numpy as np

    rows = [(np.array([5, 7, 1], np.int32), np.array([2, 1])), (np.array([2, 2, 3, 4], np.int32), np.array([1, 3, 0]))]
    assert KeptSets.from_csr_rows(rows) == KeptSets.from_lists([[[5, 7], [1]], [[2], [2, 3, 4], []]])
    assert KeptSets.from_csr_rows(rows, num_steps=4).sizes.tolist() == [[2, 1, 0, 0], [1, 3, 0, 0]]
    with pytest.raises(ValueError, match="row 1 has 3 steps but num_steps=2"):
        KeptSets.from_csr_rows(rows, num_steps=2)
    with pytest.raises(ValueError, match="row 0's sizes add up to 4, not to its 3 ids"):
        KeptSets.from_csr_rows([(rows[0][0], np.array([2, 2]))])


def test_kept_sets_from_vllm_errors():
    missing = completion(0, [1, 2], [[1], [2]])
    missing.sampling_mask = None
    with pytest.raises(ValueError, match="return_sampling_mask=True"):
        kept_sets_from_vllm([missing])
    with pytest.raises(ValueError, match="1 kept sets for 2 generated tokens"):
        kept_sets_from_vllm([completion(0, [1, 2], [[1]])])


# ---------------------------------------------------------------------------------------------------------------------
# SamplerLogprobRecorder
# ---------------------------------------------------------------------------------------------------------------------


def test_recorder_literal_steps():
    rec = SamplerLogprobRecorder()
    rec.attached = True  # driven by hand, as generate would after recording_sampler attaches it
    s0 = torch.tensor([[2.0, 1.0, NEG, NEG], [0.0, 0.0, 0.0, 0.0]])  # step 0 processed scores (N=2, V=4)
    assert rec(torch.tensor([[5], [6]]), s0) is s0  # unchanged, same object
    s1 = torch.tensor([[NEG, NEG, 5.0, NEG], [1.0, NEG, 1.0, NEG]])  # step 1
    rec(torch.tensor([[5, 0], [6, 3]]), s1)  # tokens of step 0: 0 and 3
    sequences = torch.tensor([[5, 0, 2], [6, 3, 2]])  # tokens of step 1: 2 and 2
    record = rec.finalize(sequences)
    expected = torch.tensor([
        [-math.log(1 + math.exp(-1)), 0.0],  # 2 - log(e^2 + e^1) = -0.313262;  only token kept -> 0
        [-math.log(4), -math.log(2)],  # uniform over 4: -1.386294;  two equal kept logits: -0.693147
    ])
    torch.testing.assert_close(record.logprobs, expected, atol=1e-6, rtol=0)
    assert record.kept == KeptSets.from_lists([[[0, 1], [2]], [[0, 1, 2, 3], [0, 2]]])


def test_recorder_finalize_with_completion_mask_and_size_only():
    rec = SamplerLogprobRecorder(support_size_only=True)
    rec.attached = True
    rec(torch.tensor([[5], [6]]), torch.tensor([[2.0, 1.0, NEG, NEG], [0.0, 0.0, 0.0, 0.0]]))
    rec(torch.tensor([[5, 0], [6, 1]]), torch.tensor([[NEG, NEG, 5.0, NEG], [1.0, NEG, 1.0, NEG]]))
    # row 1 ended at step 0 (EOS id 1); the pad 0 forced at step 1 is not a sampled token
    mask = torch.tensor([[True, True], [True, False]])
    record = rec.finalize(torch.tensor([[5, 0, 2], [6, 1, 0]]), completion_mask=mask)
    expected = torch.tensor([[-math.log(1 + math.exp(-1)), 0.0], [-math.log(4), 0.0]])
    torch.testing.assert_close(record.logprobs, expected, atol=1e-6, rtol=0)
    assert record.kept.support_size_only and record.kept.sizes.tolist() == [[2, 1], [4, 0]]


def test_unattached_recorder_refuses_to_run():
    # transformers puts logits_processor= entries before temperature/top_k/top_p: the recorder would see raw scores
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(RuntimeError, match="recording_sampler"):
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=5, max_new_tokens=2,
                       logits_processor=LogitsProcessorList([SamplerLogprobRecorder()]))


@pytest.mark.parametrize("truncation", [{"top_p": 0.8}, {"top_k": 5}, {"min_p": 0.1}], ids=["top_p", "top_k", "min_p"])
def test_recorder_matches_output_scores(truncation):
    model = tiny_model()
    torch.manual_seed(3)
    prompts = torch.randint(3, 300, (3, 4))  # (N, P)
    kwargs = {"attention_mask": torch.ones_like(prompts), "do_sample": True, "temperature": 0.7, "max_new_tokens": 6,
              "return_dict_in_generate": True, "output_scores": True, **truncation}

    rec = SamplerLogprobRecorder()
    torch.manual_seed(0)
    with recording_sampler(model, rec):
        out = model.generate(prompts, **kwargs)
    assert "_get_logits_processor" not in model.__dict__  # the wrapper is gone after the block
    torch.manual_seed(0)
    plain = model.generate(prompts, **kwargs)
    assert torch.equal(out.sequences, plain.sequences)  # the recorder draws no random numbers

    record = rec.finalize(out.sequences)
    scores = torch.stack(out.scores, 1)  # (N, T, V) brute force: what multinomial drew from
    tokens = out.sequences[:, prompts.shape[1]:]  # (N, T)
    brute = torch.log_softmax(scores.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)  # (N, T)
    torch.testing.assert_close(record.logprobs, brute, atol=1e-6, rtol=0)
    assert record.kept == KeptSets.from_mask(scores != NEG)
    if "top_k" in truncation:  # the recorder saw the warped scores: exactly 5 kept ids per step
        assert record.kept.sizes.unique().tolist() == [5]


def test_recorder_drops_steps_that_generate_undid():
    # a deferred stop check runs one extra step and removes it from the sequences: finalize keeps the first T steps
    rec = SamplerLogprobRecorder()
    rec.attached = True
    rec(torch.tensor([[5]]), torch.tensor([[2.0, 1.0, NEG, NEG]]))
    rec(torch.tensor([[5, 1]]), torch.tensor([[0.0, 0.0, 0.0, 0.0]]))  # token 1 of step 0; this step is undone
    record = rec.finalize(torch.tensor([[5, 1]]))  # T = 1
    # 1 - log(e^2 + e^1) = -log(1 + e) = -1.313262
    torch.testing.assert_close(record.logprobs, torch.tensor([[-math.log(1 + math.e)]]), atol=1e-6, rtol=0)
    assert record.kept == KeptSets.from_lists([[[0, 1]]])


def test_recording_sampler_records_one_generate_per_block():
    model = tiny_model()
    ids = torch.tensor([[5, 6, 7]])
    kwargs = {"attention_mask": torch.ones_like(ids), "do_sample": True, "top_k": 5, "max_new_tokens": 2}
    with recording_sampler(model, SamplerLogprobRecorder()):
        model.generate(ids, **kwargs)
        with pytest.raises(RuntimeError, match="one generate call"):
            model.generate(ids, **kwargs)
