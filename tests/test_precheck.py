"""Recipe and flag mistakes fail in one line, before the heavy imports (grpo_ratio/cli/precheck.py), with a did-you-mean.

Run: pytest tests/test_precheck.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_ratio.cli import precheck
from grpo_ratio.cli.precheck import ConfigError, check_compare, check_flags, check_recipe, check_train


ROOT = Path(__file__).parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m" / "arithmetic" / "fp32_clone.yaml"


def test_the_committed_field_list_is_the_real_parser():
    stored = json.loads(precheck.FIELDS_FILE.read_text())
    assert {k: stored[k] for k in ("flags", "keys", "only", "defaults")} == precheck.current_fields(), \
        "grpo_ratio/cli/cli_fields.json is stale: run python -m grpo_ratio.cli.precheck --write"


def _recipe(tmp_path, extra: str) -> str:
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.read_text() + extra)
    return str(path)


def test_a_recipe_key_typo_gets_a_did_you_mean(tmp_path):
    with pytest.raises(ConfigError, match=r"r\.yaml: unknown key 'max_stesp'; did you mean 'max_steps'\?"):
        check_recipe(_recipe(tmp_path, "max_stesp: 3\n"))
    with pytest.raises(ConfigError, match="old_logprob_mode='fp33_clone' is not allowed; allowed: bf16, "
                                          "fp32_clone, .*did you mean 'fp32_clone'"):
        check_recipe(_recipe(tmp_path, "old_logprob_mode: fp33_clone\n"))
    with pytest.raises(ConfigError, match=r"top_p=0 is outside the allowed range 0 < top_p <= 1"):
        check_recipe(_recipe(tmp_path, "top_p: 0\n"))
    with pytest.raises(ConfigError, match="cannot read it"):
        check_recipe(str(tmp_path / "missing.yaml"))
    check_recipe(str(RECIPE))  # a real recipe passes


def test_a_flag_typo_gets_a_did_you_mean_and_abbreviations_are_refused():
    with pytest.raises(ConfigError, match="unknown flag --old_logprob_mdoe; did you mean --old_logprob_mode?"):
        check_flags(["--old_logprob_mdoe", "fp32_clone"])
    # a prefix is a typo, not a flag (argparse's default would take it and train): refused, here and by the parser
    with pytest.raises(ConfigError, match="unknown flag --old_logprob_mod; did you mean --old_logprob_mode?"):
        check_flags(["--old_logprob_mod", "fp32_clone", "--max_steps", "3"])
    from grpo_ratio.cli.train import make_parser

    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['--old_logprob_mod', 'fp32_clone'\]"):
        make_parser().parse_args_and_config(["--output_dir", "x", "--use_cpu", "true", "--old_logprob_mod", "fp32_clone"])
    # a value that is a prefix of one allowed value: that one is suggested (not difflib's closest, 'bf16')
    with pytest.raises(ConfigError, match="did you mean 'fp16_clone'?"):
        check_flags(["--old_logprob_mode", "fp16"])
    with pytest.raises(ConfigError, match="--old_logprob_mode: old_logprob_mode='fp99'"):
        check_flags(["--old_logprob_mode=fp99"])
    for argv in (["--top_p", "0"], ["--top_p=0"], ["--top_p", "1.5"]):
        with pytest.raises(ConfigError, match="allowed range 0 < top_p <= 1"):
            check_flags(argv)
    check_flags(["--top_p", "0.8", "--bf16", "--use_cpu", "true"])
    # the sampling ranges RatioGRPOConfig enforces, before the heavy imports
    for argv, text in ((["--temperature", "0"], "temperature > 0"), (["--top_k=-2"], "an integer top_k >= 0"),
                       (["--top_k", "2.5"], "an integer top_k >= 0"), (["--min_p", "1.5"], "0 <= min_p <= 1")):
        with pytest.raises(ConfigError, match=f"is outside the allowed range {text}"):
            check_flags(argv)
    check_flags(["--temperature", "0.7", "--top_k", "0", "--min_p", "0.05"])


def test_compare_checks_every_recipe_and_override_but_not_its_own_flags(tmp_path):
    check_compare(["--recipes", str(RECIPE), str(RECIPE), "--seeds", "0", "1", "--name", "x", "--max_steps", "2"])
    with pytest.raises(ConfigError, match="did you mean --max_steps"):
        check_compare(["--recipes", str(RECIPE), "--max_stpes", "2"])
    with pytest.raises(ConfigError, match="unknown key 'max_stesp'"):
        check_compare(["--recipes", str(RECIPE), _recipe(tmp_path, "max_stesp: 3\n")])
    with pytest.raises(ConfigError, match="no such file"):
        check_compare(["--recipes", str(tmp_path / "nope.yaml")])
    check_train(["--help"])  # help is argparse's


def test_config_errors_come_before_the_heavy_imports(tmp_path):
    # in a fresh interpreter: the error, in one line, with status 2, and neither torch nor transformers imported
    bad = _recipe(tmp_path, "max_stesp: 3\n")
    code = ("import sys\nfrom grpo_ratio.cli import main\ntry:\n    main(['train', '--config', sys.argv[1]])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code, bad], capture_output=True, text=True, cwd=ROOT)
    assert proc.stdout.split() == ["2", "False", "False"], proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("grpo-ratio train: error: ") and "did you mean 'max_steps'?" in line


def test_errors_after_the_parse_are_one_line_too(capsys, tmp_path):
    from grpo_ratio.cli.train import cli_main

    # passes the early check (guided_fp32 is a mode), fails in RatioGRPOConfig.__post_init__: no layers
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--config", str(RECIPE), "--old_logprob_mode", "guided_fp32", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("grpo-ratio train: error: old_logprob_mode='guided_fp32' needs guided_fp32_layers")


QUICKSTART = ROOT / "recipes" / "smollm2-135m" / "quickstart_cpu.yaml"


def _parser_kind(action) -> str | None:
    """What the real parser's converter of `action` does with a value, probed: "bool", "int", "float" (with
    " | None" when it reads "none" as None, "list[...]" for nargs="+"), or None (strings, choices, dicts, ...)."""
    def converts(text, expected):
        try:
            got = action.type(text)
        except Exception:  # argparse's ArgumentTypeError, int()'s ValueError, a dict's TypeError, ...
            return False
        return got == expected and type(got) is type(expected)

    if action.type is None or action.choices is not None:
        return None
    kind = next((k for k, good, bad in (("bool", ("TRUE", True), "flase"), ("int", ("3", 3), "1.5"),
                                        ("float", ("1.5", 1.5), "x"))
                 if converts(*good) and not converts(bad, good[1])), None)
    if kind is None:
        return None
    if kind != "bool" and converts("none", None):  # TRL's parser reads "none" as None for `int | None` ...
        kind += " | None"
    return f"list[{kind}]" if action.nargs == "+" else kind


def test_the_recorded_field_types_are_the_parsers_conversions():
    # cli_fields.json's "types" (from the dataclass field types) against what the real parser does with a string
    from grpo_ratio.cli.train import TRAINER_NAMES, make_parser

    stored = json.loads(precheck.FIELDS_FILE.read_text())["types"]
    assert stored == precheck.current_types(), \
        "grpo_ratio/cli/cli_fields.json is stale: run python -m grpo_ratio.cli.precheck --write"
    probed = {a.dest: _parser_kind(a) for trainer in TRAINER_NAMES for a in make_parser(trainer)._actions
              if _parser_kind(a) is not None}  # GRPO's fields and RLOO's (`trainer: rloo`)
    assert probed == stored
    assert {stored[f] for f in ("bf16", "num_generations", "learning_rate", "max_steps", "reward_weights")} == \
        {"bool", "int | None", "float", "int", "list[float]"}


def test_a_value_of_the_wrong_type_fails_before_the_heavy_imports(capsys):
    # the issue: `--bf16 flase` passed the precheck and failed ~40 s later in a 226-line argparse usage dump
    for argv, line in (
        (["--bf16", "flase"], "--bf16: bf16='flase' is not a boolean; allowed: true or false (also yes/no, t/f, y/n, "
                              "1/0, any case)"),
        (["--bf16=flase"], "--bf16: bf16='flase' is not a boolean"),
        (["--save_final_model", "ja"], "--save_final_model: save_final_model='ja' is not a boolean"),
        (["--seed", "1.5"], "--seed: seed='1.5' is not an integer; allowed: an integer"),
        (["--num_generations", "eight"], "--num_generations: num_generations='eight' is not an integer; allowed: an "
                                         "integer num_generations >= 2 (GRPO's advantage compares"),
        (["--learning_rate", "1e-5x"], "--learning_rate: learning_rate='1e-5x' is not a number; allowed: a number, "
                                       "learning_rate >= 0"),
        (["--max_completion_length", "x"], "--max_completion_length: max_completion_length='x' is not an integer; "
                                           "allowed: an integer max_completion_length >= 1, or none"),
        (["--reward_weights", "1", "x"], "--reward_weights: reward_weights='x' is not a number (one of a list)"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            precheck.run_or_exit("train", ["--config", str(QUICKSTART), *argv])
        assert exit_info.value.code == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert err.startswith(f"grpo-ratio train: error: {line}"), err
    # what the parser accepts passes: string_to_bool's words in any case, a bare bool flag (True), "none" for an
    # `int | None` field, a list of numbers, a negative number
    check_train(["--config", str(QUICKSTART), "--bf16", "TRUE", "--use_cpu", "--save_final_model", "n",
                 "--max_completion_length", "none", "--reward_weights", "1", "0.5", "--seed", "-3",
                 "--max_steps", "-1"])


def test_a_recipe_value_of_the_wrong_type_is_refused(tmp_path):
    # YAML types the values itself: "flase" is a string, 2.5 a float, 1e-6 (no dot) a string the parser converts
    for extra, match in (("bf16: flase\n", r"r\.yaml: bf16='flase' is not a boolean; allowed: true or false"),
                         ("bf16: 1\n", "bf16=1 is not a boolean"),
                         ("max_steps: 2.5\n", r"max_steps=2.5 is outside the allowed range max_steps = -1 \(train "
                                             r"num_train_epochs\) or an integer max_steps >= 1"),
                         ("learning_rate: fast\n", "learning_rate='fast' is not a number"),
                         ("num_generations: 0\n", "num_generations=0 is outside the allowed range an integer "
                                                   "num_generations >= 2"),
                         ("num_generations: null\n", "num_generations=None is outside the allowed range"),
                         ("learning_rate: -1.0e-5\n",
                          "learning_rate=-1e-05 is outside the allowed range learning_rate >= 0")):
        with pytest.raises(ConfigError, match=match):
            check_recipe(_recipe(tmp_path, extra))
    for extra in ("bf16: 'yes'\n", "learning_rate: 1e-6\n", "max_completion_length: null\n", "max_steps: '3'\n"):
        check_recipe(_recipe(tmp_path, extra))


def test_trl_fields_that_fail_late_are_refused_before_the_heavy_imports(tmp_path):
    # the issue: num_generations=0 was TRL's ZeroDivisionError, learning_rate=-1 the optimizer's traceback,
    # max_completion_length=0 an error naming transformers' max_new_tokens; now one line, status 2, no torch imported
    code = ("import sys\nfrom grpo_ratio.cli import main\ntry:\n"
            "    main(['train', '--config', sys.argv[1], *sys.argv[2:]])\n"
            "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n")
    for argv, line in ((["--bf16", "flase"], "--bf16: bf16='flase' is not a boolean; allowed: true or false"),
                       (["--num_generations", "0"], "--num_generations: num_generations='0' is outside the allowed "
                                                    "range an integer num_generations >= 2"),
                       (["--learning_rate", "-1"], "--learning_rate: learning_rate='-1' is outside the allowed range "
                                                   "learning_rate >= 0"),
                       (["--max_completion_length", "0"], "--max_completion_length: max_completion_length='0' is "
                                                          "outside the allowed range an integer max_completion_length "
                                                          ">= 1")):
        proc = subprocess.run([sys.executable, "-c", code, str(QUICKSTART), *argv], capture_output=True, text=True,
                              cwd=ROOT)
        assert proc.stdout.split() == ["2", "False", "False"], proc.stdout + proc.stderr
        (err,) = proc.stderr.strip().splitlines()
        assert err.startswith(f"grpo-ratio train: error: {line}"), err
