"""Check a `grpo-ratio train` / `grpo-ratio compare` command line and its recipes before the heavy imports.

Importing torch, transformers and TRL takes 10-40 s on a CPU machine; a typo in a recipe key or a flag, or a value
outside its allowed set, should not cost that, nor print a traceback. `check_train` and `check_compare` read only the
YAML files and `cli_fields.json` (every flag of `grpo-ratio train`, with its allowed values, and the type of every
bool, int and float field, generated from the real parser by `python -m grpo_ratio.cli.precheck --write` and kept
equal to it by tests/test_precheck.py) and raise one `ConfigError` listing every mistake, one line each naming the
key, the file or flag, a "did you mean" (difflib) and the allowed values: an unknown key or flag, a key or flag of the
other trainer (`trainer: rloo` with a GRPO-only key) or of the asynchronous one (`async_objective`), a value outside
its choices, a value that does not parse as its field's type (`--bf16 flase`; a recipe's `bf16: flase`), a number
outside `RANGES` (`--num_generations 0`), and the settings that need no model (`setting_problems`: a custom
`is_correction`'s fields, the `ratio_gate` checks). What they cannot decide (the other cross-field rules) is left to
the parser and `RatioGRPOConfig.__post_init__`, whose errors (every problem at once too) the command line also prints.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ..problems import Problems, messages


FIELDS_FILE = Path(__file__).with_name("cli_fields.json")
# `grpo-ratio compare`'s own flags (grpo_ratio/cli/compare.py `main`); every other flag overrides the recipes
COMPARE_FLAGS = ("--recipes", "--seeds", "--name", "--output_root", "--last_k", "--baseline", "--render")
# numeric ranges the parser does not check; RatioGRPOConfig.__post_init__ enforces the same (grpo_ratio/checks.py
# `_check_sampling_fields`, `check_trl_fields`; tests/test_config.py keeps them in agreement). Each rule also says
# whether None (a recipe's `null`, or "none" for an `int | None` / `float | None` field) is allowed.
RANGES = {
    "top_p": (lambda x: x is None or 0.0 < x <= 1.0, "0 < top_p <= 1 (1 = no truncation)"),
    "temperature": (lambda x: x is None or x > 0.0, "temperature > 0"),
    # -1 is vLLM's "all tokens": whether vLLM is on is the config's to check (RatioGRPOConfig)
    "top_k": (lambda x: x is None or (x >= -1 and x == int(x)),
              "an integer top_k >= 0 (0 = no top-k truncation; -1 with vLLM)"),
    "min_p": (lambda x: x is None or 0.0 <= x <= 1.0, "0 <= min_p <= 1"),
    # TRL's GRPOConfig divides by num_generations before it checks it (0: ZeroDivisionError) and needs >= 2
    "num_generations": (lambda x: x is not None and x >= 2 and x == int(x),
                        "an integer num_generations >= 2 (GRPO's advantage compares the completions of one prompt)"),
    # torch's AdamW raises for lr < 0 at the first step; 0 trains nothing but runs (the ratio diagnostics still log)
    "learning_rate": (lambda x: x is not None and x >= 0.0, "learning_rate >= 0"),
    # 0 reaches transformers' generate as max_new_tokens=0 and fails there
    "max_completion_length": (lambda x: x is None or (x >= 1 and x == int(x)),
                              "an integer max_completion_length >= 1, or none"),
    "per_device_train_batch_size": (lambda x: x is not None and x >= 1 and x == int(x),
                                    "an integer per_device_train_batch_size >= 1"),
    "gradient_accumulation_steps": (lambda x: x is not None and x >= 1 and x == int(x),
                                    "an integer gradient_accumulation_steps >= 1"),
    "num_iterations": (lambda x: x is not None and x >= 1 and x == int(x), "an integer num_iterations >= 1"),
    "steps_per_generation": (lambda x: x is None or (x >= 1 and x == int(x)),
                             "an integer steps_per_generation >= 1, or none (= gradient_accumulation_steps)"),
    "generation_batch_size": (lambda x: x is None or (x >= 1 and x == int(x)),
                              "an integer generation_batch_size >= 1, or none (the effective training batch)"),
    # transformers reads every max_steps <= 0 as "train num_train_epochs": 0 would train whole epochs
    "max_steps": (lambda x: x is not None and (x == -1 or x >= 1) and x == int(x),
                  "max_steps = -1 (train num_train_epochs) or an integer max_steps >= 1"),
}
# what a value of each field type must look like: the parser's own conversions (HfArgumentParser: `string_to_bool`,
# int, float), so that `--bf16 flase` fails here in one line rather than in argparse's usage dump after the imports
BOOL_WORDS = {"yes": True, "true": True, "t": True, "y": True, "1": True,
              "no": False, "false": False, "f": False, "n": False, "0": False}
TYPE_NAMES = {"bool": "a boolean", "int": "an integer", "float": "a number"}
TYPE_ALLOWED = {"bool": "true or false (also yes/no, t/f, y/n, 1/0, any case)", "int": "an integer",
                "float": "a number"}


class ConfigError(Problems):
    """Every mistake of a command line and its recipes, one line each (`problems`; one mistake: its line alone)."""


# the config class each `trainer` of `grpo-ratio train` builds (grpo_ratio/cli/train.py `TRAINERS`)
CONFIGS = {"grpo": "RatioGRPOConfig", "rloo": "RatioRLOOConfig"}
# fields whose combinations the precheck judges without a model (`setting_problems`); their defaults are recorded in
# cli_fields.json ("defaults")
PRECHECKED = ("is_correction", "is_correction_level", "is_correction_action", "is_correction_low",
              "is_correction_high", "is_correction_rejection", "is_correction_veto", "ratio_gate",
              "ratio_gate_patience", "ratio_gate_action")


def load_fields(section: str = "flags") -> dict:
    """{flag without dashes: allowed values (strings) or None} of `grpo-ratio train` (`section="keys"`: the recipe
    keys, i.e. the fields, which TRL's parser matches by their underscore names only; `section="types"`: {field:
    "bool", "int", "float", "int | None", "float | None", "list[int]" or "list[float]"} for the fields of those types,
    whose flags are the field's name with `_` or `-`; `section="only"`: {"grpo": keys of the GRPO trainer alone,
    "rloo": of the RLOO trainer alone, "async_grpo": fields of `RatioAsyncGRPOConfig` that neither has};
    `section="defaults"`: the defaults of the `PRECHECKED` fields)."""
    return json.loads(FIELDS_FILE.read_text())[section]


def _wrong_trainer(name: str, trainer: str | None, only: dict) -> str | None:
    """For a key or flag (`name`, its field's name) that another trainer's config has: which one, and what to do;
    None otherwise (or when the trainer is unknown)."""
    if name in only.get("async_grpo", ()):
        return ("is a field of RatioAsyncGRPOConfig (RatioAsyncGRPOTrainer, the asynchronous trainer: Python only, "
                "docs/async.md), which grpo-ratio train does not run; remove it")
    other = next((t for t in CONFIGS if t != trainer and name in only.get(t, ())), None)
    if trainer not in CONFIGS or other is None:
        return None
    return (f"is a field of {CONFIGS[other]} (trainer: {other}), not of {CONFIGS[trainer]} (this run's trainer: "
            f"{trainer}); remove it, or train with trainer: {other}")


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


def _parses_as(kind: str, value) -> bool:
    """Whether `value` (a command-line string, or a recipe's YAML-typed value) reaches the field as a `kind` ("bool",
    "int", "float", optionally "... | None"): a string as TRL's parser converts it (`string_to_bool`, `int`, `float`;
    "none"/"null" for None), anything else as it is (the parser passes a recipe's non-string values through)."""
    kind, optional = kind.removesuffix(" | None"), kind.endswith(" | None")
    if isinstance(value, str):
        if kind == "bool":
            return value.lower() in BOOL_WORDS
        if optional and value.lower() in ("none", "null"):
            return True
        try:
            (int if kind == "int" else float)(value)
        except ValueError:
            return False
        return True
    if kind == "bool":
        return isinstance(value, bool)
    return isinstance(value, int if kind == "int" else (int, float)) and not isinstance(value, bool)


def _is_none(value, kind: str | None) -> bool:
    """Whether `value` reaches the field as None: a recipe's `null`, or "none"/"null" for an `X | None` field."""
    return value is None or (isinstance(value, str) and value.lower() in ("none", "null")
                             and (kind or "").endswith(" | None"))


def _check_type(field: str, value, where: str, kind: str | None) -> None:
    """`value` (not None) is a `kind` (`types` of `cli_fields.json`; None: a field of another type, not checked); a
    list field's values each.

    Raises:
        ConfigError: naming the flag or file, the field, the value and the type it expects (with its range).
    """
    if kind is None:
        return
    element = kind[len("list["):-1] if kind.startswith("list[") else kind
    base = element.removesuffix(" | None")
    inside, text = RANGES.get(field, (lambda x: True, ""))
    for item in value if element != kind and isinstance(value, list) else [value]:  # a list for a scalar: refused
        if not _parses_as(element, item):
            what = TYPE_NAMES[base] + (" (one of a list)" if element != kind else "")
            allowed = text if text.startswith(TYPE_ALLOWED[base]) else \
                ", ".join(filter(None, [TYPE_ALLOWED[base], text]))
            if element != base and inside(None) and "none" not in allowed:
                allowed += ", or none"
            raise ConfigError(f"{where}: {field}={item!r} is not {what}; allowed: {allowed}")


def _check_value(name: str, value, where: str, known: dict, types: dict | None = None) -> None:
    """`value` of flag or key `name` (None: a recipe's `null`) is in its choices, of its field's type (`types`, as
    `load_fields("types")`) and inside `RANGES`. Raises ConfigError naming which."""
    choices = known.get(name)
    if choices is not None and value is not None and str(value) not in choices:
        raise ConfigError(f"{where}: {name}={value!r} is not allowed; allowed: {', '.join(choices)}"
                          + _did_you_mean(str(value), choices))
    field = name.replace("-", "_")  # `--max-steps` is the field max_steps
    kind = (types or {}).get(field)
    if field in RANGES and not isinstance(value, bool):  # a number out of range (2.5 for an integer field included)
        inside, text = RANGES[field]
        try:
            number = None if _is_none(value, kind) else float(value)
        except (TypeError, ValueError):
            pass  # not a number: the type check below (or, for a field without a recorded type, the parser) says so
        else:
            if not inside(number):
                raise ConfigError(f"{where}: {field}={value!r} is outside the allowed range {text}")
    if value is not None:  # a recipe's null passes the parser unconverted, whatever the type
        _check_type(field, value, where, kind)


def _load_recipe(path: str) -> dict:
    """The YAML mapping of recipe `path`. Raises ConfigError: a missing or unreadable file, not YAML, not a mapping."""
    import yaml

    try:
        config = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror or err})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"--config {path}: must be a YAML mapping of field: value")
    return config


