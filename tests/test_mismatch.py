"""Tests of grpo_ratio.diagnostics.mismatch: KL estimates, PPL, chi-square, ESS, IS-weight shares and the exact full-vocabulary
divergences, each against a direct computation on literal tensors (to 1e-6), split- and process-invariant.

Run: pytest tests/test_mismatch.py -q
"""

import math
import os
import pathlib
import sys

import pytest
import torch
from test_ratios import _free_port

from grpo_ratio.corrections.is_correction import ISCorrection, importance_weights, parse_rejections
from grpo_ratio.diagnostics.mismatch import FullVocabStats, ISWeightStats, MismatchStats, full_vocab_divergence
from grpo_ratio.testing.ranks import run_ranks


# log r = logp_p - logp_q per token; row 1 has a NaN (no sampler log-prob), rows are padded differently
LOG_RATIO = torch.tensor([[0.1, -0.2, 0.05, 0.3], [-0.1, math.nan, 0.2, 9.0], [0.0, 0.01, -0.01, 0.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]).bool()
ROWS = [[0.1, -0.2, 0.05, 0.3], [-0.1, 0.2], [0.0, 0.01]]  # the valid tokens with a log-ratio, by hand


def _mean(values):
    return sum(values) / len(values)


def test_mismatch_stats_equal_direct_formulas():
    got = MismatchStats().update(LOG_RATIO, MASK).as_metrics("p_q")
    tokens = [x for row in ROWS for x in row]
    expected = {
        "p_q/kl_k1": _mean([-x for x in tokens]),
        "p_q/kl_k2": _mean([x * x / 2 for x in tokens]),
        "p_q/kl_k3": _mean([math.exp(x) - 1 - x for x in tokens]),
        "p_q/kl_k3_clamped": _mean([min(math.exp(x) - 1 - x, 10.0) for x in tokens]),
        "p_q/chi2_token": _mean([math.exp(2 * x) for x in tokens]) - 1,
        # per sequence: log PPL_p - log PPL_q = -mean_t x, then averaged over the 3 sequences (verl's definition)
        "p_q/log_ppl_diff": _mean([-_mean(row) for row in ROWS]),
        "p_q/log_ppl_abs_diff": _mean([abs(_mean(row)) for row in ROWS]),
        "p_q/ppl_ratio": _mean([math.exp(-_mean(row)) for row in ROWS]),
        "p_q/chi2_seq": _mean([math.exp(2 * sum(row)) for row in ROWS]) - 1,
    }
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


def test_mismatch_stats_are_split_invariant_and_clamped():
    whole = MismatchStats().update(LOG_RATIO, MASK)
    parts = MismatchStats().update(LOG_RATIO[:1], MASK[:1]).merge(MismatchStats().update(LOG_RATIO[1:], MASK[1:]))
    assert parts.as_metrics("x") == pytest.approx(whole.as_metrics("x"), abs=1e-12)
    # one token with log r = 500 is clamped to 20 (verl's SAFETY_BOUND): chi2 is e^40 - 1, finite
    huge = MismatchStats().update(torch.tensor([[500.0]]), torch.ones(1, 1)).as_metrics("x")
    assert huge["x/chi2_token"] == pytest.approx(math.exp(40) - 1, rel=1e-9) and math.isfinite(huge["x/kl_k3"])


def test_clamped_k3_is_miles_outlier_robust_kl():
    # miles PR #1067's table (train_rollout_kl = k3 clamped per token to [-10, 10], slime/miles `low_var_kl`):
    # identical log-probs 0; a uniform gap of 0.5 about 0.107 (its log-ratio taken q/p: x = -0.5 here); 5 of 1,000
    # tokens with |gap| = 50: 5 x 10 / 1000 = 0.05 (the unclamped k3 of those tokens is about 49 or e^50)
    def clamped(x):
        return MismatchStats().update(x.reshape(1, -1), torch.ones(1, x.numel())).as_metrics("m")["m/kl_k3_clamped"]

    assert clamped(torch.zeros(1000)) == 0.0
    assert clamped(torch.full((1000,), -0.5)) == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-9)  # 0.1065
    assert round(clamped(torch.full((1000,), -0.5)), 3) == 0.107
    for gap in (50.0, -50.0):
        outliers = torch.zeros(1000)
        outliers[:5] = gap
        assert clamped(outliers) == pytest.approx(0.05, abs=1e-12)
    # the unclamped k3 of the same tokens: dominated by the tail (x clamped to +-20 first: e^20 - 21 per token)
    row = torch.zeros(1, 1000)
    row[0, :5] = 50.0
    assert MismatchStats().update(row, torch.ones(1, 1000)).as_metrics("m")["m/kl_k3"] > 1e5


