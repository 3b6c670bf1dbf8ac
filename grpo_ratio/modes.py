"""What each `old_logprob_mode` is: one frozen record per mode, the one home of the mode names.

Every other module asks a `ScoringMode` (``MODES[name].whole_model_dtype``, ``.fp32_head``, ``.is_sampler``, ...)
instead of comparing the mode's name; `tests/test_layout.py` keeps mode-name literals out of the rest of the package.
No torch here: dtypes are the names `"fp32"` / `"fp16"`, so the command line's early checks can read the table
before the heavy imports.

Sources: the precision modes are the arms of the batch-logprob-gap report (tables T7/T10); `sampler` is verl's
`bypass_mode` and slime's `--use-rollout-logprobs` (the rollout's own log-probs anchor the ratio, no old pass).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScoringMode:
    """One value of `RatioGRPOConfig.old_logprob_mode`.

    Attributes:
        name: the config value.
        summary: one line for tables (`grpo-ratio` help, docs/scoring_modes.md).
        whole_model_dtype: `"fp32"` or `"fp16"` when the whole forward runs in that dtype (a copy of the policy where
            its weights are stored in another dtype); None when the body runs at the policy's training precision.
        fp32_head: the final norm and the LM head run in fp32.
        fp32_layers: the `guided_fp32_layers` decoder layers run in fp32 (they must be given).
        trl_pass: the old log-probs are TRL's own pass, bit for bit (no scorer).
        is_sampler: the sampler's recorded log-probs are the old log-probs: no old pass at all.
        trl_layout: the mode's forward passes no position ids, as TRL's own pass does (the others count positions as
            `generate` does), so its log-probs can equal TRL's training forward bitwise.
        overflows: fp16 activations can overflow: rows with a non-finite log-prob are re-scored in fp32
            (`ratio/fp16_fallback_rows`).
        integer: the integer model that drew the rollouts (`rollout_precision="integer"`) re-scores them: the
            integer old pass, equal to the sampler's log-probs bit for bit (no float pass of the policy).
    """

    name: str
    summary: str
    whole_model_dtype: str | None = None
    fp32_head: bool = False
    fp32_layers: bool = False
    trl_pass: bool = False
    is_sampler: bool = False
    trl_layout: bool = False
    overflows: bool = False
    integer: bool = False

    @property
    def has_scorer(self) -> bool:
        """An `OldLogprobScorer` computes the old log-probs in place of TRL's pass."""
        return not (self.trl_pass or self.is_sampler or self.integer)

    @property
    def is_precision_mode(self) -> bool:
        """The old log-probs come from a float forward pass of the policy at some precision (every mode but
        `sampler` and `integer`)."""
        return not (self.is_sampler or self.integer)

    @property
    def replaces_old_pass(self) -> bool:
        """No float old pass of the policy runs: the old log-probs are the sampler's (`sampler`) or the integer
        model's (`integer`), set once TRL returns its batch."""
        return self.is_sampler or self.integer

    @property
    def may_copy_whole_model(self) -> bool:
        """The mode may hold a whole-model copy (`copy_storage` applies): the whole forward in another dtype."""
        return self.whole_model_dtype is not None

    @property
    def runs_fp32_modules(self) -> bool:
        """Single modules (final norm, head, guided layers) run in fp32 inside a policy at its training precision."""
        return self.whole_model_dtype is None and self.fp32_head

    @property
    def takes_head_operands(self) -> bool:
        """`fp32_head_operands` applies: the final norm and the LM head are the only modules the mode changes
        (`fp32_head`), so its head can take the sampler's operands (`HEAD_OPERANDS`)."""
        return self.runs_fp32_modules and not self.fp32_layers

    @property
    def computes_in_fp32(self) -> bool:
        """At least the LM head computes in fp32: against an fp32 training forward the mode changes nothing."""
        return self.fp32_head


BF16 = ScoringMode("bf16", "the policy's own pass at its training precision: TRL's behaviour, bit for bit",
                   trl_pass=True, trl_layout=True)