def recipe_problems(path: str, known: dict | None = None, types: dict | None = None, trainer: str | None = None,
                    values: dict | None = None) -> list[str]:
    """Every mistake of the YAML recipe `path`, one line each (`check_recipe`); `values` (when given) receives its
    keys' values. `trainer`: the run's (`grpo`, `rloo`; None: the recipe's own `trainer:` key)."""
    known = known if known is not None else load_fields("keys")
    types = types if types is not None else load_fields("types")
    only = load_fields("only")
    try:
        config = _load_recipe(path)
    except ConfigError as err:
        return messages(err)
    trainer = trainer or str(config.get("trainer", "grpo"))
    problems = []
    for key, value in config.items():
        if key == "env":  # TRL's environment variables section
            continue
        wrong = _wrong_trainer(str(key), trainer, only)
        if wrong:
            problems.append(f"{path}: {key!r} {wrong}")
            continue
        if key not in known:
            mine = [k for k in known if k not in only.get(next((t for t in CONFIGS if t != trainer), ""), ())]
            problems.append(f"{path}: unknown key {key!r}{_did_you_mean(str(key), mine)} (every key is a field of "
                            f"{CONFIGS.get(trainer, 'RatioGRPOConfig')}, trl.ModelConfig or the task arguments: "
                            f"grpo-ratio train --help)")
            continue
        try:
            _check_value(key, value, path, known, types)
        except ConfigError as err:
            problems.append(str(err))
            continue
        if values is not None:
            values[key] = value
    return problems


