"""The gap by completion position and the bias/noise split (`ratio_by_position`, issue 43 item 5): literal tensors
against the formulas of docs/metrics.md written out here, split invariance, and a real run's keys.

Run: pytest tests/test_by_position.py -q
"""

import math

import pytest
import torch

from grpo_ratio.diagnostics import metric_keys as keys
from grpo_ratio.diagnostics.by_position import PositionStats, bucket_labels, position_buckets


# x = log p - log q; row 0 a constant bias, row 1 mixed, row 2 one token (no sequence statistic), row 3 a NaN
X = torch.tensor([
    [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1],
    [0.3, -0.1, 0.2, 0.0, -0.4, 0.5, 0.1, 0.0, 0.0, 0.0],
    [2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.2, math.nan, -0.2, 0.6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
])
MASK = torch.tensor([[1] * 10, [1] * 7 + [0] * 3, [1] + [0] * 9, [1, 1, 1, 1] + [0] * 6]).bool()


def _valid_rows():
    return [[v for v, m in zip(row, mrow) if m and not math.isnan(v)] for row, mrow in zip(X.tolist(), MASK.tolist())]


def test_buckets_are_powers_of_two():
    assert bucket_labels(10) == [1, 2, 4, 8] and bucket_labels(8) == [1, 2, 4, 8] and bucket_labels(7) == [1, 2, 4]
    assert position_buckets(10, 4).tolist() == [0, 1, 1, 2, 2, 2, 2, 3, 3, 3]  # positions 1 | 2-3 | 4-7 | 8-15
    assert position_buckets(10, 3).tolist() == [0, 1, 1, 2, 2, 2, 2, 2, 2, 2]  # capped at the last bucket
    assert keys.by_position_key(8, "old_sampler", "kl_k3") == "ratio/by_position/8/old_sampler/kl_k3"
    assert keys.known("ratio/by_position/8/old_sampler/kl_k3") and not keys.known("ratio/by_position/3/new_old/kl_k3")
    with pytest.raises(KeyError):
        keys.by_position_key(3, "old_sampler", "kl_k3")


def test_per_bucket_statistics_equal_direct_formulas():
    stats = PositionStats(max_len=10)
    stats.update("old_sampler", X, MASK)
    got = stats.flush()
    ranges = {1: range(0, 1), 2: range(1, 3), 4: range(3, 7), 8: range(7, 10)}  # 0-based indices of each bucket
    for label, idx in ranges.items():
        values = [X[b, t].item() for b in range(4) for t in idx if MASK[b, t] and not math.isnan(X[b, t].item())]
        prefix = f"ratio/by_position/{label}/old_sampler"
        assert got[f"{prefix}/num_tokens"] == len(values)
        assert got[f"{prefix}/mean_abs_log_ratio"] == pytest.approx(sum(abs(v) for v in values) / len(values), abs=1e-12)
        assert got[f"{prefix}/kl_k3"] == pytest.approx(sum(math.exp(v) - 1 - v for v in values) / len(values),
                                                        abs=1e-12)
    assert got["ratio/by_position/8/old_sampler/num_tokens"] == 3  # only row 0 reaches positions 8-10
    assert not any("/new_old/" in k for k in got)  # a family without an update is absent
    assert stats.flush() == {}  # reset


def test_bias_noise_split_equals_direct_formulas():
    stats = PositionStats(max_len=10)
    stats.update("new_old", X, MASK)
    got = stats.flush()
    rows = [r for r in _valid_rows() if len(r) >= 2]  # rows 0, 1, 3 (row 3 without its NaN: 3 tokens)
    assert [len(r) for r in rows] == [10, 7, 3]
    means = [sum(r) / len(r) for r in rows]
    stds = [math.sqrt(sum((v - m) ** 2 for v in r) / (len(r) - 1)) for r, m in zip(rows, means)]
    squares = [sum(r) ** 2 for r in rows]
    biases = [s2 - len(r) * sd ** 2 for r, s2, sd in zip(rows, squares, stds)]
    p = "ratio/by_position/seq/new_old"
    assert got[f"{p}/num_seqs"] == 3
    assert got[f"{p}/bias"] == pytest.approx(sum(means) / 3, abs=1e-12)
    assert got[f"{p}/abs_bias"] == pytest.approx(sum(abs(m) for m in means) / 3, abs=1e-12)
    assert got[f"{p}/noise"] == pytest.approx(sum(stds) / 3, abs=1e-12)
    assert got[f"{p}/noise_of_mean"] == pytest.approx(sum(sd / math.sqrt(len(r)) for r, sd in zip(rows, stds)) / 3,
                                                      abs=1e-12)
    assert got[f"{p}/bias_share"] == pytest.approx(sum(biases) / sum(squares), abs=1e-12)


def test_a_constant_bias_is_all_bias_and_iid_noise_is_none():
    torch.manual_seed(0)
    mask = torch.ones(512, 64, dtype=torch.bool)
    bias = PositionStats(64)
    bias.update("old_sampler", torch.full((512, 64), 0.01), mask)
    got = bias.flush()
    assert got["ratio/by_position/seq/old_sampler/bias_share"] == pytest.approx(1.0, abs=1e-9)
    assert got["ratio/by_position/seq/old_sampler/noise"] == pytest.approx(0.0, abs=1e-9)
    noise = PositionStats(64)
    noise.update("old_sampler", 0.01 * torch.randn(512, 64), mask)
    got = noise.flush()
    assert abs(got["ratio/by_position/seq/old_sampler/bias_share"]) < 0.05  # ~0 (sampling error 1/sqrt(512))
    assert got["ratio/by_position/seq/old_sampler/noise"] == pytest.approx(0.01, rel=0.02)
    assert got["ratio/by_position/seq/old_sampler/noise_of_mean"] == pytest.approx(0.01 / 8, rel=0.02)


def test_split_invariant():
    whole, parts = PositionStats(10), PositionStats(10)
    whole.update("old_sampler", X, MASK)
    parts.update("old_sampler", X[:2], MASK[:2])
    parts.update("old_sampler", X[2:, :6], MASK[2:, :6])  # a micro-batch padded to another length
    a, b = whole.flush(), parts.flush()
    assert a.keys() == b.keys()
    for k in a:
        assert b[k] == pytest.approx(a[k], abs=1e-12), k


def test_a_run_logs_the_buckets_and_the_split(tmp_path):
    from trainer_fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path, "fp32_clone", max_steps=1, ratio_by_position=True)
    trainer.train()
    row = next(r for r in trainer.state.log_history if "loss" in r)
    by_position = {k: v for k, v in row.items() if k.startswith("ratio/by_position/")}
    assert all(keys.known(k) for k in by_position)
    for family in ("new_old", "old_sampler"):
        counts = [by_position[f"ratio/by_position/{label}/{family}/num_tokens"] for label in (1, 2, 4, 8)
                  if f"ratio/by_position/{label}/{family}/num_tokens" in by_position]
        assert sum(counts) == row[f"ratio/{family}/num_tokens"]  # the buckets partition the family's tokens
        assert math.isfinite(by_position[f"ratio/by_position/seq/{family}/bias_share"])
    with pytest.raises(ValueError, match="ratio_diagnostics=False"):
        from trainer_fixtures import tiny_grpo_args

        tiny_grpo_args(tmp_path, ratio_by_position=True, ratio_diagnostics=False)


