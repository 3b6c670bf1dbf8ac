"""benchmarks/step_cost.py on the tiny model, one round: every arm runs, stock TRL is the reference of every ratio,
and the old passes are counted from the wrapped methods, not assumed."""

import importlib.util
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
# benchmarks/ is a folder of scripts, not a package: load the script as the module `step_cost` (registered, so its
# dataclasses resolve their module)
_spec = importlib.util.spec_from_file_location("step_cost", ROOT / "benchmarks" / "step_cost.py")
step_cost = sys.modules.setdefault("step_cost", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(step_cost)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("step_cost")
    recipe = step_cost.read_recipe(ROOT / step_cost.RECIPE)
    recipe["max_completion_length"] = 4  # a quarter of the recipe's 16: a shorter test, the same code path
    spec = step_cost.load_spec("tiny", tmp, recipe)
    runs = step_cost.run_benchmark(spec, recipe, rounds=1, warmup=0, steps=1, workdir=tmp, log=lambda msg: None)
    return step_cost.make_result("python benchmarks/step_cost.py --model tiny (test)", spec, step_cost.RECIPE,
                                 recipe, runs, rounds=1, steps=1, warmup=0)


@pytest.fixture(scope="module")
def summary(result):
    return step_cost.summarize(result)


def test_every_arm_runs_one_timed_step(result, summary):
    assert list(summary) == [arm.name for arm in step_cost.ARMS]
    for arm, s in summary.items():
        assert s["timed_steps"] == 1 and s["generations"] == 1, arm
        assert s["step_seconds"] > 0 and s["peak_bytes"] > 0, arm
        assert s["calls"]["train_forward"] >= 1 and s["calls"]["backward"] >= 1 and s["calls"]["optimizer"] >= 1
    for run in result["runs"]:
        (step,) = run["steps"]
        assert step["parts"]["other"] >= 0  # exclusive parts never add up to more than the step
        assert sum(step["parts"].values()) == pytest.approx(step["seconds"])


def test_ratios_are_relative_to_stock_trl(summary):
    ref = summary[step_cost.REFERENCE]
    assert ref["time_ratio"] == 1.0 and ref["memory_ratio"] == 1.0
    assert summary["fp32_clone"]["time_ratio"] == summary["fp32_clone"]["step_seconds"] / ref["step_seconds"]


def test_old_passes_are_counted(summary):
    # TRL's on-policy default skips the old pass: stock TRL and the bf16 mode run none; every other mode runs one
    # the sampler arm anchors to the rollout's recorded log-probs: no old pass of either kind
    for arm in (step_cost.REFERENCE, "trl_cast_lm_head_to_fp32", "bf16", "sampler"):
        assert summary[arm]["calls"]["trl_old_pass"] == 0 and summary[arm]["calls"]["mode_old_pass"] == 0, arm
        assert summary[arm]["old_passes_per_generation"] == 0 and summary[arm]["added_share"] == 0
    for arm in ("fp32_clone", "fp16_clone", "guided_fp32"):
        assert summary[arm]["calls"]["mode_old_pass"] == summary[arm]["generations"], arm
        assert summary[arm]["old_passes_per_generation"] == 1 and summary[arm]["added_share"] > 0
        assert summary[arm]["calls"]["fused_head"] == 0, arm
    # fp32_head in the on-policy default: no body pass, one fp32 norm + head per training forward (micro-batch)
    for arm in ("fp32_head", "fp32_head_bf16_operands"):  # the sampler's fp32 head fuses the same way
        head = summary[arm]
        assert head["calls"]["mode_old_pass"] == head["calls"]["trl_old_pass"] == 0, arm
        assert head["old_passes_per_generation"] == 0 and head["added_share"] > 0, arm
        assert head["calls"]["fused_head"] == head["calls"]["train_forward"] >= 1, arm
    # is_correction at bf16 (issue 43): no old pass, the training forward reused; the two-pass arm runs TRL's helper
    # once per generation without grad, and exactly one forward of the policy more per step (the same rollouts)
    reused, two_pass = summary["tis"], summary["tis_two_pass"]
    assert reused["calls"]["trl_old_pass"] == reused["old_passes_per_generation"] == reused["added_share"] == 0
    assert two_pass["calls"]["trl_old_pass"] == two_pass["generations"] and two_pass["old_passes_per_generation"] == 1
    assert two_pass["forwards_per_step"] == reused["forwards_per_step"] + 1
    assert reused["forwards_per_step"] == summary[step_cost.REFERENCE]["forwards_per_step"]
    # fp32 weights: only fp16_clone keeps a copy, refreshed once per old pass; the fp32 modes run the policy itself
    assert summary["fp16_clone"]["calls"]["copy_refresh"] == summary["fp16_clone"]["calls"]["mode_old_pass"]
    assert summary["fp32_clone"]["calls"]["copy_refresh"] == 0


def test_render_names_command_and_arms(result):
    text = step_cost.render(result)
    assert text.splitlines()[0].startswith("`python benchmarks/step_cost.py --model tiny (test)`")
    assert text.splitlines()[0].endswith("; machine not recorded")  # make_result without machine=...
    for arm in step_cost.ARMS:
        assert f"| {arm.name} |" in text


def test_untied_copy_has_its_own_head(tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_ratio.testing import tiny_model

    tiny_model("llama", tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    model = AutoModelForCausalLM.from_pretrained(step_cost.untie_head(str(tmp_path / "tied"), str(tmp_path / "u")))
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert not model.config.tie_word_embeddings
    assert head.data_ptr() != embedding.data_ptr() and head.equal(embedding)


def test_the_machine_is_recorded_and_named_in_the_header(result):
    import os

    import torch

    from grpo_ratio.machine import cpu_has_native_bf16, machine_record

    machine = machine_record()
    assert machine["cores"] == os.cpu_count() and machine["native_bf16"] == cpu_has_native_bf16()
    assert ("AMX" in machine["isa"]) == torch.cpu._is_amx_tile_supported()
    assert machine["native_bf16"] == bool({"AVX512-BF16", "AMX"} & set(machine["isa"]))
    header = step_cost.render({**result, "machine": {**machine, "load_before": 0.25}}).splitlines()[0]
    assert header.endswith(f"{machine['cpu']} ({'/'.join(machine['isa'])}; "
                           f"{'native bf16' if machine['native_bf16'] else 'no native bf16: bf16 emulated'}), "
                           "load 0.25 at the start")
