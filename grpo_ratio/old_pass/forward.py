"""The policy's forward as the scoring modes run it: its anatomy (decoder layers, final norm, LM head, rotary), the
input layouts (TRL's, and `generate`'s position ids), precision patches of single modules, and log-probs from the LM
head's input in tiles (`head_inputs`, `HeadProjection`): no (B, T, V) logits, as in TRL 1.16's fused head.

Shapes: B = sequences, P = prompt tokens, T = completion tokens, V = vocabulary, H = hidden size, L = decoder layers.
Used by `grpo_ratio.old_pass.scorer` (the old pass), `grpo_ratio.old_pass.fused_head`, the sharded runners and the probes.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from packaging.version import Version
from torch import nn
from torch.overrides import TorchFunctionMode
from trl.kernels import ChunkedLogProbFunction

from ..corrections.kept_logprobs import HeadLogits
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
    """Within the block `module.forward` is `new_forward` (an instance attribute shadows the class method); after it,
    the module's own instance forward is back, the same object (TRL's `cast_lm_head_to_fp32` head, Liger's RMSNorm,
    accelerate's autocast wrapper), or the class method where it had none: the policy is left untouched."""
    saved = module.__dict__.get("forward")
    module.forward = new_forward
    try:
        yield
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved


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


# ---------------------------------------------------------------------------------------------------------------------
# log-probs from the LM head's input, in tiles: no (B, T, V) logits
#
# TRL 1.16 never builds (B, T, V) logits: its old pass and training forward project the last hidden states through the
# head in tiles (`add_fused_lm_head`, `trl.kernels.ChunkedLogProbFunction`). The scoring modes do the same: a forward
# pre-hook on the head (`head_inputs`) records the head's input and the linear map its forward applies (an fp32
# runner's, a copy's, an engine's gathered weights: `capture_head`), then lets the head run on no position. At 8 rows
# x 4,096 tokens x V = 151,936 the fp32 logits of one chunk of rows would be 20 GB (and their log-softmax as much).

# vocabulary columns per tile of TRL 1.16's fused head (`_CHUNKED_LOGPROB_CHUNK_SIZE`, trl/trainer/utils.py); with its
# tiles of `trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE` = 4,096 tokens, one fp32 tile is 512 MB
VOCAB_TILE = 32768
# tokens per tile where the head is not one linear map and its own forward runs tile by tile: (1024, V) fp32 is
# 622 MB at V = 151,936
TOKEN_TILE = 1024


