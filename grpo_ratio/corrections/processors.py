"""Logits processors beyond temperature and top_k/top_p/min_p: which ones the corrections model, and the one they
re-apply to the trainer's logits (`RepetitionPenalty`).

The sampler draws each token from its *processed* distribution q: transformers' `generate` runs every processor its
`GenerationConfig` turns on (`GenerationMixin._get_logits_processor`, transformers 5.24), vLLM those of its
`SamplingParams`. The corrections put the trainer's old (and, under `renormalize`, new) log-probs on that
distribution, so each processor is one of (`PROCESSORS`, the table of docs/truncation.md):

- `reweights`, modelled: `repetition_penalty`, a function of the prefix, is re-applied to the trainer's logits at
  every position before temperature and the kept set, as generate and vLLM apply it (`RepetitionPenalty`);
- `masks`: the processor only removes tokens (-inf). With kept sets recorded during `generate` the recording holds
  what it removed, so it is modelled exactly; kept sets recomputed from the trainer's logits (vLLM's default) or vLLM's
  sampling masks do not know it: warned;
- `reweights`, not modelled: the corrected ratio carries its factor: warned;
- no effect on the sampled distribution (log-softmax, finite logits untouched, encoder-decoder only): silent.

Under `truncation_correction="none"` nothing is modelled: every active processor is named in a warning, as
truncation is (`lints.check_sampling`).

Shapes: B = rows, P = prompt tokens (left-padded), T = completion tokens, V = vocabulary, K = cells of a chunk (a cell
is one (row, position), numbered row-major).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


MODELLED = "modelled"  # re-applied to the trainer's logits (repetition_penalty)
MASKS = "masks"  # removes tokens only: modelled by recorded kept sets
REWEIGHTS = "reweights"  # changes the surviving tokens' relative probabilities: not modelled
NO_EFFECT = "no effect"


@dataclass(frozen=True)
class Processor:
    """One sampler setting that processes logits: its `kind` and what it does to the corrected ratio."""

    kind: str
    effect: str


# transformers GenerationConfig fields (generate path), as `_get_logits_processor` (transformers 5.24) turns them on
PROCESSORS: dict[str, Processor] = {
    "repetition_penalty": Processor(MODELLED, "divides the positive logits (multiplies the negative ones) of every "
                                    "token already in the prompt or the completion; re-applied to the old and new "
                                    "logits at each position"),
    "no_repeat_ngram_size": Processor(MASKS, "removes tokens that would repeat an n-gram of the prefix"),
    "bad_words_ids": Processor(MASKS, "removes tokens that would complete a banned sequence"),
    "suppress_tokens": Processor(MASKS, "removes the listed tokens at every step"),
    "begin_suppress_tokens": Processor(MASKS, "removes the listed tokens at the first step"),
    "min_length": Processor(MASKS, "removes EOS until the sequence has min_length tokens"),
    "min_new_tokens": Processor(MASKS, "removes EOS until min_new_tokens tokens are generated"),
    "forced_bos_token_id": Processor(MASKS, "forces BOS at the first step (all else removed)"),
    "forced_eos_token_id": Processor(MASKS, "forces EOS at the last step (all else removed)"),
    "typical_p": Processor(MASKS, "keeps the locally typical set (a truncation rule)"),
    "epsilon_cutoff": Processor(MASKS, "removes tokens below an absolute probability (a truncation rule)"),
    "eta_cutoff": Processor(MASKS, "removes tokens below an entropy-dependent probability (a truncation rule)"),
    "top_h": Processor(MASKS, "keeps an entropy-bounded prefix (a truncation rule)"),
    "sequence_bias": Processor(REWEIGHTS, "adds a bias to tokens that complete given sequences"),
    "exponential_decay_length_penalty": Processor(REWEIGHTS, "raises EOS's logit exponentially after a length"),
    "guidance_scale": Processor(REWEIGHTS, "mixes in an unconditional forward (classifier-free guidance)"),
    "watermarking_config": Processor(REWEIGHTS, "biases a pseudo-random green list of tokens"),
    "encoder_repetition_penalty": Processor(NO_EFFECT, "encoder-decoder models only: generate ignores it here"),
    "encoder_no_repeat_ngram_size": Processor(NO_EFFECT, "encoder-decoder models only: generate ignores it here"),
    "renormalize_logits": Processor(NO_EFFECT, "a log-softmax: the distribution is unchanged"),
    "remove_invalid_values": Processor(NO_EFFECT, "replaces NaN/inf logits only: finite logits are unchanged"),
}
# vLLM SamplingParams fields TRL forwards through `generation_kwargs` (vLLM path), and TRL's regex field
VLLM_PROCESSORS: dict[str, Processor] = {
    "repetition_penalty": PROCESSORS["repetition_penalty"],
    "presence_penalty": Processor(REWEIGHTS, "subtracts a constant from the logits of tokens already generated"),
    "frequency_penalty": Processor(REWEIGHTS, "subtracts a multiple of each generated token's count from its logit"),
    "logit_bias": Processor(REWEIGHTS, "adds the given biases to the logits"),
    "bad_words": Processor(MASKS, "removes tokens that would complete a banned word"),
    "min_tokens": Processor(MASKS, "removes EOS and stop tokens until min_tokens tokens are generated"),
    "allowed_token_ids": Processor(MASKS, "removes every token not listed"),
    "structured_outputs": Processor(MASKS, "removes tokens the grammar or regex does not allow"),
    "vllm_structured_outputs_regex": Processor(MASKS, "removes tokens the regex does not allow"),
    "logits_processors": Processor(REWEIGHTS, "custom processors: anything"),
}


def _active(name: str, value) -> bool:
    """Whether a processor field's value turns its processor on (`_get_logits_processor`'s conditions)."""
    if value is None or value is False:
        return False
    if name in ("repetition_penalty", "encoder_repetition_penalty", "guidance_scale"):
        return float(value) != 1.0
    if name in ("typical_p",):
        return float(value) < 1.0
    if name in ("epsilon_cutoff", "eta_cutoff"):
        return 0.0 < float(value) < 1.0
    if name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "min_length", "min_new_tokens",
                "min_tokens", "presence_penalty", "frequency_penalty"):
        return float(value) > 0
    if isinstance(value, (list, tuple, dict, str)):
        return len(value) > 0
    return True


def active_processors(values: Mapping, table: Mapping[str, Processor] = PROCESSORS) -> dict[str, object]:
    """The fields of `table` that `values` (a field -> value mapping: an effective `GenerationConfig.to_dict()`, or
    vLLM's sampling kwargs) turn on, with their values, in the table's order."""
    return {name: values[name] for name in table if name in values and _active(name, values[name])}


@dataclass
class RepetitionPenalty:
    """transformers' `RepetitionPenaltyLogitsProcessor` (and vLLM's repetition penalty), re-applied to the trainer's
    teacher-forced logits: at the position predicting completion token t, every token present in the prompt (left
    padding excluded) or in completion tokens 0..t-1 has its logit z divided by `penalty` if z > 0, else multiplied
    (CTRL, arXiv 1909.05858; transformers `generation/logits_process.py`). Applied to raw logits, before temperature,
    top_k/top_p/min_p, in generate's order. Differentiable in z.

    Fields:
        penalty (`float`, > 0): `repetition_penalty`.
        input_ids (`torch.Tensor`, (B, P+T) int64): prompts (left-padded) and completions, as TRL scores them.
        attention_mask (`torch.Tensor`, (B, P+T) 0/1): 0 on left padding.

    Memory: one (B, V) int64 table of each token's first position (built on first use).
    """

    penalty: float
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    _first: torch.Tensor | None = field(default=None, repr=False)

    def rows(self, index) -> RepetitionPenalty:
        """The penalty of rows `index` (a slice or index tensor), e.g. one forward chunk of the scorer."""
        return RepetitionPenalty(self.penalty, self.input_ids[index], self.attention_mask[index])

    def first_positions(self, vocab_size: int) -> torch.Tensor:
        """(B, V) int64: the first position (in P+T) at which each token occurs unmasked; P+T where it never does."""
        if self._first is None:
            B, L = self.input_ids.shape
            positions = torch.arange(L, device=self.input_ids.device).expand(B, L)  # (B, L)
            positions = torch.where(self.attention_mask.bool(), positions, L)  # padding never counts
            first = torch.full((B, vocab_size), L, dtype=torch.long, device=self.input_ids.device)  # (B, V)
            self._first = first.scatter_reduce(1, self.input_ids, positions, reduce="amin")
        return self._first

    def __call__(self, z: torch.Tensor, cells: torch.Tensor, num_steps: int) -> torch.Tensor:
        """Penalised logits (K, V) fp32 of the flat cells `cells` (K,) of a (B, T = `num_steps`) grid, from their raw
        logits z (K, V)."""
        first = self.first_positions(z.shape[-1]).to(z.device)  # (B, V)
        row, step = cells // num_steps, cells % num_steps  # (K,)
        position = self.input_ids.shape[1] - num_steps + step.to(z.device)  # (K,) position of the predicted token
        seen = first[row.to(z.device)] < position[:, None]  # (K, V) in the prefix before that token
        penalised = torch.where(z > 0, z / self.penalty, z * self.penalty)  # (K, V)
        return torch.where(seen, penalised, z)
