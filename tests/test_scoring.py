"""Scoring modes outside the trainer, on every tiny architecture (tied and untied heads).

Run: pytest tests/test_scoring.py
"""

import pytest
import torch

from grpo_ratio.old_pass.scorer import (
    OldLogprobScorer,
    completion_logprobs_from_logits,
    model_anatomy,
    score_completion_logprobs,
)
from grpo_ratio.testing import ARCHITECTURES, tiny_model


T = 5  # completion tokens scored per row


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 300, (4, 12), generator=g)  # (B, P+T)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded prompt, as TRL builds them
    return ids, mask


def _fp32_reference(model, ids, mask, temperature):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=T + 1).logits  # (B, T+1, V) fp32
    return completion_logprobs_from_logits(logits, ids[:, -T:], temperature)


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_modes_on_fp32_weights(arch, tie, temperature):
    # TRL's default: fp32 weights, bf16 autocast. fp32 modes run the policy's own weights, outside autocast.
    model = tiny_model(arch, tie_word_embeddings=tie)
    ids, mask = _batch()
    ref = _fp32_reference(model, ids, mask, temperature)
    L = len(model_anatomy(model).layers)
    score = lambda mode, layers=None: score_completion_logprobs(  # noqa: E731
        model, ids, mask, T, mode=mode, temperature=temperature, layers=layers, batch_size=2)
    assert (score("fp32_clone") - ref).abs().max() <= 1e-5
    assert (score("guided_fp32", range(L)) - ref).abs().max() <= 1e-5  # every layer + head = all fp32
    bf16_gap = (score("bf16") - ref).abs().max()
    assert bf16_gap > 1e-4  # bf16 autocast really ran (a precision gap exists, not forced to 0)
    assert (score("fp16_clone") - ref).abs().max() < bf16_gap  # 3 more mantissa bits
    scorer = OldLogprobScorer(model, "fp32_clone")
    scorer.score(ids, mask, T)
    assert scorer.copies() == [] and scorer.extra_bytes() == 0  # no copy of fp32 weights


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_guided_without_layers_equals_fp32_head(arch):
    # guided_fp32 needs >= 1 layer by config; the same code with an empty layer set is fp32_head.
    model = tiny_model(arch, dtype=torch.bfloat16)
    ids, mask = _batch()
    head = score_completion_logprobs(model, ids, mask, T, mode="fp32_head")
    scorer = OldLogprobScorer(model, "fp32_head")
    scorer.layers = []
    assert torch.equal(head, scorer.score(ids, mask, T).logps)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_bf16_weights_copies(arch, tie):
    # bf16-stored weights: fp32 modes evaluate the bf16 values in fp32 via copies; the policy is left untouched.
    model = tiny_model(arch, tie_word_embeddings=tie, dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, mask = _batch()
    clone = score_completion_logprobs(model, ids, mask, T, mode="fp32_clone")
    ref = _fp32_reference(tiny_model(arch, tie_word_embeddings=tie, dtype=torch.bfloat16).float(), ids, mask, 1.0)
    assert (clone - ref).abs().max() <= 1e-5
    L = len(model_anatomy(model).layers)
    guided_all = score_completion_logprobs(model, ids, mask, T, mode="guided_fp32", layers=range(L))
    assert (guided_all - clone).abs().max() <= 1e-5
    scorer = OldLogprobScorer(model, "fp32_head")
    scorer.score(ids, mask, T)
    head = model.get_output_embeddings()
    # the only copy is the fp32 head (plus the tiny norm); the input embedding keeps its dtype and identity
    upcast = [p for m in (head, model_anatomy(model).norm) for p in m.parameters()]
    assert scorer.extra_bytes() == sum(p.numel() for p in upcast) * 4  # fp32 = 4 bytes per value
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tie
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert "forward" not in head.__dict__  # the temporary fp32 forward is gone


def test_fp16_overflow_falls_back_to_fp32():
    # Embedding values of 2e5 overflow fp16 (max 65,504) but RMSNorm makes them harmless in fp32.
    model = tiny_model("llama")
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e7)
    ids, mask = _batch()
    scorer = OldLogprobScorer(model, "fp16_clone")
    result = scorer.score(ids, mask, T)
    logps = result.logps
    assert torch.isfinite(logps).all()
    assert result.fallback_rows == 4  # every row overflowed and was re-scored in fp32
    ref = _fp32_reference(model, ids, mask, 1.0)
    assert (logps - ref).abs().max() <= 1e-5


def _one_token_overflows(dtype=torch.float32, token=5):
    """A tiny Qwen2 whose input embedding of `token` overflows fp16 (x1e8; RMSNorm keeps fp32 finite), and a batch
    (4, 12) with `token` in rows 0 and 2 only: an fp16 pass overflows on those rows and no other."""
    model = tiny_model("qwen2", dtype=dtype)
    with torch.no_grad():
        model.get_input_embeddings().weight[token].mul_(1e8)
    ids = torch.randint(token + 1, 300, (4, 12), generator=torch.Generator().manual_seed(0))  # (B, P+T)
    ids[0, 9], ids[2, 10] = token, token
    return model, ids, torch.ones_like(ids)


