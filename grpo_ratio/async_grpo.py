"""`RatioAsyncGRPOConfig` / `RatioAsyncGRPOTrainer`: TRL's experimental `AsyncGRPOTrainer` with a choice of objective
(`async_objective`), the behaviour -> proximal IS correction and per-staleness ratio diagnostics (docs/async.md).

TRL's async trainer consumes rollouts a vLLM server sampled up to `max_staleness` weight syncs ago and clips
exp(logp_theta - logp_vLLM): policy lag, engine numerics and truncated sampling folded into one ratio. Here:

- `"coupled"` (default): TRL's loss and metrics, bit for bit; the `ratio/staleness/<k>/*` diagnostics only observe.
- `"decoupled"`: AReaL's decoupled PPO (arXiv 2505.24298): the proximal log-probs of the batch as it is consumed
  (`old_logprob_mode="bf16"`: the training forward's own, detached, no second forward, as AReaL's
  `prox_logp_method="reuse_train_logp"`; a precision mode: its no-grad pass), PPO clip on new/proximal, the
  behaviour -> proximal IS weight through `is_correction`.
- `"decoupled_loglinear"`: the same loss with A-3PO's proximal log-probs (arXiv 2512.06547), interpolated between
  behaviour and current by staleness: no proximal forward.

Hooks (no TRL method copied): the rollout queue (each sample's policy version), the collator (the version of every
loss term; its staleness is counted at the loss), and `compute_loss`, which runs TRL's own `compute_loss` on rewritten
`old_log_probs` / `advantages` (`grpo_ratio.corrections.decoupled`) and observes the forward's log-probs.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field, fields
from functools import partial
from typing import ClassVar

import torch
from accelerate.utils import broadcast_object_list
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from .checks import check_async_config, check_async_server_logprobs, check_centering_engine
from .config import KnownFields, RatioFields
from .corrections.centering import center_logps, centering_terms
from .corrections.decoupled import OBJECTIVES, decoupled_inputs, loglinear_proximal, proximal_weights
from .corrections.kept_sets import SamplingSettings
from .diagnostics.console import quiet_console
from .diagnostics.metric_keys import CENTERING_DRIFT_TV, CENTERING_FRESH_FRAC
from .diagnostics.run_record_callback import RunRecordCallback
from .diagnostics.staleness import StalenessStats
from .diagnostics.trains_nothing_callback import trains_nothing_callback
from .models import trainer_model_source
from .modes import MODES, SAMPLER_MODE, SCORING_MODES, TRL_MODE
from .old_pass.copies import WeightsVersion, WeightsVersionCallback
from .old_pass.kept_head import capture_last_hidden, head_logits
from .old_pass.scorer import OldLogprobScorer, scoring_head_arithmetic
from .old_pass.tree_attention import torch_tree_attention_active
from .problems import collect


def _declared(name: str, help: str | None = None, choices: list | None = None):
    """The field `name` as `RatioFields` declares it (default, `help`, choices): one home for its description; `help`
    and `choices` replace the GRPO ones where the async trainer allows less or means more."""
    source = {f.name: f for f in fields(RatioFields)}[name]
    metadata = dict(source.metadata)
    metadata.update({k: v for k, v in (("help", help), ("choices", choices)) if v is not None})
    return field(default=source.default, metadata=metadata)


@dataclass
class RatioAsyncGRPOConfig(KnownFields, AsyncGRPOConfig):
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
            "'decoupled' (AReaL's decoupled PPO: proximal log-probs by old_logprob_mode on the batch as it is "
            "consumed, PPO clip on new/proximal, the behaviour->proximal IS weight through is_correction) or "
            "'decoupled_loglinear' (the same loss, proximal log-probs interpolated between behaviour and current "
            "by staleness, A-3PO: no extra forward). docs/async.md.",
            "choices": list(OBJECTIVES),
        },
    )
    old_logprob_mode: str = _declared(
        "old_logprob_mode",
        help="The proximal log-probs of async_objective='decoupled' (other objectives: leave at 'bf16'): 'bf16' (the "
        "training forward's own, detached: no extra forward), 'fp32_clone', 'fp16_clone', 'fp32_head' or "
        "'guided_fp32' (a no-grad pass, as in RatioGRPOConfig). 'sampler' is refused: that is 'coupled'.",
        choices=[mode for mode in SCORING_MODES if mode != SAMPLER_MODE])
    guided_fp32_layers: str | None = _declared("guided_fp32_layers")
    fp32_head_operands: str = _declared("fp32_head_operands")
    copy_storage: str = _declared("copy_storage")
    truncation_correction: str = _declared(
        "truncation_correction",
        help="With async_objective='decoupled' and top_p/top_k/min_p on the server: 'lift_sampler' puts the server's "
        "processed log-probs back on the full support (+ log of the kept mass, recomputed from the proximal logits in "
        "vLLM's order), or 'none'. 'renormalize' is refused here (docs/async.md).",
        choices=["none", "lift_sampler"])
    is_correction: str | None = _declared(
        "is_correction",
        help="The behaviour->proximal IS weight of the decoupled objectives: a preset of "
        "grpo_ratio.corrections.is_correction.PRESETS ('tis', 'icepop', 'seq_mask_tis', 'geo_rs', ...) or 'custom' "
        "(the is_correction_* fields). Unset: the raw weight exp(proximal - behaviour), unbounded (AReaL's "
        "formulation). Refused with async_objective='coupled'.")
    is_correction_level: str | None = _declared("is_correction_level")
    is_correction_action: str | None = _declared("is_correction_action")
    is_correction_low: float | None = _declared("is_correction_low")
    is_correction_high: float | None = _declared("is_correction_high")
    is_correction_rejection: str | None = _declared("is_correction_rejection")
    is_correction_veto: float | None = _declared("is_correction_veto")
    score_centering: str | None = _declared(
        "score_centering",
        help="Score centering (arXiv 2609.20807): the sampler-expected score E_q[grad log p] subtracted from each "
        "token's score (values, ratios and metrics unchanged; the gradient centred; with every objective). 'exact': q "
        "recomputed from the training forward's own logits (detached), with the server's temperature and "
        "top_k/top_p/min_p re-applied in vLLM's order; that is the sampler's distribution only where the forward runs "
        "the sampling weights, so loss terms of staleness 0 are centred and stale ones are left as they are "
        "(ratio/centering/centred_token_frac). 'top_k' is not available here (TRL's rollout worker asks the server "
        "for the sampled token's log-prob only). Costs one more pass of the LM head over the centred tokens, K at a "
        "time. Unset: TRL's loss, bit for bit.",
        choices=["exact"])
    ratio_diagnostics: bool = _declared("ratio_diagnostics")
    ratio_band_low: float = _declared("ratio_band_low")
    ratio_band_high: float = _declared("ratio_band_high")

    trl_trainer: ClassVar[str] = "async_grpo"  # recorded in run.json

    def __post_init__(self):
        # TRL's checks, then every refusal of the new fields (grpo_ratio/checks.py): every problem in one error
        collect((super().__post_init__, partial(check_async_config, self)))

    @property
    def decoupled(self) -> bool:
        """Whether the objective separates the proximal policy from the behaviour policy."""
        return self.async_objective != "coupled"


# the key under which the rollout queue tags each sample's policy version in its `metrics` dict; the collator
# removes it before TRL's collator aggregates the metrics, so it never reaches a log
VERSION_TAG = "_grpo_ratio_policy_version"


class VersionTaggingQueue:
    """The worker's rollout queue, seen by TRL's `RolloutQueueDataset`: each sample it hands out carries the version of
    the policy that sampled it (`sample.model_version`) in a copy of its `metrics` dict, for the collator. Every other
    attribute is the queue's."""

    def __init__(self, queue):
        self._queue = queue

    def get(self, *args, **kwargs):
        sample = self._queue.get(*args, **kwargs)
        sample.metrics = {**sample.metrics, VERSION_TAG: sample.model_version}
        return sample

    def __getattr__(self, name):
        return getattr(self._queue, name)