FP32_CLONE = ScoringMode("fp32_clone", "the whole policy in fp32 (its own weights when stored in fp32, else a copy)",
                         whole_model_dtype="fp32", fp32_head=True)
FP16_CLONE = ScoringMode("fp16_clone", "the whole policy in fp16 (a copy), rows that overflow re-scored in fp32",
                         whole_model_dtype="fp16", overflows=True)
FP32_HEAD = ScoringMode("fp32_head", "final norm and LM head in fp32 on the training-precision body",
                        fp32_head=True, trl_layout=True)
GUIDED_FP32 = ScoringMode("guided_fp32", "the guided_fp32_layers decoder layers, final norm and LM head in fp32",
                          fp32_head=True, fp32_layers=True)
SAMPLER = ScoringMode("sampler", "the sampler's recorded log-probs (generate recording or vLLM): no old pass",
                      is_sampler=True)
INTEGER = ScoringMode("integer", "the integer model that drew the rollouts re-scores them (rollout_precision="
                      "'integer'): old/sampler = 1 bit for bit", integer=True)

# every value of `old_logprob_mode`, in the order the docs and tables list them
MODES: dict[str, ScoringMode] = {m.name: m for m in (BF16, FP32_CLONE, FP16_CLONE, FP32_HEAD, GUIDED_FP32, SAMPLER,
                                                     INTEGER)}
# every value `old_logprob_mode` accepts
OLD_LOGPROB_MODES = tuple(MODES)
# the arms: the values that stand alone (every one but `integer`, which only re-scores `rollout_precision="integer"`
# rollouts); one recipe each, and the tables that list the arms
SCORING_MODES = tuple(n for n, m in MODES.items() if not m.integer)
# the modes whose old log-probs come from a forward pass (OldLogprobScorer runs each, bf16 as TRL's pass does)
PRECISION_MODES = tuple(n for n, m in MODES.items() if m.is_precision_mode)
# the modes an OldLogprobScorer computes in place of TRL's pass
SCORER_MODES = tuple(n for n, m in MODES.items() if m.has_scorer)
# the modes that may hold a whole-model copy (fp16_clone always, fp32_clone on bf16/fp16-stored weights)
COPY_MODES = tuple(sorted(n for n, m in MODES.items() if m.may_copy_whole_model))
# the mode that keeps TRL's numbers (the default, and every comparison's baseline)
TRL_MODE = BF16.name
SAMPLER_MODE = SAMPLER.name
INTEGER_MODE = INTEGER.name  # also the `rollout_precision` that draws from the integer model

# `rollout_precision`: what the rollouts are drawn from on the `generate` path (`grpo_ratio.sampler.precision`): the
# policy itself (stock TRL), a copy in bf16 / fp16, the policy with int8 / int4 / int2 weight-only fake-quantized
# linears, or the integer model
POLICY_ROLLOUTS = "policy"
ROLLOUT_PRECISIONS = (POLICY_ROLLOUTS, "bf16", "fp16", "int8", "int4", "int2", INTEGER_MODE)


# the values of `fp32_head_operands`: what `fp32_head`'s LM head multiplies, both with fp32 accumulation and output.
# "fp32": the final norm and both operands in fp32 (the default; TRL's `cast_lm_head_to_fp32`). "bf16": the final norm
# as the policy trains (its output in the training precision) times the head weight, both rounded to bf16: the CUDA
# fp32 head of vLLM (`head_dtype="float32"`, PR #48390), SGLang (#32370) and prime-rl (#2441),
# `torch.mm(hidden_bf16, weight_bf16.t(), out_dtype=torch.float32)`
HEAD_OPERANDS = ("fp32", "bf16")
DEFAULT_HEAD_OPERANDS = HEAD_OPERANDS[0]
SAMPLER_HEAD_OPERANDS = HEAD_OPERANDS[1]


def mode_of(name: str) -> ScoringMode:
    """The record of `name`.

    Raises:
        ValueError: `name` is not an `old_logprob_mode`, naming the allowed values.
    """
    if name not in MODES:
        raise ValueError(f"old_logprob_mode={name!r} is not allowed; allowed: {', '.join(MODES)}")
    return MODES[name]
