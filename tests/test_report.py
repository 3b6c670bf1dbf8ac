"""`grpo-ratio report`: the per-metric summary and the findings, on literal log histories and on a real tiny run.

Run: pytest tests/test_report.py
"""

import json

import pytest

from grpo_ratio.report import findings, load_runs, main, render_comparison, separation, summarize_history


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


def test_separation_against_step_noise_and_seed_spread():
    # k=4: noise floor 2 * sqrt(2/4) * 0.05 = 0.0707
    assert separation(0.10, 4, [0.05, 0.02], [None, None]) == "beyond noise"
    assert separation(0.05, 4, [0.05, 0.02], [None, None]) == "within noise"
    assert separation(0.10, 4, [0.05, 0.02], [0.12, None]) == "within noise"  # seeds disagree by more
    assert separation(None, 4, [0.05], [None]) == "unknown"


def test_comparison_section_says_one_seed_and_unmatched_rollouts():
    summary = {"last_k_used": 4, "baseline": "bf16", "matched_first_rollouts": {"0": False}, "arms": {
        "bf16": {"num_seeds": 1, "mean": 0.2, "mean_diff_vs_baseline": 0.0, "spread": None, "reward_step_noise": 0.05},
        "sampler": {"num_seeds": 1, "mean": 0.3, "mean_diff_vs_baseline": 0.1, "spread": None,
                    "reward_step_noise": 0.04}}}
    text = render_comparison(summary)
    assert "| sampler | 1 | 0.1 | 0.04 | - | beyond noise |" in text and "| bf16 |" not in text
    assert "one seed" in text and "differ across arms for seed(s) 0" in text


def test_report_reads_a_comparison_folder(tmp_path, capsys):
    for arm in ("bf16", "fp32_clone"):
        run = tmp_path / "cmp" / f"{arm}-s0"
        run.mkdir(parents=True)
        (run / "log_history.json").write_text(json.dumps(_history(reward=[0.1, 0.2])))
        (run / "run.json").write_text(json.dumps({"config": {"old_logprob_mode": arm}}))
    (tmp_path / "cmp" / "summary.json").write_text("{}")
    assert [name for name, _, _ in load_runs(tmp_path / "cmp" / "summary.json")] == ["bf16-s0", "fp32_clone-s0"]
    assert main([str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "### bf16-s0" in out and "old_logprob_mode=fp32_clone" in out and "| `reward` |" in out
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
