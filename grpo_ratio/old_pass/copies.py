"""Low-precision and fp32 copies of the policy (or of some of its modules), kept in step with it.

A copy is only built when the scoring mode needs weights in a dtype the policy does not store: TRL keeps the policy
in fp32 and trains under bf16 autocast by default, so the fp32 modes run the policy's own weights with no copy;
an fp16 copy, or fp32 copies of a bf16-stored policy, are what this module makes.

Rules (from the fp32/fp16 clones of the batch-logprob-gap report's GRPO runs, and TRL 1.16's `GRPOTrainer`, whose
fused LM head patches `forward`):
- never `copy.deepcopy` a policy TRL has patched (its fused-head `forward` closure keeps calling the original model):
  a whole-model copy is built from the config and loaded from the policy's state dict;
- a copy carries a version (the `WeightsVersion` it was synced at: it moves whenever the policy's weights may have
  changed); `ModuleCopy.get(version)` refreshes a stale copy before use, so a stale copy is never used;
- a copy never runs dropout (eval mode), and PEFT adapters are merged by PEFT's own `merge()` (DoRA, IA3, ...);
- the policy is never modified: no mode switch, no re-tying, no merging of adapters in place, and no hook outlives
  the old pass that needed it.

Two ways to hold a whole-model copy (`copy_storage`): `ModuleCopy` keeps it resident (2 bytes per parameter in fp16)
and refreshes it after every optimizer step; `PerLayerCast` keeps nothing and casts each module's weights just before
it runs in the old pass. Per optimizer step with k old passes, the resident copy costs k passes + 1 refresh, the casts
k passes whose every module pays its cast: the casts win at small k, and hold only the largest module at any time
(docs/benchmarks.md, "Copies").
"""

from __future__ import annotations

import contextlib
import copy as _copy
import time
from collections.abc import Iterator

import torch
from torch import nn
from transformers import TrainerCallback

from .adapters import base_model


# how a whole-model copy is held: resident between passes, or cast module by module during the pass (`PerLayerCast`)
COPY_STORAGES = ("resident", "per_layer")


def _adapter_layers(base: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """The PEFT tuner layers (LoRA, DoRA, IA3, LoHa, LoKr, OFT, ...: `BaseTunerLayer` with a `base_layer`) and the
    `modules_to_save` wrappers of `base`, by qualified name; both empty without PEFT."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils import ModulesToSaveWrapper
    except ImportError:  # no PEFT installed: no adapters
        return {}, {}
    tuners, saved = {}, {}
    for name, sub in base.named_modules():
        if any(name.startswith(f"{outer}.") for outer in (*tuners, *saved)):
            continue  # inside a wrapper (lora_A, the base layer, a saved copy): handled with its wrapper
        if isinstance(sub, ModulesToSaveWrapper):
            saved[name] = sub
        elif isinstance(sub, BaseTunerLayer) and hasattr(sub, "base_layer"):
            tuners[name] = sub
    return tuners, saved


@torch.no_grad()
def _merged_layer_state(layer: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT's own merge of one tuner layer (`layer.merge()`: LoRA, DoRA's magnitude, IA3, LoHa, ...), done on an
    fp32 copy of the layer so that the policy's layer is never touched and the merge rounds once: the merged base
    layer's tensors, keyed as in the base model (`weight`, `bias`)."""
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False) or not layer.active_adapters:
        merged = layer.get_base_layer()  # already merged in place, or adapters off: the base layer is the weight
    else:
        copy = _copy.deepcopy(layer).float()
        copy.merge(adapter_names=list(layer.active_adapters))
        merged = copy.get_base_layer()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def _saved_module(wrapper: nn.Module) -> nn.Module:
    """The module a PEFT `modules_to_save` wrapper runs: its active adapter's copy, else the original module."""
    adapter = wrapper.active_adapters[0] if wrapper.active_adapters else None
    return wrapper.original_module if wrapper.disable_adapters or adapter is None else wrapper.modules_to_save[adapter]


