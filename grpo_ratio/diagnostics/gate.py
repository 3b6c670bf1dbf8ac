"""Tolerance gate: logged metrics checked against bounds, for CI and during training.

    grpo-ratio report RUN --check "ratio/new_old/oob_rate<=0.01" --check "mean:ratio/old_sampler/kl_k3<1e-3"
    grpo-ratio report RUN --thresholds gate.yaml          # the same checks from a file
    grpo-ratio report RUN --check "first:ratio/new_old/mean_abs_log_ratio<1e-8"   # slime's CI gate: ppo_kl ~ 0

A check is `[SCOPE:]KEY OP VALUE` (quote it in a shell: `<` and `>` are redirections there):
- OP is one of `<=`, `>=`, `<`, `>`, `==`, `!=`; VALUE a number (`1e-8`, `inf`).
- SCOPE says which logged values must satisfy it: `each` (the default: every logged step that has KEY), `mean` (the
  mean over those steps), `first` / `last` (that one step), `max` / `min` (the extreme over steps; `max:K<=v` is
  `K<=v` at each step, stated as one number).
- A check of a KEY the run never logged fails: a typo, or a metric that is switched off, must not pass a gate.
- A non-finite value (NaN, +-inf) logged for KEY at any step fails the check, whatever its scope: `max` and `min`
  would otherwise pick a finite extreme past a NaN, `first` and `last` read one step of a run that broke at another.
  A diverged run must not pass a gate.
- An upper bound alone on a signed key (`kl_k1`, `log_ppl_diff`: means of a log-ratio, either sign) passes every
  negative value however large; the report says so under its checks. Bound a gap's size with `mean_abs_log_ratio`
  (or `kl_k3`, which is >= 0 but quadratic in the log-ratio: k3 < 1e-8 allows |log r| up to about 1.4e-4).
Steps are the rows of the run's log history (`trainer.state.log_history`, one per `logging_steps`), without TRL's
final summary row; an `eval_` key is checked on the evaluation rows that hold it.

A thresholds file (YAML or JSON) holds a list of checks, `{"checks": [...]}`, or a mapping from `[SCOPE:]KEY` to
`OP VALUE` (`ratio/new_old/oob_rate: "<=0.01"`).

During training, `grpo_ratio.diagnostics.gate_callback.RatioGateCallback` applies `each` and `first` checks to every log row and
warns, or stops training, when a check fails on N consecutive logged steps. Exit codes of `--check`: 0 every check
passes, 1 a check fails, 2 bad input. This module imports nothing heavy (no torch, no transformers), so the report
stays quick to start in CI.
"""

from __future__ import annotations

import json
import math
import operator
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from ..problems import Problems


