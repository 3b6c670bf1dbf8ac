"""Helpers shared by the task reward functions."""

from __future__ import annotations


def completion_text(completion) -> str:
    """The text of one completion as TRL passes it to reward functions: a string (standard prompts) or a list of
    messages whose last one is the assistant's reply (conversational prompts).

    Raises:
        ValueError: anything else (the message names the type received).
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    raise ValueError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}: {completion!r}"
    )
