"""MoE routing replay: every family's adapter against its own forward, replay of foreign routes, the pitfalls
(dense/MoE layer mix, positions without a route, top-k = 1, activation checkpointing, Mixtral's jitter, unsupported
families). Tiny random models from configs (grpo_ratio.testing), CPU."""

import contextlib

import pytest
import torch

from grpo_ratio.routing import NO_ROUTE, RouteHooks, moe_layout, no_routes
from grpo_ratio.routing.hooks import _in_backward
from grpo_ratio.testing import MOE_ARCHITECTURES, tiny_model


def _ids(rows=3, seq=9, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 300, (rows, seq), generator=generator)


class RouterTap:
    """A plain forward hook on every router, registered after `RouteHooks`: it sees what the experts receive."""

    def __init__(self, layout):
        self.outputs, self.recomputed = {}, {}
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in layout.routers.items()]

    def _hook(self, layer):
        def hook(module, args, output):
            store = self.recomputed if _in_backward() else self.outputs
            store.setdefault(layer, []).append(tuple(t.detach().clone() for t in output))

        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


def _autocast(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _foreign(native: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Routes that differ from `native` at every routed position: the k lowest experts the router did not pick."""
    out = native.clone()
    routed = (native >= 0).all(-1)  # (B, S, L)
    flat = native[routed].long()  # (n, k)
    taken = torch.zeros(flat.size(0), num_experts, dtype=torch.bool).scatter_(1, flat, True)
    order = torch.arange(num_experts).expand(flat.size(0), -1) + taken * num_experts  # untaken first
    out[routed] = order.argsort(dim=1)[:, : flat.size(1)].to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# every adapter equals its family's forward when it replays the family's own routes


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_replaying_own_routes_is_bitwise_the_family_forward(arch, bf16):
    model = tiny_model(arch).train()
    layout = moe_layout(model)
    ids = _ids()
    tap = RouterTap(layout)
    with _autocast(bf16):
        reference = model(input_ids=ids).logits
    reference_routers = tap.outputs
    reference.float().square().mean().backward()
    reference_grads = {i: r.weight.grad.clone() for i, r in layout.routers.items()}
    model.zero_grad()

    hooks = RouteHooks(model)
    tap.outputs = {}
    with _autocast(bf16), hooks.recording() as recorded:
        recorded_logits = model(input_ids=ids).logits
    routes = recorded.used()  # (B, S, L, k)
    tap.outputs = {}
    with _autocast(bf16), hooks.replaying(routes) as replayed:
        logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()

    assert torch.equal(recorded_logits, reference) and torch.equal(logits, reference)
    assert torch.equal(replayed.used(), routes) and torch.equal(replayed.native(), routes)
    for layer in layout.moe_layers:
        (ref_logits, ref_weights, ref_index), = reference_routers[layer]
        (got_logits, got_weights, got_index), = tap.outputs[layer]
        assert torch.equal(got_logits, ref_logits) and torch.equal(got_index, ref_index)
        assert got_weights.dtype == ref_weights.dtype and torch.equal(got_weights, ref_weights)
        assert torch.equal(layout.routers[layer].weight.grad, reference_grads[layer])
    dense = [i for i in range(layout.num_layers) if i not in layout.moe_layers]
    assert (routes[:, :, dense] == NO_ROUTE).all() and (routes[:, :, layout.moe_layers] >= 0).all()
    hooks.remove()


# ---------------------------------------------------------------------------------------------------------------------
# foreign routes are really used, the weights come from the live logits, gradients reach the routers


def _expected_weights(arch, router, logits, hidden, index):
    """The gate weights at `index`, written out from each family's router forward (transformers 5.24)."""
    if arch in ("deepseek_v3", "glm4_moe"):
        w = logits.sigmoid().gather(1, index)
        return w / (w.sum(-1, keepdim=True) + 1e-20) * router.routed_scaling_factor if router.norm_topk_prob else \
            w * router.routed_scaling_factor
    if arch == "granitemoe":
        return torch.softmax(logits.gather(1, index), dim=-1).to(hidden.dtype)
    w = torch.softmax(logits.float(), dim=-1).gather(1, index)
    if arch == "mixtral" or router.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w if arch == "mixtral" else w.to(logits.dtype)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_replaying_foreign_routes_uses_them_and_trains_the_router(arch):
    torch.manual_seed(0)
    model = tiny_model(arch).train()
    hooks = RouteHooks(model)
    layout = hooks.layout
    ids = _ids()
    with hooks.recording() as recorded:
        reference = model(input_ids=ids).logits
    foreign = _foreign(recorded.used(), layout.num_experts)
    inputs = {}
    handles = [r.register_forward_hook(lambda m, a, o, i=i: inputs.__setitem__(i, a[0].detach()))
               for i, r in layout.routers.items()]
    tap = RouterTap(layout)
    with hooks.replaying(foreign) as replayed:
        logits = model(input_ids=ids).logits
    (logits * torch.randn_like(logits)).sum().backward()

    assert torch.equal(replayed.used(), foreign)
    moe = layout.moe_layers
    assert (replayed.native()[:, :, moe] != foreign[:, :, moe]).any(-1).all()  # every position re-routed
    assert not torch.allclose(logits, reference)
    for layer in moe:
        (router_logits, weights, index), = tap.outputs[layer]
        assert torch.equal(index, foreign[:, :, layer].reshape(-1, layout.top_k).long())
        expected = _expected_weights(arch, layout.routers[layer], router_logits, inputs[layer], index)
        torch.testing.assert_close(weights, expected, rtol=0, atol=1e-7)
        grad = layout.routers[layer].weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    for h in handles:
        h.remove()


def test_no_route_positions_keep_the_routers_own_choice():
    model = tiny_model("qwen3_moe").eval()
    hooks = RouteHooks(model)
    ids = _ids(rows=2, seq=6)
    with hooks.recording() as recorded:
        model(input_ids=ids)
    native = recorded.used()
    routes = _foreign(native, hooks.layout.num_experts)
    routes[0, :2] = NO_ROUTE  # e.g. left padding
    routes[1, -1] = NO_ROUTE  # e.g. the last token
    with hooks.replaying(routes) as replayed:
        model(input_ids=ids)
    used = replayed.used()
    given = (routes >= 0).all(-1)
    assert torch.equal(used[given], routes[given]) and torch.equal(used[~given], native[~given])
    assert int((~given).sum()) == 2 * 2 + 1 * 2  # positions x layers


def test_expert_zero_is_a_route_and_top_k_one_replays():
    """top-k = 1: an all-zero row is expert 0 (a real route), NO_ROUTE is the only 'no route' marker."""
    for arch in ("qwen3_moe", "mixtral"):
        model = tiny_model(arch, num_experts_per_tok=1).eval()
        hooks = RouteHooks(model)
        ids = _ids(rows=2, seq=5)
        with hooks.recording() as recorded:
            reference = model(input_ids=ids).logits
        with hooks.replaying(recorded.used()):
            assert torch.equal(model(input_ids=ids).logits, reference)
        zeros = torch.zeros_like(recorded.used())
        with hooks.replaying(zeros) as replayed:
            model(input_ids=ids)
        assert (replayed.used() == 0).all() and (replayed.native() != 0).any()


# ---------------------------------------------------------------------------------------------------------------------
# absolute-layer alignment where dense and MoE layers mix


@pytest.mark.parametrize("arch, overrides, moe_layers", [
    ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1]), [0, 2]),
    ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2), [1, 3]),
    ("deepseek_v3", dict(), [1, 2]),  # first_k_dense_replace=1
])
def test_routes_are_aligned_by_absolute_layer(arch, overrides, moe_layers):
    model = tiny_model(arch, **overrides).eval()
    hooks = RouteHooks(model)
    layout = hooks.layout
    assert layout.moe_layers == moe_layers and layout.num_layers == model.config.num_hidden_layers
    ids = _ids(rows=2, seq=5)
    with hooks.recording() as recorded:
        model(input_ids=ids)
    routes = recorded.used()
    assert routes.shape == (2, 5, layout.num_layers, layout.top_k)
    dense = [i for i in range(layout.num_layers) if i not in moe_layers]
    assert (routes[:, :, dense] == NO_ROUTE).all()
    # each MoE layer gets its own slot: different foreign routes per layer are each used where they belong
    foreign = _foreign(routes, layout.num_experts)
    foreign[:, :, moe_layers[-1]] = routes[:, :, moe_layers[-1]]  # the last MoE layer keeps its own
    tap = RouterTap(layout)
    with hooks.replaying(foreign):
        model(input_ids=ids)
    for layer in moe_layers:
        assert torch.equal(tap.outputs[layer][0][2], foreign[:, :, layer].reshape(-1, layout.top_k).long())
    with pytest.raises(ValueError, match="absolute index"):  # a layout over the MoE layers only
        with hooks.replaying(foreign[:, :, moe_layers]):
            pass


