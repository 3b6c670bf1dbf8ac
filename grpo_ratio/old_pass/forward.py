"""The policy's forward as the scoring modes run it: its anatomy (decoder layers, final norm, LM head, rotary), the
input layouts (TRL's, and `generate`'s position ids), precision patches of single modules, and log-probs from logits.

Shapes: B = sequences, P = prompt tokens, T = completion tokens, V = vocabulary, H = hidden size, L = decoder layers.
Used by `grpo_ratio.old_pass.scorer` (the old pass), `grpo_ratio.old_pass.fused_head`, the sharded runners and the probes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .adapters import base_model


# ---------------------------------------------------------------------------------------------------------------------
# model anatomy


@dataclass
class Anatomy:
    """Where the decoder layers, final norm and LM head of a causal LM are (Llama, Qwen2/3, MoE, GPT-NeoX, ...)."""

    layers: nn.ModuleList  # (L,)
    norm: nn.Module
    head: nn.Module
    rotary: nn.Module | None


def model_anatomy(model: nn.Module) -> Anatomy:
    """Find decoder layers, final norm, LM head and rotary embedding of a transformers causal LM.

    Raises:
        ValueError: the model does not expose them under a known name (`layers`/`h`, `norm`/`final_layer_norm`/`ln_f`).
    """
    base = base_model(model)
    decoder = base.get_decoder()
    layers = next((getattr(decoder, n) for n in ("layers", "h", "blocks") if hasattr(decoder, n)), None)
    norm = next((getattr(decoder, n) for n in ("norm", "final_layer_norm", "ln_f") if hasattr(decoder, n)), None)
    head = base.get_output_embeddings()
    if layers is None or norm is None or head is None:
        raise ValueError(
            f"{type(base).__name__}: cannot find decoder layers / final norm / LM head; fp32_head and guided_fp32 "
            f"support models with `layers` (or `h`) and `norm` (or `final_layer_norm`, `ln_f`)"
        )
    return Anatomy(layers=layers, norm=norm, head=head, rotary=getattr(decoder, "rotary_emb", None))


# model-config fields of a logit transform applied after the LM head (softcapping, logit scaling)
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                    "lm_head_multiplier")


def logit_transforms(model_config) -> list[str]:
    """The `LOGIT_TRANSFORMS` fields a model's (text) config sets: where logits != head(hidden), so whoever applies
    the LM head itself (the kept-set log-probs, the greedy probe) would mis-score them. Empty for a plain head."""
    text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return [k for k in LOGIT_TRANSFORMS if getattr(text_config, k, None) not in (None, 1, 1.0)]


def check_layer_indices(layers: Iterable[int], num_layers: int) -> list[int]:
    """Validate `guided_fp32_layers` against a model with `num_layers` decoder layers.

    Raises:
        ValueError: an index is outside `[0, num_layers - 1]` (the message names the field and the allowed range).
    """
    layers = sorted(set(int(i) for i in layers))
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"guided_fp32_layers: {bad} out of range; this model has {num_layers} decoder layers, allowed indices "
            f"0..{num_layers - 1}"
        )
    return layers


# ---------------------------------------------------------------------------------------------------------------------
# running some modules in fp32


def _cast_floats(obj, dtype: torch.dtype):
    """Cast every floating tensor in obj (tensors, tuples, lists, dicts, ModelOutput) to dtype."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_cast_floats(x, dtype) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floats(x, dtype) for x in obj)
    if isinstance(obj, dict):
        for k in list(obj.keys()):
            obj[k] = _cast_floats(obj[k], dtype)
        return obj
    return obj


@contextlib.contextmanager
def patched_forward(module: nn.Module, new_forward: Callable):
    module.forward = new_forward  # instance attribute shadows the class method ...
    try:
        yield
    finally:
        del module.forward  # ... and deleting it restores the class method: the policy is left untouched


def fp32_forward(runner: nn.Module, out_dtype: torch.dtype | None, rope_cache: dict | None, device_type: str):
    """A forward that runs `runner` in fp32 outside autocast, casting float inputs to fp32 and outputs to out_dtype."""

    def forward(*args, **kwargs):
        if rope_cache and "position_embeddings" in kwargs and rope_cache.get("fp32") is not None:
            kwargs["position_embeddings"] = rope_cache["fp32"]  # exact fp32 cos/sin, not a bf16 round trip
        args, kwargs = _cast_floats(args, torch.float32), _cast_floats(dict(kwargs), torch.float32)
        with torch.autocast(device_type, enabled=False):
            out = type(runner).forward(runner, *args, **kwargs)  # the class forward: runner may be the patched module
        return out if out_dtype is None else _cast_floats(out, out_dtype)

    return forward


