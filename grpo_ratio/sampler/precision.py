"""Rollouts drawn from a lower-precision copy of the policy (`rollout_precision`): the CPU analogue of FP8 rollouts.

The trainer keeps training the policy; only the tokens (and the sampler log-probs recorded with them) come from a copy
of it, re-made from the policy's weights once per generation after they changed (an optimizer step moved the
`WeightsVersion`). Values (`ROLLOUT_PRECISIONS`):

- `"policy"`: no copy; TRL's own `generate` on the policy, bit for bit (the default).
- `"bf16"`, `"fp16"`: the whole policy in that dtype (`old_pass.copies.ModuleCopy`: built from the config on the
  policy's device, PEFT adapters merged by PEFT, eval mode), run without the trainer's autocast.
- `"int8"`, `"int4"`, `"int2"`: the policy in its own parameter dtype with every `nn.Linear` weight (the LM head
  included; a tied head shares its tensor with the input embedding, which is then quantized too) fake-quantized
  weight-only, symmetric, per output channel: w -> round(w / s) s, s = max|w_row| / L, L = 127 (int8), 7 (int4) or 1
  (int2: the three levels -s, 0, s, ternary weights as in BitNet b1.58, arXiv 2402.17764), the rounding in fp32. int4
  and int2 are there to push the mismatch beyond what users meet.
- `"integer"`: the DetLLM integer model of the policy (`grpo_ratio.integer.convert`, calibrated once on the first
  generation batch's first prompts, re-converted from the current weights), drawn by the integer sampler
  (`grpo_ratio.integer.sample.generate`: counter-based noise, so a row's tokens depend only on its prompt, its
  sample index among the call's rows with the same prompt, the seed and the weights, never on the batch); its
  fixed-point log-probs (2^-16 nats) are the recorded sampler log-probs, exactly (`IntegerRollouts.score` re-scores
  them bit for bit: the integer old pass).

How the copy is put in the policy's place: TRL's `_generate_single_turn` calls `unwrapped_model.generate(...)` on the
policy; `RolloutCopy.drawing` sets `generate` on that instance for one call (the copy's `generate`, or the integer
sampler), and `recording_sampler` is attached to the copy, so the recorded log-probs are the copy's under the
processed distribution (temperature, top_k, top_p, min_p, as generate applies them).

Source: NVIDIA, "FP8-RL" (arXiv 2601.18150): rollouts in FP8 with TIS/MIS corrections of the rollout/trainer
mismatch; DetLLM (N. Barry, 2026) for the integer model (docs/integer.md). Shapes: B rows, P prompt tokens, T
completion tokens.
"""

from __future__ import annotations

import contextlib
import hashlib
import time

import torch
from torch import nn

from ..integer.convert import convert
from ..integer.sample import IntGeneration, IntSampling, generate
from ..modes import INTEGER_MODE, POLICY_ROLLOUTS, ROLLOUT_PRECISIONS
from ..old_pass.adapters import base_model
from ..old_pass.copies import ModuleCopy
from ..old_pass.integer_pass import integer_old_logps, to_nats, unpadded_rows
from .generate import SamplerLogprobRecorder, SamplerRecord, recording_sampler


POLICY = POLICY_ROLLOUTS
FLOAT_COPIES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # a whole copy in that dtype
FAKE_QUANT = {"int8": 127, "int4": 7, "int2": 1}  # weight-only levels per sign, per output channel (int2: -s, 0, s)
CALIBRATION_PROMPTS = 4  # prompts of the first generation batch that calibrate the integer model, kept for the run


@torch.no_grad()
def fake_quantize_(model: nn.Module, levels: int) -> int:
    """Weight-only symmetric per-output-channel fake quantization of every `nn.Linear` of `model`, in place:
    W (N, K) -> round(W / s) s with s (N, 1) = max_k |W| / `levels`, in fp32, stored back in W's dtype. A tensor
    shared by several modules (a tied head) is quantized once. Returns the number of weights quantized.

    Raises:
        ValueError: `levels` < 1.
    """
    if levels < 1:
        raise ValueError(f"fake_quantize_: levels must be >= 1, got {levels}")
    seen = set()
    for module in model.modules():
        if not isinstance(module, nn.Linear) or id(module.weight) in seen:
            continue
        seen.add(id(module.weight))
        w = module.weight.float()  # (N, K)
        scale = (w.abs().amax(1, keepdim=True) / levels).clamp(min=torch.finfo(torch.float32).tiny)  # (N, 1)
        module.weight.copy_(torch.round(w / scale).clamp(-levels, levels) * scale)
    return len(seen)


def sample_indices(rows: list[list[int]]) -> list[int]:
    """(B,) the index of each row among the earlier rows with the same prompt (0, 1, 2, ... per prompt): the integer
    sampler's sample index, so the `num_generations` copies of a prompt draw differently and a row's draw does not
    depend on the other prompts of the batch."""
    count: dict[tuple[int, ...], int] = {}
    out = []
    for row in rows:
        key = tuple(row)
        out.append(count.get(key, 0))
        count[key] = out[-1] + 1
    return out