def merged_state_parts(module: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The module's weights with its active PEFT adapters merged by PEFT itself (what `merge_and_unload()` would give,
    in fp32 for merged layers), without touching the module, one part at a time: each tuner layer's merged tensors
    (made when the part is asked for), each `modules_to_save` wrapper's active copy, then every other tensor of the
    base model. A consumer that copies a part and drops it before asking for the next (`ModuleCopy.refresh_weights`)
    holds one layer's fp32 merge at a time, not every adapted weight's (7B, all-linear LoRA: ~26 GB at once). For a
    non-PEFT module, one part: `module.state_dict()` (tensors shared, not copied).

    Keys are those of the base model (PEFT's `base_model.model.` prefix, `.base_layer` and the `modules_to_save`
    wrappers removed): a `modules_to_save` module (e.g. a trained `lm_head`) contributes its active adapter's copy.

    Raises:
        ValueError: a layer PEFT cannot merge (PEFT's own error, re-raised with the layer's name).
    """
    base = base_model(module)
    if base is module:
        yield module.state_dict()
        return
    tuners, saved = _adapter_layers(base)
    for name, layer in tuners.items():
        try:
            yield {f"{name}.{k}": v for k, v in _merged_layer_state(layer).items()}  # no reference kept here
        except (ValueError, NotImplementedError, TypeError) as err:
            raise ValueError(f"copy refresh: PEFT cannot merge the adapter of {name!r} ({type(layer).__name__}): "
                             f"{err}") from err
    for name, wrapper in saved.items():
        yield {f"{name}.{k}": v.detach() for k, v in _saved_module(wrapper).state_dict().items()}
    wrapped = tuple(f"{n}." for n in (*tuners, *saved))
    yield {key: value for key, value in base.state_dict().items() if not key.startswith(wrapped)}


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`merged_state_parts(module)` in one dict: every merged layer held at once (tests and small models; a copy's
    refresh streams the parts instead).

    Raises:
        ValueError: as `merged_state_parts`.
    """
    state = {}
    for part in merged_state_parts(module):
        state.update(part)
    return state


class WeightsVersion:
    """A counter that moves whenever the policy's weights may have changed, so that copies are refreshed then and
    never otherwise. The trainer moves it (`RatioGRPOTrainer`'s callback)
    - after every optimizer step of the training loop that was applied: transformers' `on_optimizer_step` event,
      which every engine passes through (a torch optimizer, accelerate's `AcceleratedOptimizer`, DeepSpeed ZeRO,
      whose engine steps inside `accelerator.backward`), unless accelerate reports the step skipped
      (`optimizer_step_was_skipped`: the fp16 gradient scaler or DeepSpeed's loss scaler on inf/NaN gradients), and
    - whenever training starts (`on_train_begin`: a second `train()`, a resume that loaded a checkpoint).

    An optimizer step taken outside the training loop (a user's own `optimizer.step()`) is not seen: call `bump()`
    after it. An optimizer hook cannot serve instead: DeepSpeed's ZeRO optimizers are not torch optimizers and have
    no `register_step_post_hook` (grpo_ratio issue 20: ZeRO-3 crashed at the first step). `state.global_step` cannot
    serve either: it restarts at 0 on a second `train()` while the weights went on (a copy kept the step-0 weights and
    new/old left the band for 75% of tokens).
    """

    def __init__(self):
        self.value = 0

    def bump(self) -> None:
        """Record that the weights may have changed: every copy synced at an older value is stale."""
        self.value += 1


# the hook dicts of `nn.Module` that run around a forward or a backward (`copy.deepcopy` copies them)
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def _strip_instance_patches(module: nn.Module) -> None:
    """Make a deep copy a plain module: accelerate (autocast wrapper) and TRL (fused head) patch `forward` on the
    instance, and the policy's forward/backward hooks (a `RouteHooks` router hook, ...) are copied along by
    `copy.deepcopy`; a copy inherits neither (whoever runs the copy attaches what it needs: `RouteHooks.attach`)."""
    for m in module.modules():
        m.__dict__.pop("forward", None)
        m.__dict__.pop("_original_forward", None)
        for name in _HOOK_DICTS:
            hooks = m.__dict__.get(name)
            if hooks:
                hooks.clear()  # the copy's own dict (a handle of the policy's hook removes from the policy's)


def empty_model_like(model: nn.Module) -> nn.Module:
    """A new model of the same class and config (a PEFT model's base model's) with uninitialised weights (fast: no
    random init) and its head tied as the config says (a tied head stays one tensor with the embedding)."""
    from transformers.initialization import no_init_weights

    base = base_model(model)
    with no_init_weights():
        fresh = type(base)(base.config)
    fresh.tie_weights()  # a tied head stays one tensor (else the copy holds the embedding twice)
    return fresh


