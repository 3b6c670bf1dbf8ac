"""The integer row: a bit-exact, integer-only forward of Llama / Qwen2 / Qwen3 models (DetLLM), an integer sampler
whose draws do not depend on the batch, and the exact integer old pass; docs/integer.md.

    from grpo_ratio.integer import convert, generate, IntSampling
    int_model = convert(float_model, calibration_prompts)          # the only float stage
    logits = int_model(input_ids, valid)                            # (B, T, V) int32, value = logits / 2^16
    out = generate(int_model, prompts, max_new_tokens=32, sampling=IntSampling(temperature=1.0, seed=0))
"""

from .arith import FloatInForwardError, NoFloatMode
from .convert import FAMILIES, calibrate, convert
from .model import IntCache, IntModel


__all__ = ["FAMILIES", "FloatInForwardError", "IntCache", "IntModel", "NoFloatMode", "calibrate", "convert"]
