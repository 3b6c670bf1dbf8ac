"""Every TRL internal grpo_ratio reads (the checklist in `grpo_ratio._compat`) exists in the installed TRL.

Run: pytest tests/test_trl_internals.py
"""

import importlib
import inspect
import re

import torch
from trainer_fixtures import tiny_trainer
from trl import GRPOTrainer

from grpo_ratio._compat import TRL_ATTRIBUTES, TRL_BATCH_KEYS, TRL_HOOKS, TRL_MODULE_GLOBALS, TRL_VLLM_ATTRIBUTES


def test_every_wrapped_hook_is_a_grpo_trainer_method_we_override():
    from grpo_ratio import RatioGRPOTrainer

    assert len(TRL_HOOKS) == 4
    for name in TRL_HOOKS:
        assert callable(getattr(GRPOTrainer, name)), name
        assert getattr(RatioGRPOTrainer, name) is not getattr(GRPOTrainer, name), name  # overridden, calling super()


def test_every_listed_attribute_global_and_batch_key_exists(tmp_path):
    trainer = tiny_trainer(tmp_path, "bf16", max_steps=1)
    trainer.train()  # some attributes are set in train() (current_gradient_accumulation_steps)
    missing = [name for name in TRL_ATTRIBUTES if not hasattr(trainer, name)]
    assert missing == list(TRL_VLLM_ATTRIBUTES)  # no vLLM on this run
    for module, name in TRL_MODULE_GLOBALS:
        mod = importlib.import_module(module)
        # vllm.LLM is imported there only when vLLM is installed: then its source must still call it by that name
        assert hasattr(mod, name) or re.search(rf"\b{name}\(", inspect.getsource(mod)), (module, name)
    trainer.model.train()
    out = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    always = {key for key, present in TRL_BATCH_KEYS.items() if present}
    assert always <= set(out)
    assert out["completion_ids"].shape == out["completion_mask"].shape == (4, 8) and torch.is_tensor(out["advantages"])


def test_trls_old_pass_comes_before_its_reference_pass():
    # _compat.TRL_CONDITIONS: the trainer takes the first no-grad call on the policy inside a generation batch for
    # TRL's old pass; with PEFT and beta > 0 the reference pass also calls self.model, so the order must hold
    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    old = source.index("old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(")
    refs = [m.start() for m in re.finditer(r"ref_per_token_logps, _, _ = self._get_per_token_logps_and_entropies\(",
                                           source)]
    assert len(refs) == 2 and old < min(refs)
    assert source.count("self._get_per_token_logps_and_entropies(") == 3


def test_what_the_async_trainer_reads_exists():
    """`_compat.TRL_ASYNC_READS`: the attributes, methods and module globals of TRL's experimental AsyncGRPOTrainer
    that RatioAsyncGRPOTrainer relies on exist in the installed TRL."""
    import inspect

    from trl.experimental.async_grpo import async_grpo_trainer, packing
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from grpo_ratio._compat import TRL_ASYNC_READS

    trainer_cls = async_grpo_trainer.AsyncGRPOTrainer
    for name in ("compute_loss", "get_train_dataloader", "_set_signature_columns_if_needed", "log"):
        assert name in TRL_ASYNC_READS or name in ("_set_signature_columns_if_needed", "log")
        assert callable(getattr(trainer_cls, name))
    source = inspect.getsource(trainer_cls)
    for attribute in ("self.rollout_queue", "self.model_version", "self._step_forward_s", "self._metrics"):
        assert attribute in source
    assert "metrics" in RolloutSample.__dataclass_fields__ and "model_version" in RolloutSample.__dataclass_fields__
    assert callable(packing._flash_attn) and callable(async_grpo_trainer.get_peak_flops_per_device)
    loss_source = inspect.getsource(trainer_cls.compute_loss)
    # the decoupled objectives rely on TRL's loss being the PPO clip of exp(log_probs - old_log_probs) times A
    assert "log_ratio = log_probs - old_log_probs" in loss_source
    assert "per_token_loss = -torch.min(per_token_loss1, per_token_loss2)" in loss_source
