"""Low-precision and fp32 copies of the policy (or of some of its modules), kept in step with it.

A copy is only built when the scoring mode needs weights in a dtype the policy does not store: TRL keeps the policy
in fp32 and trains under bf16 autocast by default, so the fp32 modes run the policy's own weights with no copy;
an fp16 copy, or fp32 copies of a bf16-stored policy, are what this module makes.

Rules (seed 004 arms B/D/F; trl_grpo_internals.md §3 pitfalls):
- never `copy.deepcopy` a policy TRL has patched (its fused-head `forward` closure keeps calling the original model):
  a whole-model copy is built from the config and loaded from the policy's state dict;
- a copy carries a version (the optimizer step it was synced at); `ModuleCopy.get(version)` refreshes a stale copy
  before use, so a stale copy is never used;
- the policy is never modified: no mode switch, no re-tying, no hooks, no merging of adapters in place.
"""

from __future__ import annotations

import copy as _copy

import torch
from torch import nn


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights as plain tensors, with active PEFT LoRA adapters merged in (W + delta, in fp32), without
    touching the module. For a non-PEFT module this is `module.state_dict()` (tensors shared, not copied).

    Keys are those of the base model (PEFT prefixes `base_model.model.` and `.base_layer` removed).
    """
    get_base = getattr(module, "get_base_model", None)
    if get_base is None:
        return module.state_dict()
    base = get_base()
    state = {}
    for name, sub in base.named_modules():
        # peft.tuners.lora.LoraLayer: base_layer + get_delta_weight(adapter) per active adapter
        if hasattr(sub, "base_layer") and hasattr(sub, "get_delta_weight"):
            weight = sub.base_layer.weight.detach()
            if not getattr(sub, "merged", False) and not getattr(sub, "disable_adapters", False):
                # merge in fp32: one rounding, in the copy's dtype, instead of a bf16 merge then a cast
                weight = weight.float()
                for adapter in sub.active_adapters:
                    if adapter in getattr(sub, "lora_A", {}):
                        weight = weight + sub.get_delta_weight(adapter).float()
            state[f"{name}.weight" if name else "weight"] = weight
            if getattr(sub.base_layer, "bias", None) is not None:
                state[f"{name}.bias"] = sub.base_layer.bias.detach()
    for key, value in base.state_dict().items():
        key = key.replace(".base_layer", "")
        if "lora_" in key or key in state:
            continue
        state[key] = value
    return state


def _strip_instance_patches(module: nn.Module) -> None:
    # accelerate (autocast wrapper) and TRL (fused head) patch `forward` on the instance; a copy must not inherit them
    for m in module.modules():
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_original_forward", None)


def _empty_like_model(model: nn.Module) -> nn.Module:
    """A new model of the same class and config with uninitialised weights (fast: no random init)."""
    from transformers.initialization import no_init_weights

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with no_init_weights():
        fresh = type(base)(base.config)
    return fresh


class ModuleCopy:
    """A copy of `source` (a whole causal LM, or one submodule such as a decoder layer or the LM head) in `dtype`.

    Args:
        source: the policy module to mirror. Parameters may be in any float dtype; PEFT adapters are merged.
        dtype: dtype of the copy's parameters (`torch.float32` or `torch.float16`).
        whole_model: build the copy from the model's config (for a `PreTrainedModel`); otherwise `copy.deepcopy`
            of a plain submodule (safe: submodules are not patched by TRL or accelerate).

    The copy lives on the source's device, has no gradients, and mirrors `source.training` at each refresh.
    """

    def __init__(self, source: nn.Module, dtype: torch.dtype, whole_model: bool = False):
        self.source = source
        self.dtype = dtype
        if whole_model:
            module = _empty_like_model(source)
        else:
            module = _copy.deepcopy(source)
            _strip_instance_patches(module)
        device = next(source.parameters()).device
        self.module = module.to(device=device, dtype=dtype).requires_grad_(False)
        self.version: int | None = None
        self.num_refreshes = 0

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        """Copy the source's current weights into the copy (cast to `self.dtype` by `copy_`) and record `version`."""
        state = merged_state_dict(self.source)
        own = self.module.state_dict()
        missing = [k for k in own if k not in state]
        if missing:
            raise RuntimeError(f"copy refresh: the policy has no tensor for {missing[:5]} (architecture changed?)")
        for key, dst in own.items():
            dst.copy_(state[key])
        self.module.train(self.source.training)
        self.version = version
        self.num_refreshes += 1

    def get(self, version: int) -> nn.Module:
        """The copy, synced at `version` (the policy's optimizer-step count); refreshed first when stale."""
        if self.version != version:
            self.refresh(version)
        return self.module

    def num_bytes(self) -> int:
        """Bytes held by the copy's parameters and buffers (what the copy costs in memory)."""
        tensors = {t.data_ptr(): t.numel() * t.element_size() for t in self.module.state_dict().values()}
        return sum(tensors.values())
