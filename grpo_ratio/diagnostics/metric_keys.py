"""Every `ratio/*` key the diagnostics can log: one table, with when each key is present and what it means.

`grpo_ratio.diagnostics.ratio_diagnostics` emits the keys through these names; `grpo_ratio.analysis` (plots, report) and `grpo_ratio.cli.compare` read
them through the same names, so a renamed key cannot leave a consumer behind. docs/metrics.md has the formulas and
renders this table (`python -m grpo_ratio.diagnostics.metric_keys`, a generated block); tests/test_metric_keys.py checks that a
real training run emits only keys of this table and that the table and docs/metrics.md list the same keys.

Three ratio families share one set of statistics (`ratios.RatioStats.as_metrics`): `NEW_OLD.oob_rate` is
`"ratio/new_old/oob_rate"`. The other keys are module constants (`KEPT_MASS_MEAN`, ...). TRL's own keys
(`clip_ratio/*`, `sampling/*`) are not in this table.
"""

from __future__ import annotations

from dataclasses import dataclass


PREFIX = "ratio"

# the statistics of every ratio family, in the order `RatioStats.as_metrics` emits them
FAMILY_STATS = {
    "num_tokens": "valid tokens scored (all processes)",
    "oob_rate": "share of valid tokens whose ratio is out of band (non-finite included)",
    "nonfinite_rate": "share of valid tokens with a NaN/inf log-ratio",
    "mean_abs_log_ratio": "mean absolute log-ratio over the finite ones (nats)",
    "mean": "mean r over the finite log-ratios",
    "p1": "1st percentile of r",
    "p50": "median of r",
    "p99": "99th percentile of r",
}


@dataclass(frozen=True)
class KeyInfo:
    """One row of the table: `present` says when the key is logged, `meaning` what it measures (one line each)."""

    present: str
    meaning: str


@dataclass(frozen=True)
class RatioFamily:
    """A ratio family `{prefix}/{stat}` for every stat of `FAMILY_STATS`; `present`/`meaning` as in `KeyInfo`."""

    prefix: str
    present: str
    meaning: str

    def key(self, stat: str) -> str:
        """`{prefix}/{stat}`. Raises KeyError for a stat `RatioStats` does not emit."""
        if stat not in FAMILY_STATS:
            raise KeyError(f"{stat!r} is not a ratio-family statistic; allowed: {', '.join(FAMILY_STATS)}")
        return f"{self.prefix}/{stat}"

    def keys(self) -> dict[str, KeyInfo]:
        return {self.key(s): KeyInfo(self.present, f"{self.meaning}: {m}") for s, m in FAMILY_STATS.items()}

    num_tokens = property(lambda self: self.key("num_tokens"))
    oob_rate = property(lambda self: self.key("oob_rate"))
    nonfinite_rate = property(lambda self: self.key("nonfinite_rate"))
    mean_abs_log_ratio = property(lambda self: self.key("mean_abs_log_ratio"))
    mean = property(lambda self: self.key("mean"))
    p1 = property(lambda self: self.key("p1"))
    p50 = property(lambda self: self.key("p50"))
    p99 = property(lambda self: self.key("p99"))


NEW_OLD = RatioFamily(f"{PREFIX}/new_old", "ratio_diagnostics on (an update without a valid token: num_tokens = 0 alone)",
                      "new/old at the first inner step (what the PPO clip reads)")
OLD_SAMPLER = RatioFamily(f"{PREFIX}/old_sampler", "sampler log-probs exist (vLLM, or generate recorded)",
                          "old/sampler, raw (what IS correction reads)")
OLD_SAMPLER_CORRECTED = RatioFamily(f"{PREFIX}/old_sampler_corrected", "a truncation correction with kept sets",
                                    "old/sampler after the truncation correction")
FAMILIES = (NEW_OLD, OLD_SAMPLER, OLD_SAMPLER_CORRECTED)

