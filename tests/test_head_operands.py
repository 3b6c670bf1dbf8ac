"""`fp32_head_operands="bf16"`: `fp32_head`'s LM head computed as the sampler's fp32 head (vLLM `head_dtype=float32` on
CUDA, PR #48390; SGLang #32370; prime-rl #2441): the final norm as the policy trains, its output and the head weight
rounded to bf16, fp32 accumulation and output (`grpo_ratio.old_pass.forward.mm_fp32_out`). Literal tensors against the
formula, the scorer against a hand-written head, the CUDA kernel's call on fake CUDA tensors, the checks and the run
record. The fused path, RLOO and the asynchronous trainer: tests/test_fused_head.py, tests/test_rloo.py,
tests/test_async_grpo.py; the real CUDA kernel: tests/gpu/test_cuda_precision.py.

Run: pytest tests/test_head_operands.py
"""

import json

import pytest
import torch
from fake_cuda import CUDA, fake_cuda
from torch.overrides import TorchFunctionMode
from trainer_fixtures import tiny_grpo_args, tiny_trainer

from grpo_ratio import RatioGRPOConfig
from grpo_ratio.diagnostics.run_record import HEAD_ARITHMETIC, RUN_FILE
from grpo_ratio.old_pass import forward
from grpo_ratio.old_pass.forward import (
    HeadProjection,
    head_arithmetic,
    ieee_fp32,
    mm_fp32_out,
    sampler_head_logprobs,
)
from grpo_ratio.old_pass.scorer import OldLogprobScorer
from grpo_ratio.testing import tiny_model


BF16_EPS = 2.0**-7  # bf16 keeps 7 mantissa bits: one ulp of 1.0


# -- the formula on literal tensors -------------------------------------------------------------------------------


def test_a_bf16_product_with_fp32_accumulation_keeps_what_a_bf16_output_rounds_away():
    # (1 + 2^-7)^2 = 1 + 2^-6 + 2^-14: exact in fp32 (24 bits), 1 + 2^-6 in a bf16 output
    a = torch.tensor([[1 + BF16_EPS]], dtype=torch.bfloat16)  # (1, 1)
    b = torch.tensor([[1 + BF16_EPS]], dtype=torch.bfloat16)  # (1, 1)
    out = mm_fp32_out(a, b)
    assert out.dtype == torch.float32 and out.item() == 1 + 2**-6 + 2**-14
    assert torch.mm(a, b).item() == 1 + 2**-6  # the bf16 head (TRL's, the bf16 mode) loses the 2^-14
    # a sum of bf16 products accumulated in fp32: 3 x (1 + 2^-7)(1 - 2^-7) = 3 - 3 * 2^-14, exact in fp32
    a3 = torch.full((1, 3), 1 + BF16_EPS, dtype=torch.bfloat16)  # (1, 3)
    b3 = torch.full((3, 1), 1 - BF16_EPS, dtype=torch.bfloat16)  # (3, 1)
    assert mm_fp32_out(a3, b3).item() == 3 - 3 * 2**-14
    assert torch.mm(a3, b3).item() == 3.0  # rounded to bf16


def test_it_equals_the_fp32_matmul_of_the_upcast_operands():
    # what runs on this CPU (no mm out_dtype kernel): bitwise that matmul; the maths of the CUDA kernel
    assert not forward.has_mm_out_dtype(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 64, generator=g).to(torch.bfloat16)  # (n, H)
    b = torch.randn(64, 7, generator=g).to(torch.bfloat16)  # (H, v)
    with ieee_fp32():
        assert torch.equal(mm_fp32_out(a, b), a.float() @ b.float())
    exact = a.double() @ b.double()  # every bf16 product is exact in fp64 and its sum nearly so
    assert (mm_fp32_out(a, b).double() - exact).abs().max() < 1e-5
    assert (torch.mm(a, b).double() - exact).abs().max() > 1e-3  # the bf16 output is off by a bf16 rounding


@pytest.mark.parametrize("softcap,scale,bias", [(None, 1.0, False), (30.0, 0.5, True)])
def test_the_tiled_log_probs_equal_log_softmax_of_the_fp32_logits(monkeypatch, softcap, scale, bias):
    # tiles of 3 tokens x 16 columns over 7 tokens x V = 50: the online log-sum-exp across tiles, TRL's transform order
    monkeypatch.setattr(forward, "VOCAB_TILE", 16)
    monkeypatch.setattr(forward, "SAMPLER_HEAD_TOKEN_TILE", 3)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, 32, generator=g) * 2).to(torch.bfloat16)  # (N, H)
    w = torch.randn(50, 32, generator=g).to(torch.bfloat16)  # (V, H)
    b = torch.randn(50, generator=g) if bias else None  # (V,)
    targets = torch.tensor([0, 15, 16, 31, 32, 48, 49])  # at tile edges
    temperature = 0.7
    got = sampler_head_logprobs(x, w, b, targets, temperature, softcap, scale)
    z = x.double() @ w.double().T + (0 if b is None else b.double())  # (N, V) the formula, in fp64
    z = z * scale
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    want = torch.log_softmax(z / temperature, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    # the projection's logits (the kept sets and divergences read these) are the same fp32 logits
    proj = HeadProjection(50, w, b, torch.bfloat16, softcap=softcap, scale=scale).with_sampler_operands()
    logits = proj.logits(x)  # (N, V) fp32
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), z, atol=2e-4, rtol=0)


