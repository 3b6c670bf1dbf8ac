"""The engine a launch asked for against the one accelerate set up, and a second `train()` under ZeRO-3.

The real launches (an FSDP2 config on 2 CPU processes that accelerate runs as plain DDP; a second `train()` under
ZeRO-3) are in tests/test_sharded.py (`tests/sharded_corrections.py`); these are the rules on stand-ins.

Run: pytest tests/test_engine_rules.py
"""

import logging
from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType
from trainer_fixtures import tiny_trainer

from grpo_ratio.checks import check_engine, check_train_again, engine_asked


def _accelerator(distributed_type, num_processes=2):
    return SimpleNamespace(state=SimpleNamespace(distributed_type=distributed_type), num_processes=num_processes)


@pytest.mark.parametrize("var,asked", [("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed")])
def test_an_engine_other_than_the_one_asked_for_is_said(monkeypatch, caplog, var, asked):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    monkeypatch.setenv(var, "true")
    assert engine_asked() == [asked]
    with caplog.at_level(logging.WARNING, logger="grpo_ratio"):
        said = check_engine(_accelerator(DistributedType.MULTI_CPU))
    assert said.startswith(f"the launch asked for {asked} ") and "plain DDP on 2 CPU processes (gloo)" in said
    assert "the model will not be sharded" in said and [r.getMessage() for r in caplog.records] == [said]
    assert "a single process" in check_engine(_accelerator(DistributedType.NO, 1))
    # the engine it asked for: nothing said
    got = DistributedType.FSDP if asked == "FSDP" else DistributedType.DEEPSPEED
    assert check_engine(_accelerator(got)) is None


def test_nothing_is_said_where_no_engine_was_asked_for(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert engine_asked() == [] and check_engine(_accelerator(DistributedType.MULTI_CPU)) is None


def test_a_second_train_is_refused_under_zero3_only():
    check_train_again("zero3", trained=False)
    for engine in ("none", "fsdp2"):
        check_train_again(engine, trained=True)
    with pytest.raises(RuntimeError, match=r"under DeepSpeed ZeRO-3 a second train\(\) cannot run .* Build a new "
                                           r"trainer .*resume_from_checkpoint"):
        check_train_again("zero3", trained=True)


def test_the_trainer_refuses_its_second_train_under_zero3_before_it_starts(tmp_path, monkeypatch):
    import grpo_ratio.trainer as trainer_module

    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.train()
    trainer.train()  # not ZeRO-3: a second train() runs, as in stock TRL
    assert trainer.state.global_step == 1
    monkeypatch.setattr(trainer_module, "engine_of", lambda accelerator: "zero3")  # a stand-in: the real one is slow
    with pytest.raises(RuntimeError, match="ZeRO-3"):
        trainer.train()
