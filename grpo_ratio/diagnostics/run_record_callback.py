"""`RunRecordCallback`: every `RatioGRPOTrainer` leaves its run record (`run_record.py`) in `args.output_dir`.

So `grpo-ratio report OUTPUT_DIR` reads the arm and the log history of a run from a script of your own (swap
`trl.GRPOTrainer` for `RatioGRPOTrainer`, call `trainer.train()`, save no checkpoint) as it reads one of
`grpo-ratio train`. Side effects only: it reads the trainer's state and never changes `control`, the log rows or a
checkpoint. On the main process only. Remove it with `trainer.remove_callback(RunRecordCallback)`.
"""

from __future__ import annotations

import logging
import warnings

from transformers import TrainerCallback

from .run_record import (
    GATE_STOP,
    HEAD_ARITHMETIC,
    PER_TRAIN_KEYS,
    read_run_record,
    run_config,
    run_finished,
    update_run_record,
    write_log_history,
)


logger = logging.getLogger(__name__)


class RunRecordCallback(TrainerCallback):
    """Write `run.json` (the config's `RUN_FIELDS`, whether training ended) and `log_history.json`
    (`state.log_history`) to `args.output_dir`.

    - `on_train_begin`: `run.json` with `"config"` and `"train_ended": false`, merged into the one already there
      (an entry point's keys, such as `grpo-ratio compare`'s arm and seed; without what an earlier run said of its
      own `train()`, `run_record.PER_TRAIN_KEYS`) unless that one records a finished run or one the gate stopped,
      which this run replaces.
    - `on_log` (every `logging_steps`, evaluations and TRL's final summary row): `log_history.json`; a crashed or
      stopped run keeps its history up to its last log.
    - `on_train_end`: `log_history.json` again and `"train_ended": true`.

    A file that cannot be written (a full disk, a read-only folder) is warned about once and training goes on.

    Args:
        head_arithmetic: zero-argument callable returning the run's `"head_arithmetic"` entry (a dict, or None where
            no scoring head computes in fp32), written with the config; the trainer passes it (this module imports
            no torch). The entry is written only where it returns a dict.
    """

    def __init__(self, head_arithmetic=None):
        self.recorded = False  # run.json written by this run
        self.warned = False
        self.head_arithmetic = head_arithmetic

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._record(args, train_ended=False)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            if not self.recorded:  # logged outside train() (`trainer.evaluate()`): the config still belongs beside it
                self._record(args)
            self._guarded(write_log_history, args.output_dir, state.log_history)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._guarded(write_log_history, args.output_dir, state.log_history)
            self._record(args, train_ended=True)

    def _record(self, args, **fields) -> None:
        fresh = False
        if not self.recorded:  # the first write of this run: a finished run's record is replaced, not merged into
            try:
                existing = read_run_record(args.output_dir)
            except (OSError, TypeError, ValueError):
                existing = {}
            fresh = bool(existing) and (run_finished(existing) or bool(existing.get(GATE_STOP)))
        # merged into another run's record (one cut short): what that run's train() said of itself is not this run's
        # (the callbacks that write those keys set them back themselves at a later train() of the same trainer)
        drop = PER_TRAIN_KEYS if not self.recorded else ()
        arithmetic = self.head_arithmetic() if self.head_arithmetic is not None else None
        if arithmetic is not None:  # only where a scoring head computes in fp32: other records stay as they were
            fields[HEAD_ARITHMETIC] = arithmetic
        self._guarded(update_run_record, args.output_dir, fresh, drop, config=run_config(args), **fields)
        self.recorded = True

    def _guarded(self, write, *call_args, **call_kwargs) -> None:
        try:
            write(*call_args, **call_kwargs)
        except (OSError, TypeError, ValueError) as err:  # a record is never worth a training run
            if not self.warned:
                self.warned = True
                message = (f"grpo-ratio: cannot write the run record in {call_args[0]} ({type(err).__name__}: {err}); "
                           f"training goes on, `grpo-ratio report` will lack it")
                logger.warning(message)
                warnings.warn(message, stacklevel=2)
