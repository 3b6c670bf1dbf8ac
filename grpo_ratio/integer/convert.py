"""Conversion of a float Llama / Qwen2 / Qwen3 checkpoint into an integer artifact (`IntModel`): the only stage where
floats are allowed.

1. Calibration: the float model runs on a few prompts; hooks record, per channel, the largest |x / rms(x)| at each
   norm's output (gain removed), the largest |input| of `o_proj` and `down_proj`, and the largest |K| (after the
   head norm and RoPE) and |V| per (layer, key/value head, channel).
2. Smoothing (SmoothQuant, alpha = 0.5, as DetLLM's closed-form smoothing): per input channel of every linear layer,
   s = max|x|^a / max|W|^(1-a) normalized by its median; the runtime multiplies the activation by the dyadic 1/s and
   the weights carry its exact inverse.
3. Weights: norm gains folded into the next weights, int8 per output channel (symmetric, 127 levels), the channel
   scales as dyadic mantissas m < 2^15 with one shift per matrix; embeddings int8 per row; biases 2^-24 fixed point;
   static K/V scales from the calibrated maxima times `kv_margin`; int16 RoPE tables from the model's own inverse
   frequencies.

Sources: DetLLM (N. Barry, "Eliminating Nondeterminism in LLM Inference with Integer-Only Arithmetic", 2026), I-LLM
(arXiv 2405.17849), SmoothQuant (Xiao et al., arXiv 2211.10438).
"""

from __future__ import annotations

import math
import time

import torch

from .model import BIAS_BITS, ROPE_BITS, IntLayer, IntLinear, IntModel, Smooth


FAMILIES = ("llama", "qwen2", "qwen3")
SMOOTH_BITS = 12  # smoothing mantissas; the weights carry the exact inverse, so their precision costs nothing


def _fit(s: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """Positive float64 s (any shape) -> (m int64, k) with m / 2^k ~ s, one shift k, the largest m in
    [2^(bits-1), 2^bits)."""
    k = (bits - 1) - math.floor(math.log2(float(s.max())))
    m = torch.round(s * 2.0 ** k).to(torch.int64)
    if int(m.max()) >= 1 << bits:
        k -= 1
        m = torch.round(s * 2.0 ** k).to(torch.int64)
    return m.clamp(min=1), k


def _smooth(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> tuple[Smooth, torch.Tensor]:
    """(runtime multiplier 1/s as a dyadic, the exact s the weights' input columns are multiplied by)."""
    if alpha <= 0:
        n = act_max.numel()
        return Smooth(torch.ones(n, dtype=torch.int64), 0), torch.ones(n, dtype=torch.float64)
    wmax = torch.stack([w.abs().amax(0) for w in weights]).amax(0).clamp(min=1e-8)
    s = act_max.clamp(min=1e-8).pow(alpha) / wmax.pow(1 - alpha)
    s = (s / s.median()).clamp(1 / 64, 64)
    m, k = _fit(1.0 / s, SMOOTH_BITS)
    return Smooth(m, k), 2.0 ** k / m.double()


def _linear(W: torch.Tensor, bias: torch.Tensor | None, bits: int = 15) -> IntLinear:
    """float64 W (N, K) -> int8 per output channel; checks the GEMM bound K * 127^2 < 2^31."""
    if W.size(1) * 127 * 127 >= 1 << 31:
        raise ValueError(f"a linear layer with {W.size(1)} inputs could overflow the int32 GEMM accumulator")
    scale = W.abs().amax(1).clamp(min=1e-12) / 127
    w8 = torch.round(W / scale[:, None]).clamp(-127, 127).to(torch.int8)
    m, k = _fit(scale, bits)
    b = None if bias is None else torch.round(bias.double() * 2.0 ** BIAS_BITS).to(torch.int64)
    return IntLinear(w8.t().contiguous(), m, k, b)


def _static(maxima: torch.Tensor, margin: float) -> tuple[Smooth, Smooth]:
    """Static int8 scales s = margin * max / 127 per channel: (s, 1/s) as dyadics."""
    s = (maxima.double() * margin / 127).clamp(min=1e-8)
    return Smooth(*_fit(s, 15)), Smooth(*_fit(1 / s, 15))


def _rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope_float(x: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """x (T, heads, D) rotated at positions 0..T-1 (rotate-half pairing)."""
    T, D = x.size(0), x.size(-1)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq.double())
    ang = torch.cat([ang, ang], -1)[:, None, :]
    rotated = torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1)
    return x * ang.cos() * scaling + rotated * ang.sin() * scaling


@torch.no_grad()
def calibrate(model, prompts: list[torch.Tensor]) -> dict:
    """Per-channel maxima of the float model on `prompts` (1-D int64 id tensors, each run alone, unpadded).

    Returns {"attn_in", "mlp_in", "o_in", "down_in": (L, C_in) float64, "head_in": (C,), "k", "v": (L, G, D)}."""
    core, cfg = model.model, model.config
    G = cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq, scaling = core.rotary_emb.inv_freq, float(getattr(core.rotary_emb, "attention_scaling", 1.0))
    n = len(core.layers)
    stats = {name: [None] * n for name in ("attn_in", "mlp_in", "o_in", "down_in", "k", "v")}
    stats["head_in"] = [None]

    def keep(name, i, x):
        x = x.double().abs().reshape(-1, *x.shape[2:]).amax(0)
        stats[name][i] = x if stats[name][i] is None else torch.maximum(stats[name][i], x)

    hooks = []
    for i, layer in enumerate(core.layers):
        attn = layer.self_attn
        hooks += [
            layer.input_layernorm.register_forward_pre_hook(
                lambda mod, a, i=i: keep("attn_in", i, _rms_normalized(a[0], mod.variance_epsilon))),
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda mod, a, i=i: keep("mlp_in", i, _rms_normalized(a[0], mod.variance_epsilon))),
            attn.o_proj.register_forward_pre_hook(lambda mod, a, i=i: keep("o_in", i, a[0])),
            layer.mlp.down_proj.register_forward_pre_hook(lambda mod, a, i=i: keep("down_in", i, a[0])),
            attn.v_proj.register_forward_hook(lambda mod, a, out, i=i: keep("v", i, out.view(*out.shape[:2], G, D))),
        ]
        k_site = attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj
        hooks.append(k_site.register_forward_hook(lambda mod, a, out, i=i: keep(
            "k", i, _rope_float(out.double().view(out.size(1), G, D), inv_freq, scaling).unsqueeze(0))))
    hooks.append(core.norm.register_forward_pre_hook(
        lambda mod, a: keep("head_in", 0, _rms_normalized(a[0], mod.variance_epsilon))))
    try:
        for ids in prompts:
            model(ids.view(1, -1).to(model.device))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.stack(v) if name != "head_in" else v[0] for name, v in stats.items()}


