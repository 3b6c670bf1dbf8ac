"""Tests of `grpo-ratio probe ...` (grpo_ratio/cli.py, grpo_ratio/probes/): each probe on a tiny random model in
seconds, the pure pieces on literal tensors, the error cases; one slow test on SmolLM2-135M."""

import json
import math

import pytest
import torch

from grpo_ratio.cli import main
from grpo_ratio.probes.common import compare, completion_mask_trl, layout_trl, wilson_interval


TINY = ["--model", "tiny", "--max-new-tokens", "6", "--no-progress"]


def _run(tmp_path, probe, *extra):
    rc = main(["probe", probe, *TINY, "--out", str(tmp_path), *extra])
    assert rc == 0
    return json.loads((tmp_path / f"{probe}.json").read_text())


# ---------------------------------------------------------------------------------------------------------------------
# pure pieces


def test_wilson_interval_literal_counts():
    # 5 of 100, z = 1.96: p = 0.05, z^2 = 3.8416, denom = 1.038416, center = (0.05 + 0.019208) / denom = 0.066648,
    # half = 1.96 * sqrt(0.05 * 0.95 / 100 + 3.8416 / 40000) / denom = 1.96 * 0.0238965 / 1.038416 = 0.045105
    low, high = wilson_interval(5, 100)
    assert low == pytest.approx(0.066648 - 0.045105, abs=2e-5)
    assert high == pytest.approx(0.066648 + 0.045105, abs=2e-5)
    # 0 of 100: the interval is [0, z^2 / (n + z^2)] = [0, 3.8416 / 103.8416] = [0, 0.036995]
    assert wilson_interval(0, 100) == (0.0, pytest.approx(0.036995, abs=2e-5))
    assert wilson_interval(100, 100)[1] == 1.0
    with pytest.raises(ValueError, match="0 <= k <= n"):
        wilson_interval(3, 2)


def test_compare_counts_strict_band_and_nonfinite():
    # log r per token: 0 (r = 1), 0.0953 (r = 1.09999 < 1.1, in), 0.0954 (r = 1.10010, out), -0.1053 (r = 0.90006,
    # in), -0.1055 (r = 0.89988, out), nan (out), 0.5 but invalid (not counted) -> 3 of 6 valid tokens out of band
    log_r = torch.tensor([[0.0, 0.0953, 0.0954, -0.1053], [-0.1055, math.nan, 0.5, 0.0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    c = compare(log_r, torch.zeros_like(log_r), valid)
    assert (c["num_tokens"], c["num_oob"], c["num_nonfinite"]) == (6, 3, 1)
    assert c["oob_rate"] == 0.5
    assert c["max_abs_dlogp"] == pytest.approx(0.1055, abs=1e-6)  # the largest finite valid |log r|
    assert c["oob_ci95"] == list(wilson_interval(3, 6))


def test_trl_layout_masks():
    # eos = 1, pad = 0: row 0 ends with EOS at position 1 -> mask [1, 1, 0]; row 1 has no EOS -> all valid
    completion = torch.tensor([[5, 1, 0], [7, 8, 9]])
    assert completion_mask_trl(completion, [1]).tolist() == [[1, 1, 0], [1, 1, 1]]
    data = layout_trl([torch.tensor([3, 4]), torch.tensor([6])], [torch.tensor([5, 1]), torch.tensor([7, 8, 9])],
                      pad_id=0, eos=[1])
    assert data.input_ids.tolist() == [[3, 4, 5, 1, 0], [0, 6, 7, 8, 9]]  # prompts left-, completions right-padded
    assert data.attention_mask.tolist() == [[1, 1, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert data.valid.tolist() == [[True, True, False], [True, True, True]]
    assert (data.logits_to_keep, data.num_tokens) == (3, 5)


# ---------------------------------------------------------------------------------------------------------------------
# probe batch


@pytest.fixture(scope="module")
def batch_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("batch")
    return _run(out, "batch"), out


def test_batch_probe_controls_on_tiny_model(batch_result):
    res, out = batch_result
    r = res["results"]
    n = res["info"]["num_tokens"]
    assert 0 < n <= 8 * 6  # 8 sequences of at most 6 valid completion tokens
    for dtype in ("bf16", "fp16", "fp32"):
        assert r[dtype]["b1_vs_b8"]["num_tokens"] == n  # every dtype scores the same valid tokens
    # the rerun control: the same batch shape twice is bit-identical (seed 004: 0 tokens moved)
    assert r["bf16"]["rerun"]["num_oob"] == 0 and r["bf16"]["rerun"]["max_abs_dlogp"] == 0.0
    # fp32 moves log-probs by rounding only (~1e-7 on a 2-layer model), far inside the band
    assert r["fp32"]["b1_vs_b8"]["num_oob"] == 0
    assert r["fp32"]["b1_vs_b8"]["max_abs_dlogp"] < 1e-4
    assert "| bf16 |" in (out / "batch.md").read_text()


def test_batch_probe_errors(tmp_path, capsys):
    assert main(["probe", "batch", *TINY, "--num-prompts", "4", "--out", str(tmp_path)]) == 2  # batch 8 > 4 prompts
    assert "--batch-size=8" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert main(["probe", "batch", *TINY, "--prompts", str(empty), "--out", str(tmp_path)]) == 2
    assert "holds no prompt" in capsys.readouterr().err
    missing = tmp_path / "no-such-model"
    assert main(["probe", "batch", "--model", str(missing), "--out", str(tmp_path)]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert main(["probe", "batch", *TINY, "--with-32", "--out", str(tmp_path)]) == 2  # 32 > the 8 prompts
    assert "--with-32=32" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------------------
# probe ladder


def test_ladder_probe_on_tiny_model(tmp_path):
    res = _run(tmp_path, "ladder", "--layers", "1")
    r = res["results"]
    assert list(r) == ["bf16", "fp32_clone", "fp16_clone", "fp32_head", "guided_fp32"]
    assert res["guided_fp32_layers"] == [1]
    assert r["bf16"]["time_vs_bf16"] == 1.0
    assert r["fp32_clone"]["num_oob"] == 0 and r["fp32_clone"]["max_abs_dlogp"] < 1e-4
    # fp32 weights: the fp32 modes run the policy's own weights (no copy); fp16_clone holds a 2-byte copy of every
    # parameter, the size of the policy in bf16 (tiny untied qwen2: no non-parameter state besides rotary buffers)
    assert r["fp32_clone"]["extra_bytes"] == r["fp32_head"]["extra_bytes"] == r["guided_fp32"]["extra_bytes"] == 0
    assert r["fp16_clone"]["extra_vs_bf16_model"] == pytest.approx(1.0, rel=0.01)


def test_ladder_probe_layer_errors(tmp_path, capsys):
    assert main(["probe", "ladder", *TINY, "--layers", "5", "--out", str(tmp_path)]) == 2  # tiny has 2 layers
    assert "0..1" in capsys.readouterr().err
    assert main(["probe", "ladder", *TINY, "--layers", str(tmp_path / "x.json"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