def check_recipe(path: str, known: dict | None = None, types: dict | None = None, trainer: str | None = None) -> None:
    """Every key of the YAML recipe `path` is a flag of `grpo-ratio train` for its trainer (`trainer`, else the
    recipe's `trainer:` key, else grpo), with an allowed value of its field's type (YAML's own types: `bf16: flase`
    is a string, not a boolean) inside `RANGES`.

    Raises:
        ConfigError: every mistake at once: a missing or unreadable file, a file that is not a mapping, an unknown
            key, a key of the other trainer or of the asynchronous one, a value outside the field's choices, of
            another type or outside its range.
    """
    problems = recipe_problems(path, known, types, trainer)
    if problems:
        raise ConfigError(problems)


def flag_problems(argv: Sequence[str], known: dict | None = None, skip: Sequence[str] = (),
                  types: dict | None = None, trainer: str | None = None, values: dict | None = None) -> list[str]:
    """Every mistake of the flags of `argv`, one line each (`check_flags`); `values` (when given) receives the
    flags' values, converted as the parser converts them."""
    known = known if known is not None else load_fields()
    types = types if types is not None else load_fields("types")
    only = load_fields("only")
    args, problems = list(argv), []
    for i, token in enumerate(args):
        if not token.startswith("--") or token in skip or token == "--":
            continue
        name, eq, value = token[2:].partition("=")
        wrong = _wrong_trainer(name.replace("-", "_"), trainer, only)
        if wrong:
            problems.append(f"--{name} {wrong}")
            continue
        flag = _resolve_flag(name, known)
        if flag is None:
            problems.append(f"unknown flag --{name}" + _did_you_mean(name, list(known)).replace("'", "--", 1)
                            .replace("'", "", 1) + " (grpo-ratio train --help lists every flag)")
            continue
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value = args[i + 1]
            if types.get(flag.replace("-", "_"), "").startswith("list["):  # nargs="+": every value up to the next flag
                value = _values_after(args[i:], token)
        if eq or value:  # a bare flag: True for a bool field, the parser's error otherwise
            try:
                _check_value(flag, value, f"--{flag}", known, types)
            except ConfigError as err:
                problems.append(str(err))
                continue
        if values is not None:
            field = flag.replace("-", "_")
            values[field] = _converted(value if (eq or value) else None, types.get(field))
    return problems


