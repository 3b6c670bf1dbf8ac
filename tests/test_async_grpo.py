"""RatioAsyncGRPOTrainer (grpo_ratio.async_grpo) on CPU with TRL's real AsyncGRPOTrainer, a tiny Qwen2 and a stub
rollout worker (the vLLM server is the async lane's: scripts/test_async.sh). TRL's tree attention runs through the
portable kernel of grpo_ratio.testing.tree_attention, tested here against the unpacked forward.
"""

import contextlib
import dataclasses
import io
import math
import os
import queue

import numpy as np
import pytest
import torch
from datasets import Dataset
from vllm_stub_server import StubServer


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.async_grpo import AsyncGRPOTrainer  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout  # noqa: E402
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402

from grpo_ratio.analysis.report import main as report_main  # noqa: E402
from grpo_ratio.async_grpo import RatioAsyncGRPOConfig, RatioAsyncGRPOTrainer  # noqa: E402
from grpo_ratio.corrections.decoupled import (  # noqa: E402
    decoupled_inputs,
    loglinear_alpha,
    loglinear_proximal,
    proximal_weights,
)
from grpo_ratio.corrections.is_correction import preset  # noqa: E402
from grpo_ratio.corrections.kept_sets import SamplingSettings  # noqa: E402
from grpo_ratio.diagnostics.metric_keys import known, staleness_key  # noqa: E402
from grpo_ratio.old_pass.forward import eval_mode  # noqa: E402
from grpo_ratio.testing import tiny_model, tiny_tokenizer  # noqa: E402
from grpo_ratio.testing.async_cpu import async_grpo_on_cpu  # noqa: E402


PROMPT = [5, 9, 12, 7]
VERSION = 5  # the policy version of the trainers of the loss tests
COMPLETIONS = [[20, 21, 22, 23, 1], [20, 21, 30, 31, 32, 1], [40, 41, 1], [20, 50, 51, 1]]  # shared prefixes


@pytest.fixture(scope="module", autouse=True)
def processed_server():
    """The vLLM server every trainer here talks to at start-up: a stand-in answering `/health` and `/server_info`
    with `--logprobs-mode processed_logprobs` (what TRL's async docs serve with); the rollouts come from `StubWorker`."""
    global SERVER_URL
    with StubServer("processed_logprobs") as server:
        SERVER_URL = server.url
        yield server


SERVER_URL = None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 (fp32) and its tokenizer saved where `AsyncGRPOTrainer(model=path)` loads them."""
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tiny_model("qwen2", seed=0).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def true_logprobs(model, ids: list[int]) -> torch.Tensor:
    """(len(ids),) log-probs of each token given its prefix under `model`'s unpacked forward (0 for the first)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].float()  # (n-1, V)
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


def sample(ids_completion, behaviour_shift: float, advantage: float, group_id: int, model, version: int = 0):
    """A RolloutSample whose behaviour log-probs are the model's own plus `behaviour_shift` on the completion."""
    ids = PROMPT + ids_completion
    mask = [0] * len(PROMPT) + [1] * len(ids_completion)
    lp = true_logprobs(model, ids).numpy() + behaviour_shift
    lp[: len(PROMPT)] = 0.0
    return RolloutSample(prompt=[], completion=[], input_ids=np.array(ids), completion_mask=np.array(mask),
                         old_log_probs=lp.astype(np.float32), advantage=advantage, model_version=version,
                         group_id=group_id, metrics={"reward": advantage})


def packed_batch(samples, staleness: list[int] | None = None):
    """TRL's collated micro-batch of one row (TreeRow + DataCollatorForRollout), with our `staleness` column."""
    row = TreeRow()
    for s in samples:
        row.add({"input_ids": torch.tensor(s.input_ids), "completion_mask": torch.tensor(s.completion_mask),
                 "old_log_probs": torch.tensor(s.old_log_probs), "advantage": s.advantage, "group_id": s.group_id,
                 "metrics": dict(s.metrics)})
    batch = DataCollatorForRollout(pad_token_id=0)([[row]])
    if staleness is not None:  # sampled VERSION - k: the trainers below are at VERSION (make_trainer)
        selected = batch["token_index"] >= 0
        batch["policy_version"] = torch.where(selected, VERSION - torch.tensor(staleness)[batch["segment_id"]], -1)
    return batch


class StubWorker:
    """A rollout worker in the trainer's process: serves `samples` forever, each stamped `k` versions old when
    handed out (cycling through `staleness`), so the real queue/dataset/collator path sees real staleness."""

    def __init__(self, samples, staleness=(0,)):
        self.trainer = None
        self.samples, self.staleness = samples, staleness
        outer = self

        class Buffer(queue.Queue):
            def get(self, *args, **kwargs):
                s, stale = super().get(*args, **kwargs)
                s.model_version = outer.trainer.model_version - stale
                return s

        self.rollout_buffer = Buffer()
        self.metrics_queue = queue.Queue()
        self.count = 0

    def _fill(self):
        for _ in range(2 * len(self.samples)):
            s = self.samples[self.count % len(self.samples)]
            s = dataclasses.replace(s, metrics=dict(s.metrics))
            self.rollout_buffer.put((s, self.staleness[self.count % len(self.staleness)]))
            self.count += 1

    def start(self):
        self._fill()

    def update_model_version(self, version):
        self._fill()

    def stop(self):
        pass

    def check_health(self, stale_after_s):
        pass


