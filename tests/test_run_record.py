"""The run record (grpo_ratio/diagnostics/run_record.py): every RatioGRPOTrainer leaves run.json and log_history.json
in its output_dir, so `grpo-ratio report` reads the arm of a run from a script of your own (no checkpoint, no
`grpo-ratio train`), and a crashed run keeps its history up to its last log.

Run: pytest tests/test_run_record.py
"""

import json
from types import SimpleNamespace

import pytest
from trainer_fixtures import tiny_trainer
from transformers import TrainerCallback

from grpo_ratio.analysis.report import findings, load_runs, main, summarize_history
from grpo_ratio.diagnostics.run_record import (
    LOG_HISTORY_FILE,
    RUN_FIELDS,
    RUN_FILE,
    read_run_record,
    run_config,
    run_finished,
    update_run_record,
)
from grpo_ratio.diagnostics.run_record_callback import RunRecordCallback


def _written_history(run_dir) -> str:
    return (run_dir / LOG_HISTORY_FILE).read_text()


def test_a_script_of_your_own_is_reported_with_its_arm(tmp_path, capsys):
    # what a user's script does: RatioGRPOTrainer in place of trl.GRPOTrainer, train(), no checkpoint saved
    trainer = tiny_trainer(tmp_path, "sampler", max_steps=1, top_p=0.8, save_strategy="no")
    trainer.train()
    assert not list(tmp_path.glob("checkpoint-*"))
    # the log history file is trainer.state.log_history, as `grpo-ratio train` writes it (indent 1)
    assert _written_history(tmp_path) == json.dumps(trainer.state.log_history, indent=1)
    record = read_run_record(tmp_path)
    assert record == {"config": json.loads(json.dumps(run_config(trainer.args))), "train_ended": True}
    assert set(record["config"]) == set(RUN_FIELDS) and record["config"]["old_logprob_mode"] == "sampler"

    capsys.readouterr()  # the training's own log lines
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "old_logprob_mode=sampler" in out and "top_p=0.8" in out and "Configuration unknown" not in out
    assert main([str(tmp_path), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["config"]["old_logprob_mode"] == "sampler"
    # arm-aware: old/sampler is exactly 1 in the sampler arm, a finding only the arm explains
    expected = [f for f in report["findings"] if f["severity"] == "expected"]
    assert any(f["metric"] == "ratio/old_sampler/oob_rate" and "old_logprob_mode='sampler'" in f["cause"]
               for f in expected)
    blind = findings(summarize_history(trainer.state.log_history), None)  # what "configuration unknown" would say
    assert [f.metric for f in blind] != [f["metric"] for f in report["findings"]]
    # the log_history.json file itself, given to the report, reads the run.json beside it
    ((_, rows, config),) = load_runs(tmp_path / LOG_HISTORY_FILE)
    assert config == record["config"] and len(rows) == len(trainer.state.log_history)


class Killed(Exception):
    pass


class KillAfterStepOne(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= 1:
            raise Killed


def test_a_killed_run_keeps_its_history_and_its_arm(tmp_path, capsys):
    trainer = tiny_trainer(tmp_path, "fp32_clone", max_steps=3, save_strategy="no")
    trainer.add_callback(KillAfterStepOne())
    with pytest.raises(Killed):
        trainer.train()
    assert [row["step"] for row in trainer.state.log_history] == [1]
    assert _written_history(tmp_path) == json.dumps(trainer.state.log_history, indent=1)
    record = read_run_record(tmp_path)
    assert record["train_ended"] is False and not run_finished(record)
    assert record["config"]["old_logprob_mode"] == "fp32_clone" and record["config"]["max_steps"] == 3
    ((name, rows, config),) = load_runs(tmp_path)
    assert rows == json.loads(json.dumps(trainer.state.log_history)) and config == record["config"]
    capsys.readouterr()
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "old_logprob_mode=fp32_clone" in out and "1 logged steps" in out


def test_checkpoints_hold_what_stock_trl_saves_and_nothing_else(tmp_path):
    trainer = tiny_trainer(tmp_path, "bf16", max_steps=1, save_strategy="steps", save_steps=1)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-1"
    assert (checkpoint / "trainer_state.json").is_file()
    assert not (checkpoint / RUN_FILE).exists() and not (checkpoint / LOG_HISTORY_FILE).exists()
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["log_history"] == json.loads(_written_history(tmp_path))[: len(state["log_history"])]
    assert read_run_record(tmp_path)["train_ended"] is True


def _events(callback, run_dir, main_process=True, history=()):
    """The callback's events as the Trainer calls them, on a stand-in args and state."""
    args = SimpleNamespace(output_dir=str(run_dir), old_logprob_mode="fp32_clone", top_p=0.8)
    state = SimpleNamespace(is_world_process_zero=main_process, log_history=list(history))
    callback.on_train_begin(args, state, None)
    state.log_history.append({"loss": 0.5, "step": 1})
    callback.on_log(args, state, None, logs={"loss": 0.5})
    callback.on_train_end(args, state, None)
    return state


def test_the_record_merges_into_an_entry_points_and_replaces_a_finished_runs(tmp_path):
    # grpo-ratio compare writes its keys before train(): kept, the trainer's added
    update_run_record(tmp_path, fresh=True, arm="fp32_clone", seed=3, completed=False)
    _events(RunRecordCallback(), tmp_path)
    record = read_run_record(tmp_path)
    assert record["arm"] == "fp32_clone" and record["seed"] == 3 and record["completed"] is False
    assert record["train_ended"] is True and record["config"]["old_logprob_mode"] == "fp32_clone"
    assert record["config"]["routing_replay"] is None  # a field the config lacks: None, as run_config says
    # a finished run's record in the same folder (a run over it) is replaced, not merged into
    update_run_record(tmp_path, completed=True)
    _events(RunRecordCallback(), tmp_path)
    assert set(read_run_record(tmp_path)) == {"config", "train_ended"}
    assert json.loads(_written_history(tmp_path)) == [{"loss": 0.5, "step": 1}]


def test_only_the_main_process_writes_and_a_failed_write_never_stops_training(tmp_path):
    _events(RunRecordCallback(), tmp_path, main_process=False)
    assert list(tmp_path.iterdir()) == []
    blocked = tmp_path / "file"
    blocked.write_text("")  # output_dir is a file: nothing can be written under it
    callback = RunRecordCallback()
    with pytest.warns(UserWarning, match="cannot write the run record") as warned:
        _events(callback, blocked)
    assert len(warned) == 1  # once, not per event


def test_run_finished_reads_the_entry_point_then_the_trainer():
    assert run_finished({}) and run_finished({"config": {}})  # runs from before the record: finished
    assert run_finished({"completed": True, "train_ended": True}) and run_finished({"train_ended": True})
    assert not run_finished({"completed": False, "train_ended": True})  # compare's run, its files not all written
    assert not run_finished({"train_ended": False})


def test_grpo_ratio_train_may_restart_a_run_that_was_cut_short(tmp_path):
    from grpo_ratio.cli.train import check_output_dir

    script_args = SimpleNamespace(overwrite_output_dir=False)
    training_args = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint=None, seed=0)
    (tmp_path / LOG_HISTORY_FILE).write_text("[]")
    update_run_record(tmp_path, config={}, train_ended=False)  # killed mid-way: its partial log only
    check_output_dir(script_args, training_args)
    update_run_record(tmp_path, train_ended=True)  # a finished run (of a script of your own): never overwritten
    with pytest.raises(FileExistsError, match="already holds a finished run"):
        check_output_dir(script_args, training_args)


def test_a_comparison_leaves_out_the_run_it_never_finished(tmp_path):
    for name, completed in (("bf16-s0", True), ("fp32_clone-s0", False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / LOG_HISTORY_FILE).write_text(json.dumps([{"reward": 0.1, "step": 1}]))
        update_run_record(tmp_path / name, config={"old_logprob_mode": name[:-3]}, completed=completed)
    assert [name for name, _, _ in load_runs(tmp_path)] == ["bf16-s0"]