def head_transform(model_config) -> tuple[float | None, float]:
    """(softcap, scale) of the transform a model applies to its logits after the LM head, read from the (text) config
    as TRL 1.16's `add_fused_lm_head` reads them (trl/trainer/utils.py) and applied as its kernel applies them:
    z * scale, then softcap * tanh(z / softcap). softcap = `final_logit_softcapping` (None: none); scale =
    `logit_scale`, else `output_multiplier`, else `lm_head_multiplier`, else 1 / `logits_scaling` (HyperCLOVA X
    multiplies by it), else 1."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "output_multiplier", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scale = text.logits_scaling if getattr(text, "model_type", None) == "hyperclovax" else 1 / text.logits_scaling
    return getattr(text, "final_logit_softcapping", None), 1.0 if scale is None else float(scale)


# ---------------------------------------------------------------------------------------------------------------------
# the sampler's fp32 head: 16-bit operands, fp32 accumulation and output (`fp32_head_operands="bf16"`)

# `torch.mm(a, b, out_dtype=torch.float32)` of bf16/fp16 operands: a CUDA kernel from torch 2.8 (the kernel TRL 1.16's
# `_addmm_fp32` uses in its backward); torch 2.13's CPU build has none ("Could not run 'aten::mm.dtype' with arguments
# from the 'CPU' backend")
MM_OUT_DTYPE = Version(torch.__version__.split("+")[0]) >= Version("2.8.0")
# tokens per tile of the sampler-head log-probs: TRL's `TOKEN_CHUNK_SIZE`; one (4,096, `VOCAB_TILE`) fp32 tile, 512 MB
SAMPLER_HEAD_TOKEN_TILE = 4096


def has_mm_out_dtype(device: torch.device) -> bool:
    """Whether `mm_fp32_out` runs the fused kernel on `device` (CUDA, torch >= 2.8), not its exact equivalent."""
    return MM_OUT_DTYPE and device.type == "cuda"


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with 16-bit operands, fp32 accumulation and an fp32 output: the LM head of vLLM's `head_dtype=float32`
    on CUDA (`torch.mm(hidden, weight.t(), out_dtype=head_dtype)`, vLLM PR #48390), SGLang PR #32370, prime-rl #2441.

    On CUDA (torch >= 2.8) `torch.mm(a, b, out_dtype=torch.float32)`; elsewhere (no such kernel: CPU) the exact
    equivalent, an fp32 matmul of the operands upcast: a bf16 value is exact in fp32, so the products and their fp32
    sum are the same maths (the summation order is the kernel's, as between any two GEMMs). Call it in IEEE fp32
    (`ieee_fp32`): under TF32 the upcast operands are still exact (10 mantissa bits >= bf16's 7), the sum is fp32.

    Args:
        a: (n, H) bf16 (or fp16). b: (H, v) the same dtype (a transposed weight tile).
    Returns:
        (n, v) fp32.
    """
    if has_mm_out_dtype(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def sampler_head_logprobs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                          temperature: float, softcap: float | None = None, scale: float = 1.0) -> torch.Tensor:
    """log_softmax(transform(x W^T + b) / temperature) at `targets`, the matmul by `mm_fp32_out` (16-bit operands,
    fp32 logits), in tiles of `SAMPLER_HEAD_TOKEN_TILE` tokens x `VOCAB_TILE` columns folded into an online
    log-sum-exp, as TRL's `ChunkedLogProbFunction` folds its tiles (transform: z * scale, then softcap *
    tanh(z / softcap), then z * (1 / temperature), TRL's order): no (N, V) logits. No autograd (the old pass).

    Args:
        x: (N, H) the head's inputs, already in the operand dtype (bf16). weight: (V, H) the same dtype.
        bias: (V,) or None (added in fp32). targets: (N,) int64.
    Returns:
        (N,) fp32 log-probs.
    """
    n_tokens, vocab = x.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    out = torch.empty(n_tokens, dtype=torch.float32, device=x.device)  # (N,)
    for t0 in range(0, n_tokens, SAMPLER_HEAD_TOKEN_TILE):
        xs, tg = x[t0:t0 + SAMPLER_HEAD_TOKEN_TILE], targets[t0:t0 + SAMPLER_HEAD_TOKEN_TILE]  # (n, H), (n,)
        running = torch.full((xs.shape[0],), float("-inf"), dtype=torch.float32, device=x.device)  # (n,)
        sum_exp = torch.zeros_like(running)
        target = torch.zeros_like(running)
        for v0 in range(0, vocab, VOCAB_TILE):
            w = weight[v0:v0 + VOCAB_TILE]  # (v, H)
            z = mm_fp32_out(xs, w.t())  # (n, v) fp32
            if bias is not None:
                z = z + bias[v0:v0 + w.shape[0]].float()
            z = z * scale
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            z = z * inv_t
            new = torch.maximum(running, z.amax(-1))
            sum_exp = sum_exp * torch.exp(running - new) + torch.exp(z - new[:, None]).sum(-1)
            running = new
            local = tg - v0
            inside = (local >= 0) & (local < w.shape[0])
            target = torch.where(inside, z.gather(-1, local.clamp(0, w.shape[0] - 1)[:, None]).squeeze(-1), target)
        out[t0:t0 + xs.shape[0]] = target - (running + torch.log(sum_exp))
    return out


def fp32_matmul_precision(device: torch.device) -> str:
    """What an fp32 matmul on `device` computes now: "ieee", or the reduced precision the run set ("tf32" on CUDA:
    `torch.backends.cuda.matmul.fp32_precision` / `allow_tf32`, transformers' `tf32=True`; on a CPU oneDNN's "bf16" or
    "tf32": `torch.backends.mkldnn.matmul.fp32_precision`, `set_float32_matmul_precision("medium")`)."""
    state = _matmul_precisions()
    if isinstance(state, str):  # torch < 2.9: the one legacy value
        return "ieee" if state == "highest" else ("tf32" if device.type == "cuda" else state)
    backend = state["cuda"] if device.type == "cuda" else state.get("mkldnn", "none")
    value = backend if backend != "none" else state[""]
    return "ieee" if value in ("ieee", "none") else value


