"""`fp32_head` without a pass of the body: the old log-probs of each loss micro-batch from its own training forward.

In TRL's on-policy default (`num_iterations=1`, `steps_per_generation` = gradient accumulation, no vLLM importance-
sampling correction) TRL runs no old pass: the old policy is the policy of the training forward, whose log-probs TRL
uses detached. `fp32_head`'s old log-probs are the same bf16 body followed by the final norm and LM head in fp32, so
the body need not run twice: a forward pre-hook on the final norm keeps the input the training forward hands it
(b, P+T, H), and `OldLogprobScorer.head_logprobs` applies the fp32 norm and head to it, detached, over the same T + 1
positions as the separate pass. Cost: one fp32 norm and head matmul per micro-batch; no pass of the body. The head is
applied in TRL's tiles (`grpo_ratio.old_pass.forward.HeadProjection`, TRL's `ChunkedLogProbFunction`), as in the
separate pass: no (b, T + 1, V) logits while the training forward's activations are alive.

Where the two cannot be equal the trainer keeps the separate pass (`fused_head_fallback` names why, logged once):
dropout in the training forward, a head that is not a plain `nn.Linear` or logits transformed after it, a decoder
that does not return the norm's output (a probe forward of two tokens at start-up), a sharded engine, TRL running its
own old pass (then the mode replaces it: nothing to save), a truncation correction (its kept sets and log M_old come
from the old pass's full logits). Equality is checked on a CPU, not assumed: tests/test_fused_head.py (tiny dense
models, `torch.equal` against the separate pass) and tests/test_smollm2.py (SmolLM2-135M, slow). On a GPU it is not
shown: the training forward (with grad) and the no-grad separate pass may pick different attention and matmul kernels
for the body. The fp32 norm and head run in IEEE fp32 on both paths (`ieee_fp32`), whatever TF32 setting the run has.

Shapes: b = rows of a micro-batch, P = prompt tokens, T = completion tokens, H = hidden size.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from ..modes import FP32_HEAD
from .adapters import base_model
from .forward import active_dropout, eval_mode, logit_transforms, model_anatomy


logger = logging.getLogger("grpo_ratio")


def fused_head_fallback(args, policy: nn.Module, engine: str | None, trl_runs_old_pass: bool) -> str | None:
    """Why `fp32_head` must keep its separate old pass in this run, or None when the fused path applies.

    Args:
        args: the trainer's `RatioGRPOConfig`.
        policy: the unwrapped policy, after TRL's `__init__` (which applied `disable_dropout`).
        engine: `grpo_ratio.old_pass.sharding.engines.engine_of(accelerator)`: "fsdp2", "zero3", "fsdp1", or "none" (one process,
            DDP, DeepSpeed ZeRO-0/1/2: every rank holds whole weights; None is read as "none").
        trl_runs_old_pass: TRL 1.16's own condition for an old pass (`RatioGRPOTrainer._trl_runs_old_pass`).
    Returns:
        A sentence naming the reason (for the log), or None.
    """
    if args.old_logprob_mode != FP32_HEAD.name:
        return "not fp32_head"
    if trl_runs_old_pass:
        return ("TRL runs its own old pass here (GRPO: num_iterations > 1, steps_per_generation > gradient "
                "accumulation, or vLLM importance-sampling correction; RLOO: always): the old policy is not the "
                "training forward's, and the mode's pass replaces TRL's")
    if engine not in (None, "none"):
        return f"sharded engine ({engine}): the fp32 norm and head are gathered only inside the engine's scoring pass"
    if args.truncation_correction != "none":
        return (f"truncation_correction={args.truncation_correction!r}: the kept sets and log M_old come from the "
                f"old pass's full logits")
    if getattr(args, "is_correction", None) is not None:
        return (f"is_correction={args.is_correction!r}: the IS weight is computed from the old log-probs of the whole "
                f"generation batch before any training forward")
    if getattr(args, "ratio_full_vocab", False):
        return "ratio_full_vocab=True: the exact full-vocabulary divergences need the mode's own pass"
    dropout = active_dropout(policy)
    if dropout:
        return (f"dropout is active in the training forward ({', '.join(dropout)}); the old log-probs are scored "
                f"without it")
    head = model_anatomy(policy).head
    if type(head) is not nn.Linear:
        return f"the LM head is a {type(head).__name__}, not a plain nn.Linear"
    transformed = logit_transforms(base_model(policy).config)
    if transformed:
        return f"the logits are transformed after the LM head ({', '.join(transformed)})"
    if not norm_is_last(policy):
        return "the decoder does not return the final norm's output (something runs between the norm and the head)"
    return None


def norm_is_last(policy: nn.Module) -> bool:
    """Whether the decoder returns the output of the final norm `model_anatomy` finds, itself: then the norm's input
    plus the fp32 norm and head are the whole rest of the forward. One probe forward of the decoder on two tokens,
    without grad and in eval mode (no random number is drawn)."""
    base = base_model(policy)
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(base.parameters()).device)  # (1, 2)
    with torch.no_grad(), eval_mode(base), capture_norm_inputs(policy) as record:
        base.get_decoder()(input_ids=ids, use_cache=False)
    return record.is_complete()


@dataclass
class NormInputs:
    """What one training-forward call handed the final norm, chunk by chunk.

    Fields:
        hidden (`list[torch.Tensor]`): per forward chunk, the norm's input (b, P+T, H), detached.
        norm_is_last (`list[bool]`): per chunk, whether the decoder returned the norm's output itself (so the norm is
            the last module before the head, where `model_anatomy` found it).
    """

    hidden: list[torch.Tensor] = field(default_factory=list)
    norm_is_last: list[bool] = field(default_factory=list)
    _last_output: object = None

    def is_complete(self) -> bool:
        """One norm input per decoder forward, each the decoder's last step."""
        return bool(self.hidden) and len(self.hidden) == len(self.norm_is_last) and all(self.norm_is_last)


