"""What the console prints of each log row: TRL's keys and a few headline `ratio/*` keys, not all ~50 of them.

transformers prints every log row whole (`ProgressCallback.on_log` through the progress bar, or `PrinterCallback`
under `disable_tqdm=True`); with the ratio diagnostics on that is about 75 keys per step. `quiet_console(trainer)`
puts `RatioProgressCallback` / `RatioPrinterCallback` in their place (same position in the callback list, same
behaviour otherwise): each prints the row's keys that are not `ratio/*`, the `CONSOLE_RATIO_KEYS` the row holds, and
one entry `"ratio/*": "+N more in log_history.json"` for the rest. Only the printed copy is trimmed: the row itself,
`trainer.state.log_history`, `log_history.json`, W&B, TensorBoard and every other callback get every key.

To print every key again: `trainer.remove_callback(RatioProgressCallback)` then
`trainer.add_callback(transformers.ProgressCallback)` (or the `Printer` pair under `disable_tqdm=True`).
"""

from __future__ import annotations

from transformers import PrinterCallback, ProgressCallback

from . import metric_keys as keys
from .run_record import LOG_HISTORY_FILE


# the headline ratio keys printed when present: the two ratios' size, the IS weight and what it zeroes, the clip
CONSOLE_RATIO_KEYS = (
    keys.NEW_OLD.oob_rate, keys.NEW_OLD.mean_abs_log_ratio, keys.OLD_SAMPLER.oob_rate, keys.OLD_SAMPLER.mean,
    keys.OLD_SAMPLER_CORRECTED.oob_rate, keys.KEPT_MASS_MEAN, keys.CLIP_FLIP_RATE, keys.IS_WEIGHT_MEAN,
    keys.IS_ZERO_WEIGHT_TOKEN_FRAC, keys.FP16_FALLBACK_ROWS,
)
MORE_KEY = f"{keys.PREFIX}/*"


def console_logs(logs: dict) -> dict:
    """The copy of a log row the console prints: every key but `ratio/*`, the `CONSOLE_RATIO_KEYS` it holds (in the
    row's order), and `"ratio/*": "+N more in log_history.json"` when N other `ratio/*` keys were left out."""
    prefix = keys.PREFIX + "/"
    shown = {k: v for k, v in logs.items() if not k.startswith(prefix) or k in CONSOLE_RATIO_KEYS}
    hidden = sum(1 for k in logs if k.startswith(prefix) and k not in CONSOLE_RATIO_KEYS)
    if hidden:
        shown[MORE_KEY] = f"+{hidden} more in {LOG_HISTORY_FILE}"
    return shown


class RatioProgressCallback(ProgressCallback):
    """transformers' `ProgressCallback`, printing `console_logs(logs)` under the progress bar."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return super().on_log(args, state, control, logs=console_logs(logs or {}), **kwargs)


class RatioPrinterCallback(PrinterCallback):
    """transformers' `PrinterCallback` (`disable_tqdm=True`), printing `console_logs(logs)`. Like it, it drops
    `total_flos` from the row the later callbacks see."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs.pop("total_flos", None)  # what PrinterCallback does to the shared row, kept for the callbacks after it
        return super().on_log(args, state, control, logs=console_logs(logs), **kwargs)


def quiet_console(trainer) -> None:
    """Replace the trainer's `ProgressCallback` or `PrinterCallback` (exactly those classes: a notebook's progress
    table is left alone) by its `Ratio*` counterpart, at the same place in the callback list."""
    callbacks = trainer.callback_handler.callbacks
    for i, callback in enumerate(callbacks):
        if type(callback) is ProgressCallback:
            callbacks[i] = RatioProgressCallback()
        elif type(callback) is PrinterCallback:
            callbacks[i] = RatioPrinterCallback()
