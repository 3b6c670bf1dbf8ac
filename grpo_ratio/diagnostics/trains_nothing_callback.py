"""`TrainsNothingCallback`: say during training, once, that an IS correction zeroes (nearly) every token of a step.

An IS correction whose bound the run's sampler/trainer distance never meets sets every weight to 0: loss 0,
grad_norm 0, a frozen policy, and nothing else looks wrong (e.g. `is_correction="geo_rs"` at top_p=0.8 without
a truncation correction rejected every sequence of every step). At the first logged step where the share of tokens
with IS weight 0 (`trains_nothing.zero_weight_share`) reaches `ZERO_WEIGHT_WARN` (0.9), this callback warns
(`UserWarning` and a log line) naming the correction, its bounds, the distance the run measured and a setting that
would fit, and writes the sentence to `run.json` (`"trains_nothing"`: step, share, message), which
`grpo-ratio report` prints. To stop on it instead: `ratio_gate=["ratio/is_zero_weight_token_frac<0.9"]`,
`ratio_gate_action="stop"` (`trains_nothing.GATE_CHECK`).

It reads the logged row (`on_log`: values already reduced across micro-batches and processes at log time), so it adds
no host sync; side effects only (it never changes `control` or the logs). Every `RatioGRPOTrainer`,
`RatioRLOOTrainer` and `RatioAsyncGRPOTrainer` adds it.
"""

from __future__ import annotations

import logging
import math
import warnings

from transformers import TrainerCallback

from . import metric_keys as keys
from .run_record import TRAINS_NOTHING, update_run_record
from .trains_nothing import GATE_CHECK, ZERO_WEIGHT_WARN, fmt, trained_nothing, zero_weight_share


logger = logging.getLogger(__name__)

def _round_up(x: float) -> float:
    """x rounded up to one significant digit (0.223 -> 0.3): a bound to quote."""
    if x <= 0 or not math.isfinite(x):
        return x
    unit = 10 ** math.floor(math.log10(x))
    return math.ceil(x / unit - 1e-9) * unit


def _bounds_text(correction) -> str:
    """The correction's bounds, each rule with what it means as a ratio where it is a mean k1 or ratio rule."""
    parts = []
    if correction.level != "none" and (correction.low is not None or correction.high is not None):
        parts.append(f"IS weight ({correction.level}) {correction.action} outside "
                     f"[{'' if correction.low is None else correction.low:}, "
                     f"{'' if correction.high is None else correction.high}]")
    for rule in correction.rejections:
        text = f"rejection {rule}"
        if rule.metric == "k1" and rule.agg == "mean" and rule.low is not None and rule.high is not None:
            text += (f" (the geometric-mean ratio old/sampler of a sequence kept in "
                     f"[{math.exp(-rule.high):.4g}, {math.exp(-rule.low):.4g}])")
        parts.append(text)
    if correction.veto is not None:
        parts.append(f"veto {correction.veto:g} (a sequence with any r_t below it rejected)")
    return "; ".join(parts) or str(correction)


def _measured(row: dict, correction) -> tuple[str, str | None]:
    """(the distance the run measured, as the bounds read it; a looser rejection that this distance would pass,
    or None), from the logged row."""
    family = keys.OLD_SAMPLER_CORRECTED if keys.OLD_SAMPLER_CORRECTED.mean_abs_log_ratio in row else keys.OLD_SAMPLER
    said = []
    abs_log = row.get(family.mean_abs_log_ratio)
    if abs_log is not None:
        said.append(f"mean |log old/sampler| = {fmt(abs_log)} nats per token ({family.mean_abs_log_ratio})")
    looser = []
    seq_abs = row.get(keys.mismatch_key(keys.OLD_SAMPLER, "log_ppl_abs_diff"))
    seq_signed = row.get(keys.mismatch_key(keys.OLD_SAMPLER, "log_ppl_diff"))
    for rule in correction.rejections:
        if rule.agg == "mean" and rule.metric in ("k1", "ratio") and seq_abs is not None:
            said.append(f"mean |seq_mean_k1| = {fmt(seq_abs)} nats per sequence (signed {fmt(seq_signed)}; "
                        f"{keys.mismatch_key(keys.OLD_SAMPLER, 'log_ppl_abs_diff')})")
            b = _round_up(2 * seq_abs)
            looser.append(f"-{b:g}<=seq_mean_k1<={b:g}" if rule.metric == "k1"
                          else f"{_round_down(math.exp(-b)):g}<=seq_mean_ratio<={_round_up(math.exp(b)):g}")
        elif rule.metric in ("k2", "k3") and (value := row.get(keys.mismatch_key(keys.OLD_SAMPLER, f"kl_{rule.metric}"))) is not None:
            said.append(f"mean {rule.metric} = {fmt(value)} per token (ratio/old_sampler/kl_{rule.metric})")
            looser.append(f"{rule.name}<={_round_up(2 * value):g}")
        elif rule.metric == "prob_error" and abs_log is not None:
            looser.append(f"{rule.name}<={_round_up(1 + 2 * (math.exp(abs_log) - 1)):g}")
    stale = sorted((int(k.split("/")[2]), v) for k, v in row.items()
                   if k.startswith(keys.STALENESS_PREFIX + "/") and k.endswith("/prox_behav_oob_rate"))
    if stale:  # the asynchronous trainer: the behaviour -> proximal ratio the weight is made of, per staleness
        said.append("proximal/behaviour out of band " + ", ".join(f"{v:.0%} at staleness {k}" for k, v in stale)
                    + " (ratio/staleness/<k>/prox_behav_oob_rate)")
    p1, p99 = row.get(keys.IS_WEIGHT_RAW_P1), row.get(keys.IS_WEIGHT_RAW_P99)
    if p1 is not None and p99 is not None:
        said.append(f"raw IS weights p1 {fmt(p1)}, p99 {fmt(p99)}")
    return "; ".join(said) or "no old/sampler distance logged", ", ".join(dict.fromkeys(looser)) or None


