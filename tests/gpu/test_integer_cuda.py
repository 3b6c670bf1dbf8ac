"""The integer forward on CUDA (`torch._int_mm`) against the CPU reference, bit for bit (issue 42; DetLLM's
cross-device check: N. Barry, "Eliminating Nondeterminism in LLM Inference with Integer-Only Arithmetic").

Marked `gpu`, skipped without CUDA; `bash scripts/gpu_check.sh` runs it with the rest of the GPU check; alone:

    pytest -m gpu tests/gpu/test_integer_cuda.py -q

What only a GPU shows: cuBLASLt's int8 GEMM (zero-padded to its shape rules) returning the exact integers of the CPU
int32 matmul, and every other integer kernel (shifts, integer division, sort, cumsum) agreeing across devices, so the
int32 logits, the greedy tokens, the sampled tokens and their fixed-point log-probs are the CPU's.
"""

import copy
import random

import pytest
import torch

from grpo_ratio.integer import convert
from grpo_ratio.integer.arith import int_mm
from grpo_ratio.integer.sample import IntSampling, generate, left_pad, score
from grpo_ratio.testing import tiny_model


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _prompts(n, seed=0, low=3, high=40):
    g = random.Random(seed)
    return [[g.randrange(3, 300) for _ in range(g.randrange(low, high))] for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def models(request):
    fm = tiny_model(request.param).eval()
    cpu = convert(fm, [torch.tensor(p) for p in _prompts(4, seed=9, low=16)], max_positions=2048)
    return cpu, copy.deepcopy(cpu).to("cuda")


def test_the_cuda_int8_gemm_is_exact_at_its_bound():
    K = 4096
    a = torch.full((3, K), 127, dtype=torch.int8)
    a[1] = -127
    b = torch.full((K, 5), 127, dtype=torch.int8)
    got = int_mm(a.cuda(), b.cuda()).cpu()
    assert got[:, 0].tolist() == [K * 127 * 127, -K * 127 * 127, K * 127 * 127]
    g = torch.Generator().manual_seed(0)
    for a_shape, n in [((1, 64), 9), ((5, 333), 7), ((40, 576), 1536), ((2, 3, 17, 64), 33)]:
        a = torch.randint(-127, 128, a_shape, generator=g, dtype=torch.int8)
        b = torch.randint(-127, 128, (a_shape[-1], n), generator=g, dtype=torch.int8)
        assert torch.equal(int_mm(a.cuda(), b.cuda()).cpu(), int_mm(a, b))


def test_cuda_logits_equal_the_cpu_reference(models):
    cpu, cuda = models
    ids, valid = left_pad(_prompts(8, seed=1), 0)
    assert torch.equal(cuda(ids.cuda(), valid.cuda()).cpu(), cpu(ids, valid))


def test_on_cuda_a_prompt_alone_equals_it_in_a_batch_of_32(models):
    cpu, cuda = models
    target = _prompts(1, seed=2, low=10, high=12)[0]
    ids, valid = left_pad([target], 0)
    alone = cuda(ids.cuda(), valid.cuda())[0]
    rows = _prompts(16, seed=3) + [target] + _prompts(15, seed=4)
    ids, valid = left_pad(rows, 0)
    assert torch.equal(cuda(ids.cuda(), valid.cuda())[16, -len(target):], alone)
    assert torch.equal(alone.cpu(), cpu(*left_pad([target], 0))[0])


def test_cuda_prefill_equals_token_by_token(models):
    _, cuda = models
    prompt = _prompts(1, seed=5, low=24, high=25)[0]
    full = cuda(torch.tensor([prompt]).cuda())[0]
    cache = cuda.new_cache(1)
    steps = torch.cat([cuda(torch.tensor([[t]]).cuda(), None, cache)[0] for t in prompt])
    assert torch.equal(steps, full)


def test_cuda_samples_and_old_pass_equal_the_cpus(models):
    cpu, cuda = models
    s = IntSampling(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    rows = _prompts(4, seed=6)
    a = generate(cpu, rows, 16, s, eos_token_id=1)
    b = generate(cuda, rows, 16, s, eos_token_id=1)
    assert torch.equal(a.tokens, b.tokens.cpu()) and torch.equal(a.logprobs, b.logprobs.cpu())
    old = score(cuda, rows[::-1], b.tokens.flip(0), b.lengths.flip(0), s)
    assert torch.equal(old.cpu(), a.logprobs.flip(0))


def test_a_2k_context_on_cuda_equals_cpu(models):
    cpu, cuda = models
    prompt = [random.Random(8).randrange(3, 300) for _ in range(2047)]
    ids = torch.tensor([prompt])
    last = torch.tensor([[2046]])
    assert torch.equal(cuda(ids.cuda(), None, logits_at=last.cuda()).cpu(), cpu(ids, None, logits_at=last))