class StubTransfer:
    def init_weight_transfer(self):
        pass

    def pause(self):
        pass

    def send_weights(self, iterator):
        for _ in iterator:
            pass

    def resume(self):
        pass

    def destroy(self):
        pass


def make_trainer(model_dir, tmp_path, cls=RatioAsyncGRPOTrainer, samples=(), staleness=(0,), **overrides):
    config_cls = RatioAsyncGRPOConfig if cls is RatioAsyncGRPOTrainer else __import__(
        "trl.experimental.async_grpo", fromlist=["AsyncGRPOConfig"]).AsyncGRPOConfig
    kwargs = dict(bf16=False, use_cpu=True, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                  max_steps=2, max_staleness=3, token_budget=0, learning_rate=1e-2, logging_steps=1,
                  report_to="none", save_strategy="no", seed=0, vllm_server_base_url=SERVER_URL)
    kwargs.update(overrides)
    args = config_cls(str(tmp_path / cls.__name__), **kwargs)
    worker = StubWorker(list(samples), staleness)
    with async_grpo_on_cpu():  # TRL's __init__ asks CUDA for the device name
        trainer = cls(model=model_dir, reward_funcs=[], args=args,
                      train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]] * 4}),
                      processing_class=tiny_tokenizer(), rollout_worker=worker, weight_transfer=StubTransfer())
    worker.trainer = trainer
    trainer.current_gradient_accumulation_steps = 1
    trainer.model_version = VERSION  # train() restarts from 0: its first sync
    return trainer


REFERENCE = tiny_model("qwen2", seed=0)  # the saved weights with transformers' default attention: unpacked forwards


def samples_of(model=REFERENCE, shift: float = 0.0):
    advantages = [1.0, -1.0, 0.5, -0.5]
    return [sample(c, shift, a, group_id=0, model=model) for c, a in zip(COMPLETIONS, advantages, strict=True)]


def test_portable_tree_attention_matches_the_unpacked_forward(model_dir, tmp_path):
    """TRL's packed forward (prefix trie, tree attention through the portable kernel, fused head) gives each trained
    token the log-prob of the model's unpacked forward, to 1e-5 (fp32)."""
    trainer = make_trainer(model_dir, tmp_path, cls=AsyncGRPOTrainer)
    samples = samples_of()
    batch = packed_batch(samples)
    call = {}

    def probe(**kwargs):
        call.update(kwargs)
        raise StopIteration

    with async_grpo_on_cpu(), pytest.raises(StopIteration):
        trainer.compute_loss(probe, batch)
    with async_grpo_on_cpu(), torch.no_grad():
        out = trainer.model(**call)
    selected = batch["token_index"] >= 0
    packed = out.log_probs.flatten()[batch["token_index"][selected]]  # (M,)
    unpacked = batch["old_log_probs"][selected]  # the stub's behaviour log-probs: the unpacked forward's (shift 0)
    assert packed.numel() == sum(len(c) for c in COMPLETIONS)
    torch.testing.assert_close(packed, unpacked, atol=1e-5, rtol=0)
    assert int(batch["input_ids"].numel()) < sum(len(PROMPT) + len(c) for c in COMPLETIONS)  # shared: packed


