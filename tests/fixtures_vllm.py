"""A fake of the vLLM output types that grpo_ratio reads, so the vLLM paths are tested without vLLM (a CUDA-only,
torch-pinning optional extra).

Field names and order follow vLLM's own definitions:
- `CompletionOutput`, `RequestOutput`: vllm-project/vllm `vllm/outputs.py` (read at commit 003d3ee2). CompletionOutput
  is a dataclass `index, text, token_ids, cumulative_logprob, logprobs, routed_experts=None, finish_reason=None,
  stop_reason=None, lora_request=None, ...`; RequestOutput takes `request_id, prompt, prompt_token_ids,
  prompt_logprobs, outputs, finished, metrics=None, ...`. (The brief listed RequestOutput without
  `prompt_logprobs`; vLLM has it between `prompt_token_ids` and `outputs`.)
- `sampling_mask: SamplingMask | None = None` on CompletionOutput and `SamplingMask(token_ids: list[list[int]])`:
  vLLM 0.28+ / 0.33 with the engine flag `return_sampling_mask` (shared/reference/trl_grpo_internals.md section 8,
  read from the vllm 0.33.0 wheel; the stored upstream snapshot predates the field, so it was also checked in a
  vendored copy of vllm/outputs.py: "Each inner list contains the vocabulary token IDs that survived top-k / top-p /
  min-p filtering for the corresponding generated token").
- `SamplingMaskCSR(token_ids, offsets)`: the CSR layout described for vLLM PR #49577 (Mask Replay): flat kept ids plus
  num_tokens + 1 offsets (seed notes 1(c): "PR #49577 describes CSR (`token_ids` flat + `offsets`)").
- `Logprob(logprob, rank=None, decoded_token=None)`: vllm-project/vllm `vllm/logprobs.py` (older releases:
  `vllm/sequence.py`); `CompletionOutput.logprobs` is a list, one `{token_id: Logprob}` dict per generated token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SamplingMask:
    token_ids: list[list[int]]


@dataclass
class SamplingMaskCSR:
    token_ids: list[int]
    offsets: list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    sampling_mask: SamplingMask | SamplingMaskCSR | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 prompt_logprobs: list | None, outputs: list[CompletionOutput], finished: bool, metrics=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics


def completion(index: int, token_ids: list[int], kept: list[list[int]], csr: bool = False) -> CompletionOutput:
    """A finished CompletionOutput whose sampling_mask holds `kept` (one list per token), nested or CSR."""
    if csr:
        offsets = [0]
        for cell in kept:
            offsets.append(offsets[-1] + len(cell))
        mask = SamplingMaskCSR(token_ids=[i for cell in kept for i in cell], offsets=offsets)
    else:
        mask = SamplingMask(token_ids=kept)
    logprobs = [{t: Logprob(logprob=-0.5, rank=1)} for t in token_ids]
    return CompletionOutput(index=index, text="", token_ids=token_ids, cumulative_logprob=-0.5 * len(token_ids),
                            logprobs=logprobs, finish_reason="stop", sampling_mask=mask)
