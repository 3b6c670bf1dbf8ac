"""Nothing that trains nothing may look healthy (issue 40): an IS correction that zeroes every token warns during
training and is flagged first by the report; a gate stop is recorded (step, check, value, completed false) and said
first; the report's IS-weight label follows the run's own settings."""

from __future__ import annotations

import json
import logging

import pytest
from test_rloo import tiny_rloo
from trainer_fixtures import tiny_trainer
from transformers import TrainerCallback

from grpo_ratio.analysis.report import main as report_main
from grpo_ratio.analysis.report import render_run, summarize_history
from grpo_ratio.diagnostics.run_record import GATE_STOP_EXIT_CODE, exit_status, read_run_record
from grpo_ratio.diagnostics.trains_nothing import (
    GATE_CHECK,
    steps_that_trained_nothing,
    trained_nothing,
    zero_weight_share,
)
from grpo_ratio.diagnostics.trains_nothing_callback import TrainsNothingCallback


class _WarnedBy(TrainerCallback):
    """Records, at each log event, whether the trains-nothing callback had warned: the warning comes during
    training, at the step it reads, not at the end."""

    def __init__(self, watched):
        self.watched, self.seen = watched, []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in (logs or {}):
            self.seen.append((state.global_step, self.watched.message is not None))


def _callback(trainer) -> TrainsNothingCallback:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, TrainsNothingCallback))


def test_geo_rs_that_rejects_every_sequence_warns_during_training_and_the_report_flags_every_step(
        tmp_path, capsys, caplog):
    # top_p=0.8 without a truncation correction: old/sampler is the kept mass (about 0.8, |seq_mean_k1| about 0.22
    # nats), far outside geo_rs's [0.999, 1.001]: every sequence rejected, loss 0, grad_norm 0 at every step. Before,
    # nothing warned and the report found nothing wrong with the IS weights
    trainer = tiny_trainer(tmp_path, max_steps=2, top_p=0.8, is_correction="geo_rs")
    spy = _WarnedBy(_callback(trainer))
    trainer.add_callback(spy)
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match="is_correction='geo_rs' set the IS weight") as caught:
        trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["loss"] == 0.0 and row["grad_norm"] == 0.0 and row["ratio/is_rejected_seq_frac"] == 1.0
        assert row["ratio/is_zero_weight_token_frac"] == 1.0 and trained_nothing(row) and zero_weight_share(row) == 1
    assert spy.seen == [(1, True), (2, True)]  # warned at the first step's log, while training ran
    ours = [w for w in caught if "set the IS weight" in str(w.message)]
    assert len(ours) == 1  # once per train()
    message = str(ours[0].message)
    measured = rows[0]["ratio/old_sampler/log_ppl_abs_diff"]
    for part in ("is_correction='geo_rs'", "100% of the tokens of step 1", "the step trained nothing (loss 0, grad_norm 0)",
                 "-0.0010005<=seq_mean_k1<=0.0009995", "[0.999, 1.001]",  # the preset's bound, also as a ratio
                 f"mean |seq_mean_k1| = {measured:.4g} nats per sequence",  # the distance measured
                 "truncation_correction='lift_sampler' or 'renormalize'",  # what removes the kept-mass gap
                 "is_correction_rejection='-0.5<=seq_mean_k1<=0.5'",  # a bound 2 x the distance passes
                 f"ratio_gate=['{GATE_CHECK}']"):
        assert part in message, part
    assert 0.2 < measured < 0.25
    assert any(r.levelno == logging.WARNING and "is_correction='geo_rs'" in r.getMessage() for r in caplog.records)
    record = read_run_record(tmp_path)
    assert record["trains_nothing"]["step"] == 1 and record["trains_nothing"]["message"] == message

    assert report_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Nothing out of the healthy range" not in out
    flag = out.index("**Trained nothing on 2 of 2 logged steps**")
    assert ("- steps 1, 2: every token's IS weight was 0: is_correction='geo_rs' zeroed them (it rejected 100% of "
            "the sequences).") in out
    assert flag < out.index("old_logprob_mode=bf16") < out.index("| metric |")  # first, before the configuration
    # the IS weight's label says which correction made it, and that no truncation correction ran (was: "after
    # lift_sampler" on every run)
    assert "IS weights the loss uses (is_correction='geo_rs', no truncation correction)" in out
    assert "lift_sampler (sampler" not in out


