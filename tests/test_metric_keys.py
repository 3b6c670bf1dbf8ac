"""The metric-key table (`grpo_ratio.diagnostics.metric_keys`) against what a real run emits and what docs/metrics.md lists.

Run: pytest tests/test_metric_keys.py
"""

import re
from pathlib import Path

from trainer_fixtures import tiny_trainer

from grpo_ratio.diagnostics import metric_keys as keys


METRICS_MD = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def _documented() -> tuple[set[str], set[str]]:
    """(full keys, family prefixes) named in backticks on docs/metrics.md: `ratio/x/y`, and `ratio/x/*` for a family
    (`ratio/*` is the whole namespace)."""
    names = set(re.findall(r"`(ratio/[a-z0-9_/*]+)`", METRICS_MD.read_text())) - {"ratio/*"}
    families = {n[: -len("/*")] for n in names if n.endswith("/*")}
    return {n for n in names if "*" not in n}, families


def test_a_real_run_emits_only_keys_of_the_table_and_of_the_docs(tmp_path):
    # fp16_clone with renormalize over recomputed kept sets: the richest CPU run (every family, kept mass, added rate,
    # fp16 fallback, clip flips); vLLM's IS keys need vLLM
    trainer = tiny_trainer(tmp_path, "fp16_clone", max_steps=1, top_p=0.8, truncation_correction="renormalize",
                           kept_set_source="recompute", ratio_full_vocab=True)
    trainer.train()
    emitted = {k for row in trainer.state.log_history for k in row if k.startswith(f"{keys.PREFIX}/")}
    documented, _ = _documented()
    assert {k for k in emitted if not keys.known(k)} == set()
    assert emitted - documented == set()
    expected = {*keys.NEW_OLD.keys(), *keys.OLD_SAMPLER.keys(), *keys.OLD_SAMPLER_CORRECTED.keys(),
                *keys.MISMATCH_KEYS, keys.KEPT_MASS_MEAN, keys.KEPT_SET_ADDED_RATE, keys.FP16_FALLBACK_ROWS,
                keys.CLIP_FLIP_RATE, keys.FULL_KL, keys.FULL_REVERSE_KL, keys.FULL_TV}
    assert expected <= emitted  # 47 keys: the check above ran on them


def test_an_is_correction_run_emits_only_keys_of_the_table_and_of_the_docs(tmp_path):
    # a custom correction with every part: the ratio/is_* keys of the IS weight (rejection, raw quantiles, ESS)
    trainer = tiny_trainer(tmp_path, max_steps=1, is_correction="custom", is_correction_level="token",
                           is_correction_action="mask", is_correction_low=0.5, is_correction_high=2.0,
                           is_correction_rejection="seq_mean_k3<=0.01")
    trainer.train()
    emitted = {k for row in trainer.state.log_history for k in row if k.startswith(f"{keys.PREFIX}/")}
    documented, _ = _documented()
    assert emitted - set(keys.TABLE) == set() and emitted - documented == set()
    assert {keys.IS_WEIGHT_ESS, keys.IS_WEIGHT_RAW_P50, keys.IS_MASKED_SEQ_FRAC, keys.IS_REJECTED_SEQ_FRAC,
            keys.IS_WEIGHTS_MEAN} <= emitted


def test_the_table_and_the_docs_list_the_same_keys():
    documented, families = _documented()
    assert set(keys.TABLE) - documented == set()
    assert documented - set(keys.TABLE) == set()
    assert families == {f.prefix for f in keys.FAMILIES} | {keys.ROUTE_PREFIX, keys.ATTRIBUTION_PREFIX,
                        keys.BY_POSITION_PREFIX}
    assert len(keys.TABLE) == (3 * len(keys.FAMILY_STATS) + 2 * len(keys.MISMATCH_STATS) + len(keys.SINGLE_KEYS)
                               + len(keys.ROUTE_KEYS) + len(keys.ATTRIBUTION_KEYS)
                               + len(keys.BY_POSITION_SEQ_KEYS)) == 75 + 20 + 13  # 75: with ratio/centering/*


def test_route_keys_of_an_moe_run_are_in_the_table_and_the_docs(tmp_path):
    # a tiny Qwen3-MoE with an old pass (num_iterations=2): both route pairs, per-layer keys included
    from grpo_ratio.testing import tiny_model

    trainer = tiny_trainer(tmp_path, "bf16", model=tiny_model("qwen3_moe"), max_steps=1, num_iterations=2)
    trainer.train()
    emitted = {k for row in trainer.state.log_history for k in row if k.startswith(f"{keys.PREFIX}/route/")}
    documented, _ = _documented()
    assert set(keys.ROUTE_KEYS) <= emitted
    assert {keys.route_key(p, f"layer_{i}") for p in keys.ROUTE_PAIRS for i in (0, 1)} <= emitted
    assert all(keys.known(k) for k in emitted) and set(keys.ROUTE_KEYS) <= documented
    assert not keys.known("ratio/route/old_new/layer_x") and not keys.known("ratio/route/other/any_layer")


def test_every_key_has_its_row_of_peer_keys():
    from grpo_ratio.analysis.metric_peers import PEERS

    assert set(PEERS) == set(keys.TABLE)
    assert all(len(row) == 4 and all(cell for cell in row) for row in PEERS.values())


def test_trl_pr_5243_names_are_the_nearest_trl_keys():
    # TRL PR #5243 (open): sampling/raw_importance_sampling_ratio/{min,mean,max} (before truncation) and
    # sampling/frac_modified_importance_sampling_ratio; the TRL column (index 1) names them where they are nearest
    from grpo_ratio.analysis.metric_peers import PEERS, render

    raw = "sampling/raw_importance_sampling_ratio"
    expected = {keys.OLD_SAMPLER.mean: f"{raw}/mean", keys.OLD_SAMPLER.p1: f"{raw}/min",
                keys.OLD_SAMPLER.p99: f"{raw}/max", keys.IS_WEIGHT_RAW_P1: f"{raw}/min",
                keys.IS_WEIGHT_RAW_P99: f"{raw}/max",
                keys.IS_TRUNCATED_TOKEN_FRAC: "sampling/frac_modified_importance_sampling_ratio",
                keys.IS_MASKED_TOKEN_FRAC: "sampling/frac_modified_importance_sampling_ratio"}
    for key, name in expected.items():
        assert f"`{name}`" in PEERS[key][1] and "PR #5243" in PEERS[key][1], key
    assert render().count("PR #5243") == len(expected)
    assert "sampling/frac_modified_importance_sampling_ratio" in METRICS_MD.read_text()  # the rendered docs table