# -- the scorer: the sampler's head against fp32_head's ------------------------------------------------------------


def _by_hand(model, ids, mask, T):
    """The two heads written out on the policy's own body (bf16 autocast where the weights are fp32, as the scorer's
    policy autocast): (B, T) log-probs, the products in fp64 (what fp32 accumulation approximates).

    Returns:
        (sampler, fp32_head): sampler = bf16(the norm's output as the policy computes it) x bf16(W); fp32_head =
        the final norm in fp32 on its input (fp32 weight), times fp32(W).
    """
    base, head, norm = model.model, model.lm_head, model.model.norm
    seen = []
    hook = norm.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=head.weight.dtype == torch.float32)
    with torch.no_grad(), autocast:
        normed = base(input_ids=ids, attention_mask=mask).last_hidden_state[:, -T - 1:-1]  # (B, T, H)
    hook.remove()
    x = seen[0][:, -T - 1:-1].float()  # (B, T, H) the norm's input
    norm32 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.float()
    targets = ids[:, -T:]  # (B, T)

    def logps(h, w):  # (B, T, H), (V, H) -> (B, T)
        return torch.log_softmax(h.double() @ w.double().T, -1).gather(-1, targets[..., None]).squeeze(-1)

    return (logps(normed.to(torch.bfloat16), head.weight.to(torch.bfloat16)),
            logps(norm32, head.weight.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_scorer_computes_the_formula_and_differs_from_fp32_head_by_the_casts(dtype):
    torch.manual_seed(0)
    model = tiny_model("llama", dtype=dtype).eval()  # fp32: bf16 autocast body (the recipes on CPU); bf16-stored
    ids = torch.randint(3, 300, (3, 14))  # (B, P+T)
    mask = torch.ones_like(ids)
    T = 6
    sampler_scorer = OldLogprobScorer(model, "fp32_head", head_operands="bf16")
    sampler = sampler_scorer.score(ids, mask, T).logps  # (B, T)
    fp32 = OldLogprobScorer(model, "fp32_head").score(ids, mask, T).logps
    by_hand_sampler, by_hand_fp32 = _by_hand(model, ids, mask, T)
    assert sampler.dtype == torch.float32 and sampler_scorer.copies() == []  # no fp32 copy of the norm or head
    # the formulas: bf16(norm output) x bf16(W), fp32 accumulation; fp32 norm x fp32(W)
    assert (sampler.double() - by_hand_sampler).abs().max() < 2e-6
    assert (fp32.double() - by_hand_fp32).abs().max() < 2e-6
    # the two differ by the casts: on fp32 weights the norm's output and W rounded to bf16; on bf16 weights (W exact)
    # the norm's output rounded to bf16 (and its weight multiplied in bf16). Measured on this model, nats per token:
    # fp32 weights 2.7e-4 mean, 8.5e-4 max; bf16 weights 1.8e-4 mean, 4.6e-4 max (18 tokens, V = 300)
    gap = (sampler - fp32).abs()
    assert 1e-5 < gap.mean() < 1e-3 and gap.max() < 5e-3
    torch.testing.assert_close((sampler - fp32).double(), by_hand_sampler - by_hand_fp32, atol=4e-6, rtol=0)


def test_ieee_whatever_the_run_sets(restored_precision):
    # the run's `tf32=True` (transformers' enable_tf32) and oneDNN's bf16 for fp32 matmuls on a CPU: every matmul of
    # the sampler head runs in IEEE fp32 (exact for bf16 operands anyway), the log-probs are the same bitwise, the
    # record names the run's setting, and the run's setting is back after the pass
    torch.manual_seed(0)
    model = tiny_model("qwen2").eval()
    ids = torch.randint(3, 300, (2, 12))
    mask = torch.ones_like(ids)
    scorer = OldLogprobScorer(model, "fp32_head", head_operands="bf16")
    ieee = scorer.score(ids, mask, 5).logps
    torch.backends.fp32_precision = "tf32"
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    assert head_arithmetic("bf16", torch.device("cpu"))["run_fp32_matmul"] == "bf16"
    assert head_arithmetic("bf16", CUDA)["run_fp32_matmul"] == "tf32"
    with MatmulCalls(precision=True) as seen:
        assert torch.equal(scorer.score(ids, mask, 5).logps, ieee)
    assert seen.calls and set(seen.precisions) == {("ieee", "ieee")}
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16" and torch.backends.fp32_precision == "tf32"


@pytest.fixture
def restored_precision():
    backends = torch.backends
    saved = (backends.fp32_precision, backends.cuda.matmul.fp32_precision, backends.mkldnn.matmul.fp32_precision)
    yield
    backends.fp32_precision, backends.cuda.matmul.fp32_precision, backends.mkldnn.matmul.fp32_precision = saved


# -- CUDA: the out_dtype kernel with bf16 operands (fake CUDA tensors) -------------------------------------------


class MatmulCalls(TorchFunctionMode):
    """Records (operand dtypes, device, out_dtype) of every `torch.mm` within the block; with `precision`, also the
    (CUDA, oneDNN) fp32 matmul precision each one ran under."""

    def __init__(self, precision: bool = False):
        super().__init__()
        self.calls, self.precisions, self.precision = [], [], precision

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.mm:
            self.calls.append((args[0].dtype, args[1].dtype, args[0].device, kwargs.get("out_dtype")))
            if self.precision:
                self.precisions.append((torch.backends.cuda.matmul.fp32_precision,
                                        torch.backends.mkldnn.matmul.fp32_precision))
        return func(*args, **kwargs)


def test_on_cuda_the_head_calls_mm_with_out_dtype_on_bf16_operands(monkeypatch):
    monkeypatch.setattr(forward, "VOCAB_TILE", 16)  # 3 vocabulary tiles of V = 40
    with fake_cuda():
        x = torch.randn(6, 32, device=CUDA)  # (N, H) fp32: the norm's output of an fp32-weight policy
        w = torch.randn(40, 32, device=CUDA)  # (V, H) fp32 master weights
        targets = torch.zeros(6, dtype=torch.long, device=CUDA)
        projection = HeadProjection(40, w, None, torch.float32).with_sampler_operands()
        with MatmulCalls() as seen:
            logps = projection.logprobs(x, targets, 1.0)  # (N,)
            logits = projection.logits(x)  # (N, V)
        assert logps.dtype == logits.dtype == torch.float32 and logps.device == CUDA
    assert seen.calls == [(torch.bfloat16, torch.bfloat16, CUDA, torch.float32)] * 4  # 3 tiles + the logits
    assert head_arithmetic("bf16", CUDA)["matmul"].startswith("torch.mm(bf16, bf16, out_dtype=float32)")


# -- the field: checks, default, run record -------------------------------------------------------------------------


def test_the_default_is_fp32_and_the_scorer_default_is_the_mode_as_before(tmp_path):
    assert RatioGRPOConfig.__dataclass_fields__["fp32_head_operands"].default == "fp32"
    assert tiny_grpo_args(tmp_path, old_logprob_mode="fp32_head").fp32_head_operands == "fp32"
    torch.manual_seed(0)
    model = tiny_model("llama").eval()
    ids = torch.randint(3, 300, (2, 10))
    mask = torch.ones_like(ids)
    assert torch.equal(OldLogprobScorer(model, "fp32_head", head_operands="fp32").score(ids, mask, 4).logps,
                       OldLogprobScorer(model, "fp32_head").score(ids, mask, 4).logps)


@pytest.mark.parametrize("overrides,named", [
    ({"fp32_head_operands": "fp16"}, "fp32_head_operands='fp16' is not allowed; allowed: fp32, bf16"),
    ({"fp32_head_operands": "bf16", "old_logprob_mode": "guided_fp32", "guided_fp32_layers": "0"},
     "old_logprob_mode='guided_fp32'"),
    ({"fp32_head_operands": "bf16", "old_logprob_mode": "bf16"}, "set old_logprob_mode='fp32_head'"),
    ({"fp32_head_operands": "bf16", "old_logprob_mode": "fp32_head", "bf16": False, "fp16": True}, "fp16=True"),
])
def test_refusals_name_the_field(tmp_path, overrides, named):
    with pytest.raises(ValueError, match="fp32_head_operands") as raised:
        tiny_grpo_args(tmp_path, **overrides)
    assert named in str(raised.value)
    with pytest.raises(ValueError, match="applies to old_logprob_mode='fp32_head' only"):
        OldLogprobScorer(tiny_model("llama"), "fp32_clone", head_operands="bf16")


def test_two_steps_and_the_run_record_says_which_arithmetic(tmp_path):
    # the separate pass (num_iterations=2: TRL runs its old pass, the mode's replaces it) and the run record
    trainer = tiny_trainer(tmp_path, "fp32_head", arch="llama", fp32_head_operands="bf16", num_iterations=2)
    assert not trainer.plan.fused_head
    trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    record = json.loads((tmp_path / RUN_FILE).read_text())
    assert record["config"]["fp32_head_operands"] == "bf16"
    arithmetic = record[HEAD_ARITHMETIC]
    assert arithmetic["operands"] == "bf16" and arithmetic["norm"] == "as trained"
    assert arithmetic["matmul"].startswith("fp32 matmul of the bf16 operands upcast (IEEE")  # this CPU has no kernel
    assert arithmetic["fp32_matmul"] == "ieee"


def test_the_run_record_has_no_entry_without_an_fp32_head(tmp_path):
    trainer = tiny_trainer(tmp_path, "bf16", max_steps=1)
    trainer.train()
    assert HEAD_ARITHMETIC not in json.loads((tmp_path / RUN_FILE).read_text())
