"""Trust regions on the divergence (issue 43, item 2): the Bernoulli-divergence and advantage-conditioned rejection
rules of `grpo_ratio.corrections.is_correction` and the `trust_region` loss masks of
`grpo_ratio.corrections.trust_region`, on literal tensors, each against its source's formula written out here.

Run: pytest tests/test_trust_regions.py -q
"""

import math

import pytest
import torch
from trl import GRPOTrainer, RLOOTrainer

from grpo_ratio.corrections.is_correction import (
    PRESETS,
    ISCorrection,
    RejectionRule,
    importance_weights,
    parse_rejection,
    preset,
)


# the sampled tokens' probabilities under the trainer's old policy (p) and the sampler (q): high- and low-probability
# tokens, moved up and down, one unchanged; row 1 has padding at the end
P = torch.tensor([[0.90, 0.50, 0.05, 0.30], [0.20, 0.99, 0.60, 0.40]], dtype=torch.float64)
Q = torch.tensor([[0.60, 0.75, 0.01, 0.30], [0.45, 0.70, 0.61, 0.40]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]).bool()
A_TOKEN = torch.tensor([[1.0, -1.0, 1.0, -1.0], [-2.0, 0.5, 1.0, 1.0]])
LOG_P, LOG_Q = torch.log(P).float(), torch.log(Q).float()
LOG_RATIO = LOG_P - LOG_Q


def _rejected(rule: str, advantages=A_TOKEN) -> torch.Tensor:
    correction = ISCorrection("none", rejections=(parse_rejection(rule),))
    return importance_weights(LOG_RATIO, MASK, correction, LOG_Q, advantages).rejected


def test_prime_rl_dppo_tv_mask():
    # prime-rl default_loss_fn: probs_diff = p - q; invalid = where(A > 0, diff > high, diff < -low); kept = mask & ~
    low = high = 0.2
    diff = P - Q
    invalid = torch.where(A_TOKEN > 0, diff > high, diff < -low)
    expected = invalid & MASK & (A_TOKEN != 0)  # A = 0: its term is 0 either way; never rejected here
    got = _rejected("-0.2<=token_binary_tv<=0.2@adv")
    assert got.tolist() == expected.tolist()
    # the literal cases: (0,0) p-q = 0.3 > 0.2 with A > 0; (0,1) -0.25 < -0.2 with A < 0; (1,0) -0.25 with A < 0;
    # (1,1) +0.29 with A > 0
    assert got.tolist() == [[True, True, False, False], [True, True, False, False]]
    # without @adv: every token outside the band, whatever the advantage
    both = _rejected("-0.2<=token_binary_tv<=0.2")
    assert both.tolist() == (((P - Q).abs() > 0.2) & MASK).tolist()


def test_verl_dppo_kl_mask():
    # verl compute_policy_loss_dppo_kl with old = the sampler q, current = p:
    # binary_kl = old_prob*(old_log_prob - log_prob) + (1-old_prob)*log((1-old_prob+1e-8)/(1-prob+1e-8))
    # valid_positive = (binary_kl <= high) | (prob <= old_prob); valid_negative = (binary_kl <= low) | (prob >= old_prob)
    delta = 0.05
    kl = Q * (torch.log(Q) - torch.log(P)) + (1 - Q) * torch.log((1 - Q + 1e-8) / (1 - P + 1e-8))
    valid = torch.where(A_TOKEN > 0, (kl <= delta) | (P <= Q), (kl <= delta) | (P >= Q))
    expected = ~valid & MASK & (A_TOKEN != 0)
    got = _rejected("token_binary_kl<=0.05@adv")
    assert got.tolist() == expected.tolist() and got.any()
    assert PRESETS["dppo_kl_mask"].correction.rejections == (parse_rejection("token_binary_kl<=0.05@adv"),)


