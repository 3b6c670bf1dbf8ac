"""Start-up lints that catch a sampler/trainer mismatch before it costs a run (grpo_ratio/lints.py), and the IS
weights logged under `lift_sampler`. The end-to-end versions against a real vLLM engine are in tests/vllm_lane.

Run: pytest tests/test_lints.py
"""

import warnings

import pytest
import torch

from grpo_ratio import RatioGRPOConfig
from grpo_ratio.lints import check_vllm, old_side_dtype


def _vllm_args(**kw):
    base = dict(output_dir="unused", use_cpu=True, use_vllm=True, vllm_mode="colocate", report_to="none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # config-time warnings are not under test here
        return RatioGRPOConfig(**{**base, **kw})


def _caught(args, engine, trainer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_vllm(args, engine, trainer)
    return [str(w.message) for w in caught]


def test_engine_dtype_differs_from_the_old_log_probs():
    # TRL passes no dtype: vLLM runs an fp32 checkpoint in bf16; an fp32 trainer (bf16=False) then disagrees
    args = _vllm_args(bf16=False, old_logprob_mode="fp32_clone")
    (message,) = _caught(args, torch.bfloat16, torch.float32)
    assert "vLLM samples in torch.bfloat16 but the old log-probs are computed in torch.float32" in message
    assert "vllm_dtype='float32'" in message
    assert _caught(args, torch.float32, torch.float32) == []  # vllm_dtype="float32": nothing to say


def test_bf16_trainer_and_bf16_engine_agree():
    args = _vllm_args(bf16=True, old_logprob_mode="bf16")
    assert old_side_dtype(args, torch.bfloat16) == torch.bfloat16
    assert _caught(args, torch.bfloat16, torch.bfloat16) == []


def test_fp32_head_on_one_side_only():
    args = _vllm_args(bf16=True, old_logprob_mode="fp32_head")
    messages = _caught(args, torch.bfloat16, torch.bfloat16)
    assert any("an fp32 LM head on the trainer side only" in m for m in messages)


def test_lift_sampler_names_the_is_metrics_the_loss_uses():
    args = _vllm_args(top_p=0.8, truncation_correction="lift_sampler")
    messages = _caught(args, torch.bfloat16, torch.bfloat16)
    assert any("ratio/importance_sampling_ratio/*" in m for m in messages)


def test_server_mode_names_the_dtype_flag():
    args = _vllm_args(vllm_mode="server", bf16=False)
    messages = _caught(args, None, torch.float32)
    assert any("trl vllm-serve --dtype float32" in m for m in messages)


@pytest.mark.parametrize("kw,match", [
    (dict(vllm_dtype="fp32"), "vllm_dtype='fp32' is not allowed"),
    (dict(vllm_dtype="float32", vllm_mode="server"), "trl vllm-serve --dtype float32"),
])
def test_vllm_dtype_is_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        _vllm_args(**kw)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_logged_is_weights_are_trls_formula(level):
    from accelerate import Accelerator

    from grpo_ratio.diagnostics import RatioDiagnostics

    args = _vllm_args()
    diagnostics = RatioDiagnostics(args, Accelerator(cpu=True), eos_token_ids=[1])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    if level == "token":
        weights = torch.tensor([[0.5, 2.0, 9.0], [1.0, 9.0, 9.0]])  # 9.0 only on masked cells
        expected = (0.5, (0.5 + 2.0 + 1.0) / 3, 2.0)
    else:
        weights = torch.tensor([[0.25], [3.0]])
        expected = (0.25, 1.625, 3.0)
    metrics = diagnostics.importance_sampling_metrics(weights, mask)
    assert [metrics[f"ratio/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max")] == pytest.approx(expected)
