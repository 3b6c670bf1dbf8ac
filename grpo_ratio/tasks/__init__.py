"""Tasks for GRPO runs: a training `datasets.Dataset` (columns `prompt`, `answer`) and TRL reward functions.

`load_task(name, **kwargs)` is the one entry point; `TASKS` maps each name to its loader:

| name | data | rewards |
| --- | --- | --- |
| `gsm8k` | GSM8K from a local JSONL or `openai/gsm8k` (the batch-logprob-gap report's prompt and gold) | `gsm8k_lenient_reward` or `gsm8k_strict_reward` |
| `arithmetic` | seeded small additions, generated in memory (no download) | `arithmetic_correct_reward` + `arithmetic_format_reward` |
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from datasets import Dataset

from .arithmetic import (
    ARITHMETIC_REWARD_FUNCS,
    arithmetic_correct_reward,
    arithmetic_format_reward,
    load_arithmetic,
)
from .gsm8k import GSM8K_REWARDS, gsm8k_lenient_reward, gsm8k_strict_reward, load_gsm8k
from .rewards import completion_text


RewardFunc = Callable[..., list[float]]


def gsm8k_task(
    dataset_path: str | None = None,
    split: str = "train",
    num_examples: int | None = None,
    seed: int = 0,
    reward: str = "lenient",
) -> tuple[Dataset, list[RewardFunc]]:
    """GSM8K rows (see `load_gsm8k`) and one reward: `reward="lenient"` (the batch-logprob-gap report's
    default) or `"strict"`.

    Raises:
        ValueError: unknown `reward`, plus the errors of `load_gsm8k`.
    """
    if reward not in GSM8K_REWARDS:
        raise ValueError(f"reward={reward!r} is not a GSM8K reward; allowed: {', '.join(GSM8K_REWARDS)}")
    return load_gsm8k(dataset_path, split=split, num_examples=num_examples, seed=seed), [GSM8K_REWARDS[reward]]


def arithmetic_task(
    num_examples: int = 1000, seed: int = 0, max_operand: int = 10, operations: str = "+"
) -> tuple[Dataset, list[RewardFunc]]:
    """Seeded arithmetic rows (see `load_arithmetic`) and the correctness + format rewards."""
    dataset = load_arithmetic(num_examples=num_examples, seed=seed, max_operand=max_operand, operations=operations)
    return dataset, list(ARITHMETIC_REWARD_FUNCS)


TASKS: dict[str, Callable[..., tuple[Dataset, list[RewardFunc]]]] = {
    "gsm8k": gsm8k_task,
    "arithmetic": arithmetic_task,
}


def load_task(name: str, **kwargs) -> tuple[Dataset, list[RewardFunc]]:
    """`(train_dataset, reward_funcs)` of task `name`, built by `TASKS[name](**kwargs)`.

    Raises:
        ValueError: `name` is not in TASKS, or a keyword is not accepted by that task (the message lists the
            allowed names / keywords).
    """
    if name not in TASKS:
        raise ValueError(f"task={name!r} is not a known task; allowed: {', '.join(TASKS)}")
    accepted = inspect.signature(TASKS[name]).parameters
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(f"task {name!r} does not take {', '.join(unknown)}; it takes: {', '.join(accepted)}")
    return TASKS[name](**kwargs)


__all__ = [
    "TASKS",
    "arithmetic_correct_reward",
    "arithmetic_format_reward",
    "arithmetic_task",
    "completion_text",
    "gsm8k_lenient_reward",
    "gsm8k_strict_reward",
    "gsm8k_task",
    "load_arithmetic",
    "load_gsm8k",
    "load_task",
]
