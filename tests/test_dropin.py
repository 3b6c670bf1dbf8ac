"""Drop-in fidelity: RatioGRPOTrainer keeps TRL's behaviour wherever the user did not ask for a change, and its old
log-probs stay right in the cases TRL users meet (second `train()`, resume, dropout, PEFT beyond LoRA, sampling
settings from the model, left padding with absolute positions, nothing valid to measure).

The classes of failure TRL's own `tests/test_grpo_trainer.py` found (a replaced `generate`, beam search through
`generation_kwargs`, every completion masked) are here on tiny models, so they never come back.

Run: pytest tests/test_dropin.py
"""

import copy
import warnings
from unittest.mock import patch

import pytest
import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from trainer_fixtures import tiny_trainer

from grpo_ratio.old_pass.copies import WeightsVersion, WeightsVersionCallback, merged_state_dict
from grpo_ratio.old_pass.scorer import OldLogprobScorer, completion_logprobs_from_logits
from grpo_ratio.testing import tiny_model


peft = pytest.importorskip("peft")


def _steps(trainer):
    return [row for row in trainer.state.log_history if "loss" in row]


# ---------------------------------------------------------------------------------------------------------------------
# TRL features that replace or reshape generation


def test_a_replaced_generate_trains_like_stock(tmp_path):
    # TRL's own tests patch GenerationMixin.generate; the recorder then sees nothing. The run must go on as stock
    # TRL would, with NaN sampler log-probs (old/sampler absent) and one warning, not a crash.
    def fake_generate(self, input_ids, **kwargs):
        completion = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 1]] * input_ids.size(0))  # 7 tokens then EOS (id 1)
        return torch.cat([input_ids, completion], dim=1)

    trainer = tiny_trainer(tmp_path, "fp32_clone", max_steps=1, mask_truncated_completions=True)
    with patch("transformers.generation.utils.GenerationMixin.generate", fake_generate):
        with pytest.warns(UserWarning, match="recorder did not see"):
            trainer.train()
    (row,) = _steps(trainer)
    assert row["ratio/new_old/num_tokens"] == 32.0  # 4 completions x 8 tokens, EOS included, all valid
    assert not any(k.startswith("ratio/old_sampler/") for k in row)


def test_beam_search_through_generation_kwargs_trains(tmp_path):
    # generation_kwargs={"num_beams": 2}: no per-token sampling distribution, so nothing is recorded (warned).
    with pytest.warns(UserWarning, match="not recording"):
        trainer = tiny_trainer(tmp_path, "bf16", max_steps=1,
                               generation_kwargs={"do_sample": True, "top_k": 50, "num_beams": 2})
    trainer.train()
    (row,) = _steps(trainer)
    assert row["ratio/new_old/oob_rate"] == 0.0 and "ratio/old_sampler/num_tokens" not in row


def test_beam_search_with_a_correction_is_refused(tmp_path):
    with pytest.raises(ValueError, match="num_beams=2"):
        tiny_trainer(tmp_path, "bf16", top_p=0.8, truncation_correction="renormalize",
                     generation_kwargs={"num_beams": 2})


def test_every_completion_masked_logs_zero_tokens(tmp_path):
    # The random tiny model never emits EOS in 8 tokens, so mask_truncated_completions masks everything.
    trainer = tiny_trainer(tmp_path, "fp32_clone", max_steps=2, mask_truncated_completions=True)
    with pytest.warns(UserWarning, match="no valid completion token") as record:
        trainer.train()
    assert sum("no valid completion token" in str(w.message) for w in record) == 1  # warned once, not per step
    rows = _steps(trainer)
    assert [row["ratio/new_old/num_tokens"] for row in rows] == [0.0, 0.0]
    assert all(not any(k.startswith("ratio/") and k != "ratio/new_old/num_tokens" for k in row) for row in rows)


# ---------------------------------------------------------------------------------------------------------------------
# copies refreshed whenever the weights changed, and only then


