"""RatioGRPOConfig: new fields, validation at config time, TrlParser/YAML exposure."""

import json

import pytest

from grpo_ratio import RatioGRPOConfig
from grpo_ratio.old_pass.layer_spec import parse_layer_spec


def _cfg(tmp_path, **kw):
    return RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)


def test_defaults_are_trl_behaviour(tmp_path):
    cfg = _cfg(tmp_path)
    assert cfg.old_logprob_mode == "bf16" and cfg.truncation_correction == "none"
    assert (cfg.ratio_band_low, cfg.ratio_band_high) == (0.9, 1.1)
    assert cfg.copy_storage == "resident" and cfg.vllm_lm_head_fp32 is False


@pytest.mark.parametrize("kw,match", [
    (dict(old_logprob_mode="fp8"), "allowed: bf16, fp32_clone, fp16_clone, fp32_head, guided_fp32"),
    (dict(old_logprob_mode="guided_fp32"), "needs guided_fp32_layers"),
    (dict(old_logprob_mode="fp32_head", guided_fp32_layers="1"), "only used by old_logprob_mode='guided_fp32'"),
    (dict(old_logprob_mode="guided_fp32", guided_fp32_layers="0,x"), "'x' is not an integer"),
    (dict(old_logprob_mode="guided_fp32", guided_fp32_layers="-1"), "non-negative"),
    (dict(truncation_correction="clip"), "allowed: none, renormalize, lift_sampler"),
    (dict(ratio_band_low=1.2), "ratio band"),
    (dict(clip_flip_every=-1), "clip_flip_every"),
    (dict(clip_flip_every=0.5), "clip_flip_every must be an integer"),
    (dict(ratio_diagnostics="no"), "ratio_diagnostics must be True or False"),
    (dict(old_logprob_mode="guided_fp32", guided_fp32_layers="1,1"), "layer 1 is listed twice"),
    (dict(old_logprob_mode="fp16_clone", copy_storage="layer"), "copy_storage='layer' is not allowed; allowed: "
     "resident, per_layer"),
    (dict(old_logprob_mode="fp32_head", copy_storage="per_layer"), "only used by old_logprob_mode in fp16_clone, "
     "fp32_clone"),
    (dict(top_p=0.0), r"top_p=0.0 is not allowed; allowed: 0 < top_p <= 1"),  # TRL takes it; generate keeps 1 token
    (dict(top_p=1.5), r"allowed: 0 < top_p <= 1"),
    # TRL passes these through: generate fails at the first step (temperature, top_k) or keeps one token (min_p)
    (dict(temperature=0.0), r"temperature=0.0 is not allowed; allowed: > 0"),
    (dict(temperature=-1.0), r"temperature=-1.0 is not allowed"),
    (dict(top_k=-1), r"top_k=-1 is not allowed; allowed: an integer >= 0 \(0 = no top-k truncation; -1 only with "
                     r"vLLM\)"),
    (dict(top_k=-2, use_vllm=True), r"top_k=-2 is not allowed; allowed: an integer >= 0 \(0 = no top-k truncation, "
                                    r"as is -1 with vLLM\)"),
    (dict(min_p=1.5), r"min_p=1.5 is not allowed; allowed: 0 <= min_p <= 1, or None"),
    (dict(min_p=-0.1), r"min_p=-0.1 is not allowed"),
    (dict(generation_kwargs={"top_k": 2.5}), r"generation_kwargs\['top_k'\]=2.5 is not allowed"),
    (dict(generation_kwargs={"min_p": 2}), r"generation_kwargs\['min_p'\]=2 is not allowed"),
    (dict(generation_kwargs={"temperature": "hot"}), r"generation_kwargs\['temperature'\]='hot' is not allowed"),
])
def test_bad_values_fail_at_config_time(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **kw)


def test_sampling_fields_in_range_pass(tmp_path):
    """The edges of each allowed range, as fields and through generation_kwargs (which override the fields)."""
    for kw in (dict(temperature=1e-3, top_p=1.0, top_k=0, min_p=0.0), dict(top_k=1, min_p=1.0),
               dict(top_k=-1, generation_kwargs={"top_k": 20}),  # the override is the value generation uses
               dict(top_k=-1, use_vllm=True)):  # vLLM's own "all tokens"
        cfg = _cfg(tmp_path, **kw)
        assert (cfg.top_k, cfg.min_p) == (kw["top_k"], kw.get("min_p"))


@pytest.mark.parametrize("spec", ["0,29", " 29 , 0 ", "[0, 29]", [29, 0], (0, 29), "[29,0]"])
def test_layer_spec_forms(spec):
    assert parse_layer_spec(spec) == [0, 29]


