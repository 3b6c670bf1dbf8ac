"""The nearest key of verl, TRL, prime-rl and NeMo-RL for every `ratio/*` key (`grpo_ratio.diagnostics.metric_keys.TABLE`).

"Nearest" means: the key a user of that trainer would read for the same question, on the same pair of policies where
the peer has it. Where the definitions differ (after truncation instead of raw, all inner steps instead of the first,
probability units instead of log units, a different band) the cell says so in brackets. "–" = the peer logs nothing
close. Sources, all read in the peers' code (snapshots of 2026-08, TRL 1.16.0): verl
`verl/trainer/ppo/rollout_corr_helper.py` (prefix `rollout_corr/`) and `verl/utils/debug/metrics.py`; TRL
`trl/trainer/grpo_trainer.py`, and TRL PR #5243 (open; its maintainers agreed to it in #5231), which adds
`sampling/raw_importance_sampling_ratio/{min,mean,max}` (the IS ratio before truncation or masking) and
`sampling/frac_modified_importance_sampling_ratio` (the share of weights the truncation or mask changed): where those
are the nearest TRL names they are given, marked "PR #5243", with 1.16's key beside them; prime-rl `src/prime_rl/trainer/` (`mismatch_kl/all` is k3 of the sampler against the
trainer); NeMo-RL `nemo_rl/algorithms/loss/loss_functions.py` (`gen_kl_error` with its default
`reference_policy_kl_type: k3`) and `nemo_rl/algorithms/grpo.py`. docs/metrics.md renders the table
(`python -m grpo_ratio.analysis.metric_peers`); tests/test_metric_keys.py checks it covers every key of the table.
"""

from __future__ import annotations

from ..diagnostics import metric_keys as keys


_ = "–"
RC = "rollout_corr/"  # verl's prefix
RAW = "sampling/raw_importance_sampling_ratio"  # TRL PR #5243 (open): the IS ratio before truncation/masking
MODIFIED = "`sampling/frac_modified_importance_sampling_ratio` (PR #5243)"  # the share truncated or masked

# family stat -> (verl, TRL, prime-rl, NeMo-RL), for new/old at the first inner step
_NEW_OLD = {
    "num_tokens": (_, _, _, _),
    "oob_rate": ("`actor/pg_clipfrac` (ε band, every inner step)", "`clip_ratio/region_mean` (ε band, with A's sign)",
                 "– (no old pass)", _),
    "nonfinite_rate": (_, _, _, _),
    "mean_abs_log_ratio": (_, _, _, _),
    "mean": (_, _, _, "`probs_ratio` (every inner step)"),
    "p1": (_, _, _, "`probs_ratio_min` (the min)"),
    "p50": (_, _, _, _),
    "p99": (_, _, _, "`probs_ratio_max` (the max)"),
    "kl_k1": ("`actor/ppo_kl` (every inner step); slime `train/ppo_kl`", _, _, _),
    "kl_k2": (_, _, _, _),
    "kl_k3": (_, _, _, _),
    "kl_k3_clamped": (_, _, _, _),
    "chi2_token": (_, _, _, _),
    "log_ppl_diff": (_, _, _, _),
    "log_ppl_abs_diff": (_, _, _, _),
    "ppl_ratio": (_, _, _, _),
    "chi2_seq": (_, _, _, _),
}

# family stat -> peers, for old/sampler (raw: before any truncation of the IS weight)
_OLD_SAMPLER = {
    "num_tokens": (_, _, _, _),
    "oob_rate": (f"`{RC}rollout_is_ratio_fraction_high` + `_low` (vs the IS bounds)", _,
                 "`is_masked` (vs its mask bounds)", "`is_oob_ratio` (vs the TIS bounds)"),
    "nonfinite_rate": (_, _, _, _),
    "mean_abs_log_ratio": ("`training/rollout_probs_diff_mean` (probability units)",
                           "`sampling/sampling_logp_difference/mean` (mean of per-process means)", _,
                           "`token_mult_prob_error` (mean of exp\\|Δ\\|)"),
    "mean": (f"`{RC}rollout_is_mean` (after truncation)", f"`{RAW}/mean` (PR #5243, token ratios); 1.16: "
             "`sampling/importance_sampling_ratio/mean` (after truncation)", _,
             "`sampling_importance_ratio` (after truncation)"),
    "p1": (f"`{RC}rollout_is_min` (the min)", f"`{RAW}/min` (PR #5243, the min); 1.16: "
           "`sampling/importance_sampling_ratio/min` (after truncation)", _, _),
    "p50": (_, _, _, _),
    "p99": (f"`{RC}rollout_is_max` (the max)", f"`{RAW}/max` (PR #5243, the max); 1.16: "
            "`sampling/importance_sampling_ratio/max` (after truncation)", _, _),
    "kl_k1": (f"`{RC}kl`", _, _, _),
    "kl_k2": (f"`{RC}rollout_rs_token_k2_mean` (with that rule on)", _, _, _),
    "kl_k3": (f"`{RC}k3_kl`", _, "`mismatch_kl/all`", "`gen_kl_error`"),
    "kl_k3_clamped": (_, _, _, _),  # miles `train_rollout_kl` (PR #1067; the ratio taken q/p): see docs/metrics.md
    "chi2_token": (f"`{RC}chi2_token`", _, _, _),
    "log_ppl_diff": (f"`{RC}log_ppl_diff`", _, _, _),
    "log_ppl_abs_diff": (f"`{RC}log_ppl_abs_diff`", _, _, _),
    "ppl_ratio": (f"`{RC}ppl_ratio`", _, _, _),
    "chi2_seq": (f"`{RC}chi2_seq`", _, _, _),
}