def _check_copies_at_every_old_pass(monkeypatch, trainer):
    """Wrap the scorer so that every old pass records whether each copy equals the policy's current weights."""
    seen = []
    original = OldLogprobScorer.score

    def checked(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        policy = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        for c in self.copies():
            seen.append(all(torch.equal(policy[k].to(c.dtype), v) for k, v in c.module.state_dict().items()))
        return result

    monkeypatch.setattr(OldLogprobScorer, "score", checked)
    return seen


def test_second_train_and_resume_refresh_the_copy(tmp_path, monkeypatch):
    trainer = tiny_trainer(tmp_path, "fp16_clone", max_steps=2, save_strategy="steps", save_steps=1)
    seen = _check_copies_at_every_old_pass(monkeypatch, trainer)
    trainer.train()  # old passes before steps 1 and 2
    trainer.train()  # global_step restarts at 0 but the weights went on: the copy must follow them
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))  # weights go back to step 1's
    assert seen == [True] * 5  # 2 + 2 + 1 old passes, each with a copy equal to the policy


def test_weights_version_moves_on_applied_optimizer_steps_only():
    # The trainer's callback moves the version at train start and after every optimizer step accelerate applied;
    # a step the loss scaler skipped (inf gradients) leaves the weights, and the version, as they were.
    accelerator = Accelerator(cpu=True)
    # accelerate's wrapper with the loss scaler it attaches under fp16 on a GPU (none on a CPU), registered as
    # `prepare` registers it
    model = torch.nn.Linear(2, 2)
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters()), scaler=torch.amp.GradScaler("cpu"))
    accelerator._optimizers.append(optimizer)
    version = WeightsVersion()
    callback = WeightsVersionCallback(version, accelerator)
    callback.on_train_begin(None, None, None)
    assert version.value == 1
    for overflow, expected in ((False, 2), (True, 2), (False, 3)):
        optimizer.zero_grad()
        optimizer.scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        if overflow:
            model.weight.grad.fill_(float("inf"))
        optimizer.step()
        callback.on_optimizer_step(None, None, None)
        assert accelerator.optimizer_step_was_skipped == overflow
        assert version.value == expected


# ---------------------------------------------------------------------------------------------------------------------
# dropout, PEFT adapters beyond plain LoRA


def test_dropout_never_reaches_the_old_pass_and_is_warned(tmp_path):
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.5)
    with pytest.warns(UserWarning, match="disable_dropout=True"):
        trainer = tiny_trainer(tmp_path, "fp32_clone", model=tiny_model("qwen2"), peft_config=config, bf16=False)
    trainer.model.train()  # TRL trains with dropout on (disable_dropout=False)
    ids = torch.randint(2, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    first, second = (trainer.scorer.score(ids, mask, 6).logps for _ in range(2))
    assert torch.equal(first, second)  # deterministic: a function of weights and tokens
    assert trainer.model.training  # the policy's own mode is restored


def _peft_model(config, dtype=torch.float32):
    model = peft.get_peft_model(tiny_model("qwen2", dtype=dtype), config)
    with torch.no_grad():  # adapters start as the identity; make them count
        for name, p in model.named_parameters():
            if any(t in name for t in ("lora_", "ia3_", "hada_", "lokr_", "modules_to_save")):
                p.add_(0.05 * torch.randn_like(p))
    return model


ADAPTERS = {
    "lora": lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "dora": lambda: peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True),
    "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "loha": lambda: peft.LoHaConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "lokr": lambda: peft.LoKrConfig(r=4, target_modules=["q_proj", "v_proj"]),
    "lora+modules_to_save": lambda: peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]),
}


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_copy_equals_pefts_own_merge(adapter):
    model = _peft_model(ADAPTERS[adapter]())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    reference = copy.deepcopy(model).merge_and_unload().state_dict()  # PEFT's own merge
    merged = merged_state_dict(model)
    assert set(merged) == set(reference)
    assert max((merged[k].float() - reference[k].float()).abs().max().item() for k in reference) <= 1e-6
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the policy is untouched


