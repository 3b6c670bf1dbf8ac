"""Shared fixtures: offline, CPU, tiny models. Run: pytest (default, excludes slow) or pytest -m slow."""

import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture
def tiny_tok():
    from grpo_ratio.testing import tiny_tokenizer

    return tiny_tokenizer()
