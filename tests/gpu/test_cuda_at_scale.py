"""What only a GPU shows of issue 39 ("At scale, round two"), with tiny models built from their configs (no Hub, no
vLLM): `bash scripts/gpu_check.sh` runs these with the rest of the GPU check; alone:

    pytest -m gpu tests/gpu/test_cuda_at_scale.py -q        # about a minute on one H200

- item 2: the async `fp16_clone` proximal pass whose fp16 pass overflows re-runs in fp32 without handing fp32 q/k/v to
  a tree-attention kernel that takes fp16/bf16 only: TRL's real flash-attn3 kernel where it loads (`kernels` and its
  Hub cache: skipped otherwise), and a dtype-strict stand-in with that contract on CUDA.
- item 5: the fp16 fallback re-scores the overflowing rows without rebuilding whole-model copies chunk after chunk
  (copies counted).
- item 6: the fp32 tree attention of the async fp32 proximal passes allocates less than one (H, Lq, Lk) fp32 score
  rectangle per segment (`torch.cuda.max_memory_allocated`, 28 heads, 1,024 + 2,048 tokens).
- item 9: the fused `fp32_head` path (the fp32 norm and head on the training forward's hidden states) computes in IEEE
  fp32 with TF32 on: equal, bitwise, to the same call with TF32 off, where TF32 does change an fp32 head matmul.
- PEFT (LoRA) copies, an MoE policy with route diagnostics, the async trainer's decoupled objective and
  `ratio_attribution`, each 2 steps on CUDA.

Items 2, 5 and 6 test the contract of fixes made in another branch of the same issue: on a GPU they fail until those
are merged. `GPU_TESTS_DEVICE=cpu` runs the bodies on the CPU (the memory measurements skip there): what
`scripts/gpu_check.sh --dry-run` does to exercise this module without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import types

import pytest
import torch
from transformers import AutoModelForCausalLM


DEVICE = torch.device(os.environ.get("GPU_TESTS_DEVICE", "cuda"))
ON_CUDA = DEVICE.type == "cuda"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
RUN = dict(use_cpu=not ON_CUDA, per_device_train_batch_size=8, num_generations=4, max_completion_length=16)
OVERFLOW_TOKEN = 5  # its input embedding scaled so that an fp16 forward overflows on any row holding it


def _qwen2(dtype=torch.float32, overflow: bool = False, **config):
    from grpo_ratio.testing import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", **config), dtype=dtype)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    if overflow:
        with torch.no_grad():
            model.get_input_embeddings().weight[OVERFLOW_TOKEN].mul_(1e8)
    return model.to(DEVICE)


def _logged(trainer) -> list[dict]:
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 2 and all(row["loss"] == row["loss"] for row in rows)  # two steps, finite losses
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# item 2: the async fp16_clone fallback and the tree-attention kernel's dtype contract


def _fa3_kernel():
    """TRL's flash-attn3 tree kernel (`kernels-community/flash-attn3` through `kernels`), or None where it cannot load
    (no `kernels`, no Hub cache, no Hopper GPU)."""
    if not ON_CUDA or importlib.util.find_spec("kernels") is None:
        return None
    from trl.experimental.async_grpo import packing

    try:
        return packing._flash_attn()
    except Exception:  # noqa: BLE001 (offline without the kernel in the cache, an unsupported GPU: all mean "absent")
        return None


def _strict_stand_in():
    """A kernel with flash-attn3's dtype contract (fp16/bf16/fp8 only) computing grpo_ratio's portable attention."""
    from grpo_ratio.old_pass.tree_attention import flash_attn_varlen_func

    def varlen(q, k, v, *args, **kwargs):
        if torch.float32 in (q.dtype, k.dtype, v.dtype):
            raise RuntimeError("FlashAttention only supports fp16, bf16 and fp8_e4m3 data type")
        return flash_attn_varlen_func(q, k, v, *args, **kwargs)

    return types.SimpleNamespace(flash_attn_varlen_func=varlen)


def _packed_row(device):
    """TRL's collated packed row of two samples sharing a prompt, the first holding the overflowing token: the
    forward's keyword arguments as TRL's compute_loss passes them, the trained positions and their tokens."""
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for completion in ([20, 21, OVERFLOW_TOKEN, 23, 1], [20, 30, 31, 1]):
        ids = [7, 9, 12, 8] + completion
        row.add({"input_ids": torch.tensor(ids), "completion_mask": torch.tensor([0] * 4 + [1] * len(completion)),
                 "old_log_probs": torch.zeros(len(ids)), "advantage": 1.0, "group_id": 0, "metrics": {}})
    b = DataCollatorForRollout(pad_token_id=0)([[row]])
    kept, selected = b["attention_mask"].bool(), b["token_index"] >= 0
    kwargs = dict(input_ids=b["input_ids"][kept][None], position_ids=b["position_ids"][kept][None],
                  shift_labels=b["shift_labels"][kept][None], fused_lm_head=True,
                  **{k: b[k][b[k] >= 0] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")})
    kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"] = b["tree_max_seqlens"][0].tolist()
    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    positions = b["token_index"][selected].to(device)
    return kwargs, positions, kwargs["shift_labels"].flatten()[positions]


@pytest.mark.parametrize("kernel", ["flash_attn3", "strict_stand_in"])
@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_async_fp16_clone_fallback_keeps_the_tree_kernel_contract(kernel, storage, monkeypatch):
    from trl.experimental.async_grpo import packing
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention

    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    found = _fa3_kernel() if kernel == "flash_attn3" else _strict_stand_in()
    if found is None:
        pytest.skip("TRL's flash-attn3 kernel does not load here (needs `kernels` and its Hub cache, a Hopper GPU)")
    monkeypatch.setattr(packing, "_flash_attn", lambda: found)
    register_tree_attention()
    model = _qwen2(storage, overflow=True)
    model.config._attn_implementation = TREE_ATTENTION
    kwargs, positions, targets = _packed_row(DEVICE)
    logps = OldLogprobScorer(model, "fp16_clone").score_packed(kwargs, positions, targets)  # (M,)
    assert logps.shape == targets.shape and bool(torch.isfinite(logps).all())
    reference = OldLogprobScorer(model, "fp32_clone").score_packed(kwargs, positions, targets)  # the fp32 re-run
    torch.testing.assert_close(logps, reference, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# item 5: the fp16 fallback does not rebuild whole-model copies


def test_fp16_fallback_builds_each_whole_copy_at_most_once(monkeypatch):
    from grpo_ratio.old_pass import copies

    built = []
    init = copies.ModuleCopy.__init__

    def counting(self, source, dtype, *args, whole_model=False, **kwargs):
        if whole_model:
            built.append(dtype)
        init(self, source, dtype, *args, whole_model=whole_model, **kwargs)

    monkeypatch.setattr(copies.ModuleCopy, "__init__", counting)
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    model = _qwen2(torch.bfloat16, overflow=True)  # bf16-stored: fp16 and fp32 are both copies
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 300, (4, 12), generator=g)  # (B, P+T)
    ids[[0, 2], 9] = OVERFLOW_TOKEN  # rows 0 and 2 overflow in fp16
    ids = ids.to(DEVICE)
    scorer = OldLogprobScorer(model, "fp16_clone")
    result = scorer.score(ids, torch.ones_like(ids), 4, batch_size=1)  # 4 chunks, 2 overflowing
    assert bool(torch.isfinite(result.logps).all())
    assert built.count(torch.float16) <= 1 and built.count(torch.float32) <= 1, built  # was fp16, fp32, fp16, fp32, fp16
    before = len(built)
    scorer.score(ids, torch.ones_like(ids), 4, batch_size=1)  # the next generation at the same version
    assert len(built) == before, built[before:]


# ---------------------------------------------------------------------------------------------------------------------
# item 6: the fp32 tree attention's memory on CUDA


def test_fp32_tree_attention_allocates_less_than_one_score_rectangle():
    from grpo_ratio.old_pass.tree_attention import flash_attn_varlen_func

    if not ON_CUDA:
        pytest.skip("the CUDA allocator's peak is the measurement")
    H, d, P, T = 28, 128, 1024, 2048  # Qwen2.5-7B's heads; a completion segment attends to its prompt and itself
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(P + T, H, d, device=DEVICE, generator=g)  # segments: the prompt (P queries), the completion (T)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu_q = torch.tensor([0, P, P + T], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, P, P + P + T], dtype=torch.int32, device=DEVICE)
    kv = torch.cat([k[:P], k]), torch.cat([v[:P], v])  # the completion's path: prompt K/V, then its own
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = flash_attn_varlen_func(q, kv[0], kv[1], cu_q, cu_k, T, P + T, causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    rectangle = H * T * (P + T) * 4  # one fp32 (H, Lq, Lk) score tensor of the completion segment: 704 MiB
    assert extra < rectangle / 2, f"{extra / 2**20:.0f} MiB beside the output; one rectangle is {rectangle / 2**20:.0f}"
    # the values: PyTorch's attention on the completion segment (bottom-right causal: query i sees keys <= P + i)
    qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[P:], kv[0][P:], kv[1][P:]))  # (1, H, L, d)
    mask = torch.ones(T, P + T, dtype=torch.bool, device=DEVICE).tril(P)
    expected = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)[0].transpose(0, 1)
    torch.testing.assert_close(out[P:], expected, atol=2e-4, rtol=0)


# ---------------------------------------------------------------------------------------------------------------------
# item 9: the fused fp32_head path under TF32


@pytest.fixture
def restored_precision():
    saved = (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision)
    yield
    torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision = saved


def test_fused_fp32_head_is_ieee_with_tf32_on(restored_precision):
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    model = _qwen2(hidden_size=1024, intermediate_size=2048, vocab_size=4096)
    scorer = OldLogprobScorer(model, "fp32_head")
    g = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(2, 96, 1024, device=DEVICE, generator=g)  # (b, P+T, H) the final norm's input
    completion = torch.randint(0, 4096, (2, 64), device=DEVICE, generator=g)  # (b, T)
    _precision("ieee")
    ieee = scorer.head_logprobs(hidden, completion)
    head = model.lm_head.weight
    with torch.no_grad():
        ieee_logits = hidden @ head.T
        _precision("tf32")  # transformers' enable_tf32: tf32=True, or torch_compile=True with bf16
        tf32_logits = hidden @ head.T
        run_setting = (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision)
        fused = scorer.head_logprobs(hidden, completion)
    if ON_CUDA:
        assert not torch.equal(tf32_logits, ieee_logits)  # TF32 really acts on this GPU's fp32 matmuls
    assert torch.equal(fused, ieee)  # the fused path is unchanged by it
    assert (torch.backends.fp32_precision, torch.backends.cuda.matmul.fp32_precision) == run_setting  # restored


def _precision(value: str) -> None:
    torch.backends.fp32_precision = value
    torch.backends.cuda.matmul.fp32_precision = value


# ---------------------------------------------------------------------------------------------------------------------
# PEFT, MoE, the async trainer and the attribution on CUDA


@pytest.mark.parametrize("mode", ["fp32_clone", "fp16_clone", "fp32_head"])
def test_lora_copies_train_two_steps(tmp_path, mode):
    from peft import LoraConfig
    from trainer_fixtures import tiny_trainer

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = tiny_trainer(tmp_path, mode, model=_qwen2(torch.bfloat16), peft_config=lora, **RUN)
    trainer.train()
    for row in _logged(trainer):
        assert row["ratio/new_old/num_tokens"] > 0
    for copy in trainer.scorer.copies():
        assert {p.device.type for p in copy.module.parameters()} == {DEVICE.type}


def test_moe_routes_and_fp32_layers_train_two_steps(tmp_path):
    from trainer_fixtures import tiny_trainer

    from grpo_ratio.testing import tiny_model

    model = tiny_model("qwen3_moe").to(torch.bfloat16).to(DEVICE)
    trainer = tiny_trainer(tmp_path, "guided_fp32", model=model, guided_fp32_layers="0", routing_replay="R2",
                           num_iterations=2, **RUN)
    trainer.train()
    rows = _logged(trainer)
    routes = {k: v for row in rows for k, v in row.items() if k.startswith("ratio/route/")}
    assert routes and all(v == v for v in routes.values())  # route diagnostics logged, finite


def test_attribution_trains_two_steps(tmp_path):
    from trainer_fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path, "bf16", model=_qwen2(torch.bfloat16), ratio_attribution=True, **RUN)
    trainer.train()
    terms = {k: v for row in _logged(trainer) for k, v in row.items() if k.startswith("ratio/attribution/")}
    assert terms and all(v == v for v in terms.values())
    reference = trainer.reference_scorer
    for copy in reference.copies():
        assert {p.device.type for p in copy.module.parameters()} == {DEVICE.type}


@pytest.mark.parametrize("mode", ["bf16", "fp32_clone"])
def test_async_decoupled_trains_two_steps(tmp_path, mode):
    """The async trainer's decoupled objective on CUDA: a stub rollout worker and a stand-in vLLM server (no vLLM);
    TRL's tree attention through grpo_ratio's portable kernel (flash-attn3 needs the Hub)."""
    import test_async_grpo as lane  # the CPU tests' stub worker, samples and trainer factory
    from vllm_stub_server import StubServer

    from grpo_ratio.testing import tiny_model, tiny_tokenizer
    from grpo_ratio.testing.async_cpu import async_grpo_on_cpu

    model_dir = tmp_path / "tiny_qwen2"
    tiny_model("qwen2", seed=0).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    with StubServer("processed_logprobs") as server:
        lane.SERVER_URL = server.url
        trainer = lane.make_trainer(str(model_dir), tmp_path, samples=lane.samples_of(shift=-0.2),
                                    staleness=(0, 1), async_objective="decoupled", old_logprob_mode=mode,
                                    is_correction="tis", use_cpu=not ON_CUDA, dtype="bfloat16")
        with async_grpo_on_cpu():
            trainer.train()
    # fp32_clone runs its pass; bf16 reuses the training forward's log-probs (no proximal pass)
    assert (trainer.proximal_forwards > 0) == (mode != "bf16")
    assert next(trainer.model.parameters()).device.type == DEVICE.type
    rows = [row for row in trainer.state.log_history if "loss" in row]
    assert len(rows) == 2 and all(row["loss"] == row["loss"] for row in rows)
