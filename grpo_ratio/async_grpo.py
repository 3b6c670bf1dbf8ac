"""`RatioAsyncGRPOConfig` / `RatioAsyncGRPOTrainer`: TRL's experimental `AsyncGRPOTrainer` with a choice of objective
(`async_objective`), the behaviour -> proximal IS correction and per-staleness ratio diagnostics (docs/async.md).

TRL's async trainer consumes rollouts a vLLM server sampled up to `max_staleness` weight syncs ago and clips
exp(logp_theta - logp_vLLM): policy lag, engine numerics and truncated sampling folded into one ratio. Here:

- `"coupled"` (default): TRL's loss and metrics, bit for bit; the `ratio/staleness/<k>/*` diagnostics only observe.
- `"decoupled"`: AReaL's decoupled PPO (arXiv 2505.24298): a proximal pass on the batch as it is consumed (any
  `old_logprob_mode`), PPO clip on new/proximal, the behaviour -> proximal IS weight through `is_correction`.
- `"decoupled_loglinear"`: the same loss with A-3PO's proximal log-probs (arXiv 2512.06547), interpolated between
  behaviour and current by staleness: no proximal forward.

Hooks (no TRL method copied): the rollout queue (each sample's staleness, tagged where TRL computes it), the
collator (the staleness of every loss term), and `compute_loss`, which runs TRL's own `compute_loss` on rewritten
`old_log_probs` / `advantages` (`grpo_ratio.corrections.decoupled`) and observes the forward's log-probs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields

import torch
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from .checks import check_async_config
from .config import RatioFields
from .corrections.decoupled import OBJECTIVES, decoupled_inputs, loglinear_proximal, proximal_weights
from .diagnostics.staleness import StalenessStats
from .modes import TRL_MODE
from .old_pass.copies import WeightsVersion, WeightsVersionCallback
from .old_pass.scorer import OldLogprobScorer


def _declared(name: str):
    """The field `name` exactly as `RatioFields` declares it (default and `help`): one home for its description."""
    source = {f.name: f for f in fields(RatioFields)}[name]
    return field(default=source.default, metadata=source.metadata)


@dataclass
class RatioAsyncGRPOConfig(AsyncGRPOConfig):
    """Configuration class for [`RatioAsyncGRPOTrainer`]: every field of TRL's `AsyncGRPOConfig`, `async_objective`,
    and the grpo_ratio fields that apply to an asynchronous run (declared by `RatioFields`, their `help` unchanged).

    Raises (in `__post_init__`, `grpo_ratio.checks.check_async_config`): `ValueError` naming the field and the allowed
    values for an unknown objective or mode, a proximal-pass field or `is_correction` without a decoupled objective,
    `old_logprob_mode="sampler"` (the proximal policy would be the behaviour policy: that is `"coupled"`).
    """

    async_objective: str = field(
        default="coupled",
        metadata={
            "help": "The loss of the asynchronous run: 'coupled' (TRL's: PPO clip on new/behaviour, bit for bit), "
            "'decoupled' (AReaL's decoupled PPO: a proximal pass by old_logprob_mode on the batch as it is "
            "consumed, PPO clip on new/proximal, the behaviour->proximal IS weight through is_correction) or "
            "'decoupled_loglinear' (the same loss, proximal log-probs interpolated between behaviour and current "
            "by staleness, A-3PO: no extra forward). docs/async.md.",
            "choices": list(OBJECTIVES),
        },
    )
    old_logprob_mode: str = _declared("old_logprob_mode")
    guided_fp32_layers: str | None = _declared("guided_fp32_layers")
    copy_storage: str = _declared("copy_storage")
    is_correction: str | None = _declared("is_correction")
    is_correction_level: str | None = _declared("is_correction_level")
    is_correction_action: str | None = _declared("is_correction_action")
    is_correction_low: float | None = _declared("is_correction_low")
    is_correction_high: float | None = _declared("is_correction_high")
    is_correction_rejection: str | None = _declared("is_correction_rejection")
    is_correction_veto: float | None = _declared("is_correction_veto")
    ratio_diagnostics: bool = _declared("ratio_diagnostics")
    ratio_band_low: float = _declared("ratio_band_low")
    ratio_band_high: float = _declared("ratio_band_high")

    def __post_init__(self):
        super().__post_init__()
        check_async_config(self)  # every refusal of the new fields (grpo_ratio/checks.py)

    @property
    def decoupled(self) -> bool:
        """Whether the objective separates the proximal policy from the behaviour policy."""
        return self.async_objective != "coupled"


# the key under which the rollout queue tags each sample's staleness in its `metrics` dict; the collator removes it
# before TRL's collator aggregates the metrics, so it never reaches a log
STALENESS_TAG = "_grpo_ratio_staleness"


class StalenessTaggingQueue:
    """The worker's rollout queue, seen by TRL's `RolloutQueueDataset`: each sample it hands out carries its staleness
    (`model_version_fn() - sample.model_version`, the value TRL computes right after for its drop rule) in a copy of
    its `metrics` dict. Every other attribute is the queue's."""

    def __init__(self, queue, model_version_fn):
        self._queue = queue
        self._model_version_fn = model_version_fn

    def get(self, *args, **kwargs):
        sample = self._queue.get(*args, **kwargs)
        sample.metrics = {**sample.metrics, STALENESS_TAG: self._model_version_fn() - sample.model_version}
        return sample

    def __getattr__(self, name):
        return getattr(self._queue, name)


