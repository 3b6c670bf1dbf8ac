"""State on the tensors' device (issue 31, item 2), on a CPU-only machine: the accumulators, masks, kept sets and
copies of grpo_ratio live on the device of the tensors they meet, and the per-token paths keep host syncs off the hot
path. CUDA tensors are `FakeTensorMode`'s (tests/fake_cuda.py): devices are checked as CUDA checks them, and what
would sync the host raises (`HOST_SYNC`, `HostCopy`).

Run: pytest tests/test_device.py
"""

from __future__ import annotations

import pytest
import torch
from fake_cuda import CUDA, HOST_SYNC, HostCopy, fake_cuda
from transformers import AutoModelForCausalLM

from grpo_ratio.corrections.kept_sets import KeptSets


# ---------------------------------------------------------------------------------------------------------------------
# the helper itself: what it must catch


def test_fake_cuda_raises_where_cuda_raises():
    with fake_cuda():
        cuda = torch.ones(3, device=CUDA)
        with pytest.raises(RuntimeError):
            torch.zeros((), dtype=torch.float64).add_(cuda.sum())  # cpu0d += cuda, the diagnostics' crash
        with pytest.raises(RuntimeError):
            cuda + torch.ones(3)  # a CPU tensor of more than 0 dims meets a CUDA one
        assert (cuda.sum() + torch.zeros((), dtype=torch.float64)).device == CUDA  # a 0-d CPU scalar is allowed
        with pytest.raises(HOST_SYNC):
            int(cuda.sum())
        with pytest.raises(HOST_SYNC):
            cuda[cuda > 0]  # a data-dependent size syncs on CUDA
        assert cuda[1:].shape == (2,) and cuda[None].expand(2, 3).T.shape == (3, 2)  # indexing works without a CUDA build
    with fake_cuda(allow_host_copies=False):
        with pytest.raises(HostCopy):
            torch.ones(3, device=CUDA).cpu()


# ---------------------------------------------------------------------------------------------------------------------
# diagnostics


def _corrected_diagnostics(tmp_path):
    """RatioDiagnostics of a run with `lift_sampler` on recomputed kept sets (kept mass and additions logged), on a
    fake CUDA accelerator, and one first-inner-step micro-batch on CUDA with every key the diagnostics read (tool
    mask, IS weights, full-vocabulary divergences)."""
    from trainer_fixtures import config_plan, tiny_grpo_args

    from grpo_ratio.diagnostics.ratio_diagnostics import RatioDiagnostics
    from grpo_ratio.records import MicroBatchRecord

    args = tiny_grpo_args(tmp_path, top_p=0.8, truncation_correction="lift_sampler", kept_set_source="recompute")
    plan = config_plan(args)
    assert plan.corrects and plan.recomputes_kept_sets
    accelerator = type("Acc", (), {"num_processes": 1, "device": CUDA})()
    diag = RatioDiagnostics(args, accelerator=accelerator, eos_token_ids=[1], plan=plan)
    B, T = 2, 3
    inputs = {"completion_ids": torch.full((B, T), 5, device=CUDA), "completion_mask": torch.ones(B, T, device=CUDA),
              "advantages": torch.ones(B, device=CUDA), "old_per_token_logps": torch.zeros(B, T, device=CUDA),
              "sampling_per_token_logps": torch.zeros(B, T, device=CUDA), "tool_mask": torch.ones(B, T, device=CUDA),
              "importance_sampling_ratio": torch.ones(B, 1, device=CUDA)}
    inputs |= {key: torch.zeros(B, T, device=CUDA) for key in ("full_vocab_kl", "full_vocab_reverse_kl", "full_vocab_tv")}
    micro_batch = MicroBatchRecord(inputs=inputs, train_logps=torch.zeros(B, T, device=CUDA),
                                   old_log_kept_mass=torch.zeros(B, T, device=CUDA),
                                   kept_added=torch.zeros(B, T, dtype=torch.bool, device=CUDA))
    return diag, micro_batch