def float_buffer_dtype(source: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype a copy in `dtype` holds a floating buffer in whose values come from `source`: fp32 where `source` is
    fp32, else `dtype`. The policy keeps its rotary `inv_freq` in fp32 whatever its weights' dtype; rounded to fp16,
    RoPE's angle error grows with the position (up to 30,000 x 5e-4 = 15 rad at position 30,000 with Qwen2's
    rope_theta), so no copy lowers a buffer the policy (or a fresh instance) computes in fp32."""
    return torch.float32 if source.dtype == torch.float32 else dtype


def settle_buffers(copy: nn.Module, source: nn.Module, dtype: torch.dtype) -> None:
    """Fill the buffers of a copy materialised from the meta device (`to_empty` leaves them uninitialised): each
    non-persistent one as a fresh instance of its module computes it (what a copy built from the config holds; the
    policy's own may have been rounded by a `.to(bfloat16)`), or else the policy's; persistent ones the policy's (a
    refresh copies those again). Floating ones in `float_buffer_dtype`, on the copy's device."""
    own = dict(base_model(source).named_buffers())
    for prefix, module in copy.named_modules():
        fresh = _fresh_buffers(module)
        for name, buf in list(module._buffers.items()):
            key = f"{prefix}.{name}" if prefix else name
            value = fresh.get(name, own.get(key))
            if buf is None or value is None:
                continue
            target = float_buffer_dtype(value, dtype) if value.is_floating_point() else value.dtype
            module._buffers[name] = value.detach().to(device=buf.device, dtype=target, copy=True)


def persistent_buffer_names(module: nn.Module) -> set[str]:
    """Qualified names of `module`'s persistent buffers (those in its state dict): what a refresh copies from the
    policy; the non-persistent ones (rotary tables) are settled once, when a copy is built (`settle_buffers`)."""
    return {f"{prefix}.{name}" if prefix else name for prefix, m in module.named_modules() for name in m._buffers
            if name not in m._non_persistent_buffers_set}