def rope_fp32_forward(rotary: nn.Module, cache: dict):
    """Rotary embedding computed in fp32 (kept in `cache` for the fp32 layers), returned in the hidden dtype."""
    device_type = next(iter(rotary.buffers())).device.type

    def forward(x, position_ids, *args, **kwargs):
        with torch.autocast(device_type, enabled=False):
            cos, sin = type(rotary).forward(rotary, x.float(), position_ids, *args, **kwargs)
        cache["fp32"] = (cos, sin)
        return cos.to(x.dtype), sin.to(x.dtype)

    return forward


# ---------------------------------------------------------------------------------------------------------------------
# log-probs from logits


def completion_logprobs_from_logits(logits: torch.Tensor, completion_ids: torch.Tensor, temperature: float):
    """log_softmax(logits / temperature) at the completion ids, in fp32.

    Args:
        logits: (B, T + 1, V) next-token logits of the last T + 1 positions, any float dtype (the last is dropped).
        completion_ids: (B, T) int64.
        temperature: > 0, as TRL's `temperature` (the trainer divides its logits by it too).
    Returns:
        (B, T) fp32 log-probs.
    """
    logits = logits[:, :-1].float() / temperature  # (B, T, V)
    logps = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    return logps.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)  # (B, T)


def generation_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as transformers' `generate` counts them: the number of attended tokens before each one, so a
    left-padded row's first real token is at 0 whatever its padding (padding positions get 1, as in `generate`).

    Args:
        attention_mask: (B, P+T) 0/1.
    Returns:
        (B, P+T) int64.
    """
    positions = attention_mask.long().cumsum(-1) - 1  # (B, P+T)
    return positions.masked_fill(attention_mask == 0, 1)


def _accepts_position_ids(model: nn.Module) -> bool:
    return "position_ids" in inspect.signature(type(base_model(model)).forward).parameters


def forward_kwargs(model: nn.Module, input_ids, attention_mask, logits_to_keep: int,
                   generation_positions: bool = True) -> dict:
    """The keyword arguments of a scoring forward: the last T + 1 positions' logits, no KV cache, and positions as
    generation counts them (from the attention mask): with absolute position embeddings (GPT-2 style) a completion's
    log-prob would otherwise depend on how much left padding its prompt got in this batch. `generation_positions=False`
    passes none, as TRL's own pass does (the `bf16` mode reproduces that pass)."""
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1, use_cache=False)
    if generation_positions and _accepts_position_ids(model):
        kwargs["position_ids"] = generation_position_ids(attention_mask)
    return kwargs


def plain_forward(model: nn.Module, input_ids, attention_mask, logits_to_keep: int,
                   generation_positions: bool = True) -> torch.Tensor:
    # type(model).forward bypasses the instance-level patches of accelerate (forced autocast) and TRL (fused head)
    kwargs = forward_kwargs(model, input_ids, attention_mask, logits_to_keep, generation_positions)
    out = type(model).forward(model, **kwargs)
    return out.logits  # (B, T + 1, V)


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Within the block every submodule of `model` is in eval mode (no dropout); each one's own mode is restored
    afterwards. The old log-probs must be a deterministic function of the weights and the tokens."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


# config fields of transformers models that set a dropout probability applied inside the forward
_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
                   "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout", "activation_dropout")


def active_dropout(model: nn.Module) -> list[str]:
    """Names of the dropouts with p > 0 in `model`: `nn.Dropout` modules (e.g. PEFT's `lora_dropout`) and config
    fields applied inside the forward (e.g. `attention_dropout`), as `name=p` strings."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            key = name.split(".")[-2] if name.split(".")[-1] in ("default",) else name.split(".")[-1]
            found.setdefault(key, module.p)
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    for field in _DROPOUT_FIELDS:
        value = getattr(text_config, field, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.setdefault(field, value)
    return [f"{k}={v}" for k, v in found.items()]
