"""`fp32_head` with no pass of the body in TRL's on-policy default: each micro-batch's old log-probs are the fp32 norm and
head applied to its own training-forward hidden states (grpo_ratio/old_pass/fused_head.py). Counted and compared bitwise with
the separate pass; the fallback cases keep the separate pass and say why once.

Run: pytest tests/test_fused_head.py
"""

import contextlib
import logging

import pytest
import torch
from torch import nn
from trainer_fixtures import tiny_grpo_args, tiny_trainer

from grpo_ratio import RatioGRPOTrainer
from grpo_ratio.old_pass.fused_head import fused_head_fallback
from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer


class Counting(RatioGRPOTrainer):
    """Marks generation, so that `watch_body_passes` counts only the decoder forwards outside it."""

    @contextlib.contextmanager
    def _not_counted(self):
        self._generating = True
        try:
            yield
        finally:
            self._generating = False

    def _generate_single_turn(self, *args, **kwargs):
        with self._not_counted():  # generate's forwards are the rollouts, not old passes
            return super()._generate_single_turn(*args, **kwargs)


class Recording(Counting):
    """Keeps every micro-batch's old log-probs next to the separate pass's on the same rows (`OldLogprobScorer.score`,
    the pass the fallback runs); `force_separate` turns the fused path off."""

    force_separate = False

    def _fused_head_fallback(self):
        return "forced by the test" if self.force_separate else super()._fused_head_fallback()

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
        ids = torch.cat([prompt, completion], dim=1)  # (b, P+T)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (b, P+T)
        with torch.no_grad(), self._not_counted():
            separate = self.scorer.score(ids, mask, completion.size(1), temperature=self.temperature,
                                         version=self.weights_version.value).logps  # (b, T)
        self.pairs.append((inputs["old_per_token_logps"].clone(), separate))
        return loss


