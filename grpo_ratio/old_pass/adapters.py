"""PEFT adapters: whether a model carries them, and the transformers model inside a PEFT wrapper. The one place that
knows how PEFT wraps a model (TRL 1.16 unwraps the same way: `model.get_base_model() if is_peft_model(model)`)."""

from __future__ import annotations

from accelerate.utils import is_peft_model
from torch import nn


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a `peft.PeftModel` (`get_base_model()`, accelerate's `is_peft_model`), else
    `model` itself. Call it on an unwrapped model (`accelerator.unwrap_model`)."""
    return model.get_base_model() if is_peft_model(model) else model


def has_adapters(model: nn.Module) -> bool:
    """A `peft.PeftModel` (accelerate's `is_peft_model`), or a transformers model with adapters loaded in place
    (`load_adapter` / `add_adapter` set `peft_config` on it)."""
    return is_peft_model(model) or hasattr(model, "peft_config")
