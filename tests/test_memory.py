"""Memory that does not scale with rows x T x V (issue 31, item 1): no head-side computation builds (rows, T, V) logits.

Measured with torch's dispatcher, no GPU needed: `Largest` records the largest storage any op creates inside a block
(outputs that alias an input, views and `out=` writes, are not allocations), and `saved_bytes` what autograd keeps for
backward. The tiles are made small here (TRL's token tile, the vocabulary tile, the kept-set chunk) so that, at the
real vocabulary V = 151,936, a tile is a few MB while the full logits of even a short batch are tens of MB: the
budget is one (`TOKENS` x V) fp32 buffer, and every check is shown to fail on the full-logits implementation it
replaces. The same code runs with TRL's tile sizes in training (benchmarks/peak_memory.py measures whole steps).

Run: pytest tests/test_memory.py
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F
import trl.kernels.chunked_logprob as trl_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import AutoModelForCausalLM, Qwen2Config

from grpo_ratio.corrections import kept_logprobs
from grpo_ratio.corrections.kept_logprobs import HeadLogits, kept_set_logprobs, recompute_kept_sets
from grpo_ratio.corrections.kept_sets import SamplingSettings
from grpo_ratio.corrections.processors import RepetitionPenalty
from grpo_ratio.modes import PRECISION_MODES
from grpo_ratio.old_pass import forward
from grpo_ratio.old_pass.kept_head import kept_set_logps_from_hidden, kept_set_logps_of_chunks
from grpo_ratio.old_pass.scorer import OldLogprobScorer, completion_logprobs_from_logits


V = 151_936  # Qwen2.5's vocabulary
H = 16  # hidden size: the head's fp32 weight (V x H) is 9.7 MB, under the budget
TOKENS = 64  # token tile here (TRL's is 4,096); the budget is one (TOKENS x V) fp32 buffer: 39 MB
BUDGET = TOKENS * V * 4


class Largest(TorchDispatchMode):
    """The largest storage (bytes) any op creates inside the block, and which op made it."""

    def __init__(self):
        super().__init__()
        self.bytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                if t.untyped_storage().nbytes() > self.bytes:
                    self.bytes, self.op = t.untyped_storage().nbytes(), f"{func} {tuple(t.shape)} {t.dtype}"
        return out


def saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """(bytes of the distinct storages autograd saves for backward while `fn()` runs, its output)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(storages.values()), out


@pytest.fixture
def small_tiles(monkeypatch):
    """TRL's kernel on (TOKENS x 16,384) tiles and kept-set chunks of 16 cells, instead of 4,096 x 32,768 and 1,024."""
    monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", TOKENS)
    monkeypatch.setattr(forward, "VOCAB_TILE", 16384)
    monkeypatch.setattr(kept_logprobs, "DEFAULT_CHUNK_CELLS", 16)


def real_vocab_model(dtype=torch.float32):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, pad_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config).to(dtype)


def batch(rows: int, T: int, P: int = 8):
    g = torch.Generator().manual_seed(rows * 1000 + T)
    ids = torch.randint(2, V, (rows, P + T), generator=g)  # (rows, P+T)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded prompt
    return ids, mask


def largest(fn) -> Largest:
    with torch.no_grad(), Largest() as seen:
        fn()
    return seen


@pytest.mark.parametrize("mode", PRECISION_MODES)
def test_old_pass_allocates_one_tile_whatever_rows_and_length(small_tiles, mode):
    model = real_vocab_model()
    scorer = OldLogprobScorer(model, mode, layers=[0] if mode == "guided_fp32" else None)
    scorer.score(*batch(2, 4), 4)  # copies (fp16_clone) built here, outside the measure
    sizes = {}
    for rows, T in ((2, 64), (2, 256), (8, 64)):
        ids, mask = batch(rows, T)
        sizes[rows, T] = largest(lambda: scorer.score(ids, mask, T, batch_size=2))
    assert len({s.bytes for s in sizes.values()}) == 1, {k: s.op for k, s in sizes.items()}  # not with rows, not with T
    assert sizes[2, 64].bytes <= BUDGET, sizes[2, 64].op
    # the full-logits implementation it replaces: (rows, T + 1, V) fp32 logits of one chunk, over budget at once
    ids, mask = batch(2, 64)
    old = largest(lambda: completion_logprobs_from_logits(
        model(input_ids=ids, attention_mask=mask, logits_to_keep=65).logits, ids[:, -64:], 1.0))
    assert old.bytes >= 2 * 65 * V * 4 > BUDGET