@contextlib.contextmanager
def capture_norm_inputs(model: nn.Module):
    """Within the block, record every forward's final-norm input and whether the decoder returned the norm's output.

    The hooks (a pre-hook and a hook on the norm, a hook on the decoder) are removed after the block.
    """
    base = base_model(model)
    norm, decoder = model_anatomy(base).norm, base.get_decoder()
    record = NormInputs()

    def before_norm(module, args):
        record.hidden.append(args[0].detach())

    def after_norm(module, args, output):
        record._last_output = output

    def after_decoder(module, args, output):
        last = output[0] if isinstance(output, tuple) else output.last_hidden_state
        record.norm_is_last.append(last is record._last_output)
        record._last_output = None

    handles = [norm.register_forward_pre_hook(before_norm), norm.register_forward_hook(after_norm),
               decoder.register_forward_hook(after_decoder)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


def say_fused_head(plan) -> None:
    """One log line (logger `grpo_ratio`) under `fp32_head`: the fused path, or the separate pass and why. A warning
    where the separate pass costs a body pass the fused path would save; info where TRL runs its own old pass (the
    mode's pass replaces it: nothing to save)."""
    if plan.scorer_mode != FP32_HEAD.name:
        return
    if plan.fused_head:
        logger.info("fp32_head: old log-probs from each micro-batch's own training forward (fp32 final norm and LM "
                    "head on its hidden states); no pass of the body")
    elif plan.trl_old_pass:
        logger.info(f"fp32_head: separate old pass in place of TRL's ({plan.fused_head_fallback})")
    else:
        logger.warning(f"fp32_head: one more no-grad pass of the body per generation batch, because "
                       f"{plan.fused_head_fallback}")


def fused_old_logps(scorer, norm_inputs: NormInputs, completion_ids: torch.Tensor, temperature: float,
                    version: int) -> torch.Tensor:
    """`fp32_head` without a body pass: a micro-batch's old log-probs (b, T) fp32 from its own training forward,
    the fp32 norm and head on each forward chunk's final-norm input (`OldLogprobScorer.head_logprobs`), detached.

    They reach TRL's loss through the micro-batch inputs: TRL 1.16's `_compute_loss` calls
    `_get_per_token_logps_and_entropies` (this training forward) first and reads `inputs.get(
    "old_per_token_logps")` only after it returns (grpo_trainer.py, `_compute_loss`; read in the installed 1.16.0).
    In the on-policy default every micro-batch of a generation runs before the optimizer step, so the weights of
    this forward are the old policy's.

    Args:
        scorer: the trainer's `OldLogprobScorer` in `fp32_head` mode.
        norm_inputs: what `capture_norm_inputs` recorded during the training forward.
        completion_ids: (b, T) int64, the micro-batch's completion tokens.
        temperature: TRL's `temperature`.
        version: the policy's `WeightsVersion` value.
    Raises:
        RuntimeError: the forward did not hand the final norm one input per chunk, as the start-up probe saw it.
    """
    if not norm_inputs.is_complete():
        raise RuntimeError("grpo_ratio: fp32_head's fused path saw no final-norm input per forward chunk in the "
                           "training forward (the model changed after the trainer was built?)")
    chunks, start = [], 0
    for hidden in norm_inputs.hidden:  # (rows, P+T, H) per chunk of TRL's forward
        rows = hidden.size(0)
        chunks.append(scorer.head_logprobs(hidden, completion_ids[start:start + rows], temperature, version))
        start += rows
    return torch.cat(chunks, dim=0)  # (b, T)
