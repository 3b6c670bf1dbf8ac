"""GSM8K (grade-school math word problems) with the prompt, gold answers and rewards of the GRPO runs of the
batch-logprob-gap report (github.com/GuoCheng24/batch-logprob-gap).

- Data: a local JSONL file or folder (`{split}.jsonl`, fields `question`/`answer`), else the hub id `openai/gsm8k`
  (config "main") through `datasets`.
- Prompt: `[{"role": "system", "content": GSM8K_SYSTEM_PROMPT}, {"role": "user", "content": question}]`.
- Gold: `answer.split("####")[-1].strip().replace(",", "")`.
- Rewards (1.0 / 0.0): `gsm8k_lenient_reward` (the report's default) and `gsm8k_strict_reward`.
"""

from __future__ import annotations

import re
from pathlib import Path

from datasets import Dataset, load_dataset

from .rewards import completion_text


GSM8K_HUB_ID = "openai/gsm8k"
GSM8K_SYSTEM_PROMPT = "Solve the problem. Reason briefly, then give the final integer answer on its own line in the form '#### <number>'."
SPLITS = ("train", "test")
_LENIENT_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")
_STRICT_ANSWER = re.compile(r"####\s*(-?\d[\d,]*)")


def gold_answer(answer: str) -> str:
    """The gold integer of a GSM8K `answer` field, as a string without thousands separators ("1,000" -> "1000")."""
    return answer.split("####")[-1].strip().replace(",", "")


def _to_prompt(row: dict) -> dict:
    return {
        "prompt": [
            {"role": "system", "content": GSM8K_SYSTEM_PROMPT},
            {"role": "user", "content": row["question"]},
        ],
        "answer": gold_answer(row["answer"]),
    }


def _hub_message(split: str, err: Exception) -> str:
    """Why GSM8K could not be loaded from the hub, and the two ways to get it."""
    reason = str(err).splitlines()[0] if str(err) else type(err).__name__
    return (
        f"Cannot load GSM8K ({GSM8K_HUB_ID!r}, config 'main', split {split!r}) from the Hugging Face Hub or the "
        f"datasets cache: {reason}\nTo get it:\n"
        f"  - from the Hub: with network access and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE unset, the first run "
        f"downloads it (a few MB) into the datasets cache (HF_HOME, default ~/.cache/huggingface); later runs, "
        f"offline too, reuse it\n"
        f"  - a local copy: --dataset_path FOLDER_OR_JSONL (dataset_path= in Python), a folder holding "
        f"train.jsonl/test.jsonl or one .jsonl file with fields 'question' and 'answer'; on a machine with access, "
        f"`python -c \"from datasets import load_dataset; load_dataset('{GSM8K_HUB_ID}', 'main', split='{split}')"
        f".to_json('gsm8k/{split}.jsonl')\"` writes one"
    )


def _read_raw(dataset_path: str | None, split: str) -> Dataset:
    if dataset_path is None:
        try:
            return load_dataset(GSM8K_HUB_ID, "main", split=split)
        except Exception as err:  # offline, no network, no cache: say how to get the data
            raise OSError(_hub_message(split, err)) from err
    path = Path(dataset_path).expanduser()
    file = path / f"{split}.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"dataset_path={dataset_path!r}: no GSM8K file at {str(file)!r}; expected a .jsonl file with fields "
            f"'question' and 'answer', or a folder holding {split}.jsonl. Pass --dataset_path <your GSM8K folder or "
            f".jsonl>, or remove dataset_path to load openai/gsm8k from the Hugging Face Hub"
        )
    return load_dataset("json", data_files=str(file), split="train")  # a single-file json dataset has split "train"


def load_gsm8k(
    dataset_path: str | None = None, split: str = "train", num_examples: int | None = None, seed: int = 0
) -> Dataset:
    """GSM8K as a `datasets.Dataset` with columns `prompt` (system + user chat messages) and `answer` (gold string).

    Args:
        dataset_path: a JSONL file, or a folder holding `{split}.jsonl`; None loads `openai/gsm8k` from the hub.
        split: "train" or "test".
        num_examples: keep this many rows after shuffling with `seed` (the report's GRPO runs used 2048, seed 0);
            None keeps every row in file order.
        seed: shuffle seed used with `num_examples`.

    Raises:
        ValueError: `split` not in SPLITS, `num_examples` < 1, or the rows lack `question`/`answer`.
        FileNotFoundError: `dataset_path` does not lead to a file.
        OSError: no `dataset_path` and the hub is unreachable.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not a GSM8K split; allowed: {', '.join(SPLITS)}")
    if num_examples is not None and num_examples < 1:
        raise ValueError(f"num_examples must be >= 1 (or None for all rows), got {num_examples}")
    raw = _read_raw(dataset_path, split)
    missing = {"question", "answer"} - set(raw.column_names)
    if missing:
        raise ValueError(
            f"GSM8K rows need fields 'question' and 'answer'; missing {sorted(missing)} in {dataset_path!r}"
        )
    if num_examples is not None:
        raw = raw.shuffle(seed=seed).select(range(min(num_examples, len(raw))))
    mapped = raw.map(_to_prompt, remove_columns=[c for c in raw.column_names if c != "answer"])
    return mapped.select_columns(["prompt", "answer"])


def _integer_part(number: str) -> str:
    # "1,234." -> "1234"; "18.99" -> "18" (the report's lenient rule compares the integer part only)
    return number.replace(",", "").rstrip(".").split(".")[0]


def gsm8k_lenient_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last number (regex `-?\\d[\\d,]*\\.?\\d*`, commas removed, trailing "." stripped,
    integer part only, so "18.99" counts as 18) equals the gold `answer` string, else 0.0. The report's default."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        numbers = _LENIENT_NUMBER.findall(completion_text(completion))
        rewards.append(float(bool(numbers) and _integer_part(numbers[-1]) == gold))
    return rewards


def gsm8k_strict_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last `#### <integer>` of the completion (regex `####\\s*(-?\\d[\\d,]*)`, commas removed) equals
    the gold `answer` string, else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        matches = _STRICT_ANSWER.findall(completion_text(completion))
        rewards.append(float(bool(matches) and matches[-1].replace(",", "") == gold))
    return rewards


GSM8K_REWARDS = {"lenient": gsm8k_lenient_reward, "strict": gsm8k_strict_reward}
