"""Tasks: rewards on literal completions, arithmetic determinism, GSM8K loading. Run: pytest tests/test_tasks.py"""

import json
import re
from pathlib import Path

import pytest

from grpo_ratio.tasks import TASKS, completion_text, load_task
from grpo_ratio.tasks.arithmetic import (
    ARITHMETIC_SYSTEM_PROMPT,
    arithmetic_correct_reward,
    arithmetic_format_reward,
    load_arithmetic,
)
from grpo_ratio.tasks.gsm8k import (
    GSM8K_SYSTEM_PROMPT,
    gold_answer,
    gsm8k_lenient_reward,
    gsm8k_strict_reward,
    load_gsm8k,
)


SHARED_GSM8K = Path(__file__).parents[1].parent / "shared" / "data" / "gsm8k"


def _chat(text):
    return [{"role": "assistant", "content": text}]


# ---------------------------------------------------------------- GSM8K rewards


def test_gold_answer_strips_rationale_and_commas():
    assert gold_answer("48/2 = <<48/2=24>>24\n#### 1,072") == "1072"
    assert gold_answer("#### -3 ") == "-3"


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("So she sold 72 clips.", "72", 1.0),  # last number "72." -> rstrip(".") -> 72
        ("It costs 18.99 dollars", "18", 1.0),  # integer part only: 18.99 -> 18
        ("Total: 1,234", "1234", 1.0),  # commas removed
        ("First 72, then 70", "72", 0.0),  # the LAST number counts: 70
        ("#### -5", "-5", 1.0),  # sign kept
        ("no digits at all", "7", 0.0),
        ("7 is 7.5 rounded", "7", 1.0),  # last number 7.5 -> 7
    ],
)
def test_gsm8k_lenient_reward(completion, gold, expected):
    assert gsm8k_lenient_reward([completion], [gold]) == [expected]
    assert gsm8k_lenient_reward([_chat(completion)], [gold]) == [expected]  # conversational form, same value


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("Reasoning...\n#### 72", "72", 1.0),
        ("The answer is 72", "72", 0.0),  # no "####": strict gives nothing
        ("#### 72\n#### 73", "72", 0.0),  # the last "####" counts: 73
        ("####1,000", "1000", 1.0),  # no space needed; commas removed
        ("#### 18.99", "18", 1.0),  # the regex stops at "." -> 18
    ],
)
def test_gsm8k_strict_reward(completion, gold, expected):
    assert gsm8k_strict_reward([_chat(completion)], [gold]) == [expected]


# ---------------------------------------------------------------- arithmetic rewards


@pytest.mark.parametrize(
    "completion, correct, fmt",
    [
        ("19", 1.0, 0.2),  # bare and right
        ("19.", 1.0, 0.2),  # a trailing period is still a bare number
        ("7 + 12 = 19", 0.5, 0.1),  # right answer, not first; starts with a number
        ("The answer is 19.", 1.0, 0.0),  # first number is the answer; does not start with a number
        ("20", 0.0, 0.2),  # bare but wrong: format credit only
        ("Nineteen", 0.0, 0.0),
        ("119", 0.0, 0.2),  # whole-number match only: 119 is not 19
    ],
)
def test_arithmetic_rewards(completion, correct, fmt):
    assert arithmetic_correct_reward([_chat(completion)], ["19"]) == [correct]
    assert arithmetic_format_reward([completion]) == [fmt]


def test_completion_text_rejects_other_types():
    assert completion_text(_chat("hi")) == "hi"
    with pytest.raises(ValueError, match="string or a list of chat messages"):
        completion_text(42)


# ---------------------------------------------------------------- arithmetic data


def test_arithmetic_is_deterministic_and_correct():
    a = load_arithmetic(num_examples=50, seed=3, max_operand=10, operations="+-")
    b = load_arithmetic(num_examples=50, seed=3, max_operand=10, operations="+-")
    c = load_arithmetic(num_examples=50, seed=4, max_operand=10, operations="+-")
    assert a.to_list() == b.to_list()
    assert a.to_list() != c.to_list()
    assert a.column_names == ["prompt", "answer"]
    for row in a:
        assert row["prompt"][0] == {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
        x, op, y = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", row["prompt"][1]["content"]).groups()
        x, y = int(x), int(y)
        assert 1 <= x <= 10 and 1 <= y <= 10
        assert int(row["answer"]) == (x + y if op == "+" else x - y) >= 0  # subtraction keeps a >= b


def test_arithmetic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="allowed operators"):
        load_arithmetic(operations="*")
    with pytest.raises(ValueError, match="num_examples"):
        load_arithmetic(num_examples=0)


# ---------------------------------------------------------------- registry


def test_load_task_registry_and_errors():
    assert set(TASKS) == {"gsm8k", "arithmetic"}
    dataset, rewards = load_task("arithmetic", num_examples=8, seed=0)
    assert len(dataset) == 8
    assert [f.__name__ for f in rewards] == ["arithmetic_correct_reward", "arithmetic_format_reward"]
    with pytest.raises(ValueError, match="allowed: gsm8k, arithmetic"):
        load_task("math")
    with pytest.raises(ValueError, match="does not take dataset_path"):
        load_task("arithmetic", dataset_path="x.jsonl")
    with pytest.raises(ValueError, match="allowed: lenient, strict"):
        load_task("gsm8k", dataset_path="x.jsonl", reward="exact")


# ---------------------------------------------------------------- GSM8K data


def test_gsm8k_from_tmp_jsonl(tmp_path):
    rows = [{"question": "What is 1000 + 234?", "answer": "1000 + 234 = 1234\n#### 1,234"}]
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    dataset, rewards = load_task("gsm8k", dataset_path=str(tmp_path), split="test", reward="strict")
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset[0]["prompt"] == [
        {"role": "system", "content": GSM8K_SYSTEM_PROMPT},
        {"role": "user", "content": "What is 1000 + 234?"},
    ]
    assert dataset[0]["answer"] == "1234"
    assert rewards == [gsm8k_strict_reward]


def test_gsm8k_missing_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GSM8K file"):
        load_gsm8k(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="allowed: train, test"):
        load_gsm8k(str(tmp_path), split="validation")


def test_gsm8k_offline_error_says_how_to_get_the_data(monkeypatch):
    from grpo_ratio.tasks import gsm8k

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(gsm8k, "load_dataset", offline)
    with pytest.raises(OSError) as err:
        load_gsm8k(split="test")  # no dataset_path: the hub id, as the recipes do
    message = str(err.value)
    assert "openai/gsm8k" in message and "OfflineModeIsEnabled" in message
    assert "from the Hub: with network access" in message and "HF_HUB_OFFLINE" in message
    assert "--dataset_path FOLDER_OR_JSONL" in message and "to_json('gsm8k/test.jsonl')" in message


@pytest.mark.skipif(not SHARED_GSM8K.is_dir(), reason="needs ../shared/data/gsm8k")
def test_gsm8k_from_shared_jsonl():
    full = load_gsm8k(str(SHARED_GSM8K / "train.jsonl"))
    assert len(full) == 7473  # wc -l shared/data/gsm8k/train.jsonl
    assert full[0]["prompt"][1]["content"].startswith("Natalia sold clips to 48 of her friends")
    assert full[0]["answer"] == "72"  # "... #### 72"
    subset = load_gsm8k(str(SHARED_GSM8K), split="train", num_examples=16, seed=0)
    assert len(subset) == 16
    assert subset.to_list() == load_gsm8k(str(SHARED_GSM8K), num_examples=16, seed=0).to_list()  # seeded shuffle
