"""`RatioGateCallback`: the tolerance gate of `grpo_ratio.diagnostics.gate` applied while training runs.

Each log row (`on_log`, what `logging_steps` writes to `trainer.state.log_history`) is checked; a check that fails on
`patience` consecutive logged steps warns, or stops training (`control.should_training_stop`). A stop is said in the
run's record (`run.json`: `"stopped_by_gate"`, `"gate_stop"` with the step, check and value, and `"completed": false`;
`grpo_ratio.diagnostics.run_record`), first in `grpo-ratio report`, and `grpo-ratio train` exits non-zero after it
(`run_record.GATE_STOP_EXIT_CODE`; a script of your own: `sys.exit(run_record.exit_status(output_dir))`). Checks, scopes and their syntax: `grpo_ratio.diagnostics.gate`.
"""

from __future__ import annotations

import logging
import warnings

from transformers import TrainerCallback

from .gate import Check, training_checks
from .run_record import GATE_STOP, STOPPED_BY_GATE, update_run_record


logger = logging.getLogger(__name__)


class RatioGateCallback(TrainerCallback):
    """Warn or stop training when a logged metric leaves its band for `patience` consecutive logged steps.

    Args:
        checks (`list[str | Check]`): checks with scope `each` (every log row holding the key) or `first` (the first
            log row holding it); other scopes need the whole run and are refused.
        patience (`int`, defaults to 1): consecutive failing log rows that trip the gate (a passing row resets the
            count; rows without the key neither count nor reset).
        action (`str`, defaults to `"warn"`): `"warn"` (a `UserWarning` and a log line, once per streak) or `"stop"`
            (also sets `control.should_training_stop`, so training ends after this step; checkpoints and logs of the
            steps done are kept as for any stop).

    Attributes:
        tripped (`list[str]`): one message per time the gate tripped, for inspection after training.
        stopped_by (`str | None`): under `action="stop"`, the check (`str(Check)`) that stopped the last `train()`;
            None when it ran to its end. Also written to `run.json` as `"stopped_by_gate"`, with `"gate_stop"`
            (`stop`) and `"completed": false` (main process).
        stop (`dict | None`): that stop's `step` (the logged step training stopped after), `max_steps` (planned),
            `check`, `key`, `value` (the failing logged value) and `patience`; None when no check stopped it.

    Raises:
        ValueError: a check with another scope, patience < 1, or an action not in `GATE_ACTIONS`.
    """

    def __init__(self, checks, patience: int = 1, action: str = "warn"):
        self.checks = training_checks(checks, patience, action)
        self.patience, self.action = patience, action
        self.streaks = [0] * len(self.checks)
        self.seen = [False] * len(self.checks)
        self.tripped: list[str] = []
        self.stopped_by: str | None = None
        self.stop: dict | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.stopped_by is not None:  # a second train() of the same trainer: the last stop is not this run's
            self.stopped_by = self.stop = None
            self._record(args, state)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        for i, check in enumerate(self.checks):
            value = (logs or {}).get(check.key)
            if value is None or isinstance(value, str) or (check.scope == "first" and self.seen[i]):
                continue
            self.seen[i] = True
            self.streaks[i] = 0 if check.holds(float(value)) else self.streaks[i] + 1
            if self.streaks[i] == self.patience:
                self._trip(check, float(value), args, state, control)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        never = [str(c) for c, seen in zip(self.checks, self.seen) if not seen]
        if never:  # a key no log row held: its check was never applied (a key TRL or the diagnostics did not log)
            message = f"ratio gate: never applied, no logged step held the key of {', '.join(never)}"
            self.tripped.append(message)
            logger.warning(message)
            warnings.warn(message, stacklevel=2)
        return control

    def _trip(self, check: Check, value: float, args, state, control) -> None:
        message = (f"ratio gate: {check.key} = {value:.6g} fails {check} for {self.patience} consecutive logged "
                   f"step(s), at step {state.global_step}")
        if self.action == "stop":
            message += "; stopping training"
            control.should_training_stop = True
            if self.stopped_by is None:  # the first check that stopped it
                self.stopped_by = str(check)
                self.stop = {"step": state.global_step, "max_steps": state.max_steps, "check": str(check),
                             "key": check.key, "value": value, "patience": self.patience}
                self._record(args, state)
        self.tripped.append(message)
        logger.warning(message)
        warnings.warn(message, stacklevel=2)

    def _record(self, args, state) -> None:
        """`run.json` `"stopped_by_gate"`, `"gate_stop"` and `"completed": false` after a stop; null and no
        `"completed"` after a reset (main process); a record that cannot be written is never worth the run."""
        if not state.is_world_process_zero:
            return
        stopped = self.stopped_by is not None
        try:
            update_run_record(args.output_dir, drop=() if stopped else ("completed",),
                              **{STOPPED_BY_GATE: self.stopped_by, GATE_STOP: self.stop},
                              **({"completed": False} if stopped else {}))
        except (OSError, TypeError, ValueError) as err:
            logger.warning("ratio gate: cannot write %s to the run record in %s (%s)", STOPPED_BY_GATE,
                           args.output_dir, err)