@pytest.mark.parametrize("adapter", ["dora", "lora+modules_to_save"])
@pytest.mark.parametrize("mode", ["fp16_clone", "fp32_clone"])
def test_scoring_with_merged_adapters(adapter, mode):
    # bf16-stored weights: both modes score a merged copy. Reference: PEFT's merge, in fp32, scored directly.
    model = _peft_model(ADAPTERS[adapter](), dtype=torch.bfloat16)
    ids = torch.randint(2, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    logps = OldLogprobScorer(model, mode).score(ids, mask, 4).logps  # (3, 4)
    reference = copy.deepcopy(model).float().merge_and_unload()
    with torch.no_grad():
        logits = reference(input_ids=ids, attention_mask=mask, logits_to_keep=5).logits
    tolerance = 1e-5 if mode == "fp32_clone" else 2e-2  # fp16 arithmetic vs the fp32 reference
    assert (logps - completion_logprobs_from_logits(logits, ids[:, -4:], 1.0)).abs().max() <= tolerance


# ---------------------------------------------------------------------------------------------------------------------
# sampling settings the model ships, positions under left padding


def test_sampling_settings_from_the_models_generation_config(tmp_path):
    # The model ships min_p: generate truncates although the config does not ask for it.
    model = tiny_model("qwen2")
    model.generation_config.min_p = 0.5
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = tiny_trainer(tmp_path, "bf16", model=model, bf16=False, max_steps=1,
                               truncation_correction="renormalize")
    assert not any("has no effect" in str(w.message) for w in caught)
    assert trainer.sampling.min_p == 0.5 and trainer.sampling.truncated
    trainer.train()
    (row,) = _steps(trainer)
    assert row["ratio/kept_mass_mean"] < 0.99  # the kept sets were recorded and corrected
    assert row["ratio/old_sampler_corrected/mean"] == pytest.approx(1.0, abs=1e-4)


def test_truncation_from_the_model_without_correction_is_warned(tmp_path):
    model = tiny_model("qwen2")
    model.generation_config.min_p = 0.5
    with pytest.warns(UserWarning, match=r"min_p=0\.5, from the generation config"):
        tiny_trainer(tmp_path, "bf16", model=model)


@pytest.mark.parametrize("mode", ["fp32_clone", "fp16_clone"])
def test_left_padding_never_changes_a_logprob_with_absolute_positions(mode):
    # GPT-2 adds learned position embeddings: positions must be counted from the attention mask, as generate does.
    model = tiny_model("gpt2")
    ids = torch.randint(2, 300, (1, 12), generator=torch.Generator().manual_seed(0))  # 6 prompt + 6 completion

    def left_padded(pads):
        return (torch.cat([torch.zeros(1, pads, dtype=torch.long), ids], 1),
                torch.cat([torch.zeros(1, pads, dtype=torch.long), torch.ones_like(ids)], 1))

    scorer = OldLogprobScorer(model, mode)
    logps = [scorer.score(*left_padded(pads), 6).logps for pads in (0, 3, 17)]
    # fp32: exact; fp16: only the rounding of another sequence length (1.3e-4 measured). Positions counted from 0
    # regardless of the mask (what TRL's own pass does) moved these log-probs by 0.36-0.38.
    tolerance = 0.0 if mode == "fp32_clone" else 1e-3
    assert max((x - logps[0]).abs().max().item() for x in logps) <= tolerance


def test_absolute_positions_are_warned(tmp_path):
    with pytest.warns(UserWarning, match="absolute position embeddings"):
        tiny_trainer(tmp_path, "fp32_clone", arch="gpt2")


# ---------------------------------------------------------------------------------------------------------------------
# nothing valid to measure: every public function takes empty input


def test_public_functions_accept_empty_input():
    from grpo_ratio.corrections import kept_logprobs as K
    from grpo_ratio.corrections.kept_sets import KeptSets
    from grpo_ratio.diagnostics import ratios as R

    logits = torch.randn(2, 3, 5)  # (B, T, V)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    nothing = torch.zeros(2, 3, dtype=torch.bool)  # no valid cell
    kept = KeptSets.from_mask(torch.ones(2, 3, 5, dtype=torch.bool))
    zeros = torch.zeros(2, 3)
    for sets in (kept, kept.size_only()):
        assert torch.equal(K.kept_set_logprobs(logits, tokens, sets, mask=nothing), zeros)
    assert K.is_top_prefix(logits, kept, mask=nothing).all()
    no_rows = KeptSets.from_lists([], 0)
    assert K.kept_set_logprobs(torch.randn(0, 0, 5), torch.zeros(0, 0, dtype=torch.long), no_rows).shape == (0, 0)
    assert kept.select_rows([]).num_rows == 0 and no_rows.resize_steps(3).sizes.shape == (0, 3)
    assert R.RatioStats().update(zeros, nothing).as_metrics("ratio/new_old") == {}
    assert R.clip_flips(zeros, zeros, torch.ones(2), nothing, 0.2, 0.2).as_metrics() == {}
    from grpo_ratio.corrections.is_correction import ISCorrection, importance_weights
    from grpo_ratio.diagnostics.mismatch import ISWeightStats, MismatchStats

    trl_default = ISCorrection.from_trl("sequence_mask", None, 3.0)
    assert ISWeightStats.of(trl_default).update(importance_weights(zeros, nothing, trl_default)).as_metrics() == {}
    assert MismatchStats().update(zeros, nothing).as_metrics("ratio/old_sampler") == {}


def test_a_copy_of_a_tied_model_keeps_one_embedding():
    from grpo_ratio.old_pass.copies import ModuleCopy

    model = tiny_model("llama", tie_word_embeddings=True)
    copy_ = ModuleCopy(model, torch.float16, whole_model=True)
    module = copy_.get(1)
    assert module.lm_head.weight is module.model.embed_tokens.weight
    embedding_bytes = model.model.embed_tokens.weight.numel() * 2  # fp16
    assert copy_.num_bytes() == sum(p.numel() for p in model.parameters()) * 2  # one embedding, not two
    assert embedding_bytes > 0 and torch.equal(module.lm_head.weight, model.lm_head.weight.half())


# ---------------------------------------------------------------------------------------------------------------------
# an MoE policy: routes measured by default, nothing TRL computes changes


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_defaults_equal_stock_trl_loss_metrics_and_checkpoints(tmp_path, arch):
    # the default routing_replay="none" measures the routes (ratio/route/*: hooks on every router, recording in
    # generate, TRL's old pass and the updates) and must leave TRL's loss, metrics and checkpoint bit for bit
    from safetensors.torch import load_file
    from trl import GRPOTrainer

    runs, checkpoints = [], []
    for cls in (GRPOTrainer, None):
        out = tmp_path / ("stock" if cls else "ratio")
        trainer = tiny_trainer(out, "bf16", model=tiny_model(arch), trainer_cls=cls, max_steps=3,
                               num_iterations=2, steps_per_generation=2, gradient_checkpointing=True,
                               save_strategy="steps", save_steps=3)
        trainer.train()
        runs.append([{k: v for k, v in row.items() if not k.startswith("ratio/") and k not in (
            "step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")}
            for row in trainer.state.log_history])
        checkpoints.append(load_file(str(out / "checkpoint-3" / "model.safetensors")))
    assert len(runs[0]) == 4 and runs[0] == runs[1]
    assert checkpoints[0].keys() == checkpoints[1].keys()
    assert all(torch.equal(checkpoints[0][k], checkpoints[1][k]) for k in checkpoints[0])
    routed = [row for row in trainer.state.log_history if "ratio/route/old_new/num_tokens" in row]
    assert routed and trainer.routing.active  # the routes were measured on the way