def _converted(value, kind: str | None):
    """A flag's text as the parser hands it to the field (`kind` from `types`; a bare flag, None: True)."""
    if value is None:
        return True
    if isinstance(value, list):
        return [_converted(v, kind[len("list["):-1]) for v in value] if kind else value
    base = (kind or "").removesuffix(" | None")
    if kind and kind != base and value.lower() in ("none", "null"):
        return None
    if base == "bool":
        return BOOL_WORDS[value.lower()]
    return int(value) if base == "int" else float(value) if base == "float" else value


def check_flags(argv: Sequence[str], known: dict | None = None, skip: Sequence[str] = (),
                types: dict | None = None, trainer: str | None = None) -> None:
    """Every `--flag` of `argv` (except `skip`) is a flag of `grpo-ratio train` (of its `trainer`, when given),
    spelled out (no abbreviation), and a value that follows it is allowed: in the flag's choices, parsing as its
    field's type (a bool field's bare flag is True; a list field's values each) and inside `RANGES`.

    Raises:
        ConfigError: every mistake at once: an unknown flag (with a "did you mean"), a flag of the other trainer or
            of the asynchronous one, a value outside the choices, of another type or outside its range.
    """
    problems = flag_problems(argv, known, skip, types, trainer)
    if problems:
        raise ConfigError(problems)