def test_areal_kpop_binary_kl():
    # AReaL compute_binary_kl_divergence(log_p, log_q): p, q clamped to [1e-8, 1-1e-8],
    # p*log(p/q) + (1-p)*log((1-p)/(1-q)); KPop masks max(kl(prox, behave), kl(behave, prox)) > upper
    def kl(a, b):
        a, b = a.clamp(1e-8, 1 - 1e-8), b.clamp(1e-8, 1 - 1e-8)
        return a * torch.log(a / b) + (1 - a) * torch.log((1 - a) / (1 - b))

    metric = torch.maximum(kl(P, Q), kl(Q, P))
    for upper in (0.02, 0.1):
        got = _rejected(f"token_binary_kl_max<={upper}")
        assert got.tolist() == ((metric > upper) & MASK).tolist()
    # the preset: AReaL's raw behave_imp_weight exp(log_ratio), zeroed where rejected
    weights = importance_weights(LOG_RATIO, MASK, preset("kpop"), LOG_Q).weights
    kept = MASK & (metric <= 2.0)
    torch.testing.assert_close(weights[kept], torch.exp(LOG_RATIO)[kept])


def test_the_directional_mean_k1_is_trls_off_policy_sequence_mask():
    # TRL 1.16 GRPOTrainer.get_off_policy_mask (DeepSeek-V3.2 OPSM): keep if A >= 0 or mean(sampling - current) <= d;
    # here "current" is the old policy p: the same rule, directional, against the sampler
    delta = 0.05
    a_seq = torch.tensor([-1.0, 1.0])
    for advantages in (a_seq, -a_seq):
        keep = GRPOTrainer.get_off_policy_mask(advantages.unsqueeze(1), LOG_P, LOG_Q, MASK.float(), delta)  # (B, 1)
        got = _rejected(f"seq_mean_k1<={delta}@adv", advantages)  # (B, T)
        assert got.any(dim=-1).tolist() == (keep.squeeze(1) == 0).tolist()
    # row 1: mean k1 = (0.811 - 0.347 + 0.017) / 3 = 0.16 > 0.05; dropped only when its advantage is negative
    assert _rejected(f"seq_mean_k1<={delta}@adv", -a_seq).any(dim=-1).tolist() == [False, True]
    assert not _rejected(f"seq_mean_k1<={delta}@adv", a_seq).any()


def test_open_instruct_tv_statistic():
    # open-instruct PR #1681's test: rows [0.25, 1, 4] and [4, 4, 4] against a sampler at 1: mean |rho - 1| = 1.25
    # and 3.0; with upper 2.0 only row 1 leaves the band
    log_ratio = torch.log(torch.tensor([[0.25, 1.0, 4.0], [4.0, 4.0, 4.0]]))
    mask = torch.ones(2, 3, dtype=torch.bool)
    rule = parse_rejection("seq_mean_tv<=2.0")
    got = importance_weights(log_ratio, mask, ISCorrection("none", rejections=(rule,))).rejected
    assert got.any(dim=-1).tolist() == [False, True]
    # directional per sequence (sign of the summed log-ratio times A): row 1 leans up; rejected only with A > 0
    directional = ISCorrection("none", rejections=(parse_rejection("seq_mean_tv<=2.0@adv"),))
    assert directional.sequence_level  # one decision per sequence: allowed on RLOO
    up = importance_weights(log_ratio, mask, directional, advantages=torch.tensor([1.0, 1.0])).rejected
    down = importance_weights(log_ratio, mask, directional, advantages=torch.tensor([1.0, -1.0])).rejected
    assert up.any(dim=-1).tolist() == [False, True] and not down.any()