def test_kept_sets_and_divergences_of_the_old_pass_do_not_grow(small_tiles):
    # renormalize's kept sets recomputed by top_k from the pass's logits, K = 16 cells at a time; the full-vocabulary
    # divergences (ratio_full_vocab) 128 tokens at a time in fp64, the policy's logits projected per chunk too
    model = real_vocab_model()
    scorer = OldLogprobScorer(model, "fp32_clone")
    kept, full = {}, {}
    for rows, T in ((2, 64), (2, 256)):
        ids, mask = batch(rows, T)
        kept[T] = largest(lambda: scorer.score(ids, mask, T, kept=SamplingSettings(top_k=50)))
        full[T] = largest(lambda: scorer.score(ids, mask, T, compare_policy=True))
    assert kept[64].bytes == kept[256].bytes <= BUDGET, (kept[64].op, kept[256].op)
    assert full[64].bytes == full[256].bytes == 128 * V * 8, (full[64].op, full[256].op)  # one fp64 chunk


def test_fused_head_allocates_one_tile(small_tiles):
    # fp32_head's old log-probs from the training forward's final-norm input: the fp32 norm and head in tiles
    model = real_vocab_model()
    scorer = OldLogprobScorer(model, "fp32_head")
    seen = {}
    for T in (64, 256):
        hidden = torch.randn(2, 8 + T, H)  # (b, P+T, H) the norm's input
        completion = torch.randint(0, V, (2, T))
        seen[T] = largest(lambda: scorer.head_logprobs(hidden, completion))
    assert seen[64].bytes == seen[256].bytes <= BUDGET, seen[256].op


def _kept_problem(rows=3, T=40, vocab=V, hidden=H, seed=0):
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(rows, T, hidden, generator=g, requires_grad=True)  # (B, T, H)
    head = torch.nn.Linear(hidden, vocab)
    ids = torch.randint(0, vocab, (rows, 8 + T), generator=g)  # (B, P+T)
    with torch.no_grad():
        kept, _ = recompute_kept_sets(F.linear(states, head.weight, head.bias), ids[:, -T:], SamplingSettings(top_k=20))
    return states, head, ids, kept


def test_kept_set_logprobs_under_autograd_keep_no_chunk_for_backward():
    # renormalize's training-forward log-probs over S: what autograd keeps is the hidden states and the head's
    # parameters, whatever the number of chunks; the differentiable full-logits version kept a (K, V) fp32 copy per
    # chunk (and the (B, T, V) logits themselves)
    states, head, ids, kept = _kept_problem()
    T = states.size(1)
    params = (head.weight, head.bias)
    floor = states.numel() * 4 + sum(p.numel() * 4 for p in params)  # hidden states + the head: kept in any case

    def ours(chunk_cells):
        logits = HeadLogits(states, lambda h, w, b: F.linear(h, w, b), V, params)
        return kept_set_logprobs(logits, ids[:, -T:], kept, 0.7, chunk_cells=chunk_cells)

    small, a = saved_bytes(lambda: ours(4))
    large, b = saved_bytes(lambda: ours(64))
    assert small <= 1.1 * floor and large <= 1.1 * floor  # the same few tensors for 30 chunks or 2
    old, c = saved_bytes(lambda: kept_set_logprobs(F.linear(states, *params), ids[:, -T:], kept, 0.7, chunk_cells=4))
    assert old > states.size(0) * T * V * 4 > 1.1 * floor
    torch.testing.assert_close(a, c, atol=1e-5, rtol=0)
    torch.testing.assert_close(b, c, atol=1e-5, rtol=0)