class VersionCollator:
    """TRL's `DataCollatorForRollout` plus `policy_version` (R, M_max) int64: the version of the policy that sampled
    every loss term, in the order of TRL's `token_index` (-1 on padding, and on a sample that carried no tag)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, examples):
        (rows,) = examples  # one micro-batch: R pre-packed rows (TRL's planner)
        per_row = [[example["metrics"].pop(VERSION_TAG, -1) for example in row.samples] for row in rows]
        batch = self.collate(examples)
        segment_id, selected = batch["segment_id"], batch["token_index"] >= 0  # (R, M_max)
        versions = torch.full_like(segment_id, -1)
        for r, values in enumerate(per_row):
            of_sample = torch.tensor(values, dtype=torch.long)  # (S_r,)
            versions[r] = torch.where(selected[r], of_sample[segment_id[r].clamp(max=len(values) - 1)], -1)
        batch["policy_version"] = versions
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


def check_async_device(args: AsyncGRPOConfig) -> None:
    """Refuse a run on a CPU device outside the CPU path, in one line: TRL's async trainer attends with the flash-attn3
    CUDA kernel and asks CUDA for the GPU's name when it is built (stock TRL: `AssertionError: Torch not compiled with
    CUDA enabled`, or the kernel's error at the first step).

    Raises:
        RuntimeError: `use_cpu=True` or no CUDA device, and not inside
            `grpo_ratio.testing.async_cpu.async_grpo_on_cpu()` (which runs TRL's tree attention on a torch kernel).
    """
    if (args.use_cpu or not torch.cuda.is_available()) and not torch_tree_attention_active():
        raise RuntimeError("RatioAsyncGRPOTrainer needs a CUDA GPU (TRL's async trainer runs the flash-attn3 CUDA "
                           "kernel); on a CPU build and train it inside `with grpo_ratio.testing.async_cpu."
                           "async_grpo_on_cpu():` (trainers/async_grpo.py --cpu; docs/async.md)")


class RatioAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL's `AsyncGRPOTrainer` with `async_objective`, the behaviour -> proximal IS correction and the
    `ratio/staleness/<k>/*` diagnostics (module docstring, docs/async.md). Takes TRL's arguments; `args` must be a
    [`RatioAsyncGRPOConfig`].

    Attributes:
        proximal_forwards (`int`): no-grad passes run for the proximal policy so far: one per micro-batch under
            `"decoupled"` with a precision `old_logprob_mode` or with `lift_sampler` (the kept mass), none otherwise
            (`"bf16"` reuses the training forward's log-probs).

    `model` given by name is resolved as `RatioGRPOTrainer` resolves it (`grpo_ratio.models.trainer_model_source`: a
    local directory or an id the hub or its cache has goes to TRL unchanged; offline, SmolLM2-135M-Instruct's
    converted GGUF directory).

    Raises:
        TypeError: `args` is a plain `AsyncGRPOConfig` (use `RatioAsyncGRPOConfig`).
        ValueError: a decoupled objective or `lift_sampler` and the vLLM server does not run with `--logprobs-mode
            processed_logprobs` (`grpo_ratio.checks.check_async_server_logprobs`).
        RuntimeError: a CPU device outside `grpo_ratio.testing.async_cpu.async_grpo_on_cpu()` (`check_async_device`).
        OSError: a model id that neither the hub, its cache nor the GGUF fallback provides.
    """

    def __init__(self, model, reward_funcs=None, args: RatioAsyncGRPOConfig | None = None, *pargs, **kwargs):
        if args is None:
            args = RatioAsyncGRPOConfig(f"{str(model).split('/')[-1]}-AsyncGRPO")
        if not isinstance(args, RatioAsyncGRPOConfig):
            raise TypeError(f"RatioAsyncGRPOTrainer needs args=RatioAsyncGRPOConfig(...), got {type(args).__name__}")
        check_async_device(args)
        if isinstance(model, str):  # resolved as the command line resolves it (offline: the converted SmolLM2)
            model = trainer_model_source(model, (args.model_init_kwargs or {}).get("revision"))
        super().__init__(model, reward_funcs, args, *pargs, **kwargs)
        check_async_server_logprobs(self)  # the decoupled objectives and lift_sampler need processed log-probs
        self.weights_version = WeightsVersion()
        self.add_callback(WeightsVersionCallback(self.weights_version, self.accelerator))
        # run.json + log_history.json in output_dir: what the report reads (and what the proximal pass's head computed)
        self.add_callback(RunRecordCallback(partial(scoring_head_arithmetic, args, self.accelerator.device)))
        self.is_correction = args.is_correction_spec
        self.add_callback(trains_nothing_callback(args, self.is_correction))  # every token of a step rejected: warned
        quiet_console(self)  # the console prints a few headline ratio/* keys; every key is still logged
        self.proximal_forwards = 0
        self._proximal = self._kept_mass = None
        precision_pass = args.async_objective == "decoupled" and args.old_logprob_mode != TRL_MODE
        if args.score_centering is not None and self.is_fsdp_enabled:
            check_centering_engine(args, "fsdp2")
        if (precision_pass or args.truncation_correction != "none") and self.is_fsdp_enabled:
            raise NotImplementedError(f"old_logprob_mode={args.old_logprob_mode!r} / truncation_correction="
                                      f"{args.truncation_correction!r} run a packed pass on an unsharded policy, and "
                                      "this one is FSDP2-sharded; use old_logprob_mode='bf16' and "
                                      "truncation_correction='none' (docs/async.md)")
        if precision_pass and MODES[args.old_logprob_mode].whole_model_dtype == "fp32" and \
                next(self.model.parameters()).dtype == torch.float32 and self.accelerator.mixed_precision == "no":
            warnings.warn(f"old_logprob_mode={args.old_logprob_mode!r} on an fp32 policy trained without autocast is "
                          "the policy's own pass (old_logprob_mode='bf16' gives the same numbers, bitwise the training "
                          "forward's)", stacklevel=2)
        if precision_pass:
            self._proximal = OldLogprobScorer(self.model, args.old_logprob_mode, layers=args.guided_fp32_layer_ids,
                                              policy_autocast=self.accelerator.autocast, copy_storage=args.copy_storage,
                                              head_operands=args.fp32_head_operands)
        self.sampling = None
        if args.truncation_correction == "lift_sampler":
            # the server's filter, re-applied to the proximal logits in vLLM's order (checks.check_async_config
            # refused a repetition penalty); bf16: the kept mass from a second no-grad pass of the policy
            self.sampling = SamplingSettings(temperature=args.temperature, top_k=int(args.top_k or 0),
                                             top_p=float(args.top_p if args.top_p is not None else 1.0),
                                             min_p=float(args.min_p or 0.0), engine="vllm")
            self._kept_mass = self._proximal or OldLogprobScorer(self.model, TRL_MODE,
                                                                 policy_autocast=self.accelerator.autocast)
        self._centering_filter = None  # score_centering: the server's filter re-applied to the forward's logits
        if args.score_centering is not None:
            settings = SamplingSettings(temperature=args.temperature, top_k=int(args.top_k or 0),
                                        top_p=float(args.top_p if args.top_p is not None else 1.0),
                                        min_p=float(args.min_p or 0.0), engine="vllm")
            self._centering_filter = settings if settings.truncated else None
        self._centering_sums = None  # (tv sum, centred terms, all terms) since the last log, on the device
        self.staleness_stats = None
        if args.ratio_diagnostics:
            # + 1: a sample TRL let through at max_staleness can be trained one sync later (the dispatcher's prefetch)
            self.staleness_stats = StalenessStats(args.max_staleness + 1, (args.ratio_band_low, args.ratio_band_high),
                                                  self.epsilon_low, self.epsilon_high, args.decoupled)
        if self.rollout_queue is not None:  # rank 0 holds the queue
            self.rollout_queue = VersionTaggingQueue(self.rollout_queue)
        self._syncs_seen = 0  # weight syncs, counted on every rank (TRL counts `model_version` on rank 0 only)
        self._untagged_terms = None  # decoupled_loglinear: loss terms without a policy version since the last log

    # -- versions: the staleness of every loss term -----------------------------------------------------------------

    def _sync_weight(self):
        super()._sync_weight()
        self._syncs_seen += 1
        if self.accelerator.num_processes > 1:  # rank 0's count (a resume restores it there): one small broadcast
            self._syncs_seen = broadcast_object_list([self.model_version], from_process=0)[0]

    @property
    def policy_version(self) -> int:
        """The version of the weights the loss is computed with: TRL's `model_version` (rank 0, where a resume restores
        it; the other ranks receive it at every sync)."""
        return self.model_version if self.accelerator.is_main_process else self._syncs_seen

    def staleness_of(self, versions: torch.Tensor) -> torch.Tensor:
        """Staleness k of each loss term at the loss: weight syncs between the sampling policy and the weights of this
        forward (-1 where no version was tagged). TRL's own count (`sample/staleness_*`, its drop rule) is taken when
        the sample leaves the queue; accelerate's dispatcher fetches the next micro-batch before yielding this one, so
        the first micro-batch of a step left the queue before the previous step's sync and TRL counts it one short."""
        return torch.where(versions >= 0, self.policy_version - versions, -1)

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderDispatcher wraps the DataLoader
        base.collate_fn = VersionCollator(base.collate_fn)
        return loader

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if "policy_version" not in self._signature_columns:
            self._signature_columns.append("policy_version")

    # -- the loss ---------------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        versions = inputs.pop("policy_version", None)  # (R, M_max) int64, TRL reads no such key
        selected = inputs["token_index"] >= 0  # (R, M_max): TRL's loss terms
        behaviour = inputs["old_log_probs"][selected]  # (M,) the sampler's log-probs
        advantages = inputs["advantages"][selected]  # (M,)
        terms_staleness = (self.staleness_of(versions[selected]) if versions is not None
                           else torch.full_like(advantages, -1, dtype=torch.long))
        # score_centering: the training forward runs through `_centred_forward` (the same values, the centred
        # gradient) and its outputs are replayed into TRL's compute_loss
        centred = None if self.args.score_centering is None else self._centred_forward(
            model, inputs["token_index"][selected], terms_staleness == 0)
        if not self.args.decoupled:
            if centred is not None:
                call = self._forward_call(model, inputs, run=centred)
                with contextlib.nullcontext([call.outputs]) as seen:
                    loss = super().compute_loss(_Replay(call.outputs), inputs, return_outputs, num_items_in_batch)
                self._step_forward_s += call.seconds
            else:
                with _forward_outputs(model) as seen:
                    loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            new = seen[-1].log_probs.flatten()[inputs["token_index"][selected]]  # (M,)
            self._observe(terms_staleness, new, behaviour, behaviour, advantages, torch.ones_like(advantages))
            return loss
        if self.args.async_objective == "decoupled" and self._proximal is not None:  # a precision mode's pass
            call = self._forward_call(model, inputs, run=centred)
            prox, log_mass = self._proximal_logprobs(model, call.kwargs, inputs["token_index"][selected])  # (M,) x 2
            behaviour = behaviour if log_mass is None else behaviour + log_mass  # lift_sampler: on the full support
            outputs, seconds = call.outputs, call.seconds
        else:  # the training forward first (the probe runs it), its outputs replayed below: one forward
            call = self._forward_call(model, inputs, run=centred or model)
            outputs, seconds = call.outputs, call.seconds
            new = outputs.log_probs.flatten()[inputs["token_index"][selected]]  # (M,)
            if self.args.async_objective == "decoupled":  # bf16: the proximal policy is the training forward's
                prox = new.detach().float()  # AReaL's prox_logp_method="reuse_train_logp" (PR #1453)
                log_mass = self._kept_mass_of(call.kwargs, inputs["token_index"][selected])
                behaviour = behaviour if log_mass is None else behaviour + log_mass
            else:  # decoupled_loglinear
                prox = loglinear_proximal(behaviour, new, terms_staleness)
                untagged = (terms_staleness < 0).sum()  # on the device: refused at log time (`log`), no sync here
                self._untagged_terms = untagged if self._untagged_terms is None else self._untagged_terms + untagged
        segment_id = inputs["segment_id"][selected]  # (M,)
        weights, _ = proximal_weights(prox, behaviour, segment_id, self.is_correction, advantages)  # (M,)
        old, adv = decoupled_inputs(inputs["old_log_probs"], inputs["advantages"], selected, prox, weights)
        rewritten = {**inputs, "old_log_probs": old, "advantages": adv}
        runner = model if outputs is None else _Replay(outputs)
        with _forward_outputs(model) if outputs is None else contextlib.nullcontext([outputs]) as seen:
            loss = super().compute_loss(runner, rewritten, return_outputs, num_items_in_batch)
        self._step_forward_s += seconds  # TRL timed the replay (no forward); the probe timed the real one
        new = seen[-1].log_probs.flatten()[inputs["token_index"][selected]]  # (M,)
        self._observe(terms_staleness, new, behaviour, prox, advantages, weights)
        return loss

    def _centred_forward(self, model, positions: torch.Tensor, fresh: torch.Tensor):
        """`score_centering`: a stand-in for the model that runs its forward and returns its outputs with
        `log_probs` (1, L) centred at the loss terms of staleness 0 (`fresh` (M,) bool, at the flat `positions` (M,)
        of TRL's `token_index`): the same values, the gradient minus the sampler-expected score, c_t computed from the
        forward's last hidden states through the LM head (`corrections.centering.centering_terms`, K cells at a time:
        no (L, V) tensor), q recomputed from the same logits with the server's filter. Counts on the device."""
        unwrapped = self.accelerator.unwrap_model(model)

        def run(**kwargs):
            with capture_last_hidden(unwrapped) as hidden:
                outputs = model(**kwargs)
            log_probs = outputs.log_probs  # (1, L)
            rows = positions[fresh]  # (m,) flat positions of the centred terms
            h = hidden[-1].reshape(-1, hidden[-1].shape[-1])[rows][None]  # (1, m, H)
            stats: list = []
            term = centering_terms(head_logits(unwrapped, h, False, self.accelerator.autocast),
                                   torch.ones(1, rows.numel(), dtype=torch.bool, device=h.device), self.temperature,
                                   kept=self._centering_filter, stats=stats)  # (1, m)
            full = torch.zeros(log_probs.numel(), dtype=term.dtype, device=term.device).index_put((rows,), term[0])
            outputs.log_probs = center_logps(log_probs, full.reshape(log_probs.shape).to(log_probs.dtype))
            tv = torch.stack(stats).sum(0)[0] if stats else term.new_zeros(())
            sums = torch.stack([tv, fresh.sum().to(tv.dtype), torch.tensor(float(fresh.numel()), device=tv.device)])
            self._centering_sums = sums if self._centering_sums is None else self._centering_sums + sums
            return outputs

        return run

    def _forward_call(self, model, inputs, run=None) -> _ForwardCall:
        """The arguments TRL's `compute_loss` passes to the model for this micro-batch (and, with `run`, the outputs
        of running them): TRL builds them, the probe stops the call there."""
        try:
            super().compute_loss(_Probe(run), inputs)
        except _ForwardCall as call:
            return call
        raise RuntimeError("grpo_ratio: TRL's AsyncGRPOTrainer.compute_loss did not call the model")

    @torch.no_grad()
    def _proximal_logprobs(self, model, kwargs: dict, positions: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(M,) fp32 proximal log-probs of the trained tokens by the precision mode's pass (`old_logprob_mode` other
        than `"bf16"`; `"bf16"` reuses the training forward's, `compute_loss`), and, with
        `truncation_correction="lift_sampler"`, the (M,) log kept mass of each token under the proximal logits (else
        None)."""
        self.proximal_forwards += 1
        targets = kwargs["shift_labels"].flatten()[positions]  # (M,)
        scored = dict(temperature=self.temperature, version=self.weights_version.value)
        if self._kept_mass is None:
            return self._proximal.score_packed(kwargs, positions, targets, **scored), None
        return self._proximal.score_packed(kwargs, positions, targets, kept=self.sampling, **scored)

    @torch.no_grad()
    def _kept_mass_of(self, kwargs: dict, positions: torch.Tensor) -> torch.Tensor | None:
        """With `truncation_correction="lift_sampler"` and the bf16 proximal policy, the (M,) fp32 log kept mass of
        each trained token under the policy's logits: one no-grad pass of the policy (TRL's fused head returns the
        training forward's log-probs, not the logits the server's filter needs); None without the lift (no pass)."""
        if self._kept_mass is None:
            return None
        self.proximal_forwards += 1
        targets = kwargs["shift_labels"].flatten()[positions]  # (M,)
        return self._kept_mass.score_packed(kwargs, positions, targets, kept=self.sampling,
                                            temperature=self.temperature, version=self.weights_version.value)[1]

    # -- diagnostics ------------------------------------------------------------------------------------------------

    def _observe(self, staleness, new, behaviour, prox, advantages, weights) -> None:
        if self.staleness_stats is not None:
            self.staleness_stats.update(staleness, new, behaviour, prox, advantages, weights)

    def _check_untagged_terms(self) -> None:
        """Refuse loss terms that carried no policy version (`loglinear_alpha` gave them alpha 0 on an accelerator):
        the count, summed over processes, read once per log (every process raises alike).

        Raises:
            ValueError: some term had no staleness.
        """
        count, self._untagged_terms = self._untagged_terms, None
        if count is None:
            return
        if self.accelerator.num_processes > 1:
            count = self.accelerator.reduce(count.to(self.accelerator.device), reduction="sum")
        if int(count):
            raise ValueError(f"async_objective='decoupled_loglinear': {int(count)} loss terms had no staleness (no "
                             "policy version from the rollout queue); every consumed sample must carry its version")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self._check_untagged_terms()
        if self.staleness_stats is not None and self.model.training:
            logs = {**logs, **self.staleness_stats.flush(self.accelerator)}
        if self._centering_sums is not None and self.model.training:
            sums, self._centering_sums = self._centering_sums, None
            if self.accelerator.num_processes > 1:
                sums = self.accelerator.reduce(sums, reduction="sum")
            tv, centred, total = sums.tolist()  # one read per log
            logs = {**logs, CENTERING_FRESH_FRAC: centred / max(total, 1.0)}
            if centred > 0:
                logs[CENTERING_DRIFT_TV] = tv / centred
        super().log(logs, start_time)