def head_arithmetic(operands: str, device: torch.device) -> dict:
    """What the old pass's LM head computes under `fp32_head` with `fp32_head_operands=operands` on `device`, and the
    run's own fp32 matmul precision: the run record's `head_arithmetic` (run.json).

    Returns:
        {"operands": "fp32" | "bf16", "norm": "fp32" | "as trained", "matmul": a phrase naming the kernel,
        "fp32_matmul": "ieee" (the scoring passes force it: `ieee_fp32`), "run_fp32_matmul": "ieee", "tf32" or
        "bf16" (`fp32_matmul_precision`: what the run set for its own fp32 matmuls, which the old pass does not use)}.
    """
    if operands == "fp32":
        matmul = "fp32 x fp32 (IEEE)"
    elif has_mm_out_dtype(device):
        matmul = "torch.mm(bf16, bf16, out_dtype=float32): fp32 accumulation and output"
    else:
        matmul = ("fp32 matmul of the bf16 operands upcast (IEEE; exact equivalent of mm out_dtype=float32, which "
                  f"{device.type} lacks)")
    return {"operands": operands, "norm": "fp32" if operands == "fp32" else "as trained", "matmul": matmul,
            "fp32_matmul": "ieee", "run_fp32_matmul": fp32_matmul_precision(device)}


