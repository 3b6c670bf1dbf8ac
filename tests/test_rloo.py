"""`RatioRLOOTrainer` on tiny offline models: stock `RLOOTrainer` bit for bit with defaults, every arm, the copies,
the truncation correction on `generate`, an IS correction, and where the IS weight enters RLOO's loss (docs/rloo.md).

Run: HF_HUB_OFFLINE=1 pytest tests/test_rloo.py
"""

import json
import math
from pathlib import Path

import pytest
import torch
from trainer_fixtures import trl_logged_values
from trl import RLOOConfig, RLOOTrainer

from grpo_ratio import RatioRLOOConfig, RatioRLOOTrainer
from grpo_ratio.modes import SCORING_MODES
from grpo_ratio.rloo import rloo_is_weight_gate, weighted_advantages
from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer


def tiny_rloo_args(output_dir, **overrides) -> RatioRLOOConfig:
    """`RatioRLOOConfig` for a seconds-long CPU run: 4 prompts x 4 generations, 8 tokens, logging every step."""
    kwargs = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        bf16=True,  # bf16 autocast on CPU: the precision the project is about
        per_device_train_batch_size=4,
        num_generations=4,  # 1 prompt per micro-batch, 4 samples: RLOO's leave-one-out needs >= 2
        max_completion_length=8,  # short rollouts keep a step under a second on a tiny model
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-2,  # large: a toy model must visibly move in 2 steps
        beta=0.0,  # RLOO's default 0.05 rebuilds the reference from a path; the KL case passes one (below)
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return RatioRLOOConfig(**kwargs)


def tiny_rloo(output_dir, mode: str = "bf16", stock: bool = False, model=None, peft_config=None, **overrides):
    """A RatioRLOOTrainer (or, with `stock`, `trl.RLOOTrainer` on the same values in a plain `RLOOConfig`) on a tiny
    qwen2 model, 8 plain-text prompts and `letter_reward`."""
    args = tiny_rloo_args(output_dir, old_logprob_mode=mode, **overrides)
    if stock:
        fields = RLOOConfig.__dataclass_fields__
        values = {k: getattr(args, k) for k, f in fields.items() if f.init}
        values.update(generation_batch_size=None, steps_per_generation=overrides.get("steps_per_generation"))
        args = RLOOConfig(**values)
    cls = RLOOTrainer if stock else RatioRLOOTrainer
    return cls(model=model if model is not None else tiny_model("qwen2"), reward_funcs=letter_reward, args=args,
               train_dataset=tiny_prompts(8), processing_class=tiny_tokenizer(), peft_config=peft_config)


def _steps(trainer) -> list[dict]:
    return [row for row in trainer.state.log_history if "loss" in row]


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _lora():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # non-zero B


@pytest.mark.parametrize("case", ["default", "num_iterations=2", "peft", "beta=0.05"])
def test_defaults_are_stock_rloo_bit_for_bit(tmp_path, case):
    overrides = {"num_iterations=2": dict(num_iterations=2), "beta=0.05": dict(beta=0.05)}.get(case, {})
    model = None
    if case == "beta=0.05":  # TRL builds the reference model from the policy's path
        tiny_model("qwen2").save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    runs = {}
    for stock in (True, False):
        trainer = tiny_rloo(tmp_path / str(stock), stock=stock, model=model,
                            peft_config=_lora() if case == "peft" else None, **overrides)
        trainer.train()
        runs[stock] = trl_logged_values(trainer), _weights(trainer)
    (stock_rows, stock_weights), (ours_rows, ours_weights) = runs[True], runs[False]
    assert len(ours_rows) == 2
    assert ours_rows == stock_rows  # loss, reward, kl, entropy, clip_ratio/*: every TRL value, exactly
    assert stock_weights.keys() == ours_weights.keys()
    assert all(torch.equal(stock_weights[k], ours_weights[k]) for k in stock_weights)  # what a checkpoint holds
    if case == "beta=0.05":
        assert all(math.isfinite(row["kl"]) for row in ours_rows)


@pytest.mark.parametrize("mode", SCORING_MODES)
def test_every_arm_trains_two_steps_and_sums_its_old_logprobs(tmp_path, mode):
    extra = dict(guided_fp32_layers="0") if mode == "guided_fp32" else {}
    trainer = tiny_rloo(tmp_path, mode, **extra)
    trainer.train()
    rows = _steps(trainer)
    assert len(rows) == 2 and all(math.isfinite(row["loss"]) for row in rows)
    assert all(0.5 < row["ratio/new_old/mean"] < 2.0 for row in rows)
    # RLOO's loss reads old_logps (B,): it must be the sum of the arm's own per-token old log-probs (for the
    # sampler arm the sampler's, not the zeros GRPO's stand-in pass returns)
    for batch in trainer._buffered_inputs:
        summed = (batch["old_per_token_logps"] * batch["completion_mask"]).sum(1)  # (b,)
        torch.testing.assert_close(batch["old_logps"], summed, rtol=0, atol=1e-5)
        assert bool((batch["old_logps"] < 0).all())  # log-probs of 8-token completions, never 0


