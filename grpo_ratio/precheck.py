"""Check a `grpo-ratio train` / `grpo-ratio compare` command line and its recipes before the heavy imports.

Importing torch, transformers and TRL takes 10-40 s on a CPU machine; a typo in a recipe key or a flag, or a value
outside its allowed set, should not cost that, nor print a traceback. `check_train` and `check_compare` read only the
YAML files and `cli_fields.json` (every flag of `grpo-ratio train`, with its allowed values, generated from the real
parser by `python -m grpo_ratio.precheck --write` and kept equal to it by tests/test_precheck.py) and raise
`ConfigError` with one line that names the key, the file or flag, a "did you mean" (difflib) and the allowed values.
What they cannot decide (types, cross-field rules) is left to the parser and `RatioGRPOConfig.__post_init__`, whose
errors the command line also prints in one line.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path


FIELDS_FILE = Path(__file__).with_name("cli_fields.json")
# `grpo-ratio compare`'s own flags (grpo_ratio/scripts/compare.py `main`); every other flag overrides the recipes
COMPARE_FLAGS = ("--recipes", "--seeds", "--name", "--output_root", "--last_k", "--baseline", "--render")
# numeric ranges the parser does not check; RatioGRPOConfig.__post_init__ enforces the same (tests/test_precheck.py)
RANGES = {
    "top_p": (lambda x: 0.0 < x <= 1.0, "0 < top_p <= 1 (1 = no truncation)"),
    "temperature": (lambda x: x > 0.0, "temperature > 0"),
    # -1 is vLLM's "all tokens": whether vLLM is on is the config's to check (RatioGRPOConfig)
    "top_k": (lambda x: x >= -1 and x == int(x), "an integer top_k >= 0 (0 = no top-k truncation; -1 with vLLM)"),
    "min_p": (lambda x: 0.0 <= x <= 1.0, "0 <= min_p <= 1"),
}


class ConfigError(ValueError):
    """A command line or recipe mistake, described in one line."""


def load_fields(section: str = "flags") -> dict[str, list | None]:
    """{flag without dashes: allowed values (strings) or None} of `grpo-ratio train` (`section="keys"`: the recipe
    keys, i.e. the fields, which TRL's parser matches by their underscore names only)."""
    return json.loads(FIELDS_FILE.read_text())[section]


def _did_you_mean(name: str, known: Sequence[str]) -> str:
    """"; did you mean 'x'?": the one known value `name` is a prefix of (`fp16` -> `fp16_clone`), else difflib's
    closest."""
    prefixed = [k for k in known if k.startswith(name)]
    close = prefixed if len(prefixed) == 1 else difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _resolve_flag(name: str, known: dict) -> str | None:
    """The flag `name` is: itself, or None. Abbreviations are refused, here and by the parser (`allow_abbrev=False`):
    argparse's default would read the typo `--old_logprob_mod` as `--old_logprob_mode` and train."""
    return name if name in known else None


def _check_value(name: str, value, where: str, known: dict) -> None:
    choices = known.get(name)
    if value is None:
        return
    if choices is not None and str(value) not in choices:
        raise ConfigError(f"{where}: {name}={value!r} is not allowed; allowed: {', '.join(choices)}"
                          + _did_you_mean(str(value), choices))
    if name in RANGES:
        inside, text = RANGES[name]
        try:
            number = float(value)
        except (TypeError, ValueError):
            return  # not a number: the parser says so
        if not inside(number):
            raise ConfigError(f"{where}: {name}={value!r} is outside the allowed range {text}")


def check_recipe(path: str, known: dict | None = None) -> None:
    """Every key of the YAML recipe `path` is a flag of `grpo-ratio train`, with an allowed value.

    Raises:
        ConfigError: a missing or unreadable file, a file that is not a mapping, an unknown key, a bad value.
    """
    import yaml

    known = known if known is not None else load_fields("keys")
    try:
        config = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--config {path}: must be a YAML mapping of field: value")
    for key, value in config.items():
        if key == "env":  # TRL's environment variables section
            continue
        if key not in known:
            raise ConfigError(f"{path}: unknown key {key!r}{_did_you_mean(str(key), list(known))} (every key is a "
                              f"field of RatioGRPOConfig, trl.ModelConfig or the task arguments: grpo-ratio train "
                              f"--help)")
        _check_value(key, value, path, known)


def check_flags(argv: Sequence[str], known: dict | None = None, skip: Sequence[str] = ()) -> None:
    """Every `--flag` of `argv` (except `skip`) is a flag of `grpo-ratio train`, spelled out (no abbreviation), and
    a value that follows it is allowed.

    Raises:
        ConfigError: an unknown flag (with a "did you mean"), a bad value.
    """
    known = known if known is not None else load_fields()
    args = list(argv)
    for i, token in enumerate(args):
        if not token.startswith("--") or token in skip or token == "--":
            continue
        name, eq, value = token[2:].partition("=")
        flag = _resolve_flag(name, known)
        if flag is None:
            raise ConfigError(f"unknown flag --{name}" + _did_you_mean(name, list(known)).replace("'", "--", 1)
                              .replace("'", "", 1) + " (grpo-ratio train --help lists every flag)")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
        _check_value(flag, value if (eq or value) else None, f"--{flag}", known)


def _values_after(args: list[str], flag: str) -> list[str]:
    if flag not in args:
        return []
    i = args.index(flag) + 1
    out = []
    while i < len(args) and not args[i].startswith("--"):
        out.append(args[i])
        i += 1
    return out


def check_train(argv: Sequence[str]) -> None:
    """`grpo-ratio train` arguments: the recipe of `--config` and every flag. Raises ConfigError."""
    args = list(argv)
    if "-h" in args or "--help" in args:
        return
    for path in _values_after(args, "--config")[:1]:
        check_recipe(path)
    check_flags([a for a in args if a != "--config"])


def check_compare(argv: Sequence[str]) -> None:
    """`grpo-ratio compare` arguments: every recipe of `--recipes` and every override flag. Raises ConfigError."""
    args = list(argv)
    if "-h" in args or "--help" in args or "--render" in args:
        return
    for path in _values_after(args, "--recipes"):
        if not Path(path).is_file():
            raise ConfigError(f"--recipes: no such file: {path}")
        check_recipe(path)
    own = {f.lstrip("-"): None for f in COMPARE_FLAGS}
    rest, skip_values = [], False
    for token in args:  # drop compare's own flags and their values
        if token.startswith("--"):
            skip_values = token.split("=")[0] in COMPARE_FLAGS
            if skip_values:
                continue
        elif skip_values:
            continue
        rest.append(token)
    check_flags(rest, {**load_fields(), **own})


def run_or_exit(command: str, argv: Sequence[str]) -> None:
    """`check_train` / `check_compare`; on a ConfigError print `grpo-ratio <command>: error: ...` and exit 2."""
    try:
        (check_train if command == "train" else check_compare)(argv)
    except ConfigError as err:
        print(f"grpo-ratio {command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def current_fields() -> dict[str, dict[str, list | None]]:
    """{"flags": {flag: allowed values}, "keys": {field: allowed values}} from the real parser (the heavy import):
    what `cli_fields.json` must hold."""
    from .config import KEPT_SET_SOURCES, SCORING_MODES, TRUNCATION_CORRECTIONS, VLLM_DTYPES
    from .scripts.train import make_parser

    validated = {"old_logprob_mode": SCORING_MODES, "truncation_correction": TRUNCATION_CORRECTIONS,
                 "kept_set_source": KEPT_SET_SOURCES, "vllm_dtype": VLLM_DTYPES}
    flags, keys = {}, {}
    for action in make_parser()._actions:
        choices = validated.get(action.dest, action.choices)
        choices = None if choices is None else [str(c) for c in choices]
        if action.dest != "help":
            keys[action.dest] = choices
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                flags[option[2:]] = choices
    flags["config"] = None
    return {"flags": dict(sorted(flags.items())), "keys": dict(sorted(keys.items()))}


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        FIELDS_FILE.write_text(json.dumps({"generated_by": "python -m grpo_ratio.precheck --write",
                                           **current_fields()}, indent=0) + "\n")
        print(f"wrote {FIELDS_FILE}")