def test_rules_parse_print_and_refuse():
    rule = parse_rejection("-0.2<=token_binary_tv<=0.28@adv")
    assert rule == RejectionRule("binary_tv", "token", None, -0.2, 0.28, True)
    assert str(rule) == "-0.2<=token_binary_tv<=0.28@adv" and parse_rejection(str(rule)) == rule
    assert parse_rejection("seq_max_binary_kl<=0.1").directional is False
    with pytest.raises(ValueError, match="give only an upper bound"):
        parse_rejection("0.1<=token_binary_kl")
    with pytest.raises(ValueError, match="allowed: ratio, k1"):
        parse_rejection("token_binary_js<=0.1")
    needs_q = ISCorrection("none", rejections=(parse_rejection("token_binary_tv<=0.2"),))
    assert needs_q.needs_sampler_logps and not needs_q.needs_advantages
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        importance_weights(LOG_RATIO, MASK, needs_q)
    needs_a = ISCorrection("none", rejections=(parse_rejection("token_k3<=0.1@adv"),))
    with pytest.raises(ValueError, match="advantage-conditioned"):
        importance_weights(LOG_RATIO, MASK, needs_a)
    with pytest.raises(ValueError, match="advantages"):
        importance_weights(LOG_RATIO, MASK, needs_a, advantages=torch.ones(3))


def test_nan_and_padding_are_never_rejected():
    log_ratio = LOG_RATIO.clone()
    log_ratio[0, 0] = math.nan  # no sampler log-prob: weight 1, never rejected
    for name in ("kpop", "dppo_tv_mask", "dppo_kl_mask"):
        got = importance_weights(log_ratio, MASK, preset(name), LOG_Q, A_TOKEN)
        assert not got.rejected[0, 0] and not got.rejected[1, 3] and got.weights[0, 0] == 1.0, name
        assert torch.isfinite(got.weights).all()


# ---------------------------------------------------------------------------------------------------------------------
# the loss option: `trust_region`


def test_trust_region_masks_are_verls():
    from grpo_ratio.corrections.trust_region import trust_region_mask

    log_p, log_old = LOG_P.double(), LOG_Q.double()  # current policy p, anchor p_old = the table's q
    p, p_old = P, Q
    for low, high in ((0.2, 0.2), (0.1, 0.28)):
        # verl compute_policy_loss_dppo_tv
        valid_tv = torch.where(A_TOKEN > 0, (p - p_old) <= high, (p - p_old) >= -low)
        got = trust_region_mask(log_p, log_old, A_TOKEN, "dppo_tv", low, high)
        assert got.tolist() == valid_tv.float().tolist()
        # verl compute_policy_loss_dppo_kl
        kl = p_old * (log_old - log_p) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        valid_kl = torch.where(A_TOKEN > 0, (kl <= high) | (p <= p_old), (kl <= low) | (p >= p_old))
        got = trust_region_mask(log_p, log_old, A_TOKEN, "dppo_kl", low, high)
        assert got.tolist() == valid_kl.float().tolist()
    # the defaults are verl's example bounds; a (B,) advantage broadcasts; a NaN anchor keeps the token
    assert trust_region_mask(log_p, log_old, A_TOKEN, "dppo_tv").tolist() == trust_region_mask(
        log_p, log_old, A_TOKEN, "dppo_tv", 0.15, 0.15).tolist()
    old_nan = log_old.clone()
    old_nan[0, 0] = math.nan
    assert trust_region_mask(log_p, old_nan, torch.ones(2), "dppo_tv", 0.01, 0.01)[0, 0] == 1.0
    with pytest.raises(ValueError, match="allowed: dppo_tv, dppo_kl"):
        trust_region_mask(log_p, log_old, A_TOKEN, "dppo_js")
    with pytest.raises(ValueError, match="> 0"):
        trust_region_mask(log_p, log_old, A_TOKEN, "dppo_tv", 0.0, 0.1)


