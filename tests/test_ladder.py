"""The mismatch ladders (issue 41): the definitions against the config, the outcomes and verdicts of a ladder folder,
the rule generated from it, the report's section, and the runner (`benchmarks/ladder.py`) on a real tiny ladder.

Run: pytest tests/test_ladder.py
"""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from grpo_ratio import RatioAsyncGRPOConfig, RatioGRPOConfig
from grpo_ratio.analysis import report
from grpo_ratio.corrections.is_correction import PRESETS
from grpo_ratio.corrections.trust_region import TRUST_REGIONS
from grpo_ratio.diagnostics import metric_keys as keys
from grpo_ratio.ladder import LADDERS, ladder
from grpo_ratio.ladder.definitions import OPEN_CLIP, SWEEPS, config_staleness, staleness_overrides
from grpo_ratio.ladder.outcomes import area_under_curve, run_outcome, summarize_ladder
from grpo_ratio.ladder.render import (
    render_figures,
    render_grid,
    render_headline,
    render_rule,
    render_thresholds,
    write_figures,
)
from grpo_ratio.ladder.rule import load_summaries, rule_for_run, rule_sentence, threshold_text
from grpo_ratio.modes import MODES


ROOT = Path(__file__).parents[1]
FIELDS = set(RatioGRPOConfig.__dataclass_fields__)
ASYNC_FIELDS = set(RatioAsyncGRPOConfig.__dataclass_fields__)