@dataclass
class HeadProjection:
    """The LM head of one forward as a map of its input, applied a tile at a time: logits = transform(x W^T + b), the
    transform TRL's (`head_transform`). Built from the head's own call by `capture_head`.

    Fields:
        vocab_size (`int`): V.
        weight (`torch.Tensor | None`, (V, H)), bias (`torch.Tensor | None`, (V,)): the linear map the head's forward
            applies, as it applies it (the policy's weights, a copy's, an fp32 runner's, an engine's gathered ones);
            None for a head that is not one linear map.
        compute_dtype (`torch.dtype | None`): the dtype of that matmul (the autocast dtype inside autocast, else the
            input's), as TRL's kernel chooses it.
        forward (`Callable | None`): the head's own forward, for a head that is not one linear map (a PEFT adapter or
            a parametrization on the head), run tile by tile under `autocast` = (enabled, dtype), the state it ran in.
        softcap (`float | None`), scale (`float`): the transform after the head (`head_transform`).
        operands (`torch.dtype | None`): set (bf16) by `with_sampler_operands`: the input and the weight rounded to
            it and multiplied with fp32 accumulation and output (`mm_fp32_out`), the sampler's fp32 head; None:
            the matmul in `compute_dtype`, its output in that dtype (TRL's).
    """

    vocab_size: int
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    compute_dtype: torch.dtype | None = None
    forward: Callable | None = None
    autocast: tuple[bool, torch.dtype] = (False, torch.bfloat16)
    softcap: float | None = None
    scale: float = 1.0
    operands: torch.dtype | None = None
    _cast: torch.Tensor | None = field(default=None, repr=False)  # (V, H) the weight in compute_dtype, on first use

    def _transform(self, z: torch.Tensor) -> torch.Tensor:
        if self.softcap is None and self.scale == 1.0:
            return z
        z = z.float() * self.scale  # in fp32, as TRL's kernel
        return z if self.softcap is None else self.softcap * torch.tanh(z / self.softcap)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(n, V) logits of the head's inputs x (n, H): in the head's output dtype, fp32 where a transform applies."""
        if self.weight is None:
            enabled, dtype = self.autocast
            with torch.autocast(x.device.type, enabled=enabled, dtype=dtype):
                return self._transform(self.forward(x))
        if self._cast is None:  # what autocast casts the weight to inside the head's matmul (itself when no cast)
            self._cast = self.weight.to(self.compute_dtype)
        if self.operands is not None:  # the sampler's head: 16-bit operands, fp32 logits
            with torch.autocast(x.device.type, enabled=False):
                z = mm_fp32_out(x.to(self.operands).reshape(-1, x.shape[-1]), self._cast.t())  # (n, V) fp32
                z = z if self.bias is None else z + self.bias.float()
                return self._transform(z.view(*x.shape[:-1], -1))
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        with torch.autocast(x.device.type, enabled=False):
            return self._transform(F.linear(x.to(self.compute_dtype), self._cast, bias))

    def logprobs(self, x: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """(N,) fp32 log-probs of `targets` (N,) int64 under log_softmax(transform(logits) / temperature) of x (N, H).

        One linear map: TRL's own `ChunkedLogProbFunction` (tiles of 4,096 tokens x `VOCAB_TILE` columns folded into an
        online log-sum-exp; the temperature applied as z * (1 / temperature), as TRL's fused head applies it).
        Otherwise `TOKEN_TILE` tokens of whole rows at a time, the same arithmetic. With `operands` (the sampler's
        head): `sampler_head_logprobs`, the same tiles with fp32 logits of 16-bit operands.
        """
        if self.operands is not None:
            if self._cast is None:
                self._cast = self.weight.to(self.operands)
            with torch.autocast(x.device.type, enabled=False):
                return sampler_head_logprobs(x.to(self.operands), self._cast, self.bias, targets, temperature,
                                             self.softcap, self.scale)
        if self.weight is not None:
            with torch.autocast(x.device.type, enabled=False):  # the kernel then computes in its input's dtype
                return ChunkedLogProbFunction.apply(x.to(self.compute_dtype), self.weight, self.bias, targets,
                                                    temperature, VOCAB_TILE, self.softcap, self.scale, ())[0]
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)  # (N,)
        for start in range(0, x.shape[0], TOKEN_TILE):
            tile = slice(start, start + TOKEN_TILE)
            z = self.logits(x[tile]).float() * (1.0 / temperature)  # (n, V)
            out[tile] = torch.log_softmax(z, dim=-1).gather(-1, targets[tile, None]).squeeze(-1)
        return out

    def persistent(self) -> HeadProjection:
        """This projection, still valid after the forward it was taken in: the weights cloned (a sharded engine frees
        the head's gathered weights when its forward ends).

        Raises:
            NotImplementedError: a head that is not one linear map (its forward cannot run outside the engine's).
        """
        if self.weight is None:
            raise NotImplementedError("grpo_ratio: on a sharded policy the scoring modes need an LM head that is one "
                                      "linear map (nn.Linear); this head runs its own forward")
        return HeadProjection(self.vocab_size, self.weight.detach().clone(),
                              None if self.bias is None else self.bias.detach().clone(), self.compute_dtype,
                              softcap=self.softcap, scale=self.scale, operands=self.operands)

    def with_sampler_operands(self, dtype: torch.dtype = torch.bfloat16) -> HeadProjection:
        """This projection computed as the sampler's fp32 head (`fp32_head_operands="bf16"`): its input and weight
        rounded to `dtype` (bf16), multiplied with fp32 accumulation and output (`mm_fp32_out`).

        Raises:
            NotImplementedError: a head that is not one linear map (a PEFT adapter on the head, a quantized head):
                its forward computes in its own dtype.
        """
        if self.weight is None:
            raise NotImplementedError("grpo_ratio: fp32_head_operands='bf16' needs an LM head that is one linear map "
                                      "(nn.Linear); this head runs its own forward. Use fp32_head_operands='fp32'")
        return HeadProjection(self.vocab_size, self.weight, self.bias, dtype, softcap=self.softcap, scale=self.scale,
                              operands=dtype)


class _LinearCapture(TorchFunctionMode):
    """Within the block the first `F.linear` is not computed: its input, weight, bias and the autocast state it would
    run in are kept (`seen`), and an empty (..., 0) tensor stands for its output."""

    def __init__(self):
        super().__init__()
        self.seen = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and self.seen is None:
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            device = x.device.type
            self.seen = (x, weight, bias, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
            return x.new_empty(*x.shape[:-1], 0)
        return func(*args, **kwargs)


@contextlib.contextmanager
def _torch_linear():
    """Within the block `torch.nn.functional.linear` is torch's own: DeepSpeed ZeRO-3 replaces it for good with its
    memory-efficient `zero3_linear_wrap` (an autograd function `_LinearCapture` would not see as `F.linear`; "this will
    persist unless manually reset", deepspeed/runtime/zero/partition_parameters.py). The capture computes nothing, so
    the swap changes no number; the replacement is put back on exit."""
    replaced = F.linear
    F.linear = torch._C._nn.linear
    try:
        yield
    finally:
        F.linear = replaced


def capture_head(model: nn.Module, forward: Callable, x: torch.Tensor) -> tuple[torch.Tensor, HeadProjection]:
    """What the LM head of `model` computes on x when run by `forward`, without computing it: (its input,
    `HeadProjection`).

    Args:
        model: the causal LM (or its PEFT wrapper) whose head it is: its head's type, V and `head_transform`.
        forward: the head's forward as the model would call it (its instance patch if any: an fp32 runner, TRL's
            `cast_lm_head_to_fp32`), or a runner of it (`fp32_forward`).
        x: (..., H) the head's input.
    Where the head's class forward is `nn.Linear`'s (a plain head; FSDP2's `FSDPLinear`; a parametrized weight),
    `forward` runs once with its `F.linear` intercepted (not computed): the projection keeps the input, weight, bias
    and autocast state of that call, and the returned input is the linear map's (an fp32 runner casts it). Otherwise
    (a PEFT adapter on the head, a quantized head), or where no `F.linear` was called, the projection runs `forward`
    itself, tile by tile.
    """
    base = base_model(model)
    head = base.get_output_embeddings()
    softcap, scale = head_transform(base.config)
    device = x.device.type
    capture = _LinearCapture()
    if type(head).forward is nn.Linear.forward:
        with _torch_linear(), capture:
            forward(x)
    if capture.seen is None:
        state = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        vocab_size = getattr(head, "out_features", None) or base.config.get_text_config().vocab_size
        return x, HeadProjection(vocab_size, forward=forward, autocast=state, softcap=softcap, scale=scale)
    seen_x, weight, bias, autocast_on, autocast_dtype = capture.seen
    compute = autocast_dtype if autocast_on and seen_x.is_floating_point() else seen_x.dtype
    return seen_x, HeadProjection(weight.shape[0], weight, bias, compute, softcap=softcap, scale=scale)


@dataclass
class HeadInput:
    """What the LM head received in one forward: its input at the last T + 1 positions and the map it applies.

    Fields:
        hidden (`torch.Tensor`, (b, T + 1, H)): the input as the head's linear map received it (the last position
            predicts no completion token).
        projection (`HeadProjection`).
    """

    hidden: torch.Tensor
    projection: HeadProjection

    def logprobs(self, completion_ids: torch.Tensor, temperature: float) -> torch.Tensor:
        """(b, T) fp32 log-probs of `completion_ids` (b, T) int64, tile by tile (`HeadProjection.logprobs`)."""
        b, T = completion_ids.shape
        x = self.hidden[:, :-1].reshape(b * T, -1)  # (b*T, H)
        return self.projection.logprobs(x, completion_ids.reshape(-1), temperature).view(b, T)

    def logits(self) -> HeadLogits:
        """The (b, T, V) logits predicting the T tokens, computed on demand K cells at a time (`HeadLogits`)."""
        return HeadLogits(self.hidden[:, :-1], self.projection.logits, self.projection.vocab_size)


@contextlib.contextmanager
def head_inputs(model: nn.Module, persist: bool = False):
    """Within the block, every call of `model`'s LM head records what it received in the list this yields (one
    (input, `HeadProjection`) per call; `join_head_inputs` makes the forward's `HeadInput`) and then runs on no
    position: the forward returns (b, 0, V) logits, the (b, T + 1, V) ones are never built.

    The record is taken in a forward pre-hook of the head, after the hooks registered before it (ZeRO-3 gathers the
    head's weights there; a `PerLayerCast` casts them) and with the head's instance patch (an fp32 runner, TRL's
    `cast_lm_head_to_fp32`) as the call would run it. `persist` clones the weights (sharded policies: the engine frees
    its gathered weights when the forward ends) so that the projection stays valid after the forward. The hook is
    removed after the block.
    """
    head = base_model(model).get_output_embeddings()
    seen: list[tuple[torch.Tensor, HeadProjection]] = []

    def before_head(module, args, kwargs):
        x = args[0]  # (b, T + 1, H): the causal LM's `logits_to_keep` positions
        hidden, projection = capture_head(model, module.forward, x)
        seen.append((hidden, projection.persistent() if persist else projection))
        return (x[..., :0, :], *args[1:]), kwargs  # the head itself runs on no position

    handle = head.register_forward_pre_hook(before_head, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def join_head_inputs(seen: list[tuple[torch.Tensor, HeadProjection]], positions: int) -> HeadInput:
    """The forward's `HeadInput` from the head calls `head_inputs` recorded: one call, or one per position of a
    forward that runs token by token (`grpo-ratio probe invariance` decodes), joined along positions.

    Raises:
        RuntimeError: the forward did not call the LM head module, or not on `positions` positions in all.
    """
    if not seen:
        raise RuntimeError("grpo_ratio: the forward did not call the model's LM head module "
                           "(get_output_embeddings()); the scoring modes take the log-probs from that call's input")
    hidden = seen[0][0] if len(seen) == 1 else torch.cat([h for h, _ in seen], dim=-2)  # (b, T + 1, H)
    if hidden.shape[-2] != positions:
        raise RuntimeError(f"grpo_ratio: the LM head saw {hidden.shape[-2]} positions, {positions} expected")
    return HeadInput(hidden, seen[0][1])


# TRL's fused-head arguments, which a plain forward must not receive
_FUSED_HEAD_KWARGS = ("fused_lm_head", "shift_labels", "labels", "num_items_in_batch")


def packed_head_input(model: nn.Module, forward_kwargs: dict) -> HeadInput:
    """One forward of a packed row up to the LM head: TRL `AsyncGRPOTrainer`'s layout, `input_ids` and `position_ids`
    (1, N) plus the tree-attention arguments, exactly as its `compute_loss` passes them (the fused-head ones dropped).

    Returns:
        `HeadInput` with hidden (1, N, H): every packed position (a row's trained positions are scattered over it), the
        head itself run on none (`head_inputs`).
    """
    kwargs = {k: v for k, v in forward_kwargs.items() if k not in _FUSED_HEAD_KWARGS}
    with head_inputs(model) as seen:
        # type(model).forward: the class forward, past TRL's fused-head and accelerate's autocast instance patches
        type(model).forward(model, **kwargs, use_cache=False)
    return join_head_inputs(seen, kwargs["input_ids"].size(-1))


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
    for name in _DROPOUT_FIELDS:
        value = getattr(text_config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            found.setdefault(name, value)
    return [f"{k}={v}" for k, v in found.items()]


# ---------------------------------------------------------------------------------------------------------------------
# IEEE fp32: what the "fp32" scoring passes compute in, whatever the run set for its own matmuls and attention


# attn_implementations that compute fp32 inputs in fp32 ("paged|..." variants included); the others (FlashAttention
# 2/3, the kernels hub's flash kernels) take fp16/bf16 only and refuse fp32 q/k/v
FP32_ATTENTION = ("eager", "sdpa", "flex_attention")


def _matmul_precisions() -> dict[str, str] | str:
    """The fp32 matmul precision of every backend `torch.set_float32_matmul_precision` sets: per backend on torch >=
    2.9 (whose `get_float32_matmul_precision` refuses the mix transformers' `enable_tf32` leaves: the global
    `torch.backends.fp32_precision` set, the backends' not), else the one legacy value."""
    backends = torch.backends
    if not hasattr(backends, "fp32_precision"):
        return torch.get_float32_matmul_precision()
    state = {"": backends.fp32_precision, "cuda": backends.cuda.matmul.fp32_precision}
    if hasattr(backends, "mkldnn") and hasattr(backends.mkldnn, "matmul"):
        state["mkldnn"] = backends.mkldnn.matmul.fp32_precision
    return state


def _set_matmul_precisions(state: dict[str, str] | str) -> None:
    if isinstance(state, str):
        torch.set_float32_matmul_precision(state)
        return
    torch.backends.fp32_precision = state[""]
    torch.backends.cuda.matmul.fp32_precision = state["cuda"]
    if "mkldnn" in state:
        torch.backends.mkldnn.matmul.fp32_precision = state["mkldnn"]


def attention_refusing_fp32(model: nn.Module) -> str | None:
    """`model`'s `attn_implementation` when it refuses fp32 inputs (FlashAttention: fp16/bf16 only; transformers hands
    it the fp32 q/k/v of a pass outside autocast with fp32 weights), else None."""
    config = getattr(base_model(model), "config", None)
    name = getattr(config, "_attn_implementation", None)
    if not isinstance(name, str) or name.split("|")[-1] in FP32_ATTENTION:
        return None
    return name


def _attention_settings(config) -> list[tuple[object, object]]:
    """(config, `_attn_implementation_internal`) of `config` and every sub-config under it."""
    found, stack = [], [config]
    while stack:
        current = stack.pop()
        found.append((current, getattr(current, "_attn_implementation_internal", None)))
        stack += [getattr(current, k) for k in getattr(current, "sub_configs", {}) if getattr(current, k, None) is not None]
    return found


@contextlib.contextmanager
def ieee_fp32(enabled: bool = True, attention_of: nn.Module | None = None):
    """Within the block, fp32 is IEEE fp32 in the scoring passes; after it, the run's own settings are back.

    - Matmuls: `torch.set_float32_matmul_precision("highest")` (no TF32 on CUDA, no bf16 on oneDNN CPUs), whatever the
      run set: transformers turns `tf32=True`, and `torch_compile=True` with bf16, into TF32 for the whole process
      (`enable_tf32`), which keeps 10 of fp32's 23 mantissa bits in every fp32 matmul.
    - Attention, when `attention_of` (the policy, whose config its copies share) has an `attn_implementation` that
      refuses fp32 inputs (FlashAttention): `sdpa` for the block, its mask included (transformers reads the
      config at every forward). Pass it only for passes that run attention in fp32 (a whole fp32 forward, fp32
      decoder layers); a body that runs under the training autocast keeps its kernel.

    Args:
        enabled: False: a no-op (TRL's own pass computes as the run trains).
        attention_of: see above; None leaves the attention as it is.
    Yields:
        `RunSettings`: `as_run()` gives the run's own settings back for a part of the block.
    """
    if not enabled:
        yield RunSettings(None, [])
        return
    precisions = _matmul_precisions()
    switched = _attention_settings(base_model(attention_of).config) if (
        attention_of is not None and attention_refusing_fp32(attention_of) is not None) else []
    torch.set_float32_matmul_precision("highest")
    if switched:
        switched[0][0]._attn_implementation = "sdpa"  # the setter reaches the sub-configs
    try:
        yield RunSettings(precisions, switched)
    finally:
        for config, name in switched:
            config._attn_implementation_internal = name
        _set_matmul_precisions(precisions)


class RunSettings:
    """What `ieee_fp32` yields: the run's own matmul precisions and attention, to compute a piece of a scoring pass as
    the training forward does (`score(compare_policy=True)`'s "policy as trained" pass) inside the IEEE block."""

    def __init__(self, precisions, switched: list):
        self.precisions, self.switched = precisions, switched

    @contextlib.contextmanager
    def as_run(self):
        """Within the block the run's own settings (TF32 if the run set it, its attention kernel); IEEE fp32 after."""
        if self.precisions is None:  # `ieee_fp32(enabled=False)`: the run's settings throughout
            yield
            return
        inside = _matmul_precisions()
        _set_matmul_precisions(self.precisions)
        for config, name in self.switched:
            config._attn_implementation_internal = name
        try:
            yield
        finally:
            if self.switched:
                self.switched[0][0]._attn_implementation = "sdpa"
            _set_matmul_precisions(inside)

    def wrap(self, fn: Callable) -> Callable:
        """`fn` run under `as_run()` whenever it is called (a `HeadLogits` projection computed lazily)."""
        def run(*args, **kwargs):
            with self.as_run():
                return fn(*args, **kwargs)

        return run
