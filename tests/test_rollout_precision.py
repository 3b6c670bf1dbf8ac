"""`rollout_precision`: rollouts drawn from a lower-precision copy of the policy (grpo_ratio/sampler/precision.py,
docs/rollout_precision.md): stock TRL under "policy"; the float copies train, record the copy's own log-probs and move
old/sampler off 1 in the order of their precision; the integer rollouts' old pass reproduces the sampler exactly.

Run: pytest tests/test_rollout_precision.py
"""

import math

import pytest
import torch
from trainer_fixtures import peaked_model, tiny_trainer, trl_logged_values
from trl import GRPOTrainer

from grpo_ratio import RatioGRPOConfig
from grpo_ratio.diagnostics.metric_keys import IS_WEIGHT_MEAN, OLD_SAMPLER, ROLLOUT_COPY_SECONDS
from grpo_ratio.integer.sample import IntSampling
from grpo_ratio.old_pass.integer_pass import to_nats
from grpo_ratio.sampler.generate import SamplerLogprobRecorder, finalize_from_completions
from grpo_ratio.sampler.precision import (
    FAKE_QUANT,
    IntegerRollouts,
    RolloutCopy,
    call_seed,
    fake_quantize_,
    sample_indices,
)
from grpo_ratio.testing import tiny_model


FLOAT_COPIES = ("bf16", "fp16", "int8", "int4", "int2")


def _steps(trainer):
    return [row for row in trainer.state.log_history if "loss" in row]


# ---------------------------------------------------------------------------------------------------------------------
# the default: stock TRL


def test_policy_rollouts_are_stock_grpo_bit_for_bit(tmp_path):
    runs = []
    for cls in (GRPOTrainer, None):
        extra = {} if cls is GRPOTrainer else {"rollout_precision": "policy"}
        trainer = tiny_trainer(tmp_path / str(cls), "bf16", trainer_cls=cls, **extra)
        trainer.train()
        runs.append(trl_logged_values(trainer))
    assert len(runs[0]) == 2 and runs[0] == runs[1]
    assert trainer.rollout_copy is None


# ---------------------------------------------------------------------------------------------------------------------
# the float copies


def test_fake_quantization_is_per_output_channel_with_its_levels():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 8, bias=False)
    original = lin.weight.detach().clone()
    for levels in FAKE_QUANT.values():
        with torch.no_grad():
            lin.weight.copy_(original)
        model = torch.nn.Sequential(lin)
        assert fake_quantize_(model, levels) == 1
        scale = original.abs().amax(1, keepdim=True) / levels  # (8, 1)
        q = lin.weight / scale
        assert torch.allclose(q, q.round(), atol=1e-4)  # on the grid of its row
        assert q.abs().max() <= levels + 1e-4 and set(q.abs().amax(1).round().tolist()) == {float(levels)}
        assert (lin.weight - original).abs().max() <= scale.max() / 2 + 1e-7  # round to nearest
    with pytest.raises(ValueError, match="levels"):
        fake_quantize_(model, 0)


def _recorded(copy: RolloutCopy, policy, prompts: torch.Tensor, new_tokens: int = 6):
    """(sequences (B, P+T), recorded sampler log-probs (B, T)) of one generate drawn from `copy`."""
    recorder = SamplerLogprobRecorder()
    mask = torch.ones_like(prompts)
    policy.generation_config.pad_token_id = 0
    with torch.no_grad(), copy.drawing(policy, 1, new_tokens, recorder) as state:
        out = policy.generate(input_ids=prompts, attention_mask=mask, do_sample=True, temperature=0.7, top_k=0,
                              top_p=1.0, max_new_tokens=new_tokens, eos_token_id=None)
    assert state["model"] is copy.copy.module
    completion = out[:, prompts.size(1):].tolist()
    assert len(completion[0]) == new_tokens
    return out, finalize_from_completions(recorder, completion, 0).logprobs


# the recorded log-probs against a direct forward of the copy: the fp32-stored fake-quantized copies agree to fp32
# rounding (cached decode vs one full forward); bf16 / fp16 copies to their own rounding of that difference
TOLERANCE = {"bf16": 5e-2, "fp16": 1e-2, "int8": 1e-4, "int4": 1e-4, "int2": 1e-4}


