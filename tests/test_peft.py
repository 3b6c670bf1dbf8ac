"""Copies of a PEFT (LoRA) policy carry the merged adapter weights and leave the policy untouched."""

import copy

import pytest
import torch

from grpo_ratio.old_pass.scorer import OldLogprobScorer, completion_logprobs_from_logits
from grpo_ratio.testing import tiny_model


peft = pytest.importorskip("peft")


def _lora(dtype):
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # non-zero B
    return peft.get_peft_model(tiny_model("qwen2", dtype=dtype), config)


def test_fp32_copy_of_bf16_lora_policy_has_merged_weights():
    policy = _lora(torch.bfloat16)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    ids = torch.randint(2, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    logps = OldLogprobScorer(policy, "fp32_clone").score(ids, mask, 4).logps  # (3, 4)
    reference = copy.deepcopy(policy).float().merge_and_unload()  # PEFT's own merge, done in fp32
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask, logits_to_keep=5).logits
    assert (logps - completion_logprobs_from_logits(logits, ids[:, -4:], 1.0)).abs().max() <= 1e-5
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())  # adapters not merged in place
    assert not any(getattr(m, "merged", False) for m in policy.modules())


def test_fp32_lora_policy_needs_no_copy():
    policy = _lora(torch.float32)
    ids = torch.randint(2, 300, (2, 8), generator=torch.Generator().manual_seed(1))
    scorer = OldLogprobScorer(policy, "fp32_clone")
    logps = scorer.score(ids, torch.ones_like(ids), 3).logps
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=4).logits
    assert torch.allclose(logps, completion_logprobs_from_logits(logits, ids[:, -3:], 1.0), atol=1e-6)
    assert scorer.copies() == []


def test_trainer_with_lora_keeps_copy_in_step(tmp_path):
    from trainer_fixtures import tiny_trainer

    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trainer = tiny_trainer(tmp_path, "fp16_clone", model=tiny_model("qwen2"), peft_config=config, max_steps=2)
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    (copy_,) = trainer.scorer.copies()
    module = copy_.get(trainer.weights_version.value)  # refreshed: the adapters trained, so the merge changed
    merged = copy.deepcopy(policy).merge_and_unload()
    for key, value in merged.state_dict().items():
        assert torch.equal(value.to(torch.float16), module.state_dict()[key]), key


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_copy_refresh_merges_one_layer_at_a_time(dtype):
    # every adapted layer was merged to fp32 and all were held at once before the copy_ loop (2x the bf16 bytes of the
    # adapted weights at every refresh: ~26 GB for a 7B all-linear LoRA); now one layer's merge at a time
    from live_bytes import LiveBytes

    from grpo_ratio.old_pass.adapters import base_model
    from grpo_ratio.old_pass.copies import ModuleCopy, _adapter_layers, merged_state_dict

    layers = 4
    policy = peft.get_peft_model(
        tiny_model("qwen2", dtype=torch.bfloat16, num_hidden_layers=layers, layer_types=["full_attention"] * layers),
        peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    weights = [t.get_base_layer().weight.numel() * 4 for t in _adapter_layers(base_model(policy))[0].values()]
    assert len(weights) == 7 * layers  # q, k, v, o, gate, up, down of every layer
    copy_ = ModuleCopy(policy, dtype, whole_model=True)
    with LiveBytes() as live:
        copy_.refresh(1)
    # one layer's merge (its bf16 clone, the fp32 copy, PEFT's delta) at a time: 101 KB here, where all the fp32
    # merges at once were 660 KB (1.1x the 590 KB of the adapted weights in fp32)
    assert live.peak <= 4 * max(weights) < sum(weights)
    assert live.live == 0  # nothing outlives the refresh
    for key, value in merged_state_dict(policy).items():
        assert torch.equal(copy_.module.state_dict()[key], value.to(dtype)), key
