"""Routing-replay fixtures for the tests: near-tie MoE models and a log of every replay session (what the routers
served, index by index). Shared by tests/test_routing_trainer.py and the 2-process launch tests/sharded_routing.py."""

from __future__ import annotations

import contextlib

import torch

from grpo_ratio.routing import RouteHooks, moe_layout
from grpo_ratio.routing.hooks import _in_backward
from grpo_ratio.routing.replay import GenerationRoutes
from grpo_ratio.testing import tiny_model


def near_tie_model(arch: str, dtype=torch.float32, spread: float = 0.8):
    """A tiny MoE whose router rows share a large common direction, so the experts' logits are close relative to
    their size: bf16 rounding then reorders them (16% of tokens flip between fp32 and bf16 autocast on qwen3_moe)."""
    model = tiny_model(arch)
    common = torch.randn(1, model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * spread
    weights = [router.weight for router in moe_layout(model).routers.values()]
    gathered = contextlib.nullcontext()
    if any(hasattr(w, "ds_id") for w in weights):  # built under ZeRO-3's zero.Init (a second trainer in a process)
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(weights, modifier_rank=0)
    with torch.no_grad(), gathered:
        for weight in weights:
            weight.add_(common)
    return model.to(dtype)


class ReplayLog:
    """Every replay session of a run: the routes it was given and, per layer, the indices the routers returned to
    the experts in its forwards (and in activation-checkpoint recomputes), through `RouteHooks` on any module."""

    def __init__(self, setattr_):
        self.sessions, self.finished = [], []
        log, replaying, on_router = self, RouteHooks.replaying, RouteHooks._on_router

        @contextlib.contextmanager
        def logged_replaying(hooks, routes):
            session = {"routes": routes.clone(), "served": {}, "recomputed": {}}
            hooks._log_session = session
            try:
                with replaying(hooks, routes) as recording:
                    yield recording
            finally:
                log.sessions.append(session)

        def logged_on_router(hooks, layer, router, hidden, output):
            result = on_router(hooks, layer, router, hidden, output)
            session = getattr(hooks, "_log_session", None)
            if session is not None and (hooks._routes is not None or _in_backward()):
                store = session["recomputed"] if _in_backward() else session["served"]
                store.setdefault(layer, []).append((output if result is None else result)[2].detach().clone())
            return result

        finish = GenerationRoutes.finish

        def logged_finish(routes, prompt_mask, completion_mask):
            pending = routes.pending is not None
            finish(routes, prompt_mask, completion_mask)
            if pending:
                log.finished.append(routes.sampler.clone())

        setattr_(RouteHooks, "replaying", logged_replaying)
        setattr_(RouteHooks, "_on_router", logged_on_router)
        setattr_(GenerationRoutes, "finish", logged_finish)

    def assert_served_as_given(self, top_k: int):
        """In every session, each forward's routers served exactly the given routes at the positions that have one
        (rows in order), and every recompute served what its forward served."""
        assert self.sessions
        for session in self.sessions:
            routes = session["routes"]  # (b, S, L, k)
            for layer, served in session["served"].items():
                target = routes[:, :, layer].reshape(-1, top_k).long()  # (b * S, k)
                got = torch.cat(served)[: target.size(0)]
                given = (target >= 0).all(-1)
                assert torch.equal(got[given], target[given])
                recomputed = session["recomputed"].get(layer, [])
                assert all(any(torch.equal(r, s) for s in served) for r in recomputed)


def rows_of(rows: torch.Tensor, batch: torch.Tensor) -> bool:
    """Every row of `rows` (b, ...) is a row of `batch` (B, ...)."""
    return all(any(torch.equal(r, row) for row in batch) for r in rows)
