"""Start-up refusals and single-process pieces of grpo_ratio.old_pass.sharding.engines (no launch; the sharded runs themselves are in
tests/test_sharded.py).

Run: pytest tests/test_sharding.py
"""

from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from grpo_ratio.checks import check_sharded_mode
from grpo_ratio.old_pass.sharding.base import class_forward
from grpo_ratio.old_pass.sharding.engines import engine_of
from grpo_ratio.testing import tiny_model


def fsdp(version=2, offload=False):
    plugin = SimpleNamespace(fsdp_version=version, cpu_offload=CPUOffloadPolicy() if offload else OffloadPolicy())
    return SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin))


def zero3(stage=3, **config):
    plugin = SimpleNamespace(zero_stage=stage, deepspeed_config={"zero_optimization": {"stage": stage}, **config})
    return SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, deepspeed_plugin=plugin))


def args(mode="fp16_clone", fp16=False):
    return SimpleNamespace(old_logprob_mode=mode, fp16=fp16)


def test_engines():
    assert engine_of(fsdp()) == "fsdp2" and engine_of(fsdp(version=1)) == "fsdp1"
    assert engine_of(zero3()) == "zero3" and engine_of(zero3(stage=2)) == "none"
    ddp = SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.MULTI_CPU))
    assert engine_of(ddp) == "none"


@pytest.mark.parametrize("accelerator,arguments,match", [
    (fsdp(version=1), args(), "under FSDP1: FSDP1 is not supported; set `fsdp_version: 2`"),
    (fsdp(offload=True), args("fp32_head"), "under FSDP2: parameter offload"),
    (fsdp(), args(fp16=True), "under FSDP2: fp16 mixed precision"),
    (zero3(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}), args(), "offload_param"),
    (zero3(torch_autocast={"enabled": True}), args(), "torch_autocast"),
])
def test_refused_at_start_up(accelerator, arguments, match):
    with pytest.raises(NotImplementedError, match=match):
        check_sharded_mode(accelerator, tiny_model(), arguments)


def test_bf16_mode_and_unsharded_engines_are_never_refused():
    check_sharded_mode(fsdp(version=1), tiny_model(), args("bf16"))
    check_sharded_mode(zero3(stage=2, torch_autocast={"enabled": True}), tiny_model(), args(fp16=True))


def test_peft_refused():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model(), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(NotImplementedError, match="PEFT adapter is not supported"):
        check_sharded_mode(fsdp(), model, args())


@pytest.mark.parametrize("bf16,mode,refused", [
    (True, "fp32_head", True),  # bf16 engine: the fp32 modules come from the masters
    (False, "fp16_clone", True),  # fp32 engine: the fp16 shadow is refreshed from the masters
    (False, "fp32_head", False),  # fp32 engine: runs the policy's own fp32 partitions
])
def test_zero3_frozen_parameters(bf16, mode, refused):
    model = tiny_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    accelerator = zero3(bf16={"enabled": bf16})
    if refused:
        with pytest.raises(NotImplementedError, match="frozen parameters"):
            check_sharded_mode(accelerator, model, args(mode))
    else:
        check_sharded_mode(accelerator, model, args(mode))


def test_class_forward_sets_instance_patches_aside_and_restores_them():
    model = tiny_model()
    patched = model.forward = lambda *a, **k: "patched"  # as TRL's fused head and accelerate's autocast do
    ids = torch.tensor([[5, 6, 7]])
    with class_forward(model):
        assert model(input_ids=ids).logits.shape == (1, 3, 300)
    assert model.forward is patched
    plain = tiny_model()
    with class_forward(plain):
        plain(input_ids=ids)
    assert "forward" not in plain.__dict__


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "zero3"])
def test_accelerate_configs_load_and_say_how_to_launch(name):
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(__file__).resolve().parents[1] / "recipes" / "accelerate_configs" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert config.distributed_type.value == {"ddp": "MULTI_GPU", "fsdp2": "FSDP", "zero3": "DEEPSPEED"}[name]
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(f"accelerate launch --config_file recipes/accelerate_configs/{name}.yaml" in h for h in header)
    if name == "fsdp2":
        assert config.fsdp_config["fsdp_version"] == 2
    if name == "zero3":
        assert config.deepspeed_config["zero_stage"] == 3