_SINGLE = {
    keys.KEPT_MASS_MEAN: (_, _, _, _),
    keys.KEPT_SET_ADDED_RATE: (_, _, _, _),
    keys.IS_WEIGHTS_MIN: (f"`{RC}rollout_is_min`", "`sampling/importance_sampling_ratio/min`", _, _),
    keys.IS_WEIGHTS_MEAN: (f"`{RC}rollout_is_mean`", "`sampling/importance_sampling_ratio/mean`", _,
                           "`sampling_importance_ratio`"),
    keys.IS_WEIGHTS_MAX: (f"`{RC}rollout_is_max`", "`sampling/importance_sampling_ratio/max`", _, _),
    keys.FP16_FALLBACK_ROWS: (_, _, _, _),
    keys.CLIP_FLIP_RATE: (_, _, _, _),
    keys.CLIP_FLIP_RATE_ADV_WEIGHTED: (_, _, "`masked_advantage_{positive,negative}` (DPPO masks)", _),
    keys.IS_TRUNCATED_TOKEN_FRAC: (f"`{RC}rollout_is_ratio_fraction_high` + `_low`", f"{MODIFIED} (truncate modes)",
                                   _, "`is_oob_ratio` (tis)"),
    keys.IS_TRUNCATED_SEQ_FRAC: (f"`{RC}rollout_is_seq_fraction_high` + `_low`", _, _, _),
    keys.IS_MASKED_TOKEN_FRAC: (f"`{RC}rollout_is_oob_ratio` (IcePop)", f"{MODIFIED} (mask modes)", "`is_masked`",
                                "`is_oob_ratio` (icepop)"),
    keys.IS_MASKED_SEQ_FRAC: (_, _, _, "`is_oob_ratio` (seq-mask-tis)"),
    keys.IS_REJECTED_TOKEN_FRAC: (f"`{RC}rollout_rs_masked_fraction`", _, "`is_masked` (DPPO)", _),
    keys.IS_REJECTED_SEQ_FRAC: (f"`{RC}rollout_rs_seq_masked_fraction`", _, _, _),
    keys.IS_WEIGHT_ESS: (f"`{RC}rollout_is_eff_sample_size`", _, _, _),
    keys.IS_WEIGHT_MEAN: (f"`{RC}rollout_is_mean`", "`sampling/importance_sampling_ratio/mean`", _,
                          "`sampling_importance_ratio`"),
    keys.IS_ZERO_WEIGHT_TOKEN_FRAC: (_, _, _, _),
    keys.IS_WEIGHT_RAW_P1: (f"`{RC}rollout_is_min` (raw for sequence IS)", f"`{RAW}/min` (PR #5243, the min)", _, _),
    keys.IS_WEIGHT_RAW_P50: (_, _, _, _),
    keys.IS_WEIGHT_RAW_P99: (f"`{RC}rollout_is_max` (raw for sequence IS)", f"`{RAW}/max` (PR #5243, the max)", _, _),
    keys.FULL_KL: (_, _, _, _),  # no peer logs a full-vocabulary divergence (SkyRL#2201 asks for one)
    keys.FULL_REVERSE_KL: (_, _, _, _),
    keys.FULL_TV: (_, _, _, _),
    keys.TRUST_REGION_MASKED_FRAC: ("`actor/pg_clipfrac` (dppo_tv / dppo_kl: the masked share)", _,
                                    "`is_masked` (its DPPO mask, against the sampler)", _),
    keys.ROLLOUT_COPY_SECONDS: (_, _, _, _),
    keys.CENTERING_DRIFT_TV: (_, _, _, _),
    keys.CENTERING_TAIL_MASS: (_, _, _, _),
    keys.CENTERING_FRESH_FRAC: (_, _, _, _),
}


def _family_rows(family: keys.RatioFamily, stats: dict) -> dict[str, tuple[str, ...]]:
    return {f"{family.prefix}/{stat}": peers for stat, peers in stats.items()}


PEERS: dict[str, tuple[str, str, str, str]] = {
    **_family_rows(keys.NEW_OLD, _NEW_OLD),
    **_family_rows(keys.OLD_SAMPLER, _OLD_SAMPLER),
    **{key: (_, _, _, _) for key in keys.OLD_SAMPLER_CORRECTED.keys()},  # nobody logs the corrected ratio
    **_SINGLE,
    # no peer logs routing agreement (TensorRT-LLM#19501 asks for a per-layer one; prime-rl's `routing_confidence`,
    # #2545, is the router's own confidence, not agreement between two passes)
    **{key: (_, _, _, _) for key in keys.ROUTE_KEYS},
    # no peer splits the mismatch into causes per step (the batch-logprob-gap report and Hugging Face's write-up do
    # it offline)
    **{key: (_, _, _, _) for key in keys.ATTRIBUTION_KEYS},
    # no peer logs the gap by position or a bias/noise split (tunix PR #2129 is a work in progress, with no key yet)
    **{key: (_, _, _, _) for key in keys.BY_POSITION_SEQ_KEYS},
}


def render() -> str:
    """The table as markdown (docs/metrics.md, "The same quantities in other trainers")."""
    lines = ["| `ratio/*` key | verl | TRL 1.16 | prime-rl | NeMo-RL |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| `{key}` | " + " | ".join(PEERS[key]) + " |" for key in keys.TABLE]
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