@pytest.mark.parametrize("precision", FLOAT_COPIES)
def test_recorded_logprobs_are_the_copys_own(precision):
    torch.manual_seed(0)
    policy = tiny_model("qwen2")
    copy = RolloutCopy(precision, policy)
    prompts = torch.randint(2, 300, (3, 5))
    out, recorded = _recorded(copy, policy, prompts)
    module = copy.copy.module
    assert module is not policy and next(module.parameters()).dtype == {"bf16": torch.bfloat16,
                                                                         "fp16": torch.float16}.get(precision,
                                                                                                    torch.float32)
    with torch.no_grad():
        logits = module(out).logits[:, prompts.size(1) - 1:-1].float() / 0.7  # (B, T, V)
        direct = logits.log_softmax(-1).gather(-1, out[:, prompts.size(1):, None]).squeeze(-1)
        own = (policy(out).logits[:, prompts.size(1) - 1:-1].float() / 0.7).log_softmax(-1).gather(
            -1, out[:, prompts.size(1):, None]).squeeze(-1)
    gap = (recorded - direct).abs().max().item()
    assert gap <= TOLERANCE[precision], gap
    if precision in FAKE_QUANT:  # the copy, not the policy, drew: the policy's log-probs are farther off
        assert (recorded - own).abs().max().item() > 10 * max(gap, 1e-6)
    assert copy.num_remakes == 1 and copy.last_seconds is not None and copy.num_bytes() > 0


def test_the_copy_is_remade_only_when_the_weights_moved():
    policy = tiny_model("qwen2")
    copy = RolloutCopy("int8", policy)
    first = copy.sync(1)
    assert copy.num_remakes == 1 and copy.sync(1) is first and copy.num_remakes == 1  # same version: kept
    with torch.no_grad():
        policy.lm_head.weight.mul_(2.0)
    copy.sync(2)
    assert copy.num_remakes == 2
    assert torch.allclose(first.lm_head.weight.abs().amax(1), policy.lm_head.weight.abs().amax(1), rtol=1e-6)


def test_float_copies_train_and_coarser_copies_move_old_sampler_more(tmp_path):
    # 2 steps per value on a peaked tiny model (a trained model's peaked distributions, where a tiny random one is
    # nearly uniform): finite loss, the copy's re-make cost logged at each generation, and old/sampler off 1 in the
    # order of the copy's precision
    moved = {}
    for precision in FLOAT_COPIES:
        trainer = tiny_trainer(tmp_path / precision, "bf16", model=peaked_model(), rollout_precision=precision)
        trainer.train()
        rows = _steps(trainer)
        assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
        assert all(r[ROLLOUT_COPY_SECONDS] > 0 for r in rows)
        assert trainer.rollout_copy.num_remakes == 2  # once per generation (weights moved between them)
        moved[precision] = sum(r[OLD_SAMPLER.mean_abs_log_ratio] for r in rows) / len(rows)
    assert moved["int4"] > 5 * moved["bf16"], moved
    assert moved["int2"] > moved["int4"] > moved["int8"], moved


# ---------------------------------------------------------------------------------------------------------------------
# refusals


@pytest.mark.parametrize("overrides, match", [
    ({"rollout_precision": "fp8"}, "rollout_precision='fp8' is not allowed; allowed: policy, bf16, fp16, int8, int4, "
                                   "int2, integer"),
    ({"rollout_precision": "int8", "use_vllm": True}, "rollout_precision='int8' draws .* use_vllm=True"),
    ({"rollout_precision": "bf16", "routing_replay": "R3"}, "routing_replay='R3'"),
    ({"old_logprob_mode": "integer"}, "old_logprob_mode='integer' re-scores .* rollout_precision='policy'"),
    ({"rollout_precision": "integer", "truncation_correction": "renormalize"}, "integer sampler applies top_k"),
])
def test_what_cannot_work_is_refused_naming_the_field(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **overrides)


def test_integer_rollouts_refuse_what_the_integer_sampler_does_not_implement(tmp_path):
    with pytest.raises(ValueError, match="integer sampler implements temperature, top_k and top_p.*min_p=0.1"):
        tiny_trainer(tmp_path, "bf16", rollout_precision="integer", generation_kwargs={"min_p": 0.1})
    with pytest.raises(NotImplementedError, match="not model_type='qwen2_moe'"):
        tiny_trainer(tmp_path, "bf16", arch="qwen2_moe", rollout_precision="integer")


# ---------------------------------------------------------------------------------------------------------------------
# integer rollouts


def test_sample_indices_count_each_prompt_on_its_own():
    assert sample_indices([[1, 2], [3], [1, 2], [1, 2], [3]]) == [0, 0, 1, 2, 1]
    assert call_seed(0, 0) != call_seed(0, 1) and call_seed(0, 3) == call_seed(0, 3)