def setting_problems(values: dict) -> list[str]:
    """The combinations of a run's settings (`values`: the recipe's keys, then the flags) that need no model: a
    custom IS correction's fields (`is_correction.resolve_correction`, which needs no torch) and the `ratio_gate` checks (`gate.training_checks`: keys no trainer logs, scopes, patience, action),
    judged as `RatioGRPOConfig` judges them, every problem at once."""
    settings = {**load_fields("defaults"), **{k: v for k, v in values.items() if k in PRECHECKED}}
    problems = []
    correction = [settings[f] for f in PRECHECKED[:7]]
    if any(v is not None for v in correction):
        from ..corrections.is_correction import resolve_correction

        try:
            resolve_correction(*correction)
        except ValueError as err:
            problems += messages(err)
    gate = settings["ratio_gate"]
    if gate is not None or values.keys() & {"ratio_gate_patience", "ratio_gate_action"}:
        from ..diagnostics.gate import training_checks

        try:
            training_checks([gate] if isinstance(gate, str) else gate or [], settings["ratio_gate_patience"],
                            settings["ratio_gate_action"])
        except ValueError as err:
            problems += messages(err)
    return problems


def _trainer_in(args: list[str]) -> str | None:
    """The `--trainer` flag's value, or None."""
    for i, token in enumerate(args):
        if token.startswith("--trainer="):
            return token.split("=", 1)[1]
        if token == "--trainer" and i + 1 < len(args):
            return args[i + 1]
    return None


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
    """`grpo-ratio train` arguments: the recipe of `--config`, every flag (both against the run's trainer: `--trainer`,
    else the recipe's `trainer:`, else grpo) and the settings they make together (`setting_problems`).

    Raises:
        ConfigError: every mistake at once.
    """
    args = list(argv)
    if "-h" in args or "--help" in args:
        return
    paths = _values_after(args, "--config")[:1]
    trainer = _trainer_in(args)
    if trainer is None and paths:
        try:
            trainer = str(_load_recipe(paths[0]).get("trainer", "grpo"))
        except ConfigError:
            pass  # said by recipe_problems
    values, problems = {}, []
    for path in paths:
        problems += recipe_problems(path, trainer=trainer or "grpo", values=values)
    problems += flag_problems([a for a in args if a != "--config"], trainer=trainer or "grpo", values=values)
    problems += setting_problems(values)
    if problems:
        raise ConfigError(problems)


def check_compare(argv: Sequence[str]) -> None:
    """`grpo-ratio compare` arguments: every recipe of `--recipes` (against its own trainer), every override flag,
    and the settings each recipe makes with the overrides (`setting_problems`).

    Raises:
        ConfigError: every mistake at once.
    """
    args = list(argv)
    if "-h" in args or "--help" in args or "--render" in args:
        return
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
    overrides, problems = {}, []
    problems += flag_problems(rest, {**load_fields(), **own}, trainer=_trainer_in(rest), values=overrides)
    for path in _values_after(args, "--recipes"):
        if not Path(path).is_file():
            problems.append(f"--recipes: no such file: {path}")
            continue
        values = {}
        problems += [p for p in recipe_problems(path, trainer=_trainer_in(rest), values=values)]
        problems += [f"{path} with the flags: {p}" for p in setting_problems({**values, **overrides})]
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))