def test_the_report_reads_them():
    from grpo_ratio.analysis.report import render_by_position

    def step(share, bias, floor, seqs=4):
        row = {"step": 1}
        for label, n, gap in ((1, 4, 0.01), (2, 8, 0.02), (4, 16, 0.04)):
            row |= {keys.by_position_key(label, "old_sampler", "num_tokens"): n,
                    keys.by_position_key(label, "old_sampler", "mean_abs_log_ratio"): gap,
                    keys.by_position_key(label, "old_sampler", "kl_k3"): gap * gap / 2}
        row |= {keys.by_position_seq_key("old_sampler", "num_seqs"): seqs,
                keys.by_position_seq_key("old_sampler", "bias_share"): share,
                keys.by_position_seq_key("old_sampler", "abs_bias"): bias,
                keys.by_position_seq_key("old_sampler", "noise_of_mean"): floor}
        return row

    assert render_by_position([{"loss": 1.0}]) == ""
    text = render_by_position([step(0.9, 0.02, 0.001), step(0.7, 0.02, 0.001, seqs=12)])
    assert "| 4-7 | 32 | 0.04 |" in text  # tokens summed over the two steps, the gap token-weighted
    assert "bias_share 0.75" in text and "mostly bias" in text  # (0.9 * 4 + 0.7 * 12) / 16
    assert "mostly noise" in render_by_position([step(0.05, 0.001, 0.001)])