# the KL/PPL/chi-square units of two families (`mismatch.MismatchStats.as_metrics`), in emission order
MISMATCH_STATS = {
    "kl_k1": "k1 estimate of KL(q||p), mean over valid tokens of -log r",
    "kl_k2": "k2 estimate, mean of (log r)^2 / 2",
    "kl_k3": "k3 estimate of KL(q||p), mean of r - 1 - log r",
    "kl_k3_clamped": "outlier-robust k3: mean of min(r - 1 - log r, 10), each token's k3 clamped (miles)",
    "chi2_token": "token chi-square, mean of r^2 minus 1",
    "log_ppl_diff": "log PPL_p - log PPL_q per sequence, averaged over sequences",
    "log_ppl_abs_diff": "the same, absolute value per sequence",
    "ppl_ratio": "PPL_p / PPL_q per sequence, averaged over sequences",
    "chi2_seq": "sequence chi-square, mean over sequences of (prod r)^2 minus 1",
}
MISMATCH_FAMILIES = (NEW_OLD, OLD_SAMPLER)


def mismatch_key(family: RatioFamily, stat: str) -> str:
    """`{family.prefix}/{stat}` for a `MISMATCH_STATS` stat. Raises KeyError for another stat."""
    if stat not in MISMATCH_STATS:
        raise KeyError(f"{stat!r} is not a mismatch statistic; allowed: {', '.join(MISMATCH_STATS)}")
    return f"{family.prefix}/{stat}"

KEPT_MASS_MEAN = f"{PREFIX}/kept_mass_mean"
KEPT_SET_ADDED_RATE = f"{PREFIX}/kept_set_added_rate"
IS_WEIGHTS_MIN = f"{PREFIX}/importance_sampling_ratio/min"
IS_WEIGHTS_MEAN = f"{PREFIX}/importance_sampling_ratio/mean"
IS_WEIGHTS_MAX = f"{PREFIX}/importance_sampling_ratio/max"
FP16_FALLBACK_ROWS = f"{PREFIX}/fp16_fallback_rows"
CLIP_FLIP_RATE = f"{PREFIX}/clip_flip_rate"
CLIP_FLIP_RATE_ADV_WEIGHTED = f"{PREFIX}/clip_flip_rate_adv_weighted"
IS_TRUNCATED_TOKEN_FRAC = f"{PREFIX}/is_truncated_token_frac"
IS_TRUNCATED_SEQ_FRAC = f"{PREFIX}/is_truncated_seq_frac"
IS_MASKED_TOKEN_FRAC = f"{PREFIX}/is_masked_token_frac"
IS_MASKED_SEQ_FRAC = f"{PREFIX}/is_masked_seq_frac"
IS_REJECTED_TOKEN_FRAC = f"{PREFIX}/is_rejected_token_frac"
IS_REJECTED_SEQ_FRAC = f"{PREFIX}/is_rejected_seq_frac"
IS_WEIGHT_ESS = f"{PREFIX}/is_weight_ess"
IS_WEIGHT_MEAN = f"{PREFIX}/is_weight_mean"
IS_ZERO_WEIGHT_TOKEN_FRAC = f"{PREFIX}/is_zero_weight_token_frac"
IS_WEIGHT_RAW_P1 = f"{PREFIX}/is_weight_raw/p1"
IS_WEIGHT_RAW_P50 = f"{PREFIX}/is_weight_raw/p50"
IS_WEIGHT_RAW_P99 = f"{PREFIX}/is_weight_raw/p99"
FULL_KL = f"{NEW_OLD.prefix}/full_kl"
FULL_REVERSE_KL = f"{NEW_OLD.prefix}/full_reverse_kl"
FULL_TV = f"{NEW_OLD.prefix}/full_tv"
TRUST_REGION_MASKED_FRAC = f"{PREFIX}/trust_region_masked_frac"
ROLLOUT_COPY_SECONDS = f"{PREFIX}/rollout_copy_seconds"
CENTERING_DRIFT_TV = f"{PREFIX}/centering/drift_tv"
CENTERING_TAIL_MASS = f"{PREFIX}/centering/tail_mass"
CENTERING_FRESH_FRAC = f"{PREFIX}/centering/centred_token_frac"

