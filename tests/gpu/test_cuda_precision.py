"""Precision and device state on CUDA (issue 31, items 2, 3 and 5): what tests/test_precision.py and tests/test_device.py
check on the CPU, where only a GPU shows it.

Never runs in CI (no GPU there): marked `gpu` and skipped without CUDA. No Hub: models from their configs.

    pytest -m gpu tests/gpu/test_cuda_precision.py -q        # under a minute on one H200

- IEEE fp32 with TF32 on: TF32 really changes an fp32 forward on this GPU, and the fp32 scoring modes are unchanged by
  it (bitwise equal to a run with TF32 off).
- Long positions: an fp16 copy of a bf16 policy scores a 30,000-token row with its rotary tables in fp32, close to the
  fp32 copy; the same copy with fp16 tables (what copies held before) is far off.
- FlashAttention 2 (when `flash_attn` is installed): the fp32 passes run sdpa and give the sdpa model's numbers.
- Device state: the ratio diagnostics of a truncation correction, kept sets and copies on the GPU.
- The sampler's fp32 head (`fp32_head_operands="bf16"`, issue 43 item 3): `torch.mm(out_dtype=float32)` on bf16
  operands, the fp32 matmul of the upcast operands up to the summation order, TF32 or not.
"""

import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CUDA = torch.device("cuda", 0)
ROPE = dict(max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})