def load_runner():
    spec = importlib.util.spec_from_file_location("ladder_runner", ROOT / "benchmarks" / "ladder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------------------
# the definitions


@pytest.mark.parametrize("source", list(LADDERS))
def test_every_ladder_is_a_dial_of_at_least_four_settings_with_one_uncorrected_arm(source):
    lad = ladder(source)
    # a ladder: uncorrected + 2 corrections (issue 41); a threshold sweep: the baseline + the swept correction
    assert len(lad.settings) >= 4 and len(lad.corrections) >= (2 if source in SWEEPS else 3)
    assert sum(c.uncorrected for c in lad.corrections) == 1
    assert lad.reference in {s.name for s in lad.settings}
    assert len({s.name for s in lad.settings}) == len(lad.settings)
    assert all(s.description and c.description for s in lad.settings for c in lad.corrections)


@pytest.mark.parametrize("source", list(LADDERS))
def test_every_override_is_a_config_field_with_an_allowed_value(source):
    from grpo_ratio.corrections.is_correction import CUSTOM_FIELDS, resolve_correction

    lad = ladder(source)
    fields = ASYNC_FIELDS if lad.trainer == "async" else FIELDS
    for item in (*lad.settings, *lad.corrections):
        for key, value in staleness_overrides(item.overrides, 1).items():
            assert key in fields or key == lad.needs_field, (source, item.name, key)
            if key == "is_correction":
                assert value is None or value in PRESETS or value == "custom"
            if key == "trust_region":
                assert value is None or value in TRUST_REGIONS
            if key == "old_logprob_mode":
                assert value in MODES
    for setting in lad.settings:  # each cell's IS fields resolve as the config resolves them (raises otherwise)
        for correction in lad.corrections:
            cell = lad.overrides(setting.name, correction.name)
            if "is_correction" in cell:
                resolve_correction(cell["is_correction"], *(cell.get(f) for f in CUSTOM_FIELDS))


def test_the_geometric_mask_sweep_reproduces_the_preset_at_its_default_band():
    from grpo_ratio.corrections.is_correction import CUSTOM_FIELDS, resolve_correction

    lad = ladder("geometric_mask_band")
    cell = lad.overrides("band_1.01", "swept")
    assert cell["rollout_precision"] == "int2"
    swept, preset = resolve_correction("custom", *(cell.get(f) for f in CUSTOM_FIELDS)), PRESETS["geometric_mask"]
    assert swept.level == preset.correction.level == "none"  # no IS weight, so the action is moot
    assert swept.rejections == preset.correction.rejections
    assert resolve_correction(*(lad.overrides("band_5", "none").get(f) for f in ("is_correction", *CUSTOM_FIELDS))) \
        is None  # the baseline: no IS correction at any band


def test_staleness_dial_is_trls_steps_per_generation_and_the_uncorrected_arm_opens_the_clip():
    lad = ladder("staleness")
    assert [s.value for s in lad.settings] == [0, 1, 3, 7, 15]  # 15: the dial pushed past what users meet
    assert staleness_overrides(lad.overrides("k3", "none"), 2) == {"steps_per_generation": 8, "epsilon": OPEN_CLIP}
    assert staleness_overrides(lad.overrides("k7", "ppo_clip"), 1) == {"steps_per_generation": 8, "epsilon": 0.2}
    assert lad.overrides("k1", "dppo_tv")["trust_region"] == "dppo_tv"
    # a run's staleness from its configuration: TRL's default is 0; spg = 4 x GA 2 with 2 iterations: 3
    assert config_staleness({"gradient_accumulation_steps": 1, "steps_per_generation": None}) == 0
    assert config_staleness({"gradient_accumulation_steps": 2, "steps_per_generation": 8, "num_iterations": 2}) == 7
    assert config_staleness({"max_staleness": 2}) == 2
    assert config_staleness(None) is None
    # what the report reads of a run: its run.json carries the staleness dial's fields
    from grpo_ratio.diagnostics.run_record import run_config
    from grpo_ratio.ladder.rule import run_distance

    config = run_config(RatioGRPOConfig(output_dir="unused", use_cpu=True, steps_per_generation=4,
                                        gradient_accumulation_steps=2, per_device_train_batch_size=4,
                                        num_generations=4))
    assert run_distance(lad, [], config) == 1.0


def test_async_staleness_dial_is_max_staleness_with_a_queue_deep_enough_to_reach_it(tmp_path):
    lad = ladder("async_staleness")
    assert lad.trainer == "async" and [s.value for s in lad.settings] == [0, 1, 3, 7]
    assert lad.uncorrected.overrides == {"async_objective": "coupled"}  # TRL's loss is what is left uncorrected
    runner = load_runner()
    values = runner.cell_config("async_staleness", "tiny_async", "k3", "decoupled_tis")
    samples = values["per_device_train_batch_size"] * values["gradient_accumulation_steps"]
    assert values["max_staleness"] == 3 and values["queue_maxsize"] == 4 * samples
    assert "eval_strategy" not in values  # TRL's async trainer has no evaluation loop (HeldOutReward logs it)
    args = RatioAsyncGRPOConfig(output_dir=str(tmp_path), vllm_server_base_url="http://127.0.0.1:1", **values)
    assert args.async_objective == "decoupled" and args.is_correction_spec is not None
    assert config_staleness(values) == 3  # the rule reads the cap as the run's distance
    with pytest.raises(ValueError, match=r"an asynchronous testbed \(tiny_async, smollm2_async\), not .tiny."):
        runner.run_ladder("async_staleness", "tiny", ["k0"], None, [0], output_root=str(tmp_path), show=False)
    with pytest.raises(ValueError, match="--set max_staleness"):
        runner.check_fields("async_staleness", {"max_staleness": 2})
    with pytest.raises(ValueError, match="RatioAsyncGRPOConfig has no such field"):
        runner.check_fields("async_staleness", {"ratio_attribution": "true"})


def test_a_cell_config_builds_and_a_dial_override_is_refused(tmp_path):
    runner = load_runner()
    values = runner.cell_config("staleness", "tiny", "k3", "dppo_tv", max_steps=24)
    assert values["steps_per_generation"] == 4 and values["epsilon"] == OPEN_CLIP and values["eval_steps"] == 2
    args = RatioGRPOConfig(output_dir=str(tmp_path), **values)
    assert args.trust_region == "dppo_tv" and args.steps_per_generation == 4
    with pytest.raises(ValueError, match="--set top_p"):
        runner.check_fields("truncation", {"top_p": 0.9})
    with pytest.raises(ValueError, match="no such field"):
        runner.check_fields("truncation", {"learning_rte": 1e-3})
    assert "rollout_precision" in FIELDS  # the precision ladder's field is in this checkout: its cells build
    assert _message(runner.check_fields, "precision", {}) == ""
    assert runner.cell_config("precision", "tiny", "int4", "sampler")["rollout_precision"] == "int4"


def _message(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as err:
        return str(err)
    return ""


# ---------------------------------------------------------------------------------------------------------------------
# outcomes, verdicts and the rule on a ladder folder written as a run would write it


def _history(end: float, grad: list[float], kept: float, entropy: float = 1.0) -> list[dict]:
    """A log history: evaluations at steps 0, 2, 4, 6 rising linearly to `end`, and 6 training rows."""
    rows = [{"eval_reward": end * s / 6, "step": s} for s in (0, 2, 4, 6)]
    for step, g in enumerate(grad, start=1):
        row = {"loss": 0.1, "grad_norm": g, "reward": 0.5, "entropy": entropy - 0.1 * step,
               "completions/mean_length": 10.0 - step, "step": step}
        if step == 1:
            row |= {keys.OLD_SAMPLER.mean: kept, keys.OLD_SAMPLER.oob_rate: 0.5,
                    keys.mismatch_key(keys.OLD_SAMPLER, "kl_k3"): 0.01, keys.IS_WEIGHT_ESS: 0.9,
                    keys.attribution_key("truncation", "share"): 0.7, keys.attribution_key("engine", "share"): 0.3}
        rows.append(row)
    return rows + [{"train_runtime": 1.0, "step": 6}]


def _write_cell(folder: Path, setting: str, correction: str, seed: int, history: list[dict], cpu: float) -> Path:
    run = folder / setting / f"{correction}-s{seed}"
    run.mkdir(parents=True)
    (run / "log_history.json").write_text(json.dumps(history))
    (run / "run.json").write_text(json.dumps({"config": {"top_p": 0.5}, "completed": True, "outputs_saved": True}))
    (run / "cell.json").write_text(json.dumps({"source": "truncation", "testbed": "tiny", "setting": setting,
                                               "correction": correction, "seed": seed, "cpu_s": cpu,
                                               "command": f"python benchmarks/ladder.py --settings {setting}"}))
    return run


@pytest.fixture
def written_ladder(tmp_path):
    """truncation: the reference (top_p 1.0) ends at 0.6; at top_p 0.5 the uncorrected run ends 0.1 lower and
    `renormalize` at the reference's reward; at top_p 0.95 nothing is lost. Seed offsets +-0.01 and 0."""
    folder = tmp_path / "ladders" / "truncation"
    for seed, noise in enumerate((0.01, -0.01, 0.0)):
        _write_cell(folder, "top_p_1.0", "none", seed, _history(0.6 + noise, [1, 1, 1, 1, 1, 1], 1.0), 10.0)
        _write_cell(folder, "top_p_0.95", "none", seed, _history(0.6 + noise * 1.5, [1, 1, 1, 1, 1, 1], 0.95), 10.0)
        _write_cell(folder, "top_p_0.5", "none", seed, _history(0.5 + noise, [1, 2, 1, 1, 9, 1], 0.6), 10.0)
        _write_cell(folder, "top_p_0.5", "renormalize", seed, _history(0.6 - noise / 2, [1, 1, 1, 1, 1, 1], 0.6),
                    12.0)
    return folder


def test_run_outcome_reads_held_out_reward_collapse_signals_step1_and_cost(written_ladder):
    out = run_outcome(written_ladder / "top_p_0.5" / "none-s2")
    assert out["metric"] == "eval_reward" and out["steps"] == [0, 2, 4, 6]
    assert out["end"] == pytest.approx(0.5 * (2 + 4 + 6) / 18)  # the last 3 evaluations
    assert out["auc"] == pytest.approx(0.25)  # a straight line from 0 to 0.5: its mean
    assert out["collapse"]["grad_norm_spike"] == pytest.approx(9.0)  # max 9 / median 1
    assert out["collapse"]["entropy_last"] == pytest.approx(0.4) and out["collapse"]["length_min"] == 4.0
    assert out["step1"]["old/sampler mean"] == 0.6 and out["step1"]["IS ESS"] == 0.9
    assert out["step1"]["attribution largest"] == {"term": "truncation", "share": 0.7}
    assert out["cost"]["cpu_s"] == 10.0 and out["cost"]["masked_key"] is None
    assert area_under_curve([0, 1, 3], [0.0, 1.0, 1.0]) == pytest.approx(2.5 / 3)


def test_summary_verdicts_loss_gain_and_gap_are_paired_by_seed(written_ladder):
    summary = summarize_ladder(written_ladder)
    assert list(summary["settings"]) == ["top_p_1.0", "top_p_0.95", "top_p_0.5"]  # the ladder's order
    at = summary["settings"]["top_p_0.5"]
    assert at["distance"] == pytest.approx(0.4)  # 1 - mean old/sampler at step 1
    loss = at["corrections"]["none"]["loss"]
    # the paired differences are -0.1 x (2 + 4 + 6) / 18 per seed (the noise is paired away): a zero-width interval
    assert loss["verdict"] == "beyond noise" and loss["estimate"] == pytest.approx(-0.1 * 12 / 18)
    gain = at["corrections"]["renormalize"]["gain"]
    assert gain["verdict"] == "beyond noise" and gain["estimate"] == pytest.approx(0.1 * 12 / 18)
    assert gain["method"] == "t-interval over 3 seeds"
    assert at["corrections"]["renormalize"]["gap"]["verdict"] == "within noise"
    assert summary["settings"]["top_p_0.95"]["corrections"]["none"]["loss"]["verdict"] == "within noise"
    assert "loss" not in summary["settings"]["top_p_1.0"]["corrections"]["none"]  # the reference itself


def test_rule_states_the_nearest_cell_its_loss_and_the_recovery_with_its_cost(written_ladder):
    summary = summarize_ladder(written_ladder)
    text = threshold_text(summary)
    assert "lost held-out reward from step-1 truncated mass (1 - mean old/sampler ratio) = 0.4 on" in text
    assert "no loss measured at 0.05 (setting top_p_0.95)" in text
    assert "`renormalize` recovered +0.0667" in text and "back to the reference's reward" in text
    assert "CPU x1.20 of the uncorrected cell" in text
    near = rule_sentence(summary, 0.35)
    assert near.startswith("your step-1 truncated mass (1 - mean old/sampler ratio) is 0.35: the nearest committed "
                           "cell is `top_p_0.5` (0.4, tiny testbed): uncorrected runs there lost -0.0667")
    assert rule_sentence(summary, 0.02).endswith("(0, tiny testbed). No loss measured up to distance 0.05; the first "
                                                 "loss is at `top_p_0.5` (0.4): -0.0667 [-0.0667, -0.0667], beyond "
                                                 "noise (t-interval over 3 seeds).")
    assert f"(at `top_p_0.95`: {_within(summary)})" in rule_sentence(summary, 0.06)
    assert "the ladder's largest; yours is beyond it" in rule_sentence(summary, 0.9)
    # a run of a user: its own step-1 row, against every committed ladder that applies
    history = _history(0.3, [1, 1, 1, 1, 1, 1], 0.62)
    lines = rule_for_run(history, {"top_p": 0.5}, [summary])
    assert len(lines) == 1 and "your step-1 truncated mass (1 - mean old/sampler ratio) is 0.38" in lines[0]
    # an asynchronous run (its configuration has max_staleness) is not compared with a synchronous trainer's ladder
    assert rule_for_run(history, {"top_p": 0.5, "max_staleness": 2}, [summary]) == []


def test_a_folder_without_its_reference_cell_says_it_has_no_loss_verdict(written_ladder):
    # a confirmation run at one setting (e.g. on SmolLM2) without the reference: "no loss measured" would be wrong
    import shutil

    shutil.rmtree(written_ladder / "top_p_1.0")
    summary = summarize_ladder(written_ladder)
    summary["folder"] = written_ladder.name
    text = threshold_text(summary)
    assert text.startswith("truncation (tiny): no reference cell (`top_p_1.0`) committed here, so no loss verdict; "
                           "against the uncorrected run, `renormalize` at `top_p_0.5`: +0.0667 [+0.0418, +0.0915], "
                           "beyond noise"), text
    assert "no loss measured" not in text and "no loss measured" not in rule_sentence(summary, 0.4)
    assert rule_sentence(summary, 0.4).endswith("no loss verdict; against the uncorrected run, `renormalize` at "
                                                "`top_p_0.5`: +0.0667 [+0.0418, +0.0915], beyond noise (t-interval "
                                                "over 3 seeds).")


def test_a_ladder_run_with_set_values_says_so_in_its_summary_and_rule(written_ladder):
    # every cell's command carries `--set learning_rate=0.003` (a ladder on a changed testbed): the summary keeps the
    # values all cells share, and the rule names them with the testbed
    for cell_file in written_ladder.glob("*/*/cell.json"):
        cell = json.loads(cell_file.read_text())
        extra = " --set top_k=3" if "top_p_0.5/none-s0" in str(cell_file) else ""  # not shared: left out
        cell["command"] += " --set learning_rate=0.003" + extra
        cell_file.write_text(json.dumps(cell))
    summary = summarize_ladder(written_ladder)
    assert summary["sets"] == {"learning_rate": "0.003"}
    assert threshold_text(summary).startswith("truncation (tiny, learning_rate=0.003): uncorrected runs lost")
    assert "(0.4, tiny, learning_rate=0.003 testbed)" in rule_sentence(summary, 0.35)
    # a user's run at another learning rate is told so, next to the cell it is compared with
    history = _history(0.3, [1, 1, 1, 1, 1, 1], 0.62)
    (line,) = rule_for_run(history, {"top_p": 0.5, "learning_rate": 1e-6}, [summary])
    assert line.endswith("(that ladder ran with learning_rate=0.003; this run has learning_rate=1e-06)")
    (line,) = rule_for_run(history, {"top_p": 0.5, "learning_rate": 0.003}, [summary])
    assert "that ladder ran with" not in line


def _within(summary) -> str:
    from grpo_ratio.ladder.rule import verdict_text

    return verdict_text(summary["settings"]["top_p_0.95"]["corrections"]["none"]["loss"])


def test_docs_blocks_render_from_the_folder_and_say_so_when_nothing_is_committed(written_ladder, tmp_path):
    summaries = load_summaries(written_ladder.parent)
    grid = render_grid(summaries)
    # end reward 0.5 x 2/3 and 0.6 x 2/3 (the last 3 of 4 evaluations on a line from 0); the gain's seeds differ
    assert "| `top_p_0.5` | 0.4 | 0.333 | 0.4 (+0.0667 [+0.0418, +0.0915] **gained**) | -0.0667 [-0.0667, -0.0667] " \
           "**lost** |" in grid
    assert "renormalize" in render_rule(summaries)
    assert "lost held-out reward on the truncation ladder" in render_headline(summaries)
    assert render_grid([]) == "No ladder results committed yet (results/ladders/).\n"
    assert "No threshold sweep committed yet" in render_thresholds(tmp_path / "absent")
    # the reward curves: one panel per setting, drawn into the ladder folder, linked relative to docs/
    assert render_figures(written_ladder.parent, tmp_path).startswith("(truncation: no figure yet")
    figure = write_figures(written_ladder, written_ladder)
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert render_figures(written_ladder.parent, tmp_path) == "![truncation: reward curves](" \
        "ladders/truncation/reward_curves.png)\n"


def test_the_committed_ladders_render_and_their_rule_holds_on_their_own_cells():
    """The committed results (once they exist): every ladder summarizes; the rule at a cell's own distance names that
    cell (or one at the same distance) and says "lost" exactly where the cell's loss verdict excludes 0 below."""
    from grpo_ratio.ladder.rule import lost

    summaries = load_summaries(ROOT / "results" / "ladders")
    for summary in summaries:
        distances = {}
        for setting, entry in summary["settings"].items():
            if entry["distance"] is not None and not math.isnan(entry["distance"]):
                distances.setdefault(entry["distance"], []).append(setting)
        for distance, settings in distances.items():
            sentence = rule_sentence(summary, distance)
            assert any(f"nearest committed cell is `{s}`" in sentence for s in settings), sentence
            loss = summary["settings"][settings[0]]["corrections"].get(summary["uncorrected"], {}).get("loss")
            if len(settings) == 1:
                assert ("uncorrected runs there lost" in sentence) == lost(loss), sentence


# ---------------------------------------------------------------------------------------------------------------------
# the runner on a real tiny ladder, then the report's section on one of its runs


@pytest.fixture(scope="module")
def real_ladder(tmp_path_factory):
    runner = load_runner()
    runner.TESTBEDS["tiny_test"] = {
        "kind": "tiny", "head_scale": 50.0, "train_prompts": 8, "eval_prompts": 2, "eval_points": 1,
        "config": dict(use_cpu=True, bf16=False, per_device_train_batch_size=4, num_generations=4,
                       max_completion_length=4, max_steps=1, learning_rate=3e-3, logging_steps=1,
                       save_strategy="no", report_to="none", disable_tqdm=True, per_device_eval_batch_size=8),
    }
    root = tmp_path_factory.mktemp("ladders")
    # the reference alone runs the uncorrected arm (3 cells in all: a few seconds each)
    runner.run_ladder("truncation", "tiny_test", ["top_p_1.0"], None, [0], output_root=str(root), name="truncation",
                      figures=False, show=False)
    kwargs = dict(source="truncation", testbed="tiny_test", settings=["top_p_0.5"], corrections=["none", "renormalize"],
                  seeds=[0], output_root=str(root), name="truncation", figures=False, show=False)
    summary = runner.run_ladder(**kwargs)
    return runner, root, kwargs, summary


def test_runner_writes_every_cell_with_its_command_and_cpu_time_and_resumes(real_ladder):
    runner, root, kwargs, summary = real_ladder
    folder = root / "truncation"
    cells = sorted(p.parent.relative_to(folder).as_posix() for p in folder.glob("*/*/cell.json"))
    assert cells == ["top_p_0.5/none-s0", "top_p_0.5/renormalize-s0", "top_p_1.0/none-s0"]
    cell = json.loads((folder / "top_p_0.5" / "renormalize-s0" / "cell.json").read_text())
    assert cell["command"] == (f"python benchmarks/ladder.py --source truncation --testbed tiny_test --settings "
                               f"top_p_0.5 --corrections renormalize --seeds 0 --output_root {root} --name truncation")
    assert [c.name for c in runner.ladder("truncation").corrections if c.uncorrected] == ["none"]
    assert cell["cpu_s"] > 0 and cell["steps"] == 1 and cell["config"]["top_p"] == 0.5
    assert cell["config"]["truncation_correction"] == "renormalize"
    assert json.loads((folder / "ladder.json").read_text()) == summary
    run = folder / "top_p_0.5" / "none-s0"
    assert [r["step"] for r in json.loads((run / "log_history.json").read_text()) if "eval_reward" in r] == [0, 1]
    at = summary["settings"]["top_p_0.5"]
    assert 0.01 < at["distance"] < 0.9 and abs(summary["settings"]["top_p_1.0"]["distance"]) < 1e-5
    assert at["corrections"]["none"]["loss"]["verdict"] in {"unknown", "not diverged yet"}  # 1 seed: no interval
    before = (run / "log_history.json").read_text()
    assert runner.run_ladder(**kwargs) == summary  # every cell read back, none trained again
    assert (run / "log_history.json").read_text() == before


def test_report_states_the_rule_for_a_run_from_the_ladders(real_ladder, capsys, tmp_path):
    _, root, _, _ = real_ladder
    run = root / "truncation" / "top_p_0.5" / "none-s0"
    assert report.main([str(run), "--ladders", str(root)]) == 0
    out = capsys.readouterr().out
    assert "#### When it matters (the committed mismatch ladders, docs/when_it_matters.md)" in out
    assert "- **truncation**: your step-1 truncated mass (1 - mean old/sampler ratio) is" in out
    assert "the nearest committed cell is `top_p_0.5`" in out
    assert report.main([str(run), "--ladders", str(tmp_path / "none")]) == 0
    assert "No committed ladder results under" in capsys.readouterr().out


def test_the_rule_names_a_correction_that_cost_reward_against_the_uncorrected_run():
    """A correction whose paired verdict against the uncorrected run excludes 0 below (PPO's clip on stale rollouts
    in the committed staleness ladder) is named in the ladder's sentence, the user's rule and the README headline,
    from the first setting it lost at, with its interval and how many settings it lost at."""
    from grpo_ratio.ladder.rule import cost_text_per_correction

    def verdict(estimate, lo, hi):
        beyond = lo > 0 or hi < 0
        return {"verdict": "beyond noise" if beyond else "within noise", "estimate": estimate, "interval": [lo, hi],
                "method": "t-interval over 3 seeds", "seeds": [0, 1, 2]}

    def entry(distance, clip_gain):
        corrections = {"none": {"loss": verdict(0.01, -0.1, 0.12), "cost": {}}}
        if clip_gain is not None:
            corrections["ppo_clip"] = {"gain": clip_gain, "cost": {}}
        return {"distance": distance, "corrections": corrections}

    summary = {"source": "staleness", "testbed": "tiny", "uncorrected": "none", "settings": {
        "k0": entry(0.0, None), "k1": entry(1.0, verdict(0.05, -0.2, 0.3)),
        "k3": entry(3.0, verdict(-0.2, -0.3, -0.1)), "k7": entry(7.0, verdict(-0.47, -0.85, -0.08))}}
    assert cost_text_per_correction(summary) == [
        "`ppo_clip` lost held-out reward against the uncorrected run from staleness (optimizer steps between a "
        "rollout and its last update) = 3 on (setting k3: -0.2 [-0.3, -0.1], beyond noise (t-interval over 3 "
        "seeds); at 2 of the 3 settings it ran at)"]
    assert threshold_text(summary).startswith("staleness (tiny): no loss measured up to")
    assert "A correction cost reward: `ppo_clip` lost" in threshold_text(summary)
    sentence = rule_sentence(summary, 6.0)  # nearest cell k7
    assert "nearest committed cell is `k7`" in sentence
    assert "There, `ppo_clip` lost -0.47 [-0.85, -0.08]" in sentence
    assert "ppo_clip" not in rule_sentence(summary, 1.0)  # at k1 the clip was within noise
    assert "a correction itself cost reward on the staleness ladder(s)" in render_headline([summary, summary])
    assert render_headline([summary, summary]).count("staleness") == 2  # each source once per clause
    lost_k7 = {**summary, "settings": {**summary["settings"], "k7": {"distance": 7.0, "corrections": {
        "none": {"loss": verdict(-0.3, -0.4, -0.1), "cost": {}}}}}}
    pushed = {**lost_k7, "sets": {"learning_rate": 0.01}}
    assert "(testbed: tiny; tiny, learning_rate=0.01)" in render_headline([lost_k7, pushed, pushed])


def test_the_async_ladders_held_out_reward_is_seeded_leaves_training_rng_and_attention_alone():
    """benchmarks/async_ladder.py's `HeldOutReward` (TRL's async trainer has no evaluation loop): the policy's own
    samples on the held-out prompts, the same value for the same weights and seed, equal to the letter share of a
    direct `generate` with that seed; the torch RNG and the model's attention implementation are left as found; logged
    at step 0 and every `every` steps."""
    from transformers import TrainerControl, TrainerState
    from trl.chat_template_utils import qwen2_5_chat_template

    from grpo_ratio.testing import letter_reward, peaked_model, tiny_prompts, tiny_tokenizer

    spec = importlib.util.spec_from_file_location("async_ladder", ROOT / "benchmarks" / "async_ladder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = peaked_model("llama", scale=10.0, never_eos=True, vocab_size=300, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32)
    tokenizer = tiny_tokenizer(vocab_size=300)
    tokenizer.chat_template = qwen2_5_chat_template
    held_out = module.chat(tiny_prompts(2, start=1000)).add_column("weight", [1.0, 3.0])

    def weighted(completions, weight, **kwargs):  # a reward reading a column of the held-out set, as TRL passes it
        return [w * r for w, r in zip(weight, letter_reward(completions), strict=True)]

    evaluation = module.HeldOutReward(tokenizer, held_out, [letter_reward, weighted], every=2, generations=3,
                                      max_new_tokens=5, seed=7)
    model.config._attn_implementation = "eager"
    rng = torch.get_rng_state()
    first = evaluation.evaluate(model)
    assert torch.equal(torch.get_rng_state(), rng) and model.config._attn_implementation == "eager"
    assert evaluation.evaluate(model) == first
    torch.manual_seed(7)
    out = model.generate(**evaluation.batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=5,
                         num_return_sequences=3, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, evaluation.batch["input_ids"].shape[1]:], skip_special_tokens=True)
    letters = letter_reward(texts)  # prompt 0's three completions (weight 1), then prompt 1's (weight 3)
    assert len(texts) == 6 and first == pytest.approx(sum(r * (2 if i < 3 else 4) for i, r in enumerate(letters)) / 6,
                                                      abs=1e-12)
    state = TrainerState(max_steps=5)
    evaluation.on_train_begin(None, state, TrainerControl(), model=model)
    for step in range(1, 6):
        state.global_step = step
        evaluation.on_step_end(None, state, TrainerControl(), model=model)
    assert [row["step"] for row in state.log_history] == [0, 2, 4, 5]  # and the last step
    assert state.log_history[0]["eval_reward"] == first