_IS_LOSS = "is_correction, or lift_sampler with vLLM's IS correction"
_IS_ANY = "an IS weight in the loss (vLLM's correction, or is_correction)"
_IS_RAW = "an IS weight in the loss with a weight level (not is_correction_level='none')"
_IS_TRUNCATE = "an IS weight in the loss, truncate action (TRL's *_truncate modes)"
_IS_MASK = "an IS weight in the loss, mask action (TRL's *_mask modes)"
_IS_REJECT = "is_correction with rejection rules or a veto"
SINGLE_KEYS = {
    KEPT_MASS_MEAN: KeyInfo("a truncation correction with kept sets", "mean kept mass under the old policy (1 = "
                            "untruncated)"),
    KEPT_SET_ADDED_RATE: KeyInfo('a correction with kept_set_source="recompute"', "share of sampled tokens the "
                                 "recomputed filter dropped (added back)"),
    IS_WEIGHTS_MIN: KeyInfo(_IS_LOSS, "smallest IS weight the loss uses (after any truncation correction)"),
    IS_WEIGHTS_MEAN: KeyInfo(_IS_LOSS, "mean IS weight the loss uses (after any truncation correction)"),
    IS_WEIGHTS_MAX: KeyInfo(_IS_LOSS, "largest IS weight the loss uses (after any truncation correction)"),
    FP16_FALLBACK_ROWS: KeyInfo('old_logprob_mode="fp16_clone"', "rows re-scored in fp32 after an fp16 overflow, "
                                "summed over processes"),
    CLIP_FLIP_RATE: KeyInfo("a PPO-clip loss, token-level IS, on a clip_flip_every update", "share of tokens whose "
                            "PPO-clip decision changes with the choice of old log-probs"),
    CLIP_FLIP_RATE_ADV_WEIGHTED: KeyInfo("as clip_flip_rate, and some valid token with A != 0", "the same, weighted "
                                         "by the absolute advantage"),
    IS_TRUNCATED_TOKEN_FRAC: KeyInfo(_IS_TRUNCATE, "share of tokens whose IS weight the bounds clamped"),
    IS_TRUNCATED_SEQ_FRAC: KeyInfo(_IS_TRUNCATE, "share of sequences touched by the clamp"),
    IS_MASKED_TOKEN_FRAC: KeyInfo(_IS_MASK, "share of tokens whose IS weight the bounds set to 0"),
    IS_MASKED_SEQ_FRAC: KeyInfo(_IS_MASK, "share of sequences (partly) masked"),
    IS_REJECTED_TOKEN_FRAC: KeyInfo(_IS_REJECT, "share of tokens a rejection rule or the veto set to 0"),
    IS_REJECTED_SEQ_FRAC: KeyInfo(_IS_REJECT, "share of sequences (partly) rejected"),
    IS_WEIGHT_ESS: KeyInfo(_IS_ANY, "effective sample size of the weights the loss uses, (sum w)^2 / (N sum w^2)"),
    IS_WEIGHT_MEAN: KeyInfo(_IS_ANY, "mean weight the loss uses, over valid tokens"),
    IS_ZERO_WEIGHT_TOKEN_FRAC: KeyInfo(_IS_ANY, "share of tokens whose IS weight is 0 (bounds, rejection or veto): "
                                       "they train nothing; 1 = the step trained nothing"),
    IS_WEIGHT_RAW_P1: KeyInfo(_IS_RAW, "1st percentile of the raw weight (before bounds and rejection)"),
    IS_WEIGHT_RAW_P50: KeyInfo(_IS_RAW, "median raw weight"),
    IS_WEIGHT_RAW_P99: KeyInfo(_IS_RAW, "99th percentile of the raw weight"),
    FULL_KL: KeyInfo("ratio_full_vocab with a scoring mode", "exact full-vocabulary KL(old||policy), mean over valid "
                     "tokens"),
    FULL_REVERSE_KL: KeyInfo("ratio_full_vocab with a scoring mode", "exact KL(policy||old), mean over valid tokens"),
    FULL_TV: KeyInfo("ratio_full_vocab with a scoring mode", "exact total variation between the two, mean over valid "
                     "tokens"),
    TRUST_REGION_MASKED_FRAC: KeyInfo("trust_region set (GRPO)", "share of valid tokens DPPO's divergence mask took "
                                      "out of the policy loss, over every micro-batch of the update"),
    ROLLOUT_COPY_SECONDS: KeyInfo("rollout_precision other than 'policy', a generation that re-made the copy",
                                  "wall seconds spent re-making the rollout copy from the policy's weights (re-cast, "
                                  "re-quantized or re-converted), mean over the logged generations"),
    CENTERING_DRIFT_TV: KeyInfo("score_centering set", "total variation between the sampler's distribution and the "
                                "policy's at each centred token, mean over those tokens (half the L1 norm of the "
                                "subtracted logit gradient q - p; 0: nothing to centre); top_k: over the top-k ids "
                                "and the tail as one outcome, a lower bound"),
    CENTERING_TAIL_MASS: KeyInfo('score_centering="top_k"', "the sampler's mass off its recorded top k, mean over "
                                 "centred tokens: the centred gradient is within twice it (L1) of the exact one"),
    CENTERING_FRESH_FRAC: KeyInfo("score_centering set (async)", "share of loss terms centred: those of staleness "
                                  "0, whose sampling weights are the forward's"),
}

