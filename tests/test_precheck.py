"""Recipe and flag mistakes fail in one line, before the heavy imports (grpo_ratio/precheck.py), with a did-you-mean.

Run: pytest tests/test_precheck.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_ratio import precheck
from grpo_ratio.precheck import ConfigError, check_compare, check_flags, check_recipe, check_train


ROOT = Path(__file__).parents[1]
RECIPE = ROOT / "recipes" / "smollm2-135m" / "arithmetic" / "fp32_clone.yaml"


def test_the_committed_field_list_is_the_real_parser():
    stored = json.loads(precheck.FIELDS_FILE.read_text())
    assert {"flags": stored["flags"], "keys": stored["keys"]} == precheck.current_fields(), \
        "grpo_ratio/cli_fields.json is stale: run python -m grpo_ratio.precheck --write"


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
    from grpo_ratio.scripts.train import make_parser

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
    from grpo_ratio.scripts.train import cli_main

    # passes the early check (guided_fp32 is a mode), fails in RatioGRPOConfig.__post_init__: no layers
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["--config", str(RECIPE), "--old_logprob_mode", "guided_fp32", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("grpo-ratio train: error: old_logprob_mode='guided_fp32' needs guided_fp32_layers")
