"""Every recipe parses through the real TrlParser into valid configs; trainers/grpo.py fails early and clearly; one
tiny end-to-end run of its main(). Run: pytest tests/test_recipes.py"""

import json
from pathlib import Path

import pytest

from grpo_ratio.config import SCORING_MODES
from grpo_ratio.tasks import TASKS
from grpo_ratio.testing import tiny_model, tiny_tokenizer


ROOT = Path(__file__).parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*/*/*.yaml"))
SHARED = ROOT.parent / "shared"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture
def grpo():
    from grpo_ratio.cli import train

    return train


@pytest.fixture
def tiny_dir(tmp_path):
    """A tiny qwen2 model + chat tokenizer saved with save_pretrained (what resolve_model_path accepts)."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tiny_model("qwen2").save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def _parse(grpo, args, **flags):
    """Parse `args` plus `--key value` for each of `flags`, with a fresh parser (it keeps a recipe's values as its
    defaults, so a reused parser would leak one recipe into the next)."""
    extra = [str(x) for key, value in flags.items() for x in (f"--{key}", value)]
    return grpo.make_parser().parse_args_and_config([*args, *extra])


def test_recipe_grid_is_complete():
    names = {(p.parent.name, p.stem) for p in RECIPES}
    assert {(t, m) for t in TASKS for m in SCORING_MODES} <= names  # 2 tasks x 6 modes for SmolLM2-135M


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recipe_parses_into_valid_configs(grpo, recipe):
    script_args, training_args, model_args = _parse(grpo, ["--config", str(recipe)])
    # file name = arm: the mode, or the mode and what else sets the arm apart (bf16_renormalize)
    assert recipe.stem == training_args.old_logprob_mode or recipe.stem.startswith(f"{training_args.old_logprob_mode}_")
    assert script_args.task == recipe.parent.name  # folder = task
    assert model_args.model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert training_args.use_cpu and training_args.bf16  # CPU-friendly, bf16 autocast: the regime under study
    assert training_args.report_to == ["wandb"] and training_args.logging_steps == 1
    assert training_args.output_dir.endswith(f"{recipe.parent.name}/{recipe.stem}")
    if recipe.stem == "guided_fp32":
        assert all(0 <= i < 30 for i in training_args.guided_fp32_layer_ids)  # SmolLM2-135M has 30 layers
    if script_args.task == "gsm8k":  # the hub id by default (a user has no local copy); --dataset_path overrides
        assert script_args.dataset_path is None and "--dataset_path FOLDER_OR_JSONL" in recipe.read_text()
    text = recipe.read_text()
    rel = recipe.relative_to(ROOT)
    assert text.startswith("#") and f"python trainers/grpo.py --config {rel}\n" in text  # launch command
    assert f"python trainers/grpo.py --config {rel} --" in text  # an override example
    for header in ("# Model arguments", "# Data", "# GRPO trainer", "# grpo_ratio"):
        assert f"\n{header}" in text


def _is_calibration(data) -> bool:
    """A calibration file as `grpo-ratio probe layers`/`calibrate` write it (not a probe's result, e.g. ladder.json)."""
    return isinstance(data, dict) and "guided_fp32_layers" in data and str(data.get("source")).startswith("grpo-ratio")


def test_one_calibration_file_for_smollm2():
    # The guided_fp32 recipes read one calibration file; no other committed file offers SmolLM2 a different layer
    # set (a second copy drifted once: [0, 29] here, the top 8 of `probe layers` there).
    files = sorted(p for folder in ("recipes", "results") for p in (ROOT / folder).glob("**/*.json"))
    calibrations = [p.relative_to(ROOT).as_posix() for p in files if _is_calibration(json.loads(p.read_text()))]
    assert calibrations == ["recipes/smollm2-135m/calibration.json"]
    for recipe in RECIPES:
        if "guided_fp32_layers" in recipe.read_text():
            assert recipe.read_text().count("\nguided_fp32_layers: recipes/smollm2-135m/calibration.json") == 1


def test_command_line_overrides_recipe(grpo):
    recipe = str(ROOT / "recipes/smollm2-135m/arithmetic/bf16.yaml")
    _, training_args, _ = _parse(grpo, ["--config", recipe, "--max_steps", "3", "--old_logprob_mode", "fp32_head"])
    assert training_args.max_steps == 3 and training_args.old_logprob_mode == "fp32_head"


