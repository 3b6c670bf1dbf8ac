"""trainers/compare.py: matched step-1 rollouts across arms, the summary numbers, W&B grouping, recipe loading.

Run: pytest tests/test_compare.py
"""

import json
import statistics
from pathlib import Path

import pytest
from trainer_fixtures import tiny_trainer


RECIPES = Path(__file__).parents[1] / "recipes" / "smollm2-135m"


@pytest.fixture
def compare():
    from grpo_ratio.cli import compare

    return compare


def _tiny_build(**overrides):
    def build(arm, seed, run_dir):
        # tiny_trainer: the same seed-0 tiny model for every arm, 8 prompts, 4 completions per step
        return tiny_trainer(run_dir, mode=arm, seed=seed, **({"max_steps": 2} | overrides))

    return build


def test_two_arms_match_step_one_and_summarize(compare, tmp_path):
    result = compare.run_comparison(
        ["bf16", "fp32_clone"], [0], _tiny_build(), name="cmp", output_root=tmp_path, last_k=2, show=False
    )
    bf16, fp32 = result.runs
    # same seed -> same data order and RNG state at the first generate: identical step-1 completions
    assert len(bf16.first_completions) == 4  # 1 prompt x num_generations=4 per step
    assert bf16.first_completions == fp32.first_completions
    assert bf16.first_prompts == fp32.first_prompts
    assert result.matched_first_rollouts == {0: True}
    # identical completions and reward function -> identical step-1 reward
    assert bf16.history[0]["reward"] == fp32.history[0]["reward"]

    # summary, recomputed from the logged rows: last_k=2 averages the rewards of both logged steps
    rewards = {r.arm: [row["reward"] for row in r.history if "reward" in row] for r in result.runs}
    assert [len(v) for v in rewards.values()] == [2, 2]
    runs = {row["arm"]: row for row in result.summary["runs"]}
    assert runs["bf16"]["reward_last_k"] == pytest.approx(statistics.fmean(rewards["bf16"]), abs=1e-12)
    assert runs["fp32_clone"]["reward_last_k"] == pytest.approx(statistics.fmean(rewards["fp32_clone"]), abs=1e-12)
    expected_diff = statistics.fmean(rewards["fp32_clone"]) - statistics.fmean(rewards["bf16"])
    assert runs["fp32_clone"]["diff_vs_baseline"] == pytest.approx(expected_diff, abs=1e-12)
    assert runs["bf16"]["diff_vs_baseline"] == 0.0
    assert result.summary["arms"]["fp32_clone"]["spread"] is None  # one seed: no spread measured (not 0)

    # files: per-run histories, the plot, the summary
    saved = json.loads((tmp_path / "cmp" / "fp32_clone-s0" / "log_history.json").read_text())
    assert saved == fp32.history
    assert Path(result.plot_path).stat().st_size > 0
    assert json.loads(Path(result.summary_path).read_text())["matched_first_rollouts"] == {"0": True}

    # per-step rollout fingerprints: one per optimizer step, equal at step 1, the verdict reads them
    prints = json.loads((tmp_path / "cmp" / "fp32_clone-s0" / "rollout_fingerprints.json").read_text())["fingerprints"]
    assert prints == fp32.fingerprints and len(prints) == 2 and prints[0] == bf16.fingerprints[0]
    assert prints[0] == compare.rollout_fingerprint(fp32.first_prompts, fp32.first_completions)
    (verdict,) = result.summary["verdicts"]
    assert verdict["arm"] == "fp32_clone" and verdict["divergence"][0]["exact"] is True
    assert verdict["divergence"][0]["step"] == (None if prints == bf16.fingerprints else 2)
    assert verdict["verdict"] in ("unknown", "not diverged yet") and verdict["reason"]

    # the machine each run trained on, in run.json and (without the load) in the summary and its markdown
    from grpo_ratio.machine import describe_machine, machine_record

    machine = json.loads((tmp_path / "cmp" / "bf16-s0" / "run.json").read_text())["machine"]
    assert {k: v for k, v in machine.items() if k != "load_before"} == {
        k: v for k, v in machine_record().items() if k != "load_before"}
    assert result.summary["machines"] == [describe_machine(machine, load=False)]
    assert f"Trained on: {describe_machine(machine, load=False)}." in compare.render_markdown(result.summary)