def test_is_weight_stats_equal_direct_formulas():
    # token TIS cap 1.2 plus a sequence k3 rule that rejects row 0 (mean k3 0.0188 > 0.015 > 0.0131 of row 1)
    corr = ISCorrection("token", "truncate", None, 1.2, parse_rejections("seq_mean_k3<=0.015"))
    stats = ISWeightStats.of(corr).update(importance_weights(LOG_RATIO, MASK, corr))
    got = stats.as_metrics("r")
    weights = [[0.0] * 4, [math.exp(-0.1), 1.2], [1.0, math.exp(0.01)]]  # row 0 rejected; e^0.2 = 1.22 truncated
    flat = [w for row in weights for w in row]
    ess = sum(flat) ** 2 / (len(flat) * sum(w * w for w in flat))
    raw = sorted(x for row in ROWS for x in row)  # 8 raw log-weights; p50 at position 3.5
    assert _mean([math.exp(x) - 1 - x for x in ROWS[0]]) > 0.015 > _mean([math.exp(x) - 1 - x for x in ROWS[1]])
    assert got["r/is_weight_ess"] == pytest.approx(ess, abs=1e-6)
    assert got["r/is_weight_mean"] == pytest.approx(_mean(flat), abs=1e-6)
    assert got["r/is_weight_raw/p1"] == pytest.approx(math.exp(raw[0] + 0.07 * (raw[1] - raw[0])), abs=1e-6)
    assert got["r/is_weight_raw/p50"] == pytest.approx(math.exp((raw[3] + raw[4]) / 2), abs=1e-6)
    assert got["r/is_weight_raw/p99"] == pytest.approx(math.exp(raw[6] + 0.93 * (raw[7] - raw[6])), abs=1e-6)
    assert got["r/is_rejected_token_frac"] == pytest.approx(4 / 8) and got["r/is_rejected_seq_frac"] == pytest.approx(1 / 3)
    # raw r above 1.2: e^0.3 (row 0, also rejected) and e^0.2 (row 1): truncated
    assert got["r/is_truncated_token_frac"] == pytest.approx(2 / 8) and got["r/is_truncated_seq_frac"] == pytest.approx(2 / 3)
    assert "r/is_masked_token_frac" not in got


# raw log(old / sampler): row 0 r = [3, 1, 0.25]; row 1 r = [1, NaN (no sampler log-prob), masked]
IS_LOG_RATIO = torch.tensor([[math.log(3.0), 0.0, math.log(0.25)], [0.0, math.nan, 5.0]])
IS_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize(
    ("mode", "clip_min", "clip_max", "expected"),
    [
        # 4 valid tokens with a log-ratio, 2 sequences. token_mask [0.5, 2]: r = 3 and 0.25 zeroed -> 2/4, 1/2
        ("token_mask", 0.5, 2.0, {"r/is_masked_token_frac": 0.5, "r/is_masked_seq_frac": 0.5}),
        # token_truncate max 2: only r = 3 -> 1/4 tokens, 1/2 sequences
        ("token_truncate", None, 2.0, {"r/is_truncated_token_frac": 0.25, "r/is_truncated_seq_frac": 0.5}),
        # sequence_mask [0.5, 2]: products 0.75 and 1 -> nothing masked
        ("sequence_mask", 0.5, 2.0, {"r/is_masked_token_frac": 0.0, "r/is_masked_seq_frac": 0.0}),
        # sequence_truncate max 0.9: row 1 (product 1) with its 1 token with a log-ratio -> 1/4, 1/2
        ("sequence_truncate", None, 0.9, {"r/is_truncated_token_frac": 0.25, "r/is_truncated_seq_frac": 0.5}),
    ],
)
def test_shares_of_trls_own_modes_by_hand(mode, clip_min, clip_max, expected):
    corr = ISCorrection.from_trl(mode, clip_min, clip_max)
    got = ISWeightStats.of(corr).update(importance_weights(IS_LOG_RATIO, IS_MASK, corr)).as_metrics("r")
    assert {k: got[k] for k in expected} == pytest.approx(expected)
    with pytest.raises(ValueError, match="cannot merge"):
        ISWeightStats.of(corr).merge(ISWeightStats.of(ISCorrection("none", rejections=parse_rejections("token_k2<=1"))))


