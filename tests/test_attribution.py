"""`ratio_attribution`: log(new) - log(sampler) per token split into drift, train_precision, precision, routing,
truncation and engine (grpo_ratio/diagnostics/attribution.py, docs/attribution.md): the identity on literal tensors, the
statistics, the config, the start-up checks and the memory of the fp32 reference, the report and the committed result's
rendering, and on tiny models which term each setting makes the largest or exactly 0.

Run: HF_HUB_OFFLINE=1 pytest tests/test_attribution.py
"""

import math

import pytest
import torch
from routing_fixtures import near_tie_model
from trainer_fixtures import tiny_trainer, trl_logged_values

from grpo_ratio.diagnostics import metric_keys as keys
from grpo_ratio.diagnostics.attribution import (
    TERMS,
    AttributionReference,
    AttributionStats,
    attribution_terms,
    largest_term,
    row_positions,
    sample_rows,
)


# ---------------------------------------------------------------------------------------------------------------------
# the math, on literal tensors


def _reference():
    own = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])  # the fp32 reference with the old pass's routes
    sampler_routes = torch.tensor([[-1.25, -2.0], [-0.5, -2.5]])  # the same with the sampler's routes
    kept = torch.tensor([[-1.0, -1.5], [-0.25, -2.5]])  # the latter over the sampler's kept set (>= full)
    return AttributionReference(own, sampler_routes, kept)


def test_the_six_terms_are_the_differences_of_their_passes_and_add_up_to_new_minus_sampler():
    new = torch.tensor([[-0.75, -2.0], [-0.5, -3.5]])
    at_generation = torch.tensor([[-0.5, -2.0], [-0.5, -3.0]])  # the training forward at the generation's weights
    old = torch.tensor([[-1.0, -2.0], [-0.25, -3.0]])
    sampler = torch.tensor([[-1.0, -1.0], [-0.5, -2.0]])
    terms = attribution_terms(new, old, sampler, _reference(), new_at_generation=at_generation)
    expected = {
        "drift": [[-0.25, 0.0], [0.0, -0.5]],  # new - new_gen: what moved
        "train_precision": [[0.5, 0.0], [-0.25, 0.0]],  # new_gen - old: how the training forward computes
        "precision": [[0.0, 0.0], [0.25, 0.0]],  # old - own
        "routing": [[0.25, 0.0], [0.0, -0.5]],  # own - sampler_routes
        "truncation": [[-0.25, -0.5], [-0.25, 0.0]],  # sampler_routes - kept (log M of the reference)
        "engine": [[0.0, -0.5], [0.25, -0.5]],  # kept - sampler
        "total": [[0.25, -1.0], [0.0, -1.5]],  # new - sampler
    }
    for name, values in expected.items():
        torch.testing.assert_close(terms[name], torch.tensor(values), rtol=0, atol=0)
    summed = sum(terms[t] for t in TERMS)
    torch.testing.assert_close(summed, terms["total"], rtol=0, atol=0)  # dyadic values: no rounding at all
    assert TERMS == ("drift", "train_precision", "precision", "routing", "truncation", "engine")
    # at the first inner step the training forward runs the generation's weights: it is its own new_gen, so drift
    # is exactly 0 and train_precision holds new - old; the six still add up
    first = attribution_terms(new, old, sampler, _reference())
    assert torch.equal(first["drift"], torch.zeros(2, 2))
    torch.testing.assert_close(first["train_precision"], new - old, rtol=0, atol=0)
    torch.testing.assert_close(sum(first[t] for t in TERMS), first["total"], rtol=0, atol=0)
    with pytest.raises(ValueError, match="one shape"):
        attribution_terms(new, old, sampler, _reference(), new_at_generation=new[:1])