def test_layer_spec_single_int_as_yaml_gives_it(tmp_path):
    from trl import TrlParser

    assert parse_layer_spec(29) == [29] and parse_layer_spec("29") == [29]
    yaml = tmp_path / "r.yaml"  # `guided_fp32_layers: 29` reaches the config as a YAML int, `"[0, 29]"` as a string
    for value, layers in (("29", [29]), ('"[0, 29]"', [0, 29]), ("[0, 29]", [0, 29])):
        yaml.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nreport_to: none\nold_logprob_mode: guided_fp32\n"
                        f"guided_fp32_layers: {value}\n")
        (cfg,) = TrlParser((RatioGRPOConfig,)).parse_args_and_config(["--config", str(yaml)])
        assert cfg.guided_fp32_layer_ids == layers and cfg.guided_fp32_calibration is None


@pytest.mark.parametrize("spec,match", [
    ("0,,29", "'0,,29' has an empty entry"),
    ("0,29,", "has an empty entry"),
    (",", "has an empty entry"),
    ("[0, 29", "is not a valid list"),
    ('{"a": 1}', "not an integer|expected"),
    ("[0, true]", "True is not an integer"),
    (True, "guided_fp32_layers must be"),
    (1.5, "guided_fp32_layers must be"),
    ([0, "x"], "'x' is not an integer"),
])
def test_bad_layer_specs_name_the_field(spec, match):
    with pytest.raises(ValueError, match=match) as err:
        parse_layer_spec(spec)
    assert "guided_fp32_layers" in str(err.value)


def test_layer_specs(tmp_path):
    assert parse_layer_spec("3, 1") == [1, 3]
    assert parse_layer_spec([2, 0]) == [0, 2]
    assert parse_layer_spec("") == []  # no layers: guided_fp32 then asks for some (see test_bad_values_fail_...)
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({"guided_fp32_layers": [0, 1, 29]}))
    assert _cfg(tmp_path, old_logprob_mode="guided_fp32", guided_fp32_layers=str(calib)).guided_fp32_layer_ids == [0, 1, 29]
    with pytest.raises(FileNotFoundError, match="missing.json"):
        parse_layer_spec(str(tmp_path / "missing.json"))
    calib.write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        parse_layer_spec(str(calib))


def test_calibration_metadata_is_kept_on_the_config(tmp_path):
    calib = tmp_path / "calib.json"
    calib.write_text(json.dumps({"guided_fp32_layers": [0, 29], "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                 "ranking": list(range(30)), "source": "grpo-ratio probe calibrate"}))
    cfg = _cfg(tmp_path, old_logprob_mode="guided_fp32", guided_fp32_layers=str(calib))
    assert cfg.guided_fp32_calibration == {"path": str(calib), "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                           "num_layers": 30, "source": "grpo-ratio probe calibrate"}
    calib.write_text(json.dumps({"guided_fp32_layers": [1], "num_layers": 2, "increments": [0.1, 0.2, 0.3]}))
    assert _cfg(tmp_path, old_logprob_mode="guided_fp32",
                guided_fp32_layers=str(calib)).guided_fp32_calibration["num_layers"] == 2  # recorded count wins
    assert _cfg(tmp_path, old_logprob_mode="guided_fp32", guided_fp32_layers="1").guided_fp32_calibration is None


def test_fields_are_cli_flags_and_yaml_keys(tmp_path):
    from trl import TrlParser

    yaml = tmp_path / "r.yaml"
    yaml.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nold_logprob_mode: fp16_clone\nreport_to: none\n")
    (cfg,) = TrlParser((RatioGRPOConfig,)).parse_args_and_config(
        ["--config", str(yaml), "--ratio_band_high", "1.2"])
    assert cfg.old_logprob_mode == "fp16_clone" and cfg.ratio_band_high == 1.2
    with pytest.raises(SystemExit):  # argparse refuses a value outside `choices`
        TrlParser((RatioGRPOConfig,)).parse_args_and_config(["--config", str(yaml), "--old_logprob_mode", "fp8"])


def test_correction_without_truncation_warns(tmp_path):
    # the check needs the sampling settings generate really uses (the model's generation_config fills unset fields),
    # so it runs when the trainer is built (grpo_ratio/checks.py)
    from trainer_fixtures import tiny_trainer

    with pytest.warns(UserWarning, match="has no effect: sampling is not truncated"):
        tiny_trainer(tmp_path, "bf16", truncation_correction="renormalize")


def test_kept_set_source_without_a_correction_warns(tmp_path, recwarn):
    with pytest.warns(UserWarning, match="kept_set_source='recompute' has no effect with truncation_correction='none'"):
        RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, kept_set_source="recompute")
    recwarn.clear()
    RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, kept_set_source="recompute", top_p=0.8,
                    truncation_correction="renormalize")
    RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True)  # auto: the default, silent
    assert not [w for w in recwarn if "kept_set_source" in str(w.message)]


def test_the_early_command_line_checks_agree_with_the_config(tmp_path):
    # grpo_ratio/cli/precheck.py refuses what RatioGRPOConfig refuses, before the heavy imports
    from grpo_ratio.checks import TRL_FIELD_RULES
    from grpo_ratio.cli.precheck import RANGES, ConfigError, check_flags

    cases = {"top_p": ([0.0, 1.5], [1.0, 0.5]), "temperature": ([0.0, -0.5], [0.7]), "top_k": ([-2, 2.5], [0, 50]),
             "min_p": ([-0.1, 1.5], [0.0, 1.0]),
             # TRL's fields that fail late (grpo_ratio.checks.check_trl_fields); good values fit the defaults
             # (per_device_train_batch_size=8, num_generations=8: TRL's divisibility rule)
             "num_generations": ([0, 1, -2, 2.5], [2, 8]), "learning_rate": ([-1.0, -1e-6], [0.0, 1e-6]),
             "max_completion_length": ([0, -1, 2.5], [1, 64]), "per_device_train_batch_size": ([0, -8], [8, 16]),
             "gradient_accumulation_steps": ([0, -1], [1, 2]), "num_iterations": ([0, -1], [1, 2]),
             "steps_per_generation": ([0, -1], [1, 2]), "generation_batch_size": ([0, -8], [8, 16]),
             "max_steps": ([0, -2, 2.5], [-1, 1, 10])}
    assert set(cases) == set(RANGES) and set(TRL_FIELD_RULES) <= set(RANGES)
    for name, (bad_values, good_values) in cases.items():
        for bad in bad_values:
            with pytest.raises(ConfigError):
                check_flags([f"--{name}", str(bad)])
            with pytest.raises(ValueError, match=name):
                RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{name: bad})
        for good in good_values:
            check_flags([f"--{name}", str(good)])
            assert getattr(RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{name: good}), name) == good


