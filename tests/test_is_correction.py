"""Tests of grpo_ratio.corrections.is_correction: IS weights, bounds and rejection on literal tensors, against direct formulas.

Run: pytest tests/test_is_correction.py -q
"""

import math

import pytest
import torch

from grpo_ratio.corrections.is_correction import (
    PRESETS,
    TRL_MODES,
    ISCorrection,
    RejectionRule,
    importance_weights,
    parse_rejection,
    parse_rejections,
    preset,
    sequence_log_weights,
)
from grpo_ratio.diagnostics.ratios import importance_sampling_weights


def _log(values):
    """log r of literal ratios, fp32."""
    return torch.log(torch.tensor(values, dtype=torch.float64)).float()


# log r per token; row 1 has a NaN (no sampler log-prob) and padding, row 2 is long and close to 1
LOG_RATIO = torch.stack([
    _log([0.4, 1.0, 2.5, 6.0]),
    torch.tensor([math.log(1.2), math.nan, math.log(0.8), 0.0]),
    _log([1.01, 0.99, 1.0, 1.02]),
])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]).bool()


@pytest.mark.parametrize("mode", list(TRL_MODES))
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 2.0)])
def test_trl_modes_equal_trls_own_weights(mode, bounds):
    # TRL 1.16's formula (re-done in ratios.importance_sampling_weights, itself tested against TRL's code path)
    expected = importance_sampling_weights(LOG_RATIO, MASK, mode, *bounds)
    got = importance_weights(LOG_RATIO, MASK, ISCorrection.from_trl(mode, *bounds)).weights
    assert got.shape == expected.shape
    valid = MASK if mode.startswith("token") else torch.ones(3, 1, dtype=torch.bool)
    torch.testing.assert_close(got[valid], expected[valid], rtol=0, atol=1e-6)