@pytest.mark.parametrize("penalty", [None, 1.3])
@pytest.mark.parametrize("chunk_cells", [1, 7, 1024])
def test_recomputed_chunks_give_the_same_values_and_gradients(penalty, chunk_cells):
    # literal small tensors: values and gradients (hidden states, weight, bias) of the recomputing autograd function
    # against autograd through the materialised logits, with the repetition penalty and a masked cell
    states, head, ids, kept = _kept_problem(vocab=50, hidden=8)
    T = states.size(1)
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[1, 30:] = False
    rep = None if penalty is None else RepetitionPenalty(penalty, ids, torch.ones_like(ids))
    params = (head.weight, head.bias)
    expected = kept_set_logprobs(F.linear(states, *params), ids[:, -T:], kept, 0.7, mask, chunk_cells, rep)
    logits = HeadLogits(states, lambda h, w, b: F.linear(h, w, b), 50, params)
    got = kept_set_logprobs(logits, ids[:, -T:], kept, 0.7, mask, chunk_cells, rep)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    weights = torch.randn(3, T)  # a loss that weighs every cell differently
    for a, b in zip(torch.autograd.grad((got * weights).sum(), (states, *params)),
                    torch.autograd.grad((expected * weights).sum(), (states, *params)), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_no_valid_cell_still_reaches_every_parameter():
    # an all-masked micro-batch (mask_truncated_completions): value 0, a zero gradient to the hidden states and head
    states, head, ids, kept = _kept_problem(vocab=50, hidden=8)
    logits = HeadLogits(states, lambda h, w, b: F.linear(h, w, b), 50, (head.weight, head.bias))
    out = kept_set_logprobs(logits, ids[:, -states.size(1):], kept, 1.0, torch.zeros(3, states.size(1), dtype=bool))
    grads = torch.autograd.grad(out.sum(), (states, head.weight, head.bias))
    assert out.abs().sum() == 0 and all(g is not None and g.abs().sum() == 0 for g in grads)


def test_trl_pass_kept_sets_chunk_by_chunk_equal_the_whole_batch():
    # the kept-set path on TRL's own pass: one captured forward chunk at a time equals the whole batch at once
    model = real_vocab_model()
    model.lm_head = torch.nn.Linear(H, 50)  # a small vocabulary, so that the reference can materialise the logits
    g = torch.Generator().manual_seed(1)
    T, hidden = 6, torch.randn(4, 14, H, generator=g)  # (B, P+T, H): what the decoder returned, P = 8
    ids = torch.randint(0, 50, (4, 14), generator=g)  # (B, P+T)
    mask = torch.ones_like(ids)
    rep = RepetitionPenalty(1.2, ids, mask)
    with torch.no_grad():
        kept, _ = recompute_kept_sets(model.lm_head(hidden[:, -T - 1:-1]), ids[:, -T:], SamplingSettings(top_k=20),
                                      penalty=rep)
    args = (0.7, False, contextlib.nullcontext, rep)
    whole = kept_set_logps_of_chunks(model, [hidden], ids, mask, T, kept, *args)
    parts = kept_set_logps_of_chunks(model, list(hidden.split([1, 3])), ids, mask, T, kept, *args)
    direct = kept_set_logps_from_hidden(model, hidden[:, -T - 1:-1], ids[:, -T:], kept, 0.7, False,
                                        contextlib.nullcontext, mask[:, -T:].bool(), rep)
    reference = kept_set_logprobs(model.lm_head(hidden[:, -T - 1:-1]), ids[:, -T:], kept, 0.7, penalty=rep)
    torch.testing.assert_close(parts.logps, whole.logps, atol=1e-6, rtol=0)
    assert torch.equal(whole.logps, direct.logps)
    torch.testing.assert_close(whole.logps, reference, atol=1e-6, rtol=0)
    recomputed = kept_set_logps_of_chunks(model, list(hidden.split([1, 3])), ids, mask, T,
                                          SamplingSettings(top_k=20), *args)  # the sets recomputed chunk by chunk
    assert torch.equal(recomputed.kept.sizes, kept.sizes) and torch.equal(recomputed.kept.ids, kept.ids)


def _rectangle_attention(q, k, v, cu_q, cu_k, scale=None, causal=True, window_size=(-1, -1), softcap=0.0):
    """The tree kernel as it was: per segment the whole (H, Lq, Lk) fp32 score rectangle (the reference here)."""
    scale = q.size(-1) ** -0.5 if scale is None else scale
    groups, out = q.size(1) // k.size(1), torch.empty_like(q)
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bq[:-1], bq[1:]), zip(bk[:-1], bk[1:])):
        qs = q[q0:q1].transpose(0, 1).float()  # (H, Lq, d)
        ks, vs = (x[k0:k1].transpose(0, 1).float().repeat_interleave(groups, dim=0) for x in (k, v))  # (H, Lk, d)
        scores = (qs @ ks.transpose(1, 2)) * scale  # (H, Lq, Lk)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        lq, lk = q1 - q0, k1 - k0
        i, j = torch.arange(lq)[:, None] + (lk - lq), torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        left, right = window_size
        if causal:
            allowed &= j <= i
        elif right >= 0:
            allowed &= j <= i + right
        if left >= 0:
            allowed &= j >= i - left
        out[q0:q1] = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ vs).transpose(0, 1).to(q.dtype)
    return out


