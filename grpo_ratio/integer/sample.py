"""Integer sampling that does not depend on the batch, and the integer old pass that reproduces its log-probs.

Each draw is an inverse-CDF categorical draw on integer masses: the masses are e^((l - max) / temperature) in 2^-30
(`grpo_ratio.integer.arith.exp_neg`, the forward's exp), restricted to the top_k and top_p kept set (ranks by logit,
ties to the lower id; top_p on the masses, in integers), and the uniform is a counter-based hash of (seed, prompt,
sample index, step): blake2b of those four numbers, so a row's noise, and its tokens, are the same alone or in any
batch, on any machine. Greedy is the integer argmax, ties to the lowest id. The recorded log-prob of a token is its
log-prob under the distribution it was drawn from, in fixed point 2^-16 nats: (l - max) / temperature minus the log
of the kept masses' sum (`log2_fixed`: integer bits by squaring). `score` computes the same numbers teacher-forced in
one forward; they equal the sampler's bit for bit because the forward's prefill and decode give the same logits.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .arith import FRAC, LN2, ONE, NoFloatMode, exp_neg, log2_fixed, shift_round
from .model import IntModel


I64 = torch.int64
OUTSIDE = -(1 << 40)  # the log-prob (2^-16 nats) of a token outside the kept set


@dataclass(frozen=True)
class IntSampling:
    """Sampling settings, turned into integers once: 1/temperature as m / 2^k (m < 2^15), top_p as p / 2^16.

    Raises:
        ValueError: temperature <= 0, top_k < 0, top_p outside (0, 1].
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"IntSampling.temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"IntSampling.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"IntSampling.top_p must be in (0, 1], got {self.top_p}")

    @property
    def inv_temperature(self) -> tuple[int, int]:
        inv = 1.0 / self.temperature
        k = 14 - math.floor(math.log2(inv))
        return round(inv * 2 ** k), k

    @property
    def top_p_fixed(self) -> int:
        return round(self.top_p * (1 << 16))


def prompt_key(ids) -> int:
    """A 64-bit key of a prompt's token ids (padding excluded by the caller)."""
    data = b"".join(int(t).to_bytes(4, "little", signed=True) for t in ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def row_noise(seed: int, keys: list[int], sample_index: list[int], step: int, device=None) -> torch.Tensor:
    """(B,) int64 uniforms in [0, 2^62): blake2b of (seed, prompt key, sample index, step), one per row."""
    out = [int.from_bytes(hashlib.blake2b(f"{seed}:{key}:{index}:{step}".encode(), digest_size=8).digest(),
                          "little") >> 2 for key, index in zip(keys, sample_index)]
    return torch.tensor(out, dtype=I64, device=device)


def kept_masses(logits: torch.Tensor, sampling: IntSampling):
    """(masses (..., V) int64 in 2^-30, 0 outside the kept set; their sum (..., 1); the row max (..., 1); the kept
    set (..., V) bool, or None without truncation) of int32 logits (..., V) in 2^-16 under temperature, top_k and
    top_p. Greedy rows use temperature 1, no truncation. A kept token's mass may be 0 (below 2^-30 of the max's)."""
    lg = logits.to(I64)
    top = lg.amax(-1, keepdim=True)
    m, k = (1 << 14, 14) if sampling.greedy else sampling.inv_temperature
    masses = exp_neg(top - lg, torch.full_like(top, m), k + FRAC)
    if not sampling.greedy and (sampling.top_k or sampling.top_p < 1):
        V = lg.size(-1)
        order = torch.sort(-lg, dim=-1, stable=True).indices  # by logit, ties to the lower id
        sorted_masses = masses.gather(-1, order)
        keep = torch.ones_like(sorted_masses, dtype=torch.bool)
        if sampling.top_k:
            keep = torch.arange(V, device=lg.device) < sampling.top_k
            sorted_masses = sorted_masses * keep
        if sampling.top_p < 1:
            before = sorted_masses.cumsum(-1) - sorted_masses
            total = sorted_masses.sum(-1, keepdim=True)
            keep = keep & ((before << 16) < sampling.top_p_fixed * total)
        masses = torch.zeros_like(masses).scatter(-1, order, sorted_masses * keep)
        kept = torch.zeros_like(masses, dtype=torch.bool).scatter(-1, order, keep.expand_as(sorted_masses))
        return masses, masses.sum(-1, keepdim=True).clamp(min=1), top, kept
    return masses, masses.sum(-1, keepdim=True).clamp(min=1), top, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, sampling: IntSampling) -> torch.Tensor:
    """Log-probs (..., ) int64 in 2^-16 nats of `tokens` (...) under the distribution drawn from `logits` (..., V):
    (l - max) / temperature - ln(sum of kept masses / 2^30); `OUTSIDE` for a token outside the kept set."""
    _, total, top, kept = kept_masses(logits, sampling)
    m, k = (1 << 14, 14) if sampling.greedy else sampling.inv_temperature
    tok = tokens.to(I64).unsqueeze(-1)
    z = -shift_round((top - logits.to(I64).gather(-1, tok)) * m, k)
    lse = shift_round((log2_fixed(total) - (ONE << FRAC)) * LN2[0], LN2[1])
    lp = (z - lse).squeeze(-1)
    return lp if kept is None else torch.where(kept.gather(-1, tok).squeeze(-1), lp, OUTSIDE)


