"""An embedded, seeded arithmetic task: small additions a 135M instruct model can learn to answer in a few dozen
GRPO steps on CPU. No download; the same `seed` always gives the same problems.

Prompt (conversational): system `ARITHMETIC_SYSTEM_PROMPT`, user "What is 7 + 5?". The gold answer is the result as a
decimal string. Two TRL reward functions with partial credit, so a group of completions rarely has zero reward
variance (which would give zero advantage and no gradient):

- `arithmetic_correct_reward`: 1.0 when the first number of the completion is the gold answer, 0.5 when the gold
  answer appears later as a whole number ("7 + 12 = 19"), else 0.0.
- `arithmetic_format_reward`: 0.2 when the completion is a bare number ("19" or "19."), 0.1 when it starts with a
  number, else 0.0.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

from .rewards import completion_text


ARITHMETIC_SYSTEM_PROMPT = "You are a calculator. Reply with only the result, as a number."
OPERATIONS = ("+", "-")
_NUMBER = re.compile(r"-?\d+")
_BARE_NUMBER = re.compile(r"\s*-?\d+\.?\s*")


def make_problem(rng: random.Random, max_operand: int, operations: tuple[str, ...]) -> tuple[str, str]:
    """One problem `(question, gold)` drawn from `rng`: operands in [1, max_operand]; subtraction keeps a >= b so
    answers are non-negative."""
    op = rng.choice(operations)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if op == "-" and a < b:
        a, b = b, a
    gold = a + b if op == "+" else a - b
    return f"What is {a} {op} {b}?", str(gold)


def load_arithmetic(
    num_examples: int = 1000, seed: int = 0, max_operand: int = 10, operations: str | tuple[str, ...] = "+"
) -> Dataset:
    """A `datasets.Dataset` of `num_examples` arithmetic problems with columns `prompt` (list of chat messages) and
    `answer` (gold result as a string). Deterministic given `seed` (Python's `random.Random`).

    Args:
        num_examples: number of rows (> 0).
        seed: seed of the problem generator, independent of the trainer's seed so every run sees the same problems.
        max_operand: operands are drawn uniformly from [1, max_operand] (>= 1).
        operations: the operators to draw from, a subset of `OPERATIONS`, as a tuple or a string such as "+-".

    Raises:
        ValueError: `num_examples` < 1, `max_operand` < 1, or an operator outside `OPERATIONS`.
    """
    ops = tuple(operations)
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    if not ops or any(op not in OPERATIONS for op in ops):
        raise ValueError(f"operations={operations!r}: allowed operators are {', '.join(OPERATIONS)}")
    rng = random.Random(seed)
    rows = [make_problem(rng, max_operand, ops) for _ in range(num_examples)]
    return Dataset.from_dict(
        {
            "prompt": [
                [{"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}, {"role": "user", "content": q}]
                for q, _ in rows
            ],
            "answer": [gold for _, gold in rows],
        }
    )


def arithmetic_correct_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 if the completion's first integer equals the gold `answer`, 0.5 if the gold appears later as a whole
    integer, else 0.0. `completions`: strings or conversational `[{"role": "assistant", "content": ...}]`."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        numbers = _NUMBER.findall(completion_text(completion))
        if numbers and numbers[0] == gold:
            rewards.append(1.0)
        elif gold in numbers:
            rewards.append(0.5)
        else:
            rewards.append(0.0)
    return rewards


def arithmetic_format_reward(completions, **kwargs) -> list[float]:
    """0.2 if the completion is just an integer (optionally followed by "."), 0.1 if it starts with an integer,
    else 0.0: rewards the short answer the prompt asks for, whatever its value."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        if _BARE_NUMBER.fullmatch(text):
            rewards.append(0.2)
        elif _NUMBER.match(text.lstrip()):
            rewards.append(0.1)
        else:
            rewards.append(0.0)
    return rewards


ARITHMETIC_REWARD_FUNCS = [arithmetic_correct_reward, arithmetic_format_reward]