OPS = {"<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt, "==": operator.eq, "!=": operator.ne}
SCOPES = ("each", "mean", "first", "last", "max", "min")
TRAINING_SCOPES = ("each", "first")  # what a callback can judge from the rows seen so far
GATE_ACTIONS = ("warn", "stop")
SIGNED = ("kl_k1", "log_ppl_diff")  # key suffixes whose values take either sign (docs/metrics.md)
_CHECK = re.compile(r"^\s*(?:(?P<scope>[a-z]+):)?(?P<key>[^\s<>=!]+)\s*(?P<op><=|>=|==|!=|<|>)\s*(?P<value>\S+)\s*$")


@dataclass(frozen=True)
class Check:
    """One parsed check: `scope`, metric `key`, comparison `op` (a key of `OPS`) and `value`."""

    key: str
    op: str
    value: float
    scope: str = "each"

    def holds(self, x: float) -> bool:
        """Whether a logged value satisfies the bound (a non-finite value, NaN or +-inf, never does)."""
        return math.isfinite(x) and OPS[self.op](x, self.value)

    def __str__(self) -> str:
        return f"{'' if self.scope == 'each' else self.scope + ':'}{self.key}{self.op}{self.value:g}"

    @property
    def bounds_a_signed_key_from_above(self) -> bool:
        """`<`/`<=` on a key whose values take either sign (`SIGNED`): every negative value passes it."""
        return self.op in ("<", "<=") and self.key.rsplit("/", 1)[-1] in SIGNED


def parse_check(text: str) -> Check:
    """A `Check` from `"[SCOPE:]KEY OP VALUE"` (module docstring).

    Raises:
        ValueError: not of that form, an unknown scope or operator (the allowed ones named), or VALUE not a number.
    """
    match = _CHECK.match(text)
    if match is None:
        raise ValueError(f"check {text!r}: expected [SCOPE:]KEY OP VALUE with OP one of {' '.join(OPS)}, e.g. "
                         f"'ratio/new_old/oob_rate<=0.01' or 'mean:ratio/old_sampler/kl_k3<1e-3'")
    scope = match["scope"] or "each"
    if scope not in SCOPES:
        raise ValueError(f"check {text!r}: scope {scope!r} is not allowed; allowed: {', '.join(SCOPES)}")
    try:
        value = float(match["value"])
    except ValueError:
        raise ValueError(f"check {text!r}: {match['value']!r} is not a number") from None
    if math.isnan(value):
        raise ValueError(f"check {text!r}: the bound is NaN")
    return Check(match["key"], match["op"], value, scope)


def read_thresholds(path: str | Path) -> list[Check]:
    """The checks of a thresholds file (YAML or JSON; module docstring).

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: not YAML/JSON, not one of the three forms, or a check that does not parse.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"thresholds file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as err:  # json.JSONDecodeError, yaml.YAMLError
        raise ValueError(f"thresholds file {str(path)!r} is not valid {path.suffix.lstrip('.') or 'YAML'}: {err}") from None
    if isinstance(data, dict) and set(data) == {"checks"}:
        data = data["checks"]
    if isinstance(data, dict) and all(isinstance(v, str) for v in data.values()):
        data = [f"{key}{bound}" for key, bound in data.items()]
    if not isinstance(data, list) or not all(isinstance(x, str) for x in data):
        raise ValueError(f"thresholds file {str(path)!r}: expected a list of checks, {{'checks': [...]}} or a mapping "
                         f"'[SCOPE:]KEY': 'OP VALUE'")
    return [parse_check(x) for x in data]


def collect_checks(texts: list[str] | None = None, thresholds: str | Path | None = None) -> list[Check]:
    """The checks of `--check` texts and of a `--thresholds` file, in that order (errors as the two parsers)."""
    checks = [parse_check(t) for t in texts or []]
    return checks + (read_thresholds(thresholds) if thresholds else [])


@dataclass
class CheckResult:
    """The outcome of one check on one run: `passed`, the judged `value` (None when the key was never logged), the
    `step` it belongs to (None for `mean`), for `each` the failing (step, value) pairs, and in any scope the
    `non_finite` (step, value) pairs (NaN, +-inf), which fail the check."""

    check: Check
    passed: bool
    value: float | None = None
    step: int | None = None
    failing: list[tuple[int | None, float]] = field(default_factory=list)
    num_steps: int = 0
    non_finite: list[tuple[int | None, float]] = field(default_factory=list)

    def describe(self) -> str:
        """One line: the check, PASS/FAIL and the value(s) that decided it."""
        verdict = "PASS" if self.passed else "FAIL"
        if self.value is None:
            return f"{verdict} {self.check}: never logged{_near_keys(self.check.key)}"
        if self.non_finite:
            shown = ", ".join(f"{v} at step {s}" for s, v in self.non_finite[:5])
            more = f" (+{len(self.non_finite) - 5} more)" if len(self.non_finite) > 5 else ""
            return (f"{verdict} {self.check}: {len(self.non_finite)} of {self.num_steps} logged steps are not "
                    f"finite: {shown}{more} (a non-finite value fails every scope)")
        if self.check.scope == "each" and self.failing:
            shown = ", ".join(f"{v:.6g} at step {s}" for s, v in self.failing[:5])
            more = f" (+{len(self.failing) - 5} more)" if len(self.failing) > 5 else ""
            return f"{verdict} {self.check}: {len(self.failing)} of {self.num_steps} logged steps fail: {shown}{more}"
        where = "" if self.step is None else f" at step {self.step}"
        what = {"each": "worst"}.get(self.check.scope, self.check.scope)
        return f"{verdict} {self.check}: {what} {self.value:.6g}{where} over {self.num_steps} logged steps"


def _rows(history: list[dict], key: str) -> list[tuple[int | None, float]]:
    """(step, value) of every log row holding `key`, TRL's final summary row excluded."""
    return [(row.get("step"), float(row[key])) for row in history
            if row.get(key) is not None and "train_runtime" not in row]


def evaluate(check: Check, history: list[dict]) -> CheckResult:
    """Judge one check on a run's log history (a list of log rows)."""
    rows = _rows(history, check.key)
    if not rows:
        return CheckResult(check, passed=False)
    n = len(rows)
    non_finite = [(s, v) for s, v in rows if not math.isfinite(v)]
    if non_finite:  # fails every scope (module docstring); the first one is the judged value
        step, value = non_finite[0]
        failing = [(s, v) for s, v in rows if not check.holds(v)] if check.scope == "each" else []
        return CheckResult(check, False, value, step, failing, n, non_finite)
    if check.scope == "mean":
        value = statistics.fmean(v for _, v in rows)
        return CheckResult(check, check.holds(value), value, None, num_steps=n)
    if check.scope in ("first", "last"):
        step, value = rows[0] if check.scope == "first" else rows[-1]
        return CheckResult(check, check.holds(value), value, step, num_steps=n)
    if check.scope in ("max", "min"):
        step, value = (max if check.scope == "max" else min)(rows, key=lambda r: r[1])
        return CheckResult(check, check.holds(value), value, step, num_steps=n)
    failing = [(s, v) for s, v in rows if not check.holds(v)]
    # the worst value: the farthest on the failing side of the bound (the closest to it when every step passes)
    step, value = max(rows, key=lambda r: _violation(check, r[1]))
    return CheckResult(check, not failing, value, step, failing, n)


def _violation(check: Check, x: float) -> float:
    """How far x is on the failing side of the bound (larger = worse; for == / != the distance to the value)."""
    if check.op in ("<=", "<"):
        return x - check.value
    if check.op in (">=", ">"):
        return check.value - x
    return abs(x - check.value) if check.op == "==" else -abs(x - check.value)


def evaluate_runs(runs: list[tuple[str, list[dict], object]], checks: list[Check]) -> list[tuple[str, CheckResult]]:
    """Every check on every run of `report.load_runs` ((name, history, config) triples): (run name, result) pairs."""
    return [(name, evaluate(check, history)) for name, history, _ in runs for check in checks]


def render(results: list[tuple[str, CheckResult]]) -> str:
    """Markdown: one line per (run, check), failures first, then a total, then a note per upper bound on a signed
    key (it passes every negative value)."""
    failed = [(n, r) for n, r in results if not r.passed]
    lines = ["### Checks", ""]
    lines += [f"- `{n}`: {r.describe()}" for n, r in failed + [(n, r) for n, r in results if r.passed]]
    lines += ["", f"{len(failed)} of {len(results)} checks failed." if failed else f"All {len(results)} checks pass."]
    for check in dict.fromkeys(r.check for _, r in results if r.check.bounds_a_signed_key_from_above):
        size = check.key.rsplit("/", 1)[0] + "/mean_abs_log_ratio"
        lines.append(f"- **note** `{check}`: {check.key} takes either sign, so this bound passes every negative "
                     f"value however large; to bound the gap's size check `{size}` (or `kl_k3`, >= 0).")
    return "\n".join(lines) + "\n"


def _unknown_key(key: str) -> str | None:
    """For a key no trainer logs (`metric_keys.logged_key`): "is not a key ...; did you mean ...?" (the nearest keys
    of ours and TRL's), to follow the key; for a `train/`/`eval/` prefix the key the log rows hold; None for a key
    the trainers can log."""
    from difflib import get_close_matches

    from . import metric_keys

    for prefix in ("train/", "eval/"):
        if key.startswith(prefix):
            return (f"is W&B's or TensorBoard's name: the trainer's log rows hold {key[len(prefix):]!r} (W&B and "
                    f"TensorBoard add the {prefix!r} prefix); use that key")
    if metric_keys.logged_key(key):
        return None
    ours = key.startswith(f"{metric_keys.PREFIX}/")
    candidates = ([*metric_keys.TABLE, *metric_keys.STALENESS_ROWS, *metric_keys.ROUTE_LAYER_ROWS] if ours else
                  [k for k in metric_keys.TRL_KEYS if "<" not in k])
    near = get_close_matches(key, candidates, n=3, cutoff=0.6)
    what = "the ratio diagnostics emit" if ours else "TRL or transformers log (grpo_ratio.diagnostics.metric_keys.TRL_KEYS)"
    hint = f"; did you mean {', '.join(map(repr, near))}?" if near else (
        " (docs/metrics.md lists them)" if ours else
        "; a metric of your own (TRL's log_metric, a callback) is checked under a namespace of your own, "
        "e.g. 'my/accuracy'")
    return f"is not a key {what}{hint}"


def _near_keys(key: str) -> str:
    """` (<_unknown_key>)` for a never-logged check, else ""."""
    unknown = _unknown_key(key)
    return f" ({key} {unknown})" if unknown else ""


def exit_code(results: list[tuple[str, CheckResult]]) -> int:
    """0 when every check passed, 1 otherwise."""
    return 0 if all(r.passed for _, r in results) else 1


def _check_logged_key(key: str) -> None:
    """A gate key must be one the trainer's log rows can hold (`metric_keys.logged_key`): W&B's and TensorBoard's
    `train/`/`eval/` prefixes are not in them, a `ratio/*` key must be one the diagnostics emit, another key one TRL
    or transformers logs (`metric_keys.TRL_KEYS`: `reward`, `rewards/<func>/mean`, ...) or one of a namespace of the
    user's own (`NAME/...`): a check of a key never logged could never fire.

    Raises:
        ValueError: naming the key, the key to use (a prefix) or the nearest keys.
    """
    unknown = _unknown_key(key)
    if unknown:
        raise ValueError(f"ratio_gate: {key!r} {unknown}")


def training_checks(checks, patience: int, action: str) -> list[Check]:
    """Validated settings of a gate during training (`RatioGateCallback`, the config's `ratio_gate*` fields): the
    parsed checks.

    Raises:
        Problems (a `ValueError`): every problem at once: a check that does not parse or has a scope other than
            `TRAINING_SCOPES` (the others need the whole run), a key the log rows never hold (`_check_logged_key`),
            patience not an integer >= 1, or an action not in `GATE_ACTIONS`.
    """
    problems, parsed = [], []
    for check in checks:
        try:
            parsed.append(check if isinstance(check, Check) else parse_check(check))
            _check_logged_key(parsed[-1].key)
        except ValueError as err:
            problems.append(str(err))
    bad = [str(c) for c in parsed if c.scope not in TRAINING_SCOPES]
    if bad:
        problems.append(f"ratio_gate: {', '.join(bad)}: during training only the scopes {', '.join(TRAINING_SCOPES)} "
                        f"can be judged (the others need the whole run; use `grpo-ratio report RUN --check` after it)")
    if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
        problems.append(f"ratio_gate_patience must be an integer >= 1, got {patience!r}")
    if action not in GATE_ACTIONS:
        problems.append(f"ratio_gate_action={action!r} is not allowed; allowed: {', '.join(GATE_ACTIONS)}")
    if problems:
        raise Problems(problems)
    return parsed
