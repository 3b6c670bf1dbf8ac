"""The run record: what a run leaves beside its logs so that `grpo-ratio report` can read it without the trainer.

Two files in the run's `output_dir`, written on the main process by every `RatioGRPOTrainer` (its
`RunRecordCallback`, `run_record_callback.py`), whether `grpo-ratio train`, `grpo-ratio compare` or a script of your
own calls `trainer.train()`:

- `log_history.json` (`LOG_HISTORY_FILE`): `trainer.state.log_history`, TRL's log rows as a JSON list (indent 1),
  rewritten at every log event and at the end of training, so a run that crashed or was stopped keeps its rows up to
  its last log.
- `run.json` (`RUN_FILE`): a JSON object, written when training starts and when it ends:
  - `"config"`: the `RUN_FIELDS` of the run's `RatioGRPOConfig` (`run_config`): its arm, correction and sampling,
    what the report's findings read;
  - `"train_ended"`: false from the start of `train()`, true once it reached its end (a stop by
    `control.should_training_stop` included; a crash leaves it false).
  - `"stopped_by_gate"` (`STOPPED_BY_GATE`): the check (`[SCOPE:]KEY OP VALUE`) whose failure stopped training
    under `ratio_gate_action="stop"`, written by `RatioGateCallback` when it stops the run (set back to null by a
    later `train()` of the same trainer); absent or null when no gate stopped it. `grpo-ratio train` then exits
    with status `GATE_STOP_EXIT_CODE` (3).
  Entry points add keys to the same object (`update_run_record`): `grpo-ratio train` `"completed"` (all its outputs
  written, a run stopped by the gate included), `grpo-ratio compare` `"arm"`, `"seed"`, `"fingerprint"`, `"machine"`
  and `"completed"`.

Both files are replaced whole (a temporary file, then a rename): a run killed while writing leaves the previous
version, never half a file. Nothing is written into checkpoint folders.

This module is the format's one home: the trainer writes it, `grpo_ratio.analysis.report` reads it (no torch, no
transformers imported here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


__all__ = ["GATE_STOP_EXIT_CODE", "LOG_HISTORY_FILE", "RUN_FIELDS", "RUN_FILE", "STOPPED_BY_GATE", "read_run_record",
           "run_config", "run_finished", "update_run_record", "write_log_history"]

LOG_HISTORY_FILE = "log_history.json"
RUN_FILE = "run.json"
STOPPED_BY_GATE = "stopped_by_gate"  # run.json: the check that stopped training (ratio_gate_action="stop")
# exit status of `grpo-ratio train` (trainers/grpo.py) when the ratio gate stopped training: not 0 (a CI job keyed on
# the exit status sees the gate fire), not 1 (an uncaught error) nor 2 (a set-up error, `grpo-ratio train: error:`)
GATE_STOP_EXIT_CODE = 3

# what a run was configured with, written to its run.json, printed by the report and read by the findings
# (`grpo_ratio.analysis.advice`)
RUN_FIELDS = ("old_logprob_mode", "guided_fp32_layers", "truncation_correction", "kept_set_source", "top_p", "top_k",
              "min_p", "temperature", "bf16", "fp16", "use_vllm", "vllm_dtype", "vllm_importance_sampling_correction",
              "num_iterations", "disable_dropout", "mask_truncated_completions", "max_completion_length",
              "ratio_diagnostics", "learning_rate", "max_steps", "per_device_train_batch_size", "num_generations",
              "routing_replay", "ratio_attribution", "is_correction", "async_objective", "max_staleness",
              "trl_trainer", "trust_region", "ratio_by_position")


def run_config(args) -> dict:
    """`RUN_FIELDS` of a `RatioGRPOConfig` or `RatioRLOOConfig` (None where the config lacks one: RLOO has no
    `vllm_importance_sampling_correction`); `trl_trainer` says which TRL trainer ran ("grpo", "rloo"): what
    `findings` reads of a run."""
    return {k: getattr(args, k, None) for k in RUN_FIELDS}


def read_run_record(run_dir: str | Path) -> dict:
    """The `run.json` of `run_dir` as a dict; {} when there is none.

    Raises:
        ValueError: a `run.json` that is not a JSON object.
    """
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    if not isinstance(record, dict):
        raise ValueError(f"{path}: not a JSON object (a run record)")
    return record


def run_finished(record: dict) -> bool:
    """Whether a run record belongs to a run that finished: its entry point says `"completed"`, else its trainer
    says `"train_ended"`; a record with neither (or no record, {}) counts as finished, as before either existed."""
    return bool(record.get("completed", record.get("train_ended", True)))


def _write_json(path: Path, data) -> None:
    """`path` replaced whole by `data` as JSON (indent 1): a temporary file beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def write_log_history(run_dir: str | Path, history: list[dict]) -> Path:
    """Write `history` (`trainer.state.log_history`) to `run_dir/log_history.json`; returns the file."""
    path = Path(run_dir) / LOG_HISTORY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, list(history))
    return path


def update_run_record(run_dir: str | Path, fresh: bool = False, **fields) -> dict:
    """Merge `fields` into `run_dir/run.json` (created when missing; started anew with `fresh`, or when the file is
    unreadable); returns the record written."""
    path = Path(run_dir) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        record = {} if fresh else read_run_record(run_dir)
    except ValueError:  # not ours (or not JSON): replaced, as the files of an overwritten run are
        record = {}
    record.update(fields)
    _write_json(path, record)
    return record
