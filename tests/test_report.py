"""`grpo-ratio report`: the per-metric summary and the findings, on literal log histories and on a real tiny run.

Run: pytest tests/test_report.py
"""

import json

import pytest

from grpo_ratio.analysis.report import findings, load_runs, main, render_comparison, summarize_history
from grpo_ratio.config import SCORING_MODES, TRUNCATION_CORRECTIONS


def _history(**series):
    """Log rows with one value per step for each key (plus TRL's final summary row)."""
    steps = len(next(iter(series.values())))
    rows = [{"step": i + 1, **{k.replace("__", "/"): v[i] for k, v in series.items()}} for i in range(steps)]
    return rows + [{"train_runtime": 1.0, "step": steps}]


def test_summary_statistics_over_logged_steps():
    stats = summarize_history(_history(reward=[0.1, 0.3, 0.2]))
    assert stats["reward"] == {"mean": pytest.approx(0.2), "first": 0.1, "last": 0.2, "min": 0.1, "max": 0.3,
                               "steps": 3}


def test_truncation_without_correction_is_found_with_its_fix():
    # old/sampler mean 0.89, half the tokens out of band, no corrected family: the kept mass of top_p sampling
    stats = summarize_history(_history(ratio__old_sampler__mean=[0.89, 0.90], ratio__old_sampler__oob_rate=[0.5, 0.55]))
    (finding,) = findings(stats, {"old_logprob_mode": "bf16"})
    assert finding.metric == "ratio/old_sampler/mean" and finding.value == pytest.approx(0.895)
    assert "truncation_correction='renormalize'" in finding.fix


def test_truncation_on_the_sampler_arm_is_found_in_new_old():
    # old = sampler: old/sampler is 1 by construction and the kept mass (here 0.50) sits in new/old, inside the clip
    stats = summarize_history(_history(ratio__new_old__mean=[0.50, 0.52], ratio__new_old__oob_rate=[1.0, 1.0],
                                       ratio__old_sampler__mean=[1.0, 1.0], ratio__old_sampler__oob_rate=[0.0, 0.0]))
    found = {f.metric: f for f in findings(stats, {"old_logprob_mode": "sampler", "truncation_correction": "none"})}
    assert found["ratio/new_old/mean"].value == pytest.approx(0.51) and found["ratio/new_old/mean"].severity == "warning"
    assert found["ratio/new_old/mean"].changes == {"truncation_correction": "renormalize"}
    assert "ratio/new_old/oob_rate" not in found  # not called "expected" when it is the kept mass
    corrected = findings(stats, {"old_logprob_mode": "sampler", "truncation_correction": "renormalize"})
    assert "ratio/new_old/mean" not in {f.metric for f in corrected}


def test_the_fix_is_printed_as_it_is_typed(tmp_path, capsys):
    # field names and commands are copied from the report: never capitalised
    run = tmp_path / "run"
    run.mkdir()
    rows = _history(ratio__old_sampler__mean=[0.89, 0.90], ratio__old_sampler__oob_rate=[0.5, 0.55])
    (run / "log_history.json").write_text(json.dumps(rows))
    assert main([str(run)]) == 0
    assert "Try: truncation_correction='renormalize'" in capsys.readouterr().out


def test_a_healthy_run_has_no_findings():
    stats = summarize_history(_history(ratio__new_old__oob_rate=[0.0, 0.0], ratio__old_sampler__mean=[1.0, 0.999],
                                       ratio__old_sampler__oob_rate=[0.04, 0.05], ratio__new_old__num_tokens=[30, 31]))
    assert findings(stats, {"old_logprob_mode": "bf16"}) == []


def test_each_rule_fires_on_its_symptom():
    stats = summarize_history(_history(
        ratio__old_sampler__mean=[0.8], ratio__old_sampler_corrected__oob_rate=[0.3],
        ratio__new_old__oob_rate=[0.2], ratio__clip_flip_rate=[0.03], ratio__kept_set_added_rate=[0.05],
        ratio__fp16_fallback_rows=[2.0], ratio__new_old__num_tokens=[0.0]))
    metrics = [f.metric for f in findings(stats, {"old_logprob_mode": "bf16"})]
    assert metrics == ["ratio/old_sampler_corrected/oob_rate", "ratio/new_old/oob_rate", "ratio/clip_flip_rate",
                       "ratio/kept_set_added_rate", "ratio/fp16_fallback_rows", "ratio/new_old/num_tokens"]


