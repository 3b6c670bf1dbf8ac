"""Precision that means what it says (issue 31, item 3): the fp32 buffers of the policy stay fp32 in every copy
(resident, per-layer casts, FSDP2 and ZeRO-3 shadows), checked where rounding shows, at long positions; the "fp32"
modes compute in IEEE fp32 with TF32 on; fp32 passes under a FlashAttention-style `attn_implementation`; instance
forwards set by TRL or Liger survive a pass; a quantized base is refused with a copy mode.

Run: pytest tests/test_precision.py
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_ratio.old_pass.copies import ModuleCopy, PerLayerCast
from grpo_ratio.testing import tiny_config


# Qwen2 / Qwen2.5's RoPE (rope_theta 1e6, 32k positions), read at a position long completions reach
ROPE = dict(max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
POSITION = 30_000
# fp32 inv_freq: angle error <= 30,000 x 6e-8 = 2e-3 rad, then cos/sin rounded to fp16 (5e-4); an fp16 inv_freq is off
# by up to 30,000 x 5e-4 = 15 rad
ROPE_TOLERANCE = 5e-3


def bf16_policy(arch: str = "qwen2", seed: int = 0):
    """A bf16-stored policy as `from_pretrained(..., dtype=torch.bfloat16)` holds one: weights bf16, rotary `inv_freq`
    fp32 (transformers computes it in fp32 and never casts it)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **ROPE), dtype=torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    return model


def rope_error(rotary: torch.nn.Module, dtype: torch.dtype) -> float:
    """Largest |cos - exact| or |sin - exact| of `rotary` at `POSITION` for hidden states of `dtype`, against fp64."""
    config = rotary.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    cos, sin = rotary(torch.zeros(1, 1, dim, dtype=dtype), torch.tensor([[POSITION]]))  # (1, 1, dim) each
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim / 2,)
    angle = torch.cat([POSITION * inv_freq] * 2)  # (dim,)
    return max((cos.double() - angle.cos()).abs().max().item(), (sin.double() - angle.sin()).abs().max().item())


def test_rope_error_detects_rounded_frequencies():
    model = bf16_policy()
    rotary = model.model.rotary_emb
    assert rope_error(rotary, torch.float16) < ROPE_TOLERANCE
    rotary.inv_freq = rotary.inv_freq.half()  # what a `.to(float16)` of the copy did
    assert rope_error(rotary, torch.float16) > 0.5


# ---------------------------------------------------------------------------------------------------------------------
# copies keep the policy's fp32 buffers


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_resident_copy_keeps_fp32_buffers(dtype):
    # was: `module.to(dtype)` of the whole copy rounded the rotary inv_freq to fp16
    policy = bf16_policy()
    copy = ModuleCopy(policy, dtype, whole_model=True).get(version=0)
    assert {b.dtype for b in copy.buffers()} == {torch.float32}
    assert {p.dtype for p in copy.parameters()} == {dtype}
    assert rope_error(copy.model.rotary_emb, dtype) < ROPE_TOLERANCE


def test_per_layer_cast_keeps_fp32_buffers():
    # was: each module's floating buffers were cast with its weights
    policy = bf16_policy()
    rotary = policy.model.rotary_emb
    seen = {}
    rotary.register_forward_hook(lambda module, args, out: seen.update(dtype=module.inv_freq.dtype))  # before the restore
    with PerLayerCast(policy, torch.float16).active():
        error = rope_error(rotary, torch.float16)
    assert seen["dtype"] == torch.float32 and error < ROPE_TOLERANCE
    assert rotary.inv_freq.dtype == torch.float32  # the policy's own buffer is back


def test_fsdp2_shadow_keeps_fp32_buffers(tmp_path):
    # was: the shadow was built with `.to(dtype)` on the meta device and its buffers copied into fp16 ones
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from grpo_ratio.old_pass.sharding.fsdp2 import FSDPShadow

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        policy = bf16_policy().float()  # accelerate's FSDP2 keeps fp32 storage
        mesh = init_device_mesh("cpu", (1,))
        for layer in policy.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(policy, mesh=mesh)
        shadow = FSDPShadow(policy, torch.float16).get(version=0)
        assert {b.dtype for b in shadow.buffers()} == {torch.float32}
        assert rope_error(shadow.model.rotary_emb, torch.float16) < ROPE_TOLERANCE
    finally:
        dist.destroy_process_group()


