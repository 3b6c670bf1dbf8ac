"""Shared fixtures: offline, CPU, tiny models. Run: pytest (default, excludes slow) or pytest -m slow."""

import os


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


# ci_guard: under CI=true a session whose tests were all skipped fails; pytester: tests/test_ci_guard.py runs pytest
pytest_plugins = ["ci_guard", "pytester"]


@pytest.fixture
def tiny_tok():
    from grpo_ratio.testing import tiny_tokenizer

    return tiny_tokenizer()
