"""`score_centering` (issue 43 item 1; arXiv 2609.20807) in the trainers: the batch function `centering_terms`
against the per-position formulas of `tests/test_centering.py`, 2 training steps with a finite loss on GRPO and RLOO
(the async trainer's are in tests/test_async_grpo.py), off by default (stock TRL bit for bit), the refusals, the run
record, and no (rows, T, V) tensor at a real vocabulary.

Run: pytest tests/test_centering_trainers.py -q
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from grpo_ratio.corrections.centering import (
    center_logps,
    centering_terms,
    exact_centering_term,
    topk_centering_term,
)
from grpo_ratio.corrections.kept_logprobs import HeadLogits
from grpo_ratio.corrections.kept_sets import SamplingSettings


torch.manual_seed(0)
B, T, H, V = 2, 3, 5, 23
STATES = torch.randn(B, T, H, dtype=torch.float64)
W = torch.randn(V, H, dtype=torch.float64)


def _head(states, weight):
    return HeadLogits(states, lambda h, w: F.linear(h, w), V, (weight,))


def test_batch_terms_equal_the_per_position_formula_and_its_gradient():
    # exact with the sampler's top_p re-applied (q = p renormalised over S), through a head, chunked and recomputed
    settings = SamplingSettings(temperature=0.7, top_p=0.8)
    mask = torch.tensor([[True, True, False], [True, False, True]])
    s1, w1 = STATES.clone().requires_grad_(), W.clone().requires_grad_()
    got = centering_terms(_head(s1, w1), mask, 0.7, kept=settings, chunk_cells=2)  # (B, T)
    s2, w2 = STATES.clone().requires_grad_(), W.clone().requires_grad_()
    raw = F.linear(s2, w2)[mask]  # (M, V)
    keep = settings.keep_mask(raw.detach())
    expected = exact_centering_term(raw / 0.7, (raw.detach() / 0.7).masked_fill(~keep, -math.inf))  # (M,)
    torch.testing.assert_close(got[mask], expected, rtol=0, atol=1e-12)
    assert (got[~mask] == 0).all()
    (got * torch.arange(1.0, 7.0).reshape(B, T)).sum().backward()
    (expected * torch.arange(1.0, 7.0).reshape(B, T)[mask]).sum().backward()
    # the recomputed chunks' gradients are accumulated in fp32 (as TRL's fused head accumulates its own)
    torch.testing.assert_close(s1.grad, s2.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-5)
    # the centred score's expectation under the sampler is 0 through the head too: E_q[grad (log p(y) - c)] = 0
    z = F.linear(STATES, W)[mask] / 0.7
    q = torch.softmax((z).masked_fill(~keep, -math.inf), -1)  # (M, V)
    total = torch.zeros_like(W)
    for y in range(V):
        w = W.clone().requires_grad_()
        logits = F.linear(STATES, w)
        c = centering_terms(_head(STATES, w), mask, 0.7, kept=settings)
        logp = torch.log_softmax(logits / 0.7, -1)[..., y]  # (B, T)
        (grad,) = torch.autograd.grad((q[:, y] * center_logps(logp, c)[mask]).sum(), w)
        total += grad
    assert total.abs().max() < 1e-7  # the fp32 accumulation of the chunks; uncentred it is the drift below
    assert (q - torch.softmax(z, -1)).abs().sum(-1).max() > 0.1  # top_p cut 20% of some positions


def test_batch_top_k_agrees_with_exact_within_the_tail_mass():
    mask = torch.ones(B, T, dtype=torch.bool)
    zq = F.linear(STATES, W) + 0.3 * torch.randn(B, T, V, dtype=torch.float64)  # the sampler: another engine
    logq = torch.log_softmax(zq, -1)
    for k in (1, 4, V):
        values, ids = logq.topk(k, -1)  # (B, T, k)
        s1 = STATES.clone().requires_grad_()
        top = centering_terms(_head(s1, W), mask, topk_ids=ids, topk_logprobs=values)
        # compare logit gradients: the per-position functions on the same logits
        z1 = F.linear(STATES, W).reshape(-1, V).clone().requires_grad_()
        (g_exact,) = torch.autograd.grad(exact_centering_term(z1, zq.reshape(-1, V)).sum(), z1)
        z2 = F.linear(STATES, W).reshape(-1, V).clone().requires_grad_()
        (g_k,) = torch.autograd.grad(topk_centering_term(z2, ids.reshape(-1, k), values.reshape(-1, k)).sum(), z2)
        mass = values.exp().sum(-1).reshape(-1)
        assert ((g_exact - g_k).abs().sum(-1) <= 2 * (1 - mass) + 1e-9).all()
        torch.testing.assert_close(top.reshape(-1), topk_centering_term(F.linear(STATES, W).reshape(-1, V), ids.reshape(
            -1, k), values.reshape(-1, k)), rtol=0, atol=1e-12)  # the batch function is the formula


def test_no_rows_t_v_tensor_at_a_real_vocabulary():
    # forward and backward of the exact term through a head at V = 151,936: the peak of what is alive at once is a few
    # chunks' (K, V) fp32 tensors and the head's gradient, never the batch's (B*T, V) logits
    from live_bytes import LiveBytes

    big_v, rows, steps, hidden, chunk = 151_936, 4, 128, 16, 8
    states = torch.randn(rows, steps, hidden, requires_grad=True)
    weight = (torch.randn(big_v, hidden) * 0.1).requires_grad_()
    logits = HeadLogits(states, lambda h, w: F.linear(h, w), big_v, (weight,))
    settings = SamplingSettings(top_k=50)
    with LiveBytes() as live:
        term = centering_terms(logits, torch.ones(rows, steps, dtype=torch.bool), kept=settings, chunk_cells=chunk)
        term.sum().backward()
    full = rows * steps * big_v * 4  # the (rows, T, V) fp32 logits: 311 MB
    budget = 2 * weight.numel() * 4 + 12 * chunk * big_v * 4  # the head's fp32 gradient (twice) + a few chunks
    assert live.peak <= budget < full, (live.peak, budget, full)
    assert torch.isfinite(weight.grad).all() and weight.grad.abs().sum() > 0


def _rows(trainer):
    return [r for r in trainer.state.log_history if "loss" in r]


def _run_record(trainer) -> dict:
    with open(trainer.args.output_dir + "/run.json") as f:
        return json.load(f)["config"]


@pytest.mark.parametrize("kw", [dict(score_centering="exact", top_p=0.8),
                                dict(score_centering="exact", top_p=0.8, truncation_correction="renormalize"),
                                dict(score_centering="top_k", score_centering_top_k=5)])
def test_grpo_trains_two_steps_centred(tmp_path, kw):
    from trainer_fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path, **kw)
    trainer.train()
    rows = _rows(trainer)
    assert trainer.state.global_step == 2 and len(rows) == 2
    assert all(math.isfinite(r["loss"]) for r in rows)
    tv = [r["ratio/centering/drift_tv"] for r in rows]
    config = _run_record(trainer)
    assert config["score_centering"] == kw["score_centering"]
    if kw.get("truncation_correction") == "renormalize":
        # the policy's log-probs are over the kept sets already: p_S is the sampler's q, nothing left to centre
        assert all(0.0 <= t < 1e-6 for t in tv), tv
    elif kw["score_centering"] == "exact":
        # top_p=0.8, `generate`: q is p renormalised over the kept set, TV(q, p) = 1 - the kept mass ~ 0.2
        assert all(0.1 < t < 0.3 for t in tv), tv
        assert config["score_centering_source"].startswith("exact: recomputed from the training forward")
    else:
        assert all(0.0 <= t < 0.05 for t in tv), tv  # the sampler is this policy: only rounding between them
        assert all(0.0 < r["ratio/centering/tail_mass"] < 1.0 for r in rows)
        assert config["score_centering_source"] == ("top_k: the generate recording's top 5 processed log-probs per "
                                                    "token, proportional tail")


def test_rloo_trains_two_steps_centred(tmp_path):
    from test_rloo import tiny_rloo

    trainer = tiny_rloo(tmp_path, "bf16", top_p=0.8, score_centering="exact")
    trainer.train()
    rows = _rows(trainer)
    assert trainer.state.global_step == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(0.1 < r["ratio/centering/drift_tv"] < 0.3 for r in rows)


def test_off_by_default_is_stock_trl_bit_for_bit(tmp_path):
    from trainer_fixtures import tiny_trainer, trl_logged_values
    from trl import GRPOTrainer

    stock = tiny_trainer(tmp_path / "stock", trainer_cls=GRPOTrainer, top_p=0.8)
    stock.train()
    ours = tiny_trainer(tmp_path / "ours", top_p=0.8)  # each trainer built and trained in turn (the seed's order)
    assert ours.args.score_centering is None and ours.plan.centering is None
    ours.train()
    assert trl_logged_values(ours) == trl_logged_values(stock)
    assert not any(k.startswith("ratio/centering/") for r in ours.state.log_history for k in r)
    assert _run_record(ours)["score_centering_source"] is None


def test_refusals_name_the_field_and_the_allowed_values(tmp_path):
    from trainer_fixtures import tiny_grpo_args

    cases = [
        (dict(score_centering="full"), "score_centering='full' is not allowed; allowed: exact, top_k"),
        (dict(score_centering_top_k=5), "score_centering_top_k only applies with score_centering='top_k'"),
        (dict(score_centering="exact", score_centering_tail="drop"), "only applies with score_centering='top_k'"),
        (dict(score_centering="top_k", score_centering_top_k=0), "score_centering_top_k must be an integer >= 1"),
        (dict(score_centering="top_k", score_centering_tail="uniform"),
         "score_centering_tail='uniform' is not allowed; allowed: proportional, drop"),
        (dict(score_centering="exact", num_iterations=2), "one optimizer update per generation"),
        (dict(score_centering="exact", use_vllm=True), "score_centering='top_k' (vLLM's own top-k"),
        (dict(score_centering="top_k", truncation_correction="renormalize", top_p=0.8), "lift_sampler"),
        (dict(score_centering="top_k", record_sampler_logprobs=False), "record_sampler_logprobs=True"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            tiny_grpo_args(tmp_path, **kwargs)


def test_exact_refuses_a_processor_it_does_not_recompute(tmp_path):
    from trainer_fixtures import tiny_trainer

    with pytest.raises(ValueError, match="repetition_penalty"):
        tiny_trainer(tmp_path, score_centering="exact", repetition_penalty=1.3)


def test_centring_changes_the_gradient_not_the_values(tmp_path):
    # the same rollouts (same seed) with and without centring: TRL's loss of the first step is the same bit for bit
    # (center_logps adds c - sg(c) = 0 exactly), its gradient is not (top_p=0.8: q - p is the truncation's drift)
    from trainer_fixtures import tiny_trainer

    runs = {}
    for name, kw in (("plain", {}), ("centred", {"score_centering": "exact"})):
        trainer = tiny_trainer(tmp_path / name, top_p=0.8, max_steps=1, **kw)
        trainer.train()
        runs[name] = _rows(trainer)[0]
    assert runs["plain"]["loss"] == runs["centred"]["loss"]
    assert runs["plain"]["reward"] == runs["centred"]["reward"]
    assert abs(runs["plain"]["grad_norm"] - runs["centred"]["grad_norm"]) > 1e-3 * runs["plain"]["grad_norm"]


def test_the_recorder_keeps_each_steps_top_k_of_the_processed_scores():
    from grpo_ratio.sampler.generate import SamplerLogprobRecorder

    neg = -math.inf
    rec = SamplerLogprobRecorder(support_size_only=True, top_k=2)
    rec.attached = True  # driven by hand, as generate would after recording_sampler attaches it
    s0 = torch.tensor([[2.0, 1.0, neg, neg], [0.5, 0.0, 3.0, 0.0]])  # step 0 processed scores (N=2, V=4)
    rec(torch.tensor([[5], [6]]), s0)
    s1 = torch.tensor([[neg, neg, 5.0, neg], [1.0, neg, 2.0, neg]])  # step 1: row 0 kept one token only
    rec(torch.tensor([[5, 0], [6, 2]]), s1)
    record = rec.finalize(torch.tensor([[5, 0, 2], [6, 2, 0]]))
    ids, logq = record.top_k  # (N, T, k) each
    finite = torch.isfinite(logq)  # beyond the kept set (log q = -inf, q = 0) the id is any of the tied ones
    assert torch.where(finite, ids, -1).tolist() == [[[0, 1], [2, -1]], [[2, 0], [2, 0]]]
    lse0 = math.log(math.exp(3) + math.exp(0.5) + 2)
    expected = torch.tensor([[[-math.log(1 + math.exp(-1)), -math.log(1 + math.exp(1))], [0.0, neg]],
                             [[3 - lse0, 0.5 - lse0], [-math.log(1 + math.exp(-1)), -math.log(1 + math.exp(1))]]])
    torch.testing.assert_close(logq, expected, atol=1e-6, rtol=0)


def test_a_sharded_policy_is_refused():
    from types import SimpleNamespace

    from grpo_ratio.checks import check_centering_engine

    for engine in ("fsdp1", "fsdp2", "zero3"):
        with pytest.raises(NotImplementedError, match=f"score_centering='exact' .* {engine} holds only a shard"):
            check_centering_engine(SimpleNamespace(score_centering="exact"), engine)
    check_centering_engine(SimpleNamespace(score_centering="exact"), "none")  # unsharded: fine
    check_centering_engine(SimpleNamespace(score_centering=None), "zero3")  # off: nothing to refuse


def test_vllm_top_k_is_accepted_and_asks_the_colocate_engine_for_k_log_probs(tmp_path):
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio.sampler.vllm import colocate_engine_kwargs

    args = tiny_grpo_args(tmp_path, score_centering="top_k", score_centering_top_k=32, use_vllm=True,
                          vllm_mode="colocate", record_sampler_logprobs=False)
    assert colocate_engine_kwargs(args, sampling_masks=False)["max_logprobs"] == 32
    args = tiny_grpo_args(tmp_path, score_centering="top_k", use_vllm=True, vllm_mode="colocate")
    assert colocate_engine_kwargs(args, sampling_masks=False)["max_logprobs"] == 20


def _vllm_answer():
    # TRL's extract_logprobs with logprobs=2, two completions: rank order, the sampled token appended third when it
    # is not in the top 2 (row 0, step 1), NaN as None, -inf outside a kept set (row 1, step 0)
    completion_ids = [[5, 9], [3]]
    logprobs = [[[-0.1, -2.5], [-0.3, -1.6, -4.0]], [[-0.05, -math.inf]]]
    token_ids = [[[5, 7], [2, 4, 9]], [[3, 8]]]
    return completion_ids, logprobs, token_ids


def test_split_top_logprobs_gives_trl_the_sampled_tokens_and_keeps_the_top_k():
    from grpo_ratio.sampler.vllm import split_top_logprobs

    sampled, (ids, logq) = split_top_logprobs(*_vllm_answer(), k=2)
    assert sampled == [[-0.1, -4.0], [-0.05]]
    assert ids.shape == logq.shape == (2, 2, 2) and ids.dtype == torch.int64 and logq.dtype == torch.float32
    assert ids[0].tolist() == [[5, 7], [2, 4]] and ids[1, 0].tolist() == [3, 8]
    torch.testing.assert_close(logq[0], torch.tensor([[-0.1, -2.5], [-0.3, -1.6]]), rtol=0, atol=0)
    assert logq[1, 0, 0].item() == pytest.approx(-0.05) and logq[1, 0, 1].item() == -math.inf
    assert ids[1, 1].unique().numel() == 2 and (logq[1, 1] == -math.inf).all()  # padding: distinct ids, q = 0
    # fewer entries than k (a vocabulary under k): distinct unused ids with q = 0
    _, (ids, logq) = split_top_logprobs([[1]], [[[-0.2, None]]], [[[1, 0]]], k=4)
    assert sorted(ids[0, 0].tolist()) == [0, 1, 2, 3] and logq[0, 0, 1].item() == -math.inf
    with pytest.raises(RuntimeError, match="do not contain the sampled token 6"):
        split_top_logprobs([[6]], [[[-0.1, -2.0]]], [[[5, 7]]], k=2)


def test_vllm_logprob_capture_answers_trl_as_logprobs_0_and_keeps_the_top_k():
    # TRL's VLLMGeneration stand-in: the real one needs an engine (the vLLM lane trains through it); this one answers
    # generate(...) with its 4-tuple contract for the `logprobs` it was asked
    from grpo_ratio.sampler.vllm import VLLMLogprobCapture

    class Generation:
        logprobs = 0

        def generate(self, prompts, *args, **kwargs):
            completion_ids, logprobs, token_ids = _vllm_answer()
            assert self.logprobs == 2
            return [[1]] * 2, completion_ids, logprobs, token_ids

    generation = Generation()
    capture = VLLMLogprobCapture(generation, top_k=2)
    _, completion_ids, logprobs, token_ids = generation.generate(["a", "b"])
    assert [[lp[0] for lp in seq] for seq in logprobs] == [[-0.1, -4.0], [-0.05]]  # GRPOTrainer's read
    assert token_ids == [[[5], [9]], [[3]]]
    assert capture.take(2) == [[-0.1, -4.0], [-0.05]]
    ids, logq = capture.take_top(2)
    assert ids.shape == (2, 2, 2) and capture.top is None
    with pytest.raises(RuntimeError, match="no vLLM top-k"):
        capture.take_top(2)