def run_or_exit(command: str, argv: Sequence[str]) -> None:
    """`check_train` / `check_compare`; on a ConfigError print `grpo-ratio <command>: error: ...` and exit 2."""
    try:
        (check_train if command == "train" else check_compare)(argv)
    except ConfigError as err:
        print(f"grpo-ratio {command}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def _kind(hint) -> str | None:
    """The `types` entry of a dataclass field type, as TRL's parser (`trl.scripts._hf_argparser`) converts it: bool
    and `bool | None` with `string_to_bool`; int, float and `list[...]` of them with `int`/`float`; `X | str` as X;
    `int | None` and `float | None` also take "none"/"null" (any case) for None. Other types (str, `X | str | None`,
    dict, ...): None."""
    import types
    import typing

    args = typing.get_args(hint)
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    if union and len(args) == 2 and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        if inner is bool:
            return "bool"
        kind = _kind(inner)
        return f"{kind} | None" if kind in ("int", "float") else kind
    if union and len(args) == 2 and str in args and type(None) not in args:
        return _kind([a for a in args if a is not str][0])  # `X | str`: the parser converts as X
    if union:
        return None  # `X | str | None`: the parser reads a string
    if typing.get_origin(hint) is list and args and args[0] in (int, float):
        return f"list[{args[0].__name__}]"
    return {bool: "bool", int: "int", float: "float"}.get(hint)


def current_types() -> dict[str, str]:
    """{field: "bool", "int", "float", "int | None", "float | None", "list[int]" or "list[float]"} for every field of
    the real parser's dataclasses (the heavy import) with such a type: the `types` section `cli_fields.json` must
    hold. Its flags are the field's name with `_` or `-` (`check_flags` relies on it).

    Raises:
        AssertionError: a typed field whose flags are not its name (with `-` for `_`).
    """
    import dataclasses
    import typing

    from .train import TRAINER_NAMES, make_parser

    parsers = [make_parser(trainer) for trainer in TRAINER_NAMES]  # a recipe key of either trainer (`trainer: rloo`)
    flags = {}
    for action in (a for parser in parsers for a in parser._actions):
        flags.setdefault(action.dest, set()).update(o.lstrip("-") for o in action.option_strings)
    found = {}
    for dtype in dict.fromkeys(d for parser in parsers for d in parser.dataclass_types):
        hints = typing.get_type_hints(dtype)
        for field in dataclasses.fields(dtype):
            kind = _kind(hints[field.name]) if field.init else None
            if kind is None:
                continue
            own = {field.name, field.name.replace("_", "-")}
            assert flags[field.name] <= own | {f"no_{field.name}", f"no-{field.name.replace('_', '-')}"}, field.name
            found[field.name] = kind
    return dict(sorted(found.items()))


def current_fields() -> dict[str, dict[str, list | None]]:
    """{"flags": {flag: allowed values}, "keys": {field: allowed values}} from the real parser (the heavy import):
    what `cli_fields.json` must hold (with `current_types`)."""
    from ..config import KEPT_SET_SOURCES, OLD_LOGPROB_MODES, TRUNCATION_CORRECTIONS, VLLM_DTYPES
    from .train import TRAINER_NAMES, make_parser

    validated = {"old_logprob_mode": OLD_LOGPROB_MODES, "truncation_correction": TRUNCATION_CORRECTIONS,
                 "kept_set_source": KEPT_SET_SOURCES, "vllm_dtype": VLLM_DTYPES}
    flags, keys = {}, {}
    for action in (a for trainer in TRAINER_NAMES for a in make_parser(trainer)._actions):  # GRPO's and RLOO's fields
        choices = validated.get(action.dest, action.choices)
        choices = None if choices is None else [str(c) for c in choices]
        if action.dest != "help":
            keys[action.dest] = choices
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                flags[option[2:]] = choices
    flags["config"] = None
    return {"flags": dict(sorted(flags.items())), "keys": dict(sorted(keys.items())), **trainer_fields()}


def trainer_fields() -> dict:
    """{"only": {trainer: the keys of its parser alone; "async_grpo": the fields of `RatioAsyncGRPOConfig` neither
    parser has}, "defaults": {field: default} of the `PRECHECKED` fields}, from the real classes (the heavy import;
    TRL's experimental async trainer too)."""
    import dataclasses
    import os

    from ..config import RatioGRPOConfig
    from .train import TRAINER_NAMES, make_parser

    keys = {t: {a.dest for a in make_parser(t)._actions if a.dest != "help"} for t in TRAINER_NAMES}
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from ..async_grpo import RatioAsyncGRPOConfig

    asynchronous = {f.name for f in dataclasses.fields(RatioAsyncGRPOConfig) if f.init}
    only = {t: sorted(keys[t] - set.union(*(keys[o] for o in TRAINER_NAMES if o != t))) for t in TRAINER_NAMES}
    only["async_grpo"] = sorted(asynchronous - set.union(*keys.values()))
    defaults = {f.name: f.default for f in dataclasses.fields(RatioGRPOConfig) if f.name in PRECHECKED}
    return {"only": only, "defaults": defaults}


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        FIELDS_FILE.write_text(json.dumps({"generated_by": "python -m grpo_ratio.cli.precheck --write",
                                           **current_fields(), "types": current_types()}, indent=0) + "\n")
        print(f"wrote {FIELDS_FILE}")
