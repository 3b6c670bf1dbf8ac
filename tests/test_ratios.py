"""Tests of grpo_ratio.diagnostics.ratios: literal tensors with the expected values derived in comments.

Run: /work/venv/bin/pytest tests/test_ratios.py -q
"""

import importlib.util
import math
import os
import pathlib
import socket
import sys

import pytest
import torch

from grpo_ratio.corrections.is_correction import ISCorrection, importance_weights
from grpo_ratio.diagnostics.mismatch import ISWeightStats
from grpo_ratio.diagnostics.ratios import FlipStats, RatioStats, clip_flips, ppo_clip_active, valid_token_mask
from grpo_ratio.testing.ranks import run_ranks


def _log(values):
    """log r of literal ratios, as an fp32 tensor."""
    return torch.log(torch.tensor(values, dtype=torch.float64)).float()


# ---------------------------------------------------------------- valid_token_mask


def test_valid_token_mask_keeps_first_eos_and_drops_what_follows():
    # pad = 0, eos = 1. Row 0 ends with EOS at position 2 (valid), pads after it are masked anyway.
    # Row 1 has no EOS: the completion mask decides. Row 2 is a lone EOS.
    # Row 3 has a stray 1 after the EOS with completion_mask 1 (should not happen in TRL, must still be cut).
    ids = torch.tensor([[5, 6, 1, 0, 0], [7, 8, 9, 10, 11], [1, 0, 0, 0, 0], [5, 1, 6, 7, 0]])
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]).bool()
    assert torch.equal(valid_token_mask(ids, completion_mask, 1), expected)


def test_valid_token_mask_pad_is_eos():
    # pad == eos == 1 and a completion_mask that (wrongly) says 1 everywhere: the first 1 is the EOS and is valid,
    # the trailing 1s are padding and are not. Row 2: a tool-masked token (mask 0 at position 1) stays invalid.
    ids = torch.tensor([[5, 6, 1, 1, 1], [7, 1, 1, 1, 1], [5, 6, 7, 1, 1]])
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 1, 1, 1]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 1, 0]]).bool()
    assert torch.equal(valid_token_mask(ids, completion_mask, eos_token_ids=1), expected)


def test_valid_token_mask_several_eos_ids():
    # eos ids {1, 2}: the first of either ends the row.
    ids = torch.tensor([[5, 2, 6, 1]])
    assert valid_token_mask(ids, torch.ones(1, 4), [1, 2]).tolist() == [[True, True, False, False]]


def test_valid_token_mask_errors():
    with pytest.raises(ValueError, match="eos_token_ids"):
        valid_token_mask(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), [])
    with pytest.raises(ValueError, match="one shape"):
        valid_token_mask(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 4), 1)


# ---------------------------------------------------------------- RatioStats


def test_ratio_stats_hand_values():
    # Valid r = [1.0, 1.05, 0.8, 1.2]; the 5th token (r = 2.0) is masked out.
    # Out of band (r < 0.9 or r > 1.1): 0.8 and 1.2 -> 2 / 4 = 0.5.
    # mean |log r| = (0 + log 1.05 + |log 0.8| + log 1.2) / 4.
    # Sorted log r = [log .8, 0, log 1.05, log 1.2], N = 4, position q * 3, interpolated in log space:
    #   p1:  pos 0.03 -> 0.97 * log .8 + 0.03 * 0            -> r = 0.8 ** 0.97
    #   p50: pos 1.5  -> (0 + log 1.05) / 2                   -> r = sqrt(1.05)
    #   p99: pos 2.97 -> 0.03 * log 1.05 + 0.97 * log 1.2     -> r = 1.05 ** 0.03 * 1.2 ** 0.97
    stats = RatioStats().update(_log([[1.0, 1.05, 0.8, 1.2, 2.0]]), torch.tensor([[1, 1, 1, 1, 0]]))
    m = stats.as_metrics("ratio/x")
    assert m["ratio/x/num_tokens"] == 4
    assert m["ratio/x/oob_rate"] == 0.5
    assert m["ratio/x/nonfinite_rate"] == 0.0
    expected = {
        "mean_abs_log_ratio": (math.log(1.05) - math.log(0.8) + math.log(1.2)) / 4,
        "mean": (1.0 + 1.05 + 0.8 + 1.2) / 4,  # mean of r over the finite valid tokens
        "p1": 0.8**0.97,
        "p50": math.sqrt(1.05),
        "p99": 1.05**0.03 * 1.2**0.97,
    }
    for key, value in expected.items():
        assert m[f"ratio/x/{key}"] == pytest.approx(value, rel=1e-6)  # fp32 log-ratios
    assert set(m) == {f"ratio/x/{k}" for k in ["num_tokens", "oob_rate", "nonfinite_rate", *expected]}


