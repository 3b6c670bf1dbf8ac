"""The integer forward's zero-tolerance suite (after DetLLM's: N. Barry, "Eliminating Nondeterminism in LLM Inference
with Integer-Only Arithmetic"): every check compares full int32 logits and token ids with `torch.equal`, never a
tolerance; the float model is the control that differs. Plus the integer arithmetic against exact references, the
float guard, and the batch-independent integer sampler with its exact old pass. Tiny real transformers models.

Run: pytest tests/test_integer.py
"""

import functools
import math
import random

import pytest
import torch

from grpo_ratio.integer import FloatInForwardError, NoFloatMode, arith, convert
from grpo_ratio.integer import model as int_model_module
from grpo_ratio.integer.sample import IntSampling, draw, generate, left_pad, score, token_logprobs
from grpo_ratio.testing import tiny_model


V = 300


def _prompts(n, low=4, high=24, seed=0):
    g = random.Random(seed)
    return [[g.randrange(3, V) for _ in range(g.randrange(low, high))] for _ in range(n)]


@functools.cache
def _build(arch):
    """(float model, integer model) of one tiny family; Llama's config gets SmolLM2's rope theta."""
    extra = {"rope_theta": 100000.0} if arch == "llama" else {}
    float_model = tiny_model(arch, max_position_embeddings=4608, **extra).eval()
    calib = [torch.tensor(p) for p in _prompts(4, 16, 32, seed=99)]
    return float_model, convert(float_model, calib, max_positions=4608)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def pair(request):
    return _build(request.param)


@pytest.fixture
def llama():
    return _build("llama")


def _alone(int_model, prompt):
    ids, valid = left_pad([prompt], 0)
    return int_model(ids, valid)[0]  # (T, V)


# ---------------------------------------------------------------------------------------------------------------------
# arithmetic


def test_one_rounding_rule_ties_away_from_zero():
    x = torch.tensor([5, -5, 6, -6, 7, -7, 4, -4])
    assert arith.shift_round(x, 1).tolist() == [3, -3, 3, -3, 4, -4, 2, -2]
    assert arith.div_round(torch.tensor([7, -7, 5, -5]), 2).tolist() == [4, -4, 3, -3]
    assert arith.shift_round(torch.tensor([3, -3]), torch.tensor([-2, 1])).tolist() == [12, -2]


def test_integer_sqrt_log2_and_exp_against_exact_references():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 1 << 62, (2000,), generator=g)
    assert arith.isqrt(x).tolist() == [math.isqrt(v) for v in x.tolist()]
    assert arith.ilog2(x.clamp(min=1)).tolist() == [max(v, 1).bit_length() - 1 for v in x.tolist()]
    y = torch.randint(1, 1 << 40, (500,), generator=g)
    err = [(a / 2 ** 16 - math.log2(v)) for a, v in zip(arith.log2_fixed(y).tolist(), y.tolist())]
    assert max(abs(e) for e in err) < 3e-5  # 16 truncated fraction bits
    z = torch.randint(0, 20 << 16, (2000,), generator=g)
    got = [e / 2 ** 30 for e in arith.exp2_neg(z).tolist()]
    rel = [abs(a / 2 ** -(v / 2 ** 16) - 1) for a, v in zip(got, z.tolist()) if v < (12 << 16)]
    assert max(rel) < 2e-4


def test_the_gemm_is_exact_at_its_bound():
    """|sum| <= K * 127^2 < 2^31: the worst case (all +-127) and random operands equal Python's exact integers."""
    K = 4096
    a = torch.full((3, K), 127, dtype=torch.int8)
    a[1] = -127
    b = torch.full((K, 5), 127, dtype=torch.int8)
    assert arith.int_mm(a, b)[:, 0].tolist() == [K * 127 * 127, -K * 127 * 127, K * 127 * 127]
    g = torch.Generator().manual_seed(1)
    a = torch.randint(-127, 128, (7, 333), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (333, 9), generator=g, dtype=torch.int8)
    exact = [[sum(int(a[i, t]) * int(b[t, j]) for t in range(333)) for j in range(9)] for i in range(7)]
    assert arith.int_mm(a, b).tolist() == exact
    with pytest.raises(TypeError, match="int8"):
        arith.int_mm(a.to(torch.int32), b)


