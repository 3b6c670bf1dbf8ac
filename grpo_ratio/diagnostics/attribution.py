"""Where the distance comes from: log(new) - log(sampler) per token as a sum of named causes (`ratio_attribution`).

Pure tensor math, no model, no trainer. Shapes: B = rows, T = completion tokens, n = the rows attributed (sampled
from a generation batch by `sample_rows`). Definitions, signs and sources: docs/attribution.md.

For every attributed token, with every log-prob of the sampled token on the support the loss uses (the kept set
under `truncation_correction="renormalize"`, else the full vocabulary):

    new - sampler =   drift            new - new_gen
                    + train_precision  new_gen - old
                    + precision        old - ref_own
                    + routing          ref_own - ref_sampler
                    + truncation       (ref_sampler - ref_sampler_kept) - lift
                    + engine           ref_sampler_kept - (sampler - lift)

new_gen: the training forward at the weights that generated the batch, so `drift` is what moved since (exactly 0 at
the first inner step, where the training forward runs those weights: new_gen is new) and `train_precision` how the
training forward computes against the old pass at the same weights (its precision, TRL's layout, train mode, the
micro-batch's shape); ref_own: the fp32 reference pass, same weights, the old pass's routes (its own on a dense
policy); ref_sampler: the same with the sampler's routes; ref_sampler_kept: that over the sampler's kept set (the
full-vocabulary one when the sampling truncates nothing, so the truncation term is then exactly 0); sampler: the
sampler's log-prob as the loss's side processes it (+ log M_old under `lift_sampler`, `lift`; 0 otherwise). Each term
is the difference of two passes that differ in one thing; the sum telescopes, so the identity holds by construction
and `AttributionStats` logs only the fp32 rounding of the sum (`ratio/attribution/identity_error`).

Sources: the batch-logprob-gap report (causes separated one at a time: batch shape and precision, truncation,
routing); Hugging Face's write-up on the trainer/generator mismatch (log r = policy change + precision gap); NeMo-RL
#4243 and TRL #6688 (users asking which cause a correction leaves).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from . import metric_keys as keys


TERMS = tuple(keys.ATTRIBUTION_TERMS)  # ("drift", "train_precision", "precision", "routing", "truncation", "engine")


def sample_rows(num_rows: int, limit: int, device=None) -> torch.Tensor:
    """The rows of a generation batch to attribute: all of them when `limit >= num_rows`, else `limit` rows evenly
    spaced over the batch (a systematic sample: TRL groups a prompt's generations together, so every part of the
    batch is represented; no random draw, so TRL's random stream is untouched).

    Args:
        num_rows: B, rows of the generation batch. limit: rows to attribute (>= 1).
    Returns:
        (n,) int64 row indices, increasing, n = min(B, limit).
    Raises:
        ValueError: `limit < 1`.
    """
    if limit < 1:
        raise ValueError(f"sample_rows needs limit >= 1, got {limit}")
    if limit >= num_rows:
        return torch.arange(num_rows, device=device)
    return torch.linspace(0, num_rows - 1, limit, device=device).round().long()  # (n,) distinct: limit < num_rows


def row_positions(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(B,) int64: the position of each batch row among `rows` (n,), -1 for a row not attributed. TRL shuffles and
    splits this with the batch (`attribution_row`), so a micro-batch finds its rows' references."""
    positions = torch.full((num_rows,), -1, dtype=torch.long, device=rows.device)
    positions[rows] = torch.arange(rows.numel(), device=rows.device)
    return positions


@dataclass
class AttributionReference:
    """The fp32 reference passes of the attributed rows of one generation batch, (n, T) fp32 each.

    Fields:
        own_routes: the reference on the loss's support with the old pass's routes (its own routes where none were
            recorded, the sampler's under R3; the same tensor as `sampler_routes` on a dense policy).
        sampler_routes: the same pass with the sampler's routes (the same tensor as `own_routes` where the routes
            are the same).
        sampler_kept: the `sampler_routes` pass over the sampler's kept set (the same tensor as the full-vocabulary
            one when the sampling truncates nothing).
        present: (n,) bool, the rows that are attributed (all True on a generation batch; `for_rows` sets False on a
            micro-batch's rows that were not sampled).
    """

    own_routes: torch.Tensor
    sampler_routes: torch.Tensor
    sampler_kept: torch.Tensor
    present: torch.Tensor | None = None

    def for_rows(self, positions: torch.Tensor) -> AttributionReference:
        """The references of a micro-batch's rows: `positions` (b,) int64 from `row_positions` (-1: not
        attributed, its values NaN and `present` False). Returns (b, T) tensors."""
        n = self.own_routes.size(0)
        index = torch.where(positions < 0, n, positions).to(self.own_routes.device)  # (b,) n = the NaN row

        def rows(t: torch.Tensor) -> torch.Tensor:
            padded = torch.cat([t, torch.full_like(t[:1], float("nan"))], dim=0)  # (n + 1, T)
            return padded[index]  # (b, T)

        own = rows(self.own_routes)
        sampler = own if self.sampler_routes is self.own_routes else rows(self.sampler_routes)
        kept = sampler if self.sampler_kept is self.sampler_routes else rows(self.sampler_kept)
        return AttributionReference(own, sampler, kept, present=(positions >= 0).to(own.device))


def attribution_terms(new: torch.Tensor, old: torch.Tensor, sampler: torch.Tensor, reference: AttributionReference,
                      lift: torch.Tensor | None = None, new_at_generation: torch.Tensor | None = None
                      ) -> dict[str, torch.Tensor]:
    """The six terms of log(new) - log(sampler) per token (module docstring), and that total.

    Args:
        new: (B, T) the training forward's log-probs (the loss's support). old: (B, T) the old log-probs the ratio is
            anchored to (the same support). sampler: (B, T) the sampler's log-probs as the loss's side processes
            them (lifted by + log M_old under `lift_sampler`). reference: `AttributionReference` of the same rows.
        lift: (B, T) what was added to the sampler's log-probs (log M_old under `lift_sampler`), or None (0).
        new_at_generation: (B, T) the training forward's log-probs of the same rows at the weights that generated
            them, or None: `new` itself, as at the first inner step (the only one the trainers attribute), where the
            training forward runs those weights, so `drift` is exactly 0 there.
    Returns:
        {"drift", "train_precision", "precision", "routing", "truncation", "engine", "total"}: (B, T) fp32 each;
        `total` = new - sampler, which the six terms add up to (to fp32 rounding of the sum).
    Raises:
        ValueError: shapes differ.
    """
    at_generation = new if new_at_generation is None else new_at_generation
    shapes = {tuple(t.shape) for t in (new, at_generation, old, sampler, reference.own_routes,
                                       reference.sampler_routes, reference.sampler_kept)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"attribution_terms needs (B, T) tensors of one shape, got {sorted(shapes)}")
    new, at_generation, old, sampler = new.float(), at_generation.float(), old.float(), sampler.float()
    own, ref, kept = reference.own_routes.float(), reference.sampler_routes.float(), reference.sampler_kept.float()
    lift = torch.zeros_like(sampler) if lift is None else lift.float()  # (B, T)
    return {
        "drift": new - at_generation,  # what moved: exactly 0 where new_at_generation is new (finite tokens)
        "train_precision": at_generation - old,  # how the training forward computes, against the old pass
        "precision": old - own,
        "routing": own - ref,  # exactly 0 where both are one pass
        "truncation": (ref - kept) - lift,  # exactly 0 at top_p=1 without a lift
        "engine": kept - (sampler - lift),
        "total": new - sampler,
    }


@dataclass
class AttributionStats:
    """Per-term sums over the attributed tokens of one optimizer update, exact across micro-batches and processes,
    and the largest rounding error of the identity.

    Fields:
        sums: (1 + 2 x 6,) fp64: the token count, then sum |term| per term, then sum term per term (`TERMS` order).
        identity_error: () fp64, max over tokens of |sum of the six terms (fp32) - total|.
    """

    sums: torch.Tensor = field(default_factory=lambda: torch.zeros(1 + 2 * len(TERMS), dtype=torch.float64))
    identity_error: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))

    def update(self, terms: dict[str, torch.Tensor], mask: torch.Tensor) -> AttributionStats:
        """Add the tokens of `attribution_terms`' output where `mask` (B, T) bool is True and every term is finite;
        returns `self`."""
        finite = torch.stack([torch.isfinite(terms[t]) for t in (*TERMS, "total")]).all(dim=0)  # (B, T)
        valid = mask.bool() & finite  # (B, T)
        parts = [valid.sum().double()]
        parts += [torch.where(valid, terms[t].double().abs(), 0.0).sum() for t in TERMS]
        parts += [torch.where(valid, terms[t].double(), 0.0).sum() for t in TERMS]
        self.sums = torch.stack(parts) + self.sums.to(valid.device)  # (13,)
        summed = terms[TERMS[0]]
        for t in TERMS[1:]:
            summed = summed + terms[t]  # (B, T) fp32: the sum as fp32 arithmetic gives it
        error = torch.where(valid, (summed.double() - terms["total"].double()).abs(), 0.0)  # (B, T)
        largest = error.max() if error.numel() else error.new_zeros(())
        self.identity_error = torch.maximum(largest, self.identity_error.to(valid.device))
        return self

    def merge(self, other: AttributionStats) -> AttributionStats:
        """Add `other` (a later micro-batch) into this object, in place; returns `self`."""
        self.sums = self.sums + other.sums.to(self.sums.device)
        self.identity_error = torch.maximum(self.identity_error, other.identity_error.to(self.sums.device))
        return self

    def all_reduce(self, accelerator) -> AttributionStats:
        """A new object with the sums and the max over all processes (every process must call it: two collectives);
        `accelerator=None` (one process): a copy."""
        if accelerator is None:
            return replace(self)
        sums = accelerator.reduce(self.sums.to(accelerator.device), reduction="sum")  # (13,)
        error = accelerator.gather(self.identity_error.to(accelerator.device).reshape(1)).max()  # ()
        return AttributionStats(sums=sums, identity_error=error)

    def as_metrics(self) -> dict[str, float]:
        """`ratio/attribution/<term>/{mean_abs, share, mean}`, `identity_error` and `num_tokens`; {} without a
        token (absent, never NaN)."""
        values = self.sums.tolist()
        count, abs_sums, sums = values[0], values[1 : 1 + len(TERMS)], values[1 + len(TERMS) :]
        if count == 0:
            return {}
        total_abs = sum(abs_sums)
        metrics = {}
        for t, abs_sum, signed in zip(TERMS, abs_sums, sums, strict=True):
            metrics[keys.attribution_key(t, "mean_abs")] = abs_sum / count
            metrics[keys.attribution_key(t, "share")] = abs_sum / total_abs if total_abs > 0 else 0.0
            metrics[keys.attribution_key(t, "mean")] = signed / count
        metrics[keys.ATTRIBUTION_IDENTITY_ERROR] = self.identity_error.item()
        metrics[keys.ATTRIBUTION_NUM_TOKENS] = count
        return metrics


def largest_term(metrics: dict[str, float]) -> str | None:
    """The term with the largest `mean_abs` in logged metrics (one step's, or means over steps), or None when no
    attribution key is there."""
    found = {t: metrics[keys.attribution_key(t, "mean_abs")] for t in TERMS
             if keys.attribution_key(t, "mean_abs") in metrics}
    return max(found, key=found.get) if found else None