# the mismatch units of NEW_OLD and OLD_SAMPLER, present with their family
MISMATCH_KEYS = {mismatch_key(f, stat): KeyInfo(f.present, f"{f.meaning}: {meaning}")
                 for f in MISMATCH_FAMILIES for stat, meaning in MISMATCH_STATS.items()}

# MoE route agreement (grpo_ratio.routing.replay.RouteTally): two pairs, each with three fixed keys and one key per
# MoE layer, `ratio/route/<pair>/layer_<i>` (absolute decoder-layer index i)
ROUTE_PREFIX = f"{PREFIX}/route"
ROUTE_PAIRS = {
    "sampler_old": ("an MoE policy, ratio_diagnostics on, sampler routes recorded (generate, or vLLM under R3)",
                    "sampler vs old pass (or the first update where no old pass runs)"),
    "old_new": ("an MoE policy, ratio_diagnostics on, an old pass ran", "old pass vs every update forward"),
}
ROUTE_STATS = {
    "any_layer": "share of tokens whose top-k expert set differs at one layer at least, routes the pass used",
    "native_any_layer": "the same for the routes its routers chose themselves (what replay overrode)",
    "num_tokens": "tokens routed on both sides at one MoE layer at least (all processes)",
}


def route_key(pair: str, stat: str) -> str:
    """`ratio/route/{pair}/{stat}`; stat one of `ROUTE_STATS` or `layer_<i>`. Raises KeyError otherwise."""
    if pair not in ROUTE_PAIRS or not (stat in ROUTE_STATS or _is_layer_stat(stat)):
        raise KeyError(f"no route key {pair!r}/{stat!r}; pairs {', '.join(ROUTE_PAIRS)}, stats "
                       f"{', '.join(ROUTE_STATS)} or layer_<i>")
    return f"{ROUTE_PREFIX}/{pair}/{stat}"


def _is_layer_stat(stat: str) -> bool:
    return stat.startswith("layer_") and stat[len("layer_"):].isdigit()


ROUTE_KEYS = {route_key(pair, stat): KeyInfo(present, f"{what}: {meaning}")
              for pair, (present, what) in ROUTE_PAIRS.items() for stat, meaning in ROUTE_STATS.items()}
# the per-layer keys, one pattern row per pair (`known` accepts every layer index)
ROUTE_LAYER_ROWS = {f"{ROUTE_PREFIX}/{pair}/layer_<i>": KeyInfo(present, f"{what}: share of tokens whose top-k set "
                                                                       f"differs at MoE layer i, routes used")
                    for pair, (present, what) in ROUTE_PAIRS.items()}