def test_ratio_diagnostics_accumulate_on_the_tensors_device(tmp_path):
    # was: kept_mass_sum/count created on the CPU, then `cpu0d += cuda` at the first update of any GPU run with a
    # truncation correction
    with fake_cuda(data_dependent=True):
        diag, micro_batch = _corrected_diagnostics(tmp_path)
        diag.update(micro_batch, mode_is_policy=False)
        assert diag.kept_mass.total.device == CUDA and diag.kept_set_added.total.device == CUDA
        assert diag.flips is not None and diag.is_stats is not None  # every branch of `update` ran


def test_ratio_diagnostics_update_copies_nothing_to_the_host(tmp_path):
    # was: the recomputed kept sets' additions were counted with `.cpu()` at every micro-batch
    with fake_cuda(data_dependent=True, allow_host_copies=False):
        diag, micro_batch = _corrected_diagnostics(tmp_path)
        diag.update(micro_batch, mode_is_policy=False)


def test_mean_stats_sums_on_the_values_device_and_merges_exactly():
    from grpo_ratio.diagnostics.ratios import MeanStats

    values, mask = torch.tensor([[0.5, 0.25, 7.0]]), torch.tensor([[True, True, False]])
    whole = MeanStats().update(values, mask)
    split = MeanStats().update(values[:, :1], mask[:, :1]).merge(MeanStats().update(values[:, 1:], mask[:, 1:]))
    assert whole.mean() == split.mean() == 0.375
    assert MeanStats().mean() is None  # no valid token: no metric
    with fake_cuda():
        assert MeanStats().update(torch.ones(2, 3, device=CUDA), torch.ones(2, 3, device=CUDA)).total.device == CUDA


# ---------------------------------------------------------------------------------------------------------------------
# kept sets


def _kept_on(device) -> KeptSets:
    """Kept sets of 2 rows x 3 steps, one id per cell, on `device` (built inside `fake_cuda` for CUDA)."""
    from grpo_ratio.corrections.kept_sets import KeptSets, offsets_from_sizes

    sizes = torch.ones(2, 3, dtype=torch.int32, device=device)
    return KeptSets(sizes, torch.arange(6, dtype=torch.int32, device=device) % 4, offsets_from_sizes(sizes))


def test_kept_sets_on_the_device_are_built_and_resized_without_a_host_sync():
    # was: `int(offsets[-1])` at every construction (every chunk and micro-batch), and a resize to the same length
    # (every `_kept_rows`) rebuilt the ids through a data-dependent gather
    with fake_cuda():
        kept = _kept_on(CUDA)
        assert kept.resize_steps(3).sizes.device == CUDA
        assert kept.size_only().resize_steps(5).sizes.shape == (2, 5)


def test_dense_cells_are_built_on_the_device_of_the_cells():
    # was: the (K, V) mask was built on the kept sets' device (the CPU for vLLM's masks and recomputed sets) and
    # copied up per chunk: K x V bytes of host traffic instead of the selected ids' 4 bytes each
    kept = _kept_on("cpu")
    expected = kept.dense_cells(torch.arange(3), 5)
    with fake_cuda(data_dependent=True):
        keep = kept.dense_cells(torch.arange(3, device=CUDA), 5)
        assert keep.device == CUDA and keep.shape == (3, 5)
    assert torch.equal(kept.to_dense(5)[0], expected)  # the CPU path is unchanged


def test_kept_sets_from_lists_land_on_the_asked_device():
    from grpo_ratio.corrections.kept_sets import KeptSets

    rows = [[[1, 2], [3]], [[0]]]
    on_cpu = KeptSets.from_lists(rows, num_steps=3)
    assert on_cpu.sizes.tolist() == [[2, 1, 0], [1, 0, 0]] and on_cpu.ids.tolist() == [1, 2, 3, 0]
    with fake_cuda():
        on_cuda = KeptSets.from_lists(rows, num_steps=3, device=CUDA)
        assert {on_cuda.sizes.device, on_cuda.ids.device, on_cuda.offsets.device} == {CUDA}


def test_vllm_kept_sets_land_on_the_trainer_device():
    # was: vLLM's sampling masks became CPU kept sets, densified on the CPU and copied up per chunk of every pass
    from fixtures_vllm import RequestOutput, completion

    from grpo_ratio.sampler.vllm import VLLMOutputCapture

    outputs = [RequestOutput("0", None, [1, 2], None, [completion(0, [5, 6], [[5, 7], [6]], csr=True),
                                                       completion(1, [7], [[7]])], True)]
    llm = type("LLM", (), {"generate": lambda self, *a, **k: outputs})()
    capture = VLLMOutputCapture(llm, device=CUDA)
    llm.generate()
    with fake_cuda():
        kept = capture.kept_sets(2)
        assert {kept.sizes.device, kept.ids.device, kept.offsets.device} == {CUDA}