def call_seed(seed: int, call: int) -> int:
    """The integer sampler's seed of the `call`-th generate call of a run with `seed` (a 62-bit hash of both)."""
    digest = hashlib.blake2b(f"rollout:{seed}:{call}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class IntegerRollouts:
    """The integer model of a policy and its sampler: `sync` (re-convert when the weights changed), `draw` (the
    integer sampler on left-padded prompts, TRL's `generate` contract) and `score` (the integer old pass).

    Args:
        sampling: the `IntSampling` (temperature, top_k, top_p; its `seed` is replaced per call).
        eos_token_id: the id that ends a completion (TRL cuts at any of its EOS ids; the sampler stops at this one).
        pad_token_id: the pad id of prompts and of finished rows.
        guard: run the integer forward under `NoFloatMode` (checks every op; about 5-20x slower).
    """

    def __init__(self, sampling: IntSampling, eos_token_id: int | None, pad_token_id: int, guard: bool = False):
        self.sampling = sampling
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.guard = guard
        self.model = None  # the IntModel, on the policy's device
        self.version: int | None = None
        self.calibration: list[torch.Tensor] | None = None
        self.last: IntGeneration | None = None  # the last draw (tokens, log-probs, lengths)

    def sync(self, policy: nn.Module, version: int, rows: list[list[int]] | None = None) -> float | None:
        """Re-convert the policy into the integer model when `version` moved; the first call keeps the first
        `CALIBRATION_PROMPTS` distinct rows of `rows` as the run's calibration prompts. Returns the seconds spent, or
        None when the model was current."""
        if self.model is not None and self.version == version:
            return None
        if self.calibration is None:
            distinct = list(dict.fromkeys(tuple(r) for r in rows or []))[:CALIBRATION_PROMPTS]
            if not distinct:
                raise ValueError("rollout_precision='integer': no prompt to calibrate the integer model on")
            self.calibration = [torch.tensor(r, dtype=torch.long) for r in distinct]
        start = time.perf_counter()
        model = base_model(policy)
        device = next(model.parameters()).device
        with torch.no_grad():
            self.model = convert(model, [p.to(device) for p in self.calibration]).to(device)
        self.version = version
        return time.perf_counter() - start

    def draw(self, rows: list[list[int]], max_new_tokens: int, seed: int) -> IntGeneration:
        """Sample completions of `rows` (prompt token ids, unpadded) with the integer sampler at `seed`: tokens (B, N)
        int64, log-probs (B, N) int64 in 2^-16 nats, lengths (B,). Row i's result depends only on its prompt, its
        `sample_indices` entry, the seed and the model."""
        sampling = IntSampling(self.sampling.temperature, self.sampling.top_k, self.sampling.top_p, seed=seed)
        self.last = generate(self.model, rows, max_new_tokens, sampling, sample_index=sample_indices(rows),
                             eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id, guard=self.guard)
        return self.last

    def generate_like_transformers(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                   max_new_tokens: int, seed: int) -> torch.Tensor:
        """`draw` in `GenerationMixin.generate`'s contract: left-padded prompts (B, P) and their mask (B, P) in,
        (B, P + N) prompt + completion ids out (pad after a finished row's EOS), on the prompts' device."""
        out = self.draw(unpadded_rows(input_ids, attention_mask), max_new_tokens, seed)
        return torch.cat([input_ids, out.tokens.to(input_ids.device)], dim=1)

    def score(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
              completion_mask: torch.Tensor) -> torch.Tensor:
        """The integer old pass: (B, T) fp32 log-probs (nats; 0 outside `completion_mask`) of TRL's batch (prompts
        (B, P) left-padded with `prompt_mask`, completions (B, T) with `completion_mask`), teacher-forced in one
        integer forward (`old_pass.integer_pass`): equal bit for bit to the sampler's recorded log-probs, on any
        batch composition."""
        return integer_old_logps(self.model, self.sampling, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                 self.pad_token_id, self.guard)

    def record(self, completion_ids: list[list[int]]) -> SamplerRecord:
        """The `SamplerRecord` of the last draw for TRL's per-row completions (cut after the first EOS): (B, T) fp32
        log-probs, 0 past each row's length; no kept sets (a truncation correction is refused with this sampler)."""
        T = max((len(c) for c in completion_ids), default=0)
        logps = to_nats(self.last.logprobs[:, :T]).cpu()  # (B, T)
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.long)
        logps = torch.where(torch.arange(T)[None, :] < lengths[:, None], logps, 0.0)
        return SamplerRecord(logprobs=logps, kept=None)


