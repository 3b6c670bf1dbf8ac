"""The findings of `grpo-ratio report`: the rules of docs/reading.md applied to one run's logged ratio metrics, with
the run's configuration (its arm, correction, sampling, engine) taken into account.

Two promises, tested in tests/test_report.py:
- a finding never suggests what the run already does: every suggested change is a (field, value) pair, and pairs
  equal to the run's own configuration are dropped before the text is written;
- a value that is expected for the arm (e.g. `fp32_clone`'s old/sampler out of band: the sampler is bf16 and the old
  side no longer is) is reported as "expected", with why, not as a problem to fix.

Where the configuration is unknown (a plain TRL script's `trainer_state.json`), the rules read the logged keys only
and say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..diagnostics import metric_keys as keys
from ..modes import BF16, FP16_CLONE, FP32_CLONE, FP32_HEAD, GUIDED_FP32, SAMPLER


# scoring arms whose old log-probs are (partly) more exact than the bf16 training forward and the bf16 sampler
MORE_EXACT = {FP32_CLONE.name: "fp32", FP16_CLONE.name: "fp16", FP32_HEAD.name: "fp32 in the final norm and LM head",
              GUIDED_FP32.name: "fp32 in the final norm, the LM head and the chosen decoder layers"}


@dataclass
class Finding:
    """One thing worth knowing about a run: `metric`, its run-mean `value`, the likely `cause`, the `fix` (text) and
    the config `changes` it suggests ({field: value}, never the run's own values).

    severity: "warning" (worth a change before a long run), "note" (worth knowing), "expected" (the value is what
    this arm shows by design; nothing to fix).
    """

    metric: str
    value: float
    cause: str
    fix: str
    severity: str = "warning"
    changes: dict = field(default_factory=dict)


def _mean(stats: dict, key: str) -> float | None:
    return stats[key]["mean"] if key in stats else None


def _suggest(config: dict, options: list[tuple], otherwise: str = "") -> tuple[str, dict]:
    """Fix text and changes from `options` [(field, value, why)] minus those the run already has; `(None, None,
    text)` entries are advice that is not a config change. `otherwise`: the text when every option was dropped."""
    kept = [(f, v, why) for f, v, why in options if f is None or config.get(f) != v]
    changes = {f: v for f, v, _ in kept if f is not None}
    parts = [(f"{f}={v!r}" + (f" ({why})" if why else "")) if f is not None else why for f, v, why in kept]
    return ("; or ".join(parts) if parts else otherwise), changes


def _finding(config: dict, metric: str, value: float, cause: str, options: list[tuple], severity: str = "warning",
             otherwise: str = "nothing to change") -> Finding:
    fix, changes = _suggest(config, options, otherwise)
    return Finding(metric, value, cause, fix, severity, changes)


def _truncation(stats: dict, config: dict, mode: str | None) -> list[Finding]:
    if mode == SAMPLER.name:
        return _sampler_arm_truncation(stats, config)
    sampler_mean = _mean(stats, keys.OLD_SAMPLER.mean)
    if sampler_mean is None or sampler_mean >= 0.97 or keys.OLD_SAMPLER_CORRECTED.oob_rate in stats:
        return []
    correction = config.get("truncation_correction")
    if correction not in (None, "none"):
        return [_finding(config, keys.OLD_SAMPLER.mean, sampler_mean,
                         f"old/sampler sits below 1 although truncation_correction={correction!r} is set, and the "
                         "corrected metrics (ratio/old_sampler_corrected/*) were not logged: the correction did not "
                         "run on these tokens", [("ratio_diagnostics", True, "the corrected metrics need it")],
                         otherwise="check the start-up warnings (a correction without truncated sampling is a no-op)")]
    return [_finding(config, keys.OLD_SAMPLER.mean, sampler_mean,
                     "old/sampler sits below 1 on average: the sampler's log-probs are renormalised over a kept set "
                     "(top_p / top_k / min_p, possibly from the model's generation_config) while the trainer's are "
                     "over the whole vocabulary; the ratio carries the kept mass",
                     [("truncation_correction", "renormalize", "changes the objective: no gradient outside the kept "
                       "set"), ("truncation_correction", "lift_sampler", "keeps TRL's objective; fixes the IS "
                                "weights and the diagnostics")])]


def _sampler_arm_truncation(stats: dict, config: dict) -> list[Finding]:
    """The `sampler` arm: old = sampler, so the kept mass of truncated sampling shows in new/old (policy/sampler),
    inside PPO's clip, not in old/sampler (1 by construction)."""
    new_mean = _mean(stats, keys.NEW_OLD.mean)
    if new_mean is None or new_mean >= 0.97 or config.get("truncation_correction") not in (None, "none"):
        return []
    return [_finding(config, keys.NEW_OLD.mean, new_mean,
                     "with old_logprob_mode='sampler' new/old is policy/sampler, and it sits below 1 on average: the "
                     "sampler's log-probs are renormalised over a kept set (top_p / top_k / min_p, possibly from the "
                     "model's generation_config) while the policy's are over the whole vocabulary; PPO's clip reads "
                     "the kept mass as policy change",
                     [("truncation_correction", "renormalize", "the policy's log-probs over the same kept set")])]


def _engine_options(config: dict) -> list[tuple]:
    """Ways to make the sampler compute the numbers the old side computes, for the engine this run used."""
    options = []
    if config.get("use_vllm"):
        options.append(("vllm_dtype", "float32", "the colocate engine in fp32, matching an fp32 trainer"))
    options.append(("old_logprob_mode", SAMPLER.name, "old log-probs are the sampler's own: old/sampler is 1 and "
                    "PPO's ratio becomes policy/sampler"))
    return options


def _sampler_gap(stats: dict, config: dict, mode: str | None) -> list[Finding]:
    """old/sampler often out of band, raw (no correction) or after the correction."""
    out = []
    corrected = keys.OLD_SAMPLER_CORRECTED.oob_rate in stats
    key = keys.OLD_SAMPLER_CORRECTED.oob_rate if corrected else keys.OLD_SAMPLER.oob_rate
    rate, sampler_mean = _mean(stats, key), _mean(stats, keys.OLD_SAMPLER.mean)
    shifted = not corrected and sampler_mean is not None and sampler_mean < 0.97  # the kept mass: _truncation's
    # a more exact arm shows the sampler's gap by design: say so from the level the bf16 arm stays below
    if rate is None or rate <= (0.05 if mode in MORE_EXACT else 0.10) or shifted or mode == SAMPLER.name:
        return out
    what = "after the correction old/sampler is still" if corrected else "old/sampler is"
    if mode in MORE_EXACT:
        out.append(_finding(
            config, key, rate,
            f"expected for old_logprob_mode={mode!r}: the sampler draws in bf16 (TRL's autocast, or vLLM's dtype) "
            f"while the old log-probs are now {MORE_EXACT[mode]}, so {what} out of band by the sampler's own "
            "precision gap; the gap moved here from new/old by design (docs/reading.md has each arm's measured "
            "range)", ([("vllm_dtype", "float32", "if the IS correction reads this ratio: an fp32 engine")]
                       if config.get("use_vllm") else []), severity="expected",
            otherwise="nothing to change for this arm"))
        return out
    out.append(_finding(
        config, key, rate,
        f"{what} often out of band without a systematic shift: sampler and trainer compute different numbers (the "
        "sampler decodes token by token with a KV cache, the trainer scores the padded batch in one pass; another "
        "engine or dtype with vLLM). Scoring the old side in fp32 does not lower it against a bf16 sampler: it "
        "moves the gap (docs/arms.md)", _engine_options(config) + [
            (None, None, "keep TRL's importance-sampling correction on (it reads this ratio)")]))
    return out


def _clip_text(stats: dict) -> str:
    flips = _mean(stats, keys.CLIP_FLIP_RATE)
    return ("nothing to change; read ratio/clip_flip_rate for what it does to the clip" if flips is None else
            f"nothing to change; it changes the PPO-clip decision of {flips:.2%} of tokens (ratio/clip_flip_rate)")


def _new_old(stats: dict, config: dict, mode: str | None) -> list[Finding]:
    rate = _mean(stats, keys.NEW_OLD.oob_rate)
    if rate is None:
        return []
    if mode == BF16.name:
        if rate == 0:
            return []
        return [_finding(config, keys.NEW_OLD.oob_rate, rate,
                         "with old_logprob_mode='bf16' new/old is 1 at the first inner step when TRL reuses the "
                         "training forward; tokens out of band mean TRL ran its own old pass (num_iterations > 1, or "
                         "steps_per_generation > gradient_accumulation_steps) and it differs: dropout, or another "
                         "batch shape in bf16",
                         [("disable_dropout", True, "dropout makes two passes differ"),
                          (None, None, "an fp32 old_logprob_mode to see the precision part explicitly")])]
    if rate <= 0.05:
        return []
    if mode == SAMPLER.name:
        if _sampler_arm_truncation(stats, config):  # the kept mass, not the precision gap: reported there
            return []
        return [_finding(config, keys.NEW_OLD.oob_rate, rate,
                         "expected for old_logprob_mode='sampler': new/old is policy/sampler here, the "
                         "sampler-vs-trainer gap that old/sampler shows in the other arms, now inside PPO's clip",
                         [], severity="expected", otherwise=_clip_text(stats))]
    low_precision_training = config.get("bf16") or config.get("fp16")
    if mode in MORE_EXACT and low_precision_training:
        return [_finding(config, keys.NEW_OLD.oob_rate, rate,
                         f"expected for old_logprob_mode={mode!r} under {'bf16' if config.get('bf16') else 'fp16'} "
                         f"training: the training forward runs at that precision, the old log-probs in "
                         f"{MORE_EXACT[mode]}; the precision gap moved to where PPO's clip sees it",
                         [], severity="expected", otherwise=_clip_text(stats))]
    cause = ("the old log-probs and the training forward disagree before any update" +
             (" although training is not in bf16/fp16: dropout, or another batch shape" if mode in MORE_EXACT
              else ": the training forward runs at training precision while the old log-probs may not, or dropout "
              "is on") + "; PPO's clip treats this gap as a policy change")
    return [_finding(config, keys.NEW_OLD.oob_rate, rate, cause,
                     [("disable_dropout", True, "if dropout is on"),
                      (None, None, "read ratio/clip_flip_rate to see whether it changes clip decisions")], "note")]


def _clip(stats: dict, config: dict, mode: str | None) -> list[Finding]:
    flips = _mean(stats, keys.CLIP_FLIP_RATE)
    if flips is None or flips <= 0.01:
        return []
    same = " (it equals TRL's clip_ratio/region_mean here: with num_iterations=1 every clipped token is a flip)" \
        if config.get("num_iterations") in (None, 1) else ""
    return [_finding(config, keys.CLIP_FLIP_RATE, flips,
                     f"the choice of old log-probs changes the PPO-clip decision of more than 1% of tokens{same}: the "
                     "arm changes the update, so it may change the reward",
                     [(None, None, "grpo-ratio compare against bf16 with 3+ seeds before choosing the arm")], "note")]


def _kept_sets(stats: dict, config: dict) -> list[Finding]:
    added = _mean(stats, keys.KEPT_SET_ADDED_RATE)
    if added is None or added <= 0.01:
        return []
    options = [("kept_set_source", "recorded", "the sampler's own sets: generate's recording, or vLLM colocate with "
                "sampling masks")]
    if config.get("use_vllm"):
        options.append(("vllm_dtype", "float32", "trainer and sampler put the boundary in the same place"))
    return [_finding(config, keys.KEPT_SET_ADDED_RATE, added,
                     "the kept sets recomputed from the trainer's logits often miss the token the sampler drew: the "
                     "trainer's logits and the sampler's disagree at the top_p/top_k boundary", options)]


def _counts(stats: dict, config: dict) -> list[Finding]:
    out = []
    fallback = stats.get(keys.FP16_FALLBACK_ROWS)
    if fallback is not None and fallback["max"] > 0:
        out.append(_finding(config, keys.FP16_FALLBACK_ROWS, fallback["max"],
                            "fp16 overflowed (activations past 65,504) and rows were re-scored in fp32",
                            [("old_logprob_mode", FP32_CLONE.name, "if it happens often: each fallback costs an fp32 "
                              "pass")], "note"))
    tokens = stats.get(keys.NEW_OLD.num_tokens)
    if tokens is not None and tokens["min"] == 0:
        out.append(_finding(config, keys.NEW_OLD.num_tokens, 0.0,
                            "some updates had no valid completion token (every completion masked, e.g. "
                            "mask_truncated_completions with completions that never end)",
                            [(None, None, "raise max_completion_length" + (
                                f" (now {config['max_completion_length']})" if config.get("max_completion_length")
                                else "")),
                             ("mask_truncated_completions", False, "")]))
    return out


def _by_design(stats: dict, config: dict, mode: str | None) -> list[Finding]:
    """Values that look remarkable but are what the arm does by construction."""
    rate = _mean(stats, keys.OLD_SAMPLER.oob_rate)
    if mode == SAMPLER.name and rate is not None and rate == 0:
        return [Finding(keys.OLD_SAMPLER.oob_rate, 0.0, "expected for old_logprob_mode='sampler': the old "
                        "log-probs are the sampler's, so old/sampler is identically 1 by construction (logged as "
                        "exactly 1, not measured); the sampler-vs-trainer gap shows in new/old instead",
                        "nothing to change", "expected")]
    return []


def findings(stats: dict, config: dict | None = None) -> list[Finding]:
    """The rules of docs/reading.md applied to one run's summary (`report.summarize_history`).

    Args:
        stats: {metric key: {"mean", "first", "last", "min", "max", "steps"}}.
        config: the run's configuration when known (`run_record.RUN_FIELDS` of its `RatioGRPOConfig`); without it the
            rules read the logged keys only and cannot say what is expected for the arm.
    Returns:
        Findings in rule order; none suggests a change to a value the run already has.
    """
    config = config or {}
    mode = config.get("old_logprob_mode")
    return (_truncation(stats, config, mode) + _sampler_gap(stats, config, mode) + _new_old(stats, config, mode)
            + _clip(stats, config, mode) + _kept_sets(stats, config) + _counts(stats, config)
            + _by_design(stats, config, mode))


# MoE policies (`ratio/route/*`, docs/moe.md)
ROUTE_FLIP_LIMIT = 0.01  # share of tokens routed differently (any layer) above which a route finding is written


def route_findings(stats: dict, config: dict | None = None) -> list[Finding]:
    """The route-agreement rules of docs/reading.md (MoE policies, `ratio/route/*`): a pair of passes that routes more
    than `ROUTE_FLIP_LIMIT` of the tokens differently without replay gets the `routing_replay` that removes it (R3 for
    sampler vs old, R2 or R3 for old vs new; R2 never with `old_logprob_mode="sampler"`, volcengine/verl#7805); a
    replayed pair that is not exactly 0 is reported as a fault. Never suggests the run's own `routing_replay`.
    `config`: the run's configuration when known (`run_record.RUN_FIELDS`), else the rules read the logged keys only."""
    config = config or {}
    replay, out = config.get("routing_replay"), []
    sampler_old = _mean(stats, keys.route_key("sampler_old", "any_layer"))
    old_new = _mean(stats, keys.route_key("old_new", "any_layer"))
    replayed = {"R3": ("sampler_old", "old_new"), "R2": ("old_new",)}.get(replay, ())
    for pair, value in (("sampler_old", sampler_old), ("old_new", old_new)):
        if pair in replayed and value is not None and value > 0:
            out.append(Finding(keys.route_key(pair, "any_layer"), value,
                               f"routing_replay={replay!r} replays these routes, so the share must be exactly 0: some "
                               "forward ran outside the replay session (a forward of your own, or a bug)",
                               "nothing to change in the config; file an issue with the run's log history"))
    if sampler_old is not None and sampler_old > ROUTE_FLIP_LIMIT and "sampler_old" not in replayed:
        out.append(Finding(keys.route_key("sampler_old", "any_layer"), sampler_old,
                           "the sampler and the trainer's old pass route this share of tokens to another top-k set "
                           "of experts at one MoE layer at least (decode with a KV cache vs one batched pass, another "
                           "precision or kernel): a flipped expert moves the token's log-prob by a jump no precision "
                           "mode removes, and old/sampler carries it",
                           "routing_replay='R3' (the sampler's routes in the old pass and every update; int16 routes "
                           "of every layer x top_k per token, docs/moe.md)"))
    if old_new is not None and old_new > ROUTE_FLIP_LIMIT and not replayed:
        iterations = config.get("num_iterations")
        why = ("the updates after the first move the routers (num_iterations > 1)" if iterations and iterations > 1
               else "the training forward runs in another precision or batch shape than the old pass, or the "
                    "routers moved between updates")
        options = ["routing_replay='R2' (the old pass's routes in every update)"]
        options = options if config.get("old_logprob_mode") != SAMPLER.name else []
        options.append("routing_replay='R3' (the sampler's routes everywhere: also removes sampler vs old)")
        out.append(Finding(keys.route_key("old_new", "any_layer"), old_new,
                           f"the old pass and the update forwards route this share of tokens to other experts: {why}; "
                           "PPO's clip counts every route flip as policy change", "; or ".join(options)))
    return out
