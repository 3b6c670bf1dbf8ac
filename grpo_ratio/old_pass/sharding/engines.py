"""Old-logprob scoring on a sharded policy: accelerate's FSDP2 and DeepSpeed ZeRO-3.

Under FSDP2 and ZeRO-3 no rank holds the full weights, and the dtype a forward computes in is set by the engine (an
FSDP `MixedPrecisionPolicy`, DeepSpeed's `bf16` section), not by `param.dtype`: under accelerate's bf16 policy the
parameters report fp32 while every all-gather hands bf16 to the forward. This module gives `OldLogprobScorer` what
it needs there (`ShardedPolicy`): the engine's real compute dtype, a way to call the sharded root, whole-model forwards
in fp32 or fp16 and fp32 runners for single modules, all without a full replica on any rank.

| engine, compute dtype | `fp32_clone` | `fp16_clone` | `fp32_head`, `guided_fp32` |
|---|---|---|---|
| FSDP2, no policy (fp32)   | the policy itself | `FSDPShadow` fp16, 2 B/param / N | the policy itself |
| FSDP2, bf16 policy        | the policy, every FSDP state's policy swapped to fp32 for the call | `FSDPShadow` fp16 | the states owning the fp32 modules and the root swapped to fp32 |
| ZeRO-3, fp32              | the policy itself | `ZeroShadow` fp16, 2 B/param / N | the policy itself |
| ZeRO-3, bf16              | `ZeroShadow` fp32, 4 B/param / N, from the fp32 master partitions | `ZeroShadow` fp16 | fp32 runners that all-gather the master weights of one module at a time (0 B kept) |

Shadows are models built from the policy's config and sharded exactly like it (FSDP2 `Shard(0)` on the same mesh;
ZeRO-3 partitions of the same world size), so a refresh is a local cast-copy of each rank's own shard: no
communication, and the bytes kept per rank are the copy's size divided by the number of ranks.

Rules (each one a failure seen on 2 gloo processes, torch 2.13, deepspeed 0.19):
- call the sharded root through `nn.Module.__call__` (FSDP's and DeepSpeed's root hooks run there), with the class
  forward in place of the instance patches of TRL (fused head) and accelerate (autocast);
- FSDP2 leaves `reshard_after_forward=False` groups (final norm, LM head, tied embeddings) unsharded after a forward:
  `reshard()` before reading or re-typing parameters;
- every rank runs the same sequence of sharded forwards (the fp16 fallback is agreed by an all-reduce);
- an FSDP policy is swapped state by state, each state once (the norm and the head share one state), and swapped
  back before the next training forward; fp32 layers under a bf16 policy get the rotary cos/sin in exact fp32
  (`scorer.rope_fp32_forward`), since the hidden states they come from are bf16.

Four modules: this one (which engine, `sharded_policy`), `base.py` (`ShardedPolicy`, calling a sharded root),
`fsdp2.py` (FSDP2 internals, `FSDPShadow`, `FSDP2Policy`, `fp32_logprob_output`) and `zero3.py` (DeepSpeed ZeRO-3
internals, `ZeroShadow`, `MasterFP32Runner`, `Zero3Policy`). The start-up refusals are `grpo_ratio.checks.check_sharded_mode`.

Private torch/DeepSpeed APIs are used only where no public one exists; each use says which version it was read from.
Peers: NeMo-RL keeps the FSDP2 output in fp32 (`output_dtype=float32`); TRL #4867/#6330 fixed the fp32 LM head
under FSDP2 by casting at call time; no peer keeps an fp32 or fp16 copy for the old pass.
"""

from __future__ import annotations

from torch import nn

from .base import ShardedPolicy, is_fsdp2_wrapped, is_zero3_partitioned


# ---------------------------------------------------------------------------------------------------------------------
# which engine, and what it refuses


def engine_of(accelerator) -> str:
    """`"fsdp2"`, `"zero3"`, or `"none"` (single process, DDP, FSDP1, DeepSpeed ZeRO-0/1/2: weights not sharded by
    an engine this module handles). Reads accelerate's state, which is known before the model is wrapped."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.FSDP:
        return "fsdp2" if state.fsdp_plugin.fsdp_version == 2 else "fsdp1"
    if state.distributed_type == DistributedType.DEEPSPEED and state.deepspeed_plugin.zero_stage == 3:
        return "zero3"
    return "none"


# ---------------------------------------------------------------------------------------------------------------------
# calling a sharded model


# ---------------------------------------------------------------------------------------------------------------------
# what the scorer asks of a sharded policy


def sharded_policy(accelerator, model: nn.Module) -> ShardedPolicy | None:
    """The `ShardedPolicy` of an accelerate-prepared model, or None when its weights are not sharded.

    Args:
        accelerator: the trainer's `accelerate.Accelerator`.
        model: the (unwrapped) policy module, after `accelerator.prepare` (which wraps it in place).
    Raises:
        RuntimeError: the engine is FSDP2/ZeRO-3 but the model is not wrapped yet (before `train()`).
    """
    from .fsdp2 import FSDP2Policy  # the engine modules build on this one's ShardedPolicy
    from .zero3 import Zero3Policy

    engine = engine_of(accelerator)
    if engine == "fsdp2":
        if not is_fsdp2_wrapped(model):
            raise RuntimeError("grpo_ratio: the scorer of an FSDP2 run exists once train() has wrapped the model")
        return FSDP2Policy(model)
    if engine == "zero3":
        wrapped = accelerator.deepspeed_engine_wrapped
        if wrapped is None or not is_zero3_partitioned(model):
            raise RuntimeError("grpo_ratio: the scorer of a ZeRO-3 run exists once train() has wrapped the model")
        return Zero3Policy(model, wrapped.engine)
    return None