def test_copies_follow_the_fresh_or_policy_dtype_rule():
    from grpo_ratio.old_pass.copies import float_buffer_dtype

    assert float_buffer_dtype(torch.zeros(1), torch.float16) == torch.float32
    assert float_buffer_dtype(torch.zeros(1, dtype=torch.bfloat16), torch.float16) == torch.float16
    assert math.isclose(POSITION * 5e-4, 15.0)  # the angle error the module docstring quotes


@pytest.mark.slow
def test_zero3_shadow_keeps_fp32_buffers(tmp_path, monkeypatch):
    # was: the shadow's buffers were built under zero.Init in the shadow's dtype and copied into as they were
    pytest.importorskip("deepspeed", reason='ZeRO-3 tests need `pip install -e ".[deepspeed]"`')
    import deepspeed
    import torch.distributed as dist

    from grpo_ratio.old_pass.sharding.zero3 import ZeroShadow

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731"}.items():
        monkeypatch.setenv(key, value)
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        shadow = ZeroShadow(bf16_policy(), torch.float16)  # buffers settled at build; a refresh copies persistent ones
        assert {b.dtype for b in shadow.module.buffers()} == {torch.float32}
        assert rope_error(shadow.module.model.rotary_emb, torch.float16) < ROPE_TOLERANCE
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------------------
# IEEE fp32 with TF32 on


def _precision_state() -> dict:
    backends = torch.backends
    return {"global": backends.fp32_precision, "cuda": backends.cuda.matmul.fp32_precision,
            "mkldnn": backends.mkldnn.matmul.fp32_precision}


@pytest.fixture
def restored_precision():
    """Whatever a test sets, the process's matmul precision is what it was afterwards."""
    saved = _precision_state()
    yield
    torch.backends.fp32_precision = saved["global"]
    torch.backends.cuda.matmul.fp32_precision = saved["cuda"]
    torch.backends.mkldnn.matmul.fp32_precision = saved["mkldnn"]


@pytest.mark.parametrize("setting", ["transformers_tf32", "legacy_high", "medium"])
def test_ieee_fp32_sets_highest_and_restores(restored_precision, setting):
    from grpo_ratio.old_pass.forward import ieee_fp32

    if setting == "transformers_tf32":  # `tf32=True`, or `torch_compile=True` with bf16 (transformers' enable_tf32)
        torch.backends.fp32_precision = "tf32"
    else:
        torch.set_float32_matmul_precision("high" if setting == "legacy_high" else "medium")
    before = _precision_state()
    with ieee_fp32():
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert _precision_state() == before
    with ieee_fp32(enabled=False):
        assert _precision_state() == before


def _tiny_batch(vocab: int = 300):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (2, 10), generator=g)  # (B, P+T)
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("mode,ieee", [("fp32_clone", True), ("fp32_head", True), ("fp16_clone", True),
                                       ("bf16", False)])
def test_scoring_passes_run_in_ieee_fp32(restored_precision, mode, ieee):
    # was: with `tf32=True` every "fp32" pass computed its matmuls in TF32 (10-bit mantissa) on a GPU
    from grpo_ratio.old_pass.scorer import OldLogprobScorer
    from grpo_ratio.testing import tiny_model

    torch.backends.fp32_precision = "tf32"
    model = tiny_model("qwen2")
    seen = []  # the precision every module of the pass (the policy's, a copy's, a runner's) ran under
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda *a: seen.append(torch.backends.cuda.matmul.fp32_precision))
    ids, mask = _tiny_batch()
    try:
        OldLogprobScorer(model, mode).score(ids, mask, 4)
    finally:
        hook.remove()
    assert seen and set(seen) == ({"ieee"} if ieee else {"tf32"})  # bf16 is TRL's pass, TF32 as it trains
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"


