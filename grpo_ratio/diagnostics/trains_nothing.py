"""Steps that train nothing: the one rule, read from a logged row, shared by the warning during training
(`trains_nothing_callback.TrainsNothingCallback`) and `grpo-ratio report`.

Two readings of one log row (what `trainer.state.log_history` holds per `logging_steps`):

- `zero_weight_share(row)`: the share of the step's tokens whose IS weight is exactly 0 (the bounds of a `mask`
  action, a rejection rule or the veto zeroed it): `ratio/is_zero_weight_token_frac` where logged; from an older log
  the largest of `ratio/is_rejected_token_frac` and `ratio/is_masked_token_frac` (a lower bound), or 1 when
  `ratio/is_weight_mean` is 0; on the asynchronous trainer the share of tokens in staleness buckets whose
  `ratio/staleness/<k>/is_weight_mean` is 0 (a lower bound). None when the row holds no IS weight statistic.
  At `ZERO_WEIGHT_WARN` (0.9) or more the trainer warns once and the report flags the step.
- `trained_nothing(row)`: TRL logged `loss` 0 and `grad_norm` 0 for the step: no parameter received a gradient.
  `why_trained_nothing` names the cause the row shows: every IS weight 0 (the correction), every group's rewards
  equal (advantages 0, TRL's `frac_reward_zero_std` = 1), or no valid completion token.

Both read values already reduced across processes and micro-batches (the logged floats): no tensor, no host sync.
Imports nothing heavy (no torch, no transformers): the report stays quick to start.
"""

from __future__ import annotations

import math

from . import metric_keys as keys


ZERO_WEIGHT_WARN = 0.9  # share of a logged step's tokens with IS weight 0 from which the run is said to train ~nothing
GATE_CHECK = f"{keys.IS_ZERO_WEIGHT_TOKEN_FRAC}<{ZERO_WEIGHT_WARN:g}"  # the ratio_gate check that stops on it


def _number(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _staleness_zero_share(row: dict) -> float | None:
    """Asynchronous runs: the share of trained tokens in staleness buckets whose mean IS weight is 0."""
    total = zero = 0.0
    prefix = keys.STALENESS_PREFIX + "/"
    for key, value in row.items():
        if not (key.startswith(prefix) and key.endswith("/is_weight_mean")):
            continue
        bucket = key[: -len("is_weight_mean")]
        n = _number(row, bucket + "num_tokens")
        if n:
            total += n
            zero += n if value == 0 else 0.0
    return zero / total if total else None


def zero_weight_share(row: dict) -> float | None:
    """Share in [0, 1] of a logged step's tokens whose IS weight was 0 (module docstring); None without an IS
    weight statistic in `row`."""
    share = _number(row, keys.IS_ZERO_WEIGHT_TOKEN_FRAC)
    if share is not None:
        return share
    parts = [v for k in (keys.IS_REJECTED_TOKEN_FRAC, keys.IS_MASKED_TOKEN_FRAC) if (v := _number(row, k)) is not None]
    if _number(row, keys.IS_WEIGHT_MEAN) == 0:
        return 1.0
    if parts:
        return max(parts)
    return _staleness_zero_share(row)


def trained_nothing(row: dict) -> bool:
    """TRL logged `loss` == 0 and `grad_norm` == 0 for this step (a training row; both keys needed)."""
    loss, grad = _number(row, "loss"), _number(row, "grad_norm")
    return loss is not None and grad is not None and loss == 0 and grad == 0


def correction_name(config: dict | None) -> str | None:
    """The IS correction of a run's configuration (`run_record.RUN_FIELDS`), as a setting to quote:
    `is_correction='geo_rs'`, TRL's `vllm_importance_sampling_mode='sequence_mask'` with vLLM, or None."""
    config = config or {}
    if config.get("is_correction"):
        return f"is_correction={config['is_correction']!r}"
    if config.get("use_vllm") and config.get("vllm_importance_sampling_correction"):
        mode = config.get("vllm_importance_sampling_mode")
        return f"TRL's vLLM correction (vllm_importance_sampling_mode={mode!r})" if mode else "TRL's vLLM correction"
    return None


def why_trained_nothing(row: dict, config: dict | None = None) -> str:
    """Why a step with `trained_nothing(row)` trained nothing, from what the row shows (one clause)."""
    share = zero_weight_share(row)
    if share is not None and share >= 1.0:
        name = correction_name(config) or "the IS correction"
        rejected = _number(row, keys.IS_REJECTED_SEQ_FRAC)
        what = (f"it rejected {rejected:.0%} of the sequences" if rejected is not None and rejected > 0
                else "its bounds masked every token")
        return f"every token's IS weight was 0: {name} zeroed them ({what})"
    if _number(row, "frac_reward_zero_std") == 1:
        return "every group's rewards were equal (frac_reward_zero_std = 1): every advantage was 0"
    if _number(row, keys.NEW_OLD.num_tokens) == 0:
        return "no valid completion token (every completion masked)"
    if share is not None and share >= ZERO_WEIGHT_WARN:
        return f"{share:.0%} of the tokens had IS weight 0 ({correction_name(config) or 'the IS correction'})"
    return "the row shows no cause (no IS weight statistic, rewards not all equal)"


def steps_that_trained_nothing(history: list[dict], config: dict | None = None) -> list[tuple[int | None, str]]:
    """(step, why) of every training row with loss 0 and grad_norm 0, or with `zero_weight_share` >=
    `ZERO_WEIGHT_WARN` (most of its tokens trained nothing); TRL's final summary row excluded."""
    out = []
    for row in history:
        if "train_runtime" in row:
            continue
        share = zero_weight_share(row)
        if trained_nothing(row):
            out.append((row.get("step"), why_trained_nothing(row, config)))
        elif share is not None and share >= ZERO_WEIGHT_WARN:
            out.append((row.get("step"), f"{share:.0%} of the tokens had IS weight 0 "
                                         f"({correction_name(config) or 'the IS correction'}): most trained nothing"))
    return out


def fmt(x: float) -> str:
    """A logged value in a sentence: 4 significant digits; inf/nan as is."""
    return f"{x:.4g}" if math.isfinite(x) else str(x)