def test_the_sampler_fp32_head_trains_two_steps(tmp_path):
    # issue 43 item 3: fp32_head with the sampler's head arithmetic (bf16 norm output x bf16 weight, fp32 accumulation)
    # replaces RLOO's own old pass; its old log-probs differ from fp32_head's by the norm's cast only
    runs = {}
    for operands in ("fp32", "bf16"):
        trainer = tiny_rloo(tmp_path / operands, "fp32_head", fp32_head_operands=operands)
        trainer.train()
        rows = _steps(trainer)
        assert len(rows) == 2 and all(math.isfinite(row["loss"]) for row in rows)
        runs[operands] = trainer._buffered_inputs[0]["old_per_token_logps"]  # (b, T) of the last generation
    assert runs["bf16"].dtype == torch.float32
    # the runs sample the same first rollouts; by the last generation the weights differ by the old log-probs' effect
    assert not torch.equal(runs["bf16"], runs["fp32"])


@pytest.mark.parametrize("mode", ["fp32_clone", "fp16_clone"])
def test_copies_move_the_first_step(tmp_path, mode):
    # bf16 autocast: TRL's old pass and the training forward agree (r = 1); a copy's old pass does not
    base = tiny_rloo(tmp_path / "bf16", "bf16", max_steps=1)
    base.train()
    trainer = tiny_rloo(tmp_path / mode, mode, max_steps=1)
    trainer.train()
    (base_row,), (row,) = _steps(base), _steps(trainer)
    assert base_row["ratio/new_old/mean_abs_log_ratio"] == 0.0
    assert row["ratio/new_old/mean_abs_log_ratio"] > 1e-4
    assert row["ratio/new_old/num_tokens"] == base_row["ratio/new_old/num_tokens"] == 32


def test_truncation_correction_on_generate(tmp_path):
    # fp32 end to end: the only gap between trainer and sampler is the kept mass of top_p=0.8
    trainer = tiny_rloo(tmp_path, "bf16", bf16=False, max_steps=1, top_p=0.8, truncation_correction="renormalize")
    trainer.train()
    (row,) = _steps(trainer)
    assert row["ratio/kept_mass_mean"] < 0.9
    assert row["ratio/old_sampler/mean"] == pytest.approx(row["ratio/kept_mass_mean"], abs=1e-3)  # raw: at M
    assert row["ratio/old_sampler_corrected/mean"] == pytest.approx(1.0, abs=0.01)
    assert math.isfinite(row["loss"])


def test_an_is_correction_preset_trains(tmp_path):
    trainer = tiny_rloo(tmp_path, "fp32_clone", is_correction="trl_sequence_mask")
    trainer.train()
    rows = _steps(trainer)
    assert len(rows) == 2 and all(math.isfinite(row["loss"]) for row in rows)
    for row in rows:  # the weights the loss used, logged as TRL logs its own
        assert 0.0 <= row["ratio/importance_sampling_ratio/min"] <= row["ratio/importance_sampling_ratio/max"] <= 3.0
    assert all(batch["importance_sampling_ratio"].shape == (4, 1) for batch in trainer._buffered_inputs)


def test_a_token_level_is_correction_is_refused_on_rloo(tmp_path):
    with pytest.raises(ValueError, match="RLOO's ratio and clip are per sequence"):
        tiny_rloo_args(tmp_path, is_correction="tis")
    with pytest.raises(ValueError, match="RLOO's loss reads none"):
        tiny_rloo_args(tmp_path, sampler_logprobs_in_loss=True)


def _rloo_loss(log_ratio, advantages, eps=0.2):
    """RLOOTrainer._compute_loss (TRL 1.16, rloo_trainer.py L1821-1828) on given sequence log-ratios (B,)."""
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    return -torch.min(coef_1 * advantages, coef_2 * advantages)  # (B,) per-sequence loss