def test_fused_fp32_head_runs_in_ieee_fp32(restored_precision, monkeypatch):
    # was: `fp32_head`'s fused path (the old log-probs from the training forward's own final-norm input, TRL's
    # on-policy default) ran its fp32 head matmul in TF32 under `tf32=True`; only the separate pass was IEEE
    from trl.kernels import ChunkedLogProbFunction

    from grpo_ratio.old_pass import forward as forward_module
    from grpo_ratio.old_pass.fused_head import capture_norm_inputs, fused_old_logps
    from grpo_ratio.old_pass.scorer import OldLogprobScorer
    from grpo_ratio.testing import tiny_model

    seen = []  # the fp32 matmul precision TRL's tiled head kernel ran under, call by call

    class Spy:
        @staticmethod
        def apply(*args):
            seen.append(torch.backends.cuda.matmul.fp32_precision)
            return ChunkedLogProbFunction.apply(*args)

    monkeypatch.setattr(forward_module, "ChunkedLogProbFunction", Spy)
    torch.backends.fp32_precision = "tf32"  # what transformers' enable_tf32 sets for `tf32=True`
    model = tiny_model("qwen2")
    scorer = OldLogprobScorer(model, "fp32_head")
    ids, mask = _tiny_batch()  # (2, 10)
    with torch.no_grad(), capture_norm_inputs(model) as record:
        model(input_ids=ids, attention_mask=mask)  # the training forward, as TRL runs it (TF32 on)
    fused = fused_old_logps(scorer, record, ids[:, -4:], 1.0, 0)  # (2, 4)
    assert seen == ["ieee"] and fused.shape == (2, 4) and fused.dtype == torch.float32
    scorer.score(ids, mask, 4)  # the separate pass, IEEE as before
    assert seen == ["ieee", "ieee"]
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the run's setting is back


# ---------------------------------------------------------------------------------------------------------------------
# fp32 passes under FlashAttention


FLASH_LIKE = "fp16_bf16_only_attention"  # a registered attention function with flash-attn's dtype contract
flash_like_calls = []


def flash_like_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' `flash_attention_forward` as far as dtypes go: fp32 q/k/v are cast to the autocast dtype, else to
    the attention's first Linear's dtype (`get_target_dtype`, `fa_peft_integration_check`); then flash-attn's
    contract, fp16 and bf16 only ("FlashAttention only support fp16 and bf16 data type"). The attention itself, and
    its output dtype, are sdpa's on the cast inputs."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    target = get_target_dtype(query, module)
    if target is not None:
        query, key, value = query.to(target), key.to(target), value.to(target)
    if torch.float32 in (query.dtype, key.dtype, value.dtype):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    flash_like_calls.append(query.dtype)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@pytest.fixture
