"""The kept-set log-probs of TRL's own forward through the LM head: the truncation corrections inside the trainer.

The math is `grpo_ratio.corrections.kept_logprobs` (one implementation per correction, also what the tests call); this module
feeds it from the trainer's forward passes. TRL's fused head never builds logits, so the kept-set log-probs come
from the backbone's last hidden state (captured by a forward hook during TRL's own call) through the LM head: TRL's
forward is neither copied nor repeated. No (b, T, V) logits are built either: the head is applied to K cells at a
time (`corrections.kept_logprobs.HeadLogits`), and under autograd (the training forward's log-probs over S) each
chunk is recomputed in backward (`RecomputedCells`), so what stays alive for backward is the hidden states, not a
(K, V) fp32 copy per chunk.

Both corrections make r_old/sampler = p_old,S(g) / q_S(g); they differ in the policy-gradient target
(docs/truncation.md):
- `renormalize`: old and new log-probs both over S (DeepSeek-V3.2, "Keep Sampling Mask", arXiv 2512.02556);
- `lift_sampler`: the trainer keeps full-vocabulary log-probs; the sampler's get + log M_old (TRL PR #7269, verl
  support-size replay).

Shapes: B = sequences, P = prompt tokens, T = completion tokens, H = hidden size, V = vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from trl.trainer.utils import maybe_gather_lm_head_ctx

from ..corrections.kept_logprobs import HeadLogits, KeptLogprobs, concat_kept_logprobs, logprobs_on_kept_sets
from ..corrections.kept_sets import KeptSets, SamplingSettings
from ..corrections.processors import RepetitionPenalty
from .adapters import base_model
from .forward import patched_forward


@contextlib.contextmanager
def capture_last_hidden(model: nn.Module, on_chunk=None):
    """Collect the decoder's last hidden state (b, P+T, H) of every forward within the block (one per chunk); with
    `on_chunk`, hand each to `on_chunk(hidden)` as the decoder returns it instead (outside autocast, as after the
    forward), keeping none: one chunk's hidden states alive at a time (`KeptSetChunks.add`, in no-grad passes)."""
    base = base_model(model)
    captured: list[torch.Tensor] = []

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        if on_chunk is None:
            captured.append(hidden)
            return
        with torch.autocast(hidden.device.type, enabled=False):  # what the code after the forward runs under
            on_chunk(hidden)

    handle = base.get_decoder().register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def head_logits(model: nn.Module, hidden: torch.Tensor, fp32_head: bool, autocast_ctx) -> HeadLogits:
    """The logits (B, T, V) of `hidden` (B, T, H) through the model's LM head, as `HeadLogits` (computed K cells at a
    time, differentiable in the hidden states and the head's parameters): in fp32 outside autocast with `fp32_head`
    (TRL's `cast_lm_head_to_fp32`: `F.linear` of the fp32 input, weight and bias), else the head under the trainer's
    autocast (`autocast_ctx()`), as the head computes them in the model's forward."""
    head = base_model(model).get_output_embeddings()
    device = hidden.device.type
    if fp32_head or type(head) is nn.Linear:
        params = (head.weight,) if head.bias is None else (head.weight, head.bias)

        def project(h, weight, bias=None):  # (K, H) -> (K, V)
            if not fp32_head:
                with autocast_ctx():
                    return F.linear(h, weight, bias)
            with torch.autocast(device, enabled=False):
                return F.linear(h.float(), weight.float(), None if bias is None else bias.float())

        return HeadLogits(hidden, project, head.weight.shape[0], params)
    names, params = zip(*head.named_parameters(), strict=True)  # a head that is not one linear map (PEFT, ...)

    def project_module(h, *weights):  # (K, H) -> (K, V), the head's own forward on the given parameters
        with autocast_ctx():
            return torch.func.functional_call(head, dict(zip(names, weights, strict=True)), (h,))

    vocab_size = getattr(head, "out_features", None) or base_model(model).config.get_text_config().vocab_size
    return HeadLogits(hidden, project_module, vocab_size, params)