def model_copy(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """`empty_model_like(model)` with its parameters in `dtype` on `device`, uninitialised (a refresh fills them),
    and its buffers settled (`settle_buffers`): built on the meta device and materialised there, so nothing
    full-size is allocated on the host or in another dtype first (the fp32 CPU build this replaces took 28 GB of host
    RAM per rank for a 7B model). A tied head stays one tensor with the embedding."""
    with torch.device("meta"):
        module = empty_model_like(model)
    module = module.to(dtype).to_empty(device=device)  # the cast is free on the meta device
    module.tie_weights()  # materialised off the meta device, the tied head got a Parameter of its own: tie it again
    settle_buffers(module, model, dtype)
    return module


class VersionedCopy:
    """What every copy shares (`ModuleCopy` here, the sharded shadows of `grpo_ratio.old_pass.sharding.engines`): a `module` kept in
    step with a `source` by `refresh_weights()`, and the `WeightsVersion` value it was last synced at.

    Subclasses set `source`, `dtype`, `module` (in eval mode: old log-probs never see dropout) and implement
    `refresh_weights()` and `num_bytes()`.
    """

    version: int | None = None
    num_refreshes: int = 0

    def refresh_weights(self) -> None:
        raise NotImplementedError

    def refresh(self, version: int) -> None:
        """Copy the source's current weights into the copy and record `version`."""
        with torch.no_grad():
            self.refresh_weights()
        self.version = version
        self.num_refreshes += 1

    def get(self, version: int) -> nn.Module:
        """The copy, synced at `version` (a `WeightsVersion` value); refreshed first when stale."""
        if self.version != version:
            self.refresh(version)
        return self.module


class ModuleCopy(VersionedCopy):
    """A copy of `source` (a whole causal LM, or one submodule such as a decoder layer or the LM head) in `dtype`.

    Args:
        source: the policy module to mirror. Parameters may be in any float dtype; PEFT adapters are merged.
        dtype: dtype of the copy's parameters (`torch.float32` or `torch.float16`).
        whole_model: build the copy from the model's config (for a `PreTrainedModel`); otherwise `copy.deepcopy`
            of a plain submodule (safe: submodules are not patched by TRL or accelerate).

    The copy lives on the source's device (a whole model is built there in `dtype` from the meta device, never on the
    host or in fp32 first), has no gradients, and stays in eval mode: old log-probs are a deterministic function of
    the weights and tokens (no dropout), whatever mode the policy trains in. Floating buffers the policy keeps in fp32
    (rotary `inv_freq`) stay fp32 (`float_buffer_dtype`).
    """

    def __init__(self, source: nn.Module, dtype: torch.dtype, whole_model: bool = False):
        self.source = source
        self.dtype = dtype
        device = next(source.parameters()).device
        if whole_model:
            module = model_copy(source, dtype, device)
        else:
            module = _copy.deepcopy(source)
            _strip_instance_patches(module)
            module = module.to(device=device, dtype=dtype)
            settle_buffers(module, source, dtype)  # the source's fp32 buffers, not their round trip through `dtype`
        self.module = module.requires_grad_(False).eval()

    def refresh_weights(self) -> None:
        """Copy the source's current weights (PEFT adapters merged) into the copy, cast to `self.dtype` by `copy_`,
        one merged layer at a time (`merged_state_parts`: the transient is one layer's fp32 merge, not all of them).

        Raises:
            RuntimeError: a tensor of the copy has no counterpart in the policy (architecture changed?).
        """
        own = self.module.state_dict()
        done = set()
        for part in merged_state_parts(self.source):
            for key, value in part.items():
                if key in own:
                    own[key].copy_(value)
                    done.add(key)
            part = value = None  # drop this layer's merge before the next is made
        missing = [k for k in own if k not in done]
        if missing:
            raise RuntimeError(f"copy refresh: the policy has no tensor for {missing[:5]} (architecture changed?)")

    def num_bytes(self) -> int:
        """Bytes held by the copy's parameters and buffers (what the copy costs in memory)."""
        tensors = {t.data_ptr(): t.numel() * t.element_size() for t in self.module.state_dict().values()}
        return sum(tensors.values())


# ---------------------------------------------------------------------------------------------------------------------
# per-layer casts: the copy's weights made module by module during the old pass, none kept in between



def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(
        b is not None and b.is_floating_point() for b in module.buffers(recurse=False))


def _fresh_buffers(module: nn.Module, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The non-persistent floating buffers of `module` as a newly built instance computes them (a rotary embedding's
    `inv_freq`, in fp32), which is what a whole-model copy built from the config holds: the policy's own may have been
    rounded by a `.to(bfloat16)`. On `device` (default: the module's buffers' device). Empty when the module cannot be
    rebuilt from its `config` attribute."""
    names = [n for n in getattr(module, "_non_persistent_buffers_set", ()) if getattr(module, n, None) is not None
             and getattr(module, n).is_floating_point()]
    config = getattr(module, "config", None)
    if not names or config is None:
        return {}
    try:
        with torch.device("cpu"):  # small (a rotary table); a meta context around the caller must not reach it
            fresh = type(module)(config)
    except TypeError:  # another constructor: keep the policy's buffers (cast like any other)
        return {}
    device = getattr(module, names[0]).device if device is None else device
    return {n: getattr(fresh, n).detach().to(device) for n in names}


class PerLayerCast:
    """The weights of a whole-model copy in `dtype` (what `ModuleCopy(model, dtype, whole_model=True)` holds), made one
    module at a time while the old pass runs: each module that owns parameters or floating buffers gets them cast to
    `dtype` just before its forward and dropped right after, so no copy outlives its module's call and nothing needs a
    refresh after an optimizer step (the casts read the policy's current weights). The policy's parameters are put
    back after each call; the policy is never left modified.

    Args:
        model: the policy (a transformers causal LM, optionally with PEFT adapters).
        dtype: the copy's dtype (`torch.float16` for `fp16_clone`, `torch.float32` for `fp32_clone` on bf16 weights;
            `ratio_attribution`'s fp32 reference).

    PEFT: a resident copy holds each adapted layer merged by PEFT's own `merge()` (`merged_state_dict`); here each
    tuner layer (LoRA, DoRA, IA3, ...) is merged the same way (`_merged_layer_state`, on an fp32 copy of that one
    layer) when it runs, cast to `dtype`, and its base layer's forward runs on the merged weights; a `modules_to_save`
    wrapper runs its active module on a cast of its weights: the resident copy's numbers, with one layer's merged
    weights alive at a time. The wrappers' forwards are replaced within `active()`; a forward taken from one there
    (the LM head's, which the scorer applies tile by tile after the pass) merges or casts again at each call.

    Non-persistent buffers (rotary `inv_freq`) come from a fresh instance of their module, as in a copy built from the
    config, and fp32 buffers stay fp32 (`float_buffer_dtype`). The same forward then computes the same numbers as the
    resident copy: bitwise equal log-probs
    (tests/test_copies.py). Costs: one cast of every weight per old pass (a tied embedding/head is cast twice, once per
    module) instead of one `copy_` per optimizer step; `peak_bytes` is the most cast bytes alive at once (the largest
    module, usually the embedding or the LM head).

    """

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.model = model
        self.dtype = dtype
        tuners, saved = _adapter_layers(base_model(model))
        self.wrappers = [*tuners.values(), *saved.values()]  # PEFT's: run on merged / cast weights (`_wrapped_forward`)
        self._tuners = {id(m) for m in tuners.values()}
        inside = {id(m) for wrapper in self.wrappers for m in wrapper.modules()}  # their base layers and adapters
        self.owners = [m for m in model.modules() if _owns_tensors(m) and id(m) not in inside]
        self._fresh = {id(m): _fresh_buffers(m) for m in self.owners}
        self._saved: dict[int, tuple[nn.Module, dict, dict]] = {}  # id(module) -> (module, params, buffers)
        self.num_casts = 0  # module casts over this object's life
        self.cast_seconds = 0.0  # wall seconds spent casting and restoring, over this object's life
        self.peak_bytes = 0  # most cast bytes alive at once
        self._live_bytes = 0

    def _cast_in(self, module, args):
        start = time.perf_counter()
        params, buffers = dict(module._parameters), dict(module._buffers)
        fresh = self._fresh[id(module)]
        with torch.no_grad():
            for name, p in params.items():
                if p is not None:
                    module._parameters[name] = p.detach().to(self.dtype)
            for name, b in buffers.items():
                if b is not None and b.is_floating_point():
                    value = fresh.get(name, b)
                    module._buffers[name] = value.to(float_buffer_dtype(value, self.dtype))  # fp32 ones stay fp32
        self._saved[id(module)] = (module, params, buffers)
        cast = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        self._live_bytes += sum(t.numel() * t.element_size() for t in cast)
        self.peak_bytes = max(self.peak_bytes, self._live_bytes)
        self.num_casts += 1
        self.cast_seconds += time.perf_counter() - start

    def _restore(self, module) -> None:
        start = time.perf_counter()
        saved = self._saved.pop(id(module), None)
        if saved is None:
            return
        _, params, buffers = saved
        cast = [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]
        self._live_bytes -= sum(t.numel() * t.element_size() for t in cast)
        module._parameters.update(params)
        module._buffers.update(buffers)
        self.cast_seconds += time.perf_counter() - start

    def _cast_out(self, module, args, output):
        self._restore(module)

    def _wrapped_forward(self, wrapper: nn.Module):
        """The forward of a PEFT wrapper (a tuner layer, a `modules_to_save` wrapper) on weights in `dtype` as a
        resident copy holds them: the tuner layer's base layer on its merged weights, the wrapper's active module on
        its own; made when it runs and dropped right after."""

        def forward(x, *args, **kwargs):
            kwargs.pop("adapter_names", None)  # PEFT's mixed-batch argument: the merged weights serve the active ones
            start = time.perf_counter()
            if id(wrapper) in self._tuners:
                module, state = wrapper.get_base_layer(), _merged_layer_state(wrapper)
            else:
                module = _saved_module(wrapper)
                state = {k: v.detach() for k, v in module.state_dict().items()}
            state = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in state.items()}
            size = sum(t.numel() * t.element_size() for t in state.values())
            self._live_bytes += size
            self.peak_bytes = max(self.peak_bytes, self._live_bytes)
            self.num_casts += 1
            self.cast_seconds += time.perf_counter() - start
            try:
                return torch.func.functional_call(module, state, (x, *args), kwargs)
            finally:
                self._live_bytes -= size

        return forward

    @contextlib.contextmanager
    def active(self):
        """Within the block every forward of the policy runs on `dtype` casts of its weights (hooks and the tuner
        layers' merged forwards removed after)."""
        handles, patched = [], []
        for module in self.owners:
            handles.append(module.register_forward_pre_hook(self._cast_in))
            handles.append(module.register_forward_hook(self._cast_out, always_call=True))
        for wrapper in self.wrappers:
            patched.append((wrapper, wrapper.__dict__.get("forward")))
            wrapper.forward = self._wrapped_forward(wrapper)
        try:
            yield self.model
        finally:
            for handle in handles:
                handle.remove()
            for wrapper, forward in patched:
                del wrapper.forward
                if forward is not None:  # an instance patch that was there before
                    wrapper.forward = forward
            for module, _, _ in list(self._saved.values()):  # a forward that raised half-way
                self._restore(module)
            self._live_bytes = 0

    def num_bytes(self) -> int:
        """Bytes held between old passes: none (the casts live only while their module runs; see `peak_bytes`)."""
        return 0


class WeightsVersionCallback(TrainerCallback):
    """Moves the trainer's `WeightsVersion` when training starts (a second `train()`, a resume that loaded weights)
    and after every applied optimizer step (`on_optimizer_step`: the same event under DDP, FSDP2 and DeepSpeed)."""

    def __init__(self, version: WeightsVersion, accelerator):
        self.version = version
        self.accelerator = accelerator

    def on_train_begin(self, args, state, control, **kwargs):
        self.version.bump()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if not self.accelerator.optimizer_step_was_skipped:  # a loss-scaler skip leaves the weights as they were
            self.version.bump()
