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
    under `ratio_gate_action="stop"`, and `"gate_stop"` (`GATE_STOP`): `{"step", "max_steps", "check", "key",
    "value", "patience"}` of that stop (the logged step it stopped after, of how many planned, the failing value),
    with `"completed": false`: all three written by `RatioGateCallback` when it stops the run; null when no gate
    stopped it (set back by a later `train()`). `grpo-ratio train` then exits with status `GATE_STOP_EXIT_CODE` (3);
    a script of your own turns it into its exit status with `exit_status(output_dir)`.
  - `"trains_nothing"` (`TRAINS_NOTHING`): `{"step", "share", "message"}` of the first logged step where an IS
    correction set the weight of >= 90% of the tokens to 0 (`trains_nothing_callback.TrainsNothingCallback`, the
    warning it gave); null otherwise.
  - `"head_arithmetic"` (`HEAD_ARITHMETIC`): under a scoring mode whose LM head computes in fp32 (`fp32_head`,
    `guided_fp32`, `fp32_clone`), what that head multiplied and with which kernel, and the fp32 matmul precision of
    the run itself: `{"operands", "norm", "matmul", "fp32_matmul", "run_fp32_matmul"}`
    (`grpo_ratio.old_pass.forward.head_arithmetic`; `fp32_head_operands`); absent under the other modes.
  Entry points add keys to the same object (`update_run_record`): `grpo-ratio train` `"completed"` (true once all its
  outputs are written after a run that reached its end; false after a gate stop) and `"outputs_saved"`,
  `grpo-ratio compare` `"arm"`, `"seed"`, `"fingerprint"`, `"machine"`, `"completed"` (as `grpo-ratio train`) and
  `"outputs_saved"` (a resumed comparison keeps an arm that has it, a gate-stopped one too).

Both files are replaced whole (a temporary file, then a rename): a run killed while writing leaves the previous
version, never half a file. Nothing is written into checkpoint folders.

This module is the format's one home: the trainer writes it, `grpo_ratio.analysis.report` reads it (no torch, no
transformers imported here).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..corrections.centering import centering_source


__all__ = ["GATE_STOP", "GATE_STOP_EXIT_CODE", "HEAD_ARITHMETIC", "LOG_HISTORY_FILE", "PER_TRAIN_KEYS", "RUN_FIELDS", "RUN_FILE",
           "STOPPED_BY_GATE", "TRAINS_NOTHING", "exit_status", "read_run_record", "run_config", "run_finished",
           "update_run_record", "write_log_history"]

LOG_HISTORY_FILE = "log_history.json"
RUN_FILE = "run.json"
STOPPED_BY_GATE = "stopped_by_gate"  # run.json: the check that stopped training (ratio_gate_action="stop")
GATE_STOP = "gate_stop"  # run.json: that stop's step, max_steps, check, key, value, patience
TRAINS_NOTHING = "trains_nothing"  # run.json: the first step an IS correction zeroed >= 90% of the tokens
HEAD_ARITHMETIC = "head_arithmetic"  # run.json: what the old pass's fp32 LM head multiplied, and with which kernel
PER_TRAIN_KEYS = (STOPPED_BY_GATE, GATE_STOP, TRAINS_NOTHING)  # said of one train(): null again at the next one
# exit status of `grpo-ratio train` (trainers/grpo.py) when the ratio gate stopped training: not 0 (a CI job keyed on
# the exit status sees the gate fire), not 1 (an uncaught error) nor 2 (a set-up error, `grpo-ratio train: error:`)
GATE_STOP_EXIT_CODE = 3

# what a run was configured with, written to its run.json, printed by the report and read by the findings
# (`grpo_ratio.analysis.advice`)
RUN_FIELDS = ("old_logprob_mode", "guided_fp32_layers", "truncation_correction", "kept_set_source", "top_p", "top_k",
              "min_p", "temperature", "bf16", "fp16", "use_vllm", "vllm_dtype", "vllm_importance_sampling_correction",
              "num_iterations", "disable_dropout", "mask_truncated_completions", "max_completion_length",
              "ratio_diagnostics", "learning_rate", "max_steps", "per_device_train_batch_size", "num_generations",
              "routing_replay", "ratio_attribution", "is_correction", "is_correction_level", "is_correction_action",
              "is_correction_low", "is_correction_high", "is_correction_rejection", "is_correction_veto",
              "vllm_importance_sampling_mode", "async_objective", "max_staleness", "trl_trainer", "trust_region",
              "ratio_by_position", "fp32_head_operands", "score_centering", "score_centering_top_k",
              "score_centering_tail", "score_centering_source", "steps_per_generation", "gradient_accumulation_steps",
              "epsilon")


def run_config(args) -> dict:
    """`RUN_FIELDS` of a `RatioGRPOConfig` or `RatioRLOOConfig` (None where the config lacks one: RLOO has no
    `vllm_importance_sampling_correction`); `trl_trainer` says which TRL trainer ran ("grpo", "rloo"): what
    `findings` reads of a run."""
    config = {k: getattr(args, k, None) for k in RUN_FIELDS}
    config["score_centering_source"] = centering_source(args)
    return config


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


def exit_status(run_dir: str | Path) -> int:
    """The exit status a script gives its run, as `grpo-ratio train` does: `GATE_STOP_EXIT_CODE` (3) when the ratio
    gate stopped the last `train()` in `run_dir` (its run.json names a `"stopped_by_gate"` check), else 0.

        trainer.train()
        sys.exit(exit_status(trainer.args.output_dir))

    Raises:
        ValueError: a `run.json` that is not a JSON object.
    """
    return GATE_STOP_EXIT_CODE if read_run_record(run_dir).get(STOPPED_BY_GATE) else 0


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


def update_run_record(run_dir: str | Path, fresh: bool = False, drop: tuple[str, ...] = (), **fields) -> dict:
    """Merge `fields` into `run_dir/run.json` (created when missing; started anew with `fresh`, or when the file is
    unreadable), without the keys in `drop`; returns the record written."""
    path = Path(run_dir) / RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        record = {} if fresh else read_run_record(run_dir)
    except ValueError:  # not ours (or not JSON): replaced, as the files of an overwritten run are
        record = {}
    record.update(fields)
    for key in drop:
        record.pop(key, None)
    _write_json(path, record)
    return record
