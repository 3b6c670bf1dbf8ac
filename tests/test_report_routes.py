"""`grpo-ratio report` on MoE runs: the `ratio/route/*` rows of the summary and the route findings (cause and the
`routing_replay` that removes it, never the run's own), on literal log histories and on a real tiny MoE run.

Run: pytest tests/test_report_routes.py
"""

import json

import pytest

from grpo_ratio.analysis.report import RUN_FIELDS, main, route_findings, run_config, summarize_history
from grpo_ratio.diagnostics import metric_keys as keys


SAMPLER_OLD = keys.route_key("sampler_old", "any_layer")
OLD_NEW = keys.route_key("old_new", "any_layer")


def _history(series: dict) -> list[dict]:
    steps = len(next(iter(series.values())))
    return [{"step": i + 1, **{k: v[i] for k, v in series.items()}} for i in range(steps)] + [{"train_runtime": 1.0}]


def _stats(sampler_old=None, old_new=None):
    series = {k: v for k, v in ((SAMPLER_OLD, sampler_old), (OLD_NEW, old_new)) if v is not None}
    return summarize_history(_history(series))


def test_route_keys_are_summarised_and_the_run_fields_include_routing_replay():
    stats = _stats(sampler_old=[0.02, 0.04], old_new=[0.0, 0.1])
    assert stats[SAMPLER_OLD]["mean"] == pytest.approx(0.03) and stats[OLD_NEW]["max"] == 0.1
    assert {"routing_replay", "num_iterations"} <= set(RUN_FIELDS)
    from grpo_ratio import RatioGRPOConfig

    config = run_config(RatioGRPOConfig(output_dir="unused", use_cpu=True, routing_replay="R2", num_iterations=3))
    assert config["routing_replay"] == "R2" and config["num_iterations"] == 3


def test_sampler_trainer_route_mismatch_without_replay_advises_r3():
    for config in (None, {"routing_replay": "none"}, {"routing_replay": "R2"}):
        (finding,) = route_findings(_stats(sampler_old=[0.05, 0.07]), config)
        assert finding.metric == SAMPLER_OLD and finding.value == pytest.approx(0.06)
        assert finding.fix.startswith("routing_replay='R3'") and "top-k set" in finding.cause
    assert route_findings(_stats(sampler_old=[0.005, 0.009]), None) == []  # under ROUTE_FLIP_LIMIT (1%)


def test_old_new_route_flips_advise_r2_or_r3_and_never_r2_on_the_sampler_arm():
    (finding,) = route_findings(_stats(old_new=[0.0, 0.2]), {"routing_replay": "none", "num_iterations": 2})
    assert finding.metric == OLD_NEW and finding.value == pytest.approx(0.1)
    assert "num_iterations > 1" in finding.cause
    assert finding.fix == ("routing_replay='R2' (the old pass's routes in every update); or routing_replay='R3' (the "
                           "sampler's routes everywhere: also removes sampler vs old)")
    (finding,) = route_findings(_stats(old_new=[0.2]), {"routing_replay": "none", "old_logprob_mode": "sampler"})
    assert "'R2'" not in finding.fix and finding.fix.startswith("routing_replay='R3'")  # verl#7805: no R2 there


def test_replayed_pairs_are_healthy_at_zero_and_a_fault_otherwise():
    assert route_findings(_stats(sampler_old=[0.0, 0.0], old_new=[0.0, 0.0]), {"routing_replay": "R3"}) == []
    assert route_findings(_stats(old_new=[0.0]), {"routing_replay": "R2"}) == []
    (fault,) = route_findings(_stats(sampler_old=[0.0, 0.002]), {"routing_replay": "R3"})
    assert fault.metric == SAMPLER_OLD and fault.value == pytest.approx(0.001) and "exactly 0" in fault.cause
    assert fault.fix.startswith("nothing to change")


@pytest.mark.parametrize("replay", ["none", "R2", "R3"])
def test_route_findings_never_advise_what_the_run_already_does(replay):
    found = route_findings(_stats(sampler_old=[0.3], old_new=[0.3]), {"routing_replay": replay, "num_iterations": 2})
    assert all(f"routing_replay={replay!r}" not in f.fix for f in found)
    # R2 replays old vs new (a fault there, not advice) and is advised R3 for sampler vs old; R3 replays both
    assert [f.metric for f in found] == {"none": [SAMPLER_OLD, OLD_NEW], "R2": [OLD_NEW, SAMPLER_OLD],
                                         "R3": [SAMPLER_OLD, OLD_NEW]}[replay]
    faults = [f.metric for f in found if f.fix.startswith("nothing to change")]
    assert faults == {"none": [], "R2": [OLD_NEW], "R3": [SAMPLER_OLD, OLD_NEW]}[replay]


def test_report_on_a_real_tiny_moe_run(tmp_path, capsys):
    # near-tie routers: bf16 autocast decoding and the fp32 old pass route some tokens differently (measured, not
    # replayed); the report names the pair and advises R3, with the run's configuration read from run.json
    from routing_fixtures import near_tie_model
    from trainer_fixtures import tiny_trainer

    trainer = tiny_trainer(tmp_path, "fp32_clone", model=near_tie_model("qwen3_moe"), num_iterations=2, max_steps=2)
    trainer.train()
    (tmp_path / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    (tmp_path / "run.json").write_text(json.dumps({"config": run_config(trainer.args)}))
    capsys.readouterr()
    assert main([str(tmp_path), "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    measured = [r[SAMPLER_OLD] for r in trainer.state.log_history if SAMPLER_OLD in r]
    assert report["summary"][SAMPLER_OLD]["mean"] == pytest.approx(sum(measured) / len(measured))
    assert report["config"]["routing_replay"] == "none"
    advice = [f for f in report["findings"] if f["metric"] == SAMPLER_OLD]
    assert advice and advice[0]["fix"].startswith("routing_replay='R3'")
    assert main([str(tmp_path)]) == 0
    assert f"`{SAMPLER_OLD}`" in capsys.readouterr().out  # the summary row of the markdown report