def _loss_and_grads(trainer, batch):
    trainer.model.zero_grad()
    with async_grpo_on_cpu():
        loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_coupled_is_stock_loss_and_metrics_bit_for_bit(model_dir, tmp_path):
    stock = make_trainer(model_dir, tmp_path, cls=AsyncGRPOTrainer)
    ours = make_trainer(model_dir, tmp_path)
    batch = packed_batch(samples_of(shift=-0.3), staleness=[0, 1, 2, 1])
    loss_s, grads_s = _loss_and_grads(stock, {k: v for k, v in batch.items() if k != "policy_version"})
    loss_o, grads_o = _loss_and_grads(ours, batch)
    assert torch.equal(loss_s, loss_o)
    assert grads_s.keys() == grads_o.keys() and all(torch.equal(grads_s[n], grads_o[n]) for n in grads_s)
    trl_keys = ["ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    assert [stock._metrics["train"][k] for k in trl_keys] == [ours._metrics["train"][k] for k in trl_keys]
    metrics = ours.staleness_stats.flush()
    # 4 + 5 + 2 + 3 completion tokens at staleness 0, 1, 2, 1: every behaviour log-prob is the model's - 0.3
    assert metrics[staleness_key(0, "num_tokens")] == 5
    assert metrics[staleness_key(1, "num_tokens")] == 6 + 4
    assert metrics[staleness_key(2, "num_tokens")] == 3
    assert metrics[staleness_key(1, "new_behav_mean_abs_log_ratio")] == pytest.approx(0.3, abs=1e-5)
    assert metrics[staleness_key(1, "new_behav_oob_rate")] == 1.0  # exp(0.3) = 1.35 > 1.1
    # r = 1.35 > 1 + 0.2 clips the positive-advantage tokens (A = 1 and 0.5): under coupled, every clip is a flip
    assert metrics[staleness_key(0, "new_behav_clip_rate")] == 1.0
    assert metrics[staleness_key(0, "clip_flip_rate")] == 1.0
    assert all(known(k) for k in metrics)


def test_decoupled_at_staleness_0_ratio_is_exactly_one_and_the_weight_carries_the_gap(model_dir, tmp_path):
    """old_logprob_mode at the training precision (the policy's own pass): new/proximal is exactly 1 on every token,
    so the clip never acts, and the IS weight exp(prox - behaviour) = exp(0.3) carries the whole gap."""
    trainer = make_trainer(model_dir, tmp_path, async_objective="decoupled")
    samples = samples_of(shift=-0.3)
    batch = packed_batch(samples, staleness=[0, 0, 0, 0])
    loss, _ = _loss_and_grads(trainer, batch)
    m = trainer._metrics["train"]
    assert m["ratio"][-1] == 1.0 and m["kl"][-1] == 0.0 and m["clip_ratio/region_mean"][-1] == 0.0
    # r = 1 and no clip: loss = -sum_t w_t A_t / M with w_t = exp(prox_t - behaviour_t), prox the policy's own
    selected = batch["token_index"] >= 0
    adv = batch["advantages"][selected]
    prox = batch["old_log_probs"][selected] + 0.3  # behaviour = model - 0.3
    weights = torch.exp(prox - batch["old_log_probs"][selected])
    torch.testing.assert_close(loss, -(weights * adv).sum() / adv.numel(), atol=1e-5, rtol=1e-5)
    metrics = trainer.staleness_stats.flush()
    assert metrics[staleness_key(0, "new_prox_oob_rate")] == 0.0
    assert metrics[staleness_key(0, "new_prox_clip_rate")] == 0.0
    assert metrics[staleness_key(0, "prox_behav_oob_rate")] == 1.0
    assert metrics[staleness_key(0, "is_weight_mean")] == pytest.approx(math.exp(0.3), rel=1e-5)
    assert metrics[staleness_key(0, "is_ess")] == pytest.approx(1.0, abs=1e-6)
    assert trainer.proximal_forwards == 0  # the training forward's log-probs, reused


def test_decoupled_clips_on_new_over_proximal_only(model_dir, tmp_path):
    """Stale samples whose behaviour log-probs are 1 nat below the policy: TRL's coupled ratio e = 2.72 clips every
    positive-advantage token; the decoupled objective's clip (new/proximal = 1) clips none, the IS preset (TIS,
    cap 2) bounds the weight, and the flips are counted."""
    trainer = make_trainer(model_dir, tmp_path, async_objective="decoupled", is_correction="tis")
    batch = packed_batch(samples_of(shift=-1.0), staleness=[2, 2, 1, 1])
    _loss_and_grads(trainer, batch)
    assert trainer._metrics["train"]["clip_ratio/region_mean"][-1] == 0.0
    metrics = trainer.staleness_stats.flush()
    # staleness 2: the samples with A = +1 (5 tokens) and A = -1 (6 tokens): r = e clips the positive ones
    assert metrics[staleness_key(2, "new_behav_clip_rate")] == pytest.approx(5 / 11)
    assert metrics[staleness_key(2, "new_prox_clip_rate")] == 0.0
    assert metrics[staleness_key(2, "clip_flip_rate")] == pytest.approx(5 / 11)
    assert metrics[staleness_key(2, "is_weight_mean")] == pytest.approx(2.0, rel=1e-6)  # e truncated at 2


def test_loglinear_matches_the_interpolation_and_runs_no_extra_forward(model_dir, tmp_path):
    behaviour = torch.tensor([-1.0, -2.0, -3.0])
    current = torch.tensor([-0.5, -1.0, -1.0], requires_grad=True)
    k = torch.tensor([0, 1, 2])
    torch.testing.assert_close(loglinear_alpha(k), torch.tensor([0.0, 0.5, 2 / 3]))
    prox = loglinear_proximal(behaviour, current, k)
    torch.testing.assert_close(prox, torch.tensor([-1.0, -1.5, -3.0 + 2 / 3 * 2.0]))
    assert not prox.requires_grad
    with pytest.raises(ValueError, match="staleness"):
        loglinear_alpha(torch.tensor([-1]))

    trainer = make_trainer(model_dir, tmp_path, async_objective="decoupled_loglinear")
    batch = packed_batch(samples_of(shift=-0.6), staleness=[0, 1, 2, 1])
    calls = []
    handle = trainer.model.register_forward_hook(lambda *a: calls.append(1))
    _loss_and_grads(trainer, batch)
    handle.remove()
    assert len(calls) == 1 and trainer.proximal_forwards == 0  # the training forward only
    metrics = trainer.staleness_stats.flush()
    # new/prox = exp((1 - alpha) * 0.6): k = 0 -> 1.82 (out of band), k = 1 -> 1.35, k = 2 -> exp(0.2) = 1.22
    assert metrics[staleness_key(0, "new_prox_oob_rate")] == 1.0
    assert metrics[staleness_key(2, "is_weight_mean")] == pytest.approx(math.exp(2 / 3 * 0.6), rel=1e-5)


def test_proximal_weights_and_inputs_on_literal_tensors():
    prox = torch.tensor([0.0, -1.0, -1.0, -2.0])
    behaviour = torch.tensor([-1.0, -1.0, -3.0, -2.0])
    segment = torch.tensor([0, 0, 1, 1])
    weights, _ = proximal_weights(prox, behaviour, segment, None)
    torch.testing.assert_close(weights, torch.exp(prox - behaviour))
    tis, result = proximal_weights(prox, behaviour, segment, preset("tis"))
    torch.testing.assert_close(tis, torch.tensor([math.e, 1.0, 2.0, 1.0]).clamp(max=2.0))
    # geometric sequence weight: exp(mean log-ratio) per sample, broadcast to its tokens
    geo, _ = proximal_weights(prox, behaviour, segment, preset("seq_mask_tis"))
    assert geo[0] == geo[1] and geo[2] == geo[3]
    old = torch.tensor([[-1.0, -1.0, -3.0, -2.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0]])
    selected = torch.tensor([[True, True, True, True, False]])
    new_old, new_adv = decoupled_inputs(old, adv, selected, prox, tis)
    torch.testing.assert_close(new_old, torch.tensor([[0.0, -1.0, -1.0, -2.0, 0.0]]))
    torch.testing.assert_close(new_adv, torch.tensor([[2.0, 1.0, -2.0, -1.0, 0.0]]))


@pytest.mark.parametrize("objective", ["coupled", "decoupled", "decoupled_loglinear"])
def test_each_objective_trains_through_the_real_queue_and_collator(model_dir, tmp_path, objective):
    """trainer.train() over TRL's RolloutQueueDataset, planner and collator: staleness tagged per sample reaches the
    loss terms (TRL's own sample/staleness_max agrees), loss finite, the per-staleness keys logged."""
    samples = samples_of(shift=-0.2)
    extra = {"async_objective": objective} | ({"is_correction": "icepop"} if objective != "coupled" else {})
    trainer = make_trainer(model_dir, tmp_path, samples=samples, staleness=(0, 1, 2, 1), max_steps=3, **extra)
    with async_grpo_on_cpu():
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(math.isfinite(h["loss"]) for h in logs)
    assert max(h["sample/staleness_max"] for h in logs) == 2  # TRL's count, when the sample left the queue
    keys = {k for h in logs for k in h if k.startswith("ratio/staleness/")}
    # at the loss: the stub's k, plus one sync for a micro-batch the dispatcher fetched before the previous step's sync
    assert {staleness_key(k, "num_tokens") for k in (0, 1, 2, 3)} <= keys  # 3: a k = 2 sample fetched early
    assert all(known(k) for k in keys)
    assert (staleness_key(1, "is_ess") in keys) == (objective != "coupled")
    tokens = sum(h.get(staleness_key(k, "num_tokens"), 0) for h in logs for k in range(5))
    assert tokens == 3 * sum(len(c) for c in COMPLETIONS)  # every trained token of 3 steps bucketed once
    # the run record: `grpo-ratio report` reads the run and renders the per-staleness table
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert report_main([trainer.args.output_dir]) == 0
    text = out.getvalue()
    assert f"async_objective={objective}" in text and "| 2 |" in text and "clip_flip_rate" in text


@pytest.mark.parametrize("storage", ["resident", "per_layer"])
def test_fp32_clone_proximal_pass_on_a_bf16_policy(model_dir, tmp_path, storage):
    """old_logprob_mode='fp32_clone' on a bf16 policy, a resident copy or a per-layer cast: the packed proximal pass
    (fp32 tree attention) gives the fp32 model's unpacked log-probs to 1e-5, where the policy's own bf16 pass is off
    by more."""
    trainer = make_trainer(model_dir, tmp_path, async_objective="decoupled", old_logprob_mode="fp32_clone",
                           dtype="bfloat16", copy_storage=storage)
    rounded = tiny_model("qwen2", seed=0).to(torch.bfloat16).float()  # the policy's weights, held in fp32
    batch = packed_batch(samples_of(rounded), staleness=[0, 0, 0, 0])
    selected = batch["token_index"] >= 0
    with async_grpo_on_cpu():
        call = trainer._forward_call(trainer.model, batch)
        prox, _ = trainer._proximal_logprobs(trainer.model, call.kwargs, batch["token_index"][selected])
        with torch.no_grad():
            own = trainer.model(**call.kwargs).log_probs.flatten()[batch["token_index"][selected]].float()
    reference = batch["old_log_probs"][selected]
    torch.testing.assert_close(prox, reference, atol=1e-5, rtol=0)
    assert (own - reference).abs().max() > 1e-3


def test_config_refusals_name_the_field():
    base = dict(bf16=False, use_cpu=True)
    cases = {
        "async_objective": dict(async_objective="bogus"),
        "old_logprob_mode='fp32_clone' chooses the proximal pass": dict(old_logprob_mode="fp32_clone"),
        "old_logprob_mode='sampler'": dict(async_objective="decoupled", old_logprob_mode="sampler"),
        "is_correction='tis'": dict(is_correction="tis"),
        "needs guided_fp32_layers": dict(async_objective="decoupled", old_logprob_mode="guided_fp32"),
        "max_staleness must be an integer >= 0": dict(max_staleness=-1),
        "ratio_band_low must be a number": dict(ratio_band_low="0.9"),
    }
    for message, kwargs in cases.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(")):
            RatioAsyncGRPOConfig("/tmp/unused", **base, **kwargs)
    with pytest.raises(TypeError, match="RatioAsyncGRPOConfig"):
        from trl.experimental.async_grpo import AsyncGRPOConfig

        RatioAsyncGRPOTrainer(model="unused", args=AsyncGRPOConfig("/tmp/unused", **base))


def greedy_completion(n: int = 6) -> list[int]:
    """The reference model's greedy continuation of PROMPT: each token the argmax, so in any top_p kept set."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(REFERENCE(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def processed_sample(completion: list[int], top_p: float, advantage: float) -> RolloutSample:
    """A sample whose behaviour log-probs are what a vLLM server returns under top_p (`--logprobs-mode
    processed_logprobs`): the reference model's distribution renormalised over the kept set (vLLM's order)."""
    ids = PROMPT + completion
    with torch.no_grad():
        logits = REFERENCE(input_ids=torch.tensor([ids]), use_cache=False).logits[0, len(PROMPT) - 1:-1].float()
    keep = SamplingSettings(top_p=top_p, engine="vllm").keep_mask(logits)  # (T, V)
    processed = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)
    lp = torch.zeros(len(ids))
    lp[len(PROMPT):] = processed.gather(1, torch.tensor(completion)[:, None])[:, 0]
    return RolloutSample(prompt=[], completion=[], input_ids=np.array(ids),
                         completion_mask=np.array([0] * len(PROMPT) + [1] * len(completion)),
                         old_log_probs=lp.numpy(), advantage=advantage, model_version=0, group_id=0,
                         metrics={"reward": advantage})


def test_lift_sampler_puts_processed_behaviour_log_probs_on_the_full_support(model_dir, tmp_path):
    """top_p=0.8 on the server: its processed log-probs sit above the policy's by -log M (M the kept mass). The lift
    adds log M, recomputed from the proximal logits in vLLM's order: at staleness 0 the IS weight is 1 to 1e-5, where
    without it the weight is M itself."""
    completion = greedy_completion()
    samples = [processed_sample(completion, 0.8, 1.0), processed_sample(completion[:3], 0.8, -1.0)]
    raw = make_trainer(model_dir, tmp_path, async_objective="decoupled", top_p=0.8)
    lifted = make_trainer(model_dir, tmp_path, async_objective="decoupled", top_p=0.8,
                          truncation_correction="lift_sampler")
    metrics = {}
    for name, trainer in (("raw", raw), ("lifted", lifted)):
        _loss_and_grads(trainer, packed_batch(samples, staleness=[0, 0]))
        metrics[name] = trainer.staleness_stats.flush()
    weight = staleness_key(0, "is_weight_mean")
    assert metrics["lifted"][weight] == pytest.approx(1.0, abs=1e-5)
    assert metrics["lifted"][staleness_key(0, "prox_behav_oob_rate")] == 0.0
    assert metrics["raw"][weight] < 0.99  # unlifted, the weight is the kept mass M < 1 (0.80 here)
    assert lifted.proximal_forwards == 1


@pytest.mark.parametrize("logprobs_mode", ["raw_logprobs", "processed_logits"])
@pytest.mark.parametrize("overrides,named", [
    (dict(async_objective="decoupled"), "async_objective='decoupled'"),
    (dict(async_objective="decoupled_loglinear"), "async_objective='decoupled_loglinear'"),
    (dict(async_objective="decoupled", top_p=0.8, truncation_correction="lift_sampler", is_correction="tis"),
     "async_objective='decoupled', truncation_correction='lift_sampler', is_correction='tis'"),
])
def test_a_server_without_processed_logprobs_is_refused_at_start(model_dir, tmp_path, logprobs_mode, overrides,
                                                                 named):
    # was: built and trained: the IS weight exp(proximal - behaviour) and the lift read raw log-probs as processed
    with StubServer(logprobs_mode) as server:
        with pytest.raises(ValueError, match=f"server at {server.url} runs with --logprobs-mode {logprobs_mode}") \
                as refused:
            make_trainer(model_dir, tmp_path, vllm_server_base_url=server.url, **overrides)
    assert str(refused.value).startswith(named) and "--logprobs-mode processed_logprobs" in str(refused.value)
    assert server.paths.count("/server_info") == 1


def test_coupled_runs_against_any_server_and_asks_nothing(model_dir, tmp_path):
    # TRL's own loss (the default): its start-up is stock, no /server_info request is added
    with StubServer("raw_logprobs") as server:
        trainer = make_trainer(model_dir, tmp_path, vllm_server_base_url=server.url)
    assert trainer.args.async_objective == "coupled" and server.paths == []


def test_a_processed_logprobs_server_is_asked_once(model_dir, tmp_path, processed_server):
    before = processed_server.paths.count("/server_info")
    make_trainer(model_dir, tmp_path, async_objective="decoupled")
    assert processed_server.paths.count("/server_info") == before + 1


def test_truncation_correction_refusals():
    base = dict(bf16=False, use_cpu=True)
    with pytest.raises(ValueError, match="renormalize"):
        RatioAsyncGRPOConfig("/tmp/unused", **base, async_objective="decoupled", top_p=0.8,
                             truncation_correction="renormalize")
    with pytest.raises(ValueError, match="only async_objective='decoupled'"):
        RatioAsyncGRPOConfig("/tmp/unused", **base, top_p=0.8, truncation_correction="lift_sampler")
    with pytest.raises(ValueError, match="nothing to correct"):
        RatioAsyncGRPOConfig("/tmp/unused", **base, async_objective="decoupled", truncation_correction="lift_sampler")


def test_report_warns_when_a_bucket_trained_nothing():
    """`grpo-ratio report` on a decoupled run whose is_correction rejected every token of a bucket: a warning; on a
    coupled run, the bucket whose clip the staleness flips most is named."""
    from grpo_ratio.analysis.report import render_staleness

    row = {staleness_key(0, "num_tokens"): 10, staleness_key(0, "is_weight_mean"): 1.0, staleness_key(0, "is_ess"): 1.0,
           staleness_key(1, "num_tokens"): 6, staleness_key(1, "is_weight_mean"): 0.0, staleness_key(1, "is_ess"): 0.0}
    text = render_staleness([row], {"async_objective": "decoupled"})
    assert "**warning** every token of staleness 1 got IS weight 0" in text and "staleness 0" not in text
    coupled = {staleness_key(1, "num_tokens"): 10, staleness_key(1, "clip_flip_rate"): 0.33,
               staleness_key(2, "num_tokens"): 10, staleness_key(2, "clip_flip_rate"): 0.25}
    assert "At staleness 1, 33.0% of tokens" in render_staleness([coupled], {"async_objective": "coupled"})
    assert "At staleness" not in render_staleness([coupled], {"async_objective": "decoupled"})


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_fp16_clone_fallback_attends_in_fp32_off_the_fa3_kernel(storage):
    """Async fp16_clone on a packed row whose fp16 pass overflows (token 5's embedding x1e8): the fp32 re-run attends
    through the torch tree kernel in fp32, never through TRL's flash-attn3 kernel (a dtype-strict stand-in with its
    signature refuses fp32 as the kernel does), and gives the fp32 model's unpacked log-probs to 1e-5."""
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention

    from grpo_ratio.old_pass.scorer import OldLogprobScorer
    from grpo_ratio.testing.async_cpu import dtype_strict_tree_kernel

    register_tree_attention()
    model = tiny_model("qwen2", seed=0, dtype=storage)
    with torch.no_grad():
        model.get_input_embeddings().weight[5].mul_(1e8)  # overflows fp16; RMSNorm keeps fp32 finite
    model.config._attn_implementation = TREE_ATTENTION
    reference = tiny_model("qwen2", seed=0, dtype=storage).float()  # the policy's values in fp32, unpacked
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    completions = [[20, 21, 5, 23, 1], [20, 30, 31, 1]]
    batch = packed_batch([sample(c, 0.0, 1.0, group_id=0, model=reference) for c in completions])
    selected = batch["attention_mask"].bool()
    kwargs = dict(input_ids=batch["input_ids"][selected][None], position_ids=batch["position_ids"][selected][None],
                  **{k: batch[k][batch[k] >= 0] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")})
    kwargs["tree_max_seqlen_q"], kwargs["tree_max_seqlen_k"] = batch["tree_max_seqlens"][0].tolist()
    trained = batch["token_index"] >= 0
    positions = batch["token_index"][trained]  # (M,)
    targets = batch["input_ids"][selected].roll(-1)[positions]  # (M,) the token each position predicts
    with dtype_strict_tree_kernel() as kernel_dtypes:
        logps = OldLogprobScorer(model, "fp16_clone").score_packed(kwargs, positions, targets)
    assert kernel_dtypes and set(kernel_dtypes) == {torch.float16}  # the fp16 pass only; the fp32 re-run bypassed it
    torch.testing.assert_close(logps, batch["old_log_probs"][trained], atol=1e-5, rtol=0)


def test_staleness_stats_leave_out_unknown_terms_whatever_their_values():
    # unknown terms (untagged, or past the last bucket) add nothing, even NaN or inf weights (no boolean-mask selection
    # any more: they are zeroed in place, so a NaN must not leak into the sums)
    from grpo_ratio.diagnostics.staleness import StalenessStats

    stats = StalenessStats(3, (0.9, 1.1), 0.2, 0.2, decoupled=True)
    nan, inf = float("nan"), float("inf")
    new = torch.tensor([0.0, nan, 0.5, 0.0, 0.0])
    stats.update(torch.tensor([0, -1, 1, 5, 1]), new, torch.zeros(5), torch.zeros(5), torch.ones(5),
                 torch.tensor([1.0, nan, 2.0, inf, 4.0]))
    metrics = stats.flush()
    assert metrics[staleness_key(0, "num_tokens")] == 1 and metrics[staleness_key(1, "num_tokens")] == 2
    assert metrics[staleness_key(1, "is_weight_mean")] == 3.0
    assert metrics[staleness_key(1, "new_behav_mean_abs_log_ratio")] == 0.25
    assert metrics[staleness_key(1, "new_behav_oob_rate")] == 0.5  # exp(0.5) is out of [0.9, 1.1]
    assert staleness_key(2, "num_tokens") not in metrics


def test_untagged_terms_of_the_loglinear_objective_are_refused_at_log_time(model_dir, tmp_path):
    # on an accelerator loglinear_alpha no longer asserts on the device (that left the CUDA context unusable): the
    # trainer counts untagged terms there and refuses them when it logs, where the host reads anyway
    trainer = make_trainer(model_dir, tmp_path, async_objective="decoupled_loglinear")
    trainer._untagged_terms = torch.tensor(3)
    with pytest.raises(ValueError, match="3 loss terms had no staleness"):
        trainer.log({"loss": 0.0})
    assert trainer._untagged_terms is None
    trainer._untagged_terms = torch.tensor(0)
    trainer.log({"loss": 0.0})  # none: nothing said


def _two_pass_loss_and_grads(trainer, batch):
    """The decoupled bf16 loss as it was computed before the reuse (issue 43 item 4): TRL's forward arguments, a
    no-grad proximal pass of the policy in eval mode, then TRL's `compute_loss` on the rewritten batch (its own
    training forward). Returns the loss, the gradients and the number of forwards of the policy."""
    inputs = {k: v for k, v in batch.items() if k != "policy_version"}
    selected = inputs["token_index"] >= 0
    positions, behaviour = inputs["token_index"][selected], inputs["old_log_probs"][selected]  # (M,) x 2
    advantages, segment_id = inputs["advantages"][selected], inputs["segment_id"][selected]  # (M,) x 2
    calls = []
    handle = trainer.model.register_forward_hook(lambda *a: calls.append(1))
    trainer.model.zero_grad()
    try:
        with async_grpo_on_cpu():
            call = trainer._forward_call(trainer.model, inputs)
            with torch.no_grad(), eval_mode(trainer.model):
                prox = trainer.model(**call.kwargs).log_probs.flatten()[positions].float()  # (M,)
            weights, _ = proximal_weights(prox, behaviour, segment_id, trainer.is_correction, advantages)
            old, adv = decoupled_inputs(inputs["old_log_probs"], inputs["advantages"], selected, prox, weights)
            loss = AsyncGRPOTrainer.compute_loss(trainer, trainer.model, {**inputs, "old_log_probs": old,
                                                                         "advantages": adv})
        loss.backward()
    finally:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(calls)


@pytest.mark.parametrize("is_correction", [None, "tis"])
def test_decoupled_bf16_reuses_the_training_forward_bit_for_bit(model_dir, tmp_path, is_correction):
    """Issue 43 item 4: `"decoupled"` with `old_logprob_mode="bf16"` takes the proximal log-probs from the training
    forward, detached (AReaL's `prox_logp_method="reuse_train_logp"`): one forward of the policy per micro-batch where
    the two-pass loss ran two, and the loss, gradients and TRL's metrics equal the two-pass ones bit for bit (a model
    without active dropout)."""
    trainer = make_trainer(model_dir, tmp_path, async_objective="decoupled", is_correction=is_correction)
    batch = packed_batch(samples_of(shift=-0.3), staleness=[0, 1, 2, 1])
    loss_2, grads_2, calls_2 = _two_pass_loss_and_grads(trainer, batch)
    trl_keys = ["ratio", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]
    metrics_2 = [trainer._metrics["train"][k][-1] for k in trl_keys]
    calls = []
    handle = trainer.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        loss_1, grads_1 = _loss_and_grads(trainer, batch)
    finally:
        handle.remove()
    assert calls_2 == 2 and len(calls) == 1 and trainer.proximal_forwards == 0
    assert torch.equal(loss_1, loss_2)
    assert grads_1.keys() == grads_2.keys() and all(torch.equal(grads_1[n], grads_2[n]) for n in grads_1)
    assert [trainer._metrics["train"][k][-1] for k in trl_keys] == metrics_2
    assert metrics_2[0] == 1.0 and metrics_2[-1] == 0.0  # new/proximal exactly 1, the clip never acts
    assert grads_1 and any(g.abs().sum() > 0 for g in grads_1.values())


@pytest.mark.parametrize("name", ["dppo_tv_mask", "kpop"])
def test_the_divergence_presets_train_the_decoupled_objective(model_dir, tmp_path, name):
    """The Bernoulli-divergence presets (issue 43: prime-rl's directional binary-TV mask, AReaL's KPop) on the
    behaviour -> proximal weight: two steps through the real queue, loss finite, the weight is the preset's."""
    samples = samples_of(shift=-0.2)
    trainer = make_trainer(model_dir, tmp_path, samples=samples, staleness=(0, 1, 2, 1), max_steps=2,
                           async_objective="decoupled", is_correction=name)
    assert trainer.is_correction == preset(name)
    with async_grpo_on_cpu():
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    weights = [h[k] for h in logs for k in h if k.endswith("/is_weight_mean")]
    assert weights and all(0.0 <= w < 10 for w in weights)


def test_the_sampler_fp32_head_trains_the_decoupled_objective(model_dir, tmp_path):
    """Issue 43 item 3: `old_logprob_mode="fp32_head"` with `fp32_head_operands="bf16"` as the proximal pass on a bf16
    policy: two steps through the real queue, loss finite, one proximal pass per micro-batch, and the packed pass's
    log-probs are the sampler's head (bf16 norm output x bf16 weight, fp32 accumulation), not fp32_head's."""
    import json

    from grpo_ratio.diagnostics.run_record import HEAD_ARITHMETIC, RUN_FILE
    from grpo_ratio.old_pass.scorer import OldLogprobScorer

    samples = samples_of(shift=-0.2)
    trainer = make_trainer(model_dir, tmp_path, samples=samples, staleness=(0, 1, 2, 1), max_steps=2,
                           async_objective="decoupled", old_logprob_mode="fp32_head", fp32_head_operands="bf16",
                           dtype="bfloat16")
    assert trainer._proximal.head_operands == "bf16"
    batch = packed_batch(samples_of(), staleness=[0, 0, 0, 0])
    positions = batch["token_index"][batch["token_index"] >= 0]
    with async_grpo_on_cpu():
        call = trainer._forward_call(trainer.model, batch)
        sampler_head, _ = trainer._proximal_logprobs(trainer.model, call.kwargs, positions)
        targets = call.kwargs["shift_labels"].flatten()[positions]  # (M,)
        fp32 = OldLogprobScorer(trainer.model, "fp32_head").score_packed(call.kwargs, positions, targets)
    gap = (sampler_head - fp32).abs()
    assert sampler_head.dtype == torch.float32 and 0 < gap.max() < 1e-2  # the norm's cast: small, not zero
    with async_grpo_on_cpu():
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert trainer.proximal_forwards > 0
    record = json.loads((tmp_path / RatioAsyncGRPOTrainer.__name__ / RUN_FILE).read_text())
    assert record[HEAD_ARITHMETIC]["operands"] == "bf16" and record["config"]["fp32_head_operands"] == "bf16"


def test_a_cpu_outside_the_cpu_path_is_refused_in_one_line(model_dir, tmp_path):
    # stock TRL: "AssertionError: Torch not compiled with CUDA enabled" from its MFU set-up, deep in __init__
    args = RatioAsyncGRPOConfig(str(tmp_path / "o"), use_cpu=True, bf16=False, token_budget=0, report_to="none",
                                vllm_server_base_url="http://127.0.0.1:1")
    with pytest.raises(RuntimeError) as err:
        RatioAsyncGRPOTrainer(model=model_dir, reward_funcs=[], args=args,
                              train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "x"}]] * 4}))
    message = str(err.value)
    assert "\n" not in message and message.startswith("RatioAsyncGRPOTrainer needs a CUDA GPU")
    assert "grpo_ratio.testing.async_cpu.async_grpo_on_cpu()" in message and "trainers/async_grpo.py --cpu" in message
    with async_grpo_on_cpu():  # the CPU path: built (TRL's own code throughout)
        from grpo_ratio.old_pass.tree_attention import torch_tree_attention_active

        assert torch_tree_attention_active()
    assert not torch_tree_attention_active()