# the attribution of log(new) - log(sampler) into named causes (ratio_attribution, grpo_ratio.diagnostics.attribution,
# docs/attribution.md): `ratio/attribution/<term>/<stat>` and the identity's rounding error
ATTRIBUTION_PREFIX = f"{PREFIX}/attribution"
ATTRIBUTION_TERMS = {  # in the order of the chain new -> old -> reference -> sampler
    "drift": "what moved: the training forward - the same at the weights that generated the batch (0 at the first "
             "inner step, where the attribution is measured)",
    "train_precision": "how the training forward computes: the training forward at the generation's weights - the "
                       "old log-probs (bf16 training vs an fp32 old pass; 0 where TRL's pass is the old one)",
    "precision": "old - the fp32 reference pass of the same weights and routes",
    "routing": "the fp32 reference with the old pass's routes - with the sampler's (MoE; 0 for a dense policy)",
    "truncation": "the kept-mass term left once the sampler's log-probs are processed (0 at top_p=1)",
    "engine": "the fp32 reference on the sampler's support and routes - the sampler's log-prob (the rest)",
}
ATTRIBUTION_STATS = {
    "mean_abs": "mean |term| over the attributed tokens (nats)",
    "share": "sum |term| / sum over the six terms of |term|",
    "mean": "mean signed term (nats)",
}
_ATTRIBUTION_PRESENT = "ratio_attribution on, sampler log-probs exist"


def attribution_key(term: str, stat: str) -> str:
    """`ratio/attribution/{term}/{stat}`. Raises KeyError for a term or stat not in the tables."""
    if term not in ATTRIBUTION_TERMS or stat not in ATTRIBUTION_STATS:
        raise KeyError(f"no attribution key {term!r}/{stat!r}; terms {', '.join(ATTRIBUTION_TERMS)}, stats "
                       f"{', '.join(ATTRIBUTION_STATS)}")
    return f"{ATTRIBUTION_PREFIX}/{term}/{stat}"


ATTRIBUTION_IDENTITY_ERROR = f"{ATTRIBUTION_PREFIX}/identity_error"
ATTRIBUTION_NUM_TOKENS = f"{ATTRIBUTION_PREFIX}/num_tokens"
ATTRIBUTION_KEYS = {attribution_key(term, stat): KeyInfo(_ATTRIBUTION_PRESENT, f"{what}: {meaning}")
                    for term, what in ATTRIBUTION_TERMS.items() for stat, meaning in ATTRIBUTION_STATS.items()} | {
    ATTRIBUTION_IDENTITY_ERROR: KeyInfo(_ATTRIBUTION_PRESENT, "largest |sum of the six terms - (log new - log "
                                        "sampler)| over the attributed tokens: fp32 rounding only"),
    ATTRIBUTION_NUM_TOKENS: KeyInfo(_ATTRIBUTION_PRESENT, "tokens attributed (the sampled rows' valid tokens with a "
                                    "sampler log-prob, all processes)"),
}

# asynchronous runs (RatioAsyncGRPOTrainer, grpo_ratio.diagnostics.staleness, docs/async.md): the ratios of each
# trained token, bucketed by its sample's staleness k, `ratio/staleness/<k>/<stat>` (k = 0 .. max_staleness)
STALENESS_PREFIX = f"{PREFIX}/staleness"
_ASYNC = "RatioAsyncGRPOTrainer, a token of staleness k trained in the window"
_DECOUPLED = "RatioAsyncGRPOTrainer with async_objective 'decoupled' or 'decoupled_loglinear'"
STALENESS_STATS = {
    "num_tokens": (_ASYNC, "trained tokens of staleness k (all processes)"),
    "new_behav_oob_rate": (_ASYNC, "share whose new/behaviour ratio (TRL's coupled ratio) is out of band"),
    "new_behav_clip_rate": (_ASYNC, "share whose PPO clip on new/behaviour is active (what the coupled loss clips)"),
    "new_behav_mean_abs_log_ratio": (_ASYNC, "mean |log new/behaviour| (nats; non-finite as 0)"),
    "clip_flip_rate": (_ASYNC, "share whose clip status differs between new/behaviour and the ratio the objective "
                               "clips (coupled: against the training forward itself, never clipped)"),
    "new_prox_oob_rate": (_DECOUPLED, "share whose new/proximal ratio (the one clipped) is out of band"),
    "new_prox_clip_rate": (_DECOUPLED, "share whose PPO clip on new/proximal is active"),
    "prox_behav_oob_rate": (_DECOUPLED, "share whose proximal/behaviour ratio (the IS ratio) is out of band"),
    "is_weight_mean": (_DECOUPLED, "mean behaviour -> proximal IS weight applied (is_correction; 0 = rejected)"),
    "is_ess": (_DECOUPLED, "normalised effective sample size of the applied IS weights, (sum w)^2 / (n sum w^2)"),
}


