"""The tolerance gate (grpo_ratio/diagnostics/gate.py): check parsing and scopes on literal log histories, the real
`grpo-ratio report --check` command's exit codes, and the callback stopping a real tiny training.

Run: pytest tests/test_gate.py -q
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_fixtures import tiny_trainer

from grpo_ratio import RatioGRPOConfig
from grpo_ratio.analysis.report import main
from grpo_ratio.diagnostics.gate import Check, collect_checks, evaluate, parse_check, read_thresholds
from grpo_ratio.diagnostics.gate_callback import RatioGateCallback


# four logged steps and TRL's final summary row (never judged)
HISTORY = [{"step": 1, "ratio/x": 0.0, "loss": 1.0}, {"step": 2, "ratio/x": 0.02}, {"step": 3, "ratio/x": 0.005},
           {"step": 4, "ratio/x": 0.03, "ratio/y": 2.0}, {"step": 4, "train_runtime": 1.0, "ratio/x": 99.0}]


def test_parse_check_forms_and_errors():
    assert parse_check("ratio/x<=0.01") == Check("ratio/x", "<=", 0.01, "each")
    assert parse_check(" mean:ratio/x >= 1e-3 ") == Check("ratio/x", ">=", 1e-3, "mean")
    assert parse_check("first:ratio/new_old/kl_k1<1e-8").scope == "first"
    assert str(parse_check("max:eval_ratio/x!=inf")) == "max:eval_ratio/x!=inf"
    for bad, message in [("ratio/x=0.1", "expected"), ("median:ratio/x<1", "allowed: each, mean"),
                         ("ratio/x<=abc", "not a number"), ("ratio/x<=nan", "NaN")]:
        with pytest.raises(ValueError, match=message):
            parse_check(bad)


def test_scopes_on_a_literal_history():
    each = evaluate(parse_check("ratio/x<=0.01"), HISTORY)
    assert not each.passed and each.failing == [(2, 0.02), (4, 0.03)] and (each.step, each.value) == (4, 0.03)
    assert each.num_steps == 4  # the summary row's 99.0 is not a step
    mean = evaluate(parse_check("mean:ratio/x<=0.014"), HISTORY)
    assert mean.passed and mean.value == pytest.approx(0.01375)
    assert not evaluate(parse_check("mean:ratio/x<=0.013"), HISTORY).passed
    assert evaluate(parse_check("first:ratio/x<1e-8"), HISTORY).passed  # slime's step-0 gate: 0.0 < 1e-8
    assert not evaluate(parse_check("last:ratio/x<0.03"), HISTORY).passed
    assert evaluate(parse_check("max:ratio/x<=0.03"), HISTORY).step == 4
    assert evaluate(parse_check("min:ratio/x>=0"), HISTORY).value == 0.0
    assert evaluate(parse_check("ratio/y==2"), HISTORY).passed  # a key logged on one step only
    missing = evaluate(parse_check("ratio/typo<=1"), HISTORY)
    assert not missing.passed and "never logged" in missing.describe()
    assert not evaluate(parse_check("ratio/z<=1"), [{"step": 1, "ratio/z": math.nan}]).passed  # NaN never passes


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("check", ["max:ratio/x<=0.05", "min:ratio/x>=0", "first:ratio/x<1e-8", "last:ratio/x<=0.05",
                                   "mean:ratio/x<=0.05", "ratio/x<=0.05", "max:ratio/x!=inf"])
def test_a_non_finite_value_fails_every_scope(check, bad):
    # a run that diverged at step 3 (NaN or inf logged there and after): before, max/min skipped a NaN (Python's max
    # never picks it) and first judged step 1 alone, so the run passed its gate
    history = [{"step": 1, "ratio/x": 0.0}, {"step": 2, "ratio/x": 0.01}, {"step": 3, "ratio/x": bad},
               {"step": 4, "ratio/x": bad}]
    result = evaluate(parse_check(check), history)
    assert not result.passed and result.non_finite == [(3, bad), (4, bad)] and result.step == 3
    assert f"2 of 4 logged steps are not finite: {bad} at step 3, {bad} at step 4" in result.describe()
    assert evaluate(parse_check(check), history[:2]).passed  # the same check passes the finite steps


def test_report_check_fails_a_run_that_logged_nan(tmp_path, capsys):
    # the report reads NaN back from log_history.json (json writes NaN / Infinity) and exits 1
    history = [{"step": 1, "ratio/x": 0.0}, {"step": 2, "ratio/x": math.nan}]
    (tmp_path / "log_history.json").write_text(json.dumps(history))
    assert main([str(tmp_path), "--check", "max:ratio/x<=0.05", "--check", "min:ratio/x>=0"]) == 1
    assert "2 of 2 checks failed." in capsys.readouterr().out


def test_thresholds_files(tmp_path):
    (tmp_path / "a.yaml").write_text("- ratio/x<=0.01\n- 'mean:ratio/y>1'\n")
    (tmp_path / "b.json").write_text(json.dumps({"checks": ["ratio/x<=0.01"]}))
    (tmp_path / "c.yaml").write_text("ratio/x: '<=0.01'\nmean:ratio/y: '> 1'\n")
    assert read_thresholds(tmp_path / "a.yaml") == read_thresholds(tmp_path / "c.yaml")
    assert read_thresholds(tmp_path / "b.json") == [Check("ratio/x", "<=", 0.01)]
    assert collect_checks(["ratio/y<3"], tmp_path / "b.json") == [Check("ratio/y", "<", 3.0), Check("ratio/x", "<=", 0.01)]
    (tmp_path / "bad.yaml").write_text("ratio/x: 0.01\n")
    with pytest.raises(ValueError, match="expected a list"):
        read_thresholds(tmp_path / "bad.yaml")
    with pytest.raises(FileNotFoundError):
        read_thresholds(tmp_path / "none.yaml")


def _cli(*args):
    """The installed console script (a subprocess, as CI would run it)."""
    script = Path(sys.executable).with_name("grpo-ratio")
    return subprocess.run([str(script), "report", *map(str, args)], capture_output=True, text=True, timeout=300)


def test_report_check_exit_codes(tmp_path):
    # the real console script in a subprocess, as CI runs it: 0 = every check passes, 1 = one fails, 2 = bad input
    (tmp_path / "log_history.json").write_text(json.dumps(HISTORY))
    ok = _cli(tmp_path, "--check", "mean:ratio/x<=0.014", "--check", "first:ratio/x<1e-8")
    assert ok.returncode == 0 and "All 2 checks pass." in ok.stdout, ok.stderr
    (tmp_path / "gate.yaml").write_text("- ratio/x<=0.01\n- ratio/typo<1\n")
    failed = _cli(tmp_path, "--json", "--thresholds", tmp_path / "gate.yaml")
    assert failed.returncode == 1 and json.loads(failed.stdout)[0]["run"] == tmp_path.name  # stdout stays JSON
    assert "FAIL ratio/x<=0.01: 2 of 4 logged steps fail: 0.02 at step 2, 0.03 at step 4" in failed.stderr
    bad = _cli(tmp_path, "--check", "ratio/x=<1")
    assert bad.returncode == 2 and "expected [SCOPE:]KEY OP VALUE" in bad.stderr


def test_report_check_names_failing_keys_and_values(tmp_path, capsys):
    (tmp_path / "log_history.json").write_text(json.dumps(HISTORY))
    assert main([str(tmp_path), "--check", "ratio/x<=0.01", "--check", "ratio/typo<1", "--check", "ratio/y==2"]) == 1
    out = capsys.readouterr().out
    assert out.index("FAIL ratio/x<=0.01") < out.index("PASS ratio/y==2")  # failures first
    assert "FAIL ratio/typo<1: never logged" in out and "2 of 3 checks failed." in out
    assert main([str(tmp_path)]) == 0  # no check: the report alone, exit 0 as before


def test_an_upper_bound_on_a_signed_key_is_noted_and_a_typo_gets_the_nearest_keys(tmp_path, capsys):
    # the fresh user's case: an fp16_clone run's first-step kl_k1 is negative (-8.0e-4) while its |log r| is 3.7e-3,
    # so "first:...kl_k1<1e-8" passes; the size check fails; the report says why the first one proves nothing
    history = [{"step": 1, "ratio/new_old/kl_k1": -8.0e-4, "ratio/new_old/mean_abs_log_ratio": 3.7e-3}]
    (tmp_path / "log_history.json").write_text(json.dumps(history))
    signed, size = "first:ratio/new_old/kl_k1<1e-8", "first:ratio/new_old/mean_abs_log_ratio<1e-8"
    assert main([str(tmp_path), "--check", signed]) == 0
    out = capsys.readouterr().out
    assert "PASS first:ratio/new_old/kl_k1<1e-08: first -0.0008 at step 1" in out
    assert ("**note** `first:ratio/new_old/kl_k1<1e-08`: ratio/new_old/kl_k1 takes either sign, so this bound passes "
            "every negative value however large; to bound the gap's size check `ratio/new_old/mean_abs_log_ratio`"
            in out)
    assert main([str(tmp_path), "--check", size]) == 1
    out = capsys.readouterr().out
    assert "FAIL first:ratio/new_old/mean_abs_log_ratio<1e-08: first 0.0037 at step 1" in out and "note" not in out
    assert not parse_check("ratio/new_old/kl_k1>-1e-3").bounds_a_signed_key_from_above  # a lower bound: no note
    assert parse_check("ratio/old_sampler/log_ppl_diff<=0").bounds_a_signed_key_from_above
    # a ratio/* typo: never logged, with the nearest keys the diagnostics emit
    assert main([str(tmp_path), "--check", "ratio/new_old/oob_rat<0.1"]) == 1
    assert "never logged (ratio/new_old/oob_rat is not a key the ratio diagnostics emit; did you mean " \
           "'ratio/new_old/oob_rate'" in capsys.readouterr().out


def test_callback_validation():
    with pytest.raises(ValueError, match="only the scopes each, first"):
        RatioGateCallback(["mean:ratio/new_old/oob_rate<1"])
    with pytest.raises(ValueError, match="patience"):
        RatioGateCallback(["ratio/new_old/oob_rate<1"], patience=0)
    with pytest.raises(ValueError, match="allowed: warn, stop"):
        RatioGateCallback(["ratio/new_old/oob_rate<1"], action="halt")


def test_a_key_no_log_row_holds_is_refused_or_said():
    # W&B's prefix, a misspelt ratio key: refused at once, with the key to use
    with pytest.raises(ValueError, match=r"log rows hold 'ratio/new_old/oob_rate' \(W&B and TensorBoard add"):
        RatioGateCallback(["train/ratio/new_old/oob_rate<=0.1"])
    with pytest.raises(ValueError, match=r"'ratio/new_old/oob_rat' is not a key .*did you mean 'ratio/new_old/oob_rate'"):
        RatioGateCallback(["ratio/new_old/oob_rat<=0.1"])
    with pytest.raises(ValueError, match="ratio_diagnostics=False: no ratio/\\* key is logged"):
        RatioGRPOConfig(output_dir="/tmp/unused", use_cpu=True, report_to="none", ratio_diagnostics=False,
                        ratio_gate=["ratio/new_old/oob_rate<=0.1"])
    RatioGateCallback(["reward>0", "ratio/route/old_new/layer_3<=0.5"])  # other keys, per-layer route keys: accepted


def test_a_check_never_applied_is_said_at_the_end(tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=1)
    gate = RatioGateCallback(["rewards/no_such_reward/mean>0"])  # not a ratio/* key: cannot be known in advance
    trainer.add_callback(gate)
    with pytest.warns(UserWarning, match=r"never applied, no logged step held the key of rewards/no_such_reward/mean>0"):
        trainer.train()
    assert len(gate.tripped) == 1


def test_callback_stops_a_real_training_after_patience_steps(tmp_path):
    # ratio/new_old/num_tokens is >= 1 on every step: the check fails each logged step; patience 2 -> stop at step 2
    trainer = tiny_trainer(tmp_path, max_steps=4)
    gate = RatioGateCallback(["ratio/new_old/num_tokens<1"], patience=2, action="stop")
    trainer.add_callback(gate)
    with pytest.warns(UserWarning, match="stopping training"):
        trainer.train()
    assert trainer.state.global_step == 2 and len(gate.tripped) == 1
    assert "at step 2" in gate.tripped[0]
    logged = [row["ratio/new_old/num_tokens"] for row in trainer.state.log_history if "ratio/new_old/num_tokens" in row]
    assert len(logged) == 2 and min(logged) >= 1


def test_callback_warns_and_training_goes_on(tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=3)
    gate = RatioGateCallback(["ratio/new_old/num_tokens<1", "first:ratio/new_old/num_tokens>0"], patience=1)
    trainer.add_callback(gate)
    with pytest.warns(UserWarning, match="ratio gate"):
        trainer.train()
    # the failing check trips once per streak (one streak of 3 steps), the passing first-step check never
    assert trainer.state.global_step == 3 and len(gate.tripped) == 1


def test_a_gate_stop_is_a_non_zero_exit_of_the_entry_point_and_in_the_run_record(tmp_path):
    # trainers/grpo.py on a tiny model, as a CI job runs it: a check that fails at every step stops training at step
    # 1; before, the script printed "Training completed.", exited 0 and its run.json said nothing of the gate
    from grpo_ratio.diagnostics.run_record import GATE_STOP_EXIT_CODE, STOPPED_BY_GATE
    from grpo_ratio.testing import tiny_model, tiny_tokenizer

    model_dir = tmp_path / "tiny"
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    tiny_model("qwen2").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "run"
    root = Path(__file__).parents[1]
    cmd = [sys.executable, str(root / "trainers" / "grpo.py"), "--config",
           str(root / "recipes/smollm2-135m/arithmetic/bf16.yaml"), "--model_name_or_path", str(model_dir),
           "--output_dir", str(out), "--report_to", "none", "--max_steps", "3", "--max_completion_length", "8",
           "--num_examples", "16", "--save_final_model", "false", "--ratio_gate", "ratio/new_old/num_tokens<1",
           "--ratio_gate_action", "stop"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == GATE_STOP_EXIT_CODE == 3, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Training completed." not in proc.stdout
    assert ("grpo-ratio train: stopped by the ratio gate at step 1: ratio/new_old/num_tokens<1 failed "
            "(ratio_gate_action='stop'); outputs are saved, exit status 3") in proc.stderr
    record = json.loads((out / "run.json").read_text())
    assert record[STOPPED_BY_GATE] == "ratio/new_old/num_tokens<1"
    # every output written, but the run is not complete: stopped at step 1 of 3 (was "completed": true)
    assert record["train_ended"] is True and record["outputs_saved"] is True and record["completed"] is False
    assert record["gate_stop"]["step"] == 1 and record["gate_stop"]["max_steps"] == 3
    assert len(json.loads((out / "log_history.json").read_text())) >= 1 and (out / "metrics.png").is_file()


def test_the_run_record_says_no_gate_stop_after_a_second_train(tmp_path):
    # a script of your own: the trainer's gate writes the stop into run.json; a later train() that runs to its end
    # sets it back to null
    from grpo_ratio.diagnostics.run_record import STOPPED_BY_GATE, read_run_record

    trainer = tiny_trainer(tmp_path, max_steps=1, ratio_gate=["ratio/new_old/num_tokens<1"], ratio_gate_action="stop")
    with pytest.warns(UserWarning, match="stopping training"):
        trainer.train()
    gate = next(c for c in trainer.callback_handler.callbacks if isinstance(c, RatioGateCallback))
    assert gate.stopped_by == "ratio/new_old/num_tokens<1"
    assert read_run_record(trainer.args.output_dir)[STOPPED_BY_GATE] == "ratio/new_old/num_tokens<1"
    gate.checks = [parse_check("ratio/new_old/num_tokens>=1")]  # passes every step
    trainer.train()
    assert gate.stopped_by is None and read_run_record(trainer.args.output_dir)[STOPPED_BY_GATE] is None