def test_ratio_stats_band_is_configurable():
    # Band [0.95, 1.25]: of r = [1.0, 1.05, 0.8, 1.2] only 0.8 is out -> 1 / 4.
    stats = RatioStats(band=(0.95, 1.25)).update(_log([[1.0, 1.05, 0.8, 1.2]]), torch.ones(1, 4, dtype=torch.bool))
    assert stats.as_metrics("r")["r/oob_rate"] == 0.25


def test_ratio_stats_nonfinite_log_ratios_are_out_of_band_and_left_out_of_quantiles():
    # log r = [0, nan, +inf, -inf, 0.05], all valid. r = [1, nan, inf, 0, e^0.05]: nan, inf and 0 are out of band
    # -> 3 / 5; the 3 non-finite log-ratios -> nonfinite_rate 3 / 5. Finite values [0, 0.05]:
    # mean |log r| = 0.025; p50 at pos 0.5 -> exp(0.025); p1 at pos 0.01 -> exp(0.0005); p99 -> exp(0.0495).
    log_ratio = torch.tensor([[0.0, math.nan, math.inf, -math.inf, 0.05]])
    m = RatioStats().update(log_ratio, torch.ones(1, 5, dtype=torch.bool)).as_metrics("r")
    assert m["r/oob_rate"] == 0.6
    assert m["r/nonfinite_rate"] == 0.6
    assert m["r/mean_abs_log_ratio"] == pytest.approx(0.025, rel=1e-6)
    assert m["r/p1"] == pytest.approx(math.exp(0.0005), rel=1e-6)
    assert m["r/p50"] == pytest.approx(math.exp(0.025), rel=1e-6)
    assert m["r/p99"] == pytest.approx(math.exp(0.0495), rel=1e-6)


def test_ratio_stats_all_nonfinite_has_no_quantiles():
    # Two valid NaN log-ratios: both out of band and non-finite; no finite value -> no mean or quantile keys.
    m = RatioStats().update(torch.full((1, 2), math.nan), torch.ones(1, 2, dtype=torch.bool)).as_metrics("r")
    assert m == {"r/num_tokens": 2.0, "r/oob_rate": 1.0, "r/nonfinite_rate": 1.0}


def test_ratio_stats_quantiles_match_torch_quantile_at_order_statistics():
    # N = 101: q * (N - 1) = 1, 50, 99 are integers, so p1, p50, p99 are order statistics 1, 50, 99 of r, which is
    # what torch.quantile returns there (no interpolation).
    torch.manual_seed(0)
    log_ratio = 0.2 * torch.randn(1, 101)
    m = RatioStats().update(log_ratio, torch.ones(1, 101, dtype=torch.bool)).as_metrics("r")
    reference = torch.quantile(torch.exp(log_ratio.double()), torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64))
    torch.testing.assert_close(torch.tensor([m["r/p1"], m["r/p50"], m["r/p99"]], dtype=torch.float64), reference)


def test_ratio_stats_band_errors():
    with pytest.raises(ValueError, match="band"):
        RatioStats(band=(1.1, 0.9))
    with pytest.raises(ValueError, match="band"):
        RatioStats(band=(0.9, 1.1)).merge(RatioStats(band=(0.8, 1.2)))


# ---------------------------------------------------------------- ppo_clip_active and TRL's gradient


def test_ppo_clip_active_hand_values():
    # epsilon_low = 0.2, epsilon_high = 0.28 (DAPO): clipped when A > 0 and r > 1.28, or A < 0 and r < 0.8.
    # r = [1.25, 1.35, 0.85, 0.75] in every row.
    #   A = +1: [F (1.25 <= 1.28), T (1.35 > 1.28), F, F]
    #   A = -1: [F, F, F (0.85 >= 0.8), T (0.75 < 0.8)]
    #   A =  0: never (the gradient is 0 anyway, not because of the clip)
    log_ratio = _log([[1.25, 1.35, 0.85, 0.75]] * 3)
    active = ppo_clip_active(log_ratio, torch.tensor([1.0, -1.0, 0.0]), 0.2, 0.28)
    assert active.tolist() == [[False, True, False, False], [False, False, False, True], [False] * 4]
    # Same with advantages of shape (B, 1).
    assert torch.equal(ppo_clip_active(log_ratio, torch.tensor([[1.0], [-1.0], [0.0]]), 0.2, 0.28), active)