def staleness_key(k: int, stat: str) -> str:
    """`ratio/staleness/{k}/{stat}`. Raises KeyError for a stat not in `STALENESS_STATS`, ValueError for k < 0."""
    if stat not in STALENESS_STATS:
        raise KeyError(f"no staleness stat {stat!r}; allowed: {', '.join(STALENESS_STATS)}")
    if k < 0:
        raise ValueError(f"staleness k must be >= 0, got {k}")
    return f"{STALENESS_PREFIX}/{k}/{stat}"


STALENESS_ROWS = {f"{STALENESS_PREFIX}/<k>/{stat}": KeyInfo(present, meaning)
                  for stat, (present, meaning) in STALENESS_STATS.items()}

# the gap by completion position and the bias/noise split of each sequence's log-ratio sum (`ratio_by_position`,
# grpo_ratio.diagnostics.by_position, docs/metrics.md): `ratio/by_position/<P>/<family>/<stat>` for the power-of-two
# buckets P = 1, 2, 4, ... (positions P .. 2P - 1, 1-based) and `ratio/by_position/seq/<family>/<stat>`
BY_POSITION_PREFIX = f"{PREFIX}/by_position"
BY_POSITION_FAMILIES = ("new_old", "old_sampler")
_BY_POSITION = "ratio_by_position on"
_BY_POSITION_FAMILY = {"new_old": "new/old at the first inner step", "old_sampler": "old/sampler, raw"}
BY_POSITION_STATS = {
    "num_tokens": "valid tokens at completion positions P .. 2P - 1 (all processes)",
    "mean_abs_log_ratio": "mean |log r| over them (nats)",
    "kl_k3": "k3 estimate over them, mean of r - 1 - log r",
}
BY_POSITION_SEQ_STATS = {
    "num_seqs": "sequences with at least 2 valid tokens (all processes)",
    "bias": "mean over sequences of the per-token mean log r (nats): the bias",
    "abs_bias": "mean over sequences of |per-token mean log r|",
    "noise": "mean over sequences of the within-sequence std of log r (unbiased): the noise",
    "noise_of_mean": "mean over sequences of std / sqrt(n): the |mean| noise alone would give",
    "bias_share": "share of the squared log-ratio sums that is bias, sum (S^2 - n s^2) / sum S^2 (0: noise, 1: bias)",
}


def by_position_key(bucket: int, family: str, stat: str) -> str:
    """`ratio/by_position/{bucket}/{family}/{stat}`. Raises KeyError for a bucket that is not a power of two, or a
    family or stat not in the tables."""
    if not (isinstance(bucket, int) and bucket >= 1 and bucket & (bucket - 1) == 0) or family not in \
            BY_POSITION_FAMILIES or stat not in BY_POSITION_STATS:
        raise KeyError(f"no by-position key {bucket!r}/{family!r}/{stat!r}; buckets 1, 2, 4, ..., families "
                       f"{', '.join(BY_POSITION_FAMILIES)}, stats {', '.join(BY_POSITION_STATS)}")
    return f"{BY_POSITION_PREFIX}/{bucket}/{family}/{stat}"


def by_position_seq_key(family: str, stat: str) -> str:
    """`ratio/by_position/seq/{family}/{stat}`. Raises KeyError for a family or stat not in the tables."""
    if family not in BY_POSITION_FAMILIES or stat not in BY_POSITION_SEQ_STATS:
        raise KeyError(f"no by-position sequence key {family!r}/{stat!r}")
    return f"{BY_POSITION_PREFIX}/seq/{family}/{stat}"


BY_POSITION_SEQ_KEYS = {by_position_seq_key(f, stat): KeyInfo(_BY_POSITION, f"{_BY_POSITION_FAMILY[f]}: {meaning}")
                        for f in BY_POSITION_FAMILIES for stat, meaning in BY_POSITION_SEQ_STATS.items()}