class RolloutCopy:
    """The copy `rollout_precision` draws the rollouts from, kept in step with the policy: `sync(version)` re-makes
    it when the `WeightsVersion` moved (re-cast, re-quantized or re-converted: `last_seconds`, `total_seconds`);
    `drawing(policy)` puts it in the policy's place for one `generate` call.

    Args:
        precision: a `ROLLOUT_PRECISIONS` value other than `"policy"`.
        policy: the unwrapped policy (a `PreTrainedModel`, or a PEFT model around one for the float copies).
        integer: the `IntegerRollouts` (precision `"integer"` only).
        seed: the run's seed (the integer sampler's per-call seed derives from it and the call's count).

    Raises:
        ValueError: an unknown precision, or `"integer"` without `integer`.
    """

    def __init__(self, precision: str, policy: nn.Module, integer: IntegerRollouts | None = None, seed: int = 0):
        if precision not in ROLLOUT_PRECISIONS or precision == POLICY:
            raise ValueError(f"RolloutCopy: precision={precision!r}; allowed: "
                             f"{', '.join(p for p in ROLLOUT_PRECISIONS if p != POLICY)}")
        if precision == INTEGER_MODE and integer is None:
            raise ValueError("RolloutCopy: precision 'integer' needs an IntegerRollouts")
        self.precision = precision
        self.policy = policy
        self.integer = integer
        self.seed = seed
        self.calls = 0
        self.copy: ModuleCopy | None = None
        self.last_seconds: float | None = None  # the last re-make's wall seconds (None: the copy was current)
        self.total_seconds = 0.0
        self.num_remakes = 0

    @property
    def is_integer(self) -> bool:
        return self.precision == INTEGER_MODE

    def _make_float(self) -> ModuleCopy:
        dtype = FLOAT_COPIES.get(self.precision) or next(self.policy.parameters()).dtype
        return ModuleCopy(self.policy, dtype, whole_model=True)

    def sync(self, version: int, rows: list[list[int]] | None = None) -> nn.Module | IntegerRollouts:
        """The copy at `version` (a `WeightsVersion` value): re-made first when the weights moved since the last
        sync; `rows` (prompt ids) calibrate the integer model on its first conversion. Records the re-make's cost."""
        if self.is_integer:
            seconds = self.integer.sync(self.policy, version, rows)
            model = self.integer
        else:
            seconds = None
            if self.copy is None:
                self.copy = self._make_float()
            if self.copy.version != version:
                start = time.perf_counter()
                self.copy.refresh(version)
                if self.precision in FAKE_QUANT:
                    fake_quantize_(self.copy.module, FAKE_QUANT[self.precision])
                seconds = time.perf_counter() - start
            model = self.copy.module
        self.last_seconds = seconds
        if seconds is not None:
            self.total_seconds += seconds
            self.num_remakes += 1
        return model

    @contextlib.contextmanager
    def drawing(self, target: nn.Module, version: int, max_new_tokens: int,
                recorder: SamplerLogprobRecorder | None = None):
        """Within the block, `target.generate(...)` (the unwrapped policy TRL calls) draws from the copy synced at
        `version`: the float copy's own `generate` (with the policy's `generation_config` filling unset fields, as
        on the policy) under `recording_sampler(copy, recorder)` when a recorder is given, or the integer sampler
        (`max_new_tokens` per row; its log-probs are read with `IntegerRollouts.record`). Yields a dict whose
        "model" is the copy that drew, once `generate` ran."""
        own = target.__dict__.get("generate")
        state = {}
        self.last_seconds = None

        def generate_from_copy(input_ids=None, attention_mask=None, generation_config=None, **kwargs):
            rows = None if attention_mask is None else unpadded_rows(input_ids, attention_mask)
            model = self.sync(version, rows)
            state["model"] = model
            if self.is_integer:
                seed = call_seed(self.seed, self.calls)
                self.calls += 1
                return model.generate_like_transformers(input_ids, attention_mask, max_new_tokens, seed)
            model.generation_config = target.generation_config  # TRL's override of the policy's, as generate reads it
            with contextlib.nullcontext() if recorder is None else recording_sampler(model, recorder):
                return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      generation_config=generation_config, **kwargs)

        target.generate = generate_from_copy
        try:
            yield state
        finally:
            if own is None:
                del target.generate
            else:
                target.generate = own

    def num_bytes(self) -> int:
        """Bytes held by the copy (its parameters and buffers; the integer model's tensors)."""
        if self.is_integer:
            model = self.integer.model
            if model is None:
                return 0
            seen, total = set(), 0

            def walk(obj):
                nonlocal total
                for value in vars(obj).values():
                    if isinstance(value, torch.Tensor) and id(value) not in seen:
                        seen.add(id(value))
                        total += value.numel() * value.element_size()
                    elif isinstance(value, list):
                        for item in value:
                            if hasattr(item, "__dict__"):
                                walk(item)
                    elif hasattr(value, "__dict__") and not isinstance(value, (type, nn.Module)):
                        walk(value)
            walk(model)
            return total
        return 0 if self.copy is None else self.copy.num_bytes()