def test_under_lift_sampler_the_lift_leaves_the_truncation_term_and_the_engine_sees_the_raw_sampler():
    ref = _reference()
    new = old = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])  # = own: drift and precision 0
    raw = torch.tensor([[-1.0, -1.5], [-0.25, -2.5]])  # the sampler's own log-probs = the reference over S
    lift = torch.tensor([[-0.25, -0.5], [-0.25, 0.0]])  # log M_old = log M of the reference here
    terms = attribution_terms(new, old, raw + lift, ref, lift)
    # truncation = (ref - kept) - lift = log M_ref - log M_old: 0 where the lift is exact
    torch.testing.assert_close(terms["truncation"], torch.zeros(2, 2), rtol=0, atol=0)
    torch.testing.assert_close(terms["engine"], torch.zeros(2, 2), rtol=0, atol=0)  # kept - raw
    torch.testing.assert_close(sum(terms[t] for t in TERMS), terms["total"], rtol=0, atol=0)


def test_one_pass_for_both_routes_and_no_kept_set_give_exact_zeros():
    full = torch.tensor([[-1.1, -2.3], [-0.7, -3.9]])
    ref = AttributionReference(full, full, full)  # a dense policy at top_p=1: one tensor
    terms = attribution_terms(full + 0.1, full - 0.3, full + 0.2, ref)
    assert torch.equal(terms["routing"], torch.zeros(2, 2)) and torch.equal(terms["truncation"], torch.zeros(2, 2))
    with pytest.raises(ValueError, match="one shape"):
        attribution_terms(full[:1], full, full, ref)


def test_the_statistics_pool_tokens_and_report_shares_means_and_the_rounding_error():
    terms = attribution_terms(torch.tensor([[-0.75, -2.0], [-0.5, -3.5]]), torch.tensor([[-1.0, -2.0], [-0.25, -3.0]]),
                              torch.tensor([[-1.0, -1.0], [-0.5, -2.0]]), _reference())
    mask = torch.tensor([[True, True], [True, False]])  # 3 tokens
    stats = AttributionStats().update(terms, mask)
    m = stats.as_metrics()
    # |terms| over the 3 tokens: drift 0 (the first inner step), train_precision .5, precision .25, routing .25,
    # truncation 1.0, engine .75; total 2.75
    assert m[keys.attribution_key("truncation", "mean_abs")] == pytest.approx(1.0 / 3)
    assert m[keys.attribution_key("truncation", "share")] == pytest.approx(1.0 / 2.75)
    assert m[keys.attribution_key("drift", "mean_abs")] == 0.0 and m[keys.attribution_key("drift", "share")] == 0.0
    assert m[keys.attribution_key("train_precision", "mean")] == pytest.approx(0.0)  # 0.25 + 0 - 0.25
    assert m[keys.attribution_key("train_precision", "mean_abs")] == pytest.approx(0.5 / 3)
    assert m[keys.attribution_key("engine", "mean")] == pytest.approx(-0.25 / 3)
    assert sum(m[keys.attribution_key(t, "share")] for t in TERMS) == pytest.approx(1.0)
    assert m[keys.ATTRIBUTION_IDENTITY_ERROR] == 0.0 and m[keys.ATTRIBUTION_NUM_TOKENS] == 3
    assert set(m) <= set(keys.TABLE) and len(m) == 3 * 6 + 2
    assert largest_term(m) == "truncation"
    # a second micro-batch adds up; a non-finite token is left out; an empty update logs nothing
    other = AttributionStats().update(terms, torch.tensor([[False, False], [False, True]]))
    assert stats.merge(other).as_metrics()[keys.ATTRIBUTION_NUM_TOKENS] == 4
    assert AttributionStats().update(terms, torch.zeros(2, 2, dtype=torch.bool)).as_metrics() == {}
    terms["engine"][0, 0] = float("nan")
    assert AttributionStats().update(terms, mask).as_metrics()[keys.ATTRIBUTION_NUM_TOKENS] == 2


def test_the_rounding_error_of_an_fp32_sum_is_measured():
    new, old = torch.tensor([[1.0e-8]]), torch.tensor([[1.0]])
    ref = AttributionReference(torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([[-1.0]]))
    terms = attribution_terms(new, old, torch.tensor([[3.0e-8]]), ref)
    error = AttributionStats().update(terms, torch.ones(1, 1, dtype=torch.bool)).identity_error.item()
    exact = abs(sum(float(terms[t]) for t in TERMS) - float(terms["total"]))
    assert 0 < error < 1e-6 and error == pytest.approx(exact, rel=1e-6, abs=1e-9)