def test_ppo_clip_active_delta():
    # delta = 1.5 caps r in the unclipped term: for A < 0 and r = 1.6 > delta, -min(1.5 A, 1.28 A) = -1.5 A is
    # constant -> clipped. r = 1.4 < delta stays active for A < 0. For A > 0, r = 1.6 > 1.28 was clipped anyway.
    log_ratio = _log([[1.6, 1.4], [1.6, 1.4]])
    active = ppo_clip_active(log_ratio, torch.tensor([-1.0, 1.0]), 0.2, 0.28, delta=1.5)
    assert active.tolist() == [[True, False], [True, True]]
    with pytest.raises(ValueError, match="delta"):
        ppo_clip_active(log_ratio, torch.tensor([-1.0, 1.0]), 0.2, 0.28, delta=1.2)


def _trl_per_token_loss(per_token_logps, old_per_token_logps, advantages, epsilon_low, epsilon_high, delta=None):
    """TRL 1.16 `_compute_loss` for loss_type grpo/bnpo/dr_grpo/dapo, token level (grpo_trainer.py L3081-3120).

    Copied line for line; `test_trl_loss_source_unchanged` checks that those lines are still in the installed TRL.
    """
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = per_token_logps - old_per_token_logps
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    per_token_loss1 = coef_1 * advantages
    per_token_loss2 = coef_2 * advantages
    return -torch.min(per_token_loss1, per_token_loss2)


def _trl_source() -> str:
    origin = pathlib.Path(importlib.util.find_spec("trl").origin).parent / "trainer" / "grpo_trainer.py"
    return origin.read_text()


def test_trl_loss_source_unchanged():
    source = _trl_source()
    for line in [
        "coef_2 = torch.clamp(coef_1, 1 - self.epsilon_low, 1 + self.epsilon_high)",
        "coef_1 = torch.clamp(coef_1, max=self.args.delta)",
        "per_token_loss = -torch.min(per_token_loss1, per_token_loss2)",
        "per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)",
        "per_sequence_logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)",
        "invalid_mis_mask = (vllm_importance_sampling_ratio < min_val) | (",
    ]:
        assert line in source, f"TRL's loss changed: {line!r} not found"


@pytest.mark.parametrize("delta", [None, 1.4])
def test_ppo_clip_active_is_where_trl_gradient_is_zero(delta):
    # grad of TRL's per-token loss w.r.t. logp is 0 exactly where the clip is active or A == 0, and non-zero
    # elsewhere (d/dlogp of -r A is -r A != 0). Random log-ratios in [-0.6, 0.6] land on every side of [0.8, 1.28];
    # hitting a clip edge exactly has probability ~0.
    torch.manual_seed(1)
    old = -3.0 * torch.rand(6, 20)  # (B, T) log-probs
    logp = (old + 1.2 * torch.rand(6, 20) - 0.6).requires_grad_(True)  # (B, T)
    advantages = torch.tensor([1.5, -0.7, 0.0, 0.3, -2.0, 1.0])  # (B,)
    loss = _trl_per_token_loss(logp, old, advantages, 0.2, 0.28, delta)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    active = ppo_clip_active(logp.detach() - old, advantages, 0.2, 0.28, delta)
    zero_adv = (advantages == 0).unsqueeze(1).expand_as(active)
    assert torch.equal(grad == 0, active | zero_adv)
    assert active.any() and (~active & ~zero_adv).any()  # both cases occur


# ---------------------------------------------------------------- clip_flips