def test_token_truncate_and_icepop_mask_by_hand():
    # row 0: r = [0.4, 1, 2.5, 6] with bounds [0.5, 5]: truncate -> [0.5, 1, 2.5, 5]; mask (IcePop) -> [0, 1, 2.5, 0]
    trunc = importance_weights(LOG_RATIO, MASK, ISCorrection("token", "truncate", 0.5, 5.0))
    mask = importance_weights(LOG_RATIO, MASK, ISCorrection("token", "mask", 0.5, 5.0))
    torch.testing.assert_close(trunc.weights[0], torch.tensor([0.5, 1.0, 2.5, 5.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(mask.weights[0], torch.tensor([0.0, 1.0, 2.5, 0.0]), rtol=0, atol=1e-6)
    assert trunc.truncated[0].tolist() == [True, False, False, True] and not trunc.masked.any()
    assert mask.masked[0].tolist() == [True, False, False, True] and not mask.truncated.any()
    # the NaN token and the padding keep weight 1 and are never counted as affected
    assert trunc.weights[1, 1].item() == 1.0 and trunc.weights[1, 3].item() == 1.0
    assert trunc.mask.sum().item() == 10


def test_geometric_weight_is_length_invariant_and_the_product_is_not():
    # the same per-token log-ratio 0.01 over completions of 4 and 64 tokens (padding to 64)
    mask = torch.zeros(2, 64, dtype=torch.bool)
    mask[0, :4], mask[1, :] = True, True
    log_ratio = torch.full((2, 64), 0.01)
    geometric = importance_weights(log_ratio, mask, ISCorrection("sequence_geometric", "mask")).weights  # (2, 1)
    product = importance_weights(log_ratio, mask, ISCorrection("sequence_product", "mask")).weights  # (2, 1)
    # geometric: exp(mean) = exp(0.01) for both lengths; product: exp(4 * 0.01) = 1.0408 vs exp(64 * 0.01) = 1.8965
    torch.testing.assert_close(geometric.squeeze(1), torch.full((2,), math.exp(0.01)), rtol=0, atol=1e-6)
    torch.testing.assert_close(product.squeeze(1), torch.tensor([math.exp(0.04), math.exp(0.64)]), rtol=0, atol=1e-6)
    assert product[1].item() / product[0].item() == pytest.approx(math.exp(0.60), abs=1e-5)


def test_sequence_log_weights_leave_nan_tokens_out():
    # row 1: log 1.2, NaN, log 0.8 (+ padding): sum = log 0.96, geometric mean over the 2 tokens with a log-prob
    total = sequence_log_weights(LOG_RATIO, MASK, geometric=False)
    mean = sequence_log_weights(LOG_RATIO, MASK, geometric=True)
    assert total[1].item() == pytest.approx(math.log(0.96), abs=1e-6)
    assert mean[1].item() == pytest.approx(math.log(0.96) / 2, abs=1e-6)


def _direct_stat(x, metric):
    return {"ratio": x, "k1": -x, "k2": 0.5 * x**2, "k3": math.exp(x) - 1 - x, "prob_error": math.exp(abs(x))}[metric]


@pytest.mark.parametrize("metric", ["ratio", "k1", "k2", "k3", "prob_error"])
@pytest.mark.parametrize("agg", [None, "sum", "mean", "max"])
def test_rejection_rules_against_direct_loops(metric, agg):
    # a threshold between the per-row values, so some rows/tokens pass and some do not
    rows = [[x for x, m in zip(r.tolist(), mr.tolist()) if m and not math.isnan(x)] for r, mr in zip(LOG_RATIO, MASK)]
    stats = {"ratio": lambda v: math.log(v)}  # ratio rules are compared in log space
    high = {"ratio": 1.5, "k1": 0.3, "k2": 0.05, "k3": 0.05, "prob_error": 1.3}[metric]
    rule = RejectionRule(metric, "token" if agg is None else "sequence", agg, None, high)
    rejected = importance_weights(LOG_RATIO, MASK, ISCorrection("none", rejections=(rule,))).rejected
    limit = stats.get(metric, lambda v: v)(high)
    for b, xs in enumerate(rows):
        per_token = [_direct_stat(x, metric) for x in xs]
        if agg is None:
            expected = [s > limit for s in per_token]
        else:
            value = {"sum": sum, "mean": lambda v: sum(v) / len(v), "max": max}[agg](per_token)
            expected = [value > limit] * len(xs)
        got = [rejected[b, t].item() for t in range(4) if MASK[b, t] and not math.isnan(LOG_RATIO[b, t].item())]
        assert got == expected, (b, per_token)


def test_two_sided_k1_and_the_veto():
    # token_k1 in [-0.1, 0.1]: k1 = -log r; row 2 (r within 2%) passes, row 0 tokens 0, 2, 3 fail
    rule = parse_rejection("-0.1<=token_k1<=0.1")
    got = importance_weights(LOG_RATIO, MASK, ISCorrection("token", "mask", rejections=(rule,)))
    assert got.rejected[0].tolist() == [True, False, True, True] and not got.rejected[2].any()
    assert got.weights[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    # veto 0.5: row 0 holds r = 0.4 < 0.5, so all 4 of its tokens go; nothing else does
    veto = importance_weights(LOG_RATIO, MASK, ISCorrection("token", "truncate", None, 2.0, veto=0.5))
    assert veto.rejected.sum(dim=-1).tolist() == [4, 0, 0]
    assert veto.weights[0].tolist() == [0.0] * 4 and veto.weights[1, 0].item() == pytest.approx(1.2)


def test_sequence_level_correction_keeps_trls_b1_shape_and_rejects_whole_rows():
    # geometric weight with a sequence k3 rule: one weight per row, (B, 1), like TRL's sequence_* modes
    corr = ISCorrection("sequence_geometric", "truncate", None, 5.0, parse_rejections("seq_mean_k3<=0.05"))
    got = importance_weights(LOG_RATIO, MASK, corr)
    assert got.weights.shape == (3, 1) and corr.sequence_level
    k3_row0 = sum(math.exp(x) - 1 - x for x in LOG_RATIO[0].tolist()) / 4  # 0.66 > 0.05: rejected
    assert k3_row0 > 0.05 and got.weights[0].item() == 0.0
    geo_row2 = math.exp(sum(LOG_RATIO[2].tolist()) / 4)
    assert got.weights[2].item() == pytest.approx(geo_row2, abs=1e-6)


def test_all_masked_batch_is_finite():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for name in PRESETS:
        got = importance_weights(torch.full((2, 3), 50.0), empty, preset(name), torch.full((2, 3), -1.0),
                                 torch.ones(2))
        assert torch.isfinite(got.weights).all() and (got.weights == 1).all(), name
        assert not (got.truncated | got.masked | got.rejected).any()


def test_presets_are_valid_and_sourced():
    for name, entry in PRESETS.items():
        assert entry.source and isinstance(entry.correction, ISCorrection), name
        got = importance_weights(LOG_RATIO, MASK, entry.correction, torch.full_like(LOG_RATIO, -1.0),
                                 torch.ones(LOG_RATIO.size(0)))
        assert torch.isfinite(got.weights).all(), name
    # verl decoupled_geo_rs: reject rows whose mean k1 leaves [log 0.999, log 1.001]; row 2's mean log r is 0.0049
    rejected = importance_weights(LOG_RATIO, MASK, preset("geo_rs")).rejected
    assert rejected.any(dim=-1).tolist() == [True, True, True]
    assert preset("trl_sequence_mask") == ISCorrection.from_trl("sequence_mask", None, 3.0)


def test_parse_rejection_forms_and_errors():
    rule = parse_rejection(" 0.999 <= seq_mean_ratio <= 1.002 ")
    assert (rule.metric, rule.level, rule.agg, rule.low, rule.high) == ("ratio", "sequence", "mean", 0.999, 1.002)
    assert str(parse_rejection("seq_max_k3<=0.1")) == "seq_max_k3<=0.1" and parse_rejections("") == ()
    assert [r.name for r in parse_rejections("token_k2<=0.5, seq_sum_k1<=1")] == ["token_k2", "seq_sum_k1"]
    for bad, message in [("seq_median_k3<=1", "expected"), ("token_k4<=1", "not allowed"), ("token_k3", "bound"),
                         ("0.1<=token_k3<=1", "only an upper"), ("2<=token_ratio<=1", "must be <"),
                         ("token_k2<=x", "not a number"), ("0<=token_ratio<=2", "> 0")]:
        with pytest.raises(ValueError, match=message):
            parse_rejection(bad)


def test_correction_validation_names_the_allowed_values():
    with pytest.raises(ValueError, match="sequence_geometric"):
        ISCorrection("geometric")
    with pytest.raises(ValueError, match="truncate, mask"):
        ISCorrection("token", "clip", None, 2.0)
    with pytest.raises(ValueError, match="needs a bound"):
        ISCorrection("token", "truncate")
    with pytest.raises(ValueError, match="nothing to act on"):
        ISCorrection("none", "mask", None, 2.0)
    with pytest.raises(ValueError, match="veto"):
        ISCorrection("token", "mask", veto=1.5)
    with pytest.raises(ValueError, match="token_truncate"):
        ISCorrection.from_trl("token_clip", None, 2.0)
    with pytest.raises(ValueError, match="icepop"):
        preset("ice_pop")


def test_resolve_correction_from_config_fields():
    from grpo_ratio.corrections.is_correction import resolve_correction

    assert resolve_correction(None) is None and resolve_correction("icepop") == preset("icepop")
    custom = resolve_correction("custom", "sequence_geometric", "truncate", None, 2.0, "seq_max_k3<=0.5", 1e-4)
    assert custom == ISCorrection("sequence_geometric", "truncate", None, 2.0, parse_rejections("seq_max_k3<=0.5"),
                                  1e-4)
    assert resolve_correction("custom", "none", rejection="seq_mean_k3<=0.01").level == "none"
    with pytest.raises(ValueError, match="allowed: trl_sequence_mask, tis"):
        resolve_correction("tiss")
    with pytest.raises(ValueError, match="is_correction_high only applies with is_correction='custom'"):
        resolve_correction("tis", high=3.0)
    with pytest.raises(ValueError, match="needs is_correction_level"):
        resolve_correction("custom")
    with pytest.raises(ValueError, match="needs is_correction_action"):
        resolve_correction("custom", "token")


def _trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM IS weight (grpo_trainer.py L2659-2703), copied line for line: (raw exp(diff), weight)."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return ratio, torch.clamp(ratio, min=clip_min, max=clip_max)
    min_val = clip_min if clip_min is not None else -math.inf
    max_val = clip_max if clip_max is not None else math.inf
    invalid_mis_mask = (ratio < min_val) | (ratio > max_val)
    return ratio, ratio.masked_fill(invalid_mis_mask, value=0.0)


@pytest.mark.parametrize("mode", list(TRL_MODES))
def test_truncated_and_masked_flags_match_what_trl_changes(mode):
    # a token (sequence) is truncated / masked exactly where TRL's weight differs from the raw exp(diff); the
    # weights themselves equal TRL's on every valid token
    torch.manual_seed(2)
    old = -3.0 * torch.rand(8, 6)  # (B, T)
    sampling = old + 0.3 * torch.randn(8, 6)  # (B, T)
    sampling[0, 2] = math.nan  # vLLM gave no log-prob: TRL uses ratio 1
    mask = (torch.arange(6) < torch.tensor([6, 5, 4, 3, 6, 2, 1, 6]).unsqueeze(1)).long()  # (B, T)
    raw, weight = _trl_is_ratio(old, sampling, mask, mode, 0.8, 1.25)
    got = importance_weights(old - sampling, mask, ISCorrection.from_trl(mode, 0.8, 1.25))
    has = mask.bool() & ~torch.isnan(sampling)  # the NaN token carries no evidence (and is never flagged)
    changed = (weight != raw).expand(mask.shape) & has  # (B, T)
    assert torch.equal(got.truncated | got.masked, changed)
    assert changed.any() and (~changed & has).any()  # both cases occur
    assert torch.equal(got.weights.expand(mask.shape)[mask.bool()], weight.expand(mask.shape)[mask.bool()])


def test_trl_mode_errors():
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        ISCorrection.from_trl("token", None, 3.0)
    with pytest.raises(ValueError, match="must be <"):
        ISCorrection.from_trl("token_mask", 3.0, 3.0)
    with pytest.raises(ValueError, match="needs a bound"):
        ISCorrection.from_trl("sequence_truncate", None, None)