def test_rows_are_sampled_evenly_and_found_again_after_the_shuffle():
    assert sample_rows(16, 4).tolist() == [0, 5, 10, 15]
    assert sample_rows(3, 8).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="limit >= 1"):
        sample_rows(4, 0)
    positions = row_positions(torch.tensor([0, 5, 10, 15]), 16)
    assert positions[[0, 5, 10, 15]].tolist() == [0, 1, 2, 3] and (positions >= 0).sum() == 4
    ref = AttributionReference(torch.arange(8.0).reshape(4, 2), torch.arange(8.0).reshape(4, 2) + 1,
                               torch.arange(8.0).reshape(4, 2) + 2)
    micro = ref.for_rows(torch.tensor([2, -1, 0]))  # a shuffled micro-batch: row 1 was not sampled
    assert micro.own_routes[0].tolist() == [4.0, 5.0] and micro.own_routes[2].tolist() == [0.0, 1.0]
    assert torch.isnan(micro.own_routes[1]).all() and micro.present.tolist() == [True, False, True]


# ---------------------------------------------------------------------------------------------------------------------
# the config


@pytest.mark.parametrize(("value", "rows"), [(None, None), (False, None), ("false", None), (True, 2**31 - 1),
                                             ("true", 2**31 - 1), (8, 8), ("8", 8)])
def test_the_field_accepts_true_a_row_count_or_off(tmp_path, value, rows):
    from trainer_fixtures import tiny_grpo_args

    assert tiny_grpo_args(tmp_path, ratio_attribution=value).ratio_attribution_rows == rows


@pytest.mark.parametrize(("overrides", "match"), [
    (dict(ratio_attribution=-2), "ratio_attribution=-2 is not allowed; allowed: True"),
    (dict(ratio_attribution="all"), "ratio_attribution='all' is not allowed"),
    (dict(ratio_attribution=True, ratio_diagnostics=False), "ratio_diagnostics=False"),
    (dict(ratio_attribution=4, record_sampler_logprobs=False), "record_sampler_logprobs=False"),
])
def test_bad_values_are_refused_naming_the_field(tmp_path, overrides, match):
    from trainer_fixtures import tiny_grpo_args

    with pytest.raises(ValueError, match=match):
        tiny_grpo_args(tmp_path, **overrides)


# ---------------------------------------------------------------------------------------------------------------------
# the reference scorer meets every start-up check of a scoring mode (checks.scoring_uses)


def test_the_modes_a_run_scores_with(tmp_path):
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio.checks import scoring_uses

    def uses(**overrides):
        return [(u.mode, u.field) for u in scoring_uses(tiny_grpo_args(tmp_path, **overrides))]

    assert uses() == [("bf16", "old_logprob_mode")]
    assert uses(ratio_attribution=True) == [("bf16", "old_logprob_mode"), ("fp32_clone", "ratio_attribution")]
    assert uses(old_logprob_mode="fp16_clone", ratio_attribution=4) == [("fp16_clone", "old_logprob_mode"),
                                                                         ("fp32_clone", "ratio_attribution")]
    assert uses(old_logprob_mode="fp32_clone", ratio_attribution=True) == [("fp32_clone", "old_logprob_mode")]


def _zero3(**config):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    plugin = SimpleNamespace(zero_stage=3, deepspeed_config={"zero_optimization": {"stage": 3}, **config})
    return SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, deepspeed_plugin=plugin))


def _fsdp2(offload=False):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    plugin = SimpleNamespace(fsdp_version=2, cpu_offload=CPUOffloadPolicy() if offload else OffloadPolicy())
    return SimpleNamespace(state=SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin))


def _frozen_embedding():
    from grpo_ratio.testing import tiny_model

    model = tiny_model()
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def _lora():
    peft = pytest.importorskip("peft")
    from grpo_ratio.testing import tiny_model

    return peft.get_peft_model(tiny_model(), peft.LoraConfig(r=2, target_modules=["q_proj"]))


