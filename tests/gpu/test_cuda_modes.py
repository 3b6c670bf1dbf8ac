"""Every scoring mode, and each truncation correction, 2 GRPO steps on CUDA (issue 31, item 5).

Never runs in CI (no GPU there): marked `gpu` and skipped without CUDA. No vLLM and no Hub: tiny models built from
their configs, transformers `generate`. `bash scripts/gpu_check.sh` runs these with the rest of the GPU check; alone:

    pytest -m gpu tests/gpu/test_cuda_modes.py -q        # about 2 minutes on one H200

What only a GPU shows here: every accumulator, mask, kept set and copy on the CUDA device (a CPU one raises at the
first mixed operation: the truncation-correction runs crashed at their first diagnostics update before issue 31),
copies built on the GPU in their dtype with fp32 rotary tables, and the default `bf16` mode equal to stock TRL.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (old_logprob_mode, config overrides): every mode of grpo_ratio.modes.MODES once
MODES = [
    ("bf16", {}),
    ("fp32_clone", {}),
    ("fp16_clone", {}),
    ("fp16_clone", {"copy_storage": "per_layer"}),
    ("fp32_head", {}),
    ("guided_fp32", {"guided_fp32_layers": "0"}),
    ("sampler", {}),
]
# the truncation corrections, from the generate recording and recomputed (kept sets, kept mass and additions on CUDA)
CORRECTIONS = [
    ("renormalize", "recorded"),
    ("lift_sampler", "recorded"),
    ("renormalize", "recompute"),
]
CUDA_RUN = dict(use_cpu=False, per_device_train_batch_size=8, num_generations=4, max_completion_length=32)


def _bf16_model():
    """A bf16-stored tiny Qwen2 as `from_pretrained(dtype=bfloat16)` holds one (rotary tables in fp32): the copies of
    fp32_clone and fp16_clone are then real copies."""
    from grpo_ratio.testing import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"), dtype=torch.bfloat16)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model


def _rows(trainer):
    return [row for row in trainer.state.log_history if "loss" in row]


def _check_two_steps(trainer):
    rows = _rows(trainer)
    assert len(rows) == 2
    for row in rows:
        assert row["loss"] == row["loss"]  # finite (NaN != NaN)
        assert row["ratio/new_old/num_tokens"] > 0
    return rows


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
@pytest.mark.parametrize("mode,overrides", MODES, ids=[f"{m}-{'-'.join(o) or 'default'}" for m, o in MODES])
def test_every_mode_trains_two_steps_on_cuda(tmp_path, mode, overrides, weights):
    from trainer_fixtures import tiny_trainer

    model = _bf16_model() if weights == "bf16" else None
    trainer = tiny_trainer(tmp_path, mode, model=model, **CUDA_RUN, **overrides)
    trainer.train()
    _check_two_steps(trainer)
    assert next(trainer.model.parameters()).device.type == "cuda"
    scorer = trainer.scorer
    for copy in [] if scorer is None else scorer.copies():
        module = copy.module
        assert {p.device.type for p in module.parameters()} == {"cuda"}
        assert all(b.dtype == torch.float32 for b in module.buffers() if b.is_floating_point())  # rotary tables


@pytest.mark.parametrize("correction,source", CORRECTIONS)
def test_truncation_corrections_train_two_steps_on_cuda(tmp_path, correction, source):
    # before issue 31: `cpu0d += cuda` in RatioDiagnostics at the first update of any GPU run with a correction
    from trainer_fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path, "fp32_clone", top_p=0.8, truncation_correction=correction,
                           kept_set_source=source, **CUDA_RUN)
    trainer.train()
    for row in _check_two_steps(trainer):
        assert 0.0 < row["ratio/kept_mass_mean"] <= 1.0
    kept = trainer._generations["train"].kept
    assert kept is not None
    if source == "recorded":  # the recorder keeps them where the scores are
        assert kept.sizes.device.type == "cuda"


def test_bf16_is_stock_trl_on_cuda(tmp_path):
    # the default stays stock TRL bit for bit on the GPU too (same seed, same kernels, same order)
    from trainer_fixtures import tiny_trainer, trl_logged_values
    from trl import GRPOTrainer

    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ours = tiny_trainer(tmp_path / "ours", "bf16", **CUDA_RUN)
        ours.train()
        stock = tiny_trainer(tmp_path / "stock", "bf16", trainer_cls=GRPOTrainer, **CUDA_RUN)
        stock.train()
    finally:
        torch.use_deterministic_algorithms(False)
    assert trl_logged_values(ours) == trl_logged_values(stock)