def draw(logits: torch.Tensor, sampling: IntSampling, noise: torch.Tensor) -> torch.Tensor:
    """(B,) int64 tokens from (B, V) int32 logits: greedy = the lowest id of the max; else the first id whose
    cumulative mass (in id order) exceeds noise mod total."""
    lg = logits.to(I64)
    if sampling.greedy:
        ids = torch.arange(lg.size(-1), device=lg.device)
        return torch.where(lg == lg.amax(-1, keepdim=True), ids, lg.size(-1)).amin(-1)
    masses, total, _, _ = kept_masses(lg, sampling)
    target = noise.to(lg.device).unsqueeze(-1) % total
    return (masses.cumsum(-1) <= target).sum(-1)


@dataclass
class IntGeneration:
    """tokens (B, N) int64 (pad after EOS); logprobs (B, N) int64 in 2^-16 nats (0 after EOS); lengths (B,) int64
    (completion tokens up to and including EOS)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor


def left_pad(rows: list, pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, P), valid (B, P)) of token-id rows, left-padded."""
    P = max(len(r) for r in rows)
    ids = torch.full((len(rows), P), pad_id, dtype=I64)
    valid = torch.zeros(len(rows), P, dtype=torch.bool)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, P - len(r):] = torch.as_tensor(list(r), dtype=I64)
            valid[i, P - len(r):] = True
    return ids.to(device), valid.to(device)


@torch.no_grad()
def generate(model: IntModel, prompts: list, max_new_tokens: int, sampling: IntSampling = IntSampling(), *,
             sample_index: list[int] | None = None, eos_token_id: int | None = None, pad_token_id: int = 0,
             guard: bool = True) -> IntGeneration:
    """Sample completions of `prompts` (lists or 1-D tensors of token ids) from the integer model: prefill once (left
    padded), then one token per step with the int8 cache. Row i's tokens depend only on its prompt, `sample_index[i]`
    (default i), the seed and the model: not on the batch.

    Raises:
        ValueError: no prompt, an empty prompt, max_new_tokens < 1.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: prompts must be a non-empty list of non-empty token-id sequences")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    rows = [[int(t) for t in p] for p in prompts]
    B = len(rows)
    index = list(range(B)) if sample_index is None else list(sample_index)
    keys = [prompt_key(r) for r in rows]
    ids, valid = left_pad(rows, pad_token_id, model.device)
    cache = model.new_cache(B)
    last = torch.full((B, 1), ids.size(1) - 1, dtype=I64)
    logits = model(ids, valid, cache, logits_at=last, guard=guard)[:, 0]
    done = torch.zeros(B, dtype=torch.bool, device=model.device)
    tokens, logps = [], []
    for step in range(max_new_tokens):
        noise = row_noise(sampling.seed, keys, index, step, model.device)
        with NoFloatMode() if guard else _null():
            tok = draw(logits, sampling, noise)
            lp = token_logprobs(logits, tok, sampling)
        tok = torch.where(done, pad_token_id, tok)
        tokens.append(tok)
        logps.append(torch.where(done, 0, lp))
        if eos_token_id is not None:
            done = done | (tok == eos_token_id)
        if step + 1 == max_new_tokens or bool(done.all()):
            break
        logits = model(tok.unsqueeze(1), None, cache, guard=guard)[:, 0]
    tokens, logps = torch.stack(tokens, 1), torch.stack(logps, 1)
    if eos_token_id is None:
        lengths = torch.full((B,), tokens.size(1), dtype=I64)
    else:
        is_eos = (tokens == eos_token_id).to(I64)
        first = torch.where(is_eos.any(1), is_eos.argmax(1) + 1, tokens.size(1))
        lengths = first.cpu()
    return IntGeneration(tokens, logps, lengths)


@torch.no_grad()
def score(model: IntModel, prompts: list, completions: torch.Tensor, lengths: torch.Tensor,
          sampling: IntSampling = IntSampling(), *, pad_token_id: int = 0, guard: bool = True) -> torch.Tensor:
    """The integer old pass: log-probs (B, N) int64 (2^-16 nats; 0 past each length) of `completions` (B, N) after
    `prompts`, teacher-forced in one forward (prompts left-padded, completions right-padded). Equal bit for bit to
    the `generate` log-probs of the same rows, on any batch."""
    rows = [[int(t) for t in p] for p in prompts]
    ids, valid = left_pad(rows, pad_token_id, model.device)
    N = completions.size(1)
    comp = completions.to(model.device)
    comp_valid = torch.arange(N, device=model.device)[None, :] < lengths.to(model.device)[:, None]
    full = torch.cat([ids, torch.where(comp_valid, comp, pad_token_id)], 1)
    full_valid = torch.cat([valid, comp_valid], 1)
    P = ids.size(1)
    at = (P - 1 + torch.arange(N)).expand(len(rows), N)
    logits = model(full, full_valid, logits_at=at, guard=guard)  # (B, N, V)
    with NoFloatMode() if guard else _null():
        lp = token_logprobs(logits, comp, sampling)
    return torch.where(comp_valid, lp, 0)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
