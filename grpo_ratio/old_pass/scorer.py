"""Old-logprob scoring modes: the numbers the importance ratio is anchored to.

Shapes: B = sequences, P = prompt tokens, T = completion tokens, V = vocabulary, L = decoder layers.

Every mode scores the completion tokens of `input_ids` (B, P+T) teacher-forced, where TRL does
(`_get_per_token_logps_and_entropies`): rows chunked by `batch_size` in order, the same padding,
`log_softmax(logits / temperature)` of the next-token logits, gathered at the completion ids. Two deliberate
differences from TRL's own pass: in every mode but `bf16` (which reproduces that pass) the forward runs in eval mode
(no dropout): the old log-probs are a function of the weights and tokens only; and in every mode but `bf16` and
`fp32_head` positions are counted from the attention mask as `generate` counts them (TRL passes none, so with absolute
position embeddings its log-probs move with the left padding). `fp32_head` keeps TRL's layout (no position ids) so
that its body is TRL's training forward bit for bit: inside the trainer its old log-probs are then the fp32 norm and
head applied to the training forward's own hidden states, with no pass of the body at all (`grpo_ratio.old_pass.fused_head`).
The modes differ only in the precision of the forward pass (the batch-logprob-gap report, tables T7/T10):

| mode          | forward                                                                  | log-softmax |
|---------------|--------------------------------------------------------------------------|-------------|
| `bf16`        | the policy as it trains (its weights, under the trainer's autocast)     | fp32        |
| `fp32_clone`  | all in fp32, no autocast (the policy's own weights when stored in fp32) | fp32        |
| `fp16_clone`  | an fp16 copy, no autocast; rows with non-finite logits re-scored in fp32 | fp32        |
| `fp32_head`   | as `bf16` up to the final norm (TRL's positions); final norm, LM head fp32 | fp32        |
| `guided_fp32` | as `fp32_head`, plus the chosen decoder layers in fp32                   | fp32        |

`fp32_head` with `head_operands="bf16"` (`fp32_head_operands`) keeps the final norm as the policy trains and
multiplies its output and the head weight, both rounded to bf16, with fp32 accumulation and output: the CUDA fp32 head
of vLLM (`head_dtype="float32"`), SGLang and prime-rl (`forward.mm_fp32_out`).

Inside RatioGRPOTrainer the `bf16` mode is never run by this module: TRL's own pass is used, bit for bit.

Memory: no mode builds (B, T, V) logits, as TRL 1.16 builds none. The forward's LM head runs on no position; its input
and the linear map it applies (the mode's: an fp32 runner's, a copy's) are recorded (`forward.head_inputs`) and the
log-probs computed from them in tiles by TRL's own `ChunkedLogProbFunction` (the temperature applied as TRL applies
it, z * (1 / temperature)); the kept-set log-probs and the full-vocabulary divergences read the same logits K tokens
at a time (`corrections.kept_logprobs.HeadLogits`). The fp16 fallback re-scores its rows the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ..corrections.kept_logprobs import HeadLogits, KeptLogprobs, concat_kept_logprobs, logprobs_on_kept_sets
from ..corrections.kept_sets import KeptSets, SamplingSettings
from ..corrections.processors import RepetitionPenalty
from ..diagnostics.mismatch import full_vocab_divergence
from ..modes import DEFAULT_HEAD_OPERANDS, HEAD_OPERANDS, MODES, PRECISION_MODES, SAMPLER_HEAD_OPERANDS
from .copies import COPY_STORAGES, ModuleCopy, PerLayerCast
from .forward import (
    HeadInput,
    RunSettings,
    capture_head,
    check_layer_indices,
    completion_logprobs_from_logits,  # noqa: F401 (re-exported: the full-logits reference of the tests)
    eval_mode,
    forward_kwargs,
    fp32_forward,
    head_arithmetic,
    head_inputs,
    ieee_fp32,
    join_head_inputs,
    model_anatomy,
    packed_head_input,
    patched_forward,
    plain_forward,
    rope_fp32_forward,
)
from .sharding.base import ShardedPolicy
from .tree_attention import fp32_tree_attention


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------------------------------
# the scorer


@dataclass
class ScoreResult:
    """What `OldLogprobScorer.score` returns.

    Fields:
        logps (`torch.Tensor`, (B, T) fp32): full-vocabulary log-probs of the completion tokens.
        fallback_rows (`int`): `fp16_clone` rows with non-finite fp16 log-probs, re-scored in fp32 in this call (0
            otherwise).
        on_kept (`KeptLogprobs | None`): only when kept sets were given: the same tokens' (B, T) log-probs over their
            kept sets (0.0 on cells without a set), the sets used (recomputed ones under `SamplingSettings`), the
            recomputed additions, and log M = `logps` - those log-probs.
        full_vocab (`tuple | None`): only with `compare_policy=True`: (KL(old||policy), KL(policy||old), TV), each
            (B, T) fp32, the exact full-vocabulary divergences between this mode's next-token distribution and the
            policy's own at its training precision (`mismatch.full_vocab_divergence`).
    """

    logps: torch.Tensor
    fallback_rows: int = 0
    on_kept: KeptLogprobs | None = None
    full_vocab: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def check_scorer_setup(model: nn.Module, mode: str, layers: Iterable[int] | None, copy_storage: str = "resident",
                       sharded: ShardedPolicy | None = None, head_operands: str = DEFAULT_HEAD_OPERANDS) -> list[int]:
    """What an `OldLogprobScorer(model, mode, ...)` needs, checked without building it (the trainer checks it at start-up,
    `grpo_ratio.checks.check_old_pass`; the constructor runs the same). Returns the sorted decoder-layer indices.

    Raises:
        ValueError: `mode` is not a precision mode; `guided_fp32` without layers or layers with another mode; a layer
            index out of range or a model whose anatomy (decoder layers, final norm, LM head) is not found; an unknown
            `copy_storage`; `head_operands` not in `HEAD_OPERANDS`, or `"bf16"` with a mode other than `fp32_head`.
        NotImplementedError: `"per_layer"` on a sharded policy (its copies are the engine's shadows).
    """
    if mode not in PRECISION_MODES:
        raise ValueError(f"old_logprob_mode={mode!r} is not a precision mode (a forward pass); allowed: "
                         f"{', '.join(PRECISION_MODES)}")
    layers = list(layers) if layers is not None else []
    spec = MODES[mode]
    if spec.fp32_layers and not layers:
        raise ValueError("old_logprob_mode='guided_fp32' needs guided_fp32_layers (use 'fp32_head' for none)")
    if not spec.fp32_layers and layers:
        raise ValueError(f"guided_fp32_layers is only used by 'guided_fp32', not by {mode!r}")
    if copy_storage not in COPY_STORAGES:
        raise ValueError(f"copy_storage={copy_storage!r} is not allowed; allowed: {', '.join(COPY_STORAGES)}")
    if head_operands not in HEAD_OPERANDS:
        raise ValueError(f"fp32_head_operands={head_operands!r} is not allowed; allowed: {', '.join(HEAD_OPERANDS)}")
    if head_operands != DEFAULT_HEAD_OPERANDS and not spec.takes_head_operands:
        raise ValueError(f"fp32_head_operands={head_operands!r} applies to old_logprob_mode='fp32_head' only, not "
                         f"{mode!r}")
    if copy_storage == "per_layer" and sharded is not None:
        raise NotImplementedError("copy_storage='per_layer' is not supported on FSDP2/ZeRO-3 (the copies are the "
                                  "engine's sharded shadows); use copy_storage='resident'")
    if spec.runs_fp32_modules:
        layers = check_layer_indices(layers, len(model_anatomy(model).layers))
    return layers


class OldLogprobScorer:
    """Computes old log-probs of completions with one scoring mode, holding whatever copies the mode needs.

    Args:
        model: the policy (a transformers causal LM, optionally PEFT-wrapped). Never modified.
        mode: one of `PRECISION_MODES` (`bf16`, `fp32_clone`, `fp16_clone`, `fp32_head`, `guided_fp32`).
        layers: decoder-layer indices for `guided_fp32` (required there, refused elsewhere).
        policy_autocast: zero-argument callable returning the context the policy trains under (the trainer passes
            `accelerator.autocast`); by default bf16 autocast when the weights are fp32, else no autocast.
        sharded: a `grpo_ratio.old_pass.sharding.engines.ShardedPolicy` when `model` is FSDP2- or ZeRO-3-sharded (built after
            accelerate wrapped it): then the compute dtype is the engine's, forwards go through the sharded root,
            copies are sharded shadows (`FSDPShadow`, `ZeroShadow`) and the fp16 fallback is collective.
        copy_storage: how a whole-model copy (`fp16_clone`; `fp32_clone` on bf16/fp16 weights) is held: `"resident"`
            (a `ModuleCopy`, refreshed after each optimizer step) or `"per_layer"` (a `PerLayerCast`: each module's
            weights cast just before it runs, nothing kept). Both give bitwise equal log-probs.
        route_hooks: a `grpo_ratio.routing.RouteHooks` on an MoE policy: every copy this scorer runs (a whole-model
            copy or shadow, an fp32 decoder layer) is attached to it, so a replay session reaches the copy's routers
            (R3 under `fp32_clone` replays the sampler's routes), and the fp16 fallback re-scores its rows with their
            own routes.
        head_operands: `fp32_head` only (`fp32_head_operands`): `"fp32"` (the final norm and both head operands in
            fp32) or `"bf16"` (the final norm as the policy trains, its output and the head weight rounded to bf16,
            fp32 accumulation and output: vLLM's `head_dtype=float32` on CUDA, PR #48390; SGLang #32370; prime-rl
            #2441; `forward.mm_fp32_out`). `"bf16"` runs no fp32 module and copies nothing.

    Copies are built lazily, only when the policy's weights are not already in the dtype a mode needs:
    `fp32_clone` on fp32 weights and `fp32_head`/`guided_fp32` on fp32 weights use no copy at all (they run the
    policy's own weights outside autocast); on bf16 weights they copy only the modules they upcast (or, for
    `fp32_clone`, the whole model). `fp16_clone` uses an fp16 copy unless the weights are fp16; its fp32 re-run of
    overflowing rows uses the policy's own weights when they are fp32, else per-layer fp32 casts (`PerLayerCast`:
    no fp32 copy is kept), or, with PEFT adapters, a resident fp32 copy kept beside the fp16 one (one copy per dtype).

    Raises:
        ValueError: unknown mode, guided_fp32 without layers, layers with another mode, a layer index out of range,
            an unknown `copy_storage`, a `head_operands` not allowed (`check_scorer_setup`).
        NotImplementedError: `"per_layer"` on a sharded policy (its copies are the engine's shadows).
    """

    def __init__(self, model: nn.Module, mode: str, layers: Iterable[int] | None = None,
                 policy_autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                 sharded: ShardedPolicy | None = None, copy_storage: str = "resident", route_hooks=None,
                 head_operands: str = DEFAULT_HEAD_OPERANDS):
        layers = check_scorer_setup(model, mode, layers, copy_storage, sharded, head_operands)
        spec = self.spec = MODES[mode]
        self.head_operands = head_operands
        self.sampler_head = head_operands == SAMPLER_HEAD_OPERANDS
        self.model = model
        self.mode = mode
        self.sharded = sharded
        self.copy_storage = copy_storage
        self._per_layer: dict[torch.dtype, PerLayerCast] = {}
        if copy_storage == "per_layer" and spec.may_copy_whole_model:
            self.per_layer_cast(_DTYPES[spec.whole_model_dtype])
        self.weight_dtype = next(model.parameters()).dtype if sharded is None else sharded.storage_dtype
        # dtype of the hidden states between layers: the weights' unsharded (fp32 weights stay fp32 under autocast),
        # the engine's compute dtype sharded (an FSDP bf16 policy hands bf16 weights to fp32-stored parameters)
        self.hidden_dtype = self.weight_dtype if sharded is None else sharded.compute_dtype
        self.device_type = next(model.parameters()).device.type
        self.policy_autocast = policy_autocast or self._default_policy_autocast
        self.upcast: list[nn.Module] = []
        self.layers: list[int] = []
        if spec.runs_fp32_modules:
            self._anatomy = model_anatomy(model)
            self.layers = layers
        self._copies: dict[tuple[int, torch.dtype], ModuleCopy] = {}  # (id(source module), dtype) -> copy
        self.route_hooks = route_hooks
        self._chunk_start = 0  # first row of the chunk being scored (the fp16 fallback's rows are the chunk's)
        self._run_settings = RunSettings(None, [])  # the run's own matmul/attention settings, inside `score`

    # -- contexts --------------------------------------------------------------------------------------------------

    def _default_policy_autocast(self):
        if self.weight_dtype == torch.float32:
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _no_autocast(self):
        return torch.autocast(self.device_type, enabled=False)

    def per_layer_cast(self, dtype: torch.dtype) -> PerLayerCast:
        """The `PerLayerCast` of the policy to `dtype` (`copy_storage="per_layer"`), built on first use."""
        if dtype not in self._per_layer:
            self._per_layer[dtype] = PerLayerCast(self.model, dtype)
        return self._per_layer[dtype]

    def _copy_of(self, module: nn.Module, dtype: torch.dtype, version: int, whole_model: bool = False) -> nn.Module:
        key = (id(module), dtype)  # one copy per dtype: a copy of another dtype never replaces it
        if key not in self._copies:
            self._copies[key] = ModuleCopy(module, dtype, whole_model=whole_model)
        copy = self._copies[key].get(version)
        self._attach_routes(copy, None if whole_model else module)
        return copy

    def _attach_routes(self, runner: nn.Module, source: nn.Module | None) -> None:
        """Let a replay session reach the routers of what runs in place of the policy: a whole-model copy
        (`source` None) or what runs decoder layer `source` (a copy, or a ZeRO-3 fp32 runner's skeleton)."""
        if self.route_hooks is None or runner is self.model or runner is source:
            return
        target = runner.__dict__.get("skeleton", runner)  # sharding_zero3.MasterFP32Runner runs its skeleton
        if source is None:
            self.route_hooks.attach(target)
            return
        layers = model_anatomy(self.model).layers
        index = next((i for i, layer in enumerate(layers) if layer is source), None)
        if index is not None:  # the final norm and the head hold no router
            self.route_hooks.attach(target, layer=index)

    def copies(self) -> list[ModuleCopy]:
        """The copies built so far (empty when the mode runs on the policy's own weights); sharded: the shadows,
        whose `num_bytes()` is what this rank keeps."""
        return list(self._copies.values()) + (self.sharded.copies() if self.sharded is not None else [])

    def extra_bytes(self) -> int:
        """Memory held by this scorer's copies on this rank, in bytes (0 when the mode needs no copy)."""
        return sum(c.num_bytes() for c in self.copies())

    def _forward(self, model: nn.Module, input_ids, attention_mask, logits_to_keep: int,
                 positions: bool | None = None) -> HeadInput:
        """`model`'s forward up to its LM head: the head's input at the last T + 1 positions and the map it applies
        (`HeadInput`); the head itself runs on no position, so no (b, T + 1, V) logits are built. Sharded, the
        engine's gathered head weights are cloned for use after the forward."""
        # `bf16` is TRL's own pass and `fp32_head` its body (no position ids); the others count them as generate does
        positions = not self.spec.trl_layout if positions is None else positions
        with head_inputs(model, persist=self.sharded is not None) as seen:
            if self.sharded is None:
                plain_forward(model, input_ids, attention_mask, logits_to_keep, positions)
            else:
                self.sharded.forward(model, **forward_kwargs(model, input_ids, attention_mask, logits_to_keep,
                                                             positions))
        return join_head_inputs(seen, logits_to_keep + 1)  # hidden (b, T + 1, H)

    # -- one chunk per mode ------------------------------------------------------------------------------------------

    def _head_full(self, dtype: torch.dtype, run: Callable[[nn.Module], HeadInput], version,
                   fallback: bool = False) -> HeadInput:
        """Whole forward in `dtype` outside autocast: the policy itself when its weights are already `dtype`. `run`
        runs one forward of the module it is given up to the LM head (`_forward`, `packed_head_input`). `fallback`:
        the fp16 fallback's fp32 re-run of a few rows, which keeps no whole-model copy (a per-layer cast of the policy,
        PEFT adapters merged layer by layer: bitwise the resident copy's numbers)."""
        if self.sharded is not None:
            with self.sharded.whole_model(dtype, version) as model, self._no_autocast():
                self._attach_routes(model, None)
                return run(model)
        if self.weight_dtype == dtype:
            model, casts = self.model, contextlib.nullcontext(self.model)
        elif self.copy_storage == "per_layer" or fallback:
            model, casts = self.model, self.per_layer_cast(dtype).active()
        else:
            model, casts = self._copy_of(self.model, dtype, version, True), contextlib.nullcontext()
        with casts, self._no_autocast():
            return run(model)

    def _head_policy(self, run: Callable[[nn.Module], HeadInput]) -> HeadInput:
        with self.policy_autocast():
            return run(self.model)

    def _fp32_runner(self, module: nn.Module, version: int, feeds_fp32: bool):
        """(runner, output dtype) running `module` in fp32: the module itself where its fp32 weights are at hand."""
        if self.sharded is not None:
            out_dtype = None if feeds_fp32 or self.hidden_dtype == torch.float32 else self.hidden_dtype
            runner = self.sharded.fp32_runner(module)
            self._attach_routes(runner, module)
            return runner, out_dtype
        if self.weight_dtype == torch.float32:
            return module, None  # fp32 weights: just leave autocast; no copy, no cast back
        return self._copy_of(module, torch.float32, version), None if feeds_fp32 else self.weight_dtype

    def _head_upcast(self, run: Callable[[nn.Module], HeadInput], version) -> HeadInput:
        """The policy's forward with `self.layers`, the final norm and the head in fp32 (fp32_head, guided_fp32)."""
        a = self._anatomy
        chain = [a.layers[i] for i in self.layers] + [a.norm, a.head]
        consumers_fp32 = {id(a.layers[i]) for i in self.layers if i + 1 in self.layers}
        consumers_fp32 |= {id(a.layers[-1])} if (len(a.layers) - 1) in self.layers else set()
        consumers_fp32 |= {id(a.norm), id(a.head)}  # norm feeds the fp32 head; head output is the fp32 logits
        rope_cache: dict = {}
        with contextlib.ExitStack() as stack:
            if self.sharded is not None:
                stack.enter_context(self.sharded.fp32_modules(chain))
            for module in chain:
                runner, out_dtype = self._fp32_runner(module, version, id(module) in consumers_fp32)
                forward = fp32_forward(runner, out_dtype, rope_cache, self.device_type)
                stack.enter_context(patched_forward(module, forward))
            if self.layers and a.rotary is not None and self.hidden_dtype != torch.float32:
                stack.enter_context(patched_forward(a.rotary, rope_fp32_forward(a.rotary, rope_cache)))
            return self._head_policy(run)

    @torch.no_grad()
    def head_logprobs(self, hidden: torch.Tensor, completion_ids: torch.Tensor, temperature: float = 1.0,
                      version: int = 0) -> torch.Tensor:
        """`fp32_head` from the body's own output: the final norm and the LM head in fp32 (with `head_operands="bf16"`:
        the norm as the policy trains and the sampler's head, `_head_sampler`) applied to `hidden`, the input
        of the final norm in some forward (the trainer's training forward), exactly as the separate pass applies them
        (same runners, same casts, same T + 1 positions, the same tiles: no (b, T + 1, V) logits). Equal to
        `score(...)` bitwise when `hidden` is what the separate pass's body computes (TRL's layout, no dropout):
        checked on CPU; on CUDA the training forward (with grad) and the no-grad separate pass may pick different
        attention and matmul kernels for the body, so there the two are close, not shown equal. The norm and head run
        in IEEE fp32 (`ieee_fp32`) whatever TF32 setting the run has, as in the separate pass.

        Args:
            hidden: (b, P+T, H) input of the final norm, any float dtype (detached here).
            completion_ids: (b, T) int64, the last T tokens of the rows.
            temperature: TRL's `temperature`.
            version: the policy's `WeightsVersion` value (bf16-stored weights: the fp32 norm/head copies' sync).
        Returns:
            (b, T) fp32 log-probs.
        Raises:
            ValueError: the mode is not `fp32_head`, or the policy is sharded (the fp32 modules are gathered under the
                engine's scoring context, which only the separate pass enters).
        """
        if not self.spec.runs_fp32_modules or self.spec.fp32_layers or self.sharded is not None:
            raise ValueError(f"head_logprobs is the unsharded fp32_head mode's, not {self.mode!r}"
                             f"{' (sharded)' if self.sharded is not None else ''}")
        a, T = self._anatomy, completion_ids.size(1)
        if self.sampler_head:  # the final norm as the policy trains (its instance forward: no hook), the sampler's head
            with ieee_fp32(), self.policy_autocast():
                normed = a.norm.forward(hidden.detach())  # (b, P+T, H) in the training precision
                x, projection = capture_head(self.model, a.head.forward, normed[:, -(T + 1):])  # (b, T + 1, H)
            return HeadInput(x, projection.with_sampler_operands()).logprobs(completion_ids, temperature)  # (b, T)
        # IEEE fp32 as in the separate pass (`score`): the run's `tf32=True`, or `torch_compile=True` with bf16, set
        # TF32 for the whole process, which the fused path runs inside (the training step)
        with ieee_fp32():
            norm, head = (fp32_forward(self._fp32_runner(m, version, True)[0], None, None, self.device_type)
                          for m in (a.norm, a.head))
            normed = norm(hidden.detach())  # (b, P+T, H) fp32
            # the causal LM's `logits_to_keep` slice, through the head as `head_inputs` records it in the separate pass
            x, projection = capture_head(self.model, head, normed[:, -(T + 1):])  # (b, T + 1, H)
            return HeadInput(x, projection).logprobs(completion_ids, temperature)  # (b, T)

    def _head_as_trained(self, input_ids, attention_mask, logits_to_keep) -> HeadInput:
        """The policy's head input and map as its training forward computes them: training autocast, TRL's inputs
        (no position ids)."""
        with self.policy_autocast():
            return self._forward(self.model, input_ids, attention_mask, logits_to_keep, positions=False)

    def _head_of_mode(self, run: Callable[[nn.Module], HeadInput], version: int) -> HeadInput:
        """The head input of one forward (`run`) under this scorer's mode."""
        if self.spec.trl_pass:
            return self._head_policy(run)
        if self.spec.whole_model_dtype is not None:
            return self._head_full(_DTYPES[self.spec.whole_model_dtype], run, version)
        if self.sampler_head:
            return self._head_sampler(run)
        return self._head_upcast(run, version)

    def _head_sampler(self, run: Callable[[nn.Module], HeadInput]) -> HeadInput:
        """`fp32_head_operands="bf16"`: the policy's forward as it trains (body and final norm under its autocast),
        its head computed as the sampler's fp32 head: the norm's output and the weight rounded to bf16, fp32
        accumulation and output (`HeadProjection.with_sampler_operands`)."""
        head = self._head_policy(run)
        return HeadInput(head.hidden, head.projection.with_sampler_operands())

    def _chunk_logprobs(self, input_ids, attention_mask, logits_to_keep, temperature, version, kept=None,
                        penalty=None, compare_policy=False):
        """(b, T) fp32 log-probs of one chunk and the number of its rows re-scored in fp32; with `kept` (KeptSets
        of the chunk's rows, or the sampler's SamplingSettings to recompute them from these logits), also the
        `KeptLogprobs`; with `compare_policy`, also the full-vocabulary divergences to the policy's own logits."""
        logps, n_fallback, logits = self._chunk_full(input_ids, attention_mask, logits_to_keep, temperature, version)
        full = None
        if compare_policy:  # both (b, T, V) distributions, `chunk_tokens` tokens at a time: neither is built whole
            # the policy as it trains: the run's matmul precision (TF32 if set) and attention kernel, not the IEEE
            # fp32 / sdpa this mode's pass runs under, for its forward and its head projection (computed lazily)
            with self._run_settings.as_run():
                policy = self._head_as_trained(input_ids, attention_mask, logits_to_keep).logits()  # (b, T, V)
            policy = HeadLogits(policy.hidden, self._run_settings.wrap(policy.project), policy.shape[2], policy.params)
            full = full_vocab_divergence(policy, logits, temperature=temperature)
        if kept is None:
            return logps, n_fallback, None, full
        completion = attention_mask[:, -logits_to_keep:].bool()  # (b, T)
        on_kept = logprobs_on_kept_sets(logits, input_ids[:, -logits_to_keep:], kept, temperature, completion,
                                        penalty)
        return logps, n_fallback, on_kept, full

    def _chunk_full(self, input_ids, attention_mask, logits_to_keep, temperature, version
                    ) -> tuple[torch.Tensor, int, HeadLogits]:
        """(b, T) fp32 log-probs of one chunk, how many of its rows were re-scored in fp32, and its (b, T, V) logits
        as `HeadLogits` (computed K cells at a time where the kept sets or the divergences read them)."""
        completion_ids = input_ids[:, -logits_to_keep:]  # (b, T)
        head = self._head_of_mode(lambda model: self._forward(model, input_ids, attention_mask, logits_to_keep),
                                  version)
        logps = head.logprobs(completion_ids, temperature)  # (b, T)
        logits = head.logits()  # (b, T, V), nothing computed yet
        if not self.spec.overflows:
            return logps, 0, logits
        # fp16 overflow (activations past 65,504) must never reach the ratio: re-score such rows in fp32
        scored = attention_mask[:, -logits_to_keep:].bool()  # (b, T)
        bad = (~torch.isfinite(logps) & scored).any(dim=1)  # (b,)
        n_bad = int(bad.sum())
        # sharded, every rank must run the same forwards: all re-score when any has a bad row (a rank-local fallback
        # deadlocks); a rank without one re-scores its first row and drops the result
        if (n_bad if self.sharded is None else self.sharded.sum_over_ranks(n_bad)) == 0:
            return logps, 0, logits
        rows = bad.nonzero().squeeze(1) if n_bad else torch.zeros(1, dtype=torch.long, device=bad.device)
        with self._route_rows(rows):  # a replay session serves these rows their own routes
            head32 = self._head_full(torch.float32, lambda model: self._forward(
                model, input_ids[rows], attention_mask[rows], logits_to_keep), version, fallback=True)
        if n_bad:
            logps[rows] = head32.logprobs(completion_ids[rows], temperature)
            logits = logits.with_rows(rows, head32.logits())  # the kept sets and divergences read these rows' too
        return logps, n_bad, logits

    def _route_rows(self, rows: torch.Tensor):
        """Within the block, a replay session's forward takes the chunk's rows `rows` (indices into the whole batch
        this `score` call scores)."""
        if self.route_hooks is None:
            return contextlib.nullcontext()
        return self.route_hooks.serving_rows(rows + self._chunk_start)

    # -- public ------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, *,
              temperature: float = 1.0, batch_size: int | None = None, version: int = 0,
              kept: KeptSets | SamplingSettings | None = None, penalty: RepetitionPenalty | None = None,
              compare_policy: bool = False) -> ScoreResult:
        """Old log-probs of the last `logits_to_keep` tokens of each row.

        Args:
            input_ids: (B, P+T) int64, prompts left-padded and completions right-padded (as TRL builds them).
            attention_mask: (B, P+T) 0/1.
            logits_to_keep: T, the number of completion positions.
            temperature: divides the logits before the log-softmax (TRL's `temperature`).
            batch_size: rows per forward chunk (TRL uses `per_device_train_batch_size`); None = all rows at once.
            version: the policy's optimizer-step count; copies synced at another version are refreshed first.
            kept: optional `grpo_ratio.corrections.kept_sets.KeptSets` (B, T) of the sampler's kept sets, or the sampler's
                `SamplingSettings` to recompute them from this pass's logits; then the result also holds the (B, T) log-probs
                renormalised over them (truncation correction) and the sets used.
            penalty: with `kept`, the sampler's repetition penalty over the same rows (`grpo_ratio.corrections.processors`),
                re-applied before temperature and the kept set.
            compare_policy: also run the policy's own forward on each chunk (training autocast, the run's own matmul
                precision and attention kernel, as the training forward computes; eval mode: no dropout) and return the
                exact
                full-vocabulary divergences between the two distributions (`ScoreResult.full_vocab`; one more
                forward per chunk).
        Returns:
            `ScoreResult`: (B, T) fp32 full-vocabulary log-probs (values at padded positions are whatever the forward
            gives), the rows re-scored in fp32, and the kept-set log-probs (`KeptLogprobs`) when `kept` is given.
        """
        batch_size = batch_size or input_ids.size(0)
        chunks, kept_chunks, full_chunks, fallback = [], [], [], 0
        sharding = contextlib.nullcontext() if self.sharded is None else self.sharded.scoring()
        deterministic = eval_mode(self.model) if not self.spec.trl_pass else contextlib.nullcontext()  # bf16: TRL's pass
        with deterministic, sharding, ieee_fp32(not self.spec.trl_pass, None if self.spec.trl_layout else self.model
                                                ) as self._run_settings:
            for start in range(0, input_ids.size(0), batch_size):
                sl = slice(start, start + batch_size)
                self._chunk_start = start
                rows = kept if not isinstance(kept, KeptSets) else kept.select_rows(
                    range(sl.start, min(sl.stop, input_ids.size(0))))
                logps, n, kept_logps, full = self._chunk_logprobs(input_ids[sl], attention_mask[sl], logits_to_keep,
                                                                  temperature, version, rows,
                                                                  None if penalty is None else penalty.rows(sl),
                                                                  compare_policy)
                chunks.append(logps)
                full_chunks.append(full)
                kept_chunks.append(kept_logps)
                fallback += n
        logps = torch.cat(chunks, dim=0)  # (B, T)
        full = tuple(torch.cat(parts, dim=0) for parts in zip(*full_chunks)) if compare_policy else None  # (B, T) x 3
        if kept is None:
            return ScoreResult(logps=logps, fallback_rows=fallback, full_vocab=full)
        on_kept = concat_kept_logprobs(kept_chunks)  # (B, T)
        on_kept.log_mass = logps - on_kept.logps  # log M = log p_full(g) - log p_S(g)
        return ScoreResult(logps=logps, fallback_rows=fallback, on_kept=on_kept, full_vocab=full)


    @torch.no_grad()
    def score_packed(self, forward_kwargs: dict, positions: torch.Tensor, targets: torch.Tensor, *,
                     temperature: float = 1.0, version: int = 0, kept: SamplingSettings | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs of the trained tokens of one packed row (TRL `AsyncGRPOTrainer`: the proximal pass of
        `async_objective="decoupled"`), under this scorer's mode.

        Args:
            forward_kwargs: the keyword arguments of the training forward as TRL's `compute_loss` passes them
                (`input_ids`, `position_ids` (1, N), `shift_labels`, the tree-attention arguments).
            positions (`torch.Tensor` of shape (M,), int64): the packed position predicting each trained token
                (TRL's `token_index`).
            targets (`torch.Tensor` of shape (M,), int64): the trained tokens.
            temperature: TRL's `temperature`. version: the policy's `WeightsVersion` value (copies' sync).
            kept: the sampler's `SamplingSettings`: its kept sets are recomputed from this pass's logits (in the
                sampler's processor order), 1,024 cells at a time, for the kept mass.
        Returns:
            (M,) fp32 log-probs; an fp16 pass that overflowed is re-run in fp32, as `score` does. With `kept`, also
            the (M,) fp32 log kept mass log M = log p(g) - log p_S(g) of each trained token (>= 0 is impossible:
            M <= 1, so log M <= 0).
        Raises:
            NotImplementedError: a sharded policy (FSDP2): the packed proximal pass runs on unsharded policies.
        """
        if self.sharded is not None:
            raise NotImplementedError("old_logprob_mode other than 'bf16' on a sharded AsyncGRPOTrainer policy "
                                      "(FSDP2) is not supported; use old_logprob_mode='bf16' (the policy's own pass)")

        def run(model: nn.Module) -> HeadInput:
            return packed_head_input(model, forward_kwargs)

        deterministic = eval_mode(self.model) if not self.spec.trl_pass else contextlib.nullcontext()
        # attention in fp32 (a whole fp32 pass, fp32 layers): TRL's flash-attn3 tree kernel takes fp16/bf16 only (TRL
        # casts fp32 inputs down for it) and transformers' sdpa fallback would attend across the row's samples
        fp32_attention = self.spec.whole_model_dtype == "fp32" or bool(self.spec.fp32_layers)
        with deterministic, ieee_fp32(not self.spec.trl_pass), \
                fp32_tree_attention() if fp32_attention else contextlib.nullcontext():
            head = self._head_of_mode(run, version)
            logps = head.projection.logprobs(head.hidden[0, positions], targets, temperature)  # (M,)
            # fp16 overflow must never reach the ratio (one host read, fp16 only)
            if self.spec.overflows and not bool(torch.isfinite(logps).all()):
                # the fp32 re-run attends in fp32 too: TRL's flash-attn3 kernel refuses fp32 q/k/v
                with contextlib.nullcontext() if fp32_attention else fp32_tree_attention():
                    head = self._head_full(torch.float32, run, version, fallback=True)
                logps = head.projection.logprobs(head.hidden[0, positions], targets, temperature)
            if kept is None:
                return logps
            cells = HeadLogits(head.hidden[:, positions], head.projection.logits, head.projection.vocab_size)
            mask = torch.ones(1, positions.numel(), dtype=torch.bool, device=positions.device)  # (1, M)
            on_kept = logprobs_on_kept_sets(cells, targets[None], kept, temperature, mask)  # (1, M)
        return logps, logps - on_kept.logps[0]


def scoring_head_arithmetic(args, device: torch.device) -> dict | None:
    """`head_arithmetic(args.fp32_head_operands, device)` where the run's scoring pass computes its LM head in fp32
    (`old_logprob_mode` `fp32_head`, `guided_fp32`, `fp32_clone`; the asynchronous trainer's only with a decoupled
    objective, which runs the proximal pass); None otherwise (the run record's `head_arithmetic`)."""
    spec = MODES.get(args.old_logprob_mode)
    if spec is None or not spec.computes_in_fp32 or getattr(args, "async_objective", "decoupled") == "coupled":
        return None
    return head_arithmetic(getattr(args, "fp32_head_operands", "fp32"), device)


def score_completion_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              logits_to_keep: int, *, mode: str, temperature: float = 1.0,
                              batch_size: int | None = None, layers: Iterable[int] | None = None,
                              policy_autocast: Callable | None = None) -> torch.Tensor:
    """One-shot scoring outside any trainer (the probes use this). Shapes and modes as `OldLogprobScorer.score`.

    Returns:
        (B, T) fp32 log-probs of the last `logits_to_keep` tokens of `input_ids` under `mode`.
    """
    scorer = OldLogprobScorer(model, mode, layers=layers, policy_autocast=policy_autocast)
    return scorer.score(input_ids, attention_mask, logits_to_keep, temperature=temperature,
                        batch_size=batch_size).logps


def check_text_only(args: tuple, kwargs: dict) -> None:
    """Refuse image inputs where a scoring mode computes the old log-probs (its forward passes text only): `args` and
    `kwargs` are what TRL passed to `_get_per_token_logps_and_entropies` beyond the text inputs.

    Raises:
        NotImplementedError: an image (or other non-text) input is present.
    """
    if any(v is not None for v in args) or any(v is not None for v in kwargs.values() if not isinstance(v, bool)):
        raise NotImplementedError("old_logprob_mode other than 'bf16' supports text-only models")