def kept_set_logps_from_hidden(model: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                               kept: KeptSets | SamplingSettings, temperature: float, fp32_head: bool, autocast_ctx,
                               mask: torch.Tensor, penalty: RepetitionPenalty | None = None) -> KeptLogprobs:
    """Log-probs of `tokens` renormalised over their kept sets, from hidden states through the model's LM head.

    Args:
        model: the causal LM whose head (`get_output_embeddings()`) projects `hidden`.
        hidden: (B, T, H) hidden states at the positions predicting the T completion tokens (grad flows through, to
            them and to the head's parameters; recomputed chunk by chunk in backward).
        tokens: (B, T) completion ids.
        kept: (B, T) kept sets (empty cells = padding, skipped), or the sampler's `SamplingSettings` that recompute them from
            these logits (the "recompute" kept-set source).
        temperature: TRL's `temperature`.
        fp32_head: project in fp32 outside autocast (TRL's `cast_lm_head_to_fp32`), else under `autocast_ctx`.
        autocast_ctx: zero-argument callable returning the trainer's autocast context.
        mask: (B, T) bool completion tokens.
        penalty: the sampler's repetition penalty over the same rows (`grpo_ratio.corrections.processors`), or None.
    Returns:
        `KeptLogprobs`: (B, T) fp32 log-probs over S (0.0 where the cell has no kept set), the sets, the additions.
    Raises:
        ValueError: a sampled token outside its kept set ("inconsistent rollout", naming row and position).
    """
    head = base_model(model).get_output_embeddings()

    def on_kept(h: torch.Tensor) -> KeptLogprobs:
        logits = head_logits(model, h, fp32_head, autocast_ctx)  # (B, T, V), never built whole
        return logprobs_on_kept_sets(logits, tokens, kept, temperature, mask, penalty)

    if not is_zero3_partitioned(head):
        return on_kept(hidden)
    # DeepSpeed ZeRO-3: outside its forward the head's weight is an empty partition (TRL's fused head gathers it,
    # `trl.trainer.utils.maybe_gather_lm_head_ctx`). Without autograd one gather around the whole computation (one
    # collective per call on every rank, whatever its number of cells); under autograd the computation runs as the
    # head's own forward, so ZeRO-3 gathers the head there and again before its backward (where `RecomputedCells`
    # recomputes each chunk from it) and reduces its gradient as a module's
    if not (torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))):
        with maybe_gather_lm_head_ctx(*head.parameters()):
            return on_kept(hidden)
    result: list[KeptLogprobs] = []

    def head_forward(h: torch.Tensor) -> torch.Tensor:  # (B, T): only tensors leave a ZeRO-3 module's forward
        result.append(on_kept(h))
        return result[0].logps

    with patched_forward(head, head_forward):
        logps = head(hidden)  # (B, T) fp32, hooked by ZeRO-3 for the backward
    return dataclasses.replace(result[0], logps=logps)


def is_zero3_partitioned(module: nn.Module) -> bool:
    """Whether `module`'s parameters are DeepSpeed ZeRO-3 partitions (they carry `ds_id`; empty outside a forward)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


class KeptSetChunks:
    """`kept_set_logps_from_hidden` over the forward chunks of one TRL call, one chunk at a time (as TRL's forward ran
    them), concatenated along rows: no tensor spans the whole generation batch's (B, T, H) hidden states, let alone
    its (B, T, V) logits. `add` each chunk's (rows, P+T, H) last hidden state in row order, as it comes
    (`capture_last_hidden(model, on_chunk=chunks.add)`: then no chunk's hidden state outlives its forward), then
    `result()`.

    Args:
        model: the causal LM (unwrapped).
        input_ids, attention_mask: (B, P+T) of the call; `logits_to_keep`: T.
        kept: (B, T) kept sets, or the sampler's `SamplingSettings` (recomputed per chunk).
        temperature, fp32_head, autocast_ctx: as `kept_set_logps_from_hidden`.
        penalty: the sampler's repetition penalty over the B rows, or None.
    """

    def __init__(self, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                 kept: KeptSets | SamplingSettings, temperature: float, fp32_head: bool, autocast_ctx,
                 penalty: RepetitionPenalty | None = None):
        self.model, self.kept, self.penalty, self.T = model, kept, penalty, logits_to_keep
        self.num_rows = input_ids.size(0)
        self.tokens, self.mask = input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:].bool()  # (B, T)
        self.settings = (temperature, fp32_head, autocast_ctx)
        self.parts: list[KeptLogprobs] = []
        self.start = 0

    def add(self, hidden: torch.Tensor) -> None:
        """The kept-set log-probs of the next chunk's rows from its last hidden state (rows, P+T, H).

        Raises:
            ValueError: as `kept_set_logps_from_hidden`.
        """
        rows = slice(self.start, self.start + hidden.size(0))
        self.start = rows.stop
        T, (temperature, fp32_head, autocast_ctx) = self.T, self.settings
        kept = self.kept if not isinstance(self.kept, KeptSets) else self.kept.select_rows(range(rows.start, rows.stop))
        self.parts.append(kept_set_logps_from_hidden(
            self.model, hidden[:, -T - 1:-1], self.tokens[rows], kept, temperature, fp32_head, autocast_ctx,
            self.mask[rows], None if self.penalty is None else self.penalty.rows(rows)))  # the positions predicting T

    def result(self) -> KeptLogprobs:
        """`KeptLogprobs` (B, T) of the chunks added (`log_mass` unset).

        Raises:
            RuntimeError: the chunks do not add up to the call's B rows.
        """
        if self.start != self.num_rows:
            raise RuntimeError(f"grpo_ratio: the forward's chunks cover {self.start} rows, the call has {self.num_rows}")
        return concat_kept_logprobs(self.parts)


def kept_set_logps_of_chunks(model: nn.Module, hidden: list[torch.Tensor], input_ids: torch.Tensor,
                             attention_mask: torch.Tensor, logits_to_keep: int, kept: KeptSets | SamplingSettings,
                             temperature: float, fp32_head: bool, autocast_ctx,
                             penalty: RepetitionPenalty | None = None) -> KeptLogprobs:
    """`KeptSetChunks` over hidden states already collected (`capture_last_hidden` without `on_chunk`: per forward
    chunk, in row order, (rows, P+T, H)). Arguments as `KeptSetChunks`.

    Returns:
        `KeptLogprobs` (B, T) (`log_mass` unset).
    Raises:
        RuntimeError: the chunks do not add up to the call's B rows.
        ValueError: as `kept_set_logps_from_hidden`.
    """
    chunks = KeptSetChunks(model, input_ids, attention_mask, logits_to_keep, kept, temperature, fp32_head,
                           autocast_ctx, penalty)
    for h in hidden:
        chunks.add(h)
    return chunks.result()