def test_the_early_checks_and_the_config_agree_on_none(tmp_path):
    # a recipe's `null` (or "none" for an `int | None` field) passes the parser as None: allowed by both or by neither
    from grpo_ratio.cli.precheck import RANGES, ConfigError, check_recipe

    recipe = tmp_path / "r.yaml"
    for name, (inside, _) in RANGES.items():
        recipe.write_text(f"{name}: null\n")
        if inside(None):
            check_recipe(str(recipe))
            RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{name: None})  # TRL may fill it in
        else:
            with pytest.raises(ConfigError, match=f"{name}=None is outside the allowed range"):
                check_recipe(str(recipe))
            with pytest.raises(ValueError, match=f"{name}=None is not allowed"):
                RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{name: None})


@pytest.mark.parametrize("kw,match", [
    # the issue: TRL's ZeroDivisionError (it divides by num_generations before it checks it), torch's optimizer error
    # at the first step, transformers' max_new_tokens error at the first generate; now one line naming the field
    (dict(num_generations=0), r"^num_generations=0 is not allowed; allowed: an integer >= 2 \(GRPO's advantage "
                              r"compares the completions of one prompt\)$"),
    (dict(learning_rate=-1), r"^learning_rate=-1 is not allowed; allowed: a number >= 0 \(torch's optimizers refuse a "
                             r"negative one\)$"),
    (dict(max_completion_length=0), r"^max_completion_length=0 is not allowed; allowed: an integer >= 1, or None$"),
    (dict(num_generations=1), "num_generations=1 is not allowed"),
    (dict(per_device_train_batch_size=0), "per_device_train_batch_size=0 is not allowed; allowed: an integer >= 1"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps=0 is not allowed"),
    (dict(num_iterations=0), "num_iterations=0 is not allowed"),
    (dict(max_steps=0), r"max_steps=0 is not allowed; allowed: -1 \(train num_train_epochs\) or an integer >= 1"),
    (dict(steps_per_generation=0), "steps_per_generation=0 is not allowed"),
    (dict(generation_batch_size=0), "generation_batch_size=0 is not allowed"),
    (dict(learning_rate="1e-5"), "learning_rate='1e-5' is not allowed; allowed: a number >= 0"),
])
def test_trl_fields_that_fail_late_are_refused_at_config_time(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, **kw)


def test_a_late_failing_trl_field_is_one_line_on_the_command_line_too(capsys, tmp_path):
    # past the early check (trainers/grpo.py and `grpo-ratio train` run it; cli_main alone does not): the config's line
    from pathlib import Path

    from grpo_ratio.cli.train import cli_main

    recipe = Path(__file__).parents[1] / "recipes" / "smollm2-135m" / "quickstart_cpu.yaml"
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--config", str(recipe), "--num_generations", "0", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("grpo-ratio train: error: num_generations=0 is not allowed; allowed: an integer >= 2")


@pytest.mark.parametrize("version", ["1.15.2", "1.17.0", "2.0.0"])
def test_untested_trl_is_refused_at_import(version, monkeypatch):
    from grpo_ratio._compat import check_trl_version

    monkeypatch.delenv("GRPO_RATIO_SKIP_TRL_CHECK", raising=False)
    with pytest.raises(ImportError, match=r"trl>=1\.16\.0,<1\.17\.0"):
        check_trl_version(version)
    check_trl_version("1.16.0")  # the tested release passes