# ---------------------------------------------------------------------------------------------------------------------
# activation checkpointing: the recompute in backward serves the same routes


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_replays_the_same_routes(reentrant):
    torch.manual_seed(0)
    model = tiny_model("qwen3_moe").train()
    hooks = RouteHooks(model)
    layout = hooks.layout
    chunks = [_ids(rows=2, seq=6, seed=s) for s in (1, 2)]
    with hooks.recording() as recorded:
        for ids in chunks:
            model(input_ids=ids)
    foreign = _foreign(recorded.used(), layout.num_experts)  # (4, 6, L, k): rows of both chunks

    def loss_and_grads(checkpointing):
        model.zero_grad()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        else:
            model.gradient_checkpointing_disable()
        tap = RouterTap(layout)
        with hooks.replaying(foreign):  # TRL's chunked pass: two forwards, one backward after the session
            logps = torch.cat([model(input_ids=ids).logits.log_softmax(-1)[..., 5] for ids in chunks])
        logps.sum().backward()
        tap.remove()
        return tap, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    tap, grads = loss_and_grads(checkpointing=True)
    _, plain = loss_and_grads(checkpointing=False)
    for layer in layout.moe_layers:
        served = torch.cat([out[2] for out in tap.outputs[layer]])
        recomputed = {tuple(out[2].flatten().tolist()) for out in tap.recomputed[layer]}
        assert len(tap.recomputed[layer]) == 2 and torch.equal(served, foreign[:, :, layer].reshape(-1, 2).long())
        assert recomputed == {tuple(out[2].flatten().tolist()) for out in tap.outputs[layer]}
    assert grads.keys() == plain.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], plain[name], rtol=0, atol=1e-6)