SHARDED_REFUSALS = {  # (accelerator, model, config overrides, what the message says)
    "zero3_frozen": (lambda: _zero3(bf16={"enabled": True}), _frozen_embedding, {},
                     "frozen parameters .* have no fp32 master partition to copy from; train every parameter, or turn "
                     "ratio_attribution off"),
    "zero3_peft": (lambda: _zero3(bf16={"enabled": True}), _lora, {}, "a PEFT adapter is not supported"),
    "fsdp2_peft": (_fsdp2, _lora, {}, "a PEFT adapter is not supported"),
    "zero3_offload": (lambda: _zero3(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}), None, {},
                      "parameter offload \\(offload_param\\) is not supported; turn offload_param off, or turn "
                      "ratio_attribution off"),
    "fsdp2_offload": (lambda: _fsdp2(offload=True), None, {}, "parameter offload \\(fsdp_offload_params\\)"),
    "fsdp2_fp16": (_fsdp2, None, dict(bf16=False, fp16=True), "fp16 mixed precision"),
}


@pytest.mark.parametrize("case", list(SHARDED_REFUSALS))
def test_sharded_set_ups_the_reference_cannot_run_are_refused_at_start_naming_ratio_attribution(tmp_path, case):
    # the default old_logprob_mode ('bf16', TRL's own pass, never refused): only the attribution's fp32_clone
    # reference scorer cannot run here, and the message says so (it used to fail at the first generation)
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio.checks import check_sharded_mode
    from grpo_ratio.testing import tiny_model

    accelerator, model, overrides, match = SHARDED_REFUSALS[case]
    model = (model or tiny_model)()
    check_sharded_mode(accelerator(), model, tiny_grpo_args(tmp_path, **overrides))  # attribution off: allowed
    args = tiny_grpo_args(tmp_path, ratio_attribution=True, **overrides)
    with pytest.raises(NotImplementedError, match=f"^ratio_attribution=True \\(its fp32 reference pass, an "
                                                  f"'fp32_clone' scorer\\) under .*{match}"):
        check_sharded_mode(accelerator(), model, args)


def test_a_quantized_base_is_refused_at_start_naming_ratio_attribution(tmp_path):
    from trainer_fixtures import tiny_grpo_args

    from grpo_ratio import RatioGRPOTrainer
    from grpo_ratio.testing import letter_reward, tiny_model, tiny_prompts, tiny_tokenizer

    def build(**overrides):
        model = tiny_model("qwen2")
        model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}  # as QLoRA loads
        return RatioGRPOTrainer(model=model, reward_funcs=letter_reward, args=tiny_grpo_args(tmp_path, **overrides),
                                train_dataset=tiny_prompts(4), processing_class=tiny_tokenizer())

    build()  # the default mode is TRL's own pass: a quantized base is fine
    with pytest.raises(ValueError, match="^ratio_attribution=True \\(its fp32 reference pass, an 'fp32_clone' "
                                         "scorer\\) copies the model's modules in another dtype, but the base model "
                                         "is quantized \\(bitsandbytes\\).*Turn it off: turn ratio_attribution off"):
        build(ratio_attribution=True)


# ---------------------------------------------------------------------------------------------------------------------
# on tiny models (CPU, transformers generate)


def _steps(trainer) -> list[dict]:
    return [row for row in trainer.state.log_history if keys.ATTRIBUTION_NUM_TOKENS in row]


def _term(row: dict, term: str, stat: str = "mean_abs") -> float:
    return row[keys.attribution_key(term, stat)]


