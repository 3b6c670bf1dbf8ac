"""vLLM server mode: the server's `--logprobs-mode` where the run computes with the sampler's log-probs.

TRL's own `VLLMClient` (trl/generation/vllm_client.py) talks to a stub HTTP server on loopback that answers what TRL
asks when a trainer starts (`/health`, `/v1/models`, `/server_info`): no vLLM engine, so the check runs in the default
suite. Without vLLM installed TRL's client refuses to be built (`is_vllm_available()`); the tests lift that check and
TRL's NCCL weight-transfer set-up (`init_communicator`), which only a CUDA trainer can open. The same refusal against
a real `vllm serve` runs in the vLLM lane (tests/vllm_lane/test_vllm_server.py).

Run: pytest tests/test_vllm_server_checks.py
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from trainer_fixtures import tiny_grpo_args
from vllm_stub_server import StubServer


@pytest.fixture
def trl_client_without_vllm(monkeypatch):
    """TRL's real VLLMClient and VLLMGeneration, with vLLM's availability check and the NCCL set-up lifted."""
    import trl.generation.vllm_client as vllm_client
    import trl.generation.vllm_generation as vllm_generation

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda: True)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda: True)
    monkeypatch.setattr(vllm_client.VLLMClient, "init_communicator", lambda self, device=0: None)
    return vllm_client.VLLMClient


def _trainer_view(args, client):
    """What `check_server_logprobs` reads of a trainer: its args, TRL's client, accelerate's process count."""
    return SimpleNamespace(args=args, vllm_generation=SimpleNamespace(vllm_client=client),
                           accelerator=SimpleNamespace(num_processes=1))


def _server_args(tmp_path, url, **overrides):
    return tiny_grpo_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, **overrides)


# the three settings that compute with the sampler's log-probs; is_correction needs TRL's vLLM correction on
USES = [
    (dict(old_logprob_mode="sampler"), "old_logprob_mode='sampler'"),
    (dict(top_p=0.8, truncation_correction="lift_sampler"), "truncation_correction='lift_sampler'"),
    (dict(is_correction="icepop"), "is_correction='icepop'"),
]


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "raw_logits", "processed_logits"])
@pytest.mark.parametrize("overrides,named", USES)
def test_a_server_without_processed_logprobs_is_refused(trl_client_without_vllm, tmp_path, overrides, named,
                                                        logprobs_mode):
    from grpo_ratio.checks import check_server_logprobs

    sampler_arm = "old_logprob_mode" in overrides
    with pytest.warns(UserWarning) if sampler_arm else contextlib.nullcontext():  # TRL's IS correction turned off
        args = _server_args(tmp_path, "http://127.0.0.1:1", **overrides)
    with StubServer(logprobs_mode) as server:
        client = trl_client_without_vllm(base_url=server.url)
        with pytest.raises(ValueError, match=f"runs with --logprobs-mode {logprobs_mode}") as refused:
            check_server_logprobs(_trainer_view(args, client))
    assert named in str(refused.value) and "--logprobs-mode processed_logprobs" in str(refused.value)
    assert "/server_info" in server.paths


@pytest.mark.parametrize("overrides,named", USES)
def test_a_server_with_processed_logprobs_passes(trl_client_without_vllm, tmp_path, overrides, named):
    from grpo_ratio.checks import check_server_logprobs

    sampler_arm = "old_logprob_mode" in overrides
    with pytest.warns(UserWarning) if sampler_arm else contextlib.nullcontext():  # TRL's IS correction turned off
        args = _server_args(tmp_path, "http://127.0.0.1:1", **overrides)
    with StubServer("processed_logprobs") as server:
        check_server_logprobs(_trainer_view(args, trl_client_without_vllm(base_url=server.url)))


def test_the_server_is_not_asked_where_no_sampler_logprobs_are_used(trl_client_without_vllm, tmp_path):
    # TRL's defaults (its own IS correction reads the mode itself and only warns) and renormalize: not our check
    from grpo_ratio.checks import check_server_logprobs

    with StubServer("raw_logprobs") as server:
        client = trl_client_without_vllm(base_url=server.url)
        for overrides in (dict(), dict(top_p=0.8, truncation_correction="renormalize")):
            check_server_logprobs(_trainer_view(_server_args(tmp_path, server.url, **overrides), client))
        assert "/server_info" not in server.paths


def test_the_trainer_refuses_a_raw_logprobs_server_at_start(trl_client_without_vllm, tmp_path):
    # the whole start-up: TRL's VLLMGeneration builds its client against the stub, then the trainer asks the server
    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer

    with StubServer("raw_logprobs") as server:
        with pytest.warns(UserWarning, match="vllm_importance_sampling_correction turned off"):
            args = _server_args(tmp_path, server.url, old_logprob_mode="sampler")
        with pytest.raises(ValueError, match=r"old_logprob_mode='sampler' computes with the vLLM server's sampler "
                                             r"log-probs, but the server at .* runs with --logprobs-mode raw_logprobs"):
            RatioGRPOTrainer(model=tiny_model("qwen2"), reward_funcs=letter_reward, args=args,
                             train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer())
    assert server.paths.count("/server_info") == 1  # asked once, by the check (TRL's IS correction is off)