def _tree_segments(P: int, T: int, heads=4, kv_heads=2, d=16):
    """q (P + 2T, H, d) and the gathered k, v of a prompt segment (P queries over P keys) and two completions (T
    queries over the prompt and their own T keys each), with their (4,) int32 boundaries, as TRL's tree lays them."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(P + 2 * T, heads, d, generator=g)
    k, v = (torch.randn(P + 2 * T, kv_heads, d, generator=g) for _ in range(2))
    path = torch.cat([torch.arange(P), torch.arange(P), torch.arange(P, P + T), torch.arange(P),
                      torch.arange(P + T, P + 2 * T)])  # each segment's root-to-segment keys
    cu_q = torch.tensor([0, P, P + T, P + 2 * T], dtype=torch.int32)
    cu_k = torch.tensor([0, P, 2 * P + T, 3 * P + 2 * T], dtype=torch.int32)
    return q, k[path], v[path], cu_q, cu_k


@pytest.fixture
def one_thread():
    """Intra-op threads off for the block: the tiles are many small matmuls, which a shared machine's thread
    contention slows ten-fold (the values do not depend on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(causal=False, window_size=(7, 3)),
                                    dict(causal=True, window_size=(20, 0), softcap=5.0)])
def test_tree_attention_tiles_its_queries(monkeypatch, one_thread, kwargs):
    # the fp32 tree kernel of the async proximal passes held a segment's whole (H, Lq, Lk) fp32 rectangle (two or three
    # alive: 7.9 GiB each at 28 heads, P = 1,024, T = 8,192); now (H, tile, Lk) tiles of SCORE_TILE_BYTES, same values
    from live_bytes import LiveBytes

    from grpo_ratio.old_pass import tree_attention

    monkeypatch.setattr(tree_attention, "SCORE_TILE_BYTES", 2**20)
    P = 64
    for T in (512, 2048):
        q, k, v, cu_q, cu_k = _tree_segments(P, T)
        with LiveBytes() as live:
            out = tree_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, T, P + T, **kwargs)
        torch.testing.assert_close(out, _rectangle_attention(q, k, v, cu_q, cu_k, **kwargs), atol=1e-5, rtol=0)
        # the output (q's size) plus a few tiles, whatever T (2.5 MB at T = 2,048, where the rectangles took 200 MB)
        assert live.peak <= q.nbytes + 4 * tree_attention.SCORE_TILE_BYTES
    assert live.peak < 4 * T * (P + T) * 4  # one (H, T, P + T) fp32 rectangle of a completion segment: 69 MB


def test_tree_attention_reads_the_boundaries_once_per_forward(monkeypatch):
    # every layer of a forward gets the same boundary tensors: one host read of each, not one per layer
    from grpo_ratio.old_pass import tree_attention

    q, k, v, cu_q, cu_k = _tree_segments(8, 16)
    reads, tolist = [], torch.Tensor.tolist

    def counted(self):
        reads.append(self.numel())
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    first = tree_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 16, 24, causal=True)
    for _ in range(3):  # the other layers
        assert torch.equal(tree_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 16, 24, causal=True), first)
    assert reads == [4, 4]
    cu_k[-1] -= 1  # changed in place: read again
    cu_k[-1] += 1
    tree_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 16, 24, causal=True)
    assert reads == [4, 4, 4]
    with torch.inference_mode():  # tensors without a version counter: read at every call, the same values
        cu_q, cu_k = cu_q.clone(), cu_k.clone()
    assert torch.equal(tree_attention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 16, 24, causal=True), first)
    assert reads == [4, 4, 4, 4, 4]