def test_recording_ignores_the_checkpoint_recompute():
    model = tiny_model("mixtral").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hooks = RouteHooks(model)
    with hooks.recording() as recorded:
        model(input_ids=_ids()).logits.sum().backward()
    assert len(recorded.calls) == 1 and recorded.used().shape[0] == 3


# ---------------------------------------------------------------------------------------------------------------------
# refusals


def test_mixtral_jitter_in_train_mode_is_refused():
    model = tiny_model("mixtral", router_jitter_noise=0.1).train()
    hooks = RouteHooks(model)
    routes = no_routes(1, 4, hooks.layout.num_layers, hooks.layout.top_k)
    with pytest.raises(ValueError, match="router_jitter_noise"):
        with hooks.replaying(routes):
            pass
    model.eval()  # no jitter in eval mode: replay is exact there
    with hooks.replaying(routes):
        model(input_ids=_ids(rows=1, seq=4))


def test_unsupported_moe_family_is_refused_and_dense_models_have_no_moe():
    from transformers import AutoModelForCausalLM, PhimoeConfig

    phimoe = AutoModelForCausalLM.from_config(PhimoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(ValueError, match="'phimoe'.*not supported.*qwen3_moe, qwen2_moe, olmoe, mixtral, granitemoe"):
        moe_layout(phimoe)
    dense = tiny_model("qwen2")
    assert moe_layout(dense) is None
    with pytest.raises(ValueError, match="no MoE"):
        RouteHooks(dense)


@pytest.mark.parametrize("bad, message", [
    (lambda r: r.float(), "integer"),
    (lambda r: r.clamp(max=3) + 1, "outside"),
    (lambda r: torch.cat([r[..., :1], r[..., :1]], -1), "same expert twice"),
    (lambda r: torch.cat([r[..., :1], torch.full_like(r[..., :1], NO_ROUTE)], -1), "some top-k slots"),
])
def test_malformed_routes_are_refused(bad, message):
    model = tiny_model("qwen3_moe").eval()
    hooks = RouteHooks(model)
    with hooks.recording() as recorded:
        model(input_ids=_ids(rows=1, seq=4))
    with pytest.raises(ValueError, match=message):
        with hooks.replaying(bad(recorded.used())):
            pass


def test_replay_refuses_a_forward_that_does_not_match_the_routes():
    model = tiny_model("olmoe").eval()
    hooks = RouteHooks(model)
    routes = no_routes(2, 5, hooks.layout.num_layers, hooks.layout.top_k)
    with pytest.raises(ValueError, match=r"a forward of \(2, 6\)"):
        with hooks.replaying(routes):
            model(input_ids=_ids(rows=2, seq=6))
    with pytest.raises(ValueError, match="after 2 rows served"):
        with hooks.replaying(routes):
            model(input_ids=_ids(rows=2, seq=5))
            model(input_ids=_ids(rows=1, seq=5))


# ---------------------------------------------------------------------------------------------------------------------
# routes recorded during generate, laid out as TRL pads the batch, replayed in the full-sequence forward


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_generate_routes_replay_in_the_scoring_forward(arch):
    from grpo_ratio.routing import relayout_routes, route_agreement

    model = tiny_model(arch).eval()
    hooks = RouteHooks(model)
    prompt_ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])  # left-padded (pad id 0)
    prompt_mask = (prompt_ids != 0).long()
    torch.manual_seed(3)
    with hooks.recording() as recorded, torch.no_grad():
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, max_new_tokens=5, do_sample=True,
                             eos_token_id=None, pad_token_id=0)
    decoded = recorded.decode()  # (B, 4 + 5 - 1, L, k): the last generated token is never fed
    assert decoded.shape[:2] == (2, 8) and len(recorded.calls) == 5
    completion_ids = out[:, 4:]
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])  # row 0 "ended" after 3 tokens
    routes = relayout_routes(decoded, prompt_mask, prompt_mask, completion_mask)
    ids = torch.cat([prompt_ids, completion_ids * completion_mask], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    with hooks.replaying(routes) as replayed, torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    given = (routes >= 0).all(-1)
    assert torch.equal(replayed.used()[given], routes[given].long())
    # routed: row 0's 2 real prompt tokens + its first 3 completion positions; row 1's 4 + 4 (its 5th token never fed)
    assert given[:, :, hooks.layout.moe_layers[0]].sum(1).tolist() == [5, 8]
    counts = route_agreement(replayed.native(), routes)
    assert int(counts.any_total) == 13 and 0 <= int(counts.any_differ) <= 13


def test_attached_copies_and_row_subsets_follow_the_session():
    import copy

    model = tiny_model("granitemoe").eval()
    clone = copy.deepcopy(model).to(torch.float16)  # e.g. fp16_clone's copy
    hooks = RouteHooks(model)
    hooks.attach(clone)
    hooks.attach(clone)  # idempotent
    ids = _ids(rows=3, seq=5)
    with hooks.recording() as recorded:
        model(input_ids=ids)
    foreign = _foreign(recorded.used(), hooks.layout.num_experts)
    with hooks.replaying(foreign) as replayed:
        clone(input_ids=ids)  # the copy's forward takes the rows in order
        with hooks.serving_rows(torch.tensor([2, 0])):  # e.g. the rows an fp16 pass re-scores in fp32
            model(input_ids=ids[[2, 0]])
        assert hooks.rows_served == 3
    used = replayed.used()
    assert torch.equal(used[:3], foreign) and torch.equal(used[3:], foreign[[2, 0]])
    layer_copy = copy.deepcopy(model.model.layers[0])
    hooks.attach(layer_copy, layer=0)
    with pytest.raises(ValueError, match="differ"):
        hooks.attach(tiny_model("granitemoe", num_hidden_layers=3))


def test_deep_copied_layers_carry_one_router_hook_and_report_their_own_routes():
    # guided_fp32 on bf16 weights deep-copies decoder layers to fp32; the copy once kept the policy's RouteHooks hook
    # and got a second, which recorded the replayed routes as the router's own (ratio/route/* showed full agreement)
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    model = tiny_model("qwen3_moe").to(torch.bfloat16)
    hooks = RouteHooks(model)
    layer = hooks.layout.moe_layers[0]
    scorer = OldLogprobScorer(model, "guided_fp32", layers=[layer], route_hooks=hooks)
    ids = _ids(rows=3, seq=7)
    mask = torch.ones_like(ids)
    with hooks.recording() as recorded:
        scorer.score(ids, mask, 3)
    copy_router = next(m for m in scorer._copies[id(model.model.layers[layer]), torch.float32].module.modules()
                       if type(m).__name__ == hooks.layout.family.router_class)
    assert len(copy_router._forward_hooks) == 1 and len(hooks.layout.routers[layer]._forward_hooks) == 1
    foreign = _foreign(recorded.native(), hooks.layout.num_experts)
    with hooks.replaying(foreign) as replayed:
        scorer.score(ids, mask, 3)
    assert torch.equal(replayed.used()[:, :, layer], foreign[:, :, layer])
    # the first MoE layer's input does not depend on the routes: its own choice is the one recorded without replay
    assert torch.equal(replayed.native()[:, :, layer], recorded.native()[:, :, layer])