def test_integer_rollouts_do_not_depend_on_the_batch_and_their_old_pass_is_exact():
    # the same prompts regenerated from the same weights and seed in another batch composition: identical tokens and
    # log-probs; the integer old pass on either batch equals the sampler's log-probs bit for bit
    torch.manual_seed(0)
    policy = tiny_model("qwen2")
    rollouts = IntegerRollouts(IntSampling(temperature=0.9, top_p=0.95), eos_token_id=1, pad_token_id=0)
    prompts = [torch.randint(2, 300, (n,)).tolist() for n in (3, 5, 4)]
    rollouts.sync(policy, 1, prompts)
    batch_a = [prompts[0]] * 2 + [prompts[1]] * 2  # two samples of two prompts
    batch_b = [prompts[2], prompts[1], prompts[2], prompts[1], prompts[0], prompts[0]]  # reordered, a co-prompt
    a = rollouts.draw(batch_a, 8, seed=7)
    b = rollouts.draw(batch_b, 8, seed=7)
    for i, j in ((0, 4), (1, 5), (2, 1), (3, 3)):  # prompt, sample index: the same row in both batches
        n = int(a.lengths[i])
        assert n == int(b.lengths[j])
        assert torch.equal(a.tokens[i, :n], b.tokens[j, :n]) and torch.equal(a.logprobs[i, :n], b.logprobs[j, :n])
    assert not torch.equal(a.tokens[0], a.tokens[1])  # two samples of one prompt draw differently
    for rows, out in ((batch_a, a), (batch_b, b)):
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(r[::-1]) for r in rows], batch_first=True).flip(1)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r), dtype=torch.long) for r in rows],
                                               batch_first=True).flip(1)
        T = out.tokens.size(1)
        cmask = (torch.arange(T)[None, :] < out.lengths[:, None]).long()
        old = rollouts.score(ids, mask, out.tokens, cmask)
        assert torch.equal(old, torch.where(cmask.bool(), to_nats(out.logprobs), 0.0))
    record = rollouts.record([b.tokens[i, :int(b.lengths[i])].tolist() for i in range(len(batch_b))])  # the last
    assert torch.equal(old, record.logprobs)


@pytest.mark.parametrize("shape", [{}, {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2}])
def test_integer_rollouts_with_the_integer_old_pass_train_with_old_sampler_exactly_one(tmp_path, shape):
    # 4 GRPO steps drawn by the integer model; the integer old pass re-scores them (on-policy: no TRL old pass; with
    # gradient accumulation TRL's own old pass runs and is replaced): old/sampler = 1 bit for bit on every token
    trainer = tiny_trainer(tmp_path, "integer", rollout_precision="integer", max_steps=4, **shape)
    trainer.train()
    rows = _steps(trainer)
    assert len(rows) == 4 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r[OLD_SAMPLER.num_tokens] > 0 for r in rows)
    assert all(r[OLD_SAMPLER.oob_rate] == 0.0 and r[OLD_SAMPLER.mean_abs_log_ratio] == 0.0 for r in rows)
    assert all(r[OLD_SAMPLER.mean] == 1.0 for r in rows)
    for batch in trainer._buffered_inputs:  # the last generation batch, as TRL split it
        mask = batch["completion_mask"].bool()
        assert torch.equal(batch["old_per_token_logps"][mask], batch["sampler_per_token_logps"][mask])
    assert trainer.rollout_copy.num_remakes == 4  # re-converted at each of the 4 generations (one per step)
    assert all(r[ROLLOUT_COPY_SECONDS] > 0 for r in rows)


def test_is_correction_trains_on_the_float_integer_distance(tmp_path):
    # the float policy's old pass against the integer sampler: the IS weight is their distance, not 1
    trainer = tiny_trainer(tmp_path, "bf16", model=peaked_model(), rollout_precision="integer", is_correction="tis",
                           max_steps=2)
    trainer.train()
    rows = _steps(trainer)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r[OLD_SAMPLER.num_tokens] > 0 and r[OLD_SAMPLER.mean_abs_log_ratio] > 1e-3 for r in rows)
    assert all(r[IS_WEIGHT_MEAN] != 1.0 for r in rows)


@pytest.mark.parametrize("precision", ["int4", "integer"])
def test_rloo_shares_the_hook(tmp_path, precision):
    from grpo_ratio import RatioRLOOConfig
    from grpo_ratio.rloo import RatioRLOOTrainer
    from grpo_ratio.testing import letter_reward, tiny_prompts, tiny_tokenizer

    args = RatioRLOOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                           num_generations=4, max_completion_length=8, max_steps=2, logging_steps=1, beta=0.0,
                           report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
                           rollout_precision=precision)
    trainer = RatioRLOOTrainer(model=tiny_model("qwen2"), reward_funcs=letter_reward, args=args,
                               train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer())
    trainer.train()
    rows = _steps(trainer)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r[OLD_SAMPLER.num_tokens] > 0 and r[OLD_SAMPLER.mean_abs_log_ratio] > 1e-4 for r in rows)
    assert trainer.rollout_copy.num_remakes == 2


@pytest.mark.parametrize("precision, centering", [("int8", "exact"), ("integer", "top_k"), ("integer", "exact")])
def test_score_centering_with_a_rollout_copy_is_refused_where_q_would_not_be_the_copys(tmp_path, precision, centering):
    """score_centering='exact' recomputes q from the policy's forward (not the copy's); the integer sampler records
    no top-k: both refused early, naming both fields."""
    with pytest.raises(ValueError, match=r"score_centering") as err:
        RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, rollout_precision=precision,
                        score_centering=centering, report_to="none")
    assert "rollout_precision" in str(err.value)