@pytest.mark.parametrize("support_size_only", [False, True])
@pytest.mark.parametrize("steps", [2, 0])
def test_generate_recording_stays_on_the_scores_device(support_size_only, steps):
    # was: a recording of no step (every completion empty) came back on the CPU while its scores were on the GPU
    from grpo_ratio.sampler.generate import SamplerLogprobRecorder, finalize_from_completions

    with fake_cuda(data_dependent=True, allow_host_copies=False):
        recorder = SamplerLogprobRecorder(support_size_only=support_size_only)
        recorder.attached = True  # as `recording_sampler` sets it
        input_ids = torch.zeros(2, 3, dtype=torch.long, device=CUDA)
        for _ in range(max(steps, 1)):
            recorder(input_ids, torch.zeros(2, 7, device=CUDA))
            input_ids = torch.cat([input_ids, torch.zeros(2, 1, dtype=torch.long, device=CUDA)], 1)
        record = finalize_from_completions(recorder, [[1] * steps, [1] * max(steps - 1, 0)], pad_token_id=0)
        assert record.logprobs.device == CUDA and record.kept.sizes.device == CUDA


# ---------------------------------------------------------------------------------------------------------------------
# MoE routing hooks


def test_route_hooks_fingerprint_checkpointed_forwards_without_a_host_sync():
    # was: `float(hidden.double().sum())` in every MoE layer of every checkpointed forward: a host sync per layer
    from grpo_ratio.routing import RouteHooks
    from grpo_ratio.testing import tiny_model

    model = tiny_model("qwen3_moe").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hooks = RouteHooks(model)
    layout, rows, positions = hooks.layout, 1, 4
    layer = layout.moe_layers[0]
    n, k = rows * positions, layout.top_k
    with fake_cuda(), hooks.recording():
        hooks._on_forward(None, (), {"input_ids": torch.zeros(rows, positions, dtype=torch.long, device=CUDA)})
        output = (torch.zeros(n, layout.num_experts, device=CUDA), torch.zeros(n, k, device=CUDA),
                  torch.zeros(n, k, dtype=torch.long, device=CUDA))
        hooks._on_router(layer, layout.routers[layer], torch.zeros(n, model.config.hidden_size, device=CUDA), output)
        assert len(hooks._pending[layer]) == 1  # kept for the recompute, fingerprint and all, on the device


# ---------------------------------------------------------------------------------------------------------------------
# whole-model copies


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor an op returns, as (device type, dtype, numel)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.seen.append((t.device.type, t.dtype, t.numel()))
        return out


def test_a_whole_model_copy_is_built_on_its_device_in_its_dtype():
    # was: built on the CPU in fp32 from the config, then moved and cast (a 7B copy: 28 GB of host RAM per rank)
    from grpo_ratio.old_pass.copies import ModuleCopy
    from grpo_ratio.testing import tiny_config

    with torch.device("meta"):  # a policy on a device that is not the host
        policy = AutoModelForCausalLM.from_config(tiny_config("qwen2", tie_word_embeddings=True), dtype=torch.bfloat16)
    smallest_weight = min(p.numel() for p in policy.parameters() if p.dim() == 2)  # 64 x 64
    with _Allocations() as allocations:
        copy = ModuleCopy(policy, torch.float16, whole_model=True).module
    on_host = [a for a in allocations.seen if a[0] == "cpu" and a[2] >= smallest_weight]
    assert on_host == []  # only the rotary tables (32 values) are computed on the host
    assert {(p.device.type, p.dtype) for p in copy.parameters()} == {("meta", torch.float16)}
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # the tied head stays one tensor