def test_summarize_literal_histories(compare):
    def run(arm, seed, rewards):
        rows = [
            {"step": i + 1, "reward": r, "ratio/new_old/oob_rate": 0.1 * (arm != "bf16")}
            for i, r in enumerate(rewards)
        ]
        return compare.RunResult(arm, seed, rows + [{"train_loss": 0.0}], [], [], "")

    runs = [
        run("bf16", 0, [0.1, 0.2, 0.3, 0.5]),
        run("fp16_clone", 0, [0.0, 0.0, 0.4, 0.6]),
        run("bf16", 1, [0.2, 0.2, 0.2, 0.2]),
        run("fp16_clone", 1, [0.0, 0.0, 0.0, 0.3]),
    ]
    summary = compare.summarize(runs, last_k=2)
    rows = {(r["arm"], r["seed"]): r for r in summary["runs"]}
    # last 2 rewards: bf16 s0 (0.3+0.5)/2 = 0.4; fp16 s0 (0.4+0.6)/2 = 0.5; bf16 s1 0.2; fp16 s1 (0+0.3)/2 = 0.15
    assert rows[("bf16", 0)]["reward_last_k"] == pytest.approx(0.4)
    assert rows[("fp16_clone", 0)]["diff_vs_baseline"] == pytest.approx(0.1)  # 0.5 - 0.4
    assert rows[("fp16_clone", 1)]["diff_vs_baseline"] == pytest.approx(-0.05)  # 0.15 - 0.2
    assert rows[("fp16_clone", 0)]["new/old OOB"] == pytest.approx(0.1)  # mean over all 4 logged steps
    assert rows[("bf16", 0)]["clip flips"] is None  # never logged
    arm = summary["arms"]["fp16_clone"]
    assert arm["mean"] == pytest.approx(0.325)  # (0.5 + 0.15) / 2
    assert arm["spread"] == pytest.approx(0.35)  # 0.5 - 0.15
    assert arm["mean_diff_vs_baseline"] == pytest.approx(0.025)  # (0.1 - 0.05) / 2
    with pytest.raises(ValueError, match="last_k"):
        compare.summarize(runs, last_k=0)


def test_wandb_runs_are_grouped_and_named(compare, tmp_path):
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb_offline import _payloads

    compare.run_comparison(
        ["bf16"], [3], _tiny_build(report_to=["wandb"], max_steps=1), name="grp", output_root=tmp_path, show=False
    )
    (path,) = (tmp_path / "grp" / "bf16-s3").glob("wandb/offline-run-*/run-*.wandb")  # WANDB_MODE=offline
    runs = []
    for payload in _payloads(path):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "run":
            runs.append((record.run.run_group, record.run.display_name))
    assert ("grp", "bf16-s3") in runs


def test_repeated_arms_are_refused(compare, tmp_path):
    with pytest.raises(ValueError, match="distinct"):
        compare.run_comparison(["bf16", "bf16"], [0], _tiny_build(), output_root=tmp_path, show=False)


def test_load_recipe_applies_overrides_then_run_fields(compare, tmp_path):
    recipe = str(RECIPES / "arithmetic" / "fp16_clone.yaml")
    script_args, training_args, _ = compare.load_recipe(recipe, 7, tmp_path / "r", ["--max_steps", "3"])
    assert training_args.old_logprob_mode == "fp16_clone"
    assert (training_args.seed, training_args.max_steps) == (7, 3)
    assert training_args.output_dir == str(tmp_path / "r") and training_args.run_name == "fp16_clone-s7"
    assert script_args.task == "arithmetic"