# ---------------------------------------------------------------------------------------------------------------------
# the guard and the artifact


def test_the_artifact_holds_integers_only(pair):
    _, im = pair
    tensors = [im.embed, im.embed_m, im.embed_k, im.cos, im.sin, im.head.w, im.head.m]
    for layer in im.layers:
        for lin in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down):
            tensors += [lin.w, lin.m] + ([lin.bias] if lin.bias is not None else [])
    assert tensors and all(not t.is_floating_point() for t in tensors)
    assert im.head.w.dtype == torch.int8 and im.cos.dtype == torch.int16
    assert im.info["min_weight_mantissa"] >= 1 << 8  # each channel's scale to <= 0.2%


def test_the_guard_raises_on_an_injected_float_op(llama, monkeypatch):
    _, im = llama
    with pytest.raises(FloatInForwardError, match="produced a torch.float32"):
        with NoFloatMode():
            torch.ones(2, dtype=torch.int64).float()
    real = int_model_module.silu
    monkeypatch.setattr(int_model_module, "silu", lambda g, kg: real(g, kg) + (g.double() * 0).long())
    ids, valid = left_pad(_prompts(1), 0)
    with pytest.raises(FloatInForwardError, match="float64"):
        im(ids, valid)
    out = im(ids, valid, guard=False)  # the same forward unguarded runs: the guard is what refused
    assert out.dtype == torch.int32


def test_the_integer_logits_track_the_float_model(pair):
    fm, im = pair
    ids, valid = left_pad(_prompts(3, seed=5), 0)
    got = im(ids, valid)
    assert got.dtype == torch.int32 and got.shape == (3, ids.size(1), V)
    ref = torch.log_softmax(fm(ids, attention_mask=valid.long()).logits.double(), -1)
    lp = torch.log_softmax(got.double() / 65536, -1)
    kl = (ref.exp() * (ref - lp)).sum(-1)[valid]
    assert kl.max() < 1e-3  # per-position KL(float || integer), nats


# ---------------------------------------------------------------------------------------------------------------------
# zero tolerance: the integer model's bits never move


def test_repeated_runs_are_identical(llama):
    _, im = llama
    ids, valid = left_pad(_prompts(4, seed=1), 0)
    first = im(ids, valid)
    assert all(torch.equal(first, im(ids, valid)) for _ in range(9))  # ten runs