def test_clip_flips_hand_values():
    # epsilon 0.2 / 0.2. a: r = [1.3, 0.7, 1.0] per row; b: r = 1 (log-ratio 0, as at TRL's first inner step).
    #   row 0, A = +2.0:  a clipped = [T (1.3 > 1.2), F, F]; b never -> flip at position 0
    #   row 1, A = -0.5:  a clipped = [F, T (0.7 < 0.8), (masked)] -> flip at position 1
    # Valid tokens 5, flips 2 -> 0.4. |A|-weighted: (2.0 + 0.5) / (3 * 2.0 + 2 * 0.5) = 2.5 / 7.
    log_ratio_a = _log([[1.3, 0.7, 1.0], [1.3, 0.7, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    stats = clip_flips(log_ratio_a, torch.zeros(2, 3), torch.tensor([2.0, -0.5]), mask, 0.2, 0.2)
    assert stats.as_metrics() == {"ratio/clip_flip_rate": 0.4, "ratio/clip_flip_rate_adv_weighted": 2.5 / 7}


def test_clip_flips_both_clipped_is_no_flip_and_zero_advantage_has_no_weighted_rate():
    # a == b: every decision agrees -> 0 flips. All A == 0: no token has a gradient -> weighted rate absent.
    log_ratio = _log([[1.3, 0.7]])
    stats = clip_flips(log_ratio, log_ratio, torch.tensor([2.0]), torch.ones(1, 2), 0.2, 0.2)
    assert stats.as_metrics()["ratio/clip_flip_rate"] == 0.0
    stats = clip_flips(log_ratio, torch.zeros(1, 2), torch.tensor([0.0]), torch.ones(1, 2), 0.2, 0.2)
    assert stats.as_metrics() == {"ratio/clip_flip_rate": 0.0}


# ---------------------------------------------------------------- identity, empty, exactness across splits


def test_identity_log_ratio_zero():
    # r = 1 everywhere: nothing out of band, every quantile 1, no flip, no IS weight changed.
    zeros, mask = torch.zeros(3, 4), torch.ones(3, 4, dtype=torch.bool)
    advantages = torch.tensor([1.0, -1.0, 0.5])
    m = RatioStats().update(zeros, mask).as_metrics("r")
    assert (m["r/oob_rate"], m["r/mean_abs_log_ratio"], m["r/p1"], m["r/p50"], m["r/p99"]) == (0, 0, 1, 1, 1)
    assert clip_flips(zeros, zeros, advantages, mask, 0.2, 0.2).as_metrics()["ratio/clip_flip_rate"] == 0.0
    is_metrics = _is_stats(zeros, mask, "token_mask", 0.5, 2.0).as_metrics()
    assert (is_metrics["ratio/is_masked_token_frac"], is_metrics["ratio/is_masked_seq_frac"]) == (0.0, 0.0)
    assert is_metrics["ratio/is_weight_ess"] == 1.0 and is_metrics["ratio/is_weight_raw/p50"] == 1.0


def test_empty_mask_gives_no_metric():
    log_ratio, mask = _log([[1.5, 0.5]]), torch.zeros(1, 2, dtype=torch.bool)
    assert RatioStats().update(log_ratio, mask).as_metrics("r") == {}
    assert RatioStats().as_metrics("r") == {}
    assert clip_flips(log_ratio, torch.zeros(1, 2), torch.tensor([1.0]), mask, 0.2, 0.2).as_metrics() == {}
    assert _is_stats(log_ratio, mask, "sequence_mask", None, 3.0).as_metrics() == {}
    assert FlipStats().as_metrics() == {} and ISWeightStats().as_metrics() == {}


def _synthetic_batch():
    """B = 6 rows, T = 7: log-ratios with NaN/inf, dyadic advantages (exact fp64 sums), ragged valid lengths."""
    g = torch.Generator().manual_seed(3)
    log_ratio_a = 0.15 * torch.randn(6, 7, generator=g)  # (B, T)
    log_ratio_a[1, 3], log_ratio_a[4, 0] = math.nan, math.inf
    log_ratio_b = 0.15 * torch.randn(6, 7, generator=g)  # (B, T)
    advantages = torch.tensor([0.5, -1.25, 0.0, 2.0, -0.75, 1.5])  # (B,)
    mask = torch.arange(7) < torch.tensor([7, 5, 0, 3, 7, 6]).unsqueeze(1)  # (B, T), row 2 empty
    return log_ratio_a, log_ratio_b, advantages, mask


def _is_stats(log_ratio, mask, mode, clip_min, clip_max) -> ISWeightStats:
    """`ISWeightStats` of TRL's vLLM IS correction in `mode` (grpo_ratio.diagnostics.mismatch, reduced like the rest)."""
    correction = ISCorrection.from_trl(mode, clip_min, clip_max)
    return ISWeightStats.of(correction).update(importance_weights(log_ratio, mask, correction))


def _all_stats(rows):
    """(RatioStats, FlipStats, ISWeightStats) of the synthetic batch restricted to `rows`."""
    a, b, adv, mask = (t[rows] for t in _synthetic_batch())
    return (
        RatioStats().update(a, mask),
        clip_flips(a, b, adv, mask, 0.1, 0.1),
        _is_stats(a, mask, "token_mask", 0.9, 1.1),
    )


def _metrics(stats):
    ratio, flips, is_stats = stats
    return {**ratio.as_metrics("ratio/new_old"), **flips.as_metrics(), **is_stats.as_metrics()}


def _merge(parts):
    total = [type(s)(**({"action": s.action, "rejects": s.rejects} if isinstance(s, ISWeightStats) else {}))
             for s in parts[0]]
    for part in parts:
        for acc, s in zip(total, part, strict=True):
            acc.merge(s)
    return total


def test_micro_batches_and_processes_give_exactly_the_single_batch_values():
    single = _metrics(_all_stats(slice(0, 6)))
    assert {"ratio/new_old/p99", "ratio/clip_flip_rate_adv_weighted", "ratio/is_masked_seq_frac"} <= set(single)
    # 3 micro-batches of 2 rows on one process.
    micro = _merge([_all_stats(slice(i, i + 2)) for i in (0, 2, 4)])
    assert _metrics(micro) == single
    # 2 processes: rows 0-2 (2 micro-batches) and rows 3-5 (1 micro-batch), merged in either order.
    p0 = _merge([_all_stats(slice(0, 1)), _all_stats(slice(1, 3))])
    p1 = _merge([_all_stats(slice(3, 6))])
    assert _metrics(_merge([p0, p1])) == single
    assert _metrics(_merge([p1, p0])) == single


class _TwoIdenticalProcesses:
    """Stand-in for `accelerate.Accelerator` on 2 processes that hold the same stats.

    reduce sums the 2 copies; pad_across_processes pads with 2 `pad_index` entries (as a shorter process would be
    padded); gather concatenates the 2 padded copies.
    """

    device = torch.device("cpu")

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        return 2 * tensor

    def pad_across_processes(self, tensor, dim, pad_index):
        return torch.cat([tensor, torch.full((2,), pad_index, dtype=tensor.dtype)])

    def gather(self, tensor):
        return torch.cat([tensor, tensor])


def test_all_reduce_sums_counts_and_gathers_values():
    ratio, flips, is_stats = _all_stats(slice(0, 6))
    twice = _merge([(ratio, flips, is_stats), (ratio, flips, is_stats)])
    reduced = [s.all_reduce(_TwoIdenticalProcesses()) for s in (ratio, flips, is_stats)]
    assert _metrics(reduced) == _metrics(twice)
    assert reduced[0].num_tokens.item() == 2 * ratio.num_tokens.item()
    assert _metrics([s.all_reduce(None) for s in (ratio, flips, is_stats)]) == _metrics((ratio, flips, is_stats))


_TWO_PROCESS_SCRIPT = """
from accelerate import Accelerator
from grpo_ratio.testing.ranks import end_rank
from test_ratios import _all_stats, _metrics
acc = Accelerator(cpu=True)
assert acc.num_processes == 2
rows = slice(0, 2) if acc.process_index == 0 else slice(2, 6)  # unequal numbers of values per process
reduced = [s.all_reduce(acc) for s in _all_stats(rows)]
assert _metrics(reduced) == _metrics(_all_stats(slice(0, 6))), _metrics(reduced)
print("TWO_PROCESS_OK")
end_rank()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_reduce_on_two_real_processes(tmp_path):
    # 2 CPU processes joined by gloo (accelerate reads RANK / WORLD_SIZE / MASTER_*): all_reduce over real
    # collectives, with unequal numbers of values per process, gives exactly the single-batch metrics on both.
    script = tmp_path / "two_processes.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).parent), env.get("PYTHONPATH", "")])  # test_ratios
    env["OMP_NUM_THREADS"] = "1"
    # each rank in a session of its own, killed with everything it started on a timeout; none may outlive the run
    procs = run_ranks([[sys.executable, str(script)]] * 2, timeout=120,
                      envs=[{**env, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in (0, 1)])
    for proc in procs:
        assert proc.returncode == 0 and "TWO_PROCESS_OK" in proc.stdout, proc.stderr[-3000:]