def test_with_top_p_the_truncation_term_is_the_largest_and_the_identity_holds(tmp_path, capsys):
    from grpo_ratio.analysis.report import main

    trainer = tiny_trainer(tmp_path, top_p=0.8, ratio_attribution=True)  # bf16 autocast, no correction
    trainer.train()
    assert main([str(tmp_path)]) == 0  # the report reads the run's log_history.json
    report = capsys.readouterr().out
    assert "| step | drift | train_precision | precision | routing | truncation | engine | identity error |" in report
    assert report.count("| 1 | 0% (0) | 0% (0) |") == 1 and "| 2 | 0% (0) | 0% (0) |" in report  # a row per step
    assert "terms of the time" not in report  # a run logged with today's six terms
    assert "The largest cause is **truncation**" in report and "truncation_correction='renormalize'" in report
    steps = _steps(trainer)
    assert len(steps) == 2 and all(row[keys.ATTRIBUTION_NUM_TOKENS] >= 4 * 7 for row in steps)
    for row in steps:
        assert largest_term(row) == "truncation" and _term(row, "truncation", "share") > 0.9
        # log M of a near-uniform tiny model at top_p=0.8: about log 0.8 = -0.223 per token, always negative
        assert _term(row, "truncation", "mean") == pytest.approx(math.log(0.8), abs=0.01)
        assert _term(row, "drift") == 0.0 and _term(row, "train_precision") == 0.0  # on-policy: old := new
        assert _term(row, "routing") == 0.0  # a dense policy: one reference pass
        assert 0 < _term(row, "precision") < 1e-2 and 0 < _term(row, "engine") < 1e-2  # bf16 vs fp32
        assert row[keys.ATTRIBUTION_IDENTITY_ERROR] <= 1e-6
        # the six signed means add up to mean log(new / sampler), here -mean log(old/sampler) (new == old)
        signed = sum(_term(row, t, "mean") for t in TERMS)
        assert signed == pytest.approx(-row[keys.OLD_SAMPLER.mean_abs_log_ratio], abs=2e-3)


def test_at_top_p_1_the_truncation_term_is_exactly_0(tmp_path):
    trainer = tiny_trainer(tmp_path, top_p=1.0, ratio_attribution=2)  # 2 sampled rows per generation batch
    trainer.train()
    steps = _steps(trainer)
    assert len(steps) == 2
    assert all(_term(row, "truncation") == 0.0 and _term(row, "truncation", "share") == 0.0 for row in steps)
    assert all(row[keys.ATTRIBUTION_NUM_TOKENS] <= 2 * 8 for row in steps)  # 2 rows x 8 tokens at most
    assert all(_term(row, "precision") > 0 for row in steps)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_precision_term_is_0_in_fp32_to_rounding_and_not_in_bf16(tmp_path, bf16):
    trainer = tiny_trainer(tmp_path, bf16=bf16, ratio_attribution=True)
    trainer.train()
    precision = [_term(row, "precision") for row in _steps(trainer)]
    assert len(precision) == 2
    if bf16:
        assert min(precision) > 1e-4  # bf16 autocast vs the fp32 reference: ~4e-4 nats per token
    else:
        assert max(precision) < 1e-5  # the same fp32 weights; only the batch shape and positions differ


def test_under_fp32_clone_on_bf16_weights_drift_is_exactly_0_and_train_precision_holds_new_minus_old(tmp_path):
    # the issue: under fp32_clone "drift" (then new - old) was 43-52% of the distance at the first inner step, where no
    # weight has moved: it held the bf16 training forward against the fp32 old pass. What moved is now exactly 0 there,
    # and the training forward's own precision has its own term
    from grpo_ratio.testing import tiny_model

    trainer = tiny_trainer(tmp_path, "fp32_clone", model=tiny_model("qwen2", dtype=torch.bfloat16),
                           ratio_attribution=True)  # top_p=1: no truncation term
    trainer.train()
    steps = _steps(trainer)
    assert len(steps) == 2
    for row in steps:
        assert _term(row, "drift") == 0.0 and _term(row, "drift", "share") == 0.0 and _term(row, "drift", "mean") == 0
        # the training forward (bf16 weights, bf16 autocast) against the fp32 old pass: all of new - old
        assert _term(row, "train_precision") > 1e-4
        assert _term(row, "train_precision") == pytest.approx(row[keys.NEW_OLD.mean_abs_log_ratio], rel=1e-5)
        assert _term(row, "train_precision", "share") > 0.3  # about half of the distance here, as the issue saw
        assert _term(row, "precision") == 0.0  # the reference is the fp32_clone pass itself
        assert _term(row, "truncation") == 0.0 and _term(row, "engine") > 0
        assert row[keys.ATTRIBUTION_IDENTITY_ERROR] <= 1e-6  # the six still add up to log(new) - log(sampler)
        assert sum(_term(row, t, "share") for t in TERMS) == pytest.approx(1.0)