def test_a_model_id_is_resolved_as_the_other_trainers_resolve_it(model_dir, tmp_path, monkeypatch):
    # the docs' snippet offline: the hub (and its cache) cannot give SmolLM2's id, the converted directory can (a tiny
    # model stands in for it); stock TRL would fail in from_pretrained
    import shutil

    from grpo_ratio import models

    cache = tmp_path / "cache"
    shutil.copytree(model_dir, cache / models.DEFAULT_MODEL.split("/")[-1])
    monkeypatch.setenv("GRPO_RATIO_CACHE", str(cache))

    def no_hub(name, revision):
        raise OSError("offline")

    monkeypatch.setattr(models, "_from_hub", no_hub)
    trainer = make_trainer(models.DEFAULT_MODEL, tmp_path)
    assert trainer.model.config.name_or_path == str(cache / "SmolLM2-135M-Instruct")
    assert trainer.args.output_dir == str(tmp_path / "RatioAsyncGRPOTrainer")


@pytest.mark.parametrize("objective", ["coupled", "decoupled"])
def test_score_centering_trains_the_async_trainer(model_dir, tmp_path, objective):
    """`score_centering="exact"` (issue 43 item 1): two steps through the real queue, loss finite; the terms of
    staleness 0 are centred (their share logged), with q the server's top_p re-applied: TV(q, p) = 1 - kept mass."""
    samples = samples_of(shift=-0.2)
    trainer = make_trainer(model_dir, tmp_path, samples=samples, staleness=(0, 1, 2, 1), max_steps=2,
                           async_objective=objective, score_centering="exact", top_p=0.8)
    with async_grpo_on_cpu():
        trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    fracs = [h["ratio/centering/centred_token_frac"] for h in logs]
    assert all(0.0 <= f <= 1.0 for f in fracs) and fracs[0] > 0  # the first step has staleness-0 terms
    assert 0.1 < logs[0]["ratio/centering/drift_tv"] < 0.3


def test_score_centering_leaves_the_async_loss_values_and_refuses_top_k(model_dir, tmp_path):
    """Centred, the coupled loss of a micro-batch is TRL's bit for bit (the gradient changes); "top_k" is refused."""
    samples = samples_of(shift=-0.2)
    batch = packed_batch(samples, staleness=[0, 0, 0, 0])
    losses, grads = [], []
    for centring in (None, "exact"):
        trainer = make_trainer(model_dir, tmp_path / str(centring), score_centering=centring, top_p=0.8)
        trainer.model.zero_grad()
        with async_grpo_on_cpu():
            loss = trainer.compute_loss(trainer.model, dict(batch))
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
    assert torch.equal(losses[0], losses[1])
    assert not torch.allclose(grads[0], grads[1])
    with pytest.raises(ValueError, match="score_centering='top_k' is not allowed; allowed: exact"):
        RatioAsyncGRPOConfig(str(tmp_path / "x"), use_cpu=True, score_centering="top_k")