def test_report_reads_trl_trainer_state_of_a_script_of_your_own(tmp_path, capsys):
    # what a plain TRL script leaves: output_dir/checkpoint-N/trainer_state.json (its log_history inside)
    for step, reward in ((1, [0.1]), (2, [0.1, 0.3])):
        ckpt = tmp_path / "out" / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": _history(reward=reward)}))
    ((name, rows, config),) = load_runs(tmp_path / "out")
    assert name == "out" and config is None and [r["reward"] for r in rows[:-1]] == [0.1, 0.3]  # the newest checkpoint
    assert load_runs(tmp_path / "out" / "checkpoint-1" / "trainer_state.json")[0][1][0]["reward"] == 0.1
    (tmp_path / "bad.json").write_text(json.dumps({"global_step": 1}))
    assert main([str(tmp_path / "bad.json")]) == 2
    assert "trainer_state.json" in capsys.readouterr().err


def test_report_reads_the_config_of_a_script_of_your_own_from_its_checkpoint(tmp_path, capsys):
    # no run.json (a trl.GRPOTrainer script writes none): the Trainer's own training_args.bin gives the config
    import torch

    from grpo_ratio import RatioGRPOConfig

    ckpt = tmp_path / "out" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 3, "log_history": _history(reward=[0.2])}))
    args = RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", old_logprob_mode="fp32_head",
                           top_p=0.8, truncation_correction="renormalize")
    torch.save(args, ckpt / "training_args.bin")
    for path in (tmp_path / "out", ckpt / "trainer_state.json"):
        ((_, _, config),) = load_runs(path)
        assert (config["old_logprob_mode"], config["top_p"], config["truncation_correction"]) == (
            "fp32_head", 0.8, "renormalize")
    assert main([str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "old_logprob_mode=fp32_head" in out and "Configuration unknown" not in out


def test_comparison_section_says_why_unknown_one_seed_and_unmatched_rollouts():
    # 2 logged steps (the issue: every arm "unknown" and nothing said why)
    summary = {"last_k": 4, "last_k_used": 2, "baseline": "bf16", "matched_first_rollouts": {"0": False}, "arms": {
        "bf16": {"num_seeds": 1}, "sampler": {"num_seeds": 1}}}
    from grpo_ratio.analysis.verdict import run_series

    series = [run_series("bf16", 0, _history(reward=[0.1, 0.2])), run_series("sampler", 0, _history(reward=[0.1, 0.4]))]
    text = render_comparison(summary, series)
    assert "| sampler | 1 | 2 | +0.100 | - | - | s0: <= 2 | unknown |" in text and "| bf16 |" not in text
    assert "1 seed and 2 step(s) in the last-k window: too few" in text and "--seeds 0 1 2" in text
    assert "needs >= 2 seeds" in text and ">= 10 logged steps" in text  # the minimum, in the output
    assert "one seed" in text and "differ across arms for seed(s) 0" in text


def _fp32_clone_issue_run():
    """The issue's fp32_clone run: old/sampler 11.9% out of band (by design), new/old 12% (by design)."""
    return summarize_history(_history(ratio__old_sampler__oob_rate=[0.119], ratio__old_sampler__mean=[1.002],
                                      ratio__new_old__oob_rate=[0.123], ratio__clip_flip_rate=[0.0156]))


def test_fp32_clone_is_never_told_to_score_old_log_probs_in_fp32():
    config = {"old_logprob_mode": "fp32_clone", "truncation_correction": "none", "bf16": True, "num_iterations": 1}
    found = {f.metric: f for f in findings(_fp32_clone_issue_run(), config)}
    sampler = found["ratio/old_sampler/oob_rate"]
    assert sampler.severity == "expected" and "expected for old_logprob_mode='fp32_clone'" in sampler.cause
    assert "fp32" not in sampler.fix and sampler.changes == {}
    assert found["ratio/new_old/oob_rate"].severity == "expected"
    assert "1.56% of tokens" in found["ratio/new_old/oob_rate"].fix  # the clip flips, read for the user
    assert "equals TRL's clip_ratio/region_mean" in found["ratio/clip_flip_rate"].cause
    # the same numbers in a bf16 run are a warning, and the fixes name other arms, never the run's own
    found = {f.metric: f for f in findings(_fp32_clone_issue_run(), {**config, "old_logprob_mode": "bf16"})}
    assert found["ratio/old_sampler/oob_rate"].severity == "warning"
    assert found["ratio/old_sampler/oob_rate"].changes == {"old_logprob_mode": "sampler"}


SYMPTOMS = dict(ratio__old_sampler__mean=[0.8], ratio__old_sampler__oob_rate=[0.5],
                ratio__old_sampler_corrected__oob_rate=[0.3], ratio__new_old__oob_rate=[0.2],
                ratio__clip_flip_rate=[0.03], ratio__kept_set_added_rate=[0.05], ratio__fp16_fallback_rows=[2.0],
                ratio__new_old__num_tokens=[0.0])


@pytest.mark.parametrize("mode", SCORING_MODES)
@pytest.mark.parametrize("correction", TRUNCATION_CORRECTIONS)
@pytest.mark.parametrize("use_vllm", [False, True])
def test_no_finding_advises_what_the_run_already_does(mode, correction, use_vllm):
    config = {"old_logprob_mode": mode, "truncation_correction": correction, "use_vllm": use_vllm,
              "vllm_dtype": "float32" if use_vllm else None, "kept_set_source": "recorded", "disable_dropout": True,
              "mask_truncated_completions": False, "ratio_diagnostics": True, "bf16": True}
    for keys in ({k: v for k, v in SYMPTOMS.items() if "corrected" not in k}, SYMPTOMS):
        for f in findings(summarize_history(_history(**keys)), config):
            for key, value in f.changes.items():
                assert config.get(key) != value, (f.metric, key, value)
            for key, value in config.items():
                assert f"{key}={value!r}" not in f.fix, (f.metric, f.fix)


def test_report_reads_a_comparison_folder(tmp_path, capsys):
    for arm in ("bf16", "fp32_clone"):
        run = tmp_path / "cmp" / f"{arm}-s0"
        run.mkdir(parents=True)
        (run / "log_history.json").write_text(json.dumps(_history(reward=[0.1, 0.2])))
        (run / "run.json").write_text(json.dumps({"config": {"old_logprob_mode": arm}}))
    (tmp_path / "cmp" / "summary.json").write_text(json.dumps({"last_k": 2, "last_k_used": 2, "baseline": "bf16",
                                                               "arms": {"bf16": {"num_seeds": 1},
                                                                        "fp32_clone": {"num_seeds": 1}}}))
    assert [name for name, _, _ in load_runs(tmp_path / "cmp" / "summary.json")] == ["bf16-s0", "fp32_clone-s0"]
    assert main([str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "### bf16-s0" in out and "old_logprob_mode=fp32_clone" in out and "| `reward` |" in out
    assert "| fp32_clone | 1 | 2 | +0.000 | - | - | s0: none seen | not diverged yet |" in out
    assert main([str(tmp_path / "cmp"), "--verdict"]) == 0 and "### bf16-s0" not in capsys.readouterr().out
    assert main([str(tmp_path / "cmp"), "--effect"]) == 0
    out = capsys.readouterr().out
    assert "| bf16 | no: TRL's loss bit for bit (r = 1) | - | - | (baseline) |" in out
    assert "| fp32_clone | yes: every token's gradient weighted by r = exp(new - old) != 1 | - | s0: none seen | not " \
           "diverged yet |" in out
    assert main([str(tmp_path / "missing")]) == 2


def test_report_on_a_real_tiny_run(tmp_path, capsys):
    from trainer_fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path, "fp32_clone", max_steps=1, top_p=0.8)  # truncated, uncorrected
    trainer.train()
    (tmp_path / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    capsys.readouterr()  # drop the training's own log lines
    assert main([str(tmp_path), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["summary"]["ratio/new_old/num_tokens"]["steps"] == 1
    assert any(f["metric"] == "ratio/old_sampler/mean" for f in report["findings"])  # the kept mass shows