class StalenessCollator:
    """TRL's `DataCollatorForRollout` plus `staleness` (R, M_max) int64: the staleness of every loss term, in the
    order of TRL's `token_index` (-1 on padding, and on a sample that carried no tag)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, examples):
        (rows,) = examples  # one micro-batch: R pre-packed rows (TRL's planner)
        per_row = [[example["metrics"].pop(STALENESS_TAG, -1) for example in row.samples] for row in rows]
        batch = self.collate(examples)
        segment_id, selected = batch["segment_id"], batch["token_index"] >= 0  # (R, M_max)
        staleness = torch.full_like(segment_id, -1)
        for r, values in enumerate(per_row):
            of_sample = torch.tensor(values, dtype=torch.long)  # (S_r,)
            staleness[r] = torch.where(selected[r], of_sample[segment_id[r].clamp(max=len(values) - 1)], -1)
        batch["staleness"] = staleness
        return batch


class _ForwardCall(Exception):
    """Raised by `_Probe` to end TRL's `compute_loss` at its model call, carrying the call's arguments (and the
    outputs, when the probe ran the forward)."""

    def __init__(self, kwargs: dict, outputs=None, seconds: float = 0.0):
        super().__init__("grpo_ratio: forward call captured")
        self.kwargs, self.outputs, self.seconds = kwargs, outputs, seconds


class _Probe:
    """Stands in for the model in a first `compute_loss` call: TRL builds the forward's arguments from the packed
    batch, the probe takes them (running the real forward when `run` is given) and stops the call."""

    def __init__(self, run=None):
        self.run = run

    def __call__(self, **kwargs):
        if self.run is None:
            raise _ForwardCall(kwargs)
        start = time.time()
        outputs = self.run(**kwargs)
        raise _ForwardCall(kwargs, outputs, time.time() - start)


class _Replay:
    """Stands in for the model in the second `compute_loss` call: returns the outputs the probe's forward computed
    (one forward per micro-batch; autograd runs through them)."""

    def __init__(self, outputs):
        self.outputs = outputs

    def __call__(self, **kwargs):
        return self.outputs


@contextlib.contextmanager
def _forward_outputs(model: torch.nn.Module):
    """Within the block, the outputs of every call of `model` are appended to the list this yields."""
    seen: list = []
    handle = model.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        yield seen
    finally:
        handle.remove()


class RatioAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL's `AsyncGRPOTrainer` with `async_objective`, the behaviour -> proximal IS correction and the
    `ratio/staleness/<k>/*` diagnostics (module docstring, docs/async.md). Takes TRL's arguments; `args` must be a
    [`RatioAsyncGRPOConfig`].

    Attributes:
        proximal_forwards (`int`): proximal passes run so far (one per micro-batch under `"decoupled"`, none
            otherwise).

    Raises:
        TypeError: `args` is a plain `AsyncGRPOConfig` (use `RatioAsyncGRPOConfig`).
    """

    def __init__(self, model, reward_funcs=None, args: RatioAsyncGRPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            args = RatioAsyncGRPOConfig(f"{str(model).split('/')[-1]}-AsyncGRPO")
        if not isinstance(args, RatioAsyncGRPOConfig):
            raise TypeError(f"RatioAsyncGRPOTrainer needs args=RatioAsyncGRPOConfig(...), got {type(args).__name__}")
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        self.weights_version = WeightsVersion()
        self.add_callback(WeightsVersionCallback(self.weights_version, self.accelerator))
        self.is_correction = args.is_correction_spec
        self.proximal_forwards = 0
        self._proximal = None
        if args.async_objective == "decoupled" and args.old_logprob_mode != TRL_MODE:
            self._proximal = OldLogprobScorer(self.model, args.old_logprob_mode, layers=args.guided_fp32_layer_ids,
                                              copy_storage=args.copy_storage)
        self.staleness_stats = None
        if args.ratio_diagnostics:
            self.staleness_stats = StalenessStats(args.max_staleness, (args.ratio_band_low, args.ratio_band_high),
                                                  self.epsilon_low, self.epsilon_high, args.decoupled)
        if self.rollout_queue is not None:  # rank 0 holds the queue
            self.rollout_queue = StalenessTaggingQueue(self.rollout_queue, lambda: self.model_version)

    # -- data: the staleness of every loss term ---------------------------------------------------------------------

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderDispatcher wraps the DataLoader
        base.collate_fn = StalenessCollator(base.collate_fn)
        return loader

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "staleness" not in self._signature_columns:
            self._signature_columns.append("staleness")

    # -- the loss ---------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        staleness = inputs.pop("staleness", None)  # (R, M_max) int64, TRL reads no such key
        selected = inputs["token_index"] >= 0  # (R, M_max): TRL's loss terms
        behaviour = inputs["old_log_probs"][selected]  # (M,) the sampler's log-probs
        advantages = inputs["advantages"][selected]  # (M,)
        terms_staleness = staleness[selected] if staleness is not None else torch.full_like(advantages, -1).long()
        if not self.args.decoupled:
            with _forward_outputs(model) as seen:
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            new = seen[-1].log_probs.flatten()[inputs["token_index"][selected]]  # (M,)
            self._observe(terms_staleness, new, behaviour, behaviour, advantages, torch.ones_like(advantages))
            return loss
        if self.args.async_objective == "decoupled":
            call = self._forward_call(model, inputs)
            prox = self._proximal_logprobs(model, call.kwargs, inputs["token_index"][selected])  # (M,)
            outputs, seconds = None, 0.0
        else:  # decoupled_loglinear: the training forward first (the probe runs it), no proximal pass
            call = self._forward_call(model, inputs, run=model)
            outputs, seconds = call.outputs, call.seconds
            new = outputs.log_probs.flatten()[inputs["token_index"][selected]]  # (M,)
            prox = loglinear_proximal(behaviour, new, terms_staleness)
        segment_id = inputs["segment_id"][selected]  # (M,)
        weights, _ = proximal_weights(prox, behaviour, segment_id, self.is_correction)  # (M,)
        old, adv = decoupled_inputs(inputs["old_log_probs"], inputs["advantages"], selected, prox, weights)
        rewritten = {**inputs, "old_log_probs": old, "advantages": adv}
        runner = model if outputs is None else _Replay(outputs)
        with _forward_outputs(model) if outputs is None else contextlib.nullcontext([outputs]) as seen:
            loss = super().compute_loss(runner, rewritten, return_outputs, num_items_in_batch)
        self._step_forward_s += seconds  # TRL timed the replay (no forward); the probe timed the real one
        new = seen[-1].log_probs.flatten()[inputs["token_index"][selected]]  # (M,)
        self._observe(terms_staleness, new, behaviour, prox, advantages, weights)
        return loss

    def _forward_call(self, model, inputs, run=None) -> _ForwardCall:
        """The arguments TRL's `compute_loss` passes to the model for this micro-batch (and, with `run`, the outputs
        of running them): TRL builds them, the probe stops the call there."""
        try:
            super().compute_loss(_Probe(run), inputs)
        except _ForwardCall as call:
            return call
        raise RuntimeError("grpo_ratio: TRL's AsyncGRPOTrainer.compute_loss did not call the model")

    @torch.no_grad()
    def _proximal_logprobs(self, model, kwargs: dict, positions: torch.Tensor) -> torch.Tensor:
        """(M,) fp32 proximal log-probs of the trained tokens: the training forward's own call without gradient
        (`old_logprob_mode="bf16"`: bitwise the training forward's values), or the scoring mode's pass."""
        self.proximal_forwards += 1
        if self._proximal is None:
            return model(**kwargs).log_probs.flatten()[positions].float()
        targets = kwargs["shift_labels"].flatten()[positions]  # (M,)
        return self._proximal.score_packed(kwargs, positions, targets, temperature=self.temperature,
                                           version=self.weights_version.value)

    # -- diagnostics ------------------------------------------------------------------------------------------------

    def _observe(self, staleness, new, behaviour, prox, advantages, weights) -> None:
        if self.staleness_stats is not None:
            self.staleness_stats.update(staleness, new, behaviour, prox, advantages, weights)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.staleness_stats is not None and self.model.training:
            logs = {**logs, **self.staleness_stats.flush(self.accelerator)}
        super().log(logs, start_time)
