"""Score centering (arXiv 2609.20807; issue 43 item 1), `grpo_ratio.corrections.centering`, on literal tensors: the
identity the method relies on (the centred score has expectation zero under the sampler), the exact term against a
direct full-vocabulary formula, tiling, and the top-k variants against the exact one within the top-k tail mass.

Run: pytest tests/test_centering.py -q
"""

import pytest
import torch

from grpo_ratio.corrections.centering import center_logps, exact_centering_term, topk_centering_term


torch.manual_seed(0)
N, V = 4, 37
Z = torch.randn(N, V, dtype=torch.float64) * 2  # the trained policy's logits p = softmax(Z)
ZQ = Z + 0.5 * torch.randn(N, V, dtype=torch.float64)  # the sampler's: the same model through another engine
ZQ[1, :10] = -torch.inf  # a truncated sampler (top-k/top-p removed 10 tokens at position 1)


def _centred_grads(logits_q, term_fn):
    """For every possible next token y: the gradient w.r.t. the logits of log p(y) - c (c from `term_fn`), (N, V, V)
    as [position, y, logit]."""
    grads = torch.zeros(N, V, V, dtype=torch.float64)
    for y in range(V):
        z = Z.clone().requires_grad_()
        c = term_fn(z)
        log_p = torch.log_softmax(z, dim=-1)[:, y]
        (grad,) = torch.autograd.grad((log_p - c).sum(), z)
        grads[:, y] = grad
    return grads


def test_the_centred_score_has_expectation_zero_under_the_sampler():
    q = torch.softmax(ZQ, dim=-1)
    centred = _centred_grads(ZQ, lambda z: exact_centering_term(z, ZQ, tile=8))
    expectation = (q[:, :, None] * centred).sum(1)  # (N, V): E_{y~q}[grad(log p(y) - c)]
    assert expectation.abs().max() < 1e-12
    # without centring the expectation is the drift q - p, which the estimator accumulates
    plain = _centred_grads(ZQ, lambda z: torch.zeros(N, dtype=torch.float64))
    drift = (q[:, :, None] * plain).sum(1)
    torch.testing.assert_close(drift, q - torch.softmax(Z, dim=-1), rtol=0, atol=1e-12)
    assert drift.abs().sum(-1).min() > 0.1
    # and under p itself the plain score is already centred (on-policy: nothing to subtract)
    p = torch.softmax(Z, dim=-1)
    assert (p[:, :, None] * plain).sum(1).abs().max() < 1e-12


def test_through_a_head_the_identity_holds_for_the_weights():
    # logits = h W: the centred score's expectation is zero for the parameters too (chain rule of the same identity)
    h = torch.randn(N, 6, dtype=torch.float64)
    w0 = torch.randn(6, V, dtype=torch.float64)
    zq = h @ w0 + 0.3 * torch.randn(N, V, dtype=torch.float64)
    q = torch.softmax(zq, dim=-1)
    total = torch.zeros(6, V, dtype=torch.float64)
    for y in range(V):
        w = w0.clone().requires_grad_()
        z = h @ w
        c = exact_centering_term(z, zq, tile=5)
        (grad,) = torch.autograd.grad((q[:, y] * (torch.log_softmax(z, -1)[:, y] - c)).sum(), w)
        total += grad
    assert total.abs().max() < 1e-12