@pytest.mark.parametrize("batch", [2, 8, 32])
def test_a_prompt_alone_equals_it_in_a_batch_of_random_co_prompts(pair, batch):
    _, im = pair
    target = _prompts(1, 10, 14, seed=7)[0]
    alone = _alone(im, target)
    co = _prompts(batch - 1, 2, 40, seed=batch)  # longer and shorter: the target is left-padded or not
    rows = co[: batch // 2] + [target] + co[batch // 2:]
    ids, valid = left_pad(rows, 0)
    got = im(ids, valid)[batch // 2, -len(target):]
    assert torch.equal(got, alone)


def test_prefill_equals_token_by_token_at_every_position(pair):
    _, im = pair
    prompt = _prompts(1, 20, 21, seed=3)[0]
    full = _alone(im, prompt)
    cache = im.new_cache(1)
    steps = torch.cat([im(torch.tensor([[t]]), None, cache)[0] for t in prompt])
    assert torch.equal(steps, full)
    cache = im.new_cache(1)  # split prefill: half at once, then token by token
    half = im(torch.tensor([prompt[:10]]), None, cache)[0]
    rest = torch.cat([im(torch.tensor([[t]]), None, cache)[0] for t in prompt[10:]])
    assert torch.equal(torch.cat([half, rest]), full)


def test_one_and_two_threads_give_the_same_bits(llama):
    _, im = llama
    ids, valid = left_pad(_prompts(8, seed=11), 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = im(ids, valid)
        torch.set_num_threads(2)
        two = im(ids, valid)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("n", [1024, pytest.param(4096, marks=pytest.mark.slow)])
def test_a_long_context(llama, n):
    """n tokens (4,096 in the slow lane): full prefill vs prefill n-1 + decode 1, and alone vs beside a shorter
    co-prompt (left-padded)."""
    _, im = llama
    prompt = [random.Random(4).randrange(3, V) for _ in range(n)]
    ids = torch.tensor([prompt])
    full = im(ids, None, logits_at=torch.tensor([[n - 1]]))[0, 0]
    cache = im.new_cache(1)
    im(ids[:, :-1], None, cache, logits_at=torch.tensor([[n - 2]]))
    assert torch.equal(im(ids[:, -1:], None, cache)[0, 0], full)
    batch, valid = left_pad([prompt, prompt[:100]], 0)
    assert torch.equal(im(batch, valid, logits_at=torch.tensor([[n - 1], [n - 1]]))[0, 0], full)


def test_greedy_tokens_alone_and_in_a_batch(llama):
    _, im = llama
    target = _prompts(1, seed=12)[0]
    greedy = IntSampling(greedy=True)
    alone = generate(im, [target], 12, greedy)
    batch = generate(im, _prompts(7, seed=13) + [target], 12, greedy, sample_index=[0] * 8)
    assert torch.equal(batch.tokens[-1], alone.tokens[0]) and torch.equal(batch.logprobs[-1], alone.logprobs[0])


# ---------------------------------------------------------------------------------------------------------------------
# the float control: the same checks move the float model's bits


def _float_configs(fm, dtype):
    """Logits of one prompt in fp32/bf16: alone, in a padded batch of 8, token by token with the cache."""
    model = fm.to(dtype)
    target = _prompts(1, 16, 17, seed=21)[0]
    with torch.no_grad():
        alone = model(torch.tensor([target])).logits[0]
        ids, valid = left_pad(_prompts(7, 2, 40, seed=22) + [target], 0)
        batch = model(ids, attention_mask=valid.long()).logits[-1, -len(target):]
        out, past = [], None
        for t in target:
            o = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            out.append(o.logits[0])
            past = o.past_key_values
        steps = torch.cat(out)
    fm.to(torch.float32)
    return alone, batch, steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_float_model_differs_where_the_integer_one_does_not(llama, dtype):
    fm, im = llama
    alone, batch, steps = _float_configs(fm, dtype)
    float_equal = [torch.equal(alone, batch), torch.equal(alone, steps)]
    assert not all(float_equal), "the float control moved no bit on this tiny model"
    target = _prompts(1, 16, 17, seed=21)[0]
    ialone = _alone(im, target)
    ids, valid = left_pad(_prompts(7, 2, 40, seed=22) + [target], 0)
    assert torch.equal(im(ids, valid)[-1, -len(target):], ialone)


# ---------------------------------------------------------------------------------------------------------------------
# the integer sampler and the exact old pass


def test_greedy_breaks_ties_toward_the_lowest_id():
    logits = torch.tensor([[5, 9, 9, 1], [7, 7, 7, 7], [0, 0, 3, 3]], dtype=torch.int32)
    assert draw(logits, IntSampling(greedy=True), torch.zeros(3, dtype=torch.int64)).tolist() == [1, 0, 2]


def test_the_draw_follows_the_distribution():
    """Frequencies of 20,000 counter-based draws from one row match its softmax (temperature 0.5) within 1.5 points;
    top_k and top_p keep exactly the expected tokens."""
    from grpo_ratio.integer.sample import row_noise

    logits = (torch.tensor([[0.0, 0.5, 1.0, -1.0, 0.2]]) * 65536).to(torch.int32)
    s = IntSampling(temperature=0.5)
    noise = row_noise(0, [1] * 20000, list(range(20000)), 0)
    toks = draw(logits.expand(20000, -1), s, noise)
    freq = torch.bincount(toks, minlength=5).double() / 20000
    assert (freq - torch.softmax(logits.double()[0] / 65536 / 0.5, -1)).abs().max() < 0.015
    kept = lambda s: set(draw(logits.expand(2000, -1), s, noise[:2000]).tolist())  # noqa: E731
    assert kept(IntSampling(top_k=2)) == {1, 2}
    assert kept(IntSampling(top_p=0.5)) == {1, 2}  # p(2) = 0.34, p(1) = 0.21: the smallest set past 0.5
    lp = token_logprobs(logits, torch.tensor([2]), IntSampling())
    assert abs(lp.item() / 65536 - torch.log_softmax(logits.double() / 65536, -1)[0, 2].item()) < 1e-4


def test_a_token_far_below_the_max_keeps_a_finite_log_prob():
    """Its mass underflows 2^-30 (a gap of 40 nats), but without truncation it is in the kept set: its log-prob is
    (l - max) - ln(sum), not the OUTSIDE sentinel (the perplexity of a real model meets such tokens)."""
    from grpo_ratio.integer.sample import OUTSIDE

    logits = torch.tensor([[0, -40 * 65536, -3 * 65536]], dtype=torch.int32)
    lp = token_logprobs(logits, torch.tensor([1]), IntSampling()).item() / 65536
    assert abs(lp - torch.log_softmax(logits.double() / 65536, -1)[0, 1].item()) < 1e-3
    assert token_logprobs(logits, torch.tensor([1]), IntSampling(top_k=2)).item() == OUTSIDE


def test_bad_sampling_settings_are_refused():
    for kwargs, field in (({"temperature": 0}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 1.5}, "top_p")):
        with pytest.raises(ValueError, match=field):
            IntSampling(**kwargs)


def test_a_rows_samples_are_the_same_alone_or_in_any_batch_and_the_old_pass_reproduces_them(llama):
    _, im = llama
    s = IntSampling(temperature=0.9, top_k=50, top_p=0.95, seed=3)
    rows = _prompts(6, seed=31)
    together = generate(im, rows, 10, s, eos_token_id=1)
    for i in (0, 4):
        alone = generate(im, [rows[i]], 10, s, sample_index=[i], eos_token_id=1)
        n = alone.tokens.size(1)
        assert torch.equal(together.tokens[i, :n], alone.tokens[0])
        assert torch.equal(together.logprobs[i, :n], alone.logprobs[0])
    # the integer old pass, on another batch composition (reversed, plus two strangers), equals the sampler's
    order = [5, 4, 3, 2, 1, 0]
    prompts = [rows[i] for i in order] + _prompts(2, seed=32)
    comps = torch.cat([together.tokens[order], torch.zeros(2, together.tokens.size(1), dtype=torch.int64)])
    lengths = torch.cat([together.lengths[order], torch.tensor([3, 1])])
    old = score(im, prompts, comps, lengths, s)[:6]
    assert torch.equal(old, together.logprobs[order])
    # a different seed or sample index draws different tokens
    other = generate(im, rows, 10, IntSampling(temperature=0.9, top_k=50, top_p=0.95, seed=4), eos_token_id=1)
    assert not torch.equal(other.tokens, together.tokens)


# ---------------------------------------------------------------------------------------------------------------------
# grpo-ratio probe determinism


def test_the_determinism_probe_gives_one_integer_hash(tmp_path):
    import json

    from grpo_ratio.cli import main

    assert main(["probe", "determinism", "--model", "tiny:llama", "--prompt", "what is 12 + 7 ? the answer is",
                 "--max-new-tokens", "3", "--batch-size", "4", "--calibration-prompts", "2",
                 "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "determinism.json").read_text())
    assert len(result["rows"]) == 7
    assert result["unique_hashes"]["int"] == 1  # every configuration, the integer paths included
    assert result["unique_hashes"]["fp32"] > 1 and result["unique_hashes"]["bf16"] > 1  # the float controls move
    table = (tmp_path / "determinism.md").read_text()
    assert "| **unique hashes** | **1** |" in table