@torch.no_grad()
def convert(model, calibration_prompts: list[torch.Tensor], *, alpha: float = 0.5, kv_margin: float = 1.1,
            max_positions: int | None = None) -> IntModel:
    """The integer artifact of a float `LlamaForCausalLM`, `Qwen2ForCausalLM` or `Qwen3ForCausalLM` (on CPU).

    Args:
        model: the float model (any float dtype; read in float64).
        calibration_prompts: 1-D int64 token-id tensors, each run alone through the float model (a few suffice: they
            set the static K/V scales and the smoothing).
        alpha: SmoothQuant's migration strength (0 = no smoothing).
        kv_margin: the static K/V scales cover `kv_margin` times the calibrated maxima.
        max_positions: rope table length (default the config's `max_position_embeddings`, at most 8192).

    Returns:
        `IntModel` on CPU; `info` holds the family, the calibration and conversion seconds and the smallest weight
        mantissa.

    Raises:
        ValueError: another model family, an activation other than SiLU, no calibration prompt, or a layer that could
            overflow the int32 GEMM accumulator.
    """
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        raise ValueError(f"integer conversion: model_type {cfg.model_type!r} is not supported; allowed: "
                         f"{', '.join(FAMILIES)}")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise ValueError(f"integer conversion: hidden_act {cfg.hidden_act!r}; only 'silu' (SwiGLU) is supported")
    if not calibration_prompts:
        raise ValueError("integer conversion: calibration_prompts is empty; give a few prompts (token-id tensors)")
    start = time.perf_counter()
    stats = calibrate(model, calibration_prompts)
    calibrated = time.perf_counter() - start
    core = model.model
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    layers = []
    for i, layer in enumerate(core.layers):
        attn, mlp = layer.self_attn, layer.mlp

        def w(lin, gain=None):
            W = lin.weight.detach().double()
            return W * gain.detach().double()[None, :] if gain is not None else W

        def b(lin):
            return None if lin.bias is None else lin.bias.detach()

        g_attn, g_mlp = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        Wq, Wk, Wv = w(attn.q_proj, g_attn), w(attn.k_proj, g_attn), w(attn.v_proj, g_attn)
        Wg, Wu, Wo, Wd = w(mlp.gate_proj, g_mlp), w(mlp.up_proj, g_mlp), w(attn.o_proj), w(mlp.down_proj)
        attn_in, s_a = _smooth(stats["attn_in"][i], [Wq, Wk, Wv], alpha)
        mlp_in, s_m = _smooth(stats["mlp_in"][i], [Wg, Wu], alpha)
        o_in, s_o = _smooth(stats["o_in"][i], [Wo], alpha)
        down_in, s_d = _smooth(stats["down_in"][i], [Wd], alpha)
        k_mul, k_inv = _static(stats["k"][i], kv_margin)
        v_mul, v_inv = _static(stats["v"][i], kv_margin)
        norms = {}
        if hasattr(attn, "q_norm"):
            for name in ("q_norm", "k_norm"):
                norms[name] = Smooth(*_fit_signed(getattr(attn, name).weight.detach().double(), 14))
        layers.append(IntLayer(
            q=_linear(Wq * s_a, b(attn.q_proj)), k=_linear(Wk * s_a, b(attn.k_proj)),
            v=_linear(Wv * s_a, b(attn.v_proj)), o=_linear(Wo * s_o, b(attn.o_proj)),
            gate=_linear(Wg * s_m, b(mlp.gate_proj)), up=_linear(Wu * s_m, b(mlp.up_proj)),
            down=_linear(Wd * s_d, b(mlp.down_proj)), attn_in=attn_in, mlp_in=mlp_in, o_in=o_in, down_in=down_in,
            k_mul=k_mul, k_inv=k_inv, v_mul=v_mul, v_inv=v_inv, **norms))
    E = core.embed_tokens.weight.detach().double()
    escale = E.abs().amax(1).clamp(min=1e-12) / 127
    ek = 14 - torch.floor(torch.log2(escale)).to(torch.int64)
    em = torch.round(escale * torch.pow(2.0, ek.double())).to(torch.int64)
    Wh = w(model.get_output_embeddings(), core.norm.weight)
    head_in, s_h = _smooth(stats["head_in"], [Wh], alpha)
    positions = max_positions or min(int(getattr(cfg, "max_position_embeddings", 8192)), 8192)
    inv_freq = core.rotary_emb.inv_freq.double()
    scaling = float(getattr(core.rotary_emb, "attention_scaling", 1.0))
    ang = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    ang = torch.cat([ang, ang], -1)
    cos = torch.round(ang.cos() * scaling * 2 ** ROPE_BITS).to(torch.int16)
    sin = torch.round(ang.sin() * scaling * 2 ** ROPE_BITS).to(torch.int16)
    isd = _fit(torch.tensor([1 / math.sqrt(D)], dtype=torch.float64), 15)
    out = IntModel(
        embed=torch.round(E / escale[:, None]).clamp(-127, 127).to(torch.int8), embed_m=em, embed_k=ek,
        layers=layers, head_in=head_in,
        head=_linear(Wh * s_h, None if model.get_output_embeddings().bias is None else
                     model.get_output_embeddings().bias.detach()),
        cos=cos, sin=sin, num_heads=H, num_kv_heads=G, head_dim=D, inv_sqrt_d=(int(isd[0][0]), isd[1]))
    out.info = {"model_type": cfg.model_type, "layers": len(layers), "calibration_prompts": len(calibration_prompts),
                "calibration_tokens": int(sum(p.numel() for p in calibration_prompts)),
                "calibration_s": calibrated, "conversion_s": time.perf_counter() - start, "alpha": alpha,
                "kv_margin": kv_margin, "max_positions": positions,
                "min_weight_mantissa": min(int(lin.m.min()) for L in layers
                                           for lin in (L.q, L.k, L.v, L.o, L.gate, L.up, L.down))}
    return out


def _fit_signed(g: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    k = (bits - 1) - math.floor(math.log2(float(g.abs().max().clamp(min=1e-12))))
    return torch.round(g * 2.0 ** k).to(torch.int64), k