def test_trls_cispo_term_times_the_mask_is_verls_dppo_loss():
    # TRL 1.16 loss_type="cispo": -clamp(coef_1, max=epsilon_high).detach() * A * per_token_logps; verl DPPO:
    # -A * clamp(ratio, max=clip_ratio_c).detach() * log_prob * valid_mask. Equal value and gradient with C = eps_high.
    from grpo_ratio.corrections.trust_region import trust_region_mask

    c = 3.0
    log_p = LOG_P.double().clone().requires_grad_()
    log_old = LOG_Q.double()
    keep = trust_region_mask(log_p, log_old, A_TOKEN, "dppo_tv", 0.2, 0.2).double()
    trl = -torch.clamp(torch.exp(log_p - log_old), max=c).detach() * A_TOKEN * log_p * keep
    grad_trl, = torch.autograd.grad((trl * MASK).sum(), log_p)
    log_p2 = LOG_P.double().clone().requires_grad_()
    ratio = torch.exp(torch.clamp(log_p2 - log_old, -20.0, 20.0))
    valid = torch.where(A_TOKEN > 0, (torch.exp(log_p2) - torch.exp(log_old)) <= 0.2,
                        (torch.exp(log_p2) - torch.exp(log_old)) >= -0.2).detach().double()
    verl = -A_TOKEN * torch.clamp(ratio, max=c).detach() * log_p2 * valid
    grad_verl, = torch.autograd.grad((verl * MASK).sum(), log_p2)
    torch.testing.assert_close(trl, verl.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_trl, grad_verl, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# two training steps on real (tiny) trainers


def _spy(monkeypatch):
    """Every call of TRL's own `_compute_loss` (its inputs after the call, the factor included) and the training
    forward's log-probs of each."""
    calls, forwards = [], []
    original, helper = GRPOTrainer._compute_loss, GRPOTrainer._get_per_token_logps_and_entropies

    def loss_spy(self, model, inputs):
        out = original(self, model, inputs)
        calls.append((dict(inputs), out.detach()))
        return out

    def helper_spy(self, *args, **kwargs):
        out = helper(self, *args, **kwargs)
        if torch.is_grad_enabled():
            forwards.append(out[0].detach())
        return out

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", loss_spy)
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", helper_spy)
    return calls, forwards


@pytest.mark.parametrize("kind,loss_type", [("dppo_tv", "cispo"), ("dppo_kl", "dapo")])
def test_trust_region_trains_grpo_and_the_loss_gets_verls_mask(tmp_path, monkeypatch, kind, loss_type):
    from trainer_fixtures import tiny_trainer

    from grpo_ratio.corrections.trust_region import trust_region_mask

    calls, forwards = _spy(monkeypatch)
    # num_iterations=2: an old pass, and the second iteration's policy has moved from it; tiny bounds so it masks
    trainer = tiny_trainer(tmp_path, max_steps=2, num_iterations=2, loss_type=loss_type, epsilon_high=100.0,
                           trust_region=kind, trust_region_low=1e-4, trust_region_high=1e-4)
    trainer.train()
    assert trainer.state.global_step == 2 and len(calls) == len(forwards) == 2
    for (inputs, loss), logps in zip(calls, forwards, strict=True):
        assert torch.isfinite(loss)
        expected = trust_region_mask(logps, inputs["old_per_token_logps"], inputs["advantages"], kind, 1e-4, 1e-4)
        assert torch.equal(inputs["importance_sampling_ratio"], expected)
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in rows)
    fracs = [r["ratio/trust_region_masked_frac"] for r in rows]
    assert all(0.0 <= f <= 1.0 for f in fracs) and fracs[1] > 0.0  # the moved iteration masks some tokens
    assert not trainer.use_vllm  # the gate closed again


def test_trust_region_is_validated(tmp_path):
    from grpo_ratio import RatioGRPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="allowed: dppo_tv, dppo_kl"):
        RatioGRPOConfig(**base, trust_region="dppo")
    with pytest.raises(ValueError, match="only applies with trust_region"):
        RatioGRPOConfig(**base, trust_region_high=0.1)
    with pytest.raises(ValueError, match="trust_region_low must be a number > 0"):
        RatioGRPOConfig(**base, trust_region="dppo_tv", trust_region_low=0.0)
    with pytest.raises(ValueError, match="vespo"):
        RatioGRPOConfig(**base, trust_region="dppo_tv", loss_type="vespo")
    with pytest.raises(ValueError, match="importance_sampling_level='sequence'"):
        RatioGRPOConfig(**base, trust_region="dppo_kl", importance_sampling_level="sequence")
    from test_rloo import tiny_rloo_args

    with pytest.raises(ValueError, match="RLOO's ratio and clip are per sequence"):
        tiny_rloo_args(tmp_path, trust_region="dppo_tv")