def flash_like_policy():
    """A tiny fp32-stored Qwen2 policy whose attn_implementation refuses fp32 inputs, as flash_attention_2 does."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLASH_LIKE, flash_like_attention)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation=FLASH_LIKE)
    assert model.config._attn_implementation == FLASH_LIKE
    flash_like_calls.clear()
    return model


@pytest.mark.parametrize("mode,layers", [("fp32_clone", None), ("guided_fp32", [0]), ("fp16_clone", None)])
def test_fp32_passes_run_sdpa_under_a_flash_attention(flash_like_policy, mode, layers):
    # was: the fp32 pass handed fp32 q/k/v to the flash kernel, which refuses them, at the first old pass
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    model = flash_like_policy
    ids, mask = _tiny_batch()
    logps = OldLogprobScorer(model, mode, layers=layers).score(ids, mask, 4).logps
    assert torch.isfinite(logps).all()
    assert model.config._attn_implementation == FLASH_LIKE  # the training forward keeps its kernel
    sdpa = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="sdpa")
    sdpa.load_state_dict(model.state_dict())
    assert torch.equal(logps, OldLogprobScorer(sdpa, mode, layers=layers).score(ids, mask, 4).logps)


def test_the_fp16_fallback_rescores_in_fp32_under_a_flash_attention(flash_like_policy):
    # fp16_clone re-scores rows whose fp16 activations overflow in fp32: an fp32 attention too
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    with torch.no_grad():
        flash_like_policy.get_input_embeddings().weight.mul_(1e7)  # overflows fp16 (tests/test_scoring.py)
    ids, mask = _tiny_batch()
    result = OldLogprobScorer(flash_like_policy, "fp16_clone").score(ids, mask, 4)
    assert result.fallback_rows == 2 and torch.isfinite(result.logps).all()


def test_fp32_head_keeps_the_flash_attention_of_its_body(flash_like_policy):
    # fp32_head's body is the training forward's (bf16 under autocast): it keeps its attention kernel, bit for bit
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    ids, mask = _tiny_batch()
    OldLogprobScorer(flash_like_policy, "fp32_head").score(ids, mask, 4)
    assert flash_like_calls and set(flash_like_calls) == {torch.bfloat16}


def test_the_switch_is_said_at_start_up(flash_like_policy, caplog):
    from grpo_ratio.checks import check_fp32_attention

    with caplog.at_level("INFO", logger="grpo_ratio"):
        assert check_fp32_attention(flash_like_policy, "fp32_clone") == FLASH_LIKE
    assert f"attn_implementation={FLASH_LIKE!r}" in caplog.text and "'sdpa'" in caplog.text
    assert check_fp32_attention(flash_like_policy, "fp32_head") is None  # no fp32 attention in its pass
    assert check_fp32_attention(flash_like_policy, "bf16") is None


# ---------------------------------------------------------------------------------------------------------------------
# instance forwards survive a pass (TRL's fp32 LM head, Liger's RMSNorm)


@pytest.mark.parametrize("mode,layers", [("fp32_head", None), ("guided_fp32", [1])])
def test_instance_forwards_set_before_a_pass_are_the_same_objects_after(mode, layers):
    # was: `del module.forward` after the pass: TRL's `cast_lm_head_to_fp32` head forward and Liger's RMSNorm forward
    # on the final norm were gone after the first separate fp32-head pass (generate then ran the head in bf16)
    import types

    from grpo_ratio.old_pass.scorer import OldLogprobScorer
    from grpo_ratio.testing import tiny_model

    model = tiny_model("qwen2")
    head, norm, layer = model.lm_head, model.model.norm, model.model.layers[1]
    patched = {m: types.MethodType(type(m).forward, m) for m in (head, norm, layer)}  # as TRL and Liger set them
    for module, forward in patched.items():
        module.forward = forward
    ids, mask = _tiny_batch()
    OldLogprobScorer(model, mode, layers=layers).score(ids, mask, 4)
    for module, forward in patched.items():
        assert module.__dict__.get("forward") is forward
    assert "forward" not in model.model.layers[0].__dict__  # nothing left where nothing was


# ---------------------------------------------------------------------------------------------------------------------
# a quantized base


@pytest.mark.parametrize("mode,refused", [("fp16_clone", True), ("fp32_clone", True), ("guided_fp32", True),
                                          ("fp32_head", False), ("bf16", False), ("sampler", False)])
def test_a_quantized_base_is_refused_with_a_copy_mode(mode, refused):
    from grpo_ratio.checks import check_quantized_copy
    from grpo_ratio.testing import tiny_model

    model = tiny_model("qwen2")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}  # as QLoRA loads one
    if refused:
        with pytest.raises(ValueError, match=f"old_logprob_mode={mode!r}.*quantized.*fp32_head"):
            check_quantized_copy(model, mode)
    else:
        check_quantized_copy(model, mode)
    check_quantized_copy(tiny_model("qwen2"), mode)  # an unquantized base: nothing to refuse


def test_the_trainer_refuses_a_quantized_base_with_a_copy_mode_at_start(tmp_path):
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer

    model = tiny_model("qwen2")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match="old_logprob_mode='fp16_clone'.*quantized \\(bitsandbytes\\)"):
        RatioGRPOTrainer(model=model, reward_funcs=letter_reward, args=tiny_grpo_args(tmp_path, old_logprob_mode=
                         "fp16_clone"), train_dataset=tiny_prompts(4), processing_class=tiny_tokenizer())