def test_rloo_with_geo_rs_warns_too(tmp_path):
    # RLOO: the IS weight enters as a weighted advantage; every sequence rejected -> every advantage 0, loss 0
    trainer = tiny_rloo(tmp_path, max_steps=1, top_p=0.8, is_correction="geo_rs")
    with pytest.warns(UserWarning, match="is_correction='geo_rs' set the IS weight of 100% of the tokens of step 1"):
        trainer.train()
    (row,) = [r for r in trainer.state.log_history if "loss" in r]
    assert row["loss"] == 0.0 and row["ratio/is_zero_weight_token_frac"] == 1.0
    assert _callback(trainer).message is not None


def test_a_correction_that_keeps_the_tokens_never_warns(tmp_path, recwarn):
    # the same sampling, the kept-mass gap corrected: geo_rs keeps every sequence, no warning, nothing flagged
    trainer = tiny_trainer(tmp_path, max_steps=1, top_p=0.8, truncation_correction="renormalize", is_correction="geo_rs")
    trainer.train()
    (row,) = [r for r in trainer.state.log_history if "loss" in r]
    assert row["ratio/is_zero_weight_token_frac"] == 0.0 and row["grad_norm"] > 0
    assert _callback(trainer).message is None
    assert not [w for w in recwarn if "set the IS weight" in str(w.message)]
    assert steps_that_trained_nothing(trainer.state.log_history) == []