def test_exact_term_equals_the_direct_formula_and_tiling_does_not_matter():
    z = Z.clone().requires_grad_()
    got = exact_centering_term(z, ZQ, tile=7)  # 37 = 5 tiles of 7 and one of 2
    q = torch.softmax(ZQ, dim=-1)
    log_p = torch.log_softmax(Z, dim=-1)
    expected = torch.where(q > 0, q * log_p, 0.0).sum(-1)  # sum_v q_v log p_v
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    (grad,) = torch.autograd.grad(got.sum(), z)
    torch.testing.assert_close(grad, q - torch.softmax(Z, dim=-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(exact_centering_term(Z, ZQ, tile=V), got.detach(), rtol=0, atol=1e-12)
    # fp32 and bf16 logits: the sums are in fp32 at least
    assert exact_centering_term(Z.float(), ZQ.float()).dtype == torch.float32
    assert torch.isfinite(exact_centering_term(Z.bfloat16(), ZQ.bfloat16())).all()
    with pytest.raises(ValueError, match="shape"):
        exact_centering_term(Z, ZQ[:, :5])


def _topk(zq, k):
    logq = torch.log_softmax(zq, dim=-1)
    values, ids = logq.topk(k, dim=-1)
    return ids, values, values.exp().sum(-1)  # (N, k), (N, k), (N,) the top-k mass Q_K


@pytest.mark.parametrize("k", [1, 5, 20, V])
@pytest.mark.parametrize("tail", ["proportional", "drop"])
def test_top_k_agrees_with_exact_within_the_tail_mass(k, tail):
    zq = Z + 0.5 * torch.randn(N, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids, logq, mass = _topk(zq, k)
    z1 = Z.clone().requires_grad_()
    (exact,) = torch.autograd.grad(exact_centering_term(z1, zq).sum(), z1)  # q - p
    z2 = Z.clone().requires_grad_()
    (approx,) = torch.autograd.grad(topk_centering_term(z2, ids, logq, tail=tail).sum(), z2)
    # the centred logit gradients e_y - E[score] differ by the difference of the subtracted expectations:
    # at most the sampler's tail mass twice over (its share in q and its share of the p term), in L1
    gap = (exact - approx).abs().sum(-1)
    assert (gap <= 2 * (1 - mass) + 1e-12).all(), (gap, 1 - mass)
    if k == V:
        assert gap.max() < 1e-12


def test_proportional_tail_is_exact_when_the_samplers_tail_is_proportional():
    # a sampler whose distribution off its top-k set K is the policy's, rescaled: the proportional tail is then exact
    p = torch.softmax(Z, dim=-1)
    k = 6
    ids = p.topk(k, dim=-1).indices  # K
    q = p.clone()
    q.scatter_(1, ids, torch.softmax(torch.randn(N, k, dtype=torch.float64), -1) * 0.5)  # Q_K = 0.5 on K
    in_k = torch.zeros_like(q, dtype=torch.bool).scatter_(1, ids, True)
    q = torch.where(in_k, q, p * 0.5 / (1 - (p * in_k).sum(-1, keepdim=True)))  # the tail: 0.5 spread as p
    assert torch.allclose(q.sum(-1), torch.ones(N, dtype=torch.float64))
    z1 = Z.clone().requires_grad_()
    (exact,) = torch.autograd.grad(exact_centering_term(z1, torch.log(q)).sum(), z1)
    z2 = Z.clone().requires_grad_()
    (approx,) = torch.autograd.grad(topk_centering_term(z2, ids, torch.log(q.gather(1, ids))).sum(), z2)
    torch.testing.assert_close(approx, exact, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="allowed: proportional, drop"):
        topk_centering_term(Z, ids, torch.log(q.gather(1, ids)), tail="uniform")


def test_center_logps_keeps_values_and_centres_the_gradient():
    y = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
    z = Z.clone().requires_grad_()
    log_p = torch.log_softmax(z, -1).gather(1, y[:, None]).squeeze(1)  # (N,)
    centred = center_logps(log_p, exact_centering_term(z, ZQ))
    torch.testing.assert_close(centred, log_p, rtol=0, atol=0)  # the same values: ratios and clips unchanged
    (grad,) = torch.autograd.grad(centred.sum(), z)
    onehot = torch.nn.functional.one_hot(y, V).double()
    torch.testing.assert_close(grad, onehot - torch.softmax(ZQ, dim=-1), rtol=0, atol=1e-12)  # e_y - q