def test_unknown_recipe_key_is_refused(grpo, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("task: arithmetic\nuse_cpu: true\nold_logprob_mod: fp32_clone\n")  # typo
    with pytest.raises(ValueError, match="old_logprob_mod"):
        _parse(grpo, ["--config", str(recipe)])


def test_unknown_arm_is_refused(grpo, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("old_logprob_mode: fp8_clone\nuse_cpu: true\n")
    with pytest.raises(ValueError, match="allowed: bf16, fp32_clone, fp16_clone, fp32_head, guided_fp32"):
        _parse(grpo, ["--config", str(recipe)])  # a YAML value bypasses argparse choices: the config checks it
    with pytest.raises(SystemExit):
        _parse(grpo, ["--old_logprob_mode", "fp8_clone"])  # on the command line argparse refuses it


def test_missing_data_path_fails_before_the_model(grpo, tmp_path):
    script_args, training_args, model_args = _parse(
        grpo,
        [],
        task="gsm8k",
        dataset_path=tmp_path / "nope",
        model_name_or_path=tmp_path / "none",
        output_dir=tmp_path / "out",
        use_cpu="true",
    )
    with pytest.raises(FileNotFoundError, match="no GSM8K file"):  # the data error, not the model one
        grpo.build_trainer(script_args, training_args, model_args)


def test_a_flag_the_task_does_not_take_is_named_as_a_flag(grpo, tmp_path):
    script_args, training_args, model_args = _parse(
        grpo, [], task="arithmetic", dataset_path=tmp_path / "data.jsonl", model_name_or_path=tmp_path / "none",
        output_dir=tmp_path / "out", use_cpu="true")
    with pytest.raises(ValueError, match=r"task='arithmetic' does not take --dataset_path; it takes: .*--task_seed"):
        grpo.build_trainer(script_args, training_args, model_args)


def test_unreadable_model_is_a_clear_error(grpo, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")  # a directory that looks like a model but is not
    cases = [
        (tmp_path / "none", FileNotFoundError, "not an existing model directory"),
        (tmp_path / "broken", OSError, "Cannot read a tokenizer"),
    ]
    for path, error, match in cases:
        script_args, training_args, model_args = _parse(
            grpo, [], task="arithmetic", model_name_or_path=path, output_dir=tmp_path / "out", use_cpu="true"
        )
        with pytest.raises(error, match=match):
            grpo.build_trainer(script_args, training_args, model_args)


def test_main_runs_a_recipe_on_a_tiny_model(grpo, tiny_dir, tmp_path):
    out = tmp_path / "run"
    recipe = ROOT / "recipes/smollm2-135m/arithmetic/fp32_clone.yaml"
    args = _parse(
        grpo,
        ["--config", str(recipe)],
        model_name_or_path=tiny_dir,
        output_dir=out,
        report_to="none",
        max_steps=1,
        max_completion_length=8,
        num_examples=16,
        save_final_model="false",  # and save_strategy "no": main() must create output_dir itself
    )
    grpo.main(*args)
    history = json.loads((out / "log_history.json").read_text())
    assert history[0]["step"] == 1 and "reward" in history[0] and "ratio/new_old/oob_rate" in history[0]
    assert (out / "metrics.png").stat().st_size > 0
    assert not (out / "model.safetensors").exists()
    # run.json tells `grpo-ratio report` the arm: its findings depend on the mode
    config = json.loads((out / "run.json").read_text())["config"]
    assert config["old_logprob_mode"] == "fp32_clone" and config["max_steps"] == 1
    from grpo_ratio.analysis.report import load_runs

    ((name, rows, read_config),) = load_runs(out)
    assert name == "run" and read_config == config and len(rows) == len(history)


def test_a_finished_run_is_not_overwritten(grpo, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "log_history.json").write_text("[]")  # what main() writes when a run finishes
    recipe = str(ROOT / "recipes/smollm2-135m/arithmetic/bf16.yaml")
    common = dict(output_dir=out, report_to="none", model_name_or_path=tmp_path / "no-model")
    args = _parse(grpo, ["--config", recipe], **common, seed=1)  # a second seed into the recipe's output_dir
    with pytest.raises(FileExistsError, match=r"already holds a finished run .*--seed 1 --output_dir .*run-s1\) or "
                                              r"--overwrite_output_dir true") as refused:
        grpo.main(*args)  # refused before the model (which does not exist) is even looked for
    assert "--resume_from_checkpoint" not in str(refused.value)  # no checkpoint: nothing to resume
    assert sorted(p.name for p in out.iterdir()) == ["log_history.json"]  # nothing written (no wandb dir either)
    (out / "checkpoint-1").mkdir()
    with pytest.raises(FileExistsError, match=r"--resume_from_checkpoint .*checkpoint-1 to continue it"):
        grpo.check_output_dir(*_parse(grpo, ["--config", recipe], **common, seed=1)[:2])
    for opt_in in (dict(overwrite_output_dir="true"), dict(resume_from_checkpoint=str(out / "checkpoint-1"))):
        script_args, training_args, _ = _parse(grpo, ["--config", recipe], **common, **opt_in)
        grpo.check_output_dir(script_args, training_args)  # allowed: the run goes on to load the model
    script_args, training_args, _ = _parse(grpo, ["--config", recipe], **{**common, "output_dir": tmp_path / "new"})
    grpo.check_output_dir(script_args, training_args)  # a fresh output_dir


@pytest.mark.skipif(not (SHARED / "data" / "gsm8k").is_dir(), reason="needs ../shared/data/gsm8k")
def test_gsm8k_recipe_with_a_local_copy(grpo):
    from grpo_ratio.tasks import load_task

    recipe = str(ROOT / "recipes/smollm2-135m/gsm8k/bf16.yaml")
    script_args, _, _ = _parse(grpo, ["--config", recipe], dataset_path=SHARED / "data" / "gsm8k")
    dataset, rewards = load_task(script_args.task, **grpo.task_kwargs(script_args))
    assert len(dataset) == 2048 and rewards[0].__name__ == "gsm8k_lenient_reward"


QUICKSTART = ROOT / "recipes/smollm2-135m/quickstart_cpu.yaml"


def test_quickstart_recipe_is_fp32_with_a_corrected_top_p(grpo):
    # the README's first command: fp32 (a CPU runs it natively), 10 steps, truncated sampling and its correction
    _, training_args, model_args = _parse(grpo, ["--config", str(QUICKSTART)])
    assert not training_args.bf16 and not training_args.fp16 and model_args.dtype == "float32"
    assert training_args.max_steps == 10 and training_args.top_p == 0.8
    assert training_args.truncation_correction == "renormalize" and training_args.ratio_diagnostics
    readme = (ROOT / "README.md").read_text()
    assert "trainers/grpo.py --config recipes/smollm2-135m/quickstart_cpu.yaml" in readme


def test_quickstart_on_a_tiny_model_shows_the_kept_mass_and_its_correction(grpo, tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = _parse(grpo, ["--config", str(QUICKSTART)], model_name_or_path=tiny_dir, output_dir=out,
                  report_to="none", max_steps=2, max_completion_length=8, num_examples=16)
    grpo.main(*args)
    said = capsys.readouterr().out
    assert "grpo-ratio: step 1 took" in said and "the other 1 steps take about" in said  # the estimate, once
    rows = [r for r in json.loads((out / "log_history.json").read_text()) if "reward" in r]
    assert len(rows) == 2
    for row in rows:  # a near-uniform tiny model under top_p=0.8: the sampler's log-probs carry log M < 0
        assert row["ratio/old_sampler/mean"] < 0.95
        assert row["ratio/old_sampler_corrected/mean"] == pytest.approx(1.0, abs=1e-3)


def test_bf16_on_a_cpu_without_native_bf16_is_said_once(monkeypatch, caplog):
    from types import SimpleNamespace

    from grpo_ratio import checks as lints

    monkeypatch.setattr(lints, "_said_cpu_precision", False)
    monkeypatch.setattr(lints, "cpu_has_native_bf16", lambda: False)
    with caplog.at_level("WARNING", logger="grpo_ratio"):
        lints.check_cpu_precision(SimpleNamespace(bf16=False, fp16=False), "cpu")  # fp32: nothing to say
        lints.check_cpu_precision(SimpleNamespace(bf16=True, fp16=False), "cuda")  # a GPU: nothing to say
        assert caplog.messages == []
        for _ in range(2):
            lints.check_cpu_precision(SimpleNamespace(bf16=True, fp16=False), "cpu")
    assert len(caplog.messages) == 1 and "bf16=True on a CPU without native bf16" in caplog.messages[0]
    monkeypatch.setattr(lints, "_said_cpu_precision", False)
    monkeypatch.setattr(lints, "cpu_has_native_bf16", lambda: True)
    caplog.clear()
    lints.check_cpu_precision(SimpleNamespace(bf16=True, fp16=False), "cpu")
    assert caplog.messages == []