def test_the_gate_stops_a_run_that_trains_nothing_and_the_stop_is_recorded_and_said_first(tmp_path, capsys):
    # the documented check stops the geo_rs run after step 1 of 4; before, run.json read as finished and the report
    # never mentioned the gate
    trainer = tiny_trainer(tmp_path, max_steps=4, top_p=0.8, is_correction="geo_rs", ratio_gate=[GATE_CHECK],
                           ratio_gate_action="stop")
    with pytest.warns(UserWarning, match="stopping training"):
        trainer.train()
    assert trainer.state.global_step == 1
    record = read_run_record(tmp_path)
    assert record["completed"] is False and record["train_ended"] is True
    assert record["stopped_by_gate"] == GATE_CHECK == "ratio/is_zero_weight_token_frac<0.9"
    assert record["gate_stop"] == {"step": 1, "max_steps": 4, "check": GATE_CHECK,
                                   "key": "ratio/is_zero_weight_token_frac", "value": 1.0, "patience": 1}
    assert exit_status(tmp_path) == GATE_STOP_EXIT_CODE == 3

    assert report_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    stop = out.index("**Stopped by the ratio gate at step 1 of 4**: `ratio/is_zero_weight_token_frac<0.9` failed "
                     "(ratio/is_zero_weight_token_frac = 1) (ratio_gate_action='stop'); steps 2-4 never ran.")
    assert stop < out.index("**Trained nothing on 1 of 1 logged steps**") < out.index("| metric |")
    assert "Nothing out of the healthy range" not in out

    assert report_main([str(tmp_path), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)
    assert run["gate_stop"]["step"] == 1 and run["trained_nothing"][0]["step"] == 1

    # a later train() of the same trainer that reaches its end: no stop, no "completed" from the gate, status 0
    gate = next(c for c in trainer.callback_handler.callbacks if type(c).__name__ == "RatioGateCallback")
    gate.checks = []
    trainer.train()
    record = read_run_record(tmp_path)
    assert record["gate_stop"] is None and record["stopped_by_gate"] is None and "completed" not in record
    assert exit_status(tmp_path) == 0


# ---------------------------------------------------------------------------------------------------------------------
# the report on literal log histories


def _row(step, **values):
    return {"step": step, "loss": 0.1, "grad_norm": 0.5, "reward": 0.3, **values}


HISTORY = [
    _row(1, loss=0.0, grad_norm=0.0, **{"ratio/is_rejected_seq_frac": 1.0, "ratio/is_rejected_token_frac": 1.0,
                                        "ratio/is_weight_mean": 0.0, "ratio/importance_sampling_ratio/mean": 0.0}),
    _row(2, loss=0.0, grad_norm=0.0, frac_reward_zero_std=1.0, **{"ratio/importance_sampling_ratio/mean": 1.0}),
    _row(3, **{"ratio/is_zero_weight_token_frac": 0.95, "ratio/is_rejected_seq_frac": 0.9,
               "ratio/importance_sampling_ratio/mean": 0.05}),
    _row(4, **{"ratio/is_zero_weight_token_frac": 0.0, "ratio/importance_sampling_ratio/mean": 1.0}),
    {"train_runtime": 1.0, "train_loss": 0.0, "step": 4},
]


def test_the_report_flags_each_step_that_trained_nothing_with_its_cause():
    config = {"is_correction": "geometric_mask", "truncation_correction": "renormalize", "old_logprob_mode": "bf16"}
    flagged = dict(steps_that_trained_nothing(HISTORY, config))
    assert list(flagged) == [1, 2, 3]
    assert flagged[1] == ("every token's IS weight was 0: is_correction='geometric_mask' zeroed them (it rejected "
                          "100% of the sequences)")
    assert flagged[2] == "every group's rewards were equal (frac_reward_zero_std = 1): every advantage was 0"
    assert flagged[3] == "95% of the tokens had IS weight 0 (is_correction='geometric_mask'): most trained nothing"
    stats = summarize_history(HISTORY)
    text = render_run("run", stats, [], config, HISTORY)
    assert text.index("**Trained nothing on 3 of 4 logged steps**") < text.index("old_logprob_mode=bf16")
    assert "Nothing out of the healthy range" not in text and "No other finding." in text
    assert "IS weights the loss uses (is_correction='geometric_mask', over the kept sets " \
           "(truncation_correction='renormalize'))" in text
    assert "ratio_gate=['ratio/is_zero_weight_token_frac<0.9']" in text  # no run.json warning: the generic fix
    # the same history without the failing steps is healthy, as before
    healthy = [HISTORY[3]]
    assert "Nothing out of the healthy range" in render_run("run", summarize_history(healthy), [], config, healthy)


@pytest.mark.parametrize("correction, label", [
    ("lift_sampler", "after lift_sampler (sampler log-probs lifted by the kept mass)"),
    ("none", "no truncation correction"),
])
def test_the_is_weight_label_follows_the_runs_truncation_correction(correction, label):
    config = {"use_vllm": True, "truncation_correction": correction}
    text = render_run("run", summarize_history([HISTORY[3]]), [], config, [HISTORY[3]])
    assert f"IS weights the loss uses (TRL's vLLM IS correction, {label})" in text


def test_zero_weight_share_from_older_logs_and_the_asynchronous_trainer():
    assert zero_weight_share({"ratio/is_masked_token_frac": 0.4, "ratio/is_rejected_token_frac": 0.7}) == 0.7
    assert zero_weight_share({"ratio/is_weight_mean": 0.0, "ratio/is_rejected_token_frac": 0.5}) == 1.0
    assert zero_weight_share({"loss": 0.0}) is None
    row = {"ratio/staleness/0/num_tokens": 30.0, "ratio/staleness/0/is_weight_mean": 0.0,
           "ratio/staleness/1/num_tokens": 10.0, "ratio/staleness/1/is_weight_mean": 0.8}
    assert zero_weight_share(row) == pytest.approx(0.75)
    assert not trained_nothing({"loss": 0.0}) and trained_nothing({"loss": 0.0, "grad_norm": 0.0})



def test_the_asynchronous_trainers_row_warns_from_its_staleness_buckets(tmp_path):
    # RatioAsyncGRPOTrainer logs its IS weights per staleness bucket; a row where every bucket's weight is 0
    from transformers import TrainerControl, TrainerState

    from grpo_ratio.corrections.is_correction import preset
    from grpo_ratio.diagnostics.trains_nothing_callback import trains_nothing_callback

    class Args:
        is_correction, truncation_correction, output_dir = "geometric_mask", "none", str(tmp_path)

    callback = trains_nothing_callback(Args(), preset("geometric_mask"))
    row = {"loss": 0.0, "grad_norm": 0.0, "ratio/staleness/0/num_tokens": 24.0,
           "ratio/staleness/0/is_weight_mean": 0.0, "ratio/staleness/0/prox_behav_oob_rate": 0.5,
           "ratio/staleness/1/num_tokens": 8.0, "ratio/staleness/1/is_weight_mean": 0.0,
           "ratio/staleness/1/prox_behav_oob_rate": 0.75}
    state = TrainerState(global_step=3)
    with pytest.warns(UserWarning, match="is_correction='geometric_mask' set the IS weight of 100% of the tokens"):
        callback.on_log(Args(), state, TrainerControl(), logs=row)
    assert "0.99<=seq_mean_ratio<=1.01" in callback.message
    assert "proximal/behaviour out of band 50% at staleness 0, 75% at staleness 1" in callback.message
    assert read_run_record(tmp_path)["trains_nothing"]["step"] == 3
    import warnings

    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        callback.on_log(Args(), TrainerState(global_step=4), TrainerControl(), logs=row)
    assert again == [] and "step 3" in callback.message  # once per train()