# ---------------------------------------------------------------------------------------------------------------------
# kept-set log-probs: host syncs per call, not per chunk


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts what reads a tensor's value on the host (`bool`, `int`, `float`, `.item()`, `.tolist()`): each is a
    host sync on an accelerator."""

    READS = {torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
             torch.Tensor.item, torch.Tensor.tolist}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in self.READS
        return func(*args, **(kwargs or {}))


def _kept_set_inputs(B=3, T=8, V=50, top_k=5):
    """Logits (B, T, V), sampled tokens (B, T) inside their top-k sets, and those sets."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=g)
    keep = torch.zeros(B, T, V, dtype=torch.bool).scatter_(2, logits.topk(top_k, dim=-1).indices, True)
    tokens = logits.topk(top_k, dim=-1).indices[..., 2]  # (B, T) the third-likeliest token: inside every set
    return logits, tokens, KeptSets.from_mask(keep)


@pytest.mark.parametrize("support_size_only", [False, True])
def test_kept_set_logprobs_read_the_host_once_per_call_not_per_chunk(support_size_only):
    # was: the empty-cell check, the inconsistent-rollout check and (support size) the widest set read per chunk of
    # cells: 24 chunks of one cell made 48-72 host syncs where one chunk made 2-3
    from grpo_ratio.corrections.kept_logprobs import kept_set_logprobs

    logits, tokens, kept = _kept_set_inputs()
    kept = kept.size_only() if support_size_only else kept
    counts, values = [], []
    for chunk_cells in (1, 1000):  # 24 chunks, then one
        with HostReads() as reads:
            values.append(kept_set_logprobs(logits, tokens, kept, chunk_cells=chunk_cells))
        counts.append(reads.count)
    assert counts[0] == counts[1] <= 3, counts
    torch.testing.assert_close(values[0], values[1], rtol=0, atol=1e-6)


def test_recomputed_kept_sets_are_built_on_the_logits_device():
    # was: sizes, ids and additions written to host tensors chunk by chunk (`.cpu()` three times per chunk), then
    # copied up again for every pass that reads them. The chunking splits cells by a data-dependent count, which fake
    # tensors cannot follow: counted on the CPU instead, every `.cpu()` asked for
    from grpo_ratio.corrections.kept_logprobs import recompute_kept_sets
    from grpo_ratio.corrections.kept_sets import SamplingSettings

    class ToHost(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.Tensor.cpu  # (`.to(device)` follows the logits' device: the CPU here)
            return func(*args, **(kwargs or {}))

    logits, tokens, expected = _kept_set_inputs()
    with ToHost() as to_host:
        sets, added = recompute_kept_sets(logits, tokens, SamplingSettings(top_k=5), chunk_cells=7)  # 4 chunks
    assert to_host.count == 0
    assert sets == expected and not added.any()  # the top-5 sets, every sampled token inside its set


# ---------------------------------------------------------------------------------------------------------------------
# the asynchronous trainer's per-micro-batch paths


def test_staleness_stats_update_without_a_host_sync():
    # was: `bucket[known]`, `columns[known]`: a data-dependent size, one host sync per micro-batch
    from grpo_ratio.diagnostics.staleness import StalenessStats

    with fake_cuda():
        stats = StalenessStats(3, (0.9, 1.1), 0.2, 0.2, decoupled=True)
        m = 6
        stats.update(torch.tensor([0, -1, 1, 2, 5, 0], device=CUDA), torch.zeros(m, device=CUDA),
                     torch.zeros(m, device=CUDA), torch.zeros(m, device=CUDA), torch.ones(m, device=CUDA),
                     torch.ones(m, device=CUDA))
        assert stats.sums.device == CUDA


def test_loglinear_alpha_on_an_accelerator_neither_syncs_nor_asserts(monkeypatch):
    # was: `torch._assert_async` on an untagged term: a device-side assert leaves the CUDA context unusable
    from grpo_ratio.corrections.decoupled import loglinear_alpha

    def refuse(*args, **kwargs):
        raise AssertionError("a device-side assertion")

    monkeypatch.setattr(torch, "_assert_async", refuse)
    with fake_cuda():
        alpha = loglinear_alpha(torch.tensor([0, 1, -1], device=CUDA))
        assert alpha.device == CUDA and alpha.shape == (3,)
    # on the CPU the host check costs nothing: a clean error there
    with pytest.raises(ValueError, match="no staleness"):
        loglinear_alpha(torch.tensor([0, 1, -1]))