def test_sequence_rules_on_the_new_metrics_train_rloo(tmp_path, monkeypatch):
    from test_rloo import tiny_rloo

    from grpo_ratio.rloo import weighted_advantages

    # a sequence-level correction on the new statistics: geometric weight, the KPop metric per sequence, and the
    # advantage-conditioned open-instruct-style |r - 1| filter
    trainer = tiny_rloo(tmp_path, "fp32_clone", top_p=0.8, is_correction="custom",
                        is_correction_level="sequence_geometric", is_correction_action="truncate",
                        is_correction_high=2.0,
                        is_correction_rejection="seq_max_binary_kl_max<=2.0, seq_mean_tv<=0.1@adv")
    correction = trainer.args.is_correction_spec
    assert correction.sequence_level and correction.needs_sampler_logps and correction.needs_advantages
    seen = []
    original = RLOOTrainer._compute_loss

    def spy(self, model, inputs):
        seen.append((inputs, inputs["advantages"].clone()))  # the batch itself: its own advantages come back after
        return original(self, model, inputs)

    monkeypatch.setattr(RLOOTrainer, "_compute_loss", spy)
    trainer.train()
    assert trainer.state.global_step == 2 and len(seen) == 2
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in rows)
    for inputs, weighted in seen:  # RLOO's loss saw w * A, w from old - sampler of the same rows and their A
        mask = inputs["completion_mask"].bool()
        sampler = inputs["sampler_per_token_logps"]  # ours: RLOO's loss reads no sampler log-probs
        expected = importance_weights(inputs["old_per_token_logps"] - sampler, mask, correction, sampler,
                                      inputs["advantages"]).weights
        assert expected.shape == (4, 1)
        torch.testing.assert_close(inputs["importance_sampling_ratio"], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(weighted, weighted_advantages(inputs["advantages"], expected), rtol=0, atol=1e-6)
        # top_p 0.8 without a truncation correction: old/sampler ~ the kept mass 0.8, mean |r - 1| ~ 0.2 > 0.1, so
        # the directional rule drops exactly the rows whose advantage is negative (sum log r < 0): A < 0
        rejected = expected.squeeze(1) == 0
        assert rejected.tolist() == (inputs["advantages"] < 0).tolist() and rejected.any()


def test_the_async_proximal_weight_takes_the_new_rules():
    # RatioAsyncGRPOTrainer's behaviour -> proximal weight on packed terms: the Bernoulli and directional rules see
    # the behaviour log-probs and each term's advantage, laid out per sample as importance_weights sees rows
    from grpo_ratio.corrections.decoupled import proximal_weights

    segment = torch.tensor([0, 0, 0, 0, 1, 1, 1])  # two samples, 4 and 3 terms
    prox = torch.cat([LOG_P[0], LOG_P[1, :3]])  # (7,)
    behaviour = torch.cat([LOG_Q[0], LOG_Q[1, :3]])
    adv = torch.cat([A_TOKEN[0], A_TOKEN[1, :3]])
    for name in ("dppo_tv_mask", "dppo_kl_mask", "kpop"):
        weights, result = proximal_weights(prox, behaviour, segment, preset(name), adv)
        rows = importance_weights(LOG_RATIO[:, :4], MASK[:, :4], preset(name), LOG_Q[:, :4], A_TOKEN[:, :4])
        torch.testing.assert_close(weights, rows.weights[MASK[:, :4]], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="advantage-conditioned"):
        proximal_weights(prox, behaviour, segment, preset("dppo_tv_mask"))
