"""The IS correction in the real trainer on the `generate` path: each setting trains, the weight TRL's loss used equals
a direct computation from the batch's own log-probs, and TRL's own multiplication applies it.

Run: pytest tests/test_is_training.py
"""

import inspect
import math

import pytest
import torch
from trainer_fixtures import tiny_trainer
from trl import GRPOTrainer

from grpo_ratio import RatioGRPOConfig
from grpo_ratio.corrections.is_correction import PRESETS, importance_weights
from grpo_ratio.diagnostics.mismatch import full_vocab_divergence
from grpo_ratio.diagnostics.ratio_diagnostics import FULL_VOCAB_KEYS
from grpo_ratio.diagnostics.ratios import valid_token_mask
from grpo_ratio.old_pass.scorer import OldLogprobScorer
from grpo_ratio.testing import tiny_model


# every preset, and a custom setting that uses every part (geometric weight, a token and a sequence rule, the veto)
CUSTOM = dict(is_correction="custom", is_correction_level="sequence_geometric", is_correction_action="truncate",
              is_correction_high=1.5, is_correction_rejection="token_k2<=0.5, seq_max_k3<=1.0", is_correction_veto=1e-3)
SETTINGS = [pytest.param({"is_correction": name}, id=name) for name in PRESETS] + [pytest.param(CUSTOM, id="custom")]


