"""A new user's bad-input trial, as a table: every bad input across the GRPO, RLOO and async configs, recipes (YAML),
flags, datasets and the command line fails early (when the config is built, or before the heavy imports on the
command line) with a message that names the field and, where the field takes one of a set, the allowed values. Several
mistakes at once are reported together; a field of another trainer names the config that has it.

Run: pytest tests/test_bad_inputs.py -q   (about 40 s: config construction, the precheck on temp YAML files, three
subprocess command lines)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from datasets import Dataset

from grpo_ratio import RatioGRPOConfig, RatioRLOOConfig
from grpo_ratio.checks import check_train_dataset
from grpo_ratio.cli.precheck import ConfigError, check_compare, check_train


ROOT = Path(__file__).parents[1]
CUSTOM = dict(is_correction="custom", is_correction_level="token")  # a custom IS correction, its action to choose

# (input, the fragments its message must hold): field names, values, allowed values, the fix
GRPO = [
    (dict(old_logprob_mode="fp8"), ["old_logprob_mode='fp8'", "allowed: bf16, fp32_clone, fp16_clone, fp32_head"]),
    (dict(old_logprob_mode="fp32clone"), ["old_logprob_mode", "did you mean 'fp32_clone'?"]),
    (dict(truncation_correction="clip"), ["truncation_correction='clip'", "allowed: none, renormalize, lift_sampler"]),
    (dict(kept_set_source="sampler"), ["kept_set_source='sampler'", "allowed: auto, recorded, recompute"]),
    (dict(vllm_dtype="fp32"), ["vllm_dtype='fp32'", "allowed: auto, float32, bfloat16, float16"]),
    (dict(vllm_dtype="float32"), ["vllm_dtype='float32'", "colocate", "trl vllm-serve --dtype float32"]),
    (dict(vllm_lm_head_fp32=True), ["vllm_lm_head_fp32=True", "colocate"]),
    (dict(vllm_lm_head_fp32="yes"), ["vllm_lm_head_fp32 must be True or False"]),
    (dict(copy_storage="layer"), ["copy_storage='layer'", "allowed: resident, per_layer"]),
    (dict(copy_storage="per_layer"), ["copy_storage='per_layer'", "fp16_clone, fp32_clone"]),
    (dict(old_logprob_mode="guided_fp32"), ["old_logprob_mode='guided_fp32' needs guided_fp32_layers"]),
    (dict(guided_fp32_layers="1"), ["guided_fp32_layers", "old_logprob_mode='guided_fp32'"]),
    (dict(old_logprob_mode="guided_fp32", guided_fp32_layers="0,x"), ["guided_fp32_layers", "'x'"]),
    (dict(ratio_band_low=1.2), ["ratio_band_low", "ratio_band_high"]),
    (dict(ratio_band_high="1.1"), ["ratio_band_high must be a number"]),
    (dict(clip_flip_every=-1), ["clip_flip_every must be an integer >= 0"]),
    (dict(clip_flip_every=0.5), ["clip_flip_every must be an integer >= 0"]),
    (dict(ratio_diagnostics="no"), ["ratio_diagnostics must be True or False"]),
    (dict(record_sampler_logprobs=1), ["record_sampler_logprobs must be True or False"]),
    (dict(ratio_full_vocab=True), ["ratio_full_vocab=True", "fp32_clone"]),
    (dict(sampler_logprobs_in_loss=True), ["sampler_logprobs_in_loss=True", "off_policy_mask_threshold"]),
    (dict(sampler_logprobs_in_loss=True, record_sampler_logprobs=False), ["sampler_logprobs_in_loss",
                                                                          "record_sampler_logprobs=True"]),
    (dict(is_correction="tiss"), ["is_correction='tiss'", "allowed: ", "tis, icepop", "custom"]),
    (dict(is_correction="tis", is_correction_high=3.0), ["is_correction_high only applies with is_correction="
                                                         "'custom'"]),
    (dict(is_correction="custom"), ["needs is_correction_level", "token, sequence_product, sequence_geometric"]),
    (dict(CUSTOM), ["needs is_correction_action", "truncate, mask", "is_correction_low and/or is_correction_high"]),
    (dict(CUSTOM, is_correction_level="geometric", is_correction_action="mask"),
     ["is_correction_level='geometric'", "allowed: token, sequence_product"]),
    (dict(CUSTOM, is_correction_action="clip"), ["is_correction_action='clip'", "allowed: truncate, mask"]),
    (dict(CUSTOM, is_correction_action="truncate"), ["needs a bound", "is_correction_low and/or is_correction_high"]),
    (dict(CUSTOM, is_correction_action="mask", is_correction_low=2.0, is_correction_high=1.0),
     ["is_correction_low (2.0) must be < is_correction_high (1.0)"]),
    (dict(CUSTOM, is_correction_action="mask", is_correction_high=-1.0), ["is_correction_high", "must be > 0"]),
    (dict(is_correction="custom", is_correction_level="none", is_correction_high=2.0),
     ["is_correction_level='none'", "nothing to act on"]),
    (dict(CUSTOM, is_correction_action="mask", is_correction_veto=1.5), ["is_correction_veto must be in (0, 1)"]),
    (dict(CUSTOM, is_correction_action="mask", is_correction_veto="x"), ["is_correction_veto='x' must be a number"]),
    (dict(is_correction="custom", is_correction_level="none", is_correction_rejection="seq_median_k3<=1"),
     ["is_correction_rejection", "seq_{sum,mean,max}_METRIC"]),
    (dict(is_correction="custom", is_correction_level="none", is_correction_rejection="token_k4<=1"),
     ["is_correction_rejection", "allowed: ratio, k1, k2, k3, prob_error"]),
    (dict(is_correction="custom", is_correction_level="none", is_correction_rejection="token_k3"),
     ["is_correction_rejection", "needs a bound"]),
    (dict(is_correction="tis", old_logprob_mode="sampler"), ["is_correction='tis'", "old_logprob_mode='sampler'"]),
    (dict(is_correction="tis", record_sampler_logprobs=False), ["is_correction='tis'", "record_sampler_logprobs=True"]),
    (dict(is_correction="tis", use_vllm=True, vllm_importance_sampling_correction=False),
     ["is_correction='tis'", "vllm_importance_sampling_correction=True"]),
    (dict(is_correction="tis", use_vllm=True, vllm_importance_sampling_mode="token_mask"),
     ["is_correction='tis'", "vllm_importance_sampling_mode"]),
    (dict(routing_replay="R4"), ["routing_replay='R4'", "allowed: none, R2, R3"]),
    (dict(routing_replay="R2", old_logprob_mode="sampler"), ["routing_replay='R2'", "old_logprob_mode='sampler'"]),
    (dict(routing_replay="R3", use_vllm=True, vllm_mode="server"), ["routing_replay='R3'", "vllm_mode='colocate'"]),
    (dict(ratio_gate=["rewrd>=0.1"], ratio_gate_action="stop"), ["ratio_gate", "'rewrd'", "did you mean 'reward'"]),
    (dict(ratio_gate=["train/reward>0"]), ["ratio_gate", "'train/reward'", "log rows hold 'reward'"]),
    (dict(ratio_gate=["ratio/new_old/oob_rat<=0.1"]), ["ratio_gate", "did you mean 'ratio/new_old/oob_rate'"]),
    (dict(ratio_gate=["completions/mean_lenght<100"]), ["ratio_gate", "did you mean 'completions/mean_length'"]),
    (dict(ratio_gate=["ratio/staleness/2/oob_rate<0.1"]), ["ratio_gate", "'ratio/staleness/<k>/new_behav_oob_rate'"]),
    (dict(ratio_gate=["mean:reward>0"]), ["ratio_gate", "only the scopes each, first"]),
    (dict(ratio_gate=["reward=<0"]), ["check 'reward=<0'", "[SCOPE:]KEY OP VALUE"]),
    (dict(ratio_gate=["reward>x"]), ["check 'reward>x'", "'x' is not a number"]),
    (dict(ratio_gate_patience=0), ["ratio_gate_patience must be an integer >= 1"]),
    (dict(ratio_gate_action="halt"), ["ratio_gate_action='halt'", "allowed: warn, stop"]),
    (dict(ratio_gate=["ratio/new_old/oob_rate<0.1"], ratio_diagnostics=False), ["ratio_gate", "ratio_diagnostics="
                                                                                 "False"]),
    (dict(ratio_attribution="some"), ["ratio_attribution='some'", "allowed: True"]),
    (dict(ratio_attribution=True, ratio_diagnostics=False), ["ratio_attribution", "ratio_diagnostics=True"]),
    (dict(ratio_attribution=True, record_sampler_logprobs=False), ["ratio_attribution",
                                                                   "record_sampler_logprobs=True"]),
    (dict(old_logprob_mode="sampler", record_sampler_logprobs=False), ["old_logprob_mode='sampler'",
                                                                       "record_sampler_logprobs=True"]),
    (dict(old_logprob_mode="sampler", truncation_correction="lift_sampler", top_p=0.8),
     ["truncation_correction='lift_sampler'", "'renormalize'"]),
    (dict(truncation_correction="renormalize", record_sampler_logprobs=False), ["truncation_correction=",
                                                                                "record_sampler_logprobs=True"]),
    (dict(truncation_correction="renormalize", kept_set_source="recorded", use_vllm=True, vllm_mode="server"),
     ["kept_set_source='recorded'", "kept_set_source='recompute'"]),
    (dict(temperature=0.0), ["temperature=0.0 is not allowed; allowed: > 0"]),
    (dict(top_p=0.0), ["top_p=0.0 is not allowed; allowed: 0 < top_p <= 1"]),
    (dict(top_p=1.5), ["top_p=1.5", "0 < top_p <= 1"]),
    (dict(top_k=-1), ["top_k=-1", "an integer >= 0"]),
    (dict(min_p=1.5), ["min_p=1.5", "0 <= min_p <= 1"]),
    (dict(generation_kwargs={"top_k": 2.5}), ["generation_kwargs['top_k']=2.5", "an integer >= 0"]),
    (dict(num_generations=0), ["num_generations=0", "an integer >= 2"]),
    (dict(learning_rate=-1), ["learning_rate=-1", "a number >= 0"]),
    (dict(max_completion_length=0), ["max_completion_length=0", "an integer >= 1"]),
    (dict(per_device_train_batch_size=0), ["per_device_train_batch_size=0", "an integer >= 1"]),
    (dict(gradient_accumulation_steps=0), ["gradient_accumulation_steps=0", "an integer >= 1"]),
    (dict(num_iterations=0), ["num_iterations=0", "an integer >= 1"]),
    (dict(steps_per_generation=0), ["steps_per_generation=0", "an integer >= 1"]),
    (dict(generation_batch_size=0), ["generation_batch_size=0", "an integer >= 1"]),
    (dict(max_steps=0), ["max_steps=0", "-1 (train num_train_epochs)"]),
    # another trainer's field, a typo: named, with the config that has it or a "did you mean"
    (dict(async_objective="decoupled"), ["RatioGRPOConfig has no field 'async_objective'", "RatioAsyncGRPOConfig"]),
    (dict(max_staleness=2), ["'max_staleness'", "RatioAsyncGRPOConfig (RatioAsyncGRPOTrainer"]),
    (dict(normalize_advantages=True), ["'normalize_advantages'", "RatioRLOOConfig (RatioRLOOTrainer"]),
    (dict(old_logprob_mod="fp32_clone"), ["'old_logprob_mod'", "did you mean 'old_logprob_mode'?"]),
    (dict(ratio_gates=["reward>0"]), ["'ratio_gates'", "did you mean 'ratio_gate'?"]),
    (dict(truncation_corection="renormalize"), ["'truncation_corection'", "did you mean 'truncation_correction'?"]),
    # several at once: one error listing each
    (dict(old_logprob_mode="fp8", kept_set_source="x", ratio_band_low=2.0),
     ["3 problems", "old_logprob_mode='fp8'", "kept_set_source='x'", "ratio_band_low"]),
    (dict(num_generations=0, old_logprob_mode="fp8"), ["2 problems", "num_generations=0", "old_logprob_mode='fp8'"]),
    (dict(CUSTOM, is_correction_veto=2.0, is_correction_low=0.0),
     ["3 problems", "needs is_correction_action", "is_correction_low", "must be > 0", "is_correction_veto"]),
    (dict(async_objective="decoupled", old_logprob_mod="bf16"), ["2 problems", "RatioAsyncGRPOConfig",
                                                                 "did you mean 'old_logprob_mode'"]),
]

RLOO = [
    (dict(loss_type="dapo"), ["RatioRLOOConfig has no field 'loss_type'", "RatioGRPOConfig (RatioGRPOTrainer"]),
    (dict(scale_rewards="group"), ["'scale_rewards'", "RatioGRPOConfig"]),
    (dict(off_policy_mask_threshold=0.5), ["'off_policy_mask_threshold'", "RatioGRPOConfig"]),
    (dict(vllm_importance_sampling_mode="token_mask"), ["'vllm_importance_sampling_mode'", "RatioGRPOConfig"]),
    (dict(async_objective="decoupled"), ["'async_objective'", "RatioAsyncGRPOConfig"]),
    (dict(normalize_advantage=True), ["'normalize_advantage'", "did you mean 'normalize_advantages'?"]),
    (dict(sampler_logprobs_in_loss=True), ["sampler_logprobs_in_loss=True", "RLOO's loss reads none"]),
    (dict(is_correction="tis"), ["is_correction='tis'", "token-level", "sequence_product"]),
    (dict(old_logprob_mode="fp8"), ["old_logprob_mode='fp8'", "allowed: bf16"]),
    (dict(ratio_gate=["rewrd>0"]), ["'rewrd'", "did you mean 'reward'"]),
    (dict(num_generations=1), ["num_generations=1", "an integer >= 2"]),
    (dict(routing_replay="R9", truncation_correction="x"), ["2 problems", "routing_replay='R9'",
                                                            "truncation_correction='x'"]),
]

ASYNC = [
    (dict(ratio_gate=["reward>0"]), ["RatioAsyncGRPOConfig has no field 'ratio_gate'", "RatioGRPOConfig",
                                     "RatioRLOOConfig"]),
    (dict(ratio_attribution=True), ["'ratio_attribution'", "RatioGRPOConfig"]),
    (dict(routing_replay="R2"), ["'routing_replay'", "RatioGRPOConfig"]),
    (dict(sampler_logprobs_in_loss=True), ["'sampler_logprobs_in_loss'", "RatioGRPOConfig"]),
    (dict(loss_type="dapo"), ["'loss_type'", "RatioGRPOConfig (RatioGRPOTrainer"]),
    (dict(async_objectve="decoupled"), ["'async_objectve'", "did you mean 'async_objective'?"]),
    (dict(async_objective="bogus"), ["async_objective='bogus'", "allowed: coupled, decoupled, decoupled_loglinear"]),
    (dict(async_objective="decoupld"), ["async_objective='decoupld'", "did you mean 'decoupled'?"]),
    (dict(old_logprob_mode="fp32_clone"), ["old_logprob_mode='fp32_clone' chooses the proximal pass",
                                           "async_objective='decoupled'"]),
    (dict(async_objective="decoupled", old_logprob_mode="sampler"), ["old_logprob_mode='sampler'",
                                                                     "async_objective='coupled'"]),
    (dict(async_objective="decoupled", old_logprob_mode="fp8"), ["old_logprob_mode='fp8'", "allowed: bf16"]),
    (dict(is_correction="tis"), ["is_correction='tis'", "async_objective='coupled'"]),
    (dict(async_objective="decoupled", old_logprob_mode="guided_fp32"), ["needs guided_fp32_layers"]),
    (dict(max_staleness=-1), ["max_staleness must be an integer >= 0"]),
    (dict(ratio_band_low="0.9"), ["ratio_band_low must be a number"]),
    (dict(async_objective="decoupled", top_p=0.8, truncation_correction="renormalize"),
     ["truncation_correction='renormalize'", "allowed: none, lift_sampler"]),
    (dict(top_p=0.8, truncation_correction="lift_sampler"), ["truncation_correction='lift_sampler'",
                                                             "only async_objective='decoupled'"]),
    (dict(async_objective="decoupled", truncation_correction="lift_sampler"), ["truncation_correction=",
                                                                               "nothing to correct"]),
    (dict(async_objective="decoupled", copy_storage="per_layer"), ["copy_storage='per_layer'", "fp16_clone"]),
    (dict(async_objective="decoupled", is_correction="custom", is_correction_level="token", is_correction_veto=2.0),
     ["2 problems", "needs is_correction_action", "is_correction_veto must be in (0, 1)"]),
    (dict(async_objective="x", max_staleness=-1), ["2 problems", "async_objective='x'", "max_staleness"]),
]

# recipe text (the tests/ quickstart keys are added), and what the one error must hold
RECIPES = [
    ("max_stesp: 3\n", ["unknown key 'max_stesp'", "did you mean 'max_steps'?"]),
    ("max_stesp: 3\nold_logprob_mod: fp32_clone\n", ["2 problems", "did you mean 'max_steps'?",
                                                     "did you mean 'old_logprob_mode'?"]),
    ("old_logprob_mode: fp33_clone\n", ["old_logprob_mode='fp33_clone'", "allowed: bf16, fp32_clone",
                                        "did you mean 'fp32_clone'?"]),
    ("trainer: rloo\nloss_type: dapo\n", ["'loss_type' is a field of RatioGRPOConfig (trainer: grpo), not of "
                                          "RatioRLOOConfig (this run's trainer: rloo)"]),
    ("trainer: rloo\nscale_rewards: group\n", ["'scale_rewards'", "RatioGRPOConfig (trainer: grpo)"]),
    ("normalize_advantages: true\n", ["'normalize_advantages' is a field of RatioRLOOConfig (trainer: rloo)"]),
    ("async_objective: decoupled\n", ["'async_objective' is a field of RatioAsyncGRPOConfig",
                                      "grpo-ratio train does not run"]),
    ("max_staleness: 1\n", ["'max_staleness'", "RatioAsyncGRPOConfig"]),
    ("bf16: flase\n", ["bf16='flase' is not a boolean", "allowed: true or false"]),
    ("num_generations: 0\n", ["num_generations=0", "an integer num_generations >= 2"]),
    ("top_p: 0\n", ["top_p=0", "0 < top_p <= 1"]),
    ("truncation_correction: clip\n", ["truncation_correction='clip'", "allowed: none, renormalize, lift_sampler"]),
    ("kept_set_source: sampler\n", ["kept_set_source='sampler'", "allowed: auto, recorded, recompute"]),
    ("copy_storage: layer\n", ["copy_storage='layer'", "allowed: resident, per_layer"]),
    ("routing_replay: R4\n", ["routing_replay='R4'", "allowed: none, R2, R3"]),
    ("is_correction: tiss\n", ["is_correction='tiss'", "allowed: ", "tis", "did you mean 'tis'?"]),
    ("ratio_gate_action: halt\n", ["ratio_gate_action='halt'", "allowed: warn, stop"]),
    ("trainer: ppo\n", ["trainer='ppo'", "allowed: grpo, rloo"]),
    ("learning_rate: fast\n", ["learning_rate='fast' is not a number"]),
    ("is_correction: custom\nis_correction_level: token\nis_correction_veto: 2.0\n",
     ["2 problems", "needs is_correction_action", "is_correction_veto must be in (0, 1)"]),
    ("is_correction: custom\nis_correction_level: token\nis_correction_action: truncate\n",
     ["action 'truncate' (is_correction_action) needs a bound", "is_correction_low and/or is_correction_high"]),
    ("is_correction: tis\nis_correction_low: 0.5\n", ["is_correction_low only applies with is_correction='custom'"]),
    ("ratio_gate: ['rewrd>=0.1']\nratio_gate_action: stop\n", ["ratio_gate: 'rewrd'", "did you mean 'reward'"]),
    ("ratio_gate: 'train/reward>0'\n", ["'train/reward'", "log rows hold 'reward'"]),
    ("ratio_gate: ['mean:reward>0']\n", ["ratio_gate", "only the scopes each, first"]),
    ("ratio_gate_patience: 0\nratio_gate: ['reward>0']\n", ["ratio_gate_patience", ">= 1"]),
    ("trainer: rloo\nloss_type: dapo\nmax_stesp: 3\nratio_gate: ['rewrd>0']\nbf16: flase\n",
     ["4 problems", "'loss_type'", "'max_stesp'", "'rewrd'", "bf16='flase'"]),
    ("- a\n- b\n", ["must be a YAML mapping of field: value"]),
    ("a: [\n", ["not valid YAML"]),
]

FLAGS = [
    (["--old_logprob_mdoe", "fp32_clone"], ["unknown flag --old_logprob_mdoe", "did you mean --old_logprob_mode?"]),
    (["--old_logprob_mod", "fp32_clone"], ["unknown flag --old_logprob_mod", "did you mean --old_logprob_mode?"]),
    (["--trainer", "rloo", "--loss_type", "dapo"], ["--loss_type is a field of RatioGRPOConfig (trainer: grpo)"]),
    (["--trainer=rloo", "--off_policy_mask_threshold", "0.5"], ["--off_policy_mask_threshold", "RatioGRPOConfig"]),
    (["--async_objective", "decoupled"], ["--async_objective is a field of RatioAsyncGRPOConfig"]),
    (["--normalize_advantages", "true"], ["--normalize_advantages is a field of RatioRLOOConfig (trainer: rloo)"]),
    (["--bf16", "flase", "--seed", "1.5"], ["2 problems", "bf16='flase' is not a boolean", "seed='1.5' is not an "
                                                                                             "integer"]),
    (["--old_logprob_mode", "fp16"], ["old_logprob_mode='fp16'", "allowed: bf16", "did you mean 'fp16_clone'?"]),
    (["--is_correction", "custom", "--is_correction_level", "token"], ["needs is_correction_action",
                                                                       "truncate, mask"]),
    (["--is_correction", "custom", "--is_correction_level", "token", "--is_correction_action", "mask",
      "--is_correction_veto", "1.5"], ["is_correction_veto must be in (0, 1), got 1.5"]),
    (["--ratio_gate", "rewrd>0"], ["ratio_gate: 'rewrd'", "did you mean 'reward'"]),
    (["--ratio_gate_action", "halt"], ["ratio_gate_action='halt'", "allowed: warn, stop"]),
    (["--num_generations", "0"], ["num_generations='0'", "an integer num_generations >= 2"]),
    (["--temperature", "0"], ["temperature='0'", "temperature > 0"]),
]

DATASETS = [
    (Dataset.from_dict({"prompt": [1, 2]}), ["'prompt' column holds int64 values", "a string or a conversation"]),
    (Dataset.from_dict({"prompt": [0.5, 1.5]}), ["'prompt' column holds float64 values"]),
    (Dataset.from_dict({"prompt": [None, None]}), ["'prompt' column holds null values"]),
    (Dataset.from_dict({"question": ["2+2?"]}), ["no 'prompt' column", "'question'"]),
    (Dataset.from_list([]), ["train_dataset is empty (0 rows)"]),
]


def _assert_names(err: Exception, fragments: list[str]):
    for fragment in fragments:
        assert fragment in str(err), f"{fragment!r} not in:\n{err}"


def _ids(cases):
    return [", ".join(f"{k}={v!r}" for k, v in kw.items())[:80] if isinstance(kw, dict) else
            (" ".join(kw) if isinstance(kw, list) else kw.replace("\n", " "))[:80] for kw, _ in cases]


@pytest.mark.parametrize("kw,fragments", GRPO, ids=_ids(GRPO))
def test_grpo_config(tmp_path, kw, fragments):
    with pytest.raises(ValueError) as err:  # UnknownFieldError is a ValueError (and a TypeError, as Python's own)
        RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)
    _assert_names(err.value, fragments)


@pytest.mark.parametrize("kw,fragments", RLOO, ids=_ids(RLOO))
def test_rloo_config(tmp_path, kw, fragments):
    with pytest.raises(ValueError) as err:
        RatioRLOOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kw)
    _assert_names(err.value, fragments)


@pytest.fixture(scope="module")
def async_config():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from grpo_ratio.async_grpo import RatioAsyncGRPOConfig

    return RatioAsyncGRPOConfig


@pytest.mark.parametrize("kw,fragments", ASYNC, ids=_ids(ASYNC))
def test_async_config(async_config, tmp_path, kw, fragments):
    with pytest.raises(ValueError) as err:
        async_config(str(tmp_path), bf16=False, use_cpu=True, report_to="none", **kw)
    _assert_names(err.value, fragments)


@pytest.mark.parametrize("text,fragments", RECIPES, ids=_ids(RECIPES))
def test_recipe(tmp_path, text, fragments):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        check_train(["--config", str(path)])
    _assert_names(err.value, fragments)


@pytest.mark.parametrize("argv,fragments", FLAGS, ids=_ids(FLAGS))
def test_flags(argv, fragments):
    with pytest.raises(ConfigError) as err:
        check_train(["--config", str(ROOT / "recipes" / "smollm2-135m" / "quickstart_cpu.yaml"), *argv])
    _assert_names(err.value, fragments)


@pytest.mark.parametrize("dataset,fragments", DATASETS, ids=["ints", "floats", "nulls", "no prompt", "empty"])
def test_dataset(dataset, fragments):
    with pytest.raises(ValueError) as err:
        check_train_dataset(dataset)
    _assert_names(err.value, fragments)


def test_the_trial_has_at_least_100_inputs():
    assert len(GRPO) + len(RLOO) + len(ASYNC) + len(RECIPES) + len(FLAGS) + len(DATASETS) + len(CLI) >= 100


def test_a_wrong_trainer_field_is_still_a_type_error_and_good_configs_pass(tmp_path, async_config):
    # Python's own error for an unexpected keyword is a TypeError: code catching it keeps working
    with pytest.raises(TypeError, match="RatioAsyncGRPOConfig"):
        RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, async_objective="decoupled")
    # the mixin changes nothing else: the defaults are TRL's, keyword and positional construction, copies, the parser
    import copy
    import pickle

    from trl import GRPOConfig, TrlParser

    cfg = RatioGRPOConfig(str(tmp_path), use_cpu=True, report_to="none")
    stock = GRPOConfig(str(tmp_path), use_cpu=True, report_to="none")
    assert {k: v for k, v in cfg.to_dict().items() if k in stock.to_dict()} == stock.to_dict()
    assert copy.deepcopy(cfg).to_dict() == pickle.loads(pickle.dumps(cfg)).to_dict() == cfg.to_dict()
    (parsed,) = TrlParser((RatioGRPOConfig,)).parse_args_and_config(["--output_dir", str(tmp_path), "--use_cpu",
                                                                      "true", "--old_logprob_mode", "fp32_clone"])
    assert parsed.old_logprob_mode == "fp32_clone"
    async_config(str(tmp_path), bf16=False, use_cpu=True, async_objective="decoupled", old_logprob_mode="fp32_clone")
    # gate keys TRL logs, an evaluation row's, a namespace of the user's own (TRL's log_metric, a callback): accepted
    gate = ["reward>0", "rewards/my_func/mean>0", "completions/mean_length<100", "eval_reward>0", "my/accuracy>0.5",
            "ratio/staleness/2/new_behav_oob_rate<0.1"]
    assert RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, ratio_gate=gate).ratio_gate == gate


def test_report_check_names_the_key_for_a_train_prefix_and_a_typo(tmp_path, capsys):
    from grpo_ratio.analysis.report import main

    (tmp_path / "log_history.json").write_text(json.dumps([{"step": 1, "reward": 0.5, "loss": 0.1}]))
    assert main([str(tmp_path), "--check", "train/reward>0", "--check", "rewrd>0"]) == 1
    out = capsys.readouterr().out
    assert "never logged (train/reward is W&B's or TensorBoard's name: the trainer's log rows hold 'reward'" in out
    assert "never logged (rewrd is not a key TRL or transformers log" in out and "did you mean 'reward'" in out


def test_compare_reports_every_recipe_problem_at_once(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: rloo\nloss_type: dapo\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("max_stesp: 2\n")
    with pytest.raises(ConfigError) as err:
        check_compare(["--recipes", str(bad), str(typo), str(tmp_path / "nope.yaml"), "--bf16", "flase"])
    _assert_names(err.value, ["4 problems", "'loss_type'", "'max_stesp'", "no such file", "bf16='flase'"])


# the command line, in a fresh interpreter: exit status 2, every problem on stderr, before transformers is imported
CLI = [  # (recipe, flags, what the one error must hold)
    ("trainer: rloo\nloss_type: dapo\nmax_stesp: 3\nold_logprob_mod: fp32_clone\nratio_gate: ['rewrd>0']\n", [],
     ["4 problems", "'loss_type' is a field of RatioGRPOConfig", "did you mean 'max_steps'?",
      "did you mean 'old_logprob_mode'?", "did you mean 'reward'"]),
    ("is_correction: custom\nis_correction_level: token\n", ["--is_correction_veto", "2", "--bf16", "flase"],
     ["3 problems", "needs is_correction_action", "is_correction_veto must be in (0, 1)", "bf16='flase'"]),
    ("async_objective: coupled\n", ["--normalize_advantages", "true"],
     ["2 problems", "RatioAsyncGRPOConfig", "--normalize_advantages is a field of RatioRLOOConfig"]),
]


@pytest.mark.parametrize("text,argv,fragments", CLI, ids=["recipe", "correction", "trainers"])
def test_the_command_line_says_every_problem_before_the_heavy_imports(tmp_path, text, argv, fragments):
    # the custom correction's fields too (the issue: one at a time, after 18 s of imports): torch is not imported
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    code = ("import sys, time\nstart = time.perf_counter()\nfrom grpo_ratio.cli import main\ntry:\n"
            "    main(['train', '--config', *sys.argv[1:]])\nexcept SystemExit as e:\n"
            "    print(e.code, 'torch' in sys.modules, 'transformers' in sys.modules, time.perf_counter() - start)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(recipe), *argv], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    status, torch_imported, transformers_imported, seconds = proc.stdout.split()
    assert (status, torch_imported, transformers_imported) == ("2", "False", "False"), proc.stdout + proc.stderr
    assert float(seconds) < 10  # about a second on an idle machine (no torch, TRL trainer or model): not 18 s
    assert proc.stderr.startswith("grpo-ratio train: error: ")
    _assert_names(proc.stderr, fragments)