def _model(dtype=torch.float32, hidden=256, layers=2, vocab=4096, attn_implementation="sdpa", peaked=False):
    """A Qwen2-shaped model from its config (Qwen2's RoPE), on the GPU. `peaked`: q/k scaled 8x and the head 20x, so
    attention depends on the rotary phases and next-token distributions are peaked, as in a trained model (a random
    one attends nearly uniformly, whatever its positions)."""
    from grpo_ratio.testing import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config("qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, **ROPE)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    if peaked:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(8)
                layer.self_attn.k_proj.weight.mul_(8)
            model.lm_head.weight.mul_(20)
    return model.to(CUDA)


def _batch(rows=2, length=64, vocab=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (rows, length), generator=g).to(CUDA)
    return ids, torch.ones_like(ids)


@pytest.fixture
def restored_precision():
    saved = (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision)
    yield
    torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = saved


def test_fp32_modes_compute_ieee_fp32_with_tf32_on(restored_precision):
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    model = _model(hidden=1024)
    ids, mask = _batch(length=256)
    ieee = OldLogprobScorer(model, "fp32_clone").score(ids, mask, 64).logps
    torch.backends.fp32_precision = "tf32"  # what transformers' enable_tf32 does for tf32=True / torch_compile + bf16
    with torch.no_grad():
        tf32_logits = model(input_ids=ids, attention_mask=mask).logits
    torch.backends.fp32_precision = "ieee"
    with torch.no_grad():
        ieee_logits = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.equal(tf32_logits, ieee_logits)  # TF32 really acts on this GPU
    torch.backends.fp32_precision = "tf32"
    for mode in ("fp32_clone", "fp32_head"):
        reference = OldLogprobScorer(model, mode)
        with_tf32 = reference.score(ids, mask, 64).logps
        torch.backends.fp32_precision = "ieee"
        without = OldLogprobScorer(model, mode).score(ids, mask, 64).logps
        torch.backends.fp32_precision = "tf32"
        assert torch.equal(with_tf32, without), mode
    assert torch.equal(OldLogprobScorer(model, "fp32_clone").score(ids, mask, 64).logps, ieee)
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # restored after every pass


def test_an_fp16_copy_scores_long_positions_with_fp32_rotary_tables():
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    policy = _model(dtype=torch.bfloat16, peaked=True)
    assert policy.model.rotary_emb.inv_freq.dtype == torch.float32
    ids, mask = _batch(rows=1, length=30_064)  # completion tokens at positions 30,000 to 30,063
    fp32 = OldLogprobScorer(policy, "fp32_clone").score(ids, mask, 64).logps
    scorer = OldLogprobScorer(policy, "fp16_clone")
    fp16 = scorer.score(ids, mask, 64).logps
    (copy,) = scorer.copies()
    assert copy.module.model.rotary_emb.inv_freq.dtype == torch.float32
    gap = (fp16 - fp32).abs().max().item()
    copy.module.model.rotary_emb.inv_freq = copy.module.model.rotary_emb.inv_freq.half()  # what copies held before
    rounded = scorer.score(ids, mask, 64).logps
    rounded_gap = (rounded - fp32).abs().max().item()
    # on a CPU at 3,064 / 8,064 tokens: gap 0.16 / 0.25 nats (fp16 logits of a peaked head), rounded 8.2 / 16.5
    assert gap < 1.0 and rounded_gap > 10 * gap, (gap, rounded_gap)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
@pytest.mark.parametrize("mode,layers", [("fp32_clone", None), ("guided_fp32", [0])])
def test_fp32_passes_under_flash_attention_2(mode, layers):
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    flash = _model(dtype=torch.bfloat16, attn_implementation="flash_attention_2")
    sdpa = _model(dtype=torch.bfloat16, attn_implementation="sdpa")
    sdpa.load_state_dict(flash.state_dict())
    ids, mask = _batch()
    logps = OldLogprobScorer(flash, mode, layers=layers).score(ids, mask, 16).logps
    assert flash.config._attn_implementation == "flash_attention_2"
    assert torch.equal(logps, OldLogprobScorer(sdpa, mode, layers=layers).score(ids, mask, 16).logps)


def test_diagnostics_and_kept_sets_live_on_the_gpu(tmp_path):
    from trainer_fixtures import config_plan, tiny_grpo_args

    from grpo_ratio.corrections.kept_sets import KeptSets
    from grpo_ratio.diagnostics.ratio_diagnostics import RatioDiagnostics
    from grpo_ratio.records import MicroBatchRecord

    args = tiny_grpo_args(tmp_path, top_p=0.8, truncation_correction="lift_sampler", kept_set_source="recompute")
    accelerator = type("Acc", (), {"num_processes": 1, "device": CUDA})()
    diag = RatioDiagnostics(args, accelerator=accelerator, eos_token_ids=[1], plan=config_plan(args))
    B, T = 4, 8
    inputs = {"completion_ids": torch.full((B, T), 5, device=CUDA), "completion_mask": torch.ones(B, T, device=CUDA),
              "advantages": torch.ones(B, device=CUDA), "old_per_token_logps": torch.zeros(B, T, device=CUDA),
              "sampling_per_token_logps": torch.full((B, T), -0.1, device=CUDA)}
    diag.update(MicroBatchRecord(inputs=inputs, train_logps=torch.zeros(B, T, device=CUDA),
                                 old_log_kept_mass=torch.full((B, T), -0.1, device=CUDA),
                                 kept_added=torch.zeros(B, T, dtype=torch.bool, device=CUDA)), mode_is_policy=False)
    metrics = diag.flush()
    assert metrics["ratio/kept_mass_mean"] == pytest.approx(0.904837, abs=1e-5)
    kept = KeptSets.from_lists([[[1, 2], [3]], [[0]]], num_steps=2, device=CUDA)
    keep = kept.dense_cells(torch.arange(4, device=CUDA), 8)
    assert keep.device.type == "cuda" and keep.sum().item() == 4
    on_host = KeptSets.from_lists([[[1, 2], [3]], [[0]]], num_steps=2)
    assert torch.equal(on_host.dense_cells(torch.arange(4, device=CUDA), 8), keep)  # only the ids travel


def test_the_sampler_fp32_head_runs_the_out_dtype_kernel(restored_precision):
    """vLLM's `head_dtype=float32` head on CUDA (PR #48390), SGLang #32370, prime-rl #2441: bf16 operands, fp32
    accumulation and output. The kernel against the IEEE fp32 matmul of the upcast operands (the same maths, the
    summation order cuBLAS's) and against a bf16 output; the scorer's old log-probs under it, unchanged by TF32, and
    close to fp32_head's (they differ by the norm's cast)."""
    from grpo_ratio.old_pass import forward
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    assert forward.has_mm_out_dtype(CUDA)
    g = torch.Generator(device=CUDA).manual_seed(0)
    a = torch.randn(40, 4096, device=CUDA, generator=g).to(torch.bfloat16)  # (M, K): decode-sized, SGLang's shape
    b = torch.randn(4096, 8192, device=CUDA, generator=g).to(torch.bfloat16)  # (K, N)
    out = forward.mm_fp32_out(a, b)
    torch.backends.fp32_precision = "ieee"
    upcast = a.float() @ b.float()
    assert out.dtype == torch.float32
    assert (out - upcast).abs().max() < 1e-3  # |logit| ~ 64: fp32 rounding of the sum, not bf16's (0.25 at 64)
    assert (torch.mm(a, b).float() - upcast).abs().max() > 1e-2  # a bf16 output rounds it
    torch.backends.fp32_precision = "tf32"
    assert torch.equal(forward.mm_fp32_out(a, b), out)  # exact bf16 operands: TF32 does not touch this kernel
    model = _model(dtype=torch.bfloat16, hidden=1024)
    ids, mask = _batch(length=256)
    scorer = OldLogprobScorer(model, "fp32_head", head_operands="bf16")
    with_tf32 = scorer.score(ids, mask, 64).logps  # (B, T)
    torch.backends.fp32_precision = "ieee"
    assert torch.equal(scorer.score(ids, mask, 64).logps, with_tf32) and scorer.copies() == []
    fp32 = OldLogprobScorer(model, "fp32_head").score(ids, mask, 64).logps
    gap = (with_tf32 - fp32).abs()
    assert 0 < gap.max() < 0.05
    assert forward.head_arithmetic("bf16", CUDA)["matmul"].startswith("torch.mm(bf16, bf16, out_dtype=float32)")