def test_trl_compute_loss_reads_the_weight_only_behind_the_vllm_gate():
    # the wrap opens `use_vllm and vllm_importance_sampling_correction` for TRL's `_compute_loss` call only: valid as
    # long as nothing else in that method (or the log-prob helper it calls) reads the two
    loss_src = inspect.getsource(GRPOTrainer._compute_loss)
    gate = [line.strip() for line in loss_src.splitlines() if "self.use_vllm" in line]
    assert gate == ['if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":']
    assert loss_src.count("vllm_importance_sampling_correction") == 1
    assert 'per_token_loss = per_token_loss * inputs["importance_sampling_ratio"]' in loss_src
    helper = inspect.getsource(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "use_vllm" not in helper and "vllm_importance_sampling" not in helper


def _spy_trl_loss(monkeypatch):
    """Record, for every call of TRL's own `_compute_loss`, the inputs as the loss read them (the IS weight joins them
    during the training forward where that forward is reused as the old log-probs, issue 43), whether its IS gate was
    open, and the old log-probs the loss used (the batch's, else the training forward's, detached, as TRL takes them)."""
    calls = []
    original = GRPOTrainer._compute_loss

    def spy(self, model, inputs):
        gate = self.use_vllm and self.vllm_importance_sampling_correction
        loss = original(self, model, inputs)
        micro_batch = self._micro_batch  # None where a test calls TRL's method itself
        old = inputs.get("old_per_token_logps", None if micro_batch is None else micro_batch.train_logps)
        calls.append(({**inputs, "old_per_token_logps": old}, gate))
        return loss

    monkeypatch.setattr(GRPOTrainer, "_compute_loss", spy)
    return calls


# top_p=0.8 without a truncation correction: old/sampler is the kept mass, about 0.8 on every token of the random
# tiny model, so the length-invariant rejections (geometric ratio < 0.99, mean k1 > 0.001, mean k3 > 0.01) drop every
# sequence; token TIS (cap 2), IcePop ([0.5, 5]) and NeMo-RL's 1.5 error bound keep every token
REJECT_ALL = ("seq_mask_tis", "geo_rs", "geometric_mask", "k3_rs", "k3_rs_token_tis")


@pytest.mark.parametrize("overrides", SETTINGS)
def test_each_setting_trains_on_generate_and_the_loss_uses_its_weight(tmp_path, monkeypatch, overrides):
    calls = _spy_trl_loss(monkeypatch)
    trainer = tiny_trainer(tmp_path, max_steps=2, top_p=0.8, **overrides)
    correction = trainer.args.is_correction_spec
    trainer.train()
    assert trainer.state.global_step == 2 and len(calls) == 2
    for inputs, gate_open in calls:
        assert gate_open and not trainer.use_vllm  # opened for TRL's call only
        mask = inputs["completion_mask"].bool()
        # direct computation from the batch's own log-probs: old (the training forward's, reused) minus the sampler's
        expected = importance_weights(inputs["old_per_token_logps"] - inputs["sampler_per_token_logps"], mask,
                                      correction, inputs["sampler_per_token_logps"], inputs["advantages"]).weights
        got = inputs["importance_sampling_ratio"]
        assert got.shape == ((4, 1) if correction.sequence_level else (4, 8))
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    rows = [r for r in trainer.state.log_history if "loss" in r]
    for row in rows:
        assert 0.0 <= row["ratio/is_weight_ess"] <= 1.0 and math.isfinite(row["ratio/old_sampler/kl_k3"])
        assert ("ratio/is_rejected_token_frac" in row) == bool(correction.rejections or correction.veto)
        assert ("ratio/is_weight_raw/p50" in row) == (correction.level != "none")
        assert not any("/full_" in k for k in row)  # bf16: no pass holds two distributions
        assert 0.75 < row["ratio/old_sampler/mean"] < 0.85  # the kept mass
        if overrides["is_correction"] in REJECT_ALL:  # every weight 0: TRL's loss is exactly 0
            assert row["ratio/is_rejected_seq_frac"] == 1.0 and row["loss"] == 0.0
        elif overrides["is_correction"] in ("tis", "icepop"):  # every token keeps its raw weight, the kept mass
            assert row["ratio/is_weight_mean"] == pytest.approx(row["ratio/old_sampler/mean"], abs=1e-6)
            assert row.get("ratio/is_truncated_token_frac", 0.0) == row.get("ratio/is_masked_token_frac", 0.0) == 0.0
        elif overrides["is_correction"] == "seq_logprob_error":  # mean exp|log r| = 1.25 < 1.5: weight 1 kept
            assert row["ratio/is_weight_mean"] == 1.0 and row["ratio/is_rejected_token_frac"] == 0.0


def test_trls_own_multiplication_applies_the_weight(tmp_path, monkeypatch):
    # one micro-batch of a real run: TRL's loss is linear in the weight (dapo, beta = 0), so doubling it doubles
    # the loss and zeroing it gives 0; without the wrap TRL 1.16 ignores the weight on the generate path
    calls = _spy_trl_loss(monkeypatch)
    trainer = tiny_trainer(tmp_path, max_steps=1, is_correction="tis")
    trainer.train()
    inputs = calls[0][0]
    model = trainer.model

    def loss(weight, wrapped=True):
        batch = {**inputs, "importance_sampling_ratio": weight}
        with torch.no_grad():
            return (trainer._compute_loss if wrapped else lambda m, b: GRPOTrainer._compute_loss(trainer, m, b))(
                model, batch).item()

    ones = torch.ones_like(inputs["importance_sampling_ratio"])
    base = loss(ones)
    assert base != 0.0
    assert loss(2 * ones) == pytest.approx(2 * base, rel=1e-5)
    assert loss(0 * ones) == 0.0
    assert loss(2 * ones, wrapped=False) == pytest.approx(base, rel=1e-6)  # stock TRL without vLLM: not applied
    assert not trainer.use_vllm  # the gate was closed again


def test_settings_are_validated(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="allowed: trl_sequence_mask"):
        RatioGRPOConfig(**base, is_correction="tiss")
    with pytest.raises(ValueError, match="only applies with is_correction='custom'"):
        RatioGRPOConfig(**base, is_correction="tis", is_correction_high=3.0)
    with pytest.raises(ValueError, match="old_logprob_mode='sampler'"):
        RatioGRPOConfig(**base, is_correction="tis", old_logprob_mode="sampler")
    with pytest.raises(ValueError, match="record_sampler_logprobs=True"):
        RatioGRPOConfig(**base, is_correction="tis", record_sampler_logprobs=False)
    with pytest.raises(ValueError, match="vespo"):
        RatioGRPOConfig(**base, is_correction="trl_sequence_mask", loss_type="vespo")
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode would be unused"):
        RatioGRPOConfig(**base, is_correction="tis", use_vllm=True, vllm_importance_sampling_mode="token_mask")
    with pytest.raises(ValueError, match="needs vllm_importance_sampling_correction=True"):
        RatioGRPOConfig(**base, is_correction="tis", use_vllm=True, vllm_importance_sampling_correction=False)
    with pytest.raises(ValueError, match="only the scopes each, first"):
        RatioGRPOConfig(**base, ratio_gate=["mean:ratio/new_old/oob_rate<1"])
    assert RatioGRPOConfig(**base, ratio_gate="reward>0").ratio_gate == ["reward>0"]
    with pytest.raises(ValueError, match="num_beams=2"):
        tiny_trainer(tmp_path, is_correction="icepop", generation_kwargs={"num_beams": 2})


def test_the_ratio_gate_field_stops_training(tmp_path):
    trainer = tiny_trainer(tmp_path, max_steps=3, ratio_gate=["ratio/new_old/num_tokens<1"], ratio_gate_action="stop")
    with pytest.warns(UserWarning, match="stopping training"):
        trainer.train()
    assert trainer.state.global_step == 1


def test_full_vocabulary_divergence_from_the_scoring_pass(tmp_path):
    # fp32_clone under bf16 training: the old pass holds the fp32 distribution, the policy's own pass the bf16 one;
    # the trainer's per-token KL / TV equal a direct computation from two independent forwards
    trainer = tiny_trainer(tmp_path, "fp32_clone", max_steps=1, ratio_full_vocab=True)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    out = trainer._generate_and_score_completions(batch)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    T = out["completion_ids"].size(1)
    ref = tiny_model("qwen2")  # the same seed-0 weights, untouched
    with torch.no_grad():
        old = ref(input_ids=ids, attention_mask=mask, logits_to_keep=T + 1).logits[:, :-1]  # fp32
        with torch.autocast("cpu", dtype=torch.bfloat16):
            policy = ref(input_ids=ids, attention_mask=mask, logits_to_keep=T + 1).logits[:, :-1]
    expected = full_vocab_divergence(policy, old)
    valid = out["completion_mask"].bool()
    for key, want in zip(FULL_VOCAB_KEYS, expected, strict=True):
        assert (out[key] - want)[valid].abs().max() <= 1e-5, key
    assert (expected[2][valid] > 0).all()  # bf16 vs fp32 differ on every token of this model
    with pytest.raises(ValueError, match="ratio_full_vocab=True compares a scoring mode"):
        tiny_trainer(tmp_path, "bf16", ratio_full_vocab=True)
    with pytest.raises(ValueError, match="ratio_full_vocab=True compares a scoring mode"):
        tiny_trainer(tmp_path, "sampler", ratio_full_vocab=True)


def _direct_full_vocab(policy_logits, old_logits, valid, temperature):
    """Token means over `valid` (B, T) of KL(old||policy), KL(policy||old) and TV, in fp64 from (B, T, V) logits."""
    lp = torch.log_softmax(policy_logits.double() / temperature, dim=-1)  # (B, T, V)
    lq = torch.log_softmax(old_logits.double() / temperature, dim=-1)  # (B, T, V)
    kl = (lq.exp() * (lq - lp)).sum(-1)  # (B, T)
    reverse = (lp.exp() * (lp - lq)).sum(-1)  # (B, T)
    tv = 0.5 * (lq.exp() - lp.exp()).abs().sum(-1)  # (B, T)
    return [x[valid].mean().item() for x in (kl, reverse, tv)]


def test_logged_full_vocabulary_divergence_equals_the_two_passes_logits(tmp_path, monkeypatch):
    # a real run of 2 optimizer steps on one generation (num_iterations=2): the spy keeps the logits the scoring pass
    # read, the mode's (fp32 copy) and the policy's own (bf16 autocast), materialised here from the hidden states and
    # head maps the pass held (it never builds them whole); the logged ratio/new_old/full_* of step 1 are their token
    # means over the valid tokens, to 1e-6; step 2 (second inner step, no old pass) logs none of them
    seen = {"old": [], "policy": [], "valid": []}
    full, as_trained = OldLogprobScorer._chunk_full, OldLogprobScorer._head_as_trained

    def spy_full(self, input_ids, attention_mask, logits_to_keep, temperature, version):
        result = full(self, input_ids, attention_mask, logits_to_keep, temperature, version)
        seen["old"].append(result[2].materialize().detach().clone())  # (b, T, V)
        seen["valid"].append(valid_token_mask(input_ids[:, -logits_to_keep:], attention_mask[:, -logits_to_keep:],
                                              trainer.eos_token_ids))  # (b, T)
        return result

    def spy_trained(self, input_ids, attention_mask, logits_to_keep):
        head = as_trained(self, input_ids, attention_mask, logits_to_keep)
        seen["policy"].append(head.logits().materialize().detach().clone())  # (b, T, V)
        return head

    monkeypatch.setattr(OldLogprobScorer, "_chunk_full", spy_full)
    monkeypatch.setattr(OldLogprobScorer, "_head_as_trained", spy_trained)
    trainer = tiny_trainer(tmp_path, "fp32_clone", max_steps=2, num_iterations=2, ratio_full_vocab=True)
    trainer.train()
    assert len(seen["old"]) == len(seen["policy"]) == 1  # one generation, one chunk of 4 rows
    old, policy, valid = (torch.cat(seen[k]) for k in ("old", "policy", "valid"))
    assert policy.dtype == torch.bfloat16 and old.dtype == torch.float32 and valid.sum() == 32
    kl, reverse, tv = _direct_full_vocab(policy, old, valid, trainer.temperature)
    first, second = (r for r in trainer.state.log_history if "loss" in r)
    for key, want in zip(("full_kl", "full_reverse_kl", "full_tv"), (kl, reverse, tv), strict=True):
        # both the tolerance asked of every metric and a relative one: the KL is ~2.5e-7 nats here (bf16 vs fp32),
        # where fp32 math was 25% off (so mismatch.full_vocab_divergence works in fp64)
        error = abs(first[f"ratio/new_old/{key}"] - want)
        assert error <= 1e-6 and error <= 1e-5 * want, (key, first[f"ratio/new_old/{key}"], want)
    assert 0 < kl < 1e-5 and 1e-5 < tv < 1e-2
    assert not any(k.startswith("ratio/new_old/") for k in second)  # no first inner step in update 2


def test_an_all_masked_batch_logs_only_finite_values(tmp_path):
    # the random tiny model never ends a completion within 8 tokens: mask_truncated_completions masks every token.
    # With every new metric switched on (full vocabulary, a correction with bounds, rules and veto) the run trains,
    # the loss is finite and every logged ratio/* value is finite: the token counts are 0, the other keys absent
    trainer = tiny_trainer(tmp_path, "fp32_clone", max_steps=2, mask_truncated_completions=True,
                           ratio_full_vocab=True, **CUSTOM)
    with pytest.warns(UserWarning, match="no valid completion token"):
        trainer.train()
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2
    for row in rows:
        logged = {k: v for k, v in row.items() if k.startswith("ratio/")}
        assert all(math.isfinite(v) for v in logged.values()) and math.isfinite(row["loss"])
        assert logged["ratio/new_old/num_tokens"] == 0.0
        assert not any("full_" in k or "kl_k" in k or k.startswith("ratio/is_weight") for k in logged)


def test_rejection_keeps_the_tokens_once_truncation_is_corrected(tmp_path):
    # the same top_p=0.8 run as above with renormalize: old/sampler is back near 1, and verl's Geo-RS bound
    # (mean k1 within +-0.001) keeps every sequence instead of rejecting all of them
    trainer = tiny_trainer(tmp_path, max_steps=2, top_p=0.8, truncation_correction="renormalize", is_correction="geo_rs")
    trainer.train()
    for row in (r for r in trainer.state.log_history if "loss" in r):
        assert abs(row["ratio/old_sampler_corrected/mean"] - 1.0) < 1e-3
        assert row["ratio/is_rejected_seq_frac"] == 0.0 and row["ratio/is_weight_mean"] == 1.0