def test_the_report_reads_a_run_logged_with_the_five_terms_of_the_time():
    from grpo_ratio.analysis.report import ATTRIBUTION_FIXES, render_attribution

    old = {"drift": 0.004, "precision": 0.0, "routing": 0.0, "truncation": 0.001, "engine": 0.002}  # an fp32_clone run
    row = {"step": 1, keys.ATTRIBUTION_NUM_TOKENS: 64, keys.ATTRIBUTION_IDENTITY_ERROR: 0.0}
    for term, value in old.items():
        row |= {f"ratio/attribution/{term}/mean_abs": value, f"ratio/attribution/{term}/share": value / 0.007}
    text = render_attribution([row])
    assert "| step | drift | precision | routing | truncation | engine | identity error |" in text
    assert "logged with the 5 terms of the time (drift, precision, routing, truncation, engine)" in text
    assert "its `drift` is new - old at the first inner step, which is today's `train_precision`" in text
    # its largest term is its drift, read as today's train_precision: no setting of the four removes it
    assert "The largest cause is **drift**" in text and ATTRIBUTION_FIXES["train_precision"] in text
    assert render_attribution([{"step": 1, "loss": 0.0}]) == ""


def _benchmark():
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "attribution_smollm2.py"
    spec = importlib.util.spec_from_file_location("attribution_smollm2", path)
    module = sys.modules.setdefault("attribution_smollm2", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


def test_the_committed_result_renders_with_its_own_terms_and_a_new_one_with_six():
    import json
    from pathlib import Path

    bench = _benchmark()
    old = json.loads((Path(__file__).resolve().parents[1] / "results" / "attribution_smollm2.json").read_text())
    assert bench.recorded_terms(old) == ["drift", "precision", "routing", "truncation", "engine"]
    text = bench.render(old)
    assert "| arm | top_p | drift: share, mean | precision: share, mean |" in text
    assert "Recorded with the 5 terms of the time" in text and "today's `train_precision`" in text
    assert "| bf16 (TRL's own pass) | 0.8 |" in text and "| fp32_clone | 1.0 |" in text  # the arms by what they do
    new = json.loads(json.dumps(old))
    for run in new["runs"]:
        summary = run["summary"]
        summary |= {keys.attribution_key("train_precision", s): summary[keys.attribution_key("drift", s)]
                    for s in keys.ATTRIBUTION_STATS}
        summary |= {keys.attribution_key("drift", s): 0.0 for s in keys.ATTRIBUTION_STATS}
    assert bench.recorded_terms(new) == list(TERMS)
    text = bench.render(new)
    assert "| drift: share, mean | train_precision: share, mean | precision: share, mean |" in text
    assert "terms of the time" not in text


@pytest.mark.parametrize("replay", ["none", "R3"])
def test_on_a_tiny_moe_the_routing_term_is_non_zero_without_replay_and_0_with_r3(tmp_path, replay):
    # near-tied routers: the bf16 sampler's routes flip against an fp32 pass (tests/test_routing_trainer.py); an fp32
    # old pass (fp32_clone) with num_iterations=2, so the old pass records its routes
    trainer = tiny_trainer(tmp_path, "fp32_clone", model=near_tie_model("qwen3_moe"), routing_replay=replay,
                           num_iterations=2, max_steps=4, ratio_attribution=True)
    trainer.train()
    routing = [_term(row, "routing") for row in _steps(trainer)]
    assert len(routing) == 2
    if replay == "R3":
        assert routing == [0.0, 0.0]  # the old pass replays the sampler's routes: one reference pass
    else:
        assert max(routing) > 1e-4
    assert all(_term(row, "precision") == 0.0 for row in _steps(trainer))  # the reference is the fp32_clone pass


class _WeightCasts:
    """A dispatcher mode: the fp32 casts of the policy's weights (`_to_copy` of a parameter's storage) alive at once
    inside the block, at most (`peak`, bytes), and how many are alive at its end (`alive`)."""

    def __init__(self, model):
        from torch.utils._python_dispatch import TorchDispatchMode

        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        live = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
                import weakref

                out = func(*args, **(kwargs or {}))
                source = args[0] if args and isinstance(args[0], torch.Tensor) else None
                if (func is torch.ops.aten._to_copy.default and out.dtype == torch.float32 and source is not None
                        and source.untyped_storage().data_ptr() in weights):
                    live[id(out)] = (weakref.ref(out), out.untyped_storage().nbytes())
                for key in [k for k, (ref, _) in live.items() if ref() is None]:
                    del live[key]
                self.peak = max(self.peak, sum(n for _, n in live.values()))
                return out

        self.mode, self.live, self.peak = Mode(), live, 0

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.alive = sum(n for ref, n in self.live.values() if ref() is not None)


@pytest.mark.parametrize("adapters", [False, True])
def test_on_bf16_weights_the_reference_keeps_no_fp32_copy_and_casts_one_module_at_a_time(tmp_path, adapters):
    # a bf16-stored policy (every PEFT run, dtype=bfloat16): the fp32 reference used to hold a resident fp32 copy of
    # the whole model (4 bytes per parameter on every rank, 30 GB at 7B); now each module's weights are cast (a LoRA
    # layer merged) just before it runs and dropped after: about the largest module's fp32 bytes alive, none kept
    from grpo_ratio.testing import tiny_model

    peft = pytest.importorskip("peft") if adapters else None
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    whole = sum(p.numel() for p in model.parameters()) * 4  # an fp32 copy of the whole model (452 kB here)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) * 4  # 300 x 64
    trainer = tiny_trainer(tmp_path, model=model, ratio_attribution=True,
                           peft_config=peft.LoraConfig(r=2, target_modules="all-linear") if adapters else None)
    trainer.train()
    steps = _steps(trainer)
    assert len(steps) == 2 and all(row[keys.ATTRIBUTION_IDENTITY_ERROR] <= 1e-6 for row in steps)
    assert all(_term(row, "precision") > 1e-4 for row in steps)  # bf16 weights and autocast vs the fp32 reference
    reference = trainer.reference_scorer
    assert reference is not trainer.scorer and reference.copies() == [] and reference.extra_bytes() == 0
    cast = reference.per_layer_cast(torch.float32)
    assert cast.num_casts > 0 and cast.peak_bytes == largest == 300 * 64 * 4 and largest < whole / 5
    # measured, not reported: the fp32 casts of the policy's weights alive at once during one reference pass
    policy = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.randint(2, 300, (4, 12), generator=torch.Generator().manual_seed(0))
    with _WeightCasts(policy) as casts:
        reference.score(ids, torch.ones_like(ids), 5, batch_size=2)
    assert 0 < casts.peak <= largest and casts.alive == 0


def test_off_by_default_no_key_and_stock_trl_values_and_on_it_changes_no_trl_value(tmp_path):
    from trl import GRPOTrainer

    runs = {}
    for name, cls, extra in (("stock", GRPOTrainer, {}), ("off", None, {}), ("on", None, dict(ratio_attribution=True))):
        trainer = tiny_trainer(tmp_path / name, trainer_cls=cls, top_p=0.8, **extra)
        trainer.train()
        runs[name] = trainer
    off_keys = {k for row in runs["off"].state.log_history for k in row}
    assert not any(k.startswith(keys.ATTRIBUTION_PREFIX) for k in off_keys)
    assert runs["off"].args.ratio_attribution is None and not runs["off"].plan.attributes
    assert trl_logged_values(runs["off"]) == trl_logged_values(runs["stock"])  # loss, reward, ...: bit for bit
    assert trl_logged_values(runs["on"]) == trl_logged_values(runs["stock"])  # the reference passes change nothing
    assert len(_steps(runs["on"])) == 2


def test_on_rloo(tmp_path):
    from test_rloo import tiny_rloo

    trainer = tiny_rloo(tmp_path, top_p=0.8, ratio_attribution=True)
    trainer.train()
    steps = _steps(trainer)
    assert len(steps) == 2 and all(largest_term(row) == "truncation" for row in steps)
    assert all(row[keys.ATTRIBUTION_IDENTITY_ERROR] <= 1e-6 for row in steps)
