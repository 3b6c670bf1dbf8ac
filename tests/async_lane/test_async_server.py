"""Stock TRL `AsyncGRPOTrainer` (trl/experimental/async_grpo) on CPU against a real vLLM server, LoRA adapter-only sync.

One 3-step run (`stock_run`) is read by several tests: the adapter sync is the one TRL picks by itself (`--enable-lora`
server + PEFT model: `_lora_sync`), the server holds the last max_staleness + 1 versions, the rollouts the trainer
consumed were really off-policy (staleness >= 1), the sampler log-probs reached the loss, and the adapter the server
serves is the trained policy. Two more tests pin what stock TRL cannot do on a CPU machine (async_lane_utils module
docstring), so that a fix upstream shows up here.
"""

import math
import types

import pytest
import torch
from async_lane_utils import (
    LORA_NAME,
    MAX_STALENESS,
    async_args,
    capturing,
    completion_logprobs,
    hf_logprobs,
    logged,
    requires_vllm,
    served_adapters,
    train_async,
    unload_adapters,
)


pytestmark = [pytest.mark.async_lane, requires_vllm]

STEPS = 3


@pytest.fixture(scope="module")
def stock_run(vllm_lora_server, tiny_chat_llama_dir, tmp_path_factory):
    """3 steps of stock `AsyncGRPOTrainer` (capturing its loss inputs), then what the server holds and serves right
    after; the adapters are unloaded at the end."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    url = vllm_lora_server
    unload_adapters(url)
    trainer = train_async(capturing(AsyncGRPOTrainer), AsyncGRPOConfig, tiny_chat_llama_dir, url,
                          tmp_path_factory.mktemp("stock_async"), max_steps=STEPS)
    adapters = served_adapters(url)
    # The latest adapter, served: one completion, and the log-probs of the same tokens from vLLM's base model and
    # from an HF model with the adapter the trainer saved for that version.
    latest = f"{LORA_NAME}-v{trainer.model_version}"
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_llama_dir)
    prompt_ids = tokenizer.apply_chat_template([{"role": "system", "content": "Hi"}, {"role": "user", "content": "a b"}],
                                               add_generation_prompt=True, return_dict=False)
    completion_ids, served = completion_logprobs(url, latest, prompt_ids)
    base = AutoModelForCausalLM.from_pretrained(tiny_chat_llama_dir, dtype=torch.float32, attn_implementation="eager")
    hf_base = hf_logprobs(base.eval(), prompt_ids, completion_ids)
    policy = PeftModel.from_pretrained(base, adapters[latest]).eval()
    hf_policy = hf_logprobs(policy, prompt_ids, completion_ids)
    yield types.SimpleNamespace(trainer=trainer, adapters=adapters, latest=latest, served=torch.tensor(served),
                                hf_policy=hf_policy, hf_base=hf_base, completion_ids=completion_ids)
    unload_adapters(url)


def test_lora_sync_is_active_and_the_server_holds_the_last_versions(stock_run):
    """TRL chose adapter-only sync (server probed through /server_info), synced after the cold start and every step,
    and unloaded what fell out of the staleness window: the server lists exactly v(N - max_staleness) .. vN."""
    trainer = stock_run.trainer
    assert trainer._lora_sync is True
    assert trainer.weight_transfer is None  # no NCCL transfer group on the adapter path
    assert trainer.state.global_step == STEPS
    assert trainer.model_version == STEPS + 1  # the cold sync at train begin, then one per step
    versions = range(trainer.model_version - MAX_STALENESS, trainer.model_version + 1)
    assert set(stock_run.adapters) == {f"{LORA_NAME}-v{v}" for v in versions}
    assert stock_run.latest in stock_run.adapters
    assert stock_run.adapters[stock_run.latest].startswith(trainer._lora_dir)


def test_rollouts_were_consumed_off_policy(stock_run):
    """Staleness happened for real: step 1 trains on rollouts of the policy it holds (v1), a later step on rollouts of
    an older version, still within max_staleness."""
    staleness = logged(stock_run.trainer, "sample/staleness_max")
    assert len(staleness) == STEPS
    assert staleness[0] == 0
    assert 1 <= max(staleness) <= MAX_STALENESS


def test_sampler_logprobs_reached_the_loss(stock_run):
    """The loss consumed the server's log-probs (`logprobs: 0` on /v1/completions) for every trained token: finite,
    <= 0, those of a near-uniform 300-token model; and at step 1, on-policy, the PPO ratio trainer/sampler is 1 (vLLM
    and the trainer both in fp32, the adapter still zero)."""
    captured = stock_run.trainer.captured_old_log_probs
    assert len(captured) == 2 * STEPS  # gradient_accumulation_steps micro-batches per step
    old = torch.cat(captured)
    assert old.numel() >= 2 * STEPS * 4  # at least one token per completion
    assert torch.isfinite(old).all() and (old <= 0).all()
    assert old.mean() < -math.log(300) / 2
    assert abs(logged(stock_run.trainer, "ratio")[0] - 1) < 1e-4


def test_served_adapter_is_the_trained_policy(stock_run):
    """What vLLM serves under the latest adapter name is the trainer's policy: its log-probs match an HF model with
    that adapter to fp32 rounding, and differ from the base model's (the adapter moved the policy)."""
    gap_to_policy = (stock_run.served - stock_run.hf_policy).abs().max().item()
    gap_to_base = (stock_run.served - stock_run.hf_base).abs().max().item()
    assert gap_to_policy < 1e-4, gap_to_policy
    assert gap_to_base > 100 * max(gap_to_policy, 1e-6), (gap_to_base, gap_to_policy)


def test_cuda_device_query_fails_on_cpu(tiny_chat_llama_dir, tmp_path):
    """Pinned: unmodified, `AsyncGRPOTrainer.__init__` dies on a CPU-only torch in `get_peak_flops_per_device`
    (`torch.cuda.get_device_name`). When this stops failing, drop that stand-in from `async_grpo_on_cpu`."""
    from async_lane_rewards import letter_reward
    from async_lane_utils import chat_prompts
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = async_args(AsyncGRPOConfig, tmp_path, "http://127.0.0.1:9")  # never reached: __init__ fails first
    with pytest.raises(AssertionError, match="Torch not compiled with CUDA enabled"):
        AsyncGRPOTrainer(model=tiny_chat_llama_dir, reward_funcs=letter_reward, args=args,
                         train_dataset=chat_prompts(8))


def test_tree_attention_kernel_is_not_available_on_cpu():
    """Pinned: the `tree_fa3` attention's kernel comes from the `kernels` package (flash-attn3, CUDA, fetched from the
    Hub), which the lane's venv lacks. When this stops failing, check whether the stand-in is still needed."""
    from trl.experimental.async_grpo import packing

    packing._flash_attn.cache_clear()
    with pytest.raises(ModuleNotFoundError, match="kernels"):
        packing._flash_attn()