def test_sequence_level_weights_count_once_per_token_and_quantiles_per_sequence():
    corr = ISCorrection("sequence_geometric", "mask", 0.9, 1.1)
    got = ISWeightStats.of(corr).update(importance_weights(LOG_RATIO, MASK, corr)).as_metrics("r")
    geo = [math.exp(_mean(row)) for row in ROWS]  # all within [0.9, 1.1]: nothing masked
    per_token = [g for g, row in zip(geo, ROWS) for _ in row]
    assert got["r/is_weight_ess"] == pytest.approx(sum(per_token) ** 2 / (8 * sum(w * w for w in per_token)), abs=1e-6)
    assert got["r/is_weight_raw/p50"] == pytest.approx(sorted(geo)[1], abs=1e-6)  # 3 sequences: the median one
    assert got["r/is_masked_seq_frac"] == 0.0 and "r/is_rejected_seq_frac" not in got


def test_all_masked_batch_gives_no_metric_and_no_nan():
    empty = torch.zeros(3, 4, dtype=torch.bool)
    assert MismatchStats().update(LOG_RATIO, empty).as_metrics("x") == {}
    corr = ISCorrection("token", "mask", 0.5, 2.0, parse_rejections("seq_max_k2<=0.1"), veto=1e-4)
    assert ISWeightStats.of(corr).update(importance_weights(LOG_RATIO, empty, corr)).as_metrics() == {}
    kl, rkl, tv = full_vocab_divergence(torch.randn(3, 4, 5), torch.randn(3, 4, 5))
    assert FullVocabStats().update(kl, rkl, tv, empty).as_metrics("x") == {}
    # every weight masked to 0 (but tokens valid): ESS is 0, not NaN
    zero = ISCorrection("token", "mask", 5.0, 6.0)
    assert ISWeightStats.of(zero).update(importance_weights(LOG_RATIO, MASK, zero)).as_metrics()["ratio/is_weight_ess"] == 0.0


def test_full_vocab_divergence_equals_direct_sums():
    p_logits = torch.tensor([[[1.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])  # (1, 2, 3)
    q_logits = torch.tensor([[[0.8, 0.1, -0.5], [2.0, -1.0, 0.0]]])
    kl, rkl, tv = full_vocab_divergence(p_logits, q_logits, temperature=0.7)
    for t in range(2):
        p = torch.softmax(p_logits[0, t].double() / 0.7, -1).tolist()
        q = torch.softmax(q_logits[0, t].double() / 0.7, -1).tolist()
        assert kl[0, t].item() == pytest.approx(sum(b * math.log(b / a) for a, b in zip(p, q)), abs=1e-6)
        assert rkl[0, t].item() == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)), abs=1e-6)
        assert tv[0, t].item() == pytest.approx(0.5 * sum(abs(a - b) for a, b in zip(p, q)), abs=1e-6)
    # log-probs with a zero-probability token in q (top-k): its term adds 0 to KL(q||p), makes KL(p||q) inf
    lp = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    lq = torch.log(torch.tensor([[[2 / 3, 1 / 3, 0.0]]]))
    kl, rkl, tv = full_vocab_divergence(lp, lq, are_logprobs=True)
    assert kl.item() == pytest.approx(2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(4 / 3), abs=1e-6)
    assert math.isinf(rkl.item()) and tv.item() == pytest.approx(0.25, abs=1e-6)


def _direct_kl_tv(p_logits, q_logits):
    """KL(q||p), KL(p||q), TV of one position from two lists of logits, by hand with math.fsum."""
    def softmax(x):
        top = max(x)
        e = [math.exp(v - top) for v in x]
        total = math.fsum(e)
        return [v / total for v in e]

    p, q = softmax(p_logits), softmax(q_logits)
    return (math.fsum(b * math.log(b / a) for a, b in zip(p, q)), math.fsum(a * math.log(a / b) for a, b in zip(p, q)),
            0.5 * math.fsum(abs(a - b) for a, b in zip(p, q)))