def test_fp16_fallback_rows_meet_the_kept_sets_and_the_full_vocabulary():
    # fp16_clone with a truncation correction (kept sets recomputed from the pass's logits) or ratio_full_vocab
    # (compare_policy): the overflowing rows' fp32 logits sit beside the other rows' fp16 ones in one HeadLogits, whose
    # cells once raised "Index put requires the source and destination dtypes match"
    from grpo_ratio.corrections.kept_sets import SamplingSettings

    model, ids, mask = _one_token_overflows()
    settings = SamplingSettings(top_k=20)
    fp16 = OldLogprobScorer(model, "fp16_clone").score(ids, mask, T, kept=settings, compare_policy=True)
    assert fp16.fallback_rows == 2
    fp32 = OldLogprobScorer(model, "fp32_clone").score(ids, mask, T, kept=settings, compare_policy=True)
    alone = OldLogprobScorer(model, "fp16_clone").score(ids[[1, 3]], mask[[1, 3]], T, kept=settings,
                                                        compare_policy=True)
    assert alone.fallback_rows == 0
    # the fallback rows are the fp32 pass's, the others the fp16 pass's, on the kept sets and the full vocabulary
    torch.testing.assert_close(fp16.on_kept.logps[[0, 2]], fp32.on_kept.logps[[0, 2]], atol=1e-5, rtol=0)
    torch.testing.assert_close(fp16.on_kept.logps[[1, 3]], alone.on_kept.logps, atol=1e-6, rtol=0)
    for mixed, whole, rows in zip(fp16.full_vocab, fp32.full_vocab, alone.full_vocab, strict=True):
        torch.testing.assert_close(mixed[[0, 2]], whole[[0, 2]], atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(mixed[[1, 3]], rows, atol=1e-6, rtol=1e-4)
    assert torch.isfinite(fp16.on_kept.log_mass).all() and (fp16.on_kept.log_mass <= 1e-6).all()


@pytest.mark.parametrize("mode,layers,match", [
    ("fp64", None, "allowed: bf16, fp32_clone, fp16_clone, fp32_head, guided_fp32"),
    ("guided_fp32", None, "needs guided_fp32_layers"),
    ("guided_fp32", [2], r"allowed indices 0\.\.1"),
    ("fp32_head", [0], "only used by 'guided_fp32'"),
])
def test_bad_scorer_arguments(mode, layers, match):
    with pytest.raises(ValueError, match=match):
        OldLogprobScorer(tiny_model("qwen2"), mode, layers=layers)


FP32_REFUSING = "bf16_only_test_attention"  # an attention with flash-attn's dtype contract (fp16/bf16 only)
attention_dtypes = []


def _bf16_only_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    device = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device):  # as transformers' flash_attention_forward
        query, key, value = (x.to(torch.get_autocast_dtype(device)) for x in (query, key, value))
    attention_dtypes.append(query.dtype)
    if query.dtype == torch.float32:
        raise RuntimeError("FlashAttention only supports fp16 and bf16 data type")
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_the_compared_policy_pass_computes_as_the_training_forward():
    # ratio_full_vocab's "policy as trained" pass ran inside the mode's IEEE fp32 / sdpa block: its matmuls were IEEE
    # and its attention sdpa where the training forward runs TF32 and its flash kernel; now the run's own settings
    from transformers import AttentionInterface, AutoModelForCausalLM

    from grpo_ratio.old_pass import forward
    from grpo_ratio.testing import tiny_config

    AttentionInterface.register(FP32_REFUSING, _bf16_only_attention)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation=FP32_REFUSING)
    ids, mask = _batch()
    saved = torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision
    torch.backends.fp32_precision = "tf32"  # as transformers' `tf32=True` leaves it
    layers, heads, project = [], [], forward.HeadProjection.logits
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda *a: layers.append(torch.backends.cuda.matmul.fp32_precision))

    def spy(self, x):
        heads.append(torch.backends.cuda.matmul.fp32_precision)
        return project(self, x)

    forward.HeadProjection.logits = spy
    attention_dtypes.clear()
    try:
        result = OldLogprobScorer(model, "fp32_clone").score(ids, mask, T, batch_size=2, compare_policy=True)
    finally:
        hook.remove()
        forward.HeadProjection.logits = project
        torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = saved
    assert layers == ["ieee", "tf32"] * 2  # per chunk: the mode's fp32 pass, then the policy's as it trains
    assert set(heads) == {"ieee", "tf32"}  # both projections, computed lazily, each under its own settings
    assert attention_dtypes == [torch.bfloat16] * 2 * 2  # the compared pass (2 layers x 2 chunks) on the run's kernel
    assert model.config._attn_implementation == FP32_REFUSING
    assert all(torch.isfinite(t).all() for t in result.full_vocab)