BY_POSITION_ROWS = {f"{BY_POSITION_PREFIX}/<P>/{f}/{stat}": KeyInfo(_BY_POSITION, f"{_BY_POSITION_FAMILY[f]}: "
                                                                                  f"{meaning}")
                    for f in BY_POSITION_FAMILIES for stat, meaning in BY_POSITION_STATS.items()}

# every key the diagnostics can emit (the per-layer route keys, per-staleness and per-position keys: `known`)
TABLE: dict[str, KeyInfo] = ({k: v for family in FAMILIES for k, v in family.keys().items()} | MISMATCH_KEYS
                             | SINGLE_KEYS | ROUTE_KEYS | ATTRIBUTION_KEYS | BY_POSITION_SEQ_KEYS)


def known(key: str) -> bool:
    """Whether the diagnostics can emit `key`: a key of `TABLE`, a per-layer route key, a per-staleness key or a
    per-position key."""
    if key in TABLE:
        return True
    parts = key.split("/")
    if len(parts) == 5 and parts[:2] == [PREFIX, "by_position"] and parts[2].isdigit():
        bucket = int(parts[2])
        return bucket >= 1 and bucket & (bucket - 1) == 0 and parts[3] in BY_POSITION_FAMILIES and \
            parts[4] in BY_POSITION_STATS
    if len(parts) == 4 and parts[:2] == [PREFIX, "staleness"]:
        return parts[2].isdigit() and parts[3] in STALENESS_STATS
    return len(parts) == 4 and parts[:2] == [PREFIX, "route"] and parts[2] in ROUTE_PAIRS and _is_layer_stat(parts[3])


# The keys TRL 1.16 and transformers log next to ours (fnmatch patterns: `*` is one path segment here), which
# `ratio_gate` may check: transformers' Trainer (`loss`, `grad_norm`, `learning_rate`, `epoch`), TRL's GRPOTrainer and
# RLOOTrainer (trl/trainer/grpo_trainer.py, rloo_trainer.py: `self._metrics[mode][...]`) and its experimental
# AsyncGRPOTrainer (trl/experimental/async_grpo: the trainer's metrics and the rollout worker's sample metrics).
# `<func>` is a reward function's name. A key of another namespace (`NAME/...`) is the user's own (TRL's
# `log_metric`, a callback) and cannot be known in advance.
TRL_KEYS = (
    "loss", "grad_norm", "learning_rate", "epoch",
    "reward", "reward_std", "frac_reward_zero_std", "rewards/<func>", "rewards/<func>/mean", "rewards/<func>/std",
    "num_tokens", "kl", "entropy", "aux_loss", "policy_loss", "entropy_coef", "cispo_clip_ratio", "step_time",
    "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
    "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length",
    "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
    "clip_ratio/region_mean",
    "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "tools/call_frequency", "tools/failure_frequency", "vespo/phi_seq_mean",
    "ratio", "sample/<name>", "batch/<name>", "perf/<name>",  # AsyncGRPOTrainer
)
# the namespaces of the keys above and of ours: a key under one of them must be one of the keys
NAMESPACES = (PREFIX, *dict.fromkeys(k.split("/")[0] for k in TRL_KEYS if "/" in k))


def logged_key(key: str) -> bool:
    """Whether `key` is one the trainers can log: a `ratio/*` key of ours (`known`), a key of TRL or transformers
    (`TRL_KEYS`, `<...>` standing for one segment; an evaluation row's `eval_` prefix removed), or a key of a
    namespace of the user's own (`NAME/...`, NAME not one of `NAMESPACES`)."""
    key = key.removeprefix("eval_")
    if key.startswith(f"{PREFIX}/"):
        return known(key)
    parts = key.split("/")
    if len(parts) > 1 and parts[0] not in NAMESPACES:
        return True
    return any(len(p) == len(parts) and all(a == b or (a.startswith("<") and b) for a, b in zip(p, parts))
               for p in (pattern.split("/") for pattern in TRL_KEYS))


def render() -> str:
    """The table as markdown (docs/metrics.md, "Every key")."""
    lines = ["| key | present when | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | {info.present} | {info.meaning} |" for key, info in (TABLE | ROUTE_LAYER_ROWS | STALENESS_ROWS
                                                                              | BY_POSITION_ROWS).items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