def watch_body_passes(trainer: Counting) -> Counting:
    """Count the decoder's forwards outside generation in `trainer.body_passes` ("grad" / "no_grad")."""
    trainer.pairs, trainer.body_passes, trainer._generating = [], {"grad": 0, "no_grad": 0}, False
    decoder = trainer.accelerator.unwrap_model(trainer.model).get_decoder()

    def count(module, args, output):
        if not trainer._generating:
            trainer.body_passes["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    decoder.register_forward_hook(count)
    return trainer


def recording(tmp_path, arch="qwen2", model=None, force_separate=False, **overrides):
    model = model if model is not None else tiny_model(arch)
    Recording.force_separate = force_separate
    return watch_body_passes(tiny_trainer(tmp_path, "fp32_head", trainer_cls=Recording, model=model, **overrides))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt_neox"])  # qwen2: the whole-run test below
def test_no_body_pass_and_bitwise_equal_to_the_separate_pass(tmp_path, arch):
    # on-policy default, 2 optimizer steps of 2 micro-batches each (gradient accumulation 2)
    trainer = recording(tmp_path, arch, gradient_accumulation_steps=2, per_device_train_batch_size=4,
                        steps_per_generation=2)
    assert trainer.plan.fused_head and trainer.plan.fused_head_fallback is None
    trainer.train()
    assert trainer.body_passes == {"grad": 4, "no_grad": 0}  # the 4 training forwards, no old pass of the body
    assert len(trainer.pairs) == 4
    for fused, separate in trainer.pairs:
        assert fused.dtype == torch.float32 and torch.equal(fused, separate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sampler_fp32_head_fuses_too(tmp_path, dtype):
    # fp32_head_operands="bf16" (issue 43 item 3): the policy's own norm and the sampler's head on the training
    # forward's norm input, no body pass, bitwise the separate pass; no fp32 copy of the norm or the head
    overrides = {} if dtype == torch.float32 else {"bf16": False}
    trainer = recording(tmp_path, "llama", model=tiny_model("llama", dtype=dtype), fp32_head_operands="bf16",
                        gradient_accumulation_steps=2, steps_per_generation=2, **overrides)
    assert trainer.plan.fused_head and trainer.scorer.head_operands == "bf16"
    trainer.train()
    assert trainer.body_passes == {"grad": 4, "no_grad": 0} and len(trainer.pairs) == 4
    for fused, separate in trainer.pairs:
        assert fused.dtype == torch.float32 and torch.equal(fused, separate)
    assert trainer.scorer.copies() == []
    rows = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)


def test_with_gradient_checkpointing_and_bf16_weights(tmp_path):
    # bf16-stored weights: the fp32 norm and head are copies, synced at the step's version; checkpointing recomputes
    # the layers in backward, the norm's input is captured once per forward
    trainer = recording(tmp_path, "llama", model=tiny_model("llama", dtype=torch.bfloat16), bf16=False,
                        gradient_checkpointing=True)
    trainer.train()
    assert trainer.body_passes["no_grad"] == 0 and len(trainer.pairs) == 2
    assert all(torch.equal(fused, separate) for fused, separate in trainer.pairs)
    assert {c.dtype for c in trainer.scorer.copies()} == {torch.float32}  # the norm's and the head's fp32 copies


def test_the_run_equals_the_separate_pass_run(tmp_path):
    # the same two steps with the separate old pass (scored on the unshuffled generation batch, as the fallback does):
    # the same old log-probs, so the same loss, metrics (ratio/* included) and weights, bit for bit
    runs = {}
    for separate in (False, True):
        trainer = recording(tmp_path / str(separate), "qwen2", force_separate=separate)
        trainer.train()
        runs[separate] = trainer
    fused, split = runs[False], runs[True]
    assert split.plan.fused_head_fallback == "forced by the test" and not split.plan.fused_head
    assert split.body_passes == {"grad": 2, "no_grad": 2} and fused.body_passes == {"grad": 2, "no_grad": 0}
    for (a, _), (b, _) in zip(fused.pairs, split.pairs, strict=True):
        assert torch.equal(a, b)
    drop = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time")
    history = lambda t: [{k: v for k, v in row.items() if k not in drop} for row in t.state.log_history]
    assert history(fused) == history(split)
    # new/old at the first inner step: the training forward's bf16 head over the fp32 head on the same body
    assert fused.state.log_history[0]["ratio/new_old/mean_abs_log_ratio"] > 1e-4
    for (name, p), q in zip(fused.model.named_parameters(), split.model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_evaluation_adds_no_forward_either(tmp_path):
    # evaluate(): TRL's loss forward runs without grad there; the fused fp32_head adds no decoder forward to it (the
    # same count as the bf16 arm, TRL's own numbers) and its old log-probs equal the separate pass's
    counts = {}
    for mode, cls in (("bf16", Counting), ("fp32_head", Recording)):
        Recording.force_separate = False
        args = tiny_grpo_args(tmp_path / mode, old_logprob_mode=mode, per_device_eval_batch_size=4)
        trainer = watch_body_passes(cls(model=tiny_model("qwen2"), reward_funcs=letter_reward, args=args,
                                        train_dataset=tiny_prompts(8), eval_dataset=tiny_prompts(1),
                                        processing_class=tiny_tokenizer()))
        trainer.evaluate()
        counts[mode] = trainer.body_passes
    assert counts["fp32_head"] == counts["bf16"] == {"grad": 0, "no_grad": 1}  # 1 prompt x 4 completions, 1 batch
    assert len(trainer.pairs) == 1 and torch.equal(*trainer.pairs[0])


def _fallback(tmp_path, caplog, model=None, **overrides):
    with caplog.at_level(logging.INFO, logger="grpo_ratio"):
        trainer = recording(tmp_path, model=model, **overrides)
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "fp32_head" in r.getMessage()]
    return trainer, said


@pytest.mark.parametrize("overrides,reason,no_grad_passes", [
    (dict(num_iterations=2), "TRL runs its own old pass", 1),  # one generation serves both steps
    (dict(top_p=0.9, truncation_correction="renormalize"), "truncation_correction='renormalize'", 2),
    (dict(disable_dropout=False, model=tiny_model("qwen2", attention_dropout=0.1)), "dropout is active", 2),
    (dict(is_correction="tis"), "is_correction='tis'", 2),  # the IS weight needs the batch's old log-probs first
    (dict(ratio_full_vocab=True), "ratio_full_vocab=True", 4),  # the mode's pass and the policy's, per generation
])
def test_fallbacks_keep_the_separate_pass_and_say_why_once(tmp_path, caplog, overrides, reason, no_grad_passes):
    trainer, said = _fallback(tmp_path, caplog, **overrides)
    assert not trainer.plan.fused_head and reason in trainer.plan.fused_head_fallback
    assert len(said) == 1 and reason in said[0]
    assert trainer.body_passes["no_grad"] == no_grad_passes  # the separate pass, once per generation


def test_a_decoder_that_transforms_the_norm_output_falls_back(tmp_path, caplog):
    # a model whose decoder returns something other than the norm's output (a forward hook doubles it): the fp32
    # norm + head would miss that step; the start-up probe (one decoder forward of two tokens) sees it
    model = tiny_model("qwen2")

    def doubled(module, args, output):
        output.last_hidden_state = output.last_hidden_state * 2
        return output

    model.model.register_forward_hook(doubled)
    trainer, said = _fallback(tmp_path, caplog, model=model)
    assert "does not return the final norm's output" in trainer.plan.fused_head_fallback and len(said) == 1
    assert all(torch.equal(fused, separate) for fused, separate in trainer.pairs)
    assert trainer.body_passes["no_grad"] == 2  # the separate pass of each generation


def test_heads_that_cannot_be_fused(tmp_path):
    from transformers import AutoModelForCausalLM, Gemma2Config

    args = tiny_grpo_args(tmp_path, old_logprob_mode="fp32_head")
    gemma = AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, final_logit_softcapping=30.0))
    assert "final_logit_softcapping" in fused_head_fallback(args, gemma, "none", False)
    model = tiny_model("llama")
    nn.utils.parametrizations.weight_norm(model.lm_head)  # the head becomes a ParametrizedLinear
    assert "not a plain nn.Linear" in fused_head_fallback(args, model, "none", False)
    assert "sharded engine (fsdp2)" in fused_head_fallback(args, tiny_model("llama"), "fsdp2", False)
    assert fused_head_fallback(args, tiny_model("llama"), "none", False) is None