def _round_down(x: float) -> float:
    """x in (0, 1] rounded down to the decimal that keeps its first digit below 9 (0.7999 -> 0.7)."""
    unit = 10 ** math.floor(math.log10(1 - x)) if 0 < x < 1 else 1
    return math.floor(x / unit) * unit if 0 < x < 1 else x


def _fits(row: dict, correction, setting: str, truncation_correction: str | None, looser: str | None) -> str:
    """The settings that would fit the measured distance."""
    options = []
    sampler_mean = row.get(keys.OLD_SAMPLER.mean)
    if (truncation_correction in (None, "none") and sampler_mean is not None and sampler_mean < 0.97):
        options.append(f"truncation_correction='lift_sampler' or 'renormalize' (old/sampler has mean "
                       f"{fmt(sampler_mean)}: the kept mass of truncated sampling, top_p/top_k/min_p, which no bound "
                       f"on the sampler's precision should absorb)")
    if looser is not None:
        options.append(f"a bound this run's distance passes: is_correction='custom', is_correction_level="
                       f"{correction.level!r}" + (f", is_correction_action={correction.action!r}"
                                                  if correction.level != "none" else "")
                       + f", is_correction_rejection={looser!r}")
    if correction.level == "none" or correction.action == "mask":
        options.append("is_correction='tis' (truncates the token weight at 2: it never zeroes a token)")
    return "; or ".join(options)


def trains_nothing_message(row: dict, step, share: float, correction, setting: str,
                           truncation_correction: str | None = None) -> str:
    """The warning: which correction (`setting`, e.g. "is_correction='geo_rs'"), its bounds, the distance measured
    (from the logged `row`), and the settings that would fit. `correction`: the `ISCorrection` the weight came from."""
    measured, looser = _measured(row, correction)
    frozen = ("the step trained nothing (loss 0, grad_norm 0)" if trained_nothing(row)
              else "those tokens train nothing")
    rejected = row.get(keys.IS_REJECTED_SEQ_FRAC)
    seqs = f", {rejected:.0%} of the sequences rejected" if rejected is not None else ""
    fits = _fits(row, correction, setting, truncation_correction, looser)
    return (f"grpo_ratio: {setting} set the IS weight of {share:.0%} of the tokens of step {step} to 0 "
            f"({keys.IS_ZERO_WEIGHT_TOKEN_FRAC} = {fmt(share)}{seqs}): {frozen}. "
            f"Its bounds: {_bounds_text(correction)}. Measured: {measured}. "
            + (f"What would fit: {fits}. " if fits else "")
            + f"To stop such a run instead: ratio_gate=[{GATE_CHECK!r}], ratio_gate_action='stop' (docs/corrections.md).")


class TrainsNothingCallback(TrainerCallback):
    """Warn once, at the first logged step where at least `threshold` of the tokens got IS weight 0.

    Args:
        correction (`ISCorrection | None`): the correction the loss's IS weight comes from (`is_correction`, or TRL's
            vLLM mode as an `ISCorrection`); None: the callback never warns.
        setting (`str`): how to name it to the user, e.g. "is_correction='geo_rs'".
        truncation_correction (`str | None`): the run's `truncation_correction` (a suggestion never repeats it).
        threshold (`float`, defaults to `ZERO_WEIGHT_WARN`): the share of zero-weight tokens that warns.

    Attributes:
        message (`str | None`): the warning once given.
    """

    def __init__(self, correction, setting: str, truncation_correction: str | None = None,
                 threshold: float = ZERO_WEIGHT_WARN):
        self.correction, self.setting, self.truncation_correction = correction, setting, truncation_correction
        self.threshold = threshold
        self.message: str | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.message is not None:  # a second train() of the same trainer warns again, for itself
            self.message = None
            if state.is_world_process_zero:
                self._record(args, None)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.message is not None or self.correction is None or not logs:
            return control
        share = zero_weight_share(logs)
        if share is None or share < self.threshold:
            return control
        self.message = trains_nothing_message(logs, state.global_step, share, self.correction, self.setting,
                                              self.truncation_correction)
        if state.is_local_process_zero:  # every process reads the same reduced row: one warning per machine
            logger.warning(self.message)
            warnings.warn(self.message, stacklevel=2)
        if state.is_world_process_zero:
            self._record(args, {"step": state.global_step, "share": share, "message": self.message})
        return control

    @staticmethod
    def _record(args, value) -> None:
        try:
            update_run_record(args.output_dir, **{TRAINS_NOTHING: value})
        except (OSError, TypeError, ValueError) as err:  # a record is never worth the run
            logger.warning("grpo_ratio: cannot write %s to the run record in %s (%s)", TRAINS_NOTHING,
                           args.output_dir, err)


def trains_nothing_callback(args, correction) -> TrainsNothingCallback:
    """The callback of a trainer's config: `correction` is the `ISCorrection` of its loss's IS weight (the plan's,
    or TRL's vLLM mode), named by `args.is_correction` or TRL's `vllm_importance_sampling_mode`."""
    name = getattr(args, "is_correction", None)
    if name:
        setting = f"is_correction={name!r}"
    else:
        mode = getattr(args, "vllm_importance_sampling_mode", None)
        setting = f"TRL's vLLM IS correction (vllm_importance_sampling_mode={mode!r})"
    return TrainsNothingCallback(correction, setting, getattr(args, "truncation_correction", None))
