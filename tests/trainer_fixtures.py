"""Trainer fixtures for the tests: a `RatioGRPOTrainer` (or stock `trl.GRPOTrainer`) on a tiny offline model.

Run any test file; pytest puts tests/ on `sys.path`, so `from trainer_fixtures import tiny_trainer` works in them.
"""

from __future__ import annotations

from trl import GRPOConfig, GRPOTrainer

from grpo_ratio import RatioGRPOConfig, RatioGRPOTrainer
from grpo_ratio.testing import letter_reward, peaked_model, tiny_model, tiny_prompts, tiny_tokenizer


__all__ = ["peaked_model", "tiny_grpo_args", "tiny_trainer", "trl_logged_values", "config_plan"]


def tiny_grpo_args(output_dir, **overrides):
    """`RatioGRPOConfig` for a seconds-long CPU run: 4 prompts x 4 generations, 8 tokens, logging every step."""
    kwargs = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=True,  # bf16 autocast on CPU: the precision the project is about
        per_device_train_batch_size=4,
        num_generations=4,  # 1 prompt per micro-batch, 4 samples: the smallest group with a std
        max_completion_length=8,  # short rollouts keep a step under a second on a tiny model
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-2,  # large: a toy model must visibly move in 2 steps
        report_to="none",
        save_strategy="no",
        seed=0,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return RatioGRPOConfig(**kwargs)


def tiny_trainer(output_dir, mode: str = "bf16", arch: str = "qwen2", trainer_cls=None, model=None, peft_config=None,
                 **overrides):
    """A RatioGRPOTrainer (or, with `trainer_cls=trl.GRPOTrainer`, stock TRL on an equivalent plain GRPOConfig) on a
    tiny model, 8 plain-text prompts and `letter_reward`; `overrides` go to `tiny_grpo_args`."""
    trainer_cls = trainer_cls or RatioGRPOTrainer
    args = tiny_grpo_args(output_dir, old_logprob_mode=mode, **overrides)
    if trainer_cls is GRPOTrainer:  # the same values in TRL's own config class
        fields = GRPOConfig.__dataclass_fields__
        values = {k: getattr(args, k) for k, f in fields.items() if f.init}
        # re-derived, as from a user's config (both set is an error in GRPOConfig); keep what the test asked for
        values.update(generation_batch_size=None)
        values["steps_per_generation"] = overrides.get("steps_per_generation")
        args = GRPOConfig(**values)
    return trainer_cls(
        model=model if model is not None else tiny_model(arch),
        reward_funcs=letter_reward,
        args=args,
        train_dataset=tiny_prompts(8),
        processing_class=tiny_tokenizer(),
        peft_config=peft_config,
    )


WALL_CLOCK_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def trl_logged_values(trainer) -> list[dict]:
    """TRL's own logged values of every optimizer step (ours are `ratio/*`), wall-clock keys left out: what must
    equal stock TRL's bit for bit."""
    return [{k: v for k, v in row.items() if not k.startswith("ratio/") and k not in WALL_CLOCK_KEYS}
            for row in trainer.state.log_history if "loss" in row]


def config_plan(args):
    """The `RunPlan` of a config alone (a diagnostics test without a trainer): the config's sampling settings and
    backend, as the trainer resolves them for vLLM or `generate`."""
    from grpo_ratio.plan import GENERATE, VLLM, RunPlan
    from grpo_ratio.sampler.settings import settings_from_config

    return RunPlan.resolve(args, settings_from_config(args), VLLM if args.use_vllm else GENERATE)