def test_full_vocab_divergence_is_exact_at_a_precision_mismatch():
    # q: fp32 logits over 2048 tokens; p: the same logits rounded to bf16, the trainer-vs-sampler situation. The KL is
    # about 1.4e-7 nats, below fp32 log-softmax rounding (the same sums in fp32 give -5e-8 to 2.8e-7 on these four
    # positions): the result must match a by-hand math.fsum to 1e-6 relative (and 1e-9 absolute)
    torch.manual_seed(0)
    q = 0.3 * torch.randn(2, 2, 2048)  # a flat distribution, as the tiny test model's
    p = q.bfloat16().float()
    kl, rkl, tv = full_vocab_divergence(p, q)
    for b in range(2):
        for t in range(2):
            want = _direct_kl_tv(p[b, t].tolist(), q[b, t].tolist())
            for got, value in zip((kl[b, t].item(), rkl[b, t].item(), tv[b, t].item()), want, strict=True):
                assert abs(got - value) <= 1e-9 and abs(got - value) <= 1e-6 * value, (got, value)
            assert 1e-8 < want[0] < 1e-5


def test_full_vocab_divergence_chunks_give_the_same_numbers():
    torch.manual_seed(0)
    p, q = torch.randn(3, 5, 11), torch.randn(3, 5, 11)
    whole = full_vocab_divergence(p, q, chunk_tokens=1024)
    chunked = full_vocab_divergence(p, q, chunk_tokens=2)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    valid = MASK[:, :4].repeat(1, 2)[:, :5]  # (3, 5)
    got = FullVocabStats().update(*whole, valid).as_metrics("x")
    for key, values in zip(("x/full_kl", "x/full_reverse_kl", "x/full_tv"), whole, strict=True):
        assert got[key] == pytest.approx(_mean(values[valid].tolist()), abs=1e-6), key


def _stats(rows: slice):
    corr = ISCorrection("token", "mask", 0.9, 1.2, parse_rejections("seq_mean_k3<=0.02"))
    mismatch = MismatchStats().update(LOG_RATIO[rows], MASK[rows])
    weights = ISWeightStats.of(corr).update(importance_weights(LOG_RATIO[rows], MASK[rows], corr))
    full = FullVocabStats().update(*(x[rows] for x in full_vocab_divergence(
        torch.arange(60.0).reshape(3, 4, 5).sin(), torch.arange(60.0).reshape(3, 4, 5).cos())), MASK[rows])
    return mismatch, weights, full


def _metrics(stats):
    return {**stats[0].as_metrics("m"), **stats[1].as_metrics("w"), **stats[2].as_metrics("f")}


_TWO_PROCESS_SCRIPT = """
from accelerate import Accelerator
from grpo_ratio.testing.ranks import end_rank
from test_mismatch import _metrics, _stats
acc = Accelerator(cpu=True)
assert acc.num_processes == 2
rows = slice(0, 1) if acc.process_index == 0 else slice(1, 3)  # unequal numbers of tokens per process
reduced = [s.all_reduce(acc) for s in _stats(rows)]
whole = _metrics(_stats(slice(0, 3)))
got = _metrics(reduced)
assert got.keys() == whole.keys() and all(abs(got[k] - whole[k]) < 1e-9 for k in got), (got, whole)
print("TWO_PROCESS_OK")
end_rank()
"""


def test_all_reduce_on_two_real_processes(tmp_path):
    # the per-process partial sums reduced over real gloo collectives give the single-process metrics
    script = tmp_path / "two_processes.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parent), env.get("PYTHONPATH", "")])
    # each rank in a session of its own, killed with everything it started on a timeout; none may outlive the run
    procs = run_ranks([[sys.executable, str(script)]] * 2, timeout=120,
                      envs=[{**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in (0, 1)])
    for proc in procs:
        assert proc.returncode == 0 and "TWO_PROCESS_OK" in proc.stdout, proc.stderr[-3000:]
    assert _metrics([s.all_reduce(None) for s in _stats(slice(0, 3))]) == _metrics(_stats(slice(0, 3)))