def test_a_killed_comparison_resumes_with_the_missing_runs_only(compare, tmp_path, monkeypatch):
    # The first run finishes, the second is killed mid-way (here: its trainer raises at step 1); restarting trains
    # only the second and reads the first back from disk, unchanged.
    calls = []

    def build(arm, seed, run_dir):
        calls.append(arm)
        trainer = _tiny_build(max_steps=1)(arm, seed, run_dir)
        if arm == "fp32_clone" and calls.count("fp32_clone") == 1:
            monkeypatch.setattr(trainer, "training_step", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        return trainer

    kwargs = dict(name="cmp", output_root=tmp_path, last_k=1, show=False)
    with pytest.raises(KeyboardInterrupt):
        compare.run_comparison(["bf16", "fp32_clone"], [0], build, **kwargs)
    first = json.loads((tmp_path / "cmp" / "bf16-s0" / "log_history.json").read_text())
    assert json.loads((tmp_path / "cmp" / "fp32_clone-s0" / "run.json").read_text())["completed"] is False
    result = compare.run_comparison(["bf16", "fp32_clone"], [0], build, **kwargs)
    assert calls == ["bf16", "fp32_clone", "fp32_clone"]  # bf16 was not trained again
    assert result.resumed == ["bf16-s0"] and result.runs[0].history == first
    assert len([r for r in result.runs[1].history if "loss" in r]) == 1


def test_a_gate_stopped_arm_reads_as_stopped_and_is_kept_on_resume(compare, tmp_path):
    # the gate stops the arm at step 1 of 3: run.json says so (completed false), the outputs are saved, and a
    # resumed comparison reads the arm back instead of training it again
    calls = []

    def build(arm, seed, run_dir):
        calls.append(arm)
        return _tiny_build(max_steps=3, ratio_gate=["ratio/new_old/num_tokens<1"], ratio_gate_action="stop")(
            arm, seed, run_dir)

    kwargs = dict(name="cmp", output_root=tmp_path, last_k=1, show=False)
    with pytest.warns(UserWarning, match="stopping training"):
        compare.run_comparison(["bf16"], [0], build, **kwargs)
    record = json.loads((tmp_path / "cmp" / "bf16-s0" / "run.json").read_text())
    assert record["completed"] is False and record["outputs_saved"] is True
    assert record["gate_stop"]["step"] == 1 and record["gate_stop"]["max_steps"] == 3
    result = compare.run_comparison(["bf16"], [0], build, **kwargs)
    assert calls == ["bf16"] and result.resumed == ["bf16-s0"]


def test_a_folder_of_another_configuration_is_never_overwritten(compare, tmp_path):
    kwargs = dict(name="cmp", output_root=tmp_path, show=False)
    compare.run_comparison(["bf16"], [0], _tiny_build(max_steps=1), fingerprints={"bf16": "recipe A"}, **kwargs)
    with pytest.raises(FileExistsError, match="another configuration"):
        compare.run_comparison(["bf16"], [0], _tiny_build(max_steps=1), fingerprints={"bf16": "recipe B"}, **kwargs)


def test_an_override_that_would_mislabel_the_arms_is_refused(compare, tmp_path):
    recipes = [str(RECIPES / "arithmetic" / f"{arm}.yaml") for arm in ("bf16", "fp32_clone")]
    with pytest.raises(SystemExit):
        compare.main(["--recipes", *recipes, "--output_root", str(tmp_path), "--old_logprob_mode", "fp16_clone"])
    with pytest.raises(ValueError, match="--old_logprob_mode overrides what tells the arms apart"):
        compare.check_overrides({"bf16": recipes[0], "fp32_clone": recipes[1]}, ["--old_logprob_mode", "fp16_clone"],
                                tmp_path)
    # an override of a field the arms share is fine
    parsed = compare.check_overrides({"bf16": recipes[0], "fp32_clone": recipes[1]}, ["--max_steps", "3"], tmp_path)
    assert {p["max_steps"] for p in parsed.values()} == {3}


def test_a_baseline_that_is_not_an_arm_is_refused(compare, tmp_path, capsys):
    recipes = [str(RECIPES / "arithmetic" / f"{arm}.yaml") for arm in ("bf16", "fp32_clone")]
    with pytest.raises(SystemExit):
        compare.main(["--recipes", *recipes, "--output_root", str(tmp_path), "--baseline", "fp16_clone"])
    assert "--baseline 'fp16_clone' is not an arm" in capsys.readouterr().err


def test_summary_says_how_many_steps_it_averaged(compare):
    rows = [{"step": i + 1, "reward": 0.1 * i} for i in range(3)]
    summary = compare.summarize([compare.RunResult("bf16", 0, rows, [], [], "")], last_k=10)
    assert summary["last_k_used"] == 3  # 3 logged steps, not the 10 asked for
    assert "last 3 logged steps" in compare.render_markdown(summary)
    # step noise: differences 0.1, 0.1 -> std 0 -> noise 0
    assert summary["runs"][0]["reward_step_noise"] == pytest.approx(0.0, abs=1e-12)


def test_plots_show_the_correction_and_the_band(tmp_path):
    from grpo_ratio.analysis.plots import plot_metrics

    rows = [{"step": s, "reward": 0.2, "ratio/old_sampler/oob_rate": 0.7, "ratio/old_sampler_corrected/oob_rate": 0.05,
             "ratio/kept_mass_mean": 0.86, "ratio/new_old/p1": 0.95, "ratio/new_old/p99": 1.04} for s in (1, 2, 3)]
    drawn = plot_metrics({"run": rows}, tmp_path / "m.png", "SmolLM2: renormalize, 3 steps")
    assert {"ratio/old_sampler_corrected/oob_rate", "ratio/kept_mass_mean", "ratio/new_old/p1"} <= set(drawn)
    assert (tmp_path / "m.png").stat().st_size > 0


def test_the_trl_arm_is_named_by_what_it_does_where_it_is_shown(compare, tmp_path):
    # the issue: old_logprob_mode="bf16" titled the plots of fp32 runs; that arm is TRL's own pass at the run's
    # training precision, bf16 only under bf16 autocast or on bf16 weights
    from types import SimpleNamespace

    import torch

    from grpo_ratio.analysis.plots import arm_label, comparison_styles, draw_runs, run_title

    assert arm_label("bf16", bf16=True, fp16=False) == "bf16 (TRL's own pass)"
    assert arm_label("bf16", bf16=False, fp16=False, weights="fp32") == "TRL's own pass (fp32)"
    assert arm_label("bf16", bf16=False, fp16=False, weights="bf16") == "bf16 (TRL's own pass)"
    assert arm_label("bf16", bf16=False, fp16=True) == "TRL's own pass (fp16)"
    assert arm_label("fp32_clone", bf16=False, fp16=False, weights="fp32") == "fp32_clone"
    fp32_run = SimpleNamespace(old_logprob_mode="bf16", truncation_correction="none", bf16=False, fp16=False,
                               top_p=1.0, top_k=0, min_p=None)
    assert run_title("SmolLM2", fp32_run, 3, torch.float32) == ("SmolLM2: TRL's own pass (fp32), "
                                                               "truncation_correction=none, 3 steps")
    bf16_run = SimpleNamespace(**{**vars(fp32_run), "bf16": True})
    assert run_title("SmolLM2", bf16_run, 3, torch.float32).startswith("SmolLM2: bf16 (TRL's own pass), ")
    clone = SimpleNamespace(**{**vars(fp32_run), "old_logprob_mode": "fp32_clone"})
    assert run_title("SmolLM2", clone, 3, torch.float32).startswith("SmolLM2: old_logprob_mode=fp32_clone, ")
    # a comparison of fp32 runs: the legend names the recipe "bf16" by what it ran (compare records the weights)
    rows = [{"step": s, "reward": 0.1 * s} for s in (1, 2)]
    config = {"bf16": False, "fp16": False, "weights_dtype": "fp32"}
    runs = [compare.RunResult(arm, 0, rows, [], [], "", {**config, "old_logprob_mode": mode})
            for arm, mode in (("bf16", "bf16"), ("fp32_clone", "fp32_clone"), ("mine", "bf16"))]
    styles, offsets = comparison_styles(runs)
    assert list(styles) == ["TRL's own pass (fp32) s0", "fp32_clone s0", "mine s0"]  # a label of one's own stays
    fig, _ = draw_runs({k: rows for k in styles}, "t", styles, offsets=offsets)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["TRL's own pass (fp32)", "fp32_clone", "mine"]


def test_summary_printed_to_a_log_file_is_never_cut(compare, tmp_path, capsys):
    # the issue: the table was cut at the terminal width in a log file; off a terminal the markdown is printed whole
    rows = [{"step": i + 1, "reward": 0.1 * i, "ratio/new_old/oob_rate": 0.0123456, "clip_ratio/region_mean": 0.0}
            for i in range(3)]
    runs = [compare.RunResult(arm, 0, rows, [], [], "") for arm in ("bf16", "a_rather_long_arm_label_for_a_column")]
    summary = compare.summarize(runs, last_k=2)
    with open(tmp_path / "log.txt", "w") as log:
        compare.print_summary(summary, "cmp", stream=log)
    text = (tmp_path / "log.txt").read_text()
    assert "…" not in text and "a_rather_long_arm_label_for_a_column | 0 | 3 | 0.150 |" in text
    assert "| TRL clip |" in text and "### Verdict" in text and "needs >= 2 seeds" in text
    assert max(len(line) for line in text.splitlines()) > 140  # nothing was wrapped or cut to fit a width


def test_comparison_plot_keeps_equal_arms_visible_and_legends_off_the_data(compare):
    # the issue: arms whose lines equal the baseline's were hidden under it, and legends covered the data
    from grpo_ratio.analysis.plots import comparison_styles, draw_runs

    rows = [{"step": s, "reward": 0.1 * s, "ratio/new_old/oob_rate": 0.0, "ratio/new_old/p1": 0.9,
             "ratio/new_old/p99": 1.1} for s in (1, 2, 3)]
    runs = [compare.RunResult(arm, seed, rows, [], [], "")
            for seed in (0, 1) for arm in ("bf16", "fp32_clone", "sampler")]
    styles, offsets = comparison_styles(runs)
    fig, drawn = draw_runs({f"{r.arm} s{r.seed}": r.history for r in runs}, "t", styles, offsets=offsets)
    assert drawn == ["reward", "ratio/new_old/oob_rate", "ratio/new_old/p1", "ratio/new_old/p99"]
    fig.canvas.draw()
    for ax in fig.axes:
        lines = ax.get_lines()
        starts = sorted({round(ln.get_xdata()[0], 6) for ln in lines})
        assert starts == pytest.approx([0.85, 1.0, 1.15])  # shifted apart, per arm
        assert len({ln.get_marker() for ln in lines}) == 3 and {ln.get_markerfacecolor() for ln in lines} == {"none"}
        assert len({ln.get_linestyle() for ln in lines}) == 2  # one line style per seed
    # one figure legend, right of every panel: an entry per arm and per seed (not one per arm x seed x series)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["bf16", "fp32_clone", "sampler", "seed 0", "seed 1"]
    box = legend.get_window_extent()
    assert all(box.x0 >= ax.get_window_extent().x1 for ax in fig.axes)
    # a panel legend only where a panel has several series, naming just those (and the band), also off the data
    reward, oob, quantiles = fig.axes
    assert reward.get_legend() is None and oob.get_legend() is None
    names = [t.get_text() for t in quantiles.get_legend().get_texts()]
    assert names == ["new/old p1", "new/old p99", "band [0.9, 1.1]"]
    assert quantiles.get_legend().get_window_extent().x0 >= quantiles.get_window_extent().x1


def test_command_line_mistakes_are_one_line_errors(compare, tmp_path, capsys):
    recipes = [str(RECIPES / "arithmetic" / f"{arm}.yaml") for arm in ("bf16", "fp32_clone")]
    base = ["--recipes", *recipes, "--output_root", str(tmp_path)]
    for extra, said in ((["--seeds", "0", "0"], "--seeds must be distinct, got [0, 0]"),
                        (["--last_k", "0"], "--last_k must be >= 1, got 0")):
        with pytest.raises(SystemExit) as stop:
            compare.main([*base, *extra])
        assert stop.value.code == 2 and said in capsys.readouterr().err
    # no prefix matching: `--seed 5` is not `--seeds 5`; and a per-run field is refused, not silently replaced
    with pytest.raises(SystemExit):
        compare.main([*base, "--seed", "5"])
    assert "--seed is set per run by compare (--seeds, --output_root/--name); remove it" in capsys.readouterr().err


def test_a_changed_configuration_names_what_differs(compare):
    stored = json.dumps({"recipe": {"max_steps": 40, "top_p": 1.0}, "overrides": ["--max_steps", "12"]})
    asked = json.dumps({"recipe": {"max_steps": 40, "top_p": 0.8}, "overrides": []})
    assert compare._differences(stored, asked) == "flags: '--max_steps 12' there, 'none' now; top_p: 1.0 there, 0.8 now"
    assert compare._differences("recipe A", "recipe B") == "fingerprint: 'recipe A' there, 'recipe B' now"