def test_the_is_weight_enters_rloo_as_a_weighted_advantage():
    log_ratio = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    advantages = torch.tensor([1.0, -2.0, 0.5])
    weights = torch.tensor([[0.5], [2.0], [0.0]])  # (B, 1): sequence-level
    # row 0: r=1.5, A=1 -> min(1.5, 1.2) = 1.2, loss -1.2; times w=0.5: -0.6
    # row 1: r=0.5, A=-2 -> min(-1.0, 0.8 * -2 = -1.6) = -1.6, loss 1.6; times w=2: 3.2
    # row 2: w=0 (masked): 0
    expected = torch.tensor([-0.6, 3.2, 0.0])
    weighted = _rloo_loss(log_ratio, weighted_advantages(advantages, weights))
    torch.testing.assert_close(weighted, expected)
    torch.testing.assert_close(weighted, weights.squeeze(1) * _rloo_loss(log_ratio, advantages))
    torch.testing.assert_close(weighted.mean(), torch.tensor(2.6 / 3))  # RLOO's loss: the mean over sequences
    inputs = {"advantages": advantages, "importance_sampling_ratio": weights}
    with rloo_is_weight_gate(inputs):
        torch.testing.assert_close(inputs["advantages"], torch.tensor([0.5, -4.0, 0.0]))
    assert inputs["advantages"] is advantages  # restored
    with pytest.raises(ValueError, match="token-level"):
        weighted_advantages(advantages, torch.ones(3, 8))
    with pytest.raises(ValueError, match=">= 0"):
        weighted_advantages(advantages, torch.tensor([1.0, -1.0, 1.0]))


# ---------------------------------------------------------------------------------------------------------------------
# the command line: `trainer: rloo` recipes, `grpo-ratio train`, `grpo-ratio report`

ROOT = Path(__file__).parents[1]
RLOO_RECIPES = sorted((ROOT / "recipes/smollm2-135m/rloo").glob("*/*.yaml"))


def test_there_is_an_rloo_recipe_per_arm():
    assert {p.stem for p in RLOO_RECIPES} >= set(SCORING_MODES) and len(RLOO_RECIPES) == len(SCORING_MODES) + 1


@pytest.mark.parametrize("recipe", RLOO_RECIPES, ids=lambda p: p.stem)
def test_rloo_recipes_parse_into_rloo_configs(recipe):
    from grpo_ratio.cli.precheck import check_train
    from grpo_ratio.cli.train import make_parser, trainer_of

    argv = ["--config", str(recipe)]
    check_train(argv)  # the recipe keys, before the heavy imports
    script_args, training_args, _ = make_parser(trainer_of(argv)).parse_args_and_config(argv)
    assert script_args.trainer == "rloo" and type(training_args) is RatioRLOOConfig
    assert recipe.stem == training_args.old_logprob_mode or recipe.stem.startswith(f"{training_args.old_logprob_mode}_")
    assert training_args.output_dir.endswith(f"rloo/arithmetic/{recipe.stem}") and training_args.beta == 0.0
    rel = recipe.relative_to(ROOT)
    assert f"python trainers/rloo.py --config {rel}\n" in recipe.read_text()


def test_an_unknown_trainer_is_refused_early_with_the_allowed_values(tmp_path):
    from grpo_ratio.cli.precheck import ConfigError, check_train
    from grpo_ratio.cli.train import trainer_of

    with pytest.raises(ConfigError, match="trainer='rlo' is not allowed; allowed: grpo, rloo"):
        check_train(["--trainer", "rlo"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("trainer: ppo\n")
    with pytest.raises(ValueError, match="trainer='ppo' is not allowed; allowed: grpo, rloo"):
        trainer_of(["--config", str(recipe)])
    assert trainer_of([]) == "grpo" and trainer_of(["--trainer=rloo"]) == "rloo"


def test_train_runs_an_rloo_recipe_and_report_reads_it(tmp_path, capsys):
    from grpo_ratio.analysis import report
    from grpo_ratio.cli import train

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    tiny_model("qwen2").save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "run"
    train.cli_main(["--config", str(ROOT / "recipes/smollm2-135m/rloo/arithmetic/fp32_clone.yaml"),
                    "--model_name_or_path", str(tmp_path / "tiny"), "--output_dir", str(out), "--report_to", "none",
                    "--max_steps", "1", "--max_completion_length", "8", "--num_examples", "16"])
    config = json.loads((out / "run.json").read_text())["config"]
    assert config["trl_trainer"] == "rloo" and config["old_logprob_mode"] == "fp32_clone"
    assert config["vllm_importance_sampling_correction"] is None  # RLOO has none
    capsys.readouterr()
    assert report.main([str(out)]) == 0
    text = capsys.readouterr().out
    assert "trl_trainer=rloo" in text and "ratio/new_old" in text
